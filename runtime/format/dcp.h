// Decode context parallelism (model-family.md 4.4): where a request's key at position p lives when its
// KV is spread over a DCP group of `world` ranks in runs of `interleave` positions, and how many rows a
// rank's packed share of an indexer prefill chunk can hold. Shared by the compiler (the indexer's CPU
// reference, the workspace size) and the runtime (the prefill's chunk planning), so both place keys
// the same way. Plain arithmetic: callers check world, interleave and the limits are positive.
#pragma once

#include <algorithm>
#include <cstdint>

namespace dp::dcp {

// Rank holding position `pos`: (pos / interleave) % world.
constexpr int64_t owner(int64_t pos, int64_t world, int64_t interleave) { return (pos / interleave) % world; }

// Index of position `pos` among its rank's keys of the request: whole rounds of world * interleave
// positions give `interleave` keys each, plus the offset within the current run.
constexpr int64_t local_index(int64_t pos, int64_t world, int64_t interleave) {
  return (pos / (interleave * world)) * interleave + pos % interleave;
}

// Keys of a request of `len` keys on `rank` (vLLM get_dcp_local_seq_lens).
constexpr int64_t local_len(int64_t len, int64_t world, int64_t rank, int64_t interleave) {
  const int64_t base = (len / interleave / world) * interleave;
  return base + std::clamp<int64_t>(len - base * world - rank * interleave, 0, interleave);
}

// Rows of one rank's packed keys for a chunk of at most max_keys keys in max_requests requests:
// max_keys at world 1, else ceil(max_keys / world) + max_requests * interleave (a rank's keys of one
// request exceed an even split by at most one interleave run). Returns false when that overflows.
constexpr bool local_rows_bound(int64_t max_keys, int64_t max_requests, int64_t world, int64_t interleave,
                                int64_t* out) {
  if (world == 1) {
    *out = max_keys;
    return true;
  }
  int64_t runs = 0;
  return !__builtin_mul_overflow(max_requests, interleave, &runs) &&
         !__builtin_add_overflow(max_keys / world + (max_keys % world != 0), runs, out);
}

}  // namespace dp::dcp
