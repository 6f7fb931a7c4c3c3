// Weights as a rank binds them: the model a bundle was built from (--model, or the built-in preset
// whose config digest the manifest records), and each tensor's bytes from the checkpoint (converted to
// the bound dtype and cut to the rank's shard by compiler/model/shard.h, as the fingerprints are) or
// from the deterministic synth fill.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "format/manifest.h"
#include "model/ir.h"
#include "model/safetensors.h"
#include "reference/layer.h"

namespace dp::tools {

// The full (unsharded) tensor of a weight in its bound dtype: the checkpoint's, converted, or the
// deterministic synth fill (`decodepack synth --seed S` writes the same bytes). The CPU reference reads
// the same bytes through lookup(), so both sides see identical values. Thread-safe.
class WeightSource {
 public:
  WeightSource(const model::Model& m, const st::Checkpoint* ckpt, uint64_t seed) : m_(m), ckpt_(ckpt), seed_(seed) {}
  std::vector<uint8_t> full_bytes(const model::WeightSpec& w) const;
  // Rank `rank`'s shard of it as the rank binds it: the range [part * rank, part * (rank + 1)) of
  // dimension split_dim (-1: the whole tensor), cut by model::slice_shard (the fingerprints' cut).
  std::vector<uint8_t> rank_bytes(const model::WeightSpec& w, int split_dim, int64_t part, int64_t rank) const;
  ref::WeightLookup lookup(int layer) const;

 private:
  const model::Model& m_;
  const st::Checkpoint* ckpt_;
  uint64_t seed_;
};

// The model a bundle was built from: --model, or the built-in preset whose config digest it records.
struct ResolvedModel {
  model::Model m;
  std::string source;
  std::optional<st::Checkpoint> ckpt;
};

// The model of `manifest_config_digest` ("sha256:<hex>"): `model_arg` (a checkpoint dir, config file
// or preset; its config must have that digest), else the built-in preset that has it. With a checkpoint
// and !random_weights, ckpt holds it open. `bundle` names the bundle in messages. Throws dp::Error
// (input: a different config; usage: no preset matches and no --model).
ResolvedModel resolve_model(const std::string& model_arg, bool random_weights, const std::string& manifest_config_digest,
                            const std::string& bundle);

// The checkpoint dtype of a libdecodepack dp_dtype value.
DType dtype_of(int32_t dp_dtype_value);

}  // namespace dp::tools
