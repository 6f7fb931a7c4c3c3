#include "tooling/weights.h"

#include <filesystem>

#include "common/error.h"
#include "decodepack/decodepack.h"
#include "model/shard.h"
#include "model/synth.h"
#include "reference/numeric.h"

namespace dp::tools {

namespace fs = std::filesystem;

DType dtype_of(int32_t dp_dtype_value) {
  auto d = dtype_from_name(dp_dtype_name(dp_dtype_value));
  if (!d) fail(Errc::internal, "libdecodepack dtype {} has no checkpoint spelling", dp_dtype_value);
  return *d;
}

ResolvedModel resolve_model(const std::string& model_arg, bool random_weights, const std::string& manifest_config_digest,
                            const std::string& bundle) {
  const std::string& want = manifest_config_digest;  // "sha256:<hex>"
  ResolvedModel r;
  if (!model_arg.empty()) {
    r.m = model::load_model(model_arg);
    if ("sha256:" + r.m.config_digest != want)
      fail(Errc::input, "--model {}: its config (sha256:{}) is not the one the bundle was built from ({}): pass the "
           "checkpoint or config the bundle was built with", model_arg, r.m.config_digest, want);
    r.source = model_arg;
    std::error_code ec;
    if (!random_weights && fs::is_directory(model_arg, ec) && st::Checkpoint::present(model_arg))
      r.ckpt.emplace(st::Checkpoint::open(model_arg));
    return r;
  }
  for (const std::string& p : model::preset_names()) {
    model::Model m = model::load_model(p);
    if ("sha256:" + m.config_digest == want) {
      r.m = std::move(m);
      r.source = "preset " + p;
      return r;
    }
  }
  fail(Errc::usage, "{}: the bundle was built from a model_arg config that is not a built-in preset (config {}): pass "
       "--model_arg DIR (the checkpoint or config.json it was built from)", bundle, want);
}

std::vector<uint8_t> WeightSource::full_bytes(const model::WeightSpec& w) const {
  if (!ckpt_) return model::synth_weight(m_, w, seed_);
  const st::TensorInfo* t = ckpt_->find(w.name);
  for (size_t i = 0; !t && i < w.aliases.size(); ++i) t = ckpt_->find(w.aliases[i]);
  if (!t) fail(Errc::input, "checkpoint {}: tensor {} is missing", ckpt_->dir().string(), w.name);
  if (static_cast<int64_t>(t->numel()) != w.numel())
    fail(Errc::input, "checkpoint tensor {}: shape {} has {} elements, expected {} (shape {})", t->name,
         st::shape_string(t->shape), t->numel(), w.numel(), st::shape_string(w.shape));
  if (!model::can_convert(t->dtype, w.dtype))
    fail(Errc::input, "checkpoint tensor {}: dtype {} cannot be converted to the bound dtype {}", t->name,
         dtype_name(t->dtype), dtype_name(w.dtype));
  std::vector<uint8_t> out;
  model::convert_elements(ckpt_->data(*t), t->dtype, w.dtype, out);
  return out;
}

std::vector<uint8_t> WeightSource::rank_bytes(const model::WeightSpec& w, int split_dim, int64_t part,
                                              int64_t rank) const {
  return model::slice_shard(full_bytes(w), w.shape, dtype_size(w.dtype), model::rank_cut(split_dim, part, rank), w.name);
}

ref::WeightLookup WeightSource::lookup(int layer) const {
  return [this, layer](const std::string& key) {
    const model::WeightSpec& w = ref::find_weight(m_, layer, key);
    const std::vector<uint8_t> b = full_bytes(w);
    return ref::decode_tensor(b, w.dtype, w.name);
  };
}

}  // namespace dp::tools
