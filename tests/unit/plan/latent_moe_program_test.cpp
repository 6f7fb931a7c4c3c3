// Layer programs of the K3 latent MoE with MXFP4 routed experts (program.cpp latent_moe): the steps, their
// kernels and bindings (packed U8 codes and U8 scales, expert strides, the scratch the steps pass on),
// the single all-reduce of the latent sum and the shared output at tensor_parallel 2; and the plain MoE
// over MXFP4 experts (program.cpp moe_mxfp4).
//
// Kimi-K3 models get no program yet (their mixers and block attention residuals have none), so these
// tests read the kimi-k3-tiny preset with Kimi-Linear mixers (low-rank KDA gate, no q-LoRA, no MLA
// output gate, no block attention residuals) and mark the IR as kimi_linear: its FFN layers are K3's
// latent MoE with MXFP4 experts.
#include <gtest/gtest.h>

#include "common/embedded.h"
#include "common/json.h"
#include "deploy/deploy.h"
#include "model/ir.h"
#include "plan/plan.h"
#include "plan/program.h"

namespace dp::plan {
namespace {

model::Model latent_model(bool norm = true, int64_t shared = 2) {
  Json c = parse_json(*embedded_file("presets/kimi-k3-tiny.json"), "preset");
  Json& t = c["text_config"];
  t["linear_attn_config"].erase("use_full_rank_gate");
  t["linear_attn_config"].erase("gate_lower_bound");
  t["q_lora_rank"] = nullptr;
  t["mla_use_output_gate"] = false;
  t.erase("attn_res_block_size");
  t["latent_moe_use_norm"] = norm;
  t["num_shared_experts"] = shared;
  model::Model m = model::model_from_config(c, "config.json");
  m.type = model::ModelType::kimi_linear;
  return m;
}

deploy::Deploy deploy_of(int64_t tp) {
  const Json d = {{"targets", {"sm_90a", "gfx942"}}, {"tensor_parallel", tp}, {"max_num_seqs", 8},
                  {"num_speculative_tokens", 0}, {"kv_cache", {{"dtype", "bf16"}, {"block_size", 64}}}};
  return deploy::parse_deploy(d, "deploy.json");
}

const ProgramArg& arg(const ProgramStep& s, const std::string& param) {
  for (const ProgramArg& a : s.args)
    if (a.param == param) return a;
  ADD_FAILURE() << s.name << " has no parameter " << param;
  static ProgramArg none;
  return none;
}

// The FFN part of a program: the steps after the post-attention norm (the second rmsnorm over H).
std::vector<const ProgramStep*> ffn_steps(const LayerProgram& p) {
  std::vector<const ProgramStep*> out;
  int norms = 0;
  for (const ProgramStep& s : p.steps) {
    if (norms >= 2) out.push_back(&s);
    if (s.kernel.op == "rmsnorm" && s.kernel.params.at("H") == 256) ++norms;
  }
  return out;
}

TEST(LatentMoePrograms, StepsKernelsAndBindingsAtTp1) {
  const model::Model m = latent_model();
  ASSERT_EQ(m.moe.expert_format, model::ExpertFormat::mxfp4);
  for (LayerClass cls : {LayerClass::kda_latent_moe, LayerClass::mla_latent_moe}) {
    // As plan() builds it: once to size the counter words, then with its scratch above them.
    const LayerProgram p = layer_program(m, deploy_of(1), cls, 4, layer_program(m, deploy_of(1), cls, 4).counter_bytes);
    ASSERT_EQ(p.unavailable, "") << to_string(cls);
    const std::vector<const ProgramStep*> f = ffn_steps(p);
    std::vector<std::string> names;
    for (const ProgramStep* s : f) names.push_back(s->name);
    EXPECT_EQ(names, (std::vector<std::string>{
                         "gemm_w4_k256_na16_f1_tk4_tr1",                    // router + routing
                         "gemm_w4_k256_na128",                              // latent down
                         "moe_up_w4_d128_i128_e16_k4_s0_act1_q41",          // MXFP4 gate/up in the latent
                         "moe_down_w4_d128_i128_e16_k4_s0_q41",             // MXFP4 down: the latent sum
                         "mlp_up_w4_d256_i256_act1",                        // shared expert gate/up
                         "gemm_w4_k256_na256",                              // shared expert down
                         "rmsnorm_w4_h128",                                 // routed_expert_norm
                         "gemm_w4_k128_na256_ad1",                          // latent up + shared
                     }));
    const ProgramStep &down_lat = *f[1], &up = *f[2], &down = *f[3], &sdown = *f[5], &norm = *f[6], &last = *f[7];
    EXPECT_EQ(arg(down_lat, "w0").name, "block_sparse_moe.routed_expert_down_proj.weight");
    EXPECT_EQ(arg(up, "x").from, ProgramArg::From::workspace);
    EXPECT_EQ(arg(up, "x").offset, arg(down_lat, "out").offset);
    EXPECT_EQ(arg(up, "w1").name, "block_sparse_moe.experts.{e}.w1.weight_packed");
    EXPECT_EQ(arg(up, "w1_scale").name, "block_sparse_moe.experts.{e}.w1.weight_scale");
    EXPECT_EQ(arg(up, "w3").name, "block_sparse_moe.experts.{e}.w3.weight_packed");
    EXPECT_EQ(arg(up, "stride_w3").from, ProgramArg::From::expert_stride);
    EXPECT_EQ(arg(up, "stride_w3").name, "block_sparse_moe.experts.{e}.w3.weight_packed");
    EXPECT_EQ(arg(up, "stride_w3_scale").name, "block_sparse_moe.experts.{e}.w3.weight_scale");
    EXPECT_EQ(arg(up, "act_beta").value, 4.0);
    EXPECT_EQ(arg(down, "w2").name, "block_sparse_moe.experts.{e}.w2.weight_packed");
    EXPECT_EQ(arg(down, "stride_w2_scale").name, "block_sparse_moe.experts.{e}.w2.weight_scale");
    EXPECT_EQ(arg(down, "routed_scaling").value, 1.0);
    // The MXFP4 latent sum keeps one block per tile: its split grid measured slower (H200, 2026-12-05).
    EXPECT_EQ(down.kernel.params.count("SK"), 0u);
    // The router's block counter (the routing tail) is a counter word, below the program's scratch.
    const ProgramStep& router = *f[0];
    EXPECT_EQ(arg(router, "done").from, ProgramArg::From::workspace);
    EXPECT_EQ(arg(router, "done").offset, 0u);
    EXPECT_GE(p.counter_bytes, 4u);
    EXPECT_GE(arg(router, "out").offset, p.counter_bytes);
    // The latent sum and the shared output lie side by side: [T, D] then [T, H].
    const uint64_t sums = arg(down, "out").offset;
    EXPECT_EQ(arg(sdown, "out").offset, sums + 4 * 128 * 2);
    EXPECT_EQ(arg(norm, "hidden").offset, sums);
    EXPECT_EQ(arg(norm, "residual").from, ProgramArg::From::null);
    EXPECT_EQ(arg(norm, "residual_out").from, ProgramArg::From::workspace);
    EXPECT_NE(arg(norm, "residual_out").offset, sums);
    EXPECT_EQ(arg(norm, "weight").name, "block_sparse_moe.routed_expert_norm.weight");
    EXPECT_EQ(arg(last, "x").offset, arg(norm, "out").offset);
    EXPECT_EQ(arg(last, "w0").name, "block_sparse_moe.routed_expert_up_proj.weight");
    EXPECT_EQ(arg(last, "add").offset, arg(sdown, "out").offset);
    EXPECT_EQ(arg(last, "out").from, ProgramArg::From::io);
    EXPECT_EQ(arg(last, "out").name, "out");
    EXPECT_EQ(&p.steps.back(), f.back());  // nothing after it at TP 1
  }
}

TEST(LatentMoePrograms, OneAllReduceOfLatentSumAndSharedOutputAtTp2) {
  const model::Model m = latent_model();
  const LayerProgram p = layer_program(m, deploy_of(2), LayerClass::kda_latent_moe, 2);
  ASSERT_EQ(p.unavailable, "");
  const std::vector<const ProgramStep*> f = ffn_steps(p);
  std::vector<std::string> ops;
  for (const ProgramStep* s : f) ops.push_back(s->kernel.op);
  EXPECT_EQ(ops, (std::vector<std::string>{"gemm", "gemm", "moe_up", "moe_down", "mlp_up", "gemm", "allreduce",
                                           "rmsnorm", "gemm"}));
  // Rank shards: the expert and shared intermediates halve (I 64, shared 128); the latent does not.
  EXPECT_EQ(f[2]->name, "moe_up_w2_d128_i64_e16_k4_s0_act1_q41");
  EXPECT_EQ(f[4]->name, "mlp_up_w2_d256_i128_act1");
  const ProgramStep& ar = *f[6];
  EXPECT_EQ(ar.name, "allreduce_w2_h384_r2");  // latent 128 + hidden 256 per row
  EXPECT_EQ(arg(ar, "op").value, 1);
  EXPECT_EQ(arg(ar, "partial").offset, arg(*f[3], "out").offset);
  EXPECT_EQ(arg(ar, "out").offset, arg(*f[3], "out").offset);
  EXPECT_EQ(arg(*f[5], "out").offset, arg(*f[3], "out").offset + 2 * 128 * 2);
  EXPECT_EQ(arg(*f[8], "out").from, ProgramArg::From::io);  // every rank writes the whole output
  // Two all-reduces a layer (o-projection op 0, FFN op 1): the exchange halves alternate.
  int reduces = 0;
  for (const ProgramStep& s : p.steps) reduces += s.kernel.op == "allreduce";
  EXPECT_EQ(reduces, 2);
}

TEST(LatentMoePrograms, WithoutNormOrSharedExpert) {
  const LayerProgram p = layer_program(latent_model(false, 0), deploy_of(1), LayerClass::mla_latent_moe, 1);
  ASSERT_EQ(p.unavailable, "");
  const std::vector<const ProgramStep*> f = ffn_steps(p);
  ASSERT_EQ(f.size(), 5u);
  EXPECT_EQ(f.back()->name, "gemm_w1_k128_na256");  // no addend
  EXPECT_EQ(arg(*f.back(), "x").offset, arg(*f[3], "out").offset);  // the latent sum itself
  EXPECT_EQ(arg(*f.back(), "out").name, "out");
}

TEST(LatentMoePrograms, KimiK3AndTheLatentVariantPlanEveryClass) {
  // The real preset: its latent MoE class has a program (K3 mixers, attention residuals and all).
  const model::Model k3 = model::load_model("kimi-k3-tiny");
  const LayerProgram p = layer_program(k3, deploy_of(1), LayerClass::kda_latent_moe, 1);
  EXPECT_EQ(p.unavailable, "");
  EXPECT_FALSE(p.steps.empty());
  // The Kimi-Linear-mixer variant plans every class at every width, each on both targets.
  const Plan plan = make_plan(latent_model(), deploy_of(1), "deploy.json");
  ASSERT_FALSE(plan.programs.empty());
  for (const LayerProgram& pr : plan.programs) EXPECT_EQ(pr.unavailable, "") << to_string(pr.cls) << " w" << pr.width;
}

// Kimi-Linear-tiny with the routed experts in MXFP4 (the K3 preset's compressed-tensors description):
// a plain MoE over MXFP4 experts at the hidden width. The Q4 forms write the routed sum to scratch, the
// shared expert's down gemm adds it (AD) into the output; at tensor_parallel 2 both are partials and the
// FFN's one allreduce sums them.
TEST(LatentMoePrograms, PlainMoeOverMxfp4Experts) {
  Json c = parse_json(*embedded_file("presets/kimi-linear-tiny.json"), "preset");
  c["quantization_config"] =
      parse_json(*embedded_file("presets/kimi-k3-tiny.json"), "preset")["quantization_config"];
  const model::Model m = model::model_from_config(c, "config.json");
  ASSERT_EQ(m.moe.expert_format, model::ExpertFormat::mxfp4);
  for (int64_t tp : {1, 2}) {
    const LayerProgram p = layer_program(m, deploy_of(tp), LayerClass::kda_moe, 2);
    ASSERT_EQ(p.unavailable, "") << "tp " << tp;
    const std::vector<const ProgramStep*> f = ffn_steps(p);
    std::vector<std::string> names;
    for (const ProgramStep* s : f) names.push_back(s->name);
    if (tp == 1) {
      EXPECT_EQ(names, (std::vector<std::string>{"gemm_w2_k256_na16_f1_tk4_tr1",
                                                 "moe_up_w2_d256_i128_e16_k4_s0_act0_q41",
                                                 "moe_down_w2_d256_i128_e16_k4_s0_q41", "mlp_up_w2_d256_i128_act0",
                                                 "gemm_w2_k128_na256_ad1"}));
    } else {
      EXPECT_EQ(names, (std::vector<std::string>{"gemm_w2_k256_na16_f1_tk4_tr1",
                                                 "moe_up_w2_d256_i64_e16_k4_s0_act0_q41",
                                                 "moe_down_w2_d256_i64_e16_k4_s0_q41", "mlp_up_w2_d256_i64_act0",
                                                 "gemm_w2_k64_na256_ad1", "allreduce_w2_h256_r2"}));
      EXPECT_EQ(arg(*f.back(), "op").value, 1);
      EXPECT_EQ(arg(*f.back(), "partial").offset, arg(*f[4], "out").offset);
    }
    EXPECT_EQ(arg(*f[1], "x").offset, arg(*f[0], "x").offset);  // the experts read x2 itself
    EXPECT_EQ(arg(*f[1], "w3_scale").name, "block_sparse_moe.experts.{e}.w3.weight_scale");
    EXPECT_EQ(arg(*f[4], "add").offset, arg(*f[2], "out").offset);
    EXPECT_EQ(arg(*f[4], "w0").name, "block_sparse_moe.shared_experts.down_proj.weight");
    EXPECT_EQ(arg(*f[4], "out").from, tp == 1 ? ProgramArg::From::io : ProgramArg::From::workspace);
  }
}

}  // namespace
}  // namespace dp::plan
