// norm.h: fused residual add + RMSNorm, the op that opens every decoder layer (input_layernorm) and
// its second half (post_attention_layernorm), and the final norm.
//
// vLLM's (hidden_states, residual) convention: with a residual,
//   residual_out = bf16(hidden + residual)            the residual stream after this layer's mixer/FFN
//   out          = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * weight),  x = residual_out in fp32
// and for layer 0 (residual == nullptr) the sum is just `hidden`. The statistics are taken over the
// bf16-rounded sum, as HF transformers does (its residual stream is a bf16 tensor), and the
// normalised value is rounded to bf16 before the weight multiply, as HF's `weight * x.to(bf16)`.
#pragma once

#include "vendor.h"

// Host-side launch contract (compiler/codegen computes the same numbers): grid = W blocks, one row
// each; block = kThreads threads, a multiple of 64 so that it is whole warps (32) and whole
// wavefronts (64). H must be a multiple of 8 (16-byte vectors of bf16) and every pointer 16-byte
// aligned; the runtime checks both at bind time. `out` may alias `hidden` and `residual_out` may
// alias `residual` (vLLM updates in place): each thread reads its elements before it writes them.
// kHiddenStride (elements between hidden rows, a multiple of 8, default H) lets the op normalise the
// leading H columns of wider rows, e.g. the K3 MLA q-LoRA latent inside the fused projection output
// [q_a | kv_a | g]; out, residual and residual_out keep dense [W, H] rows.
template <int W, int H, int kThreads, int kHiddenStride = H>
__device__ __forceinline__ void dp_add_rmsnorm(const dp_bf16* hidden,                 // [W, kHiddenStride] bf16
                                               const dp_bf16* residual,               // [W, H] bf16, or nullptr (layer 0)
                                               const dp_bf16* __restrict__ weight,    // [H] bf16
                                               dp_bf16* out,                          // [W, H] bf16
                                               dp_bf16* residual_out,                 // [W, H] bf16
                                               float eps) {
  static_assert(H % 8 == 0, "dp_add_rmsnorm: H must be a multiple of 8 (16-byte bf16 vectors)");
  static_assert(kThreads % 64 == 0, "dp_add_rmsnorm: block must be whole wave64 wavefronts");
  static_assert(kHiddenStride >= H && kHiddenStride % 8 == 0, "dp_add_rmsnorm: hidden rows hold H, 16-byte aligned");
  constexpr int kVecs = H / 8;                                // 16-byte vectors per row
  constexpr int kPer = (kVecs + kThreads - 1) / kThreads;    // vectors per thread (registers)
  const int row = (int)blockIdx.x;
  if (row >= W) return;  // whole block leaves together, so the barrier below stays uniform

  const dp_bf16* h = hidden + (dp_u64)row * kHiddenStride;              // [H] bf16
  const dp_bf16* r = residual ? residual + (dp_u64)row * H : nullptr;   // [H] bf16
  dp_bf16* o = out + (dp_u64)row * H;                                    // [H] bf16
  dp_bf16* ro = residual_out + (dp_u64)row * H;                          // [H] bf16

  // The weight does not depend on the row: where registers allow (up to 2 vectors a thread; at 4,
  // H = 7168, 8 bytes spill), its loads are issued with the row's, not one more round trip after the
  // block sum.
  constexpr bool kEarlyWeight = kPer <= 2;
  dp_u32x4 wv[kPer];  // [kPer] 16-byte bf16 weight vectors
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int v = (int)threadIdx.x + i * kThreads;
    if (kEarlyWeight && v < kVecs) wv[i] = dp_load16(weight + 8 * v);
  }

  float x[kPer][8];  // [kPer, 8] fp32: this thread's slice of the row, kept in registers
  float sumsq = 0.0f;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int v = (int)threadIdx.x + i * kThreads;
    if (v < kVecs) {
      dp_unpack8_bf16(dp_load16(h + 8 * v), x[i]);
      if (r) {
        float b[8];
        dp_unpack8_bf16(dp_load16(r + 8 * v), b);
#pragma unroll
        for (int k = 0; k < 8; ++k) x[i][k] = dp_bf16_to_f32(dp_f32_to_bf16(x[i][k] + b[k]));
      }
      dp_store16(ro + 8 * v, dp_pack8_bf16(x[i]));
#pragma unroll
      for (int k = 0; k < 8; ++k) sumsq += x[i][k] * x[i][k];
    }
  }

  // mean = sum * (1/H): a multiply by a compile-time constant (within 1 ulp of torch's division, far
  // below bf16 resolution) instead of an IEEE division, whose slow path triples the NVIDIA code size.
  const float scale = dp_rsqrtf(dp_block_sum<kThreads>(sumsq) * (1.0f / (float)H) + eps);

#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int v = (int)threadIdx.x + i * kThreads;
    if (v < kVecs) {
      float w[8];
      dp_unpack8_bf16(kEarlyWeight ? wv[i] : dp_load16(weight + 8 * v), w);
      float y[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) y[k] = dp_bf16_to_f32(dp_f32_to_bf16(x[i][k] * scale)) * w[k];
      dp_store16(o + 8 * v, dp_pack8_bf16(y));
    }
  }
}
