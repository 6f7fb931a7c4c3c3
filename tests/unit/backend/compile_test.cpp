// Compiling the templates for real: NVRTC/nvcc for sm_90a, clang for gfx942 and gfx90a; inspecting
// the code objects; the compile cache; determinism. CPU only: nothing here needs a GPU.
#include "backend/compile.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <iostream>

#include "backend/inspect.h"
#include "backend_test_util.h"
#include "common/fs.h"
#include "common/hash.h"

namespace dp::backend {
namespace {

namespace fs = std::filesystem;
using test::compiled_set;
using test::prefetch;
using test::rmsnorm;

// The checkout the tests run from: no path of it may end up in a code object.
const std::string kSourceRoot = fs::path(DP_TEST_DATA_DIR).parent_path().string() + "/";

// Every kernel of the set is in its code object with the parameter size of its signature.
void expect_complete(const test::CompiledSet& set) {
  ASSERT_EQ(set.report.kernels.size(), set.instances.size());
  for (size_t i = 0; i < set.instances.size(); ++i) {
    const CompiledKernel& k = set.report.kernels[i];
    SCOPED_TRACE(k.key);
    EXPECT_EQ(k.instance, set.instances[i]);
    EXPECT_EQ(k.key, codegen::instance_key(set.instances[i]));
    EXPECT_FALSE(k.code_object.empty());
    EXPECT_EQ(k.sha256, sha256_hex(std::span<const uint8_t>(k.code_object)));
    EXPECT_FALSE(k.cache_hit);
    auto kernels = inspect_code_object(k.code_object, k.instance.target, k.file_name);
    ASSERT_EQ(kernels.size(), 1u);
    EXPECT_EQ(kernels[0].symbol, k.name);
    EXPECT_EQ(kernels[0].param_bytes, k.signature.bytes);
    EXPECT_EQ(k.usage.param_bytes, k.signature.bytes);
    EXPECT_GT(k.usage.registers, 0u);
    EXPECT_EQ(k.usage.spill_bytes, 0u) << k.log;
    EXPECT_TRUE(k.warnings.empty()) << k.warnings.front();
  }
}

// No path of the build machine may reach a code object (the bundle must not depend on where it was
// built): neither the cache, nor the templates directory, nor a temporary directory.
void expect_no_host_paths(const CompiledKernel& k, const std::vector<std::string>& paths) {
  const std::string bytes(k.code_object.begin(), k.code_object.end());
  for (const std::string& p : paths) EXPECT_EQ(bytes.find(p), std::string::npos) << k.key << " contains " << p;
}

TEST(CompileCuda, Sm90aPrefetchAndRmsnormInspectWithExpectedSignatures) {
  DP_SKIP_WITHOUT(Vendor::nvidia);
  const auto& set = compiled_set("sm_90a");
  expect_complete(set);
  for (const CompiledKernel& k : set.report.kernels) {
    SCOPED_TRACE(k.key);
    EXPECT_EQ(k.file_name, k.key + ".cubin");
    // The cubin's numbers agree with what ptxas printed.
    auto log = parse_ptxas_log(k.log);
    ASSERT_TRUE(log.count(k.name)) << k.log;
    EXPECT_EQ(k.usage.registers, log[k.name].registers);
    EXPECT_EQ(k.usage.shared_bytes, log[k.name].shared_bytes);
    EXPECT_EQ(k.usage.stack_bytes, log[k.name].stack_bytes);
    EXPECT_EQ(k.log.find("Compile time"), std::string::npos) << "timing lines make logs nondeterministic";
    expect_no_host_paths(k, {set.cache.path().string(), "/tmp/", kSourceRoot, "/home/"});
  }
  // rmsnorm's block reduction: one fp32 partial per 32-lane warp (192 threads -> 6 warps).
  EXPECT_EQ(set.report.kernels[3].usage.shared_bytes, 6u * 4u);
  EXPECT_EQ(set.report.kernels[0].usage.shared_bytes, 0u);
  EXPECT_EQ(set.report.toolchains.count("nvidia"), 1u);
}

TEST(CompileHip, Gfx942PrefetchAndRmsnormInspectWithExpectedSignatures) {
  DP_SKIP_WITHOUT(Vendor::amd);
  const auto& set = compiled_set("gfx942");
  expect_complete(set);
  for (const CompiledKernel& k : set.report.kernels) {
    SCOPED_TRACE(k.key);
    EXPECT_EQ(k.file_name, k.key + ".hsaco");
    EXPECT_GE(k.usage.kernarg_bytes, k.usage.param_bytes);
    EXPECT_GT(k.usage.scalar_registers, 0u);
    expect_no_host_paths(k, {set.cache.path().string(), "/tmp/", kSourceRoot, "/home/"});
  }
  // rmsnorm's block reduction: one fp32 partial per 64-lane wavefront (192 threads -> 3 waves).
  EXPECT_EQ(set.report.kernels[3].usage.shared_bytes, 3u * 4u);
  EXPECT_EQ(set.report.toolchains.count("amd"), 1u);
}

TEST(CompileHip, Gfx90aToo) {
  DP_SKIP_WITHOUT(Vendor::amd);
  test::TempDir cache;
  CompileOptions o;
  o.cache_dir = cache.path();
  o.jobs = 2;
  CompileReport r = compile_all({prefetch(32, "gfx90a"), rmsnorm(4, 2304, "gfx90a")}, o);
  ASSERT_EQ(r.kernels.size(), 2u);
  for (const CompiledKernel& k : r.kernels)
    require_kernel(inspect_code_object(k.code_object, "gfx90a", k.file_name), k.name, k.file_name, k.signature.bytes);
}

TEST(CompileHip, Gfx950IsRefusedBeforeAnyWorkNamingTheLlvmItNeeds) {
  DP_SKIP_WITHOUT(Vendor::amd);
  auto tc = make_hip_toolchain({});
  if (tc->version().find("version 19.") == std::string::npos && tc->version().find("version 18.") == std::string::npos &&
      tc->version().find("version 17.") == std::string::npos)
    GTEST_SKIP() << "the found clang (" << tc->version() << ") may know gfx950";
  test::TempDir cache;
  CompileOptions o;
  o.cache_dir = cache.path();
  // Listed after targets that would compile: still nothing is compiled.
  test::expect_error([&] { compile_all({rmsnorm(4, 2304, "gfx942"), rmsnorm(4, 2304, "gfx950")}, o); },
                     Errc::toolchain,
                     {"target gfx950 needs LLVM >= 20", "install clang-20 or newer", "--hip-clang PATH",
                      "DECODEPACK_HIP_CLANG"});
  EXPECT_TRUE(fs::is_empty(cache.path())) << "work started before the refusal";
}

TEST(CompileHip, AnOldClangIsRefusedForGfx942ByTheVersionTable) {
  // A stand-in for "the clang on PATH is LLVM 16": only --version is ever run before the refusal.
  test::TempDir dir;
  const fs::path fake = dir / "clang++";
  {
    std::ofstream f(fake);
    f << "#!/bin/sh\necho 'clang version 16.0.6 (fake)'\n";
  }
  fs::permissions(fake, fs::perms::owner_all);
  ToolchainOptions t;
  t.hip_clang = fake;
  auto tc = make_hip_toolchain(t);
  EXPECT_EQ(tc->version(), "clang version 16.0.6 (fake)");
  test::expect_error([&] { tc->check_target(target_info("gfx942")); }, Errc::toolchain,
                     {"target gfx942 needs LLVM >= 17", "LLVM 16", fake.string(), "--hip-clang"});
  EXPECT_NO_THROW(tc->check_target(target_info("gfx90a")));  // 16 >= 13 per the table; probe is a no-op script
}

TEST(CompileHip, AMissingExplicitClangIsAnErrorNamingIt) {
  ToolchainOptions t;
  t.hip_clang = "/nonexistent/clang++";
  test::expect_error([&] { make_hip_toolchain(t); }, Errc::toolchain,
                     {"/nonexistent/clang++", "--hip-clang", "DECODEPACK_HIP_CLANG"});
}

TEST(CompileCache, SecondBuildIsAllHitsWithTheSameBytes) {
  DP_SKIP_WITHOUT(Vendor::nvidia);
  DP_SKIP_WITHOUT(Vendor::amd);
  const auto& nv = compiled_set("sm_90a");
  const auto& amd = compiled_set("gfx942");
  test::TempDir dir;
  const fs::path cache = dir / "cache";
  test::copy_tree(nv.cache.path(), cache);
  std::filesystem::copy(amd.cache.path(), cache,
                        fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  std::vector<codegen::KernelInstance> all = nv.instances;
  all.insert(all.end(), amd.instances.begin(), amd.instances.end());
  CompileOptions o;
  o.cache_dir = cache;
  o.jobs = 3;
  std::vector<std::string> lines;
  o.progress = [&](const CompileProgress& p) {
    lines.push_back(fmt::format("[{}/{}] {} {}", p.done, p.total, p.key, p.cache_hit));
  };
  CompileReport r = compile_all(all, o);
  EXPECT_EQ(r.cache.hits, all.size());
  EXPECT_EQ(r.cache.misses, 0u);
  EXPECT_EQ(r.cache.corrupt, 0u);
  ASSERT_EQ(lines.size(), all.size());
  EXPECT_EQ(lines.back().substr(0, 7), fmt::format("[{}/{}]", all.size(), all.size()));
  for (size_t i = 0; i < all.size(); ++i) {
    const CompiledKernel& cold = i < nv.instances.size() ? nv.report.kernels[i] : amd.report.kernels[i - nv.instances.size()];
    EXPECT_TRUE(r.kernels[i].cache_hit);
    EXPECT_EQ(r.kernels[i].key, cold.key);
    EXPECT_EQ(r.kernels[i].code_object, cold.code_object) << cold.key;
    EXPECT_EQ(r.kernels[i].usage.registers, cold.usage.registers);
    EXPECT_EQ(r.kernels[i].usage.spill_bytes, cold.usage.spill_bytes);
  }
}

TEST(CompileCache, ACorruptEntryIsDetectedRecompiledAndOverwritten) {
  DP_SKIP_WITHOUT(Vendor::nvidia);
  const auto& nv = compiled_set("sm_90a");
  test::TempDir dir;
  const fs::path cache = dir / "cache";
  test::copy_tree(nv.cache.path(), cache);
  std::vector<fs::path> entries;
  for (const auto& e : fs::recursive_directory_iterator(cache))
    if (e.is_regular_file()) entries.push_back(e.path());
  std::sort(entries.begin(), entries.end());
  ASSERT_EQ(entries.size(), nv.instances.size());
  // Flip one byte in the middle of one entry's payload, truncate another: both are corrupt.
  {
    std::string bytes = read_text_file(entries[0]);
    bytes[bytes.size() / 2] ^= 0x5a;
    write_file_atomic(entries[0], bytes);
    std::string cut = read_text_file(entries[1]);
    write_file_atomic(entries[1], cut.substr(0, cut.size() - 100));
  }
  CompileOptions o;
  o.cache_dir = cache;
  o.jobs = 2;
  CompileReport r = compile_all(nv.instances, o);
  EXPECT_EQ(r.cache.corrupt, 2u);
  EXPECT_EQ(r.cache.misses, 2u);
  EXPECT_EQ(r.cache.hits, nv.instances.size() - 2);
  for (size_t i = 0; i < r.kernels.size(); ++i)
    EXPECT_EQ(r.kernels[i].code_object, nv.report.kernels[i].code_object) << r.kernels[i].key;
  // The rebuilt entries replaced the corrupt ones.
  CompileReport again = compile_all(nv.instances, o);
  EXPECT_EQ(again.cache.hits, nv.instances.size());
  EXPECT_EQ(again.cache.corrupt, 0u);
}

// Issue 12: an entry whose checksum is valid but which holds another kernel's code object (here: one
// entry's bytes written under another entry's key, header and all) made the build fail with an internal
// error. It is compiled again, with a note naming the entry, counted as corrupt, and overwritten.
TEST(CompileCache, AnEntryHoldingAnotherKernelIsRecompiledWithANote) {
  DP_SKIP_WITHOUT(Vendor::nvidia);
  const auto& nv = compiled_set("sm_90a");
  test::TempDir dir;
  const fs::path cache = dir / "cache";
  test::copy_tree(nv.cache.path(), cache);
  std::vector<fs::path> entries;
  for (const auto& e : fs::recursive_directory_iterator(cache))
    if (e.is_regular_file()) entries.push_back(e.path());
  std::sort(entries.begin(), entries.end());
  ASSERT_GE(entries.size(), 2u);
  const std::string victim = entries[0].filename().string(), donor = entries[1].filename().string();
  std::string bytes = read_text_file(entries[1]);
  const size_t at = bytes.find("key " + donor);
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at, 4 + donor.size(), "key " + victim);
  write_file_atomic(entries[0], bytes);
  CompileCache check(cache);
  ASSERT_TRUE(check.get(victim)) << "the forged entry must pass the cache's own checks";

  CompileOptions o;
  o.cache_dir = cache;
  CompileReport r = compile_all(nv.instances, o);
  EXPECT_EQ(r.cache.corrupt, 1u);
  EXPECT_EQ(r.cache.misses, 1u);
  EXPECT_EQ(r.cache.hits, nv.instances.size() - 1);
  size_t noted = 0;
  for (size_t i = 0; i < r.kernels.size(); ++i) {
    EXPECT_EQ(r.kernels[i].code_object, nv.report.kernels[i].code_object) << r.kernels[i].key;
    for (const std::string& n : r.kernels[i].notes) {
      ++noted;
      EXPECT_NE(n.find(entries[0].string()), std::string::npos) << n;
      EXPECT_NE(n.find("does not hold this kernel"), std::string::npos) << n;
      EXPECT_FALSE(r.kernels[i].cache_hit);
    }
  }
  EXPECT_EQ(noted, 1u);
  CompileReport again = compile_all(nv.instances, o);
  EXPECT_EQ(again.cache.hits, nv.instances.size());
  EXPECT_EQ(again.cache.corrupt, 0u);
}

TEST(CompileCache, EntryFormatIsVerifiedOnRead) {
  test::TempDir dir;
  CompileCache cache(dir.path());
  const std::string key(64, 'a');
  EXPECT_FALSE(cache.get(key));
  cache.put(key, {{1, 2, 3, 4}, "log", "ptx"});
  auto e = cache.get(key);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->code_object, (std::vector<uint8_t>{1, 2, 3, 4}));
  EXPECT_EQ(e->log, "log");
  EXPECT_EQ(e->ptx, "ptx");
  // The same bytes under another key (a copied or renamed file) are not that key's entry.
  const std::string other(64, 'b');
  fs::create_directories(cache.entry_path(other).parent_path());
  fs::copy_file(cache.entry_path(key), cache.entry_path(other));
  EXPECT_FALSE(cache.get(other));
  CacheStats s = cache.stats();
  EXPECT_EQ(s.hits, 1u);
  EXPECT_EQ(s.corrupt, 1u);
  EXPECT_EQ(s.misses, 2u);
  EXPECT_EQ(cache.entry_path(key), dir.path() / "v1" / "aa" / key);
}

TEST(CompileDeterminism, SameInputsGiveTheSameBytesWhateverTheJobCount) {
  DP_SKIP_WITHOUT(Vendor::nvidia);
  DP_SKIP_WITHOUT(Vendor::amd);
  // Uncached, in a different order from the shared set, with duplicates, at -j1 and -j3.
  std::vector<codegen::KernelInstance> in = {rmsnorm(4, 2304, "gfx942"), prefetch(32, "sm_90a"),
                                             rmsnorm(4, 2304, "sm_90a"), rmsnorm(4, 2304, "gfx942"),
                                             prefetch(32, "gfx942")};
  CompileOptions o;
  o.use_cache = false;
  o.jobs = 1;
  CompileReport a = compile_all(in, o);
  o.jobs = 3;
  CompileReport b = compile_all(in, o);
  ASSERT_EQ(a.kernels.size(), in.size());
  ASSERT_EQ(b.kernels.size(), in.size());
  for (size_t i = 0; i < in.size(); ++i) {
    EXPECT_EQ(a.kernels[i].instance, in[i]);
    EXPECT_EQ(b.kernels[i].key, a.kernels[i].key);
    EXPECT_EQ(a.kernels[i].code_object, b.kernels[i].code_object) << a.kernels[i].key;
  }
  EXPECT_EQ(a.kernels[0].code_object, a.kernels[3].code_object);  // duplicate compiled once
  // And the same bytes as the cold compile in the shared set (another cache, another temp dir).
  EXPECT_EQ(a.kernels[2].code_object, compiled_set("sm_90a").report.kernels[3].code_object);
  EXPECT_EQ(a.kernels[0].code_object, compiled_set("gfx942").report.kernels[3].code_object);
}

TEST(CompileCuda, NvccFallbackBuildsTheSameKernel) {
  DP_SKIP_WITHOUT(Vendor::nvidia);
  ToolchainOptions t;
  t.allow_nvrtc = false;
  std::unique_ptr<DeviceToolchain> nvcc;
  try {
    nvcc = make_cuda_toolchain(t);
  } catch (const Error& e) {
    GTEST_SKIP() << "no nvcc: " << e.what();
  }
  EXPECT_EQ(nvcc->version().rfind("nvcc ", 0), 0u) << nvcc->version();
  CompileOptions o;
  o.use_cache = false;
  o.toolchains = t;
  CompileReport r = compile_all({rmsnorm(4, 2304, "sm_90a")}, o);
  ASSERT_EQ(r.kernels.size(), 1u);
  EXPECT_EQ(r.toolchains["nvidia"], nvcc->version());
  const CompiledKernel& k = r.kernels[0];
  EXPECT_EQ(k.usage.param_bytes, 44u);
  EXPECT_EQ(k.usage.shared_bytes, 24u);
  expect_no_host_paths(k, {"/tmp/", kSourceRoot});
}

TEST(CompileCuda, PortablePtxOnRequest) {
  DP_SKIP_WITHOUT(Vendor::nvidia);
  DP_SKIP_WITHOUT(Vendor::amd);
  CompileOptions o;
  o.use_cache = false;
  o.emit_ptx = true;
  CompileReport r = compile_all({rmsnorm(4, 2304, "sm_90a"), rmsnorm(4, 2304, "gfx942")}, o);
  EXPECT_NE(r.kernels[0].ptx.find(".entry rmsnorm_w4_h2304"), std::string::npos);
  EXPECT_NE(r.kernels[0].ptx.find(".target sm_90\n"), std::string::npos) << "compute_90, not the 'a' variant";
  EXPECT_TRUE(r.kernels[1].ptx.empty());
}

// Every primitive of vendor.h, used once, compiles and links on every target: on AMD (no device
// libraries) this proves the math builtins lower to instructions rather than libcalls.
TEST(VendorHeader, EveryPrimitiveBuildsForEveryTarget) {
  const std::string src = R"(#include "vendor.h"
extern "C" __global__ DP_LAUNCH_BOUNDS(128) void probe(float* f, dp_bf16* h, dp_u32* u) {
  const dp_u32 t = threadIdx.x + blockIdx.x * blockDim.x + gridDim.x + threadIdx.y + blockIdx.z;
  float x = f[t];
  x = dp_expf(x) + dp_logf(x + 2.0f) + dp_rsqrtf(x + 3.0f);
  x = dp_shfl_xor(x, 1) + dp_shfl_down(x, 3) + dp_warp_sum(x);
  x += dp_block_sum<128>(x);
  u[t] = dp_shfl_group32(u[t], 7u) + (dp_u32)dp_shfl_group32((dp_u64)u[t + 1] << 33, 3u) + dp_lane_id() + DP_WARP_SIZE;
  h[t] = dp_f32_to_bf16(x + dp_bf16_to_f32(h[t]));
  float e[8];
  dp_unpack8_bf16(dp_load16(h + 8 * t), e);
  dp_store16(h + 8 * t + 4096, dp_pack8_bf16(e));
  __syncthreads();
  dp_prefetch_l2(f + 1024, 512);
})";
  const codegen::TemplateSet templates = codegen::TemplateSet::load(codegen::TemplateSet::default_dir());
  for (const char* target : {"sm_90a", "gfx942", "gfx90a"}) {
    const TargetInfo& t = target_info(target);
    if (auto why = test::toolchain_absent(t.vendor)) {
      std::cout << "skipping " << target << ": " << *why << "\n";
      continue;
    }
    auto tc = t.vendor == Vendor::nvidia ? make_cuda_toolchain({}) : make_hip_toolchain({});
    CompileJob job;
    job.stem = std::string("probe.") + target;
    job.source = src;
    job.headers = templates.files();
    job.target = &t;
    CompileOutput out = tc->compile(job);
    auto ks = inspect_code_object(out.code_object, target, job.stem);
    const CodeObjectKernel& k = require_kernel(ks, "probe", job.stem, 24);
    EXPECT_EQ(k.spill_bytes, 0u) << target;
  }
}

TEST(CompileAll, RefusesBadInstancesBeforeLocatingAnyToolchain) {
  CompileOptions o;
  o.use_cache = false;
  o.toolchains.hip_clang = "/nonexistent/clang++";  // would fail if it got that far
  test::expect_error([&] { compile_all({rmsnorm(4, 2304, "gfx942"), rmsnorm(4, 2305, "gfx942")}, o); },
                     Errc::input, {"kernel instance #1", "H = 2305"});
  test::expect_error([&] { compile_all({rmsnorm(4, 2304, "gfx1234")}, o); }, Errc::input,
                     {"unknown target \"gfx1234\"", "sm_90a", "gfx942"});
}

TEST(ProgressPrinter, TenPercentLinesOffATerminalAndOneRedrawnLineOnIt) {
  for (bool tty : {false, true}) {
    char* buf = nullptr;
    size_t size = 0;
    std::FILE* f = open_memstream(&buf, &size);
    auto print = progress_printer(f, tty);
    const size_t total = 200;  // one line per 10% off a terminal, not one per kernel
    for (size_t i = 1; i <= total; ++i) print({i, total, fmt::format("k{}.sm_90a", i), i % 2 == 0, 0.01});
    std::fclose(f);
    const std::string out(buf, size);
    std::free(buf);
    std::vector<std::string> lines;
    for (size_t at = 0; at < out.size();) {
      const size_t nl = out.find('\n', at);
      lines.push_back(out.substr(at, nl - at));
      at = nl == std::string::npos ? out.size() : nl + 1;
    }
    if (!tty) {
      ASSERT_EQ(lines.size(), 10u) << out;  // 10%, 20%, ... 90%, then the final line
      for (size_t k = 0; k < 9; ++k) {
        EXPECT_EQ(lines[k].rfind(fmt::format("compiling kernels: {}% ({}/200), ", 10 * (k + 1), 20 * (k + 1)), 0), 0u)
            << lines[k];
        EXPECT_NE(lines[k].find(", ETA "), std::string::npos) << lines[k];
      }
      EXPECT_EQ(lines[9].rfind("compiling kernels: 100% (200/200) in ", 0), 0u) << lines[9];
      EXPECT_NE(lines[9].find("; 100 from the cache"), std::string::npos) << lines[9];
      EXPECT_EQ(out.find('\r'), std::string::npos);
    } else {
      // Redrawn in place (at most 10 times a second), then closed by the final line.
      ASSERT_EQ(lines.size(), 1u) << out;
      EXPECT_EQ(out.rfind("\r\033[2Kcompiling kernels: 0% (1/200), ", 0), 0u) << out;
      EXPECT_NE(out.find("[k1.sm_90a (0.01 s)]"), std::string::npos) << out;
      const size_t last = out.rfind("\r\033[2K");
      EXPECT_EQ(out.substr(last).rfind("\r\033[2Kcompiling kernels: 100% (200/200) in ", 0), 0u) << out;
      EXPECT_EQ(out.back(), '\n');
    }
  }
}

}  // namespace
}  // namespace dp::backend
