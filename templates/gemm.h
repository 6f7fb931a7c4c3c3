// gemm.h: skinny bf16 GEMM for the few rows of a decode step, y = x W^T, and the pieces the MoE and
// MLP kernels (moe.h) build on.
//
// Decode multiplies T = W*q activation rows (1..64) by weight matrices of thousands of rows: the
// weights are read exactly once and dominate the time, so the kernels are organised around streaming
// weight rows with 16-byte loads, and the T activation rows ride along (they stay in L1/L2).
//
// Work split. A block of 256 threads is 8 groups of 32 lanes (a warp on NVIDIA, half a wavefront on
// AMD gfx9: everything below reduces within 32-lane groups, so one source serves both). A group owns a
// slot of 16*MT weight rows and one of S slices of K; the block therefore covers RB = (8/S)*16*MT rows.
// S > 1 is the split-K for short matrices (few rows, long K), so that they still spread over enough
// blocks. The split-K partials are combined in shared memory in a fixed order: results are
// deterministic.
//
// NVIDIA: each warp multiplies its weight rows by the activation rows on the tensor cores (bf16 in,
// fp32 accumulation; dp_mma_rows), every weight byte loaded once with 16-byte loads straight into the
// operand registers. With T activation rows the lane-FMA formulation spends T FMAs and an activation
// load per weight element and runs out of L1 bandwidth and issue slots long before HBM bandwidth at
// T = 8; on the tensor cores the activation loads fall to a half of the weight loads and the
// arithmetic disappears from the profile. AMD (untested on hardware): the lane-FMA loop below (lane l
// reads 16-byte vectors l, l+32, ... of its slice of each row and accumulates fp32 partial dot products
// against the same vectors of every activation row; a butterfly over the group sums them).
#pragma once

#include "vendor.h"

// Launch bounds of the decode ops' entry points: blocks of at most n threads, and on NVIDIA at least one
// resident block per SM. Without the second number ptxas may cap registers to fit more blocks and
// spill a few values to local memory instead (seen: 12 bytes at 64 registers, where 71 fit without);
// these kernels are bounded by memory, not by occupancy beyond one or two blocks.
#if DP_VENDOR_NVIDIA
#define DP_KERNEL_BOUNDS(n) __launch_bounds__(n, 1)
#define DP_KERNEL_BOUNDS_2(n) __launch_bounds__(n, 2)  // two resident blocks per SM (at most 128 registers)
#else
#define DP_KERNEL_BOUNDS(n) DP_LAUNCH_BOUNDS(n)
#define DP_KERNEL_BOUNDS_2(n) DP_LAUNCH_BOUNDS(n)
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
      if constexpr (T == 1) {
        // One activation row (many weight rows, dp_fma_rows): the weight rows are unpacked one at a
        // time, so that the loads of the others stay packed in their registers. (Written for any T, as
        // measured on the H200; several rows take the branch below.)
        float xf[T][8];  // [T, 8] fp32 activation vector (a masked row is never read)
#pragma unroll
        for (int t = 0; t < T; ++t)
          if (x[t]) dp_unpack8_bf16(dp_load16(x[t] + 8 * v), xf[t]);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float wf[8];  // [8] fp32
          dp_unpack8_bf16(wv[j][m], wf);
#pragma unroll
          for (int t = 0; t < T; ++t) {
            if (!x[t]) continue;
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[m][t] += wf[k] * xf[t][k];
          }
        }
      } else {
        // Several activation rows (few weight rows): the weight rows unpacked once, each activation
        // row loaded and used in turn (all of them at once spill at 16 rows on gfx942).
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
}

// Sums every acc[m][t] over the group's lanes (all lanes get the totals). Uniform control flow.
template <int T, int M>
__device__ __forceinline__ void dp_group_reduce(float (&acc)[M][T]) {
#pragma unroll
  for (int m = 0; m < M; ++m)
#pragma unroll
    for (int t = 0; t < T; ++t) acc[m][t] = dp_group_sum(acc[m][t]);
}

// The geometry of one GEMM-shaped block: 8 groups = (8/S) row slots x S K-slices; a slot holds
// 16*MT weight rows (MT tiles of 16 rows, the height of one tensor-core tile on NVIDIA). K is walked
// in chunks of 32 elements (four 16-byte vectors per row).
template <int K, int MT, int S>
struct dp_gemm_geometry {
  static_assert(K % 8 == 0, "gemm: K must be a multiple of 8 (16-byte bf16 vectors)");
  static_assert(S == 1 || S == 2 || S == 4 || S == 8, "gemm: split-K must divide the 8 groups");
  static_assert(MT >= 1 && MT <= 4, "gemm: 1..4 row tiles per slot");
  static constexpr int kSlots = DP_GEMM_GROUPS / S;          // row slots per block
  static constexpr int kSlotRows = 16 * MT;                  // weight rows per slot
  static constexpr int kRows = kSlots * kSlotRows;           // weight rows per block (RB)
  static constexpr int kVecs = K / 8;                        // 16-byte vectors per row
  static constexpr int kChunks = (K + 31) / 32;              // 32-element chunks per row
  static constexpr int kSliceChunks = (kChunks + S - 1) / S; // chunks per K-slice
};

#if DP_VENDOR_NVIDIA
// One bf16 tensor-core step, D = A B + D: A 16x16 (row), B 16x8 (column), fp32 accumulators.
__device__ __forceinline__ void dp_mma_16816(float (&c)[4], dp_u32 a0, dp_u32 a1, dp_u32 a2, dp_u32 a3, dp_u32 b0,
                                             dp_u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Tensor-core dot products of one warp: MT tiles of 16 weight rows against NT tiles of 8 activation
// rows over the chunks [c0, c_end) of K. The weight rows are the A operand, the activation rows the B
// operand. Lane (g = lane/4, q = lane%4) loads 16 bytes of weight rows g and g+8 of every tile and of
// activation row g of every tile, all at elements [32c + 8q, 32c + 8q + 8): the sum over K does not
// care in which order the products are taken, so the four 32-bit words a lane loads are used as its
// fragments of two 16-deep steps (words 0,1 for the first, 2,3 for the second), the same way for A and
// B, and no shuffle or shared memory is needed. Accumulator layout (per tile pair): c[0], c[1] = rows
// g, activations 2q, 2q+1; c[2], c[3] = row g+8, the same activations.
//   wrow(m): pointer to weight row m (0 <= m < 16*MT) of the slot, [K] bf16
//   xrow(t): pointer to activation row t (0 <= t < 8*NT), [K] bf16, or null (a zero row)
template <int K, int MT, int NT, typename WRow, typename XRow>
__device__ __forceinline__ void dp_mma_rows(WRow wrow, XRow xrow, int c0, int c_end, float (&acc)[MT][NT][4]) {
  constexpr int kUnroll = (NT <= 2 ? 8 : 4) / MT > 0 ? (NT <= 2 ? 8 : 4) / MT : 1;  // chunks of loads in flight
  const int lane = (int)dp_lane_id() % DP_GROUP, g = lane / 4, q = lane % 4;
  const dp_bf16* wp[MT][2];  // rows g, g+8 of each tile, at this lane's column
  const dp_bf16* xp[NT];     // row g of each activation tile, or null
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    wp[mt][0] = wrow(16 * mt + g) + 8 * q;
    wp[mt][1] = wrow(16 * mt + g + 8) + 8 * q;
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const dp_bf16* p = xrow(8 * nt + g);
    xp[nt] = p ? p + 8 * q : nullptr;
  }
  for (int cb = c0; cb < c_end; cb += kUnroll) {
    dp_u32x4 wv[kUnroll][MT][2];  // weight vectors in flight
    dp_u32x4 xv[kUnroll][NT];     // activation vectors
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = cb + u;
      const bool in = c < c_end && 32 * c + 8 * q < K;
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          if (in) {
            wv[u][mt][h] = dp_load16(wp[mt][h] + 32 * c);
          } else {
            wv[u][mt][h].x = wv[u][mt][h].y = wv[u][mt][h].z = wv[u][mt][h].w = 0u;
          }
        }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        if (in && xp[nt]) {
          xv[u][nt] = dp_load16(xp[nt] + 32 * c);
        } else {
          xv[u][nt].x = xv[u][nt].y = xv[u][nt].z = xv[u][nt].w = 0u;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          dp_mma_16816(acc[mt][nt], wv[u][mt][0].x, wv[u][mt][1].x, wv[u][mt][0].y, wv[u][mt][1].y, xv[u][nt].x,
                       xv[u][nt].y);
          dp_mma_16816(acc[mt][nt], wv[u][mt][0].z, wv[u][mt][1].z, wv[u][mt][0].w, wv[u][mt][1].w, xv[u][nt].z,
                       xv[u][nt].w);
        }
  }
}
#endif

// Rows the lane-FMA loop walks at a time (dp_dot_rows' M): one activation row leaves each lane nothing
// to do but stream weights, so it takes as many rows at once as keep about DP_FMA_LOADS 16-byte loads
// in flight per lane (a warp's slot is then walked in fewer dependent bursts; 32 loads, one block per
// SM, measured slower); from two rows, 2 rows.
#ifndef DP_FMA_LOADS
#define DP_FMA_LOADS 16
#endif
template <int T, int RS, int kIters>
__host__ __device__ constexpr int dp_fma_rows() {
  if (T != 1) return 2;
  const int unroll = kIters < 4 ? kIters : 4;  // dp_dot_rows' loads per row in flight
  int rows = 4;
  while (rows * 2 <= RS && rows * 2 * unroll <= DP_FMA_LOADS) rows *= 2;
  return rows;
}

// Block-level dot products: every weight row of the block with every activation row, left in shared
// memory: out_smem[(slot*16*MT + m)*T + t] = wrow(slot, m) . x[t]  (fp32), valid after the call (it ends
// with a barrier). The group's slot is group / S and its K-slice group % S; the S slices are summed in
// a fixed order (deterministic). Rows of a slot beyond the matrix must still be given a readable row
// (the caller repeats a valid one and ignores its result).
//   wrow(slot, m): pointer to row m (< 16*MT) of the slot, [K] bf16
//   xrow(t): pointer to activation row t (< T), [K] bf16, or null (masked: contributes 0)
// NVIDIA with T >= 2: tensor cores (dp_mma_rows). T == 1, and AMD: the lane-FMA loop (dp_dot_rows),
// kFmaRows rows at a time (each lane streams 16-byte vectors of whole row slices: measured faster than
// the tensor-core tile's 64-byte row pieces when one activation row leaves nothing to multiply).
template <int T, int K, int MT, int S, typename WRow, typename XRow>
__device__ __forceinline__ void dp_block_dot(WRow wrow, XRow xrow,
                                             float* partial,     // smem [8, 16*MT, T] fp32
                                             float* out_smem) {  // smem [RB, T] fp32
  typedef dp_gemm_geometry<K, MT, S> G;
  constexpr int RS = G::kSlotRows;
  const int group = (int)threadIdx.x / DP_GROUP;
  const int lane = (int)threadIdx.x % DP_GROUP;
  const int slot = group / S, slice = group % S;
#if DP_VENDOR_NVIDIA
  constexpr bool kMma = T >= 2;
#else
  constexpr bool kMma = false;
#endif
  if constexpr (kMma) {
#if DP_VENDOR_NVIDIA
    constexpr int NT = (T + 7) / 8;
    const int c0 = slice * G::kSliceChunks;
    const int c_end = (c0 + G::kSliceChunks < G::kChunks) ? c0 + G::kSliceChunks : G::kChunks;
    float acc[MT][NT][4];  // [MT, NT, 4] fp32 accumulator fragments
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
    dp_mma_rows<K, MT, NT>([&](int m) { return wrow(slot, m); }, [&](int t) { return t < T ? xrow(t) : nullptr; },
                           c0, c_end, acc);
    const int g = lane / 4, q = lane % 4;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int m = 16 * mt + g + 8 * (k / 2), t = 8 * nt + 2 * q + (k % 2);
          if (t < T) partial[(group * RS + m) * T + t] = acc[mt][nt][k];
        }
#endif
  } else {
    constexpr int kIters = (G::kSliceChunks * 4 + DP_GROUP - 1) / DP_GROUP;
    constexpr int kFmaRows = dp_fma_rows<T, RS, kIters>();
    const int v0 = slice * G::kSliceChunks * 4;
    const int v_end = (v0 + G::kSliceChunks * 4 < G::kVecs) ? v0 + G::kSliceChunks * 4 : G::kVecs;
    const dp_bf16* xr[T];
#pragma unroll
    for (int t = 0; t < T; ++t) xr[t] = xrow(t);
    for (int m0 = 0; m0 < RS; m0 += kFmaRows) {
      const dp_bf16* w[kFmaRows];
#pragma unroll
      for (int m = 0; m < kFmaRows; ++m) w[m] = wrow(slot, m0 + m);
      float acc[kFmaRows][T];  // [rows, T] fp32 lane partials
#pragma unroll
      for (int m = 0; m < kFmaRows; ++m)
#pragma unroll
        for (int t = 0; t < T; ++t) acc[m][t] = 0.0f;
      dp_dot_rows<T, kFmaRows, kIters>(w, xr, v0, v_end, lane, acc);
      dp_group_reduce<T, kFmaRows>(acc);
      if (lane == 0) {
#pragma unroll
        for (int m = 0; m < kFmaRows; ++m)
#pragma unroll
          for (int t = 0; t < T; ++t) partial[(group * RS + m0 + m) * T + t] = acc[m][t];
      }
    }
  }
  __syncthreads();
  // Fixed-order sum of the S K-slices of every (row, t).
  for (int i = (int)threadIdx.x; i < G::kRows * T; i += DP_GEMM_THREADS) {
    const int t = i % T;
    const int m = (i / T) % RS;
    const int sl = i / (T * RS);
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < S; ++k) s += partial[((sl * S + k) * RS + m) * T + t];
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
template <int T, int K, int N0, int N1, int N2, int N3, int N4, int N5, int kOutF32, int MT, int S>
__device__ __forceinline__ void dp_gemm(const dp_bf16* __restrict__ x,  // [T, K] bf16
                                        void* __restrict__ out,          // [T, Ntot] bf16 (fp32 if kOutF32)
                                        const dp_bf16* __restrict__ w0,  // [N0, K] bf16
                                        const dp_bf16* __restrict__ w1 = nullptr,  // [N1, K] bf16
                                        const dp_bf16* __restrict__ w2 = nullptr,  // [N2, K] bf16
                                        const dp_bf16* __restrict__ w3 = nullptr,  // [N3, K] bf16
                                        const dp_bf16* __restrict__ w4 = nullptr,  // [N4, K] bf16
                                        const dp_bf16* __restrict__ w5 = nullptr) {  // [N5, K] bf16
  typedef dp_gemm_geometry<K, MT, S> G;
  constexpr int kNtot = N0 + N1 + N2 + N3 + N4 + N5;
  static_assert(N0 > 0, "gemm: segment 0 must have rows");
  __shared__ float partial[DP_GEMM_GROUPS * G::kSlotRows * T];  // [8, 16*MT, T] fp32 split-K partials
  __shared__ float result[G::kRows * T];                        // [RB, T] fp32 dot products of this block

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

  // Rows past the matrix re-read row 0 and are dropped.
  dp_block_dot<T, K, MT, S>(
      [&](int slot, int m) {
        const int r = row0 + slot * G::kSlotRows + m;
        return wseg + (dp_u64)(r < n_seg ? r : 0) * K;
      },
      [&](int t) { return x + (dp_u64)t * K; }, partial, result);

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
