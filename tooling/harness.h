// The machinery under `decodepack run` and `decodepack bench` (tooling/run.h says what a run does):
// the model a bundle was built from, its weights bound through libdecodepack, the caches and step
// metadata of one batch width, the step's launches, and the layer-by-layer comparison with the float64
// CPU reference. `run` drives it through Harness::run(); `bench` drives the phases itself (one
// weight binding, then several widths, graphs of chosen layers, its own timing).
#pragma once

#include <functional>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "deploy/deploy.h"
#include "format/manifest.h"
#include "model/ir.h"
#include "model/safetensors.h"
#include "reference/layer.h"
#include "tooling/device.h"
#include "tooling/ranks.h"
#include "tooling/run.h"
#include "tooling/weights.h"
#include "tooling/workload.h"

namespace dp::tools {

class Harness {
 public:
  Harness(const RunOptions& o, RunResult& res) : o_(o), res_(res) {}
  // A tensor_parallel > 1 bundle: `group` holds every rank's process (this one is rank group.rank(),
  // which must be o.rank). Ranks exchange their all-reduce buffers when the device opens, start every
  // step together, and with --check ranks > 0 send rank 0 what the step read and wrote: rank 0 compares
  // every rank's caches and outputs with the reference over all ranks (decoder_layer_tp).
  Harness(const RunOptions& o, RunResult& res, RankGroup* group) : o_(o), res_(res), group_(group) {}

  // `decodepack run`: every step RunOptions asks for (open, set_width(o.width), steps, checks).
  void run();

  // ---- phases, for other drivers --------------------------------------------------------------------
  // Opens and validates the bundle and resolves the model (no GPU yet; o.width, when > 0, is checked
  // against the bundle's widths). Uses o.bundle, model, random_weights, seed, rank, check.
  void open_bundle();
  // Creates the session on o.device, binds every weight and loads the kernels.
  void open_device_and_weights();
  const std::vector<int32_t>& bundle_widths() const { return widths_; }
  // dp::Error(usage) when the bundle lacks `width` or `requests` exceeds it; `option` names the width
  // in the message.
  void check_width(int width, int requests, const char* option = "--width") const;
  // Per-width state: metadata for `requests` real requests (steps: decode steps the MLA blocks must
  // hold), caches of fresh random contents bound again, io buffers, and which layers have a program.
  // uniform_context: every request at exactly o.context cached tokens (else [context/2, context], all
  // different). Frees the previous width's buffers and any captured graph.
  void set_width(int width, int requests, int steps, bool uniform_context);
  const dp_step* plan(int32_t graph_mode);
  // The whole step: every layer with a program, the final norm, the prefetch join.
  void enqueue_step(const dp_step* step);
  // Only `layers` (in order; each reads its own input buffer and writes the next layer's), with their
  // prefetch forks and one join; the final norm when `final_norm`.
  void enqueue_layers(const dp_step* step, const std::vector<int>& layers, bool final_norm);
  // One layer's launch alone (no prefetch): for per-kernel timing.
  void launch_layer(const dp_step* step, int layer);
  // The prefetch points enqueue_layers forks (bit p: dp_prefetch_point p; default all), and the forks
  // of one layer and the join, for drivers that launch layers one by one.
  void set_prefetch_points(unsigned mask) { prefetch_points_ = mask; }
  void fork_prefetch(int layer);
  void join_prefetch();
  // Fresh inputs and metadata, and poison in the outputs and write-only cache rows (devices and mirrors).
  void upload_step_inputs(Rng& rng);
  // Compares the last step with the CPU reference, layer by layer (on up to check_threads threads);
  // appends to result().checks and records each MoE layer's routing.
  void check_step(int index, const std::string& mode);
  // Stream capture of what `enqueue` launches on stream(), instantiated (an exception ends the capture).
  std::unique_ptr<Graph> capture(const std::function<void()>& enqueue);
  // The host mirrors of every cache := the device's (after steps that were not checked).
  void refresh_cache_mirrors();
  void sync() { drv_->check(drv_->StreamSynchronize(stream_->s), "cuStreamSynchronize"); }

  // ---- what the phases set up ------------------------------------------------------------------------
  const Driver& driver() const { return *drv_; }
  cuda::CUstream stream() const { return stream_->s; }
  dp_session* session() const { return sh_.s; }
  const model::Model& model() const { return model_->m; }
  // The manifest as libdecodepack opened and checked it (dp_bundle_info.manifest_json), and its deploy
  // block read as a deploy file is (dp_bundle_info.deploy_json).
  const format::Manifest& manifest() const { return manifest_; }
  const deploy::Deploy& deploy() const { return deploy_; }
  const Meta& meta() const { return meta_; }
  RunResult& result() { return res_; }
  int num_layers() const { return num_layers_; }
  int q() const { return q_; }
  bool runs_layer(int layer) const { return run_layer_[static_cast<size_t>(layer)]; }
  const std::vector<std::string>& missing_layers() const { return missing_; }
  // Distinct experts the last checked step routed layer `layer`'s real rows to (-1: not a checked MoE layer).
  int64_t routed_experts(int layer) const { return routed_[static_cast<size_t>(layer)]; }
  DeviceMemory& width_memory() { return *width_mem_; }
  // Threads of check_step (each holds one layer's reference weights in double: up to ~1 GB at 48B shapes).
  unsigned check_threads = std::max(1u, std::min(8u, std::thread::hardware_concurrency()));

 private:
  void log(const std::string& s) const {
    if (o_.log) o_.log(s);
  }
  void open_and_validate();
  void open_device();
  void bind_weights();
  void bind_caches();
  void allocate_io();
  dp_layer_io layer_io(int layer) const;
  std::vector<uint8_t> download(CUdeviceptr p, size_t bytes);
  void connect_peers();                 // tensor_parallel > 1: exchange buffers, dp_session_set_peers
  void connect_nccl();                  // an NCCL width: the unique id through the group, dp_session_init_nccl
  void send_check_data(int index);      // ranks > 0 under --check: see check_step
  void run_fault_step();                // --tp-fault

  const RunOptions& o_;
  RunResult& res_;
  RankGroup* group_ = nullptr;
  int plans_ = 0;  // dp_plan calls so far (names of the ranks' plan agreements)

  // Host side.
  format::Manifest manifest_;
  deploy::Deploy deploy_;
  std::optional<ResolvedModel> model_;
  std::optional<WeightSource> source_;
  CacheLayouts layouts_;
  int num_layers_ = 0, q_ = 1, tp_ = 1;
  int width_ = 0;
  unsigned prefetch_points_ = 0xF;
  int64_t hidden_ = 0;
  std::string kv_dtype_;
  std::vector<std::string> mixers_;
  std::vector<int32_t> widths_;
  std::vector<bool> run_layer_;
  std::vector<int64_t> routed_;
  std::vector<std::string> missing_;  // layers without a program at this width, and why
  Meta meta_;
  Rng meta_rng_{0};
  std::vector<std::vector<std::unique_ptr<ref::LayerWeights>>> ref_weights_;  // [layer][rank]
  std::vector<double> norm_weight_;
  bool drop_reference_cache_ = false;

  // Device side, in construction order (destroyed in reverse: graph, events, stream, session, the
  // width's memory, the weights' memory, context).
  const Driver* drv_ = nullptr;
  std::unique_ptr<Context> ctx_;
  std::unique_ptr<DeviceMemory> mem_;        // weights
  std::unique_ptr<DeviceMemory> width_mem_;  // caches and io of the current width
  SessionHandle sh_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<Event> start_, stop_;
  std::unique_ptr<Graph> graph_;
  CUdeviceptr exchange_ = 0;               // this rank's all-reduce exchange buffer (its own allocation)
  std::vector<CUdeviceptr> opened_peers_;  // the other ranks' buffers, opened through CUDA IPC

  std::vector<LayerCaches> caches_;
  std::vector<CUdeviceptr> hidden_bufs_, residual_bufs_;  // [L+1]; residual_bufs_[0] = 0 (layer 0 has none)
  CUdeviceptr final_out_ = 0, final_residual_ = 0;
  // K3 block attention residuals: the bound attn_res buffer [rows of the largest width, blocks, H] bf16
  // (0 when the model has none); rows attn_res_stride_ elements apart.
  CUdeviceptr attn_res_ = 0;
  int64_t attn_res_stride_ = 0, attn_res_blocks_ = 0;
  std::vector<double> out_res_norm_, out_res_proj_;  // output_attn_res_norm / _proj (reference)
  CUdeviceptr d_positions_ = 0, d_state_indices_ = 0, d_block_table_ = 0, d_seq_lens_ = 0, d_slot_mapping_ = 0,
              d_num_accepted_ = 0;
  size_t act_bytes_ = 0;  // one [rows, H] bf16 buffer
};

// K3 block attention residuals (model-family.md 3d): the model's attention-residual buffer, one per
// session (dp_session_bind_kv, layer -1, DP_KV_ATTN_RES), as `run`, `bench` and `generate` bind it.
struct AttnResBuffer {
  CUdeviceptr data = 0;            // 0: the model has none (nothing allocated or bound)
  int64_t rows = 0;                // the largest width x q (the session refuses fewer)
  int64_t blocks = 0, stride = 0;  // blocks per row; elements between rows (the session's layout)
  size_t bytes = 0;
};
// With attn_res_block > 0: `rows` = the largest of `widths` x q rows in the session's layout
// (dp_session_kv_layout), allocated through `alloc` (bytes, what) and bound; with 0, nothing. Its
// contents are the caller's: the layer programs write each block before a later layer of the same step
// reads it (layer 0 pushes the embedding), so a host that runs every layer on the bundle's programs puts
// nothing there; one that runs some layers itself writes the blocks those layers push.
AttnResBuffer bind_attn_res(dp_session* s, int64_t attn_res_block, const std::vector<int32_t>& widths, int q,
                            const std::function<CUdeviceptr(size_t, const std::string&)>& alloc);

}  // namespace dp::tools
