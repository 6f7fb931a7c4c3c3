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
// these kernels are bounded by memory, not by occupancy beyond one or two blocks. The GEMM-shaped ops
// (gemm, mlp_up, moe_up, moe_down) up to 8 activation rows take DP_KERNEL_BOUNDS_2 (codegen's
// gemv_bounds): their grids have more blocks than SMs (144 blocks of 16 rows for a 2304-row matrix on
// 132 SMs), so one block per SM left the rest to a second wave; the 48B-shaped e4m3 down_proj at 130
// registers took 14.4 us at width 1 against 11.6 us capped at 128 (H200, 2026-12-03). None of them
// spills at the cap up to 8 rows; from 9 rows some do, and they keep one block per SM.
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

// ---------------------------------------------------------------------------------------------------
// FP8 block-quantized weights (DeepSeek-style: e4m3 values, one fp32 scale per 128 x 128 block; the real
// weight is e4m3 * scale). A weight row is read as 16 e4m3 per 16-byte load, and the products of every
// 128-column block are summed before they meet the block's scale (fp32), so the dequantised weights are
// never rounded: the kernels compute the same sums as bf16 kernels over the exact dequantised weights.
#define DP_FP8_BLOCK 128

// Row r of an e4m3 matrix [N, K] and the scales of its 128-row block ([ceil(N/128), ceil(K/128)] fp32):
// column c's weight is w[c] * s[c / 128].
struct dp_fp8_row {
  const dp_u8* w;
  const float* s;
};
template <typename R>
struct dp_is_fp8_row {
  static constexpr bool value = false;
};
template <>
struct dp_is_fp8_row<dp_fp8_row> {
  static constexpr bool value = true;
};
template <int K>
__device__ __forceinline__ dp_fp8_row dp_fp8_matrix_row(const dp_u8* w, const float* s, int r) {
  return dp_fp8_row{w + (dp_u64)r * K, s + (dp_u64)(r / DP_FP8_BLOCK) * ((K + DP_FP8_BLOCK - 1) / DP_FP8_BLOCK)};
}

// Four e4m3 (one word, element 0 in the low byte) as exact fp32 values. NVIDIA: the hardware
// conversion to f16 (exact: f16 holds every e4m3 value, subnormals included as normals), then to
// fp32. Portable: exponent rebias for normal values (e4m3 bias 7, fp32 127), m * 2^-9 for subnormals.
__device__ __forceinline__ void dp_e4m3x4_to_f32(dp_u32 w, float out[4]) {
#if DP_VENDOR_NVIDIA
  dp_u32 h[2];
  asm("{ .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.rn.f16x2.e4m3x2 %0, a;\n cvt.rn.f16x2.e4m3x2 %1, b;\n}"
      : "=r"(h[0]), "=r"(h[1])
      : "r"(w));
#pragma unroll
  for (int k = 0; k < 2; ++k)
    asm("{ .reg .b16 a, b;\n mov.b32 {a, b}, %2;\n cvt.f32.f16 %0, a;\n cvt.f32.f16 %1, b;\n}"
        : "=f"(out[2 * k]), "=f"(out[2 * k + 1])
        : "r"(h[k]));
#else
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const dp_u32 b = (w >> (8 * k)) & 0xffu, mag = b & 0x7fu;
    const float f = mag < 8u ? (float)mag * 0.001953125f : dp_bits_to_f32((mag << 20) + (120u << 23));
    out[k] = (b & 0x80u) ? -f : f;
  }
#endif
}
// Sixteen e4m3 of a 16-byte vector as fp32.
__device__ __forceinline__ void dp_unpack16_e4m3(dp_u32x4 v, float out[16]) {
  dp_e4m3x4_to_f32(v.x, out);
  dp_e4m3x4_to_f32(v.y, out + 4);
  dp_e4m3x4_to_f32(v.z, out + 8);
  dp_e4m3x4_to_f32(v.w, out + 12);
}

#if DP_VENDOR_NVIDIA
// Two bf16 pairs times two bf16 pairs (halves apart), rounded to nearest: exact for the power-of-two
// factors the conversions below use. Subnormal operands are not flushed.
__device__ __forceinline__ dp_u32 dp_mul_bf16x2(dp_u32 a, dp_u32 b) {
  dp_u32 r;
  asm("mul.rn.bf16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
  return r;
}

// Four e4m3 (one word, element 0 in the low byte) as two bf16x2 words holding their exact values:
// lo = elements (0, 2), hi = elements (1, 3) (low half, high half). A byte's sign goes to bit 15 of its
// half and its seven exponent-mantissa bits to bits 10..4: bf16 exponent field = the e4m3 one, mantissa
// = the e4m3 one followed by zeros, so the half holds value * 2^-120 (an e4m3 subnormal becomes a bf16
// subnormal, exactly); one multiply by 2^120 makes every value exact and normal (the smallest e4m3,
// 2^-9, stays far above bf16's normal range's end), so the tensor cores see no subnormal operand.
// About seven integer shift and mask instructions and two bf16x2 multiplies for four values (the
// hardware e4m3 conversion this replaces took ten integer and conversion instructions). The callers
// pair the activations the same way (dp_pair_even_odd).
__device__ __forceinline__ void dp_e4m3x4_to_bf16x4(dp_u32 w, dp_u32& lo, dp_u32& hi) {
  const dp_u32 k2p120 = 0x7B807B80u;  // bf16x2 (2^120, 2^120)
  hi = dp_mul_bf16x2((w & 0x80008000u) | ((w >> 4) & 0x07F007F0u), k2p120);
  lo = dp_mul_bf16x2(((w << 8) & 0x80008000u) | ((w << 4) & 0x07F007F0u), k2p120);
}
// Four bf16 in two words (elements 0, 1 in a; 2, 3 in b) paired as dp_e4m3x4_to_bf16x4 pairs the
// weights: lo = (0, 2), hi = (1, 3).
__device__ __forceinline__ void dp_pair_even_odd(dp_u32 a, dp_u32 b, dp_u32& lo, dp_u32& hi) {
  lo = __byte_perm(a, b, 0x5410u);
  hi = __byte_perm(a, b, 0x7632u);
}
#endif

// Lane partials over e4m3 rows, as dp_dot_rows over vectors of 16 columns: v = v0 + lane + 32*i,
// i < kIters, v < v_end; each vector's products are summed, then scaled by its block's scale (v / 8).
template <int T, int M, int kIters>
__device__ __forceinline__ void dp_dot_rows_fp8(const dp_fp8_row (&w)[M], const dp_bf16* const (&x)[T], int v0,
                                                int v_end, int lane, float (&acc)[M][T]) {
  constexpr int kUnroll = kIters < 4 ? kIters : 4;
  for (int i0 = 0; i0 < kIters; i0 += kUnroll) {
    dp_u32x4 wv[kUnroll][M];
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int v = v0 + lane + DP_GROUP * (i0 + j);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        if (i0 + j < kIters && v < v_end) {
          wv[j][m] = dp_load16(w[m].w + 16 * v);
        } else {
          wv[j][m].x = wv[j][m].y = wv[j][m].z = wv[j][m].w = 0u;
        }
      }
    }
#pragma unroll
    for (int j = 0; j < kUnroll; ++j) {
      const int v = v0 + lane + DP_GROUP * (i0 + j);
      if (i0 + j >= kIters || v >= v_end) continue;
      // The weight vectors converted once, each activation row loaded and used in turn.
      float wf[M][16];  // [M, 16] fp32
      float sc[M];      // their block scales
#pragma unroll
      for (int m = 0; m < M; ++m) {
        dp_unpack16_e4m3(wv[j][m], wf[m]);
        sc[m] = w[m].s[v / 8];
      }
#pragma unroll
      for (int t = 0; t < T; ++t) {
        if (!x[t]) continue;
        float xf[16];
        dp_unpack8_bf16(dp_load16(x[t] + 16 * v), xf);
        dp_unpack8_bf16(dp_load16(x[t] + 16 * v + 8), xf + 8);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          float p = 0.0f;
#pragma unroll
          for (int k = 0; k < 16; ++k) p += wf[m][k] * xf[k];
          acc[m][t] += p * sc[m];
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

// The activation operand of one half (h = 0, 1) of a 128-column block for the e4m3 tensor-core step:
// lane (g, q) loads columns col = 128b + 64h + 16q .. +16 of activation row 8nt + g (xp[nt]; null:
// zeros), with coherent loads when kCoherent (after a dependency wait in the same kernel), and pairs
// them as the weights are (xw). `in` false (past the range or past K): zeros.
template <int NT, int kCoherent>
__device__ __forceinline__ void dp_load_x_half_fp8(const dp_bf16* const (&xp)[NT], int col, bool in,
                                                   dp_u32 (&xw)[NT][8]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    dp_u32x4 x0, x1;
    if (in && xp[nt]) {
      x0 = kCoherent ? dp_load16_coherent(xp[nt] + col) : dp_load16(xp[nt] + col);
      x1 = kCoherent ? dp_load16_coherent(xp[nt] + col + 8) : dp_load16(xp[nt] + col + 8);
    } else {
      x0.x = x0.y = x0.z = x0.w = 0u;
      x1 = x0;
    }
    dp_pair_even_odd(x0.x, x0.y, xw[nt][0], xw[nt][1]);
    dp_pair_even_odd(x0.z, x0.w, xw[nt][2], xw[nt][3]);
    dp_pair_even_odd(x1.x, x1.y, xw[nt][4], xw[nt][5]);
    dp_pair_even_odd(x1.z, x1.w, xw[nt][6], xw[nt][7]);
  }
}
// The products of one warp's e4m3 tile with its activation tiles over one half h of a 128-column block,
// unscaled, added to blk: wv holds the lane's weight vectors (rows g and g + 8 of each tile, columns
// 128b + 64h + 16q for h = 0, 1), here read from a shared-memory ring, and xw the activation columns of
// half h (dp_load_x_half_fp8); weights past K must be zero. (dp_mma_rows_fp8 below keeps its own copy of
// these two steps: through a helper, the measured kernels' register allocation changed, and with it
// their machine code.)
template <int MT, int NT>
__device__ __forceinline__ void dp_mma_half_fp8(const dp_u32x4 (&wv)[MT][2][2], const dp_u32 (&xw)[NT][8], int h,
                                                float (&blk)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    dp_u32 a[2][8];  // rows g, g+8: 16 columns as bf16 pairs (exact values)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const dp_u32x4 v = wv[mt][r][h];
      dp_e4m3x4_to_bf16x4(v.x, a[r][0], a[r][1]);
      dp_e4m3x4_to_bf16x4(v.y, a[r][2], a[r][3]);
      dp_e4m3x4_to_bf16x4(v.z, a[r][4], a[r][5]);
      dp_e4m3x4_to_bf16x4(v.w, a[r][6], a[r][7]);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        dp_mma_16816(blk[mt][nt], a[0][2 * i], a[1][2 * i], a[0][2 * i + 1], a[1][2 * i + 1], xw[nt][2 * i],
                     xw[nt][2 * i + 1]);
  }
}

// Tensor-core dot products of one warp over e4m3 weight rows (dp_fp8_row): MT tiles of 16 rows against
// NT tiles of 8 activation rows over the 128-column blocks [b0, b_end) of K; like dp_mma_rows, lane
// (g, q) supplies the same columns for both operands, here [128b + 64h + 16q, +16) for h = 0, 1 (one
// 16-byte load of each weight row, two of each activation row): converted to bf16, each load is four
// 16-deep steps. Every block's products are summed apart and added to acc times the rows' block scale,
// c[0], c[1] with row g's scale, c[2], c[3] with row g + 8's (the two may belong to different matrices).
//   wrow(m): dp_fp8_row of weight row m (0 <= m < 16*MT); xrow(t): [K] bf16 or null (a zero row)
//   kSpan: b_end - b0 where every caller's range has that many blocks (at most; 0: not known), which
//   picks how many blocks' loads a lane issues at once (dp_fp8_unroll).
// A lane loads kUnroll blocks, then converts and multiplies them, then loads the next kUnroll: the loads
// of a round wait for the previous round's arithmetic, so the rounds a range takes are latency the
// kernel pays. kUnroll 2 by default (one tile); 3 where the range is an odd multiple of 3 blocks (9:
// three full rounds instead of five, the last half empty; the 48B-shaped down_proj 11.4 -> 9.7 us at
// width 1, 12.2 -> 10.0 us at width 8), all 4 where it is 4 blocks (one round; the o_proj 6.0 -> 5.8
// us). Measured on an H200 with the same outputs bit for bit (2026-12-03, tests/results/
// gpu-2026-12-03d); 3 on 5-block ranges and 4 on longer ones were slower (more registers, no fewer
// rounds).
template <int MT, int kSpan>
__host__ __device__ constexpr int dp_fp8_unroll() {
  if (MT != 1) return 1;
  if (kSpan == 4) return 4;
  if (kSpan > 0 && kSpan % 3 == 0 && kSpan % 2 != 0) return 3;
  return 2;
}
// kEarly 1 (the entry point only triggered its dependents, vendor.h): the first round of weight loads
// is issued before the wait for the previous kernel, and the activations are read coherently after it.
template <int K, int MT, int NT, int kSpan = 0, int kEarly = 0, typename WRow, typename XRow>
__device__ __forceinline__ void dp_mma_rows_fp8(WRow wrow, XRow xrow, int b0, int b_end, float (&acc)[MT][NT][4]) {
  static_assert(K % 16 == 0, "fp8 weights: K must be a multiple of 16 (16-byte e4m3 vectors)");
  constexpr int kUnroll = dp_fp8_unroll<MT, kSpan>();  // blocks of loads in flight
  const int lane = (int)dp_lane_id() % DP_GROUP, g = lane / 4, q = lane % 4;
  dp_fp8_row wr[MT][2];  // rows g, g+8 of each tile
  const dp_bf16* xp[NT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    wr[mt][0] = wrow(16 * mt + g);
    wr[mt][1] = wrow(16 * mt + g + 8);
  }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xp[nt] = xrow(8 * nt + g);
  for (int bb = b0; bb < b_end; bb += kUnroll) {
    dp_u32x4 wv[kUnroll][MT][2][2];  // [block, tile, row g / g+8, column half]
    float sc[kUnroll][MT][2];        // block scales of rows g, g+8
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int b = bb + u;
          sc[u][mt][r] = b < b_end ? wr[mt][r].s[b] : 0.0f;
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int col = DP_FP8_BLOCK * b + 64 * h + 16 * q;
            if (b < b_end && col < K) {
              wv[u][mt][r][h] = dp_load16(wr[mt][r].w + col);
            } else {
              wv[u][mt][r][h].x = wv[u][mt][r][h].y = wv[u][mt][r][h].z = wv[u][mt][r][h].w = 0u;
            }
          }
        }
    if constexpr (kEarly != 0) dp_grid_dependency_wait();  // after the first round: a no-op later
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int b = bb + u;
      float blk[MT][NT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) blk[mt][nt][0] = blk[mt][nt][1] = blk[mt][nt][2] = blk[mt][nt][3] = 0.0f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = DP_FP8_BLOCK * b + 64 * h + 16 * q;
        const bool in = b < b_end && col < K;
        dp_u32 xw[NT][8];  // activation row g's 16 columns as bf16 pairs, paired as the weights
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          dp_u32x4 x0, x1;
          if (in && xp[nt]) {
            x0 = kEarly ? dp_load16_coherent(xp[nt] + col) : dp_load16(xp[nt] + col);
            x1 = kEarly ? dp_load16_coherent(xp[nt] + col + 8) : dp_load16(xp[nt] + col + 8);
          } else {
            x0.x = x0.y = x0.z = x0.w = 0u;
            x1 = x0;
          }
          dp_pair_even_odd(x0.x, x0.y, xw[nt][0], xw[nt][1]);
          dp_pair_even_odd(x0.z, x0.w, xw[nt][2], xw[nt][3]);
          dp_pair_even_odd(x1.x, x1.y, xw[nt][4], xw[nt][5]);
          dp_pair_even_odd(x1.z, x1.w, xw[nt][6], xw[nt][7]);
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          dp_u32 a[2][8];  // rows g, g+8: 16 columns as bf16 pairs (exact values)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const dp_u32x4 v = wv[u][mt][r][h];
            dp_e4m3x4_to_bf16x4(v.x, a[r][0], a[r][1]);
            dp_e4m3x4_to_bf16x4(v.y, a[r][2], a[r][3]);
            dp_e4m3x4_to_bf16x4(v.z, a[r][4], a[r][5]);
            dp_e4m3x4_to_bf16x4(v.w, a[r][6], a[r][7]);
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i)
              dp_mma_16816(blk[mt][nt], a[0][2 * i], a[1][2 * i], a[0][2 * i + 1], a[1][2 * i + 1], xw[nt][2 * i],
                           xw[nt][2 * i + 1]);
        }
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int k = 0; k < 4; ++k) acc[mt][nt][k] += blk[mt][nt][k] * sc[u][mt][k / 2];
    }
  }
}

// A block's weight rows streamed through a ring of stages in shared memory (sm_90), filled by bulk
// asynchronous copies: a stage holds kRows rows of up to kCols bytes each, one copy per row, issued by
// warp 0. A row's bytes are padded by 64 in the ring (kRowBytes), so that rows g and g + 1, which one
// quarter-warp reads together in the tensor-core fragment layout, lie half a 128-byte line apart: 16-byte
// reads at the same column of 8 rows are free of bank conflicts. The first kStages stages are issued
// before the dependency wait when kEarly (their rows must not depend on the previous kernel); each
// stage is refilled once every warp is done with it (a block barrier). Every thread of the block calls
// it, with the same arguments. The ring is the kernel's dynamic shared memory, kStages * kStageBytes
// bytes (dp_ring_bytes): the launch must give at least that much.
//   stages: how many stages the block streams, in order
//   cols(j): bytes of every row of stage j (a multiple of 16, at most kCols)
//   row(j, i): global address of row i of stage j (16-byte aligned)
//   consume(j, stage): every warp, once stage j has landed (`stage`: its first row in the ring)
template <int kRows, int kCols>
struct dp_ring_geometry {
  static constexpr int kRowBytes = kCols + 64;
  static constexpr int kStageBytes = kRows * kRowBytes;
};
template <int kRows, int kCols, int kStages>
__host__ __device__ constexpr int dp_ring_bytes() {
  return kStages * dp_ring_geometry<kRows, kCols>::kStageBytes;
}
// The rings of dp_warp_ring_stream (below): one per warp of the block.
template <int kRows, int kCols, int kStages>
__host__ __device__ constexpr int dp_warp_ring_bytes() {
  return DP_GEMM_GROUPS * dp_ring_bytes<kRows, kCols, kStages>();
}
#if DP_HAS_BULK_COPY
template <int kRows, int kCols, int kStages, int kEarly, typename Cols, typename Row, typename Consume>
__device__ __forceinline__ void dp_ring_stream(int stages, Cols cols, Row row, Consume consume) {
  typedef dp_ring_geometry<kRows, kCols> R;
  static_assert(kCols % 16 == 0 && kStages >= 1, "ring: 16-byte rows, at least one stage");
  extern __shared__ __align__(128) unsigned char dp_ring[];  // [kStages][kRows][kRowBytes]
  __shared__ __align__(8) dp_u64 full[kStages];                // per stage: its bytes have landed
  const int group = (int)threadIdx.x / DP_GROUP, lane = (int)threadIdx.x % DP_GROUP;
  // A launch with less dynamic shared memory than the ring stops here (a launch error the host sees),
  // rather than copying past the block's shared memory.
  if (dp_dynamic_smem_bytes() < (dp_u32)(kStages * R::kStageBytes)) __trap();
  auto issue = [&](int j) {  // warp 0: stage j's copies into its slot
    const dp_u32 n = (dp_u32)cols(j);
    unsigned char* st = dp_ring + (j % kStages) * R::kStageBytes;
    dp_u64* bar = &full[j % kStages];
    if (lane == 0) dp_mbar_expect_bytes(bar, n * (dp_u32)kRows);
    __syncwarp();
    for (int i = lane; i < kRows; i += DP_GROUP) dp_bulk_copy_shared(st + i * R::kRowBytes, row(j, i), n, bar);
  };
  if (threadIdx.x == 0) {
    for (int k = 0; k < kStages; ++k) dp_mbar_init(&full[k]);
    dp_mbar_init_fence();
  }
  __syncthreads();
  if (group == 0)
    for (int j = 0; j < kStages && j < stages; ++j) issue(j);
  if constexpr (kEarly != 0) dp_grid_dependency_wait();
  for (int j = 0; j < stages; ++j) {
    dp_mbar_wait(&full[j % kStages], (dp_u32)(j / kStages) & 1u);
    consume(j, (const unsigned char*)dp_ring + (j % kStages) * R::kStageBytes);
    if (j + kStages < stages) {
      __syncthreads();  // every warp is done with stage j's slot
      if (group == 0) issue(j + kStages);
    }
  }
}

// The same for one warp on its own (sm_90): the warp's rows stream through its own ring of kStages
// stages (its slice of the launch's dynamic shared memory, after the slices of the warps before it;
// DP_GEMM_GROUPS slices in all: dp_warp_ring_bytes) with an mbarrier per stage of its own. Lane 0
// announces a stage's bytes, lanes 0..kRows-1 issue its copies, and a stage is refilled once the warp is
// done with it (a warp barrier): no block barrier, so a warp may walk a sequence of tiles of its own,
// and the stream runs on from one tile into the next. Every lane of the warp calls it, with the same
// arguments; cols, row and consume as dp_ring_stream's, consume(j, stage) called by the warp alone.
template <int kRows, int kCols, int kStages, typename Cols, typename Row, typename Consume>
__device__ __forceinline__ void dp_warp_ring_stream(int stages, Cols cols, Row row, Consume consume) {
  typedef dp_ring_geometry<kRows, kCols> R;
  static_assert(kCols % 16 == 0 && kStages >= 1 && kRows <= DP_GROUP, "warp ring: 16-byte rows, one copy a lane");
  extern __shared__ __align__(128) unsigned char dp_ring[];  // [DP_GEMM_GROUPS][kStages][kRows][kRowBytes]
  __shared__ __align__(8) dp_u64 full[DP_GEMM_GROUPS][kStages];  // per warp and stage: its bytes have landed
  const int warp = (int)threadIdx.x / DP_GROUP, lane = (int)threadIdx.x % DP_GROUP;
  if (dp_dynamic_smem_bytes() < (dp_u32)dp_warp_ring_bytes<kRows, kCols, kStages>()) __trap();
  unsigned char* ring = dp_ring + warp * kStages * R::kStageBytes;
  dp_u64* bar = full[warp];
  auto issue = [&](int j) {  // stage j's copies into its slot
    const dp_u32 n = (dp_u32)cols(j);
    unsigned char* st = ring + (j % kStages) * R::kStageBytes;
    if (lane == 0) dp_mbar_expect_bytes(&bar[j % kStages], n * (dp_u32)kRows);
    __syncwarp();
    if (lane < kRows) dp_bulk_copy_shared(st + lane * R::kRowBytes, row(j, lane), n, &bar[j % kStages]);
  };
  if (lane == 0) {
    for (int k = 0; k < kStages; ++k) dp_mbar_init(&bar[k]);
    dp_mbar_init_fence();
  }
  __syncwarp();
  for (int j = 0; j < kStages && j < stages; ++j) issue(j);
  for (int j = 0; j < stages; ++j) {
    dp_mbar_wait(&bar[j % kStages], (dp_u32)(j / kStages) & 1u);
    consume(j, (const unsigned char*)ring + (j % kStages) * R::kStageBytes);
    if (j + kStages < stages) {
      __syncwarp();  // every lane is done with stage j's slot
      issue(j + kStages);
    }
  }
}

// The operands of one 128-column e4m3 block that come from global memory (its activation columns and
// the rows' block scales), loaded one block ahead of the products in the ring loops.
template <int MT, int NT>
struct dp_fp8_block_ops {
  dp_u32 x[2][NT][8];  // per half: dp_load_x_half_fp8
  float sc[MT][2];       // block scales of rows g, g + 8 of each tile
};
// One warp's products over one 128-column e4m3 block of a ring stage: its tile rows (16 MT from
// `first`, the stage's row index of the warp's row 0) at byte column `col` of the stage, against the
// block's activation columns; scaled by the rows' block scales and added to acc. `valid`: the columns
// of the block inside the matrix (at least 128: all); the ring's bytes past them are stale, read as 0.
template <int MT, int NT, int kRowBytes>
__device__ __forceinline__ void dp_mma_ring_block_fp8(const unsigned char* stage, int first, int col, int valid,
                                                      const dp_fp8_block_ops<MT, NT>& ops,
                                                      float (&acc)[MT][NT][4]) {
  const int lane = (int)dp_lane_id() % DP_GROUP, g = lane / 4, q = lane % 4;
  const unsigned char* p = stage + (first + g) * kRowBytes + col + 16 * q;
  dp_u32x4 wv[MT][2][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (64 * h + 16 * q < valid) {
          wv[mt][r][h] = *(const dp_u32x4*)(p + (16 * mt + 8 * r) * kRowBytes + 64 * h);
        } else {
          wv[mt][r][h].x = wv[mt][r][h].y = wv[mt][r][h].z = wv[mt][r][h].w = 0u;
        }
      }
  float blk[MT][NT][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) blk[mt][nt][0] = blk[mt][nt][1] = blk[mt][nt][2] = blk[mt][nt][3] = 0.0f;
  dp_mma_half_fp8<MT, NT>(wv, ops.x[0], 0, blk);
  dp_mma_half_fp8<MT, NT>(wv, ops.x[1], 1, blk);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[mt][nt][k] += blk[mt][nt][k] * ops.sc[mt][k / 2];
}
#endif

// The GEMM block's e4m3 rows through the ring (dp_block_dot with kRing stages): stage j holds the
// columns [128 S j, 128 S (j + 1)) of all the block's rows, one 128-column block per K-slice, so K-slice
// s takes blocks s, s + S, s + 2S, ... (not a contiguous range: the sum over K is taken in another order
// than dp_mma_rows_fp8's). The block's rows do not depend on the previous kernel, so with kEarly the
// first stages are in flight during the wait.
//   wrow(slot, m): dp_fp8_row of row m of the slot; xrow(t): [K] bf16 or null (a zero row)
template <int K, int MT, int S>
struct dp_fp8_ring_geometry {
  typedef dp_gemm_geometry<K, MT, S> G;
  static constexpr int kCols = DP_FP8_BLOCK * S;            // columns of a stage
  static constexpr int kStagesK = (K + kCols - 1) / kCols;  // stages that cover K
};
template <int K, int MT, int S, int kRing>
__host__ __device__ constexpr int dp_fp8_ring_bytes() {
  typedef dp_fp8_ring_geometry<K, MT, S> F;
  return kRing <= 0 ? 0 : dp_ring_bytes<F::G::kRows, F::kCols, (kRing < F::kStagesK ? kRing : F::kStagesK)>();
}
#if DP_HAS_BULK_COPY
template <int K, int MT, int NT, int S, int kRing, int kEarly, typename WRow, typename XRow>
__device__ __forceinline__ void dp_mma_ring_fp8(WRow wrow, XRow xrow, float (&acc)[MT][NT][4]) {
  typedef dp_fp8_ring_geometry<K, MT, S> F;
  typedef typename F::G G;
  static_assert(K % 16 == 0, "fp8 weights: K must be a multiple of 16 (16-byte e4m3 vectors)");
  constexpr int kStages = kRing < F::kStagesK ? kRing : F::kStagesK;
  constexpr int kBlocks = (K + DP_FP8_BLOCK - 1) / DP_FP8_BLOCK;
  constexpr int RS = G::kSlotRows;
  const int group = (int)threadIdx.x / DP_GROUP, lane = (int)dp_lane_id() % DP_GROUP, g = lane / 4, q = lane % 4;
  const int slot = group / S, slice = group % S;
  const float* scale[MT][2];  // block scales of rows g, g+8 of each tile
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) scale[mt][r] = wrow(slot, 16 * mt + g + 8 * r).s;
  const dp_bf16* xp[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) xp[nt] = xrow(8 * nt + g);
  // Block b's activation columns and scales; loaded one stage ahead (the first after the wait).
  auto load = [&](int b, dp_fp8_block_ops<MT, NT>& o) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int col = DP_FP8_BLOCK * b + 64 * h + 16 * q;
      dp_load_x_half_fp8<NT, kEarly>(xp, col, b < kBlocks && col < K, o.x[h]);
    }
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) o.sc[mt][r] = b < kBlocks ? scale[mt][r][b] : 0.0f;
  };
  dp_fp8_block_ops<MT, NT> cur, next;
  dp_ring_stream<G::kRows, F::kCols, kStages, kEarly>(
      F::kStagesK, [&](int j) { return K - j * F::kCols < F::kCols ? K - j * F::kCols : F::kCols; },
      [&](int j, int i) { return wrow(i / RS, i % RS).w + j * F::kCols; },
      [&](int j, const unsigned char* stage) {
        const int b = j * S + slice;
        if (j == 0)
          load(b, cur);
        else
          cur = next;
        if (j + 1 < F::kStagesK) load(b + S, next);
        if (b < kBlocks)
          dp_mma_ring_block_fp8<MT, NT, dp_ring_geometry<G::kRows, F::kCols>::kRowBytes>(
              stage, slot * RS, DP_FP8_BLOCK * slice, K - DP_FP8_BLOCK * b, cur, acc);
      });
}
#endif
#endif  // DP_VENDOR_NVIDIA

// ---------------------------------------------------------------------------------------------------
// MXFP4 weights (OCP microscaling, compressed-tensors "mxfp4-pack-quantized": Kimi-K3's routed experts).
// A row of K values is K/2 bytes of E2M1 codes, two per byte, the even element in the low nibble, and
// K/32 bytes of E8M0 scales, one per group of 32 consecutive values; the real weight is
// e2m1(code) * 2^(scale - 127), e2m1 codes 0..7 = {0, 0.5, 1, 1.5, 2, 3, 4, 6} and 8..15 the same
// negated. One 16-byte load of a row is exactly one group (32 values, one scale byte). Rows are walked
// in chunks of 128 columns (4 groups), the unit of the K-slices; K must be a multiple of 32.
// Scales: the lane-FMA loop decodes bytes 1..254 exactly; the tensor-core form (NVIDIA) decodes bytes
// up to 160 exactly (weights up to 6 * 2^33; larger bytes are taken as 160), and below 34 the smallest
// values reach the tensor cores as bf16 subnormals. 255 (NaN in the format) is not supported.
#define DP_FP4_GROUP 32
#define DP_FP4_CHUNK 128

// A if B, else C (the templates include no standard headers).
template <bool B, typename A, typename C>
struct dp_conditional {
  typedef A type;
};
template <typename A, typename C>
struct dp_conditional<false, A, C> {
  typedef C type;
};

// Row r of an MXFP4 matrix [N, K]: its packed codes [K/2] bytes and its scales [K/32] bytes.
struct dp_fp4_row {
  const dp_u8* w;
  const dp_u8* s;
};
template <typename R>
struct dp_is_fp4_row {
  static constexpr bool value = false;
};
template <>
struct dp_is_fp4_row<dp_fp4_row> {
  static constexpr bool value = true;
};
template <int K>
__device__ __forceinline__ dp_fp4_row dp_fp4_matrix_row(const dp_u8* w, const dp_u8* s, int r) {
  return dp_fp4_row{w + (dp_u64)r * (K / 2), s + (dp_u64)r * (K / DP_FP4_GROUP)};
}

// Portable decoding (the lane-FMA loop): code c's value times 2 is nibble c & 7 of 0xC8643210
// ({0, 1, 2, 3, 4, 6, 8, 12}); the group's factor 2^(s-127) / 2 is built from the exponent bits.
__device__ __forceinline__ float dp_e8m0_half(dp_u32 s) {  // 2^(s - 128), s in 1..254
  return dp_bits_to_f32((s > 1u ? s - 1u : 1u) << 23);
}
// Eight codes of a word (element 0 in the low nibble) as value * 2 in fp32, exact.
__device__ __forceinline__ void dp_e2m1x8_to_f32x2(dp_u32 w, float out[8]) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const dp_u32 c = (w >> (4 * k)) & 0xfu;
    const float m = (float)((0xC8643210u >> (4 * (c & 7u))) & 0xfu);
    out[k] = (c & 8u) ? -m : m;
  }
}

// Lane partials over MXFP4 rows, as dp_dot_rows over vectors of 32 columns (one group each):
// v = v0 + lane + 32*i, i < kIters, v < v_end; each vector's products are summed, then scaled by its
// group's scale.
template <int T, int M, int kIters>
__device__ __forceinline__ void dp_dot_rows_fp4(const dp_fp4_row (&w)[M], const dp_bf16* const (&x)[T], int v0,
                                                int v_end, int lane, float (&acc)[M][T]) {
  if constexpr (kIters > 0) {
    constexpr int kUnroll = kIters < 4 ? kIters : 4;
    for (int i0 = 0; i0 < kIters; i0 += kUnroll) {
      dp_u32x4 wv[kUnroll][M];
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int v = v0 + lane + DP_GROUP * (i0 + j);
#pragma unroll
        for (int m = 0; m < M; ++m) {
          if (i0 + j < kIters && v < v_end) {
            wv[j][m] = dp_load16(w[m].w + 16 * v);
          } else {
            wv[j][m].x = wv[j][m].y = wv[j][m].z = wv[j][m].w = 0u;
          }
        }
      }
#pragma unroll
      for (int j = 0; j < kUnroll; ++j) {
        const int v = v0 + lane + DP_GROUP * (i0 + j);
        if (i0 + j >= kIters || v >= v_end) continue;
#pragma unroll
        for (int m = 0; m < M; ++m) {
          const float sc = dp_e8m0_half(w[m].s[v]);
          const dp_u32 ww[4] = {wv[j][m].x, wv[j][m].y, wv[j][m].z, wv[j][m].w};
          float p[T];
#pragma unroll
          for (int t = 0; t < T; ++t) p[t] = 0.0f;
#pragma unroll
          for (int k = 0; k < 4; ++k) {
            float wf[8];  // [8] fp32: value * 2
            dp_e2m1x8_to_f32x2(ww[k], wf);
#pragma unroll
            for (int t = 0; t < T; ++t) {
              if (!x[t]) continue;
              float xf[8];
              dp_unpack8_bf16(dp_load16(x[t] + 32 * v + 8 * k), xf);
#pragma unroll
              for (int e = 0; e < 8; ++e) p[t] += wf[e] * xf[e];
            }
          }
#pragma unroll
          for (int t = 0; t < T; ++t) acc[m][t] += p[t] * sc;
        }
      }
    }
  }
}

#if DP_VENDOR_NVIDIA
// The tensor-core operands of one MXFP4 group: the eight codes of `w` (element 0 in the low nibble) as
// four bf16x2 words, word p = elements (p, p + 4) (low half, high half), holding e2m1 * 2^(s-127-32)
// exactly for the group's scale byte s, given as dp_fp4_factor(s). Nibble p of each 16-bit half has its
// sign bit moved to bit 15 of the half and its three exponent-mantissa bits to bits 8..6: bf16 exponent
// field = the e2m1 one, mantissa = its bit, which is e2m1 * 2^-126 (code 1, 0.5, as the subnormal
// 2^-127); one bf16x2 multiply by 2^(s-1-32) scales both values exactly. Two shifts and two masks per
// word (some shifts go to the multiply-add pipe) and four multiplies for eight values, against the
// fifteen byte-permute and logic instructions of the lookup tables this replaces (measured: the expert
// GEMVs 15-20% faster). The callers pair the activations the same way (dp_pair_fp4) and multiply their
// sums by 2^32. The 2^-32 keeps the factor a normal bf16 for s up to 160 and every operand normal from
// s = 34; s above 160 is taken as 160 (real checkpoints' scales sit near 127: weights of magnitude
// 2^-93 to 2^33 are decoded exactly).
#define DP_FP4_UNSHIFT 0x1p32f
__device__ __forceinline__ dp_u32 dp_fp4_factor(dp_u32 s) {  // bf16x2 (2^(s-33), 2^(s-33))
  return (dp_u32)(s < 160u ? s : 160u) * 0x00800080u + 94u * 0x00800080u;
}
__device__ __forceinline__ void dp_e2m1x8_to_bf16x8(dp_u32 w, dp_u32 factor, dp_u32 out[4]) {
  out[0] = dp_mul_bf16x2(((w << 12) & 0x80008000u) | ((w << 6) & 0x01C001C0u), factor);
  out[1] = dp_mul_bf16x2(((w << 8) & 0x80008000u) | ((w << 2) & 0x01C001C0u), factor);
  out[2] = dp_mul_bf16x2(((w << 4) & 0x80008000u) | ((w >> 2) & 0x01C001C0u), factor);
  out[3] = dp_mul_bf16x2((w & 0x80008000u) | ((w >> 6) & 0x01C001C0u), factor);
}
// Eight bf16 in four words (elements 2k, 2k+1 in word k) paired as dp_e2m1x8_to_bf16x8 pairs the
// weights: out[p] = (p, p + 4).
__device__ __forceinline__ void dp_pair_fp4(dp_u32 x0, dp_u32 x1, dp_u32 x2, dp_u32 x3, dp_u32 out[4]) {
  out[0] = __byte_perm(x0, x2, 0x5410u);
  out[1] = __byte_perm(x0, x2, 0x7632u);
  out[2] = __byte_perm(x1, x3, 0x5410u);
  out[3] = __byte_perm(x1, x3, 0x7632u);
}

// Lane (g, q)'s activation columns of one MXFP4 chunk: columns [col + 32 q, +32) of activation row g of
// every tile (xp[nt]: that row from column 32 q, or null for a zero row), paired as the weights
// (dp_pair_fp4); zero when !in (the lane's group lies past K).
template <int NT>
__device__ __forceinline__ void dp_load_x_chunk_fp4(const dp_bf16* const (&xp)[NT], int col, bool in,
                                                    dp_u32 (&xw)[NT][16]) {
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dp_u32x4 v;
      if (in && xp[nt]) {
        v = dp_load16(xp[nt] + col + 8 * i);
      } else {
        v.x = v.y = v.z = v.w = 0u;
      }
      dp_pair_fp4(v.x, v.y, v.z, v.w, xw[nt] + 4 * i);
    }
}
// One warp's products over one MXFP4 chunk: lane (g, q)'s weight vectors (group q of rows g, g + 8 of
// every tile) and their scale bytes, converted (dp_e2m1x8_to_bf16x8) and multiplied with its paired
// activation columns (dp_load_x_chunk_fp4) in eight 16-deep steps; the products times 2^-32 are added
// to sum. The even and the odd steps are two chains, added at the end, so that each step waits for the
// one two before it, not the one just before (with the activations a chunk ahead, dp_mma_rows_fp4: K3's width-1 moe_down
// 57.8 -> 54.6 us, width 4 146.5 -> 140.9, moe_up 1-2% faster; H100, tests/results/gpu-2026-12-07).
template <int MT, int NT>
__device__ __forceinline__ void dp_mma_chunk_fp4(const dp_u32x4 (&wv)[MT][2], const dp_u32 (&sc)[MT][2],
                                                 const dp_u32 (&xw)[NT][16], float (&sum)[MT][NT][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    dp_u32 a[2][16];  // rows g, g+8: 32 columns as bf16 pairs (real values * 2^-32)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const dp_u32 factor = dp_fp4_factor(sc[mt][r]);
      dp_e2m1x8_to_bf16x8(wv[mt][r].x, factor, a[r]);
      dp_e2m1x8_to_bf16x8(wv[mt][r].y, factor, a[r] + 4);
      dp_e2m1x8_to_bf16x8(wv[mt][r].z, factor, a[r] + 8);
      dp_e2m1x8_to_bf16x8(wv[mt][r].w, factor, a[r] + 12);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      float odd[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // the odd steps: a second chain
#pragma unroll
      for (int i = 0; i < 8; i += 2) {
        dp_mma_16816(sum[mt][nt], a[0][2 * i], a[1][2 * i], a[0][2 * i + 1], a[1][2 * i + 1], xw[nt][2 * i],
                     xw[nt][2 * i + 1]);
        dp_mma_16816(odd, a[0][2 * i + 2], a[1][2 * i + 2], a[0][2 * i + 3], a[1][2 * i + 3], xw[nt][2 * i + 2],
                     xw[nt][2 * i + 3]);
      }
#pragma unroll
      for (int k = 0; k < 4; ++k) sum[mt][nt][k] += odd[k];
    }
  }
}

// The shared-memory ring dp_mma_rows_fp4 streams weights through: 8 slots of 16 bytes per lane of each
// of the block's 8 warps (32 KB), one instance per kernel (the function is not a template).
__device__ __forceinline__ dp_u32x4* dp_fp4_ring() {
  __shared__ dp_u32x4 ring[DP_GEMM_GROUPS * 8 * DP_GROUP];
  return ring;
}

// Tensor-core dot products of one warp over MXFP4 weight rows (dp_fp4_row): MT tiles of 16 rows against
// NT tiles of 8 activation rows over the 128-column chunks [c0, c_end) of K. Lane (g, q) loads group q
// of every chunk (columns [128c + 32q, +32): one 16-byte load and one scale byte) of weight rows g and
// g + 8 of every tile, and the same 32 columns of activation row g of every tile (four 16-byte loads);
// converted to bf16 with the group's scale folded in (exact, times 2^-32: dp_e2m1x8_to_bf16x8), they
// are eight 16-deep steps whose k slots the lane fills with its own columns for both operands, as
// dp_mma_rows does (the activations paired as the weights). The weight vectors come through the warp's
// slots of the shared-memory ring (dp_fp4_ring), copied by cp.async 4/MT chunks ahead. The ring's slots
// are the warp's own: the function may be called by any subset of a block's warps, with no barrier.
//   wrow(m): dp_fp4_row of weight row m (0 <= m < 16*MT); xrow(t): [K] bf16 or null (a zero row)
template <int K, int MT, int NT, typename WRow, typename XRow>
__device__ __forceinline__ void dp_mma_rows_fp4(WRow wrow, XRow xrow, int c0, int c_end, float (&acc)[MT][NT][4]) {
  static_assert(K % DP_FP4_GROUP == 0, "mxfp4 weights: K must be a multiple of 32 (one scale per 32 values)");
  const int lane = (int)dp_lane_id() % DP_GROUP, g = lane / 4, q = lane % 4;
  const dp_u8* wp[MT][2];  // rows g, g+8 of each tile, at this lane's group of chunk 0
  const dp_u8* sp[MT][2];
  const dp_bf16* xp[NT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const dp_fp4_row row = wrow(16 * mt + g + 8 * r);
      wp[mt][r] = row.w + 16 * q;
      sp[mt][r] = row.s + q;
    }
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    const dp_bf16* p = xrow(8 * nt + g);
    xp[nt] = p ? p + 32 * q : nullptr;
  }
  float sum[MT][NT][4];  // the products times 2^-32
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) sum[mt][nt][0] = sum[mt][nt][1] = sum[mt][nt][2] = sum[mt][nt][3] = 0.0f;
  // The activation columns are loaded a chunk ahead: chunk c + 1's before the wait for chunk c's weights,
  // so their L2 round trip overlaps that wait and chunk c's products (measured with the two chains of
  // dp_mma_chunk_fp4 above; alone, K3's width-1 moe_down 57.8 -> 55.1 us).
  auto load_x = [&](int c, dp_u32 (&xw)[NT][16]) {
    dp_load_x_chunk_fp4<NT>(xp, DP_FP4_CHUNK * c, c < c_end && DP_FP4_CHUNK * c + DP_FP4_GROUP * q < K, xw);
  };
  // The weights stream through the warp's ring with cp.async, kStages chunks ahead of their use (no
  // registers held for them: measured 2-5% faster than chunks of loads into registers); the scale
  // bytes are loaded as their chunk is issued. Each lane reads back only its own slots.
  constexpr int kStages = 4 / MT;
  const int warp = (int)threadIdx.x / DP_GROUP;
  // This lane's slots: chunk stage st, row r of tile mt at ring + (st*2*MT + 2*mt + r) * 512 bytes.
  const dp_u32 ring =
      (dp_u32)__cvta_generic_to_shared(dp_fp4_ring()) + (dp_u32)((warp * 2 * kStages * MT * DP_GROUP + lane) * 16);
  dp_u32 scr[kStages][MT][2];  // scale bytes of the chunks in flight
  // Issues chunk c (zero-filled past c_end or K: nothing is copied and its scales are 0) into stage st.
  auto issue = [&](int c, int st) {
    const bool in = c < c_end && DP_FP4_CHUNK * c + DP_FP4_GROUP * q < K;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const dp_u32 dst = ring + (dp_u32)((st * 2 * MT + mt * 2 + r) * 32 * 16);
        if (in) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(wp[mt][r] + 64 * c));
        scr[st][mt][r] = in ? (dp_u32)sp[mt][r][4 * c] : 0u;
      }
    asm volatile("cp.async.commit_group;");
  };
#pragma unroll
  for (int st = 0; st < kStages; ++st) issue(c0 + st, st);
  dp_u32 xn[NT][16];  // the next chunk's activation columns (row g's 32 columns as bf16 pairs)
  load_x(c0, xn);
  for (int cb = c0; cb < c_end; cb += kStages) {
#pragma unroll
    for (int st = 0; st < kStages; ++st) {
      const int c = cb + st;
      if (c < c_end) {  // uniform over the warp
        dp_u32 xw[NT][16];  // this chunk's, paired as the weights
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
          for (int i = 0; i < 16; ++i) xw[nt][i] = xn[nt][i];
        load_x(c + 1, xn);
        asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1));
        dp_u32x4 wv[MT][2];
        dp_u32 sc[MT][2];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const dp_u32 src = ring + (dp_u32)((st * 2 * MT + mt * 2 + r) * 32 * 16);
            const bool in = DP_FP4_CHUNK * c + DP_FP4_GROUP * q < K;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                         : "=r"(wv[mt][r].x), "=r"(wv[mt][r].y), "=r"(wv[mt][r].z), "=r"(wv[mt][r].w)
                         : "r"(src));
            if (!in) wv[mt][r].x = wv[mt][r].y = wv[mt][r].z = wv[mt][r].w = 0u;
            sc[mt][r] = scr[st][mt][r];
          }
        dp_mma_chunk_fp4<MT, NT>(wv, sc, xw, sum);
        issue(c + kStages, st);
      }
    }
  }
  asm volatile("cp.async.wait_group 0;");  // nothing in flight into the ring when the next call begins
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int k = 0; k < 4; ++k) acc[mt][nt][k] += sum[mt][nt][k] * DP_FP4_UNSHIFT;
}
#endif

#if DP_HAS_BULK_COPY
// The operands of one MXFP4 chunk that come from global memory in the ring loops (its activation
// columns and the rows' scale bytes), loaded one stage ahead of the products.
template <int MT, int NT>
struct dp_fp4_chunk_ops {
  dp_u32 x[NT][16];  // dp_load_x_chunk_fp4
  dp_u32 sc[MT][2];  // scale bytes of rows g, g + 8 of each tile, group q of the chunk
};
// One warp's products over one MXFP4 chunk of a ring stage (dp_ring_stream): its tile rows (16 MT from
// `first`, the stage's row index of the warp's row 0) at byte column `col` of the stage (64 bytes a
// chunk), against the chunk's activation columns. `in`: the lane's group lies inside the matrix (the
// ring's bytes past it are stale, read as 0). The products times 2^-32 are added to sum.
template <int MT, int NT, int kRowBytes>
__device__ __forceinline__ void dp_mma_ring_chunk_fp4(const unsigned char* stage, int first, int col, bool in,
                                                      const dp_fp4_chunk_ops<MT, NT>& ops, float (&sum)[MT][NT][4]) {
  const int lane = (int)dp_lane_id() % DP_GROUP, g = lane / 4, q = lane % 4;
  const unsigned char* p = stage + (first + g) * kRowBytes + col + 16 * q;
  dp_u32x4 wv[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (in) {
        wv[mt][r] = *(const dp_u32x4*)(p + (16 * mt + 8 * r) * kRowBytes);
      } else {
        wv[mt][r].x = wv[mt][r].y = wv[mt][r].z = wv[mt][r].w = 0u;
      }
    }
  dp_mma_chunk_fp4<MT, NT>(wv, ops.sc, ops.x, sum);
}
#endif


// A weight matrix [N, K] for the row accessors: bf16, e4m3 with its block scales, or MXFP4.
template <int K>
struct dp_bf16_matrix {
  const dp_bf16* w;
  __device__ __forceinline__ const dp_bf16* row(int r) const { return w + (dp_u64)r * K; }
};
template <int K>
struct dp_fp8_matrix {
  const dp_u8* w;
  const float* s;
  __device__ __forceinline__ dp_fp8_row row(int r) const { return dp_fp8_matrix_row<K>(w, s, r); }
};
template <int K>
struct dp_fp4_matrix {
  const dp_u8* w;
  const dp_u8* s;
  __device__ __forceinline__ dp_fp4_row row(int r) const { return dp_fp4_matrix_row<K>(w, s, r); }
};

#if DP_VENDOR_NVIDIA
// The units of K the tensor-core loops take ranges of, for weight rows of type R: 128-column blocks
// (e4m3), 128-column chunks (MXFP4) or 32-column chunks (bf16).
template <int K, typename R>
__host__ __device__ constexpr int dp_mma_units() {
  if constexpr (dp_is_fp8_row<R>::value)
    return (K + DP_FP8_BLOCK - 1) / DP_FP8_BLOCK;
  else if constexpr (dp_is_fp4_row<R>::value)
    return (K + DP_FP4_CHUNK - 1) / DP_FP4_CHUNK;
  else
    return (K + 31) / 32;
}
// dp_mma_rows, dp_mma_rows_fp8 or dp_mma_rows_fp4 (by what wrow returns) over the units [u0, u_end).
template <int K, int MT, int NT, typename WRow, typename XRow>
__device__ __forceinline__ void dp_mma_rows_range(WRow wrow, XRow xrow, int u0, int u_end, float (&acc)[MT][NT][4]) {
  if constexpr (dp_is_fp8_row<decltype(wrow(0))>::value)
    dp_mma_rows_fp8<K, MT, NT>(wrow, xrow, u0, u_end, acc);
  else if constexpr (dp_is_fp4_row<decltype(wrow(0))>::value)
    dp_mma_rows_fp4<K, MT, NT>(wrow, xrow, u0, u_end, acc);
  else
    dp_mma_rows<K, MT, NT>(wrow, xrow, u0, u_end, acc);
}
// dp_mma_rows, dp_mma_rows_fp8 or dp_mma_rows_fp4 (by what wrow returns) over the whole of K.
template <int K, int MT, int NT, typename WRow, typename XRow>
__device__ __forceinline__ void dp_mma_rows_all(WRow wrow, XRow xrow, float (&acc)[MT][NT][4]) {
  if constexpr (dp_is_fp8_row<decltype(wrow(0))>::value)
    dp_mma_rows_fp8<K, MT, NT>(wrow, xrow, 0, (K + DP_FP8_BLOCK - 1) / DP_FP8_BLOCK, acc);
  else if constexpr (dp_is_fp4_row<decltype(wrow(0))>::value)
    dp_mma_rows_fp4<K, MT, NT>(wrow, xrow, 0, (K + DP_FP4_CHUNK - 1) / DP_FP4_CHUNK, acc);
  else
    dp_mma_rows<K, MT, NT>(wrow, xrow, 0, (K + 31) / 32, acc);
}
#endif

// dp_dot_rows, dp_dot_rows_fp8 or dp_dot_rows_fp4 (by the row type) over the whole of K.
template <int T, int M, int K, typename R>
__device__ __forceinline__ void dp_dot_rows_all(const R (&w)[M], const dp_bf16* const (&x)[T], int lane,
                                                float (&acc)[M][T]) {
  if constexpr (dp_is_fp8_row<R>::value)
    dp_dot_rows_fp8<T, M, (K / 16 + DP_GROUP - 1) / DP_GROUP>(w, x, 0, K / 16, lane, acc);
  else if constexpr (dp_is_fp4_row<R>::value)
    dp_dot_rows_fp4<T, M, (K / DP_FP4_GROUP + DP_GROUP - 1) / DP_GROUP>(w, x, 0, K / DP_FP4_GROUP, lane, acc);
  else
    dp_dot_rows<T, M, (K / 8 + DP_GROUP - 1) / DP_GROUP>(w, x, 0, K / 8, lane, acc);
}

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
//   wrow(slot, m): pointer to row m (< 16*MT) of the slot, [K] bf16; or its dp_fp8_row (e4m3 weights)
//   xrow(t): pointer to activation row t (< T), [K] bf16, or null (masked: contributes 0)
// NVIDIA with T >= 2, and e4m3 or MXFP4 weights at any T: tensor cores (dp_mma_rows, dp_mma_rows_fp8,
// dp_mma_rows_fp4). T == 1, and AMD: the lane-FMA loop (dp_dot_rows),
// kFmaRows rows at a time (each lane streams 16-byte vectors of whole row slices: measured faster than
// the tensor-core tile's 64-byte row pieces when one activation row leaves nothing to multiply).
template <int T, int K, int MT, int S, int kEarly = 0, int kRing = 0, typename WRow, typename XRow>
__device__ __forceinline__ void dp_block_dot(WRow wrow, XRow xrow,
                                             float* partial,     // smem [8, 16*MT, T] fp32
                                             float* out_smem) {  // smem [RB, T] fp32
  typedef dp_gemm_geometry<K, MT, S> G;
  constexpr int RS = G::kSlotRows;
  const int group = (int)threadIdx.x / DP_GROUP;
  const int lane = (int)threadIdx.x % DP_GROUP;
  const int slot = group / S, slice = group % S;
  constexpr bool kFp8 = dp_is_fp8_row<decltype(wrow(0, 0))>::value;
  constexpr bool kFp4 = dp_is_fp4_row<decltype(wrow(0, 0))>::value;
  // e4m3 and MXFP4 rows: the K-slices are whole 128-column blocks (chunks).
  constexpr int kBlocks = (K + DP_FP8_BLOCK - 1) / DP_FP8_BLOCK;
  constexpr int kSliceBlocks = (kBlocks + S - 1) / S;
#if DP_VENDOR_NVIDIA
  constexpr bool kMma = T >= 2 || kFp8 || kFp4;
#else
  constexpr bool kMma = false;
#endif
  if constexpr (kMma) {
#if DP_VENDOR_NVIDIA
    constexpr int NT = (T + 7) / 8;
    float acc[MT][NT][4];  // [MT, NT, 4] fp32 accumulator fragments
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) acc[mt][nt][0] = acc[mt][nt][1] = acc[mt][nt][2] = acc[mt][nt][3] = 0.0f;
#if DP_HAS_BULK_COPY
    if constexpr (kFp8 && kRing > 0) {
      dp_mma_ring_fp8<K, MT, NT, S, kRing, kEarly>(wrow, [&](int t) { return t < T ? xrow(t) : nullptr; }, acc);
    } else
#endif
    if constexpr (kFp8) {
      const int b0 = slice * kSliceBlocks;
      const int b_end = (b0 + kSliceBlocks < kBlocks) ? b0 + kSliceBlocks : kBlocks;
      dp_mma_rows_fp8<K, MT, NT, kSliceBlocks, kEarly>([&](int m) { return wrow(slot, m); },
                                               [&](int t) { return t < T ? xrow(t) : nullptr; }, b0, b_end, acc);
    } else if constexpr (kFp4) {
      const int b0 = slice * kSliceBlocks;
      const int b_end = (b0 + kSliceBlocks < kBlocks) ? b0 + kSliceBlocks : kBlocks;
      dp_mma_rows_fp4<K, MT, NT>([&](int m) { return wrow(slot, m); },
                                 [&](int t) { return t < T ? xrow(t) : nullptr; }, b0, b_end, acc);
    } else {
      const int c0 = slice * G::kSliceChunks;
      const int c_end = (c0 + G::kSliceChunks < G::kChunks) ? c0 + G::kSliceChunks : G::kChunks;
      dp_mma_rows<K, MT, NT>([&](int m) { return wrow(slot, m); }, [&](int t) { return t < T ? xrow(t) : nullptr; },
                             c0, c_end, acc);
    }
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
    // Vectors of 8 bf16, of 16 e4m3 (8 per 128-column block), or of 32 MXFP4 values (4 per chunk).
    constexpr int kSliceVecs = kFp8 ? kSliceBlocks * 8 : kFp4 ? kSliceBlocks * 4 : G::kSliceChunks * 4;
    constexpr int kVecs = kFp8 ? K / 16 : kFp4 ? K / DP_FP4_GROUP : G::kVecs;
    constexpr int kIters = (kSliceVecs + DP_GROUP - 1) / DP_GROUP;
    constexpr int kFmaRows = dp_fma_rows<T, RS, kIters>();
    const int v0 = slice * kSliceVecs;
    const int v_end = (v0 + kSliceVecs < kVecs) ? v0 + kSliceVecs : kVecs;
    const dp_bf16* xr[T];
#pragma unroll
    for (int t = 0; t < T; ++t) xr[t] = xrow(t);
    for (int m0 = 0; m0 < RS; m0 += kFmaRows) {
      decltype(wrow(0, 0)) w[kFmaRows];
#pragma unroll
      for (int m = 0; m < kFmaRows; ++m) w[m] = wrow(slot, m0 + m);
      float acc[kFmaRows][T];  // [rows, T] fp32 lane partials
#pragma unroll
      for (int m = 0; m < kFmaRows; ++m)
#pragma unroll
        for (int t = 0; t < T; ++t) acc[m][t] = 0.0f;
      if constexpr (kFp8)
        dp_dot_rows_fp8<T, kFmaRows, kIters>(w, xr, v0, v_end, lane, acc);
      else if constexpr (kFp4)
        dp_dot_rows_fp4<T, kFmaRows, kIters>(w, xr, v0, v_end, lane, acc);
      else
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

// Work after the whole grid's output (gemm NM, and moe.h's fused routing): the last block of the
// launch to store its tile runs a tail over the complete output. dp_gemm_last_block counts the block in
// on `done`, a word the step workspace holds at zero (the runtime zeroes the workspace once; the last
// block resets the word), and says whether it was the last. Every thread of every block calls it, after
// its stores of the output.
__device__ __forceinline__ bool dp_gemm_last_block(dp_u32* done) {
  __shared__ dp_u32 last;
  dp_fence_device();  // this thread's stores of the output are visible to the grid before the count
  __syncthreads();
  if (threadIdx.x == 0) last = dp_arrive_device(done) == gridDim.x - 1 ? 1u : 0u;
  __syncthreads();
  if (!last) return false;
  dp_fence_device();  // every other block's stores, seen by this thread (read them coherently)
  if (threadIdx.x == 0) *done = 0u;  // every block has arrived: ready for the next launch
  return true;
}
// A tail: kActive, the counter `done`, and operator()(out), which every thread of the last block runs.
struct dp_gemm_no_tail {
  enum { kActive = 0 };  // an enum, not a static member: no device global in every kernel
  dp_u32* done = nullptr;
  __device__ __forceinline__ void operator()(const void*) const {}
};

// The post-attention norm fused into the o-projection (gemm NM 1): the last block adds the residual to
// the projection h and normalises the T rows, as dp_add_rmsnorm does:
//   residual_out = bf16(h + residual),  out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight)
// with the same roundings; the sum of squares is taken in another order (a 32-lane group per row, lane
// partials then the group's butterfly), so `out` may differ from the separate op's in the last bit of
// a few elements. One launch less per layer: the separate norm's launch and its wait for the GEMM
// become this block's tail (bench/NOTES.md has the prediction and what was measured).
template <int T, int N>
struct dp_gemm_norm_tail {
  enum { kActive = 1 };
  const dp_bf16* residual;  // [T, N] bf16 (may alias residual_out)
  const dp_bf16* weight;    // [N] bf16
  dp_bf16* out;             // [T, N] bf16 normalised rows
  dp_bf16* residual_out;    // [T, N] bf16
  float eps;
  dp_u32* done;
  __device__ __forceinline__ void operator()(const void* out_h) const {
    static_assert(N % 8 == 0, "gemm: the fused norm reads 16-byte rows");
    const dp_bf16* h = (const dp_bf16*)out_h;
    constexpr int kVecs = N / 8;
    const int group = (int)threadIdx.x / DP_GROUP, lane = (int)threadIdx.x % DP_GROUP;
    for (int t = group; t < T; t += DP_GEMM_GROUPS) {
      const dp_bf16* hr = h + (dp_u64)t * N;
      const dp_bf16* rr = residual + (dp_u64)t * N;
      dp_bf16* ro = residual_out + (dp_u64)t * N;
      dp_bf16* o = out + (dp_u64)t * N;
      float sumsq = 0.0f;
      for (int v = lane; v < kVecs; v += DP_GROUP) {
        float xv[8], b[8];
        dp_unpack8_bf16(dp_load16_coherent(hr + 8 * v), xv);
        dp_unpack8_bf16(dp_load16_coherent(rr + 8 * v), b);
#pragma unroll
        for (int k = 0; k < 8; ++k) xv[k] = dp_round_bf16(xv[k] + b[k]);
        dp_store16(ro + 8 * v, dp_pack8_bf16(xv));
#pragma unroll
        for (int k = 0; k < 8; ++k) sumsq += xv[k] * xv[k];
      }
      const float scale = dp_rsqrtf(dp_group_sum(sumsq) * (1.0f / (float)N) + eps);
      for (int v = lane; v < kVecs; v += DP_GROUP) {
        float xv[8], w[8], y[8];
        dp_unpack8_bf16(dp_load16_coherent(ro + 8 * v), xv);  // this lane's own stores above
        dp_unpack8_bf16(dp_load16(weight + 8 * v), w);
#pragma unroll
        for (int k = 0; k < 8; ++k) y[k] = dp_round_bf16(xv[k] * scale) * w[k];
        dp_store16(o + 8 * v, dp_pack8_bf16(y));
      }
    }
  }
};

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
// kQ8 (bit s: weight s is e4m3 with fp32 128 x 128 block scales s_s, dp_fp8_row) selects the weights'
// storage per segment; dp_gemm is the all-bf16 form.
template <int T, int K, int N0, int N1, int N2, int N3, int N4, int N5, int kOutF32, int MT, int S, int kQ8,
          int kAdd = 0, int kEarly = 0, int kRing = 0, typename Tail = dp_gemm_no_tail>
__device__ __forceinline__ void dp_gemm_segments(const dp_bf16* __restrict__ x,  // [T, K] bf16
                                                 void* __restrict__ out,  // [T, Ntot] bf16 (fp32 if kOutF32)
                                                 const void* const (&ws)[6],   // [N_s, K] bf16 or e4m3
                                                 const float* const (&ss)[6],  // e4m3: [ceil(N_s/128), ceil(K/128)]
                                                 const dp_bf16* __restrict__ add = nullptr,  // kAdd: [T, Ntot] bf16
                                                 const Tail& tail = Tail{}) {  // run by the grid's last block
  typedef dp_gemm_geometry<K, MT, S> G;
  constexpr int kNtot = N0 + N1 + N2 + N3 + N4 + N5;
  static_assert(N0 > 0, "gemm: segment 0 must have rows");
  __shared__ float partial[DP_GEMM_GROUPS * G::kSlotRows * T];  // [8, 16*MT, T] fp32 split-K partials
  __shared__ float result[G::kRows * T];                        // [RB, T] fp32 dot products of this block

  // Which segment and tile this block computes (unrolled over the six compile-time segments).
  // (Static indices only: ws[seg] with a run-time seg would put the arrays on the stack.)
  const int ns[6] = {N0, N1, N2, N3, N4, N5};
  int b = (int)blockIdx.x, col0 = 0, n_seg = 0;
  const void* wseg_any = ws[0];
  const float* sseg = ss[0];
  bool found = false, seg_fp8 = false;
#pragma unroll
  for (int s = 0; s < 6; ++s) {
    const int tiles = (ns[s] + G::kRows - 1) / G::kRows;
    if (!found) {
      if (b < tiles) {
        found = true;
        n_seg = ns[s];
        wseg_any = ws[s];
        sseg = ss[s];
        seg_fp8 = (kQ8 >> s) & 1;
      } else {
        b -= tiles;
        col0 += ns[s];
      }
    }
  }
  if constexpr (Tail::kActive) {
    if (!found) {  // a grid larger than the tiles: the block still counts, and may be the last
      if constexpr (kEarly != 0) dp_grid_dependency_wait();  // the tail reads the previous kernel's data
      if (dp_gemm_last_block(tail.done)) tail(out);
      return;
    }
  }
  if (!found) return;  // a grid larger than the tiles: whole block leaves together
  const int row0 = b * G::kRows;

  // Rows past the matrix re-read row 0 and are dropped.
  auto xrow = [&](int t) { return x + (dp_u64)t * K; };
  if constexpr (kEarly != 0)
    if (!seg_fp8) dp_grid_dependency_wait();  // the bf16 segments wait before anything
  if (kQ8 != 0 && seg_fp8) {
    const dp_u8* wseg = (const dp_u8*)wseg_any;
    dp_block_dot<T, K, MT, S, kEarly, kRing>(
        [&](int slot, int m) {
          const int r = row0 + slot * G::kSlotRows + m;
          return dp_fp8_matrix_row<K>(wseg, sseg, r < n_seg ? r : 0);
        },
        xrow, partial, result);
  } else {
    const dp_bf16* wseg = (const dp_bf16*)wseg_any;
    dp_block_dot<T, K, MT, S>(
        [&](int slot, int m) {
          const int r = row0 + slot * G::kSlotRows + m;
          return wseg + (dp_u64)(r < n_seg ? r : 0) * K;
        },
        xrow, partial, result);
  }
  // Every thread has waited before any output is written (a group with an empty K-slice never
  // reached the wait in the loop).
  if constexpr (kEarly != 0) dp_grid_dependency_wait();

  for (int i = (int)threadIdx.x; i < G::kRows * T; i += DP_GEMM_THREADS) {
    const int t = i % T;
    const int r = row0 + i / T;
    if (r >= n_seg) continue;
    const dp_u64 o = (dp_u64)t * kNtot + col0 + r;
    if constexpr (kAdd != 0) {
      // The product rounded to bf16 (as a separate GEMM would store it), plus the addend, rounded again.
      ((dp_bf16*)out)[o] = dp_f32_to_bf16(dp_round_bf16(result[i]) + dp_bf16_to_f32(add[o]));
    } else if (kOutF32) {
      ((float*)out)[o] = result[i];
    } else {
      ((dp_bf16*)out)[o] = dp_f32_to_bf16(result[i]);
    }
  }
  if constexpr (Tail::kActive)
    if (dp_gemm_last_block(tail.done)) tail(out);
}

template <int T, int K, int N0, int N1, int N2, int N3, int N4, int N5, int kOutF32, int MT, int S>
__device__ __forceinline__ void dp_gemm(const dp_bf16* __restrict__ x,  // [T, K] bf16
                                        void* __restrict__ out,          // [T, Ntot] bf16 (fp32 if kOutF32)
                                        const dp_bf16* __restrict__ w0,  // [N0, K] bf16
                                        const dp_bf16* __restrict__ w1 = nullptr,  // [N1, K] bf16
                                        const dp_bf16* __restrict__ w2 = nullptr,  // [N2, K] bf16
                                        const dp_bf16* __restrict__ w3 = nullptr,  // [N3, K] bf16
                                        const dp_bf16* __restrict__ w4 = nullptr,  // [N4, K] bf16
                                        const dp_bf16* __restrict__ w5 = nullptr) {  // [N5, K] bf16
  const void* const ws[6] = {w0, w1, w2, w3, w4, w5};
  const float* const ss[6] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  dp_gemm_segments<T, K, N0, N1, N2, N3, N4, N5, kOutF32, MT, S, 0>(x, out, ws, ss);
}

// The GEMM with e4m3 weights in the segments of kQ8: every segment's weight and its scales (null for
// bf16 and absent segments). kEarly 1: the entry point only triggered its dependents, and the e4m3
// segments' first weight loads are in flight while the block waits for the previous kernel (codegen's
// early_weights).
template <int T, int K, int N0, int N1, int N2, int N3, int N4, int N5, int kOutF32, int MT, int S, int kQ8,
          int kEarly = 0, int kRing = 0>
__device__ __forceinline__ void dp_gemm_q8(const dp_bf16* __restrict__ x, void* __restrict__ out, const void* w0,
                                           const float* s0, const void* w1, const float* s1, const void* w2,
                                           const float* s2, const void* w3, const float* s3, const void* w4,
                                           const float* s4, const void* w5, const float* s5) {
  const void* const ws[6] = {w0, w1, w2, w3, w4, w5};
  const float* const ss[6] = {s0, s1, s2, s3, s4, s5};
  dp_gemm_segments<T, K, N0, N1, N2, N3, N4, N5, kOutF32, MT, S, kQ8, 0, kEarly, kRing>(x, out, ws, ss);
}

// The GEMM of one weight with the post-attention norm fused (dp_gemm_norm_tail): out is the projection,
// the norm's outputs go to normed and residual_out. The weight as for dp_gemm_q8 (kQ8 0: bf16).
template <int T, int K, int N0, int N1, int N2, int N3, int N4, int N5, int kOutF32, int MT, int S, int kQ8,
          int kEarly = 0>
__device__ __forceinline__ void dp_gemm_norm_q8(const dp_bf16* __restrict__ x, void* __restrict__ out, const void* w0,
                                                const float* s0, const dp_bf16* residual, const dp_bf16* norm_weight,
                                                dp_bf16* normed, dp_bf16* residual_out, float eps, dp_u32* done) {
  const void* const ws[6] = {w0, nullptr, nullptr, nullptr, nullptr, nullptr};
  const float* const ss[6] = {s0, nullptr, nullptr, nullptr, nullptr, nullptr};
  static_assert(kOutF32 == 0 && N1 == 0, "gemm: the fused norm takes one weight's bf16 output");
  const dp_gemm_norm_tail<T, N0> nm{residual, norm_weight, normed, residual_out, eps, done};
  dp_gemm_segments<T, K, N0, N1, N2, N3, N4, N5, kOutF32, MT, S, kQ8, 0, kEarly>(x, out, ws, ss, nullptr, nm);
}

// The GEMM plus a bf16 addend of the output's shape: out = bf16(bf16(x W^T) + add), the sum of two bf16
// tensors as a separate add would form it (the K3 latent MoE: latent up-projection + shared expert).
// bf16 output only; the weights as for dp_gemm_q8 (kQ8 0: all bf16, their scales null).
template <int T, int K, int N0, int N1, int N2, int N3, int N4, int N5, int kOutF32, int MT, int S, int kQ8>
__device__ __forceinline__ void dp_gemm_add(const dp_bf16* __restrict__ x, void* __restrict__ out, const void* w0,
                                            const float* s0, const void* w1, const float* s1, const void* w2,
                                            const float* s2, const void* w3, const float* s3, const void* w4,
                                            const float* s4, const void* w5, const float* s5,
                                            const dp_bf16* __restrict__ add) {
  static_assert(kOutF32 == 0, "gemm: the addend form writes bf16");
  const void* const ws[6] = {w0, w1, w2, w3, w4, w5};
  const float* const ss[6] = {s0, s1, s2, s3, s4, s5};
  dp_gemm_segments<T, K, N0, N1, N2, N3, N4, N5, kOutF32, MT, S, kQ8, 1>(x, out, ws, ss, add);
}
