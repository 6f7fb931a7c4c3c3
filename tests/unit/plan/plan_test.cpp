#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <stdexcept>

#include "codegen/kernel.h"
#include "common/fs.h"
#include "common/json.h"
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
  // Classes of the 48B model: kda_dense (layer 0), kda_moe, mla_moe; 8 widths: every program is built.
  ASSERT_EQ(p.programs.size(), 3u * 8);
  for (const LayerProgram& pr : p.programs) EXPECT_EQ(pr.unavailable, "") << to_string(pr.cls) << " w" << pr.width;
  std::set<std::string> keys;
  for (const KernelInstance& k : p.kernels) EXPECT_TRUE(keys.insert(k.target + "/" + k.name).second) << k.name;
  // Every kernel a program launches is built for every target, and nothing else but the final norm
  // and the prefetch kernel is.
  std::set<std::string> used;
  for (const LayerProgram& pr : p.programs)
    for (const ProgramStep& s : pr.steps)
      for (const char* t : {"gfx942", "sm_90a"}) {
        EXPECT_TRUE(keys.count(std::string(t) + "/" + s.name)) << s.name;
        used.insert(std::string(t) + "/" + s.name);
      }
  for (const KernelInstance& k : p.kernels) {
    if (k.role == "layer") {
      EXPECT_TRUE(used.count(k.target + "/" + k.name)) << k.name;
    } else {
      EXPECT_TRUE(k.role == "final_norm" || k.role == "lm_head" || k.role == "prefetch") << k.role;
    }
  }
  EXPECT_TRUE(keys.count("sm_90a/kda_step_w4_q1_nh32_d128_cv4_fr128_gr128_sg0_on0"));
  EXPECT_TRUE(keys.count("gfx942/moe_up_w4_d2304_i1024_e256_k8_s1024_act0"));
  Plan again = make_plan(m, deploy_of(base_deploy()), "deploy.json");
  ASSERT_EQ(again.kernels.size(), p.kernels.size());
  for (size_t i = 0; i < p.kernels.size(); ++i) EXPECT_EQ(again.kernels[i].name, p.kernels[i].name);
}

TEST(Plan, ProgramsFollowTheLayerContract) {
  model::Model m = model::load_model("kimi-linear-48b-a3b");
  Plan p = make_plan(m, deploy_of(base_deploy()), "deploy.json");
  auto find = [&](LayerClass c, int64_t w) -> const LayerProgram& {
    for (const LayerProgram& pr : p.programs)
      if (pr.cls == c && pr.width == w) return pr;
    throw std::runtime_error("no program");
  };
  auto ops = [](const LayerProgram& pr) {
    std::vector<std::string> v;
    for (const ProgramStep& s : pr.steps) v.push_back(s.kernel.op);
    return v;
  };
  // The router gemm runs the routing (TK): no moe_route step.
  EXPECT_EQ(ops(find(LayerClass::kda_moe, 3)),
            (std::vector<std::string>{"rmsnorm", "gemm", "kda_step", "gemm", "rmsnorm", "gemm", "moe_up", "moe_down"}));
  EXPECT_EQ(ops(find(LayerClass::mla_moe, 3)),
            (std::vector<std::string>{"rmsnorm", "gemm", "mla_prep", "mla_attn", "mla_combine", "gemm", "rmsnorm", "gemm",
                                      "moe_up", "moe_down"}));
  EXPECT_EQ(ops(find(LayerClass::kda_dense, 3)),
            (std::vector<std::string>{"rmsnorm", "gemm", "kda_step", "gemm", "rmsnorm", "mlp_up", "gemm"}));
  for (const LayerProgram& pr : p.programs) {
    SCOPED_TRACE(std::string(to_string(pr.cls)) + " w" + std::to_string(pr.width));
    // The layer reads io.hidden first and writes io.out last; workspace offsets stay inside its workspace.
    const ProgramStep& first = pr.steps.front();
    const ProgramStep& last = pr.steps.back();
    auto arg = [](const ProgramStep& s, const std::string& name) -> const ProgramArg& {
      for (const ProgramArg& a : s.args)
        if (a.param == name) return a;
      throw std::runtime_error("no arg " + name);
    };
    EXPECT_EQ(arg(first, "hidden").from, ProgramArg::From::io);
    EXPECT_EQ(arg(first, "hidden").name, "hidden");
    EXPECT_EQ(arg(first, "weight").name, "input_layernorm.weight");
    EXPECT_EQ(arg(last, "out").name, "out");
    for (const ProgramStep& s : pr.steps) {
      EXPECT_EQ(s.args.size(), codegen::kernel_signature(s.kernel).params.size()) << s.name;
      for (const ProgramArg& a : s.args)
        if (a.from == ProgramArg::From::workspace) {
          EXPECT_LT(a.offset, pr.workspace) << s.name << " " << a.param;
          EXPECT_EQ(a.offset % 16, 0u) << s.name << " " << a.param;
        }
    }
    // Every MoE program's router gemm runs the routing (TK) with its own block counter.
    const ProgramStep* router = nullptr;
    for (const ProgramStep& s : pr.steps)
      for (const ProgramArg& a : s.args)
        if (a.from == ProgramArg::From::weight && a.name == "block_sparse_moe.gate.weight") router = &s;
    if (pr.cls == LayerClass::kda_dense || pr.cls == LayerClass::mla_dense) {
      EXPECT_EQ(router, nullptr);
      continue;
    }
    ASSERT_NE(router, nullptr);
    EXPECT_EQ(router->kernel.params.at("TK"), 8);
    EXPECT_EQ(arg(*router, "done").from, ProgramArg::From::workspace);
    EXPECT_EQ(arg(*router, "topk_ids").from, ProgramArg::From::workspace);
    // Counter words (program.h) lie below the scratch of every program of the plan, not only this one's:
    // one workspace serves them all, and a counter must still be zero when its op launches.
    EXPECT_EQ(arg(*router, "done").offset, 0u);
    uint64_t counters = 0;
    for (const LayerProgram& other : p.programs) counters = std::max(counters, other.counter_bytes);
    EXPECT_GE(counters, 256u);
    for (const LayerProgram& other : p.programs)
      for (const ProgramStep& s : other.steps)
        for (const ProgramArg& a : s.args)
          if (a.from == ProgramArg::From::workspace && a.param != "done") {
            EXPECT_GE(a.offset, counters) << to_string(other.cls) << " w" << other.width << " " << s.name << " "
                                          << a.param << " lies on the counter words";
          }
    // moe_down takes the split grid (SK) from 8 rows (q 1 here), one block per tile below.
    for (const ProgramStep& s : pr.steps)
      if (s.kernel.op == "moe_down") {
        EXPECT_EQ(s.kernel.params.count("SK"), pr.width >= 8 ? 1u : 0u) << s.name;
        if (pr.width >= 8) {
          EXPECT_EQ(arg(s, "done").offset, 0u) << s.name;
        }
      }
    // The routed experts are read as one stacked group with its stride (never per expert).
    for (const ProgramStep& s : pr.steps)
      if (s.kernel.op == "moe_up") {
        EXPECT_EQ(arg(s, "w1").name, "block_sparse_moe.experts.{e}.w1.weight");
        EXPECT_EQ(arg(s, "stride_w1").from, ProgramArg::From::expert_stride);
      }
  }
  // The step workspace is the largest program's.
  for (const Workspace& w : p.ranks[0].workspace) {
    uint64_t most = 0;
    for (const LayerProgram& pr : p.programs)
      if (pr.width == w.width) most = std::max(most, pr.workspace);
    EXPECT_EQ(w.bytes, most);
  }
}

TEST(Plan, ProgramsThisVersionCannotBuildSayWhy) {
  model::Model m = model::load_model("kimi-linear-48b-a3b");
  struct Case {
    const char* what;
    Json deploy;
    std::set<std::string> built;  // classes still built
    const char* reason;
  };
  Json spec = base_deploy(), fp8 = base_deploy(), vk = base_deploy();
  spec["num_speculative_tokens"] = 7;  // width 8 x q 8 = 64 rows
  spec.erase("max_num_seqs");
  spec["widths"] = {8};
  fp8["kv_cache"] = {{"dtype", "fp8"}, {"block_size", 64}};
  vk["kda_state"] = {{"dtype", "float32"}, {"layout", "vk"}};
  const std::vector<Case> cases = {
      {"64 rows", spec, {}, "width 8 x q 8 = 64 rows"},
      {"fp8 cache", fp8, {"kda_dense", "kda_moe"}, "kv_cache.dtype fp8"},
      {"vk state", vk, {"mla_moe"}, "kda_state.layout \"vk\""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    Plan p = make_plan(m, deploy_of(c.deploy), "deploy.json");
    for (const LayerProgram& pr : p.programs) {
      const bool built = c.built.count(to_string(pr.cls)) > 0;
      EXPECT_EQ(pr.unavailable.empty(), built) << to_string(pr.cls) << ": " << pr.unavailable;
      EXPECT_EQ(pr.steps.empty(), !built);
      if (!built) {
        EXPECT_NE(pr.unavailable.find(c.reason), std::string::npos) << pr.unavailable;
      }
    }
  }
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

// Tensor parallelism: every rank runs the same program over its shard (shapes divided by the split
// rules), the o-projection and the FFN's down projection write partial sums to scratch, and an
// allreduce step sums them over the ranks before the residual is added (by the next rmsnorm, or by the
// next layer's first one for the layer output).
TEST(Plan, TensorParallelProgramsRunTheRankShardAndAllReduceInsideTheLayer) {
  model::Model m = model::load_model("kimi-linear-48b-a3b");
  auto arg = [](const ProgramStep& s, const std::string& name) -> const ProgramArg& {
    for (const ProgramArg& a : s.args)
      if (a.param == name) return a;
    throw std::runtime_error(s.name + ": no arg " + name);
  };
  auto ops = [](const LayerProgram& pr) {
    std::vector<std::string> v;
    for (const ProgramStep& s : pr.steps) v.push_back(s.kernel.op);
    return v;
  };
  for (int64_t tp : {2, 4, 8}) {
    Json d = base_deploy();
    d["tensor_parallel"] = tp;
    const Plan p = make_plan(m, deploy_of(d), "deploy.json");
    ASSERT_EQ(p.programs.size(), 3u * 8);
    for (const LayerProgram& pr : p.programs) {
      SCOPED_TRACE(fmt::format("tp {} {} w{}", tp, to_string(pr.cls), pr.width));
      ASSERT_EQ(pr.unavailable, "");
      const int64_t rows = pr.width;  // q = 1
      const std::vector<std::string> o = ops(pr);
      if (pr.cls == LayerClass::kda_moe) {
        EXPECT_EQ(o, (std::vector<std::string>{"rmsnorm", "gemm", "kda_step", "gemm", "allreduce", "rmsnorm", "gemm",
                                               "moe_up", "moe_down", "allreduce"}));
      }
      if (pr.cls == LayerClass::mla_moe) {
        EXPECT_EQ(o, (std::vector<std::string>{"rmsnorm", "gemm", "mla_prep", "mla_attn", "mla_combine", "gemm",
                                               "allreduce", "rmsnorm", "gemm", "moe_up", "moe_down", "allreduce"}));
      }
      if (pr.cls == LayerClass::kda_dense) {
        EXPECT_EQ(o, (std::vector<std::string>{"rmsnorm", "gemm", "kda_step", "gemm", "allreduce", "rmsnorm", "mlp_up",
                                               "gemm", "allreduce"}));
      }
      int reductions = 0;
      for (size_t i = 0; i < pr.steps.size(); ++i) {
        const ProgramStep& s = pr.steps[i];
        const auto& k = s.kernel.params;
        // The rank's shard: 32 KDA / MLA heads, MoE intermediate 1024 (shared 1024), dense 9216, all / tp.
        if (s.kernel.op == "kda_step") { EXPECT_EQ(k.at("NH"), 32 / tp); }
        if (s.kernel.op == "mla_prep" || s.kernel.op == "mla_attn" || s.kernel.op == "mla_combine") {
          EXPECT_EQ(k.at("N"), 32 / tp);
        }
        if (s.kernel.op == "moe_up" || s.kernel.op == "moe_down") {
          EXPECT_EQ(k.at("I"), 1024 / tp);
          EXPECT_EQ(k.at("S"), 1024 / tp);
          EXPECT_EQ(k.at("E"), 256);  // every rank holds a slice of every expert
        }
        if (s.kernel.op == "mlp_up") { EXPECT_EQ(k.at("I"), 9216 / tp); }
        if (s.kernel.op == "gemm" && arg(s, "w0").name == "self_attn.q_proj.weight") {
          EXPECT_EQ(k.at("K"), 2304);
          EXPECT_EQ(k.at("NA"), (pr.cls == LayerClass::mla_moe ? 32 * 192 : 32 * 128) / tp);
        }
        if (s.kernel.op == "gemm" && (arg(s, "w0").name == "self_attn.o_proj.weight" ||
                                      arg(s, "w0").name == "mlp.down_proj.weight")) {
          EXPECT_EQ(k.at("NA"), 2304);  // full output rows, from the shard of the input dimension
          EXPECT_EQ(k.at("K"), arg(s, "w0").name == "mlp.down_proj.weight" ? 9216 / tp : 32 * 128 / tp);
        }
        if (s.kernel.op != "allreduce") {
          // No projection writes the layer output itself at TP > 1: only the last allreduce does.
          if (const auto it = std::find_if(s.args.begin(), s.args.end(), [](const ProgramArg& a) { return a.param == "out"; });
              it != s.args.end()) {
            EXPECT_NE(it->from, ProgramArg::From::io) << s.name;
          }
          continue;
        }
        // allreduce: rows x hidden over tp ranks, reading the partial the step before it wrote.
        EXPECT_EQ(k.at("W"), rows);
        EXPECT_EQ(k.at("H"), 2304);
        EXPECT_EQ(k.at("R"), tp);
        ASSERT_GT(i, 0u);
        const ProgramStep& prev = pr.steps[i - 1];
        EXPECT_EQ(arg(prev, "out").from, ProgramArg::From::workspace);
        EXPECT_EQ(arg(s, "partial").from, ProgramArg::From::workspace);
        EXPECT_EQ(arg(s, "partial").offset, arg(prev, "out").offset);
        for (const char* t : {"peers", "flag", "rank", "layer", "timeout_us"}) {
          EXPECT_EQ(arg(s, t).from, ProgramArg::From::tp) << t;
          EXPECT_EQ(arg(s, t).name, t);
        }
        EXPECT_EQ(arg(s, "op").from, ProgramArg::From::u32);
        EXPECT_EQ(arg(s, "op").value, reductions);
        if (reductions == 0) {
          // The mixer's sum feeds the post-attention norm, which adds the residual once.
          ASSERT_LT(i + 1, pr.steps.size());
          const ProgramStep& next = pr.steps[i + 1];
          EXPECT_EQ(next.kernel.op, "rmsnorm");
          EXPECT_EQ(arg(next, "hidden").from, ProgramArg::From::workspace);
          EXPECT_EQ(arg(next, "hidden").offset, arg(s, "out").offset);
          EXPECT_EQ(arg(next, "residual").name, "residual_out");
        } else {
          EXPECT_EQ(i + 1, pr.steps.size());
          EXPECT_EQ(arg(s, "out").from, ProgramArg::From::io);
          EXPECT_EQ(arg(s, "out").name, "out");
        }
        ++reductions;
      }
      EXPECT_EQ(reductions, 2);
      // Only the norms touch the residual stream: one rank's worth, added after the reductions.
      for (const ProgramStep& s : pr.steps)
        for (const ProgramArg& a : s.args)
          if (a.from == ProgramArg::From::io && (a.name == "residual" || a.name == "residual_out")) {
            EXPECT_EQ(s.kernel.op, "rmsnorm") << s.name;
          }
    }
  }
  // At tensor_parallel 1 nothing changes: no allreduce, no tp source.
  const Plan one = make_plan(m, deploy_of(base_deploy()), "deploy.json");
  for (const LayerProgram& pr : one.programs)
    for (const ProgramStep& s : pr.steps) {
      EXPECT_NE(s.kernel.op, "allreduce");
      for (const ProgramArg& a : s.args) EXPECT_NE(a.from, ProgramArg::From::tp) << s.name;
    }
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

TEST(Plan, PrefetchTablesFollowTheDeployDefaults) {
  model::Model m = model::load_model("kimi-linear-48b-a3b");
  // TP 1: none (measured not to pay on the H200).
  EXPECT_TRUE(make_plan(m, deploy_of(base_deploy()), "deploy.json").ranks[0].prefetch.empty());
  // TP 2: the K3 module's points, without attention_oproj.
  Json d = base_deploy();
  d["tensor_parallel"] = 2;
  std::set<std::string> points;
  const Plan p = make_plan(m, deploy_of(d), "deploy.json");
  for (const PrefetchTable& t : p.ranks[0].prefetch) points.insert(t.point);
  EXPECT_EQ(points, (std::set<std::string>{"oproj_down", "next_attention"}));  // attention_moe: TP 8 only
}

TEST(Plan, PrefetchTablesFollowTheWidthRules) {
  model::Model m = model::load_model("kimi-linear-48b-a3b");
  Json d = base_deploy();
  d["prefetch"] = {{"points", {"oproj_down", "attention_moe", "next_attention", "attention_oproj"}}};
  Plan p = make_plan(m, deploy_of(d), "deploy.json");
  int oproj = 0, next = 0, attention_oproj = 0;
  for (const PrefetchTable& t : p.ranks[0].prefetch) {
    if (t.point == "attention_oproj") {
      ++attention_oproj;
      EXPECT_TRUE(t.critical);
      EXPECT_EQ(t.widths, (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8}));
      ASSERT_EQ(t.ranges.size(), 1u);
      EXPECT_EQ(t.ranges[0].name, fmt::format("model.layers.{}.self_attn.o_proj.weight", t.layer));
      EXPECT_EQ(t.bytes(), 4096u * 2304 * 2);  // the whole o-projection: under the 24 MiB cap
    }
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
  EXPECT_EQ(attention_oproj, 27);  // every layer, dense or MoE
}

TEST(Plan, DeployThatDoesNotFitTheModelIsRefused) {
  model::Model m = model::load_model("kimi-linear-tiny");  // 2 KDA heads
  Json d = base_deploy();
  d["tensor_parallel"] = 4;
  test::expect_error([&] { make_plan(m, deploy_of(d), "deploy.json"); }, Errc::input,
                     {"deploy.json", "tensor_parallel 4", "2"});
}

// Block attention residuals in the layer skeleton, on the tiny Kimi-Linear shapes with
// attn_res_block_size 2 (4 layers: layers 0 and 2 push, 2 blocks), so that the programs are built
// whatever this version's K3 mixers do: attnres replaces both rmsnorms, bound to the step's attn_res
// buffer, the layer source and the half's own *_res weights; only layer 0's program binds no residual
// differently (it is the same program for every layer of the class). The final norm is attnres stage 2.
TEST(Plan, AttentionResidualsOpenBothHalvesOfTheLayer) {
  Json cfg = parse_json(read_text_file(test::data_dir().parent_path() / "manifests/presets/kimi-linear-tiny.json"),
                        "kimi-linear-tiny.json");
  cfg["attn_res_block_size"] = 2;
  const model::Model m = model::model_from_config(cfg, "config.json");
  ASSERT_EQ(m.attn_res_block, 2);
  Json dj = base_deploy();
  dj["max_num_seqs"] = 2;
  Plan p = make_plan(m, deploy_of(dj), "deploy.json");
  auto arg = [](const ProgramStep& s, const std::string& name) -> const ProgramArg& {
    for (const ProgramArg& a : s.args)
      if (a.param == name) return a;
    throw std::runtime_error("no arg " + name);
  };
  ASSERT_FALSE(p.programs.empty());
  for (const LayerProgram& pr : p.programs) {
    SCOPED_TRACE(std::string(to_string(pr.cls)) + " w" + std::to_string(pr.width));
    ASSERT_TRUE(pr.unavailable.empty()) << pr.unavailable;
    std::vector<const ProgramStep*> mixes;
    for (const ProgramStep& s : pr.steps) {
      EXPECT_NE(s.kernel.op, "rmsnorm");
      if (s.kernel.op == "attnres") mixes.push_back(&s);
    }
    ASSERT_EQ(mixes.size(), 2u);
    EXPECT_EQ(mixes[0], &pr.steps.front());  // the layer opens with the first mix
    const char* res[2] = {"self_attention", "mlp"};
    const char* norm[2] = {"input_layernorm.weight", "post_attention_layernorm.weight"};
    for (int s = 0; s < 2; ++s) {
      const ProgramStep& st = *mixes[static_cast<size_t>(s)];
      EXPECT_EQ(st.kernel.params.at("S"), s);
      EXPECT_EQ(st.kernel.params.at("B"), 2);
      EXPECT_EQ(st.kernel.params.at("NB"), 2);
      EXPECT_EQ(st.kernel.params.at("W"), pr.width);
      EXPECT_EQ(st.name, fmt::format("attnres_w{}_h256_b2_n2_s{}", pr.width, s));
      EXPECT_EQ(arg(st, "blocks").from, ProgramArg::From::kv);
      EXPECT_EQ(arg(st, "blocks").name, "attn_res");
      EXPECT_EQ(arg(st, "stride_blocks").from, ProgramArg::From::kv_stride);
      EXPECT_EQ(arg(st, "layer").from, ProgramArg::From::layer);
      EXPECT_EQ(arg(st, "res_norm").name, std::string(res[s]) + "_res_norm.weight");
      EXPECT_EQ(arg(st, "res_proj").name, std::string(res[s]) + "_res_proj.weight");
      EXPECT_EQ(arg(st, "weight").name, norm[s]);
      EXPECT_EQ(arg(st, "residual_out").name, "residual_out");  // p travels as the residual
    }
    EXPECT_EQ(arg(*mixes[0], "residual").name, "residual");
    EXPECT_EQ(arg(*mixes[1], "residual").name, "residual_out");
  }
  int finals = 0;
  for (const KernelInstance& k : p.kernels)
    if (k.role == "final_norm") {
      ++finals;
      EXPECT_EQ(k.op, "attnres");
      EXPECT_EQ(k.codegen.params.at("S"), 2);
    }
  EXPECT_EQ(finals, 4);  // widths 1, 2 x targets sm_90a, gfx942

  // The same model without attention residuals keeps its rmsnorm programs, kernel for kernel.
  Json plain = cfg;
  plain.erase("attn_res_block_size");
  Plan q = make_plan(model::model_from_config(plain, "config.json"), deploy_of(dj), "deploy.json");
  Plan r = make_plan(model::load_model("kimi-linear-tiny"), deploy_of(dj), "deploy.json");
  ASSERT_EQ(q.kernels.size(), r.kernels.size());
  for (size_t i = 0; i < q.kernels.size(); ++i) EXPECT_EQ(q.kernels[i].name, r.kernels[i].name);
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
  // Every K3 class has a program (k3_program_test.cpp has the rest), without weights.
  ASSERT_FALSE(p.programs.empty());
  for (const LayerProgram& pr : p.programs) EXPECT_EQ(pr.unavailable, "") << to_string(pr.cls) << " w" << pr.width;
}

// The LM head (format 1.5): one fp32-output GEMM per (target, width) over the rank's vocabulary shard,
// none where the rows exceed one GEMM launch or tensor_parallel does not divide the vocabulary.
TEST(Plan, LmHeadIsOneGemmPerWidthOverTheVocabularyShard) {
  model::Model m = model::load_model("kimi-linear-48b-a3b");
  Json d = base_deploy();
  d["tensor_parallel"] = 2;
  Plan p = make_plan(m, deploy_of(d), "deploy.json");
  std::set<std::pair<std::string, int64_t>> seen;
  for (const KernelInstance& k : p.kernels) {
    if (k.role != "lm_head") continue;
    EXPECT_EQ(k.op, "gemm");
    EXPECT_EQ(k.param("w"), k.width);
    EXPECT_EQ(k.param("k"), m.hidden);
    EXPECT_EQ(k.param("na"), m.vocab / 2);
    EXPECT_EQ(k.param("nb"), 0);
    EXPECT_EQ(k.param("f"), 1);
    EXPECT_TRUE(seen.insert({k.target, k.width}).second) << k.name;
  }
  EXPECT_EQ(seen.size(), 2u * 8);  // 2 targets x widths 1..8
  EXPECT_TRUE(seen.count({"sm_90a", 8}));

  // q = 2 (one speculative token): 2 rows per request, so widths 17.. exceed the 32 rows of one GEMM.
  Json wide = base_deploy();
  wide["max_num_seqs"] = 20;
  wide["num_speculative_tokens"] = 1;
  const deploy::Deploy dw = deploy_of(wide);
  Plan q = make_plan(m, dw, "deploy.json");
  std::set<int64_t> widths;
  for (const KernelInstance& k : q.kernels)
    if (k.role == "lm_head") {
      widths.insert(k.width);
      EXPECT_EQ(k.param("w"), 2 * k.width) << k.name;
    }
  EXPECT_EQ(widths.size(), 16u);
  EXPECT_FALSE(widths.count(17));
  EXPECT_EQ(lm_head_kernel_gap(m, dw, 17), "width 17 x q 2 = 34 rows, the GEMM takes at most 32");
  EXPECT_EQ(lm_head_kernel_gap(m, dw, 16), "");

  // A vocabulary beyond the GEMM's 2^20 rows gives no LM head, and still a plan.
  model::Model big = model::load_model("kimi-linear-tiny");
  big.vocab = int64_t{1} << 21;
  const deploy::Deploy d1 = deploy_of(base_deploy());
  EXPECT_EQ(lm_head_kernel_gap(big, d1, 1), "a vocabulary shard of 2097152 rows or hidden size 256, the GEMM takes at "
                                            "most 2^20 of each");
  Plan pb = make_plan(big, d1, "deploy.json");
  for (const KernelInstance& k : pb.kernels) EXPECT_NE(k.role, "lm_head") << k.name;
}

// The sparse-attention indexer's prefill ops: six width-independent kernels per target for a model whose
// indexer the templates take (head dim 128, heads a multiple of 8 up to 64, top-k 1..4096), none otherwise.
TEST(Plan, ReportsTheIndexer) {
  model::Model m = model::load_model("kimi-k3-tiny-indexer");
  const deploy::Deploy d = deploy_of(base_deploy());
  const Plan p = make_plan(m, d, "deploy.json");
  const Json j = to_json(p, m, d);
  ASSERT_TRUE(j.contains("indexer"));
  // 2^30 + 68 * (max_keys + ceil(max_keys / 64) * 64) at world 1, with the deploy's limits.
  const int64_t keys = d.indexer.max_keys_per_chunk, padded = (keys + 63) / 64 * 64;
  ASSERT_EQ(d.dcp.size, 1);
  EXPECT_EQ(j["indexer"]["prefill_workspace_bytes"].get<uint64_t>(), (uint64_t{1} << 30) + 68 * uint64_t(keys + padded));
  EXPECT_EQ(j["indexer"]["heads"], 8);
  EXPECT_EQ(j["indexer"]["top_k"], 2048);
  EXPECT_EQ(j["indexer"]["kernels"], true);
  EXPECT_NE(to_text(p, m, d).find("indexer   8 heads x 128, top-k 2048; prefill chunk scratch"), std::string::npos);

  m.indexer.num_heads = 72;  // beyond what idx_score takes: planned without kernels, and the text says why
  const Plan q = make_plan(m, d, "deploy.json");
  EXPECT_EQ(to_json(q, m, d)["indexer"]["kernels"], false);
  EXPECT_NE(to_text(q, m, d).find("no prefill kernels: index_n_heads 72"), std::string::npos) << to_text(q, m, d);

  const model::Model plain = model::load_model("kimi-linear-tiny");
  const Plan r = make_plan(plain, d, "deploy.json");
  EXPECT_FALSE(to_json(r, plain, d).contains("indexer"));
  EXPECT_EQ(to_text(r, plain, d).find("indexer "), std::string::npos);
}

TEST(Plan, IndexerKernelsArePlannedPerTargetForAModelWithAnIndexer) {
  model::Model m = model::load_model("kimi-k3-tiny-indexer");  // 8 index heads, head dim 128, top-k 2048
  ASSERT_TRUE(m.indexer.present());
  EXPECT_EQ(indexer_kernel_gap(m), "");
  EXPECT_TRUE(indexer_kernels_supported(m));
  Plan p = make_plan(m, deploy_of(base_deploy()), "deploy.json");
  const std::set<std::string> want = {"idx_pack", "idx_quant", "idx_rows", "idx_score_nh8", "idx_stage",
                                      "idx_topk_k2048"};
  for (const char* t : {"gfx942", "sm_90a"}) {
    SCOPED_TRACE(t);
    std::set<std::string> got;
    size_t count = 0;
    for (const KernelInstance& k : p.kernels) {
      if (k.target != t || k.role != "indexer") continue;
      ++count;
      got.insert(k.name);
      EXPECT_EQ(k.width, 0) << k.name;
      EXPECT_EQ(k.codegen.target, t) << k.name;
      EXPECT_EQ(codegen::kernel_name(k.codegen), k.name);
    }
    EXPECT_EQ(count, 6u);
    EXPECT_EQ(got, want);
  }
  // The instances themselves carry the model's numbers.
  const std::vector<codegen::KernelInstance> inst = indexer_kernel_instances(m);
  ASSERT_EQ(inst.size(), 6u);
  std::set<std::string> names;
  for (codegen::KernelInstance k : inst) {
    k.target = "sm_90a";
    names.insert(codegen::kernel_name(k));
  }
  EXPECT_EQ(names, want);
  // The indexer adds exactly these 12 (6 per target); every other kernel is also planned for the same
  // model without its indexer (which plans more: its MLA layers, dense without an indexer, have programs).
  model::Model plain = m;
  plain.indexer = {};
  Plan q = make_plan(plain, deploy_of(base_deploy()), "deploy.json");
  std::set<std::string> plain_names;
  for (const KernelInstance& k : q.kernels) {
    EXPECT_NE(k.role, "indexer") << k.name;
    plain_names.insert(k.name + "." + k.target);
  }
  size_t indexer = 0;
  for (const KernelInstance& k : p.kernels) {
    if (k.role == "indexer") ++indexer;
    else EXPECT_TRUE(plain_names.count(k.name + "." + k.target)) << k.name;
  }
  EXPECT_EQ(indexer, 12u);
}

TEST(Plan, NoIndexerKernelsWithoutAnIndexer) {
  for (const char* preset : {"kimi-linear-tiny", "kimi-k3-tiny"}) {
    SCOPED_TRACE(preset);
    model::Model m = model::load_model(preset);
    EXPECT_FALSE(m.indexer.present());
    EXPECT_EQ(indexer_kernel_gap(m), "the model has no indexer");
    EXPECT_FALSE(indexer_kernels_supported(m));
    Plan p = make_plan(m, deploy_of(base_deploy()), "deploy.json");
    for (const KernelInstance& k : p.kernels) {
      EXPECT_NE(k.role, "indexer") << k.name;
      EXPECT_NE(k.op.rfind("idx_", 0), 0u) << k.name;
    }
  }
}

TEST(Plan, IndexerConfigsTheTemplatesCannotBuildSayWhyAndPlanNoIndexerKernels) {
  const model::Model base = model::load_model("kimi-k3-tiny-indexer");
  struct Case {
    int64_t heads, head_dim, top_k;
    std::vector<std::string> fragments;
  };
  const Case cases[] = {
      {72, 128, 2048, {"index_n_heads 72", "multiple of 8 up to 64"}},
      {12, 128, 2048, {"index_n_heads 12", "multiple of 8"}},
      {4, 128, 2048, {"index_n_heads 4"}},
      {8, 64, 2048, {"index_head_dim 64", "128"}},
      {8, 128, 4097, {"index_topk 4097", "1..4096"}},
      {8, 128, 0, {"index_topk 0"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << c.heads << " heads, dim " << c.head_dim << ", top-k " << c.top_k);
    model::Model m = base;
    m.indexer.num_heads = c.heads;
    m.indexer.head_dim = c.head_dim;
    m.indexer.top_k = c.top_k;
    const std::string gap = indexer_kernel_gap(m);
    for (const std::string& f : c.fragments) EXPECT_NE(gap.find(f), std::string::npos) << gap;
    EXPECT_FALSE(indexer_kernels_supported(m));
    Plan p = make_plan(m, deploy_of(base_deploy()), "deploy.json");
    for (const KernelInstance& k : p.kernels) EXPECT_NE(k.role, "indexer") << k.name;
  }
  // The limits themselves are supported.
  for (auto [heads, top_k] : {std::pair<int64_t, int64_t>{64, 4096}, {8, 1}, {16, 2048}}) {
    model::Model m = base;
    m.indexer.num_heads = heads;
    m.indexer.top_k = top_k;
    EXPECT_EQ(indexer_kernel_gap(m), "") << heads << " " << top_k;
  }
}

}  // namespace
}  // namespace dp::plan
