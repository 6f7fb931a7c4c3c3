// Load-time validation without a GPU: described devices against real bundles (targets, driver
// versions, kernel resources), ranks, host settings, and the driver loader on a host without a driver.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include <nlohmann/json.hpp>

#include "runtime_test_util.h"

namespace dp::rttest {
namespace {

const Bundles& bundles() {
  static const Bundles b = ensure_bundles();
  return b;
}

dp_device_desc device(const char* arch, int32_t driver = 13000) {
  dp_device_desc d;
  dp_device_desc_init(&d);
  d.vendor = std::strncmp(arch, "gfx", 3) == 0 ? DP_VENDOR_HIP : DP_VENDOR_CUDA;
  std::snprintf(d.arch, sizeof(d.arch), "%s", arch);
  std::snprintf(d.name, sizeof(d.name), "Test GPU");
  d.driver_version = driver;
  return d;
}

// True when this host has a working CUDA driver (then the "no driver" tests do not apply).
bool have_cuda_driver() {
  int32_t n = 0;
  return outcome(dp_device_count(DP_VENDOR_CUDA, &n)).ok();
}

class ValidityTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!bundles().error.empty()) GTEST_FAIL() << bundles().error;
    ASSERT_TRUE(outcome(dp_bundle_open(bundles().tiny.c_str(), nullptr, &tiny_)).ok());
    ASSERT_TRUE(outcome(dp_bundle_open(bundles().multi.c_str(), nullptr, &multi_)).ok());
    ASSERT_TRUE(outcome(dp_bundle_open(bundles().tp2.c_str(), nullptr, &tp2_)).ok());
    ASSERT_TRUE(outcome(dp_bundle_open(bundles().spec.c_str(), nullptr, &spec_)).ok());
  }
  void TearDown() override {
    for (dp_bundle* b : {tiny_, multi_, tp2_, spec_}) dp_bundle_close(b);
  }
  // The target a host-only session picks for a described device ("" and the status when refused).
  std::string picked(dp_bundle* b, const dp_device_desc& d, Outcome* o = nullptr, const char* target = nullptr) {
    dp_session_options opt = host_options(0, target);
    opt.device_desc = &d;
    dp_session* s = nullptr;
    Outcome r = outcome(dp_session_create(b, &opt, &s));
    if (o) *o = r;
    std::string t = s ? dp_session_target(s) : "";
    dp_session_destroy(s);
    return t;
  }
  dp_bundle *tiny_ = nullptr, *multi_ = nullptr, *tp2_ = nullptr, *spec_ = nullptr;
};

TEST_F(ValidityTest, WithoutADeviceTheBundleIsConsistent) {
  DP_EXPECT_OK(dp_bundle_query_validity(tiny_, nullptr, -1));
  DP_EXPECT_OK(dp_bundle_query_validity(tiny_, nullptr, 0));
  DP_EXPECT_OK(dp_bundle_query_validity(spec_, nullptr, 0));
}

TEST_F(ValidityTest, HopperRunsTheSm90aCode) {
  const dp_device_desc h200 = device("sm_90");
  DP_EXPECT_OK(dp_bundle_query_validity(tiny_, &h200, 0));
  EXPECT_EQ(picked(tiny_, h200), "sm_90a");
}

TEST_F(ValidityTest, BlackwellIsRefusedWithWhatToRebuild) {
  const dp_device_desc b200 = device("sm_100");
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, &b200, 0), DP_ERR_TARGET, "tiny.dpk", "no code object for",
                   "Test GPU, sm_100", "the bundle's targets are gfx942, sm_90a",
                   "an sm_90a code object runs only on compute capability 9.0",
                   "gfx942 is AMD code and the device is NVIDIA",
                   "add sm_100a to the deploy config's \"targets\" and rebuild the bundle");
}

TEST_F(ValidityTest, AmdProcessorsMatchByNameIgnoringFeatures) {
  const dp_device_desc mi300 = device("gfx942:sramecc+:xnack-");
  DP_EXPECT_OK(dp_bundle_query_validity(tiny_, &mi300, 0));
  EXPECT_EQ(picked(tiny_, mi300), "gfx942");
  const dp_device_desc mi250 = device("gfx90a");
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, &mi250, 0), DP_ERR_TARGET,
                   "a gfx942 code object runs only on gfx942 processors", "add gfx90a");
}

TEST_F(ValidityTest, UnknownArchitecture) {
  const dp_device_desc odd = device("tpu_v5");
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, &odd, 0), DP_ERR_TARGET, "tpu_v5 is not one this runtime knows");
}

TEST_F(ValidityTest, GenericAndArchSpecificTargets) {
  // multi.dpk holds sm_80, sm_90 and sm_90a code.
  EXPECT_EQ(picked(multi_, device("sm_90")), "sm_90a");  // arch-specific preferred on its own device
  EXPECT_EQ(picked(multi_, device("sm_86")), "sm_80");   // sm_80 SASS runs on 8.x, x >= 0
  EXPECT_EQ(picked(multi_, device("sm_89")), "sm_80");
  EXPECT_EQ(picked(multi_, device("sm_90"), nullptr, "sm_90"), "sm_90");  // the host may ask for one
  Outcome o;
  EXPECT_EQ(picked(multi_, device("sm_90"), &o, "sm_80"), "");
  EXPECT_EQ(o.code, DP_ERR_TARGET) << o.message;
  EXPECT_NE(o.message.find("target sm_80 does not run on"), std::string::npos) << o.message;
  EXPECT_NE(o.message.find("compute capability 8.0 to 8.9"), std::string::npos) << o.message;
  EXPECT_EQ(picked(multi_, device("sm_75"), &o), "");
  EXPECT_EQ(o.code, DP_ERR_TARGET);
  EXPECT_NE(o.message.find("add sm_75a"), std::string::npos) << o.message;
}

TEST_F(ValidityTest, DriverOlderThanTheToolkitMajor) {
  const dp_device_desc old = device("sm_90", 12040);
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, &old, 0), DP_ERR_DRIVER_VERSION, "the driver supports CUDA 12.4",
                   "cuDriverGetVersion 12040", "nvrtc 13.0", "needs a driver for CUDA 13.0 or newer",
                   "rebuild the bundle with a CUDA 12.x toolkit");
  const dp_device_desc current = device("sm_90", 13000);
  DP_EXPECT_OK(dp_bundle_query_validity(tiny_, &current, 0));
  const dp_device_desc unknown = device("sm_90", 0);  // not described: not checked
  DP_EXPECT_OK(dp_bundle_query_validity(tiny_, &unknown, 0));
}

TEST_F(ValidityTest, DriverThatPredatesTheArchitecture) {
  const dp_device_desc old = device("sm_90", 11080);
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, &old, 0), DP_ERR_DRIVER_VERSION, "CUDA 11.8",
                   "sm_90a code needs a driver for CUDA 12.0 or newer");
}

TEST_F(ValidityTest, KernelResourcesAgainstDeviceLimits) {
  dp_device_desc d = device("sm_90");
  d.max_threads_per_block = 32;
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, &d, 0), DP_ERR_DEVICE_LIMITS, "kernel ", ".sm_90a", "threads per block (block [",
                   "allows 32");
  d = device("sm_90");
  d.max_block_dim[0] = 32;
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, &d, 0), DP_ERR_DEVICE_LIMITS, "block dimension x is", "allows 32");
  d = device("sm_90");
  d.max_grid_dim[0] = 4;
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, &d, 0), DP_ERR_DEVICE_LIMITS, "grid dimension x is", "allows 4");
  d.max_grid_dim[0] = 7;
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, &d, 0), DP_ERR_DEVICE_LIMITS, "grid dimension x is", "allows 7");
  d = device("sm_90");
  d.max_registers_per_block = 64;
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, &d, 0), DP_ERR_DEVICE_LIMITS, "kernel ",
                   "registers per block", "has 64");
  d = device("sm_90");
  d.max_shared_per_block = 4;
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, &d, 0), DP_ERR_DEVICE_LIMITS, ".sm_90a",
                   "bytes of static shared memory per block", "allows 4");
  // Real H200 numbers pass.
  d = device("sm_90");
  d.max_threads_per_block = 1024;
  d.max_block_dim[0] = d.max_block_dim[1] = 1024;
  d.max_block_dim[2] = 64;
  d.max_grid_dim[0] = 2147483647;
  d.max_grid_dim[1] = d.max_grid_dim[2] = 65535;
  d.max_registers_per_block = 65536;
  d.max_shared_per_block = 49152;
  d.max_shared_per_block_optin = 232448;
  DP_EXPECT_OK(dp_bundle_query_validity(tiny_, &d, 0));
}

// A kernel with dynamic shared memory (format 1.9) needs static + dynamic within the device's limit with
// opt-in (the limit without opt-in where the opt-in one is not described). The tiny bundle's manifest
// is edited to give its sm_90a kernels 150 KiB each.
TEST_F(ValidityTest, DynamicSharedMemoryAgainstTheOptInLimit) {
  const fs::path dir = fs::temp_directory_path() / ("dp-validity-dsm-" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::copy(bundles().tiny_dir, dir, fs::copy_options::recursive);
  nlohmann::json m = nlohmann::json::parse(read_text(dir / "manifest.json"));
  m["format_version"]["minor"] = 9;
  for (nlohmann::json& k : m["kernels"])
    if (k["target"] == "sm_90a") k["dynamic_shared_bytes"] = 150 * 1024;
  write_text(dir / "manifest.json", m.dump());
  dp_bundle* b = nullptr;
  ASSERT_TRUE(outcome(dp_bundle_open(dir.c_str(), nullptr, &b)).ok());
  dp_device_desc d = device("sm_90");
  d.max_shared_per_block = 49152;
  d.max_shared_per_block_optin = 232448;  // the H200's
  DP_EXPECT_OK(dp_bundle_query_validity(b, &d, 0));
  d.max_shared_per_block_optin = 101376;  // an sm_86 part's
  DP_EXPECT_STATUS(dp_bundle_query_validity(b, &d, 0), DP_ERR_DEVICE_LIMITS, ".sm_90a", "bytes of shared memory per block (",
                   " static + 153600 dynamic)", "allows 101376 with opt-in");
  d.max_shared_per_block_optin = 0;  // not described: the limit without opt-in applies
  DP_EXPECT_STATUS(dp_bundle_query_validity(b, &d, 0), DP_ERR_DEVICE_LIMITS, "allows 49152");
  dp_bundle_close(b);
  fs::remove_all(dir);
}

TEST_F(ValidityTest, RanksAndTensorParallelSize) {
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, nullptr, 1), DP_ERR_RANK, "rank 1 is not in the bundle",
                   "it holds rank 0 of tensor_parallel 1", "\"ranks\"");
  DP_EXPECT_STATUS(dp_bundle_query_validity(tiny_, nullptr, -2), DP_ERR_INVALID_ARGUMENT, "rank -2");
  DP_EXPECT_OK(dp_bundle_query_validity(tp2_, nullptr, 1));
  DP_EXPECT_STATUS(dp_bundle_query_validity(tp2_, nullptr, 2), DP_ERR_RANK, "ranks 0, 1 of tensor_parallel 2");

  dp_session* s = nullptr;
  dp_session_options o = host_options(1);
  DP_EXPECT_STATUS(dp_session_create(tiny_, &o, &s), DP_ERR_RANK, "rank 1 is not in the bundle");
  o = host_options(-1);
  DP_EXPECT_STATUS(dp_session_create(tiny_, &o, &s), DP_ERR_INVALID_ARGUMENT, "rank -1, expected >= 0");
  o = host_options(0);
  o.tensor_parallel = 2;
  DP_EXPECT_STATUS(dp_session_create(tiny_, &o, &s), DP_ERR_RANK, "the host runs tensor_parallel 2",
                   "built for tensor_parallel 1");
  o = host_options(1);
  o.tensor_parallel = 2;
  DP_EXPECT_OK(dp_session_create(tp2_, &o, &s));
  dp_session_destroy(s);
}

TEST_F(ValidityTest, SpeculativeTokensMustMatch) {
  dp_session* s = nullptr;
  dp_session_options o = host_options();
  o.num_speculative_tokens = 1;
  DP_EXPECT_STATUS(dp_session_create(tiny_, &o, &s), DP_ERR_CONFIG, "the host runs num_speculative_tokens 1",
                   "built for 0 (q = 1 rows per request)", "\"num_speculative_tokens\": 1");
  DP_EXPECT_OK(dp_session_create(spec_, &o, &s));
  dp_session_destroy(s);
}

TEST_F(ValidityTest, HostOnlyTargetChoice) {
  dp_session* s = nullptr;
  dp_session_options o = host_options(0, "sm_89");
  DP_EXPECT_STATUS(dp_session_create(tiny_, &o, &s), DP_ERR_TARGET,
                   "target sm_89 is not one of the bundle's targets (gfx942, sm_90a)");
  o = host_options(0, "sm_90a");
  DP_EXPECT_OK(dp_session_create(tiny_, &o, &s));
  EXPECT_STREQ(dp_session_target(s), "sm_90a");
  dp_session_destroy(s);
  const dp_device_desc b200 = device("sm_100");
  o = host_options(0);
  o.device_desc = &b200;
  DP_EXPECT_STATUS(dp_session_create(tiny_, &o, &s), DP_ERR_TARGET, "add sm_100a");
  o.device = -7;
  o.device_desc = nullptr;
  DP_EXPECT_STATUS(dp_session_create(tiny_, &o, &s), DP_ERR_INVALID_ARGUMENT, "device -7");
}

TEST_F(ValidityTest, NoDriverOnThisHost) {
  if (have_cuda_driver()) GTEST_SKIP() << "this host has a CUDA driver";
  int32_t n = -1;
  DP_EXPECT_STATUS(dp_device_count(DP_VENDOR_CUDA, &n), DP_ERR_DRIVER_UNAVAILABLE, "CUDA driver", "libcuda.so.1",
                   "host-only sessions");
  EXPECT_EQ(n, 0);
  dp_device_desc d;
  dp_device_desc_init(&d);
  DP_EXPECT_STATUS(dp_device_query(DP_VENDOR_CUDA, 0, &d), DP_ERR_DRIVER_UNAVAILABLE, "libcuda.so.1");
  dp_session* s = nullptr;
  dp_session_options o;
  dp_session_options_init(&o);  // device 0
  DP_EXPECT_STATUS(dp_session_create(tiny_, &o, &s), DP_ERR_DRIVER_UNAVAILABLE, "libcuda.so.1",
                   "DECODEPACK_CUDA_LIBRARY");
  EXPECT_EQ(s, nullptr);
  o.vendor = DP_VENDOR_HIP;
  const Outcome hip = outcome(dp_session_create(tiny_, &o, &s));
  EXPECT_TRUE(hip.code == DP_ERR_DRIVER_UNAVAILABLE || hip.code == DP_ERR_NOT_SUPPORTED) << hip.message;
  o.vendor = 9;
  DP_EXPECT_STATUS(dp_session_create(tiny_, &o, &s), DP_ERR_INVALID_ARGUMENT, "vendor 9");
  DP_EXPECT_STATUS(dp_device_count(9, &n), DP_ERR_INVALID_ARGUMENT, "vendor 9");
}

TEST_F(ValidityTest, DriverLibraryOverrideIsReported) {
  if (have_cuda_driver()) GTEST_SKIP() << "this host has a CUDA driver (the loaded table is kept)";
  int32_t n = 0;
  ::setenv("DECODEPACK_CUDA_LIBRARY", "/nonexistent/libcuda.so.1", 1);
  DP_EXPECT_STATUS(dp_device_count(DP_VENDOR_CUDA, &n), DP_ERR_DRIVER_UNAVAILABLE, "cannot load /nonexistent/libcuda.so.1");
  // A library that is not a CUDA driver: the first missing entry point is named.
  ::setenv("DECODEPACK_CUDA_LIBRARY", "libc.so.6", 1);
  DP_EXPECT_STATUS(dp_device_count(DP_VENDOR_CUDA, &n), DP_ERR_DRIVER_UNAVAILABLE, "libc.so.6",
                   "no entry point cuGetErrorName");
  ::unsetenv("DECODEPACK_CUDA_LIBRARY");
}

}  // namespace
}  // namespace dp::rttest
