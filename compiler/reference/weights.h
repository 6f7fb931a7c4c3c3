// Weights for the float64 CPU reference: one decoder layer's tensors, as one tensor-parallel rank holds
// them, converted to double.
//
// A WeightLookup returns a FULL (unsharded) checkpoint tensor by its layer-relative key
// ("self_attn.q_proj.weight", "block_sparse_moe.experts.7.w2.weight", ...; for model-level tensors
// the model-relative key, "norm.weight"), row-major in its checkpoint shape, converted to double
// (see decode_tensor: bf16/f16/f32/e4m3 by value, U8 / F8_E8M0 as raw bytes): the values as stored.
// LayerWeights turns them into the weight's real values (real_values: an FP8 block-quantized weight is
// its e4m3 values times its block's scale_inv, read from the weight's scale tensor, a weight of its own
// with key "<module>.weight_scale_inv"), cuts the rank's shard out of the whole dequantised tensor with
// the IR's Split rule and keeps it: tensors are loaded on first use only, so a MoE layer reads only the
// experts that some row routes to (a 48B-shaped layer never holds all 256 experts in double).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "model/ir.h"

namespace dp::st {
class Checkpoint;
}

namespace dp::ref {

// Tensor-parallel shard: rank `rank` of `tp`. Split::along(d) gives rank r the contiguous range
// [r*n/tp, (r+1)*n/tp) of dimension d; replicated weights are whole on every rank.
struct Shard {
  int tp = 1;
  int rank = 0;
};

// Row-major n-d array of doubles.
struct Tensor {
  std::vector<int64_t> shape;
  std::vector<double> data;

  int64_t numel() const;
  int64_t dim(size_t i) const { return shape.at(i); }
  // [dim 0, product of the other dims]: the [out, in] matrix view of a linear weight.
  int64_t rows() const { return shape.empty() ? 1 : shape[0]; }
  int64_t cols() const { return rows() ? numel() / rows() : 0; }
  double at(int64_t r, int64_t c) const { return data[static_cast<size_t>(r * cols() + c)]; }
};

using WeightLookup = std::function<std::vector<double>(const std::string& key)>;

// The WeightSpec of `key` in layer `layer` (-1: a model-level tensor), or dp::Error(input) naming it.
const model::WeightSpec& find_weight(const model::Model& m, int layer, const std::string& key);

// Lookup over an opened checkpoint: finds the tensor by its name or an alias, checks its element count
// against the IR shape and decodes its dtype. Missing tensors are dp::Error(input) naming them.
// `model` and `ckpt` must outlive the returned function.
WeightLookup checkpoint_lookup(const model::Model& model, const st::Checkpoint& ckpt, int layer);
// Lookup over model::synth_weight (the bytes `decodepack synth --seed` writes, in the IR dtype: an FP8
// model's e4m3 weights and fp32 scales as `synth --quantize fp8` writes them).
WeightLookup synth_lookup(const model::Model& model, int layer, uint64_t seed);

// The full tensor of weight `w` of model `m` as real values: lookup(w.key), and for an FP8 block-quantized
// weight (quant.method fp8_block) those e4m3 values times the scale_inv of their block, from
// lookup(<its scale tensor's key>) (dequant_fp8_blocks). The keys looked up are appended to `keys`
// when given. dp::Error(input) when the scale tensor is not in the model or has the wrong size.
std::vector<double> real_values(const model::Model& m, const model::WeightSpec& w, const WeightLookup& lookup,
                                std::vector<std::string>* keys = nullptr);

// The rank's shard of a full tensor, by the weight's Split rule. dp::Error(input) when the split
// dimension does not divide by tp.
Tensor shard_tensor(const model::WeightSpec& w, std::vector<double> full, Shard shard);

// One rank's weights of one decoder layer. Holds a pointer to `model`, which must outlive it.
// Not thread-safe (tensors are loaded lazily into a cache on first get()).
class LayerWeights {
 public:
  LayerWeights(const model::Model& model, int layer, WeightLookup lookup, Shard shard = {});
  static LayerWeights from_checkpoint(const model::Model& model, const st::Checkpoint& ckpt, int layer,
                                      Shard shard = {});
  static LayerWeights from_synth(const model::Model& model, int layer, uint64_t seed, Shard shard = {});

  const model::Model& model() const { return *model_; }
  const model::LayerSpec& spec() const { return model_->layers.at(static_cast<size_t>(layer_)); }
  int layer() const { return layer_; }
  Shard shard() const { return shard_; }

  bool has(const std::string& key) const;           // the IR lists `key` for this layer
  // The rank's shard, with its sharded shape, of the weight's real values (FP8 weights dequantised;
  // an FP8 weight's scale tensor, asked for by its own key, is returned as stored).
  const Tensor& get(const std::string& key) const;
  // Routed expert `e`'s matrix `w` ("w1" gate [I/tp, D], "w3" up [I/tp, D], "w2" down [D, I/tp]) as
  // doubles, MXFP4 and FP8 experts dequantised (D = hidden, or the latent width for K3 latent MoE). Loaded
  // on every call and NOT cached: a MoE step streams its routed experts, so a 48B-shaped layer holds
  // only the experts in flight in double.
  // With `keys`, the keys looked up go there instead of to lookups(), and the call is safe on several
  // threads at once (the lookups of checkpoints and synth fills are); the caller then records them with
  // note_lookups() in an order of its choosing.
  Tensor expert(int64_t e, const std::string& w, std::vector<std::string>* keys = nullptr) const;
  void note_lookups(const std::vector<std::string>& keys) const {
    lookups_.insert(lookups_.end(), keys.begin(), keys.end());
  }
  void drop_cache() const { cache_.clear(); }
  // Keys passed to the lookup so far, in order (a MoE step reads only its routed experts; an FP8
  // weight's key is followed by its scale tensor's).
  const std::vector<std::string>& lookups() const { return lookups_; }

 private:
  const model::Model* model_;
  int layer_;
  WeightLookup lookup_;
  Shard shard_;
  mutable std::map<std::string, Tensor> cache_;
  mutable std::vector<std::string> lookups_;

  // lookup + shard, uncached; the keys looked up go to `keys` (default: lookups_)
  Tensor load(const std::string& key, std::vector<std::string>* keys = nullptr) const;
};

// A model-level tensor (e.g. "norm.weight"), whole.
Tensor model_tensor(const model::Model& m, const WeightLookup& lookup, const std::string& key);

}  // namespace dp::ref
