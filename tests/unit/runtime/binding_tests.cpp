// Weight and KV-cache binding on host-only sessions against real bundles: every error path with its
// code and message, the re-binding rules, and the cache shapes per deploy layout.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "runtime_test_util.h"

namespace dp::rttest {
namespace {

const Bundles& bundles() {
  static const Bundles b = ensure_bundles();
  return b;
}

constexpr const char* kQ = "model.layers.1.self_attn.q_proj.weight";       // [256, 256] BF16
constexpr const char* kW1 = "model.layers.1.block_sparse_moe.experts.{e}.w1.weight";  // 16 x [128, 256] BF16
constexpr uint64_t kAddr = 0x7f0000100000ull;

dp_tensor bf16(uint64_t data, std::vector<int64_t> shape) {
  dp_tensor t;
  dp_tensor_init(&t, data, DP_DTYPE_BF16, static_cast<int32_t>(shape.size()), shape.data());
  return t;
}

class BindingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!bundles().error.empty()) GTEST_FAIL() << bundles().error;
    open(bundles().tiny, 0);
  }
  void TearDown() override { close(); }
  void open(const fs::path& bundle, int32_t rank, const char* target = nullptr) {
    close();
    ASSERT_TRUE(outcome(dp_bundle_open(bundle.c_str(), nullptr, &b_)).ok());
    dp_session_options o = host_options(rank, target);
    ASSERT_TRUE(outcome(dp_session_create(b_, &o, &s_)).ok());
  }
  void close() {
    dp_session_destroy(s_);
    dp_bundle_close(b_);
    s_ = nullptr;
    b_ = nullptr;
  }
  dp_bundle* b_ = nullptr;
  dp_session* s_ = nullptr;
};

// ---- Weights ------------------------------------------------------------------------------------------

TEST_F(BindingTest, EveryWeightBindsAndFinalizes) {
  const Outcome o = bind_all_weights(b_, s_, 0);
  ASSERT_TRUE(o.ok()) << o.message;
  DP_EXPECT_OK(dp_session_finalize_weights(s_));
}

TEST_F(BindingTest, UnknownWeight) {
  const dp_tensor t = bf16(kAddr, {256});
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, "model.embed_tokens.weight", &t), DP_ERR_UNKNOWN_TENSOR,
                   "weight model.embed_tokens.weight", "not a weight of rank 0", "lists 86 weights",
                   "embeddings and the LM head stay with the host");
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, "model.layers.9.input_layernorm.weight", &t), DP_ERR_UNKNOWN_TENSOR,
                   "model.layers.9.input_layernorm.weight");
}

TEST_F(BindingTest, WrongDtype) {
  dp_tensor t = bf16(kAddr, {256, 256});
  t.dtype = DP_DTYPE_F32;
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, kQ, &t), DP_ERR_DTYPE, "weight model.layers.1.self_attn.q_proj.weight (rank 0)",
                   "dtype F32, expected BF16");
  // F32 weights (the conv kernels, A_log, dt_bias) are F32 in the bundle: BF16 is wrong for them.
  dp_tensor c = bf16(kAddr, {256, 1, 4});
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, "model.layers.1.self_attn.q_conv1d.weight", &c), DP_ERR_DTYPE,
                   "dtype BF16, expected F32");
}

TEST_F(BindingTest, WrongShape) {
  const dp_tensor t = bf16(kAddr, {256, 128});
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, kQ, &t), DP_ERR_SHAPE, "shape [256, 128], expected [256, 256]",
                   "this rank's shard: range [0, 256) of dimension 0");
  const dp_tensor flat = bf16(kAddr, {65536});
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, kQ, &flat), DP_ERR_SHAPE, "shape [65536], expected [256, 256]");
}

TEST_F(BindingTest, ShardShapeOnTensorParallelRanks) {
  open(bundles().tp2, 1);
  // q_proj is split over heads (dimension 0): rank 1 holds rows [128, 256).
  const dp_tensor full = bf16(kAddr, {256, 256});
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, kQ, &full), DP_ERR_SHAPE, "(rank 1)", "expected [128, 256]",
                   "range [128, 256) of dimension 0");
  const dp_tensor shard = bf16(kAddr, {128, 256});
  DP_EXPECT_OK(dp_session_bind_weight(s_, kQ, &shard));
  const Outcome o = bind_all_weights(b_, s_, 1, 0x7d0000000000ull);
  EXPECT_EQ(o.code, DP_ERR_REBIND) << o.message;  // kQ is already bound elsewhere
}

TEST_F(BindingTest, StridesMustBeDenseRows) {
  dp_tensor t = bf16(kAddr, {256, 256});
  t.strides[0] = 512;  // every other row of a wider tensor
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, kQ, &t), DP_ERR_LAYOUT, "strides [512, 1], expected [256, 1]",
                   "read weights as dense rows");
  t.strides[0] = 1;
  t.strides[1] = 256;  // a transposed view
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, kQ, &t), DP_ERR_LAYOUT, "strides [1, 256]");
  // A_log is [1, 1, 2, 1]: size-1 dimensions may carry any stride (PyTorch views do).
  dp_tensor a;
  const int64_t shape[4] = {1, 1, 2, 1};
  dp_tensor_init(&a, kAddr, DP_DTYPE_F32, 4, shape);
  a.strides[0] = 77;
  a.strides[3] = 5;
  DP_EXPECT_OK(dp_session_bind_weight(s_, "model.layers.1.self_attn.A_log", &a));
}

TEST_F(BindingTest, AddressMustBeAlignedAndNonZero) {
  const dp_tensor t = bf16(kAddr + 8, {256, 256});
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, kQ, &t), DP_ERR_ALIGNMENT, "0x7f0000100008", "not a multiple of 16 bytes",
                   "8 past one");
  const dp_tensor z = bf16(0, {256, 256});
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, kQ, &z), DP_ERR_INVALID_ARGUMENT, "data address is 0");
  dp_tensor bad = bf16(kAddr, {256, 256});
  bad.ndim = 9;
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, kQ, &bad), DP_ERR_INVALID_ARGUMENT, "ndim 9, expected 0..8");
}

TEST_F(BindingTest, RebindingSameAddressIsAcceptedAnotherIsRefused) {
  const dp_tensor t = bf16(kAddr, {256, 256});
  DP_EXPECT_OK(dp_session_bind_weight(s_, kQ, &t));
  DP_EXPECT_OK(dp_session_bind_weight(s_, kQ, &t));
  const dp_tensor moved = bf16(kAddr + 0x100000, {256, 256});
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, kQ, &moved), DP_ERR_REBIND, "already bound at 0x7f0000100000",
                   "now 0x7f0000200000", "weight reloads are not supported");
}

TEST_F(BindingTest, RebindingAfterFinalize) {
  ASSERT_TRUE(bind_all_weights(b_, s_, 0).ok());
  DP_EXPECT_OK(dp_session_finalize_weights(s_));
  // Addresses are those bind_all_weights chose; find q_proj's by trying a moved address: refused.
  const dp_tensor moved = bf16(0x10, {256, 256});
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, kQ, &moved), DP_ERR_REBIND, "weight reloads are not supported");
}

TEST_F(BindingTest, ExpertsOneByOne) {
  const dp_tensor t = bf16(kAddr, {128, 256});
  DP_EXPECT_OK(dp_session_bind_weight(s_, "model.layers.1.block_sparse_moe.experts.0.w1.weight", &t));
  const dp_tensor t15 = bf16(kAddr + 0x10000, {128, 256});
  DP_EXPECT_OK(dp_session_bind_weight(s_, "model.layers.1.block_sparse_moe.experts.15.w1.weight", &t15));
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, "model.layers.1.block_sparse_moe.experts.16.w1.weight", &t),
                   DP_ERR_UNKNOWN_TENSOR, "expert 16 of group", "experts 0..15");
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, kW1, &t), DP_ERR_INVALID_ARGUMENT, "is an expert group",
                   "dp_session_bind_expert_weights");
  const dp_tensor moved = bf16(kAddr + 0x20000, {128, 256});
  DP_EXPECT_STATUS(dp_session_bind_weight(s_, "model.layers.1.block_sparse_moe.experts.0.w1.weight", &moved),
                   DP_ERR_REBIND, "experts.0.w1.weight");
}

TEST_F(BindingTest, ExpertGroupInOneCall) {
  // vLLM's stacked w13 [E, 2I, H]: w1 of expert e at base + e * (2I * H * 2 bytes).
  const uint64_t stride = 2 * 128 * 256 * 2;
  std::vector<uint64_t> ptrs;
  for (int e = 0; e < 16; ++e) ptrs.push_back(kAddr + e * stride);
  const dp_tensor one = bf16(0, {128, 256});
  DP_EXPECT_STATUS(dp_session_bind_expert_weights(s_, kW1, ptrs.data(), 8, &one), DP_ERR_SHAPE, "8 experts given",
                   "the rank holds 16");
  DP_EXPECT_STATUS(dp_session_bind_expert_weights(s_, "model.layers.1.self_attn.q_proj.weight", ptrs.data(), 16, &one),
                   DP_ERR_INVALID_ARGUMENT, "is a single tensor, not an expert group");
  DP_EXPECT_STATUS(dp_session_bind_expert_weights(s_, "model.layers.7.experts.{e}.w1.weight", ptrs.data(), 16, &one),
                   DP_ERR_UNKNOWN_TENSOR, "expert group model.layers.7.experts.{e}.w1.weight");
  std::vector<uint64_t> bad = ptrs;
  bad[5] += 4;
  DP_EXPECT_STATUS(dp_session_bind_expert_weights(s_, kW1, bad.data(), 16, &one), DP_ERR_ALIGNMENT,
                   "experts.5.w1.weight (expert 5 of group", "not a multiple of 16");
  // The refused call bound nothing: expert 0 may still take any address.
  const dp_tensor t0 = bf16(kAddr + 0x40, {128, 256});
  DP_EXPECT_OK(dp_session_bind_weight(s_, "model.layers.1.block_sparse_moe.experts.0.w1.weight", &t0));
  DP_EXPECT_STATUS(dp_session_bind_expert_weights(s_, kW1, ptrs.data(), 16, &one), DP_ERR_REBIND, "expert 0");
  ptrs[0] = kAddr + 0x40;
  DP_EXPECT_OK(dp_session_bind_expert_weights(s_, kW1, ptrs.data(), 16, &one));
  DP_EXPECT_OK(dp_session_bind_expert_weights(s_, kW1, ptrs.data(), 16, &one));  // same addresses again
}

TEST_F(BindingTest, FinalizeNamesWhatIsMissing) {
  const dp_tensor t = bf16(kAddr, {128, 256});
  DP_EXPECT_OK(dp_session_bind_weight(s_, "model.layers.1.block_sparse_moe.experts.3.w1.weight", &t));
  DP_EXPECT_STATUS(dp_session_finalize_weights(s_), DP_ERR_MISSING_TENSOR, "rank 0", "86 of 86 weights are not bound",
                   "model.layers.0.input_layernorm.weight", "and 78 more");
  ASSERT_TRUE(bind_all_weights(b_, s_, 0).code == DP_ERR_REBIND);  // expert 3 was bound elsewhere: stops there
  // Bind everything but the final norm and three experts of one group.
  open(bundles().tiny, 0);
  const int32_t n = dp_bundle_weight_count(b_, 0);
  uint64_t next = 0x7f0000000000ull;
  for (int32_t i = 0; i < n; ++i) {
    dp_weight_info w;
    w.size = sizeof(w);
    DP_EXPECT_OK(dp_bundle_get_weight(b_, 0, i, &w));
    if (std::string(w.name) == "model.norm.weight") continue;
    dp_tensor x;
    dp_tensor_init(&x, 0, w.dtype, w.ndim, w.shape);
    if (w.experts == 0) {
      x.data = next += 0x100000;
      DP_EXPECT_OK(dp_session_bind_weight(s_, w.name, &x));
      continue;
    }
    for (int32_t e = 0; e < w.experts; ++e) {
      if (std::string(w.name) == kW1 && (e == 2 || e == 7 || e == 9)) continue;
      std::string name = w.name;
      name.replace(name.find("{e}"), 3, std::to_string(e));
      x.data = next += 0x100000;
      DP_EXPECT_OK(dp_session_bind_weight(s_, name.c_str(), &x));
    }
  }
  DP_EXPECT_STATUS(dp_session_finalize_weights(s_), DP_ERR_MISSING_TENSOR, "2 of 86 weights are not bound",
                   "model.layers.1.block_sparse_moe.experts.{e}.w1.weight (3 of 16 experts: 2, 7, 9)",
                   "model.norm.weight");
}

TEST_F(BindingTest, LoadingNeedsADeviceAndPlanningNeedsFinalizedWeights) {
  DP_EXPECT_STATUS(dp_session_load_kernels(s_), DP_ERR_NO_DEVICE, "host-only");
  DP_EXPECT_STATUS(dp_session_verify_weights(s_), DP_ERR_NO_DEVICE, "reads the weights from the device");
  DP_EXPECT_STATUS(dp_session_verify_weights(nullptr), DP_ERR_INVALID_ARGUMENT, "session is NULL");
  dp_step_desc d;
  dp_step_desc_init(&d);
  d.num_requests = 1;
  dp_plan_result r;
  dp_plan_result_init(&r);
  DP_EXPECT_STATUS(dp_plan(s_, &d, &r), DP_ERR_STATE, "dp_plan before dp_session_finalize_weights");
}

// ---- KV caches ----------------------------------------------------------------------------------------

// ---- LM head (format 1.5) ------------------------------------------------------------------------------

TEST_F(BindingTest, LmHeadBindsTheHostsWeightOnce) {
  dp_bundle_info i{};
  i.size = sizeof(i);
  DP_EXPECT_OK(dp_bundle_get_info(b_, &i));
  EXPECT_EQ(i.vocab_size, 1024);
  const dp_tensor t = bf16(kAddr, {1024, 256});
  DP_EXPECT_OK(dp_session_bind_lm_head(s_, &t));
  DP_EXPECT_OK(dp_session_bind_lm_head(s_, &t));  // the same address again: accepted
  const dp_tensor moved = bf16(kAddr + 0x100000, {1024, 256});
  DP_EXPECT_STATUS(dp_session_bind_lm_head(s_, &moved), DP_ERR_REBIND, "LM head weight (rank 0)", "already bound",
                   "weight reloads are not supported");
}

TEST_F(BindingTest, LmHeadChecksShapeDtypeAndAddress) {
  const dp_tensor short_vocab = bf16(kAddr, {1000, 256});
  DP_EXPECT_STATUS(dp_session_bind_lm_head(s_, &short_vocab), DP_ERR_SHAPE, "LM head weight (rank 0)",
                   "shape [1000, 256], expected [1024, 256]");
  dp_tensor f32 = bf16(kAddr, {1024, 256});
  f32.dtype = DP_DTYPE_F32;
  DP_EXPECT_STATUS(dp_session_bind_lm_head(s_, &f32), DP_ERR_DTYPE, "dtype F32, expected BF16");
  const dp_tensor odd = bf16(kAddr + 8, {1024, 256});
  DP_EXPECT_STATUS(dp_session_bind_lm_head(s_, &odd), DP_ERR_ALIGNMENT, "LM head weight");
  DP_EXPECT_STATUS(dp_session_bind_lm_head(s_, nullptr), DP_ERR_INVALID_ARGUMENT, "weight");
}

TEST_F(BindingTest, LmHeadOfATensorParallelRankIsItsVocabularyShard) {
  open(bundles().tp2, 1);
  const dp_tensor whole = bf16(kAddr, {1024, 256});
  DP_EXPECT_STATUS(dp_session_bind_lm_head(s_, &whole), DP_ERR_SHAPE, "LM head weight (rank 1)",
                   "expected [512, 256]");
  const dp_tensor shard = bf16(kAddr, {512, 256});
  DP_EXPECT_OK(dp_session_bind_lm_head(s_, &shard));
}

TEST_F(BindingTest, LaunchingTheLmHeadNeedsADevice) {
  dp_lm_head_io io;
  dp_lm_head_io_init(&io);
  EXPECT_EQ(io.size, sizeof(io));
  DP_EXPECT_STATUS(dp_launch_lm_head(s_, nullptr, &io, nullptr), DP_ERR_NO_DEVICE, "host-only session");
  DP_EXPECT_STATUS(dp_launch_lm_head(s_, nullptr, nullptr, nullptr), DP_ERR_INVALID_ARGUMENT, "io");
}

TEST_F(BindingTest, KvLayoutsOfTheDefaultDeploy) {
  dp_tensor t;
  // kimi-linear-tiny: KDA 2 heads x 128, conv kernel 4; MLA kv_lora_rank 512 + rope 64; bf16, block 64.
  DP_EXPECT_OK(dp_session_kv_layout(s_, 0, DP_KV_KDA_STATE, 10, &t));
  EXPECT_EQ(t.dtype, DP_DTYPE_F32);
  EXPECT_EQ(std::vector<int64_t>(t.shape, t.shape + t.ndim), (std::vector<int64_t>{10, 2, 128, 128}));
  DP_EXPECT_OK(dp_session_kv_layout(s_, 0, DP_KV_CONV_K, 10, &t));
  EXPECT_EQ(t.dtype, DP_DTYPE_BF16);
  EXPECT_EQ(std::vector<int64_t>(t.shape, t.shape + t.ndim), (std::vector<int64_t>{10, 3, 256}));  // "sd"
  DP_EXPECT_OK(dp_session_kv_layout(s_, 3, DP_KV_MLA_LATENT, 5, &t));
  EXPECT_EQ(t.dtype, DP_DTYPE_BF16);
  EXPECT_EQ(std::vector<int64_t>(t.shape, t.shape + t.ndim), (std::vector<int64_t>{5, 64, 576}));
  EXPECT_EQ(t.strides[0], 64 * 576);
  DP_EXPECT_STATUS(dp_session_kv_layout(s_, 3, DP_KV_KDA_STATE, 5, &t), DP_ERR_UNKNOWN_TENSOR,
                   "layer 3 is an MLA layer: it has no DP_KV_KDA_STATE (it binds DP_KV_MLA_LATENT)");
  DP_EXPECT_STATUS(dp_session_kv_layout(s_, 0, DP_KV_MLA_LATENT, 5, &t), DP_ERR_UNKNOWN_TENSOR,
                   "layer 0 is a KDA layer", "DP_KV_KDA_STATE and DP_KV_CONV_Q/K/V");
  DP_EXPECT_STATUS(dp_session_kv_layout(s_, 4, DP_KV_MLA_LATENT, 5, &t), DP_ERR_INVALID_ARGUMENT, "KV layer 4");
  DP_EXPECT_STATUS(dp_session_kv_layout(s_, 0, 9, 5, &t), DP_ERR_INVALID_ARGUMENT, "KV kind 9");
  DP_EXPECT_STATUS(dp_session_kv_layout(s_, 0, DP_KV_CONV_Q, 0, &t), DP_ERR_INVALID_ARGUMENT, "count 0");
}

TEST_F(BindingTest, KvLayoutsFollowTheDeploy) {
  open(bundles().spec, 0);  // conv ds/float32, kv fp8 with 16-token blocks
  dp_tensor t;
  DP_EXPECT_OK(dp_session_kv_layout(s_, 1, DP_KV_CONV_V, 7, &t));
  EXPECT_EQ(t.dtype, DP_DTYPE_F32);
  EXPECT_EQ(std::vector<int64_t>(t.shape, t.shape + t.ndim), (std::vector<int64_t>{7, 256, 3}));  // "ds"
  DP_EXPECT_OK(dp_session_kv_layout(s_, 3, DP_KV_MLA_LATENT, 7, &t));
  EXPECT_EQ(t.dtype, DP_DTYPE_F8_E4M3);
  EXPECT_EQ(std::vector<int64_t>(t.shape, t.shape + t.ndim), (std::vector<int64_t>{7, 16, 576}));
  open(bundles().tp2, 1);  // heads and channels split over 2 ranks
  DP_EXPECT_OK(dp_session_kv_layout(s_, 0, DP_KV_KDA_STATE, 7, &t));
  EXPECT_EQ(std::vector<int64_t>(t.shape, t.shape + t.ndim), (std::vector<int64_t>{7, 1, 128, 128}));
  DP_EXPECT_OK(dp_session_kv_layout(s_, 0, DP_KV_CONV_Q, 7, &t));
  EXPECT_EQ(std::vector<int64_t>(t.shape, t.shape + t.ndim), (std::vector<int64_t>{7, 3, 128}));
}

TEST_F(BindingTest, KvChecks) {
  dp_tensor t;
  DP_EXPECT_OK(dp_session_kv_layout(s_, 0, DP_KV_KDA_STATE, 8, &t));
  t.data = kAddr;
  dp_tensor x = t;
  x.dtype = DP_DTYPE_BF16;
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, 0, DP_KV_KDA_STATE, &x), DP_ERR_DTYPE, "layer 0 DP_KV_KDA_STATE",
                   "dtype BF16, expected F32");
  x = t;
  x.shape[1] = 4;
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, 0, DP_KV_KDA_STATE, &x), DP_ERR_SHAPE, "shape [8, 4, 128, 128]",
                   "expected [N, 2, 128, 128]");
  x = t;
  x.strides[2] = 256;
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, 0, DP_KV_KDA_STATE, &x), DP_ERR_LAYOUT, "strides", "each slot/block");
  x = t;
  x.strides[0] = 100;  // less than one slot
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, 0, DP_KV_KDA_STATE, &x), DP_ERR_LAYOUT, "or a larger first stride");
  x = t;
  x.strides[0] = 2 * 128 * 128 + 2;  // a page shared with another state, but 8 bytes off 16
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, 0, DP_KV_KDA_STATE, &x), DP_ERR_ALIGNMENT, "first-dimension stride 32770");
  x = t;
  x.strides[0] = 2 * 128 * 128 + 4;  // 16 bytes more per slot: accepted
  DP_EXPECT_OK(dp_session_bind_kv(s_, 0, DP_KV_KDA_STATE, &x));
  x = t;
  x.data = kAddr + 4;
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, 0, DP_KV_CONV_Q, &x), DP_ERR_DTYPE);  // kind checked before address
  DP_EXPECT_OK(dp_session_kv_layout(s_, 0, DP_KV_CONV_Q, 8, &x));
  x.data = kAddr + 4;
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, 0, DP_KV_CONV_Q, &x), DP_ERR_ALIGNMENT, "layer 0 DP_KV_CONV_Q");
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, 3, DP_KV_CONV_Q, &x), DP_ERR_UNKNOWN_TENSOR, "layer 3 is an MLA layer");
}

TEST_F(BindingTest, KvGrowsInPlaceButDoesNotMove) {
  dp_tensor t;
  DP_EXPECT_OK(dp_session_kv_layout(s_, 3, DP_KV_MLA_LATENT, 4, &t));
  t.data = kAddr;
  DP_EXPECT_OK(dp_session_bind_kv(s_, 3, DP_KV_MLA_LATENT, &t));
  DP_EXPECT_OK(dp_session_kv_layout(s_, 3, DP_KV_MLA_LATENT, 4000, &t));  // the cache grew where it was
  t.data = kAddr;
  DP_EXPECT_OK(dp_session_bind_kv(s_, 3, DP_KV_MLA_LATENT, &t));
  t.data = kAddr + 0x1000;
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, 3, DP_KV_MLA_LATENT, &t), DP_ERR_REBIND, "layer 3 DP_KV_MLA_LATENT",
                   "bound at 0x7f0000100000, now 0x7f0000101000", "dp_session_release_kv");
  t.data = kAddr;
  t.strides[0] = 64 * 576 * 2;
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, 3, DP_KV_MLA_LATENT, &t), DP_ERR_REBIND, "not change its layout");
  // vLLM frees the memory-profiling cache and allocates the real one elsewhere: release, then bind.
  DP_EXPECT_OK(dp_session_release_kv(s_));
  DP_EXPECT_OK(dp_session_kv_layout(s_, 3, DP_KV_MLA_LATENT, 9000, &t));
  t.data = kAddr + 0x1000;
  DP_EXPECT_OK(dp_session_bind_kv(s_, 3, DP_KV_MLA_LATENT, &t));
}

// ---- K3 block attention residuals (format 1.7) -----------------------------------------------------------

// kimi-k3-tiny: 5 layers, attn_res_block_size 2 (layers 0, 2, 4 push: 3 blocks), hidden 256; widths 1-2.
TEST_F(BindingTest, AttnResBufferIsTheModelsAndItsLayoutIsChecked) {
  open(bundles().k3, 0);
  dp_tensor t;
  DP_EXPECT_OK(dp_session_kv_layout(s_, -1, DP_KV_ATTN_RES, 4, &t));
  EXPECT_EQ(t.dtype, DP_DTYPE_BF16);
  EXPECT_EQ(std::vector<int64_t>(t.shape, t.shape + t.ndim), (std::vector<int64_t>{4, 3, 256}));
  EXPECT_EQ(t.strides[0], 3 * 256);
  DP_EXPECT_STATUS(dp_session_kv_layout(s_, 0, DP_KV_ATTN_RES, 4, &t), DP_ERR_INVALID_ARGUMENT, "layer 0 DP_KV_ATTN_RES",
                   "bind it with layer -1");
  DP_EXPECT_STATUS(dp_session_kv_layout(s_, -1, DP_KV_ATTN_RES, 0, &t), DP_ERR_INVALID_ARGUMENT, "count 0");
  DP_EXPECT_STATUS(dp_session_kv_layout(s_, -1, DP_KV_KDA_STATE, 4, &t), DP_ERR_INVALID_ARGUMENT, "KV layer -1");

  DP_EXPECT_OK(dp_session_kv_layout(s_, -1, DP_KV_ATTN_RES, 2, &t));
  t.data = kAddr;
  dp_tensor x = t;
  x.shape[0] = 1;  // one row: the largest width (2) x q (1) does not fit
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, -1, DP_KV_ATTN_RES, &x), DP_ERR_SHAPE, "DP_KV_ATTN_RES: 1 rows, expected >= 2",
                   "largest width 2 x q 1");
  x = t;
  x.shape[1] = 2;  // fewer blocks than the model stores
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, -1, DP_KV_ATTN_RES, &x), DP_ERR_SHAPE, "shape [2, 2, 256]",
                   "expected [N, 3, 256]");
  x = t;
  x.dtype = DP_DTYPE_F32;
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, -1, DP_KV_ATTN_RES, &x), DP_ERR_DTYPE, "dtype F32, expected BF16");
  x = t;
  x.strides[0] = 3 * 256 + 4;  // 8 bytes past a 16-byte multiple
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, -1, DP_KV_ATTN_RES, &x), DP_ERR_ALIGNMENT, "first-dimension stride 772");
  x = t;
  x.strides[1] = 512;  // blocks not dense
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, -1, DP_KV_ATTN_RES, &x), DP_ERR_LAYOUT, "strides");
  x = t;
  x.strides[0] = 3 * 256 + 8;  // padded rows: accepted
  DP_EXPECT_OK(dp_session_bind_kv(s_, -1, DP_KV_ATTN_RES, &x));
  x.data = kAddr + 0x1000;
  DP_EXPECT_STATUS(dp_session_bind_kv(s_, -1, DP_KV_ATTN_RES, &x), DP_ERR_REBIND, "DP_KV_ATTN_RES: bound at");
  DP_EXPECT_OK(dp_session_release_kv(s_));
  DP_EXPECT_OK(dp_session_bind_kv(s_, -1, DP_KV_ATTN_RES, &x));

  // A model without attention residuals has no such buffer.
  open(bundles().tiny, 0);
  DP_EXPECT_STATUS(dp_session_kv_layout(s_, -1, DP_KV_ATTN_RES, 4, &t), DP_ERR_UNKNOWN_TENSOR,
                   "no block attention residuals");
}

TEST_F(BindingTest, StepsWaitForTheAttnResBuffer) {
  open(bundles().k3, 0);
  ASSERT_TRUE(bind_all_weights(b_, s_, 0).ok());
  DP_EXPECT_OK(dp_session_finalize_weights(s_));
  const Outcome k = bind_all_kv(b_, s_, 8, 8);
  ASSERT_TRUE(k.ok()) << k.message;
  std::vector<int32_t> q = {1, 1};
  dp_step_desc d;
  dp_step_desc_init(&d);
  d.num_requests = 2;
  d.query_lens = q.data();
  dp_plan_result r;
  dp_plan_result_init(&r);
  DP_EXPECT_OK(dp_plan(s_, &d, &r));
  EXPECT_EQ(r.reason, DP_REASON_NO_KV);
  EXPECT_NE(std::string(r.message).find("DP_KV_ATTN_RES"), std::string::npos) << r.message;
  dp_tensor t;
  DP_EXPECT_OK(dp_session_kv_layout(s_, -1, DP_KV_ATTN_RES, 2, &t));
  t.data = kAddr;
  DP_EXPECT_OK(dp_session_bind_kv(s_, -1, DP_KV_ATTN_RES, &t));
  DP_EXPECT_OK(dp_plan(s_, &d, &r));
  EXPECT_EQ(r.reason, DP_REASON_NONE) << r.message;
  EXPECT_EQ(r.width, 2);
}

// ---- Tensor-parallel exchange buffers -------------------------------------------------------------------

TEST_F(BindingTest, TensorParallelOneHasNoExchangeBuffers) {
  EXPECT_EQ(dp_session_exchange_bytes(s_), 0u);
  const uint64_t one = kAddr;
  DP_EXPECT_STATUS(dp_session_set_peers(s_, &one, 1, 1000), DP_ERR_INVALID_ARGUMENT, "dp_session_set_peers",
                   "do not all-reduce (tensor_parallel 1)");
}

TEST_F(BindingTest, TensorParallelPeersAreCheckedAndRequiredBeforeLoad) {
  open(bundles().tp2, 1);
  // 512 bytes of abort word and counters, 2 x 8 x 64 flag lines of 128 bytes, then data[2][2 ranks][4 rows][256] bf16.
  EXPECT_EQ(dp_session_exchange_bytes(s_), 131584u + 2 * 2 * 4 * 256 * 2);
  ASSERT_TRUE(bind_all_weights(b_, s_, 1).ok());
  DP_EXPECT_OK(dp_session_finalize_weights(s_));
  DP_EXPECT_STATUS(dp_session_load_kernels(s_), DP_ERR_STATE, "all-reduce over tensor_parallel 2 ranks",
                   "call dp_session_set_peers with the 2 ranks' exchange buffers", "before dp_session_load_kernels");
  const uint64_t two[2] = {kAddr, kAddr + 0x100000};
  DP_EXPECT_STATUS(dp_session_set_peers(s_, two, 1, 1000), DP_ERR_INVALID_ARGUMENT,
                   "1 exchange buffers, expected 2 (one per rank of tensor_parallel 2, in rank order)");
  DP_EXPECT_STATUS(dp_session_set_peers(s_, two, 3, 1000), DP_ERR_INVALID_ARGUMENT, "3 exchange buffers, expected 2");
  DP_EXPECT_STATUS(dp_session_set_peers(s_, nullptr, 2, 1000), DP_ERR_INVALID_ARGUMENT, "0 exchange buffers, expected 2");
  const uint64_t zero[2] = {kAddr, 0};
  DP_EXPECT_STATUS(dp_session_set_peers(s_, zero, 2, 1000), DP_ERR_INVALID_ARGUMENT, "exchange[1] (rank 1's buffer) is 0");
  const uint64_t odd[2] = {kAddr + 8, kAddr + 0x100000};
  DP_EXPECT_STATUS(dp_session_set_peers(s_, odd, 2, 1000), DP_ERR_ALIGNMENT, "exchange[0] (rank 0's buffer)",
                   "not a multiple of 16");
  const uint64_t same[2] = {kAddr, kAddr};
  DP_EXPECT_STATUS(dp_session_set_peers(s_, same, 2, 1000), DP_ERR_INVALID_ARGUMENT,
                   "exchange[0] and exchange[1] are both", "every rank needs its own buffer");
  DP_EXPECT_STATUS(dp_session_set_peers(s_, two, 2, 0), DP_ERR_INVALID_ARGUMENT, "timeout_us 0, expected >= 1");
  DP_EXPECT_OK(dp_session_set_peers(s_, two, 2, 1000));
  DP_EXPECT_STATUS(dp_session_set_peers(s_, two, 2, 1000), DP_ERR_REBIND, "called twice");
  // With the peers set, what is left missing is the device (a host-only session loads nothing).
  DP_EXPECT_STATUS(dp_session_load_kernels(s_), DP_ERR_NO_DEVICE, "needs a device");
}

}  // namespace
}  // namespace dp::rttest
