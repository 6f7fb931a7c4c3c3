// Bounds of a bundle's deploy block: the deploy reader (compiler/deploy) refuses a deploy file
// outside them, and the runtime's manifest reader (runtime/src/bundle.cpp) a bundle outside them, so
// that both agree on what a valid bundle is.
#pragma once

#include <cstdint>

namespace dp::format {

inline constexpr int64_t kMaxTensorParallel = 8;     // one node's GPUs (powers of two)
inline constexpr int64_t kMaxWidth = 64;             // per-row loops are unrolled per width
inline constexpr int64_t kMaxSpeculativeTokens = 7;  // q <= 8 rows per request
inline constexpr int64_t kMinBlockSize = 16;         // KV-cache tokens per block
inline constexpr int64_t kMaxBlockSize = 65536;      // larger is a typo (bytes for tokens)
inline constexpr int64_t kMaxDcpSize = 8;            // decode context parallelism within one node

}  // namespace dp::format
