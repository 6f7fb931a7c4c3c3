#include "indexer/geometry.h"

#include <algorithm>
#include <string>

#include "common/error.h"
#include "format/dcp.h"
#include "deploy/deploy.h"
#include "indexer/key.h"
#include "indexer/workspace.h"

namespace dp::indexer {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return a / b + (a % b != 0); }

std::string divisors(int64_t n) {
  std::string s;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) s += (s.empty() ? "" : ", ") + std::to_string(i);
  return s;
}

void check_dcp(int64_t world, int64_t interleave) {
  if (world < 1 || interleave < 1)
    fail(Errc::input, "indexer DCP: world {} and interleave {} must each be at least 1", world, interleave);
}

}  // namespace

int64_t dcp_owner(int64_t pos, int64_t world, int64_t interleave) {
  check_dcp(world, interleave);
  return dcp::owner(pos, world, interleave);
}

int64_t dcp_local_index(int64_t pos, int64_t world, int64_t interleave) {
  check_dcp(world, interleave);
  return dcp::local_index(pos, world, interleave);
}

int64_t dcp_local_len(int64_t len, int64_t world, int64_t rank, int64_t interleave) {
  check_dcp(world, interleave);
  return dcp::local_len(len, world, rank, interleave);
}

int64_t dcp_slot(std::span<const int32_t> block_row, int64_t pos, int64_t block_size, int64_t world, int64_t rank,
                 int64_t interleave) {
  check_dcp(world, interleave);
  if (pos < 0 || block_size < 1 || rank < 0 || rank >= world)
    fail(Errc::input, "indexer slot mapping: position {}, block size {}, rank {} of world {}: expected position >= 0, "
         "block size >= 1 and a rank below the world", pos, block_size, rank, world);
  const int64_t virtual_block = block_size * world;
  const int64_t vo = pos % virtual_block;
  if (dcp::owner(vo, world, interleave) != rank) return -1;
  const int64_t entry = pos / virtual_block;
  if (entry >= static_cast<int64_t>(block_row.size()))
    fail(Errc::input, "indexer slot mapping: position {} needs block-table entry {}, the row has {}", pos, entry,
         block_row.size());
  return static_cast<int64_t>(block_row[entry]) * block_size + dcp::local_index(vo, world, interleave);
}

PrefillConfig PrefillConfig::from(const deploy::Deploy& d) {
  return {d.indexer.max_keys_per_chunk, d.indexer.max_requests, d.dcp.size, d.dcp.interleave,
          d.kv_cache.block_size};
}

int64_t ChunkGeometry::pages() const { return ceil_div(total_keys, kPageKeys); }

void check_config(const PrefillConfig& c) {
  if (c.max_keys < 1 || c.max_requests < 1)
    fail(Errc::input, "indexer prefill: max_keys_per_chunk {} and max_requests {} must each be at least 1",
         c.max_keys, c.max_requests);
  check_dcp(c.world, c.interleave);
  if (c.block_size < 1) fail(Errc::input, "indexer prefill: cache block size {} must be at least 1", c.block_size);
  if (c.block_size % c.interleave != 0)
    fail(Errc::input, "indexer prefill: dcp interleave {} does not divide the cache block size {} (valid: {})",
         c.interleave, c.block_size, divisors(c.block_size));
}

ChunkGeometry plan_chunk(const PrefillChunk& chunk, const PrefillConfig& config) {
  check_config(config);
  const int64_t R = static_cast<int64_t>(chunk.seq_lens.size()), W = config.world, I = config.interleave;
  if (chunk.query_lens.size() != chunk.seq_lens.size() || chunk.block_table.size() != chunk.seq_lens.size())
    fail(Errc::input, "indexer prefill chunk: {} seq_lens, {} query_lens and {} block-table rows, expected one of "
         "each per request", chunk.seq_lens.size(), chunk.query_lens.size(), chunk.block_table.size());
  if (R == 0) fail(Errc::input, "indexer prefill chunk: no requests");
  if (R > config.max_requests)
    fail(Errc::input, "indexer prefill chunk: {} requests, more than the workspace holds (indexer.max_requests {})",
         R, config.max_requests);

  ChunkGeometry g;
  g.config = config;
  g.num_requests = R;
  g.cu.assign(1, 0);
  g.row_cu.assign(1, 0);
  for (int64_t r = 0; r < R; ++r) {
    const int64_t len = chunk.seq_lens[r], q = chunk.query_lens[r];
    if (len < 1) fail(Errc::input, "indexer prefill chunk: request {} has seq_len {}, expected at least 1", r, len);
    if (q < 0 || q > len)
      fail(Errc::input, "indexer prefill chunk: request {} has query_len {}, expected 0..seq_len {}", r, q, len);
    // Bounded before the sum so that no sum can overflow.
    if (len > config.max_keys || g.cu.back() + len > config.max_keys)
      fail(Errc::input, "indexer prefill chunk: requests 0..{} hold {} keys, beyond the workspace's {} "
           "(indexer.max_keys_per_chunk)", r, g.cu.back() + len, config.max_keys);
    g.cu.push_back(g.cu.back() + len);
    g.row_cu.push_back(g.row_cu.back() + q);
  }
  g.total_keys = g.cu.back();
  g.num_rows = g.row_cu.back();

  g.local_lens.assign(W, std::vector<int64_t>(R));
  g.local_cu.assign(W, std::vector<int64_t>(1, 0));
  for (int64_t rank = 0; rank < W; ++rank) {
    for (int64_t r = 0; r < R; ++r) {
      g.local_lens[rank][r] = dcp_local_len(chunk.seq_lens[r], W, rank, I);
      g.local_cu[rank].push_back(g.local_cu[rank].back() + g.local_lens[rank][r]);
    }
    g.max_local = std::max(g.max_local, g.local_cu[rank].back());
  }
  // The workspace bound holds for every chunk within the limits; a failure here is a bug in this file.
  if (g.max_local > local_keys_bound(config.max_keys, config.max_requests, W, I))
    fail(Errc::internal, "indexer prefill chunk: a rank holds {} keys, above the workspace bound {}", g.max_local,
         local_keys_bound(config.max_keys, config.max_requests, W, I));

  for (int64_t r = 0; r < R; ++r) {
    int64_t most = 0;
    for (int64_t rank = 0; rank < W; ++rank) most = std::max(most, g.local_lens[rank][r]);
    const int64_t need = ceil_div(most, config.block_size);
    const auto& row = chunk.block_table[r];
    if (static_cast<int64_t>(row.size()) < need)
      fail(Errc::input, "indexer prefill chunk: request {} has {} block-table entries, its {} keys need {} (block "
           "size {}, dcp world {})", r, row.size(), chunk.seq_lens[r], need, config.block_size, W);
    for (int64_t e = 0; e < need; ++e)
      if (row[e] < 0)
        fail(Errc::input, "indexer prefill chunk: request {} block-table entry {} is {}, expected a block id >= 0", r,
             e, row[e]);
  }

  g.key_request.resize(g.total_keys);
  g.row_request.resize(g.num_rows);
  g.row_position.resize(g.num_rows);
  for (int64_t r = 0; r < R; ++r) {
    std::fill(g.key_request.begin() + g.cu[r], g.key_request.begin() + g.cu[r + 1], static_cast<int32_t>(r));
    const int64_t first = chunk.seq_lens[r] - chunk.query_lens[r];
    for (int64_t j = 0; j < chunk.query_lens[r]; ++j) {
      g.row_request[g.row_cu[r] + j] = static_cast<int32_t>(r);
      g.row_position[g.row_cu[r] + j] = first + j;
    }
  }
  return g;
}

}  // namespace dp::indexer
