// The random stream of the test inputs: splitmix64, the same numbers on every platform. `run --check`,
// `bench` and `generate` draw their inputs from it (tooling/device.h), and so does the reference
// sensitivity tool, so that it perturbs the inputs those checks see.
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace dp {

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x5DEECE66Dull) {}
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) { return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1.0p-53; }
  // Uniform in [lo, hi] but never 0 (inputs are non-zero, so a kernel that ignores one shows).
  double nonzero(double lo, double hi) {
    const double x = uniform(lo, hi);
    return x == 0 ? hi : x;
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[static_cast<size_t>(below(static_cast<int64_t>(i)))]);
  }
};

}  // namespace dp
