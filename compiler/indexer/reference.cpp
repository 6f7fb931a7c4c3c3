#include "indexer/reference.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "common/error.h"

namespace dp::indexer {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

// Byte offsets of a slot's payload (64 bytes) and scales (4 bytes) inside the cache.
struct SlotBytes {
  size_t payload, scales;
};

SlotBytes locate(const KeyCache& c, int64_t slot) {
  if (slot < 0 || slot >= c.slots())
    fail(Errc::input, "index-key cache: slot {} is outside the cache (valid: 0..{}, {} blocks of {} tokens)", slot,
         c.slots() - 1, c.num_blocks, c.block_size);
  const int64_t block = slot / c.block_size, off = slot % c.block_size, base = block * c.block_stride;
  if (c.layout == CacheLayout::packed)
    return {static_cast<size_t>(base + off * kKeyBytes), static_cast<size_t>(base + off * kKeyBytes + kPayloadBytes)};
  return {static_cast<size_t>(base + off * kPayloadBytes),
          static_cast<size_t>(base + c.block_size * kPayloadBytes + off * kGroups)};
}

void check_query(const ChunkGeometry& g, const IndexQuery& query) {
  if (query.heads < 1) fail(Errc::input, "indexer query: {} heads, expected at least 1", query.heads);
  const auto rows = static_cast<size_t>(g.num_rows), heads = static_cast<size_t>(query.heads);
  if (query.q.size() != rows * heads * kHeadDim || query.w.size() != rows * heads)
    fail(Errc::input,
         "indexer query: q has {} values and w {}, expected [{} rows, {} heads, {}] = {} and [{}, {}] = {}",
         query.q.size(), query.w.size(), rows, heads, kHeadDim, rows * heads * kHeadDim, rows, heads, rows * heads);
}

void check_k(int64_t k) {
  if (k < 1 || k > std::numeric_limits<int32_t>::max())
    fail(Errc::input, "indexer top-k: k {} is out of range (valid: 1..{})", k, std::numeric_limits<int32_t>::max());
}

void check_ranges(const ChunkGeometry& g, std::span<const QueryRange> ranges) {
  for (size_t i = 0; i < ranges.size(); ++i)
    if (ranges[i].begin < 0 || ranges[i].begin > ranges[i].end || ranges[i].end > g.num_rows)
      fail(Errc::input, "indexer query range {}: rows [{}, {}) are not within the chunk's {} rows", i,
           ranges[i].begin, ranges[i].end, g.num_rows);
}

// Every staged key dequantised once: [keys, 128].
std::vector<double> dequantise_all(const StagedKeys& keys) {
  std::vector<double> out(static_cast<size_t>(keys.keys * kHeadDim));
  for (int64_t t = 0; t < keys.keys; ++t) {
    const KeyBytes b = keys.key(t);
    const auto v = dequantise_key(b);
    std::copy(v.begin(), v.end(), out.begin() + t * kHeadDim);
  }
  return out;
}

std::vector<double> score(std::span<const double> kd, const ChunkGeometry& g, const IndexQuery& query, int64_t row,
                          double weight_scale) {
  if (row < 0 || row >= g.num_rows)
    fail(Errc::input, "indexer score: row {} is outside the chunk's {} rows", row, g.num_rows);
  const int64_t r = g.row_request[row], pos = g.row_position[row], H = query.heads;
  std::vector<double> logits(static_cast<size_t>(pos + 1));
  for (int64_t t = 0; t <= pos; ++t) {
    const double* k = kd.data() + (g.cu[r] + t) * kHeadDim;
    double sum = 0;
    for (int64_t h = 0; h < H; ++h) {
      const double* q = query.q.data() + (row * H + h) * kHeadDim;
      double dot = 0;
      for (int64_t d = 0; d < kHeadDim; ++d) dot += q[d] * k[d];
      sum += query.w[row * H + h] * std::max(dot, 0.0);
    }
    logits[t] = weight_scale * sum;
  }
  return logits;
}

void topk_into(std::span<const double> kd, const ChunkGeometry& g, const IndexQuery& query, int64_t k, int64_t row,
               double weight_scale, int32_t* out) {
  const std::vector<int32_t> sel = select_topk(score(kd, g, query, row, weight_scale), k);
  std::copy(sel.begin(), sel.end(), out);
}

}  // namespace

const char* to_string(CacheLayout l) { return l == CacheLayout::split ? "split" : "packed"; }

KeyCache::KeyCache(int64_t blocks, int64_t bs, CacheLayout l, int64_t stride)
    : num_blocks(blocks), block_size(bs), block_stride(stride ? stride : bs * kKeyBytes), layout(l) {
  if (num_blocks < 1 || block_size < 1)
    fail(Errc::input, "index-key cache: {} blocks of {} tokens, expected at least 1 of each", num_blocks, block_size);
  int64_t row_bytes, total;
  if (__builtin_mul_overflow(block_size, kKeyBytes, &row_bytes) ||
      __builtin_mul_overflow(num_blocks, std::max(block_stride, row_bytes), &total))
    fail(Errc::input, "index-key cache: {} blocks of {} tokens overflow 64 bits", num_blocks, block_size);
  if (block_stride < row_bytes)
    fail(Errc::input, "index-key cache: block stride {} bytes is below block_size {} x {} bytes = {}", block_stride,
         block_size, kKeyBytes, row_bytes);
  bytes.assign(static_cast<size_t>(total), 0);
}

KeyBytes KeyCache::read(int64_t slot) const {
  const SlotBytes at = locate(*this, slot);
  KeyBytes k;
  std::memcpy(k.data(), bytes.data() + at.payload, kPayloadBytes);
  std::memcpy(k.data() + kPayloadBytes, bytes.data() + at.scales, kGroups);
  return k;
}

void KeyCache::write(int64_t slot, const KeyBytes& key) {
  const SlotBytes at = locate(*this, slot);
  std::memcpy(bytes.data() + at.payload, key.data(), kPayloadBytes);
  std::memcpy(bytes.data() + at.scales, key.data() + kPayloadBytes, kGroups);
}

void write_keys(KeyCache& cache, std::span<const double> keys, std::span<const int64_t> slot_mapping) {
  if (keys.size() != slot_mapping.size() * kHeadDim)
    fail(Errc::input, "index-key write: {} values for {} slots, expected {} per key", keys.size(),
         slot_mapping.size(), kHeadDim);
  for (size_t t = 0; t < slot_mapping.size(); ++t) {
    if (slot_mapping[t] == -1) continue;
    cache.write(slot_mapping[t], quantise_key(keys.subspan(t * kHeadDim, kHeadDim)));
  }
}

std::vector<uint8_t> pack_keys(const KeyCache& cache, const PrefillChunk& chunk, const ChunkGeometry& g,
                               int64_t rank) {
  const PrefillConfig& c = g.config;
  if (rank < 0 || rank >= c.world)
    fail(Errc::input, "indexer pack: rank {} is not a rank of DCP world {} (valid: 0..{})", rank, c.world, c.world - 1);
  if (cache.block_size != c.block_size)
    fail(Errc::input, "indexer pack: rank {}'s cache has {}-token blocks, the chunk was planned for {}", rank,
         cache.block_size, c.block_size);
  if (static_cast<int64_t>(chunk.seq_lens.size()) != g.num_requests ||
      static_cast<int64_t>(chunk.block_table.size()) != g.num_requests)
    fail(Errc::input, "indexer pack: the chunk has {} requests, it was planned with {}", chunk.seq_lens.size(),
         g.num_requests);
  std::vector<uint8_t> packed(static_cast<size_t>(g.max_local * kKeyBytes), 0);
  for (int64_t r = 0; r < g.num_requests; ++r) {
    if (chunk.seq_lens[r] != g.cu[r + 1] - g.cu[r])
      fail(Errc::input, "indexer pack: request {} has seq_len {}, it was planned with {}", r, chunk.seq_lens[r],
           g.cu[r + 1] - g.cu[r]);
    const auto& row = chunk.block_table[r];
    for (int64_t j = 0; j < g.local_lens[rank][r]; ++j) {
      if (j / c.block_size >= static_cast<int64_t>(row.size()))
        fail(Errc::input, "indexer pack: request {} has {} block-table entries, rank {} needs entry {}", r, row.size(),
             rank, j / c.block_size);
      const int32_t block = row[j / c.block_size];
      if (block >= cache.num_blocks)
        fail(Errc::input, "indexer pack: request {} block-table entry {} is block {}, rank {}'s cache has {} blocks", r,
             j / c.block_size, block, rank, cache.num_blocks);
      const KeyBytes k = cache.read(static_cast<int64_t>(block) * c.block_size + j % c.block_size);
      std::memcpy(packed.data() + (g.local_cu[rank][r] + j) * kKeyBytes, k.data(), kKeyBytes);
    }
  }
  return packed;
}

std::vector<uint8_t> all_gather(std::span<const std::vector<uint8_t>> packed, const ChunkGeometry& g) {
  const int64_t W = g.config.world;
  if (static_cast<int64_t>(packed.size()) != W)
    fail(Errc::input, "indexer all-gather: {} ranks' buffers, DCP world is {}", packed.size(), W);
  std::vector<uint8_t> out;
  out.reserve(static_cast<size_t>(W * g.max_local * kKeyBytes));
  for (int64_t q = 0; q < W; ++q) {
    if (static_cast<int64_t>(packed[q].size()) != g.max_local * kKeyBytes)
      fail(Errc::input, "indexer all-gather: rank {} sent {} bytes, expected [{} rows, {}] = {}", q, packed[q].size(),
           g.max_local, kKeyBytes, g.max_local * kKeyBytes);
    out.insert(out.end(), packed[q].begin(), packed[q].end());
  }
  return out;
}

KeyBytes StagedKeys::key(int64_t t) const {
  if (t < 0 || t >= keys) fail(Errc::input, "staged keys: key {} is outside the {} staged keys", t, keys);
  const int64_t page = t / kPageKeys, slot = t % kPageKeys;
  KeyBytes k;
  for (int64_t c = 0; c < kGroups; ++c) {
    std::memcpy(k.data() + c * kGroupBytes, payload.data() + ((page * kGroups + c) * kPageKeys + slot) * kGroupBytes,
                kGroupBytes);
    k[kPayloadBytes + c] = scales[(page * kGroups + c) * kPageKeys + slot];
  }
  return k;
}

StagedKeys stage_keys(std::span<const uint8_t> gathered, const ChunkGeometry& g) {
  const int64_t W = g.config.world, I = g.config.interleave;
  if (static_cast<int64_t>(gathered.size()) != W * g.max_local * kKeyBytes)
    fail(Errc::input, "indexer stage: {} gathered bytes, expected [{} ranks x {} rows, {}] = {}", gathered.size(), W,
         g.max_local, kKeyBytes, W * g.max_local * kKeyBytes);
  StagedKeys s;
  s.keys = g.total_keys;
  s.pages = g.pages();
  s.payload.assign(static_cast<size_t>(s.pages * kGroups * kPageKeys * kGroupBytes), 0);
  s.scales.assign(static_cast<size_t>(s.pages * kGroups * kPageKeys), 0);
  for (int64_t t = 0; t < g.total_keys; ++t) {
    const int64_t r = g.key_request[t], p = t - g.cu[r];
    const int64_t owner = dcp_owner(p, W, I);
    const int64_t src = owner * g.max_local + g.local_cu[owner][r] + dcp_local_index(p, W, I);
    const uint8_t* row = gathered.data() + src * kKeyBytes;
    const int64_t page = t / kPageKeys, slot = t % kPageKeys;
    for (int64_t c = 0; c < kGroups; ++c) {
      std::memcpy(s.payload.data() + ((page * kGroups + c) * kPageKeys + slot) * kGroupBytes, row + c * kGroupBytes,
                  kGroupBytes);
      s.scales[(page * kGroups + c) * kPageKeys + slot] = row[kPayloadBytes + c];
    }
  }
  return s;
}

std::vector<double> score_row(const StagedKeys& keys, const ChunkGeometry& g, const IndexQuery& query, int64_t row,
                              double weight_scale) {
  check_query(g, query);
  if (keys.keys != g.total_keys)
    fail(Errc::input, "indexer score: {} staged keys, the chunk has {}", keys.keys, g.total_keys);
  return score(dequantise_all(keys), g, query, row, weight_scale);
}

std::vector<int32_t> select_topk(std::span<const double> logits, int64_t k) {
  check_k(k);
  if (logits.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    fail(Errc::input, "indexer top-k: {} logits, more than int32 positions", logits.size());
  for (size_t i = 0; i < logits.size(); ++i)
    if (std::isnan(logits[i])) fail(Errc::input, "indexer top-k: logit {} is NaN", i);
  std::vector<int32_t> idx(logits.size());
  std::iota(idx.begin(), idx.end(), 0);
  const size_t n = std::min(idx.size(), static_cast<size_t>(k));
  std::partial_sort(idx.begin(), idx.begin() + static_cast<std::ptrdiff_t>(n), idx.end(), [&](int32_t a, int32_t b) {
    return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
  });
  idx.resize(n);
  idx.resize(static_cast<size_t>(k), -1);
  return idx;
}

std::vector<int32_t> topk_rows(const StagedKeys& keys, const ChunkGeometry& g, const IndexQuery& query, int64_t k,
                               int64_t row_begin, int64_t row_end, double weight_scale) {
  check_query(g, query);
  check_k(k);
  const QueryRange range{row_begin, row_end};
  check_ranges(g, {&range, 1});
  if (keys.keys != g.total_keys)
    fail(Errc::input, "indexer top-k: {} staged keys, the chunk has {}", keys.keys, g.total_keys);
  const std::vector<double> kd = dequantise_all(keys);
  std::vector<int32_t> out(static_cast<size_t>((row_end - row_begin) * k));
  for (int64_t row = row_begin; row < row_end; ++row)
    topk_into(kd, g, query, k, row, weight_scale, out.data() + (row - row_begin) * k);
  return out;
}

int64_t rank_share(int64_t n, int64_t world) {
  if (n < 0 || world < 1) fail(Errc::input, "indexer row share: {} rows over world {}", n, world);
  return ceil_div(n, world);
}

std::vector<int32_t> rank_topk(const StagedKeys& keys, const ChunkGeometry& g, const IndexQuery& query, int64_t k,
                               std::span<const QueryRange> ranges, int64_t rank, double weight_scale) {
  check_query(g, query);
  check_k(k);
  check_ranges(g, ranges);
  const int64_t W = g.config.world;
  if (rank < 0 || rank >= W)
    fail(Errc::input, "indexer rank top-k: rank {} is not a rank of DCP world {} (valid: 0..{})", rank, W, W - 1);
  if (keys.keys != g.total_keys)
    fail(Errc::input, "indexer rank top-k: {} staged keys, the chunk has {}", keys.keys, g.total_keys);
  const std::vector<double> kd = dequantise_all(keys);
  std::vector<int32_t> out;
  for (const QueryRange& range : ranges) {
    const int64_t share = rank_share(range.end - range.begin, W);
    const size_t at = out.size();
    out.resize(at + static_cast<size_t>(share * k), -1);
    for (int64_t i = 0; i < share; ++i) {
      const int64_t row = range.begin + rank * share + i;
      if (row < range.end) topk_into(kd, g, query, k, row, weight_scale, out.data() + at + i * k);
    }
  }
  return out;
}

std::vector<int32_t> exchange(std::span<const std::vector<int32_t>> per_rank, const ChunkGeometry& g, int64_t k,
                              std::span<const QueryRange> ranges) {
  check_k(k);
  check_ranges(g, ranges);
  const int64_t W = g.config.world;
  int64_t mine = 0;  // rows each rank contributes
  for (const QueryRange& range : ranges) mine += rank_share(range.end - range.begin, W);
  if (static_cast<int64_t>(per_rank.size()) != W)
    fail(Errc::input, "indexer exchange: {} ranks' selections, DCP world is {}", per_rank.size(), W);
  for (int64_t q = 0; q < W; ++q)
    if (static_cast<int64_t>(per_rank[q].size()) != mine * k)
      fail(Errc::input, "indexer exchange: rank {} sent {} indices, expected [{} rows, {}] = {}", q,
           per_rank[q].size(), mine, k, mine * k);
  std::vector<int32_t> out(static_cast<size_t>(g.num_rows * k), -1);
  int64_t offset = 0;
  for (const QueryRange& range : ranges) {
    const int64_t n = range.end - range.begin, share = rank_share(n, W);
    for (int64_t q = 0; q < W; ++q)
      for (int64_t i = 0; i < share && q * share + i < n; ++i)
        std::copy_n(per_rank[q].begin() + (offset + i) * k, k, out.begin() + (range.begin + q * share + i) * k);
    offset += share;
  }
  return out;
}

std::vector<int32_t> prefill_topk(std::span<const KeyCache> caches, const PrefillChunk& chunk,
                                  const PrefillConfig& config, const IndexQuery& query, int64_t k,
                                  std::span<const QueryRange> ranges, double weight_scale) {
  const ChunkGeometry g = plan_chunk(chunk, config);
  check_query(g, query);
  check_k(k);
  const int64_t W = config.world;
  if (static_cast<int64_t>(caches.size()) != W)
    fail(Errc::input, "indexer prefill: {} caches, expected one per DCP rank ({})", caches.size(), W);
  std::vector<std::vector<uint8_t>> packed;
  for (int64_t q = 0; q < W; ++q) packed.push_back(pack_keys(caches[q], chunk, g, q));
  const StagedKeys staged = stage_keys(all_gather(packed, g), g);
  const QueryRange all{0, g.num_rows};
  if (ranges.empty()) ranges = {&all, 1};
  if (W == 1) {
    check_ranges(g, ranges);
    std::vector<int32_t> out(static_cast<size_t>(g.num_rows * k), -1);
    for (const QueryRange& range : ranges) {
      const std::vector<int32_t> sel = topk_rows(staged, g, query, k, range.begin, range.end, weight_scale);
      std::copy(sel.begin(), sel.end(), out.begin() + range.begin * k);
    }
    return out;
  }
  std::vector<std::vector<int32_t>> mine;
  for (int64_t q = 0; q < W; ++q) mine.push_back(rank_topk(staged, g, query, k, ranges, q, weight_scale));
  return exchange(mine, g, k, ranges);
}

}  // namespace dp::indexer
