// The in-kernel tensor-parallel all-reduce as the runtime sees it (templates/allreduce.h is the device
// side): the size of one rank's exchange buffer, and what the error flag word says after a wait gave up.
// Pure functions, compiled into the CPU tests too.
#pragma once

#include <cstdint>
#include <string>

namespace dp::rt {

// templates/allreduce.h's layout: 512 bytes of abort word and sequence counts, flags[2][8][64] on
// 128-byte lines, then data[2][ranks][rows][hidden] bf16. The two must agree (tests/unit/runtime).
inline constexpr uint64_t kAllreduceFlagsOffset = 512;
inline constexpr uint64_t kAllreduceDataOffset = kAllreduceFlagsOffset + 2ull * 8 * 64 * 128;

// Bytes of one rank's exchange buffer for `ranks` ranks and at most `rows` rows of `hidden` bf16.
uint64_t allreduce_exchange_bytes(int64_t ranks, int64_t rows, int64_t hidden);

// "a wait of this rank gave up: layer 3, after the FFN, waiting for rank 1 (error flag 0x00040209)".
std::string describe_error_flag(uint32_t v);

}  // namespace dp::rt
