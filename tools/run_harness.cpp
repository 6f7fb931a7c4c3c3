#include "run_harness.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <thread>
#include <unordered_map>

#include <fmt/ranges.h>

#include "bundle/bundle.h"
#include "common/dtype.h"
#include "common/error.h"
#include "common/progress.h"
#include "cuda_driver.h"
#include "decodepack/decodepack.h"
#include "model/ir.h"
#include "model/safetensors.h"
#include "model/synth.h"
#include "reference/layer.h"
#include "reference/numeric.h"
#include "harness.h"
#include "run_device.h"

namespace dp::tools {

int RunResult::failures() const {
  return static_cast<int>(std::count_if(checks.begin(), checks.end(), [](const RunCheck& c) { return !c.ok; }));
}

namespace {

namespace fs = std::filesystem;

constexpr double kBf16Limit = 1e-2, kF32Limit = 1e-4;

// ---- element conversions ---------------------------------------------------------------------------

DType dtype_of(int32_t dp_dtype_value) {
  auto d = dtype_from_name(dp_dtype_name(dp_dtype_value));
  if (!d) fail(Errc::internal, "libdecodepack dtype {} has no checkpoint spelling", dp_dtype_value);
  return *d;
}

void put_bf16(uint8_t* p, double v) {
  const uint16_t b = ref::double_to_bf16_bits(v);
  std::memcpy(p, &b, 2);
}
void put_f32(uint8_t* p, double v) {
  const float f = static_cast<float>(v);
  std::memcpy(p, &f, 4);
}
double get_bf16(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return ref::bf16_bits_to_double(b);
}
double get_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
// One stored element of a bf16 or f32 cache / activation as a double.
double get_value(const uint8_t* p, DType t) { return t == DType::F32 ? get_f32(p) : get_bf16(p); }
void put_value(uint8_t* p, DType t, double v) { t == DType::F32 ? put_f32(p, v) : put_bf16(p, v); }

// A checkpoint tensor's bytes in the dtype the bundle binds (the IR's alt dtypes: bf16 <-> f32,
// rounded to nearest even like the fingerprints and vLLM's loader do).
std::vector<uint8_t> convert_bytes(std::span<const uint8_t> src, DType from, DType to, const std::string& what) {
  if (from == to) return {src.begin(), src.end()};
  const bool float_from = from == DType::BF16 || from == DType::F16 || from == DType::F32 || from == DType::F64;
  if (!float_from || (to != DType::BF16 && to != DType::F32))
    fail(Errc::input, "checkpoint tensor {}: dtype {} cannot be converted to the bound dtype {}", what, dtype_name(from),
         dtype_name(to));
  const std::vector<double> v = ref::decode_tensor(src, from, what);
  std::vector<uint8_t> out(v.size() * dtype_size(to));
  for (size_t i = 0; i < v.size(); ++i) put_value(out.data() + i * dtype_size(to), to, v[i]);
  return out;
}

// Rank `rank`'s contiguous range along `dim` of a row-major tensor of `elem`-byte elements.
std::vector<uint8_t> shard_bytes(std::vector<uint8_t> full, const std::vector<int64_t>& shape, int dim, int64_t part,
                                 int64_t rank, size_t elem) {
  if (dim < 0 || part == shape.at(static_cast<size_t>(dim))) return full;
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < dim; ++i) outer *= shape[static_cast<size_t>(i)];
  for (size_t i = static_cast<size_t>(dim) + 1; i < shape.size(); ++i) inner *= shape[i];
  const int64_t n = shape[static_cast<size_t>(dim)], begin = part * rank;
  const size_t run = static_cast<size_t>(part * inner) * elem;
  std::vector<uint8_t> out(static_cast<size_t>(outer) * run);
  for (int64_t o = 0; o < outer; ++o)
    std::memcpy(out.data() + static_cast<size_t>(o) * run, full.data() + static_cast<size_t>((o * n + begin) * inner) * elem,
                run);
  return out;
}

// ---- the model a bundle was built from ---------------------------------------------------------------

ResolvedModel resolve_model(const RunOptions& o, const format::Manifest& man) {
  const std::string want = man.model.config_digest;  // "sha256:<hex>"
  ResolvedModel r;
  if (!o.model.empty()) {
    r.m = model::load_model(o.model);
    if ("sha256:" + r.m.config_digest != want)
      fail(Errc::input, "--model {}: its config (sha256:{}) is not the one the bundle was built from ({}): pass the "
           "checkpoint or config the bundle was built with", o.model, r.m.config_digest, want);
    r.source = o.model;
    std::error_code ec;
    if (!o.random_weights && fs::is_directory(o.model, ec) && st::Checkpoint::present(o.model))
      r.ckpt.emplace(st::Checkpoint::open(o.model));
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
  fail(Errc::usage, "{}: the bundle was built from a model config that is not a built-in preset (config {}): pass "
       "--model DIR (the checkpoint or config.json it was built from)", o.bundle, want);
}

// ---- step metadata ------------------------------------------------------------------------------------

Meta make_meta(int W, int requests, int q, int steps, int64_t context, int64_t block_size, bool uniform, Rng& rng) {
  Meta m;
  m.W = W;
  m.q = q;
  m.block_size = block_size;
  m.real.assign(static_cast<size_t>(W), false);
  for (int r = 0; r < requests; ++r) m.real[r] = true;
  // Context lengths: different per request where [context/2, context] has room for them (uniform:
  // exactly `context` each).
  const int64_t lo = uniform ? context : context / 2, span = context - lo + 1;
  std::vector<int64_t> ctx;
  std::set<int64_t> used;
  for (int r = 0; r < requests; ++r) {
    int64_t c = lo + rng.below(span);
    for (int tries = 0; !uniform && used.count(c) && tries < 64 && span >= requests; ++tries) c = lo + rng.below(span);
    used.insert(c);
    ctx.push_back(c);
  }
  // KDA slots: a random permutation of 1..S-1 (0 is the null block), W spare slots nobody uses.
  m.slots = 1 + static_cast<int64_t>(W) * q + W;
  std::vector<int32_t> perm(static_cast<size_t>(m.slots - 1));
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int32_t>(i + 1);
  rng.shuffle(perm);
  m.state_indices.assign(static_cast<size_t>(W * q), DP_NULL_BLOCK_ID);
  for (int r = 0; r < requests; ++r)
    for (int i = 0; i < q; ++i) m.state_indices[static_cast<size_t>(r * q + i)] = perm[static_cast<size_t>(r * q + i)];
  // MLA blocks: enough for the context and every step's rows, a random permutation, 2 spare blocks.
  std::vector<int64_t> need(static_cast<size_t>(W), 0);
  int64_t total = 0;
  for (int r = 0; r < requests; ++r) {
    need[r] = std::max<int64_t>(1, (ctx[r] + static_cast<int64_t>(steps) * q + block_size - 1) / block_size);
    total += need[r];
  }
  m.stride = static_cast<int>(std::max<int64_t>(1, *std::max_element(need.begin(), need.end())));
  m.blocks = 1 + total + 2;
  std::vector<int32_t> bperm(static_cast<size_t>(m.blocks - 1));
  for (size_t i = 0; i < bperm.size(); ++i) bperm[i] = static_cast<int32_t>(i + 1);
  rng.shuffle(bperm);
  m.block_table.assign(static_cast<size_t>(W * m.stride), DP_NULL_BLOCK_ID);
  size_t next = 0;
  for (int r = 0; r < requests; ++r)
    for (int64_t b = 0; b < need[r]; ++b) m.block_table[static_cast<size_t>(r * m.stride + b)] = bperm[next++];
  m.num_accepted.assign(static_cast<size_t>(W), 1);
  m.seq_lens.assign(static_cast<size_t>(W), 0);
  for (int r = 0; r < requests; ++r) {
    m.num_accepted[r] = q > 1 ? static_cast<int32_t>(1 + rng.below(q)) : 1;
    m.seq_lens[r] = static_cast<int32_t>(ctx[r] + q);
  }
  m.refresh();
  return m;
}

// ---- reference views of the caches ------------------------------------------------------------------

ref::KdaState kda_from_raw(const model::Model& m, ref::Shard shard, LayerCaches& lc, const CacheLayouts& lay) {
  const Cache& st = *lc.find(DP_KV_KDA_STATE);
  const Cache& cq = *lc.find(DP_KV_CONV_Q);
  const int64_t S = st.count, h = st.desc.shape[1], d = st.desc.shape[2];
  const bool sd = lay.conv == "sd";
  const int64_t width = sd ? cq.desc.shape[1] : cq.desc.shape[2], P = sd ? cq.desc.shape[2] : cq.desc.shape[1];
  ref::KdaState k = ref::KdaState::zeros(m, shard, S, width);
  if (k.heads != h || k.head_dim != d || k.conv_dim != P)
    fail(Errc::internal, "KDA cache [{} heads, dim {}, {} conv channels], the reference expects [{}, {}, {}]", h, d, P,
         k.heads, k.head_dim, k.conv_dim);
  const bool vk = lay.kda_state == "vk";
  for (int64_t s = 0; s < S; ++s)
    for (int64_t j = 0; j < h; ++j) {
      std::span<double> dst = k.slot_state(s, j);
      const uint8_t* src = st.host.data() + static_cast<size_t>(s) * st.slot_bytes + static_cast<size_t>(j * d * d) * 4;
      for (int64_t a = 0; a < d; ++a)
        for (int64_t b = 0; b < d; ++b)
          dst[static_cast<size_t>(a * d + b)] = get_f32(src + static_cast<size_t>(vk ? b * d + a : a * d + b) * 4);
    }
  for (int which = 0; which < 3; ++which) {
    const Cache& c = *lc.find(DP_KV_CONV_Q + which);
    for (int64_t s = 0; s < S; ++s)
      for (int64_t ch = 0; ch < P; ++ch) {
        std::span<double> dst = k.conv(which, s, ch);
        const uint8_t* base = c.host.data() + static_cast<size_t>(s) * c.slot_bytes;
        for (int64_t w = 0; w < width; ++w)
          dst[static_cast<size_t>(w)] = get_value(base + static_cast<size_t>(sd ? w * P + ch : ch * width + w) * c.elem, c.dtype);
      }
  }
  return k;
}

ref::MlaCache mla_from_raw(const model::Model& m, LayerCaches& lc) {
  const Cache& c = *lc.find(DP_KV_MLA_LATENT);
  ref::MlaCache out = ref::MlaCache::zeros(m, c.count, c.desc.shape[1]);
  if (out.row != c.desc.shape[2])
    fail(Errc::internal, "MLA cache rows of {} values, the reference expects {}", c.desc.shape[2], out.row);
  for (size_t i = 0; i < out.data.size(); ++i) out.data[i] = get_bf16(c.host.data() + i * 2);
  return out;
}

// Elements of `now` that differ from `before` (bitwise) outside the units (slots, or cache rows) in
// `skip`; a unit is `unit_bytes` long, an element `elem`.
int64_t changed_outside(const std::vector<uint8_t>& before, const std::vector<uint8_t>& now, size_t unit_bytes,
                        size_t elem, const std::set<int64_t>& skip) {
  int64_t n = 0;
  const int64_t units = static_cast<int64_t>(before.size() / unit_bytes);
  for (int64_t s = 0; s < units; ++s) {
    if (skip.count(s)) continue;
    const size_t off = static_cast<size_t>(s) * unit_bytes;
    if (std::memcmp(before.data() + off, now.data() + off, unit_bytes) == 0) continue;
    for (size_t e = 0; e < unit_bytes; e += elem) n += std::memcmp(before.data() + off + e, now.data() + off + e, elem) != 0;
  }
  return n;
}

ref::Mat bf16_mat(const std::vector<uint8_t>& raw, int64_t rows, int64_t cols) {
  ref::Mat m(rows, cols);
  for (size_t i = 0; i < m.v.size(); ++i) m.v[i] = get_bf16(raw.data() + 2 * i);
  return m;
}

// Padded requests' rows are don't-care: whatever the GPU left there (even NaN) must not reach the
// reference, whose routing and norms are per row anyway.
void zero_rows(ref::Mat& m, const std::vector<bool>& valid) {
  for (int64_t t = 0; t < m.rows; ++t)
    if (!valid[static_cast<size_t>(t)])
      for (double& v : m.row(t)) v = 0;
}

// MoE routing near-ties. The GPU layer computes the router from its own bf16 activations, which may
// differ from the reference's by an ulp here and there; where the k-th and (k+1)-th biased scores of a
// row are closer than kNearTie, the two sides may legitimately pick different experts, and that row's
// FFN output then differs entirely. For such rows the reference FFN is also computed with the
// alternative choice (the weakest chosen expert swapped for the near-tied one, done by moving the
// selection-only correction bias, so the weights stay the router's), and the row takes whichever
// candidate is closer to the GPU's. Returns the rows that took an alternative.
constexpr double kNearTie = 1e-2;

int64_t match_near_ties(const model::Model& m, const WeightSource& src, int layer, ref::Shard shard,
                        const ref::LayerWeights& w, const ref::Trace& trace, const ref::Mat& gpu,
                        const std::vector<bool>& valid, const ref::Options& opt, ref::Mat& want) {
  if (w.spec().ffn == model::Ffn::dense || !trace.t.count("router_logits")) return 0;
  const int64_t E = m.moe.num_experts, k = m.moe.top_k;
  if (k < 1 || k >= E) return 0;
  const std::string bias_key = "block_sparse_moe.gate.e_score_correction_bias";
  const std::vector<double> bias = w.get(bias_key).data;
  const ref::Mat& logits = trace.at("router_logits");
  const ref::Mat& x2 = trace.at("x2");
  auto sqdist = [&](int64_t t, std::span<const double> ref_row) {
    double d = 0;
    for (int64_t c = 0; c < gpu.cols; ++c) {
      const double e = gpu(t, c) - ref_row[static_cast<size_t>(c)];
      d += e * e;
    }
    return std::isnan(d) ? std::numeric_limits<double>::infinity() : d;
  };
  int64_t taken = 0;
  for (int64_t t = 0; t < logits.rows; ++t) {
    if (!valid[static_cast<size_t>(t)]) continue;
    std::vector<double> sel(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      sel[static_cast<size_t>(e)] = ref::sigmoid(logits(t, e)) + (bias.empty() ? 0.0 : bias[static_cast<size_t>(e)]);
    std::vector<int64_t> order(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) order[static_cast<size_t>(e)] = e;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return sel[static_cast<size_t>(a)] > sel[static_cast<size_t>(b)]; });
    const int64_t a = order[static_cast<size_t>(k - 1)];
    double best = sqdist(t, want.row(t));
    std::vector<double> best_row;
    for (int64_t j = k; j < E; ++j) {
      const int64_t b = order[static_cast<size_t>(j)];
      const double gap = sel[static_cast<size_t>(a)] - sel[static_cast<size_t>(b)];
      if (gap > kNearTie || bias.empty()) break;
      std::vector<double> nb = bias;
      nb[static_cast<size_t>(b)] += gap + 1e-9;
      nb[static_cast<size_t>(a)] -= 1e-9;
      ref::LayerWeights alt(m, layer,
                            [base = src.lookup(layer), nb, bias_key](const std::string& key) {
                              return key == bias_key ? nb : base(key);
                            },
                            shard);
      ref::Mat xr(1, x2.cols);
      std::copy(x2.row(t).begin(), x2.row(t).end(), xr.row(0).begin());
      const ref::LayerWeights* ranks[1] = {&alt};
      const ref::Mat y = ref::ffn(ranks, xr, opt);
      const double d = sqdist(t, y.row(0));
      if (d < best) {
        best = d;
        best_row = y.v;
      }
    }
    if (!best_row.empty()) {
      std::copy(best_row.begin(), best_row.end(), want.row(t).begin());
      ++taken;
    }
  }
  return taken;
}

}  // namespace

// ---- where weight values come from, step metadata ----------------------------------------------------

std::vector<uint8_t> WeightSource::full_bytes(const model::WeightSpec& w) const {
  if (!ckpt_) return model::synth_tensor(w, w.dtype, seed_);
  const st::TensorInfo* t = ckpt_->find(w.name);
  for (size_t i = 0; !t && i < w.aliases.size(); ++i) t = ckpt_->find(w.aliases[i]);
  if (!t) fail(Errc::input, "checkpoint {}: tensor {} is missing", ckpt_->dir().string(), w.name);
  if (static_cast<int64_t>(t->numel()) != w.numel())
    fail(Errc::input, "checkpoint tensor {}: shape {} has {} elements, expected {} (shape {})", t->name,
         st::shape_string(t->shape), t->numel(), w.numel(), st::shape_string(w.shape));
  return convert_bytes(ckpt_->data(*t), t->dtype, w.dtype, t->name);
}

ref::WeightLookup WeightSource::lookup(int layer) const {
  return [this, layer](const std::string& key) {
    const model::WeightSpec& w = ref::find_weight(m_, layer, key);
    const std::vector<uint8_t> b = full_bytes(w);
    return ref::decode_tensor(b, w.dtype, w.name);
  };
}

void Meta::refresh() {
  positions.assign(static_cast<size_t>(rows()), 0);
  slot_mapping.assign(static_cast<size_t>(rows()), ref::kPadSlotId);
  for (int r = 0; r < W; ++r) {
    if (!real[r]) continue;
    for (int i = 0; i < q; ++i) {
      const int64_t pos = seq_lens[r] - q + i;
      const size_t t = static_cast<size_t>(r * q + i);
      positions[t] = pos;
      slot_mapping[t] = static_cast<int64_t>(block_table[static_cast<size_t>(r * stride + pos / block_size)]) * block_size +
                        pos % block_size;
    }
  }
}

void Meta::advance(Rng& rng) {
  for (int r = 0; r < W; ++r) {
    if (!real[r]) continue;
    const int32_t a = q > 1 ? static_cast<int32_t>(1 + rng.below(q)) : 1;
    num_accepted[r] = a;
    seq_lens[r] += a;  // the previous step's q rows minus the rejected ones, plus q new rows
  }
  refresh();
}

ref::StepMeta Meta::step_meta() const {
  ref::StepMeta m;
  m.num_requests = W;
  m.q = q;
  for (int r = 0; r < W; ++r) {
    std::vector<int64_t> slots, bt;
    for (int i = 0; i < q; ++i) slots.push_back(state_indices[static_cast<size_t>(r * q + i)]);
    for (int c = 0; c < stride; ++c) bt.push_back(block_table[static_cast<size_t>(r * stride + c)]);
    m.kda_slots.push_back(slots);
    m.block_table.push_back(bt);
    m.num_accepted.push_back(num_accepted[r]);
    m.seq_lens.push_back(seq_lens[r]);
  }
  m.slot_mapping = slot_mapping;
  return m;
}
// ---- the harness ------------------------------------------------------------------------------------

void Harness::check_width(int width, int requests, const char* option) const {
  if (std::find(widths_.begin(), widths_.end(), width) == widths_.end())
    fail(Errc::usage, "{} {}: {} has no kernels for width {} (built widths: {})", option, width, o_.bundle, width,
         fmt::join(widths_, ", "));
  if (requests > width)
    fail(Errc::usage, "--requests {}: more than --width {} (the rest of a width's rows are padding)", requests, width);
}

void Harness::open_and_validate() {
  // The compiler's reader for the manifest (deploy settings, config digest), with the CLI's exit codes
  // for unreadable or malformed bundles; then libdecodepack's own open, as a host does.
  manifest_bundle_.emplace(bundle::Bundle::open(o_.bundle));
  const format::Manifest& man = manifest_bundle_->manifest();
  rt(dp_bundle_open(o_.bundle.c_str(), nullptr, &sh_.b), "opening " + o_.bundle);
  dp_bundle_info info{};
  info.size = sizeof(info);
  rt(dp_bundle_get_info(sh_.b, &info), "bundle info");
  res_.digest = info.digest;
  num_layers_ = info.num_layers;
  hidden_ = info.hidden_size;
  q_ = info.q;
  tp_ = info.tensor_parallel;
  res_.q = q_;
  res_.tensor_parallel = tp_;
  res_.rank = o_.rank;

  widths_.assign(info.widths, info.widths + info.num_widths);
  if (o_.width > 0) check_width(o_.width, o_.requests);
  if (dp_bundle_weight_count(sh_.b, o_.rank) < 0) {
    std::vector<int32_t> ranks(info.ranks, info.ranks + info.num_ranks);
    fail(Errc::usage, "--rank {}: not built into {} (ranks: {})", o_.rank, o_.bundle, fmt::join(ranks, ", "));
  }
  if (tp_ > 1 && o_.check)
    fail(Errc::usage, "--check: {} is built for tensor_parallel {}; its layer programs all-reduce with their peer "
         "ranks, which one `run` process does not start, so their outputs cannot be checked on one rank (build a "
         "tensor_parallel 1 bundle to check the kernels)", o_.bundle, tp_);

  const deploy::Deploy& d = manifest_bundle_->deploy();  // checked by Bundle::open
  layouts_.kda_state = deploy::to_string(d.kda_state.layout);
  layouts_.conv = deploy::to_string(d.conv_state.layout);
  kv_dtype_ = deploy::to_string(d.kv_cache.dtype);
  if (o_.check && kv_dtype_ != "bf16")
    fail(Errc::usage, "--check: {} keeps the MLA cache in {}; the CPU reference models bf16 caches only", o_.bundle,
         kv_dtype_);

  for (int32_t l = 0; l < num_layers_; ++l) {
    dp_layer_info li{};
    li.size = sizeof(li);
    rt(dp_bundle_get_layer(sh_.b, l, &li), "bundle layer");
    mixers_.push_back(li.mixer == DP_MIXER_KDA ? "kda" : "mla");
    res_.layer_classes.push_back(li.layer_class);
  }

  model_.emplace(resolve_model(o_, man));
  const model::Model& m = model_->m;
  res_.model = model_->source;
  if (m.num_layers != num_layers_ || m.hidden != hidden_)
    fail(Errc::input, "{}: {} layers of hidden size {}, the bundle has {} of {}", model_->source, m.num_layers, m.hidden,
         num_layers_, hidden_);
  if (o_.check && m.attn_res_block > 0)
    fail(Errc::usage, "--check: {} uses Kimi-K3 block attention residuals, which the CPU reference's layer skeleton "
         "does not model yet", model_->source);
  source_.emplace(m, model_->ckpt ? &*model_->ckpt : nullptr, o_.seed);
  res_.weights = model_->ckpt ? "the checkpoint's" : fmt::format("random (the synth fill of seed {})", o_.seed);
}

void Harness::open_device() {
  drv_ = &Driver::get();
  ctx_ = std::make_unique<Context>(*drv_, o_.device);
  int version = 0;
  drv_->DriverGetVersion(&version);
  res_.device = fmt::format("{} (device {}, CUDA driver {}.{})", ctx_->name(), o_.device, version / 1000,
                            (version % 1000) / 10);
  mem_ = std::make_unique<DeviceMemory>(*drv_);
  dp_session_options so;
  dp_session_options_init(&so);
  so.device = o_.device;
  so.rank = o_.rank;
  so.tensor_parallel = tp_;
  so.num_speculative_tokens = q_ - 1;
  if (!o_.prefetch) so.flags |= DP_SESSION_NO_PREFETCH;
  if (!o_.pdl) so.flags |= DP_SESSION_NO_PDL;
  rt(dp_session_create(sh_.b, &so, &sh_.s), fmt::format("creating a session on device {}", o_.device));
  res_.target = dp_session_target(sh_.s);
  stream_ = std::make_unique<Stream>(*drv_);
  start_ = std::make_unique<Event>(*drv_);
  stop_ = std::make_unique<Event>(*drv_);
  log(fmt::format("device: {}, target {}", res_.device, res_.target));
}

void Harness::bind_weights() {
  const model::Model& m = model_->m;
  std::unordered_map<std::string, const model::WeightSpec*> by_name;
  for (const model::WeightSpec& w : m.weights) by_name.emplace(w.name, &w);
  const int32_t n = dp_bundle_weight_count(sh_.b, o_.rank);
  log(fmt::format("weights: binding {} tensors of rank {} from {}", n, o_.rank, res_.weights));
  const auto t0 = std::chrono::steady_clock::now();
  uint64_t bytes = 0;
  const unsigned threads = std::max(1u, std::min(16u, std::thread::hardware_concurrency()));
  auto weight_info = [&](int32_t i) {
    dp_weight_info wi{};
    wi.size = sizeof(wi);
    rt(dp_bundle_get_weight(sh_.b, o_.rank, i, &wi), "bundle weight");
    return wi;
  };
  // Progress in device bytes (the expert groups dwarf the other entries), counted as the loop allocates.
  auto device_bytes = [](const dp_weight_info& wi) {
    size_t shard = dp_dtype_size(wi.dtype);
    for (int32_t k = 0; k < wi.ndim; ++k) shard *= static_cast<size_t>(wi.shape[k]);
    return wi.experts > 0 ? (shard + 15) / 16 * 16 * static_cast<size_t>(wi.experts) : shard;
  };
  uint64_t total_bytes = 0;
  for (int32_t i = 0; i < n; ++i) total_bytes += device_bytes(weight_info(i));
  Progress bar(o_.log ? stderr : nullptr, stderr_is_terminal(), "weights: binding", total_bytes, Progress::Unit::bytes);
  for (int32_t i = 0; i < n; ++i) {
    const dp_weight_info wi = weight_info(i);
    const std::string group = wi.name;
    const DType dt = dtype_of(wi.dtype);
    const size_t elem = dp_dtype_size(wi.dtype);
    size_t shard = elem;
    for (int32_t k = 0; k < wi.ndim; ++k) shard *= static_cast<size_t>(wi.shape[k]);
    const size_t count = wi.experts > 0 ? static_cast<size_t>(wi.experts) : 1;
    // Experts are one stacked tensor [E, rows, cols] (vLLM's FusedMoE layout): expert e at
    // base + e * stride. The stride is the expert's size, rounded to the 16 bytes binding requires.
    const size_t stride = wi.experts > 0 ? (shard + 15) / 16 * 16 : shard;
    const CUdeviceptr base = mem_->alloc(stride * count, "weight " + group);
    bytes += stride * count;
    std::vector<uint8_t> host(stride * count, 0);
    parallel_for(count, wi.experts > 0 ? threads : 1, [&](size_t e) {
      std::string name = group;
      if (wi.experts > 0) name.replace(name.find("{e}"), 3, std::to_string(e));
      const auto it = by_name.find(name);
      const model::WeightSpec* spec = it == by_name.end() ? nullptr : it->second;
      if (!spec) fail(Errc::input, "{} lists weight {}, which model {} does not have", o_.bundle, name, model_->source);
      if (spec->dtype != dt)
        fail(Errc::input, "{} binds {} as {}, model {} says {}", o_.bundle, name, dtype_name(dt), model_->source,
             dtype_name(spec->dtype));
      int64_t part = 0;
      if (wi.split_dim >= 0) {
        part = wi.shape[wi.split_dim];
        if (spec->shape.at(static_cast<size_t>(wi.split_dim)) != part * tp_)
          fail(Errc::input, "{}: weight {} dimension {} is {} on rank {}, the model's {} is not {} x tensor_parallel {}",
               o_.bundle, name, wi.split_dim, part, o_.rank, spec->shape[static_cast<size_t>(wi.split_dim)], part, tp_);
      }
      std::vector<uint8_t> b = shard_bytes(source_->full_bytes(*spec), spec->shape, wi.split_dim, part, o_.rank, elem);
      if (b.size() != shard) fail(Errc::internal, "weight {}: {} bytes for a shard of {}", name, b.size(), shard);
      std::memcpy(host.data() + e * stride, b.data(), shard);
    });
    drv_->check(drv_->MemcpyHtoD(base, host.data(), host.size()), "cuMemcpyHtoD", "weight " + group);
    dp_tensor t;
    dp_tensor_init(&t, base, wi.dtype, wi.ndim, wi.shape);
    if (wi.experts > 0) {
      std::vector<uint64_t> ptrs(count);
      for (size_t e = 0; e < count; ++e) ptrs[e] = base + e * stride;
      rt(dp_session_bind_expert_weights(sh_.s, group.c_str(), ptrs.data(), wi.experts, &t), "binding " + group);
    } else {
      rt(dp_session_bind_weight(sh_.s, group.c_str(), &t), "binding " + group);
    }
    bar.advance(stride * count, group);
  }
  bar.finish();
  rt(dp_session_finalize_weights(sh_.s), "finalizing weights");
  res_.weight_bytes = static_cast<int64_t>(bytes);
  res_.weight_entries = n;
  log(fmt::format("weights: {} bound in {:.1f} s", human_bytes(bytes),
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()));
  if (o_.verify_weights) {
    rt(dp_session_verify_weights(sh_.s), "verifying the bound weights against the bundle's fingerprints");
    log("weights: every shard matches the bundle's fingerprints");
  }
}

void Harness::bind_caches() {
  Rng rng(o_.seed ^ 0xC0FFEEull);
  caches_.resize(static_cast<size_t>(num_layers_));
  uint64_t total = 0;
  for (int32_t l = 0; l < num_layers_; ++l) {
    LayerCaches& lc = caches_[static_cast<size_t>(l)];
    lc.kda = mixers_[static_cast<size_t>(l)] == "kda";
    const std::vector<int32_t> kinds = lc.kda ? std::vector<int32_t>{DP_KV_KDA_STATE, DP_KV_CONV_Q, DP_KV_CONV_K, DP_KV_CONV_V}
                                              : std::vector<int32_t>{DP_KV_MLA_LATENT};
    for (int32_t kind : kinds) {
      Cache c;
      c.kind = kind;
      c.count = kind == DP_KV_MLA_LATENT ? meta_.blocks : meta_.slots;
      rt(dp_session_kv_layout(sh_.s, l, kind, c.count, &c.desc), fmt::format("layer {} cache layout", l));
      c.dtype = dtype_of(c.desc.dtype);
      c.elem = dp_dtype_size(c.desc.dtype);
      c.slot_bytes = c.elem;
      for (int32_t k = 1; k < c.desc.ndim; ++k) c.slot_bytes *= static_cast<size_t>(c.desc.shape[k]);
      c.ptr = width_mem_->alloc(c.bytes(), fmt::format("layer {} cache kind {}", l, kind));
      c.desc.data = c.ptr;
      // Random, non-zero contents in the scale a decode sees: fp32 recurrent states and bf16 conv
      // histories around 1, latent rows [normed c | k_pe] around 1.
      c.host.resize(c.bytes());
      const size_t n = c.bytes() / c.elem;
      for (size_t i = 0; i < n; ++i) {
        uint8_t* p = c.host.data() + i * c.elem;
        if (c.dtype == DType::F8_E4M3) {
          *p = static_cast<uint8_t>((0x28 + rng.below(32)) | (rng.below(2) << 7));  // |v| in [0.25, 3.75]
        } else {
          put_value(p, c.dtype, rng.nonzero(kind == DP_KV_MLA_LATENT ? -1.5 : -1.0, kind == DP_KV_MLA_LATENT ? 1.5 : 1.0));
        }
      }
      drv_->check(drv_->MemcpyHtoD(c.ptr, c.host.data(), c.host.size()), "cuMemcpyHtoD", fmt::format("layer {} cache", l));
      rt(dp_session_bind_kv(sh_.s, l, kind, &c.desc), fmt::format("binding layer {} cache", l));
      total += c.bytes();
      if (!o_.check) c.host = {};
      lc.c.push_back(std::move(c));
    }
  }
  log(fmt::format("caches: {} for {} KDA slots and {} MLA blocks per layer", human_bytes(total), meta_.slots,
                  meta_.blocks));
}

void Harness::allocate_io() {
  act_bytes_ = static_cast<size_t>(res_.rows * hidden_) * 2;
  DeviceMemory& mem = *width_mem_;
  hidden_bufs_.clear();
  residual_bufs_.clear();
  for (int32_t l = 0; l <= num_layers_; ++l) {
    hidden_bufs_.push_back(mem.alloc(act_bytes_, "hidden rows"));
    residual_bufs_.push_back(l == 0 ? 0 : mem.alloc(act_bytes_, "residual rows"));
  }
  final_out_ = mem.alloc(act_bytes_, "final norm output");
  final_residual_ = mem.alloc(act_bytes_, "final residual");
  const size_t rows = static_cast<size_t>(res_.rows), W = static_cast<size_t>(width_);
  d_positions_ = mem.alloc(rows * 8, "positions");
  d_state_indices_ = mem.alloc(meta_.state_indices.size() * 4, "state indices");
  d_block_table_ = mem.alloc(meta_.block_table.size() * 4, "block table");
  d_seq_lens_ = mem.alloc(W * 4, "seq lens");
  d_slot_mapping_ = mem.alloc(rows * 8, "slot mapping");
  d_num_accepted_ = mem.alloc(W * 4, "num accepted");
}

void Harness::set_width(int width, int requests, int steps, bool uniform_context) {
  check_width(width, requests, "width");
  graph_.reset();  // captured with the previous width's buffers
  if (width_mem_) {
    sync();
    rt(dp_session_release_kv(sh_.s), "releasing the previous width's caches");
  }
  caches_.clear();
  width_mem_.reset();
  width_mem_ = std::make_unique<DeviceMemory>(*drv_);
  width_ = width;
  res_.width = width;
  res_.requests = requests > 0 ? requests : width;
  res_.rows = width * q_;
  meta_rng_ = Rng(o_.seed ^ 0x5EEDull);
  const int64_t block_size = manifest_bundle_->deploy().kv_cache.block_size;
  meta_ = make_meta(width, res_.requests, q_, steps, o_.context, block_size, uniform_context, meta_rng_);
  bind_caches();
  allocate_io();
  routed_.assign(static_cast<size_t>(num_layers_), -1);

  // Which layers have a program at this width (the plan's step is the same object for every step).
  const dp_step* step = plan(DP_GRAPH_NONE);
  run_layer_.assign(static_cast<size_t>(num_layers_), true);
  res_.layers_run.clear();
  res_.layers_skipped.clear();
  missing_.clear();
  for (int32_t l = 0; l < num_layers_; ++l) {
    if (dp_step_layer_kernel(step, l)) {
      res_.layers_run.push_back(l);
      continue;
    }
    run_layer_[static_cast<size_t>(l)] = false;
    res_.layers_skipped.push_back(l);
    // dp_launch_layer says why (it refuses before looking at the io or launching anything).
    dp_layer_io io;
    dp_layer_io_init(&io);
    dp_status* st = dp_launch_layer(sh_.s, step, l, &io, stream_->s);
    missing_.push_back(fmt::format("layer {} ({}): {}", l, res_.layer_classes[static_cast<size_t>(l)],
                                   st ? dp_status_message(st) : "no program"));
    dp_status_free(st);
  }
}

const dp_step* Harness::plan(int32_t graph_mode) {
  std::vector<int32_t> qlens(static_cast<size_t>(width_), q_);
  dp_step_desc d;
  dp_step_desc_init(&d);
  d.num_requests = width_;  // padded requests included: the step runs at exactly this width
  d.query_lens = qlens.data();
  d.num_accepted = meta_.num_accepted.data();
  d.state_indices = meta_.state_indices.data();
  d.state_indices_stride = q_;
  d.block_table = meta_.block_table.data();
  d.block_table_stride = meta_.stride;
  d.block_table_cols = meta_.stride;
  d.graph_mode = graph_mode;
  dp_plan_result r;
  dp_plan_result_init(&r);
  rt(dp_plan(sh_.s, &d, &r), "dp_plan");
  // The host all-gathers the reasons over its TP group; one rank here.
  const int32_t verdict = dp_agree(&r.reason, 1, nullptr);
  if (verdict != DP_REASON_NONE)
    fail(Errc::internal, "the runtime refused the step at width {}: {}: {}", width_, dp_reason_name(verdict), r.message);
  if (r.width != width_)
    fail(Errc::internal, "dp_plan chose width {} for {} requests, expected {}", r.width, width_, width_);
  return r.step;
}

dp_layer_io Harness::layer_io(int layer) const {
  const size_t l = static_cast<size_t>(layer);
  dp_layer_io io;
  dp_layer_io_init(&io);
  io.hidden = hidden_bufs_[l];
  io.residual = residual_bufs_[l];
  io.out = hidden_bufs_[l + 1];
  io.residual_out = residual_bufs_[l + 1];
  io.positions = d_positions_;
  io.state_indices = d_state_indices_;
  io.block_table = d_block_table_;
  io.block_table_stride = meta_.stride;
  io.seq_lens = d_seq_lens_;
  io.slot_mapping = d_slot_mapping_;
  io.num_accepted = d_num_accepted_;
  return io;
}

void Harness::enqueue_step(const dp_step* step) {
  std::vector<int> layers;
  for (int32_t l = 0; l < num_layers_; ++l)
    if (run_layer_[static_cast<size_t>(l)]) layers.push_back(l);
  enqueue_layers(step, layers, true);
}

void Harness::enqueue_layers(const dp_step* step, const std::vector<int>& layers, bool final_norm) {
  dp_stream s = stream_->s;
  for (int l : layers) {
    // Prefetch points of the layer (the session has a table where it is worth it, and starts each
    // inside the layer's launch); one join closes the side stream at the end of the step.
    fork_prefetch(l);
    const dp_layer_io io = layer_io(l);
    rt(dp_launch_layer(sh_.s, step, l, &io, s), fmt::format("launching layer {} ({})", l, res_.layer_classes[l]));
  }
  if (final_norm) {
    dp_final_norm_io n;
    dp_final_norm_io_init(&n);
    n.hidden = hidden_bufs_.back();
    n.residual = residual_bufs_.back();
    n.out = final_out_;
    n.residual_out = final_residual_;
    rt(dp_launch_final_norm(sh_.s, step, &n, s), "launching the final norm");
  }
  join_prefetch();
}

void Harness::fork_prefetch(int layer) {
  for (int32_t point : {DP_PREFETCH_OPROJ_DOWN, DP_PREFETCH_ATTENTION_MOE, DP_PREFETCH_NEXT_ATTENTION,
                        DP_PREFETCH_ATTENTION_OPROJ})
    if (prefetch_points_ & (1u << point))
      rt(dp_prefetch_fork(sh_.s, point, layer, width_, stream_->s, nullptr), fmt::format("prefetch fork, layer {}", layer));
}

void Harness::join_prefetch() { rt(dp_prefetch_join(sh_.s, stream_->s), "prefetch join"); }

void Harness::launch_layer(const dp_step* step, int layer) {
  const dp_layer_io io = layer_io(layer);
  rt(dp_launch_layer(sh_.s, step, layer, &io, stream_->s),
     fmt::format("launching layer {} ({})", layer, res_.layer_classes[static_cast<size_t>(layer)]));
}

// Fresh inputs, the step's metadata, and poison in every output and in the cache rows the step only
// writes; the host mirrors of the caches get the same poison.
void Harness::upload_step_inputs(Rng& rng) {
  const Driver& d = *drv_;
  cuda::CUstream s = stream_->s;
  auto upload = [&](CUdeviceptr dst, const void* src, size_t bytes, const char* what) {
    d.check(d.MemcpyHtoDAsync(dst, src, bytes, s), "cuMemcpyHtoDAsync", what);
  };
  auto poison = [&](CUdeviceptr dst, size_t bytes) { d.check(d.MemsetD8Async(dst, 0xFF, bytes, s), "cuMemsetD8Async"); };
  auto random_rows = [&](CUdeviceptr dst) {
    std::vector<uint8_t> v(act_bytes_);
    for (size_t i = 0; i < v.size(); i += 2) put_bf16(v.data() + i, rng.nonzero(-1.0, 1.0));
    upload(dst, v.data(), v.size(), "input rows");
    sync();  // `v` is pageable and dies here
  };
  random_rows(hidden_bufs_[0]);
  for (int32_t l = 0; l < num_layers_; ++l) {
    const size_t next = static_cast<size_t>(l) + 1;
    if (run_layer_[static_cast<size_t>(l)]) {
      poison(hidden_bufs_[next], act_bytes_);
      poison(residual_bufs_[next], act_bytes_);
    } else {  // what the host's own layer would have produced: fresh rows for the next program
      random_rows(hidden_bufs_[next]);
      random_rows(residual_bufs_[next]);
    }
  }
  poison(final_out_, act_bytes_);
  poison(final_residual_, act_bytes_);
  upload(d_positions_, meta_.positions.data(), meta_.positions.size() * 8, "positions");
  upload(d_state_indices_, meta_.state_indices.data(), meta_.state_indices.size() * 4, "state indices");
  upload(d_block_table_, meta_.block_table.data(), meta_.block_table.size() * 4, "block table");
  upload(d_seq_lens_, meta_.seq_lens.data(), meta_.seq_lens.size() * 4, "seq lens");
  upload(d_slot_mapping_, meta_.slot_mapping.data(), meta_.slot_mapping.size() * 8, "slot mapping");
  upload(d_num_accepted_, meta_.num_accepted.data(), meta_.num_accepted.size() * 4, "num accepted");

  // Cache rows that are written before anything reads them: new MLA tokens, and with q > 1 the KDA
  // slots of draft positions other than num_accepted - 1 (the one the step reads).
  for (int32_t l = 0; l < num_layers_; ++l) {
    if (!run_layer_[static_cast<size_t>(l)]) continue;
    LayerCaches& lc = caches_[static_cast<size_t>(l)];
    if (!lc.kda) {
      Cache& c = *lc.find(DP_KV_MLA_LATENT);
      const size_t row = c.slot_bytes / static_cast<size_t>(c.desc.shape[1]);
      for (size_t t = 0; t < meta_.slot_mapping.size(); ++t) {
        const int64_t slot = meta_.slot_mapping[t];
        if (slot < 0) continue;
        poison(c.ptr + static_cast<size_t>(slot) * row, row);
        if (!c.host.empty()) std::memset(c.host.data() + static_cast<size_t>(slot) * row, 0xFF, row);
      }
      continue;
    }
    for (int r = 0; r < width_; ++r) {
      if (!meta_.real[r]) continue;
      for (int i = 0; i < q_; ++i) {
        if (i == meta_.num_accepted[r] - 1) continue;
        const int64_t slot = meta_.state_indices[static_cast<size_t>(r * q_ + i)];
        for (Cache& c : lc.c) {
          poison(c.ptr + static_cast<size_t>(slot) * c.slot_bytes, c.slot_bytes);
          if (!c.host.empty()) std::memset(c.host.data() + static_cast<size_t>(slot) * c.slot_bytes, 0xFF, c.slot_bytes);
        }
      }
    }
  }
}

std::unique_ptr<Graph> Harness::capture(const std::function<void()>& enqueue) {
  auto graph = std::make_unique<Graph>(*drv_);
  sync();
  drv_->check(drv_->StreamBeginCapture(stream_->s, cuda::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL), "cuStreamBeginCapture");
  try {
    enqueue();
  } catch (...) {
    cuda::CUgraph g = nullptr;
    drv_->StreamEndCapture(stream_->s, &g);
    if (g) drv_->GraphDestroy(g);
    throw;
  }
  drv_->check(drv_->StreamEndCapture(stream_->s, &graph->g), "cuStreamEndCapture");
  drv_->check(drv_->GraphInstantiate(&graph->exec, graph->g, 0), "cuGraphInstantiateWithFlags");
  return graph;
}

void Harness::refresh_cache_mirrors() {
  for (LayerCaches& lc : caches_)
    for (Cache& c : lc.c) c.host = download(c.ptr, c.bytes());
}

std::vector<uint8_t> Harness::download(CUdeviceptr p, size_t bytes) {
  std::vector<uint8_t> v(bytes);
  drv_->check(drv_->MemcpyDtoHAsync(v.data(), p, bytes, stream_->s), "cuMemcpyDtoHAsync");
  sync();
  return v;
}

void Harness::check_step(int index, const std::string& mode) {
  const model::Model& m = model_->m;
  const ref::StepMeta sm = meta_.step_meta();
  const int64_t T = res_.rows, H = hidden_;
  auto make_check = [&](int layer, const std::string& cls, const std::string& quantity, double value,
                        double limit) {
    RunCheck c;
    c.step = index;
    c.mode = mode;
    c.layer = layer;
    c.cls = cls;
    c.quantity = quantity;
    c.value = value;
    c.limit = limit;
    c.ok = std::isfinite(value) && value < limit;
    return c;
  };
  const std::vector<bool> valid = ref::valid_rows(sm, model::Mixer::kda);  // padding is the same for both mixers
  const ref::Options opt;

  // What the comparisons read comes off the device first (one stream); then the layers are compared
  // in parallel, each with its own reference weights, caches and results.
  struct LayerData {
    int32_t layer = 0;
    std::vector<uint8_t> hin, rin, hout, rout;
    std::vector<std::vector<uint8_t>> now;  // the caches as the GPU left them
    std::vector<RunCheck> checks;
    int64_t routed = -1;
  };
  std::vector<LayerData> data;
  for (int32_t l = 0; l < num_layers_; ++l) {
    if (!run_layer_[static_cast<size_t>(l)]) continue;
    const size_t li = static_cast<size_t>(l);
    LayerData d;
    d.layer = l;
    d.hin = download(hidden_bufs_[li], act_bytes_);
    if (l > 0) d.rin = download(residual_bufs_[li], act_bytes_);
    d.hout = download(hidden_bufs_[li + 1], act_bytes_);
    d.rout = download(residual_bufs_[li + 1], act_bytes_);
    for (const Cache& c : caches_[li].c) d.now.push_back(download(c.ptr, c.bytes()));
    data.push_back(std::move(d));
  }
  parallel_for(data.size(), check_threads, [&](size_t i) {
    LayerData& d = data[i];
    const int32_t l = d.layer;
    const size_t li = static_cast<size_t>(l);
    auto add = [&](int layer, const std::string& cls, const std::string& quantity, double value,
                   double limit) -> RunCheck& {
      d.checks.push_back(make_check(layer, cls, quantity, value, limit));
      return d.checks.back();
    };
    // A count that must be 0 (cache rows changed where the step must not write).
    auto add_count = [&](int layer, const std::string& cls, const std::string& quantity, int64_t n) {
      RunCheck& c = add(layer, cls, quantity, static_cast<double>(n), 0);
      c.kind = "count";
      c.ok = n == 0;
    };
      const std::string& cls = res_.layer_classes[li];
      ref::Mat hin = bf16_mat(d.hin, T, H);
      zero_rows(hin, valid);
      ref::Mat rin;
      if (l > 0) {
        rin = bf16_mat(d.rin, T, H);
        zero_rows(rin, valid);
      }
      const ref::Mat hout = bf16_mat(d.hout, T, H);
      const ref::Mat rout = bf16_mat(d.rout, T, H);

      if (!ref_weights_[li])
        ref_weights_[li] = std::make_unique<ref::LayerWeights>(m, l, source_->lookup(l), ref::Shard{tp_, o_.rank});
      LayerCaches& lc = caches_[li];
      ref::LayerState state;
      if (lc.kda) state.kda = kda_from_raw(m, ref::Shard{tp_, o_.rank}, lc, layouts_);
      else state.mla = mla_from_raw(m, lc);
      ref::Trace trace;
      ref::LayerOutput want =
          ref::decoder_layer(*ref_weights_[li], hin, l > 0 ? &rin : nullptr, sm, state, opt, &trace);
      const int64_t alternatives =
          match_near_ties(m, *source_, l, ref::Shard{tp_, o_.rank}, *ref_weights_[li], trace, hout, valid, opt, want.hidden);
      if (drop_reference_cache_) ref_weights_[li]->drop_cache();
      if (const auto it = trace.t.find("topk_ids"); it != trace.t.end()) {
        std::set<int64_t> experts;
        for (int64_t t = 0; t < it->second.rows; ++t)
          if (valid[static_cast<size_t>(t)])
            for (double e : it->second.row(t)) experts.insert(static_cast<int64_t>(e));
        d.routed = static_cast<int64_t>(experts.size());
      }
      add(l, cls,
          alternatives ? fmt::format("hidden ({} near-tie row{} rerouted)", alternatives, alternatives == 1 ? "" : "s")
                       : std::string("hidden"),
          ref::rel_error(hout, want.hidden, &valid), kBf16Limit);
      add(l, cls, "residual", ref::rel_error(rout, want.residual, &valid), kBf16Limit);

      // The caches as the GPU left them; the mirror becomes them, so the next step starts from the
      // GPU's state (the comparison of each step stands alone).
      const std::vector<std::vector<uint8_t>>& now = d.now;
      if (lc.kda) {
        std::set<int64_t> touched;
        for (int r = 0; r < width_; ++r)
          if (meta_.real[r])
            for (int i = 0; i < q_; ++i) touched.insert(meta_.state_indices[static_cast<size_t>(r * q_ + i)]);
        int64_t changed = 0;
        for (size_t k = 0; k < lc.c.size(); ++k)
          changed += changed_outside(lc.c[k].host, now[k], lc.c[k].slot_bytes, lc.c[k].elem, touched);
        const ref::KdaState before = kda_from_raw(m, ref::Shard{tp_, o_.rank}, lc, layouts_);
        for (size_t k = 0; k < lc.c.size(); ++k) lc.c[k].host = now[k];
        const ref::KdaState got = kda_from_raw(m, ref::Shard{tp_, o_.rank}, lc, layouts_);
        std::vector<double> gs, ws, gc, wc;
        ref::KdaState& ref_state = state.kda;
        for (int64_t s : touched) {
          for (int64_t j = 0; j < got.heads; ++j) {
            const size_t n = static_cast<size_t>(got.head_dim * got.head_dim);
            const size_t off = static_cast<size_t>((s * got.heads + j)) * n;
            gs.insert(gs.end(), got.recurrent.begin() + static_cast<std::ptrdiff_t>(off),
                      got.recurrent.begin() + static_cast<std::ptrdiff_t>(off + n));
            std::span<double> w = ref_state.slot_state(s, j);
            ws.insert(ws.end(), w.begin(), w.end());
          }
          for (int which = 0; which < 3; ++which) {
            const std::vector<double>& gv = which == 0 ? got.conv_q : which == 1 ? got.conv_k : got.conv_v;
            const std::vector<double>& wv = which == 0 ? ref_state.conv_q : which == 1 ? ref_state.conv_k : ref_state.conv_v;
            const size_t n = static_cast<size_t>(got.conv_dim * got.conv_width), off = static_cast<size_t>(s) * n;
            gc.insert(gc.end(), gv.begin() + static_cast<std::ptrdiff_t>(off), gv.begin() + static_cast<std::ptrdiff_t>(off + n));
            wc.insert(wc.end(), wv.begin() + static_cast<std::ptrdiff_t>(off), wv.begin() + static_cast<std::ptrdiff_t>(off + n));
          }
        }
        // The state limit. The state read is exact on both sides, so only this step's update S_new - S_read
        // can differ, and it is computed from bf16-rounded inputs (projections, conv outputs, gates): where
        // a GPU GEMM and the float64 reference round one such input to neighbouring bf16 values, the
        // update moves by up to one bf16 unit (2^-8) of its size. The limit is that, or 1e-4 when larger.
        double upd2 = 0, new2 = 0;
        for (int r = 0; r < width_; ++r) {
          if (!meta_.real[r]) continue;
          const int64_t src = meta_.state_indices[static_cast<size_t>(r * q_ + meta_.num_accepted[static_cast<size_t>(r)] - 1)];
          for (int i = 0; i < q_; ++i) {
            const int64_t dst = meta_.state_indices[static_cast<size_t>(r * q_ + i)];
            for (int64_t j = 0; j < got.heads; ++j) {
              const size_t n = static_cast<size_t>(got.head_dim * got.head_dim);
              const size_t off = static_cast<size_t>((src * got.heads + j)) * n;
              std::span<double> w = ref_state.slot_state(dst, j);
              for (size_t e = 0; e < n; ++e) {
                const double d = w[e] - before.recurrent[off + e];
                upd2 += d * d;
                new2 += w[e] * w[e];
              }
            }
          }
        }
        const double state_limit = std::max(kF32Limit, new2 > 0 ? std::ldexp(std::sqrt(upd2 / new2), -8) : 0.0);
        add(l, cls, fmt::format("kda state ({} slots)", touched.size()), ref::rel_error(gs, ws), state_limit);
        add(l, cls, "conv state q/k/v", ref::rel_error(gc, wc), kBf16Limit);
        add_count(l, cls, "other slots unchanged", changed);
      } else {
        Cache& c = lc.c[0];
        const int64_t bs = c.desc.shape[1];
        const size_t row_values = static_cast<size_t>(c.desc.shape[2]);
        std::set<int64_t> written;  // cache slots (block * block_size + offset) the step writes
        for (size_t t = 0; t < meta_.slot_mapping.size(); ++t)
          if (valid[t] && meta_.slot_mapping[t] >= 0) written.insert(meta_.slot_mapping[t]);
        // Every other row, bitwise.
        const int64_t changed = changed_outside(c.host, now[0], c.slot_bytes / static_cast<size_t>(bs), c.elem, written);
        c.host = now[0];
        const ref::MlaCache got = mla_from_raw(m, lc);
        std::vector<double> g, w;
        for (int64_t s : written) {
          const size_t off = static_cast<size_t>(s) * row_values;
          g.insert(g.end(), got.data.begin() + static_cast<std::ptrdiff_t>(off),
                   got.data.begin() + static_cast<std::ptrdiff_t>(off + row_values));
          w.insert(w.end(), state.mla.data.begin() + static_cast<std::ptrdiff_t>(off),
                   state.mla.data.begin() + static_cast<std::ptrdiff_t>(off + row_values));
        }
        add(l, cls, fmt::format("latent rows ({} written)", written.size()), ref::rel_error(g, w), kBf16Limit);
        add_count(l, cls, "other rows unchanged", changed);
      }
  });
  for (LayerData& d : data) {
    res_.checks.insert(res_.checks.end(), d.checks.begin(), d.checks.end());
    routed_[static_cast<size_t>(d.layer)] = d.routed;
  }

  // The final norm, from the rows the GPU fed it.
  ref::Mat h = bf16_mat(download(hidden_bufs_.back(), act_bytes_), T, H);
  ref::Mat r = bf16_mat(download(residual_bufs_.back(), act_bytes_), T, H);
  zero_rows(h, valid);
  zero_rows(r, valid);
  if (norm_weight_.empty()) norm_weight_ = ref::model_tensor(m, source_->lookup(-1), "norm.weight").data;
  const ref::AddNorm want = ref::fused_add_rms_norm(h, &r, norm_weight_, m.rms_norm_eps, opt.rounding);
  res_.checks.push_back(make_check(
      -1, "final_norm", "out", ref::rel_error(bf16_mat(download(final_out_, act_bytes_), T, H), want.x, &valid),
      kBf16Limit));
  res_.checks.push_back(make_check(
      -1, "final_norm", "residual",
      ref::rel_error(bf16_mat(download(final_residual_, act_bytes_), T, H), want.residual, &valid), kBf16Limit));
}

void Harness::open_bundle() { open_and_validate(); }

void Harness::open_device_and_weights() {
  open_device();
  bind_weights();
  log("kernels: loading every width's code objects");
  rt(dp_session_load_kernels(sh_.s), "loading kernels");
  if (o_.check) {
    ref_weights_.resize(static_cast<size_t>(num_layers_));
    // A real-shaped model does not fit in double on the host: keep only one layer's tensors at a time.
    drop_reference_cache_ = model_->m.total_weight_bytes() > (uint64_t{4} << 30);
  }
}

void Harness::run() {
  open_bundle();
  open_device_and_weights();
  set_width(o_.width, o_.requests, o_.steps + (o_.graph ? 1 : 0), false);
  if (!missing_.empty() && !o_.skip_missing)
    fail(Errc::input, "width {}: {} of {} layers have no program in the bundle, so the step cannot run on the GPU alone "
         "(--skip-missing runs the others, each fed fresh inputs):\n  {}", o_.width, missing_.size(), num_layers_,
         fmt::join(missing_, "\n  "));
  for (const std::string& s : missing_) log("skipped: " + s);

  // With --graph, one eager warm-up step (as a host runs before capturing), then one capture, and every
  // further step replays it with fresh contents in the captured buffers.
  const int total = o_.steps + (o_.graph ? 1 : 0);
  Rng input_rng(o_.seed ^ 0x1A9E7ull);
  for (int i = 1; i <= total; ++i) {
    const bool replay = o_.graph && i > 1;
    const std::string mode = replay ? "graph" : "eager";
    if (replay && !graph_) {
      const dp_step* captured = plan(DP_GRAPH_FULL);  // under FULL graphs a host plans at capture only
      graph_ = capture([&] { enqueue_step(captured); });
      log("graph: one step captured");
    }
    upload_step_inputs(input_rng);
    sync();
    const dp_step* st = replay ? nullptr : plan(DP_GRAPH_NONE);
    drv_->check(drv_->EventRecord(start_->e, stream_->s), "cuEventRecord");
    if (replay) drv_->check(drv_->GraphLaunch(graph_->exec, stream_->s), "cuGraphLaunch");
    else enqueue_step(st);
    drv_->check(drv_->EventRecord(stop_->e, stream_->s), "cuEventRecord");
    drv_->check(drv_->StreamSynchronize(stream_->s), "cuStreamSynchronize", fmt::format("running step {}", i));
    rt(dp_after_step(sh_.s), fmt::format("after step {}", i));
    float ms = 0;
    drv_->check(drv_->EventElapsedTime(&ms, start_->e, stop_->e), "cuEventElapsedTime");
    res_.steps.push_back({i, mode, ms});
    log(fmt::format("step {}/{} ({}): {:.3f} ms", i, total, mode, ms));
    if (o_.check) {
      res_.checked = true;
      check_step(i, mode);
    }
    meta_.advance(meta_rng_);
  }
}

RunResult run_bundle(const RunOptions& o) {
  if (o.width < 1) fail(Errc::usage, "--width {}: expected a batch width >= 1", o.width);
  if (o.steps < 1) fail(Errc::usage, "--steps {}: expected >= 1", o.steps);
  if (o.requests < 0) fail(Errc::usage, "--requests {}: expected 1..--width (0: all)", o.requests);
  if (o.context < 0) fail(Errc::usage, "--context {}: expected >= 0 tokens", o.context);
  if (o.rank < 0) fail(Errc::usage, "--rank {}: expected >= 0", o.rank);
  if (o.device < 0) fail(Errc::usage, "--device {}: expected a device ordinal >= 0", o.device);
  RunResult res;
  res.bundle = o.bundle;
  Harness h(o, res);
  h.run();
  return res;
}

}  // namespace dp::tools
