// Bounds of a bundle's deploy block: the deploy reader (compiler/deploy) refuses a deploy file
// outside them, and the deploy section's reader (format/sections.h, which the runtime opens bundles
// with) a bundle outside them, so that both agree on what a valid bundle is.
// tests/unit/format/deploy_limits_test.cpp holds the deploy reader to each bound (accepted at it,
// refused past it); tests/unit/format/sections_test.cpp the section's reader and
// tests/unit/runtime/planning_tests.cpp the runtime.
#pragma once

#include <cstdint>

namespace dp::format {

inline constexpr int64_t kMaxTensorParallel = 8;     // one node's GPUs (powers of two)
inline constexpr int64_t kMaxWidth = 64;             // per-row loops are unrolled per width
inline constexpr int64_t kMaxSpeculativeTokens = 7;  // q <= 8 rows per request
inline constexpr int64_t kMinBlockSize = 16;         // KV-cache tokens per block
inline constexpr int64_t kMaxBlockSize = 65536;      // larger is a typo (bytes for tokens)
inline constexpr int64_t kMaxDcpSize = 8;            // decode context parallelism within one node
inline constexpr int64_t kMaxDcpInterleave = kMaxBlockSize;  // it divides the block size
inline constexpr int64_t kMaxPrefetchCapBytes = int64_t{1} << 30;  // more than any GPU's L2
// The indexer's prefill limits: kernels index keys and requests with int32, and the staged pages round
// a chunk's keys up to a multiple of 64, which must stay an int32 too.
inline constexpr int64_t kMaxIndexerLimit = (int64_t{1} << 31) - 1;
inline constexpr int64_t kMaxIndexerKeys = kMaxIndexerLimit / 64 * 64;  // 2147483584

}  // namespace dp::format
