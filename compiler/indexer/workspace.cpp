#include "indexer/workspace.h"

#include "common/error.h"
#include "deploy/deploy.h"
#include "format/dcp.h"
#include "indexer/key.h"

namespace dp::indexer {
namespace {

void require_positive(int64_t max_keys, int64_t max_requests, int64_t world, int64_t interleave) {
  if (max_keys < 1 || max_requests < 1 || world < 1 || interleave < 1)
    fail(Errc::input,
         "indexer prefill workspace: max_keys {}, max_requests {}, world {}, interleave {}: each must be at least 1",
         max_keys, max_requests, world, interleave);
}

[[noreturn]] void overflow(int64_t max_keys, int64_t max_requests, int64_t world, int64_t interleave) {
  fail(Errc::input, "indexer prefill workspace: max_keys {}, max_requests {}, world {}, interleave {}: the size "
       "overflows 64 bits", max_keys, max_requests, world, interleave);
}

}  // namespace

int64_t padded_keys(int64_t keys) {
  if (keys < 0) fail(Errc::input, "indexer: {} keys, expected at least 0", keys);
  return (keys / kPageKeys + (keys % kPageKeys != 0)) * kPageKeys;
}

int64_t local_keys_bound(int64_t max_keys, int64_t max_requests, int64_t world, int64_t interleave) {
  require_positive(max_keys, max_requests, world, interleave);
  int64_t local = 0;
  if (!dcp::local_rows_bound(max_keys, max_requests, world, interleave, &local))
    overflow(max_keys, max_requests, world, interleave);
  return local;
}

uint64_t prefill_workspace_bytes(int64_t max_keys, int64_t max_requests, int64_t world, int64_t interleave) {
  require_positive(max_keys, max_requests, world, interleave);
  const uint64_t padded = static_cast<uint64_t>(padded_keys(max_keys));
  uint64_t rows;  // 68-byte rows held at once
  if (world == 1) {
    rows = static_cast<uint64_t>(max_keys) + padded;
  } else {
    const uint64_t local = static_cast<uint64_t>(local_keys_bound(max_keys, max_requests, world, interleave));
    if (__builtin_mul_overflow(static_cast<uint64_t>(world) + 1, local, &rows) ||
        __builtin_add_overflow(rows, padded, &rows))
      overflow(max_keys, max_requests, world, interleave);
  }
  uint64_t bytes;
  if (__builtin_mul_overflow(rows, static_cast<uint64_t>(kKeyBytes), &bytes) ||
      __builtin_add_overflow(bytes, kLogitsTileBytes, &bytes))
    overflow(max_keys, max_requests, world, interleave);
  return bytes;
}

uint64_t prefill_workspace_bytes(const deploy::Deploy& d) {
  return prefill_workspace_bytes(d.indexer.max_keys_per_chunk, d.indexer.max_requests, d.dcp.size, d.dcp.interleave);
}

}  // namespace dp::indexer
