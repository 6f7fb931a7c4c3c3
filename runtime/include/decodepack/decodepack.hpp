// decodepack.hpp: header-only C++17 RAII wrapper over the C ABI (decodepack.h).
//
// Handles own their C objects (move-only); failing calls throw decodepack::Error carrying the dp_code
// and the library's message. The exceptions are thrown here, in the caller's code: nothing throws
// across the C ABI. Planning refusals are results (Plan::reason), not exceptions.
//
//   auto bundle = decodepack::Bundle::open("tiny.dpk");
//   decodepack::SessionOptions o;  o.c.device = 0;  o.c.rank = 0;
//   auto session = decodepack::Session(bundle, o);
//   session.bind_weight("model.norm.weight", decodepack::tensor(ptr, DP_DTYPE_BF16, {256}));
//   ...
//   session.finalize_weights();
//   session.load_kernels();
//   decodepack::Plan p = session.plan(desc);
//   if (p.reason() == DP_REASON_NONE) session.launch_final_norm(p.step(), io, stream);
#ifndef DECODEPACK_HPP_
#define DECODEPACK_HPP_

#include <cstdint>
#include <initializer_list>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "decodepack/decodepack.h"

namespace decodepack {

class Error : public std::runtime_error {
 public:
  Error(dp_code code, const std::string& message) : std::runtime_error(message), code_(code) {}
  dp_code code() const noexcept { return code_; }
  const char* code_name() const noexcept { return dp_code_name(code_); }

 private:
  dp_code code_;
};

// Throws for a non-NULL status (and frees it).
inline void check(dp_status* s) {
  if (!s) return;
  const dp_code code = dp_status_code(s);
  std::string message = dp_status_message(s);
  dp_status_free(s);
  throw Error(code, message);
}

// A contiguous tensor description.
inline dp_tensor tensor(uint64_t data, dp_dtype dtype, std::initializer_list<int64_t> shape) {
  std::vector<int64_t> s(shape);
  dp_tensor t;
  dp_tensor_init(&t, data, dtype, static_cast<int32_t>(s.size()), s.data());
  return t;
}

class Bundle {
 public:
  static Bundle open(const std::string& path) {
    dp_bundle* b = nullptr;
    check(dp_bundle_open(path.c_str(), nullptr, &b));
    return Bundle(b);
  }
  Bundle(Bundle&& o) noexcept : b_(std::exchange(o.b_, nullptr)) {}
  Bundle& operator=(Bundle&& o) noexcept {
    if (this != &o) {
      dp_bundle_close(b_);
      b_ = std::exchange(o.b_, nullptr);
    }
    return *this;
  }
  Bundle(const Bundle&) = delete;
  Bundle& operator=(const Bundle&) = delete;
  ~Bundle() { dp_bundle_close(b_); }

  dp_bundle* get() const noexcept { return b_; }
  dp_bundle_info info() const {
    dp_bundle_info i{};
    i.size = sizeof(i);
    check(dp_bundle_get_info(b_, &i));
    return i;
  }
  dp_layer_info layer(int32_t index) const {
    dp_layer_info i{};
    i.size = sizeof(i);
    check(dp_bundle_get_layer(b_, index, &i));
    return i;
  }
  std::vector<dp_weight_info> weights(int32_t rank) const {
    std::vector<dp_weight_info> out;
    const int32_t n = dp_bundle_weight_count(b_, rank);
    for (int32_t i = 0; i < n; ++i) {
      dp_weight_info w{};
      w.size = sizeof(w);
      check(dp_bundle_get_weight(b_, rank, i, &w));
      out.push_back(w);
    }
    return out;
  }
  // Throws the reason the bundle would not run on `device` as `rank` (NULL / -1: not checked).
  void query_validity(const dp_device_desc* device, int32_t rank = -1) const {
    check(dp_bundle_query_validity(b_, device, rank));
  }

 private:
  explicit Bundle(dp_bundle* b) : b_(b) {}
  dp_bundle* b_;
};

struct SessionOptions {
  SessionOptions() { dp_session_options_init(&c); }
  dp_session_options c;
};

class Plan {
 public:
  explicit Plan(const dp_plan_result& r) : r_(r) {}
  int32_t reason() const noexcept { return r_.reason; }
  const char* reason_name() const noexcept { return dp_reason_name(r_.reason); }
  int32_t width() const noexcept { return r_.width; }
  int32_t rows() const noexcept { return r_.rows; }
  const dp_step* step() const noexcept { return r_.step; }
  const char* message() const noexcept { return r_.message; }
  bool layer_kernel(int32_t layer) const noexcept { return dp_step_layer_kernel(r_.step, layer) != 0; }

 private:
  dp_plan_result r_;
};

// The plan of one attention group's indexer prefill (dp_indexer_prepare); free it before its session.
class IndexerMetadata {
 public:
  IndexerMetadata(dp_indexer_metadata* m, const dp_indexer_plan_info& info) : m_(m), info_(info) {}
  IndexerMetadata(IndexerMetadata&& o) noexcept : m_(std::exchange(o.m_, nullptr)), info_(o.info_) {}
  IndexerMetadata& operator=(IndexerMetadata&& o) noexcept {
    if (this != &o) {
      dp_indexer_metadata_free(m_);
      m_ = std::exchange(o.m_, nullptr);
      info_ = o.info_;
    }
    return *this;
  }
  IndexerMetadata(const IndexerMetadata&) = delete;
  IndexerMetadata& operator=(const IndexerMetadata&) = delete;
  ~IndexerMetadata() { dp_indexer_metadata_free(m_); }

  const dp_indexer_metadata* get() const noexcept { return m_; }
  const dp_indexer_plan_info& info() const noexcept { return info_; }

 private:
  dp_indexer_metadata* m_ = nullptr;
  dp_indexer_plan_info info_;
};

class Session {
 public:
  Session(const Bundle& bundle, const SessionOptions& options = SessionOptions()) {
    check(dp_session_create(bundle.get(), &options.c, &s_));
  }
  Session(Session&& o) noexcept : s_(std::exchange(o.s_, nullptr)) {}
  Session& operator=(Session&& o) noexcept {
    if (this != &o) {
      dp_session_destroy(s_);
      s_ = std::exchange(o.s_, nullptr);
    }
    return *this;
  }
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;
  ~Session() { dp_session_destroy(s_); }

  dp_session* get() const noexcept { return s_; }

  void bind_weight(const std::string& name, const dp_tensor& t) { check(dp_session_bind_weight(s_, name.c_str(), &t)); }
  void bind_expert_weights(const std::string& group, const std::vector<uint64_t>& data, const dp_tensor& expert) {
    check(dp_session_bind_expert_weights(s_, group.c_str(), data.data(), static_cast<int32_t>(data.size()), &expert));
  }
  void finalize_weights() { check(dp_session_finalize_weights(s_)); }
  void verify_weights() { check(dp_session_verify_weights(s_)); }
  std::string target() const { return dp_session_target(s_); }
  // Tensor parallelism (format 1.6): every rank's exchange buffer, in rank order, before load_kernels.
  uint64_t exchange_bytes() const { return dp_session_exchange_bytes(s_); }
  void set_peers(const std::vector<uint64_t>& exchange, uint32_t timeout_us) {
    check(dp_session_set_peers(s_, exchange.data(), static_cast<int32_t>(exchange.size()), timeout_us));
  }
  void load_kernels() { check(dp_session_load_kernels(s_)); }
  void bind_kv(int32_t layer, dp_kv_kind kind, const dp_tensor& t) { check(dp_session_bind_kv(s_, layer, kind, &t)); }
  void release_kv() { check(dp_session_release_kv(s_)); }
  dp_tensor kv_layout(int32_t layer, dp_kv_kind kind, int64_t count) const {
    dp_tensor t;
    check(dp_session_kv_layout(s_, layer, kind, count, &t));
    return t;
  }

  Plan plan(const dp_step_desc& desc) {
    dp_plan_result r;
    dp_plan_result_init(&r);
    check(dp_plan(s_, &desc, &r));
    return Plan(r);
  }
  void after_step() { check(dp_after_step(s_)); }

  void launch_layer(const dp_step* step, int32_t layer, const dp_layer_io& io, dp_stream stream) {
    check(dp_launch_layer(s_, step, layer, &io, stream));
  }
  void launch_final_norm(const dp_step* step, const dp_final_norm_io& io, dp_stream stream) {
    check(dp_launch_final_norm(s_, step, &io, stream));
  }
  void bind_lm_head(const dp_tensor& weight) { check(dp_session_bind_lm_head(s_, &weight)); }
  void launch_lm_head(const dp_step* step, const dp_lm_head_io& io, dp_stream stream) {
    check(dp_launch_lm_head(s_, step, &io, stream));
  }
  bool prefetch_fork(dp_prefetch_point point, int32_t layer, int32_t width, dp_stream stream) {
    int32_t launched = 0;
    check(dp_prefetch_fork(s_, point, layer, width, stream, &launched));
    return launched != 0;
  }
  void prefetch_join(dp_stream stream) { check(dp_prefetch_join(s_, stream)); }

  // Sparse-attention indexer prefill.
  void indexer_write_keys(const dp_indexer_cache& cache, uint64_t keys, uint64_t slot_mapping, int64_t count,
                          dp_stream stream) {
    check(dp_indexer_write_keys(s_, &cache, keys, slot_mapping, count, stream));
  }
  IndexerMetadata indexer_prepare(const std::vector<dp_indexer_requests>& sets, int32_t dcp_rank = 0,
                                  uint64_t max_tile_bytes = 0) {
    dp_indexer_batch_desc d;
    dp_indexer_batch_desc_init(&d);
    d.num_sets = static_cast<int32_t>(sets.size());
    d.sets = sets.data();
    d.dcp_rank = dcp_rank;
    d.max_tile_bytes = max_tile_bytes;
    dp_indexer_plan_info info;
    dp_indexer_plan_info_init(&info);
    dp_indexer_metadata* m = nullptr;
    check(dp_indexer_prepare(s_, &d, &m, &info));
    return IndexerMetadata(m, info);
  }
  void indexer_prefill(const IndexerMetadata& metadata, const dp_indexer_cache& cache, const dp_indexer_prefill_io& io,
                       dp_stream stream) {
    check(dp_indexer_prefill(s_, metadata.get(), &cache, &io, stream));
  }

 private:
  dp_session* s_ = nullptr;
};

}  // namespace decodepack

#endif  // DECODEPACK_HPP_
