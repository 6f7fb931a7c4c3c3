// `bench`: one layer kernel by kernel (the launch observer and Bench::breakdown).
#include "tooling/bench_detail.h"

#include <algorithm>
#include <bit>
#include <map>
#include <set>

#include <fmt/ranges.h>

#include "common/error.h"
#include "deploy/deploy.h"

namespace dp::tools::bench_detail {

void Observer::call(void* user, int32_t layer, int32_t index, const char* kernel, int32_t after, dp_stream stream) {
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

}  // namespace dp::tools::bench_detail
