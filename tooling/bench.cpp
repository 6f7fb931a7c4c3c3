#include "tooling/bench.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cstdint>
#include <map>
#include <memory>
#include <set>

#include <fmt/ranges.h>

#include "bench/bytes.h"
#include "tooling/bench_device.h"
#include "common/error.h"
#include "deploy/deploy.h"
#include "tooling/harness.h"

namespace dp::tools {
namespace {

constexpr int kCeilingPasses = 15;
constexpr int kFloorKernels = 64;
constexpr int kFloorReps = 10;
constexpr int kWarmup = 3;
constexpr size_t kMaxKernelsPerLayer = 64;
// Events of the prefetch launches in the sequence: 2 per point (before, after), after the kernels'.
constexpr size_t kPrefetchEvents = kMaxKernelsPerLayer + 1;
constexpr int kPrefetchPoints = static_cast<int>(format::kPrefetchPoints.size());  // dp_prefetch_point
std::string point_name(int p) { return std::string(format::kPrefetchPoints[static_cast<size_t>(p)]); }
// next_attention caps the sweep tries below the bundle's (bytes per table).
constexpr uint64_t kSweepCaps[] = {uint64_t{2} << 20, uint64_t{4} << 20, uint64_t{8} << 20, uint64_t{16} << 20};
constexpr int kSweepRounds = 5;

// What the launch observer does around each kernel of one layer (dp_session_set_launch_observer).
//   isolated: before kernel i an L2 flush (a read stream over a few times the L2) and event 2i, after
//             it event 2i+1: the kernel alone, L2-cold;
//   sequence: after kernel i event i+1 (the caller records event 0 before the layer), as an event node
//             when `capturing`: the layer's own sequence, gaps included.
struct Observer {
  enum class Mode { off, isolated, sequence };
  Mode mode = Mode::off;
  bool capturing = false;
  int layer = -1;
  const Driver* d = nullptr;
  const BenchKernels* kernels = nullptr;
  const EventPool* events = nullptr;
  CUdeviceptr flush = 0, sink = 0;
  size_t flush_bytes = 0;
  unsigned blocks = 0;
  std::vector<std::string> names;  // kernel names by program index, as the runtime reported them
  int last_done = -1;              // the last kernel launched (sequence mode)
  std::array<int, kPrefetchPoints> prefetch_after{-1, -1, -1, -1};  // per point launched: the kernel before it
  std::array<bool, kPrefetchPoints> prefetch_seen{};
  std::string error;               // the first failure inside the callback (it must not throw)

  static void call(void* user, int32_t layer, int32_t index, const char* kernel, int32_t after, dp_stream stream) {
    auto* o = static_cast<Observer*>(user);
    if (o->mode == Mode::off || layer != o->layer || !o->error.empty()) return;
    try {
      if (index < 0) {  // a prefetch launch, on the side stream: events around it (sequence mode only)
        const int point = -1 - index;
        if (o->mode != Mode::sequence || point >= kPrefetchPoints) return;
        const auto s = static_cast<cuda::CUstream>(stream);
        const size_t e = kPrefetchEvents + 2 * static_cast<size_t>(point) + (after ? 1 : 0);
        if (!after) o->prefetch_after[static_cast<size_t>(point)] = o->last_done;
        o->prefetch_seen[static_cast<size_t>(point)] = true;
        if (o->capturing)
          o->d->check(o->d->EventRecordWithFlags((*o->events)[e], s, cuda::CU_EVENT_RECORD_EXTERNAL),
                      "cuEventRecordWithFlags", "an event node around a prefetch launch, during capture");
        else
          o->d->check(o->d->EventRecord((*o->events)[e], s), "cuEventRecord");
        return;
      }
      const size_t i = static_cast<size_t>(index);
      if (i >= kMaxKernelsPerLayer) fail(Errc::internal, "layer {} launches more than {} kernels", layer, kMaxKernelsPerLayer);
      if (o->names.size() <= i) o->names.resize(i + 1);
      o->names[i] = kernel;
      const auto s = static_cast<cuda::CUstream>(stream);
      if (o->mode == Mode::isolated) {
        if (!after) {
          o->kernels->read(s, o->flush, o->flush_bytes, o->sink, o->blocks);
          o->d->check(o->d->EventRecord((*o->events)[2 * i], s), "cuEventRecord");
        } else {
          o->d->check(o->d->EventRecord((*o->events)[2 * i + 1], s), "cuEventRecord");
        }
      } else if (after) {
        o->last_done = index;
        if (o->capturing)
          o->d->check(o->d->EventRecordWithFlags((*o->events)[i + 1], s, cuda::CU_EVENT_RECORD_EXTERNAL),
                      "cuEventRecordWithFlags", "an event node after a kernel, during capture");
        else
          o->d->check(o->d->EventRecord((*o->events)[i + 1], s), "cuEventRecord");
      }
    } catch (const std::exception& e) {
      o->error = e.what();
    }
  }
};

int64_t bytes_per_elem(DType t) { return static_cast<int64_t>(dtype_size(t)); }

class Bench {
 public:
  explicit Bench(const BenchOptions& o) : o_(o), ro_(o.run) {}
  bench::BenchResult run();

 private:
  void log(const std::string& s) const {
    if (o_.run.log) o_.run.log(s);
  }
  void measure_ceiling();
  void measure_launch_floor();
  void measure_width(int width);
  void sweep_prefetch(int width, const dp_step* step);
  uint64_t prefetch_bytes(int point, int width, uint64_t cap, int layer) const;
  bench::StepTraffic traffic(int layer) const;
  bench::KernelBreakdown breakdown(const std::string& cls, int layer, int width, double layer_us);
  double ceiling() const { return res_.ceiling.bytes_per_s(); }

  const BenchOptions& o_;
  RunOptions ro_;
  RunResult rr_;
  bench::BenchResult res_;
  bench::CacheElems elems_;
  unsigned blocks_ = 0;  // grid of the read stream: 8 blocks of 256 threads per SM

  // Destroyed in reverse: device objects first, then the harness (session, memory, context).
  std::unique_ptr<Harness> h_;
  std::unique_ptr<BenchKernels> kernels_;
  std::unique_ptr<EventPool> events_;
  std::unique_ptr<DeviceBuffer> sink_, flush_;
};

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

bench::KernelBreakdown Bench::breakdown(const std::string& cls, int layer, int width, double layer_us) {
  Harness& h = *h_;
  const Driver& d = h.driver();
  const cuda::CUstream s = h.stream();
  const format::Manifest& man = h.manifest();
  const format::ProgramEntry* prog = nullptr;
  for (const format::ProgramEntry& p : man.programs)
    if (p.cls == cls && p.width == width) prog = &p;
  if (!prog || prog->steps.empty())
    fail(Errc::input, "{}: no {} program at width {} in the manifest", o_.run.bundle, cls, width);
  const size_t n = prog->steps.size();
  if (n > kMaxKernelsPerLayer) fail(Errc::internal, "{} program of {} kernels: more than {}", cls, n, kMaxKernelsPerLayer);

  log(fmt::format("width {}: kernels of layer {} ({})", width, layer, cls));
  Observer ob;
  ob.layer = layer;
  ob.d = &d;
  ob.kernels = kernels_.get();
  ob.events = events_.get();
  ob.flush = flush_->ptr();
  ob.flush_bytes = flush_->bytes();
  ob.sink = sink_->ptr();
  ob.blocks = blocks_;
  rt(dp_session_set_launch_observer(h.session(), &Observer::call, &ob), "setting the launch observer");
  struct Unset {
    dp_session* s;
    ~Unset() { dp_status_free(dp_session_set_launch_observer(s, nullptr, nullptr)); }
  } unset{h.session()};
  auto raise = [&](const std::string& doing) {
    if (!ob.error.empty()) fail(Errc::device, "{}: {}", doing, ob.error);
  };

  // Alone, L2 flushed before each kernel.
  const dp_step* eager = h.plan(DP_GRAPH_NONE);
  std::vector<std::vector<double>> alone(n), seq(n);
  ob.mode = Observer::Mode::isolated;
  for (int r = 0; r < o_.kernel_reps; ++r) {
    h.launch_layer(eager, layer);
    raise("timing the kernels alone");
    d.check(d.StreamSynchronize(s), "cuStreamSynchronize", fmt::format("layer {} kernel by kernel", layer));
    if (ob.names.size() != n)
      fail(Errc::internal, "layer {} ({}) at width {} launched {} kernels, its program has {}", layer, cls, width,
           ob.names.size(), n);
    for (size_t i = 0; i < n; ++i) alone[i].push_back(events_->us(2 * i, 2 * i + 1));
  }
  for (size_t i = 0; i < n; ++i)
    if (ob.names[i] != prog->steps[i].kernel)
      fail(Errc::internal, "layer {} kernel {} is {}, the manifest's program says {}", layer, i, ob.names[i],
           prog->steps[i].kernel);

  // In sequence: the layer after an L2 flush, an event after each kernel. In a graph first (event record
  // nodes, as a host replays a step); where the driver refuses that, on the stream with the launches
  // queued behind a long read, so that the device runs them back to back.
  bench::KernelBreakdown k;
  k.cls = cls;
  k.width = width;
  k.layer = layer;
  k.layer_us = layer_us;
  ob.mode = Observer::Mode::sequence;
  std::vector<std::vector<double>> ends(n);                                          // event 0 -> after kernel i
  std::array<std::array<std::vector<double>, 2>, kPrefetchPoints> spans;            // event 0 -> prefetch start, end
  auto record_timeline = [&] {
    for (size_t i = 0; i < n; ++i) ends[i].push_back(events_->us(0, i + 1));
    for (size_t p = 0; p < kPrefetchPoints; ++p)
      if (ob.prefetch_seen[p])
        for (size_t e = 0; e < 2; ++e) spans[p][e].push_back(events_->us(0, kPrefetchEvents + 2 * p + e));
  };
  try {
    const dp_step* captured = h.plan(DP_GRAPH_FULL);
    ob.capturing = true;
    std::unique_ptr<Graph> g = h.capture([&] {
      kernels_->read(s, flush_->ptr(), flush_->bytes(), sink_->ptr(), blocks_);
      d.check(d.EventRecordWithFlags((*events_)[0], s, cuda::CU_EVENT_RECORD_EXTERNAL), "cuEventRecordWithFlags",
              "an event node before the layer, during capture");
      ob.last_done = -1;
      if (ro_.prefetch) h.fork_prefetch(layer);
      h.launch_layer(captured, layer);
      if (ro_.prefetch) h.join_prefetch();
      raise("capturing the layer with an event node after each kernel");
    });
    ob.capturing = false;
    for (int r = 0; r < o_.kernel_reps; ++r) {
      d.check(d.GraphLaunch(g->exec, s), "cuGraphLaunch");
      d.check(d.StreamSynchronize(s), "cuStreamSynchronize", "the layer's graph with event nodes");
      for (size_t i = 0; i < n; ++i) seq[i].push_back(events_->us(i, i + 1));
      record_timeline();
    }
    k.sequence_mode = "graph";
  } catch (const Error& e) {
    ob.capturing = false;
    ob.error.clear();
    for (auto& v : seq) v.clear();
    res_.notes.push_back(fmt::format("width {}, layer {}: event nodes in a graph failed ({}); the in-sequence times "
                                     "come from the stream", width, layer, e.what()));
    for (auto& v : ends) v.clear();
    for (auto& sp : spans)
      for (auto& v : sp) v.clear();
    ob.prefetch_seen = {};
    for (int r = 0; r < o_.kernel_reps; ++r) {
      for (int i = 0; i < 4; ++i) kernels_->read(s, flush_->ptr(), flush_->bytes(), sink_->ptr(), blocks_);
      d.check(d.EventRecord((*events_)[0], s), "cuEventRecord");
      ob.last_done = -1;
      if (ro_.prefetch) h.fork_prefetch(layer);
      h.launch_layer(eager, layer);
      if (ro_.prefetch) h.join_prefetch();
      raise("timing the layer's sequence on the stream");
      d.check(d.StreamSynchronize(s), "cuStreamSynchronize", "the layer's sequence on the stream");
      for (size_t i = 0; i < n; ++i) seq[i].push_back(events_->us(i, i + 1));
      record_timeline();
    }
    k.sequence_mode = "stream";
  }
  ob.mode = Observer::Mode::off;

  const bench::StepTraffic t = traffic(layer);
  for (size_t i = 0; i < n; ++i) {
    bench::KernelLaunch l;
    l.index = static_cast<int>(i);
    l.kernel = prog->steps[i].kernel;
    for (const format::KernelEntry& e : man.kernels)
      if (e.name == l.kernel && e.target == rr_.target) l.op = e.op;
    l.isolated_us = bench::Summary::of(alone[i]);
    l.sequence_us = bench::Summary::of(seq[i]);
    l.gap_us = l.sequence_us.median - l.isolated_us.median;
    l.bytes = bench::kernel_bytes(h.model(), layer, prog->steps[i], elems_, t);
    l.share = bench::share_of(l.bytes.total(), l.isolated_us.median, ceiling());
    l.end_us = bench::Summary::of(ends[i]).median;
    k.sum_isolated_us += l.isolated_us.median;
    k.sum_sequence_us += l.sequence_us.median;
    k.launches.push_back(std::move(l));
  }
  for (int p = 0; p < kPrefetchPoints; ++p) {
    const auto& sp = spans[static_cast<size_t>(p)];
    if (sp[0].empty()) continue;
    bench::PrefetchSpan x;
    x.point = point_name(p);
    x.after = ob.prefetch_after[static_cast<size_t>(p)];
    x.bytes = prefetch_bytes(p, width, UINT64_MAX, layer);
    x.start_us = bench::Summary::of(sp[0]).median;
    x.end_us = bench::Summary::of(sp[1]).median;
    k.prefetch.push_back(x);
  }
  return k;
}

// What the tables of `point` at `width` pull (each capped at `cap` bytes), in one layer (>= 0) or the step.
uint64_t Bench::prefetch_bytes(int point, int width, uint64_t cap, int layer) const {
  uint64_t total = 0;
  for (const format::PrefetchEntry& e : h_->manifest().prefetch) {
    if (e.point != point_name(point) || (layer >= 0 && e.layer != layer)) continue;
    if (std::find(e.widths.begin(), e.widths.end(), width) == e.widths.end()) continue;
    uint64_t t = 0;
    for (const format::PrefetchRangeEntry& r : e.ranges) t += r.bytes;
    total += std::min(t, cap) / 16 * 16;
  }
  return total;
}

// The whole step with prefetch off, with the bundle's tables, with each point alone and with the
// next_attention tables capped: one graph each, replayed round robin so that drift (clocks, heat)
// spreads over all of them alike.
void Bench::sweep_prefetch(int width, const dp_step* step) {
  Harness& h = *h_;
  const Driver& d = h.driver();
  const cuda::CUstream s = h.stream();
  struct Variant {
    bench::PrefetchVariant v;
    unsigned mask = 0;
    uint64_t cap = UINT64_MAX;
    std::unique_ptr<Graph> g;
    std::vector<double> us;
  };
  std::vector<Variant> vs;
  unsigned all = 0;
  for (int p = 0; p < kPrefetchPoints; ++p)
    if (prefetch_bytes(p, width, UINT64_MAX, -1) > 0) all |= 1u << p;
  auto add = [&](std::string name, unsigned mask, uint64_t cap) {
    Variant x;
    x.v.width = width;
    x.v.name = std::move(name);
    x.mask = mask;
    x.cap = cap;
    x.v.next_attention_cap = cap == UINT64_MAX ? -1 : static_cast<int64_t>(cap);
    for (int p = 0; p < kPrefetchPoints; ++p)
      if (mask & (1u << p)) {
        x.v.points.push_back(point_name(p));
        x.v.bytes += prefetch_bytes(p, width, p == DP_PREFETCH_NEXT_ATTENTION ? cap : UINT64_MAX, -1);
      }
    vs.push_back(std::move(x));
  };
  add("off", 0, UINT64_MAX);
  if (all == 0) {
    res_.notes.push_back(fmt::format("width {}: the bundle has no prefetch table at this width; the sweep times "
                                     "prefetch off only", width));
  } else {
    add("all tables", all, UINT64_MAX);
    if (std::popcount(all) > 1)
      for (int p = 0; p < kPrefetchPoints; ++p)
        if (all & (1u << p)) add(fmt::format("{} only", point_name(p)), 1u << p, UINT64_MAX);
    if (all & (1u << DP_PREFETCH_NEXT_ATTENTION)) {
      uint64_t largest = 0;  // the largest next_attention table
      for (const format::PrefetchEntry& e : h.manifest().prefetch)
        if (e.point == point_name(DP_PREFETCH_NEXT_ATTENTION) &&
            std::find(e.widths.begin(), e.widths.end(), width) != e.widths.end()) {
          uint64_t t = 0;
          for (const format::PrefetchRangeEntry& r : e.ranges) t += r.bytes;
          largest = std::max(largest, t);
        }
      for (uint64_t cap : kSweepCaps)
        if (cap < largest) add(fmt::format("next_attention <= {} MiB", cap >> 20), all, cap);
    }
  }
  log(fmt::format("width {}: prefetch sweep, {} variants side by side", width, vs.size()));
  for (Variant& x : vs) {
    rt(dp_prefetch_set_cap(h.session(), DP_PREFETCH_NEXT_ATTENTION, width, x.cap), "capping the next_attention tables");
    h.set_prefetch_points(x.mask);
    x.g = h.capture([&] { h.enqueue_step(step); });
  }
  h.set_prefetch_points(0xF);
  rt(dp_prefetch_set_cap(h.session(), DP_PREFETCH_NEXT_ATTENTION, width, UINT64_MAX), "restoring the next_attention tables");
  const int per_round = std::max(2, o_.replays / kSweepRounds);
  for (int r = 0; r < kSweepRounds; ++r)
    for (Variant& x : vs) {
      std::vector<double> us = time_graph(d, s, *x.g, per_round, r == 0 ? kWarmup : 1, *events_);
      x.us.insert(x.us.end(), us.begin(), us.end());
    }
  rt(dp_after_step(h.session()), "after the prefetch sweep");
  const double off = bench::Summary::of(vs.front().us).median;
  for (Variant& x : vs) {
    x.v.us = bench::Summary::of(x.us);
    x.v.vs_off = x.v.us.median > 0 ? off / x.v.us.median - 1 : 0;
    x.g.reset();
    res_.prefetch_variants.push_back(std::move(x.v));
  }
}

}  // namespace

bench::BenchResult run_bench(const BenchOptions& o) {
  Bench b(o);
  return b.run();
}

}  // namespace dp::tools
