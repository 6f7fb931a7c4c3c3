// Code-object inspection: real code objects from the compile tests, and broken ones.
#include "backend/inspect.h"

#include <gtest/gtest.h>

#include "backend/toolchain.h"
#include "backend_test_util.h"

namespace dp::backend {
namespace {

using test::compiled_set;
using test::expect_error;

const CompiledKernel& rmsnorm_w4(const std::string& target) { return compiled_set(target).report.kernels[3]; }

TEST(InspectCubin, ListsTheKernelWithItsParameterBlockAndUsage) {
  DP_SKIP_WITHOUT(Vendor::nvidia);
  const CompiledKernel& k = rmsnorm_w4("sm_90a");
  auto ks = inspect_code_object(k.code_object, "sm_90a", "x.cubin");
  ASSERT_EQ(ks.size(), 1u);
  EXPECT_EQ(ks[0].symbol, "rmsnorm_w4_h2304");
  EXPECT_EQ(ks[0].param_bytes, 44u);
  EXPECT_EQ(ks[0].shared_bytes, 24u);
  EXPECT_EQ(ks[0].kernarg_bytes, 0u);
  EXPECT_EQ(ks[0].scalar_registers, 0u);
  const CodeObjectKernel& p = compiled_set("sm_90a").report.kernels[0].usage;
  EXPECT_EQ(p.symbol, "prefetch_b32");
  EXPECT_EQ(p.param_bytes, 12u);
  EXPECT_EQ(&require_kernel(ks, "rmsnorm_w4_h2304", "x.cubin", 44), &ks[0]);
}

TEST(InspectAmdgpu, ReadsTheMetadataNote) {
  DP_SKIP_WITHOUT(Vendor::amd);
  const CompiledKernel& k = rmsnorm_w4("gfx942");
  auto ks = inspect_code_object(k.code_object, "gfx942", "x.hsaco");
  ASSERT_EQ(ks.size(), 1u);
  EXPECT_EQ(ks[0].symbol, "rmsnorm_w4_h2304");
  EXPECT_EQ(ks[0].param_bytes, 44u);
  EXPECT_EQ(ks[0].shared_bytes, 12u);
  EXPECT_EQ(ks[0].stack_bytes, 0u);
  EXPECT_GE(ks[0].kernarg_bytes, 44u);
  // The prefetch kernel reads gridDim, i.e. hidden arguments after its 12 explicit bytes.
  const CodeObjectKernel& p = compiled_set("gfx942").report.kernels[0].usage;
  EXPECT_EQ(p.param_bytes, 12u);
  EXPECT_GT(p.kernarg_bytes, 12u);
}

TEST(InspectCodeObject, RefusesTheWrongTargetOrMachine) {
  DP_SKIP_WITHOUT(Vendor::nvidia);
  DP_SKIP_WITHOUT(Vendor::amd);
  const auto& cubin = rmsnorm_w4("sm_90a").code_object;
  const auto& hsaco = rmsnorm_w4("gfx942").code_object;
  expect_error([&] { inspect_code_object(cubin, "gfx942", "k.cubin"); }, Errc::input,
               {"k.cubin", "not EM_AMDGPU"});
  expect_error([&] { inspect_code_object(hsaco, "sm_90a", "k.hsaco"); }, Errc::input, {"k.hsaco", "not EM_CUDA"});
  expect_error([&] { inspect_code_object(hsaco, "gfx90a", "k.hsaco"); }, Errc::input,
               {"code object is for \"gfx942\"", "expected gfx90a"});
  expect_error([&] { inspect_code_object(cubin, "sm_80", "k.cubin"); }, Errc::input,
               {"cubin is for sm_90", "expected sm_80"});
}

TEST(InspectCodeObject, RefusesBrokenBytes) {
  const std::vector<uint8_t> junk = {'n', 'o', 't', ' ', 'e', 'l', 'f'};
  expect_error([&] { inspect_code_object(junk, "sm_90a", "junk.cubin"); }, Errc::input,
               {"junk.cubin", "not an ELF file"});
  expect_error([&] { inspect_code_object({}, "gfx942", "empty.hsaco"); }, Errc::input, {"empty.hsaco"});
  expect_error([&] { inspect_code_object(junk, "sm_77", "x"); }, Errc::input, {"unknown target \"sm_77\""});
}

TEST(InspectCodeObject, RefusesTruncatedCodeObjects) {
  DP_SKIP_WITHOUT(Vendor::nvidia);
  DP_SKIP_WITHOUT(Vendor::amd);
  for (const char* target : {"sm_90a", "gfx942"}) {
    const auto& full = rmsnorm_w4(target).code_object;
    for (size_t keep : {size_t{16}, size_t{64}, full.size() / 2, full.size() - 1}) {
      std::vector<uint8_t> cut(full.begin(), full.begin() + static_cast<ptrdiff_t>(keep));
      try {
        auto ks = inspect_code_object(cut, target, "cut");
        // Cutting only trailing padding may leave a readable object; it must still be the kernel.
        ASSERT_EQ(ks.size(), 1u) << target << " kept " << keep;
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), Errc::input) << e.what();
        EXPECT_EQ(std::string(e.what()).rfind("cut: ", 0), 0u) << e.what();
      }
    }
  }
}

TEST(InspectCodeObject, UnalignedInputIsReadToo) {
  DP_SKIP_WITHOUT(Vendor::amd);
  const auto& co = rmsnorm_w4("gfx942").code_object;
  std::vector<uint8_t> shifted(co.size() + 3);
  std::copy(co.begin(), co.end(), shifted.begin() + 3);
  auto ks = inspect_code_object(std::span<const uint8_t>(shifted).subspan(3), "gfx942", "tar member");
  ASSERT_EQ(ks.size(), 1u);
  EXPECT_EQ(ks[0].param_bytes, 44u);
}

TEST(RequireKernel, NamesWhatIsMissingAndWhatIsThere) {
  std::vector<CodeObjectKernel> ks(2);
  ks[0].symbol = "prefetch_b32";
  ks[0].param_bytes = 12;
  ks[1].symbol = "rmsnorm_w4_h2304";
  ks[1].param_bytes = 44;
  expect_error([&] { require_kernel(ks, "rmsnorm_w8_h2304", "b.dpk:kernels/x.cubin"); }, Errc::verify,
               {"b.dpk:kernels/x.cubin", "kernel rmsnorm_w8_h2304 is missing",
                "present: prefetch_b32, rmsnorm_w4_h2304"});
  expect_error([&] { require_kernel(ks, "prefetch_b32", "f", 16); }, Errc::verify,
               {"prefetch_b32 takes 12 parameter bytes, expected 16"});
  EXPECT_EQ(require_kernel(ks, "rmsnorm_w4_h2304", "f", 44).param_bytes, 44u);
}

TEST(PtxasLog, ParsesNvrtcAndNvccStyles) {
  const char* nvrtc =
      "ptxas info    : 0 bytes gmem\n"
      "ptxas info    : Compiling entry function 'rmsnorm_w4_h2304' for 'sm_90a'\n"
      "ptxas info    : Function properties for rmsnorm_w4_h2304\n"
      "ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Used 34 registers, used 1 barriers, 24 bytes smem\n"
      "ptxas info    : Compiling entry function 'big' for 'sm_90a'\n"
      "ptxas info    : Function properties for helper\n"
      "ptxas         .     8 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
      "ptxas info    : Function properties for big\n"
      "ptxas         .     96 bytes stack frame, 64 bytes spill stores, 72 bytes spill loads\n"
      "ptxas info    : Used 255 registers, used 0 barriers\n";
  auto u = parse_ptxas_log(nvrtc);
  ASSERT_EQ(u.size(), 2u);
  EXPECT_EQ(u["rmsnorm_w4_h2304"].registers, 34u);
  EXPECT_EQ(u["rmsnorm_w4_h2304"].shared_bytes, 24u);
  EXPECT_EQ(u["big"].registers, 255u);
  EXPECT_EQ(u["big"].stack_bytes, 96u);
  EXPECT_EQ(u["big"].spill_store_bytes, 64u);
  EXPECT_EQ(u["big"].spill_load_bytes, 72u);
  EXPECT_EQ(u.count("helper"), 0u);

  const char* nvcc =
      "ptxas info    : Compiling entry function 'k' for 'sm_80'\n"
      "ptxas info    : Function properties for k\n"
      "    16 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n"
      "ptxas info    : Used 12 registers, 400 bytes smem, 368 bytes cmem[0]\n";
  auto v = parse_ptxas_log(nvcc);
  EXPECT_EQ(v["k"].registers, 12u);
  EXPECT_EQ(v["k"].shared_bytes, 400u);
  EXPECT_EQ(v["k"].stack_bytes, 16u);
  EXPECT_EQ(v["k"].spill_store_bytes, 4u);
}

}  // namespace
}  // namespace dp::backend
