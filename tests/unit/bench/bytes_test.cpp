#include <gtest/gtest.h>

#include <numeric>

#include "bench/bytes.h"
#include "common/dtype.h"
#include "common/embedded.h"
#include "common/json.h"
#include "deploy/deploy.h"
#include "model/ir.h"
#include "model/synth.h"
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

// A preset with the quantization_config `synth --quantize fp8` writes (e4m3 weights, 128 x 128 blocks).
model::Model fp8_model(const std::string& preset) {
  const model::Model bf16 = model::load_model(preset);
  Json cfg = parse_json(*embedded_file("presets/" + preset + ".json"), preset);
  cfg["quantization_config"] = model::fp8_quantization_config(bf16);
  return model::model_from_config(cfg, preset + " with --quantize fp8");
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

// FP8 weights are read as one byte per value plus their fp32 block scales: the HBM share of an FP8 step
// is counted on the FP8 bytes.
TEST(BenchBytes, Fp8WeightsCountOneBytePerValuePlusTheirScales) {
  const model::Model m = fp8_model("kimi-linear-48b-a3b");
  const model::Model b = model::load_model("kimi-linear-48b-a3b");
  ASSERT_EQ(m.quant.method, model::QuantMethod::fp8_block);
  const CacheElems e;
  // One expert: w1 + w3 [1024, 2304] and w2 [2304, 1024] e4m3, each with [8, 18] (w2: [18, 8]) fp32 scales.
  EXPECT_EQ(expert_bytes(m, 1), 3ull * 1024 * 2304 + 3ull * 8 * 18 * 4);
  EXPECT_EQ(expert_bytes(b, 1), 3ull * 1024 * 2304 * 2);
  // KDA layer 1: q, k, v [4096, 2304], o [2304, 4096], the shared expert's gate, up [1024, 2304] and down
  // in e4m3 with their scales; the gate and beta projections, router, norms, conv taps and vectors as in
  // the bf16 model.
  const StepTraffic t = traffic(2, 4097, 8);
  const Bytes k = layer_bytes(m, 1, e, t), kb = layer_bytes(b, 1, e, t);
  const uint64_t fp8_values = 4ull * 4096 * 2304 + 3ull * 1024 * 2304;
  const uint64_t scales = (4ull * 32 * 18 + 3ull * 8 * 18) * 4;
  EXPECT_EQ(k.dense_weights, kb.dense_weights - fp8_values + scales);
  EXPECT_EQ(k.expert_weights, 8 * expert_bytes(m, 1));
  EXPECT_EQ(k.state_read, kb.state_read);
  EXPECT_EQ(k.act_read + k.act_write, kb.act_read + kb.act_write);
  // The same as the IR's byte count of every decode weight of the layer (each weight, each scale once).
  uint64_t dense = 0, fp8 = 0, bytes16 = 0;
  for (size_t i : m.layers[1].weights) {
    const model::WeightSpec& w = m.weights[i];
    if (w.decode && w.expert < 0) dense += static_cast<uint64_t>(w.numel()) * dtype_size(w.dtype);
    if (w.expert < 0 && w.quant.method == model::QuantMethod::fp8_block) fp8 += static_cast<uint64_t>(w.numel());
  }
  for (size_t i : b.layers[1].weights)
    if (b.weights[i].decode && b.weights[i].expert < 0) bytes16 += b.weights[i].bytes();
  EXPECT_EQ(k.dense_weights, dense);
  EXPECT_EQ(fp8, fp8_values);
  EXPECT_EQ(kb.dense_weights, bytes16);
  // MLA layer 3: kv_b_proj [32 x 256, 512] e4m3 with [64, 4] scales among its weights.
  const Bytes a = layer_bytes(m, 3, e, t), ab = layer_bytes(b, 3, e, t);
  EXPECT_LT(a.dense_weights, ab.dense_weights * 6 / 10);
  EXPECT_EQ(a.kv_read, ab.kv_read);
  // The whole step: about half the bf16 weight bytes (scales add 1/4096 per value).
  Bytes sm, sb;
  for (int l = 0; l < m.num_layers; ++l) {
    sm += layer_bytes(m, l, e, t);
    sb += layer_bytes(b, l, e, t);
  }
  EXPECT_LT(sm.weights(), sb.weights() * 52 / 100);
  EXPECT_GT(sm.weights(), sb.weights() * 48 / 100);
}

// The bench's FP8 step at the plan's worst case reads the weight bytes `plan` reports for the FP8 model.
TEST(BenchBytes, Fp8WorstCaseAgreesWithPlan) {
  const model::Model m = fp8_model("kimi-linear-48b-a3b");
  const plan::Plan p = plan::make_plan(m, deploy_of({1, 8}), "deploy.json");
  ASSERT_FALSE(p.ranks.front().step_bytes.empty());
  for (const plan::StepBytes& sb : p.ranks.front().step_bytes) {
    const int64_t experts = std::min<int64_t>(m.moe.num_experts, sb.width * m.moe.top_k);
    Bytes sum;
    for (int l = 0; l < m.num_layers; ++l) sum += layer_bytes(m, l, {}, traffic(sb.width, 4096, experts));
    sum += final_norm_bytes(m, sb.width);
    EXPECT_EQ(sum.weights(), sb.weights) << "width " << sb.width;
    EXPECT_EQ(sum.kv_read, sb.kv_read);
  }
}

// A kernel reading an e4m3 weight names it and its scale tensor (gemm's "w0" and "w0_scale", moe_up's
// "w1" and "w1_scale" over the expert group): both are counted, the expert group's per routed expert.
TEST(BenchBytes, Fp8KernelCountsItsWeightsAndTheirScales) {
  const model::Model m = fp8_model("kimi-linear-48b-a3b");
  const StepTraffic t = traffic(1, 100, 8);
  format::ProgramStepEntry g;
  g.kernel = "gemm_w1_k4096_na2304_q81";
  g.args.push_back({"w0", "weight", "self_attn.o_proj.weight", 0, 0});
  g.args.push_back({"w0_scale", "weight", "self_attn.o_proj.weight_scale_inv", 0, 0});
  EXPECT_EQ(kernel_bytes(m, 1, g, {}, t).dense_weights, 2304ull * 4096 + 18ull * 32 * 4);
  format::ProgramStepEntry u;
  u.kernel = "moe_up_q81";
  u.args.push_back({"w1", "weight", "block_sparse_moe.experts.{e}.w1.weight", 0, 0});
  u.args.push_back({"w1_scale", "weight", "block_sparse_moe.experts.{e}.w1.weight_scale_inv", 0, 0});
  u.args.push_back({"shared_gate", "weight", "block_sparse_moe.shared_experts.gate_proj.weight", 0, 0});
  u.args.push_back({"shared_gate_scale", "weight", "block_sparse_moe.shared_experts.gate_proj.weight_scale_inv", 0, 0});
  const Bytes ub = kernel_bytes(m, 1, u, {}, t);
  EXPECT_EQ(ub.expert_weights, 8 * (1024ull * 2304 + 8ull * 18 * 4));
  EXPECT_EQ(ub.dense_weights, 1024ull * 2304 + 8ull * 18 * 4);
}

// Once the FP8 layers have programs, their kernels together read every weight and every scale of the
// layer (an e4m3 weight bound without its scale, or a scale never bound, shows up here).
TEST(BenchBytes, Fp8KernelsOfAProgramCoverTheLayer) {
  const model::Model m = fp8_model("kimi-linear-48b-a3b");
  const plan::Plan p = plan::make_plan(m, deploy_of({1, 8}), "deploy.json");
  const std::vector<format::ProgramEntry> programs = programs_of(p);
  int checked = 0;
  for (int layer : {0, 1, 3}) {
    for (int64_t width : {1, 8}) {
      const std::string cls = plan::to_string(p.ranks.front().layers[static_cast<size_t>(layer)].cls);
      const format::ProgramEntry* prog = nullptr;
      for (const format::ProgramEntry& pe : programs)
        if (pe.cls == cls && pe.width == width && !pe.steps.empty()) prog = &pe;
      if (!prog) continue;
      ++checked;
      const StepTraffic t = traffic(width, 4097, width * 8);
      const Bytes lb = layer_bytes(m, layer, {}, t);
      Bytes kb;
      for (const format::ProgramStepEntry& s : prog->steps) kb += kernel_bytes(m, layer, s, {}, t);
      // kv_b_proj and its scales are read twice (prep absorbs the query with W_UK, combine applies W_UV).
      uint64_t kv_b = 0;
      if (m.layers[static_cast<size_t>(layer)].mixer == model::Mixer::mla)
        for (size_t i : m.layers[static_cast<size_t>(layer)].weights)
          if (m.weights[i].key.starts_with("self_attn.kv_b_proj.")) kv_b += m.weights[i].bytes();
      EXPECT_EQ(kb.dense_weights, lb.dense_weights + kv_b) << cls << " w" << width;
      EXPECT_EQ(kb.expert_weights, lb.expert_weights) << cls << " w" << width;
    }
  }
  if (checked == 0) GTEST_SKIP() << "no FP8 layer class has a program in this build (the plan refuses them)";
}

// MXFP4 experts (Kimi-K3): the packed E2M1 bytes (two values per byte) and the E8M0 scale bytes (one per
// 32 values) of w1, w3 and w2 are what an expert costs, per routed expert; the bench's share of the HBM
// limit is taken on these bytes.
TEST(BenchBytes, Mxfp4ExpertsCountTheirPackedBytesAndScales) {
  const model::Model m = model::load_model("kimi-k3");
  ASSERT_EQ(m.moe.expert_format, model::ExpertFormat::mxfp4);
  const uint64_t packed = 3072ull * 1792, scales = 3072ull * 112;  // [3072, 3584] and [3584, 3072] alike
  EXPECT_EQ(expert_bytes(m, 1), 3 * (packed + scales));
  const StepTraffic t = traffic(1, 100, 16);
  EXPECT_EQ(layer_bytes(m, 1, {}, t).expert_weights, 16 * 3 * (packed + scales));
  format::ProgramStepEntry u;
  u.kernel = "moe_up_w1_d3584_i3072_e896_k16_s0_act1_q41";
  for (const char* w : {"w1", "w3"}) {
    const std::string g = std::string("block_sparse_moe.experts.{e}.") + w;
    u.args.push_back({w, "weight", g + ".weight_packed", 0, 0});
    u.args.push_back({std::string(w) + "_scale", "weight", g + ".weight_scale", 0, 0});
  }
  const Bytes ub = kernel_bytes(m, 1, u, {}, t);
  EXPECT_EQ(ub.expert_weights, 16 * 2 * (packed + scales));
  EXPECT_EQ(ub.dense_weights, 0u);
}

// The latent MoE's program (MXFP4 experts; Kimi-Linear mixers, since K3's have no program yet) reads
// every weight of its layer once: the router, the latent down / up projections and norm, the shared
// expert, and per routed expert the packed codes and scales of w1, w3, w2.
TEST(BenchBytes, LatentMoeKernelsOfAProgramCoverTheLayer) {
  Json c = parse_json(*embedded_file("presets/kimi-k3-tiny.json"), "preset");
  Json& tc = c["text_config"];
  tc["linear_attn_config"].erase("use_full_rank_gate");
  tc["linear_attn_config"].erase("gate_lower_bound");
  tc["q_lora_rank"] = nullptr;
  tc["mla_use_output_gate"] = false;
  tc.erase("attn_res_block_size");
  model::Model m = model::model_from_config(c, "config.json");
  m.type = model::ModelType::kimi_linear;
  const plan::Plan p = plan::make_plan(m, deploy_of({1, 8}), "deploy.json");
  const std::vector<format::ProgramEntry> programs = programs_of(p);
  int checked = 0;
  for (int layer : {1, 3}) {
    for (int64_t width : {1, 8}) {
      const std::string cls = plan::to_string(p.ranks.front().layers[static_cast<size_t>(layer)].cls);
      const format::ProgramEntry* prog = nullptr;
      for (const format::ProgramEntry& pe : programs)
        if (pe.cls == cls && pe.width == width) prog = &pe;
      ASSERT_TRUE(prog && !prog->steps.empty()) << cls << " w" << width;
      ++checked;
      const StepTraffic t = traffic(width, 300, width * 4);
      const Bytes lb = layer_bytes(m, layer, {}, t);
      Bytes kb;
      for (const format::ProgramStepEntry& s : prog->steps) kb += kernel_bytes(m, layer, s, {}, t);
      uint64_t kv_b = 0;  // read twice by the MLA kernels
      if (m.layers[static_cast<size_t>(layer)].mixer == model::Mixer::mla)
        for (size_t i : m.layers[static_cast<size_t>(layer)].weights)
          if (m.weights[i].key.starts_with("self_attn.kv_b_proj.")) kv_b += m.weights[i].bytes();
      EXPECT_EQ(kb.dense_weights, lb.dense_weights + kv_b) << cls << " w" << width;
      EXPECT_EQ(kb.expert_weights, lb.expert_weights) << cls << " w" << width;
      EXPECT_EQ(lb.expert_weights, static_cast<uint64_t>(width) * 4 * expert_bytes(m, layer));
    }
  }
  EXPECT_EQ(checked, 4);
}

}  // namespace
}  // namespace dp::bench
