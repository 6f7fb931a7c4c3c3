// Layer programs over FP8 block-quantized weights: the e4m3 forms of the ops, each e4m3 weight bound with
// its scales, and no program (with the reason) where an op has no e4m3 form or mixes storage.
#include <gtest/gtest.h>

#include <set>

#include "common/embedded.h"
#include "common/json.h"
#include "deploy/deploy.h"
#include "model/ir.h"
#include "plan/plan.h"

namespace dp::plan {
namespace {

// Kimi-Linear-48B with the FP8 quantization `synth --quantize fp8` writes (router and KDA gate/beta
// projections kept bf16), plus `extra_ignored` modules.
model::Model fp8_model(std::vector<std::string> extra_ignored = {}) {
  Json c = parse_json(*embedded_file("presets/kimi-linear-48b-a3b.json"), "preset");
  Json ignore = {"model.embed_tokens", "lm_head", "block_sparse_moe.gate", "self_attn.f_a_proj", "self_attn.f_b_proj",
                 "self_attn.g_a_proj", "self_attn.g_b_proj", "self_attn.b_proj"};
  for (const std::string& e : extra_ignored) ignore.push_back(e);
  c["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
                              {"weight_block_size", {128, 128}}, {"modules_to_not_convert", ignore}};
  return model::model_from_config(c, "config.json");
}

Plan plan_of(const model::Model& m) {
  const Json d = {{"targets", {"sm_90a", "gfx942"}}, {"tensor_parallel", 1}, {"max_num_seqs", 8},
                  {"num_speculative_tokens", 0}, {"kv_cache", {{"dtype", "bf16"}, {"block_size", 64}}}};
  return make_plan(m, deploy::parse_deploy(d, "deploy.json"), "deploy.json");
}

const ProgramArg* arg(const ProgramStep& s, const std::string& param) {
  for (const ProgramArg& a : s.args)
    if (a.param == param) return &a;
  return nullptr;
}

TEST(Fp8Programs, EveryClassReadsItsE4m3WeightsWithTheirScales) {
  const Plan p = plan_of(fp8_model());
  ASSERT_EQ(p.programs.size(), 3u * 8);
  std::set<std::string> q8_ops;
  for (const LayerProgram& pr : p.programs) {
    ASSERT_EQ(pr.unavailable, "") << to_string(pr.cls) << " w" << pr.width;
    for (const ProgramStep& s : pr.steps) {
      const auto q8 = s.kernel.params.find("Q8");
      if (q8 == s.kernel.params.end()) continue;
      q8_ops.insert(s.kernel.op);
      // Every e4m3 weight parameter has its scales bound to the weight's weight_scale_inv.
      for (const ProgramArg& a : s.args) {
        if (a.from != ProgramArg::From::weight || a.param.ends_with("_scale")) continue;
        const ProgramArg* sc = arg(s, a.param + "_scale");
        if (!sc) continue;  // a bf16 segment of a mixed gemm
        EXPECT_EQ(sc->name, a.name.substr(0, a.name.size() - 7) + ".weight_scale_inv") << s.name;
      }
    }
  }
  EXPECT_EQ(q8_ops, (std::set<std::string>{"gemm", "mla_prep", "mla_combine", "mlp_up", "moe_up", "moe_down"}));

  for (const LayerProgram& pr : p.programs) {
    if (pr.cls != LayerClass::kda_moe || pr.width != 4) continue;
    // q, k, v e4m3; f_a, g_a, b bf16.
    const ProgramStep& in = pr.steps.at(1);
    EXPECT_EQ(in.name, "gemm_w4_k2304_na4096_nb4096_nc4096_nd128_ne128_nf32_q87");
    EXPECT_EQ(arg(in, "w2_scale")->name, "self_attn.v_proj.weight_scale_inv");
    EXPECT_EQ(arg(in, "w3_scale"), nullptr);
    // The router stays bf16 (fp32 logits); the experts read e4m3 with expert strides for the scales.
    EXPECT_EQ(pr.steps.at(3).name, "gemm_w4_k4096_na2304_q81");
    EXPECT_EQ(pr.steps.at(5).name, "gemm_w4_k2304_na256_f1_tk8_tr1");  // with the routing fused
    const ProgramStep& up = pr.steps.at(6);
    EXPECT_EQ(up.kernel.op, "moe_up");
    EXPECT_EQ(arg(up, "stride_w1_scale")->from, ProgramArg::From::expert_stride);
    EXPECT_EQ(arg(up, "stride_w1_scale")->name, "block_sparse_moe.experts.{e}.w1.weight_scale_inv");
    EXPECT_EQ(arg(up, "shared_gate_scale")->name, "block_sparse_moe.shared_experts.gate_proj.weight_scale_inv");
  }
}

TEST(Fp8Programs, NoProgramWhereAnOpHasNoE4m3FormOrMixesStorage) {
  // The KDA gate projections in e4m3 (an ignore list without them): kda_step reads f_b_proj as bf16.
  Json c = parse_json(*embedded_file("presets/kimi-linear-48b-a3b.json"), "preset");
  c["quantization_config"] = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128, 128}},
                              {"modules_to_not_convert", {"lm_head", "block_sparse_moe.gate"}}};
  const Plan all = plan_of(model::model_from_config(c, "config.json"));
  for (const LayerProgram& pr : all.programs) {
    if (pr.cls == LayerClass::mla_moe) {
      EXPECT_EQ(pr.unavailable, "");
    } else {
      EXPECT_NE(pr.unavailable.find("FP8 weight self_attn.f_b_proj.weight is stored e4m3, but op kda_step"), std::string::npos)
          << pr.unavailable;
    }
  }
  // The shared expert kept bf16 while the routed experts are e4m3: one op, two storages.
  const Plan mixed = plan_of(fp8_model({"shared_experts"}));
  for (const LayerProgram& pr : mixed.programs) {
    if (pr.cls == LayerClass::kda_dense) {
      EXPECT_EQ(pr.unavailable, "");
    } else {
      EXPECT_NE(pr.unavailable.find("the MoE experts: 3 of its 6 matrices are FP8 (e4m3) and the rest not"),
                std::string::npos)
          << pr.unavailable;
    }
  }
}

}  // namespace
}  // namespace dp::plan
