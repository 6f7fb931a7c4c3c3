// dp_session: one (device, rank) view of a bundle: bound weights and caches, loaded kernels with their
// parameter templates, prefetch tables and events, the error flag, and one dp_step per width.
//
// Everything that can fail for a reason known before a step (shapes, alignment, parameter names,
// kernel resources) fails in bind/finalize/load; the launch functions only pack precomputed parameter
// templates and call the driver.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "decodepack/decodepack.h"
#include "src/bundle.h"
#include "src/device.h"
#include "src/nccl.h"
#include "src/params.h"
#include "src/status.h"

namespace dp::rt {

struct WeightBinding {
  std::vector<uint64_t> data;  // one address, or one per expert (0: not bound)
  dp_tensor desc{};            // dtype, shape, strides as bound (all experts alike)
  bool described = false;
};

struct KvBinding {
  bool bound = false;
  uint64_t data = 0;
  int64_t count = 0;           // slots or blocks
  int64_t lead_stride = 0;     // elements between slots/blocks
};

// One parameter of a kernel, with where its value comes from.
struct ParamSlot {
  uint32_t offset = 0, size = 0;
  ParamSource source{};
  bool nullable = false;
  std::string name;
};

// A device address a launch reads or writes: non-zero (unless nullable) and a multiple of 16 bytes.
// DP_ERR_INVALID_ARGUMENT / DP_ERR_ALIGNMENT naming `what` and `field`.
Status check_io_address(const char* what, const char* field, uint64_t v, bool nullable);

// A loaded kernel and its parameter block with every value fixed at load already filled in; or a
// program's collective step (format 1.8: `collective` set, no entry or function): ncclAllReduce of
// `elements` bf16 from `send` into `recv` (0: the launch's dp_layer_io out).
struct LoadedKernel {
  const format::KernelEntry* entry = nullptr;
  void* function = nullptr;
  std::vector<ParamSlot> call_slots;   // filled per launch (io fields)
  std::vector<uint8_t> block;          // param_bytes, fixed values pre-packed
  const format::ProgramStepEntry* collective = nullptr;
  uint64_t elements = 0, send = 0, recv = 0;
  const std::string& name() const { return collective ? collective->collective : entry->name; }
};

struct PrefetchTable {
  const format::PrefetchEntry* entry = nullptr;
  uint64_t device_table = 0;  // {u64 addr, u64 bytes}[count] on the device
  uint32_t count = 0;
  LoadedKernel kernel;        // the prefetch kernel with table/count packed
  size_t event = 0;           // index into Session::events_ ((point, layer) pair)
  std::vector<uint64_t> host; // the table as uploaded, {addr, bytes} pairs (dp_prefetch_set_cap clips it)
};

// Where a (point, layer, width) table fires: after the launch of program step `after` of that layer
// (-1: before its first kernel).
struct PrefetchSlot {
  size_t table = 0;  // into Session::prefetch
  int32_t after = -1;
  bool off = false;  // dp_prefetch_set_cap(..., 0)
};

// A fork waiting for its layer's launch (or the next launch or join, whichever comes first).
struct ArmedPrefetch {
  size_t table = 0;
  int32_t point = 0, layer = 0, after = -1;
  dp_stream stream = nullptr;
};

}  // namespace dp::rt

struct dp_step {
  dp_session* session = nullptr;
  int32_t width = 0, q = 1;
  size_t index = 0;                     // into the session's widths
  std::vector<uint8_t> layer_program;   // per layer: 1 if the bundle has its program at this width
  std::vector<const dp::format::ProgramEntry*> program;  // per layer: that program, or null
  std::vector<std::string> why_not;     // per layer without one: why (for dp_launch_layer's message)
  bool lm_head = false;                 // the bundle has the LM head at this width on the session's target
  bool nccl = false;                    // some program at this width all-reduces with NCCL (format 1.8)
};

struct dp_session {
  ~dp_session();

  dp_bundle* bundle = nullptr;  // retained
  dp_session_options options{};
  std::string target;
  const dp::rt::RankWeights* weights = nullptr;
  std::unique_ptr<dp::rt::Device> device;  // null: host-only
  int32_t ordinal = DP_DEVICE_NONE;

  std::vector<dp::rt::WeightBinding> bindings;  // parallel to weights->weights
  bool finalized = false;
  bool loaded = false;
  std::vector<std::array<dp::rt::KvBinding, 6>> kv;  // per layer, indexed by dp_kv_kind (1..5)
  dp::rt::KvBinding attn_res;                         // DP_KV_ATTN_RES (layer -1): count = rows
  std::vector<std::unique_ptr<dp_step>> steps;        // one per width

  // Device resources (load_kernels).
  std::vector<void*> modules;
  std::map<const dp::format::KernelEntry*, void*> functions;  // loaded entry points
  std::vector<dp::rt::LoadedKernel> final_norm;        // per width index (function null: none in the bundle)
  std::vector<dp::rt::LoadedKernel> lm_head;           // per width index (function null: none in the bundle)
  uint64_t lm_head_weight = 0;                         // dp_session_bind_lm_head (0: not bound)
  std::vector<std::vector<std::vector<dp::rt::LoadedKernel>>> layer_programs;  // [width][layer][kernel]
  std::vector<dp::rt::PrefetchTable> prefetch;
  std::map<std::array<int32_t, 3>, dp::rt::PrefetchSlot> prefetch_index;  // (point, layer, width)
  std::vector<dp::rt::ArmedPrefetch> armed;                 // forks not launched yet, in fork order
  std::vector<uint64_t> capped_tables;                      // device buffers of dp_prefetch_set_cap
  std::vector<dp::rt::ParamSlot> prefetch_call_slots;       // where the prefetch kernel takes table and count
  std::vector<void*> events;                               // per (point, layer)
  void* side_stream = nullptr;
  void* join_event = nullptr;
  bool prefetch_pending = false;
  uint64_t prefetch_tables = 0;   // device buffer holding every table
  uint64_t workspace = 0;
  uint32_t* flag_host = nullptr;  // the error flag word (mapped host memory, or host_flag_ below)
  uint64_t flag_device = 0;
  uint32_t host_flag_storage = 0;
  bool aborted = false;
  // Tensor parallelism (dp_session_set_peers): every rank's exchange buffer, by rank, and the device
  // copy of that table the allreduce steps read; the bound of their waits.
  std::vector<uint64_t> peers;
  uint64_t peers_table = 0;
  uint32_t timeout_us = 0;
  // NCCL (format 1.8): the library's table and the session's communicator, created by
  // dp_session_init_nccl (owned: destroyed with the session) or the host's (dp_session_set_nccl_comm).
  const dp::rt::NcclApi* nccl = nullptr;
  dp::rt::NcclComm nccl_comm = nullptr;
  bool nccl_owned = false;
  bool programmatic = false;  // launch layer and final-norm kernels with programmatic dependent launch
  dp_launch_observer_fn observer = nullptr;  // dp_session_set_launch_observer (profilers only)
  void* observer_user = nullptr;

  static dp::rt::Result<dp_session*> create(dp_bundle* b, const dp_session_options& o);

  dp::rt::Status bind_weight(const std::string& name, const dp_tensor& t);
  dp::rt::Status bind_experts(const std::string& group, const uint64_t* data, int32_t count, const dp_tensor& t);
  dp::rt::Status finalize_weights();
  dp::rt::Status verify_weights();
  dp::rt::Status load_kernels();
  dp::rt::Status bind_kv(int32_t layer, int32_t kind, const dp_tensor& t);
  void release_kv();
  dp::rt::Status kv_layout(int32_t layer, int32_t kind, int64_t count, dp_tensor* out) const;
  dp::rt::Status plan(const dp_step_desc& d, dp_plan_result* out);
  dp::rt::Status after_step();
  dp::rt::Status set_peers(const uint64_t* exchange, int32_t num_ranks, uint32_t timeout_us);
  // Bytes of one rank's exchange buffer (0 when no program all-reduces in-kernel).
  uint64_t exchange_bytes() const;
  // The widths whose programs all-reduce with NCCL, sorted.
  std::vector<int32_t> nccl_widths() const;
  // dp_session_init_nccl (comm null: create one from `id`) and dp_session_set_nccl_comm (the host's comm).
  dp::rt::Status set_nccl(const uint8_t* id, void* comm, const char* library);

  dp::rt::Status launch_layer(const dp_step* step, int32_t layer, const dp_layer_io& io, dp_stream stream);
  dp::rt::Status launch_final_norm(const dp_step* step, const dp_final_norm_io& io, dp_stream stream);
  dp::rt::Status bind_lm_head(const dp_tensor& t);
  dp::rt::Status launch_lm_head(const dp_step* step, const dp_lm_head_io& io, dp_stream stream);
  dp::rt::Status prefetch_fork(int32_t point, int32_t layer, int32_t width, dp_stream stream, int32_t* launched);
  dp::rt::Status prefetch_join(dp_stream stream);
  dp::rt::Status prefetch_set_cap(int32_t point, int32_t width, uint64_t bytes);

  // Sparse-attention indexer prefill (src/indexer.cpp). Its kernels load with the others in load_kernels,
  // or on first use when the host calls the indexer before that (they need no weights).
  std::map<std::string, dp::rt::LoadedKernel> indexer_kernels;  // by op: idx_quant, idx_pack, ...
  dp::rt::Status load_indexer();
  dp::rt::Status indexer_write_keys(const dp_indexer_cache& cache, uint64_t keys, uint64_t slot_mapping, int64_t count,
                                    dp_stream stream);
  dp::rt::Status indexer_prepare(const dp_indexer_batch_desc& desc, dp_indexer_metadata** out,
                                 dp_indexer_plan_info* info);
  dp::rt::Status indexer_prefill(const dp_indexer_metadata& md, const dp_indexer_cache& cache,
                                 const dp_indexer_prefill_io& io, dp_stream stream);

 private:
  std::string label() const;
  dp::rt::Status check_tensor(const std::string& what, const dp_tensor& t, dp_dtype dtype,
                              const std::vector<int64_t>& shape, bool lead_free, dp_code shape_code) const;
  // `layer`: the decoder layer a layer program's kernel is loaded for (-1 otherwise); the per-layer
  // weight parameters of layer programs will be packed from it.
  // Loads k's function; with role_params, also packs the parameters its role (final_norm, prefetch) defines.
  dp::rt::Status load_kernel(const dp::format::KernelEntry& k, int32_t layer, dp::rt::LoadedKernel* out,
                             bool role_params = true);
  dp::rt::Status load_program_step(const dp::format::ProgramEntry& prog, size_t step_index, int32_t layer,
                                   dp::rt::LoadedKernel* out);
  dp::rt::Status load_collective_step(const dp::format::ProgramEntry& prog, size_t step_index, int32_t layer,
                                      dp::rt::LoadedKernel* out);
  size_t layer_weight(int32_t layer, const std::string& key) const;
  dp::rt::Status build_prefetch_tables();
  // Launches the armed forks that `fire` selects (all of them when it is null), in fork order.
  dp::rt::Status fire_prefetch(const std::function<bool(const dp::rt::ArmedPrefetch&)>& fire);
  const dp::format::KernelEntry* find_kernel(const std::string& role, int32_t width) const;
  dp::rt::Status indexer_launch(const char* op, uint32_t grid_x, uint32_t grid_y,
                                std::initializer_list<std::pair<const char*, uint64_t>> args, dp_stream stream);
  dp::rt::Status check_indexer_cache(const char* fn, const dp_indexer_cache& cache) const;
};
