// One variant of the FP8 48B-shaped GEMV kernels: the entry points the product generates (build.sh puts
// them in OUT_DIR/gen/*.inc), each renamed with the variant suffix VAR so that variants link together.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define gemm_w1_k4096_na2304_q81 CAT(o1_, VAR)
#define gemm_w8_k4096_na2304_q81 CAT(o8_, VAR)
#define gemm_w1_k9216_na2304_q81 CAT(d1_, VAR)
#define gemm_w8_k9216_na2304_q81 CAT(d8_, VAR)
#define gemm_w1_k2304_na4096_nb4096_nc4096_nd128_ne128_nf32_q87 CAT(q1_, VAR)
#define gemm_w8_k2304_na4096_nb4096_nc4096_nd128_ne128_nf32_q87 CAT(q8_, VAR)
#define mlp_up_w1_d2304_i9216_act0_q81 CAT(m1_, VAR)
#define mlp_up_w8_d2304_i9216_act0_q81 CAT(m8_, VAR)
#define moe_up_w1_d2304_i1024_e256_k8_s1024_act0_q81 CAT(u1_, VAR)
#define moe_up_w8_d2304_i1024_e256_k8_s1024_act0_q81 CAT(u8_, VAR)
#define moe_down_w1_d2304_i1024_e256_k8_s1024_q81 CAT(n1_, VAR)
#define moe_down_w8_d2304_i1024_e256_k8_s1024_q81_sk264 CAT(n8_, VAR)
#include "gemm_w1_k4096_na2304_q81.inc"
#include "gemm_w8_k4096_na2304_q81.inc"
#include "gemm_w1_k9216_na2304_q81.inc"
#include "gemm_w8_k9216_na2304_q81.inc"
#include "gemm_w1_k2304_na4096_nb4096_nc4096_nd128_ne128_nf32_q87.inc"
#include "gemm_w8_k2304_na4096_nb4096_nc4096_nd128_ne128_nf32_q87.inc"
#include "mlp_up_w1_d2304_i9216_act0_q81.inc"
#include "mlp_up_w8_d2304_i9216_act0_q81.inc"
#include "moe_up_w1_d2304_i1024_e256_k8_s1024_act0_q81.inc"
#include "moe_up_w8_d2304_i1024_e256_k8_s1024_act0_q81.inc"
#include "moe_down_w1_d2304_i1024_e256_k8_s1024_q81.inc"
#include "moe_down_w8_d2304_i1024_e256_k8_s1024_q81_sk264.inc"
// Grids: the generated launch's by default (grids.h, written by build.sh); a variant may override one
// with -DGRID_<kernel>=N.
#include "grids.h"
// Buffers: P = pointers by role, set s (0/1) picks the weight copy (L2-cold alternation).
struct Buf { void* x; void* out; void* w[6]; float* s[6]; void* h; void* hs; int* ex; int* sl; float* tw; float* part; unsigned* done; };
// Dynamic shared memory of the kernels whose e4m3 weights stream through a ring (-DRING_STAGES=N with the
// edited entry points of ring_incs.sh): the gemm block's rows (dp_fp8_ring_bytes), the routed gate/up
// and dense gate/up block tiles (2 slots x 16 rows, 4 K-slices) and the routed down's 16-row tile (1024-column stages).
#ifndef RING_STAGES
#define RING_STAGES 0
#endif
#define RING(K, MT, S) dp_fp8_ring_bytes<K, MT, S, RING_STAGES>()
#define RING_DOWN (RING_STAGES > 0 ? dp_ring_bytes<16, 1024, RING_STAGES>() : 0)
// -DWARP_RING_STAGES=M (ring_incs.sh with M): the gate/ups' warp tiles with a ring per warp instead.
#ifndef WARP_RING_STAGES
#define WARP_RING_STAGES 0
#endif
#define RING_GATE_UP (WARP_RING_STAGES > 0 ? dp_warp_ring_bytes<16, 256, WARP_RING_STAGES>() : RING(2304, 1, 4))
// Launch with or without programmatic dependent launch (the product's discipline), dynamic shared
// memory allowed once per kernel.
extern "C" int harness_pdl;
template <typename... P, typename... A>
static void launch(void (*f)(P...), int grid, int smem, A... a) {
  static const void* allowed[32];  // kernels whose dynamic shared memory is allowed (several share a type)
  static int n_allowed = 0;
  bool known = false;
  for (int i = 0; i < n_allowed; ++i) known |= allowed[i] == (const void*)f;
  if (!known && smem > 0 && n_allowed < 32) {
    cudaFuncSetAttribute(f, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    allowed[n_allowed++] = (const void*)f;
  }
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3(grid); c.blockDim = dim3(256); c.dynamicSmemBytes = smem;
  cudaLaunchAttribute at[1];
  at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  at[0].val.programmaticStreamSerializationAllowed = 1;
  c.attrs = at; c.numAttrs = harness_pdl ? 1 : 0;
  const cudaError_t e = cudaLaunchKernelEx(&c, f, (P)a...);
  if (e != cudaSuccess) {
    std::printf("launch of a %d-block grid with %d bytes of dynamic shared memory: %s\n", grid, smem,
                cudaGetErrorString(e));
    std::exit(1);
  }
}
// which: 0 o_proj, 1 down, 2 qkv, 3 mlp_up, 4 moe_up, 5 moe_down; T 1 or 8
extern "C" void CAT(run_, VAR)(int which, int T, const Buf& b) {
  const unsigned SE = 1024u * 2304u, SS = 8u * 18u;  // expert stride (elements), scale stride
  switch (which * 10 + (T == 8)) {
    case 0: launch(CAT(o1_, VAR), GRID_O1, RING(4096, 1, 8), (const dp_bf16*)b.x, b.out, (const dp_u8*)b.w[0], b.s[0]); break;
    case 1: launch(CAT(o8_, VAR), GRID_O8, RING(4096, 1, 8), (const dp_bf16*)b.x, b.out, (const dp_u8*)b.w[0], b.s[0]); break;
    case 10: launch(CAT(d1_, VAR), GRID_D1, RING(9216, 1, 8), (const dp_bf16*)b.x, b.out, (const dp_u8*)b.w[0], b.s[0]); break;
    case 11: launch(CAT(d8_, VAR), GRID_D8, RING(9216, 1, 8), (const dp_bf16*)b.x, b.out, (const dp_u8*)b.w[0], b.s[0]); break;
    case 20: launch(CAT(q1_, VAR), GRID_Q1, RING(2304, 1, 4), (const dp_bf16*)b.x, b.out, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], (const dp_u8*)b.w[2], b.s[2], (const dp_bf16*)b.w[3], (const dp_bf16*)b.w[4], (const dp_bf16*)b.w[5]); break;
    case 21: launch(CAT(q8_, VAR), GRID_Q8, RING(2304, 1, 4), (const dp_bf16*)b.x, b.out, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], (const dp_u8*)b.w[2], b.s[2], (const dp_bf16*)b.w[3], (const dp_bf16*)b.w[4], (const dp_bf16*)b.w[5]); break;
    case 30: launch(CAT(m1_, VAR), GRID_M1, RING_GATE_UP, (const dp_bf16*)b.x, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], (dp_bf16*)b.out); break;
    case 31: launch(CAT(m8_, VAR), GRID_M8, RING_GATE_UP, (const dp_bf16*)b.x, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], (dp_bf16*)b.out); break;
    case 40: launch(CAT(u1_, VAR), GRID_U1, RING_GATE_UP, (const dp_bf16*)b.x, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], (const dp_u8*)b.w[2], b.s[2], (const dp_u8*)b.w[3], b.s[3], b.ex, b.sl, (dp_bf16*)b.h, (dp_bf16*)b.hs, SE, SS, SE, SS); break;
    case 41: launch(CAT(u8_, VAR), GRID_U8, RING_GATE_UP, (const dp_bf16*)b.x, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], (const dp_u8*)b.w[2], b.s[2], (const dp_u8*)b.w[3], b.s[3], b.ex, b.sl, (dp_bf16*)b.h, (dp_bf16*)b.hs, SE, SS, SE, SS); break;
    case 50: launch(CAT(n1_, VAR), GRID_N1, RING_DOWN, (const dp_bf16*)b.h, (const dp_bf16*)b.hs, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], b.ex, b.sl, b.tw, (dp_bf16*)b.out, 1.0f, SE, SS); break;
    case 51: launch(CAT(n8_, VAR), GRID_N8, 0, (const dp_bf16*)b.h, (const dp_bf16*)b.hs, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], b.ex, b.sl, b.tw, (dp_bf16*)b.out, 1.0f, SE, SS, b.part, b.done); break;
  }
}
