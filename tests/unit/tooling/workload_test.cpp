// tooling/workload: the random step metadata `run` and `bench` feed libdecodepack, and element access.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <set>

#include "tooling/workload.h"

namespace dp::tools {
namespace {

TEST(Workload, MetadataOfRealAndPaddedRequests) {
  Rng rng(3);
  const int W = 8, requests = 5, q = 2, steps = 3;
  const int64_t context = 100, block = 16;
  const Meta m = make_meta(W, requests, q, steps, context, block, false, rng);
  ASSERT_EQ(m.rows(), W * q);
  std::set<int32_t> slots, blocks;
  std::set<int32_t> lengths;
  for (int r = 0; r < W; ++r) {
    const bool real = r < requests;
    EXPECT_EQ(m.real[r], real);
    for (int i = 0; i < q; ++i) {
      const int32_t s = m.state_indices[static_cast<size_t>(r * q + i)];
      if (!real) {
        EXPECT_EQ(s, DP_NULL_BLOCK_ID);
        continue;
      }
      EXPECT_GT(s, 0);  // slot 0 is the null block
      EXPECT_LT(s, m.slots);
      EXPECT_TRUE(slots.insert(s).second) << "slot " << s << " used twice";
    }
    if (!real) continue;
    // Context in [context/2, context], then q new tokens; all different here (the range has room).
    const int32_t len = m.seq_lens[r];
    EXPECT_GE(len, context / 2 + q);
    EXPECT_LE(len, context + q);
    EXPECT_TRUE(lengths.insert(len).second);
    EXPECT_GE(m.num_accepted[r], 1);
    EXPECT_LE(m.num_accepted[r], q);
    // Enough distinct blocks for the context and every step's rows.
    const int64_t need = (len - q + int64_t{steps} * q + block - 1) / block;
    for (int64_t b = 0; b < need; ++b) {
      const int32_t id = m.block_table[static_cast<size_t>(r * m.stride + b)];
      EXPECT_GT(id, 0);
      EXPECT_LT(id, m.blocks);
      EXPECT_TRUE(blocks.insert(id).second) << "block " << id << " used twice";
    }
    // The newest q positions map into the request's own blocks.
    for (int i = 0; i < q; ++i) {
      const size_t t = static_cast<size_t>(r * q + i);
      const int64_t pos = len - q + i;
      EXPECT_EQ(m.positions[t], pos);
      EXPECT_EQ(m.slot_mapping[t],
                int64_t{m.block_table[static_cast<size_t>(r * m.stride + pos / block)]} * block + pos % block);
    }
  }
}

TEST(Workload, UniformContextAndAdvance) {
  Rng rng(5);
  Meta m = make_meta(4, 4, 2, 2, 64, 16, true, rng);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(m.seq_lens[r], 64 + 2);
  const std::vector<int32_t> before = m.seq_lens;
  m.advance(rng);
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(m.seq_lens[r], before[r] + m.num_accepted[r]);
    EXPECT_EQ(m.positions[static_cast<size_t>(r * 2 + 1)], m.seq_lens[r] - 1);
  }
}

TEST(Workload, SameSeedSameMetadata) {
  Rng a(9), b(9);
  const Meta x = make_meta(4, 3, 1, 1, 300, 64, false, a);
  const Meta y = make_meta(4, 3, 1, 1, 300, 64, false, b);
  EXPECT_EQ(x.block_table, y.block_table);
  EXPECT_EQ(x.state_indices, y.state_indices);
  EXPECT_EQ(x.seq_lens, y.seq_lens);
}

TEST(Workload, ElementAccessRoundsToTheStoredType) {
  uint8_t b[4];
  put_value(b, DType::BF16, 1.0 + 1.0 / 512);  // a tie between 1 and 1 + 2^-7: to even
  EXPECT_EQ(get_value(b, DType::BF16), 1.0);
  put_value(b, DType::BF16, -3.5);
  EXPECT_EQ(get_bf16(b), -3.5);
  put_value(b, DType::F32, 0.1);
  EXPECT_EQ(get_f32(b), static_cast<double>(0.1f));
  put_f32(b, std::numeric_limits<double>::quiet_NaN());
  EXPECT_TRUE(std::isnan(get_value(b, DType::F32)));
}

}  // namespace
}  // namespace dp::tools
