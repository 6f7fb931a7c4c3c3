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
// Every thread needs every range's chunk offset, so every thread walks the whole table. It does so
// 32 entries at a time with its group of 32 lanes: each lane loads one entry (one coalesced load per
// group instead of one dependent load per entry), the group computes the entries' offsets with a
// prefix sum over shuffles, and then each lane takes the 32 entries from its neighbours' registers.
// The next 32 entries are loaded before the current ones are issued, hiding the load latency.
//
// kThreads is the block size the kernel is compiled for (the launch must use it); the grid size is
// free (default 32 blocks), so the runtime can trade prefetch bandwidth against SMs taken from the
// main stream without a rebuild.
template <int kThreads>
__device__ __forceinline__ void dp_prefetch_ranges(const dp_prefetch_range* __restrict__ table,  // [count]
                                                   dp_u32 count) {
  static_assert(kThreads % 32 == 0, "dp_prefetch_ranges: block must be whole groups of 32 lanes");
  constexpr dp_u32 kChunk = DP_PREFETCH_CHUNK_BYTES;
  constexpr dp_u32 kGroup = 32;
  // 32-bit chunk arithmetic: 64-bit division is a long software sequence on both vendors. A range
  // has fewer than 2^31 chunks (the runtime caps ranges far below the 8 TiB that would take), and
  // the grid has fewer than 2^26 threads, so the sums below cannot wrap.
  const dp_u32 nthreads = gridDim.x * (dp_u32)kThreads;
  const dp_u32 me = blockIdx.x * (dp_u32)kThreads + threadIdx.x;
  const dp_u32 lane = threadIdx.x % kGroup;
  dp_u32 phase = 0;  // (chunks in all ranges before the current group of 32) mod nthreads

  dp_u64 next_addr = 0, next_bytes = 0;  // [kGroup] entries spread over the lanes, one each
  if (lane < count) {
    next_addr = table[lane].addr;
    next_bytes = table[lane].bytes;
  }
  for (dp_u32 base = 0; base < count; base += kGroup) {
    const dp_u64 addr = next_addr;
    const dp_u64 bytes = next_bytes;
    if (base + kGroup + lane < count) {
      next_addr = table[base + kGroup + lane].addr;
      next_bytes = table[base + kGroup + lane].bytes;
    }
    const dp_u32 chunks = (dp_u32)((bytes + kChunk - 1) / kChunk);
    // Inclusive prefix sum over the group of (chunks mod nthreads): each term < nthreads.
    const dp_u32 own = chunks % nthreads;
    dp_u32 incl = own;
#pragma unroll
    for (dp_u32 d = 1; d < kGroup; d <<= 1) {
      const dp_u32 t = dp_shfl_group32(incl, lane >= d ? lane - d : lane);
      if (lane >= d) incl += t;
    }
    const dp_u32 excl = (incl - own) % nthreads;  // this entry's offset after `phase`
    const dp_u32 group_total = dp_shfl_group32(incl, kGroup - 1) % nthreads;

    const dp_u32 n = count - base < kGroup ? count - base : kGroup;
    for (dp_u32 j = 0; j < n; ++j) {  // uniform trip count: every lane takes part in the shuffles
      const dp_u64 a = dp_shfl_group32(addr, j);
      const dp_u64 b = dp_shfl_group32(bytes, j);
      const dp_u32 ch = dp_shfl_group32(chunks, j);
      dp_u32 start = phase + dp_shfl_group32(excl, j);
      if (start >= nthreads) start -= nthreads;
      // This thread's first chunk of range j: the smallest c with (start + c) mod nthreads == me.
      for (dp_u32 c = me >= start ? me - start : me + nthreads - start; c < ch; c += nthreads) {
        const dp_u64 off = (dp_u64)c * kChunk;
        const dp_u64 left = b - off;
        dp_prefetch_l2((const void*)(a + off), left < kChunk ? (dp_u32)left : kChunk);
      }
    }
    phase += group_total;
    if (phase >= nthreads) phase -= nthreads;
  }
}
