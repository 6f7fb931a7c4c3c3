// Tensor-parallel shards of a row-major tensor, and element conversion to the dtype a bundle binds:
// the one cut and the one conversion that both the build's fingerprints (bundle/fingerprint.cpp, which
// hashes shards streamed from the checkpoint files) and the tools that load weights onto a device
// (tooling/weights.cpp) use, so that the bytes a rank binds are the bytes its fingerprint hashed.
#pragma once

#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "common/dtype.h"

namespace dp::model {

// The range [begin, end) of dimension split_dim (-1: the whole tensor).
struct ShardCut {
  int split_dim = -1;
  int64_t begin = 0, end = 0;
};

// Where a shard's bytes lie in the full tensor's: `outer` contiguous runs of `run` bytes, run o at
// byte first + o * stride.
struct ShardLayout {
  uint64_t outer = 1, run = 0, stride = 0, first = 0;
  uint64_t offset(uint64_t o) const { return first + o * stride; }
  uint64_t bytes() const { return outer * run; }
};

// The layout of `cut` in a tensor of `shape` and `elem`-byte elements. Throws dp::Error(verify) naming
// `what` when the tensor has no such range.
ShardLayout shard_layout(std::span<const int64_t> shape, uint64_t elem, const ShardCut& cut, std::string_view what);

// The shard's bytes copied out of the full tensor's (`full` holds the whole tensor).
std::vector<uint8_t> slice_shard(std::span<const uint8_t> full, std::span<const int64_t> shape, uint64_t elem,
                                 const ShardCut& cut, std::string_view what);

// Rank `rank`'s cut of a dimension split into equal parts of `part` elements.
inline ShardCut rank_cut(int split_dim, int64_t part, int64_t rank) {
  if (split_dim < 0) return {};
  return {split_dim, part * rank, part * (rank + 1)};
}

// Whether elements stored as `from` can be bound as `to`: the same bytes (U8 and F8_E8M0 scales are
// one), or a float (BF16, F16, F32, F64) to BF16 or F32.
bool can_convert(DType from, DType to);

// `src` (elements of `from`) as elements of `to`, written to `out` (resized to fit).
// Widening is exact; narrowing rounds to nearest even (one rounding, also from F64); a NaN stays a
// quiet NaN of the same sign. Requires can_convert(from, to) (dp::Error(internal) otherwise).
void convert_elements(std::span<const uint8_t> src, DType from, DType to, std::vector<uint8_t>& out);

}  // namespace dp::model
