#include <gtest/gtest.h>

#include <numeric>

#include "bench/bytes.h"
#include "deploy/deploy.h"
#include "model/ir.h"
#include "plan/plan.h"
#include "../test_util.h"

namespace dp::bench {
namespace {

deploy::Deploy deploy_of(std::vector<int64_t> widths) {
  return deploy::parse_deploy(Json{{"targets", {"sm_90a"}}, {"widths", widths}}, "deploy.json");
}

// The manifest's form of the plan's programs, as the bundle writer records them.
std::vector<format::ProgramEntry> programs_of(const plan::Plan& p) {
  std::vector<format::ProgramEntry> out;
  for (const plan::LayerProgram& lp : p.programs) {
    format::ProgramEntry pe;
    pe.cls = plan::to_string(lp.cls);
    pe.width = lp.width;
    for (const plan::ProgramStep& s : lp.steps) {
      format::ProgramStepEntry se;
      se.kernel = s.name;
      for (const plan::ProgramArg& a : s.args) se.args.push_back({a.param, plan::to_string(a.from), a.name, a.offset, a.value});
      pe.steps.push_back(std::move(se));
    }
    out.push_back(std::move(pe));
  }
  return out;
}

StepTraffic traffic(int64_t width, int64_t seq_len, int64_t routed) {
  StepTraffic t;
  t.seq_lens.assign(static_cast<size_t>(width), seq_len);
  t.routed_experts = routed;
  return t;
}

TEST(BenchBytes, ClosedFormFor48bShapes) {
  const model::Model m = model::load_model("kimi-linear-48b-a3b");
  const CacheElems e;
  // One expert: w1 + w3 [1024, 2304] and w2 [2304, 1024], bf16.
  EXPECT_EQ(expert_bytes(m, 1), 3ull * 1024 * 2304 * 2);
  EXPECT_EQ(expert_bytes(m, 0), 0u);  // layer 0 is dense
  // KDA layer 1 (MoE), width 2, 8 distinct experts: state = [32, 128, 128] fp32 + 3 x [4096, 3] bf16 per slot.
  const Bytes k = layer_bytes(m, 1, e, traffic(2, 4097, 8));
  const uint64_t slot = 32ull * 128 * 128 * 4 + 3ull * 4096 * 3 * 2;
  EXPECT_EQ(k.state_read, 2 * slot);
  EXPECT_EQ(k.state_write, 2 * slot);
  EXPECT_EQ(k.kv_read, 0u);
  EXPECT_EQ(k.expert_weights, 8 * expert_bytes(m, 1));
  EXPECT_EQ(k.act_read, 2ull * 2 * 2304 * 2);  // hidden + residual
  EXPECT_EQ(k.act_write, 2ull * 2 * 2304 * 2);
  // MLA layer 3: every request's seq_len rows of 576 bf16 read, one row each written.
  const Bytes a = layer_bytes(m, 3, e, traffic(2, 4097, 8));
  EXPECT_EQ(a.kv_read, 2ull * 4097 * 576 * 2);
  EXPECT_EQ(a.kv_write, 2ull * 576 * 2);
  EXPECT_EQ(a.state_read + a.state_write, 0u);
  // Layer 0 has no residual input.
  EXPECT_EQ(layer_bytes(m, 0, e, traffic(1, 10, 0)).act_read, 2304ull * 2);
  // The final norm: its weight [2304] bf16 plus two rows in, two out.
  const Bytes f = final_norm_bytes(m, 1);
  EXPECT_EQ(f.dense_weights, 2304u * 2);
  EXPECT_EQ(f.total(), 2304u * 2 + 4 * 2304 * 2);
  test::expect_error([&] { layer_bytes(m, 27, e, traffic(1, 1, 0)); }, Errc::input, {"layer 27", "27 layers"});
}

// With the plan's worst case (min(E, rows x k) experts, every request at the planned context), the
// layers plus the final norm read exactly the weights, states and cache bytes `plan` reports.
TEST(BenchBytes, WorstCaseAgreesWithPlan) {
  const model::Model m = model::load_model("kimi-linear-48b-a3b");
  const plan::Plan p = plan::make_plan(m, deploy_of({1, 8}), "deploy.json");
  for (const plan::StepBytes& sb : p.ranks.front().step_bytes) {
    Bytes sum;
    for (int l = 0; l < m.num_layers; ++l)
      sum += layer_bytes(m, l, {}, traffic(sb.width, 4096, std::min<int64_t>(m.moe.num_experts, sb.width * m.moe.top_k)));
    sum += final_norm_bytes(m, sb.width);
    EXPECT_EQ(sum.weights(), sb.weights) << "width " << sb.width;
    EXPECT_EQ(sum.state_read, sb.state_read);
    EXPECT_EQ(sum.state_write, sb.state_write);
    EXPECT_EQ(sum.kv_read, sb.kv_read);
    EXPECT_EQ(sum.kv_write, sb.kv_write);
  }
}

// Every weight a layer reads is named by some kernel of its program, the KDA states and MLA rows are
// counted by exactly the kernels that read or write them, and only the MLA kernels share a weight
// (kv_b_proj: prep absorbs the query with W_UK, combine applies W_UV).
TEST(BenchBytes, KernelsOfAProgramCoverTheLayer) {
  const model::Model m = model::load_model("kimi-linear-48b-a3b");
  const plan::Plan p = plan::make_plan(m, deploy_of({1, 8}), "deploy.json");
  const std::vector<format::ProgramEntry> programs = programs_of(p);
  for (int layer : {0, 1, 3}) {
    for (int64_t width : {1, 8}) {
      const std::string cls = plan::to_string(p.ranks.front().layers[static_cast<size_t>(layer)].cls);
      const format::ProgramEntry* prog = nullptr;
      for (const format::ProgramEntry& pe : programs)
        if (pe.cls == cls && pe.width == width) prog = &pe;
      ASSERT_TRUE(prog) << cls << " w" << width;
      const StepTraffic t = traffic(width, 4097, width * 8);
      const Bytes lb = layer_bytes(m, layer, {}, t);
      Bytes kb;
      for (const format::ProgramStepEntry& s : prog->steps) kb += kernel_bytes(m, layer, s, {}, t);
      const uint64_t kv_b = m.layers[static_cast<size_t>(layer)].mixer == model::Mixer::mla
                                ? uint64_t{32} * 256 * 512 * 2
                                : 0;
      EXPECT_EQ(kb.dense_weights, lb.dense_weights + kv_b) << cls << " w" << width;
      EXPECT_EQ(kb.expert_weights, lb.expert_weights) << cls;
      EXPECT_EQ(kb.state_read, lb.state_read) << cls;
      EXPECT_EQ(kb.state_write, lb.state_write) << cls;
      EXPECT_EQ(kb.kv_read, lb.kv_read) << cls;
      EXPECT_EQ(kb.kv_write, lb.kv_write) << cls;
      // The post-attention norm reads and writes the residual once more.
      const uint64_t rows = static_cast<uint64_t>(width) * 2304 * 2;
      EXPECT_EQ(kb.act_read, lb.act_read + rows) << cls;
      EXPECT_EQ(kb.act_write, lb.act_write + rows) << cls;
    }
  }
}

TEST(BenchBytes, KernelNamingAWeightTheLayerLacksIsAnError) {
  const model::Model m = model::load_model("kimi-linear-48b-a3b");
  format::ProgramStepEntry s;
  s.kernel = "gemm_x";
  s.args.push_back({"w0", "weight", "self_attn.no_such.weight", 0, 0});
  test::expect_error([&] { kernel_bytes(m, 1, s, {}, traffic(1, 1, 0)); }, Errc::input,
                     {"gemm_x", "layer 1", "self_attn.no_such.weight"});
}

}  // namespace
}  // namespace dp::bench
