// gemm.h: skinny bf16 GEMM for the few rows of a decode step, y = x W^T, and the pieces the MoE and
// MLP kernels (moe.h) build on.
//
// Decode multiplies T = W*q activation rows (1..64) by weight matrices of thousands of rows: the
// weights are read exactly once and dominate the time, so the kernels are organised around streaming
// weight rows with 16-byte loads, and the T activation rows ride along (they stay in L1/L2).
//
// Work split. A block of 256 threads is 8 groups of 32 lanes (a warp on NVIDIA, half a wavefront on
// AMD gfx9: everything below reduces within 32-lane groups, so one source serves both). A group owns
// M weight rows and one of S slices of K; the block therefore covers RB = (8/S)*M rows. Small S and
// large M suit tall matrices (many rows, each group streams several rows at once); S > 1 is the
// split-K for short matrices (few rows, long K), so that they still spread over enough blocks. The
// split-K partials are combined in shared memory in a fixed order: results are deterministic.
//
// Lane l of a group reads 16-byte vectors l, l+32, l+64, ... of its slice of each of its M rows and
// accumulates fp32 partial dot products against the same vectors of every activation row; a butterfly
// over the group sums them.
#pragma once

#include "vendor.h"

// Launch bounds of the decode ops' entry points: blocks of at most n threads, and on NVIDIA at least one
// resident block per SM. Without the second number ptxas may cap registers to fit more blocks and
// spill a few values to local memory instead (seen: 12 bytes at 64 registers, where 71 fit without);
// these kernels are bounded by memory, not by occupancy beyond one or two blocks.
#if DP_VENDOR_NVIDIA
#define DP_KERNEL_BOUNDS(n) __launch_bounds__(n, 1)
#else
#define DP_KERNEL_BOUNDS(n) DP_LAUNCH_BOUNDS(n)
#endif

#define DP_GROUP 32          // lanes of a work group
#define DP_GEMM_THREADS 256  // threads of every GEMM-shaped block (8 groups)
#define DP_GEMM_GROUPS (DP_GEMM_THREADS / DP_GROUP)

// Sum over the caller's 32-lane group; every lane of the group gets the total. Masks below 32 never
// leave the group, also in a 64-lane wavefront. Call from uniform control flow only.
__device__ __forceinline__ float dp_group_sum(float v) {
#pragma unroll
  for (int m = DP_GROUP / 2; m > 0; m >>= 1) v += dp_shfl_xor(v, m);
  return v;
}

// Division without NVIDIA's IEEE slow path: a / b calls a subroutine for extreme operands, whose call
// ABI costs registers and stack in every kernel that divides; __fdividef is within 2 ulp, far below
// the bf16 rounding every caller applies. AMD's a / b is an inline instruction sequence already.
__device__ __forceinline__ float dp_div(float a, float b) {
#if DP_VENDOR_NVIDIA
  return __fdividef(a, b);
#else
  return a / b;
#endif
}
__device__ __forceinline__ float dp_sigmoid(float x) { return dp_div(1.0f, 1.0f + dp_expf(-x)); }
__device__ __forceinline__ float dp_silu(float x) { return dp_div(x, 1.0f + dp_expf(-x)); }
__device__ __forceinline__ float dp_round_bf16(float x) { return dp_bf16_to_f32(dp_f32_to_bf16(x)); }
// tanh from one exponential: exact to a few ulp away from 0 and saturating (no inf/inf) for large |x|.
__device__ __forceinline__ float dp_tanh(float x) {
  const float a = x < 0.0f ? -x : x;
  const float e = dp_expf(-2.0f * (a < 40.0f ? a : 40.0f));
  const float t = dp_div(1.0f - e, 1.0f + e);
  return x < 0.0f ? -t : t;
}

// Gated activation of the MLPs and experts, on bf16-rounded GEMM outputs (as vLLM stores them):
// kAct 0: silu(gate) * up (Kimi-Linear); kAct 1: Kimi-K3 SiTU,
//   beta*tanh(gate/beta)*sigmoid(gate) * lbeta*tanh(up/lbeta).
template <int kAct>
__device__ __forceinline__ float dp_gated_act(float gate, float up, float beta, float lbeta) {
  if (kAct == 0) return dp_silu(gate) * up;
  return beta * dp_tanh(dp_div(gate, beta)) * dp_sigmoid(gate) * (lbeta * dp_tanh(dp_div(up, lbeta)));
}

// Lane partials of M x T dot products over a slice of K:
//   acc[m][t] += sum over this lane's vectors v of w[m][8v .. 8v+7] . x[t][8v .. 8v+7]
// for v = v0 + lane + 32*i, i < kIters, v < v_end. x[t] == nullptr masks activation row t (no loads,
// no FMAs; acc[.][t] unchanged). The weight loads of kUnroll iterations are issued before any of them
// is used, so each lane keeps M*kUnroll 16-byte loads in flight.
template <int T, int M, int kIters>
__device__ __forceinline__ void dp_dot_rows(const dp_bf16* const (&w)[M],  // M rows, each [K] bf16
                                            const dp_bf16* const (&x)[T],  // T rows, each [K] bf16, or null
                                            int v0, int v_end, int lane,
                                            float (&acc)[M][T]) {          // [M, T] fp32 lane partials
  constexpr int kUnroll = kIters < 4 ? kIters : 4;
  for (int i0 = 0; i0 < kIters; i0 += kUnroll) {
    dp_u32x4 wv[kUnroll][M];  // [kUnroll, M] 16-byte weight vectors in flight
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int v = v0 + lane + DP_GROUP * (i0 + j);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (i0 + j < kIters && v < v_end) {
          wv[j][m] = dp_load16(w[m] + 8 * v);
        } else {
          wv[j][m].x = wv[j][m].y = wv[j][m].z = wv[j][m].w = 0u;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int v = v0 + lane + DP_GROUP * (i0 + j);
      if (i0 + j >= kIters || v >= v_end) continue;
      float wf[M][8];  // [M, 8] fp32
#pragma unroll
      for (int m = 0; m < M; ++m) dp_unpack8_bf16(wv[j][m], wf[m]);
#pragma unroll
      for (int t = 0; t < T; ++t) {
        if (!x[t]) continue;
        float xf[8];  // [8] fp32
        dp_unpack8_bf16(dp_load16(x[t] + 8 * v), xf);
#pragma unroll
        for (int m = 0; m < M; ++m)
#pragma unroll
          for (int k = 0; k < 8; ++k) acc[m][t] += wf[m][k] * xf[k];
      }
    }
  }
}

// Sums every acc[m][t] over the group's lanes (all lanes get the totals). Uniform control flow.
template <int T, int M>
__device__ __forceinline__ void dp_group_reduce(float (&acc)[M][T]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[m][t] = dp_group_sum(acc[m][t]);
}

// The geometry of one GEMM-shaped block: 8 groups = (8/S) row slots x S K-slices, M rows per slot.
template <int K, int M, int S>
struct dp_gemm_geometry {
  static_assert(K % 8 == 0, "gemm: K must be a multiple of 8 (16-byte bf16 vectors)");
  static_assert(S == 1 || S == 2 || S == 4 || S == 8, "gemm: split-K must divide the 8 groups");
  static constexpr int kSlots = DP_GEMM_GROUPS / S;          // row slots per block
  static constexpr int kRows = kSlots * M;                   // weight rows per block (RB)
  static constexpr int kVecs = K / 8;                        // 16-byte vectors per row
  static constexpr int kSliceVecs = (kVecs + S - 1) / S;     // vectors per K-slice
  static constexpr int kIters = (kSliceVecs + DP_GROUP - 1) / DP_GROUP;  // per lane
};

// Block-level dot products: for the group's M rows w[m] (row slot = group / S, K-slice = group % S),
// computes the full dot products with every activation row and leaves them in shared memory:
//   out_smem[(slot*M + m)*T + t] = w_row . x[t]   (fp32), valid after the call (ends with a barrier).
// Rows of a slot beyond the matrix must still be given a readable row (the caller repeats a valid one
// and ignores its result), because every lane takes part in the reductions.
template <int T, int K, int M, int S>
__device__ __forceinline__ void dp_block_dot(const dp_bf16* const (&w)[M],  // this group's M rows, [K] bf16 each
                                             const dp_bf16* const (&x)[T],  // [T] rows of [K] bf16, or null
                                             float* partial,                // smem [8, M, T] fp32
                                             float* out_smem) {             // smem [RB, T] fp32
  typedef dp_gemm_geometry<K, M, S> G;
  const int group = (int)threadIdx.x / DP_GROUP;
  const int lane = (int)threadIdx.x % DP_GROUP;
  const int slice = group % S;
  const int v0 = slice * G::kSliceVecs;
  const int v_end = (v0 + G::kSliceVecs < G::kVecs) ? v0 + G::kSliceVecs : G::kVecs;

  float acc[M][T];  // [M, T] fp32 lane partials
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[m][t] = 0.0f;
  dp_dot_rows<T, M, G::kIters>(w, x, v0, v_end, lane, acc);
  dp_group_reduce<T, M>(acc);
  if (lane == 0) {
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int t = 0; t < T; ++t) partial[(group * M + m) * T + t] = acc[m][t];
  }
  __syncthreads();
  // Fixed-order sum of the S K-slices of every (row, t).
  for (int i = (int)threadIdx.x; i < G::kRows * T; i += DP_GEMM_THREADS) {
    const int t = i % T;
    const int m = (i / T) % M;
    const int slot = i / (T * M);
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < S; ++k) s += partial[((slot * S + k) * M + m) * T + t];
    out_smem[i] = s;
  }
  __syncthreads();
}

// ---------------------------------------------------------------------------------------------------
// The GEMM op: up to six weight matrices that read the same input, stacked in one launch (the KDA
// q/k/v/f_a/g_a/b projections, MLA q/kv_a, a single o_proj or down_proj, the MoE router).
//
//   out[t, c_s + n] = sum_k x[t, k] * w_s[n, k]     for segment s, n < N_s, c_s = N_0 + ... + N_{s-1}
//
// Segments with N_s = 0 are absent (only trailing ones may be). The output row is the concatenation of
// the segments: out is [T, Ntot] with Ntot = N_0 + ... + N_5. kOutF32 selects fp32 output (router
// logits) instead of bf16 (rounded to nearest even, as torch stores a bf16 GEMM output).
//
// Launch: grid = sum over segments of ceil(N_s / RB) blocks (segment 0's tiles first), block 256.
template <int T, int K, int N0, int N1, int N2, int N3, int N4, int N5, int kOutF32, int M, int S>
__device__ __forceinline__ void dp_gemm(const dp_bf16* __restrict__ x,  // [T, K] bf16
                                        void* __restrict__ out,          // [T, Ntot] bf16 (fp32 if kOutF32)
                                        const dp_bf16* __restrict__ w0,  // [N0, K] bf16
                                        const dp_bf16* __restrict__ w1 = nullptr,  // [N1, K] bf16
                                        const dp_bf16* __restrict__ w2 = nullptr,  // [N2, K] bf16
                                        const dp_bf16* __restrict__ w3 = nullptr,  // [N3, K] bf16
                                        const dp_bf16* __restrict__ w4 = nullptr,  // [N4, K] bf16
                                        const dp_bf16* __restrict__ w5 = nullptr) {  // [N5, K] bf16
  typedef dp_gemm_geometry<K, M, S> G;
  constexpr int kNtot = N0 + N1 + N2 + N3 + N4 + N5;
  static_assert(N0 > 0, "gemm: segment 0 must have rows");
  __shared__ float partial[DP_GEMM_GROUPS * M * T];  // [8, M, T] fp32 split-K partials
  __shared__ float result[G::kRows * T];             // [RB, T] fp32 dot products of this block

  // Which segment and tile this block computes (unrolled over the six compile-time segments).
  const int ns[6] = {N0, N1, N2, N3, N4, N5};
  const dp_bf16* const ws[6] = {w0, w1, w2, w3, w4, w5};
  int b = (int)blockIdx.x, col0 = 0, n_seg = 0;
  const dp_bf16* wseg = w0;
  bool found = false;
#pragma unroll
  for (int s = 0; s < 6; ++s) {
    const int tiles = (ns[s] + G::kRows - 1) / G::kRows;
    if (!found) {
      if (b < tiles) {
        found = true;
        n_seg = ns[s];
        wseg = ws[s];
      } else {
        b -= tiles;
        col0 += ns[s];
      }
    }
  }
  if (!found) return;  // a grid larger than the tiles: whole block leaves together
  const int row0 = b * G::kRows;

  const int slot = (int)threadIdx.x / DP_GROUP / S;
  const dp_bf16* w[M];  // this group's rows; rows past the matrix re-read row 0 and are dropped
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int r = row0 + slot * M + m;
    w[m] = wseg + (dp_u64)(r < n_seg ? r : 0) * K;
  }
  const dp_bf16* xr[T];
#pragma unroll
  for (int t = 0; t < T; ++t) xr[t] = x + (dp_u64)t * K;
  dp_block_dot<T, K, M, S>(w, xr, partial, result);

  for (int i = (int)threadIdx.x; i < G::kRows * T; i += DP_GEMM_THREADS) {
    const int t = i % T;
    const int r = row0 + i / T;
    if (r >= n_seg) continue;
    const dp_u64 o = (dp_u64)t * kNtot + col0 + r;
    if (kOutF32)
      ((float*)out)[o] = result[i];
    else
      ((dp_bf16*)out)[o] = dp_f32_to_bf16(result[i]);
  }
}
