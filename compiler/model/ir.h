// The model IR: one description of a Kimi-Linear / Kimi-K3 decoder, whatever config flavour it was
// read from (Hub `kimi_linear`, HF transformers 5 `kimi_linear`, `kimi_k3` with text_config).
//
// Everything downstream (inventory check, plan, codegen, bundle) reads this and never the raw config.
// Shapes follow PyTorch's [out, in] convention and are the full (unsharded) checkpoint shapes; a
// Split says how tensor parallelism divides each one.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "common/json.h"

namespace dp::model {

enum class ModelType { kimi_linear, kimi_k3 };
enum class Mixer { kda, mla };
enum class Ffn { dense, moe, latent_moe };
enum class Activation { silu, situ };
enum class ExpertFormat { bf16, mxfp4 };

const char* to_string(ModelType t);
const char* to_string(Mixer m);
const char* to_string(Ffn f);
const char* to_string(Activation a);
const char* to_string(ExpertFormat f);

// How tensor parallelism divides a weight: replicated on every rank, or cut into `tp` equal
// contiguous ranges along `dim` (rank r holds [r*n/tp, (r+1)*n/tp)).
struct Split {
  enum class Kind { replicated, dim };
  Kind kind = Kind::replicated;
  int dim = -1;

  static Split replicated() { return {}; }
  static Split along(int d) { return {Kind::dim, d}; }
  bool operator==(const Split&) const = default;
};
std::string to_string(const Split& s);  // "replicated", "dim0", ...

// How a checkpoint stores quantized weights: the config's quantization description (HF
// quantization_config, read by model/quant.h). none: every weight in its own dtype (bf16 and friends).
enum class QuantMethod { none, mxfp4_experts, fp8_block };
const char* to_string(QuantMethod q);  // "none", "mxfp4", "fp8"
inline constexpr int64_t kFp8Block = 128;  // the one FP8 block edge supported: 128 x 128 values per scale

// The model's quantization, as the config describes it.
struct Quantization {
  QuantMethod method = QuantMethod::none;
  std::string quant_method;         // the config's spelling: "fp8", "compressed-tensors"
  std::vector<int64_t> block;       // values per scale, [out, in]: fp8 {128, 128}, mxfp4 {1, 32}
  std::vector<std::string> ignore;  // the config's ignore list: modules stored unquantized
};

// One weight's quantization: how its stored values become the real ones.
struct TensorQuant {
  QuantMethod method = QuantMethod::none;  // none: stored as the weight's dtype
  std::vector<int64_t> block;              // values per scale, [out, in]
  std::string scale;                       // checkpoint name of the scale tensor (also in Model::weights)
  DType scale_dtype = DType::F32;          // the scale tensor's dtype
  bool excluded = false;                   // a linear layer the config's ignore list keeps unquantized
};

struct WeightSpec {
  std::string name;                  // checkpoint name, e.g. "model.layers.3.self_attn.q_proj.weight"
  std::vector<std::string> aliases;  // other names a checkpoint may use for it (HF transformers 5)
  DType dtype = DType::BF16;         // the dtype vLLM loads it as
  std::vector<DType> alt_dtypes;     // also accepted from a checkpoint (converted at bind time)
  std::vector<int64_t> shape;
  Split split;
  int layer = -1;         // decoder layer, or -1 for model-level tensors
  int expert = -1;        // routed expert index, or -1
  bool decode = true;     // read by the decode-layer kernels (embeddings and lm_head are not)
  std::string key;        // name relative to the layer (or model) prefix: "self_attn.q_proj.weight"
  TensorQuant quant;      // dtype is the storage dtype (F8_E4M3, U8 for packed MXFP4) when quantized
  std::string scale_of;   // a scale tensor: the name of the weight it scales

  int64_t numel() const;
  uint64_t bytes() const;  // numel * dtype size, overflow-checked
};

struct KdaConfig {
  int64_t num_heads = 0;
  int64_t head_dim = 0;           // d; the recurrent state is [heads, d, d]
  int64_t conv_kernel = 0;        // short causal conv width K (state keeps K-1 inputs)
  int64_t gate_rank = 0;          // low-rank f_a / g_a width (= head_dim in the released models)
  bool full_rank_gate = false;    // K3: g_proj [P, H] replaces g_a_proj / g_b_proj
  std::optional<double> gate_lower_bound;  // K3 "safe gate": alpha = lb * sigmoid(...)
  int64_t a_log_size = 0;         // stored A_log elements (K3 stores more than num_heads)
  int64_t projection_size() const { return num_heads * head_dim; }  // P
};

struct MlaConfig {
  int64_t num_heads = 0;
  int64_t q_lora_rank = 0;  // 0: plain q_proj
  int64_t kv_lora_rank = 0; // L
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  bool use_nope = true;     // no rotary embedding at all (Kimi)
  bool output_gate = false; // K3: concat(o) * sigmoid(g_proj x)
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
  int64_t cache_row() const { return kv_lora_rank + qk_rope_head_dim; }  // latent-cache values per token
};

struct MoeConfig {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t intermediate = 0;     // per expert
  int64_t num_shared = 0;       // shared MLP width = intermediate * num_shared
  double routed_scaling = 1.0;
  bool renormalize = true;
  int64_t num_expert_group = 1;
  int64_t topk_group = 1;
  std::string scoring = "sigmoid";
  int64_t latent_dim = 0;       // K3 latent MoE: experts run in this width (0: no latent MoE)
  bool latent_norm = false;
  ExpertFormat expert_format = ExpertFormat::bf16;
  int64_t mxfp4_group = 32;     // values per E8M0 scale
};

// Sparse-attention "lightning indexer" (DeepSeek-V3.2-style DSA, model-family.md section 4): config keys
// index_n_heads, index_head_dim, index_topk. The released Kimi-Linear and K3 configs have none, and then
// present() is false and no layer carries indexer weights. When present, every MLA layer has one: its
// query projection reads the MLA q-LoRA latent, its key is one 128-value vector per token shared by all
// heads (stored as MXFP4, 68 bytes; compiler/indexer/), and it selects top_k keys per query row.
struct IndexerConfig {
  int64_t num_heads = 0;  // index_n_heads (DeepSeek-V3.2: 64)
  int64_t head_dim = 0;   // index_head_dim; always 128 (one MXFP4 index key holds 128 values)
  int64_t top_k = 0;      // index_topk (DeepSeek-V3.2: 2048)
  bool present() const { return num_heads > 0; }
};

struct LayerSpec {
  int index = 0;
  Mixer mixer = Mixer::kda;
  Ffn ffn = Ffn::dense;
  bool attn_res_push = false;   // K3 block attention residuals: push the partial sum before this layer
  bool indexer = false;         // this (MLA) layer has a sparse-attention indexer
  std::vector<size_t> weights;  // indices into Model::weights
};

struct Model {
  ModelType type = ModelType::kimi_linear;
  std::string model_type;       // the config's outer model_type string
  std::string architecture;     // architectures[0]
  std::string prefix;           // "model." or "language_model.model."
  std::string config_source;    // file or preset the config came from (messages only)
  std::string config_digest;    // sha256 of the canonical config JSON

  int64_t hidden = 0;
  int64_t num_layers = 0;
  int64_t vocab = 0;
  double rms_norm_eps = 1e-5;
  Activation activation = Activation::silu;
  double situ_beta = 0, situ_linear_beta = 0;
  int64_t dense_intermediate = 0;
  int64_t first_k_dense = 1;
  int64_t attn_res_block = 0;   // K3 block size for attention residuals (0: plain residual)
  bool tie_word_embeddings = false;

  KdaConfig kda;
  MlaConfig mla;
  MoeConfig moe;
  IndexerConfig indexer;
  Quantization quant;

  std::vector<LayerSpec> layers;
  std::vector<WeightSpec> weights;

  const WeightSpec* find(std::string_view name) const;
  int64_t count(Mixer m) const;
  uint64_t total_weight_bytes() const;
};

// Reads a HF config.json (already parsed). `where` names the file in messages.
Model model_from_config(const Json& config, const std::string& where);

// `spec` is a directory holding config.json, a path to a config file, or a preset name from
// manifests/presets (e.g. "kimi-linear-48b-a3b"). Throws dp::Error(input|io) naming what is wrong, and
// dp::Error(usage) naming `flag` and the nearest preset when `spec` is neither a path nor a preset.
Model load_model(const std::string& spec, std::string_view flag = "--model");

// Names of the presets compiled into the tool.
std::vector<std::string> preset_names();

}  // namespace dp::model
