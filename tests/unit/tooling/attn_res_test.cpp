// tooling/harness: bind_attn_res, the K3 attention-residual buffer as `run`, `bench` and `generate` bind
// it, against a host-only libdecodepack session (no GPU: the allocation is the test's, an address the
// session never dereferences).
#include <gtest/gtest.h>

#include <fstream>

#include "bundle/build.h"
#include "decodepack/decodepack.h"
#include "../test_util.h"
#include "tooling/harness.h"

namespace dp::tools {
namespace {

constexpr CUdeviceptr kAddr = 0x7f0000200000ull;

// kimi-k3-tiny without weights: 5 layers, attn_res_block_size 2 (layers 0, 2, 4 push: 3 blocks), hidden
// 256; widths 1 and 3 at q 2 (num_speculative_tokens 1), so the buffer needs 3 x 2 = 6 rows.
class AttnRes : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new test::TempDir();
    std::ofstream(*dir_ / "deploy.json") << R"({"targets": ["sm_90a"], "widths": [1, 3],
      "num_speculative_tokens": 1})";
    bundle::BuildOptions o;
    o.model = "kimi-k3-tiny";
    o.deploy = (*dir_ / "deploy.json").string();
    o.out = *dir_ / "k3.dpk";
    o.jobs = 2;
    o.cache_dir = *dir_ / "cache";
    o.weights = false;
    bundle::build_bundle(o);
  }
  static void TearDownTestSuite() { delete dir_; }

  void SetUp() override {
    ASSERT_EQ(dp_bundle_open((*dir_ / "k3.dpk").c_str(), nullptr, &b_), nullptr);
    dp_session_options o;
    dp_session_options_init(&o);
    o.device = DP_DEVICE_NONE;
    ASSERT_EQ(dp_session_create(b_, &o, &s_), nullptr);
  }
  void TearDown() override {
    dp_session_destroy(s_);
    dp_bundle_close(b_);
  }

  // Binds a buffer of the session's own layout at `at`; the status code (DP_OK when accepted).
  int32_t bind_at(CUdeviceptr at, int64_t rows) {
    dp_tensor t;
    rt(dp_session_kv_layout(s_, -1, DP_KV_ATTN_RES, rows, &t), "layout");
    t.data = at;
    dp_status* st = dp_session_bind_kv(s_, -1, DP_KV_ATTN_RES, &t);
    const int32_t code = st ? dp_status_code(st) : DP_OK;
    dp_status_free(st);
    return code;
  }

  static test::TempDir* dir_;
  dp_bundle* b_ = nullptr;
  dp_session* s_ = nullptr;
};
test::TempDir* AttnRes::dir_ = nullptr;

TEST_F(AttnRes, SizedForTheLargestWidthTimesQAndBound) {
  std::vector<std::pair<size_t, std::string>> allocs;
  const AttnResBuffer ar = bind_attn_res(s_, 2, {3, 1}, 2, [&](size_t bytes, const std::string& what) {
    allocs.emplace_back(bytes, what);
    return kAddr;
  });
  EXPECT_EQ(ar.data, kAddr);
  EXPECT_EQ(ar.rows, 6);
  EXPECT_EQ(ar.blocks, 3);
  EXPECT_EQ(ar.stride, 3 * 256);
  EXPECT_EQ(ar.bytes, size_t{6 * 3 * 256 * 2});
  ASSERT_EQ(allocs.size(), 1u);
  EXPECT_EQ(allocs[0].first, ar.bytes);
  EXPECT_EQ(allocs[0].second, "attention-residual blocks");
  // The session holds it: the same address again is accepted, another one is a rebind.
  EXPECT_EQ(bind_at(kAddr, 6), DP_OK);
  EXPECT_EQ(bind_at(kAddr + 0x10000, 6), DP_ERR_REBIND);
}

TEST_F(AttnRes, NothingForAModelWithoutAttentionResiduals) {
  int allocs = 0;
  const AttnResBuffer ar = bind_attn_res(s_, 0, {1, 3}, 2, [&](size_t, const std::string&) {
    ++allocs;
    return kAddr;
  });
  EXPECT_EQ(ar.data, 0u);
  EXPECT_EQ(ar.bytes, 0u);
  EXPECT_EQ(allocs, 0);
  EXPECT_EQ(bind_at(kAddr + 0x10000, 6), DP_OK);  // nothing was bound before
}

TEST_F(AttnRes, TooFewRowsAreRefusedNamingTheBuffer) {
  // Widths that are not the bundle's (the largest 3 is missing): 2 rows where the session wants 6.
  test::expect_error(
      [&] { bind_attn_res(s_, 2, {1}, 2, [](size_t, const std::string&) { return kAddr; }); }, Errc::internal,
      {"binding the attention-residual buffer", "2 rows, expected >= 6", "DP_ERR_SHAPE"});
}

}  // namespace
}  // namespace dp::tools
