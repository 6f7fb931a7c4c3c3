// The NCCL all-reduce path (format 1.8) on host-only sessions: which widths a bundle gives to NCCL, the
// exchange buffers only in-kernel widths need, steps at an NCCL width refused until the session has a
// communicator, and the NCCL loader's refusals (no library, too old, an entry point missing), each named.
// The collective itself runs on two GPUs: `decodepack run --devices 0,1` of a bundle built from
// tests/gpu/deploy-tiny-tp2-nccl.json or deploy-tiny-tp2-mixed.json.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "runtime_test_util.h"

namespace dp::rttest {
namespace {

const Bundles& bundles() {
  static const Bundles b = ensure_bundles();
  return b;
}

class NcclTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!bundles().error.empty()) GTEST_FAIL() << bundles().error;
  }
  void TearDown() override {
    dp_session_destroy(s_);
    dp_bundle_close(b_);
  }
  void open(const fs::path& bundle, int32_t rank = 0) {
    ASSERT_TRUE(outcome(dp_bundle_open(bundle.c_str(), nullptr, &b_)).ok());
    dp_session_options o = host_options(rank);
    ASSERT_TRUE(outcome(dp_session_create(b_, &o, &s_)).ok());
  }
  void bind_and_finalize(int32_t rank = 0) {
    const Outcome w = bind_all_weights(b_, s_, rank);
    ASSERT_TRUE(w.ok()) << w.message;
    DP_EXPECT_OK(dp_session_finalize_weights(s_));
  }
  std::vector<int32_t> nccl_widths() const {
    std::vector<int32_t> w(8, -1);
    w.resize(static_cast<size_t>(dp_session_nccl_widths(s_, w.data(), 8)));
    return w;
  }
  int32_t format_minor() const {
    dp_bundle_info info;
    info.size = sizeof(info);
    EXPECT_TRUE(outcome(dp_bundle_get_info(b_, &info)).ok());
    return info.format_minor;
  }
  dp_plan_result plan(int32_t requests) {
    std::vector<int32_t> q(static_cast<size_t>(requests), 1), acc(static_cast<size_t>(requests), 1), st;
    for (int32_t i = 0; i < requests; ++i) st.push_back(1 + i);
    dp_step_desc d;
    dp_step_desc_init(&d);
    d.num_requests = requests;
    d.query_lens = q.data();
    d.num_accepted = acc.data();
    d.state_indices = st.data();
    d.graph_mode = DP_GRAPH_FULL;
    dp_plan_result r;
    dp_plan_result_init(&r);
    const Outcome o = outcome(dp_plan(s_, &d, &r));
    EXPECT_TRUE(o.ok()) << o.message;
    return r;
  }
  dp_bundle* b_ = nullptr;
  dp_session* s_ = nullptr;
};

TEST_F(NcclTest, DefaultBundlesHaveNoNcclWidthAndKeepTheirFormat) {
  open(bundles().tp2);
  EXPECT_EQ(format_minor(), 6);  // the in-kernel all-reduce's tp sources; no collective step
  EXPECT_TRUE(nccl_widths().empty());
  const uint8_t id[128] = {};
  DP_EXPECT_STATUS(dp_session_init_nccl(s_, id, nullptr), DP_ERR_INVALID_ARGUMENT, "dp_session_init_nccl",
                   "do not all-reduce with NCCL at any width");
}

TEST_F(NcclTest, MixedBundleNeedsPeersForItsInKernelWidthsAndACommunicatorForItsNcclWidths) {
  open(bundles().tp2_mixed);
  EXPECT_EQ(format_minor(), 8);
  EXPECT_EQ(nccl_widths(), (std::vector<int32_t>{3, 4}));
  int32_t first = 0;
  EXPECT_EQ(dp_session_nccl_widths(s_, &first, 1), 2);  // the count, whatever the capacity
  EXPECT_EQ(first, 3);
  EXPECT_GT(dp_session_exchange_bytes(s_), 0u);  // widths 1 and 2 still all-reduce in-kernel
  bind_and_finalize();
  ASSERT_TRUE(bind_all_kv(b_, s_, 64, 32).ok());
  EXPECT_EQ(plan(2).reason, DP_REASON_NONE);
  const dp_plan_result r = plan(3);
  EXPECT_EQ(r.reason, DP_REASON_NO_COMMUNICATOR);
  EXPECT_EQ(r.step, nullptr);
  EXPECT_NE(std::string(r.message).find("width 3 all-reduces with NCCL"), std::string::npos) << r.message;
  EXPECT_NE(std::string(r.message).find("dp_session_init_nccl"), std::string::npos) << r.message;
  EXPECT_EQ(plan(4).reason, DP_REASON_NO_COMMUNICATOR);
  EXPECT_STREQ(dp_reason_name(DP_REASON_NO_COMMUNICATOR), "DP_REASON_NO_COMMUNICATOR");
  const int32_t reasons[2] = {DP_REASON_NONE, DP_REASON_NO_COMMUNICATOR};
  int32_t who = -1;
  EXPECT_EQ(dp_agree(reasons, 2, &who), DP_REASON_NO_COMMUNICATOR);
  EXPECT_EQ(who, 1);
  // The communicator needs a device; the load, the in-kernel widths' exchange buffers.
  const uint8_t id[128] = {};
  DP_EXPECT_STATUS(dp_session_init_nccl(s_, id, nullptr), DP_ERR_NO_DEVICE, "dp_session_init_nccl needs a device");
  DP_EXPECT_STATUS(dp_session_init_nccl(s_, nullptr, nullptr), DP_ERR_INVALID_ARGUMENT, "unique_id");
  DP_EXPECT_STATUS(dp_session_set_nccl_comm(s_, nullptr, nullptr), DP_ERR_INVALID_ARGUMENT, "comm");
  DP_EXPECT_STATUS(dp_session_load_kernels(s_), DP_ERR_STATE, "call dp_session_set_peers");
}

TEST_F(NcclTest, NcclOnlyBundleNeedsNoExchangeBuffers) {
  open(bundles().tp2_nccl, 1);
  EXPECT_EQ(format_minor(), 8);
  EXPECT_EQ(nccl_widths(), (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(dp_session_exchange_bytes(s_), 0u);
  const uint64_t two[2] = {0x7e0000000000ull, 0x7e0000100000ull};
  DP_EXPECT_STATUS(dp_session_set_peers(s_, two, 2, 1000), DP_ERR_INVALID_ARGUMENT, "do not all-reduce");
  bind_and_finalize(1);
  // No peers asked for: what is left missing is the device alone.
  DP_EXPECT_STATUS(dp_session_load_kernels(s_), DP_ERR_NO_DEVICE, "needs a device");
  ASSERT_TRUE(bind_all_kv(b_, s_, 64, 32).ok());
  EXPECT_EQ(plan(1).reason, DP_REASON_NO_COMMUNICATOR);
}

TEST(NcclLibrary, AMissingLibraryIsNamed) {
  uint8_t id[128];
  DP_EXPECT_STATUS(dp_nccl_get_unique_id("libnccl-that-is-not-here.so.2", id), DP_ERR_NCCL_UNAVAILABLE,
                   "NCCL: libnccl-that-is-not-here.so.2 cannot be loaded", "DECODEPACK_NCCL_LIBRARY",
                   "\"allreduce\": \"in_kernel\"", "2.10.0 or later");
  EXPECT_STREQ(dp_code_name(DP_ERR_NCCL_UNAVAILABLE), "DP_ERR_NCCL_UNAVAILABLE");
  DP_EXPECT_STATUS(dp_nccl_get_unique_id(nullptr, nullptr), DP_ERR_INVALID_ARGUMENT, "unique_id");
}

TEST(NcclLibrary, TheEnvironmentNamesTheDefaultLibrary) {
  ::setenv("DECODEPACK_NCCL_LIBRARY", "libnccl-from-the-environment.so.2", 1);
  uint8_t id[128];
  DP_EXPECT_STATUS(dp_nccl_get_unique_id(nullptr, id), DP_ERR_NCCL_UNAVAILABLE, "libnccl-from-the-environment.so.2");
  ::unsetenv("DECODEPACK_NCCL_LIBRARY");
}

TEST(NcclLibrary, TooOldOrIncompleteLibrariesAreRefusedByName) {
  uint8_t id[128];
  DP_EXPECT_STATUS(dp_nccl_get_unique_id(DP_FAKE_NCCL_OLD, id), DP_ERR_NCCL_UNAVAILABLE, "is NCCL 2.9.3 (code 20903)",
                   "older than 2.10.0");
  DP_EXPECT_STATUS(dp_nccl_get_unique_id(DP_FAKE_NCCL_NO_ALLREDUCE, id), DP_ERR_NCCL_UNAVAILABLE,
                   "has no entry point ncclAllReduce");
}

}  // namespace
}  // namespace dp::rttest
