#include "bench/result.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include <fmt/format.h>

namespace dp::bench {

namespace {

double percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0;
  const double pos = p * static_cast<double>(sorted.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(pos));
  const size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - static_cast<double>(lo));
}

// JSON has no NaN or infinity.
Json num(double v) { return std::isfinite(v) ? Json(v) : Json(nullptr); }

double mb(uint64_t b) { return static_cast<double>(b) / 1e6; }

std::string pct(double share) { return fmt::format("{:.1f}%", share * 100); }

}  // namespace

Summary Summary::of(std::vector<double> v) {
  Summary s;
  s.n = static_cast<int64_t>(v.size());
  if (v.empty()) return s;
  std::sort(v.begin(), v.end());
  s.median = percentile(v, 0.5);
  s.p10 = percentile(v, 0.1);
  s.p90 = percentile(v, 0.9);
  s.min = v.front();
  s.max = v.back();
  s.mean = std::accumulate(v.begin(), v.end(), 0.0) / static_cast<double>(v.size());
  return s;
}

Bytes ClassResult::bytes_per_layer() const {
  Bytes b = bytes;
  const uint64_t n = layers.empty() ? 1 : layers.size();
  for (uint64_t* f : {&b.dense_weights, &b.expert_weights, &b.state_read, &b.state_write, &b.kv_read, &b.kv_write,
                      &b.act_read, &b.act_write})
    *f /= n;
  return b;
}

double share_of(uint64_t bytes, double us, double ceiling_bytes_per_s) {
  if (us <= 0 || ceiling_bytes_per_s <= 0) return 0;
  return static_cast<double>(bytes) / (us * 1e-6) / ceiling_bytes_per_s;
}

Json to_json(const Summary& s) {
  return Json{{"n", s.n},         {"median", num(s.median)}, {"p10", num(s.p10)}, {"p90", num(s.p90)},
              {"min", num(s.min)}, {"max", num(s.max)},       {"mean", num(s.mean)}};
}

Json to_json(const Bytes& b) {
  return Json{{"dense_weights", b.dense_weights}, {"expert_weights", b.expert_weights}, {"state_read", b.state_read},
              {"state_write", b.state_write},     {"kv_read", b.kv_read},               {"kv_write", b.kv_write},
              {"act_read", b.act_read},           {"act_write", b.act_write},           {"total", b.total()}};
}

Json to_json(const BenchResult& r) {
  Json gate = Json::array(), classes = Json::array(), steps = Json::array(), kernels = Json::array();
  for (const GateResult& g : r.gate)
    gate.push_back({{"width", g.width}, {"checks", g.checks}, {"failed", g.failed}, {"failures", g.failures}});
  for (const ClassResult& c : r.classes)
    classes.push_back({{"class", c.cls},
                       {"width", c.width},
                       {"status", c.status},
                       {"reason", c.reason},
                       {"layers", c.layers},
                       {"routed_experts", c.routed_experts},
                       {"us_per_layer", to_json(c.us_per_layer)},
                       {"bytes", to_json(c.bytes)},
                       {"bytes_per_layer", to_json(c.bytes_per_layer())},
                       {"replay_bytes", c.replay_bytes},
                       {"share", num(c.share)}});
  for (const StepResult& s : r.steps)
    steps.push_back({{"width", s.width},
                     {"status", s.status},
                     {"reason", s.reason},
                     {"layers", s.layers},
                     {"us", to_json(s.us)},
                     {"bytes", to_json(s.bytes)},
                     {"share", num(s.share)},
                     {"tokens_per_s_per_request", num(s.tokens_per_s_per_request)},
                     {"tokens_per_s", num(s.tokens_per_s)}});
  for (const KernelBreakdown& k : r.kernels) {
    Json launches = Json::array();
    for (const KernelLaunch& l : k.launches)
      launches.push_back({{"index", l.index},
                          {"kernel", l.kernel},
                          {"op", l.op},
                          {"isolated_us", to_json(l.isolated_us)},
                          {"sequence_us", to_json(l.sequence_us)},
                          {"gap_us", num(l.gap_us)},
                          {"bytes", to_json(l.bytes)},
                          {"share", num(l.share)},
                          {"end_us", num(l.end_us)}});
    Json spans = Json::array();
    for (const PrefetchSpan& p : k.prefetch)
      spans.push_back({{"point", p.point}, {"after", p.after}, {"bytes", p.bytes}, {"start_us", num(p.start_us)},
                       {"end_us", num(p.end_us)}});
    kernels.push_back({{"class", k.cls},
                       {"width", k.width},
                       {"layer", k.layer},
                       {"status", k.status},
                       {"reason", k.reason},
                       {"sequence_mode", k.sequence_mode},
                       {"layer_us", num(k.layer_us)},
                       {"sum_isolated_us", num(k.sum_isolated_us)},
                       {"sum_sequence_us", num(k.sum_sequence_us)},
                       {"launches", launches},
                       {"prefetch", spans}});
  }
  Json variants = Json::array();
  for (const PrefetchVariant& v : r.prefetch_variants)
    variants.push_back({{"width", v.width},
                        {"name", v.name},
                        {"points", v.points},
                        {"next_attention_cap", v.next_attention_cap},
                        {"bytes", v.bytes},
                        {"us", to_json(v.us)},
                        {"vs_off", num(v.vs_off)}});
  return Json{{"format", kResultFormat},
              {"format_version", kResultFormatVersion},
              {"implementation", r.implementation},
              {"version", r.version},
              {"bundle", r.bundle},
              {"digest", r.digest},
              {"model", r.model},
              {"weights", r.weights},
              {"device", r.device},
              {"target", r.target},
              {"context", r.context},
              {"replays", r.replays},
              {"prefetch", r.prefetch},
              {"prefetch_mode", r.prefetch_mode},
              {"l2_bytes", r.l2_bytes},
              {"sms", r.sms},
              {"ceiling",
               {{"method", r.ceiling.method},
                {"bytes", r.ceiling.bytes},
                {"us", to_json(r.ceiling.us)},
                {"bytes_per_s", num(r.ceiling.bytes_per_s())}}},
              {"launch_floor",
               {{"kernels", r.launch_floor.kernels},
                {"graph_us", num(r.launch_floor.graph_us)},
                {"stream_us", num(r.launch_floor.stream_us)}}},
              {"widths", r.widths},
              {"gate", gate},
              {"classes", classes},
              {"steps", steps},
              {"kernels", kernels},
              {"prefetch_variants", variants},
              {"notes", r.notes}};
}

std::string to_text(const BenchResult& r) {
  std::string o;
  auto line = [&o](const std::string& s) { o += s + "\n"; };
  line(fmt::format("implementation {} {}", r.implementation, r.version));
  if (!r.bundle.empty()) line(fmt::format("bundle         {} ({})", r.bundle, r.digest));
  line(fmt::format("model          {}; weights {}", r.model, r.weights));
  line(fmt::format("device         {}, target {}, {} SMs, L2 {:.1f} MB", r.device, r.target, r.sms,
                   mb(static_cast<uint64_t>(r.l2_bytes))));
  line(fmt::format("context        {} tokens per request; {} graph replays per figure; L2 prefetch {}", r.context,
                   r.replays, r.prefetch_mode));
  line(fmt::format("ceiling        {:.3f} TB/s ({}, {:.2f} GiB; median of {}, p10-p90 {:.3f}-{:.3f} TB/s)",
                   r.ceiling.bytes_per_s() / 1e12, r.ceiling.method,
                   static_cast<double>(r.ceiling.bytes) / double(1ull << 30), r.ceiling.us.n,
                   r.ceiling.us.p90 > 0 ? static_cast<double>(r.ceiling.bytes) / r.ceiling.us.p90 / 1e6 : 0.0,
                   r.ceiling.us.p10 > 0 ? static_cast<double>(r.ceiling.bytes) / r.ceiling.us.p10 / 1e6 : 0.0));
  if (r.launch_floor.kernels > 0)
    line(fmt::format("launch floor   {:.2f} us per dependent empty kernel in a graph, {:.2f} us on a busy stream",
                     r.launch_floor.graph_us, r.launch_floor.stream_us));

  for (const GateResult& g : r.gate) {
    line(fmt::format("gate           width {}: {} checks, {} failed", g.width, g.checks, g.failed));
    for (const std::string& f : g.failures) line("               FAIL " + f);
  }

  line("");
  line(fmt::format("{:<14} {:>5} {:>7} {:>10} {:>9} {:>9} {:>10} {:>7}  {}", "layer class", "width", "layers",
                   "us/layer", "p10", "p90", "MB/layer", "share", "status"));
  for (const ClassResult& c : r.classes) {
    if (c.status != "ok") {
      line(fmt::format("{:<14} {:>5} {:>7} {:>10} {:>9} {:>9} {:>10} {:>7}  {}: {}", c.cls, c.width, c.layers.size(), "-",
                       "-", "-", "-", "-", c.status, c.reason));
      continue;
    }
    line(fmt::format("{:<14} {:>5} {:>7} {:>10.1f} {:>9.1f} {:>9.1f} {:>10.2f} {:>7}  ok", c.cls, c.width,
                     c.layers.size(), c.us_per_layer.median, c.us_per_layer.p10, c.us_per_layer.p90,
                     mb(c.bytes_per_layer().total()), pct(c.share)));
  }

  if (!r.steps.empty()) {
    line("");
    line(fmt::format("{:<14} {:>5} {:>7} {:>10} {:>9} {:>9} {:>10} {:>7} {:>11} {:>9}  {}", "whole step", "width",
                     "layers", "us", "p10", "p90", "MB", "share", "tok/s/req", "tok/s", "status"));
    for (const StepResult& s : r.steps) {
      if (s.status != "ok") {
        line(fmt::format("{:<14} {:>5} {:>7} {:>10} {:>9} {:>9} {:>10} {:>7} {:>11} {:>9}  {}: {}", "", s.width, s.layers,
                         "-", "-", "-", "-", "-", "-", "-", s.status, s.reason));
        continue;
      }
      line(fmt::format("{:<14} {:>5} {:>7} {:>10.1f} {:>9.1f} {:>9.1f} {:>10.2f} {:>7} {:>11.1f} {:>9.1f}  ok", "",
                       s.width, s.layers, s.us.median, s.us.p10, s.us.p90, mb(s.bytes.total()), pct(s.share),
                       s.tokens_per_s_per_request, s.tokens_per_s));
    }
  }

  for (const KernelBreakdown& k : r.kernels) {
    line("");
    if (k.status != "ok") {
      line(fmt::format("kernels of layer {} ({}), width {}: {}: {}", k.layer, k.cls, k.width, k.status, k.reason));
      continue;
    }
    line(fmt::format("kernels of layer {} ({}), width {}: alone (L2 flushed) and in sequence ({}); layer {:.1f} us "
                     "per layer in the class graph, sum alone {:.1f} us, sum in sequence {:.1f} us",
                     k.layer, k.cls, k.width, k.sequence_mode, k.layer_us, k.sum_isolated_us, k.sum_sequence_us));
    line(fmt::format("  {:>2} {:<44} {:>9} {:>9} {:>8} {:>9} {:>7} {:>8}", "#", "kernel", "us alone", "in seq", "gap",
                     "MB", "share", "ends at"));
    for (const KernelLaunch& l : k.launches)
      line(fmt::format("  {:>2} {:<44} {:>9.1f} {:>9.1f} {:>8.1f} {:>9.3f} {:>7} {:>8.1f}", l.index,
                       l.kernel.substr(0, 44), l.isolated_us.median, l.sequence_us.median, l.gap_us,
                       mb(l.bytes.total()), pct(l.share), l.end_us));
    for (const PrefetchSpan& p : k.prefetch)
      line(fmt::format("  prefetch {} ({:.2f} MB, after kernel {}): side stream from {:.1f} to {:.1f} us ({:.2f} TB/s)",
                       p.point, mb(p.bytes), p.after, p.start_us, p.end_us,
                       p.end_us > p.start_us ? static_cast<double>(p.bytes) / (p.end_us - p.start_us) / 1e6 : 0.0));
  }
  if (!r.prefetch_variants.empty()) {
    line("");
    line(fmt::format("{:<34} {:>5} {:>10} {:>9} {:>9} {:>10} {:>8}", "prefetch (whole step)", "width", "us", "p10", "p90",
                     "MB pulled", "vs off"));
    for (const PrefetchVariant& v : r.prefetch_variants)
      line(fmt::format("{:<34} {:>5} {:>10.1f} {:>9.1f} {:>9.1f} {:>10.2f} {:>+7.1f}%", v.name.substr(0, 34), v.width,
                       v.us.median, v.us.p10, v.us.p90, mb(v.bytes), 100 * v.vs_off));
  }
  for (const std::string& n : r.notes) line("note: " + n);
  return o;
}

}  // namespace dp::bench
