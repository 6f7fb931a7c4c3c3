#include "model/synth.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string>

#include "common/dtype.h"
#include "common/embedded.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/hash.h"
#include "common/json.h"
#include "common/output.h"
#include "common/progress.h"
#include "model/inventory.h"
#include "model/quant.h"
#include "model/safetensors.h"

namespace fs = std::filesystem;

namespace dp::model {
namespace {

// splitmix64: small, fast, and good enough for test weights.
struct Rng {
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  double symmetric(double a) { return (2 * uniform() - 1) * a; }              // (-a, a)
};

uint64_t name_seed(uint64_t seed, const std::string& key, int layer, int expert) {
  // Hash the layer-relative key plus indices so that vLLM and transformers layouts get the same values.
  std::string h = sha256_hex(fmt::format("{}|{}|{}|{}", seed, key, layer, expert));
  uint64_t v = 0;
  for (int i = 0; i < 16; ++i) v = v * 16 + static_cast<uint64_t>(h[i] <= '9' ? h[i] - '0' : h[i] - 'a' + 10);
  return v;
}

uint16_t to_bf16(float f) { return f32_to_bf16_bits(f); }

enum class Fill { linear, norm, a_log, dt_bias, conv, bias, scale_e8m0, packed_fp4, res_proj };

Fill fill_for(const WeightSpec& w) {
  const std::string& k = w.key;
  auto ends = [&](std::string_view s) { return k.size() >= s.size() && k.compare(k.size() - s.size(), s.size(), s) == 0; };
  if (ends("A_log")) return Fill::a_log;
  if (ends("dt_bias")) return Fill::dt_bias;
  if (ends("conv1d.weight")) return Fill::conv;
  if (ends("e_score_correction_bias") || ends(".bias")) return Fill::bias;  // router bias; indexer k_norm.bias
  if (ends("weight_scale")) return Fill::scale_e8m0;
  if (ends("weight_packed")) return Fill::packed_fp4;
  if (ends("_res_proj.weight")) return Fill::res_proj;
  if (ends("norm.weight") || ends("layernorm.weight")) return Fill::norm;
  return Fill::linear;
}

// An FP8 weight and its scale tensor, quantized from the bf16 values synth writes for the weight in a
// checkpoint without quantization (same seed, same name).
Fp8Blocks synth_fp8(const WeightSpec& w, uint64_t seed) {
  if (w.shape.size() != 2 || w.quant.block.size() != 2 || w.quant.block[0] != w.quant.block[1])
    fail(Errc::internal, "synth: FP8 weight {} has shape {} and block {}", w.name, shape_string(w.shape),
         shape_string(w.quant.block));
  const std::vector<uint8_t> bf16 = synth_tensor(w, DType::BF16, seed);
  std::vector<float> values(bf16.size() / 2);
  for (size_t i = 0; i < values.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, &bf16[2 * i], 2);
    values[i] = bf16_bits_to_f32(b);
  }
  return quantize_fp8_blocks(values, w.shape[0], w.shape[1], w.quant.block[0]);
}

// The scales of the FP8 weights synthesized so far in this process, so that a scale tensor asked for
// after its weight (the order checkpoints and bundles list them) costs a lookup, not the weight's whole
// fill and quantization again. Keyed by everything the fill depends on; kept for the process (one float
// per 16384 weights: under 1 MB for a 3.6 GB FP8 model).
class Fp8ScaleCache {
 public:
  static std::string key(const WeightSpec& w, uint64_t seed) {
    return fmt::format("{}|{}|{}|{}|{}|{}|{}", w.name, w.key, w.layer, w.expert, seed, shape_string(w.shape),
                       shape_string(w.quant.block));
  }
  void put(const std::string& k, const std::vector<float>& s) {
    std::lock_guard<std::mutex> lock(mu_);
    scales_[k] = s;
  }
  std::optional<std::vector<float>> get(const std::string& k) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = scales_.find(k);
    if (it == scales_.end()) return std::nullopt;
    return it->second;
  }

 private:
  std::mutex mu_;
  std::map<std::string, std::vector<float>> scales_;
};
Fp8ScaleCache& fp8_scale_cache() {
  static Fp8ScaleCache c;
  return c;
}

}  // namespace

Json fp8_quantization_config(const Model& m) {
  // What stays bf16, besides what no FP8 checkpoint quantizes (norms, convolutions, A_log, dt_bias,
  // biases): the embeddings and the LM head, the MoE router (its output is the expert choice), and the
  // KDA gate and beta projections (f_a/f_b, g_a/g_b, b_proj: low-rank or num_heads wide, feeding
  // exponentials and sigmoids; b_proj's num_heads rows cannot be cut on 128-row block edges for tensor
  // parallelism). Listed by full module name, in model order.
  static constexpr std::array<std::string_view, 6> kKept = {
      "block_sparse_moe.gate.weight", "self_attn.f_a_proj.weight", "self_attn.f_b_proj.weight",
      "self_attn.g_a_proj.weight",    "self_attn.g_b_proj.weight", "self_attn.b_proj.weight"};
  Json kept = Json::array({"model.embed_tokens", "lm_head"});
  for (const WeightSpec& w : m.weights)
    if (w.layer >= 0 && std::find(kKept.begin(), kKept.end(), w.key) != kKept.end())
      kept.push_back(w.name.substr(0, w.name.size() - 7));  // less ".weight"
  return Json{{"quant_method", "fp8"},
              {"fmt", "e4m3"},
              {"activation_scheme", "dynamic"},
              {"weight_block_size", {kFp8Block, kFp8Block}},
              {"modules_to_not_convert", std::move(kept)}};
}

std::vector<uint8_t> synth_tensor(const WeightSpec& w, DType dtype, uint64_t seed) {
  Rng rng{name_seed(seed, w.key, w.layer, w.expert)};
  const int64_t n = w.numel();
  const Fill fill = fill_for(w);
  std::vector<uint8_t> out(static_cast<size_t>(n) * dtype_size(dtype));
  if (dtype == DType::U8 || dtype == DType::F8_E8M0) {
    for (int64_t i = 0; i < n; ++i) {
      // E8M0 scales near 2^-6 keep MXFP4 weights (|v| <= 6) at a sensible magnitude.
      out[i] = fill == Fill::scale_e8m0 ? static_cast<uint8_t>(127 - 8 + rng.next() % 5)
                                        : static_cast<uint8_t>(rng.next() & 0xff);
    }
    return out;
  }
  const int64_t fan_in = w.shape.size() >= 2 ? w.shape.back() : 1;
  for (int64_t i = 0; i < n; ++i) {
    double v;
    switch (fill) {
      case Fill::linear: v = rng.symmetric(std::sqrt(3.0 / static_cast<double>(fan_in))); break;
      case Fill::norm: v = 1.0 + rng.symmetric(0.1); break;
      case Fill::a_log: v = std::log(1.0 + 15.0 * rng.uniform()); break;  // A in [1, 16), as Mamba-style init
      case Fill::dt_bias: v = rng.symmetric(1.0) - 2.0; break;
      case Fill::conv: v = rng.symmetric(0.5); break;
      case Fill::bias: v = rng.symmetric(0.05); break;
      // A K3 attention-residual pseudo-query [1, H] (times res_norm ~1): the linear fill's fan-in scale
      // gives mix logits (x . w) * rsqrt(mean(x^2)) of standard deviation ~1 at every hidden size, so
      // the softmax over the blocks is neither uniform (the paper's zero init, which would leave the
      // logit path untested) nor one-hot. A fixed +-0.2 gave logits of sd 0.115 * sqrt(H): ~1.8 at H
      // 256 but ~10 at H 7168, an all-or-nothing mix no trained model shows, which fed K3-shaped layer
      // 0's FFN the renormalised MLA output alone (tests/results/gpu-2026-12-03/README.md).
      case Fill::res_proj: v = rng.symmetric(std::sqrt(3.0 / static_cast<double>(fan_in))); break;
      default: v = 0; break;
    }
    if (dtype == DType::F32) {
      float f = static_cast<float>(v);
      std::memcpy(&out[i * 4], &f, 4);
    } else if (dtype == DType::BF16) {
      uint16_t b = to_bf16(static_cast<float>(v));
      std::memcpy(&out[i * 2], &b, 2);
    } else {
      fail(Errc::internal, "synth: tensor {}: no fill for dtype {}", w.name, dtype_name(dtype));
    }
  }
  return out;
}

std::vector<uint8_t> synth_weight(const Model& m, const WeightSpec& w, uint64_t seed) {
  if (w.quant.method == QuantMethod::fp8_block) {
    Fp8Blocks q = synth_fp8(w, seed);
    fp8_scale_cache().put(Fp8ScaleCache::key(w, seed), q.scale_inv);
    return std::move(q.values);
  }
  if (w.scale_of.empty()) return synth_tensor(w, w.dtype, seed);
  // A scale tensor: of an FP8 weight of the same layer (or of the model), listed before it.
  const WeightSpec* q = nullptr;
  if (w.layer >= 0 && w.layer < static_cast<int>(m.layers.size())) {
    for (size_t i : m.layers[static_cast<size_t>(w.layer)].weights)
      if (m.weights[i].name == w.scale_of) q = &m.weights[i];
  } else {
    q = m.find(w.scale_of);
  }
  if (!q) fail(Errc::internal, "synth: scale {} of weight {}, which the model does not list", w.name, w.scale_of);
  if (q->quant.method != QuantMethod::fp8_block) return synth_tensor(w, w.dtype, seed);
  std::optional<std::vector<float>> cached = fp8_scale_cache().get(Fp8ScaleCache::key(*q, seed));
  const std::vector<float> s = cached ? std::move(*cached) : synth_fp8(*q, seed).scale_inv;
  std::vector<uint8_t> out(s.size() * sizeof(float));
  std::memcpy(out.data(), s.data(), out.size());
  return out;
}

std::optional<std::vector<std::string>> synth_own_files(const fs::path& dir) {
  try {
    std::error_code ec;
    const fs::path marker = dir / kSynthMarker;
    if (!fs::is_regular_file(fs::symlink_status(marker, ec)) || fs::file_size(marker, ec) > (1u << 20) || ec)
      return std::nullopt;
    const Json j = parse_json(read_text_file(marker), kSynthMarker);
    if (!j.is_object() || j.value("written_by", Json()) != "decodepack synth" || !j.contains("files") ||
        !j["files"].is_array())
      return std::nullopt;
    std::vector<std::string> own{kSynthMarker};
    for (const Json& f : j["files"])
      if (f.is_string() && is_safe_relative_path(f.get<std::string>())) own.push_back(f.get<std::string>());
    return own;
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

SynthResult synthesize(const SynthOptions& opt) {
  // Checked before anything is written, and again before publishing. A preset name means the
  // embedded preset, even where a directory of that name exists (a previous `synth -o <preset name>`).
  if (!embedded_file("presets/" + opt.preset + ".json")) refuse_output_over_input(opt.out, opt.preset, "input config");
  plan_output(opt.out, OutputKind::directory, opt.force, "a checkpoint", synth_own_files);
  remove_stale_staging(opt.out);

  // config.json: the preset's own JSON, byte for byte as decodepack reads it (plus the quantization
  // config with --quantize).
  Model m = load_model(opt.preset, "--preset");
  Json cfg;
  if (auto data = embedded_file("presets/" + opt.preset + ".json")) cfg = parse_json(*data, opt.preset);
  else cfg = load_json_file(fs::is_directory(opt.preset) ? fs::path(opt.preset) / "config.json" : fs::path(opt.preset));
  if (opt.quantize == SynthQuantize::fp8) {
    if (m.type != ModelType::kimi_linear)
      fail(Errc::usage, "--quantize fp8: FP8 block quantization is written for kimi_linear models, not {} ({})",
           to_string(m.type), m.config_source);
    if (m.quant.method != QuantMethod::none)
      fail(Errc::usage, "--quantize fp8: {} already has a quantization_config ({}); --quantize starts from a bf16 "
           "config", m.config_source, describe(m.quant));
    cfg["quantization_config"] = fp8_quantization_config(m);
    m = model_from_config(cfg, m.config_source + " with --quantize fp8");
  }
  const bool hf = opt.layout == CheckpointLayout::transformers;
  if (hf && m.type != ModelType::kimi_linear)
    fail(Errc::usage, "--layout transformers: HF transformers implements kimi_linear only, not {}",
         to_string(m.type));

  struct Planned {
    const WeightSpec* w;
    std::string name;
    DType dtype;
  };
  std::vector<Planned> plan;
  uint64_t total = 0;
  for (const WeightSpec& w : m.weights) {
    Planned p{&w, w.name, w.dtype};
    if (hf) {
      if (!w.aliases.empty()) p.name = w.aliases.front();
      if (p.dtype == DType::F32 && !w.alt_dtypes.empty() && w.alt_dtypes.front() == DType::BF16) p.dtype = DType::BF16;
    }
    total += static_cast<uint64_t>(w.numel()) * dtype_size(p.dtype);
    plan.push_back(std::move(p));
  }
  const uint64_t shard_target = opt.shard_bytes ? opt.shard_bytes : std::max<uint64_t>(total / 3 + 1, 1);

  // Cut into shards at tensor boundaries, in IR order.
  std::vector<std::vector<size_t>> shards(1);
  uint64_t acc = 0;
  for (size_t i = 0; i < plan.size(); ++i) {
    uint64_t b = static_cast<uint64_t>(plan[i].w->numel()) * dtype_size(plan[i].dtype);
    if (acc > 0 && acc + b > shard_target) shards.emplace_back(), acc = 0;
    shards.back().push_back(i);
    acc += b;
  }

  StagingDir stage(opt.out);
  std::map<std::string, std::string> weight_map;
  std::map<std::string, std::vector<uint8_t>> fp8_scales;  // scale name -> bytes, between weight and scale
  const size_t ns = shards.size();
  Progress bar(opt.progress, opt.progress_tty, fmt::format("writing {} safetensors files", ns), total,
               Progress::Unit::bytes);
  for (size_t s = 0; s < ns; ++s) {
    std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", s + 1, ns);
    std::vector<st::TensorData> tensors;
    for (size_t i : shards[s]) {
      const Planned& p = plan[i];
      if (p.w->quant.method == QuantMethod::fp8_block) {
        Fp8Blocks q = synth_fp8(*p.w, opt.seed);
        std::vector<uint8_t> scale(q.scale_inv.size() * sizeof(float));
        std::memcpy(scale.data(), q.scale_inv.data(), scale.size());
        fp8_scales[p.w->quant.scale] = std::move(scale);
        tensors.push_back({p.name, p.dtype, p.w->shape, std::move(q.values)});
      } else if (!p.w->scale_of.empty() && m.find(p.w->scale_of)->quant.method == QuantMethod::fp8_block) {
        // The weight comes first in IR order, so its scales are waiting (in this shard or an earlier one).
        auto it = fp8_scales.find(p.w->name);
        if (it == fp8_scales.end()) fail(Errc::internal, "synth: scale {} before its weight {}", p.w->name, p.w->scale_of);
        tensors.push_back({p.name, p.dtype, p.w->shape, std::move(it->second)});
        fp8_scales.erase(it);
      } else {
        tensors.push_back({p.name, p.dtype, p.w->shape, synth_tensor(*p.w, p.dtype, opt.seed)});
      }
      weight_map[p.name] = file;
    }
    st::write_file(stage.path() / file, tensors, {{"format", "pt"}});
    uint64_t written = 0;
    for (const st::TensorData& t : tensors) written += t.bytes.size();
    bar.advance(written, file);
  }
  bar.finish();
  st::write_index(stage.path(), weight_map, total);

  write_file_atomic(stage.path() / "config.json", cfg.dump(2) + "\n");
  std::vector<std::string> written;
  for (const fs::directory_entry& e : fs::directory_iterator(stage.path())) written.push_back(e.path().filename().string());
  std::sort(written.begin(), written.end());
  const Json files = written;
  write_file_atomic(stage.path() / kSynthMarker,
                    Json{{"files", files}, {"written_by", "decodepack synth"}}.dump(2) + "\n");
  const OutputPlan publish = plan_output(opt.out, OutputKind::directory, opt.force, "a checkpoint", synth_own_files);
  if (publish.action == OutputPlan::Action::write_into)
    stage.commit_into(publish.previous, {"config.json", kSynthMarker});
  else
    stage.commit();
  return {plan.size(), ns, total};
}

}  // namespace dp::model
