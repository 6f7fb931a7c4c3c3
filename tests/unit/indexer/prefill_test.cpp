// CPU reference of the FP4 indexer prefill (compiler/indexer/geometry.h, reference.h): DCP placement,
// the paged cache, packing, the all-gather, staging into 64-key pages, causal scoring, top-k and the
// exchange of selected rows, checked on closed-form cases and against a direct computation from the
// original keys, at world 1 and above, for odd lengths, one and many requests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "indexer/geometry.h"
#include "indexer/reference.h"
#include "indexer/workspace.h"
#include "../test_util.h"

namespace dp::indexer {
namespace {

// ---- Helpers -----------------------------------------------------------------------------------------

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// A chunk's inputs: the keys of every request (position-major [len, 128]) and its block table.
struct Scenario {
  PrefillConfig config;
  PrefillChunk chunk;
  std::vector<std::vector<double>> keys;  // [R][len * 128]
  int64_t num_blocks = 0;
};

// Requests of the given lengths and query rows; distinct block ids (never block 0), shuffled.
Scenario make_scenario(std::vector<int64_t> lens, std::vector<int64_t> queries, int64_t world, int64_t interleave,
                       int64_t block_size, uint64_t seed) {
  Scenario s;
  s.config = {/*max_keys=*/1 << 20, /*max_requests=*/1024, world, interleave, block_size};
  s.chunk.seq_lens = std::move(lens);
  s.chunk.query_lens = std::move(queries);
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  int64_t entries = 0;
  for (int64_t len : s.chunk.seq_lens) entries += ceil_div(len, block_size);
  std::vector<int32_t> pool(static_cast<size_t>(entries));
  std::iota(pool.begin(), pool.end(), 1);
  std::shuffle(pool.begin(), pool.end(), rng);
  s.num_blocks = entries + 1;
  size_t next = 0;
  for (int64_t len : s.chunk.seq_lens) {
    // One entry per block_size keys is more than any rank needs (it holds about len / world).
    std::vector<int32_t> row(pool.begin() + next, pool.begin() + next + ceil_div(len, block_size));
    next += row.size();
    s.chunk.block_table.push_back(std::move(row));
    std::vector<double> k(static_cast<size_t>(len * kHeadDim));
    for (double& v : k) v = n(rng);
    s.keys.push_back(std::move(k));
  }
  return s;
}

// Every rank's cache, written through vLLM's DCP slot mapping.
std::vector<KeyCache> fill_caches(const Scenario& s, CacheLayout layout = CacheLayout::split, int64_t stride = 0) {
  std::vector<KeyCache> caches;
  for (int64_t rank = 0; rank < s.config.world; ++rank) {
    KeyCache c(s.num_blocks, s.config.block_size, layout, stride);
    for (size_t r = 0; r < s.keys.size(); ++r) {
      std::vector<int64_t> slots;
      for (int64_t p = 0; p < s.chunk.seq_lens[r]; ++p)
        slots.push_back(dcp_slot(s.chunk.block_table[r], p, s.config.block_size, s.config.world, rank,
                                 s.config.interleave));
      write_keys(c, s.keys[r], slots);
    }
    caches.push_back(std::move(c));
  }
  return caches;
}

KeyBytes quantised(const Scenario& s, int64_t r, int64_t p) {
  return quantise_key(std::span<const double>(s.keys[r]).subspan(p * kHeadDim, kHeadDim));
}

IndexQuery random_query(int64_t rows, int64_t heads, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0.0, 1.0);
  std::uniform_real_distribution<double> u(0.1, 1.0);
  IndexQuery q;
  q.heads = heads;
  q.q.resize(static_cast<size_t>(rows * heads * kHeadDim));
  q.w.resize(static_cast<size_t>(rows * heads));
  for (double& v : q.q) v = n(rng);
  for (double& v : q.w) v = u(rng);
  return q;
}

// The top-k computed straight from the original keys, with no cache, packing or staging: each key
// through quantise_key / dequantise_key, scores summed in the reference's order, sorted by
// (score descending, position ascending).
std::vector<int32_t> direct_topk(const Scenario& s, const IndexQuery& q, int64_t k, double weight_scale = 1.0) {
  std::vector<int32_t> out;
  const int64_t H = q.heads;
  int64_t row = 0;
  for (size_t r = 0; r < s.keys.size(); ++r) {
    const int64_t len = s.chunk.seq_lens[r], nq = s.chunk.query_lens[r];
    for (int64_t j = 0; j < nq; ++j, ++row) {
      const int64_t pos = len - nq + j;
      std::vector<std::pair<double, int32_t>> scored;
      for (int64_t t = 0; t <= pos; ++t) {
        const auto key = dequantise_key(quantised(s, static_cast<int64_t>(r), t));
        double sum = 0;
        for (int64_t h = 0; h < H; ++h) {
          double dot = 0;
          for (int64_t d = 0; d < kHeadDim; ++d) dot += q.q[(row * H + h) * kHeadDim + d] * key[d];
          sum += q.w[row * H + h] * std::max(dot, 0.0);
        }
        scored.push_back({weight_scale * sum, static_cast<int32_t>(t)});
      }
      std::sort(scored.begin(), scored.end(), [](const auto& a, const auto& b) {
        return a.first > b.first || (a.first == b.first && a.second < b.second);
      });
      for (int64_t i = 0; i < k; ++i) out.push_back(i < static_cast<int64_t>(scored.size()) ? scored[i].second : -1);
    }
  }
  return out;
}

// ---- DCP placement -----------------------------------------------------------------------------------

TEST(IndexerDcp, OwnerLocalIndexAndLocalLengthAgreeWithEnumeration) {
  for (int64_t W : {1, 2, 3, 4, 8})
    for (int64_t I : {1, 2, 4, 16})
      for (int64_t len : {1, 2, 7, 31, 64, 65, 100, 129}) {
        std::vector<int64_t> count(W, 0);
        for (int64_t p = 0; p < len; ++p) {
          const int64_t q = dcp_owner(p, W, I);
          ASSERT_EQ(q, (p / I) % W);
          // Positions a rank owns get local indices 0, 1, 2, ... in position order.
          ASSERT_EQ(dcp_local_index(p, W, I), count[q]) << "W " << W << " I " << I << " p " << p;
          ++count[q];
        }
        for (int64_t q = 0; q < W; ++q) ASSERT_EQ(dcp_local_len(len, W, q, I), count[q]) << W << " " << I << " " << len;
      }
}

TEST(IndexerDcp, SlotMappingIsTheLocalIndexInTheBlockTable) {
  const std::vector<int32_t> row = {7, 3, 9, 12};
  for (int64_t W : {1, 2, 4})
    for (int64_t I : {1, 4, 16})
      for (int64_t rank = 0; rank < W; ++rank)
        for (int64_t p = 0; p < 16 * W * 3; ++p) {
          const int64_t slot = dcp_slot(row, p, 16, W, rank, I);
          if (dcp_owner(p, W, I) != rank) {
            EXPECT_EQ(slot, -1);
            continue;
          }
          const int64_t j = dcp_local_index(p, W, I);
          EXPECT_EQ(slot, row[j / 16] * 16 + j % 16) << W << " " << I << " " << rank << " " << p;
        }
  // Worked example: W 2, I 4, block 16: position 21 is run 5 (21 / 4), owned by rank 1; virtual offset
  // 21 of a 32-token virtual block; local offset (21 / 8) * 4 + 21 % 4 = 9 in block row[0] = 7: slot 121.
  EXPECT_EQ(dcp_slot(row, 21, 16, 2, 1, 4), 7 * 16 + 9);
  EXPECT_EQ(dcp_slot(row, 21, 16, 2, 0, 4), -1);
  test::expect_error([&] { dcp_slot(row, 16 * 4, 16, 1, 0, 1); }, Errc::input, {"position 64", "entry 4", "has 4"});
  test::expect_error([&] { dcp_slot(row, 3, 16, 2, 2, 1); }, Errc::input, {"rank 2 of world 2"});
}

// ---- Geometry and refusals ---------------------------------------------------------------------------

TEST(IndexerGeometry, OffsetsAndRows) {
  PrefillConfig c{1000, 8, 2, 2, 16};
  PrefillChunk ch{{5, 1, 9}, {2, 1, 9}, {{1}, {2}, {3}}};
  const ChunkGeometry g = plan_chunk(ch, c);
  EXPECT_EQ(g.total_keys, 15);
  EXPECT_EQ(g.num_rows, 12);
  EXPECT_EQ(g.cu, (std::vector<int64_t>{0, 5, 6, 15}));
  EXPECT_EQ(g.row_cu, (std::vector<int64_t>{0, 2, 3, 12}));
  // W 2, I 2: len 5 -> runs [0,1] r0, [2,3] r1, [4] r0: 3 / 2; len 1 -> 1 / 0; len 9 -> r0 0,1,4,5,8; r1 2,3,6,7.
  EXPECT_EQ(g.local_lens[0], (std::vector<int64_t>{3, 1, 5}));
  EXPECT_EQ(g.local_lens[1], (std::vector<int64_t>{2, 0, 4}));
  EXPECT_EQ(g.local_cu[0], (std::vector<int64_t>{0, 3, 4, 9}));
  EXPECT_EQ(g.local_cu[1], (std::vector<int64_t>{0, 2, 2, 6}));
  EXPECT_EQ(g.max_local, 9);
  EXPECT_EQ(g.pages(), 1);
  // Rows: request 0's last two positions (3, 4), request 1's only one (0), all nine of request 2.
  EXPECT_EQ(g.row_request, (std::vector<int32_t>{0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 2}));
  EXPECT_EQ(g.row_position, (std::vector<int64_t>{3, 4, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8}));
  EXPECT_EQ(g.key_request[4], 0);
  EXPECT_EQ(g.key_request[5], 1);
  EXPECT_EQ(g.key_request[6], 2);
}

TEST(IndexerGeometry, BadGeometryIsRefusedWithAClearMessage) {
  const PrefillChunk ok{{100, 50}, {4, 4}, {{1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11}}};
  const PrefillConfig c{200, 4, 1, 1, 16};
  EXPECT_NO_THROW(plan_chunk(ok, c));
  // Keys beyond the workspace.
  test::expect_error([&] { plan_chunk(ok, PrefillConfig{149, 4, 1, 1, 16}); }, Errc::input,
                     {"150 keys", "beyond the workspace's 149", "indexer.max_keys_per_chunk"});
  // More requests than the workspace.
  test::expect_error([&] { plan_chunk(ok, PrefillConfig{200, 1, 1, 1, 16}); }, Errc::input,
                     {"2 requests", "indexer.max_requests 1"});
  // Interleave not dividing the block size.
  test::expect_error([&] { plan_chunk(ok, PrefillConfig{200, 4, 2, 3, 16}); }, Errc::input,
                     {"dcp interleave 3 does not divide the cache block size 16", "valid: 1, 2, 4, 8, 16"});
  test::expect_error([&] { plan_chunk(ok, PrefillConfig{200, 4, 0, 1, 16}); }, Errc::input, {"world 0"});
  // Shapes of the chunk.
  test::expect_error([&] { plan_chunk(PrefillChunk{}, c); }, Errc::input, {"no requests"});
  test::expect_error([&] { plan_chunk(PrefillChunk{{10}, {11}, {{1}}}, c); }, Errc::input,
                     {"request 0 has query_len 11", "0..seq_len 10"});
  test::expect_error([&] { plan_chunk(PrefillChunk{{0}, {0}, {{1}}}, c); }, Errc::input, {"request 0 has seq_len 0"});
  test::expect_error([&] { plan_chunk(PrefillChunk{{10, 10}, {1}, {{1}, {2}}}, c); }, Errc::input,
                     {"2 seq_lens, 1 query_lens and 2 block-table rows"});
  // Block table too short: 100 keys in 16-token blocks need 7 entries at world 1 ...
  test::expect_error([&] { plan_chunk(PrefillChunk{{100}, {1}, {{1, 2, 3, 4, 5, 6}}}, c); }, Errc::input,
                     {"request 0 has 6 block-table entries, its 100 keys need 7"});
  // ... and 4 at world 2 (each rank holds 50).
  EXPECT_NO_THROW(plan_chunk(PrefillChunk{{100}, {1}, {{1, 2, 3, 4}}}, PrefillConfig{200, 4, 2, 1, 16}));
  test::expect_error([&] { plan_chunk(PrefillChunk{{100}, {1}, {{1, -2, 3, 4}}}, PrefillConfig{200, 4, 2, 1, 16}); },
                     Errc::input, {"entry 1 is -2"});
}

// The workspace's per-rank bound holds at its worst: every request a single interleave run, so one rank
// holds all of them.
TEST(IndexerGeometry, RankShareStaysWithinTheWorkspaceBound) {
  PrefillConfig c{64, 8, 4, 8, 16};
  PrefillChunk ch;
  for (int i = 0; i < 8; ++i) {
    ch.seq_lens.push_back(8);
    ch.query_lens.push_back(1);
    ch.block_table.push_back({i + 1});
  }
  const ChunkGeometry g = plan_chunk(ch, c);
  EXPECT_EQ(g.local_cu[0].back(), 64);  // all 64 keys on rank 0
  EXPECT_EQ(g.max_local, 64);
  EXPECT_LE(g.max_local, local_keys_bound(64, 8, 4, 8));  // 16 + 8 * 8 = 80
}

// ---- Cache, pack, gather, stage ----------------------------------------------------------------------

TEST(IndexerCache, SplitAndPackedLayoutsPutTheBytesWhereDocumented) {
  KeyBytes key;
  for (int i = 0; i < kKeyBytes; ++i) key[i] = static_cast<uint8_t>(i + 1);
  {
    KeyCache c(3, 16, CacheLayout::split, 2000);  // a merged page: stride above 16 * 68 = 1088
    c.write(2 * 16 + 5, key);                      // block 2, offset 5
    for (int i = 0; i < 64; ++i) EXPECT_EQ(c.bytes[2 * 2000 + 5 * 64 + i], i + 1);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(c.bytes[2 * 2000 + 16 * 64 + 5 * 4 + i], 65 + i);
    EXPECT_EQ(c.read(37), key);
    EXPECT_EQ(std::count(c.bytes.begin(), c.bytes.end(), 0), static_cast<long>(c.bytes.size()) - 68);
  }
  {
    KeyCache c(3, 16, CacheLayout::packed);
    c.write(16 + 2, key);
    for (int i = 0; i < 68; ++i) EXPECT_EQ(c.bytes[16 * 68 + 2 * 68 + i], i + 1);
    EXPECT_EQ(c.read(18), key);
  }
  test::expect_error([] { KeyCache(2, 16, CacheLayout::split, 1000); }, Errc::input,
                     {"block stride 1000", "16 x 68 bytes = 1088"});
  KeyCache c(2, 16);
  test::expect_error([&] { c.read(32); }, Errc::input, {"slot 32 is outside the cache", "valid: 0..31"});
  test::expect_error([&] { write_keys(c, std::vector<double>(128, 1.0), std::vector<int64_t>{40}); }, Errc::input,
                     {"slot 40"});
  test::expect_error([&] { write_keys(c, std::vector<double>(100, 1.0), std::vector<int64_t>{1}); }, Errc::input,
                     {"100 values for 1 slots"});
  // PAD_SLOT_ID writes nothing.
  write_keys(c, std::vector<double>(128, 1.0), std::vector<int64_t>{-1});
  EXPECT_EQ(std::count(c.bytes.begin(), c.bytes.end(), 0), static_cast<long>(c.bytes.size()));
}

TEST(IndexerPack, WorldOneRowsAreTheKeysInRequestOrder) {
  const Scenario s = make_scenario({7, 64, 1, 130}, {7, 1, 1, 3}, 1, 1, 16, 1);
  const auto caches = fill_caches(s);
  const ChunkGeometry g = plan_chunk(s.chunk, s.config);
  const std::vector<uint8_t> packed = pack_keys(caches[0], s.chunk, g, 0);
  ASSERT_EQ(packed.size(), static_cast<size_t>(g.total_keys * 68));
  for (int64_t r = 0; r < 4; ++r)
    for (int64_t p = 0; p < s.chunk.seq_lens[r]; ++p) {
      const KeyBytes want = quantised(s, r, p);
      ASSERT_TRUE(std::equal(want.begin(), want.end(), packed.begin() + (g.cu[r] + p) * 68)) << r << " " << p;
    }
}

TEST(IndexerPack, EachRankPacksItsOwnKeysInPositionOrder) {
  const Scenario s = make_scenario({7, 64, 1, 130, 33}, {1, 1, 1, 1, 1}, 3, 4, 16, 2);
  const auto caches = fill_caches(s);
  const ChunkGeometry g = plan_chunk(s.chunk, s.config);
  for (int64_t rank = 0; rank < 3; ++rank) {
    const std::vector<uint8_t> packed = pack_keys(caches[rank], s.chunk, g, rank);
    ASSERT_EQ(packed.size(), static_cast<size_t>(g.max_local * 68));
    for (int64_t r = 0; r < 5; ++r) {
      int64_t j = 0;
      for (int64_t p = 0; p < s.chunk.seq_lens[r]; ++p) {
        if ((p / 4) % 3 != rank) continue;
        const KeyBytes want = quantised(s, r, p);
        ASSERT_TRUE(std::equal(want.begin(), want.end(), packed.begin() + (g.local_cu[rank][r] + j) * 68))
            << "rank " << rank << " request " << r << " position " << p;
        ++j;
      }
      EXPECT_EQ(j, g.local_lens[rank][r]);
    }
    // Rows past the rank's own keys are zero.
    EXPECT_TRUE(std::all_of(packed.begin() + g.local_cu[rank].back() * 68, packed.end(),
                            [](uint8_t b) { return b == 0; }));
  }
}

// Staging restores global order for every world and interleave; the staged bytes do not depend on the
// cache layout or on the world size.
TEST(IndexerStage, GlobalOrderFromEveryRank) {
  struct Case {
    int64_t world, interleave;
  };
  const std::vector<int64_t> lens = {1, 7, 63, 64, 65, 129, 200};
  std::vector<uint8_t> payload1, scales1;
  for (const Case& c : {Case{1, 1}, Case{2, 1}, Case{2, 4}, Case{3, 2}, Case{4, 16}, Case{8, 1}})
    for (CacheLayout layout : {CacheLayout::split, CacheLayout::packed}) {
      const Scenario s = make_scenario(lens, std::vector<int64_t>(lens.size(), 1), c.world, c.interleave, 16, 3);
      const auto caches = fill_caches(s, layout);
      const ChunkGeometry g = plan_chunk(s.chunk, s.config);
      std::vector<std::vector<uint8_t>> packed;
      for (int64_t rank = 0; rank < c.world; ++rank) packed.push_back(pack_keys(caches[rank], s.chunk, g, rank));
      const StagedKeys st = stage_keys(all_gather(packed, g), g);
      const int64_t total = 1 + 7 + 63 + 64 + 65 + 129 + 200;  // 529 keys: 8 full pages and 17 keys
      ASSERT_EQ(st.keys, total);
      ASSERT_EQ(st.pages, 9);
      ASSERT_EQ(st.payload.size(), static_cast<size_t>(9 * 1 * 4 * 64 * 16));  // [pages, 1, 4, 64, 16]
      ASSERT_EQ(st.scales.size(), static_cast<size_t>(9 * 1 * 4 * 64));       // [pages, 1, 4, 64]
      for (int64_t r = 0; r < static_cast<int64_t>(lens.size()); ++r)
        for (int64_t p = 0; p < lens[r]; ++p) {
          const int64_t t = g.cu[r] + p, page = t / 64, slot = t % 64;
          const KeyBytes want = quantised(s, r, p);
          ASSERT_EQ(st.key(t), want) << "W " << c.world << " I " << c.interleave << " key " << t;
          // The documented page layout, byte by byte.
          for (int64_t grp = 0; grp < 4; ++grp) {
            for (int64_t b = 0; b < 16; ++b)
              ASSERT_EQ(st.payload[((page * 4 + grp) * 64 + slot) * 16 + b], want[grp * 16 + b]);
            ASSERT_EQ(st.scales[(page * 4 + grp) * 64 + slot], want[64 + grp]);
          }
        }
      // Keys 529..575 of the last page are zero.
      for (int64_t slot = total % 64; slot < 64; ++slot)
        for (int64_t grp = 0; grp < 4; ++grp) {
          ASSERT_EQ(st.scales[(8 * 4 + grp) * 64 + slot], 0);
          for (int64_t b = 0; b < 16; ++b) ASSERT_EQ(st.payload[((8 * 4 + grp) * 64 + slot) * 16 + b], 0);
        }
      if (payload1.empty()) payload1 = st.payload, scales1 = st.scales;
      EXPECT_EQ(st.payload, payload1);
      EXPECT_EQ(st.scales, scales1);
    }
}

TEST(IndexerStage, WrongBufferSizesAreRefused) {
  const Scenario s = make_scenario({10, 20}, {1, 1}, 2, 2, 16, 4);
  const auto caches = fill_caches(s);
  const ChunkGeometry g = plan_chunk(s.chunk, s.config);
  std::vector<std::vector<uint8_t>> packed = {pack_keys(caches[0], s.chunk, g, 0)};
  test::expect_error([&] { all_gather(packed, g); }, Errc::input, {"1 ranks' buffers, DCP world is 2"});
  packed.push_back(std::vector<uint8_t>(5));
  test::expect_error([&] { all_gather(packed, g); }, Errc::input, {"rank 1 sent 5 bytes"});
  test::expect_error([&] { stage_keys(std::vector<uint8_t>(68), g); }, Errc::input, {"68 gathered bytes"});
  test::expect_error([&] { pack_keys(caches[0], s.chunk, g, 2); }, Errc::input, {"rank 2", "DCP world 2"});
  KeyCache other(s.num_blocks, 32);
  test::expect_error([&] { pack_keys(other, s.chunk, g, 0); }, Errc::input, {"32-token blocks", "planned for 16"});
  KeyCache small(1, 16);
  test::expect_error([&] { pack_keys(small, s.chunk, g, 0); }, Errc::input, {"cache has 1 blocks"});
  PrefillChunk changed = s.chunk;
  changed.seq_lens[0] = 11;
  test::expect_error([&] { pack_keys(caches[0], changed, g, 0); }, Errc::input,
                     {"request 0 has seq_len 11, it was planned with 10"});
}

// ---- Scoring and top-k -------------------------------------------------------------------------------

TEST(IndexerScore, ClosedFormTwoHeadsCausal) {
  // Keys with only dims 0 and 1 set, each exactly representable (checked below): key t = (a_t, b_t, 0...).
  const std::vector<double> a = {1.0, -2.0, 0.5, 4.0, 3.0, -0.5};
  const std::vector<double> b = {-1.0, 2.0, 0.0, -0.5, -3.0, 1.0};
  Scenario s;
  s.config = {64, 4, 1, 1, 16};
  s.chunk = {{6}, {3}, {{1}}};
  s.num_blocks = 2;
  s.keys.assign(1, std::vector<double>(6 * 128, 0.0));
  for (int t = 0; t < 6; ++t) s.keys[0][t * 128] = a[t], s.keys[0][t * 128 + 1] = b[t];
  for (int t = 0; t < 6; ++t) {
    const auto back = dequantise_key(quantised(s, 0, t));
    ASSERT_EQ(back[0], a[t]);
    ASSERT_EQ(back[1], b[t]);
  }
  // Two heads: q_0 = e_0, q_1 = -2 e_1; w = (1.5, 0.25), the same for the three rows.
  IndexQuery q;
  q.heads = 2;
  q.q.assign(3 * 2 * 128, 0.0);
  q.w.assign(3 * 2, 0.0);
  for (int row = 0; row < 3; ++row) {
    q.q[(row * 2 + 0) * 128 + 0] = 1.0;
    q.q[(row * 2 + 1) * 128 + 1] = -2.0;
    q.w[row * 2] = 1.5, q.w[row * 2 + 1] = 0.25;
  }
  // logit_t = 1.5 * relu(a_t) + 0.25 * relu(-2 b_t):
  //   t0: 1.5 + 0.5 = 2.0; t1: 0 + 0 = 0; t2: 0.75 + 0 = 0.75; t3: 6 + 0.25 = 6.25; t4: 4.5 + 1.5 = 6.0; t5: 0 + 0 = 0.
  const std::vector<double> want = {2.0, 0.0, 0.75, 6.25, 6.0, 0.0};
  const auto caches = fill_caches(s);
  const ChunkGeometry g = plan_chunk(s.chunk, s.config);
  const StagedKeys st = stage_keys(pack_keys(caches[0], s.chunk, g, 0), g);
  // Rows are positions 3, 4, 5 (the last three of six keys): 4, 5 and 6 visible keys.
  for (int row = 0; row < 3; ++row) {
    const std::vector<double> got = score_row(st, g, q, row);
    ASSERT_EQ(got.size(), static_cast<size_t>(4 + row));
    for (int t = 0; t <= 3 + row; ++t) EXPECT_EQ(got[t], want[t]) << row << " " << t;
  }
  EXPECT_EQ(score_row(st, g, q, 2, 0.5)[3], 3.125);  // weight_scale multiplies the sum
  // Top-3 of row 0 (positions 0..3): 6.25 (3), 2.0 (0), 0.75 (2). Row 2: 6.25, 6.0, 2.0.
  EXPECT_EQ(topk_rows(st, g, q, 3, 0, 3),
            (std::vector<int32_t>{3, 0, 2, 3, 4, 0, 3, 4, 0}));
  // k above the visible keys: the zeros tie, lower position first, then -1.
  EXPECT_EQ(topk_rows(st, g, q, 8, 2, 3), (std::vector<int32_t>{3, 4, 0, 2, 1, 5, -1, -1}));
}

TEST(IndexerTopk, TiesGoToTheLowerPositionAndShortRowsArePadded) {
  const std::vector<double> l = {1, 3, 3, 2, 3, -1, 0};
  EXPECT_EQ(select_topk(l, 3), (std::vector<int32_t>{1, 2, 4}));
  EXPECT_EQ(select_topk(l, 1), (std::vector<int32_t>{1}));
  EXPECT_EQ(select_topk(l, 9), (std::vector<int32_t>{1, 2, 4, 3, 0, 6, 5, -1, -1}));
  EXPECT_EQ(select_topk(std::vector<double>{}, 2), (std::vector<int32_t>{-1, -1}));
  test::expect_error([] { select_topk(std::vector<double>{1.0}, 0); }, Errc::input, {"k 0 is out of range"});
  test::expect_error([] { select_topk(std::vector<double>{1.0, std::nan("")}, 1); }, Errc::input, {"logit 1 is NaN"});
}

// ---- Whole chunks, every world -----------------------------------------------------------------------

struct E2E {
  const char* name;
  std::vector<int64_t> lens, queries;
  int64_t k;
};

std::vector<E2E> e2e_cases() {
  std::vector<E2E> out = {
      {"one request, one key", {1}, {1}, 4},
      {"one request, odd length", {77}, {77}, 16},
      {"one request, long, few rows", {300}, {5}, 64},
      {"keys a multiple of 64", {64, 128}, {64, 3}, 32},
      {"odd lengths", {1, 7, 63, 65, 129}, {1, 7, 2, 65, 9}, 20},
      {"context without queries", {40, 50, 3}, {0, 50, 0}, 10},
  };
  // Many requests of random odd and even lengths.
  std::mt19937_64 rng(99);
  E2E many{"many requests", {}, {}, 24};
  for (int i = 0; i < 23; ++i) {
    const int64_t len = 1 + static_cast<int64_t>(rng() % 90);
    many.lens.push_back(len);
    many.queries.push_back(1 + static_cast<int64_t>(rng() % len));
  }
  out.push_back(many);
  return out;
}

TEST(IndexerPrefill, EveryWorldAndInterleaveSelectsWhatTheKeysSay) {
  struct Dcp {
    int64_t world, interleave;
  };
  const std::vector<Dcp> dcps = {{1, 1}, {2, 1}, {2, 8}, {3, 2}, {4, 16}, {8, 4}};
  for (const E2E& e : e2e_cases()) {
    const int64_t rows = std::accumulate(e.queries.begin(), e.queries.end(), int64_t{0});
    const IndexQuery q = random_query(rows, 3, 17);
    std::vector<int32_t> direct;
    for (const Dcp& d : dcps) {
      const Scenario s = make_scenario(e.lens, e.queries, d.world, d.interleave, 16, 5);
      if (direct.empty()) direct = direct_topk(s, q, e.k);
      const auto caches = fill_caches(s);
      const std::vector<int32_t> got = prefill_topk(caches, s.chunk, s.config, q, e.k);
      EXPECT_EQ(got, direct) << e.name << " at world " << d.world << " interleave " << d.interleave;
      // Query ranges (long prefills scored in pieces) change nothing, also with ragged shares.
      std::vector<QueryRange> ranges;
      for (int64_t b = 0; b < rows; b += 5) ranges.push_back({b, std::min(rows, b + 5)});
      EXPECT_EQ(prefill_topk(caches, s.chunk, s.config, q, e.k, ranges), direct)
          << e.name << " in ranges of 5 at world " << d.world << " interleave " << d.interleave;
    }
  }
}

TEST(IndexerPrefill, WorkspaceLimitsAreEnforced) {
  const Scenario s = make_scenario({100, 50}, {1, 1}, 2, 4, 16, 6);
  const auto caches = fill_caches(s);
  const IndexQuery q = random_query(2, 1, 1);
  PrefillConfig c = s.config;
  c.max_keys = 149;
  test::expect_error([&] { prefill_topk(caches, s.chunk, c, q, 8); }, Errc::input,
                     {"150 keys", "beyond the workspace's 149"});
  test::expect_error([&] { prefill_topk(std::span(caches).first(1), s.chunk, s.config, q, 8); }, Errc::input,
                     {"1 caches", "one per DCP rank (2)"});
  IndexQuery bad = q;
  bad.w.pop_back();
  test::expect_error([&] { prefill_topk(caches, s.chunk, s.config, bad, 8); }, Errc::input,
                     {"w 1", "[2, 1] = 2"});
}

// ---- Exchange ----------------------------------------------------------------------------------------

TEST(IndexerExchange, RowsGoBackInRankMajorShares) {
  // 7 rows, world 3, k 1, ranges [0, 4) and [4, 7): shares ceil(4 / 3) = 2 and ceil(3 / 3) = 1, so each
  // rank sends 3 rows. Rank q's row i holds 10 * q + i.
  PrefillConfig c{100, 4, 3, 1, 16};
  const ChunkGeometry g = plan_chunk(PrefillChunk{{7}, {7}, {{1}}}, c);
  const std::vector<QueryRange> ranges = {{0, 4}, {4, 7}};
  EXPECT_EQ(rank_share(4, 3), 2);
  EXPECT_EQ(rank_share(3, 3), 1);
  std::vector<std::vector<int32_t>> mine = {{0, 1, 2}, {10, 11, 12}, {20, 21, 22}};
  // Range 0: rows 0, 1 <- rank 0 rows 0, 1; rows 2, 3 <- rank 1 rows 0, 1; rank 2's share (rows 4, 5 of
  // the range) is past its end. Range 1 (offset 2): row 4 <- rank 0 row 2, 5 <- rank 1 row 2, 6 <- rank 2 row 2.
  EXPECT_EQ(exchange(mine, g, 1, ranges), (std::vector<int32_t>{0, 1, 10, 11, 2, 12, 22}));
  // Rows outside every range stay -1.
  const std::vector<QueryRange> part = {{1, 3}};
  std::vector<std::vector<int32_t>> one = {{5}, {6}, {7}};
  EXPECT_EQ(exchange(one, g, 1, part), (std::vector<int32_t>{-1, 5, 6, -1, -1, -1, -1}));
  test::expect_error([&] { exchange(std::vector<std::vector<int32_t>>{{0, 1}}, g, 1, ranges); }, Errc::input,
                     {"1 ranks' selections, DCP world is 3"});
  test::expect_error([&] { exchange(mine, g, 1, std::vector<QueryRange>{{0, 8}}); }, Errc::input,
                     {"rows [0, 8)", "7 rows"});
}

TEST(IndexerExchange, RankBuffersHoldTheirShareAndPadWithMinusOne) {
  const Scenario s = make_scenario({9, 4}, {9, 2}, 4, 1, 16, 8);  // 11 rows over 4 ranks: share 3
  const auto caches = fill_caches(s);
  const ChunkGeometry g = plan_chunk(s.chunk, s.config);
  std::vector<std::vector<uint8_t>> packed;
  for (int64_t rank = 0; rank < 4; ++rank) packed.push_back(pack_keys(caches[rank], s.chunk, g, rank));
  const StagedKeys st = stage_keys(all_gather(packed, g), g);
  const IndexQuery q = random_query(11, 2, 9);
  const QueryRange all{0, 11};
  const std::vector<int32_t> direct = topk_rows(st, g, q, 5, 0, 11);
  for (int64_t rank = 0; rank < 4; ++rank) {
    const std::vector<int32_t> mine = rank_topk(st, g, q, 5, {&all, 1}, rank);
    ASSERT_EQ(mine.size(), 3u * 5);
    for (int64_t i = 0; i < 3; ++i) {
      const int64_t row = rank * 3 + i;
      for (int64_t j = 0; j < 5; ++j)
        EXPECT_EQ(mine[i * 5 + j], row < 11 ? direct[row * 5 + j] : -1) << rank << " " << i << " " << j;
    }
  }
}

}  // namespace
}  // namespace dp::indexer
