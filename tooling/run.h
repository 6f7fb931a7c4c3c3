// `decodepack run`: decode steps of a bundle on a GPU through libdecodepack, as a serving host drives it,
// optionally checked layer by layer against the float64 CPU reference (compiler/reference).
//
// What one run does:
//   1. opens the bundle (runtime C ABI), finds the model it was built from (--model, or the built-in
//      preset whose config digest the manifest records), creates a session on the device;
//   2. binds every weight the bundle lists for the rank: the checkpoint's tensors (converted to the
//      bound dtype, the rank's shard cut out) or, without a checkpoint, the deterministic random
//      tensors `decodepack synth --seed S` would write; expert groups as ONE stacked allocation
//      [E, rows, cols] per group (data[e] = base + e * expert_bytes);
//   3. binds every layer's caches with random non-zero contents (KDA recurrent and conv states, MLA
//      latent rows) and builds random step metadata: distinct non-zero state slots and blocks, a
//      different context length per request, num_accepted in 1..q;
//   4. per step: dp_plan -> per layer dp_launch_layer (prefetch forks before each layer, one join at the
//      end) -> dp_launch_final_norm. With --graph: one eager warm-up step (as a host runs before it
//      captures), then one step captured in a CUDA graph (planned at capture, DP_GRAPH_FULL), replayed
//      for each of the --steps steps. Between steps the metadata advances as a decode does (seq_len +=
//      tokens accepted), and every step gets fresh inputs copied into the same (captured) buffers.
//
// Layer inputs and outputs live in separate buffers per layer (layer l reads hidden[l], residual[l],
// writes hidden[l+1], residual[l+1]), so that every layer can be compared with the reference computed
// from the very input the GPU layer read: errors of one layer never leak into the next one's check.
//
// --check, after each step: per layer the output pair (hidden, residual) on the rows of real requests
// (bf16, limit 1e-2), KDA recurrent states of the step's slots (fp32, 1e-4) and conv states (1e-2),
// MLA latent rows the step writes (1e-2), and, bit for bit, that nothing else in any cache changed;
// then the final norm (1e-2). Outputs are poisoned (0xFF bytes: NaN) before every step, and so are the
// cache rows a step only writes (new MLA tokens, KDA slots of draft positions other than the one read),
// so a kernel that writes nothing fails. NaN anywhere fails. Padded requests' rows are not compared.
// MoE rows whose k-th and (k+1)-th routing scores are nearly tied may be routed either way by the GPU's
// activations (an ulp apart from the reference's): there the reference output of the alternative
// routing is accepted too, and the table says how many rows took it.
//
// Tensor parallelism (a bundle built for tensor_parallel N > 1): every rank runs as its own process
// (tooling/ranks.h; rank 0 is the caller) on --device, with its shard of every weight and its own caches;
// the ranks bind each other's all-reduce exchange buffers (CUDA IPC), agree on each plan (dp_agree) and
// start every step together. At a width the bundle all-reduces with NCCL (deploy "allreduce", format
// 1.8) rank 0 makes an NCCL unique id, the ranks exchange it through the rendezvous and each session
// creates its communicator (dp_session_init_nccl); NCCL needs one GPU per rank (--devices). With --check, ranks > 0 send rank 0 their caches before and after the step
// and their output rows; rank 0 checks the outputs against decoder_layer_tp over every rank's shard, that
// every rank's outputs are rank 0's bit for bit, and every rank's caches as above.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dp::tools {

struct RunOptions {
  std::string bundle;
  std::string model;          // checkpoint dir, config file or preset; "" = the preset the bundle was built from
  bool random_weights = false;  // random weights even when --model holds safetensors
  int width = 0;              // batch width (requests per step) to run: one of the bundle's widths
  int requests = 0;           // real requests (1..width; 0 = width); the rest are padding rows
  int steps = 1;               // with graph: replays, after one eager warm-up step
  bool check = false;
  bool graph = false;
  bool skip_missing = false;  // run only the layers with a program at this width
  bool prefetch = true;
  bool pdl = true;        // programmatic dependent launch where the bundle and device take it (--no-pdl)
  bool verify_weights = false;
  uint64_t seed = 0;
  int rank = 0;
  int device = 0;
  // tensor_parallel > 1: rank r's CUDA device is devices[r] (one per rank; empty: every rank on `device`).
  // A width whose programs all-reduce with NCCL needs a device per rank: NCCL refuses two ranks on one GPU.
  std::vector<int> devices;
  std::string nccl;  // the NCCL library for such widths ("": $DECODEPACK_NCCL, else the runtime's default)
  uint32_t allreduce_timeout_us = 10'000'000;  // tensor_parallel > 1: the bound of every all-reduce wait
  std::string tp_fault;  // "skip:R:L" / "die:R:L": the fault tests of tensor parallelism (Harness::run_fault_step)
  int64_t context = 100;      // cached tokens per request before the first step (requests get lengths in
                              // [context/2, context], all different where the range allows)
  std::function<void(const std::string&)> log;  // progress lines
};

// One comparison. kind "rel_error": value = ||gpu - ref|| / ||ref||, ok when value < limit (NaN/inf
// fail); kind "count": value = elements that changed where the step must not write, ok when 0.
struct RunCheck {
  int step = 0;
  std::string mode;      // "eager" | "graph"
  int layer = -1;        // -1: the final norm
  std::string cls;       // layer class ("kda_moe", ...) or "final_norm"
  std::string quantity;  // "hidden", "residual", "kda state", "conv state", "latent rows", "caches untouched"
  std::string kind = "rel_error";
  double value = 0, limit = 0;
  bool ok = false;
};

struct RunStep {
  int index = 0;   // 1-based
  std::string mode;
  double ms = 0;   // device time of the step (cuEvent pair around the launches or the graph launch)
};

struct RunResult {
  std::string bundle, digest, device, target;
  std::string weights;   // "the checkpoint's" | "random (the synth fill of seed S)"
  std::string model;     // where the model config came from
  int width = 0, requests = 0, q = 1, rows = 0, tensor_parallel = 1, rank = 0;
  int64_t weight_bytes = 0;
  int64_t weight_entries = 0;  // the rank's bundle weight entries bound (an expert group is one)
  std::vector<int> layers_run, layers_skipped;  // decoder layers run through their programs / skipped
  std::vector<std::string> layer_classes;       // per layer
  std::vector<RunStep> steps;
  std::vector<RunCheck> checks;
  bool checked = false;
  int failures() const;
};

// Throws dp::Error: usage (width not built, bad option values), input (model/bundle mismatch, missing
// layer programs), io, verify (bundle damaged), device (no driver or GPU, driver or runtime failures).
// A completed run with failing checks returns normally (result.failures() > 0).
RunResult run_bundle(const RunOptions& o);

}  // namespace dp::tools
