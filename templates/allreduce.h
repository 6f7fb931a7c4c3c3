// allreduce.h: the one-shot in-kernel all-reduce of tensor parallelism. Each of R ranks holds a partial
// [W, H] bf16 output (the o-projection's, the FFN's down projection's, over its shard of the inner
// dimension); every rank ends with the same full sum, inside the layer program, with no host call and
// no separate barrier kernel.
//
// Exchange buffers. Every rank owns one device buffer that every rank maps (the host allocates it,
// exchanges CUDA/HIP IPC handles and hands each rank the table of the R device pointers, indexed by
// rank, `peers`). Its layout, in bytes (runtime/format/exchange.h computes the same numbers; the host
// allocates dp_bundle_info's exchange_bytes and the runtime zeroes its own rank's buffer once):
//   [0, 4)                 abort word: 0, or 1 + the first rank that gave up a wait (then sticky)
//   [128, 384)             seq[64] u32: this rank's count of all-reduces per block index (only the
//                          owning rank's block b reads and writes seq[b])
//   [512, 512 + 131072)    flags[2][8][64]: one u32 per (parity, source rank, block) on its own
//                          128-byte line, written by the source rank, polled by this rank's block
//   [131584, ...)          data[2][R][W][H] bf16: parity, source rank's slot, rows
// Parity is the op (0: attention o-projection, 1: FFN), so consecutive all-reduces alternate halves.
//
// One call, block b of rank r (blocks split the W*H/8 16-byte vectors into equal chunks; every rank
// launches the same grid, so block b meets block b of every peer):
//   1. count = seq[b] + 1 and tag = (count mod 2^18, layer, op) in one word (never 0): the same on every
//      rank, since every rank runs the same all-reduces in the same order (dp_agree makes all ranks
//      take the same path each step); a rank out of step (a skipped layer) writes tags that never match;
//   2. push: store its chunk of `partial` into data[parity][r] of every rank's buffer (its own too);
//   3. every thread fences at system scope, the block synchronises, then thread 0 stores `tag` into
//      flags[parity][r][b] of every rank with release semantics;
//   4. thread 0 waits, peer by peer, until flags[parity][p][b] of its own buffer equals `tag`;
//   5. every thread fences (acquire) and sums data[parity][0..R-1] of its chunk in rank order in fp32,
//      rounds once to bf16 and writes `out`: the same bits on every rank (same inputs, same order);
//   6. seq[b] = count.
// Why no barrier is needed and nothing is ever zeroed: a flag equal to this call's tag can only have
// been written in this call (the flag a half holds is from the call two before, another count). Why two halves suffice: before rank p
// can push call n+1 into my buffer, it must have seen my flag of call n, which I store only after my
// call n-1 (the same half as n+1) has finished reading; kernels of one stream do not overlap (also
// under programmatic dependent launch: every entry point waits for the previous kernel first).
//
// Memory ordering (both vendors, system scope because a peer device is outside the GPU scope):
//   - producer: plain 16-byte stores to peer memory, then dp_fence_system() in every thread (each
//     thread's own stores complete and become visible system-wide before anything it does after; on
//     AMD a release by thread 0 alone would not cover the other waves' stores), __syncthreads(), then
//     a st.release.sys (AMD: release atomic store) of the flag by thread 0. Flags are whole 32-bit
//     words on their own 128-byte line: sub-word flags race, and shared lines make pollers contend.
//   - consumer: thread 0 polls with ld.acquire.sys (AMD: acquire atomic load); after __syncthreads()
//     every thread fences again before it reads the data, and reads it with dp_load16_coherent (never
//     the read-only / L1 path, which is not coherent with other agents' stores).
//
// Bounded waits. A wait gives up after `timeout_us` microseconds (dp_timer_ns, a device-wide clock):
// the block records, once per rank, DP_FLAG_WAIT_TIMEOUT with the op, the peer it waited for and the
// layer in the session's error flag word `flag` (decodepack.h; system-scope compare-and-swap, so the
// first record wins and later ones only OR their bit), writes 1 + its rank into every rank's abort
// word and carries on. A block that finds an abort word set (at entry or while waiting) records
// DP_FLAG_PEER_ABORT with the originating rank and skips its waits, as do all later calls on this rank:
// each rank then finishes the step within about one bound, results are garbage, and dp_after_step
// fails on the rank (sticky: the session must be rebuilt, and the buffers are zeroed again).
// Flag word fields: bit 0 timeout, bit 1 peer abort, bits 2-3 op + 1, bits 8-15 peer + 1 (timeout:
// the rank waited for; peer abort: the rank that gave up), bits 16-31 layer + 1.
//
// Residency: every block of the launch must be resident at once with the peers' (a few dozen blocks of
// 256 threads); ranks sharing one device (processes without MPS) are time-sliced, so their bound must
// exceed the driver's time slice.
#pragma once

#include "vendor.h"

#define DP_AR_MAX_RANKS 8
#define DP_AR_MAX_BLOCKS 64
#define DP_AR_LINE 128
#define DP_AR_SEQ_OFFSET 128
#define DP_AR_FLAGS_OFFSET 512
#define DP_AR_DATA_OFFSET (DP_AR_FLAGS_OFFSET + 2 * DP_AR_MAX_RANKS * DP_AR_MAX_BLOCKS * DP_AR_LINE)

#define DP_AR_FLAG_WAIT_TIMEOUT 0x1u  // = DP_FLAG_WAIT_TIMEOUT (decodepack.h)
#define DP_AR_FLAG_PEER_ABORT 0x2u    // = DP_FLAG_PEER_ABORT

__device__ __forceinline__ dp_u32* dp_ar_flag(dp_u64 buffer, dp_u32 parity, dp_u32 source, dp_u32 block) {
  return (dp_u32*)(buffer + DP_AR_FLAGS_OFFSET +
                   (((dp_u64)parity * DP_AR_MAX_RANKS + source) * DP_AR_MAX_BLOCKS + block) * DP_AR_LINE);
}

__device__ __forceinline__ dp_u32 dp_ar_record(dp_u32 bit, dp_u32 op, dp_u32 peer, dp_u32 layer) {
  return bit | (((op & 1u) + 1u) << 2) | (((peer + 1u) & 0xffu) << 8) | ((layer + 1u) << 16);
}

// Records a fault in the session's flag word: the first record keeps its fields, later ones add their bit.
__device__ __forceinline__ void dp_ar_note(dp_u32* flag, dp_u32 record) {
  if (dp_cas_system(flag, 0u, record) != 0u) dp_or_system(flag, record & 0x3u);
  dp_fence_system();
}

// Host-side launch contract (compiler/codegen/ops/allreduce.cpp computes the same numbers): grid =
// kBlocks blocks (at most DP_AR_MAX_BLOCKS), block = kThreads threads. H is a multiple of 8, every
// pointer and every peer buffer 16-byte aligned. `out` may alias `partial` (each thread reads its
// vectors of `partial` before it writes the same vectors of `out`).
template <int W, int H, int R, int kThreads, int kBlocks>
__device__ __forceinline__ void dp_allreduce(const dp_bf16* partial,  // [W, H] bf16: this rank's partial sum
                                             dp_bf16* out,            // [W, H] bf16: the sum over ranks
                                             const dp_u64* peers,     // [R] exchange buffer of each rank
                                             dp_u32* flag,            // the session's error flag word
                                             dp_u32 rank, dp_u32 layer, dp_u32 op, dp_u32 timeout_us) {
  static_assert(H % 8 == 0, "dp_allreduce: H must be a multiple of 8 (16-byte bf16 vectors)");
  static_assert(R >= 2 && R <= DP_AR_MAX_RANKS, "dp_allreduce: 2..8 ranks");
  static_assert(kBlocks >= 1 && kBlocks <= DP_AR_MAX_BLOCKS, "dp_allreduce: 1..64 blocks");
  constexpr int kVecs = W * H / 8;                          // 16-byte vectors of [W, H]
  constexpr int kPer = (kVecs + kBlocks - 1) / kBlocks;     // vectors per block
  constexpr dp_u64 kSlot = (dp_u64)W * H * 2;               // bytes of one rank's [W, H] slot
  const dp_u32 b = blockIdx.x;
  const int v0 = (int)b * kPer;
  const int v1 = v0 + kPer < kVecs ? v0 + kPer : kVecs;
  const dp_u32 parity = op & 1u;
  const dp_u64 mine = peers[rank];
  dp_u32* const abort_word = (dp_u32*)mine;
  dp_u32* const seq = (dp_u32*)(mine + DP_AR_SEQ_OFFSET) + b;
  const dp_u64 half = DP_AR_DATA_OFFSET + (dp_u64)parity * R * kSlot;  // data[parity]

  __shared__ dp_u32 s_count, s_tag, s_skip;
  if (threadIdx.x == 0) {
    // The flag value names the call (its count, 18 bits) and what it reduces (layer, op): a rank that
    // skipped or added an all-reduce meets values that never match, and the wait gives up naming it,
    // instead of pairing this call with the peer's next one. Counts whose low 18 bits are 0 are skipped,
    // so no value is 0 (flags start at 0).
    dp_u32 count = *(volatile dp_u32*)seq + 1u;
    if ((count & 0x3ffffu) == 0u) ++count;
    s_count = count;
    s_tag = ((count & 0x3ffffu) << 14) | ((layer & 0x1fffu) << 1) | (op & 1u);
    const dp_u32 a = dp_load_acquire_system(abort_word);
    if (a != 0u && a - 1u != rank) dp_ar_note(flag, dp_ar_record(DP_AR_FLAG_PEER_ABORT, op, a - 1u, layer));
    s_skip = a != 0u;
  }
  __syncthreads();
  const dp_u32 tag = s_tag;

  // Push this block's chunk into slot `rank` of every rank's buffer.
  for (int v = v0 + (int)threadIdx.x; v < v1; v += kThreads) {
    const dp_u32x4 x = dp_load16(partial + 8 * (dp_u64)v);
#pragma unroll
    for (int p = 0; p < R; ++p) dp_store16((void*)(peers[p] + half + rank * kSlot + 16 * (dp_u64)v), x);
  }
  dp_fence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
#pragma unroll
    for (int p = 0; p < R; ++p) dp_store_release_system(dp_ar_flag(peers[p], parity, rank, b), tag);

    if (!s_skip) {
      const dp_u64 bound = (dp_u64)timeout_us * 1000ull;
      const dp_u64 t0 = dp_timer_ns();
      for (dp_u32 p = 0; p < (dp_u32)R && !s_skip; ++p) {
        if (p == rank) continue;
        const dp_u32* f = dp_ar_flag(mine, parity, p, b);
        while (dp_load_acquire_system(f) != tag) {
          const dp_u32 a = dp_load_acquire_system(abort_word);
          if (a != 0u) {
            if (a - 1u != rank) dp_ar_note(flag, dp_ar_record(DP_AR_FLAG_PEER_ABORT, op, a - 1u, layer));
            s_skip = 1u;
            break;
          }
          if (dp_timer_ns() - t0 > bound) {
            dp_ar_note(flag, dp_ar_record(DP_AR_FLAG_WAIT_TIMEOUT, op, p, layer));
#pragma unroll
            for (int q = 0; q < R; ++q) dp_cas_system((dp_u32*)peers[q], 0u, rank + 1u);
            dp_fence_system();
            s_skip = 1u;
            break;
          }
        }
      }
    }
  }
  __syncthreads();
  dp_fence_system();

  // Sum the R slots of this chunk in rank order (after a give-up, whatever the slots hold).
  for (int v = v0 + (int)threadIdx.x; v < v1; v += kThreads) {
    float acc[8];  // [8] fp32
#pragma unroll
    for (int k = 0; k < 8; ++k) acc[k] = 0.0f;
#pragma unroll
    for (int p = 0; p < R; ++p) {
      float x[8];
      dp_unpack8_bf16(dp_load16_coherent((const void*)(mine + half + p * kSlot + 16 * (dp_u64)v)), x);
#pragma unroll
      for (int k = 0; k < 8; ++k) acc[k] += x[k];
    }
    dp_store16(out + 8 * (dp_u64)v, dp_pack8_bf16(acc));
  }
  if (threadIdx.x == 0) *(volatile dp_u32*)seq = s_count;
}
