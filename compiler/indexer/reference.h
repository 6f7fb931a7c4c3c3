// CPU reference of the FP4 indexer prefill (reference/seeds/004; model-family.md section 4): quantise
// index keys into the paged cache, pack a chunk's keys into compact 68-byte rows, stage them into
// 64-key pages in global order (all-gathered from every DCP rank), score query rows causally and select
// the top-k per row. Bytes and indices are exact; scores are float64. The GPU kernels match the bytes
// of every stage and the top-k sets (except exact score ties, where accumulation order decides).
//
// Pipeline for one chunk (geometry.h describes chunks, ranks and positions):
//   write_keys     keys [T, 128] -> MXFP4 -> cache slots (one KeyCache per rank; slot -1 skipped)
//   pack_keys      rank's cache + block table -> packed [max_local, 68]: row local_cu[rank][r] + j is
//                  local key j of request r; rows past the rank's total are zero
//   all_gather     every rank's packed rows, rank-major -> gathered [W * max_local, 68]
//   stage_keys     gathered -> StagedKeys in global key order (key g = cu[r] + position)
//   score_row      logits of one query row over positions 0..its own position of its request
//   select_topk    k positions per row, by descending score, ties to the lower position, -1 padded
//   rank_topk / exchange   under DCP each rank selects a share of every query range's rows, and one
//                  all-gather puts them back in row order (seed prefill_chunks)
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "indexer/geometry.h"
#include "indexer/key.h"

namespace dp::indexer {

// ---- Paged key cache ---------------------------------------------------------------------------------

// Where a token's 68 bytes sit inside a cache block of block_size tokens. model-family.md 4.2 leaves the
// FP4 page organisation unverified, so both are here:
//   split:  the block's payload rows first (block_size x 64 bytes), then its scale rows
//           (block_size x 4 bytes): the FP8 indexer cache's organisation;
//   packed: one 68-byte row per token (payload, then its 4 scales).
enum class CacheLayout { split, packed };
const char* to_string(CacheLayout l);

// One rank's index-key cache, [num_blocks] blocks of `block_stride` bytes (at least block_size * 68;
// larger when the block shares a merged page with other caches).
struct KeyCache {
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t block_stride = 0;
  CacheLayout layout = CacheLayout::split;
  std::vector<uint8_t> bytes;  // [num_blocks * block_stride], zero-filled

  KeyCache() = default;
  // block_stride 0 means block_size * 68. dp::Error(input) on a non-positive size or a short stride.
  KeyCache(int64_t num_blocks, int64_t block_size, CacheLayout layout = CacheLayout::split, int64_t block_stride = 0);

  int64_t slots() const { return num_blocks * block_size; }
  KeyBytes read(int64_t slot) const;  // dp::Error(input) when the slot is outside the cache
  void write(int64_t slot, const KeyBytes& key);
};

// Quantises keys [T, 128] (row-major doubles) into `cache` at slot_mapping[t]; -1 skips the token
// (PAD_SLOT_ID: another DCP rank owns it, or a padded token). dp::Error(input) on a slot outside the
// cache or a mismatched count.
void write_keys(KeyCache& cache, std::span<const double> keys, std::span<const int64_t> slot_mapping);

// ---- Pack, gather, stage -----------------------------------------------------------------------------

// One rank's packed rows, [g.max_local, 68] bytes. dp::Error(input) when the cache's block size is not
// the chunk's, a block id is outside the cache, or rank is not below the world size.
std::vector<uint8_t> pack_keys(const KeyCache& cache, const PrefillChunk& chunk, const ChunkGeometry& g, int64_t rank);

// The DCP all-gather of packed rows: ranks' buffers concatenated in rank order, [W * max_local, 68].
std::vector<uint8_t> all_gather(std::span<const std::vector<uint8_t>> packed, const ChunkGeometry& g);

// A chunk's keys in 64-key pages: payload [pages, 1, 4, 64, 16] bytes, scales [pages, 1, 4, 64]. Key g
// is key g % 64 of page g / 64; its scale group c's 16 payload bytes are payload[page][0][c][g % 64][:]
// (the key's bytes 16c..16c+15), its scale c is scales[page][0][c][g % 64]. Keys past total_keys in
// the last page are zero.
struct StagedKeys {
  int64_t keys = 0;
  int64_t pages = 0;
  std::vector<uint8_t> payload;
  std::vector<uint8_t> scales;

  KeyBytes key(int64_t g) const;  // the 68 bytes of key g, back in packed order
};

// Restores global key order from the gathered rows (at world 1, the packed rows): key g = cu[r] + p
// comes from rank dcp_owner(p), row owner * max_local + local_cu[owner][r] + dcp_local_index(p).
// dp::Error(input) when `gathered` is not [W * max_local, 68].
StagedKeys stage_keys(std::span<const uint8_t> gathered, const ChunkGeometry& g);

// ---- Scoring and top-k -------------------------------------------------------------------------------

// The indexer's query rows of a chunk: q [rows, heads, 128] (already dequantised where the kernel reads
// MXFP4 q) and per-head weights w [rows, heads] (weights_proj output with its scales folded in).
struct IndexQuery {
  int64_t heads = 0;
  std::vector<double> q;
  std::vector<double> w;
};

// logit[t] = weight_scale * sum_h w_h * relu(q_h . k_t) for the row's request and positions
// t = 0..row_position (causal); k_t dequantised from the staged pages. Returns row_position + 1 logits.
std::vector<double> score_row(const StagedKeys& keys, const ChunkGeometry& g, const IndexQuery& query, int64_t row,
                              double weight_scale = 1.0);

// The k best indices of `logits` by descending value, ties to the lower index; -1 after the last
// when there are fewer than k. dp::Error(input) on k < 1 or a NaN logit.
std::vector<int32_t> select_topk(std::span<const double> logits, int64_t k);

// Top-k positions (within each row's request) of rows [row_begin, row_end): [rows, k] row-major.
std::vector<int32_t> topk_rows(const StagedKeys& keys, const ChunkGeometry& g, const IndexQuery& query, int64_t k,
                               int64_t row_begin, int64_t row_end, double weight_scale = 1.0);

// ---- DCP exchange ------------------------------------------------------------------------------------

// One query range [begin, end) of a chunk's rows (long prefills are scored in several ranges to keep a
// logits tile under 1 GiB; all ranges share the chunk's staged keys).
struct QueryRange {
  int64_t begin = 0;
  int64_t end = 0;
};

// Rows each rank selects for a range of n rows: ceil(n / world). Rank q takes rows
// begin + q * share .. begin + (q + 1) * share - 1; those at or past `end` are padding.
int64_t rank_share(int64_t n, int64_t world);

// Rank `rank`'s selections for all ranges, concatenated in range order: [sum of shares, k], padding
// rows -1 (what the rank contributes to the one all-gather).
std::vector<int32_t> rank_topk(const StagedKeys& keys, const ChunkGeometry& g, const IndexQuery& query, int64_t k,
                               std::span<const QueryRange> ranges, int64_t rank, double weight_scale = 1.0);

// The all-gather of every rank's rank_topk and the copy back into row order: out [g.num_rows, k], rows
// outside every range -1. For each range with share s at offset o of the rank buffers, out row
// begin + q * s + i is rank q's row o + i (for begin + q * s + i < end).
std::vector<int32_t> exchange(std::span<const std::vector<int32_t>> per_rank, const ChunkGeometry& g, int64_t k,
                              std::span<const QueryRange> ranges);

// ---- Whole chunk -------------------------------------------------------------------------------------

// Every stage for every rank: caches[rank] is rank's cache. Returns [g.num_rows, k]. `ranges` empty means
// one range of all rows. At world 1 the rows are selected directly; above, through rank_topk and
// exchange. The result does not depend on the world size: that is what the GPU tests compare.
std::vector<int32_t> prefill_topk(std::span<const KeyCache> caches, const PrefillChunk& chunk,
                                  const PrefillConfig& config, const IndexQuery& query, int64_t k,
                                  std::span<const QueryRange> ranges = {}, double weight_scale = 1.0);

}  // namespace dp::indexer
