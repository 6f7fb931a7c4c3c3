// The fused FFN half: every device function of the chain sees a virtual blockIdx/gridDim (the block it
// stands for in its own kernel's grid), set in shared memory before each call.
#include <cuda_runtime.h>

#include "common.h"
// PROBE_CG: every 16-byte load of the templates (weights and activations) through L2 only (ld.global.cg),
// coherent with the other blocks' stores of the same launch, as a fused kernel must read its activations.
#if PROBE_CG
#include "vendor.h"
#define dp_load16 dp_load16_coherent
#define PROBE(name) name##_cg
#else
#define PROBE(name) name
#endif
__shared__ uint3 dp_vblock;
__shared__ uint3 dp_vgrid;
#define blockIdx dp_vblock
#define gridDim dp_vgrid
#include "gemm.h"
#include "moe.h"
#include "norm.h"
#undef blockIdx
#undef gridDim

__device__ __forceinline__ unsigned phys_block() {
  unsigned v;
  asm("mov.u32 %0, %%ctaid.x;" : "=r"(v));
  return v;
}
__device__ __forceinline__ unsigned phys_grid() {
  unsigned v;
  asm("mov.u32 %0, %%nctaid.x;" : "=r"(v));
  return v;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// Every block of the resident grid: count in, the last resets the count and bumps the generation.
__device__ __forceinline__ void grid_barrier(unsigned* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned g = ld_acquire(bar + 1);
    __threadfence();
    if (atomicAdd(bar, 1u) == phys_grid() - 1) {
      atomicExch(bar, 0u);
      __threadfence();
      atomicAdd(bar + 1, 1u);
    } else {
      while (ld_acquire(bar + 1) == g) {
      }
    }
    __threadfence();
  }
  __syncthreads();
}
// Runs f for this block's virtual blocks of a grid of g.
template <typename F>
__device__ __forceinline__ void as_grid(unsigned g, F f) {
  for (unsigned vb = phys_block(); vb < g; vb += phys_grid()) {
    __syncthreads();
    if (threadIdx.x == 0) {
      dp_vblock = make_uint3(vb, 0, 0);
      dp_vgrid = make_uint3(g, 1, 1);
    }
    __syncthreads();
    f();
  }
}

// The blocks idle in an op of g virtual blocks (g <= the grid) pull the next ops' known weights into L2.
__device__ __forceinline__ void prefetch_idle(unsigned g, const void* p, unsigned long long bytes) {
  const unsigned b = phys_block(), n = phys_grid();
  if (b < g || n <= g) return;
  const unsigned long long lines = bytes / 128, who = (unsigned long long)(b - g) * 256 + threadIdx.x,
                           all = (unsigned long long)(n - g) * 256;
  for (unsigned long long i = who; i < lines; i += all)
    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"((const char*)p + i * 128));
}

template <bool kPrefetch>
__global__ DP_KERNEL_BOUNDS_2(256) void PROBE(ffn_mega)(FfnArgs a, unsigned* bar) {
  DP_GRID_DEPENDENCY_ENTRY();
  if (kPrefetch) prefetch_idle(1, a.router_w, (unsigned long long)kE * kH * 2);
  if (kPrefetch) prefetch_idle(16, a.sg, (unsigned long long)kS * kH);
  as_grid(1, [&] {
    dp_add_rmsnorm<1, kH, 256>((const dp_bf16*)a.hidden, (const dp_bf16*)a.residual, (const dp_bf16*)a.norm_w,
                               (dp_bf16*)a.x2, (dp_bf16*)a.residual, 1e-6f);
  });
  grid_barrier(bar);
  if (kPrefetch) prefetch_idle(16, a.su, (unsigned long long)kS * kH);
  as_grid(16, [&] {
    dp_gemm_route<1, kH, kE, 0, 0, 0, 0, 0, 1, 1, 8, 0, 8, 1>((const dp_bf16*)a.x2, a.logits, (const dp_bf16*)a.router_w,
                                                              nullptr, a.bias, a.topk_ids, a.topk_w, a.experts, a.slots,
                                                              a.done);
  });
  grid_barrier(bar);
  as_grid(144, [&] {
    dp_moe_up_q8<1, kH, kI, kE, kTopK, kS, 0, 1, 4, 1>(
        (const dp_bf16*)a.x2, a.w1, a.w1s, a.w3, a.w3s, a.sg, a.sgs, a.su, a.sus, a.experts, a.slots, (dp_bf16*)a.h,
        (dp_bf16*)a.hs, kI * kH, 144, kI * kH, 144);
  });
  grid_barrier(bar);
  as_grid(144, [&] {
    dp_moe_down_q8<1, kH, kI, kE, kTopK, kS, 16>((const dp_bf16*)a.h, (const dp_bf16*)a.hs, a.w2, a.w2s, a.sd, a.sds,
                                                 a.experts, a.slots, a.topk_w, (dp_bf16*)a.out, 1.0f, kH * kI, 144);
  });
}

void PROBE(launch_mega)(const FfnArgs& a, unsigned* bar, int blocks, void* stream, bool prefetch) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(256);
  cfg.stream = (cudaStream_t)stream;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = at;
  cfg.numAttrs = 1;
  if (prefetch)
    cudaLaunchKernelEx(&cfg, PROBE(ffn_mega)<true>, a, bar);
  else
    cudaLaunchKernelEx(&cfg, PROBE(ffn_mega)<false>, a, bar);
}
int PROBE(mega_blocks_per_sm)() {
  int n = 0;
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, PROBE(ffn_mega)<false>, 256, 0);
  return n;
}
