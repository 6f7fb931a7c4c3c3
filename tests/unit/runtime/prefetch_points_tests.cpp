// Where in a layer program the runtime starts each L2 prefetch point (runtime/src/prefetch_points.h),
// on the programs the compiler makes for the four Kimi-Linear layer classes.
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "decodepack/decodepack.h"
#include "src/prefetch_points.h"

namespace dp::rt {
namespace {

// A program from (op, weight read) pairs; "" reads no weight.
std::pair<format::ProgramEntry, std::vector<std::string>> program(
    const std::vector<std::pair<std::string, std::string>>& steps) {
  format::ProgramEntry p;
  std::vector<std::string> ops;
  for (const auto& [op, weight] : steps) {
    format::ProgramStepEntry s;
    s.kernel = op + "_w1";
    s.args.push_back({"x", "workspace", "", 0, 0});
    if (!weight.empty()) s.args.push_back({"w0", "weight", weight, 0, 0});
    p.steps.push_back(s);
    ops.push_back(op);
  }
  return {p, ops};
}

const auto kKdaMoe = program({{"rmsnorm", "input_layernorm.weight"},
                              {"gemm", "self_attn.q_proj.weight"},
                              {"kda_step", "self_attn.A_log"},
                              {"gemm", "self_attn.o_proj.weight"},
                              {"rmsnorm", "post_attention_layernorm.weight"},
                              {"gemm", "block_sparse_moe.gate.weight"},
                              {"moe_route", ""},
                              {"moe_up", "block_sparse_moe.experts.w1.weight"},
                              {"moe_down", "block_sparse_moe.experts.w2.weight"}});
const auto kMlaMoe = program({{"rmsnorm", "input_layernorm.weight"},
                              {"gemm", "self_attn.q_proj.weight"},
                              {"mla_prep", "self_attn.kv_b_proj.weight"},
                              {"mla_attn", ""},
                              {"mla_combine", "self_attn.kv_b_proj.weight"},
                              {"gemm", "self_attn.o_proj.weight"},
                              {"rmsnorm", "post_attention_layernorm.weight"},
                              {"gemm", "block_sparse_moe.gate.weight"},
                              {"moe_route", ""},
                              {"moe_up", "block_sparse_moe.experts.w1.weight"},
                              {"moe_down", "block_sparse_moe.experts.w2.weight"}});
const auto kMlaDense = program({{"rmsnorm", "input_layernorm.weight"},
                                {"gemm", "self_attn.q_proj.weight"},
                                {"mla_prep", ""},
                                {"mla_attn", ""},
                                {"mla_combine", ""},
                                {"gemm", "self_attn.o_proj.weight"},
                                {"rmsnorm", "post_attention_layernorm.weight"},
                                {"mlp_up", "mlp.gate_proj.weight"},
                                {"gemm", "mlp.down_proj.weight"}});

int32_t at(int32_t point, const std::pair<format::ProgramEntry, std::vector<std::string>>& p) {
  return prefetch_start_after(point, p.first, p.second);
}

TEST(PrefetchPoints, NamesAreTheHeadersPoints) {
  EXPECT_EQ(prefetch_point_id("oproj_down"), DP_PREFETCH_OPROJ_DOWN);
  EXPECT_EQ(prefetch_point_id("attention_moe"), DP_PREFETCH_ATTENTION_MOE);
  EXPECT_EQ(prefetch_point_id("next_attention"), DP_PREFETCH_NEXT_ATTENTION);
  EXPECT_EQ(prefetch_point_id("attention_oproj"), DP_PREFETCH_ATTENTION_OPROJ);
  EXPECT_EQ(prefetch_point_id("next_layer"), -1);
  EXPECT_EQ(prefetch_point_id(""), -1);
}

TEST(PrefetchPoints, AttentionOprojStartsBeforeTheCore) {
  EXPECT_EQ(at(DP_PREFETCH_ATTENTION_OPROJ, kKdaMoe), 1);    // after the input projection, before kda_step
  EXPECT_EQ(at(DP_PREFETCH_ATTENTION_OPROJ, kMlaMoe), 1);    // before mla_prep
  EXPECT_EQ(at(DP_PREFETCH_ATTENTION_OPROJ, kMlaDense), 1);
}

TEST(PrefetchPoints, OprojDownStartsAfterTheOProjection) {
  EXPECT_EQ(at(DP_PREFETCH_OPROJ_DOWN, kKdaMoe), 3);
  EXPECT_EQ(at(DP_PREFETCH_OPROJ_DOWN, kMlaMoe), 5);
}

TEST(PrefetchPoints, AttentionMoeStartsAfterTheInputProjectionOrTheMlaCore) {
  EXPECT_EQ(at(DP_PREFETCH_ATTENTION_MOE, kKdaMoe), 1);
  EXPECT_EQ(at(DP_PREFETCH_ATTENTION_MOE, kMlaMoe), 4);  // mla_combine, not the q projection
}

TEST(PrefetchPoints, NextAttentionStartsAfterTheFirstExpertKernel) {
  EXPECT_EQ(at(DP_PREFETCH_NEXT_ATTENTION, kKdaMoe), 7);
  EXPECT_EQ(at(DP_PREFETCH_NEXT_ATTENTION, kMlaMoe), 9);
}

TEST(PrefetchPoints, MissingKernelsStartBeforeTheLayer) {
  EXPECT_EQ(at(DP_PREFETCH_NEXT_ATTENTION, kMlaDense), -1);  // no routed experts
  const auto norm_only = program({{"rmsnorm", "input_layernorm.weight"}});
  for (int32_t p : {DP_PREFETCH_OPROJ_DOWN, DP_PREFETCH_ATTENTION_MOE, DP_PREFETCH_NEXT_ATTENTION,
                    DP_PREFETCH_ATTENTION_OPROJ})
    EXPECT_EQ(at(p, norm_only), -1) << p;
  EXPECT_EQ(at(7, kKdaMoe), -1);  // not a point
  // A program whose op list is shorter than its steps (never made by the compiler) reads only both.
  auto truncated = kKdaMoe;
  truncated.second.resize(2);
  EXPECT_EQ(at(DP_PREFETCH_NEXT_ATTENTION, truncated), -1);
}

}  // namespace
}  // namespace dp::rt
