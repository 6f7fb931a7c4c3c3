// `decodepack bench`: how fast a bundle's layer programs run on this GPU, and how close to the HBM read
// ceiling, through libdecodepack exactly as a host launches them (DESIGN.md section 9, issue 14).
//
// One run:
//   1. opens the bundle and binds the weights once (as `run` does: run.h), then measures the
//      HBM read ceiling: a read-only stream of 16-byte loads over --ceiling-gib GiB (bench_ptx.h),
//      median of 15 passes; and the launch floor (an empty kernel, dependent launches, in a graph and
//      on a busy stream);
//   2. per width: caches and metadata for `width` requests at exactly --context tokens each; one eager
//      step; one step captured in a CUDA graph and replayed with fresh inputs, then checked layer by
//      layer against the float64 CPU reference (the `run --check` comparisons): the correctness gate.
//      A layer class with a failing layer is reported as failed and not timed; the whole step is timed
//      only when every layer passed;
//   3. the whole step (every layer and the final norm, the graph just checked), replayed --replays
//      times back to back: µs per step (median, p10, p90), the bytes it must move (compiler/bench/
//      bytes.h: routed experts from the checked step's routing), the share of the ceiling, tokens/s;
//   4. per layer class: a graph of every layer of the class (distinct weights and caches, so a replay
//      streams far more than the L2 holds), replayed --replays times: µs per layer = replay / layers;
//   5. per layer class, its first layer kernel by kernel (dp_session_set_launch_observer): each kernel
//      alone after an L2 flush (median of --kernel-reps), and in the layer's own sequence (an event
//      recorded after each kernel inside a graph, the layer started L2-cold); the difference of the two
//      medians estimates the idle time between dependent launches.
#pragma once

#include <functional>
#include <vector>

#include "bench/result.h"
#include "tooling/run.h"

namespace dp::tools {

struct BenchOptions {
  RunOptions run;          // bundle, model, random_weights, seed, rank, device, context, prefetch, log
  std::vector<int> widths; // empty: every width of the bundle
  int replays = 100;       // timed graph replays per figure
  int kernel_reps = 20;    // repetitions of the per-kernel measurements
  double ceiling_gib = 4;  // bytes the ceiling stream reads
  bool kernels = true;     // the per-kernel breakdown
  // on: the bundle's prefetch tables; off: none (DP_SESSION_NO_PREFETCH); sweep: the bundle's tables,
  // and per width the whole step with prefetch off, each point alone and the next_attention tables
  // capped, timed side by side.
  std::string prefetch = "on";
  // Called with the results so far after each width (e.g. to rewrite --json, so that a run stopped
  // early keeps what it measured).
  std::function<void(const bench::BenchResult&)> progress;
};

// Throws dp::Error: usage (bad options, widths not built, q > 1, TP > 1), input, io, verify, device.
// A failing correctness gate is a result (result.gate[].failed > 0), not an error.
bench::BenchResult run_bench(const BenchOptions& o);

}  // namespace dp::tools
