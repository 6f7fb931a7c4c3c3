#include "bench/bytes.h"

#include <numeric>
#include <string>

#include "common/error.h"

namespace dp::bench {

namespace {

const model::LayerSpec& layer_spec(const model::Model& m, int layer) {
  if (layer < 0 || layer >= static_cast<int>(m.layers.size()))
    fail(Errc::input, "bench bytes: layer {} does not exist (the model has {} layers)", layer, m.layers.size());
  return m.layers[static_cast<size_t>(layer)];
}

uint64_t u(int64_t v) { return static_cast<uint64_t>(v); }

// Per slot: the recurrent state [h, d, d] and ONE conv tensor [P, K-1].
uint64_t recurrent_slot(const model::Model& m, const CacheElems& e) {
  return u(m.kda.num_heads) * u(m.kda.head_dim) * u(m.kda.head_dim) * e.state;
}
uint64_t conv_slot(const model::Model& m, const CacheElems& e) {
  return u(m.kda.projection_size()) * u(m.kda.conv_kernel - 1) * e.conv;
}
uint64_t latent_row(const model::Model& m, const CacheElems& e) { return u(m.mla.cache_row()) * e.kv; }
uint64_t act_rows(const model::Model& m, int64_t rows) { return u(rows) * u(m.hidden) * 2; }

uint64_t sum_seq(const StepTraffic& t) { return u(std::accumulate(t.seq_lens.begin(), t.seq_lens.end(), int64_t{0})); }

// The weight of `layer` whose layer-relative key is `key`; "{e}" in a key stands for expert 0.
const model::WeightSpec* find_key(const model::Model& m, int layer, const std::string& name) {
  const size_t at = name.find("{e}");
  const std::string key = at == std::string::npos ? name : name.substr(0, at) + "0" + name.substr(at + 3);
  for (size_t i : layer_spec(m, layer).weights)
    if (m.weights[i].key == key) return &m.weights[i];
  return nullptr;
}

}  // namespace

uint64_t Bytes::total() const {
  return dense_weights + expert_weights + state_read + state_write + kv_read + kv_write + act_read + act_write;
}

Bytes& Bytes::operator+=(const Bytes& o) {
  dense_weights += o.dense_weights;
  expert_weights += o.expert_weights;
  state_read += o.state_read;
  state_write += o.state_write;
  kv_read += o.kv_read;
  kv_write += o.kv_write;
  act_read += o.act_read;
  act_write += o.act_write;
  return *this;
}

uint64_t expert_bytes(const model::Model& m, int layer) {
  uint64_t b = 0;
  for (size_t i : layer_spec(m, layer).weights)
    if (m.weights[i].expert == 0 && m.weights[i].decode) b += m.weights[i].bytes();
  return b;
}

Bytes layer_bytes(const model::Model& m, int layer, const CacheElems& e, const StepTraffic& t) {
  const model::LayerSpec& l = layer_spec(m, layer);
  Bytes b;
  for (size_t i : l.weights)
    if (m.weights[i].decode && m.weights[i].expert < 0) b.dense_weights += m.weights[i].bytes();
  if (l.ffn != model::Ffn::dense) b.expert_weights = u(t.routed_experts) * expert_bytes(m, layer);
  const uint64_t W = t.seq_lens.size(), q = u(t.q);
  if (l.mixer == model::Mixer::kda) {
    const uint64_t slot = recurrent_slot(m, e) + 3 * conv_slot(m, e);
    b.state_read = W * slot;       // the slot of the last accepted token
    b.state_write = W * q * slot;  // one slot per draft position
  } else {
    b.kv_read = sum_seq(t) * latent_row(m, e);
    b.kv_write = W * q * latent_row(m, e);
  }
  b.act_read = act_rows(m, t.rows()) * (layer > 0 ? 2 : 1);
  b.act_write = act_rows(m, t.rows()) * 2;
  return b;
}

Bytes final_norm_bytes(const model::Model& m, int64_t rows) {
  Bytes b;
  for (const model::WeightSpec& w : m.weights)
    if (w.layer < 0 && w.decode) b.dense_weights += w.bytes();
  b.act_read = act_rows(m, rows) * 2;
  b.act_write = act_rows(m, rows) * 2;
  return b;
}

Bytes kernel_bytes(const model::Model& m, int layer, const format::ProgramStepEntry& step, const CacheElems& e,
                   const StepTraffic& t) {
  layer_spec(m, layer);
  bool reads_context = false, writes_rows = false;
  for (const format::ProgramArgEntry& a : step.args)
    if (a.from == "io") {
      reads_context |= a.name == "block_table";
      writes_rows |= a.name == "slot_mapping";
    }
  const uint64_t W = t.seq_lens.size(), q = u(t.q);
  Bytes b;
  for (const format::ProgramArgEntry& a : step.args) {
    if (a.from == "weight") {
      const model::WeightSpec* w = find_key(m, layer, a.name);
      if (!w)
        fail(Errc::input, "bench bytes: kernel {} of layer {} names weight \"{}\", which the layer does not have",
             step.kernel, layer, a.name);
      if (a.name.find("{e}") != std::string::npos) b.expert_weights += u(t.routed_experts) * w->bytes();
      else b.dense_weights += w->bytes();
    } else if (a.from == "kv") {
      if (a.name == "kda_state") {
        b.state_read += W * recurrent_slot(m, e);
        b.state_write += W * q * recurrent_slot(m, e);
      } else if (a.name == "conv_q" || a.name == "conv_k" || a.name == "conv_v") {
        b.state_read += W * conv_slot(m, e);
        b.state_write += W * q * conv_slot(m, e);
      } else if (a.name == "mla_latent") {
        if (reads_context) b.kv_read += sum_seq(t) * latent_row(m, e);
        if (writes_rows) b.kv_write += W * q * latent_row(m, e);
      }
    } else if (a.from == "io") {
      // By the kernel's parameter: `residual` of the post-attention norm is bound to residual_out, and
      // it is read there. Layer 0 has no residual input.
      if (a.param == "hidden" || (a.param == "residual" && !(layer == 0 && a.name == "residual")))
        b.act_read += act_rows(m, t.rows());
      else if (a.param == "out" || a.param == "residual_out")
        b.act_write += act_rows(m, t.rows());
    }
  }
  return b;
}

}  // namespace dp::bench
