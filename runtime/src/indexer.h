// The indexer prefill's metadata (decodepack.h dp_indexer_prepare): what src/indexer.cpp plans once per
// attention group and every prefill of the group reads.
#pragma once

#include <cstdint>
#include <vector>

#include "decodepack/decodepack.h"

namespace dp::rt {

// One query chunk of a request set: rows [begin, end) of the set; each rank scores `share` of them.
struct IndexerRange {
  int64_t begin = 0, end = 0, share = 0;
  int64_t pending = 0;  // DCP: this chunk's first row in every rank's buffer of selected rows
};

struct IndexerSet {
  int32_t requests = 0;
  int64_t keys = 0, pages = 0, max_local = 0, max_len = 0, rows = 0;
  int64_t row_offset = 0;  // first output row
  uint64_t block_table = 0;
  int64_t bt_stride = 0;
  // Device arrays (offsets into the metadata's buffer): cu [R+1], local_cu [W, R+1], row_request and
  // row_position [rows], all int32.
  uint64_t cu = 0, local_cu = 0, row_request = 0, row_position = 0;
  std::vector<IndexerRange> ranges;
};

}  // namespace dp::rt

struct dp_indexer_metadata {
  dp_session* session = nullptr;
  int64_t rank = 0, world = 1, interleave = 1;
  int64_t rows = 0, keys = 0;
  int32_t chunks = 0;
  std::vector<dp::rt::IndexerSet> sets;
  int64_t pending_rows = 0;  // DCP: rows of each rank's selected-rows buffer
  uint64_t device = 0;       // one allocation holding everything below (0 on a host-only session)
  uint64_t bytes = 0;
  uint64_t pending = 0, gathered = 0, map = 0;  // DCP: [pending_rows, K], [W * pending_rows, K], [rows] i32

  ~dp_indexer_metadata();  // frees the device memory through the session
};
