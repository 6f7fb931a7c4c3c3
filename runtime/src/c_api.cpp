// The C ABI (decodepack.h): argument checks, versioned-struct handling, and the one place where an
// internal Status becomes a dp_status and where no exception may pass.
#include <cstring>
#include <new>
#include <string>

#include "decodepack/decodepack.h"
#include "format/manifest.h"
#include "src/bundle.h"
#include "src/device.h"
#include "src/indexer.h"
#include "src/nccl.h"
#include "src/session.h"
#include "src/status.h"
#include "src/validity.h"

// The public header's format version is the reader's (runtime/format/manifest.h): one number.
static_assert(DP_BUNDLE_FORMAT_MAJOR == dp::format::kFormatMajor && DP_BUNDLE_FORMAT_MINOR == dp::format::kFormatMinor,
              "decodepack.h's DP_BUNDLE_FORMAT_* must equal dp::format::kFormatMajor/kFormatMinor");

struct dp_status {
  dp_code code;
  std::string message;
};

using namespace dp::rt;

namespace {

// Returned when even the status cannot be allocated; dp_status_free ignores it.
dp_status g_out_of_memory{DP_ERR_OUT_OF_MEMORY, "out of host memory"};

dp_status* to_c(const Status& s) {
  if (s.ok()) return nullptr;
  try {
    return new dp_status{s.code(), s.message()};
  } catch (...) {
    return &g_out_of_memory;
  }
}

// Runs `f` (returning a Status) so that nothing thrown escapes into C.
template <typename F>
dp_status* guarded(const char* fn, F&& f) {
  try {
    return to_c(f(fn));
  } catch (const std::bad_alloc&) {
    return &g_out_of_memory;
  } catch (const std::exception& e) {
    return to_c(error(DP_ERR_INTERNAL, "{}: unexpected error: {}", fn, e.what()));
  } catch (...) {
    return to_c(error(DP_ERR_INTERNAL, "{}: unexpected error", fn));
  }
}

Status null_arg(const char* fn, const char* arg) {
  return error(DP_ERR_INVALID_ARGUMENT, "{}: {} is NULL", fn, arg);
}

// Copies a caller's versioned struct into `out` (which holds this library's defaults): the first
// min(size, sizeof(T)) bytes; a larger size is accepted only when the tail this library does not know
// is zero (a newer caller that leaves new fields at their defaults).
template <typename T>
Status read_versioned(const char* fn, const char* what, const T* in, T* out) {
  if (in->size < sizeof(size_t))
    return error(DP_ERR_INVALID_ARGUMENT, "{}: {}.size is {}, expected sizeof({}) = {} (call {}_init)", fn, what, in->size,
                 what, sizeof(T), what);
  if (in->size > sizeof(T)) {
    const auto* tail = reinterpret_cast<const unsigned char*>(in) + sizeof(T);
    for (size_t i = 0; i < in->size - sizeof(T); ++i)
      if (tail[i])
        return error(DP_ERR_INVALID_ARGUMENT, "{}: {}.size is {}, this library knows {} bytes and the rest sets fields it "
                     "does not implement (libdecodepack {})", fn, what, in->size, sizeof(T), dp_version_string());
  }
  std::memcpy(out, in, in->size < sizeof(T) ? in->size : sizeof(T));
  out->size = sizeof(T);
  return ok();
}

// Output structs: the caller's size says how much it can take.
template <typename T>
Status check_out(const char* fn, const char* what, const T* out) {
  if (!out) return null_arg(fn, what);
  if (out->size < sizeof(size_t))
    return error(DP_ERR_INVALID_ARGUMENT, "{}: {}->size is {}, expected sizeof = {} (call the _init function)", fn, what,
                 out->size, sizeof(T));
  return ok();
}

template <typename T>
void write_out(T* out, T value) {
  const size_t n = out->size < sizeof(T) ? out->size : sizeof(T);
  value.size = out->size;
  std::memcpy(out, &value, n);
}

}  // namespace

extern "C" {

// ---- Versions and status ------------------------------------------------------------------------------

uint32_t dp_version(void) { return DP_VERSION_NUMBER; }

const char* dp_version_string(void) {
#define DP_STR2(x) #x
#define DP_STR(x) DP_STR2(x)
  return DP_STR(DP_VERSION_MAJOR) "." DP_STR(DP_VERSION_MINOR) "." DP_STR(DP_VERSION_PATCH);
#undef DP_STR
#undef DP_STR2
}

dp_code dp_status_code(const dp_status* s) { return s ? s->code : DP_OK; }
const char* dp_status_message(const dp_status* s) { return s ? s->message.c_str() : ""; }
void dp_status_free(dp_status* s) {
  if (s && s != &g_out_of_memory) delete s;
}

const char* dp_code_name(int32_t code) {
  static const char* const names[] = {
      "DP_OK", "DP_ERR_INVALID_ARGUMENT", "DP_ERR_OUT_OF_MEMORY", "DP_ERR_IO", "DP_ERR_FORMAT_VERSION",
      "DP_ERR_FORMAT", "DP_ERR_INTEGRITY", "DP_ERR_DRIVER_UNAVAILABLE", "DP_ERR_DRIVER", "DP_ERR_NO_DEVICE",
      "DP_ERR_TARGET", "DP_ERR_DRIVER_VERSION", "DP_ERR_DEVICE_LIMITS", "DP_ERR_RANK", "DP_ERR_CONFIG",
      "DP_ERR_UNKNOWN_TENSOR", "DP_ERR_MISSING_TENSOR", "DP_ERR_DTYPE", "DP_ERR_SHAPE", "DP_ERR_LAYOUT",
      "DP_ERR_ALIGNMENT", "DP_ERR_REBIND", "DP_ERR_STATE", "DP_ERR_NO_KERNEL", "DP_ERR_ABORTED",
      "DP_ERR_NOT_SUPPORTED", "DP_ERR_INTERNAL", "DP_ERR_COMMUNICATOR", "DP_ERR_NCCL_UNAVAILABLE",
  };
  if (code < 0 || code >= static_cast<int32_t>(sizeof(names) / sizeof(names[0]))) return "DP_ERR_?";
  return names[code];
}

const char* dp_reason_name(int32_t reason) {
  static const char* const names[] = {
      "DP_REASON_NONE", "DP_REASON_NO_KV", "DP_REASON_PP_STAGE_INPUT", "DP_REASON_PIECEWISE",
      "DP_REASON_TOO_MANY_REQUESTS", "DP_REASON_NOT_UNIFORM", "DP_REASON_BAD_METADATA", "DP_REASON_INVALID",
      "DP_REASON_NO_COMMUNICATOR",
  };
  if (reason < 0 || reason >= static_cast<int32_t>(sizeof(names) / sizeof(names[0]))) return "DP_REASON_?";
  return names[reason];
}

// ---- Types --------------------------------------------------------------------------------------------

const char* dp_dtype_name(int32_t dtype) {
  static const char* const names[] = {"?",   "BF16", "F16", "F32",     "F64",     "U8",      "I8",
                                      "I16", "I32",  "I64", "F8_E4M3", "F8_E5M2", "F8_E8M0", "BOOL"};
  if (dtype < 0 || dtype >= static_cast<int32_t>(sizeof(names) / sizeof(names[0]))) return "?";
  return names[dtype];
}

size_t dp_dtype_size(int32_t dtype) {
  switch (dtype) {
    case DP_DTYPE_BF16: case DP_DTYPE_F16: case DP_DTYPE_I16: return 2;
    case DP_DTYPE_F32: case DP_DTYPE_I32: return 4;
    case DP_DTYPE_F64: case DP_DTYPE_I64: return 8;
    case DP_DTYPE_U8: case DP_DTYPE_I8: case DP_DTYPE_F8_E4M3: case DP_DTYPE_F8_E5M2: case DP_DTYPE_F8_E8M0:
    case DP_DTYPE_BOOL: return 1;
    default: return 0;
  }
}

void dp_tensor_init(dp_tensor* t, uint64_t data, int32_t dtype, int32_t ndim, const int64_t* shape) {
  if (!t) return;
  std::memset(t, 0, sizeof(*t));
  t->data = data;
  t->dtype = dtype;
  t->ndim = ndim < 0 ? 0 : ndim > DP_MAX_DIMS ? DP_MAX_DIMS : ndim;
  int64_t stride = 1;
  for (int32_t i = t->ndim - 1; i >= 0; --i) {
    t->shape[i] = shape ? shape[i] : 0;
    t->strides[i] = stride;
    stride *= t->shape[i];
  }
}

void dp_device_desc_init(dp_device_desc* d) {
  if (!d) return;
  std::memset(d, 0, sizeof(*d));
  d->size = sizeof(*d);
}

void dp_bundle_open_options_init(dp_bundle_open_options* o) {
  if (!o) return;
  std::memset(o, 0, sizeof(*o));
  o->size = sizeof(*o);
}

void dp_session_options_init(dp_session_options* o) {
  if (!o) return;
  std::memset(o, 0, sizeof(*o));
  o->size = sizeof(*o);
  o->vendor = DP_VENDOR_CUDA;
  o->device = 0;
  o->rank = 0;
  o->tensor_parallel = 0;
  o->num_speculative_tokens = -1;
}

void dp_step_desc_init(dp_step_desc* d) {
  if (!d) return;
  std::memset(d, 0, sizeof(*d));
  d->size = sizeof(*d);
  d->graph_mode = DP_GRAPH_NONE;
}

void dp_plan_result_init(dp_plan_result* r) {
  if (!r) return;
  std::memset(r, 0, sizeof(*r));
  r->size = sizeof(*r);
}

void dp_layer_io_init(dp_layer_io* io) {
  if (!io) return;
  std::memset(io, 0, sizeof(*io));
  io->size = sizeof(*io);
}

void dp_final_norm_io_init(dp_final_norm_io* io) {
  if (!io) return;
  std::memset(io, 0, sizeof(*io));
  io->size = sizeof(*io);
}

void dp_lm_head_io_init(dp_lm_head_io* io) {
  if (!io) return;
  std::memset(io, 0, sizeof(*io));
  io->size = sizeof(*io);
}

// ---- Devices ------------------------------------------------------------------------------------------

dp_status* dp_device_query(int32_t vendor, int32_t ordinal, dp_device_desc* out) {
  return guarded(__func__, [&](const char* fn) -> Status {
    DP_RETURN_IF_ERROR(check_out(fn, "out", out));
    return query_device(vendor, ordinal, out);
  });
}

dp_status* dp_device_count(int32_t vendor, int32_t* count) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!count) return null_arg(fn, "count");
    return device_count(vendor, count);
  });
}

// ---- Bundles ------------------------------------------------------------------------------------------

dp_status* dp_bundle_open(const char* path, const dp_bundle_open_options* options, dp_bundle** out) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!out) return null_arg(fn, "out");
    *out = nullptr;
    if (!path) return null_arg(fn, "path");
    dp_bundle_open_options o;
    dp_bundle_open_options_init(&o);
    if (options) DP_RETURN_IF_ERROR(read_versioned(fn, "dp_bundle_open_options", options, &o));
    if (o.flags != 0)
      return error(DP_ERR_INVALID_ARGUMENT, "{}: options.flags {:#x}, expected 0 (no flags are defined)", fn, o.flags);
    auto b = dp_bundle::open(path);
    if (!b.ok()) return b.status();
    *out = *b;
    return ok();
  });
}

void dp_bundle_close(dp_bundle* b) {
  if (b) b->release();
}

dp_status* dp_bundle_get_info(const dp_bundle* b, dp_bundle_info* out) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!b) return null_arg(fn, "bundle");
    DP_RETURN_IF_ERROR(check_out(fn, "out", out));
    const auto& m = b->manifest();
    dp_bundle_info i{};
    i.format_major = m.format_version.major;
    i.format_minor = m.format_version.minor;
    i.digest = b->reader.digest().c_str();
    i.tool_version = b->tool_version.c_str();
    i.model_type = b->model_type.c_str();
    i.num_layers = static_cast<int32_t>(m.layers.size());
    i.hidden_size = m.model.hidden_size;
    i.rms_norm_eps = m.model.rms_norm_eps;
    i.tensor_parallel = b->deploy.tensor_parallel;
    i.num_ranks = static_cast<int32_t>(b->deploy.ranks.size());
    i.ranks = b->deploy.ranks.data();
    i.num_widths = static_cast<int32_t>(b->deploy.widths.size());
    i.widths = b->deploy.widths.data();
    i.q = b->deploy.q;
    i.num_targets = static_cast<int32_t>(b->target_names.size());
    i.targets = b->target_names.data();
    i.weights_fingerprinted = m.weights_fingerprinted ? 1 : 0;
    i.indexer_heads = static_cast<int32_t>(m.indexer.heads);
    i.indexer_top_k = static_cast<int32_t>(m.indexer.top_k);
    i.indexer_prefill_workspace_bytes = m.indexer.prefill_workspace_bytes;
    i.config_digest = m.model.config_digest.c_str();
    i.deploy_json = b->deploy_json.c_str();
    i.manifest_json = b->reader.manifest_bytes().c_str();
    i.vocab_size = m.model.vocab_size;
    write_out(out, i);
    return ok();
  });
}

dp_status* dp_bundle_get_layer(const dp_bundle* b, int32_t layer, dp_layer_info* out) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!b) return null_arg(fn, "bundle");
    DP_RETURN_IF_ERROR(check_out(fn, "out", out));
    const auto& layers = b->manifest().layers;
    if (layer < 0 || static_cast<size_t>(layer) >= layers.size())
      return error(DP_ERR_INVALID_ARGUMENT, "{}: layer {}, expected 0..{}", fn, layer, layers.size() - 1);
    dp_layer_info i{};
    i.index = layer;
    i.mixer = layers[layer].mixer == "kda" ? DP_MIXER_KDA : DP_MIXER_MLA;
    i.ffn = layers[layer].ffn.c_str();
    i.layer_class = layers[layer].cls.c_str();
    write_out(out, i);
    return ok();
  });
}

int32_t dp_bundle_weight_count(const dp_bundle* b, int32_t rank) {
  if (!b) return -1;
  const RankWeights* r = b->rank_weights(rank);
  return r ? static_cast<int32_t>(r->weights.size()) : -1;
}

dp_status* dp_bundle_get_weight(const dp_bundle* b, int32_t rank, int32_t index, dp_weight_info* out) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!b) return null_arg(fn, "bundle");
    DP_RETURN_IF_ERROR(check_out(fn, "out", out));
    const RankWeights* r = b->rank_weights(rank);
    if (!r) return check_rank(*b, rank);
    if (index < 0 || static_cast<size_t>(index) >= r->weights.size())
      return error(DP_ERR_INVALID_ARGUMENT, "{}: index {}, rank {} has weights 0..{}", fn, index, rank,
                   r->weights.size() - 1);
    const WeightSpec& w = r->weights[index];
    dp_weight_info i{};
    i.name = r->names[index].c_str();
    i.dtype = w.dtype;
    i.ndim = static_cast<int32_t>(w.entry->shape.size());
    for (int32_t d = 0; d < i.ndim; ++d) i.shape[d] = w.entry->shape[d];
    i.experts = static_cast<int32_t>(w.entry->experts);
    i.layer = w.entry->layer;
    i.split_dim = w.entry->split_dim;
    write_out(out, i);
    return ok();
  });
}

dp_status* dp_bundle_query_validity(const dp_bundle* b, const dp_device_desc* device, int32_t rank) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!b) return null_arg(fn, "bundle");
    if (rank < -1) return error(DP_ERR_INVALID_ARGUMENT, "{}: rank {}, expected >= 0 or -1", fn, rank);
    if (rank != -1) DP_RETURN_IF_ERROR(check_rank(*b, rank));
    if (!device) {
      for (const std::string& t : b->deploy.targets) DP_RETURN_IF_ERROR(check_kernels(*b, t));
      return ok();
    }
    dp_device_desc d;
    dp_device_desc_init(&d);
    DP_RETURN_IF_ERROR(read_versioned(fn, "dp_device_desc", device, &d));
    d.arch[sizeof(d.arch) - 1] = 0;
    d.name[sizeof(d.name) - 1] = 0;
    std::string target;
    DP_RETURN_IF_ERROR(check_device(*b, d, -1, &target));
    return check_kernels(*b, target);
  });
}

// ---- Sessions -----------------------------------------------------------------------------------------

dp_status* dp_session_create(dp_bundle* b, const dp_session_options* options, dp_session** out) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!out) return null_arg(fn, "out");
    *out = nullptr;
    if (!b) return null_arg(fn, "bundle");
    dp_session_options o;
    dp_session_options_init(&o);
    if (options) DP_RETURN_IF_ERROR(read_versioned(fn, "dp_session_options", options, &o));
    dp_device_desc desc;
    if (o.device_desc) {
      dp_device_desc_init(&desc);
      DP_RETURN_IF_ERROR(read_versioned(fn, "dp_device_desc", o.device_desc, &desc));
      desc.arch[sizeof(desc.arch) - 1] = 0;
      desc.name[sizeof(desc.name) - 1] = 0;
      o.device_desc = &desc;
    }
    auto s = dp_session::create(b, o);
    if (!s.ok()) return s.status();
    (*s)->options.device_desc = nullptr;  // the caller's memory: not kept
    *out = *s;
    return ok();
  });
}

const char* dp_session_target(const dp_session* s) { return s ? s->target.c_str() : ""; }

void dp_session_destroy(dp_session* s) {
  try {
    delete s;
  } catch (...) {
  }
}

dp_status* dp_session_bind_weight(dp_session* s, const char* name, const dp_tensor* t) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!name) return null_arg(fn, "name");
    if (!t) return null_arg(fn, "tensor");
    return s->bind_weight(name, *t);
  });
}

dp_status* dp_session_bind_expert_weights(dp_session* s, const char* group, const uint64_t* data, int32_t count,
                                          const dp_tensor* expert) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!group) return null_arg(fn, "group");
    if (!data) return null_arg(fn, "data");
    if (!expert) return null_arg(fn, "expert");
    return s->bind_experts(group, data, count, *expert);
  });
}

dp_status* dp_session_finalize_weights(dp_session* s) {
  return guarded(__func__, [&](const char* fn) -> Status { return s ? s->finalize_weights() : null_arg(fn, "session"); });
}

dp_status* dp_session_verify_weights(dp_session* s) {
  return guarded(__func__, [&](const char* fn) -> Status { return s ? s->verify_weights() : null_arg(fn, "session"); });
}

dp_status* dp_session_load_kernels(dp_session* s) {
  return guarded(__func__, [&](const char* fn) -> Status { return s ? s->load_kernels() : null_arg(fn, "session"); });
}

dp_status* dp_session_bind_kv(dp_session* s, int32_t layer, int32_t kind, const dp_tensor* t) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!t) return null_arg(fn, "tensor");
    return s->bind_kv(layer, kind, *t);
  });
}

dp_status* dp_session_release_kv(dp_session* s) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    s->release_kv();
    return ok();
  });
}

dp_status* dp_session_kv_layout(const dp_session* s, int32_t layer, int32_t kind, int64_t count, dp_tensor* out) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!out) return null_arg(fn, "out");
    return s->kv_layout(layer, kind, count, out);
  });
}

// ---- Planning -----------------------------------------------------------------------------------------

dp_status* dp_plan(dp_session* s, const dp_step_desc* desc, dp_plan_result* out) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!desc) return null_arg(fn, "desc");
    DP_RETURN_IF_ERROR(check_out(fn, "out", out));
    dp_step_desc d;
    dp_step_desc_init(&d);
    DP_RETURN_IF_ERROR(read_versioned(fn, "dp_step_desc", desc, &d));
    return s->plan(d, out);
  });
}

int32_t dp_step_width(const dp_step* step) { return step ? step->width : 0; }
int32_t dp_step_q(const dp_step* step) { return step ? step->q : 0; }

int32_t dp_step_layer_kernel(const dp_step* step, int32_t layer) {
  if (!step || layer < 0 || static_cast<size_t>(layer) >= step->layer_program.size()) return 0;
  return step->layer_program[layer];
}

int32_t dp_agree(const int32_t* reasons, int32_t n, int32_t* refusing_rank) {
  if (refusing_rank) *refusing_rank = -1;
  if (!reasons || n <= 0) return DP_REASON_INVALID;
  for (int32_t r = 0; r < n; ++r) {
    if (reasons[r] < DP_REASON_NONE || reasons[r] > DP_REASON_NO_COMMUNICATOR) {
      if (refusing_rank) *refusing_rank = r;
      return DP_REASON_INVALID;
    }
    if (reasons[r] != DP_REASON_NONE) {
      if (refusing_rank) *refusing_rank = r;
      return reasons[r];
    }
  }
  return DP_REASON_NONE;
}

dp_status* dp_after_step(dp_session* s) {
  return guarded(__func__, [&](const char* fn) -> Status { return s ? s->after_step() : null_arg(fn, "session"); });
}

uint64_t dp_session_exchange_bytes(const dp_session* s) { return s ? s->exchange_bytes() : 0; }

dp_status* dp_session_set_peers(dp_session* s, const uint64_t* exchange, int32_t num_ranks, uint32_t timeout_us) {
  return guarded(__func__, [&](const char* fn) -> Status {
    return s ? s->set_peers(exchange, num_ranks, timeout_us) : null_arg(fn, "session");
  });
}

int32_t dp_session_nccl_widths(const dp_session* s, int32_t* widths, int32_t capacity) {
  if (!s) return 0;
  const std::vector<int32_t> w = s->nccl_widths();
  for (int32_t i = 0; widths && i < capacity && i < static_cast<int32_t>(w.size()); ++i) widths[i] = w[static_cast<size_t>(i)];
  return static_cast<int32_t>(w.size());
}

dp_status* dp_nccl_get_unique_id(const char* library, uint8_t unique_id[128]) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!unique_id) return null_arg(fn, "unique_id");
    auto api = dp::rt::nccl_api(dp::rt::nccl_library_name(library));
    if (!api.ok()) return api.status();
    dp::rt::NcclUniqueId id{};
    DP_RETURN_IF_ERROR(dp::rt::nccl_check(**api, (*api)->GetUniqueId(&id), "ncclGetUniqueId"));
    std::memcpy(unique_id, id.internal, sizeof id.internal);
    return ok();
  });
}

dp_status* dp_session_init_nccl(dp_session* s, const uint8_t unique_id[128], const char* library) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!unique_id) return null_arg(fn, "unique_id");
    return s->set_nccl(unique_id, nullptr, library);
  });
}

dp_status* dp_session_set_nccl_comm(dp_session* s, void* comm, const char* library) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!comm) return null_arg(fn, "comm");
    return s->set_nccl(nullptr, comm, library);
  });
}

dp_status* dp_session_error_flag(const dp_session* s, uint64_t* device_address, uint32_t* value) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (device_address) *device_address = s->flag_device;
    if (value) *value = *static_cast<volatile const uint32_t*>(s->flag_host);
    return ok();
  });
}

dp_status* dp_session_raise_error_flag(dp_session* s, uint32_t bits) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    // The device may OR into the same word concurrently (system-scope atomics): match with a host atomic.
    __atomic_fetch_or(s->flag_host, bits, __ATOMIC_SEQ_CST);
    return ok();
  });
}

dp_status* dp_session_set_launch_observer(dp_session* s, dp_launch_observer_fn fn, void* user) {
  return guarded(__func__, [&](const char* fn_name) -> Status {
    if (!s) return null_arg(fn_name, "session");
    s->observer = fn;
    s->observer_user = fn ? user : nullptr;
    return ok();
  });
}

// ---- Launch -------------------------------------------------------------------------------------------

dp_status* dp_launch_layer(dp_session* s, const dp_step* step, int32_t layer, const dp_layer_io* io, dp_stream stream) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!io) return null_arg(fn, "io");
    dp_layer_io v;
    dp_layer_io_init(&v);
    DP_RETURN_IF_ERROR(read_versioned(fn, "dp_layer_io", io, &v));
    return s->launch_layer(step, layer, v, stream);
  });
}

dp_status* dp_launch_final_norm(dp_session* s, const dp_step* step, const dp_final_norm_io* io, dp_stream stream) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!io) return null_arg(fn, "io");
    dp_final_norm_io v;
    dp_final_norm_io_init(&v);
    DP_RETURN_IF_ERROR(read_versioned(fn, "dp_final_norm_io", io, &v));
    return s->launch_final_norm(step, v, stream);
  });
}

dp_status* dp_session_bind_lm_head(dp_session* s, const dp_tensor* weight) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!weight) return null_arg(fn, "weight");
    return s->bind_lm_head(*weight);
  });
}

int32_t dp_step_lm_head(const dp_step* step) { return step && step->lm_head ? 1 : 0; }

dp_status* dp_launch_lm_head(dp_session* s, const dp_step* step, const dp_lm_head_io* io, dp_stream stream) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!io) return null_arg(fn, "io");
    dp_lm_head_io v;
    dp_lm_head_io_init(&v);
    DP_RETURN_IF_ERROR(read_versioned(fn, "dp_lm_head_io", io, &v));
    return s->launch_lm_head(step, v, stream);
  });
}

dp_status* dp_prefetch_fork(dp_session* s, int32_t point, int32_t layer, int32_t width, dp_stream stream,
                            int32_t* launched) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (launched) *launched = 0;
    if (!s) return null_arg(fn, "session");
    return s->prefetch_fork(point, layer, width, stream, launched);
  });
}

dp_status* dp_prefetch_join(dp_session* s, dp_stream stream) {
  return guarded(__func__, [&](const char* fn) -> Status { return s ? s->prefetch_join(stream) : null_arg(fn, "session"); });
}

dp_status* dp_prefetch_set_cap(dp_session* s, int32_t point, int32_t width, uint64_t bytes) {
  return guarded(__func__, [&](const char* fn) -> Status {
    return s ? s->prefetch_set_cap(point, width, bytes) : null_arg(fn, "session");
  });
}

// ---- Sparse-attention indexer prefill ------------------------------------------------------------------

void dp_indexer_cache_init(dp_indexer_cache* c) {
  if (!c) return;
  *c = dp_indexer_cache{};
  c->size = sizeof(*c);
  c->layout = DP_INDEXER_LAYOUT_SPLIT;
}

void dp_indexer_batch_desc_init(dp_indexer_batch_desc* d) {
  if (!d) return;
  *d = dp_indexer_batch_desc{};
  d->size = sizeof(*d);
}

void dp_indexer_plan_info_init(dp_indexer_plan_info* i) {
  if (!i) return;
  *i = dp_indexer_plan_info{};
  i->size = sizeof(*i);
}

void dp_indexer_prefill_io_init(dp_indexer_prefill_io* io) {
  if (!io) return;
  *io = dp_indexer_prefill_io{};
  io->size = sizeof(*io);
  io->weight_scale = 1.0f;
}

dp_status* dp_indexer_write_keys(dp_session* s, const dp_indexer_cache* cache, uint64_t keys, uint64_t slot_mapping,
                                 int64_t count, dp_stream stream) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!cache) return null_arg(fn, "cache");
    dp_indexer_cache c;
    dp_indexer_cache_init(&c);
    DP_RETURN_IF_ERROR(read_versioned(fn, "dp_indexer_cache", cache, &c));
    return s->indexer_write_keys(c, keys, slot_mapping, count, stream);
  });
}

dp_status* dp_indexer_prepare(dp_session* s, const dp_indexer_batch_desc* desc, dp_indexer_metadata** out,
                              dp_indexer_plan_info* info) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (out) *out = nullptr;
    if (!s) return null_arg(fn, "session");
    if (!desc) return null_arg(fn, "desc");
    if (!out) return null_arg(fn, "out");
    if (info) DP_RETURN_IF_ERROR(check_out(fn, "info", info));
    dp_indexer_batch_desc d;
    dp_indexer_batch_desc_init(&d);
    DP_RETURN_IF_ERROR(read_versioned(fn, "dp_indexer_batch_desc", desc, &d));
    return s->indexer_prepare(d, out, info);
  });
}

void dp_indexer_metadata_free(dp_indexer_metadata* metadata) { delete metadata; }

dp_status* dp_indexer_prefill(dp_session* s, const dp_indexer_metadata* metadata, const dp_indexer_cache* cache,
                              const dp_indexer_prefill_io* io, dp_stream stream) {
  return guarded(__func__, [&](const char* fn) -> Status {
    if (!s) return null_arg(fn, "session");
    if (!metadata) return null_arg(fn, "metadata");
    if (!cache) return null_arg(fn, "cache");
    if (!io) return null_arg(fn, "io");
    dp_indexer_cache c;
    dp_indexer_cache_init(&c);
    DP_RETURN_IF_ERROR(read_versioned(fn, "dp_indexer_cache", cache, &c));
    dp_indexer_prefill_io v;
    dp_indexer_prefill_io_init(&v);
    DP_RETURN_IF_ERROR(read_versioned(fn, "dp_indexer_prefill_io", io, &v));
    return s->indexer_prefill(*metadata, c, v, stream);
  });
}

}  // extern "C"
