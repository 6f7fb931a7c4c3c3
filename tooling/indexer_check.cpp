#include "tooling/indexer_check.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <thread>

#include <fmt/format.h>

#include "common/error.h"

namespace dp::tools::ixrun {

Reference reference(const Inputs& in, const Layout& L, const ix::PrefillConfig& cfg) {
  Reference ref;
  std::vector<double> keys(in.keys.size());
  for (size_t i = 0; i < keys.size(); ++i) keys[i] = bf16_value(in.keys[i]);
  for (int64_t rank = 0; rank < L.world; ++rank) {
    ref.caches.emplace_back(L.num_blocks, L.block_size, L.layout, L.block_stride);
    ix::write_keys(ref.caches.back(), keys, L.slots[rank]);
  }
  for (const Set& s : L.sets) {
    const ix::ChunkGeometry g = ix::plan_chunk(s.chunk, cfg);
    ix::IndexQuery query;
    query.heads = in.heads;
    for (int64_t i = s.first_row * in.heads * ix::kHeadDim; i < (s.first_row + s.rows) * in.heads * ix::kHeadDim; ++i)
      query.q.push_back(bf16_value(in.q[i]));
    for (int64_t i = s.first_row * in.heads; i < (s.first_row + s.rows) * in.heads; ++i) query.w.push_back(in.w[i]);
    std::vector<std::vector<uint8_t>> packed;
    for (int64_t rank = 0; rank < L.world; ++rank) packed.push_back(ix::pack_keys(ref.caches[rank], s.chunk, g, rank));
    const ix::StagedKeys staged = ix::stage_keys(ix::all_gather(packed, g), g);
    // Rows in parallel: each row's float64 logits, then its selection (what topk_rows does, row by row).
    std::vector<std::vector<double>> lg(static_cast<size_t>(g.num_rows));
    std::vector<int32_t> topk(static_cast<size_t>(g.num_rows * in.k));
    std::atomic<int64_t> next{0};
    std::vector<std::thread> pool;
    std::exception_ptr failed;
    std::mutex failed_mu;
    for (unsigned t = 0; t < std::max(1u, std::thread::hardware_concurrency()); ++t)
      pool.emplace_back([&] {
        try {
          for (int64_t row; (row = next++) < g.num_rows;) {
            lg[row] = ix::score_row(staged, g, query, row, in.weight_scale);
            const std::vector<int32_t> sel = ix::select_topk(lg[row], in.k);
            std::copy(sel.begin(), sel.end(), topk.begin() + row * in.k);
          }
        } catch (...) {
          std::lock_guard<std::mutex> lock(failed_mu);
          failed = std::current_exception();
        }
      });
    for (std::thread& t : pool) t.join();
    if (failed) std::rethrow_exception(failed);
    ref.topk.push_back(std::move(topk));
    ref.logits.push_back(std::move(lg));
  }
  return ref;
}

double median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

void compare_row(std::span<const int32_t> gpu, std::span<const int32_t> ref, std::span<const double> logits,
                 int64_t row, RowCheck& rc) {
  ++rc.rows;
  if (std::equal(gpu.begin(), gpu.end(), ref.begin())) {
    ++rc.identical;
    return;
  }
  const int64_t n = static_cast<int64_t>(logits.size()), k = static_cast<int64_t>(gpu.size());
  double scale = 0;
  for (double v : logits) scale = std::max(scale, std::fabs(v));
  const double tol = 1e-5 * scale + 1e-30;
  auto fail_row = [&](const std::string& why) {
    ++rc.failed;
    if (rc.failures.size() < 8) rc.failures.push_back(fmt::format("row {}: {}", row, why));
  };
  const int64_t valid = std::min(n, k);
  std::vector<int32_t> gs(gpu.begin(), gpu.begin() + valid), rs(ref.begin(), ref.begin() + valid);
  for (int64_t i = valid; i < k; ++i)
    if (gpu[i] != -1) return fail_row(fmt::format("entry {} is {}, expected -1 ({} visible keys)", i, gpu[i], n));
  for (int32_t p : gs)
    if (p < 0 || p >= n) return fail_row(fmt::format("position {} outside 0..{}", p, n - 1));
  std::sort(gs.begin(), gs.end());
  if (std::adjacent_find(gs.begin(), gs.end()) != gs.end()) return fail_row("a position is selected twice");
  const double kth = logits[ref[valid - 1]];
  std::sort(rs.begin(), rs.end());
  std::vector<int32_t> only_gpu, only_ref;
  std::set_difference(gs.begin(), gs.end(), rs.begin(), rs.end(), std::back_inserter(only_gpu));
  std::set_difference(rs.begin(), rs.end(), gs.begin(), gs.end(), std::back_inserter(only_ref));
  for (int32_t p : only_gpu)
    if (std::fabs(logits[p] - kth) > tol)
      return fail_row(fmt::format("position {} (score {:.9g}) selected, the k-th best scores {:.9g} (tolerance {:.2g})",
                                  p, logits[p], kth, tol));
  for (int32_t p : only_ref)
    if (std::fabs(logits[p] - kth) > tol)
      return fail_row(fmt::format("position {} (score {:.9g}) missing, the k-th best scores {:.9g} (tolerance {:.2g})",
                                  p, logits[p], kth, tol));
  for (int64_t i = 1; i < valid; ++i)
    if (logits[gpu[i]] > logits[gpu[i - 1]] + tol)
      return fail_row(fmt::format("entries {} and {} out of order (scores {:.9g} < {:.9g})", i - 1, i,
                                  logits[gpu[i - 1]], logits[gpu[i]]));
  ++rc.near_ties;
}

}  // namespace dp::tools::ixrun
