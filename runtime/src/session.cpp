#include "src/session.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "src/allreduce.h"
#include "src/planner.h"
#include "src/prefetch_points.h"
#include "src/targets.h"
#include "src/validity.h"

using namespace dp::rt;
namespace format = dp::format;

namespace {

// The kernels read 16-byte vectors, and the prefetch kernel walks 16-byte chunks.
constexpr uint64_t kAlign = 16;
constexpr size_t kMaxParamBytes = 4096;  // validity.cpp refuses larger parameter blocks

const char* kv_kind_name(int32_t kind) {
  switch (kind) {
    case DP_KV_KDA_STATE: return "DP_KV_KDA_STATE";
    case DP_KV_CONV_Q: return "DP_KV_CONV_Q";
    case DP_KV_CONV_K: return "DP_KV_CONV_K";
    case DP_KV_CONV_V: return "DP_KV_CONV_V";
    case DP_KV_MLA_LATENT: return "DP_KV_MLA_LATENT";
    case DP_KV_ATTN_RES: return "DP_KV_ATTN_RES";
    default: return "?";
  }
}


// Whether the bundle's kernels for `target` take programmatic dependent launch: NVIDIA sm_90 and later,
// built by a compiler of format 1.3 or later (whose entry points wait for the previous kernel before
// they read anything; older kernels would race with it).
bool takes_programmatic_launch(const dp_bundle& b, const std::string& target) {
  const dp::format::Manifest& m = b.manifest();
  if (m.format_version.major != 1 || m.format_version.minor < 3) return false;
  if (target.rfind("sm_", 0) != 0) return false;
  int cc = 0;
  for (size_t i = 3; i < target.size() && target[i] >= '0' && target[i] <= '9'; ++i) cc = cc * 10 + (target[i] - '0');
  return cc >= 90;
}

std::string dims_text(const int64_t* v, int32_t n) {
  return fmt::format("[{}]", fmt::join(std::vector<int64_t>(v, v + std::max(n, 0)), ", "));
}
std::string dims_text(const std::vector<int64_t>& v) { return fmt::format("[{}]", fmt::join(v, ", ")); }

// Bytes from the first to one past the last element a strided view touches (0 for an empty view).
uint64_t span_bytes(const dp_tensor& t) {
  uint64_t last = 0;
  for (int32_t i = 0; i < t.ndim; ++i) {
    if (t.shape[i] == 0) return 0;
    last += static_cast<uint64_t>(t.shape[i] - 1) * static_cast<uint64_t>(t.strides[i]);
  }
  return (last + 1) * dp_dtype_size(t.dtype);
}

template <typename T>
void put(uint8_t* block, uint32_t offset, T v) {
  std::memcpy(block + offset, &v, sizeof(T));
}

}  // namespace

std::string dp_session::label() const {
  return fmt::format("session (rank {}, {}, target {})", options.rank,
                     device ? fmt::format("device {}", ordinal) : std::string("host-only"), target);
}

Result<dp_session*> dp_session::create(dp_bundle* b, const dp_session_options& o) {
  const DeploySettings& d = b->deploy;
  if (o.rank < 0) return error(DP_ERR_INVALID_ARGUMENT, "session options: rank {}, expected >= 0", o.rank);
  DP_RETURN_IF_ERROR(check_rank(*b, o.rank));
  if (o.tensor_parallel != 0 && o.tensor_parallel != d.tensor_parallel)
    return error(DP_ERR_RANK, "{}: the host runs tensor_parallel {}, the bundle was built for tensor_parallel {}: use a "
                 "bundle built for tensor_parallel {}", b->reader.label(), o.tensor_parallel, d.tensor_parallel,
                 o.tensor_parallel);
  if (o.num_speculative_tokens >= 0 && o.num_speculative_tokens + 1 != d.q)
    return error(DP_ERR_CONFIG, "{}: the host runs num_speculative_tokens {}, the bundle was built for {} (q = {} rows "
                 "per request): rebuild with \"num_speculative_tokens\": {}", b->reader.label(),
                 o.num_speculative_tokens, d.q - 1, d.q, o.num_speculative_tokens);

  auto s = std::make_unique<dp_session>();
  s->options = o;
  s->ordinal = o.device;
  const std::string asked = o.target ? o.target : "";
  if (o.device == DP_DEVICE_NONE) {
    if (o.device_desc) {
      DP_RETURN_IF_ERROR(check_device(*b, *o.device_desc, -1, &s->target, asked));
    } else if (!asked.empty()) {
      if (std::find(d.targets.begin(), d.targets.end(), asked) == d.targets.end())
        return error(DP_ERR_TARGET, "{}: session options: target {} is not one of the bundle's targets ({})",
                     b->reader.label(), asked, fmt::join(d.targets, ", "));
      s->target = asked;
    } else {
      s->target = d.targets.front();
    }
  } else {
    if (o.device < 0) return error(DP_ERR_INVALID_ARGUMENT, "session options: device {}, expected an ordinal >= 0 or "
                                   "DP_DEVICE_NONE ({})", o.device, DP_DEVICE_NONE);
    auto dev = open_device(o.vendor, o.device);
    if (!dev.ok()) return dev.status();
    s->device = std::move(*dev);
    DP_RETURN_IF_ERROR(check_device(*b, s->device->desc(), o.device, &s->target, asked));
  }
  DP_RETURN_IF_ERROR(check_kernels(*b, s->target));
  s->programmatic = s->device && !(o.flags & DP_SESSION_NO_PDL) && takes_programmatic_launch(*b, s->target);

  s->weights = b->rank_weights(o.rank);
  for (const WeightSpec& w : s->weights->weights) {
    WeightBinding wb;
    wb.data.assign(w.entry->experts > 0 ? static_cast<size_t>(w.entry->experts) : 1, 0);
    s->bindings.push_back(std::move(wb));
  }
  const format::Manifest& m = b->manifest();
  s->kv.resize(m.layers.size());
  for (size_t i = 0; i < d.widths.size(); ++i) {
    auto step = std::make_unique<dp_step>();
    step->session = s.get();
    step->width = d.widths[i];
    step->q = d.q;
    step->index = i;
    step->layer_program.assign(m.layers.size(), 0);
    step->program.assign(m.layers.size(), nullptr);
    step->why_not.assign(m.layers.size(), {});
    for (const format::LayerEntry& l : m.layers) {
      const format::ProgramEntry* prog = nullptr;
      for (const format::ProgramEntry& p : m.programs)
        if (p.cls == l.cls && p.width == d.widths[i]) prog = &p;
      if (!prog)
        step->why_not[l.index] = m.format_version.minor < 1
                                     ? fmt::format("the bundle (format {}.{}) predates layer programs (format 1.1)",
                                                   m.format_version.major, m.format_version.minor)
                                     : "the bundle has no program for this layer class at this width";
      else if (prog->steps.empty())
        step->why_not[l.index] = "the build made no program: " + prog->reason;
      else
        step->layer_program[l.index] = 1, step->program[l.index] = prog;
      if (prog)
        for (const format::ProgramStepEntry& st : prog->steps) step->nccl |= !st.collective.empty();
    }
    s->steps.push_back(std::move(step));
  }
  for (const format::KernelEntry& k : m.kernels)
    if (k.role == "lm_head" && k.target == s->target)
      for (auto& step : s->steps) step->lm_head |= step->width == k.width;
  s->flag_host = &s->host_flag_storage;
  if (s->device) {
    DeviceScope scope(s->device.get());
    DP_RETURN_IF_ERROR(scope.status());
    void* host = nullptr;
    DP_RETURN_IF_ERROR(s->device->alloc_mapped(sizeof(uint32_t), "the session's error flag word", &host, &s->flag_device));
    s->flag_host = static_cast<uint32_t*>(host);
  }
  b->retain();
  s->bundle = b;
  return s.release();
}

dp_session::~dp_session() {
  if (device) {
    DeviceScope scope(device.get());
    if (scope.status().ok()) {
      for (void* e : events) device->destroy_event(e);
      if (join_event) device->destroy_event(join_event);
      if (side_stream) device->destroy_stream(side_stream);
      for (void* m : modules) device->unload_module(m);
      if (prefetch_tables) device->free(prefetch_tables);
      for (uint64_t t : capped_tables) device->free(t);
      if (workspace) device->free(workspace);
      if (peers_table) device->free(peers_table);
      // A communicator the session created; its pending work on the session's streams is the host's
      // to have finished, as for every buffer here.
      if (nccl_comm && nccl_owned) nccl->CommDestroy(nccl_comm);
      if (flag_host && flag_host != &host_flag_storage) device->free_mapped(flag_host);
    }
  }
  steps.clear();
  device.reset();
  if (bundle) bundle->release();
}

// ---- Tensors ------------------------------------------------------------------------------------------

Status dp_session::check_tensor(const std::string& what, const dp_tensor& t, dp_dtype dtype,
                                const std::vector<int64_t>& shape, bool lead_free, dp_code shape_code) const {
  if (t.ndim < 0 || t.ndim > DP_MAX_DIMS)
    return error(DP_ERR_INVALID_ARGUMENT, "{}: ndim {}, expected 0..{}", what, t.ndim, DP_MAX_DIMS);
  if (t.dtype != dtype)
    return error(DP_ERR_DTYPE, "{}: dtype {}, expected {}", what, dp_dtype_name(t.dtype), dp_dtype_name(dtype));
  bool same = static_cast<size_t>(t.ndim) == shape.size();
  for (size_t i = lead_free ? 1 : 0; same && i < shape.size(); ++i) same = t.shape[i] == shape[i];
  if (same && lead_free && t.shape[0] < 1) same = false;
  if (!same) {
    std::vector<std::string> want;
    for (size_t i = 0; i < shape.size(); ++i) want.push_back(lead_free && i == 0 ? "N" : std::to_string(shape[i]));
    return error(shape_code, "{}: shape {}, expected [{}]{}", what, dims_text(t.shape, t.ndim), fmt::join(want, ", "),
                 lead_free ? " (N >= 1 slots or blocks)" : "");
  }
  // Dense rows: every dimension (but a free leading one) has the row-major stride; size-1 dimensions
  // are never stepped over, so their stride does not matter (PyTorch reports various values there).
  int64_t expect = 1;
  bool dense = true;
  for (int32_t i = t.ndim - 1; i >= (lead_free ? 1 : 0); --i) {
    if (t.shape[i] != 1 && t.strides[i] != expect) dense = false;
    expect *= t.shape[i];
  }
  if (!dense || (lead_free && t.ndim > 0 && t.shape[0] > 1 && t.strides[0] < expect)) {
    std::vector<int64_t> want(t.ndim);
    int64_t e = 1;
    for (int32_t i = t.ndim - 1; i >= 0; --i) {
      want[i] = e;
      e *= t.shape[i];
    }
    return error(DP_ERR_LAYOUT, "{}: strides {}, expected {}{} (the kernels read {} as dense rows)", what,
                 dims_text(t.strides, t.ndim), dims_text(want), lead_free ? " or a larger first stride" : "",
                 lead_free ? "each slot/block" : "weights");
  }
  if (t.data == 0) return error(DP_ERR_INVALID_ARGUMENT, "{}: data address is 0", what);
  if (t.data % kAlign)
    return error(DP_ERR_ALIGNMENT, "{}: address {:#x} is not a multiple of {} bytes (it is {} past one)", what, t.data,
                 kAlign, t.data % kAlign);
  if (lead_free && t.ndim > 0 && t.shape[0] > 1 &&
      (static_cast<uint64_t>(t.strides[0]) * dp_dtype_size(t.dtype)) % kAlign)
    return error(DP_ERR_ALIGNMENT, "{}: first-dimension stride {} elements ({} bytes) is not a multiple of {} bytes", what,
                 t.strides[0], static_cast<uint64_t>(t.strides[0]) * dp_dtype_size(t.dtype), kAlign);
  return ok();
}

// ---- Weights ------------------------------------------------------------------------------------------

namespace {

// The group and expert a per-expert name refers to: each run of digits in `name` is tried as "{e}".
bool find_expert(const RankWeights& rw, const std::string& name, size_t* index, int64_t* expert) {
  for (size_t i = 0; i < name.size();) {
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < name.size() && std::isdigit(static_cast<unsigned char>(name[j]))) ++j;
    const std::string pattern = name.substr(0, i) + "{e}" + name.substr(j);
    auto it = rw.by_name.find(pattern);
    if (it != rw.by_name.end() && j - i <= 9 && (j - i == 1 || name[i] != '0')) {
      *index = it->second;
      *expert = std::stoll(name.substr(i, j - i));
      return true;
    }
    i = j;
  }
  return false;
}

std::string shard_note(const format::WeightEntry& w) {
  if (w.split_dim < 0) return {};
  return fmt::format(" (this rank's shard: range [{}, {}) of dimension {} of the full tensor)", w.begin, w.end,
                     w.split_dim);
}

}  // namespace

Status dp_session::bind_weight(const std::string& name, const dp_tensor& t) {
  size_t index = 0;
  int64_t expert = -1;
  if (auto it = weights->by_name.find(name); it != weights->by_name.end()) {
    index = it->second;
    if (weights->weights[index].entry->experts > 0)
      return error(DP_ERR_INVALID_ARGUMENT, "weight {} (rank {}) is an expert group: bind it with "
                   "dp_session_bind_expert_weights, or each expert by its name with {{e}} replaced by the expert index",
                   name, options.rank);
  } else if (!find_expert(*weights, name, &index, &expert)) {
    return error(DP_ERR_UNKNOWN_TENSOR, "weight {}: not a weight of rank {} in {} (it lists {} weights; embeddings and "
                 "the LM head stay with the host)", name, options.rank, bundle->reader.label(), weights->weights.size());
  }
  const WeightSpec& spec = weights->weights[index];
  if (expert >= spec.entry->experts)
    return error(DP_ERR_UNKNOWN_TENSOR, "weight {}: expert {} of group {}, which has experts 0..{} on rank {}", name, expert,
                 spec.entry->name, spec.entry->experts - 1, options.rank);
  const std::string what = fmt::format("weight {} (rank {})", name, options.rank);
  const Status st = check_tensor(what, t, spec.dtype, spec.entry->shape, false, DP_ERR_SHAPE);
  if (!st.ok() && st.code() == DP_ERR_SHAPE) return Status(st.code(), st.message() + shard_note(*spec.entry));
  DP_RETURN_IF_ERROR(st);
  WeightBinding& b = bindings[index];
  uint64_t& slot = b.data[expert < 0 ? 0 : static_cast<size_t>(expert)];
  if (slot != 0 && slot != t.data)
    return error(DP_ERR_REBIND, "{}: already bound at {:#x}, now {:#x}: weight reloads are not supported (kernels and "
                 "prefetch tables use the first address; create a new session for new weights)", what, slot, t.data);
  slot = t.data;
  b.desc = t;
  b.described = true;
  return ok();
}

Status dp_session::bind_experts(const std::string& group, const uint64_t* data, int32_t count, const dp_tensor& t) {
  auto it = weights->by_name.find(group);
  if (it == weights->by_name.end())
    return error(DP_ERR_UNKNOWN_TENSOR, "expert group {}: not a weight of rank {} in {} (groups are named with \"{{e}}\" "
                 "for the expert index, as dp_bundle_get_weight lists them)", group, options.rank, bundle->reader.label());
  const WeightSpec& spec = weights->weights[it->second];
  if (spec.entry->experts == 0)
    return error(DP_ERR_INVALID_ARGUMENT, "weight {} (rank {}) is a single tensor, not an expert group: bind it with "
                 "dp_session_bind_weight", group, options.rank);
  if (count != spec.entry->experts)
    return error(DP_ERR_SHAPE, "expert group {} (rank {}): {} experts given, the rank holds {}", group, options.rank,
                 count, spec.entry->experts);
  WeightBinding& b = bindings[it->second];
  for (int32_t e = 0; e < count; ++e) {
    dp_tensor one = t;
    one.data = data[e];
    const std::string what = fmt::format("weight {} (expert {} of group {}, rank {})",
                                         group.substr(0, group.find("{e}")) + std::to_string(e) +
                                             group.substr(group.find("{e}") + 3), e, group, options.rank);
    const Status st = check_tensor(what, one, spec.dtype, spec.entry->shape, false, DP_ERR_SHAPE);
    if (!st.ok() && st.code() == DP_ERR_SHAPE) return Status(st.code(), st.message() + shard_note(*spec.entry));
    DP_RETURN_IF_ERROR(st);
    if (b.data[e] != 0 && b.data[e] != data[e])
      return error(DP_ERR_REBIND, "{}: already bound at {:#x}, now {:#x}: weight reloads are not supported", what,
                   b.data[e], data[e]);
  }
  // All checked: bind atomically, so a refused call leaves the group as it was.
  for (int32_t e = 0; e < count; ++e) b.data[e] = data[e];
  b.desc = t;
  b.described = true;
  return ok();
}

Status dp_session::finalize_weights() {
  std::vector<std::string> missing;
  for (size_t i = 0; i < bindings.size(); ++i) {
    const WeightBinding& b = bindings[i];
    const format::WeightEntry& w = *weights->weights[i].entry;
    const size_t unbound = static_cast<size_t>(std::count(b.data.begin(), b.data.end(), uint64_t{0}));
    if (unbound == 0) continue;
    if (w.experts == 0) {
      missing.push_back(w.name);
    } else {
      std::vector<size_t> which;
      for (size_t e = 0; e < b.data.size() && which.size() < 4; ++e)
        if (!b.data[e]) which.push_back(e);
      missing.push_back(unbound == b.data.size()
                            ? fmt::format("{} (all {} experts)", w.name, w.experts)
                            : fmt::format("{} ({} of {} experts: {}{})", w.name, unbound, w.experts, fmt::join(which, ", "),
                                          unbound > which.size() ? ", ..." : ""));
    }
  }
  if (!missing.empty()) {
    const size_t shown = std::min<size_t>(missing.size(), 8);
    return error(DP_ERR_MISSING_TENSOR, "{}: {} of {} weights are not bound: {}{}", label(), missing.size(),
                 bindings.size(), fmt::join(missing.begin(), missing.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
                 missing.size() > shown ? fmt::format(", and {} more", missing.size() - shown) : std::string());
  }
  // The kernels read an expert group as one tensor [experts, ...]: expert e at base + e * stride.
  for (size_t i = 0; i < bindings.size(); ++i) {
    const std::vector<uint64_t>& a = bindings[i].data;
    if (a.size() < 2) continue;
    const uint64_t stride = a[1] - a[0];
    for (size_t e = 1; e < a.size(); ++e)
      if (a[e] <= a[e - 1] || a[e] - a[e - 1] != stride || stride % dp_dtype_size(weights->weights[i].dtype) != 0)
        return error(DP_ERR_LAYOUT, "weight group {} (rank {}): expert {} is bound at {:#x} and expert {} at {:#x}, but "
                     "expert 1 is {:#x} after expert 0: the kernels read a group as one stacked tensor, so expert e must "
                     "lie at base + e * stride with one positive stride, a whole number of elements (vLLM's FusedMoE "
                     "[E, N, K] layout, or one half of its fused w13 tensor)", weights->weights[i].entry->name,
                     options.rank, e - 1, a[e - 1], e, a[e], stride);
  }
  finalized = true;
  return ok();
}

Status dp_session::verify_weights() {
  if (!device)
    return error(DP_ERR_NO_DEVICE, "{}: dp_session_verify_weights reads the weights from the device; this session is "
                 "host-only", label());
  if (!finalized) return error(DP_ERR_STATE, "{}: dp_session_verify_weights before dp_session_finalize_weights", label());
  if (!bundle->manifest().weights_fingerprinted)
    return error(DP_ERR_NOT_SUPPORTED, "{}: the bundle carries no weight fingerprints (it was built without reading the "
                 "weights, e.g. --no-weights)", bundle->reader.label());
  DeviceScope scope(device.get());
  DP_RETURN_IF_ERROR(scope.status());
  std::vector<std::string> differ;
  size_t shards = 0;
  std::vector<uint8_t> host;
  for (size_t i = 0; i < bindings.size(); ++i) {
    const format::WeightEntry& w = *weights->weights[i].entry;
    const WeightBinding& b = bindings[i];
    // Bound weights are dense (checked at bind), so the shard's bytes in fingerprint order (row-major,
    // little-endian, in the bound dtype: bundle-format.md section 4) are the device bytes as they lie.
    host.resize(span_bytes(b.desc));
    for (size_t e = 0; e < b.data.size(); ++e, ++shards) {
      DP_RETURN_IF_ERROR(device->download(host.data(), b.data[e], host.size(), "weight " + w.name));
      if (format::sha256_hex(host) != w.sha256[e])
        differ.push_back(w.experts ? fmt::format("{} (expert {})", w.name, e) : w.name);
    }
  }
  if (differ.empty()) return ok();
  const size_t shown = std::min<size_t>(differ.size(), 8);
  return error(DP_ERR_INTEGRITY, "{}: {} of {} weight shards differ from the bundle's fingerprints (not the weights the "
               "bundle was built from, or not this rank's shards): {}{}", label(), differ.size(), shards,
               fmt::join(differ.begin(), differ.begin() + static_cast<std::ptrdiff_t>(shown), ", "),
               differ.size() > shown ? fmt::format(", and {} more", differ.size() - shown) : std::string());
}

// ---- Kernels ------------------------------------------------------------------------------------------

const format::KernelEntry* dp_session::find_kernel(const std::string& role, int32_t width) const {
  for (const format::KernelEntry& k : bundle->manifest().kernels)
    if (k.target == target && k.role == role && k.width == width) return &k;
  return nullptr;
}

Status dp_session::load_kernel(const format::KernelEntry& k, int32_t layer, LoadedKernel* out, bool role_params) {
  const std::string what = fmt::format("kernel {} ({})", k.key, k.file);
  void* fn = nullptr;
  // One module per code object, shared by every width, layer and table that launches it.
  if (auto it = functions.find(&k); it != functions.end()) {
    fn = it->second;
  } else {
    void* module = nullptr;
    std::span<const uint8_t> image;
    try {
      image = bundle->reader.file(k.file);
    } catch (const std::exception& e) {
      return Status(DP_ERR_INTEGRITY, e.what());
    }
    DP_RETURN_IF_ERROR(device->load_module(image, what, &module));
    modules.push_back(module);
    DP_RETURN_IF_ERROR(device->function(module, k.name, what, &fn));
    FunctionInfo info;
    DP_RETURN_IF_ERROR(device->function_info(fn, what, &info));
    if (k.dynamic_shared_bytes > 0) DP_RETURN_IF_ERROR(device->allow_dynamic_shared(fn, k.dynamic_shared_bytes, what));
    const int threads = static_cast<int>(k.block[0] * k.block[1] * k.block[2]);
    if (info.max_threads < threads)
      return error(DP_ERR_DEVICE_LIMITS, "{}: the driver launches this code object with at most {} threads per block ({} "
                   "registers per thread), the manifest's block has {}", what, info.max_threads, info.registers, threads);
    if (info.has_param_info) {
      bool same = info.params.size() == k.params.size();
      for (size_t i = 0; same && i < k.params.size(); ++i)
        same = info.params[i].first == k.params[i].offset && info.params[i].second == k.params[i].size;
      if (!same) {
        std::vector<std::string> got, want;
        for (const auto& [o, sz] : info.params) got.push_back(fmt::format("{}+{}", o, sz));
        for (const auto& p : k.params) want.push_back(fmt::format("{}+{}", p.offset, p.size));
        return error(DP_ERR_DEVICE_LIMITS, "{}: the code object's parameters are at (offset+size) {}, the manifest says {}: "
                     "the bundle is inconsistent, rebuild it", what, fmt::join(got, " "), fmt::join(want, " "));
      }
    }
    functions[&k] = fn;
  }
  out->entry = &k;
  out->function = fn;
  out->block.assign(k.param_bytes, 0);
  out->call_slots.clear();
  if (!role_params) return ok();  // a program step: load_program_step binds every parameter
  for (const format::KernelParamEntry& p : k.params) {
    const ParamSource src = *param_source(k.role, p.name, p.kind);  // check_kernels made sure it exists
    switch (src) {
      case ParamSource::eps: put<float>(out->block.data(), p.offset, static_cast<float>(bundle->manifest().model.rms_norm_eps)); break;
      case ParamSource::workspace: put<uint64_t>(out->block.data(), p.offset, workspace); break;
      case ParamSource::error_flag: put<uint64_t>(out->block.data(), p.offset, flag_device); break;
      case ParamSource::num_layers:
        put<uint32_t>(out->block.data(), p.offset, static_cast<uint32_t>(bundle->manifest().layers.size()));
        break;
      case ParamSource::final_norm_weight:
      case ParamSource::final_res_norm_weight:
      case ParamSource::final_res_proj_weight: {
        // A model-level weight (layer -1) by its key: "<prefix>norm.weight", "<prefix>output_attn_res_*".
        const std::string key = src == ParamSource::final_norm_weight       ? ".norm.weight"
                                : src == ParamSource::final_res_norm_weight ? ".output_attn_res_norm.weight"
                                                                            : ".output_attn_res_proj.weight";
        uint64_t addr = 0;
        for (size_t i = 0; i < weights->weights.size(); ++i) {
          const format::WeightEntry& w = *weights->weights[i].entry;
          if (w.layer < 0 && w.experts == 0 && ("." + w.name).ends_with(key)) addr = bindings[i].data[0];
        }
        if (!addr)
          return error(DP_ERR_FORMAT, "{}: {}: the rank lists no model weight {} (a weight with layer -1) for parameter "
                       "{}", bundle->reader.label(), what, key.substr(1), p.name);
        put<uint64_t>(out->block.data(), p.offset, addr);
        break;
      }
      default: out->call_slots.push_back({p.offset, p.size, src, p.nullable, p.name});
    }
  }
  return ok();
}

// The weight of `layer` whose name relative to the layer is `key` ("self_attn.q_proj.weight", or a
// group's "block_sparse_moe.experts.{e}.w1.weight"): index into weights->weights, or SIZE_MAX.
size_t dp_session::layer_weight(int32_t layer, const std::string& key) const {
  const std::string tail = fmt::format("layers.{}.{}", layer, key);
  for (size_t i = 0; i < weights->weights.size(); ++i) {
    const format::WeightEntry& w = *weights->weights[i].entry;
    if (w.layer != layer || w.name.size() < tail.size()) continue;
    const size_t at = w.name.size() - tail.size();
    if (w.name.compare(at, tail.size(), tail) == 0 && (at == 0 || w.name[at - 1] == '.')) return i;
  }
  return SIZE_MAX;
}

// Binds one program step's kernel for `layer` at the width whose workspace is `ws_bytes`: constants,
// weights, expert strides and workspace addresses are packed now; dp_layer_io fields and caches at
// each launch (caches may be bound after load).
Status dp_session::load_program_step(const format::ProgramEntry& prog, size_t step_index, int32_t layer,
                                     LoadedKernel* out) {
  const format::ProgramStepEntry& st = prog.steps[step_index];
  if (!st.collective.empty()) return load_collective_step(prog, step_index, layer, out);
  const std::string key = st.kernel + "." + target;
  const format::KernelEntry* k = nullptr;
  for (const format::KernelEntry& e : bundle->manifest().kernels)
    if (e.key == key) k = &e;
  const std::string what = fmt::format("{}: layer {} ({} program, width {}) step {}", bundle->reader.label(), layer,
                                       prog.cls, prog.width, step_index);
  if (!k) return error(DP_ERR_FORMAT, "{}: kernel {} is not in the bundle", what, key);
  // A program binds every parameter itself, also of a kernel that is the final norm too.
  DP_RETURN_IF_ERROR(load_kernel(*k, layer, out, /*role_params=*/false));
  for (size_t a = 0; a < st.args.size(); ++a) {
    const format::ProgramArgEntry& arg = st.args[a];
    const format::KernelParamEntry& p = k->params[a];  // the manifest checked names, kinds and count
    uint8_t* block = out->block.data();
    if (auto src = program_source(arg)) {
      out->call_slots.push_back({p.offset, p.size, *src, p.nullable, p.name});
    } else if (arg.from == "weight" || arg.from == "expert_stride") {
      const size_t wi = layer_weight(layer, arg.name);
      if (wi == SIZE_MAX)
        return error(DP_ERR_FORMAT, "{} ({}): parameter {} names weight {} of layer {}, which rank {} does not list", what,
                     k->key, p.name, arg.name, layer, options.rank);
      const WeightBinding& b = bindings[wi];
      const format::WeightEntry& w = *weights->weights[wi].entry;
      // A group is one tensor [experts, ...] with one distance between experts (finalize checked it).
      const uint64_t stride = b.data.size() > 1 ? b.data[1] - b.data[0] : 0;
      if (arg.from == "weight") {
        put<uint64_t>(block, p.offset, b.data[0] + arg.offset);
      } else {
        const uint64_t elem = dp_dtype_size(weights->weights[wi].dtype);
        const uint64_t elems = stride ? stride / elem : span_bytes(b.desc) / elem;
        if (stride % elem || elems > UINT32_MAX)
          return error(DP_ERR_LAYOUT, "weight group {} (rank {}): {} bytes between experts is not a whole number of "
                       "elements below 2^32", w.name, options.rank, stride);
        put<uint32_t>(block, p.offset, static_cast<uint32_t>(elems));
      }
    } else if (arg.from == "workspace") {
      put<uint64_t>(block, p.offset, workspace + arg.offset);
    } else if (arg.from == "f32") {
      put<float>(block, p.offset, static_cast<float>(arg.value));
    } else if (arg.from == "u32") {
      put<uint32_t>(block, p.offset, static_cast<uint32_t>(arg.value));
    } else if (arg.from == "null") {
      put<uint64_t>(block, p.offset, 0);
    } else if (arg.from == "layer") {
      put<uint32_t>(block, p.offset, static_cast<uint32_t>(layer));
    } else if (arg.from == "tp") {
      // load_kernels made sure the peers are set before any program step is loaded.
      if (arg.name == "peers") put<uint64_t>(block, p.offset, peers_table);
      else if (arg.name == "flag") put<uint64_t>(block, p.offset, flag_device);
      else if (arg.name == "rank") put<uint32_t>(block, p.offset, static_cast<uint32_t>(options.rank));
      else if (arg.name == "layer") put<uint32_t>(block, p.offset, static_cast<uint32_t>(layer));
      else if (arg.name == "timeout_us") put<uint32_t>(block, p.offset, timeout_us);
      else
        return error(DP_ERR_NOT_SUPPORTED, "{} ({}): parameter {} from tp \"{}\" is not a source libdecodepack {} knows",
                     what, k->key, p.name, arg.name, dp_version_string());
    } else {
      return error(DP_ERR_NOT_SUPPORTED, "{} ({}): parameter {} from \"{}\" is not a source libdecodepack {} knows", what,
                   k->key, p.name, arg.from, dp_version_string());
    }
  }
  return ok();
}

// A collective step (format 1.8, nccl_allreduce): its buffers resolved now, the workspace's at load and
// the dp_layer_io out at each launch (recv 0). The manifest's validation checked the step's shape.
Status dp_session::load_collective_step(const format::ProgramEntry& prog, size_t step_index, int32_t layer,
                                        LoadedKernel* out) {
  const format::ProgramStepEntry& st = prog.steps[step_index];
  const std::string what = fmt::format("{}: layer {} ({} program, width {}) step {}", bundle->reader.label(), layer,
                                       prog.cls, prog.width, step_index);
  if (st.collective != "nccl_allreduce" || st.args.size() != 2)
    return error(DP_ERR_NOT_SUPPORTED, "{}: collective \"{}\" with {} args is not one libdecodepack {} knows (it runs "
                 "nccl_allreduce: send, recv)", what, st.collective, st.args.size(), dp_version_string());
  out->collective = &st;
  out->elements = st.elements;
  out->send = workspace + st.args[0].offset;
  out->recv = st.args[1].from == "workspace" ? workspace + st.args[1].offset : 0;
  return ok();
}

namespace {

std::vector<std::string> ops_of(const std::vector<LoadedKernel>& program) {
  std::vector<std::string> ops;
  for (const LoadedKernel& k : program) ops.push_back(k.collective ? k.collective->collective : k.entry->op);
  return ops;
}

}  // namespace

Status dp_session::build_prefetch_tables() {
  const format::Manifest& m = bundle->manifest();
  if (m.prefetch.empty()) return ok();
  const format::KernelEntry* pk = find_kernel("prefetch", 0);
  if (!pk) return error(DP_ERR_FORMAT, "{}: prefetch tables but no prefetch kernel for {}", bundle->reader.label(), target);
  LoadedKernel base;
  DP_RETURN_IF_ERROR(load_kernel(*pk, -1, &base));
  prefetch_call_slots = base.call_slots;

  std::vector<uint64_t> host;  // every table, {addr, bytes} pairs
  std::vector<std::pair<size_t, size_t>> spans;  // (first entry, count) per manifest table
  std::map<std::pair<int32_t, int32_t>, size_t> event_of;
  for (const format::PrefetchEntry& p : m.prefetch) {
    const int32_t point = prefetch_point_id(p.point);
    if (point < 0)
      return error(DP_ERR_NOT_SUPPORTED, "{}: prefetch table at point \"{}\" of layer {}: libdecodepack {} knows the points "
                   "oproj_down, attention_moe, next_attention, attention_oproj", bundle->reader.label(), p.point, p.layer, dp_version_string());
    const size_t first = host.size() / 2;
    for (const format::PrefetchRangeEntry& r : p.ranges) {
      auto it = weights->by_name.find(r.weight);
      if (it == weights->by_name.end())
        return error(DP_ERR_FORMAT, "{}: prefetch table {} of layer {}: weight {} is not a weight of rank {}",
                     bundle->reader.label(), p.point, p.layer, r.weight, options.rank);
      const WeightBinding& b = bindings[it->second];
      // The bundle's bytes were capped from rank 0's shard; this rank's shard may be shorter, so cap
      // again at the bound tensor's extent (computed from its shape and strides), keeping 16-byte units.
      const uint64_t extent = span_bytes(b.desc);
      for (uint64_t addr : b.data) {  // a group prefetches the same leading bytes of every expert
        const uint64_t bytes = std::min<uint64_t>(r.bytes, extent) / kAlign * kAlign;
        if (bytes == 0) continue;
        host.push_back(addr);
        host.push_back(bytes);
      }
    }
    spans.emplace_back(first, host.size() / 2 - first);
    event_of.emplace(std::make_pair(point, p.layer), event_of.size());
  }
  const size_t bytes = std::max<size_t>(host.size() * sizeof(uint64_t), kAlign);
  DP_RETURN_IF_ERROR(device->alloc(bytes, "prefetch range tables", &prefetch_tables));
  if (!host.empty())
    DP_RETURN_IF_ERROR(device->upload(prefetch_tables, host.data(), host.size() * sizeof(uint64_t), "prefetch range tables"));

  for (size_t i = 0; i < m.prefetch.size(); ++i) {
    const format::PrefetchEntry& p = m.prefetch[i];
    PrefetchTable t;
    t.entry = &p;
    t.device_table = prefetch_tables + spans[i].first * 2 * sizeof(uint64_t);
    t.count = static_cast<uint32_t>(spans[i].second);
    t.kernel = base;
    for (const ParamSlot& s : base.call_slots) {
      if (s.source == ParamSource::prefetch_table) put<uint64_t>(t.kernel.block.data(), s.offset, t.device_table);
      if (s.source == ParamSource::prefetch_count) put<uint32_t>(t.kernel.block.data(), s.offset, t.count);
    }
    t.kernel.call_slots.clear();
    t.host.assign(host.begin() + static_cast<std::ptrdiff_t>(2 * spans[i].first),
                  host.begin() + static_cast<std::ptrdiff_t>(2 * (spans[i].first + spans[i].second)));
    const int32_t point = prefetch_point_id(p.point);
    t.event = event_of.at({point, p.layer});
    if (t.count == 0) continue;  // nothing to pull on this rank: fork reports "not launched"
    prefetch.push_back(std::move(t));
    for (int64_t w : p.widths) {
      int32_t after = -1;
      for (size_t wi = 0; wi < bundle->deploy.widths.size(); ++wi)
        if (bundle->deploy.widths[wi] == w && steps[wi]->program[p.layer])
          after = prefetch_start_after(point, *steps[wi]->program[p.layer], ops_of(layer_programs[wi][p.layer]));
      prefetch_index[{point, p.layer, static_cast<int32_t>(w)}] = PrefetchSlot{prefetch.size() - 1, after};
    }
  }
  events.assign(event_of.size(), nullptr);
  for (void*& e : events) DP_RETURN_IF_ERROR(device->create_event(&e));
  DP_RETURN_IF_ERROR(device->create_event(&join_event));
  return device->create_stream(&side_stream);
}

Status dp_session::load_kernels() {
  // Before the device check, so that a host-only session names it too.
  if (!loaded && exchange_bytes() && peers.empty())
    return error(DP_ERR_STATE, "{}: the bundle's layer programs all-reduce over tensor_parallel {} ranks in-kernel: call "
                 "dp_session_set_peers with the {} ranks' exchange buffers (dp_session_exchange_bytes each) before "
                 "dp_session_load_kernels", label(), bundle->deploy.tensor_parallel, bundle->deploy.tensor_parallel);
  if (!device)
    return error(DP_ERR_NO_DEVICE, "{}: dp_session_load_kernels needs a device; this session is host-only (it binds, "
                 "checks and plans)", label());
  if (!finalized)
    return error(DP_ERR_STATE, "{}: dp_session_load_kernels before dp_session_finalize_weights (the kernels and prefetch "
                 "tables use the bound weights)", label());
  if (loaded) return ok();
  DeviceScope scope(device.get());
  DP_RETURN_IF_ERROR(scope.status());
  const format::Manifest& m = bundle->manifest();
  const DeploySettings& d = bundle->deploy;

  bool any_layer_program = false;
  for (const auto& s : steps)
    for (uint8_t p : s->layer_program) any_layer_program |= p != 0;

  if (any_layer_program) {
    uint64_t bytes = 0;
    for (const format::WorkspaceEntry& w : m.workspace) bytes = std::max(bytes, w.bytes);
    if (bytes) {
      DP_RETURN_IF_ERROR(device->alloc(bytes, "the step workspace", &workspace));
      // Zeroed once: ops that count blocks there (the gemm's fused norm) find their counters at zero and
      // leave them so (templates/gemm.h).
      const std::vector<uint8_t> zeros(bytes, 0);
      DP_RETURN_IF_ERROR(device->upload(workspace, zeros.data(), bytes, "the step workspace"));
    }
  }

  final_norm.assign(d.widths.size(), LoadedKernel{});
  lm_head.assign(d.widths.size(), LoadedKernel{});
  layer_programs.assign(d.widths.size(), std::vector<std::vector<LoadedKernel>>(m.layers.size()));
  for (size_t i = 0; i < d.widths.size(); ++i) {
    if (const format::KernelEntry* k = find_kernel("final_norm", d.widths[i])) {
      LoadedKernel lk;
      DP_RETURN_IF_ERROR(load_kernel(*k, -1, &lk));
      final_norm[i] = std::move(lk);
    }
    if (const format::KernelEntry* k = find_kernel("lm_head", d.widths[i])) {
      LoadedKernel lk;
      DP_RETURN_IF_ERROR(load_kernel(*k, -1, &lk));
      lm_head[i] = std::move(lk);
    }
    for (const format::LayerEntry& l : m.layers) {
      const format::ProgramEntry* prog = steps[i]->program[l.index];
      if (!prog) continue;
      for (size_t st = 0; st < prog->steps.size(); ++st) {
        LoadedKernel lk;
        DP_RETURN_IF_ERROR(load_program_step(*prog, st, l.index, &lk));
        layer_programs[i][l.index].push_back(std::move(lk));
      }
    }
  }
  DP_RETURN_IF_ERROR(build_prefetch_tables());
  // The indexer's kernels too, so that nothing loads later (memory profiling, graph capture); a model
  // whose indexer the build could not make kernels for has none, and the indexer calls say so.
  for (const format::KernelEntry& k : m.kernels)
    if (k.target == target && k.role == "indexer") {
      DP_RETURN_IF_ERROR(load_indexer());
      break;
    }
  loaded = true;
  return ok();
}

// ---- KV caches ----------------------------------------------------------------------------------------

Status dp_session::kv_layout(int32_t layer, int32_t kind, int64_t count, dp_tensor* out) const {
  const format::Manifest& m = bundle->manifest();
  const DeploySettings& d = bundle->deploy;
  if (kind == DP_KV_ATTN_RES) {
    if (layer != -1)
      return error(DP_ERR_INVALID_ARGUMENT, "layer {} DP_KV_ATTN_RES: the attention-residual block buffer is the "
                   "model's, shared by its layers: bind it with layer -1", layer);
    if (d.attn_res_block == 0)
      return error(DP_ERR_UNKNOWN_TENSOR, "DP_KV_ATTN_RES: the model has no block attention residuals "
                   "(model.details.attn_res_block 0)");
    if (count < 1) return error(DP_ERR_INVALID_ARGUMENT, "DP_KV_ATTN_RES: count {}, expected >= 1", count);
    const std::vector<int64_t> shape = {count, d.attn_res_blocks, d.hidden};
    dp_tensor_init(out, 0, DP_DTYPE_BF16, 3, shape.data());
    return ok();
  }
  if (layer < 0 || static_cast<size_t>(layer) >= m.layers.size())
    return error(DP_ERR_INVALID_ARGUMENT, "KV layer {}: expected 0..{}", layer, m.layers.size() - 1);
  if (kind < DP_KV_KDA_STATE || kind > DP_KV_MLA_LATENT)
    return error(DP_ERR_INVALID_ARGUMENT, "layer {}: KV kind {} is not a dp_kv_kind (1..6)", layer, kind);
  if (count < 1) return error(DP_ERR_INVALID_ARGUMENT, "layer {} {}: count {}, expected >= 1", layer, kv_kind_name(kind), count);
  const bool kda = m.layers[layer].mixer == "kda";
  if (kda != (kind != DP_KV_MLA_LATENT))
    return error(DP_ERR_UNKNOWN_TENSOR, "layer {} is a{} {} layer: it has no {} (it binds {})", layer,
                 kda ? "" : "n", kda ? "KDA" : "MLA", kv_kind_name(kind),
                 kda ? "DP_KV_KDA_STATE and DP_KV_CONV_Q/K/V" : "DP_KV_MLA_LATENT");
  const int64_t tp = d.tensor_parallel;
  std::vector<int64_t> shape;
  dp_dtype dtype = DP_DTYPE_F32;
  if (kind == DP_KV_KDA_STATE) {
    shape = {count, d.kda_heads / tp, d.kda_head_dim, d.kda_head_dim};
  } else if (kind == DP_KV_MLA_LATENT) {
    shape = {count, d.block_size, d.mla_kv_lora_rank + d.mla_rope_dim};
    dtype = d.kv_dtype;
  } else {
    const int64_t p = d.kda_heads * d.kda_head_dim / tp, k = d.conv_kernel - 1;
    shape = d.conv_layout == "sd" ? std::vector<int64_t>{count, k, p} : std::vector<int64_t>{count, p, k};
    dtype = d.conv_dtype;
  }
  dp_tensor_init(out, 0, dtype, static_cast<int32_t>(shape.size()), shape.data());
  return ok();
}

Status dp_session::bind_kv(int32_t layer, int32_t kind, const dp_tensor& t) {
  dp_tensor want;
  const int64_t count = t.ndim > 0 ? std::max<int64_t>(t.shape[0], 1) : 1;
  DP_RETURN_IF_ERROR(kv_layout(layer, kind, count, &want));
  const bool attn = kind == DP_KV_ATTN_RES;
  const std::string what = attn ? "DP_KV_ATTN_RES" : fmt::format("layer {} {}", layer, kv_kind_name(kind));
  DP_RETURN_IF_ERROR(check_tensor(what, t, static_cast<dp_dtype>(want.dtype),
                                  std::vector<int64_t>(want.shape, want.shape + want.ndim), true, DP_ERR_SHAPE));
  if (attn) {
    // A row per row of the step: the largest width's rows must fit, whatever the step.
    const int64_t rows = static_cast<int64_t>(bundle->deploy.widths.back()) * bundle->deploy.q;
    if (t.shape[0] < rows)
      return error(DP_ERR_SHAPE, "{}: {} rows, expected >= {} (the largest width {} x q {}: one row of blocks per row "
                   "of a step)", what, t.shape[0], rows, bundle->deploy.widths.back(), bundle->deploy.q);
  }
  KvBinding& b = attn ? attn_res : kv[layer][kind];
  if (b.bound && b.data != t.data)
    return error(DP_ERR_REBIND, "{}: bound at {:#x}, now {:#x}: call dp_session_release_kv first when the cache moved "
                 "(graphs captured with the old address would still use it)", what, b.data, t.data);
  if (b.bound && b.lead_stride != t.strides[0] && t.shape[0] > 1 && b.count > 1)
    return error(DP_ERR_REBIND, "{}: re-bound at the same address with first stride {}, was {}: a cache may grow in place, "
                 "not change its layout (call dp_session_release_kv first)", what, t.strides[0], b.lead_stride);
  const int64_t lead = t.shape[0] > 1 ? t.strides[0] : want.strides[0];
  if (lead > INT64_C(0xffffffff))
    return error(DP_ERR_LAYOUT, "{}: first stride {} elements, expected below 2^32 (the kernels take it as a 32-bit "
                 "value)", what, lead);
  if (kind >= DP_KV_CONV_Q && kind <= DP_KV_CONV_V)  // the KDA kernel takes one stride for the three conv states
    for (int32_t other = DP_KV_CONV_Q; other <= DP_KV_CONV_V; ++other)
      if (other != kind && kv[layer][other].bound && kv[layer][other].lead_stride != lead)
        return error(DP_ERR_LAYOUT, "{}: first stride {} elements, but layer {} {} has {}: the three conv states of a "
                     "layer must share one slot stride", what, lead, layer, kv_kind_name(other),
                     kv[layer][other].lead_stride);
  b.bound = true;
  b.data = t.data;
  b.count = t.shape[0];
  b.lead_stride = lead;
  return ok();
}

void dp_session::release_kv() {
  for (auto& layer : kv)
    for (KvBinding& b : layer) b = KvBinding{};
  attn_res = KvBinding{};
}

// ---- Planning -----------------------------------------------------------------------------------------

Status dp_session::plan(const dp_step_desc& d, dp_plan_result* out) {
  if (aborted || *static_cast<volatile uint32_t*>(flag_host)) {
    aborted = true;
    return error(DP_ERR_ABORTED, "{}: the session gave up an in-kernel wait (error flag {:#010x}); it can run no more "
                 "steps", label(), *static_cast<volatile uint32_t*>(flag_host));
  }
  if (!finalized)
    return error(DP_ERR_STATE, "{}: dp_plan before dp_session_finalize_weights", label());
  if (device && !loaded)
    return error(DP_ERR_STATE, "{}: dp_plan before dp_session_load_kernels (load every width's kernels before the host "
                 "profiles memory or captures graphs)", label());
  if (d.graph_mode < DP_GRAPH_NONE || d.graph_mode > DP_GRAPH_FULL)
    return error(DP_ERR_INVALID_ARGUMENT, "step: graph_mode {}, expected DP_GRAPH_NONE (0), DP_GRAPH_PIECEWISE (1) or "
                 "DP_GRAPH_FULL (2)", d.graph_mode);
  if (d.block_table && (d.block_table_cols < 0 || d.block_table_stride < d.block_table_cols))
    return error(DP_ERR_INVALID_ARGUMENT, "step: block_table_cols {} and block_table_stride {}, expected 0 <= cols <= "
                 "stride", d.block_table_cols, d.block_table_stride);
  if (d.state_indices && d.state_indices_stride != 0 && d.state_indices_stride < bundle->deploy.q)
    return error(DP_ERR_INVALID_ARGUMENT, "step: state_indices_stride {}, expected 0 or >= q = {}", d.state_indices_stride,
                 bundle->deploy.q);

  PlanInputs in;
  in.widths = &bundle->deploy.widths;
  in.q = bundle->deploy.q;
  const format::Manifest& m = bundle->manifest();
  size_t missing = 0;
  for (const format::LayerEntry& l : m.layers) {
    const bool kda = l.mixer == "kda";
    for (int32_t kind = DP_KV_KDA_STATE; kind <= DP_KV_MLA_LATENT; ++kind) {
      if (kda != (kind != DP_KV_MLA_LATENT)) continue;
      const KvBinding& b = kv[l.index][kind];
      if (!b.bound) {
        if (missing++ == 0) in.kv_missing = fmt::format("layer {} {}", l.index, kv_kind_name(kind));
        continue;
      }
      int64_t& bound = kind == DP_KV_MLA_LATENT ? in.blocks : in.slots;
      bound = bound < 0 ? b.count : std::min(bound, b.count);
    }
  }
  if (bundle->deploy.attn_res_block > 0 && !attn_res.bound && missing++ == 0)
    in.kv_missing = "the attention-residual block buffer (DP_KV_ATTN_RES)";
  if (missing > 1) in.kv_missing += fmt::format(" and {} more", missing - 1);

  const std::vector<int32_t> nccl = nccl_widths();
  in.nccl_widths = &nccl;
  in.communicator = nccl_comm != nullptr;
  const PlanOutcome o = plan_step(in, d);
  dp_plan_result r;
  dp_plan_result_init(&r);
  r.reason = o.reason;
  r.q = in.q;
  if (o.reason == DP_REASON_NONE) {
    const auto it = std::find(bundle->deploy.widths.begin(), bundle->deploy.widths.end(), o.width);
    const dp_step* step = steps[static_cast<size_t>(it - bundle->deploy.widths.begin())].get();
    r.width = o.width;
    r.rows = o.width * in.q;
    r.step = step;
  }
  std::snprintf(r.message, sizeof(r.message), "%s", o.message.c_str());
  const size_t n = std::min(out->size, sizeof(r));
  r.size = out->size;
  std::memcpy(out, &r, n);
  return ok();
}

Status dp_session::after_step() {
  const uint32_t v = *static_cast<volatile uint32_t*>(flag_host);
  if (v == 0 && !aborted) return ok();
  aborted = true;
  return error(DP_ERR_ABORTED, "{}: {}: every rank reports this; the session can run no more steps (tear it down and "
               "restart the engine)", label(), describe_error_flag(v));
}

std::vector<int32_t> dp_session::nccl_widths() const {
  std::vector<int32_t> w;
  for (const auto& s : steps)
    if (s->nccl) w.push_back(s->width);
  return w;
}

Status dp_session::set_nccl(const uint8_t* id, void* comm, const char* library) {
  const char* fn = comm ? "dp_session_set_nccl_comm" : "dp_session_init_nccl";
  const int64_t tp = bundle->deploy.tensor_parallel;
  if (nccl_widths().empty())
    return error(DP_ERR_INVALID_ARGUMENT, "{}: {}: the bundle's programs do not all-reduce with NCCL at any width "
                 "(tensor_parallel {}; deploy \"allreduce\" gives no width to nccl): there is no communicator to set",
                 label(), fn, tp);
  if (nccl_comm)
    return error(DP_ERR_REBIND, "{}: {}: the session already has an NCCL communicator (one per session)", label(), fn);
  if (!device)
    return error(DP_ERR_NO_DEVICE, "{}: {} needs a device; this session is host-only", label(), fn);
  auto api = nccl_api(nccl_library_name(library));
  if (!api.ok()) return api.status();
  if (comm) {
    nccl = *api;
    nccl_comm = static_cast<NcclComm>(comm);
    nccl_owned = false;
    return ok();
  }
  NcclUniqueId uid;
  std::memcpy(uid.internal, id, sizeof uid.internal);
  DeviceScope scope(device.get());  // NCCL takes the device whose context is current
  DP_RETURN_IF_ERROR(scope.status());
  NcclComm c = nullptr;
  DP_RETURN_IF_ERROR(nccl_check(**api, (*api)->CommInitRank(&c, static_cast<int>(tp), uid, options.rank),
                                "ncclCommInitRank",
                                fmt::format("{}: rank {} of {} on device {} (NCCL {}; NCCL refuses two ranks on one "
                                            "GPU)", label(), options.rank, tp, ordinal,
                                            nccl_version_text((*api)->version))));
  nccl = *api;
  nccl_comm = c;
  nccl_owned = true;
  return ok();
}

uint64_t dp_session::exchange_bytes() const {
  bool all_reduces = false;
  for (const auto& s : steps)
    for (const format::ProgramEntry* p : s->program)
      if (p)
        for (const format::ProgramStepEntry& st : p->steps)
          for (const format::ProgramArgEntry& a : st.args) all_reduces |= a.from == "tp";
  if (!all_reduces) return 0;
  const DeploySettings& d = bundle->deploy;
  int64_t rows = 0;
  for (const int64_t w : d.widths) rows = std::max<int64_t>(rows, w * d.q);
  // Each rank's slot holds the largest all-reduce of the programs: [rows, hidden] after the o-projection
  // and the FFN, and for the K3 latent MoE the latent sum and the shared output together (their
  // allreduce kernel's `partial` is [W, latent + hidden]).
  int64_t elems = rows * bundle->manifest().model.hidden_size;
  for (const format::KernelEntry& k : bundle->manifest().kernels) {
    if (!k.name.starts_with("allreduce_")) continue;
    for (const format::KernelParamEntry& p : k.params) {
      int64_t w = 0, h = 0;
      if (p.name == "partial" && std::sscanf(p.shape.c_str(), "[%lld, %lld]", reinterpret_cast<long long*>(&w),
                                             reinterpret_cast<long long*>(&h)) == 2)
        elems = std::max<int64_t>(elems, w * h);
    }
  }
  return allreduce_exchange_bytes(d.tensor_parallel, 1, elems);
}

Status dp_session::set_peers(const uint64_t* exchange, int32_t num_ranks, uint32_t timeout) {
  const int64_t tp = bundle->deploy.tensor_parallel;
  const uint64_t bytes = exchange_bytes();
  if (!bytes)
    return error(DP_ERR_INVALID_ARGUMENT, "{}: dp_session_set_peers: the bundle's programs do not all-reduce (tensor_parallel "
                 "{}{}): there are no exchange buffers to set", label(), tp,
                 tp > 1 ? ", no program built" : "");
  if (loaded)
    return error(DP_ERR_STATE, "{}: dp_session_set_peers after dp_session_load_kernels: the kernels' parameters were packed "
                 "at load; set the peers first", label());
  if (!peers.empty())
    return error(DP_ERR_REBIND, "{}: dp_session_set_peers called twice: the exchange buffers are set once per session",
                 label());
  if (!exchange || num_ranks != tp)
    return error(DP_ERR_INVALID_ARGUMENT, "{}: dp_session_set_peers: {} exchange buffers, expected {} (one per rank of "
                 "tensor_parallel {}, in rank order)", label(), exchange ? num_ranks : 0, tp, tp);
  if (timeout == 0)
    return error(DP_ERR_INVALID_ARGUMENT, "{}: dp_session_set_peers: timeout_us 0, expected >= 1 microsecond (the bound "
                 "of every in-kernel wait)", label());
  for (int32_t r = 0; r < num_ranks; ++r) {
    DP_RETURN_IF_ERROR(check_io_address(fmt::format("{}: dp_session_set_peers", label()).c_str(),
                                        fmt::format("exchange[{}] (rank {}'s buffer)", r, r).c_str(), exchange[r], false));
    for (int32_t q = 0; q < r; ++q)
      if (exchange[q] == exchange[r])
        return error(DP_ERR_INVALID_ARGUMENT, "{}: dp_session_set_peers: exchange[{}] and exchange[{}] are both {:#x}: "
                     "every rank needs its own buffer", label(), q, r, exchange[r]);
  }
  std::vector<uint64_t> table(exchange, exchange + num_ranks);
  if (device) {
    DeviceScope scope(device.get());
    DP_RETURN_IF_ERROR(scope.status());
    uint64_t dev = 0;
    DP_RETURN_IF_ERROR(device->alloc(table.size() * sizeof(uint64_t), "the tensor-parallel peer table", &dev));
    Status st = device->upload(dev, table.data(), table.size() * sizeof(uint64_t), "the tensor-parallel peer table");
    // This rank's buffer starts zeroed: no abort mark, no sequence counts, no flags (they are tags the
    // kernels compare, never reset). The host makes every rank return from here before any launches.
    if (st.ok()) {
      const std::vector<uint8_t> zeros(bytes, 0);
      st = device->upload(table[static_cast<size_t>(options.rank)], zeros.data(), zeros.size(),
                          fmt::format("rank {}'s exchange buffer ({} bytes)", options.rank, bytes));
    }
    if (!st.ok()) {
      device->free(dev);
      return st;
    }
    peers_table = dev;
  }
  peers = std::move(table);
  timeout_us = timeout;
  return ok();
}

// ---- Launch -------------------------------------------------------------------------------------------

Status dp::rt::check_io_address(const char* what, const char* field, uint64_t v, bool nullable) {
  if (v == 0) {
    if (nullable) return ok();
    return error(DP_ERR_INVALID_ARGUMENT, "{}: {} is 0, expected a device address", what, field);
  }
  if (v % kAlign)
    return error(DP_ERR_ALIGNMENT, "{}: {} {:#x} is not a multiple of {} bytes", what, field, v, kAlign);
  return ok();
}

namespace {

// Packs a kernel's parameter block (the load-time constants plus this call's values, taken from
// `value_of` per slot) and launches it. The one launch path of final norm and layer programs.
template <typename ValueOf>
Status launch_packed(Device& device, const LoadedKernel& k, dp_stream stream, bool programmatic,
                     ValueOf&& value_of) {
  alignas(16) uint8_t block[kMaxParamBytes];
  std::memcpy(block, k.block.data(), k.block.size());
  for (const ParamSlot& s : k.call_slots) {
    const uint64_t v = value_of(s.source);
    if (s.size == 8) put<uint64_t>(block, s.offset, v);
    else put<uint32_t>(block, s.offset, static_cast<uint32_t>(v));
  }
  LaunchSpec l;
  l.function = k.function;
  std::copy(k.entry->grid, k.entry->grid + 3, l.grid);
  std::copy(k.entry->block, k.entry->block + 3, l.block);
  l.dynamic_shared = k.entry->dynamic_shared_bytes;
  l.stream = stream;
  l.params = block;
  l.param_bytes = k.block.size();
  l.programmatic = programmatic;
  return device.launch(l, k.entry->key.c_str());
}

}  // namespace

Status dp_session::launch_final_norm(const dp_step* step, const dp_final_norm_io& io, dp_stream stream) {
  if (!device) return error(DP_ERR_NO_DEVICE, "{}: dp_launch_final_norm on a host-only session", label());
  if (!loaded) return error(DP_ERR_STATE, "{}: dp_launch_final_norm before dp_session_load_kernels", label());
  if (!step || step->session != this)
    return error(DP_ERR_INVALID_ARGUMENT, "{}: dp_launch_final_norm: the step is {} (expected a dp_plan_result.step of this "
                 "session)", label(), step ? "another session's" : "NULL");
  const LoadedKernel& k = final_norm[step->index];
  if (!k.function)
    return error(DP_ERR_NO_KERNEL, "{}: the bundle has no final_norm kernel for width {} on {}", label(), step->width, target);
  static const char* what = "dp_launch_final_norm";
  DP_RETURN_IF_ERROR(check_io_address(what, "hidden", io.hidden, false));
  DP_RETURN_IF_ERROR(check_io_address(what, "residual", io.residual, true));
  DP_RETURN_IF_ERROR(check_io_address(what, "out", io.out, false));
  DP_RETURN_IF_ERROR(check_io_address(what, "residual_out", io.residual_out, false));
  // Without a residual the sum is `hidden` alone: the kernel then writes hidden to residual_out.
  for (const ParamSlot& s : k.call_slots)
    if (s.source == ParamSource::kv_attn_res && !attn_res.bound)
      return error(DP_ERR_STATE, "{}: dp_launch_final_norm: the final norm ({}) mixes the attention-residual blocks: "
                   "bind DP_KV_ATTN_RES first", label(), k.entry->name);
  DeviceScope scope(device.get());
  DP_RETURN_IF_ERROR(scope.status());
  DP_RETURN_IF_ERROR(fire_prefetch(nullptr));
  if (observer) observer(observer_user, -1, 0, k.entry->name.c_str(), 0, stream);
  Status st = launch_packed(*device, k, stream, programmatic, [&](ParamSource src) -> uint64_t {
    switch (src) {
      case ParamSource::io_hidden: return io.hidden;
      case ParamSource::io_residual: return io.residual;
      case ParamSource::io_out: return io.out;
      case ParamSource::io_residual_out: return io.residual_out;
      case ParamSource::kv_attn_res: return attn_res.data;
      case ParamSource::attn_res_stride: return static_cast<uint32_t>(attn_res.lead_stride);
      default: return 0;
    }
  });
  if (observer) observer(observer_user, -1, 0, k.entry->name.c_str(), 1, stream);
  return st;
}

Status dp_session::bind_lm_head(const dp_tensor& t) {
  const format::Manifest& m = bundle->manifest();
  const int64_t tp = bundle->deploy.tensor_parallel;
  if (m.model.vocab_size % tp != 0)
    return error(DP_ERR_NOT_SUPPORTED, "{}: vocab_size {} is not divisible by tensor_parallel {}: the bundle has no LM "
                 "head", bundle->reader.label(), m.model.vocab_size, tp);
  const std::string what = fmt::format("LM head weight (rank {})", options.rank);
  DP_RETURN_IF_ERROR(check_tensor(what, t, DP_DTYPE_BF16, {m.model.vocab_size / tp, m.model.hidden_size}, false,
                                  DP_ERR_SHAPE));
  if (lm_head_weight != 0 && lm_head_weight != t.data)
    return error(DP_ERR_REBIND, "{}: already bound at {:#x}, now {:#x}: weight reloads are not supported", what,
                 lm_head_weight, t.data);
  lm_head_weight = t.data;
  return ok();
}

Status dp_session::launch_lm_head(const dp_step* step, const dp_lm_head_io& io, dp_stream stream) {
  if (!device) return error(DP_ERR_NO_DEVICE, "{}: dp_launch_lm_head on a host-only session", label());
  if (!loaded) return error(DP_ERR_STATE, "{}: dp_launch_lm_head before dp_session_load_kernels", label());
  if (!step || step->session != this)
    return error(DP_ERR_INVALID_ARGUMENT, "{}: dp_launch_lm_head: the step is {} (expected a dp_plan_result.step of this "
                 "session)", label(), step ? "another session's" : "NULL");
  const LoadedKernel& k = lm_head[step->index];
  if (!k.function)
    return error(DP_ERR_NO_KERNEL, "{}: the bundle has no lm_head kernel for width {} on {} (LM heads are in bundles of "
                 "format 1.5 and later, for widths of at most 32 rows)", label(), step->width, target);
  if (!lm_head_weight)
    return error(DP_ERR_STATE, "{}: dp_launch_lm_head before dp_session_bind_lm_head", label());
  static const char* what = "dp_launch_lm_head";
  DP_RETURN_IF_ERROR(check_io_address(what, "hidden", io.hidden, false));
  DP_RETURN_IF_ERROR(check_io_address(what, "logits", io.logits, false));
  DeviceScope scope(device.get());
  DP_RETURN_IF_ERROR(scope.status());
  if (observer) observer(observer_user, -1, 1, k.entry->name.c_str(), 0, stream);
  Status st = launch_packed(*device, k, stream, programmatic, [&](ParamSource src) -> uint64_t {
    switch (src) {
      case ParamSource::io_hidden: return io.hidden;
      case ParamSource::io_logits: return io.logits;
      case ParamSource::lm_head_weight: return lm_head_weight;
      default: return 0;
    }
  });
  if (observer) observer(observer_user, -1, 1, k.entry->name.c_str(), 1, stream);
  return st;
}

Status dp_session::launch_layer(const dp_step* step, int32_t layer, const dp_layer_io& io, dp_stream stream) {
  const format::Manifest& m = bundle->manifest();
  if (!step || step->session != this)
    return error(DP_ERR_INVALID_ARGUMENT, "{}: dp_launch_layer: the step is {} (expected a dp_plan_result.step of this "
                 "session)", label(), step ? "another session's" : "NULL");
  if (layer < 0 || static_cast<size_t>(layer) >= m.layers.size())
    return error(DP_ERR_INVALID_ARGUMENT, "{}: dp_launch_layer: layer {}, expected 0..{}", label(), layer, m.layers.size() - 1);
  if (!step->layer_program[layer])
    return error(DP_ERR_NO_KERNEL, "{}: layer {} ({}) at width {} on {}: {}; the host runs its own layer "
                 "(dp_step_layer_kernel returns 0)", label(), layer, m.layers[layer].cls, step->width, target,
                 step->why_not[layer]);
  if (!device) return error(DP_ERR_NO_DEVICE, "{}: dp_launch_layer on a host-only session", label());
  if (!loaded) return error(DP_ERR_STATE, "{}: dp_launch_layer before dp_session_load_kernels", label());
  static const char* what = "dp_launch_layer";
  DP_RETURN_IF_ERROR(check_io_address(what, "hidden", io.hidden, false));
  DP_RETURN_IF_ERROR(check_io_address(what, "residual", io.residual, layer == 0));
  DP_RETURN_IF_ERROR(check_io_address(what, "out", io.out, false));
  DP_RETURN_IF_ERROR(check_io_address(what, "residual_out", io.residual_out, false));
  const auto& kvl = kv[layer];
  DeviceScope scope(device.get());
  DP_RETURN_IF_ERROR(scope.status());
  auto value_of = [&](ParamSource src) -> uint64_t {
    switch (src) {
      case ParamSource::io_hidden: return io.hidden;
      case ParamSource::io_residual: return io.residual;
      case ParamSource::io_out: return io.out;
      case ParamSource::io_residual_out: return io.residual_out;
      case ParamSource::io_positions: return io.positions;
      case ParamSource::io_state_indices: return io.state_indices;
      case ParamSource::io_block_table: return io.block_table;
      case ParamSource::io_seq_lens: return io.seq_lens;
      case ParamSource::io_slot_mapping: return io.slot_mapping;
      case ParamSource::io_num_accepted: return io.num_accepted;
      case ParamSource::kv_kda_state: return kvl[DP_KV_KDA_STATE].data;
      case ParamSource::kv_conv_q: return kvl[DP_KV_CONV_Q].data;
      case ParamSource::kv_conv_k: return kvl[DP_KV_CONV_K].data;
      case ParamSource::kv_conv_v: return kvl[DP_KV_CONV_V].data;
      case ParamSource::kv_mla_latent: return kvl[DP_KV_MLA_LATENT].data;
      case ParamSource::io_block_table_stride: return static_cast<uint32_t>(io.block_table_stride);
      case ParamSource::kda_state_stride: return static_cast<uint32_t>(kvl[DP_KV_KDA_STATE].lead_stride);
      case ParamSource::conv_stride: return static_cast<uint32_t>(kvl[DP_KV_CONV_Q].lead_stride);
      case ParamSource::mla_block_stride: return static_cast<uint32_t>(kvl[DP_KV_MLA_LATENT].lead_stride);
      case ParamSource::kv_attn_res: return attn_res.data;
      case ParamSource::attn_res_stride: return static_cast<uint32_t>(attn_res.lead_stride);
      default: return 0;
    }
  };
  const std::vector<LoadedKernel>& program = layer_programs[step->index][layer];
  // Before anything is enqueued: a layer whose program calls NCCL needs the communicator (dp_plan
  // refuses such steps too, DP_REASON_NO_COMMUNICATOR, but a host may launch without planning).
  if (step->nccl && !nccl_comm)
    return error(DP_ERR_STATE, "{}: layer {} ({} program, width {}) all-reduces with NCCL (deploy allreduce) and the "
                 "session has no communicator: call dp_session_init_nccl (or dp_session_set_nccl_comm) first", label(),
                 layer, m.layers[layer].cls, step->width);
  // Forks of other layers start now; this layer's start after the kernel they overlap.
  DP_RETURN_IF_ERROR(fire_prefetch([&](const ArmedPrefetch& a) { return a.layer != layer || a.after < 0; }));
  for (size_t i = 0; i < program.size(); ++i) {
    const LoadedKernel& k = program[i];
    if (observer) observer(observer_user, layer, static_cast<int32_t>(i), k.name().c_str(), 0, stream);
    Status st;
    if (k.collective) {
      // Between the layer's kernels, on the same stream: NCCL's kernel waits for the partial before it
      // reads it, and the next kernel (programmatic launch or not) starts after the sum is complete.
      const uint64_t recv = k.recv ? k.recv : io.out;
      st = nccl_check(*nccl, nccl->AllReduce(reinterpret_cast<const void*>(k.send), reinterpret_cast<void*>(recv),
                                             k.elements, kNcclBfloat16, kNcclSum, nccl_comm, stream),
                      "ncclAllReduce", fmt::format("{}: layer {} step {} ({} bf16)", label(), layer, i, k.elements));
    } else {
      st = launch_packed(*device, k, stream, programmatic, value_of);
    }
    if (observer) observer(observer_user, layer, static_cast<int32_t>(i), k.name().c_str(), 1, stream);
    DP_RETURN_IF_ERROR(std::move(st));
    if (!armed.empty())
      DP_RETURN_IF_ERROR(fire_prefetch([&](const ArmedPrefetch& a) { return a.after <= static_cast<int32_t>(i); }));
  }
  return fire_prefetch(nullptr);
}

// ---- Prefetch -----------------------------------------------------------------------------------------

Status dp_session::prefetch_fork(int32_t point, int32_t layer, int32_t width, dp_stream stream, int32_t* launched) {
  if (launched) *launched = 0;
  if (point < DP_PREFETCH_OPROJ_DOWN || point > DP_PREFETCH_ATTENTION_OPROJ)
    return error(DP_ERR_INVALID_ARGUMENT, "dp_prefetch_fork: point {}, expected a dp_prefetch_point (0..3)", point);
  if (!device) return error(DP_ERR_NO_DEVICE, "{}: dp_prefetch_fork on a host-only session", label());
  if (!loaded) return error(DP_ERR_STATE, "{}: dp_prefetch_fork before dp_session_load_kernels", label());
  if (options.flags & DP_SESSION_NO_PREFETCH) return ok();
  const auto it = prefetch_index.find({point, layer, width});
  if (it == prefetch_index.end() || it->second.off) return ok();
  // Armed, not launched: the layer's launch starts it after the kernel it overlaps (fire_after), and the
  // next launch of another layer, the final norm or join starts it where the host did not launch this
  // layer next. A second fork of the same point and layer replaces the first.
  std::erase_if(armed, [&](const ArmedPrefetch& a) { return a.point == point && a.layer == layer; });
  armed.push_back(ArmedPrefetch{it->second.table, point, layer, it->second.after, stream});
  if (launched) *launched = 1;
  return ok();
}

Status dp_session::fire_prefetch(const std::function<bool(const ArmedPrefetch&)>& fire) {
  for (size_t i = 0; i < armed.size();) {
    if (fire && !fire(armed[i])) {
      ++i;
      continue;
    }
    const ArmedPrefetch a = armed[i];
    armed.erase(armed.begin() + static_cast<std::ptrdiff_t>(i));
    const PrefetchTable& t = prefetch[a.table];
    // The prefetch may start only once the work it overlaps was issued: the side stream waits on an
    // event recorded on the host's stream (under capture this also pulls the side stream into the graph).
    DP_RETURN_IF_ERROR(device->record(events[t.event], a.stream));
    DP_RETURN_IF_ERROR(device->wait(side_stream, events[t.event]));
    LaunchSpec l;
    l.function = t.kernel.function;
    l.grid[0] = static_cast<uint32_t>(t.entry->grid);
    std::copy(t.kernel.entry->block, t.kernel.entry->block + 3, l.block);
    l.dynamic_shared = t.kernel.entry->dynamic_shared_bytes;
    l.stream = side_stream;
    l.params = const_cast<uint8_t*>(t.kernel.block.data());
    l.param_bytes = t.kernel.block.size();
    // Critical tables (the MoE front, the o-projection) get the greatest stream priority. Not the
    // maximum shared-memory carveout the seed also asks for: on the H200 it cost 3 to 24% of a whole
    // step (the SMs the prefetch lands on are reconfigured, and the layer kernels after it wait for
    // that; bench/NOTES.md, prefetch), with priority alone within noise of no prefetch.
    l.high_priority = t.entry->critical;
    prefetch_pending = true;  // the side stream now depends on the host's stream: join must close it
    const char* name = t.kernel.entry->name.c_str();
    if (observer) observer(observer_user, a.layer, -1 - a.point, name, 0, side_stream);
    Status st = device->launch(l, t.kernel.entry->key.c_str());
    if (observer) observer(observer_user, a.layer, -1 - a.point, name, 1, side_stream);
    DP_RETURN_IF_ERROR(std::move(st));
  }
  return ok();
}

Status dp_session::prefetch_join(dp_stream stream) {
  if (!device) return error(DP_ERR_NO_DEVICE, "{}: dp_prefetch_join on a host-only session", label());
  if (armed.empty() && !prefetch_pending) return ok();
  DeviceScope scope(device.get());
  DP_RETURN_IF_ERROR(scope.status());
  DP_RETURN_IF_ERROR(fire_prefetch(nullptr));
  DP_RETURN_IF_ERROR(device->record(join_event, side_stream));
  DP_RETURN_IF_ERROR(device->wait(stream, join_event));
  prefetch_pending = false;
  return ok();
}

Status dp_session::prefetch_set_cap(int32_t point, int32_t width, uint64_t bytes) {
  if (point < DP_PREFETCH_OPROJ_DOWN || point > DP_PREFETCH_ATTENTION_OPROJ)
    return error(DP_ERR_INVALID_ARGUMENT, "dp_prefetch_set_cap: point {}, expected a dp_prefetch_point (0..3)", point);
  if (!device) return error(DP_ERR_NO_DEVICE, "{}: dp_prefetch_set_cap on a host-only session", label());
  if (!loaded) return error(DP_ERR_STATE, "{}: dp_prefetch_set_cap before dp_session_load_kernels", label());
  if (!armed.empty() || prefetch_pending)
    return error(DP_ERR_STATE, "{}: dp_prefetch_set_cap between a fork and its join", label());
  DeviceScope scope(device.get());
  DP_RETURN_IF_ERROR(scope.status());
  for (auto it = prefetch_index.begin(); it != prefetch_index.end();) {
    const auto& [key, slot] = *it;
    if (key[0] != point || key[2] != width) {
      ++it;
      continue;
    }
    it->second.off = bytes == 0;
    if (bytes == 0) {  // off at this width
      ++it;
      continue;
    }
    // The table's leading `bytes`, in table order, from the table as the bundle made it (a cap above
    // it restores it). The clipped table gets its own device buffer.
    const PrefetchTable& base = prefetch[slot.table];
    std::vector<uint64_t> host;
    uint64_t left = bytes;
    for (size_t r = 0; r + 1 < base.host.size() && left >= kAlign; r += 2) {
      const uint64_t b = std::min(base.host[r + 1], left) / kAlign * kAlign;
      host.push_back(base.host[r]);
      host.push_back(b);
      left -= b;
    }
    PrefetchTable t = base;  // keeps the whole table (host) for later caps
    t.count = static_cast<uint32_t>(host.size() / 2);
    if (t.count == 0) {  // a cap under 16 bytes
      it->second.off = true;
      ++it;
      continue;
    }
    uint64_t dev = 0;
    DP_RETURN_IF_ERROR(device->alloc(host.size() * sizeof(uint64_t), "a capped prefetch range table", &dev));
    capped_tables.push_back(dev);
    DP_RETURN_IF_ERROR(device->upload(dev, host.data(), host.size() * sizeof(uint64_t), "a capped prefetch range table"));
    t.device_table = dev;
    for (const ParamSlot& s : prefetch_call_slots) {
      if (s.source == ParamSource::prefetch_table) put<uint64_t>(t.kernel.block.data(), s.offset, t.device_table);
      if (s.source == ParamSource::prefetch_count) put<uint32_t>(t.kernel.block.data(), s.offset, t.count);
    }
    prefetch.push_back(std::move(t));
    it->second.table = prefetch.size() - 1;
    ++it;
  }
  return ok();
}
