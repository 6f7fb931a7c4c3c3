#include "tooling/bench.h"

#include <algorithm>
#include <bit>
#include <map>
#include <set>

#include <fmt/ranges.h>

#include "common/error.h"
#include "deploy/deploy.h"
#include "tooling/bench_detail.h"

namespace dp::tools {
namespace bench_detail {

bench::BenchResult Bench::run() {
  if (o_.replays < 5) fail(Errc::usage, "--replays {}: expected >= 5 (a median and a spread need several)", o_.replays);
  if (o_.kernel_reps < 1) fail(Errc::usage, "--kernel-reps {}: expected >= 1", o_.kernel_reps);
  if (!(o_.ceiling_gib >= 0.25) || o_.ceiling_gib > 64)
    fail(Errc::usage, "--ceiling-gib {}: expected 0.25 to 64 (DESIGN.md section 9 measures the ceiling over >= 4 GiB)",
         o_.ceiling_gib);
  if (o_.run.context < 1) fail(Errc::usage, "--context {}: expected >= 1 cached token per request", o_.run.context);
  for (int w : o_.widths)
    if (w < 1) fail(Errc::usage, "--widths: {} is not a batch width (expected integers >= 1)", w);
  if (o_.prefetch != "on" && o_.prefetch != "off" && o_.prefetch != "sweep")
    fail(Errc::usage, "--prefetch {}: expected on, off or sweep", o_.prefetch);
  ro_.prefetch = o_.prefetch != "off";
  ro_.check = true;  // the correctness gate
  ro_.graph = true;
  ro_.width = 0;
  ro_.requests = 0;
  h_ = std::make_unique<Harness>(ro_, rr_);
  h_->open_bundle();
  if (h_->q() != 1)
    fail(Errc::usage, "{}: built for {} speculative token{} (q = {}); bench times q = 1 bundles (one token per request "
         "per step)", o_.run.bundle, h_->q() - 1, h_->q() == 2 ? "" : "s", h_->q());
  std::vector<int> widths = o_.widths;
  if (widths.empty()) widths.assign(h_->bundle_widths().begin(), h_->bundle_widths().end());
  std::sort(widths.begin(), widths.end());
  widths.erase(std::unique(widths.begin(), widths.end()), widths.end());
  for (int w : widths) h_->check_width(w, w, "--widths");  // before the weights take minutes to bind
  res_.widths = widths;

  const deploy::Deploy& dep = h_->deploy();
  elems_.state = static_cast<uint64_t>(bytes_per_elem(deploy::element_dtype(dep.kda_state.dtype)));
  elems_.conv = static_cast<uint64_t>(bytes_per_elem(deploy::element_dtype(dep.conv_state.dtype)));
  elems_.kv = static_cast<uint64_t>(bytes_per_elem(deploy::element_dtype(dep.kv_cache.dtype)));

  res_.version = DP_VERSION_STRING;
  res_.bundle = o_.run.bundle;
  res_.digest = rr_.digest;
  res_.model = rr_.model;
  res_.weights = rr_.weights;
  res_.context = o_.run.context;
  res_.replays = o_.replays;
  res_.prefetch = ro_.prefetch;
  res_.prefetch_mode = o_.prefetch;

  h_->open_device_and_weights();
  res_.device = rr_.device;
  res_.target = rr_.target;
  const Driver& d = h_->driver();
  cuda::CUdevice dev = 0;
  d.check(d.DeviceGet(&dev, o_.run.device), "cuDeviceGet");
  int sms = 0, l2 = 0;
  d.check(d.DeviceGetAttribute(&sms, cuda::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev), "cuDeviceGetAttribute",
          "multiprocessor count");
  d.check(d.DeviceGetAttribute(&l2, cuda::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dev), "cuDeviceGetAttribute", "L2 size");
  res_.sms = sms;
  res_.l2_bytes = l2;
  blocks_ = static_cast<unsigned>(std::max(1, sms) * 8);

  kernels_ = std::make_unique<BenchKernels>(d);
  events_ = std::make_unique<EventPool>(d, std::max<size_t>(static_cast<size_t>(o_.replays) + 1, 2 * kMaxKernelsPerLayer + 2));
  sink_ = std::make_unique<DeviceBuffer>(d, 16, "the bench kernels' sink");
  const size_t flush_bytes = (std::max<size_t>(4 * static_cast<size_t>(l2), size_t{64} << 20) + 15) / 16 * 16;
  flush_ = std::make_unique<DeviceBuffer>(d, flush_bytes, "the L2 flush buffer");
  d.check(d.MemsetD8Async(flush_->ptr(), 0x3C, flush_->bytes(), h_->stream()), "cuMemsetD8Async");
  h_->sync();

  measure_ceiling();
  measure_launch_floor();
  for (int w : widths) {
    measure_width(w);
    if (o_.progress) o_.progress(res_);
  }

  res_.notes.push_back(
      "bytes: weights (routed experts: distinct experts of the checked step's routing, as the CPU reference routed "
      "it) + KDA states read and written + MLA latent rows read (each request's sequence) and written + layer "
      "inputs and outputs; scratch inside a layer program is not counted");
  res_.notes.push_back(
      "per kernel: 'alone' = the kernel launched by itself after an L2 flush; 'in seq' = from the event after the "
      "previous kernel to the event after this one in the layer's sequence; gap = in seq - alone (medians), which "
      "also absorbs the L2 hits the sequence gets from the previous kernel's outputs");
  return std::move(res_);
}

void Bench::measure_ceiling() {
  const Driver& d = h_->driver();
  const cuda::CUstream s = h_->stream();
  const size_t bytes = static_cast<size_t>(o_.ceiling_gib * double(1ull << 30)) / 16 * 16;
  log(fmt::format("ceiling: read-only stream over {}", human_bytes(bytes)));
  DeviceBuffer buf(d, bytes, "the ceiling's stream buffer");
  d.check(d.MemsetD8Async(buf.ptr(), 0x5A, bytes, s), "cuMemsetD8Async");
  for (int i = 0; i < 2; ++i) kernels_->read(s, buf.ptr(), bytes, sink_->ptr(), blocks_);
  h_->sync();
  const EventPool& ev = *events_;
  d.check(d.EventRecord(ev[0], s), "cuEventRecord");
  for (int i = 0; i < kCeilingPasses; ++i) {
    kernels_->read(s, buf.ptr(), bytes, sink_->ptr(), blocks_);
    d.check(d.EventRecord(ev[static_cast<size_t>(i) + 1], s), "cuEventRecord");
  }
  d.check(d.StreamSynchronize(s), "cuStreamSynchronize", "the ceiling's read stream");
  std::vector<double> us;
  for (int i = 0; i < kCeilingPasses; ++i) us.push_back(ev.us(static_cast<size_t>(i), static_cast<size_t>(i) + 1));
  res_.ceiling.method = fmt::format("read-only stream, 16-byte ld.global.nc loads, {} blocks x 256 threads", blocks_);
  res_.ceiling.bytes = bytes;
  res_.ceiling.us = bench::Summary::of(us);
  log(fmt::format("ceiling: {:.3f} TB/s", ceiling() / 1e12));
}

void Bench::measure_launch_floor() {
  const Driver& d = h_->driver();
  const cuda::CUstream s = h_->stream();
  auto g = h_->capture([&] {
    for (int i = 0; i < kFloorKernels; ++i) kernels_->empty(s);
  });
  const std::vector<double> graph_us = time_graph(d, s, *g, kFloorReps, 2, *events_);
  // On a stream: the launches queue behind a long read (the flush buffer, several times), so the
  // device runs them back to back instead of waiting for the host.
  std::vector<double> stream_us;
  const EventPool& ev = *events_;
  for (int r = 0; r < kFloorReps; ++r) {
    for (int i = 0; i < 8; ++i) kernels_->read(s, flush_->ptr(), flush_->bytes(), sink_->ptr(), blocks_);
    d.check(d.EventRecord(ev[0], s), "cuEventRecord");
    for (int i = 0; i < kFloorKernels; ++i) kernels_->empty(s);
    d.check(d.EventRecord(ev[1], s), "cuEventRecord");
    d.check(d.StreamSynchronize(s), "cuStreamSynchronize", "the launch floor");
    stream_us.push_back(ev.us(0, 1));
  }
  res_.launch_floor.kernels = kFloorKernels;
  res_.launch_floor.graph_us = bench::Summary::of(graph_us).median / kFloorKernels;
  res_.launch_floor.stream_us = bench::Summary::of(stream_us).median / kFloorKernels;
}

bench::StepTraffic Bench::traffic(int layer) const {
  bench::StepTraffic t;
  t.q = h_->q();
  const Meta& m = h_->meta();
  for (int r = 0; r < m.W; ++r)
    if (m.real[static_cast<size_t>(r)]) t.seq_lens.push_back(m.seq_lens[static_cast<size_t>(r)]);
  t.routed_experts = std::max<int64_t>(0, h_->routed_experts(layer));
  return t;
}

void Bench::measure_width(int width) {
  Harness& h = *h_;
  const Driver& d = h.driver();
  const cuda::CUstream s = h.stream();
  log(fmt::format("width {}: caches for {} requests at {} tokens", width, width, o_.run.context));
  h.set_width(width, width, 2, true);
  const int L = h.num_layers();

  // Layer classes, in name order, with their layers (only those with a program at this width).
  std::map<std::string, std::vector<int>> classes, missing;
  for (int l = 0; l < L; ++l) (h.runs_layer(l) ? classes : missing)[rr_.layer_classes[static_cast<size_t>(l)]].push_back(l);

  // One eager step (a host's warm-up before capture), then the step captured and replayed with fresh
  // inputs, and that replay checked: the gate.
  Rng rng(o_.run.seed ^ (0xBE7C400ull + static_cast<uint64_t>(width)));
  h.upload_step_inputs(rng);
  h.sync();
  h.enqueue_step(h.plan(DP_GRAPH_NONE));
  d.check(d.StreamSynchronize(s), "cuStreamSynchronize", fmt::format("width {}: the eager step", width));
  rt(dp_after_step(h.session()), "after the eager step");
  h.refresh_cache_mirrors();
  const dp_step* step = h.plan(DP_GRAPH_FULL);
  std::unique_ptr<Graph> full = h.capture([&] { h.enqueue_step(step); });
  h.upload_step_inputs(rng);
  h.sync();
  d.check(d.GraphLaunch(full->exec, s), "cuGraphLaunch");
  d.check(d.StreamSynchronize(s), "cuStreamSynchronize", fmt::format("width {}: the checked graph replay", width));
  rt(dp_after_step(h.session()), "after the checked step");
  const size_t first = rr_.checks.size();
  log(fmt::format("width {}: checking every layer against the CPU reference", width));
  h.check_step(width, "graph");

  bench::GateResult gate;
  gate.width = width;
  std::map<int, std::vector<std::string>> failed;  // layer (-1: final norm) -> failing quantities
  bool rerouted = false;
  for (size_t i = first; i < rr_.checks.size(); ++i) {
    const RunCheck& c = rr_.checks[i];
    ++gate.checks;
    rerouted |= c.quantity.find("rerouted") != std::string::npos;
    if (c.ok) continue;
    ++gate.failed;
    const std::string what = c.kind == "count"
                                 ? fmt::format("{}: {} changed", c.quantity, static_cast<int64_t>(c.value))
                                 : fmt::format("{}: {:.3e} >= {:.0e}", c.quantity, c.value, c.limit);
    gate.failures.push_back(fmt::format("layer {} ({}) {}", c.layer, c.cls, what));
    failed[c.layer].push_back(what);
  }
  res_.gate.push_back(gate);
  log(fmt::format("width {}: gate {} checks, {} failed", width, gate.checks, gate.failed));
  if (rerouted)
    res_.notes.push_back(fmt::format("width {}: some MoE rows had near-tied routing scores and the GPU took the "
                                     "alternative expert (accepted by the gate, as in run --check)", width));

  // The whole step.
  bench::StepResult sr;
  sr.width = width;
  sr.layers = static_cast<int>(rr_.layers_run.size());
  if (!h.missing_layers().empty()) {
    sr.status = "no_program";
    sr.reason = fmt::format("{} layer(s) have no program at this width, e.g. {}", h.missing_layers().size(),
                            h.missing_layers().front());
  } else if (!failed.empty()) {
    sr.status = "failed";
    sr.reason = fmt::format("the correctness gate failed ({} checks)", gate.failed);
  } else {
    log(fmt::format("width {}: timing the whole step ({} replays)", width, o_.replays));
    sr.us = bench::Summary::of(time_graph(d, s, *full, o_.replays, kWarmup, *events_));
    rt(dp_after_step(h.session()), "after the timed steps");
    for (int l = 0; l < L; ++l) sr.bytes += bench::layer_bytes(h.model(), l, elems_, traffic(l));
    sr.bytes += bench::final_norm_bytes(h.model(), h.meta().rows());
    sr.share = bench::share_of(sr.bytes.total(), sr.us.median, ceiling());
    sr.tokens_per_s_per_request = sr.us.median > 0 ? 1e6 / sr.us.median : 0;
    sr.tokens_per_s = sr.tokens_per_s_per_request * width;
  }
  res_.steps.push_back(sr);
  full.reset();
  if (o_.prefetch == "sweep" && sr.status == "ok") sweep_prefetch(width, step);

  for (const auto& [cls, layers] : missing) {
    bench::ClassResult c;
    c.cls = cls;
    c.width = width;
    c.layers = layers;
    c.status = "no_program";
    c.reason = "the bundle has no program for this class at this width";
    res_.classes.push_back(c);
  }
  for (const auto& [cls, layers] : classes) {
    bench::ClassResult c;
    c.cls = cls;
    c.width = width;
    c.layers = layers;
    for (int l : layers) {
      c.bytes += bench::layer_bytes(h.model(), l, elems_, traffic(l));
      if (h.routed_experts(l) >= 0) c.routed_experts.push_back(h.routed_experts(l));
    }
    c.replay_bytes = c.bytes.total();
    std::vector<std::string> why;
    for (int l : layers)
      if (auto it = failed.find(l); it != failed.end())
        why.push_back(fmt::format("layer {}: {}", l, fmt::join(it->second, "; ")));
    if (!why.empty()) {
      c.status = "failed";
      c.reason = "the correctness gate failed: " + fmt::format("{}", fmt::join(why, "; "));
      res_.classes.push_back(c);
      continue;
    }
    log(fmt::format("width {}: timing {} ({} layer{}, {} per replay)", width, cls, layers.size(),
                    layers.size() == 1 ? "" : "s", human_bytes(c.replay_bytes)));
    std::unique_ptr<Graph> g = h.capture([&] { h.enqueue_layers(step, layers, false); });
    std::vector<double> us = time_graph(d, s, *g, o_.replays, kWarmup, *events_);
    rt(dp_after_step(h.session()), "after the timed layers");
    const double replay_median = bench::Summary::of(us).median;
    for (double& v : us) v /= static_cast<double>(layers.size());
    c.us_per_layer = bench::Summary::of(us);
    c.share = bench::share_of(c.bytes.total(), replay_median, ceiling());
    if (res_.l2_bytes > 0 && c.replay_bytes < 4 * static_cast<uint64_t>(res_.l2_bytes))
      res_.notes.push_back(fmt::format("width {}: one replay of {} streams {}, less than 4x the L2 ({}): its layers may "
                                       "find part of their weights in L2", width, cls, human_bytes(c.replay_bytes),
                                       human_bytes(static_cast<uint64_t>(res_.l2_bytes))));
    res_.classes.push_back(c);
    g.reset();
    if (o_.kernels) {
      try {
        res_.kernels.push_back(breakdown(cls, layers.front(), width, c.us_per_layer.median));
      } catch (const Error& e) {
        bench::KernelBreakdown k;
        k.cls = cls;
        k.width = width;
        k.layer = layers.front();
        k.status = "error";
        k.reason = e.what();
        res_.kernels.push_back(k);
        log(fmt::format("width {}: per-kernel breakdown of {}: {}", width, cls, e.what()));
      }
    }
  }
}

}  // namespace bench_detail

bench::BenchResult run_bench(const BenchOptions& o) {
  bench_detail::Bench b(o);
  return b.run();
}

}  // namespace dp::tools
