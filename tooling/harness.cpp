#include "tooling/harness.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <optional>
#include <ranges>
#include <set>
#include <span>
#include <thread>
#include <unordered_map>

#include <fmt/ranges.h>

#include "common/json.h"
#include "common/dtype.h"
#include "common/error.h"
#include "common/progress.h"
#include "decodepack/decodepack.h"
#include "model/ir.h"
#include "model/safetensors.h"
#include "model/synth.h"
#include "reference/layer.h"
#include "reference/numeric.h"
#include "tooling/check.h"
#include "tooling/device.h"
#include "common/parallel.h"

namespace dp::tools {

int RunResult::failures() const {
  return static_cast<int>(std::count_if(checks.begin(), checks.end(), [](const RunCheck& c) { return !c.ok; }));
}

void Harness::check_width(int width, int requests, const char* option) const {
  if (std::find(widths_.begin(), widths_.end(), width) == widths_.end())
    fail(Errc::usage, "{} {}: {} has no kernels for width {} (built widths: {})", option, width, o_.bundle, width,
         fmt::join(widths_, ", "));
  if (requests > width)
    fail(Errc::usage, "--requests {}: more than --width {} (the rest of a width's rows are padding)", requests, width);
}

void Harness::open_and_validate() {
  // libdecodepack's open, as a host does: the bundle is read once. What the harness needs beyond the
  // C API's tables (the deploy settings, the model config's digest, the kernel and prefetch tables
  // bench reads) comes from dp_bundle_info, not from a second reader.
  sh_.b = tools::open_bundle(o_.bundle);  // (the free function, not the phase of that name)
  dp_bundle_info info{};
  info.size = sizeof(info);
  rt(dp_bundle_get_info(sh_.b, &info), "bundle info");
  manifest_ = format::from_json(Json::parse(info.manifest_json), o_.bundle + ": manifest.json");
  deploy_ = deploy::parse_deploy(Json::parse(info.deploy_json), o_.bundle + ": deploy");
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
  if (tp_ > 1 && (!group_ || group_->size() != tp_ || group_->rank() != o_.rank))
    fail(Errc::usage, "{} is built for tensor_parallel {}: its layer programs all-reduce with their peer ranks, which "
         "`run` starts (one process per rank) and this command does not (build a tensor_parallel 1 bundle for it)",
         o_.bundle, tp_);

  const deploy::Deploy& d = deploy_;
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

  model_.emplace(resolve_model(o_.model, o_.random_weights, info.config_digest, o_.bundle));
  const model::Model& m = model_->m;
  res_.model = model_->source;
  if (m.num_layers != num_layers_ || m.hidden != hidden_)
    fail(Errc::input, "{}: {} layers of hidden size {}, the bundle has {} of {}", model_->source, m.num_layers, m.hidden,
         num_layers_, hidden_);
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
      std::vector<uint8_t> b = source_->rank_bytes(*spec, wi.split_dim, part, o_.rank);
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
  // K3: one attention-residual buffer for the model (its contents: upload_step_inputs).
  const AttnResBuffer ar =
      bind_attn_res(sh_.s, model_->m.attn_res_block, widths_, q_,
                    [&](size_t bytes, const std::string& what) { return width_mem_->alloc(bytes, what); });
  attn_res_ = ar.data;
  attn_res_blocks_ = ar.blocks;
  attn_res_stride_ = ar.stride;
  total += ar.bytes;
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
  const int64_t block_size = deploy_.kv_cache.block_size;
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
  // The host all-gathers the reasons over its TP group (every rank plans the same steps in the same
  // order) and runs the step specialised only when every rank can.
  std::vector<int32_t> reasons{r.reason};
  if (group_) {
    const std::string name = fmt::format("plan.{}", plans_);
    group_->publish(name, &r.reason, sizeof(r.reason));
    const std::vector<std::vector<uint8_t>> all = group_->gather(name);
    reasons.clear();
    for (const std::vector<uint8_t>& b : all) {
      int32_t v = DP_REASON_INVALID;
      if (b.size() == 4) std::memcpy(&v, b.data(), 4);
      reasons.push_back(v);
    }
  }
  ++plans_;
  int32_t refusing = -1;
  const int32_t verdict = dp_agree(reasons.data(), static_cast<int32_t>(reasons.size()), &refusing);
  if (verdict != DP_REASON_NONE)
    fail(Errc::internal, "the runtime refused the step at width {} (rank {}): {}: {}", width_, refusing,
         dp_reason_name(verdict), refusing == o_.rank ? r.message : "see that rank's message");
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
  if (attn_res_) {
    // The step's blocks: poisoned (a block read before this step wrote it shows as NaN), except those
    // a layer the host runs itself would have pushed: random rows, like its hidden and residual.
    const int64_t B = model_->m.attn_res_block, H = hidden_;
    std::vector<uint8_t> v(static_cast<size_t>(res_.rows * attn_res_stride_) * 2, 0xFF);
    for (int32_t l = 0; l < num_layers_; l += static_cast<int32_t>(B))
      if (!run_layer_[static_cast<size_t>(l)])
        for (int64_t t = 0; t < res_.rows; ++t)
          for (int64_t i = 0; i < H; ++i)
            put_bf16(v.data() + static_cast<size_t>(t * attn_res_stride_ + (l / B) * H + i) * 2, rng.nonzero(-1.0, 1.0));
    upload(attn_res_, v.data(), v.size(), "attention-residual blocks");
    sync();  // `v` is pageable and dies here
  }
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

// Tensor parallelism: every rank allocates its exchange buffer (an allocation of its own, so that its
// CUDA IPC handle maps exactly it), publishes the handle, opens the others' and gives the session every
// rank's address; dp_session_set_peers zeroes this rank's buffer, and the barrier after it keeps every
// rank from launching before all buffers are zeroed.
void Harness::connect_peers() {
  const Driver& d = *drv_;
  if (!d.IpcGetMemHandle || !d.IpcOpenMemHandle)
    fail(Errc::device, "tensor_parallel {}: the CUDA driver ({}) has no CUDA IPC entry points", tp_, d.library);
  const uint64_t bytes = dp_session_exchange_bytes(sh_.s);
  if (bytes == 0) fail(Errc::internal, "tensor_parallel {}: the session needs no exchange buffer", tp_);
  exchange_ = mem_->alloc(bytes, "all-reduce exchange buffer");
  cuda::CUipcMemHandle mine;
  d.check(d.IpcGetMemHandle(&mine, exchange_), "cuIpcGetMemHandle", "the all-reduce exchange buffer");
  group_->publish("ipc", &mine, sizeof(mine));
  const std::vector<std::vector<uint8_t>> handles = group_->gather("ipc");
  std::vector<uint64_t> peers(static_cast<size_t>(tp_));
  for (int p = 0; p < tp_; ++p) {
    if (p == o_.rank) {
      peers[static_cast<size_t>(p)] = exchange_;
      continue;
    }
    cuda::CUipcMemHandle h;
    if (handles[static_cast<size_t>(p)].size() != sizeof(h))
      fail(Errc::internal, "rank {}'s IPC handle: {} bytes", p, handles[static_cast<size_t>(p)].size());
    std::memcpy(&h, handles[static_cast<size_t>(p)].data(), sizeof(h));
    CUdeviceptr ptr = 0;
    d.check(d.IpcOpenMemHandle(&ptr, h, cuda::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS), "cuIpcOpenMemHandle",
            fmt::format("rank {}'s exchange buffer", p));
    opened_peers_.push_back(ptr);
    peers[static_cast<size_t>(p)] = ptr;
  }
  const uint32_t timeout = o_.allreduce_timeout_us;
  rt(dp_session_set_peers(sh_.s, peers.data(), tp_, timeout), "binding the ranks' exchange buffers");
  group_->barrier("peers");
  log(fmt::format("tensor parallel: rank {} of {}, exchange buffers of {} bound (wait bound {} ms)", o_.rank, tp_,
                  human_bytes(bytes), timeout / 1000));
}

// Rank > 0 under --check: what rank 0 needs to check this rank's part of the step (check_step), per
// layer run: every cache as the step read it (the mirror) and as the GPU left it, then the layer's
// output rows. The mirror then becomes the GPU's caches, as rank 0's do.
void Harness::send_check_data(int index) {
  std::vector<uint8_t> blob;
  auto put = [&](const std::vector<uint8_t>& v) { blob.insert(blob.end(), v.begin(), v.end()); };
  for (int32_t l = 0; l < num_layers_; ++l) {
    const size_t li = static_cast<size_t>(l);
    if (!run_layer_[li]) continue;
    for (Cache& c : caches_[li].c) {
      std::vector<uint8_t> now = download(c.ptr, c.bytes());
      put(c.host);
      put(now);
      c.host = std::move(now);
    }
    put(download(hidden_bufs_[li + 1], act_bytes_));
    put(download(residual_bufs_[li + 1], act_bytes_));
  }
  group_->publish(fmt::format("check.{}", index), blob);
}

// The fault tests of tensor parallelism (--tp-fault skip:R:L or die:R:L): one eager step in which rank R
// does not launch layer L (skip), or launches the layers before L and then its process exits (die). The
// other ranks' all-reduce waits for R give up after the bound; every surviving rank must then finish the
// step (no hang) and dp_after_step must report the gave-up wait (DP_ERR_ABORTED) on every one. Rank 0
// gathers each survivor's report and wall time into the checks (kind "fault": value = the step's wall
// milliseconds, limit = 3 bounds + 2 s). The session refuses further steps after such a report (the
// runtime's contract: the engine restarts), so the run ends there.
void Harness::run_fault_step() {
  const std::string& f = o_.tp_fault;
  const size_t c1 = f.find(':'), c2 = c1 == std::string::npos ? c1 : f.find(':', c1 + 1);
  const std::string kind = f.substr(0, c1);
  int fault_rank = -1, fault_layer = -1;
  if (c2 != std::string::npos) {
    fault_rank = std::atoi(f.substr(c1 + 1, c2 - c1 - 1).c_str());
    fault_layer = std::atoi(f.substr(c2 + 1).c_str());
  }
  if ((kind != "skip" && kind != "die") || c2 == std::string::npos || fault_rank < 0 || fault_rank >= tp_ ||
      fault_layer < 0 || fault_layer >= num_layers_ || (kind == "die" && fault_rank == 0) || tp_ < 2)
    fail(Errc::usage, "--tp-fault {}: expected skip:RANK:LAYER or die:RANK:LAYER (die: rank >= 1, it must not be the "
         "rank that reports) with a rank of tensor_parallel {} > 1 and a layer of {}", f, tp_, num_layers_);
  Rng input_rng(o_.seed ^ 0x1A9E7ull);
  upload_step_inputs(input_rng);
  sync();
  const dp_step* st = plan(DP_GRAPH_NONE);
  group_->barrier("step.1");
  std::vector<int> layers;
  for (int32_t l = 0; l < num_layers_; ++l) {
    if (!run_layer_[static_cast<size_t>(l)]) continue;
    if (o_.rank == fault_rank && l == fault_layer) {
      if (kind == "skip") continue;
      enqueue_layers(st, layers, false);
      log(fmt::format("fault test: exiting before layer {}", l));
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(0);  // dies mid-step: no teardown, the kernels already queued are ended with the process
    }
    layers.push_back(l);
  }
  const auto t0 = std::chrono::steady_clock::now();
  enqueue_layers(st, layers, true);
  drv_->check(drv_->StreamSynchronize(stream_->s), "cuStreamSynchronize", "the fault step");
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::string report = "no report: dp_after_step returned success";
  bool reported = false;
  if (dp_status* s = dp_after_step(sh_.s)) {
    reported = dp_status_code(s) == DP_ERR_ABORTED;
    report = fmt::format("{} ({})", dp_status_message(s), dp_code_name(dp_status_code(s)));
    dp_status_free(s);
  }
  log(fmt::format("fault test: step ended after {:.0f} ms: {}", ms, report));
  res_.steps.push_back({1, "eager", ms});
  res_.checked = true;
  const std::string mine = fmt::format("{}\n{}\n{}", reported ? 1 : 0, ms, report);
  if (o_.rank != 0) {
    group_->publish("fault", mine.data(), mine.size());
    return;
  }
  const double limit = 3.0 * o_.allreduce_timeout_us / 1000.0 + 2000.0;
  for (int p = 0; p < tp_; ++p) {
    if (kind == "die" && p == fault_rank) continue;
    std::string r = mine;
    if (p != 0) {
      const std::vector<uint8_t> b = group_->receive("fault", p);
      r.assign(b.begin(), b.end());
    }
    const size_t a = r.find('\n'), b = r.find('\n', a + 1);
    RunCheck c;
    c.step = 1;
    c.mode = "eager";
    c.layer = fault_layer;
    c.cls = fmt::format("tp fault {} rank {}", kind, fault_rank);
    c.quantity = fmt::format("rank {} reports: {}", p, b == std::string::npos ? r : r.substr(b + 1));
    c.kind = "fault";
    c.value = std::atof(r.substr(a + 1, b - a - 1).c_str());
    c.limit = limit;
    c.ok = r.starts_with("1") && c.value < limit;
    res_.checks.push_back(c);
  }
}

void Harness::open_bundle() { open_and_validate(); }

// An NCCL width (format 1.8): rank 0 makes the unique id, every rank receives it through the rendezvous
// and creates its communicator; ncclCommInitRank returns once all ranks have called it. The library is
// --nccl, else $DECODEPACK_NCCL (as indexer-run), else the runtime's default (libnccl.so.2).
void Harness::connect_nccl() {
  const char* env = std::getenv("DECODEPACK_NCCL");
  const std::string lib = !o_.nccl.empty() ? o_.nccl : env && *env ? env : "";
  const char* library = lib.empty() ? nullptr : lib.c_str();
  std::vector<uint8_t> id(128);
  if (o_.rank == 0) {
    rt(dp_nccl_get_unique_id(library, id.data()), "making the NCCL unique id");
    group_->publish("nccl_id", id);
  } else {
    id = group_->receive("nccl_id", 0);
    if (id.size() != 128) fail(Errc::internal, "rank 0's NCCL unique id: {} bytes, expected 128", id.size());
  }
  rt(dp_session_init_nccl(sh_.s, id.data(), library),
     fmt::format("creating the NCCL communicator (rank {} of {} on device {})", o_.rank, tp_, o_.device));
  log(fmt::format("tensor parallel: rank {} of {}, NCCL communicator on device {} (width {} all-reduces with NCCL)",
                  o_.rank, tp_, o_.device, o_.width));
}

void Harness::open_device_and_weights() {
  open_device();
  bind_weights();
  if (tp_ > 1) {
    if (dp_session_exchange_bytes(sh_.s)) connect_peers();
    std::vector<int32_t> nccl(64);
    nccl.resize(static_cast<size_t>(std::max(0, dp_session_nccl_widths(sh_.s, nccl.data(), 64))));
    if (std::find(nccl.begin(), nccl.end(), o_.width) != nccl.end()) {
      if (!o_.tp_fault.empty())
        fail(Errc::usage, "--tp-fault at width {}: the bundle all-reduces with NCCL there, whose collectives have no "
             "bounded wait to give up; the fault tests are the in-kernel path's (run a width built with \"allreduce\": "
             "\"in_kernel\")", o_.width);
      connect_nccl();
    }
  }
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

  if (!o_.tp_fault.empty()) {
    run_fault_step();
    return;
  }
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
    if (group_) group_->barrier(fmt::format("step.{}", i));  // the ranks' all-reduces wait for each other
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
      if (group_ && group_->rank() != 0) send_check_data(i);
      else check_step(i, mode);
    }
    meta_.advance(meta_rng_);
  }
}

namespace {

// Whether `bundle`'s programs at `width` all-reduce with NCCL: a host-only session (no driver needed)
// answers, before any rank starts.
bool nccl_at_width(const std::string& bundle, int tp, int width) {
  dp_bundle* b = open_bundle(bundle);
  dp_session_options so;
  dp_session_options_init(&so);
  so.device = DP_DEVICE_NONE;
  so.rank = 0;
  so.tensor_parallel = tp;
  dp_session* s = nullptr;
  dp_status* st = dp_session_create(b, &so, &s);
  std::vector<int32_t> w(64);
  if (!st) w.resize(static_cast<size_t>(std::max(0, dp_session_nccl_widths(s, w.data(), 64))));
  else w.clear();
  dp_status_free(st);
  if (s) dp_session_destroy(s);
  dp_bundle_close(b);
  return std::find(w.begin(), w.end(), width) != w.end();
}

}  // namespace

RunResult run_bundle(const RunOptions& o) {
  if (o.width < 1) fail(Errc::usage, "--width {}: expected a batch width >= 1", o.width);
  if (o.steps < 1) fail(Errc::usage, "--steps {}: expected >= 1", o.steps);
  if (o.requests < 0) fail(Errc::usage, "--requests {}: expected 1..--width (0: all)", o.requests);
  if (o.context < 0) fail(Errc::usage, "--context {}: expected >= 0 tokens", o.context);
  if (o.rank < 0) fail(Errc::usage, "--rank {}: expected >= 0", o.rank);
  if (o.device < 0) fail(Errc::usage, "--device {}: expected a device ordinal >= 0", o.device);
  RunResult res;
  res.bundle = o.bundle;
  // A tensor_parallel > 1 bundle runs every rank, each a process of its own (forked here, before any
  // driver call), all on --device.
  int tp = 1;
  {
    dp_bundle* b = open_bundle(o.bundle);
    dp_bundle_info info{};
    info.size = sizeof(info);
    dp_status* st = dp_bundle_get_info(b, &info);
    tp = st ? 1 : info.tensor_parallel;
    std::vector<int32_t> ranks(info.ranks, info.ranks + (st ? 0 : info.num_ranks));
    dp_status_free(st);
    dp_bundle_close(b);
    if (tp > 1) {
      if (o.rank != 0)
        fail(Errc::usage, "--rank {}: {} is built for tensor_parallel {}, and run starts every rank (one process each; "
             "rank 0's step times are reported)", o.rank, o.bundle, tp);
      if (static_cast<int>(ranks.size()) != tp)
        fail(Errc::usage, "{}: built for tensor_parallel {} but holds ranks {} only; run needs every rank", o.bundle, tp,
             fmt::join(ranks, ", "));
    }
  }
  // Each rank's device: --devices, or every rank on --device (CUDA IPC works within one device). A
  // width that all-reduces with NCCL needs a GPU per rank.
  if (!o.devices.empty() && static_cast<int>(o.devices.size()) != tp)
    fail(Errc::usage, "--devices {}: {} devices for tensor_parallel {}, expected one per rank", fmt::join(o.devices, ","),
         o.devices.size(), tp);
  for (int dev : o.devices)
    if (dev < 0) fail(Errc::usage, "--devices {}: device {}, expected ordinals >= 0", fmt::join(o.devices, ","), dev);
  auto device_of = [&](int rank) { return o.devices.empty() ? o.device : o.devices[static_cast<size_t>(rank)]; };
  if (tp > 1 && nccl_at_width(o.bundle, tp, o.width)) {
    std::set<int> distinct;
    for (int r = 0; r < tp; ++r) distinct.insert(device_of(r));
    if (static_cast<int>(distinct.size()) != tp)
      fail(Errc::usage, "{}: width {} all-reduces with NCCL (the deploy's \"allreduce\"), and NCCL refuses two ranks "
           "on one GPU: give each of the {} ranks its own device with --devices (e.g. --devices {}), or rebuild with "
           "\"allreduce\": \"in_kernel\" to run every rank on one GPU{}", o.bundle, o.width, tp,
           fmt::join(std::views::iota(0, tp), ","),
           o.devices.empty() ? fmt::format(" (now every rank is on --device {})", o.device) : "");
  }
  if (tp == 1) {
    RunOptions r1 = o;
    r1.device = device_of(0);
    Harness h(r1, res);
    h.run();
    return res;
  }
  RankGroup group(tp, [&](int rank, RankGroup& g) {
    RunOptions ro = o;
    ro.rank = rank;
    ro.device = device_of(rank);
    ro.log = [rank, log = o.log](const std::string& s) {
      if (log) log(fmt::format("rank {}: {}", rank, s));
    };
    RunResult rr;
    Harness h(ro, rr, &g);
    h.run();
  });
  RunOptions r0 = o;
  r0.device = device_of(0);
  r0.log = [log = o.log](const std::string& s) {
    if (log) log("rank 0: " + s);
  };
  Harness h(r0, res, &group);
  h.run();
  group.join();
  return res;
}

AttnResBuffer bind_attn_res(dp_session* s, int64_t attn_res_block, const std::vector<int32_t>& widths, int q,
                            const std::function<CUdeviceptr(size_t, const std::string&)>& alloc) {
  AttnResBuffer b;
  if (attn_res_block <= 0) return b;
  if (widths.empty()) fail(Errc::internal, "the attention-residual buffer: no widths to size it for");
  // Rows for the largest width the bundle holds, whatever width runs (the session refuses fewer).
  b.rows = static_cast<int64_t>(*std::max_element(widths.begin(), widths.end())) * q;
  dp_tensor t;
  rt(dp_session_kv_layout(s, -1, DP_KV_ATTN_RES, b.rows, &t), "attention-residual buffer layout");
  b.blocks = t.shape[1];
  b.stride = t.strides[0];
  b.bytes = static_cast<size_t>(b.rows * b.stride) * dp_dtype_size(t.dtype);
  b.data = alloc(b.bytes, "attention-residual blocks");
  t.data = b.data;
  rt(dp_session_bind_kv(s, -1, DP_KV_ATTN_RES, &t), "binding the attention-residual buffer");
  return b;
}

}  // namespace dp::tools
