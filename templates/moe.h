// moe.h: the MoE block of a decode step (model-family.md 3c) in three launches after the router GEMM,
// plus the dense MLP's gate/up:
//
//   router logits   gemm.h, fp32 output                        [T, E]
//   dp_moe_route    sigmoid, correction bias (selection only), top-k, renormalise; the list of
//                   distinct experts the step uses and which rows use each          (one block)
//   dp_moe_up       gate/up + activation of every used expert and of the shared expert (one launch)
//   dp_moe_down     down projection of every used expert, weighted sum, routed scaling, plus the
//                   shared expert's down projection                                  (one launch)
//   dp_mlp_up       the dense MLP's gate/up + activation (its down is a plain gemm.h launch)
//
// Only used experts' weights are read, each once per step however many rows chose it: the up kernel
// gives each used expert its own blocks, and every block of the down kernel owns a few output features
// and spreads the used experts over its groups, summing them in a fixed order (deterministic, no
// atomics). Grids are sized for the most experts a step can use, U = min(E, T*KT); blocks beyond the
// step's actual count leave at once.
//
// Expert weights are stacked by expert id with a stride between experts (bf16 elements, 64-bit
// offsets): expert e's w1 (gate) [I, D] at w1 + e*stride_w1, its w3 (up) [I, D] at w3 + e*stride_w3,
// its w2 (down) [D, I] at w2 + e*stride_w2. Dense stacks (the per-expert checkpoint tensors
// experts.{e}.w1/w3/w2 placed one after the other) have stride_w1 = stride_w3 = I*D, stride_w2 = D*I;
// vLLM's fused w13 [E, 2I, D] binds w1 = w13, w3 = w13 + I*D, stride_w1 = stride_w3 = 2*I*D. Rows are
// read with 16-byte loads: the strides must be multiples of 8 and the base pointers 16-byte aligned.
// D is the width the experts read and write (the hidden size; the latent width for K3 latent MoE).
#pragma once

#include "vendor.h"
#include "gemm.h"

// ---------------------------------------------------------------------------------------------------
// Routing. One block of 256 threads; 32-lane group g takes rows g, g+8, ...; lane l holds the scores
// of experts l, l+32, ... and the group finds the top-k by KT rounds of a group-wide arg-max (ties go
// to the lower expert id, as in the reference). Scores are fp32; a NaN logit scores -inf, so whatever
// the input, every chosen id is a valid expert. The used experts are then marked and ranked by a block
// scan; with one row they are that row's choices, ranked by the group itself (no scan, no barrier:
// 7.1 -> 6.5 us on the H200, bench/NOTES.md).
// kCoherent 1: the logits were stored by other blocks of the same launch (the router GEMM's fused
// routing, dp_moe_route_tail): read them through L2.
#define DP_MOE_ROUTE_THREADS 256

template <int T, int E, int KT, int kRenorm, int kCoherent = 0>
__device__ __forceinline__ void dp_moe_route(
    const float* __restrict__ logits,     // [T, E] fp32 router logits
    const float* __restrict__ bias,       // [E] fp32 e_score_correction_bias (selection only)
    dp_i32* __restrict__ topk_ids,        // [T, KT] i32: chosen experts, by decreasing biased score
    float* __restrict__ topk_weights,     // [T, KT] fp32: their sigmoid scores, renormalised when
                                          //   kRenorm (routed_scaling is applied by dp_moe_down)
    dp_i32* __restrict__ experts,         // [1 + U] i32: [0] = count of distinct experts used by any
                                          //   row, [1 .. count] their ids ascending; U = min(E, T*KT)
    dp_i32* __restrict__ expert_slots) {  // [U, T] i32: for used expert u < count and row t, the j
                                          //   with topk_ids[t][j] == experts[1+u], or -1
  constexpr int kPer = (E + DP_GROUP - 1) / DP_GROUP;  // scores per lane
  constexpr int kGroups = DP_MOE_ROUTE_THREADS / DP_GROUP;
  constexpr int kChunk = (E + DP_MOE_ROUTE_THREADS - 1) / DP_MOE_ROUTE_THREADS;  // experts per thread (scan)
  constexpr int U = E < T * KT ? E : T * KT;
  static_assert(kPer <= 32, "moe_route: at most 1024 experts");
  static_assert(KT >= 1 && KT <= DP_GROUP && KT <= E, "moe_route: top-k must be 1..32 and at most E");
  __shared__ dp_i32 chosen[T * KT];                 // [T, KT] i32 topk ids
  __shared__ dp_i32 used[E];                        // [E] i32: 1 if any row chose the expert, then its rank
  __shared__ dp_i32 scan[DP_MOE_ROUTE_THREADS];     // [256] i32 per-thread counts, prefix-summed

  const int tid = (int)threadIdx.x, group = tid / DP_GROUP, lane = tid % DP_GROUP;
  const float neg_inf = dp_bits_to_f32(0xff800000u);
  if constexpr (T != 1)
    for (int e = tid; e < E; e += DP_MOE_ROUTE_THREADS) used[e] = 0;

  for (int t = group; t < T; t += kGroups) {
    float sel[kPer], sc[kPer];  // [kPer] biased selection score, sigmoid score
    dp_u32 taken = 0;
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int e = lane + DP_GROUP * i;
      if (e < E) {
        sc[i] = dp_sigmoid(kCoherent ? dp_load_f32_coherent(logits + (dp_u64)t * E + e) : logits[(dp_u64)t * E + e]);
        sel[i] = sc[i] + bias[e];
        if (!(sel[i] == sel[i])) sel[i] = neg_inf;  // NaN
      } else {
        sc[i] = 0.0f;
        sel[i] = neg_inf;
        taken |= 1u << i;
      }
    }
    dp_i32 my_id = 0;     // lane j < KT keeps the j-th choice
    float my_w = 0.0f;
    float wsum = 0.0f;
#pragma unroll
    for (int j = 0; j < KT; ++j) {
      float best = neg_inf, bscore = 0.0f;
      dp_i32 bidx = 0x7fffffff;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const dp_i32 e = lane + DP_GROUP * i;
        const bool free = !((taken >> i) & 1u);
        if (free && (sel[i] > best || (sel[i] == best && e < bidx))) {
          best = sel[i];
          bidx = e;
          bscore = sc[i];
        }
      }
#pragma unroll
      for (int m = DP_GROUP / 2; m > 0; m >>= 1) {
        const float ob = dp_shfl_xor(best, m);
        const dp_i32 oi = (dp_i32)dp_f32_to_bits(dp_shfl_xor(dp_bits_to_f32((dp_u32)bidx), m));
        const float os = dp_shfl_xor(bscore, m);
        if (ob > best || (ob == best && oi < bidx)) {
          best = ob;
          bidx = oi;
          bscore = os;
        }
      }
      if (bidx % DP_GROUP == lane) taken |= 1u << (bidx / DP_GROUP);
      if (lane == j) {
        my_id = bidx;
        my_w = bscore;
      }
      wsum += bscore;
    }
    if (lane < KT) {
      topk_ids[t * KT + lane] = my_id;
      topk_weights[t * KT + lane] = kRenorm ? dp_div(my_w, wsum) : my_w;
      chosen[t * KT + lane] = my_id;
    }
    if constexpr (T == 1) {
      // One row: the used experts are its KT distinct choices. Each lane's rank among them (ascending
      // ids) is its place in `experts`, and its top-k position the expert's slot: no block scan.
      int rank = 0;
#pragma unroll
      for (int j = 0; j < KT; ++j) {
        const dp_i32 other = (dp_i32)dp_shfl_group32((dp_u32)my_id, (dp_u32)j);  // lane j's choice
        rank += other < my_id ? 1 : 0;  // the ids are distinct: never true for j == lane
      }
      if (lane < KT) {
        experts[1 + rank] = my_id;
        expert_slots[rank] = lane;
      }
      if (lane == 0) experts[0] = KT;
    }
  }
  if constexpr (T == 1) return;  // the whole block: group 0 wrote everything above
  __syncthreads();
  for (int i = tid; i < T * KT; i += DP_MOE_ROUTE_THREADS) used[chosen[i]] = 1;
  __syncthreads();

  // Ranks of the used experts: per-thread counts over a contiguous chunk, then a block scan.
  int cnt = 0;
#pragma unroll
  for (int k = 0; k < kChunk; ++k) {
    const int e = tid * kChunk + k;
    if (e < E) cnt += used[e];
  }
  scan[tid] = cnt;
  __syncthreads();
  for (int d = 1; d < DP_MOE_ROUTE_THREADS; d <<= 1) {  // Hillis-Steele inclusive scan
    const int add = tid >= d ? scan[tid - d] : 0;
    __syncthreads();
    scan[tid] += add;
    __syncthreads();
  }
  int rank = scan[tid] - cnt;
  const int count = scan[DP_MOE_ROUTE_THREADS - 1];
  __syncthreads();  // used[] is rewritten with ranks below
#pragma unroll
  for (int k = 0; k < kChunk; ++k) {
    const int e = tid * kChunk + k;
    if (e < E && used[e]) {
      experts[1 + rank] = e;
      used[e] = rank + 1;  // rank + 1, so that 0 still means unused
      ++rank;
    }
  }
  if (tid == 0) experts[0] = count;
  __syncthreads();
  // expert_slots: every (used expert, row) entry, -1 or the row's top-k position of that expert.
  for (int i = tid; i < count * T; i += DP_MOE_ROUTE_THREADS) {
    const int u = i / T, t = i % T;
    dp_i32 slot = -1;
    for (int j = 0; j < KT; ++j) {
      const dp_i32 e = chosen[t * KT + j];
      if (used[e] == u + 1) slot = j;
    }
    expert_slots[i] = slot;
  }
  (void)U;
}

// The routing fused into the router GEMM (gemm TK > 0): the GEMM's last block (dp_gemm_last_block)
// routes the complete [T, E] fp32 logits, as the separate moe_route launch would (same outputs bit for
// bit: the same code, the logits read through L2). One launch less per MoE layer: the routing's launch
// and its wait for the router become this block's tail.
template <int T, int E, int KT, int kRenorm>
struct dp_moe_route_tail {
  enum { kActive = 1 };
  const float* bias;
  dp_i32* topk_ids;
  float* topk_weights;
  dp_i32* experts;
  dp_i32* expert_slots;
  dp_u32* done;
  __device__ __forceinline__ void operator()(const void* logits) const {
    dp_moe_route<T, E, KT, kRenorm, 1>((const float*)logits, bias, topk_ids, topk_weights, experts, expert_slots);
  }
};
// The router GEMM (one weight [E, K], fp32 logits; bf16 or e4m3 as for dp_gemm_q8) with the routing
// fused. The grid's blocks are 256 threads, the routing's block size.
template <int T, int K, int N0, int N1, int N2, int N3, int N4, int N5, int kOutF32, int MT, int S, int kQ8,
          int KT, int kRenorm, int kEarly = 0>
__device__ __forceinline__ void dp_gemm_route(const dp_bf16* __restrict__ x, void* __restrict__ out, const void* w0,
                                              const float* s0, const float* bias, dp_i32* topk_ids, float* topk_weights,
                                              dp_i32* experts, dp_i32* expert_slots, dp_u32* done) {
  static_assert(kOutF32 == 1 && N1 == 0, "gemm: the fused routing takes one weight's fp32 logits");
  static_assert(DP_GEMM_THREADS == DP_MOE_ROUTE_THREADS, "gemm: the routing runs on one GEMM block");
  const void* const ws[6] = {w0, nullptr, nullptr, nullptr, nullptr, nullptr};
  const float* const ss[6] = {s0, nullptr, nullptr, nullptr, nullptr, nullptr};
  const dp_moe_route_tail<T, N0, KT, kRenorm> rt{bias, topk_ids, topk_weights, experts, expert_slots, done};
  dp_gemm_segments<T, K, N0, N1, N2, N3, N4, N5, kOutF32, MT, S, kQ8, 0, kEarly>(x, out, ws, ss, nullptr, rt);
}

// ---------------------------------------------------------------------------------------------------
// Gate/up tiles. A block computes RB = (8/S)*8*MT intermediate features of one MLP (an expert or the
// shared/dense MLP): each 16-row tile of a slot holds the gate rows of 8 features (rows 0-7) and the up
// rows of the same features (rows 8-15), so the activation is applied in the block and only the
// activated product leaves it.
template <int T, int D, int MT, int S>
struct dp_gate_up_geometry {
  typedef dp_gemm_geometry<D, MT, S> G;
  static constexpr int kSlotFeatures = 8 * MT;
  static constexpr int kFeatures = G::kSlots * kSlotFeatures;  // RB
};

template <int T, int D, int MT, int S, int kAct, int kRing = 0, typename XRow, typename WM>
__device__ __forceinline__ void dp_gate_up_tile(XRow xrow,  // row t of [D] bf16, or null
                                                WM wg,      // [Irows, D] gate rows (dp_bf16_matrix, dp_fp8_matrix)
                                                WM wu,      // [Irows, D] up rows
                                                int Irows, int row0, float act_beta, float act_lbeta,
                                                float* partial, float* result,   // smem
                                                float* act_out) {                // smem [RB, T] fp32
  typedef dp_gate_up_geometry<T, D, MT, S> F;
  typedef typename F::G G;
  dp_block_dot<T, D, MT, S, 0, kRing>(
      [&](int slot, int m) {
        const int f = row0 + slot * F::kSlotFeatures + 8 * (m / 16) + m % 8;  // feature of row m
        return (m % 16 < 8 ? wg : wu).row(f < Irows ? f : 0);  // features past the matrix re-read row 0
      },
      xrow, partial, result);
  // result[(slot*16*MT + 16*mt + i)*T + t]: gate (i < 8) and up (i >= 8) of feature slot*8*MT + 8*mt + i%8.
  for (int i = (int)threadIdx.x; i < F::kFeatures * T; i += DP_GEMM_THREADS) {
    const int t = i % T, f = i / T;  // feature within the block
    const int slot = f / F::kSlotFeatures, mt = (f % F::kSlotFeatures) / 8, k = f % 8;
    const int rg = slot * G::kSlotRows + 16 * mt + k;
    const float g = dp_round_bf16(result[rg * T + t]);
    const float u = dp_round_bf16(result[(rg + 8) * T + t]);
    act_out[i] = dp_gated_act<kAct>(g, u, act_beta, act_lbeta);
  }
  __syncthreads();
}

// Gate/up of one 8-feature tile by one warp on the tensor cores (NVIDIA, T >= 2): the warp's 16-row
// tile holds the gate rows (0-7) and the up rows (8-15) of features f0 .. f0+7 over the whole of D, so
// lane (g, q) ends with gate and up of feature f0 + g for activation rows 8nt + 2q and 8nt + 2q + 1 in
// its own accumulators: the activation is applied in registers and stored by the lane, with no shared
// memory and no barrier, and the warp goes on to its next tile.
//   xrow(t): activation row t (< T), [D] bf16, or null (masked: its outputs are not stored)
//   store(t, f, v): v = act(gate, up) of feature f for row t
#if DP_VENDOR_NVIDIA
template <int T, int D, int kAct, typename XRow, typename WM, typename Store>
__device__ __forceinline__ void dp_gate_up_warp_tile(XRow xrow, WM wg, WM wu, int Irows, int f0,
                                                     float act_beta, float act_lbeta, Store store) {
  constexpr int NT = (T + 7) / 8;
  const int lane = (int)dp_lane_id() % DP_GROUP, g = lane / 4, q = lane % 4;
  float acc[1][NT][4];  // rows g (gate) and g + 8 (up) of the tile
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[0][nt][0] = acc[0][nt][1] = acc[0][nt][2] = acc[0][nt][3] = 0.0f;
  dp_mma_rows_all<D, 1, NT>(
      [&](int m) {
        const int f = f0 + m % 8;
        return (m < 8 ? wg : wu).row(f < Irows ? f : 0);  // features past the matrix re-read row 0
      },
      [&](int t) { return t < T ? xrow(t) : nullptr; }, acc);
  const int f = f0 + g;
  if (f >= Irows) return;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int t = 8 * nt + 2 * q + k;
      if (t < T && xrow(t))
        store(t, f, dp_gated_act<kAct>(dp_round_bf16(acc[0][nt][k]), dp_round_bf16(acc[0][nt][k + 2]), act_beta,
                                       act_lbeta));
    }
}
#endif

// The first tile of this warp in the warp tiles' walk (the warps then go on with a stride of all the
// grid's warps): kWarpTiles 1 deals the tiles block by block (warp w of block b first takes tile 8b + w),
// 2 warp by warp (tile w * gridDim.x + b), which spreads fewer tiles than warps over every block of the
// grid (the compiler's choice, codegen warp_tiles_form).
template <int kWarpTiles>
__device__ __forceinline__ int dp_warp_tile_first() {
  const int warp = (int)threadIdx.x / DP_GROUP;
  return kWarpTiles == 2 ? warp * (int)gridDim.x + (int)blockIdx.x : (int)blockIdx.x * DP_GEMM_GROUPS + warp;
}

#if DP_HAS_BULK_COPY
// A gate/up tile of dp_gate_up_warp_ring: the gate and up matrices (dp_fp8_matrix<D> or
// dp_fp4_matrix<D>), their rows (features) and the tile's first feature.
template <typename WM>
struct dp_gate_up_tile_of {
  WM wg, wu;
  int rows, f0;
};
// Warp tiles of 8 features over all of D, as dp_gate_up_warp_tile computes them, whose weight rows
// stream through each warp's own ring (gemm.h, dp_warp_ring_stream; NVIDIA sm_90, e4m3 or MXFP4
// weights). A stage is 256 bytes of each of the tile's 16 rows (two 128-column e4m3 blocks, or four MXFP4
// chunks), and the warp's whole sequence of tiles is one stream, so that the next tile's rows are in
// flight while the current one ends. A stage's block scales are loaded one stage ahead, its activation
// columns as it is multiplied; the units are summed in the register loops' order (the same outputs bit
// for bit as dp_gate_up_warp_tile). Every thread of the block calls it.
//   total: the step's tiles, walked by the warps of the grid with a stride
//   tile(it): dp_gate_up_tile_of of tile it; xrow(it, t): its activation row t (< T), [D] bf16, or null
//   (not stored); store(it, t, f, v): v = act(gate, up) of feature f for row t
template <int T, int D, int kAct, int kRing, typename Tile, typename XRow, typename Store>
__device__ __forceinline__ void dp_gate_up_warp_ring(int total, Tile tile, XRow xrow, Store store, float act_beta,
                                                     float act_lbeta) {
  typedef decltype(tile(0).wg.row(0)) Row;
  constexpr bool kFp4 = dp_is_fp4_row<Row>::value;
  static_assert(kFp4 || dp_is_fp8_row<Row>::value, "gate/up weight ring: e4m3 or MXFP4 weights");
  constexpr int NT = (T + 7) / 8;
  constexpr int kCols = 256;                                        // bytes of a row a stage
  constexpr int kUnitBytes = kFp4 ? DP_FP4_CHUNK / 2 : DP_FP8_BLOCK;  // bytes of a 128-column unit
  constexpr int kUnits = kCols / kUnitBytes;                        // units a stage
  constexpr int kRowUnits = (D + 127) / 128;                        // units of a row
  constexpr int nSt = (kRowUnits + kUnits - 1) / kUnits;            // stages of a tile
  constexpr int kRowBytes = kFp4 ? D / 2 : D;
  typedef typename dp_conditional<kFp4, dp_u32, float>::type Scale;  // E8M0 byte, or fp32 block scale
  const int lane = (int)dp_lane_id() % DP_GROUP, g = lane / 4, q = lane % 4;
  const int warps = (int)gridDim.x * DP_GEMM_GROUPS;
  const int first = dp_warp_tile_first<1>();  // this warp's first tile (dealt block by block)
  const int tiles = first < total ? (total - first + warps - 1) / warps : 0;        // this warp's tiles
  auto tile_of = [&](int j) { return first + (j / nSt) * warps; };                 // the tile of stage j
  // Row m of tile `it`: the gate (m < 8) or up row of feature f0 + m % 8.
  auto wrow = [&](int it, int m) {
    const auto tl = tile(it);
    const int f = tl.f0 + m % 8;
    return (m < 8 ? tl.wg : tl.wu).row(f < tl.rows ? f : 0);  // features past the matrix re-read row 0
  };
  typedef Scale StageScales[kUnits][2];  // a stage's units: scales of rows g and g + 8
  auto load_scales = [&](int j, StageScales& sc) {
    const int it = tile_of(j);
#pragma unroll
    for (int u = 0; u < kUnits; ++u) {
      const int b = (j % nSt) * kUnits + u;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if constexpr (kFp4) {
          const bool in = DP_FP4_CHUNK * b + DP_FP4_GROUP * q < D;
          sc[u][r] = in ? (dp_u32)wrow(it, g + 8 * r).s[4 * b + q] : 0u;
        } else {
          sc[u][r] = b < kRowUnits ? wrow(it, g + 8 * r).s[b] : 0.0f;
        }
      }
    }
  };
  float acc[1][NT][4];  // the tile's sums (MXFP4: times 2^-32)
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) acc[0][nt][0] = acc[0][nt][1] = acc[0][nt][2] = acc[0][nt][3] = 0.0f;
  StageScales cur, next;
  const int stages = tiles * nSt;
  dp_warp_ring_stream<16, kCols, kRing>(
      stages,
      [&](int j) {
        const int left = kRowBytes - (j % nSt) * kCols;
        return left < kCols ? left : kCols;
      },
      [&](int j, int i) { return (const void*)(wrow(tile_of(j), i).w + (j % nSt) * kCols); },
      [&](int j, const unsigned char* stage) {
        if (j == 0) {
          load_scales(j, cur);
        } else {
#pragma unroll
          for (int u = 0; u < kUnits; ++u) cur[u][0] = next[u][0], cur[u][1] = next[u][1];
        }
        if (j + 1 < stages) load_scales(j + 1, next);
        const int it = tile_of(j), s = j % nSt;
        const dp_bf16* xp[NT];  // activation row g of each tile (MXFP4: from the lane's group)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
          const dp_bf16* p = 8 * nt + g < T ? xrow(it, 8 * nt + g) : nullptr;
          xp[nt] = p && kFp4 ? p + DP_FP4_GROUP * q : p;
        }
#pragma unroll
        for (int u = 0; u < kUnits; ++u) {
          const int b = s * kUnits + u;
          if (b >= kRowUnits) continue;  // uniform over the warp
          if constexpr (kFp4) {
            const bool in = DP_FP4_CHUNK * b + DP_FP4_GROUP * q < D;
            dp_fp4_chunk_ops<1, NT> ops;
            dp_load_x_chunk_fp4<NT>(xp, DP_FP4_CHUNK * b, in, ops.x);
            ops.sc[0][0] = cur[u][0];
            ops.sc[0][1] = cur[u][1];
            dp_mma_ring_chunk_fp4<1, NT, dp_ring_geometry<16, kCols>::kRowBytes>(stage, 0, kUnitBytes * u, in, ops,
                                                                                 acc);
          } else {
            dp_fp8_block_ops<1, NT> ops;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int col = DP_FP8_BLOCK * b + 64 * h + 16 * q;
              dp_load_x_half_fp8<NT, 0>(xp, col, col < D, ops.x[h]);
            }
            ops.sc[0][0] = cur[u][0];
            ops.sc[0][1] = cur[u][1];
            dp_mma_ring_block_fp8<1, NT, dp_ring_geometry<16, kCols>::kRowBytes>(stage, 0, kUnitBytes * u,
                                                                                 D - DP_FP8_BLOCK * b, ops, acc);
          }
        }
        if (s + 1 < nSt) return;
        // The tile's last stage: lane (g, q) holds gate and up of feature f for rows 8 nt + 2 q + k.
        const float unshift = kFp4 ? DP_FP4_UNSHIFT : 1.0f;
        const int f = tile(it).f0 + g;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
          for (int k = 0; k < 2; ++k) {
            const int t = 8 * nt + 2 * q + k;
            if (f < tile(it).rows && t < T && xrow(it, t))
              store(it, t, f,
                    dp_gated_act<kAct>(dp_round_bf16(acc[0][nt][k] * unshift),
                                       dp_round_bf16(acc[0][nt][k + 2] * unshift), act_beta, act_lbeta));
          }
          acc[0][nt][0] = acc[0][nt][1] = acc[0][nt][2] = acc[0][nt][3] = 0.0f;
        }
      });
}
#endif

// Routed + shared gate/up. Two work splits (kWarpTiles, chosen by the compiler from T):
//   0: block tiles. Launch: grid = nS + U*nI blocks, block 256, where nI = ceil(I/RB) tiles of one
//      expert, nS = ceil(SI/RB) tiles of the shared expert (0 without one): shared tiles first, then
//      used expert u's tiles at nS + u*nI .. (u+1)*nI - 1.
//   1, 2: warp tiles of 8 features (dp_gate_up_warp_tile), the shared expert's first, then each used
//      expert's, walked by all warps of the grid with a stride (any grid; the compiler launches about two
//      blocks per SM), dealt block by block (1) or warp by warp (2: dp_warp_tile_first). On AMD: the
//      block tiles of 0, walked by the blocks of the grid with a stride. MXFP4 and e4m3 experts (kQ4,
//      kQ8) take the warp tiles from one row on NVIDIA.
// Expert storage: bf16; e4m3 with 128 x 128 block scales (kQ8, every matrix, routed and shared); or
// MXFP4 (kQ4: the routed experts' packed E2M1 codes [I, D/2] bytes and E8M0 scales [I, D/32] bytes,
// strides in bytes; no shared expert, SI == 0).
template <int T, int D, int I, int E, int KT, int SI, int kAct, int MT, int S, int kWarpTiles, int kQ8, int kQ4 = 0,
          int kRing = 0>
__device__ __forceinline__ void dp_moe_up_impl(
    const dp_bf16* __restrict__ x,             // [T, D] bf16 post-attention-norm rows (or latent)
    const void* w1, const void* w1_scale,      // [E, stride_w1] expert gate (w1) weights, [I, D] each
    const void* w3, const void* w3_scale,      // [E, stride_w3] expert up (w3) weights, [I, D] each
    const void* shared_gate, const void* shared_gate_scale,  // [SI, D] shared expert gate_proj (null if SI == 0)
    const void* shared_up, const void* shared_up_scale,      // [SI, D] shared expert up_proj
    const dp_i32* __restrict__ experts,        // [1 + U] i32 from dp_moe_route
    const dp_i32* __restrict__ expert_slots,   // [U, T] i32 from dp_moe_route
    dp_bf16* __restrict__ h,                   // [T, KT, I] bf16: activated product of row t's j-th expert
    dp_bf16* __restrict__ hs,                  // [T, SI] bf16: shared expert's activated product
    dp_u32 stride_w1, dp_u32 stride_w1_scale,  // elements between experts of w1 and of its scales
    dp_u32 stride_w3, dp_u32 stride_w3_scale,  // elements between experts of w3 and of its scales
    float act_beta, float act_lbeta) {         // SiTU betas (kAct 1)
  static_assert(kQ4 == 0 || (SI == 0 && kQ8 == 0), "moe_up: MXFP4 experts have no shared expert and no e4m3");
  // Expert (or shared expert) matrices: bf16, e4m3 with their block scales (kQ8), or MXFP4 (kQ4).
  auto mat = [&](const void* w, const void* sc, dp_u64 w_off, dp_u64 s_off) {
    if constexpr (kQ4 != 0)
      return dp_fp4_matrix<D>{(const dp_u8*)w + w_off, (const dp_u8*)sc + s_off};
    else if constexpr (kQ8 != 0)
      return dp_fp8_matrix<D>{(const dp_u8*)w + w_off, (const float*)sc + s_off};
    else
      return dp_bf16_matrix<D>{(const dp_bf16*)w + w_off};
  };
#if DP_VENDOR_NVIDIA
#if DP_HAS_BULK_COPY
  if constexpr (kWarpTiles && (kQ4 != 0 || kQ8 != 0) && kRing > 0) {
    // The warp tiles below, their rows through a ring per warp.
    constexpr int tS = (SI + 7) / 8, tI = (I + 7) / 8;
    typedef decltype(mat(w1, w1_scale, 0, 0)) WM;
    dp_gate_up_warp_ring<T, D, kAct, kRing>(
        tS + experts[0] * tI,
        [&](int it) {
          if (it < tS) return dp_gate_up_tile_of<WM>{mat(shared_gate, shared_gate_scale, 0, 0),
                                                     mat(shared_up, shared_up_scale, 0, 0), SI, 8 * it};
          const dp_u64 e = (dp_u64)experts[1 + (it - tS) / tI];
          return dp_gate_up_tile_of<WM>{mat(w1, w1_scale, e * stride_w1, e * stride_w1_scale),
                                        mat(w3, w3_scale, e * stride_w3, e * stride_w3_scale), I,
                                        8 * ((it - tS) % tI)};
        },
        [&](int it, int t) -> const dp_bf16* {
          if (it < tS) return x + (dp_u64)t * D;
          return expert_slots[((it - tS) / tI) * T + t] >= 0 ? x + (dp_u64)t * D : nullptr;  // rows that chose e
        },
        [&](int it, int t, int f, float v) {
          if (it < tS) {
            hs[(dp_u64)t * SI + f] = dp_f32_to_bf16(v);
          } else {
            h[((dp_u64)t * KT + expert_slots[((it - tS) / tI) * T + t]) * I + f] = dp_f32_to_bf16(v);
          }
        },
        act_beta, act_lbeta);
    return;
  }
#endif
  if constexpr (kWarpTiles && (T >= 2 || kQ4 != 0 || kQ8 != 0)) {
    constexpr int tS = (SI + 7) / 8, tI = (I + 7) / 8;  // 8-feature tiles of the shared expert, of one expert
    const int warps = (int)gridDim.x * DP_GEMM_GROUPS;
    const int total = tS + experts[0] * tI;
    for (int it = dp_warp_tile_first<kWarpTiles>(); it < total; it += warps) {
      if (it < tS) {
        dp_gate_up_warp_tile<T, D, kAct>(
            [&](int t) { return x + (dp_u64)t * D; }, mat(shared_gate, shared_gate_scale, 0, 0),
            mat(shared_up, shared_up_scale, 0, 0), SI, 8 * it, act_beta, act_lbeta,
            [&](int t, int f, float v) { hs[(dp_u64)t * SI + f] = dp_f32_to_bf16(v); });
      } else {
        const int u = (it - tS) / tI, f0 = 8 * ((it - tS) % tI);
        const dp_i32 e = experts[1 + u];
        const dp_i32* slots = expert_slots + u * T;
        dp_gate_up_warp_tile<T, D, kAct>(
            [&](int t) { return slots[t] >= 0 ? x + (dp_u64)t * D : nullptr; },  // rows that chose e
            mat(w1, w1_scale, (dp_u64)e * stride_w1, (dp_u64)e * stride_w1_scale),
            mat(w3, w3_scale, (dp_u64)e * stride_w3, (dp_u64)e * stride_w3_scale), I, f0, act_beta, act_lbeta,
            [&](int t, int f, float v) { h[((dp_u64)t * KT + slots[t]) * I + f] = dp_f32_to_bf16(v); });
      }
    }
    return;
  }
#endif
  typedef dp_gate_up_geometry<T, D, MT, S> F;
  typedef typename F::G G;
  constexpr int RB = F::kFeatures;
  constexpr int nI = (I + RB - 1) / RB;
  constexpr int nS = (SI + RB - 1) / RB;
  __shared__ float partial[DP_GEMM_GROUPS * G::kSlotRows * T];  // [8, 16*MT, T] fp32
  __shared__ float result[G::kRows * T];                        // [2*RB, T] fp32
  __shared__ float act[RB * T];                                 // [RB, T] fp32
  __shared__ dp_i32 slot_of[T];                                 // [T] i32 this expert's top-k position per row

  const int total = nS + experts[0] * nI;  // tiles of this step (fewer experts used than the grid allows for)
  const int stride = kWarpTiles ? (int)gridDim.x : total;
  for (int b = (int)blockIdx.x; b < total; b += stride) {
    __syncthreads();  // the previous tile's readers of slot_of and act are done
    if (b < nS) {
      const int row0 = b * RB;
      dp_gate_up_tile<T, D, MT, S, kAct, kRing>([&](int t) { return x + (dp_u64)t * D; },
                                         mat(shared_gate, shared_gate_scale, 0, 0),
                                         mat(shared_up, shared_up_scale, 0, 0), SI, row0, act_beta, act_lbeta, partial,
                                         result, act);
      for (int i = (int)threadIdx.x; i < RB * T; i += DP_GEMM_THREADS) {
        const int t = i % T, r = row0 + i / T;
        if (r < SI) hs[(dp_u64)t * SI + r] = dp_f32_to_bf16(act[i]);
      }
      continue;
    }
    const int u = (b - nS) / nI, tile = (b - nS) % nI;
    const dp_i32 e = experts[1 + u];
    if ((int)threadIdx.x < T) slot_of[threadIdx.x] = expert_slots[u * T + threadIdx.x];
    __syncthreads();
    const int row0 = tile * RB;
    dp_gate_up_tile<T, D, MT, S, kAct, kRing>(
        [&](int t) { return slot_of[t] >= 0 ? x + (dp_u64)t * D : nullptr; },  // rows that chose e
        mat(w1, w1_scale, (dp_u64)e * stride_w1, (dp_u64)e * stride_w1_scale),
        mat(w3, w3_scale, (dp_u64)e * stride_w3, (dp_u64)e * stride_w3_scale), I, row0, act_beta, act_lbeta, partial,
        result, act);
    for (int i = (int)threadIdx.x; i < RB * T; i += DP_GEMM_THREADS) {
      const int t = i % T, r = row0 + i / T;
      const int j = slot_of[t];
      if (r < I && j >= 0) h[((dp_u64)t * KT + j) * I + r] = dp_f32_to_bf16(act[i]);
    }
  }
}

// The bf16 entry (expert weights bf16) and the e4m3 one (every expert matrix, routed and shared, e4m3
// with 128 x 128 block scales; the scale tensors of the experts stacked like the weights).
template <int T, int D, int I, int E, int KT, int SI, int kAct, int MT, int S, int kWarpTiles>
__device__ __forceinline__ void dp_moe_up(const dp_bf16* __restrict__ x, const dp_bf16* w1, const dp_bf16* w3,
                                          const dp_bf16* shared_gate, const dp_bf16* shared_up,
                                          const dp_i32* __restrict__ experts, const dp_i32* __restrict__ expert_slots,
                                          dp_bf16* __restrict__ h, dp_bf16* __restrict__ hs, dp_u32 stride_w1,
                                          dp_u32 stride_w3, float act_beta = 0.0f, float act_lbeta = 0.0f) {
  dp_moe_up_impl<T, D, I, E, KT, SI, kAct, MT, S, kWarpTiles, 0>(x, w1, nullptr, w3, nullptr, shared_gate, nullptr,
                                                                  shared_up, nullptr, experts, expert_slots, h, hs,
                                                                  stride_w1, 0, stride_w3, 0, act_beta, act_lbeta);
}
template <int T, int D, int I, int E, int KT, int SI, int kAct, int MT, int S, int kWarpTiles, int kRing = 0>
__device__ __forceinline__ void dp_moe_up_q8(const dp_bf16* __restrict__ x, const dp_u8* w1, const float* w1_scale,
                                             const dp_u8* w3, const float* w3_scale, const dp_u8* shared_gate,
                                             const float* shared_gate_scale, const dp_u8* shared_up,
                                             const float* shared_up_scale, const dp_i32* __restrict__ experts,
                                             const dp_i32* __restrict__ expert_slots, dp_bf16* __restrict__ h,
                                             dp_bf16* __restrict__ hs, dp_u32 stride_w1, dp_u32 stride_w1_scale,
                                             dp_u32 stride_w3, dp_u32 stride_w3_scale, float act_beta = 0.0f,
                                             float act_lbeta = 0.0f) {
  dp_moe_up_impl<T, D, I, E, KT, SI, kAct, MT, S, kWarpTiles, 1, 0, kRing>(
      x, w1, w1_scale, w3, w3_scale, shared_gate, shared_gate_scale, shared_up, shared_up_scale, experts, expert_slots,
      h, hs, stride_w1, stride_w1_scale, stride_w3, stride_w3_scale, act_beta, act_lbeta);
}

// Routed experts in MXFP4 (the K3 latent MoE: D is the latent width), no shared expert. The scale
// tensors are stacked like the packed weights; strides in bytes (packed: at least I*D/2, a multiple of
// 16; scales: at least I*D/32). kRing > 0 (sm_90, warp tiles): each warp's rows stream through its own
// ring of kRing stages of 16 x 512 columns in the launch's dynamic shared memory (8 * kRing * 5120 bytes).
template <int T, int D, int I, int E, int KT, int SI, int kAct, int MT, int S, int kWarpTiles, int kRing = 0>
__device__ __forceinline__ void dp_moe_up_q4(const dp_bf16* __restrict__ x, const dp_u8* w1, const dp_u8* w1_scale,
                                             const dp_u8* w3, const dp_u8* w3_scale, const dp_i32* __restrict__ experts,
                                             const dp_i32* __restrict__ expert_slots, dp_bf16* __restrict__ h,
                                             dp_u32 stride_w1, dp_u32 stride_w1_scale, dp_u32 stride_w3,
                                             dp_u32 stride_w3_scale, float act_beta = 0.0f, float act_lbeta = 0.0f) {
  dp_moe_up_impl<T, D, I, E, KT, SI, kAct, MT, S, kWarpTiles, 0, 1, kRing>(
      x, w1, w1_scale, w3, w3_scale, nullptr, nullptr, nullptr, nullptr, experts, expert_slots, h, nullptr, stride_w1,
      stride_w1_scale, stride_w3, stride_w3_scale, act_beta, act_lbeta);
}

// Dense MLP gate/up: h = act(gate x, up x). dp_mlp_up: bf16 weights; dp_mlp_up_q8: e4m3 gate_proj and
// up_proj with their 128 x 128 block scales. Two work splits (kWarpTiles, chosen by the compiler):
//   0: block tiles of RB features. Launch: grid ceil(I/RB), block 256.
//   1, 2 (NVIDIA): warp tiles of 8 features (dp_gate_up_warp_tile) walked by every warp of the grid with
//      a stride (any grid), dealt as dp_moe_up_impl's warp tiles.
template <int T, int D, int I, int kAct, int MT, int S, int kWarpTiles, int kRing, typename WM>
__device__ __forceinline__ void dp_mlp_up_impl(const dp_bf16* __restrict__ x,  // [T, D] bf16
                                               WM w_gate,                      // [I, D] gate_proj
                                               WM w_up,                        // [I, D] up_proj
                                               dp_bf16* __restrict__ h,        // [T, I] bf16
                                               float act_beta, float act_lbeta) {
#if DP_VENDOR_NVIDIA
  constexpr bool kBlockTiles = kWarpTiles == 0;
#if DP_HAS_BULK_COPY
  if constexpr (!kBlockTiles && kRing > 0) {  // the same warp tiles, their rows through a ring per warp
    dp_gate_up_warp_ring<T, D, kAct, kRing>(
        (I + 7) / 8, [&](int it) { return dp_gate_up_tile_of<WM>{w_gate, w_up, I, 8 * it}; },
        [&](int, int t) { return x + (dp_u64)t * D; },
        [&](int, int t, int f, float v) { h[(dp_u64)t * I + f] = dp_f32_to_bf16(v); }, act_beta, act_lbeta);
    return;
  }
#endif
  if constexpr (!kBlockTiles) {
    // Warp tiles of 8 features over all of D (dp_gate_up_warp_tile), walked by every warp of the grid
    // with a stride.
    constexpr int tI = (I + 7) / 8;
    const int warps = (int)gridDim.x * DP_GEMM_GROUPS;
    for (int it = dp_warp_tile_first<kWarpTiles>(); it < tI; it += warps)
      dp_gate_up_warp_tile<T, D, kAct>([&](int t) { return x + (dp_u64)t * D; }, w_gate, w_up, I, 8 * it, act_beta,
                                       act_lbeta,
                                       [&](int t, int f, float v) { h[(dp_u64)t * I + f] = dp_f32_to_bf16(v); });
  }
#else
  constexpr bool kBlockTiles = true;  // AMD: the block tiles, walked with a stride under the warp tiles' grid
#endif
  if constexpr (kBlockTiles) {
    typedef dp_gate_up_geometry<T, D, MT, S> F;
    typedef typename F::G G;
    constexpr int RB = F::kFeatures;
    __shared__ float partial[DP_GEMM_GROUPS * G::kSlotRows * T];  // [8, 16*MT, T] fp32
    __shared__ float result[G::kRows * T];                        // [2*RB, T] fp32
    __shared__ float act[RB * T];                                 // [RB, T] fp32
    auto tile = [&](int b) {
      const int row0 = b * RB;
      dp_gate_up_tile<T, D, MT, S, kAct, kRing>([&](int t) { return x + (dp_u64)t * D; }, w_gate, w_up, I, row0,
                                                act_beta, act_lbeta, partial, result, act);
      for (int i = (int)threadIdx.x; i < RB * T; i += DP_GEMM_THREADS) {
        const int t = i % T, r = row0 + i / T;
        if (r < I) h[(dp_u64)t * I + r] = dp_f32_to_bf16(act[i]);
      }
    };
    if constexpr (kWarpTiles == 0) {
      tile((int)blockIdx.x);
    } else {
      // The warp tiles' grid on AMD: the block tiles walked by the blocks with a stride.
      for (int b = (int)blockIdx.x; b < (I + RB - 1) / RB; b += (int)gridDim.x) {
        __syncthreads();  // the previous tile's readers of act are done
        tile(b);
      }
    }
  }
}
template <int T, int D, int I, int kAct, int MT, int S, int kWarpTiles = 0>
__device__ __forceinline__ void dp_mlp_up(const dp_bf16* __restrict__ x, const dp_bf16* w_gate, const dp_bf16* w_up,
                                          dp_bf16* __restrict__ h, float act_beta = 0.0f, float act_lbeta = 0.0f) {
  dp_mlp_up_impl<T, D, I, kAct, MT, S, kWarpTiles, 0>(x, dp_bf16_matrix<D>{w_gate}, dp_bf16_matrix<D>{w_up}, h,
                                                      act_beta,
                                                   act_lbeta);
}
template <int T, int D, int I, int kAct, int MT, int S, int kWarpTiles = 0, int kRing = 0>
__device__ __forceinline__ void dp_mlp_up_q8(const dp_bf16* __restrict__ x, const dp_u8* w_gate,
                                             const float* w_gate_scale, const dp_u8* w_up, const float* w_up_scale,
                                             dp_bf16* __restrict__ h, float act_beta = 0.0f, float act_lbeta = 0.0f) {
  dp_mlp_up_impl<T, D, I, kAct, MT, S, kWarpTiles, kRing>(x, dp_fp8_matrix<D>{w_gate, w_gate_scale},
                                                   dp_fp8_matrix<D>{w_up, w_up_scale}, h, act_beta, act_lbeta);
}

// ---------------------------------------------------------------------------------------------------
// Down + weighted sum + shared expert:
//   out[t, n] = sum_j (routed_scaling * topk_weights[t, j]) * (W2[ids[t, j]] h[t, j])[n] + (W2s hs[t])[n]
// Launch: grid ceil(D/M) blocks, block 256. A block owns M output features; its 8 groups share out the
// items (the shared expert first, then the used experts in order: item i goes to group i % 8; with one
// row on the tensor cores the items' K-ranges end to end in 8 equal parts), so that many experts' rows
// are in flight at once instead of one expert after another. Each expert's rows are
// read once for all the rows that chose it (rows that did not are masked out). A group sums its items
// in order and the block sums its groups in order: deterministic, no atomics.
// M = 16 with T >= 2 on NVIDIA: the block's 16 rows of an item are one tensor-core tile (dp_mma_rows)
// against the rows that chose the expert, each item's products scaled by their rows' weights as they
// are added up. Otherwise (T = 1, AMD): the lane-FMA loop, at most 4 rows at a time.
// Expert storage as for dp_moe_up_impl: bf16, e4m3 (kQ8) or MXFP4 (kQ4, routed only, SI == 0).
// kSplit G > 0 (NVIDIA tensor-core path; bf16 from two rows, e4m3 and MXFP4 at any row count): a grid of G
// blocks shares the work of all ceil(D/M) tiles evenly, instead of one block per tile. Tile t's K-units
// (its items' chunks end to end) follow tile t-1's; block b takes units [b*total/G, (b+1)*total/G), so
// every block streams the same bytes and a tile's units may span up to kSlots blocks. A block sums each
// tile it touches over its range (its 8 groups split the range end to end, as one row does), stores the
// [M, T] fp32 sum in the tile's slot of `partials` (slot = block - first block of the tile) and counts
// itself in on the tile's word of `done` (zero between launches); the tile's last block adds the slots
// in order and writes the tile's rows: deterministic. The 3584-row MXFP4 latent sum (224 tiles) ran one
// block per tile on 132 SMs of two blocks each, 40 SMs with one (bench/NOTES.md, 2026-12-03).
template <int D, int M, int G>
struct dp_moe_split {
  static constexpr int kTiles = (D + M - 1) / M;
  static constexpr int kSlots = (G + kTiles - 1) / kTiles + 1;  // most blocks one tile's units can span
};
#if DP_HAS_BULK_COPY
// moe_down's weight ring over pairs (dp_moe_down_impl with kRing; sm_90; MXFP4 or e4m3 rows): the pairs
// [lo, hi) of (tile, item) (pair p: tile p / items, item p % items) stream their 16 rows as one sequence
// of stages of 1024 columns (512 bytes a row for MXFP4, 1024 for e4m3; gemm.h, dp_ring_stream). Each of
// the block's groups takes one 128-column unit of every stage, and adds its products, weighted per
// activation row, to acc; a unit's activation columns, scales and row weights are loaded one stage
// ahead. Every item is I columns wide. Every thread calls leave(tile) after the last stage of each tile
// (the split grid closes the tile there).
//   wrow(tile, item, m): dp_fp4_row or dp_fp8_row of row m of the tile of item; act_row(item, t, coef)
//   and row_weight(item, t): as dp_moe_down_impl's
template <int T, int I, int M, int kRing, typename WRow, typename ActRow, typename RowWeight, typename Leave>
__device__ __forceinline__ void dp_moe_down_ring(dp_u64 lo, dp_u64 hi, int items, WRow wrow, ActRow act_row,
                                                 RowWeight row_weight, float (&acc)[(T + 7) / 8][4], Leave leave) {
  typedef decltype(wrow(0, 0, 0)) Row;
  constexpr bool kFp4 = dp_is_fp4_row<Row>::value;
  static_assert(kFp4 || dp_is_fp8_row<Row>::value, "moe_down weight ring: MXFP4 or e4m3 rows");
  constexpr int NT = (T + 7) / 8;
  constexpr int kUnits = DP_GEMM_GROUPS;                              // 128-column units a stage, one a group
  constexpr int kUnitBytes = kFp4 ? DP_FP4_CHUNK / 2 : DP_FP8_BLOCK;  // bytes of a unit of a row
  constexpr int kCols = kUnits * kUnitBytes;                          // bytes of a row a stage
  constexpr int nI = (I + 128 * kUnits - 1) / (128 * kUnits);         // stages of a pair
  constexpr int kRowBytes = kFp4 ? I / 2 : I;
  const int group = (int)threadIdx.x / DP_GROUP, lane = (int)dp_lane_id() % DP_GROUP, g = lane / 4, q = lane % 4;
  struct Ops {
    typename dp_conditional<kFp4, dp_fp4_chunk_ops<1, NT>, dp_fp8_block_ops<1, NT>>::type o;
    float coef[NT][2];  // weight of the item in rows 8 nt + 2 q + k (MXFP4: times 2^32; 0: not used)
  };
  auto pair_of = [&](int j) { return lo + (dp_u64)(j / nI); };
  auto unit_of = [&](int j) { return (j % nI) * kUnits + group; };  // the group's unit of the item's row
  auto load = [&](int j, Ops& o) {
    const dp_u64 p = pair_of(j);
    const int item = (int)(p % items), b = unit_of(j);
    const dp_bf16* xp[NT];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const dp_bf16* x = 8 * nt + g < T ? act_row(item, 8 * nt + g, nullptr) : nullptr;
      xp[nt] = x && kFp4 ? x + DP_FP4_GROUP * q : x;
    }
    if constexpr (kFp4) {
      const bool in = DP_FP4_CHUNK * b + DP_FP4_GROUP * q < I;
      dp_load_x_chunk_fp4<NT>(xp, DP_FP4_CHUNK * b, in, o.o.x);
#pragma unroll
      for (int r = 0; r < 2; ++r) o.o.sc[0][r] = in ? (dp_u32)wrow(p / items, item, g + 8 * r).s[4 * b + q] : 0u;
    } else {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int col = DP_FP8_BLOCK * b + 64 * h + 16 * q;
        dp_load_x_half_fp8<NT, 0>(xp, col, col < I, o.o.x[h]);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) o.o.sc[0][r] = DP_FP8_BLOCK * b < I ? wrow(p / items, item, g + 8 * r).s[b] : 0.0f;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int k = 0; k < 2; ++k)
        o.coef[nt][k] = row_weight(item, 8 * nt + 2 * q + k) * (kFp4 ? DP_FP4_UNSHIFT : 1.0f);
  };
  Ops cur, next;
  const int stages = (int)(hi - lo) * nI;
  dp_ring_stream<M, kCols, kRing, 0>(
      stages,
      [&](int j) {
        const int left = kRowBytes - (j % nI) * kCols;
        return left < kCols ? left : kCols;
      },
      [&](int j, int i) {
        const dp_u64 p = pair_of(j);
        return (const void*)(wrow(p / items, (int)(p % items), i).w + (j % nI) * kCols);
      },
      [&](int j, const unsigned char* stage) {
        if (j == 0)
          load(j, cur);
        else
          cur = next;
        if (j + 1 < stages) load(j + 1, next);
        const int b = unit_of(j);
        if (128 * b < I) {  // uniform over the group
          float sum[1][NT][4] = {};
          if constexpr (kFp4)
            dp_mma_ring_chunk_fp4<1, NT, dp_ring_geometry<M, kCols>::kRowBytes>(
                stage, 0, kUnitBytes * group, DP_FP4_CHUNK * b + DP_FP4_GROUP * q < I, cur.o, sum);
          else
            dp_mma_ring_block_fp8<1, NT, dp_ring_geometry<M, kCols>::kRowBytes>(stage, 0, kUnitBytes * group,
                                                                                I - DP_FP8_BLOCK * b, cur.o, sum);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int k = 0; k < 4; ++k) acc[nt][k] += cur.coef[nt][k % 2] * sum[0][nt][k];
        }
        const dp_u64 tile = pair_of(j) / items;
        if (j + 1 == stages || pair_of(j + 1) / items != tile) leave(tile);  // the same for every thread
      });
}
#endif

template <int T, int D, int I, int E, int KT, int SI, int M, int kQ8, int kQ4 = 0, int kSplit = 0, int kRing = 0>
__device__ __forceinline__ void dp_moe_down_impl(
    const dp_bf16* __restrict__ h,             // [T, KT, I] bf16 from dp_moe_up
    const dp_bf16* __restrict__ hs,            // [T, SI] bf16 from dp_moe_up (null if SI == 0)
    const void* w2, const void* w2_scale,      // [E, stride_w2] expert down (w2) weights, [D, I] each
    const void* shared_down, const void* shared_down_scale,  // [D, SI] shared expert down_proj (null if SI == 0)
    const dp_i32* __restrict__ experts,        // [1 + U] i32 from dp_moe_route
    const dp_i32* __restrict__ expert_slots,   // [U, T] i32 from dp_moe_route
    const float* __restrict__ topk_weights,    // [T, KT] fp32 from dp_moe_route
    dp_bf16* __restrict__ out,                 // [T, D] bf16: the FFN output (next layer's hidden)
    float routed_scaling,
    dp_u32 stride_w2, dp_u32 stride_w2_scale,  // elements between experts of w2 (dense: D*I) and of its scales
    float* partials = nullptr,                 // kSplit: [ceil(D/M), kSlots, M, T] fp32 (workspace)
    dp_u32* done = nullptr,                    // kSplit: [ceil(D/M)] u32, zero between launches
    int tile_of_block = -1) {                  // the tile this block computes (-1: blockIdx.x)
  static_assert(I % 8 == 0 && SI % 8 == 0 && D % 8 == 0, "moe_down: widths must be multiples of 8");
  static_assert(kQ4 == 0 || (SI == 0 && kQ8 == 0), "moe_down: MXFP4 experts have no shared expert and no e4m3");
  constexpr int kShared = SI > 0 ? 1 : 0;
#if DP_VENDOR_NVIDIA
  // e4m3 and MXFP4 weights: tensor cores also for one row.
  constexpr bool kMma = (T >= 2 || kQ8 != 0 || kQ4 != 0) && M == 16;
#else
  constexpr bool kMma = false;
  if constexpr (kSplit > 0) {
    // The split is the tensor cores' (NVIDIA); the lane-FMA loop's G blocks take whole tiles in turn.
    for (int tile = (int)blockIdx.x; tile < dp_moe_split<D, M, kSplit>::kTiles; tile += kSplit) {
      dp_moe_down_impl<T, D, I, E, KT, SI, M, kQ8, kQ4>(h, hs, w2, w2_scale, shared_down, shared_down_scale, experts,
                                                        expert_slots, topk_weights, out, routed_scaling, stride_w2,
                                                        stride_w2_scale, nullptr, nullptr, tile);
      __syncthreads();  // the next tile reuses the shared partial sums
    }
    return;
  }
#endif
  // Rows of the weights one group multiplies at a time (the lane-FMA loop keeps MF x T accumulators).
  constexpr int MF = kMma ? M : (M < 4 ? M : 4);
  static_assert(M % MF == 0, "moe_down: M must be a multiple of the rows per pass");
  __shared__ float partial[DP_GEMM_GROUPS * M * T];  // [8, M, T] fp32 group sums
  const int group = (int)threadIdx.x / DP_GROUP, lane = (int)threadIdx.x % DP_GROUP;
  int row0 = (tile_of_block < 0 ? (int)blockIdx.x : tile_of_block) * M;  // the tile's first row (kSplit: per tile)
  const int items = kShared + experts[0];

  // Item `item`'s weight row m of this block, its activation row t (null: row t does not use it) and
  // the weight of its products in row t's output.
  auto weight_row = [&](int item, int m) {
    const int r = row0 + m < D ? row0 + m : 0;  // rows past the matrix re-read row 0 and are dropped
    const bool sh = kShared && item == 0;
    const dp_u64 e = sh ? 0 : (dp_u64)experts[1 + item - kShared];
    if constexpr (kQ4 != 0) {
      return dp_fp4_matrix_row<I>((const dp_u8*)w2 + e * stride_w2, (const dp_u8*)w2_scale + e * stride_w2_scale, r);
    } else if constexpr (kQ8 != 0) {
      // The shared expert's rows are SI long, the routed ones I: one row function per width.
      return sh ? dp_fp8_matrix_row<SI>((const dp_u8*)shared_down, (const float*)shared_down_scale, r)
                : dp_fp8_matrix_row<I>((const dp_u8*)w2 + e * stride_w2, (const float*)w2_scale + e * stride_w2_scale,
                                       r);
    } else {
      return sh ? (const dp_bf16*)shared_down + (dp_u64)r * SI : (const dp_bf16*)w2 + e * stride_w2 + (dp_u64)r * I;
    }
  };
  auto act_row = [&](int item, int t, float* coef) -> const dp_bf16* {
    if (kShared && item == 0) {
      if (coef) *coef = 1.0f;
      return hs + (dp_u64)t * SI;
    }
    const int u = item - kShared;
    const dp_i32 j = expert_slots[u * T + t];
    if (coef) *coef = j >= 0 ? routed_scaling * topk_weights[t * KT + j] : 0.0f;
    return j >= 0 ? h + ((dp_u64)t * KT + j) * I : nullptr;
  };
  // The weight of item `item`'s products in activation row t (0 for rows past T).
  auto row_weight = [&](int item, int t) {
    float c = 0.0f;
    if (t < T) act_row(item, t, &c);
    return c;
  };

  if constexpr (kMma) {
#if DP_VENDOR_NVIDIA
    constexpr int NT = (T + 7) / 8;
    const int g = lane / 4, q = lane % 4;
    float acc[NT][4];  // [NT, 4] fp32 accumulator fragments: rows g, g+8; activations 8nt + 2q + (k % 2)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
    // One item's products, over its K-units [u0, u_end) with one row (all of them from two), added to acc
    // with each row's weight.
    auto add_item = [&](int item, int u0, int u_end) {
      float tmp[1][NT][4];  // this item's products
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) tmp[0][nt][0] = tmp[0][nt][1] = tmp[0][nt][2] = tmp[0][nt][3] = 0.0f;
      auto wrow = [&](int m) { return weight_row(item, m); };
      auto xrow = [&](int t) { return t < T ? act_row(item, t, nullptr) : nullptr; };
      if constexpr (T == 1 || kSplit > 0) {  // a range of the item's units
        if (kShared && item == 0)
          dp_mma_rows_range<SI, 1, NT>(wrow, xrow, u0, u_end, tmp);
        else
          dp_mma_rows_range<I, 1, NT>(wrow, xrow, u0, u_end, tmp);
      } else {
        if (kShared && item == 0)
          dp_mma_rows_all<SI, 1, NT>(wrow, xrow, tmp);
        else
          dp_mma_rows_all<I, 1, NT>(wrow, xrow, tmp);
      }
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int k = 0; k < 2; ++k) {
          const float c = row_weight(item, 8 * nt + 2 * q + k);
          acc[nt][k] += c * tmp[0][nt][k];
          acc[nt][k + 2] += c * tmp[0][nt][k + 2];
        }
    };
    if constexpr (kSplit > 0) {
      static_assert(kSplit > 0 && M == 16, "moe_down: the split grid is the tensor-core path's");
      typedef dp_moe_split<D, M, kSplit> Split;
#if DP_HAS_BULK_COPY
      if constexpr ((kQ4 != 0 || kQ8 != 0) && kRing > 0) {
        // MXFP4 or e4m3 through the weight ring (dp_moe_down_ring): the block takes an equal range of the
        // (tile, item) pairs and closes each tile it leaves.
        static_assert(kShared == 0 || SI == I, "moe_down: the split ring takes a shared expert as wide as the experts");
        const dp_u64 total = (dp_u64)Split::kTiles * items;  // pairs
        const dp_u64 blocks = total < (dp_u64)kSplit ? total : (dp_u64)kSplit;
        if ((dp_u64)blockIdx.x >= blocks) return;  // the whole block (no pairs for it)
        const dp_u64 lo = (dp_u64)blockIdx.x * total / blocks, hi = ((dp_u64)blockIdx.x + 1) * total / blocks;
        auto block_of = [&](dp_u64 p) { return (int)(((p + 1) * blocks + total - 1) / total) - 1; };
        // Row m of tile `tile` of item `item` (rows past the matrix re-read row 0).
        auto wrow = [&](dp_u64 tile, int item, int m) {
          const int r = (int)tile * M + m < D ? (int)tile * M + m : 0;
          if constexpr (kQ4 != 0) {
            const dp_u64 e = (dp_u64)experts[1 + item];
            return dp_fp4_matrix_row<I>((const dp_u8*)w2 + e * stride_w2,
                                        (const dp_u8*)w2_scale + e * stride_w2_scale, r);
          } else {
            if (kShared && item == 0)
              return dp_fp8_matrix_row<SI>((const dp_u8*)shared_down, (const float*)shared_down_scale, r);
            const dp_u64 e = (dp_u64)experts[1 + item - kShared];
            return dp_fp8_matrix_row<I>((const dp_u8*)w2 + e * stride_w2, (const float*)w2_scale + e * stride_w2_scale,
                                        r);
          }
        };
        __shared__ dp_u32 last;
        // The end of the block's part of a tile (rows from row0), as the loop below ends each tile: the
        // groups' sums, the block's slot, the count, and the last block's sum of the slots. (A copy: the
        // loop's planned kernels changed their machine code when it shared this through a function.)
        auto finish_tile = [&](dp_u64 tile, int first, int last_block) {
          const int slots = last_block - first + 1;
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const int m = g + 8 * (k / 2), t = 8 * nt + 2 * q + (k % 2);
              if (t < T) partial[(group * M + m) * T + t] = acc[nt][k];
            }
          __syncthreads();
          float* mine = partials + ((dp_u64)tile * Split::kSlots + ((int)blockIdx.x - first)) * M * T;
          for (int i = (int)threadIdx.x; i < M * T; i += DP_GEMM_THREADS) {
            float sum = 0.0f;
#pragma unroll
            for (int gg = 0; gg < DP_GEMM_GROUPS; ++gg) sum += partial[gg * M * T + i];
            mine[i] = sum;
          }
          dp_fence_device();  // this block's slot is visible before it is counted
          __syncthreads();
          if (threadIdx.x == 0) last = dp_arrive_device(done + tile) == (dp_u32)(slots - 1) ? 1u : 0u;
          __syncthreads();
          if (last) {
            dp_fence_device();
            if (threadIdx.x == 0) done[tile] = 0u;
            const float* tp = partials + (dp_u64)tile * Split::kSlots * M * T;
            for (int i = (int)threadIdx.x; i < M * T; i += DP_GEMM_THREADS) {
              const int m = i / T, t = i % T;
              float sum = 0.0f;
              for (int sl = 0; sl < slots; ++sl) sum += dp_load_f32_coherent(tp + (dp_u64)sl * M * T + i);
              if (row0 + m < D) out[(dp_u64)t * D + row0 + m] = dp_f32_to_bf16(sum);
            }
          }
          __syncthreads();  // partial[] and `last` are reused by the next tile
        };
        dp_moe_down_ring<T, I, M, kRing>(lo, hi, items, wrow, act_row, row_weight, acc, [&](dp_u64 tile) {
          row0 = (int)tile * M;
          finish_tile(tile, block_of(tile * items), block_of((tile + 1) * items - 1));
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
        });
      } else
#endif
      {
        typedef decltype(weight_row(0, 0)) Row;
        constexpr int uS = kShared ? dp_mma_units<SI, Row>() : 0, uI = dp_mma_units<I, Row>();
        const dp_u64 per = (dp_u64)(kShared * uS + (items - kShared) * uI);  // units of one tile
        const dp_u64 total = per * Split::kTiles;
        // Blocks that get units: all G, or one per unit when there are fewer units than blocks (a block
        // with an empty range would be counted among a tile's blocks but never arrive).
        const dp_u64 blocks = total < (dp_u64)kSplit ? total : (dp_u64)kSplit;
        if ((dp_u64)blockIdx.x >= blocks) return;  // the whole block
        const dp_u64 lo = (dp_u64)blockIdx.x * total / blocks, hi = ((dp_u64)blockIdx.x + 1) * total / blocks;
        // The block holding unit u: the largest b with b*total/blocks <= u.
        auto block_of = [&](dp_u64 u) { return (int)(((u + 1) * blocks + total - 1) / total) - 1; };
        __shared__ dp_u32 last;
        for (dp_u64 tile = lo / per; tile * per < hi; ++tile) {  // every block has a unit: per > 0, lo < hi
          row0 = (int)tile * M;
          const int a = (int)((lo > tile * per ? lo : tile * per) - tile * per);
          const int b = (int)((hi < (tile + 1) * per ? hi : (tile + 1) * per) - tile * per);
#pragma unroll
          for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;
          // This group's part of the block's range of the tile, the items' units end to end.
          const int glo = a + group * (b - a) / DP_GEMM_GROUPS, ghi = a + (group + 1) * (b - a) / DP_GEMM_GROUPS;
          for (int item = (kShared && glo < uS) ? 0 : kShared + (glo - kShared * uS) / uI; item < items; ++item) {
            const int off = (kShared && item == 0) ? 0 : kShared * uS + (item - kShared) * uI;
            if (off >= ghi) break;
            const int n = (kShared && item == 0) ? uS : uI;
            add_item(item, glo > off ? glo - off : 0, ghi - off < n ? ghi - off : n);
          }
#pragma unroll
          for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
              const int m = g + 8 * (k / 2), t = 8 * nt + 2 * q + (k % 2);
              if (t < T) partial[(group * M + m) * T + t] = acc[nt][k];
            }
          __syncthreads();
          const int first = block_of(tile * per), slots = block_of((tile + 1) * per - 1) - first + 1;
          float* mine = partials + ((dp_u64)tile * Split::kSlots + ((int)blockIdx.x - first)) * M * T;
          for (int i = (int)threadIdx.x; i < M * T; i += DP_GEMM_THREADS) {
            float sum = 0.0f;
#pragma unroll
            for (int gg = 0; gg < DP_GEMM_GROUPS; ++gg) sum += partial[gg * M * T + i];
            mine[i] = sum;
          }
          dp_fence_device();  // this block's slot is visible before it is counted
          __syncthreads();
          if (threadIdx.x == 0) last = dp_arrive_device(done + tile) == (dp_u32)(slots - 1) ? 1u : 0u;
          __syncthreads();
          if (last) {
            dp_fence_device();
            if (threadIdx.x == 0) done[tile] = 0u;
            const float* tp = partials + (dp_u64)tile * Split::kSlots * M * T;
            for (int i = (int)threadIdx.x; i < M * T; i += DP_GEMM_THREADS) {
              const int m = i / T, t = i % T;
              float sum = 0.0f;
              for (int sl = 0; sl < slots; ++sl) sum += dp_load_f32_coherent(tp + (dp_u64)sl * M * T + i);
              if (row0 + m < D) out[(dp_u64)t * D + row0 + m] = dp_f32_to_bf16(sum);
            }
          }
          __syncthreads();  // partial[] and `last` are reused by the next tile
      }
      }
    } else {  // one block per tile
#if DP_HAS_BULK_COPY
    if constexpr (kQ4 != 0 && kRing > 0) {
      // MXFP4, any width: the tile's pairs (tile, expert) through the ring.
      const dp_u64 tile = (dp_u64)row0 / M;
      dp_moe_down_ring<T, I, M, kRing>(
          tile * items, (tile + 1) * items, items,
          [&](dp_u64, int item, int m) { return weight_row(item, m); }, act_row, row_weight, acc, [&](dp_u64) {});
    } else
    if constexpr (T == 1 && kQ8 != 0 && kRing > 0) {
      // One row, e4m3: the tile's 16 rows of every item through the ring (gemm.h, dp_ring_stream), the
      // shared expert's first. A stage holds 1024 columns of one item, so each group takes one 128-column
      // block of every stage; the item's coefficient is folded into the block scales.
      constexpr int kCols = 8 * DP_FP8_BLOCK;
      constexpr int nS = (SI + kCols - 1) / kCols, nI = (I + kCols - 1) / kCols;  // stages of an item
      constexpr int kStages = kRing;
      auto item_of = [&](int j) { return (kShared && j < nS) ? 0 : kShared + (j - kShared * nS) / nI; };
      auto stage_of = [&](int j) { return (kShared && j < nS) ? j : (j - kShared * nS) % nI; };
      auto width_of = [&](int j) { return (kShared && j < nS) ? SI : I; };
      auto cols_of = [&](int j) {  // bytes of each row in stage j
        const int left = width_of(j) - stage_of(j) * kCols;
        return left < kCols ? left : kCols;
      };
      auto load = [&](int j, dp_fp8_block_ops<1, NT>& o) {
        const int item = item_of(j), b = stage_of(j) * 8 + group, width = width_of(j);
        const bool in = DP_FP8_BLOCK * b < width;
        float c = 0.0f;
        const dp_bf16* xr = act_row(item, 0, &c);
        const dp_bf16* const xp[NT] = {g == 0 ? xr : nullptr};  // lanes g > 0: activation rows past T
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int col = DP_FP8_BLOCK * b + 64 * h + 16 * q;
          dp_load_x_half_fp8<NT, 0>(xp, col, col < width, o.x[h]);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) o.sc[0][r] = in ? weight_row(item, g + 8 * r).s[b] * c : 0.0f;
      };
      float racc[1][NT][4] = {};
      dp_fp8_block_ops<1, NT> cur, next;
      const int stages = kShared * nS + (items - kShared) * nI;
      dp_ring_stream<M, kCols, kStages, 0>(
          stages, cols_of,
          [&](int j, int i) { return weight_row(item_of(j), i).w + stage_of(j) * kCols; },
          [&](int j, const unsigned char* stage) {
            if (j == 0)
              load(j, cur);
            else
              cur = next;
            if (j + 1 < stages) load(j + 1, next);
            const int b = stage_of(j) * 8 + group, width = width_of(j);
            if (DP_FP8_BLOCK * b < width)
              dp_mma_ring_block_fp8<1, NT, dp_ring_geometry<M, kCols>::kRowBytes>(
                  stage, 0, DP_FP8_BLOCK * group, width - DP_FP8_BLOCK * b, cur, racc);
          });
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int k = 0; k < 4; ++k) acc[nt][k] = racc[0][nt][k];
    } else
#endif
    if constexpr (T == 1) {
      // One row: the items' K-units (dp_mma_units: blocks or chunks) laid end to end, the shared
      // expert's first, and cut into 8 equal ranges, one per group; a group's range may end inside an
      // item and the next group's begin there. The 9 items of the 48B shape (8 experts and the shared
      // one) left one group two whole items and the others one: 15.4 -> 14.7 us (H200, 2026-12-04).
      // With more rows (more items) the split items cost more than the balance won (width 8: 57.5 ->
      // 63.3 us), so from 2 rows a group takes whole items i, i + 8, ...
      typedef decltype(weight_row(0, 0)) Row;
      constexpr int uS = kShared ? dp_mma_units<SI, Row>() : 0, uI = dp_mma_units<I, Row>();
      const int units = kShared * uS + (items - kShared) * uI;
      const int lo = group * units / DP_GEMM_GROUPS, hi = (group + 1) * units / DP_GEMM_GROUPS;
      // First item the range touches: the shared expert, or routed item kShared + (lo - uS) / uI.
      for (int item = (kShared && lo < uS) ? 0 : kShared + (lo - kShared * uS) / uI; item < items; ++item) {
        const int off = (kShared && item == 0) ? 0 : kShared * uS + (item - kShared) * uI;
        if (off >= hi) break;
        const int n = (kShared && item == 0) ? uS : uI;
        add_item(item, lo > off ? lo - off : 0, hi - off < n ? hi - off : n);
      }
    } else {
      for (int item = group; item < items; item += DP_GEMM_GROUPS) add_item(item, 0, 0);
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int m = g + 8 * (k / 2), t = 8 * nt + 2 * q + (k % 2);
        if (t < T) partial[(group * M + m) * T + t] = acc[nt][k];
      }
    }  // one block per tile
#endif
  } else {
    for (int m0 = 0; m0 < M; m0 += MF) {
      float acc[MF][T];  // [MF, T] fp32 lane partials of this group's items
#pragma unroll
      for (int m = 0; m < MF; ++m)
#pragma unroll
        for (int t = 0; t < T; ++t) acc[m][t] = 0.0f;
      for (int item = group; item < items; item += DP_GEMM_GROUPS) {
        float tmp[MF][T];  // [MF, T] fp32 this item's lane partials
#pragma unroll
        for (int m = 0; m < MF; ++m)
#pragma unroll
          for (int t = 0; t < T; ++t) tmp[m][t] = 0.0f;
        float coef[T];  // [T] fp32 weight of this item in row t's output (0: row t does not use it)
        const dp_bf16* xr[T];
#pragma unroll
        for (int t = 0; t < T; ++t) xr[t] = act_row(item, t, &coef[t]);
        decltype(weight_row(0, 0)) w[MF];
#pragma unroll
        for (int m = 0; m < MF; ++m) w[m] = weight_row(item, m0 + m);
        if (kShared && item == 0)
          dp_dot_rows_all<T, MF, SI>(w, xr, lane, tmp);
        else
          dp_dot_rows_all<T, MF, I>(w, xr, lane, tmp);
#pragma unroll
        for (int m = 0; m < MF; ++m)
#pragma unroll
          for (int t = 0; t < T; ++t) acc[m][t] += coef[t] * tmp[m][t];
      }
      dp_group_reduce<T, MF>(acc);
      if (lane == 0) {
#pragma unroll
        for (int m = 0; m < MF; ++m)
#pragma unroll
          for (int t = 0; t < T; ++t) partial[(group * M + m0 + m) * T + t] = acc[m][t];
      }
    }
  }
  if constexpr (kSplit > 0 && kMma) return;  // the split grid wrote every tile it finished
  __syncthreads();
  for (int i = (int)threadIdx.x; i < M * T; i += DP_GEMM_THREADS) {
    const int m = i / T, t = i % T;
    float s = 0.0f;
#pragma unroll
    for (int g = 0; g < DP_GEMM_GROUPS; ++g) s += partial[(g * M + m) * T + t];
    if (row0 + m < D) out[(dp_u64)t * D + row0 + m] = dp_f32_to_bf16(s);
  }
}

template <int T, int D, int I, int E, int KT, int SI, int M>
__device__ __forceinline__ void dp_moe_down(const dp_bf16* __restrict__ h, const dp_bf16* __restrict__ hs,
                                            const dp_bf16* w2, const dp_bf16* shared_down,
                                            const dp_i32* __restrict__ experts, const dp_i32* __restrict__ expert_slots,
                                            const float* __restrict__ topk_weights, dp_bf16* __restrict__ out,
                                            float routed_scaling, dp_u32 stride_w2) {
  dp_moe_down_impl<T, D, I, E, KT, SI, M, 0>(h, hs, w2, nullptr, shared_down, nullptr, experts, expert_slots,
                                             topk_weights, out, routed_scaling, stride_w2, 0);
}
// Every expert matrix (routed and shared) e4m3 with 128 x 128 block scales.
template <int T, int D, int I, int E, int KT, int SI, int M, int kRing = 0>
__device__ __forceinline__ void dp_moe_down_q8(const dp_bf16* __restrict__ h, const dp_bf16* __restrict__ hs,
                                               const dp_u8* w2, const float* w2_scale, const dp_u8* shared_down,
                                               const float* shared_down_scale, const dp_i32* __restrict__ experts,
                                               const dp_i32* __restrict__ expert_slots,
                                               const float* __restrict__ topk_weights, dp_bf16* __restrict__ out,
                                               float routed_scaling, dp_u32 stride_w2, dp_u32 stride_w2_scale) {
  dp_moe_down_impl<T, D, I, E, KT, SI, M, 1, 0, 0, kRing>(h, hs, w2, w2_scale, shared_down, shared_down_scale,
                                                          experts, expert_slots, topk_weights, out, routed_scaling,
                                                          stride_w2, stride_w2_scale);
}
// Routed experts in MXFP4 (the K3 latent MoE: D is the latent width, out the scaled latent sum), no
// shared expert; strides in bytes (packed: at least D*I/2, a multiple of 16; scales: at least D*I/32).
// kRing > 0 (sm_90): the weight rows stream through a ring of kRing stages of 16 x 1024 columns in the
// launch's dynamic shared memory (kRing * 9216 bytes), at any width.
template <int T, int D, int I, int E, int KT, int SI, int M, int kRing = 0>
__device__ __forceinline__ void dp_moe_down_q4(const dp_bf16* __restrict__ h, const dp_u8* w2, const dp_u8* w2_scale,
                                               const dp_i32* __restrict__ experts,
                                               const dp_i32* __restrict__ expert_slots,
                                               const float* __restrict__ topk_weights, dp_bf16* __restrict__ out,
                                               float routed_scaling, dp_u32 stride_w2, dp_u32 stride_w2_scale) {
  dp_moe_down_impl<T, D, I, E, KT, SI, M, 0, 1, 0, kRing>(h, nullptr, w2, w2_scale, nullptr, nullptr, experts,
                                                          expert_slots, topk_weights, out, routed_scaling, stride_w2,
                                                          stride_w2_scale);
}
// The bf16 and e4m3 forms over a grid of G blocks that share every tile's work evenly (dp_moe_split;
// kSplit = G; bf16 from two rows, where the tensor cores take the tiles).
template <int T, int D, int I, int E, int KT, int SI, int M, int G>
__device__ __forceinline__ void dp_moe_down_split(const dp_bf16* __restrict__ h, const dp_bf16* __restrict__ hs,
                                                  const dp_bf16* w2, const dp_bf16* shared_down,
                                                  const dp_i32* __restrict__ experts,
                                                  const dp_i32* __restrict__ expert_slots,
                                                  const float* __restrict__ topk_weights, dp_bf16* __restrict__ out,
                                                  float routed_scaling, dp_u32 stride_w2, float* partials,
                                                  dp_u32* done) {
  static_assert(T >= 2, "moe_down: the bf16 split grid needs the tensor-core path (two rows or more)");
  dp_moe_down_impl<T, D, I, E, KT, SI, M, 0, 0, G>(h, hs, w2, nullptr, shared_down, nullptr, experts, expert_slots,
                                                   topk_weights, out, routed_scaling, stride_w2, 0, partials, done);
}
template <int T, int D, int I, int E, int KT, int SI, int M, int G, int kRing = 0>
__device__ __forceinline__ void dp_moe_down_q8_split(const dp_bf16* __restrict__ h, const dp_bf16* __restrict__ hs,
                                                     const dp_u8* w2, const float* w2_scale, const dp_u8* shared_down,
                                                     const float* shared_down_scale,
                                                     const dp_i32* __restrict__ experts,
                                                     const dp_i32* __restrict__ expert_slots,
                                                     const float* __restrict__ topk_weights, dp_bf16* __restrict__ out,
                                                     float routed_scaling, dp_u32 stride_w2, dp_u32 stride_w2_scale,
                                                     float* partials, dp_u32* done) {
  dp_moe_down_impl<T, D, I, E, KT, SI, M, 1, 0, G, kRing>(h, hs, w2, w2_scale, shared_down, shared_down_scale,
                                                          experts, expert_slots, topk_weights, out, routed_scaling,
                                                          stride_w2, stride_w2_scale, partials, done);
}
// The MXFP4 form over a grid of G blocks that share every tile's work evenly (dp_moe_split; kSplit = G).
// kRing > 0 (sm_90; also in the e4m3 form): the weight ring, the blocks sharing the (tile, item) pairs.
template <int T, int D, int I, int E, int KT, int SI, int M, int G, int kRing = 0>
__device__ __forceinline__ void dp_moe_down_q4_split(const dp_bf16* __restrict__ h, const dp_u8* w2,
                                                     const dp_u8* w2_scale, const dp_i32* __restrict__ experts,
                                                     const dp_i32* __restrict__ expert_slots,
                                                     const float* __restrict__ topk_weights, dp_bf16* __restrict__ out,
                                                     float routed_scaling, dp_u32 stride_w2, dp_u32 stride_w2_scale,
                                                     float* partials, dp_u32* done) {
  dp_moe_down_impl<T, D, I, E, KT, SI, M, 0, 1, G, kRing>(h, nullptr, w2, w2_scale, nullptr, nullptr, experts,
                                                          expert_slots, topk_weights, out, routed_scaling, stride_w2,
                                                          stride_w2_scale, partials, done);
}
