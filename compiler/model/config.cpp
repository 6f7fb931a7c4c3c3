// Config readers: HF config.json of `kimi_linear` (as the Hub ships it and as HF transformers 5
// writes it) and `kimi_k3` (text config under `text_config`, tensors under `language_model.`),
// into the one model IR of ir.h, with every weight's name, dtype, shape and TP split rule.
#include <algorithm>
#include <array>
#include <filesystem>
#include <set>

#include "common/embedded.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/hash.h"
#include "common/suggest.h"
#include "format/manifest.h"
#include "model/ir.h"
#include "model/quant.h"

namespace fs = std::filesystem;

namespace dp::model {

const char* to_string(ModelType t) { return t == ModelType::kimi_linear ? "kimi_linear" : "kimi_k3"; }
const char* to_string(Mixer m) { return m == Mixer::kda ? "kda" : "mla"; }
const char* to_string(Ffn f) {
  switch (f) {
    case Ffn::dense: return "dense";
    case Ffn::moe: return "moe";
    case Ffn::latent_moe: return "latent_moe";
  }
  return "?";
}
const char* to_string(Activation a) { return a == Activation::silu ? "silu" : "situ"; }
const char* to_string(ExpertFormat f) { return f == ExpertFormat::bf16 ? "bf16" : "mxfp4"; }
const char* to_string(QuantMethod q) {
  switch (q) {
    case QuantMethod::none: return "none";
    case QuantMethod::mxfp4_experts: return "mxfp4";
    case QuantMethod::fp8_block: return "fp8";
  }
  return "?";
}
std::string to_string(const Split& s) {
  return s.kind == Split::Kind::replicated ? std::string("replicated") : fmt::format("dim{}", s.dim);
}

int64_t WeightSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape)
    if (__builtin_mul_overflow(n, d, &n)) fail(Errc::input, "tensor {}: element count overflows", name);
  return n;
}

uint64_t WeightSpec::bytes() const {
  uint64_t b;
  if (__builtin_mul_overflow(static_cast<uint64_t>(numel()), dtype_size(dtype), &b))
    fail(Errc::input, "tensor {}: byte size overflows", name);
  return b;
}

const WeightSpec* Model::find(std::string_view name) const {
  for (const WeightSpec& w : weights)
    if (w.name == name) return &w;
  return nullptr;
}

int64_t Model::count(Mixer m) const {
  return std::count_if(layers.begin(), layers.end(), [m](const LayerSpec& l) { return l.mixer == m; });
}

uint64_t Model::total_weight_bytes() const {
  uint64_t total = 0;
  for (const WeightSpec& w : weights)
    if (__builtin_add_overflow(total, w.bytes(), &total))
      fail(Errc::input, "{}: the weights' total byte size overflows 64 bits", config_source);
  return total;
}

namespace {

// Builds the weight list of a model whose hyper-parameters are already read.
class WeightBuilder {
 public:
  explicit WeightBuilder(Model& m) : m_(m) {}

  void layer_weight(LayerSpec& layer, std::string key, std::vector<int64_t> shape, Split split,
                    DType dtype = DType::BF16, std::vector<DType> alt = {}, std::vector<std::string> alias_keys = {},
                    int expert = -1) {
    WeightSpec w;
    std::string lp = fmt::format("{}layers.{}.", m_.prefix, layer.index);
    w.name = lp + key;
    for (const std::string& a : alias_keys) w.aliases.push_back(lp + a);
    w.key = std::move(key);
    w.dtype = dtype;
    w.alt_dtypes = std::move(alt);
    w.shape = std::move(shape);
    w.split = split;
    w.layer = layer.index;
    w.expert = expert;
    if (m_.quant.method != QuantMethod::none && is_quantizable_linear(w.key)) {
      quantize(layer, std::move(w));
      return;
    }
    layer.weights.push_back(m_.weights.size());
    m_.weights.push_back(std::move(w));
  }

  // A linear layer's weight under the model's quantization: kept as it is when the config's ignore list
  // names its module; FP8: stored e4m3 with an fp32 weight_scale_inv per block, added after it.
  void quantize(LayerSpec& layer, WeightSpec w) {
    const Quantization& q = m_.quant;
    auto module = [](const std::string& name) { return name.substr(0, name.size() - 7); };  // less ".weight"
    bool ignored = module_ignored(module(w.name), q.ignore);
    for (const std::string& a : w.aliases) ignored = ignored || module_ignored(module(a), q.ignore);
    if (ignored) {
      w.quant.excluded = true;
    } else if (q.method == QuantMethod::mxfp4_experts) {
      // MXFP4 checkpoints hold the routed experts (weight_packed, built apart) in MXFP4 and nothing else.
      fail(Errc::input, "{}: quantization_config (compressed-tensors mxfp4-pack-quantized) quantizes {}, which is not "
           "a routed expert: MXFP4 is supported for the routed experts only (its ignore list must name every other "
           "linear layer)", m_.config_source, module(w.name));
    } else {
      WeightSpec s;
      s.name = module(w.name) + ".weight_scale_inv";
      for (const std::string& a : w.aliases) s.aliases.push_back(module(a) + ".weight_scale_inv");
      s.key = module(w.key) + ".weight_scale_inv";
      s.dtype = DType::F32;
      s.shape = {(w.shape[0] + q.block[0] - 1) / q.block[0], (w.shape[1] + q.block[1] - 1) / q.block[1]};
      s.split = w.split;
      s.layer = w.layer;
      s.expert = w.expert;
      s.decode = w.decode;
      s.scale_of = w.name;
      w.dtype = DType::F8_E4M3;
      w.alt_dtypes.clear();
      w.quant = {q.method, q.block, s.name, s.dtype, false};
      layer.weights.push_back(m_.weights.size());
      m_.weights.push_back(std::move(w));
      layer.weights.push_back(m_.weights.size());
      m_.weights.push_back(std::move(s));
      return;
    }
    layer.weights.push_back(m_.weights.size());
    m_.weights.push_back(std::move(w));
  }

  void model_weight(std::string name, std::string key, std::vector<int64_t> shape, Split split, bool decode) {
    WeightSpec w;
    w.name = std::move(name);
    w.key = std::move(key);
    w.shape = std::move(shape);
    w.split = split;
    w.decode = decode;
    m_.weights.push_back(std::move(w));
  }

 private:
  Model& m_;
};

// Upper bounds of every dimension a config gives: far above the real models (K3: hidden 7168, 93 layers,
// 93 x 896 expert MLPs, 96 MLA heads, q_lora_rank 1536, vocabulary 163840), and low enough that no
// product of them (a weight's elements and bytes, a model's total bytes, a decode step's bytes at any
// width, context and TP) comes near 2^63. Layers, hidden and vocabulary sizes are the bundle reader's
// bounds, so that every model read here builds a bundle the runtime accepts.
constexpr int64_t kMaxLayers = format::kMaxLayers;
constexpr int64_t kMaxHidden = format::kMaxHiddenSize;  // hidden_size, routed_expert_hidden_size
constexpr int64_t kMaxVocab = format::kMaxVocabSize;
constexpr int64_t kMaxExpertTensors = 1 << 18;  // num_experts x num_hidden_layers
constexpr int64_t kMaxIntermediate = 1 << 18;   // intermediate_size, moe_intermediate_size
constexpr int64_t kMaxExperts = 1 << 14;        // num_experts, num_expert_group, topk_group
constexpr int64_t kMaxSharedExperts = 64;
constexpr int64_t kMaxHeads = 1024;             // num_attention_heads, KDA num_heads
constexpr int64_t kMaxHeadDim = 4096;           // qk_nope/qk_rope/v_head_dim, KDA head_dim
constexpr int64_t kMaxLoraRank = 1 << 16;       // q_lora_rank, kv_lora_rank
constexpr int64_t kMaxConvKernel = 64;          // short_conv_kernel_size (the runtime's limit)
// Far above DeepSeek-V3.2's 64 index heads and 2048 selected keys.
constexpr int64_t kMaxIndexHeads = 1024;
constexpr int64_t kMaxIndexTopk = (int64_t{1} << 31) - 1;

const Split kRep = Split::replicated();
const Split kCol = Split::along(0);  // column-parallel: output features divided
const Split kRow = Split::along(1);  // row-parallel: input features divided

void add_kda_weights(Model& m, WeightBuilder& b, LayerSpec& l) {
  const KdaConfig& k = m.kda;
  const int64_t H = m.hidden, P = k.projection_size(), h = k.num_heads, r = k.gate_rank;
  for (const char* x : {"q", "k", "v"}) b.layer_weight(l, fmt::format("self_attn.{}_proj.weight", x), {P, H}, kCol);
  // vLLM keeps the conv weights, A_log and dt_bias in fp32; HF transformers may save them as bf16.
  for (const char* x : {"q", "k", "v"})
    b.layer_weight(l, fmt::format("self_attn.{}_conv1d.weight", x), {P, 1, k.conv_kernel}, kCol, DType::F32,
                   {DType::BF16});
  b.layer_weight(l, "self_attn.f_a_proj.weight", {r, H}, kRep);
  b.layer_weight(l, "self_attn.f_b_proj.weight", {P, r}, kCol);
  b.layer_weight(l, "self_attn.dt_bias", {P}, kCol, DType::F32, {DType::BF16});
  if (m.type == ModelType::kimi_k3)
    b.layer_weight(l, "self_attn.A_log", {k.a_log_size}, kRep, DType::F32, {DType::BF16});
  else
    b.layer_weight(l, "self_attn.A_log", {1, 1, h, 1}, Split::along(2), DType::F32, {DType::BF16});
  b.layer_weight(l, "self_attn.b_proj.weight", {h, H}, kCol);
  if (k.full_rank_gate) {
    b.layer_weight(l, "self_attn.g_proj.weight", {P, H}, kCol);
  } else {
    b.layer_weight(l, "self_attn.g_a_proj.weight", {r, H}, kRep);
    b.layer_weight(l, "self_attn.g_b_proj.weight", {P, r}, kCol);
  }
  b.layer_weight(l, "self_attn.o_norm.weight", {k.head_dim}, kRep,
                 m.type == ModelType::kimi_k3 ? DType::F32 : DType::BF16, {DType::BF16, DType::F32});
  b.layer_weight(l, "self_attn.o_proj.weight", {H, P}, kRow);
}

void add_mla_weights(Model& m, WeightBuilder& b, LayerSpec& l) {
  const MlaConfig& a = m.mla;
  const int64_t H = m.hidden, N = a.num_heads;
  if (a.q_lora_rank > 0) {
    b.layer_weight(l, "self_attn.q_a_proj.weight", {a.q_lora_rank, H}, kRep);
    b.layer_weight(l, "self_attn.q_a_layernorm.weight", {a.q_lora_rank}, kRep);
    b.layer_weight(l, "self_attn.q_b_proj.weight", {N * a.qk_head_dim(), a.q_lora_rank}, kCol);
  } else {
    b.layer_weight(l, "self_attn.q_proj.weight", {N * a.qk_head_dim(), H}, kCol);
  }
  b.layer_weight(l, "self_attn.kv_a_proj_with_mqa.weight", {a.kv_lora_rank + a.qk_rope_head_dim, H}, kRep);
  b.layer_weight(l, "self_attn.kv_a_layernorm.weight", {a.kv_lora_rank}, kRep);
  b.layer_weight(l, "self_attn.kv_b_proj.weight", {N * (a.qk_nope_head_dim + a.v_head_dim), a.kv_lora_rank}, kCol);
  if (a.output_gate) b.layer_weight(l, "self_attn.g_proj.weight", {N * a.v_head_dim, H}, kCol);
  b.layer_weight(l, "self_attn.o_proj.weight", {H, N * a.v_head_dim}, kRow);
}

// DeepSeek-V3.2 / GLM-5 DSA checkpoint names (model-family.md 4.1: q_idx = wq_b(q_c), k = LayerNorm(wk x),
// w = weights_proj(x)). vLLM builds every one as a ReplicatedLinear / LayerNorm: the indexer runs whole on
// each rank. Not read by the decode-layer kernels: the host computes q_idx, k and w, and the prefill ops
// (compiler/indexer/) take those as inputs.
void add_indexer_weights(Model& m, WeightBuilder& b, LayerSpec& l) {
  const IndexerConfig& x = m.indexer;
  const int64_t H = m.hidden, d = x.head_dim;
  const size_t first = m.weights.size();
  b.layer_weight(l, "self_attn.indexer.wq_b.weight", {x.num_heads * d, m.mla.q_lora_rank}, kRep);
  b.layer_weight(l, "self_attn.indexer.wk.weight", {d, H}, kRep);
  b.layer_weight(l, "self_attn.indexer.k_norm.weight", {d}, kRep, DType::BF16, {DType::F32});
  b.layer_weight(l, "self_attn.indexer.k_norm.bias", {d}, kRep, DType::BF16, {DType::F32});
  b.layer_weight(l, "self_attn.indexer.weights_proj.weight", {x.num_heads, H}, kRep, DType::BF16, {DType::F32});
  for (size_t i = first; i < m.weights.size(); ++i) m.weights[i].decode = false;
}

// The last two weights of `l` are an MXFP4 expert matrix (weight_packed) and its scales (weight_scale):
// record the pair (one E8M0 scale per 32 inputs).
void mxfp4_pair(Model& m, const LayerSpec& l) {
  WeightSpec& packed = m.weights[l.weights[l.weights.size() - 2]];
  WeightSpec& scale = m.weights[l.weights.back()];
  packed.quant = {QuantMethod::mxfp4_experts, {1, m.moe.mxfp4_group}, scale.name, scale.dtype, false};
  scale.scale_of = packed.name;
}

void add_ffn_weights(Model& m, WeightBuilder& b, LayerSpec& l) {
  const int64_t H = m.hidden;
  const MoeConfig& e = m.moe;
  if (l.ffn == Ffn::dense) {
    const int64_t I = m.dense_intermediate;
    // HF transformers 5 names layer 0's dense MLP block_sparse_moe.*; vLLM's loader expects mlp.*.
    b.layer_weight(l, "mlp.gate_proj.weight", {I, H}, kCol, DType::BF16, {}, {"block_sparse_moe.gate_proj.weight"});
    b.layer_weight(l, "mlp.up_proj.weight", {I, H}, kCol, DType::BF16, {}, {"block_sparse_moe.up_proj.weight"});
    b.layer_weight(l, "mlp.down_proj.weight", {H, I}, kRow, DType::BF16, {}, {"block_sparse_moe.down_proj.weight"});
    return;
  }
  b.layer_weight(l, "block_sparse_moe.gate.weight", {e.num_experts, H}, kRep);
  b.layer_weight(l, "block_sparse_moe.gate.e_score_correction_bias", {e.num_experts}, kRep, DType::F32,
                 {DType::BF16});
  const int64_t I = e.intermediate;
  const int64_t D = l.ffn == Ffn::latent_moe ? e.latent_dim : H;  // width the experts run in
  if (l.ffn == Ffn::latent_moe) {
    b.layer_weight(l, "block_sparse_moe.routed_expert_down_proj.weight", {D, H}, kRep);
    b.layer_weight(l, "block_sparse_moe.routed_expert_up_proj.weight", {H, D}, kRep);
    if (e.latent_norm) b.layer_weight(l, "block_sparse_moe.routed_expert_norm.weight", {D}, kRep);
  }
  for (int64_t x = 0; x < e.num_experts; ++x) {
    const std::string p = fmt::format("block_sparse_moe.experts.{}.", x);
    const int ex = static_cast<int>(x);
    if (e.expert_format == ExpertFormat::mxfp4) {
      // MXFP4: two E2M1 values per byte along the input dim, one E8M0 scale per 32 inputs.
      const int64_t g = e.mxfp4_group;
      for (const char* w : {"w1", "w3"}) {
        b.layer_weight(l, p + w + ".weight_packed", {I, D / 2}, kCol, DType::U8, {}, {}, ex);
        b.layer_weight(l, p + w + ".weight_scale", {I, D / g}, kCol, DType::U8, {DType::F8_E8M0}, {}, ex);
        mxfp4_pair(m, l);
      }
      b.layer_weight(l, p + "w2.weight_packed", {D, I / 2}, kRow, DType::U8, {}, {}, ex);
      b.layer_weight(l, p + "w2.weight_scale", {D, I / g}, kRow, DType::U8, {DType::F8_E8M0}, {}, ex);
      mxfp4_pair(m, l);
    } else {
      b.layer_weight(l, p + "w1.weight", {I, D}, kCol, DType::BF16, {}, {}, ex);
      b.layer_weight(l, p + "w3.weight", {I, D}, kCol, DType::BF16, {}, {}, ex);
      b.layer_weight(l, p + "w2.weight", {D, I}, kRow, DType::BF16, {}, {}, ex);
    }
  }
  if (e.num_shared > 0) {
    const int64_t S = I * e.num_shared;
    b.layer_weight(l, "block_sparse_moe.shared_experts.gate_proj.weight", {S, H}, kCol);
    b.layer_weight(l, "block_sparse_moe.shared_experts.up_proj.weight", {S, H}, kCol);
    b.layer_weight(l, "block_sparse_moe.shared_experts.down_proj.weight", {H, S}, kRow);
  }
}

std::vector<int64_t> read_layer_list(const JsonReader& r, std::string_view key, int64_t num_layers) {
  std::vector<int64_t> v = r.int_list(key);
  std::set<int64_t> seen;
  for (int64_t x : v) {
    if (x < 1 || x > num_layers)
      fail(Errc::input, "{}: field {} holds layer {}, expected 1-based layer numbers in [1, {}]", r.where(),
           r.field(key), x, num_layers);
    if (!seen.insert(x).second) fail(Errc::input, "{}: field {} lists layer {} twice", r.where(), r.field(key), x);
  }
  return v;
}

// An integer field within [lo, hi]: "<file>: field <name> is <v>, expected at most <hi>" (or "a positive
// integer", "at least <lo>") names the field, the value and the limit.
int64_t in_range(const JsonReader& r, std::string_view key, int64_t v, int64_t lo, int64_t hi) {
  if (v < lo && lo == 1)
    fail(Errc::input, "{}: field {} is {}, expected a positive integer", r.where(), r.field(key), v);
  if (v < lo) fail(Errc::input, "{}: field {} is {}, expected at least {}", r.where(), r.field(key), v, lo);
  if (v > hi) fail(Errc::input, "{}: field {} is {}, expected at most {}", r.where(), r.field(key), v, hi);
  return v;
}

int64_t pos_int(const JsonReader& r, std::string_view key, int64_t hi) { return in_range(r, key, r.integer(key), 1, hi); }

int64_t pos_int_or(const JsonReader& r, std::string_view key, int64_t def, int64_t hi) {
  return in_range(r, key, r.integer_or(key, def), 1, hi);
}

int64_t int_or(const JsonReader& r, std::string_view key, int64_t def, int64_t lo, int64_t hi) {
  return in_range(r, key, r.integer_or(key, def), lo, hi);
}

// The sparse-attention indexer (DeepSeek-V3.2 config keys): all three keys or none.
void read_indexer(Model& m, const JsonReader& t) {
  static constexpr std::array<std::string_view, 3> kKeys = {"index_n_heads", "index_head_dim", "index_topk"};
  const bool any = std::any_of(kKeys.begin(), kKeys.end(), [&](std::string_view k) { return t.has(k); });
  if (!any) return;
  for (std::string_view k : kKeys)
    if (!t.has(k))
      fail(Errc::input, "{}: missing field {}: an indexer needs all of index_n_heads, index_head_dim and index_topk",
           t.where(), t.field(k));
  IndexerConfig& x = m.indexer;
  x.num_heads = pos_int(t, "index_n_heads", kMaxIndexHeads);
  x.head_dim = pos_int(t, "index_head_dim", kMaxHeadDim);
  if (x.head_dim != 128)
    fail(Errc::input, "{}: field {} is {}, expected 128 (one MXFP4 index key holds 128 values in 68 bytes: 64 of E2M1 "
         "pairs and 4 UE8M0 scales)", t.where(), t.field("index_head_dim"), x.head_dim);
  x.top_k = pos_int(t, "index_topk", kMaxIndexTopk);  // key positions are int32
  // The indexer's query projection wq_b reads the MLA q-LoRA latent (model-family.md 4.1).
  if (m.mla.q_lora_rank <= 0)
    fail(Errc::input, "{}: field {} is set but {} is {}: the indexer's query projection (wq_b) reads the q-LoRA "
         "latent, so q_lora_rank must be positive", t.where(), t.field("index_n_heads"), t.field("q_lora_rank"),
         m.mla.q_lora_rank);
}

// Reads the decoder hyper-parameters shared by kimi_linear and the K3 text config.
void read_text_config(Model& m, const JsonReader& t) {
  m.hidden = pos_int(t, "hidden_size", kMaxHidden);
  m.num_layers = pos_int(t, "num_hidden_layers", kMaxLayers);
  m.vocab = pos_int(t, "vocab_size", kMaxVocab);
  m.rms_norm_eps = t.number_or("rms_norm_eps", 1e-5);
  if (!(m.rms_norm_eps > 0 && m.rms_norm_eps < 1))
    fail(Errc::input, "{}: field {} is {}, expected a value in (0, 1)", t.where(), t.field("rms_norm_eps"),
         m.rms_norm_eps);
  m.tie_word_embeddings = t.boolean_or("tie_word_embeddings", false);

  std::string act = t.string_or("hidden_act", "silu");
  if (act == "silu") {
    m.activation = Activation::silu;
  } else if (act == "situ") {
    m.activation = Activation::situ;
    m.situ_beta = t.number_or("activation_situ_beta", 4.0);
    m.situ_linear_beta = t.number_or("activation_situ_linear_beta", 25.0);
  } else {
    fail(Errc::input, "{}: field {} is \"{}\", expected \"silu\" or \"situ\"", t.where(), t.field("hidden_act"), excerpt(act));
  }

  // KDA. Hub configs carry linear_attn_config; HF transformers 5 also writes flat keys
  // (linear_head_dim, ...) and layer_types. The nested block wins where both are present.
  const bool has_lac = t.has("linear_attn_config");
  std::vector<int64_t> kda_layers, full_layers;
  if (has_lac) {
    JsonReader lac = t.object("linear_attn_config");
    m.kda.num_heads = pos_int(lac, "num_heads", kMaxHeads);
    m.kda.head_dim = pos_int(lac, "head_dim", kMaxHeadDim);
    m.kda.conv_kernel = pos_int_or(lac, "short_conv_kernel_size", 4, kMaxConvKernel);
    m.kda.full_rank_gate = lac.boolean_or("use_full_rank_gate", false);
    if (lac.has("gate_lower_bound")) m.kda.gate_lower_bound = lac.number("gate_lower_bound");
    kda_layers = read_layer_list(lac, "kda_layers", m.num_layers);
    full_layers = read_layer_list(lac, "full_attn_layers", m.num_layers);
  } else if (t.has("layer_types")) {
    m.kda.num_heads = pos_int(t, "linear_num_heads", kMaxHeads);
    m.kda.head_dim = pos_int(t, "linear_head_dim", kMaxHeadDim);
    m.kda.conv_kernel = pos_int_or(t, "linear_conv_kernel_dim", 4, kMaxConvKernel);
  } else {
    fail(Errc::input, "{}: missing field {} (and no layer_types): cannot tell KDA from MLA layers", t.where(),
         t.field("linear_attn_config"));
  }
  m.kda.gate_rank = m.kda.head_dim;
  m.kda.a_log_size = m.type == ModelType::kimi_k3 ? std::max(m.kda.num_heads, m.kda.head_dim) : m.kda.num_heads;

  // Per-layer mixer: layer_types (HF transformers 5) when present, checked against the lists.
  std::vector<Mixer> mixers(static_cast<size_t>(m.num_layers));
  std::vector<bool> assigned(mixers.size(), false);
  if (has_lac) {
    for (int64_t x : kda_layers) mixers[x - 1] = Mixer::kda, assigned[x - 1] = true;
    for (int64_t x : full_layers) {
      if (assigned[x - 1])
        fail(Errc::input, "{}: layer {} (1-based) is in both linear_attn_config.kda_layers and full_attn_layers",
             t.where(), x);
      mixers[x - 1] = Mixer::mla, assigned[x - 1] = true;
    }
  }
  if (t.has("layer_types")) {
    const Json& lt = t.raw("layer_types");
    if (!lt.is_array() || static_cast<int64_t>(lt.size()) != m.num_layers)
      fail(Errc::input, "{}: field {} has {} entries, expected num_hidden_layers = {}", t.where(),
           t.field("layer_types"), lt.is_array() ? lt.size() : 0, m.num_layers);
    for (size_t i = 0; i < lt.size(); ++i) {
      std::string s = lt[i].is_string() ? lt[i].get<std::string>() : json_excerpt(lt[i]);
      Mixer mx;
      if (s == "linear_attention" || s == "kda") mx = Mixer::kda;
      else if (s == "full_attention" || s == "mla") mx = Mixer::mla;
      else
        fail(Errc::input, "{}: field {}[{}] is \"{}\", expected \"linear_attention\" or \"full_attention\"",
             t.where(), t.field("layer_types"), i, excerpt(s));
      if (assigned[i] && mixers[i] != mx)
        fail(Errc::input, "{}: field {}[{}] is \"{}\" but linear_attn_config makes layer {} (1-based) {}", t.where(),
             t.field("layer_types"), i, s, i + 1, to_string(mixers[i]));
      mixers[i] = mx, assigned[i] = true;
    }
  }
  for (size_t i = 0; i < assigned.size(); ++i)
    if (!assigned[i])
      fail(Errc::input, "{}: layer {} (1-based) is in neither linear_attn_config.kda_layers nor full_attn_layers",
           t.where(), i + 1);

  // MLA.
  m.mla.num_heads = pos_int(t, "num_attention_heads", kMaxHeads);
  m.mla.q_lora_rank = int_or(t, "q_lora_rank", 0, 0, kMaxLoraRank);
  m.mla.kv_lora_rank = pos_int(t, "kv_lora_rank", kMaxLoraRank);
  m.mla.qk_nope_head_dim = pos_int(t, "qk_nope_head_dim", kMaxHeadDim);
  m.mla.qk_rope_head_dim = int_or(t, "qk_rope_head_dim", 0, 0, kMaxHeadDim);
  m.mla.v_head_dim = pos_int(t, "v_head_dim", kMaxHeadDim);
  m.mla.use_nope = t.boolean_or("mla_use_nope", true);
  m.mla.output_gate = t.boolean_or("mla_use_output_gate", false);
  if (!m.mla.use_nope)
    fail(Errc::input, "{}: field {} is false: rotary MLA is not supported (Kimi MLA layers are NoPE)", t.where(),
         t.field("mla_use_nope"));

  read_indexer(m, t);

  // FFN.
  m.dense_intermediate = pos_int(t, "intermediate_size", kMaxIntermediate);
  m.first_k_dense = t.integer_or("first_k_dense_replace", 1);
  int64_t moe_freq = pos_int_or(t, "moe_layer_freq", 1, kMaxLayers);
  if (m.first_k_dense < 0 || m.first_k_dense > m.num_layers)
    fail(Errc::input, "{}: field {} is {}, expected 0..{}", t.where(), t.field("first_k_dense_replace"),
         m.first_k_dense, m.num_layers);
  m.moe.num_experts = pos_int(t, "num_experts", kMaxExperts);
  // The IR lists every expert tensor; bound the list so a hostile config cannot exhaust memory. Both
  // factors are bounded above, so the product cannot overflow.
  if (m.moe.num_experts * m.num_layers > kMaxExpertTensors)
    fail(Errc::input, "{}: num_experts {} x num_hidden_layers {} = {} expert MLPs, expected at most {}", t.where(),
         m.moe.num_experts, m.num_layers, m.moe.num_experts * m.num_layers, kMaxExpertTensors);
  m.moe.top_k = pos_int(t, "num_experts_per_token", kMaxExperts);
  if (m.moe.top_k > m.moe.num_experts)
    fail(Errc::input, "{}: field {} is {}, more than num_experts {}", t.where(), t.field("num_experts_per_token"),
         m.moe.top_k, m.moe.num_experts);
  m.moe.intermediate = pos_int(t, "moe_intermediate_size", kMaxIntermediate);
  m.moe.num_shared = int_or(t, "num_shared_experts", 0, 0, kMaxSharedExperts);
  m.moe.routed_scaling = t.number_or("routed_scaling_factor", 1.0);
  m.moe.renormalize = t.boolean_or("moe_renormalize", true);
  m.moe.num_expert_group = pos_int_or(t, "num_expert_group", 1, kMaxExperts);
  m.moe.topk_group = pos_int_or(t, "topk_group", 1, kMaxExperts);
  m.moe.scoring = t.string_or("moe_router_activation_func", "sigmoid");
  if (m.moe.scoring != "sigmoid")
    fail(Errc::input, "{}: field {} is \"{}\", expected \"sigmoid\"", t.where(),
         t.field("moe_router_activation_func"), excerpt(m.moe.scoring));
  m.moe.latent_dim = int_or(t, "routed_expert_hidden_size", 0, 0, kMaxHidden);
  m.moe.latent_norm = t.boolean_or("latent_moe_use_norm", false);
  if (m.quant.method == QuantMethod::mxfp4_experts) m.moe.expert_format = ExpertFormat::mxfp4;
  if (m.moe.expert_format == ExpertFormat::mxfp4) {
    int64_t d = m.moe.latent_dim > 0 ? m.moe.latent_dim : m.hidden;
    if (d % m.moe.mxfp4_group || m.moe.intermediate % m.moe.mxfp4_group)
      fail(Errc::input, "{}: MXFP4 experts need expert widths divisible by {}: got {} and moe_intermediate_size {}",
           t.where(), m.moe.mxfp4_group, d, m.moe.intermediate);
  }
  m.attn_res_block = int_or(t, "attn_res_block_size", 0, 0, kMaxLayers);

  // Dense or MoE per layer: mlp_layer_types (HF transformers 5) when present, else the vLLM rule.
  std::vector<Ffn> ffns(mixers.size());
  for (int64_t i = 0; i < m.num_layers; ++i)
    ffns[i] = (i >= m.first_k_dense && (i - m.first_k_dense) % moe_freq == 0)
                  ? (m.moe.latent_dim > 0 ? Ffn::latent_moe : Ffn::moe)
                  : Ffn::dense;
  if (t.has("mlp_layer_types")) {
    const Json& mt = t.raw("mlp_layer_types");
    if (!mt.is_array() || static_cast<int64_t>(mt.size()) != m.num_layers)
      fail(Errc::input, "{}: field {} has {} entries, expected num_hidden_layers = {}", t.where(),
           t.field("mlp_layer_types"), mt.is_array() ? mt.size() : 0, m.num_layers);
    for (size_t i = 0; i < mt.size(); ++i) {
      std::string s = mt[i].is_string() ? mt[i].get<std::string>() : json_excerpt(mt[i]);
      bool sparse;
      if (s == "sparse" || s == "moe") sparse = true;
      else if (s == "dense") sparse = false;
      else
        fail(Errc::input, "{}: field {}[{}] is \"{}\", expected \"dense\" or \"sparse\"", t.where(),
             t.field("mlp_layer_types"), i, excerpt(s));
      ffns[i] = sparse ? (m.moe.latent_dim > 0 ? Ffn::latent_moe : Ffn::moe) : Ffn::dense;
    }
  }

  for (int64_t i = 0; i < m.num_layers; ++i) {
    LayerSpec l;
    l.index = static_cast<int>(i);
    l.mixer = mixers[i];
    l.ffn = ffns[i];
    // Layer 0 pushes too (the embedding becomes the first block): 93 layers keep up to 8 blocks.
    l.attn_res_push = m.attn_res_block > 0 && i % m.attn_res_block == 0;
    l.indexer = m.indexer.present() && l.mixer == Mixer::mla;
    m.layers.push_back(std::move(l));
  }
  if (m.indexer.present() && m.count(Mixer::mla) == 0)
    fail(Errc::input, "{}: field {} is set but the model has no MLA layer to hold an indexer", t.where(),
         t.field("index_n_heads"));
}

void build_weights(Model& m) {
  WeightBuilder b(m);
  const int64_t H = m.hidden;
  b.model_weight(m.prefix + "embed_tokens.weight", "embed_tokens.weight", {m.vocab, H}, kCol, false);
  for (LayerSpec& l : m.layers) {
    b.layer_weight(l, "input_layernorm.weight", {H}, kRep);
    b.layer_weight(l, "post_attention_layernorm.weight", {H}, kRep);
    if (m.attn_res_block > 0) {
      b.layer_weight(l, "self_attention_res_norm.weight", {H}, kRep);
      b.layer_weight(l, "self_attention_res_proj.weight", {1, H}, kRep);
      b.layer_weight(l, "mlp_res_norm.weight", {H}, kRep);
      b.layer_weight(l, "mlp_res_proj.weight", {1, H}, kRep);
    }
    if (l.mixer == Mixer::kda) add_kda_weights(m, b, l);
    else add_mla_weights(m, b, l);
    if (l.indexer) add_indexer_weights(m, b, l);
    add_ffn_weights(m, b, l);
  }
  b.model_weight(m.prefix + "norm.weight", "norm.weight", {H}, kRep, true);
  if (m.attn_res_block > 0) {
    b.model_weight(m.prefix + "output_attn_res_norm.weight", "output_attn_res_norm.weight", {H}, kRep, true);
    b.model_weight(m.prefix + "output_attn_res_proj.weight", "output_attn_res_proj.weight", {1, H}, kRep, true);
  }
  if (!m.tie_word_embeddings) {
    // "model." -> "lm_head.weight"; "language_model.model." -> "language_model.lm_head.weight".
    std::string outer = m.prefix.substr(0, m.prefix.size() - std::string("model.").size());
    b.model_weight(outer + "lm_head.weight", "lm_head.weight", {m.vocab, H}, kCol, false);
  }
}

}  // namespace

Model model_from_config(const Json& config, const std::string& where) {
  JsonReader top(config, where);
  Model m;
  m.config_source = where;
  m.model_type = top.string("model_type");
  if (top.has("architectures")) {
    const Json& a = top.raw("architectures");
    if (a.is_array() && !a.empty() && a[0].is_string()) m.architecture = a[0].get<std::string>();
  }
  if (m.model_type == "kimi_linear") {
    m.type = ModelType::kimi_linear;
    m.prefix = "model.";
    m.quant = read_quantization(config, config, where);
    read_text_config(m, top);
  } else if (m.model_type == "kimi_k3") {
    m.type = ModelType::kimi_k3;
    m.prefix = "language_model.model.";
    JsonReader text = top.object("text_config");
    std::string inner = text.string_or("model_type", "kimi_linear");
    if (inner != "kimi_linear")
      fail(Errc::input, "{}: field text_config.model_type is \"{}\", expected \"kimi_linear\"", where, excerpt(inner));
    m.quant = read_quantization(config, top.raw("text_config"), where);
    read_text_config(m, text);
  } else {
    fail(Errc::input, "{}: field model_type is \"{}\", expected \"kimi_linear\" or \"kimi_k3\"", where,
         excerpt(m.model_type));
  }
  if (m.moe.latent_dim > 0 && m.type != ModelType::kimi_k3)
    fail(Errc::input, "{}: routed_expert_hidden_size (latent MoE) is only defined for kimi_k3", where);
  build_weights(m);
  m.config_digest = sha256_hex(canonical_json(config));
  return m;
}

std::vector<std::string> preset_names() {
  std::vector<std::string> out;
  for (const EmbeddedFile& f : embedded_files()) {
    std::string_view p = f.path;
    if (p.starts_with("presets/") && p.ends_with(".json"))
      out.emplace_back(p.substr(8, p.size() - 8 - 5));
  }
  return out;
}

Model load_model(const std::string& spec, std::string_view flag) {
  std::error_code ec;
  fs::path p(spec);
  const fs::file_status st = fs::status(p, ec);
  if (fs::is_directory(st)) {
    // An unreadable directory is an I/O error, not a checkpoint without a config.
    fs::path cfg = p / "config.json";
    if (!path_exists(cfg)) fail(Errc::input, "{}: directory has no config.json", p.string());
    return model_from_config(load_json_file(cfg), cfg.string());
  }
  if (fs::is_regular_file(st)) return model_from_config(load_json_file(p), p.string());
  if (fs::exists(st))
    fail(Errc::io, "{} {}: is {}, expected a checkpoint directory, a config file or a preset name", flag, spec,
         format::file_type_name(st.type()));
  if (auto data = embedded_file("presets/" + spec + ".json"))
    return model_from_config(parse_json(*data, "preset " + spec), "preset " + spec);
  // Neither a path nor a preset: a mistyped command-line value (usage), with the nearest preset.
  const std::vector<std::string> presets = preset_names();
  std::string names;
  for (const std::string& n : presets) names += (names.empty() ? "" : ", ") + n;
  std::string near = spec.find('/') == std::string::npos ? closest_name(spec, presets, 3) : "";
  for (const std::string& n : presets)  // "kimi-linear-48b" for "kimi-linear-48b-a3b"
    if (near.empty() && spec.size() >= 4 && n.starts_with(spec)) near = n;
  fail(Errc::usage, "{} {}: no such directory, file or preset{} (presets: {})", flag, excerpt(spec),
       near.empty() ? "" : fmt::format("; did you mean {}?", near), names);
}

}  // namespace dp::model
