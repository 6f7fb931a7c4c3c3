// tooling/check: the pieces of the comparison policy that need no GPU, and the tools' thread pool.
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "tooling/check.h"
#include "common/parallel.h"

namespace dp::tools {
namespace {

TEST(Check, ChangedOutsideCountsElementsOutsideTheWrittenUnits) {
  // 4 units of 8 bytes (two 4-byte elements each).
  std::vector<uint8_t> before(32, 0), now(32, 0);
  now[0] = 1;             // unit 0, element 0: the step wrote unit 0 (skipped)
  now[9] = 1;             // unit 1, element 0
  now[13] = 1;            // unit 1, element 1
  now[31] = 1;            // unit 3, element 1
  EXPECT_EQ(changed_outside(before, now, 8, 4, {0}), 3);
  EXPECT_EQ(changed_outside(before, now, 8, 4, {0, 1, 3}), 0);
  EXPECT_EQ(changed_outside(before, before, 8, 4, {}), 0);
}

TEST(Check, PaddedRowsAreZeroedNaNIncluded) {
  std::vector<uint8_t> raw(2 * 3 * 2, 0xFF);  // bf16 NaN everywhere
  ref::Mat m = bf16_mat(raw, 2, 3);
  EXPECT_TRUE(std::isnan(m(0, 0)));
  zero_rows(m, {true, false});
  EXPECT_TRUE(std::isnan(m(0, 2)));  // a real row keeps what the GPU wrote
  for (int64_t c = 0; c < 3; ++c) EXPECT_EQ(m(1, c), 0.0);
}

TEST(Check, LimitsAreTheDocumentedOnes) {
  EXPECT_EQ(kBf16Limit, 1e-2);
  EXPECT_EQ(kF32Limit, 1e-4);
}

TEST(Parallel, EveryIndexOnceAndTheFirstErrorRethrown) {
  std::vector<std::atomic<int>> seen(100);
  parallel_for(seen.size(), 4, [&](size_t i) { seen[i]++; });
  for (auto& s : seen) EXPECT_EQ(s.load(), 1);
  EXPECT_THROW(parallel_for(10, 3, [](size_t i) {
                 if (i == 7) throw std::runtime_error("seven");
               }),
               std::runtime_error);
  int n = 0;
  parallel_for(0, 8, [&](size_t) { ++n; });
  EXPECT_EQ(n, 0);
}

}  // namespace
}  // namespace dp::tools
