#include "plan/plan.h"

#include <algorithm>
#include <map>
#include <set>

#include "codegen/ops/spec.h"
#include "common/error.h"
#include "model/quant.h"
#include "indexer/workspace.h"

namespace dp::plan {

using model::Ffn;
using model::Mixer;
using model::Model;
using model::WeightSpec;

const char* to_string(LayerClass c) {
  switch (c) {
    case LayerClass::kda_dense: return "kda_dense";
    case LayerClass::kda_moe: return "kda_moe";
    case LayerClass::kda_latent_moe: return "kda_lmoe";
    case LayerClass::mla_dense: return "mla_dense";
    case LayerClass::mla_moe: return "mla_moe";
    case LayerClass::mla_latent_moe: return "mla_lmoe";
    case LayerClass::final_norm: return "final_norm";
  }
  return "?";
}

LayerClass layer_class(const model::LayerSpec& l) {
  const bool kda = l.mixer == Mixer::kda;
  switch (l.ffn) {
    case Ffn::dense: return kda ? LayerClass::kda_dense : LayerClass::mla_dense;
    case Ffn::moe: return kda ? LayerClass::kda_moe : LayerClass::mla_moe;
    case Ffn::latent_moe: return kda ? LayerClass::kda_latent_moe : LayerClass::mla_latent_moe;
  }
  return LayerClass::kda_dense;
}

int64_t KernelInstance::param(std::string_view key) const {
  for (const auto& [k, v] : params)
    if (k == key) return v;
  return -1;
}

uint64_t PrefetchTable::bytes() const {
  uint64_t b = 0;
  for (const PrefetchRange& r : ranges) b += r.bytes;
  return b;
}

namespace {

constexpr uint64_t align256(uint64_t x) { return (x + 255) / 256 * 256; }

WeightShard shard_of(const Model& m, size_t index, int64_t tp, int64_t rank) {
  const WeightSpec& w = m.weights[index];
  WeightShard s;
  s.weight = index;
  s.name = w.name;
  s.shape = w.shape;
  if (w.split.kind == model::Split::Kind::dim) {
    s.split_dim = w.split.dim;
    const int64_t n = w.shape[static_cast<size_t>(w.split.dim)];
    s.begin = n / tp * rank;
    s.end = s.begin + n / tp;
    s.shape[static_cast<size_t>(w.split.dim)] = n / tp;
  } else {
    s.begin = 0;
    s.end = w.shape.empty() ? 1 : w.shape[0];
  }
  uint64_t numel = 1;
  for (int64_t x : s.shape) numel *= static_cast<uint64_t>(x);
  s.bytes = numel * dtype_size(w.dtype);
  return s;
}

// Per-layer facts a rank needs repeatedly.
struct LayerCost {
  uint64_t dense_weights = 0;  // every non-expert weight of the layer the decode kernels read
  uint64_t expert_bytes = 0;   // one routed expert's shard (all of its tensors)
};

// The next layer's attention weights in the order its kernels read them.
std::vector<size_t> attention_weights(const Model& m, const model::LayerSpec& l) {
  static const std::vector<std::string> kda = {
      "self_attn.q_proj.weight",  "self_attn.k_proj.weight",   "self_attn.v_proj.weight",
      "self_attn.g_proj.weight",  "self_attn.g_a_proj.weight", "self_attn.f_a_proj.weight",
      "self_attn.b_proj.weight",  "self_attn.f_b_proj.weight", "self_attn.g_b_proj.weight",
      "self_attn.o_proj.weight"};
  static const std::vector<std::string> mla = {
      "self_attn.q_proj.weight",    "self_attn.q_a_proj.weight",  "self_attn.kv_a_proj_with_mqa.weight",
      "self_attn.q_b_proj.weight",  "self_attn.g_proj.weight",    "self_attn.kv_b_proj.weight",
      "self_attn.o_proj.weight"};
  std::vector<size_t> out;
  for (const std::string& key : l.mixer == Mixer::kda ? kda : mla)
    for (size_t i : l.weights)
      if (m.weights[i].key == key) out.push_back(i);
  return out;
}

size_t weight_by_key(const Model& m, const model::LayerSpec& l, std::string_view key) {
  for (size_t i : l.weights)
    if (m.weights[i].key == key) return i;
  return SIZE_MAX;
}

}  // namespace

std::string lm_head_kernel_gap(const Model& m, const deploy::Deploy& d, int64_t width) {
  if (width * d.q() > codegen::ops::kMaxGemmRows)
    return fmt::format("width {} x q {} = {} rows, the GEMM takes at most {}", width, d.q(), width * d.q(),
                       codegen::ops::kMaxGemmRows);
  if (m.vocab % d.tensor_parallel != 0)
    return fmt::format("vocab_size {} is not divisible by tensor_parallel {}", m.vocab, d.tensor_parallel);
  if (m.hidden % 8 != 0) return fmt::format("hidden_size {} is not a multiple of 8", m.hidden);
  // The gemm op's bounds (codegen/ops/gemm.cpp): a vocabulary shard or hidden size beyond them has no
  // LM head rather than no plan.
  if (m.vocab / d.tensor_parallel > (int64_t{1} << 20) || m.hidden > (int64_t{1} << 20))
    return fmt::format("a vocabulary shard of {} rows or hidden size {}, the GEMM takes at most 2^20 of each",
                       m.vocab / d.tensor_parallel, m.hidden);
  return {};
}

codegen::KernelInstance lm_head_kernel(const Model& m, const deploy::Deploy& d, int64_t width) {
  return {"gemm",
          {{"W", width * d.q()}, {"K", m.hidden}, {"NA", m.vocab / d.tensor_parallel}, {"NB", 0}, {"NC", 0},
           {"ND", 0}, {"NE", 0}, {"NF", 0}, {"F", 1}},
          ""};
}

std::string indexer_kernel_gap(const Model& m) {
  const model::IndexerConfig& ix = m.indexer;
  if (!ix.present()) return "the model has no indexer";
  if (ix.head_dim != 128) return fmt::format("index_head_dim {} (the MXFP4 key holds 128 values)", ix.head_dim);
  if (ix.num_heads % 8 != 0 || ix.num_heads > 64)
    return fmt::format("index_n_heads {} (the scoring kernel takes a multiple of 8 up to 64)", ix.num_heads);
  if (ix.top_k < 1 || ix.top_k > 4096) return fmt::format("index_topk {} (the top-k kernel takes 1..4096)", ix.top_k);
  return {};
}

std::vector<codegen::KernelInstance> indexer_kernel_instances(const Model& m) {
  return {{"idx_quant", {}, ""},
          {"idx_pack", {}, ""},
          {"idx_stage", {}, ""},
          {"idx_score", {{"NH", m.indexer.num_heads}}, ""},
          {"idx_topk", {{"K", m.indexer.top_k}}, ""},
          {"idx_rows", {}, ""}};
}

Plan make_plan(const Model& m, const deploy::Deploy& d, const std::string& deploy_where, const PlanOptions& opt) {
  deploy::check_against_model(d, m, deploy_where);
  // The step-bytes estimate multiplies context by widths, layers and cache rows: 2^24 tokens keeps that far
  // from overflow and far above any model's context window.
  if (opt.context < 1 || opt.context > kMaxContext)
    fail(Errc::usage, "--context {}: expected 1..{} tokens", opt.context, kMaxContext);
  Plan plan;
  plan.options = opt;
  const int64_t tp = d.tensor_parallel, q = d.q();

  // Layer programs and the kernels they launch: identical on every rank (equal shards), so planned once.
  std::set<LayerClass> classes;
  for (const model::LayerSpec& l : m.layers) classes.insert(layer_class(l));
  for (LayerClass c : classes)
    for (int64_t w : d.widths) plan.programs.push_back(layer_program(m, d, c, w));
  // Counter words (program.h): when some op takes them, every program is built again with its scratch
  // above the most any program takes, so that no program's scratch covers another's counters.
  uint64_t counters = 0;
  for (const LayerProgram& p : plan.programs) counters = std::max(counters, p.counter_bytes);
  if (counters > 0) {
    plan.programs.clear();
    for (LayerClass c : classes)
      for (int64_t w : d.widths) plan.programs.push_back(layer_program(m, d, c, w, counters));
  }
  std::sort(plan.programs.begin(), plan.programs.end(), [](const LayerProgram& a, const LayerProgram& b) {
    return std::make_pair(std::string(to_string(a.cls)), a.width) < std::make_pair(std::string(to_string(b.cls)), b.width);
  });
  for (const std::string& target : d.targets) {
    std::set<std::string> seen;
    auto add = [&](codegen::KernelInstance ci, const char* role, int64_t width) {
      ci.target = target;
      KernelInstance k;
      k.op = ci.op;
      for (const auto& [key, v] : ci.params) {
        std::string lower = key;
        for (char& ch : lower) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
        k.params.emplace_back(lower, v);
      }
      k.target = target;
      k.role = role;
      k.width = width;
      k.name = codegen::kernel_name(ci);
      k.codegen = std::move(ci);
      if (seen.insert(k.name).second) plan.kernels.push_back(std::move(k));
    };
    // The model's last norm is the fused residual add + RMSNorm over the step's rows. Listed first, so
    // that a layer program using the same rmsnorm shares its code object and the role stays final_norm.
    // K3 (block attention residuals): the final mix of the stored blocks and the partial sum with
    // output_attn_res_norm/proj, then the final norm, in one attnres launch (stage 2, layer = the
    // number of layers; the runtime binds the step's attn_res buffer and the model-level weights).
    for (int64_t w : d.widths) {
      if (const int64_t B = m.attn_res_block; B > 0)
        add({"attnres", {{"W", w * q}, {"H", m.hidden}, {"B", B}, {"NB", (m.num_layers + B - 1) / B}, {"S", 2}}, ""},
            "final_norm", w);
      else
        add({"rmsnorm", {{"W", w * q}, {"H", m.hidden}}, ""}, "final_norm", w);
    }
    // The LM head (format 1.5): fp32 logits of every row against the rank's vocabulary shard (split
    // along the vocabulary like vLLM's ParallelLMHead; the host all-gathers them), one GEMM per width.
    // The host keeps the weight and binds it with dp_session_bind_lm_head.
    for (int64_t w : d.widths)
      if (lm_head_kernel_gap(m, d, w).empty())
        add(lm_head_kernel(m, d, w), "lm_head", w);
    for (const LayerProgram& p : plan.programs)
      for (const ProgramStep& s : p.steps)
        if (s.collective.empty()) add(s.kernel, "layer", p.width);  // collectives compile nothing
    add({"prefetch", {{"B", 32}}, ""}, "prefetch", 0);
    // The sparse-attention indexer's prefill ops (templates/indexer.h), width-independent.
    if (indexer_kernels_supported(m))
      for (codegen::KernelInstance ci : indexer_kernel_instances(m)) add(std::move(ci), "indexer", 0);
  }
  std::sort(plan.kernels.begin(), plan.kernels.end(), [](const KernelInstance& a, const KernelInstance& b) {
    return std::tie(a.target, a.name) < std::tie(b.target, b.name);
  });

  for (int64_t rank : d.ranks) {
    RankPlan rp;
    rp.rank = rank;
    std::vector<WeightShard> all(m.weights.size());
    for (size_t i = 0; i < m.weights.size(); ++i) {
      all[i] = shard_of(m, i, tp, rank);
      rp.weight_bytes += all[i].bytes;
    }
    // Listed shards: per-expert tensors folded into one entry per (layer, tensor key).
    for (size_t i = 0; i < m.weights.size(); ++i) {
      const WeightSpec& w = m.weights[i];
      if (w.expert > 0) continue;
      WeightShard s = all[i];
      if (w.expert == 0) {
        s.experts = m.moe.num_experts;
        const std::string tag = "experts.0.";
        s.name.replace(s.name.find(tag), tag.size(), "experts.{e}.");
      }
      rp.shards.push_back(std::move(s));
    }

    std::vector<LayerCost> costs(m.layers.size());
    for (const model::LayerSpec& l : m.layers) {
      rp.layers.push_back({l.index, l.mixer, l.ffn, layer_class(l)});
      for (size_t i : l.weights) {
        if (!m.weights[i].decode) continue;
        if (m.weights[i].expert < 0) costs[l.index].dense_weights += all[i].bytes;
        else if (m.weights[i].expert == 0) costs[l.index].expert_bytes += all[i].bytes;
      }
    }
    uint64_t model_level = 0;
    for (size_t i = 0; i < m.weights.size(); ++i)
      if (m.weights[i].layer < 0 && m.weights[i].decode) model_level += all[i].bytes;

    // Bytes of one decode step per width.
    const uint64_t state_elem = dtype_size(deploy::element_dtype(d.kda_state.dtype));
    const uint64_t conv_elem = dtype_size(deploy::element_dtype(d.conv_state.dtype));
    const uint64_t kv_elem = dtype_size(deploy::element_dtype(d.kv_cache.dtype));
    const uint64_t nh = static_cast<uint64_t>(m.kda.num_heads / tp), hd = static_cast<uint64_t>(m.kda.head_dim);
    const uint64_t rec = nh * hd * hd * state_elem;
    const uint64_t conv = 3 * static_cast<uint64_t>(m.kda.projection_size() / tp) *
                          static_cast<uint64_t>(m.kda.conv_kernel - 1) * conv_elem;
    const uint64_t kv_row = static_cast<uint64_t>(m.mla.cache_row()) * kv_elem;
    for (int64_t w : d.widths) {
      StepBytes sb;
      sb.width = w;
      const uint64_t W = static_cast<uint64_t>(w), rows = W * static_cast<uint64_t>(q);
      for (const model::LayerSpec& l : m.layers) {
        sb.weights += costs[l.index].dense_weights;
        if (l.ffn != Ffn::dense)
          sb.weights += std::min<uint64_t>(m.moe.num_experts, rows * m.moe.top_k) * costs[l.index].expert_bytes;
        if (l.mixer == Mixer::kda) {
          sb.state_read += W * (rec + conv);
          sb.state_write += W * static_cast<uint64_t>(q) * (rec + conv);  // one state slot per draft position
        } else {
          const uint64_t local = (static_cast<uint64_t>(opt.context) + d.dcp.size - 1) / d.dcp.size;
          sb.kv_read += W * local * kv_row;
          sb.kv_write += rows * kv_row / static_cast<uint64_t>(d.dcp.size);
        }
        sb.activations += rows * static_cast<uint64_t>(m.hidden) * 2 * 2;
      }
      sb.weights += model_level;
      rp.step_bytes.push_back(sb);

      Workspace ws{w, 0};
      for (const LayerProgram& p : plan.programs)
        if (p.width == w) ws.bytes = std::max(ws.bytes, p.workspace);
      rp.workspace.push_back(ws);
    }

    // L2 prefetch tables (reference: the specialized decode's prefetch controller).
    if (d.prefetch.enabled) {
      auto widths_in = [&](int64_t lo, int64_t hi) {
        std::vector<int64_t> v;
        for (int64_t w : d.widths)
          if (w >= lo && w <= hi) v.push_back(w);
        return v;
      };
      auto range = [&](size_t i, uint64_t bytes) { return PrefetchRange{i, m.weights[i].name, bytes}; };
      // Widths that share a cap share a table.
      std::map<int64_t, std::vector<int64_t>> by_cap;
      for (int64_t w : d.widths)
        if (int64_t cap = d.prefetch_cap(w); cap > 0) by_cap[cap].push_back(w);
      auto capped = [&](const char* point, int layer, bool critical, const std::vector<size_t>& weights) {
        for (const auto& [cap, ws] : by_cap) {
          PrefetchTable t{point, layer, ws, critical, 32, {}};
          uint64_t left = static_cast<uint64_t>(cap);
          for (size_t i : weights) {
            uint64_t b = std::min<uint64_t>(all[i].bytes, left) / 16 * 16;
            if (b) t.ranges.push_back(range(i, b));
            left -= b;
            if (left < 16) break;
          }
          if (!t.ranges.empty()) rp.prefetch.push_back(std::move(t));
        }
      };
      for (size_t pos = 0; pos < m.layers.size(); ++pos) {
        const model::LayerSpec& l = m.layers[pos];
        // While the attention core runs (it reads the caches, far below the HBM limit at small widths),
        // the o-projection that follows it.
        if (size_t o = weight_by_key(m, l, "self_attn.o_proj.weight"); o != SIZE_MAX && d.prefetch_point("attention_oproj"))
          capped("attention_oproj", l.index, true, {o});
        if (l.ffn == Ffn::dense) continue;
        std::vector<size_t> front{weight_by_key(m, l, "block_sparse_moe.gate.weight")};
        if (l.ffn == Ffn::latent_moe) front.push_back(weight_by_key(m, l, "block_sparse_moe.routed_expert_down_proj.weight"));
        if (auto ws = widths_in(3, 8); !ws.empty() && d.prefetch_point("oproj_down")) {
          PrefetchTable t{"oproj_down", l.index, ws, true, 8, {}};
          for (size_t i : front) t.ranges.push_back(range(i, all[i].bytes / 16 * 16));
          rp.prefetch.push_back(std::move(t));
        }
        if (tp == 8 && d.prefetch_point("attention_moe")) {
          auto ws = l.mixer == Mixer::kda ? widths_in(5, 8) : widths_in(8, 8);
          if (!ws.empty()) {
            PrefetchTable t{"attention_moe", l.index, ws, true, 32, {}};
            for (size_t i : front) t.ranges.push_back(range(i, all[i].bytes / 16 * 16));
            for (const char* k : {"block_sparse_moe.shared_experts.gate_proj.weight",
                                  "block_sparse_moe.shared_experts.up_proj.weight",
                                  "block_sparse_moe.shared_experts.down_proj.weight"})
              if (size_t i = weight_by_key(m, l, k); i != SIZE_MAX) t.ranges.push_back(range(i, all[i].bytes / 16 * 16));
            rp.prefetch.push_back(std::move(t));
          }
        }
        if (pos + 1 < m.layers.size() && d.prefetch_point("next_attention")) capped("next_attention", l.index, false, attention_weights(m, m.layers[pos + 1]));
      }
    }
    plan.ranks.push_back(std::move(rp));
  }
  return plan;
}

DecodeWeights decode_weights(const RankPlan& r, const Model& m) {
  DecodeWeights dw;
  for (const WeightShard& s : r.shards) {
    if (!m.weights[s.weight].decode) continue;
    const uint64_t count = s.experts > 0 ? static_cast<uint64_t>(s.experts) : 1;
    dw.entries += 1;
    dw.tensors += count;
    dw.bytes += s.bytes * count;
  }
  return dw;
}

namespace {
// How a quantized model's weight bytes divide: quantized weights, their scales, and the rest.
struct QuantBytes {
  size_t quantized = 0, excluded = 0, scales = 0;
  uint64_t quantized_bytes = 0, scale_bytes = 0;
};
QuantBytes quant_bytes(const Model& m) {
  QuantBytes q;
  for (const model::WeightSpec& w : m.weights) {
    if (w.quant.method != model::QuantMethod::none) ++q.quantized, q.quantized_bytes += w.bytes();
    if (!w.scale_of.empty()) ++q.scales, q.scale_bytes += w.bytes();
    q.excluded += w.quant.excluded;
  }
  return q;
}
}  // namespace

Json to_json(const Plan& p, const Model& m, const deploy::Deploy& d) {
  Json j;
  j["model"] = {{"model_type", m.model_type},
                {"config_digest", "sha256:" + m.config_digest},
                {"hidden_size", m.hidden},
                {"num_layers", m.num_layers},
                {"kda_layers", m.count(Mixer::kda)},
                {"mla_layers", m.count(Mixer::mla)},
                {"experts", m.moe.num_experts},
                {"top_k", m.moe.top_k},
                {"expert_format", model::to_string(m.moe.expert_format)},
                {"checkpoint_tensors", m.weights.size()},
                {"checkpoint_bytes", m.total_weight_bytes()}};
  if (m.quant.method != model::QuantMethod::none) {
    const QuantBytes qb = quant_bytes(m);
    j["model"]["quantization"] = {{"method", model::to_string(m.quant.method)},
                                  {"quant_method", m.quant.quant_method},
                                  {"block", m.quant.block},
                                  {"ignore", m.quant.ignore},
                                  {"quantized_weights", qb.quantized},
                                  {"excluded_weights", qb.excluded},
                                  {"quantized_bytes", qb.quantized_bytes},
                                  {"scales", qb.scales},
                                  {"scale_bytes", qb.scale_bytes}};
  }
  if (m.indexer.present())
    j["indexer"] = {{"heads", m.indexer.num_heads},
                    {"head_dim", m.indexer.head_dim},
                    {"top_k", m.indexer.top_k},
                    {"prefill_workspace_bytes", indexer::prefill_workspace_bytes(d)},
                    {"kernels", indexer_kernels_supported(m)},
                    {"no_kernels_because", indexer_kernel_gap(m)}};
  j["deploy"] = deploy::to_json(d);
  j["options"] = {{"context", p.options.context}};
  Json kernels = Json::array();
  for (const KernelInstance& k : p.kernels) {
    Json params = Json::object();
    for (const auto& [key, v] : k.params) params[key] = v;
    kernels.push_back({{"name", k.name}, {"op", k.op}, {"role", k.role}, {"target", k.target}, {"width", k.width},
                       {"params", params}});
  }
  j["kernels"] = std::move(kernels);
  Json programs = Json::array();
  for (const LayerProgram& pr : p.programs) {
    Json jp{{"class", to_string(pr.cls)}, {"width", pr.width}, {"available", pr.unavailable.empty()}};
    if (pr.unavailable.empty()) {
      Json steps = Json::array();
      for (const ProgramStep& s : pr.steps) steps.push_back(s.name);
      jp["steps"] = std::move(steps);
      jp["workspace"] = pr.workspace;
    } else {
      jp["reason"] = pr.unavailable;
    }
    programs.push_back(std::move(jp));
  }
  j["programs"] = std::move(programs);
  Json ranks = Json::array();
  for (const RankPlan& r : p.ranks) {
    Json jr;
    jr["rank"] = r.rank;
    jr["weight_bytes"] = r.weight_bytes;
    const DecodeWeights dw = decode_weights(r, m);
    jr["weight_entries"] = dw.entries;
    jr["decode_tensors"] = dw.tensors;
    jr["decode_bytes"] = dw.bytes;
    Json layers = Json::array();
    for (const LayerPlan& l : r.layers)
      layers.push_back({{"index", l.index}, {"mixer", model::to_string(l.mixer)}, {"ffn", model::to_string(l.ffn)},
                        {"class", to_string(l.cls)}});
    jr["layers"] = std::move(layers);
    Json shards = Json::array();
    for (const WeightShard& s : r.shards) {
      Json js{{"name", s.name}, {"shape", s.shape}, {"bytes", s.bytes},
              {"split", s.split_dim < 0 ? Json("replicated") : Json(s.split_dim)}};
      if (s.split_dim >= 0) js["range"] = {s.begin, s.end};
      if (s.experts) js["experts"] = s.experts;
      shards.push_back(std::move(js));
    }
    jr["shards"] = std::move(shards);
    Json steps = Json::array();
    for (const StepBytes& s : r.step_bytes)
      steps.push_back({{"width", s.width}, {"weights", s.weights}, {"state_read", s.state_read},
                       {"state_write", s.state_write}, {"kv_read", s.kv_read}, {"kv_write", s.kv_write},
                       {"activations", s.activations}, {"total_read", s.total_read()}});
    jr["step_bytes"] = std::move(steps);
    Json pf = Json::array();
    for (const PrefetchTable& t : r.prefetch) {
      Json ranges = Json::array();
      for (const PrefetchRange& x : t.ranges) ranges.push_back({{"weight", x.name}, {"bytes", x.bytes}});
      pf.push_back({{"point", t.point}, {"layer", t.layer}, {"widths", t.widths}, {"critical", t.critical},
                    {"grid", t.grid}, {"bytes", t.bytes()}, {"ranges", std::move(ranges)}});
    }
    jr["prefetch"] = std::move(pf);
    Json ws = Json::array();
    for (const Workspace& w : r.workspace) ws.push_back({{"width", w.width}, {"bytes", w.bytes}});
    jr["workspace"] = std::move(ws);
    ranks.push_back(std::move(jr));
  }
  j["ranks"] = std::move(ranks);
  return j;
}

namespace {
template <typename... A>
void line_to(std::string& out, fmt::format_string<A...> f, A&&... a) {
  out += fmt::format(f, std::forward<A>(a)...);
  out += '\n';
}

std::string human_bytes(uint64_t b) {
  if (b >= (1ull << 30)) return fmt::format("{:.2f} GiB", b / double(1ull << 30));
  if (b >= (1ull << 20)) return fmt::format("{:.1f} MiB", b / double(1ull << 20));
  if (b >= (1ull << 10)) return fmt::format("{:.1f} KiB", b / double(1ull << 10));
  return fmt::format("{} B", b);
}
}  // namespace

std::string to_text(const Plan& p, const Model& m, const deploy::Deploy& d) {
  std::string out;
  line_to(out, "model     {} ({} layers: {} KDA, {} MLA; hidden {}; {} experts top-{} {}; {} checkpoint tensors, {})", m.model_type,
       m.num_layers, m.count(Mixer::kda), m.count(Mixer::mla), m.hidden, m.moe.num_experts, m.moe.top_k,
       m.quant.method == model::QuantMethod::none ? model::to_string(m.moe.expert_format) : model::describe(m.quant),
       m.weights.size(), human_bytes(m.total_weight_bytes()));
  // Checkpoint tensors include the embeddings and LM head; a rank's bundle lists only decode weights.
  if (m.quant.method != model::QuantMethod::none) {
    const QuantBytes qb = quant_bytes(m);
    line_to(out, "quant     {}: {} quantized weights ({}) + {} scale tensors ({}); {} linear weights kept unquantized "
            "by the ignore list; the rest {}", model::describe(m.quant), qb.quantized, human_bytes(qb.quantized_bytes),
            qb.scales, human_bytes(qb.scale_bytes), qb.excluded,
            human_bytes(m.total_weight_bytes() - qb.quantized_bytes - qb.scale_bytes));
  }
  line_to(out, "deploy    targets {}; tensor_parallel {} (ranks {}); widths {}; q {}; kv {} block {}",
       fmt::join(d.targets, ","), d.tensor_parallel, fmt::join(d.ranks, ","), fmt::join(d.widths, ","), d.q(),
       deploy::to_string(d.kv_cache.dtype), d.kv_cache.block_size);
  std::map<std::string, std::vector<std::string>> by_target;
  for (const KernelInstance& k : p.kernels) by_target[k.target].push_back(k.name);
  line_to(out, "kernels   {} code objects ({} targets)", p.kernels.size(), by_target.size());
  for (const auto& [t, names] : by_target) {
    line_to(out, "  {} ({}):", t, names.size());
    for (const std::string& n : names) line_to(out, "    {}", n);
  }
  if (m.indexer.present())
    line_to(out, "indexer   {} heads x {}, top-k {}; prefill chunk scratch {} ({} keys, {} requests, dcp {} x {}); {}",
            m.indexer.num_heads, m.indexer.head_dim, m.indexer.top_k, human_bytes(indexer::prefill_workspace_bytes(d)),
            d.indexer.max_keys_per_chunk, d.indexer.max_requests, d.dcp.size, d.dcp.interleave,
            indexer_kernels_supported(m) ? std::string("prefill kernels idx_* for every target")
                                         : "no prefill kernels: " + indexer_kernel_gap(m));
  line_to(out, "programs  per layer class and width (`+` built, `-` not built: the host runs those layers)");
  for (const LayerProgram& pr : p.programs) {
    if (pr.unavailable.empty())
      line_to(out, "  + {:<10} w{:<3} {} launches: {}", to_string(pr.cls), pr.width, pr.steps.size(),
              [&] {
                std::vector<std::string> ops;
                for (const ProgramStep& s : pr.steps) ops.push_back(s.kernel.op);
                return fmt::format("{}", fmt::join(ops, " "));
              }());
    else
      line_to(out, "  - {:<10} w{:<3} {}", to_string(pr.cls), pr.width, pr.unavailable);
  }
  for (const RankPlan& r : p.ranks) {
    out += "\n";
    const DecodeWeights dw = decode_weights(r, m);
    line_to(out, "rank {}: holds {} of weights; its bundle lists {} decode weight entries ({} tensors, {})", r.rank,
            human_bytes(r.weight_bytes), dw.entries, dw.tensors, human_bytes(dw.bytes));
    std::string classes;
    for (const LayerPlan& l : r.layers) classes += fmt::format("{}{}:{}", classes.empty() ? "" : " ", l.index, to_string(l.cls));
    line_to(out, "  layers    {}", classes);
    line_to(out, "  {:>5}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}", "width", "weights", "state r/w", "kv read",
         "total read", "workspace");
    for (size_t i = 0; i < r.step_bytes.size(); ++i) {
      const StepBytes& s = r.step_bytes[i];
      line_to(out, "  {:>5}  {:>12}  {:>12}  {:>12}  {:>12}  {:>12}", s.width, human_bytes(s.weights),
           human_bytes(s.state_read + s.state_write), human_bytes(s.kv_read), human_bytes(s.total_read()),
           human_bytes(r.workspace[i].bytes));
    }
    line_to(out, "  (kv read at {} tokens of context per request; routed experts counted as min(E, rows*top_k) per layer)",
         p.options.context);
    std::map<std::string, std::pair<size_t, uint64_t>> pf;
    for (const PrefetchTable& t : r.prefetch) pf[t.point].first++, pf[t.point].second += t.bytes();
    for (const auto& [point, v] : pf)
      line_to(out, "  prefetch  {:<15} {} tables, {} in all", point, v.first, human_bytes(v.second));
  }
  return out;
}

}  // namespace dp::plan
