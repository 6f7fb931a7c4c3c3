// Peak scratch of one FP4 indexer prefill chunk, exactly as reference/seeds/004 `prefill_workspace_bytes`
// defines it. One chunk holds at most `max_keys` keys of at most `max_requests` requests
// (deploy.json indexer.max_keys_per_chunk / indexer.max_requests); under decode context parallelism
// (dcp.size = world > 1, dcp.interleave) its keys are spread over the ranks.
//
//   padded   = ceil(max_keys / 64) * 64                      keys of the staged 64-key pages
//   world 1:   2^30 + 68 * (max_keys + padded)
//   world W:   local = ceil(max_keys / W) + max_requests * interleave
//              2^30 + 68 * ((W + 1) * local + padded)
//
// 2^30 is the logits tile (each tile is kept under 1 GiB); 68 bytes per key. Staging holds the rank's
// packed keys (local rows), their all-gather (W * local rows) and the restored pages (padded keys) at
// once. `local` bounds every rank's share: a rank's keys of one request exceed an even split by at most
// one interleave run, so its chunk total is at most ceil(max_keys / W) + max_requests * interleave.
#pragma once

#include <cstdint>

namespace dp::format {
struct Deploy;
}
namespace dp::deploy {
using format::Deploy;
}

namespace dp::indexer {

inline constexpr uint64_t kLogitsTileBytes = uint64_t{1} << 30;

// ceil(keys / 64) * 64.
int64_t padded_keys(int64_t keys);

// Rows of one rank's packed-key buffer: max_keys at world 1, else ceil(max_keys / world) +
// max_requests * interleave. Arguments must be positive (dp::Error(input) otherwise).
int64_t local_keys_bound(int64_t max_keys, int64_t max_requests, int64_t world, int64_t interleave);

// The seed's prefill_workspace_bytes, overflow-checked (dp::Error(input) naming the arguments).
uint64_t prefill_workspace_bytes(int64_t max_keys, int64_t max_requests, int64_t world, int64_t interleave);

// The same for a deploy config: indexer.max_keys_per_chunk, indexer.max_requests, dcp.size, dcp.interleave.
uint64_t prefill_workspace_bytes(const deploy::Deploy& d);

}  // namespace dp::indexer
