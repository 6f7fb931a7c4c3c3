#include "tooling/generator.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>

#include <fmt/ranges.h>

#include "common/error.h"
#include "decodepack/decodepack.h"
#include "model/safetensors.h"
#include "tooling/batcher.h"
#include "tooling/device.h"
#include "tooling/harness.h"

namespace dp::tools {
namespace {

namespace fs = std::filesystem;

// The widths a batch of n requests may run at: the fixed one, or every built width up to the smallest
// that holds all n (requests leave, the width shrinks).
std::vector<int32_t> widths_in_use(const std::vector<int32_t>& built, int fixed, int n) {
  if (fixed > 0) return {fixed};
  std::vector<int32_t> out;
  for (int32_t w : built) {
    out.push_back(w);
    if (w >= n) break;
  }
  return out;
}

// Everything the batch needs from the bundle, checked before any GPU work: q = 1, tensor_parallel 1,
// every layer class's program and the LM head at every width in use.
void check_bundle_serves(const GenerateOptions& o, const format::Manifest& man, const std::vector<int32_t>& widths,
                         int q) {
  if (q != 1)
    fail(Errc::input, "{}: built with num_speculative_tokens {} (q = {}); generate runs plain decode steps (q = 1) "
         "bundles", o.bundle, q - 1, q);
  const int64_t tp = man.deploy.value("tensor_parallel", int64_t{1});
  if (tp != 1)
    fail(Errc::input, "{}: built for tensor_parallel {}; generate runs one rank (a tensor_parallel 1 bundle)", o.bundle,
         tp);
  std::vector<std::string> missing;
  std::set<std::string> classes;
  for (const format::LayerEntry& l : man.layers) classes.insert(l.cls);
  for (int32_t w : widths) {
    for (const std::string& c : classes) {
      const format::ProgramEntry* p = nullptr;
      for (const format::ProgramEntry& e : man.programs)
        if (e.cls == c && e.width == w) p = &e;
      if (!p) missing.push_back(fmt::format("width {}: no {} program", w, c));
      else if (p->steps.empty()) missing.push_back(fmt::format("width {}: no {} program ({})", w, c, p->reason));
    }
    const bool head = std::any_of(man.kernels.begin(), man.kernels.end(),
                                  [&](const format::KernelEntry& k) { return k.role == "lm_head" && k.width == w; });
    if (!head)
      missing.push_back(fmt::format("width {}: no LM head{}", w,
                                    man.format_version.minor < 5
                                        ? fmt::format(" (format {}.{}: LM heads are in bundles of format 1.5 and later; "
                                                      "rebuild the bundle)", man.format_version.major,
                                                      man.format_version.minor)
                                        : std::string()));
  }
  if (!missing.empty())
    fail(Errc::input, "{}: generate runs the whole model on the GPU, but the bundle lacks what widths {} need:\n  {}",
         o.bundle, fmt::join(widths, ", "), fmt::join(missing, "\n  "));
}

// The model-level tensor with this key ("embed_tokens.weight", "lm_head.weight").
const model::WeightSpec* model_weight(const model::Model& m, const std::string& key) {
  for (const model::WeightSpec& w : m.weights)
    if (w.layer < 0 && w.key == key) return &w;
  return nullptr;
}

class Generator {
 public:
  Generator(const GenerateOptions& o, GenerateResult& res) : o_(o), res_(res) {
    ro_.bundle = o.bundle;
    ro_.model = o.model;
    ro_.seed = o.seed;
    ro_.device = o.device;
    ro_.prefetch = o.prefetch;
    ro_.pdl = o.pdl;
    ro_.log = o.log;
    harness_ = std::make_unique<Harness>(ro_, run_);
  }
  ~Generator() {
    // Device objects of this class before the harness's context.
    graphs_.clear();
    start_.reset();
    stop_.reset();
    mem_.reset();
  }

  void run();

 private:
  void log(const std::string& s) const {
    if (o_.log) o_.log(s);
  }
  void prepare();              // host: bundle, model, prompts, checks
  void open_device();          // session, weights, kernels, LM head, caches, buffers
  void bind_caches(const BatchSizing& z);
  void allocate_io(int widest, int32_t cols);
  const dp_step* plan(const BatchStep& s, int32_t graph_mode);
  void upload(const BatchStep& s);
  void enqueue(const dp_step* step, int width);
  std::vector<RowResult> read_logits(const BatchStep& s);

  const GenerateOptions& o_;
  GenerateResult& res_;
  RunOptions ro_;
  RunResult run_;
  std::unique_ptr<Harness> harness_;

  std::vector<std::vector<int32_t>> prompts_;
  std::vector<int32_t> widths_;
  int widest_ = 0;
  int64_t block_size_ = 0, vocab_ = 0, hidden_ = 0;
  std::optional<st::Checkpoint> ckpt_;
  std::optional<WeightSource> source_;
  std::vector<uint16_t> embed_;  // [vocab, hidden] bf16 bits: the embedding stays on the host
  std::optional<Batcher> batcher_;

  // Device side (destroyed before the harness).
  std::unique_ptr<DeviceMemory> mem_;
  std::unique_ptr<Event> start_, stop_;
  std::map<int, std::unique_ptr<Graph>> graphs_;  // per width
  struct KdaCaches {
    std::vector<std::pair<CUdeviceptr, size_t>> c;  // (base, bytes per slot) of state, conv q, k, v
  };
  std::vector<KdaCaches> kda_;  // per KDA layer
  CUdeviceptr hid_[2] = {0, 0}, res_buf_[2] = {0, 0}, norm_out_ = 0, norm_res_ = 0, logits_ = 0;
  CUdeviceptr d_positions_ = 0, d_state_ = 0, d_block_table_ = 0, d_seq_lens_ = 0, d_slots_ = 0, d_accepted_ = 0;
  int32_t cols_ = 1;
  std::vector<float> logits_host_;
  std::vector<uint16_t> rows_host_;
  std::vector<std::vector<float>> kept_logits_;  // per request, with --logits
};

void Generator::prepare() {
  Harness& h = *harness_;
  h.open_bundle();  // the bundle (compiler reader and libdecodepack), the model it was built from
  const format::Manifest& man = h.manifest();
  vocab_ = man.model.vocab_size;
  hidden_ = man.model.hidden_size;
  widths_ = h.bundle_widths();
  std::sort(widths_.begin(), widths_.end());
  if (o_.width > 0) h.check_width(o_.width, 0, "--width");
  widest_ = o_.width > 0 ? o_.width : widths_.back();
  prompts_ = read_prompts(o_.prompts, vocab_, widest_,
                          o_.width > 0 ? fmt::format("the --width {} every step runs at", o_.width)
                                       : fmt::format("the widest width of {} (generate runs every request in one "
                                                     "batch)", o_.bundle));
  check_bundle_serves(o_, man, widths_in_use(widths_, o_.width, static_cast<int>(prompts_.size())), h.q());
  block_size_ = man.deploy.at("kv_cache").at("block_size").get<int64_t>();

  res_.digest = run_.digest;
  res_.model = run_.model;
  res_.weights = run_.weights;
  res_.vocab = vocab_;
  res_.hidden = hidden_;
  res_.num_layers = h.num_layers();
  res_.max_tokens = o_.max_tokens;
  res_.graph = o_.graph;

  // The embedding (and the LM head below) from the same source `run` binds the decode weights from.
  const model::Model& m = h.model();
  std::error_code ec;
  if (fs::is_directory(o_.model, ec) && st::Checkpoint::present(o_.model)) ckpt_.emplace(st::Checkpoint::open(o_.model));
  source_.emplace(m, ckpt_ ? &*ckpt_ : nullptr, o_.seed);
  const model::WeightSpec* e = model_weight(m, "embed_tokens.weight");
  if (!e || e->dtype != DType::BF16 || e->shape != std::vector<int64_t>{vocab_, hidden_})
    fail(Errc::input, "model {}: no bf16 embed_tokens.weight [{}, {}]", res_.model, vocab_, hidden_);
  const std::vector<uint8_t> bytes = source_->full_bytes(*e);
  embed_.resize(bytes.size() / 2);
  std::memcpy(embed_.data(), bytes.data(), bytes.size());
}

void Generator::bind_caches(const BatchSizing& z) {
  const Driver& d = harness_->driver();
  dp_session* s = harness_->session();
  const format::Manifest& man = harness_->manifest();
  uint64_t total = 0;
  for (const format::LayerEntry& l : man.layers) {
    const bool kda = l.mixer == "kda";
    KdaCaches kc;
    const std::vector<int32_t> kinds = kda ? std::vector<int32_t>{DP_KV_KDA_STATE, DP_KV_CONV_Q, DP_KV_CONV_K, DP_KV_CONV_V}
                                           : std::vector<int32_t>{DP_KV_MLA_LATENT};
    for (int32_t kind : kinds) {
      const int64_t count = kind == DP_KV_MLA_LATENT ? z.blocks : z.slots;
      dp_tensor t;
      rt(dp_session_kv_layout(s, l.index, kind, count, &t), fmt::format("layer {} cache layout", l.index));
      size_t per = dp_dtype_size(t.dtype);
      for (int32_t k = 1; k < t.ndim; ++k) per *= static_cast<size_t>(t.shape[k]);
      const size_t bytes = per * static_cast<size_t>(count);
      t.data = mem_->alloc(bytes, fmt::format("layer {} cache kind {}", l.index, kind));
      // Zero: a new sequence starts from zero KDA state and conv history; MLA rows are written before read.
      d.check(d.MemsetD8Async(t.data, 0, bytes, harness_->stream()), "cuMemsetD8Async");
      rt(dp_session_bind_kv(s, l.index, kind, &t), fmt::format("binding layer {} cache", l.index));
      total += bytes;
      if (kda) kc.c.emplace_back(t.data, per);
    }
    if (kda) kda_.push_back(std::move(kc));
  }
  // K3 block attention residuals: the model's buffer, rows for the largest width the bundle holds. Every
  // layer runs on the bundle's programs (check_bundle_serves, plan), and they write each block before a
  // later layer of the same step reads it (layer 0 pushes the embedding), so no step puts anything there.
  // Filled with bf16 NaN once: a block read before its step wrote it would give NaN logits, not plausible
  // tokens.
  const AttnResBuffer ar =
      bind_attn_res(s, harness_->model().attn_res_block, widths_, harness_->q(),
                    [&](size_t bytes, const std::string& what) { return mem_->alloc(bytes, what); });
  if (ar.data) {
    d.check(d.MemsetD8Async(ar.data, 0xFF, ar.bytes, harness_->stream()), "cuMemsetD8Async",
            "attention-residual blocks");
    total += ar.bytes;
  }
  harness_->sync();
  log(fmt::format("caches: {} for {} KDA slots and {} MLA blocks of {} tokens per layer{}", human_bytes(total), z.slots,
                  z.blocks, block_size_,
                  ar.data ? fmt::format(", attention-residual blocks ({} per row) for {} rows", ar.blocks, ar.rows)
                          : std::string()));
}

void Generator::allocate_io(int widest, int32_t cols) {
  const size_t W = static_cast<size_t>(widest), act = W * static_cast<size_t>(hidden_) * 2;
  for (int i = 0; i < 2; ++i) {
    hid_[i] = mem_->alloc(act, "hidden rows");
    res_buf_[i] = mem_->alloc(act, "residual rows");
  }
  norm_out_ = mem_->alloc(act, "final norm output");
  norm_res_ = mem_->alloc(act, "final residual");
  logits_ = mem_->alloc(W * static_cast<size_t>(vocab_) * 4, "logits");
  d_positions_ = mem_->alloc(W * 8, "positions");
  d_state_ = mem_->alloc(W * 4, "state indices");
  d_block_table_ = mem_->alloc(W * static_cast<size_t>(cols) * 4, "block table");
  d_seq_lens_ = mem_->alloc(W * 4, "seq lens");
  d_slots_ = mem_->alloc(W * 8, "slot mapping");
  d_accepted_ = mem_->alloc(W * 4, "num accepted");
  logits_host_.resize(W * static_cast<size_t>(vocab_));
  rows_host_.resize(W * static_cast<size_t>(hidden_));
}

void Generator::open_device() {
  Harness& h = *harness_;
  h.open_device_and_weights();  // session, every decode weight bound (as `run` binds them), kernels loaded
  res_.device = run_.device;
  res_.target = run_.target;
  const Driver& d = h.driver();
  mem_ = std::make_unique<DeviceMemory>(d);
  start_ = std::make_unique<Event>(d);
  stop_ = std::make_unique<Event>(d);

  // The LM head weight: the host's, bound for the bundle's GEMM (tied models use the embedding).
  const model::Model& m = h.model();
  const model::WeightSpec* head = model_weight(m, "lm_head.weight");
  if (!head) head = model_weight(m, "embed_tokens.weight");
  const std::vector<uint8_t> bytes = source_->full_bytes(*head);
  const CUdeviceptr p = mem_->alloc(bytes.size(), "LM head weight");
  d.check(d.MemcpyHtoD(p, bytes.data(), bytes.size()), "cuMemcpyHtoD", "LM head weight");
  const int64_t shape[2] = {vocab_, hidden_};
  dp_tensor t;
  dp_tensor_init(&t, p, DP_DTYPE_BF16, 2, shape);
  rt(dp_session_bind_lm_head(h.session(), &t), "binding the LM head (" + head->name + ")");
  log(fmt::format("LM head: {} bound ({})", head->name, human_bytes(bytes.size())));

  std::vector<BatchRequest> reqs;
  for (const std::vector<int32_t>& prompt : prompts_) reqs.push_back({prompt, o_.max_tokens});
  const BatchSizing z = batch_sizing(reqs, block_size_);
  cols_ = z.cols;
  bind_caches(z);
  allocate_io(widest_, cols_);
  batcher_.emplace(widths_, o_.width, z.slots, z.blocks, z.cols, block_size_);
  for (BatchRequest& r : reqs) batcher_->join(std::move(r));
  kept_logits_.resize(prompts_.size());
}

const dp_step* Generator::plan(const BatchStep& s, int32_t graph_mode) {
  std::vector<int32_t> qlens(static_cast<size_t>(s.width), 1);
  dp_step_desc d;
  dp_step_desc_init(&d);
  d.num_requests = s.width;  // padded requests included
  d.query_lens = qlens.data();
  d.num_accepted = s.num_accepted.data();
  d.state_indices = s.state_indices.data();
  d.state_indices_stride = 1;
  d.block_table = s.block_table.data();
  d.block_table_stride = s.cols;
  d.block_table_cols = s.cols;
  d.graph_mode = graph_mode;
  dp_plan_result r;
  dp_plan_result_init(&r);
  rt(dp_plan(harness_->session(), &d, &r), "dp_plan");
  const int32_t verdict = dp_agree(&r.reason, 1, nullptr);
  if (verdict != DP_REASON_NONE)
    fail(Errc::internal, "the runtime refused a step of {} requests at width {}: {}: {}", s.requests, s.width,
         dp_reason_name(verdict), r.message);
  if (r.width != s.width) fail(Errc::internal, "dp_plan chose width {} for a step of width {}", r.width, s.width);
  for (int l = 0; l < res_.num_layers; ++l)
    if (!dp_step_layer_kernel(r.step, l)) fail(Errc::input, "width {}: layer {} has no program in the bundle", s.width, l);
  if (!dp_step_lm_head(r.step))
    fail(Errc::input, "width {}: the bundle has no LM head for target {}", s.width, res_.target);
  return r.step;
}

// The step's input rows (embedding gathered on the host) and metadata into the step buffers, and zeros
// into the state slots of requests that start. Stream-ordered before the step's launches.
void Generator::upload(const BatchStep& s) {
  const Driver& d = harness_->driver();
  cuda::CUstream st = harness_->stream();
  const size_t H = static_cast<size_t>(hidden_), W = static_cast<size_t>(s.width);
  for (size_t r = 0; r < W; ++r)
    std::memcpy(rows_host_.data() + r * H, embed_.data() + static_cast<size_t>(s.tokens[r]) * H, H * 2);
  auto put = [&](CUdeviceptr dst, const void* src, size_t bytes, const char* what) {
    d.check(d.MemcpyHtoDAsync(dst, src, bytes, st), "cuMemcpyHtoDAsync", what);
  };
  put(hid_[0], rows_host_.data(), W * H * 2, "input rows");
  put(d_positions_, s.positions.data(), W * 8, "positions");
  put(d_state_, s.state_indices.data(), W * 4, "state indices");
  put(d_block_table_, s.block_table.data(), s.block_table.size() * 4, "block table");
  put(d_seq_lens_, s.seq_lens.data(), W * 4, "seq lens");
  put(d_slots_, s.slot_mapping.data(), W * 8, "slot mapping");
  put(d_accepted_, s.num_accepted.data(), W * 4, "num accepted");
  for (int32_t slot : s.fresh_slots)
    for (const KdaCaches& k : kda_)
      for (const auto& [base, per] : k.c)
        d.check(d.MemsetD8Async(base + static_cast<size_t>(slot) * per, 0, per, st), "cuMemsetD8Async", "fresh state slot");
  harness_->sync();  // the host vectors are pageable and change with the next step
}

void Generator::enqueue(const dp_step* step, int width) {
  dp_session* s = harness_->session();
  cuda::CUstream st = harness_->stream();
  for (int l = 0; l < res_.num_layers; ++l) {
    for (int32_t point : {DP_PREFETCH_OPROJ_DOWN, DP_PREFETCH_ATTENTION_MOE, DP_PREFETCH_NEXT_ATTENTION,
                          DP_PREFETCH_ATTENTION_OPROJ})
      rt(dp_prefetch_fork(s, point, l, width, st, nullptr), fmt::format("prefetch fork, layer {}", l));
    // Ping-pong: layer l reads buffers l % 2 and writes the others (layer 0 has no residual input).
    dp_layer_io io;
    dp_layer_io_init(&io);
    io.hidden = hid_[l % 2];
    io.residual = l == 0 ? 0 : res_buf_[l % 2];
    io.out = hid_[(l + 1) % 2];
    io.residual_out = res_buf_[(l + 1) % 2];
    io.positions = d_positions_;
    io.state_indices = d_state_;
    io.block_table = d_block_table_;
    io.block_table_stride = cols_;
    io.seq_lens = d_seq_lens_;
    io.slot_mapping = d_slots_;
    io.num_accepted = d_accepted_;
    rt(dp_launch_layer(s, step, l, &io, st), fmt::format("launching layer {}", l));
  }
  const int last = res_.num_layers % 2;
  dp_final_norm_io n;
  dp_final_norm_io_init(&n);
  n.hidden = hid_[last];
  n.residual = res_buf_[last];
  n.out = norm_out_;
  n.residual_out = norm_res_;
  rt(dp_launch_final_norm(s, step, &n, st), "launching the final norm");
  rt(dp_prefetch_join(s, st), "prefetch join");
  dp_lm_head_io h;
  dp_lm_head_io_init(&h);
  h.hidden = norm_out_;
  h.logits = logits_;
  rt(dp_launch_lm_head(s, step, &h, st), "launching the LM head");
}

std::vector<RowResult> Generator::read_logits(const BatchStep& s) {
  const Driver& d = harness_->driver();
  const size_t V = static_cast<size_t>(vocab_), W = static_cast<size_t>(s.width);
  d.check(d.MemcpyDtoHAsync(logits_host_.data(), logits_, W * V * 4, harness_->stream()), "cuMemcpyDtoHAsync", "logits");
  harness_->sync();
  std::vector<RowResult> out(W);
  for (size_t r = 0; r < W; ++r) {
    if (s.request[r] < 0) continue;
    const float* row = logits_host_.data() + r * V;
    // Greedy: the first maximum (ties to the lower id, as torch.argmax); NaN never wins, and a row of
    // NaN fails (a kernel that wrote nothing).
    size_t best = V;
    float top = -std::numeric_limits<float>::infinity(), second = top;
    for (size_t v = 0; v < V; ++v) {
      if (std::isnan(row[v])) continue;
      if (best == V || row[v] > top) {
        second = best == V ? second : top;
        top = row[v];
        best = v;
      } else if (row[v] > second) {
        second = row[v];
      }
    }
    if (best == V)
      fail(Errc::device, "step at width {}: request {}'s logits are all NaN (row {})", s.width, s.request[r], r);
    out[r] = {static_cast<int32_t>(best), top - second};
    if (!o_.logits.empty()) {
      std::vector<float>& k = kept_logits_[static_cast<size_t>(s.request[r])];
      k.insert(k.end(), row, row + V);
    }
  }
  return out;
}

void Generator::run() {
  prepare();
  log(fmt::format("prompts: {} requests of {} to {} tokens, {} new tokens each", prompts_.size(),
                  std::min_element(prompts_.begin(), prompts_.end(), [](auto& a, auto& b) { return a.size() < b.size(); })->size(),
                  std::max_element(prompts_.begin(), prompts_.end(), [](auto& a, auto& b) { return a.size() < b.size(); })->size(),
                  o_.max_tokens));
  open_device();
  const Driver& d = harness_->driver();
  cuda::CUstream st = harness_->stream();
  std::vector<int> first(prompts_.size(), 0), last(prompts_.size(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  int index = 0;
  while (!batcher_->idle()) {
    const BatchStep s = batcher_->next();
    ++index;
    upload(s);
    GenerateStep gs;
    gs.index = index;
    gs.width = s.width;
    gs.requests = s.requests;
    const auto g = graphs_.find(s.width);
    const bool replay = o_.graph && g != graphs_.end();
    const dp_step* step = replay ? nullptr : plan(s, DP_GRAPH_NONE);
    d.check(d.EventRecord(start_->e, st), "cuEventRecord");
    if (replay) d.check(d.GraphLaunch(g->second->exec, st), "cuGraphLaunch");
    else enqueue(step, s.width);
    d.check(d.EventRecord(stop_->e, st), "cuEventRecord");
    d.check(d.StreamSynchronize(st), "cuStreamSynchronize", fmt::format("running step {} (width {})", index, s.width));
    rt(dp_after_step(harness_->session()), fmt::format("after step {}", index));
    float ms = 0;
    d.check(d.EventElapsedTime(&ms, start_->e, stop_->e), "cuEventElapsedTime");
    gs.ms = ms;
    gs.mode = replay ? "graph" : "eager";
    const std::vector<RowResult> rows = read_logits(s);
    // Capture after the eager step at this width (a host warms up before it captures); it does not run.
    if (o_.graph && !replay) {
      const dp_step* captured = plan(s, DP_GRAPH_FULL);  // under FULL graphs a host plans at capture only
      graphs_[s.width] = harness_->capture([&] { enqueue(captured, s.width); });
      gs.mode = "capture";
      log(fmt::format("graph: width {} captured", s.width));
    }
    for (int r = 0; r < s.requests; ++r) {
      const size_t id = static_cast<size_t>(s.request[static_cast<size_t>(r)]);
      if (!first[id]) first[id] = index;
      last[id] = index;
    }
    gs.left = batcher_->complete(s, rows);
    log(fmt::format("step {}: width {}, {} request{}, {} ({:.3f} ms){}", index, s.width, s.requests,
                    s.requests == 1 ? "" : "s", gs.mode, ms,
                    gs.left.empty() ? std::string() : fmt::format("; finished: {}", fmt::join(gs.left, ", "))));
    res_.steps.push_back(std::move(gs));
  }
  res_.wall_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  int64_t row = 0;
  std::ofstream logits;
  if (!o_.logits.empty()) {
    logits.open(o_.logits, std::ios::binary | std::ios::trunc);
    if (!logits) fail(Errc::io, "--logits {}: cannot write: {}", o_.logits, std::strerror(errno));
    res_.logits = o_.logits;
  }
  for (size_t id = 0; id < prompts_.size(); ++id) {
    GenerateRequest r;
    r.prompt = prompts_[id];
    r.tokens = batcher_->generated(static_cast<int>(id));
    for (const RowResult& p : batcher_->predictions(static_cast<int>(id))) {
      r.argmax.push_back(p.token);
      r.gap.push_back(p.gap);
    }
    r.first_step = first[id];
    r.last_step = last[id];
    if (logits.is_open()) {
      const std::vector<float>& k = kept_logits_[id];
      logits.write(reinterpret_cast<const char*>(k.data()), static_cast<std::streamsize>(k.size() * 4));
      r.logits_row = row;
      row += static_cast<int64_t>(r.argmax.size());
    }
    res_.requests.push_back(std::move(r));
  }
  if (logits.is_open() && !logits.flush()) fail(Errc::io, "--logits {}: write failed", o_.logits);
}

}  // namespace

GenerateResult generate(const GenerateOptions& o) {
  if (o.max_tokens < 1) fail(Errc::usage, "--max-tokens {}: expected >= 1", o.max_tokens);
  if (o.width < 0) fail(Errc::usage, "--width {}: expected a batch width the bundle holds", o.width);
  if (o.device < 0) fail(Errc::usage, "--device {}: expected a device ordinal >= 0", o.device);
  GenerateResult res;
  res.bundle = o.bundle;
  Generator g(o, res);
  g.run();
  return res;
}

}  // namespace dp::tools
