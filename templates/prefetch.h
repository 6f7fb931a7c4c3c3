// prefetch.h: the L2 weight-prefetch kernel.
//
// Runs on a side stream while the main stream computes the current layer and pulls the next layer's
// weights into L2, so that their first reads hit in L2 instead of HBM. It reads a table of device
// address ranges (resolved by the runtime at bind time) and touches every byte range exactly once;
// it writes nothing, and a wrong table can slow a step down but never change a result.
#pragma once

#include "vendor.h"

// One contiguous span of device memory to prefetch. Layout is part of the bundle format (the runtime
// writes these tables): 16 bytes, little-endian, no padding.
struct dp_prefetch_range {
  dp_u64 addr;   // device address, 16-byte aligned
  dp_u64 bytes;  // length, a multiple of 16; 0 is allowed and skipped
};
static_assert(sizeof(dp_prefetch_range) == 16, "prefetch.h: range table entries are 16 bytes");

// The work is cut into chunks of DP_PREFETCH_CHUNK_BYTES (one dp_prefetch_l2 call each) numbered
// consecutively across the whole table, and chunk g goes to thread g mod (all threads of the grid).
// Numbering across ranges (rather than restarting at thread 0 for every range) keeps a table of many
// small ranges, such as per-expert scales, from landing on the first few threads.
//
// kThreads is the block size the kernel is compiled for (the launch must use it); the grid size is
// free (default 32 blocks), so the runtime can trade prefetch bandwidth against SMs taken from the
// main stream without a rebuild.
template <int kThreads>
__device__ __forceinline__ void dp_prefetch_ranges(const dp_prefetch_range* __restrict__ table,  // [count]
                                                   dp_u32 count) {
  constexpr dp_u32 kChunk = DP_PREFETCH_CHUNK_BYTES;
  // 32-bit chunk arithmetic: 64-bit division is a long software sequence on both vendors. A range
  // has fewer than 2^31 chunks (the runtime caps ranges far below the 8 TiB that would take).
  const dp_u32 nthreads = gridDim.x * (dp_u32)kThreads;
  const dp_u32 me = blockIdx.x * (dp_u32)kThreads + threadIdx.x;
  dp_u32 phase = 0;  // (chunks in the ranges before this one) mod nthreads
  for (dp_u32 r = 0; r < count; ++r) {
    const dp_u64 addr = table[r].addr;
    const dp_u64 bytes = table[r].bytes;
    const dp_u32 chunks = (dp_u32)((bytes + kChunk - 1) / kChunk);
    // This thread's first chunk in range r: the smallest c with (phase + c) mod nthreads == me.
    for (dp_u32 c = me >= phase ? me - phase : me + nthreads - phase; c < chunks; c += nthreads) {
      const dp_u64 off = (dp_u64)c * kChunk;
      const dp_u64 left = bytes - off;
      dp_prefetch_l2((const void*)(addr + off), left < kChunk ? (dp_u32)left : kChunk);
    }
    phase += chunks % nthreads;
    if (phase >= nthreads) phase -= nthreads;
  }
}
