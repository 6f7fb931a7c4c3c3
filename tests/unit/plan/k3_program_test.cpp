// Kimi-K3 layer programs: the full-rank safe-gate KDA, the q-LoRA MLA with its output gate and the dense
// SiTU FFN, at tensor_parallel 1 and 8; and the K3 parts that have no program yet say why.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <set>
#include <stdexcept>

#include "codegen/kernel.h"
#include "common/embedded.h"
#include "common/json.h"
#include "deploy/deploy.h"
#include "model/ir.h"
#include "plan/plan.h"

namespace dp::plan {
namespace {

// The K3 preset (hidden 7168, 96 KDA and 96 MLA heads, q_lora_rank 1536) with only what the mixers need:
// every FFN dense, no block attention residuals, bf16 (no quantization_config).
Json k3_mixers_config(const char* preset = "presets/kimi-k3.json") {
  Json c = parse_json(*embedded_file(preset), "preset");
  c.erase("quantization_config");
  Json& t = c["text_config"];
  t["first_k_dense_replace"] = t["num_hidden_layers"];
  t["attn_res_block_size"] = 0;
  return c;
}

Plan plan_of(const model::Model& m, int64_t tp, int64_t spec) {
  Json d = {{"targets", {"sm_90a", "gfx942"}}, {"tensor_parallel", tp}, {"max_num_seqs", 8},
            {"num_speculative_tokens", spec}, {"kv_cache", {{"dtype", "bf16"}, {"block_size", 64}}}};
  if (tp > 1) d["ranks"] = {0};
  return make_plan(m, deploy::parse_deploy(d, "deploy.json"), "deploy.json");
}

const ProgramArg& arg(const ProgramStep& s, const std::string& name) {
  for (const ProgramArg& a : s.args)
    if (a.param == name) return a;
  throw std::runtime_error(s.name + ": no arg " + name);
}
std::vector<std::string> ops(const LayerProgram& pr) {
  std::vector<std::string> v;
  for (const ProgramStep& s : pr.steps) v.push_back(s.kernel.op);
  return v;
}
// The steps of `op` in program order.
std::vector<const ProgramStep*> steps_of(const LayerProgram& pr, const std::string& op) {
  std::vector<const ProgramStep*> v;
  for (const ProgramStep& s : pr.steps)
    if (s.kernel.op == op) v.push_back(&s);
  return v;
}

TEST(K3Programs, MixersAndDenseLayersAtEveryWidthQAndTensorParallel) {
  const model::Model m = model::model_from_config(k3_mixers_config(), "config.json");
  const int64_t H = 7168;
  for (int64_t tp : {1, 8})
    for (int64_t spec : {0, 1}) {
      const Plan p = plan_of(m, tp, spec);
      const int64_t q = 1 + spec, NH = 96 / tp, N = 96 / tp, P = NH * 128;
      // kda_dense and mla_dense at widths 1..8.
      ASSERT_EQ(p.programs.size(), 2u * 8);
      for (const LayerProgram& pr : p.programs) {
        SCOPED_TRACE(fmt::format("tp {} q {} {} w{}", tp, q, to_string(pr.cls), pr.width));
        ASSERT_EQ(pr.unavailable, "");
        const int64_t T = pr.width * q;
        const std::vector<std::string> reduce = tp > 1 ? std::vector<std::string>{"allreduce"} : std::vector<std::string>{};
        std::vector<std::string> want;
        if (pr.cls == LayerClass::kda_dense) {
          want = {"rmsnorm", "gemm", "kda_step", "gemm"};
        } else {
          ASSERT_EQ(pr.cls, LayerClass::mla_dense);
          want = {"rmsnorm", "gemm", "rmsnorm", "gemm", "mla_prep", "mla_attn", "mla_combine", "gemm"};
        }
        want.insert(want.end(), reduce.begin(), reduce.end());
        for (const char* o : {"rmsnorm", "mlp_up", "gemm"}) want.push_back(o);
        want.insert(want.end(), reduce.begin(), reduce.end());
        EXPECT_EQ(ops(pr), want);
        for (const ProgramStep& s : pr.steps) {
          EXPECT_EQ(s.args.size(), codegen::kernel_signature(s.kernel).params.size()) << s.name;
          for (const ProgramArg& a : s.args)
            if (a.from == ProgramArg::From::workspace) {
              EXPECT_LT(a.offset, pr.workspace) << s.name << " " << a.param;
              EXPECT_EQ(a.offset % 16, 0u) << s.name << " " << a.param;
            }
        }

        // Dense FFN: SiTU gate/up over the rank's slice of the 33792 features.
        const ProgramStep& up = *steps_of(pr, "mlp_up").at(0);
        EXPECT_EQ(up.kernel.params.at("ACT"), 1);
        EXPECT_EQ(up.kernel.params.at("I"), 33792 / tp);
        EXPECT_EQ(arg(up, "act_beta").value, 4.0);
        EXPECT_EQ(arg(up, "act_linear_beta").value, 25.0);

        const std::vector<const ProgramStep*> gemms = steps_of(pr, "gemm");
        if (pr.cls == LayerClass::kda_dense) {
          // One gemm: q | k | v | f_a | g_proj (P columns, the full-rank gate) | b.
          const ProgramStep& in = *gemms.at(0);
          EXPECT_EQ(in.kernel.params.at("K"), H);
          EXPECT_EQ(in.kernel.params.at("NE"), P);
          EXPECT_EQ(arg(in, "w4").name, "self_attn.g_proj.weight");
          EXPECT_EQ(in.kernel.params.at("NF"), NH);
          const ProgramStep& k = *steps_of(pr, "kda_step").at(0);
          EXPECT_EQ(k.kernel.params.at("NH"), NH);
          EXPECT_EQ(k.kernel.params.at("GR"), 0);
          EXPECT_EQ(k.kernel.params.at("SG"), 1);
          EXPECT_EQ(k.kernel.params.at("ON"), 1);
          EXPECT_EQ(k.kernel.params.at("Q"), q);
          EXPECT_EQ(arg(k, "w_gb").from, ProgramArg::From::null);
          EXPECT_EQ(arg(k, "lower_bound").value, -5.0);
          EXPECT_EQ(arg(k, "a_log").name, "self_attn.A_log");
          EXPECT_EQ(arg(k, "conv_wq").name, "self_attn.q_conv1d.weight");
          EXPECT_EQ(arg(k, "proj").offset, arg(in, "out").offset);
          // The whole A_log on every rank: at TP > 1 the kernel offsets it by rank*NH (AR, tp "rank").
          if (tp > 1) {
            EXPECT_EQ(k.kernel.params.at("AR"), 1);
            EXPECT_EQ(arg(k, "rank").from, ProgramArg::From::tp);
            EXPECT_EQ(arg(k, "rank").name, "rank");
            EXPECT_NE(k.name.find("_ar1"), std::string::npos) << k.name;
          } else {
            EXPECT_EQ(k.kernel.params.count("AR"), 0u);
            EXPECT_EQ(k.name, fmt::format("kda_step_w{}_q{}_nh96_d128_cv4_fr128_gr0_sg1_on1", pr.width, q));
          }
          EXPECT_EQ(arg(*gemms.at(1), "w0").name, "self_attn.o_proj.weight");
          EXPECT_EQ(gemms.at(1)->kernel.params.at("K"), P);
        } else {
          // [q_a 1536 | kv_a 576 | g N*128] over x, q_a_layernorm over the q_a columns of those rows, q_b.
          const int64_t row = 1536 + 576 + N * 128, QW = N * 192;
          const ProgramStep& in = *gemms.at(0);
          EXPECT_EQ(in.kernel.params.at("K"), H);
          EXPECT_EQ(in.kernel.params.at("NA"), 1536);
          EXPECT_EQ(in.kernel.params.at("NB"), 576);
          EXPECT_EQ(in.kernel.params.at("NC"), N * 128);
          EXPECT_EQ(in.kernel.params.at("ND"), 0);
          EXPECT_EQ(arg(in, "w0").name, "self_attn.q_a_proj.weight");
          EXPECT_EQ(arg(in, "w1").name, "self_attn.kv_a_proj_with_mqa.weight");
          EXPECT_EQ(arg(in, "w2").name, "self_attn.g_proj.weight");
          const uint64_t qkv = arg(in, "out").offset;
          const ProgramStep& norm = pr.steps.at(2);
          EXPECT_EQ(norm.kernel.params.at("W"), T);
          EXPECT_EQ(norm.kernel.params.at("H"), 1536);
          EXPECT_EQ(norm.kernel.params.at("S"), row);
          EXPECT_EQ(norm.name, fmt::format("rmsnorm_w{}_h1536_s{}", T, row));
          EXPECT_EQ(arg(norm, "hidden").offset, qkv);
          EXPECT_EQ(arg(norm, "residual").from, ProgramArg::From::null);
          EXPECT_EQ(arg(norm, "weight").name, "self_attn.q_a_layernorm.weight");
          EXPECT_EQ(arg(norm, "residual_out").from, ProgramArg::From::workspace);
          EXPECT_EQ(arg(norm, "eps").value, m.rms_norm_eps);
          const ProgramStep& qb = pr.steps.at(3);
          EXPECT_EQ(arg(qb, "w0").name, "self_attn.q_b_proj.weight");
          EXPECT_EQ(qb.kernel.params.at("K"), 1536);
          EXPECT_EQ(qb.kernel.params.at("NA"), QW);
          EXPECT_EQ(arg(qb, "x").offset, arg(norm, "out").offset);
          const ProgramStep& prep = *steps_of(pr, "mla_prep").at(0);
          EXPECT_EQ(arg(prep, "q").offset, arg(qb, "out").offset);
          EXPECT_EQ(arg(prep, "stride_q").value, QW);
          EXPECT_EQ(arg(prep, "kv").offset, qkv + 1536 * 2);
          EXPECT_EQ(arg(prep, "stride_kv").value, row);
          const ProgramStep& comb = *steps_of(pr, "mla_combine").at(0);
          EXPECT_EQ(comb.kernel.params.at("OG"), 1);
          EXPECT_EQ(comb.kernel.params.at("N"), N);
          EXPECT_EQ(arg(comb, "gate").from, ProgramArg::From::workspace);
          EXPECT_EQ(arg(comb, "gate").offset, qkv + (1536 + 576) * 2);
          EXPECT_EQ(arg(comb, "stride_g").value, row);
          const ProgramStep& o = *gemms.at(2);
          EXPECT_EQ(arg(o, "w0").name, "self_attn.o_proj.weight");
          EXPECT_EQ(o.kernel.params.at("K"), N * 128);
          EXPECT_EQ(arg(o, "x").offset, arg(comb, "out").offset);
        }
        // No tensor-parallel source at TP 1.
        if (tp == 1) {
          for (const ProgramStep& s : pr.steps)
            for (const ProgramArg& a : s.args) EXPECT_NE(a.from, ProgramArg::From::tp) << s.name;
        }
      }
    }
}

// At tensor_parallel 8 every rank holds an equal shard: q_a, kv_a and their norms whole, q_b, g_proj and kv_b
// by heads, o_proj by its input; KDA's A_log (128 entries for 96 heads) whole.
TEST(K3Programs, TensorParallel8ShardsAreEqual) {
  const model::Model m = model::model_from_config(k3_mixers_config(), "config.json");
  Json d = {{"targets", {"sm_90a"}}, {"tensor_parallel", 8}, {"max_num_seqs", 2},
            {"num_speculative_tokens", 0}, {"kv_cache", {{"dtype", "bf16"}, {"block_size", 64}}}};
  const Plan p = make_plan(m, deploy::parse_deploy(d, "deploy.json"), "deploy.json");
  ASSERT_EQ(p.ranks.size(), 8u);
  struct Want {
    int dim;
    std::vector<int64_t> shape;
  };
  const std::string mla = "language_model.model.layers.3.self_attn.", kda = "language_model.model.layers.0.self_attn.";
  const std::vector<std::pair<std::string, Want>> wants = {
      {mla + "q_a_proj.weight", {-1, {1536, 7168}}},
      {mla + "q_a_layernorm.weight", {-1, {1536}}},
      {mla + "q_b_proj.weight", {0, {2304, 1536}}},
      {mla + "kv_a_proj_with_mqa.weight", {-1, {576, 7168}}},
      {mla + "kv_b_proj.weight", {0, {3072, 512}}},
      {mla + "g_proj.weight", {0, {1536, 7168}}},
      {mla + "o_proj.weight", {1, {7168, 1536}}},
      {kda + "g_proj.weight", {0, {1536, 7168}}},
      {kda + "q_conv1d.weight", {0, {1536, 1, 4}}},
      {kda + "b_proj.weight", {0, {12, 7168}}},
      {kda + "A_log", {-1, {128}}},
      {kda + "o_proj.weight", {1, {7168, 1536}}},
  };
  for (const RankPlan& r : p.ranks)
    for (const auto& [name, w] : wants) {
      SCOPED_TRACE(fmt::format("rank {} {}", r.rank, name));
      const WeightShard* s = nullptr;
      for (const WeightShard& x : r.shards)
        if (x.name == name) s = &x;
      ASSERT_NE(s, nullptr);
      EXPECT_EQ(s->split_dim, w.dim);
      EXPECT_EQ(s->shape, w.shape);
      if (w.dim >= 0) {
        const int64_t n = w.shape[static_cast<size_t>(w.dim)];
        EXPECT_EQ(s->begin, n * r.rank);
        EXPECT_EQ(s->end, n * (r.rank + 1));
      }
    }
}

// The tiny K3 config builds the same program shapes (2 heads: TP 1 and 2).
TEST(K3Programs, TinyK3MixersBuildAtTp1And2) {
  const model::Model m = model::model_from_config(k3_mixers_config("presets/kimi-k3-tiny.json"), "config.json");
  for (int64_t tp : {1, 2}) {
    const Plan p = plan_of(m, tp, 1);
    ASSERT_EQ(p.programs.size(), 2u * 8);
    for (const LayerProgram& pr : p.programs) {
      SCOPED_TRACE(fmt::format("tp {} {} w{}", tp, to_string(pr.cls), pr.width));
      EXPECT_EQ(pr.unavailable, "");
      if (pr.cls == LayerClass::mla_dense) {
        EXPECT_EQ(pr.steps.at(2).kernel.params.at("S"), 128 + 576 + 2 * 128 / tp);
      }
    }
  }
}

// Every K3 layer class has a program at TP 8, with the block attention residuals (the real preset) and
// without them.
TEST(K3Programs, EveryClassHasAProgramWithAndWithoutAttentionResiduals) {
  {
    const model::Model m = model::load_model("kimi-k3");
    const Plan p = plan_of(m, 8, 0);
    ASSERT_FALSE(p.programs.empty());
    for (const LayerProgram& pr : p.programs) {
      EXPECT_EQ(pr.unavailable, "") << to_string(pr.cls) << " w" << pr.width;
      ASSERT_FALSE(pr.steps.empty());
      EXPECT_EQ(pr.steps.front().kernel.op, "attnres");  // the residual mix opens the layer
    }
  }
  Json c = parse_json(*embedded_file("presets/kimi-k3.json"), "preset");
  c["text_config"]["attn_res_block_size"] = 0;
  const model::Model m = model::model_from_config(c, "config.json");
  const Plan p = plan_of(m, 8, 0);
  std::set<std::string> built;
  for (const LayerProgram& pr : p.programs) {
    EXPECT_EQ(pr.unavailable, "") << to_string(pr.cls) << " w" << pr.width;
    EXPECT_EQ(pr.steps.front().kernel.op, "rmsnorm");
    built.insert(to_string(pr.cls));
  }
  EXPECT_EQ(built, (std::set<std::string>{"kda_dense", "kda_lmoe", "mla_lmoe"}));
}

}  // namespace
}  // namespace dp::plan
