// attnres.h: Kimi-K3 block attention residuals (model-family.md 3d), the K3 form of the fused
// residual add + RMSNorm (norm.h). It opens both halves of every K3 decoder layer and closes the model.
//
// The step's state lives in the attn_res buffer the host binds (runtime: DP_KV_ATTN_RES): per row t of
// the step, up to NB stored blocks of H bf16 values, `blocks + t * stride_blocks + k * H`, oldest first.
// The partial sum p of the current block travels as vLLM's residual (the layer program's `residual`).
// Per row:
//   p  = bf16(hidden + residual)                       (residual == nullptr: p = hidden, layer 0)
//   n  = blocks stored: S 0 (before the input norm)     ceil(layer / B)
//                       S 1 (before the post-attention) floor(layer / B) + 1
//                       S 2 (before the final norm)     ceil(layer / B), layer = num_hidden_layers
//   l_k = (x_k . w_eff) * rsqrt(mean(x_k^2) + eps) for the n blocks x_k and for p; w_eff = res_norm * res_proj
//   pi = softmax(l);  h = bf16(sum_k pi_k x_k + pi_p p)
//   push (S 0 and layer % B == 0): p is stored as block n and residual_out = 0 (the sum restarts);
//         otherwise residual_out = p
//   out = bf16(bf16(h * rsqrt(mean(h^2) + eps)) * weight)  (as norm.h; statistics of the bf16 h)
// res_norm * res_proj is exact in fp32 (a product of two bf16). Logits, softmax and the mix are fp32.
#pragma once

#include "vendor.h"

// Host-side launch contract (compiler/codegen computes the same numbers): grid = W blocks, one row
// each; block = kThreads threads, whole wave64 wavefronts. H a multiple of 8, every pointer and
// stride_blocks * 2 bytes 16-byte aligned. `out` may alias `hidden` and `residual_out` `residual`: each
// thread reads its elements before it writes them. The blocks a launch reads (k < n) and the one it
// writes (k = n) are distinct. n is clamped to NB and a push beyond NB is dropped: the runtime never
// passes such a layer (the buffer it validates holds NB blocks), so this only keeps a bad value in bounds.
template <int W, int H, int B, int NB, int S, int kThreads>
__device__ __forceinline__ void dp_attn_res_norm(const dp_bf16* hidden,                 // [W, H] bf16
                                                 const dp_bf16* residual,               // [W, H] bf16, or nullptr
                                                 dp_bf16* blocks,                       // [W, stride] bf16: [NB, H] used
                                                 dp_u32 stride_blocks,                  // elements between rows
                                                 dp_u32 layer,                          // decoder layer (S 2: layers)
                                                 const dp_bf16* __restrict__ res_norm,  // [H] bf16
                                                 const dp_bf16* __restrict__ res_proj,  // [1, H] bf16
                                                 const dp_bf16* __restrict__ weight,    // [H] bf16
                                                 dp_bf16* out,                          // [W, H] bf16
                                                 dp_bf16* residual_out,                 // [W, H] bf16
                                                 float eps) {
  static_assert(H % 8 == 0, "dp_attn_res_norm: H must be a multiple of 8 (16-byte bf16 vectors)");
  static_assert(kThreads % 64 == 0, "dp_attn_res_norm: block must be whole wave64 wavefronts");
  static_assert(B >= 1 && NB >= 1 && S >= 0 && S <= 2, "dp_attn_res_norm: B >= 1, NB >= 1, S in 0..2");
  constexpr int kVecs = H / 8;                               // 16-byte vectors per row
  constexpr int kPer = (kVecs + kThreads - 1) / kThreads;   // vectors per thread
  constexpr int kWarps = kThreads / DP_WARP_SIZE;
  constexpr int kSums = 2 * (NB + 1);                       // (dot, sumsq) of each block, then of p
  const int row = (int)blockIdx.x;
  if (row >= W) return;  // whole block leaves together

  const int stored = S == 1 ? (int)(layer / B) + 1 : (int)((layer + B - 1) / B);
  const int n = stored < NB ? stored : NB;
  const bool push = S == 0 && layer % B == 0 && n < NB;

  const dp_bf16* h = hidden + (dp_u64)row * H;
  const dp_bf16* r = residual ? residual + (dp_u64)row * H : nullptr;
  dp_bf16* blk = blocks + (dp_u64)row * stride_blocks;  // [NB, H] of this row
  dp_bf16* o = out + (dp_u64)row * H;
  dp_bf16* ro = residual_out + (dp_u64)row * H;

  // Pass 1: p (bf16, kept packed), w_eff (fp32), and every source's dot with w_eff and sum of squares.
  dp_u32x4 pv[kPer];     // [kPer] p as 16-byte bf16 vectors
  float we[kPer][8];     // [kPer, 8] w_eff
  float sums[kSums];     // per source: [2k] = x_k . w_eff, [2k + 1] = x_k . x_k; p at k = NB
#pragma unroll
  for (int j = 0; j < kSums; ++j) sums[j] = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int v = (int)threadIdx.x + i * kThreads;
    if (v < kVecs) {
      float x[8], a[8], b[8];
      dp_unpack8_bf16(dp_load16(h + 8 * v), x);
      if (r) {
        dp_unpack8_bf16(dp_load16(r + 8 * v), b);
#pragma unroll
        for (int k = 0; k < 8; ++k) x[k] = dp_bf16_to_f32(dp_f32_to_bf16(x[k] + b[k]));
      }
      pv[i] = dp_pack8_bf16(x);
      dp_unpack8_bf16(dp_load16(res_norm + 8 * v), a);
      dp_unpack8_bf16(dp_load16(res_proj + 8 * v), b);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        we[i][k] = a[k] * b[k];
        sums[2 * NB] += x[k] * we[i][k];
        sums[2 * NB + 1] += x[k] * x[k];
      }
    }
  }
#pragma unroll
  for (int kb = 0; kb < NB; ++kb) {
    if (kb < n) {
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int v = (int)threadIdx.x + i * kThreads;
        if (v < kVecs) {
          float x[8];
          dp_unpack8_bf16(dp_load16(blk + (dp_u64)kb * H + 8 * v), x);
#pragma unroll
          for (int k = 0; k < 8; ++k) {
            sums[2 * kb] += x[k] * we[i][k];
            sums[2 * kb + 1] += x[k] * x[k];
          }
        }
      }
    }
  }

  // One block reduction for all of them: warp butterflies, then every thread adds the warps' partials
  // in the same order (so every thread holds bit-identical totals and the same softmax).
  __shared__ float red[kWarps][kSums];  // [kWarps, kSums] fp32
#pragma unroll
  for (int j = 0; j < kSums; ++j) sums[j] = dp_warp_sum(sums[j]);
  const int warp = (int)threadIdx.x / DP_WARP_SIZE;
  if (dp_lane_id() == 0)
#pragma unroll
    for (int j = 0; j < kSums; ++j) red[warp][j] = sums[j];
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kSums; ++j) {
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) t += red[w][j];
    sums[j] = t;
  }

  // Softmax over the n blocks and p (index NB).
  float pi[NB + 1];
  float mx = -3.0e38f;
#pragma unroll
  for (int k = 0; k <= NB; ++k) {
    if (k < n || k == NB) {
      pi[k] = sums[2 * k] * dp_rsqrtf(sums[2 * k + 1] * (1.0f / (float)H) + eps);
      mx = pi[k] > mx ? pi[k] : mx;
    }
  }
  float z = 0.0f;
#pragma unroll
  for (int k = 0; k <= NB; ++k) {
    if (k < n || k == NB) {
      pi[k] = dp_expf(pi[k] - mx);
      z += pi[k];
    }
  }
  const float inv_z = 1.0f / z;

  // Pass 2: h = sum pi x (the blocks again, now from cache), rounded to bf16; the stores of p.
  float hx[kPer][8];  // [kPer, 8] fp32 h (bf16 values)
  float sumsq = 0.0f;
  const dp_u32x4 zero = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int v = (int)threadIdx.x + i * kThreads;
    if (v < kVecs) {
      float x[8];
      dp_unpack8_bf16(pv[i], x);
#pragma unroll
      for (int k = 0; k < 8; ++k) hx[i][k] = pi[NB] * x[k];
#pragma unroll
      for (int kb = 0; kb < NB; ++kb) {
        if (kb < n) {
          dp_unpack8_bf16(dp_load16(blk + (dp_u64)kb * H + 8 * v), x);
#pragma unroll
          for (int k = 0; k < 8; ++k) hx[i][k] += pi[kb] * x[k];
        }
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        hx[i][k] = dp_bf16_to_f32(dp_f32_to_bf16(hx[i][k] * inv_z));
        sumsq += hx[i][k] * hx[i][k];
      }
      if (push) {
        dp_store16(blk + (dp_u64)n * H + 8 * v, pv[i]);
        dp_store16(ro + 8 * v, zero);
      } else {
        dp_store16(ro + 8 * v, pv[i]);
      }
    }
  }

  const float scale = dp_rsqrtf(dp_block_sum<kThreads>(sumsq) * (1.0f / (float)H) + eps);
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int v = (int)threadIdx.x + i * kThreads;
    if (v < kVecs) {
      float w[8], y[8];
      dp_unpack8_bf16(dp_load16(weight + 8 * v), w);
#pragma unroll
      for (int k = 0; k < 8; ++k) y[k] = dp_bf16_to_f32(dp_f32_to_bf16(hx[i][k] * scale)) * w[k];
      dp_store16(o + 8 * v, dp_pack8_bf16(y));
    }
  }
}
