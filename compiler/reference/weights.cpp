#include "reference/weights.h"

#include "common/error.h"
#include "model/safetensors.h"
#include "model/synth.h"
#include "reference/numeric.h"

namespace dp::ref {

int64_t Tensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

const model::WeightSpec& find_weight(const model::Model& m, int layer, const std::string& key) {
  if (layer >= 0) {
    if (layer >= static_cast<int>(m.layers.size()))
      fail(Errc::input, "reference: layer {} does not exist (the model has {} layers)", layer, m.layers.size());
    for (size_t i : m.layers[static_cast<size_t>(layer)].weights)
      if (m.weights[i].key == key) return m.weights[i];
    fail(Errc::input, "reference: layer {} ({} + {}) has no weight \"{}\"", layer,
         to_string(m.layers[static_cast<size_t>(layer)].mixer), to_string(m.layers[static_cast<size_t>(layer)].ffn),
         key);
  }
  for (const model::WeightSpec& w : m.weights)
    if (w.layer < 0 && w.key == key) return w;
  fail(Errc::input, "reference: the model has no model-level weight \"{}\"", key);
}

namespace {

// The scale tensor of FP8 weight `w` (its quant.scale, a weight of the same layer or of the model).
const model::WeightSpec& scale_spec(const model::Model& m, const model::WeightSpec& w) {
  if (w.layer >= 0 && w.layer < static_cast<int>(m.layers.size())) {
    for (size_t i : m.layers[static_cast<size_t>(w.layer)].weights)
      if (m.weights[i].name == w.quant.scale) return m.weights[i];
  } else if (const model::WeightSpec* s = m.find(w.quant.scale)) {
    return *s;
  }
  fail(Errc::input, "reference: FP8 weight {} names the scale tensor \"{}\", which the model does not list", w.name,
       w.quant.scale);
}

}  // namespace

std::vector<double> real_values(const model::Model& m, const model::WeightSpec& w, const WeightLookup& lookup,
                                std::vector<std::string>* keys) {
  std::vector<double> v = lookup(w.key);
  if (keys) keys->push_back(w.key);
  if (w.quant.method != model::QuantMethod::fp8_block) return v;
  if (w.shape.size() != 2 || w.quant.block.size() != 2)
    fail(Errc::input, "reference: FP8 weight {} has shape {} and blocks {}, expected a matrix and [rows, cols] blocks",
         w.name, st::shape_string(w.shape), st::shape_string(w.quant.block));
  const model::WeightSpec& s = scale_spec(m, w);
  const std::vector<double> scale = lookup(s.key);
  if (keys) keys->push_back(s.key);
  return dequant_fp8_blocks(v, scale, w.shape[0], w.shape[1], w.quant.block[0], w.quant.block[1], w.name);
}

WeightLookup checkpoint_lookup(const model::Model& model, const st::Checkpoint& ckpt, int layer) {
  return [&model, &ckpt, layer](const std::string& key) {
    const model::WeightSpec& w = find_weight(model, layer, key);
    const st::TensorInfo* t = ckpt.find(w.name);
    for (size_t i = 0; !t && i < w.aliases.size(); ++i) t = ckpt.find(w.aliases[i]);
    if (!t) fail(Errc::input, "checkpoint {}: tensor {} is missing", ckpt.dir().filename().string(), w.name);
    if (static_cast<int64_t>(t->numel()) != w.numel())
      fail(Errc::input, "checkpoint tensor {}: shape {} has {} elements, expected {} (shape {})", t->name,
           st::shape_string(t->shape), t->numel(), w.numel(), st::shape_string(w.shape));
    return decode_tensor(ckpt.data(*t), t->dtype, t->name);
  };
}

WeightLookup synth_lookup(const model::Model& model, int layer, uint64_t seed) {
  return [&model, layer, seed](const std::string& key) {
    const model::WeightSpec& w = find_weight(model, layer, key);
    return decode_tensor(model::synth_weight(model, w, seed), w.dtype, w.name);
  };
}

Tensor shard_tensor(const model::WeightSpec& w, std::vector<double> full, Shard shard) {
  if (shard.tp < 1 || shard.rank < 0 || shard.rank >= shard.tp)
    fail(Errc::input, "reference: bad shard rank {} of tp {}", shard.rank, shard.tp);
  if (static_cast<int64_t>(full.size()) != w.numel())
    fail(Errc::input, "weight {}: lookup returned {} values, expected {} (shape {})", w.name, full.size(), w.numel(),
         st::shape_string(w.shape));
  Tensor t;
  t.shape = w.shape;
  if (w.split.kind == model::Split::Kind::replicated || shard.tp == 1) {
    t.data = std::move(full);
    return t;
  }
  const auto d = static_cast<size_t>(w.split.dim);
  if (d >= w.shape.size()) fail(Errc::internal, "weight {}: split dim {} out of range", w.name, d);
  const int64_t n = w.shape[d];
  if (n % shard.tp)
    fail(Errc::input, "weight {}: dimension {} ({}) does not divide by tensor_parallel {}", w.name, d, n, shard.tp);
  int64_t outer = 1, inner = 1;
  for (size_t i = 0; i < d; ++i) outer *= w.shape[i];
  for (size_t i = d + 1; i < w.shape.size(); ++i) inner *= w.shape[i];
  const int64_t part = n / shard.tp, begin = part * shard.rank;
  t.shape[d] = part;
  t.data.resize(static_cast<size_t>(outer * part * inner));
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t j = 0; j < part; ++j)
      for (int64_t i = 0; i < inner; ++i)
        t.data[static_cast<size_t>((o * part + j) * inner + i)] =
            full[static_cast<size_t>((o * n + begin + j) * inner + i)];
  return t;
}

LayerWeights::LayerWeights(const model::Model& model, int layer, WeightLookup lookup, Shard shard)
    : model_(&model), layer_(layer), lookup_(std::move(lookup)), shard_(shard) {
  if (layer < 0 || layer >= static_cast<int>(model.layers.size()))
    fail(Errc::input, "reference: layer {} does not exist (the model has {} layers)", layer, model.layers.size());
  if (shard.tp < 1 || shard.rank < 0 || shard.rank >= shard.tp)
    fail(Errc::input, "reference: bad shard rank {} of tp {}", shard.rank, shard.tp);
}

LayerWeights LayerWeights::from_checkpoint(const model::Model& model, const st::Checkpoint& ckpt, int layer,
                                           Shard shard) {
  return LayerWeights(model, layer, checkpoint_lookup(model, ckpt, layer), shard);
}

LayerWeights LayerWeights::from_synth(const model::Model& model, int layer, uint64_t seed, Shard shard) {
  return LayerWeights(model, layer, synth_lookup(model, layer, seed), shard);
}

bool LayerWeights::has(const std::string& key) const {
  for (size_t i : spec().weights)
    if (model_->weights[i].key == key) return true;
  return false;
}

Tensor LayerWeights::load(const std::string& key, std::vector<std::string>* keys) const {
  const model::WeightSpec& w = find_weight(*model_, layer_, key);
  return shard_tensor(w, real_values(*model_, w, lookup_, keys ? keys : &lookups_), shard_);
}

const Tensor& LayerWeights::get(const std::string& key) const {
  auto it = cache_.find(key);
  if (it != cache_.end()) return it->second;
  return cache_.emplace(key, load(key)).first->second;
}

Tensor LayerWeights::expert(int64_t e, const std::string& w, std::vector<std::string>* keys) const {
  const std::string base = fmt::format("block_sparse_moe.experts.{}.{}", e, w);
  if (model_->moe.expert_format == model::ExpertFormat::bf16) return load(base + ".weight", keys);
  const Tensor packed = load(base + ".weight_packed", keys);  // [rows, cols/2] bytes, sharded
  const Tensor scales = load(base + ".weight_scale", keys);   // [rows, cols/group] bytes, sharded
  Tensor t;
  t.shape = {packed.dim(0), packed.dim(1) * 2};
  t.data = dequant_mxfp4(packed.data, scales.data, t.shape[0], t.shape[1], model_->moe.mxfp4_group, base);
  return t;
}

Tensor model_tensor(const model::Model& m, const WeightLookup& lookup, const std::string& key) {
  const model::WeightSpec& w = find_weight(m, -1, key);
  return shard_tensor(w, real_values(m, w, lookup), Shard{});
}

}  // namespace dp::ref
