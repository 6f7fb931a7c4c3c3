// Geometry of one FP4 indexer prefill chunk: where each key lives under decode context parallelism
// (model-family.md 4.4), which rows each rank packs, and the checks that refuse a chunk the prefill
// workspace (workspace.h) cannot hold. Everything is exact integer arithmetic.
//
// A chunk is a set of requests. Request r has seq_lens[r] keys, one per position 0..seq_len-1 (its
// context and its new tokens), and query_lens[r] query rows: its newest positions
// seq_len - query_len .. seq_len - 1. Keys and rows are request-major: key g = cu[r] + p is position p
// of request r, row i = row_cu[r] + j is position seq_len - query_len + j of request r.
//
// DCP (world W = dcp.size, interleave I = dcp.interleave, I divides the cache block size B):
//   position p lives on rank (p / I) % W, at the rank's local index (p / (I*W)) * I + p % I;
//   local index j of request r sits in block block_table[r][j / B] at offset j % B of that rank's cache
//   (the block table is shared by the ranks; each rank's cache has its own memory for a block id);
//   a request of len keys has on rank q: base + clamp(len - base*W - q*I, 0, I) keys,
//   with base = (len / I / W) * I.
// At W = 1 every key is local: local index = position.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace dp::format {
struct Deploy;
}
namespace dp::deploy {
using format::Deploy;
}

namespace dp::indexer {

// ---- DCP placement -----------------------------------------------------------------------------------

int64_t dcp_owner(int64_t pos, int64_t world, int64_t interleave);
int64_t dcp_local_index(int64_t pos, int64_t world, int64_t interleave);
// Keys of a request of `len` keys held by `rank` (vLLM get_dcp_local_seq_lens).
int64_t dcp_local_len(int64_t len, int64_t world, int64_t rank, int64_t interleave);
// Cache slot (block * block_size + offset) of position `pos` of a request with block-table row
// `block_row` on `rank`, or -1 (PAD_SLOT_ID) when another rank owns the position. This is vLLM's slot
// mapping (virtual blocks of block_size * world positions). dp::Error(input) when the row is too short.
int64_t dcp_slot(std::span<const int32_t> block_row, int64_t pos, int64_t block_size, int64_t world, int64_t rank,
                 int64_t interleave);

// ---- Chunks ------------------------------------------------------------------------------------------

// The deployment limits and layout one chunk is checked against.
struct PrefillConfig {
  int64_t max_keys = 0;      // indexer.max_keys_per_chunk
  int64_t max_requests = 0;  // indexer.max_requests
  int64_t world = 1;         // dcp.size
  int64_t interleave = 1;    // dcp.interleave
  int64_t block_size = 64;   // kv_cache.block_size: tokens per cache block on each rank

  static PrefillConfig from(const deploy::Deploy& d);
};

struct PrefillChunk {
  std::vector<int64_t> seq_lens;                  // [R] keys of each request
  std::vector<int64_t> query_lens;                // [R] query rows of each request (0..seq_len)
  std::vector<std::vector<int32_t>> block_table;  // [R][entries] block ids
};

// Everything derived from a chunk, computed once (the CPU side of prepare_prefill_metadata).
struct ChunkGeometry {
  PrefillConfig config;
  int64_t num_requests = 0;
  int64_t total_keys = 0;                       // sum of seq_lens
  int64_t num_rows = 0;                         // sum of query_lens
  std::vector<int64_t> cu;                      // [R+1] key offsets (cu_seq_lens)
  std::vector<std::vector<int64_t>> local_lens; // [W][R] keys of each request on each rank
  std::vector<std::vector<int64_t>> local_cu;   // [W][R+1] offsets into each rank's packed rows
  int64_t max_local = 0;                        // packed rows per rank: max over ranks of the local totals
  std::vector<int32_t> key_request;             // [total_keys] request of each key (token_to_seq)
  std::vector<int64_t> row_cu;                  // [R+1] row offsets
  std::vector<int32_t> row_request;             // [num_rows]
  std::vector<int64_t> row_position;            // [num_rows] position of each row in its request

  int64_t pages() const;  // staged 64-key pages: ceil(total_keys / 64)
};

// Checks the chunk against `config` and derives its geometry. Throws dp::Error(input) naming the
// request, field, value and limit: interleave not dividing the block size, more requests or keys than
// the workspace holds (indexer.max_requests, indexer.max_keys_per_chunk), an empty request, more query
// rows than keys, a block-table row too short for the rank-local keys, a negative block id.
ChunkGeometry plan_chunk(const PrefillChunk& chunk, const PrefillConfig& config);

// Checks a PrefillConfig alone (positive limits, interleave dividing the block size).
void check_config(const PrefillConfig& config);

}  // namespace dp::indexer
