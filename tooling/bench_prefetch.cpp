// `bench --prefetch sweep`: the whole step under each prefetch setting.
#include "tooling/bench_detail.h"

#include <algorithm>
#include <bit>
#include <map>
#include <set>

#include <fmt/ranges.h>

#include "common/error.h"
#include "deploy/deploy.h"

namespace dp::tools::bench_detail {

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

}  // namespace dp::tools::bench_detail
