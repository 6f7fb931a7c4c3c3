#include <gtest/gtest.h>

#include <set>

#include "deploy/deploy.h"
#include "model/ir.h"
#include "plan/plan.h"
#include "../test_util.h"

namespace dp::plan {
namespace {

deploy::Deploy deploy_of(Json j) { return deploy::parse_deploy(j, "deploy.json"); }

Json base_deploy() {
  return {{"targets", {"sm_90a", "gfx942"}}, {"tensor_parallel", 1}, {"max_num_seqs", 8},
          {"num_speculative_tokens", 0}, {"kv_cache", {{"dtype", "bf16"}, {"block_size", 64}}}};
}

TEST(Plan, KernelNamesAreDeterministicAndCoverEveryClassWidthAndTarget) {
  model::Model m = model::load_model("kimi-linear-48b-a3b");
  Plan p = make_plan(m, deploy_of(base_deploy()), "deploy.json");
  // Classes of the 48B model: kda_dense (layer 0), kda_moe, mla_moe, final_norm; 8 widths; 2 targets;
  // plus one prefetch kernel per target.
  EXPECT_EQ(p.kernels.size(), 2u * (4 * 8 + 1));
  std::set<std::string> keys;
  for (const KernelInstance& k : p.kernels) EXPECT_TRUE(keys.insert(k.target + "/" + k.name).second) << k.name;
  EXPECT_TRUE(keys.count("sm_90a/kda_moe_w4_q1_h2304_tp1_nh32_d128_cv4_gr128_sg0_e256_k8_i1024_s1024_lat0_fp40_act0_ar0"));
  Plan again = make_plan(m, deploy_of(base_deploy()), "deploy.json");
  ASSERT_EQ(again.kernels.size(), p.kernels.size());
  for (size_t i = 0; i < p.kernels.size(); ++i) EXPECT_EQ(again.kernels[i].name, p.kernels[i].name);
}

TEST(Plan, TensorParallelShardsDivideSplitDims) {
  model::Model m = model::load_model("kimi-linear-48b-a3b");
  Json d = base_deploy();
  d["tensor_parallel"] = 4;
  Plan p = make_plan(m, deploy_of(d), "deploy.json");
  ASSERT_EQ(p.ranks.size(), 4u);
  uint64_t total = 0;
  for (const RankPlan& r : p.ranks) {
    for (const WeightShard& s : r.shards) {
      if (s.name == "model.layers.0.self_attn.q_proj.weight") {
        EXPECT_EQ(s.split_dim, 0);
        EXPECT_EQ(s.begin, 1024 * r.rank);
        EXPECT_EQ(s.end, 1024 * (r.rank + 1));
        EXPECT_EQ(s.bytes, 1024u * 2304 * 2);
      }
      if (s.name == "model.layers.0.self_attn.o_proj.weight") {
        EXPECT_EQ(s.split_dim, 1);
        EXPECT_EQ(s.shape, (std::vector<int64_t>{2304, 1024}));
      }
      if (s.name == "model.layers.0.self_attn.f_a_proj.weight") {
        EXPECT_EQ(s.split_dim, -1);
      }
      if (s.name == "model.layers.5.block_sparse_moe.experts.{e}.w2.weight") {
        EXPECT_EQ(s.experts, 256);
        EXPECT_EQ(s.shape, (std::vector<int64_t>{2304, 256}));
      }
    }
    total += r.weight_bytes;
  }
  // Replicated tensors are held by every rank, so the ranks together hold at least the model.
  EXPECT_GE(total, m.total_weight_bytes());
}

TEST(Plan, StepBytesCountRoutedExpertsAsTheWorstCase) {
  model::Model m = model::load_model("kimi-linear-48b-a3b");
  Plan p = make_plan(m, deploy_of(base_deploy()), "deploy.json");
  const RankPlan& r = p.ranks[0];
  ASSERT_EQ(r.step_bytes.size(), 8u);
  const uint64_t expert = 3ull * 1024 * 2304 * 2;
  // Width 1 to 2: 8 more distinct experts in each of the 26 MoE layers.
  EXPECT_EQ(r.step_bytes[1].weights - r.step_bytes[0].weights, 26 * 8 * expert);
  // The measured width-1 floor is about 6.3 GB per step including the 755 MB LM head, which the decode
  // layers do not read: about 5.5 GB of layer weights.
  EXPECT_GT(r.step_bytes[0].weights, 5'000'000'000ull);
  EXPECT_LT(r.step_bytes[0].weights, 5'800'000'000ull);
  // KDA state: 2 MiB fp32 per layer per request, read once, 20 layers.
  EXPECT_GE(r.step_bytes[0].state_read, 20ull * 2 * 1024 * 1024);
  EXPECT_GT(r.step_bytes[7].total_read(), r.step_bytes[0].total_read());
}

TEST(Plan, PrefetchTablesFollowTheWidthRules) {
  model::Model m = model::load_model("kimi-linear-48b-a3b");
  Plan p = make_plan(m, deploy_of(base_deploy()), "deploy.json");
  int oproj = 0, next = 0;
  for (const PrefetchTable& t : p.ranks[0].prefetch) {
    if (t.point == "oproj_down") {
      ++oproj;
      EXPECT_TRUE(t.critical);
      EXPECT_EQ(t.widths, (std::vector<int64_t>{3, 4, 5, 6, 7, 8}));
    }
    if (t.point == "next_attention") {
      ++next;
      EXPECT_FALSE(t.critical);
      EXPECT_LE(t.bytes(), 24u << 20);
    }
    EXPECT_NE(t.point, "attention_moe");  // TP 8 only
    for (const PrefetchRange& x : t.ranges) EXPECT_EQ(x.bytes % 16, 0u);
  }
  EXPECT_EQ(oproj, 26);
  EXPECT_EQ(next, 25);  // every MoE layer but the last
}

TEST(Plan, DeployThatDoesNotFitTheModelIsRefused) {
  model::Model m = model::load_model("kimi-linear-tiny");  // 2 KDA heads
  Json d = base_deploy();
  d["tensor_parallel"] = 4;
  test::expect_error([&] { make_plan(m, deploy_of(d), "deploy.json"); }, Errc::input,
                     {"deploy.json", "tensor_parallel 4", "2"});
}

TEST(Plan, K3PlansWithoutWeights) {
  model::Model m = model::load_model("kimi-k3");
  Json d = base_deploy();
  d["tensor_parallel"] = 8;
  d["ranks"] = {0};
  Plan p = make_plan(m, deploy_of(d), "deploy.json");
  ASSERT_EQ(p.ranks.size(), 1u);
  bool attention_moe = false;
  for (const PrefetchTable& t : p.ranks[0].prefetch) attention_moe |= t.point == "attention_moe";
  EXPECT_TRUE(attention_moe);
  bool latent = false;
  for (const KernelInstance& k : p.kernels) latent |= k.op == "kda_lmoe" && k.param("fp4") == 1 && k.param("lat") == 3584;
  EXPECT_TRUE(latent);
}

}  // namespace
}  // namespace dp::plan
