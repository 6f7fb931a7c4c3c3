// rmsnorm (templates/norm.h, compiler/codegen/ops/norm.cpp): parameter checks and the block shape.
// The generic naming, layout and source rules are shown with rmsnorm in ../kernel_test.cpp.
#include <gtest/gtest.h>

#include "../../backend/backend_test_util.h"
#include "../../test_util.h"
#include "../compile_check.h"
#include "codegen/kernel.h"
#include "instances.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

TEST(NormOp, RefusesRowsTheTemplateCannotRead) {
  test::expect_error([] { kernel_name(rmsnorm(4, 2300)); }, Errc::input, {"H = 2300 is not a multiple of 8"});
}

// S: the rows to normalise are the first H of every S elements (the K3 q-LoRA latent inside the fused
// [q_a | kv_a | g] projection rows); S 0 is the dense instance (same name, signature and device call).
TEST(NormOp, StridedInputRows) {
  KernelInstance k = rmsnorm(16, 1536);
  k.params["S"] = 3648;
  EXPECT_EQ(kernel_name(k), "rmsnorm_w16_h1536_s3648");
  const KernelSignature sig = kernel_signature(k);
  ASSERT_EQ(sig.params.size(), 6u);
  EXPECT_EQ(sig.params[0].shape, "[16, 3648] bf16");
  EXPECT_EQ(sig.params[3].shape, "[16, 1536] bf16");  // out: dense rows
  EXPECT_NE(generate_source(k).find("dp_add_rmsnorm<16, 1536, 192, 3648>("), std::string::npos) << generate_source(k);
  EXPECT_EQ(launch_shape(k).block[0], launch_shape(rmsnorm(16, 1536)).block[0]);
  KernelInstance zero = rmsnorm(16, 1536);
  zero.params["S"] = 0;
  EXPECT_EQ(kernel_name(zero), "rmsnorm_w16_h1536");
  EXPECT_EQ(kernel_signature(zero).params[0].shape, "[16, 1536] bf16");
  EXPECT_NE(generate_source(zero).find("dp_add_rmsnorm<16, 1536, 192>("), std::string::npos);
  k.params["S"] = 1000;
  test::expect_error([&] { kernel_name(k); }, Errc::input, {"S = 1000", "at least H = 1536"});
  k.params["S"] = 3650;
  test::expect_error([&] { kernel_name(k); }, Errc::input, {"S = 3650", "multiple of 8"});
}

TEST(NormOp, IsOneBlockPerRowOfWholeWavefronts) {
  for (int64_t h : {8, 64, 512, 2304, 4096, 7168, 16384, 65536}) {
    LaunchShape s = launch_shape(rmsnorm(3, h));
    EXPECT_EQ(s.grid[0], 3u);
    EXPECT_EQ(s.block[0] % 64, 0u) << h;
    EXPECT_LE(s.block[0], 256u) << h;
    EXPECT_GE(s.block[0] * ((h / 8 + s.block[0] - 1) / s.block[0]), static_cast<uint64_t>(h / 8));
  }
  EXPECT_EQ(launch_shape(rmsnorm(4, 2304)).block[0], 192u);
}

// The K3 q-LoRA latent norm (strided rows) and the K3 hidden size, dense.
std::vector<KernelInstance> compile_set(const std::string& t) {
  KernelInstance strided = rmsnorm(16, 1536, t);
  strided.params["S"] = 3648;
  return {strided, rmsnorm(8, 7168, t)};
}

TEST(NormOpCompile, CompilesForSm90a) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  test_util::expect_compiles(compile_set("sm_90a"), "sm_90a");
}

TEST(NormOpCompile, CompilesForGfx942) {
  DP_SKIP_WITHOUT(backend::Vendor::amd);
  test_util::expect_compiles(compile_set("gfx942"), "gfx942");
}

}  // namespace
}  // namespace dp::codegen
