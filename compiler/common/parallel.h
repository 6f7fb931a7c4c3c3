// A parallel loop over indices, for work whose items are independent and equal enough to be dealt out
// round robin (weight conversion of expert groups, the layer-by-layer reference checks, rows of FP8
// blocks in the quantizer).
#pragma once

#include <algorithm>
#include <exception>
#include <thread>
#include <vector>

namespace dp {

// Runs f(i) for i in [0, n) on up to `threads` threads; the first exception is rethrown after all joined.
template <class F>
void parallel_for(size_t n, unsigned threads, F&& f) {
  threads = std::max(1u, std::min<unsigned>(threads, static_cast<unsigned>(n)));
  if (threads == 1) {
    for (size_t i = 0; i < n; ++i) f(i);
    return;
  }
  std::vector<std::thread> pool;
  std::vector<std::exception_ptr> errors(threads);
  for (unsigned t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      try {
        for (size_t i = t; i < n; i += threads) f(i);
      } catch (...) {
        errors[t] = std::current_exception();
      }
    });
  for (auto& th : pool) th.join();
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace dp
