// What `decodepack bench` measured, and its two renderings: the table on stdout and the JSON document
// that `--json` writes (manifests/bench-result.schema.json; bench/baseline.py writes the same shape, and
// bench/chart.py reads both). Times are microseconds, sizes bytes, shares fractions of the read ceiling
// measured in the same run (bytes / time / ceiling).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/bytes.h"
#include "common/json.h"

namespace dp::bench {

inline constexpr const char* kResultFormat = "decodepack-bench";
inline constexpr int kResultFormatVersion = 1;

// A sample of times (µs): percentiles by linear interpolation between order statistics (p10 of 11
// values is the second smallest).
struct Summary {
  int64_t n = 0;
  double median = 0, p10 = 0, p90 = 0, min = 0, max = 0, mean = 0;
  static Summary of(std::vector<double> v);
};

// The HBM read ceiling: a read-only stream of 16-byte loads over `bytes`, timed `us.n` times.
struct Ceiling {
  std::string method;
  uint64_t bytes = 0;
  Summary us;
  double bytes_per_s() const { return us.median > 0 ? static_cast<double>(bytes) / (us.median * 1e-6) : 0; }
};

// The cost of a dependent launch that does nothing: an empty kernel repeated `kernels` times, per kernel.
struct LaunchFloor {
  int kernels = 0;
  double graph_us = 0;   // in one CUDA graph
  double stream_us = 0;  // enqueued on a busy stream (the launches wait in the queue, not on the host)
};

// One layer class at one width: every layer of the class in one CUDA graph, replayed.
struct ClassResult {
  std::string cls;
  int width = 0;
  std::string status = "ok";  // ok | failed (the correctness gate) | no_program | error
  std::string reason;         // why not ok
  std::vector<int> layers;
  std::vector<int64_t> routed_experts;  // per layer (MoE), from the checked step's routing
  Summary us_per_layer;                 // replay time / layers
  Bytes bytes;                          // all the class's layers, one step
  uint64_t replay_bytes = 0;            // == bytes.total(): what one replay streams (vs the L2 size)
  double share = 0;                     // bytes / replay time / ceiling (median)
  Bytes bytes_per_layer() const;
};

// A whole step of the model: every layer with a program and the final norm, one CUDA graph.
struct StepResult {
  int width = 0;
  std::string status = "ok";
  std::string reason;
  int layers = 0;
  Summary us;
  Bytes bytes;
  double share = 0;
  double tokens_per_s_per_request = 0;  // one token per request per step (q = 1)
  double tokens_per_s = 0;
};

struct KernelLaunch {
  int index = 0;          // position in the layer program
  std::string kernel;     // kernel name
  std::string op;         // its template op ("gemm", "kda_step", ...)
  Summary isolated_us;    // launched alone, L2 flushed before it
  Summary sequence_us;    // in the layer's own sequence: end of the previous launch to its own end
  double gap_us = 0;      // sequence - isolated (medians): idle between dependent launches, estimated
  Bytes bytes;            // what its arguments name (bench/bytes.h kernel_bytes)
  double share = 0;       // bytes / isolated time (median) / ceiling
  double end_us = 0;      // in the sequence: from the event before the layer to the event after it (median)
};

// A prefetch launch in the layer's sequence (the timeline): side-stream events before and after the
// prefetch kernel, from the main stream's event before the layer (medians).
struct PrefetchSpan {
  std::string point;
  int after = -1;         // the layer kernel it starts after (-1: before the first)
  uint64_t bytes = 0;     // what its table pulls
  double start_us = 0, end_us = 0;
};

// The launches of one layer (the first of its class) at one width.
struct KernelBreakdown {
  std::string cls;
  int width = 0;
  int layer = 0;
  std::string status = "ok";  // ok | error
  std::string reason;
  std::string sequence_mode;  // "graph" (event nodes between the launches) | "stream" (eager, queued)
  std::vector<KernelLaunch> launches;
  double layer_us = 0;          // the class's µs per layer (uninstrumented graph), for comparison
  double sum_isolated_us = 0;   // sum of the launches' isolated medians
  double sum_sequence_us = 0;   // sum of the launches' in-sequence medians (instrumented)
  std::vector<PrefetchSpan> prefetch;  // the layer's prefetch launches in the sequence (prefetch on)
};

// A whole-step variant of the prefetch comparison (`bench --prefetch sweep`): which points forked,
// with which next_attention cap, timed side by side with the others at the same width.
struct PrefetchVariant {
  int width = 0;
  std::string name;                 // "off", "all tables", "next_attention only", "next_attention <= 8 MiB", ...
  std::vector<std::string> points;  // the points forked
  int64_t next_attention_cap = -1;  // bytes per table; -1: the bundle's
  uint64_t bytes = 0;               // what the step's prefetch launches pull (tables as capped)
  Summary us;
  double vs_off = 0;                // off median / this median - 1: > 0 is faster than prefetch off
};

// The correctness gate of one width: the same comparisons as `run --check`, on one graph replay.
struct GateResult {
  int width = 0;
  int checks = 0;
  int failed = 0;
  std::vector<std::string> failures;  // "layer 3 (kda_moe) hidden: 2.1e-02 >= 1e-02"
};

struct BenchResult {
  std::string implementation = "decodepack";  // or the baseline's "stock PyTorch ..."
  std::string version;
  std::string bundle, digest, model, weights, device, target;
  int64_t context = 0;
  int replays = 0;
  bool prefetch = true;
  std::string prefetch_mode = "on";  // on | off | sweep
  int64_t l2_bytes = 0;
  int sms = 0;
  Ceiling ceiling;
  LaunchFloor launch_floor;
  std::vector<int> widths;
  std::vector<GateResult> gate;
  std::vector<ClassResult> classes;
  std::vector<StepResult> steps;
  std::vector<KernelBreakdown> kernels;
  std::vector<PrefetchVariant> prefetch_variants;  // --prefetch sweep
  std::vector<std::string> notes;
};

// share = bytes / (us * 1e-6) / ceiling_bytes_per_s; 0 when either is 0.
double share_of(uint64_t bytes, double us, double ceiling_bytes_per_s);

Json to_json(const Summary& s);
Json to_json(const Bytes& b);
Json to_json(const BenchResult& r);
std::string to_text(const BenchResult& r);

}  // namespace dp::bench
