// One variant of the FP8 48B-shaped GEMV kernels: the entry points the product generates (build.sh puts
// them in OUT_DIR/gen/*.inc), each renamed with the variant suffix VAR so that variants link together.
#include <cuda_runtime.h>
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
#define moe_down_w8_d2304_i1024_e256_k8_s1024_q81 CAT(n8_, VAR)
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
#include "moe_down_w8_d2304_i1024_e256_k8_s1024_q81.inc"
// Grids: the generated launch's by default; a variant may override one with -DGRID_<kernel>=N.
#ifndef GRID_O1
#define GRID_O1 144
#endif
#ifndef GRID_O8
#define GRID_O8 144
#endif
#ifndef GRID_D1
#define GRID_D1 144
#endif
#ifndef GRID_D8
#define GRID_D8 144
#endif
#ifndef GRID_Q1
#define GRID_Q1 393
#endif
#ifndef GRID_Q8
#define GRID_Q8 393
#endif
#ifndef GRID_M1
#define GRID_M1 576
#endif
#ifndef GRID_M8
#define GRID_M8 576
#endif
#ifndef GRID_U1
#define GRID_U1 576
#endif
#ifndef GRID_U8
#define GRID_U8 264
#endif
#ifndef GRID_N1
#define GRID_N1 144
#endif
#ifndef GRID_N8
#define GRID_N8 144
#endif
// Buffers: P = pointers by role, set s (0/1) picks the weight copy (L2-cold alternation).
struct Buf { void* x; void* out; void* w[6]; float* s[6]; void* h; void* hs; int* ex; int* sl; float* tw; };
// which: 0 o_proj, 1 down, 2 qkv, 3 mlp_up, 4 moe_up, 5 moe_down; T 1 or 8
extern "C" void CAT(run_, VAR)(int which, int T, const Buf& b) {
  const unsigned SE = 1024u * 2304u, SS = 8u * 18u;  // expert stride (elements), scale stride
#define G(f) f<<<grid, 256>>>
  int grid = 0;
  switch (which * 10 + (T == 8)) {
    case 0: grid = GRID_O1; G(CAT(o1_, VAR))((const dp_bf16*)b.x, b.out, (const dp_u8*)b.w[0], b.s[0]); break;
    case 1: grid = GRID_O8; G(CAT(o8_, VAR))((const dp_bf16*)b.x, b.out, (const dp_u8*)b.w[0], b.s[0]); break;
    case 10: grid = GRID_D1; G(CAT(d1_, VAR))((const dp_bf16*)b.x, b.out, (const dp_u8*)b.w[0], b.s[0]); break;
    case 11: grid = GRID_D8; G(CAT(d8_, VAR))((const dp_bf16*)b.x, b.out, (const dp_u8*)b.w[0], b.s[0]); break;
    case 20: grid = GRID_Q1; G(CAT(q1_, VAR))((const dp_bf16*)b.x, b.out, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], (const dp_u8*)b.w[2], b.s[2], (const dp_bf16*)b.w[3], (const dp_bf16*)b.w[4], (const dp_bf16*)b.w[5]); break;
    case 21: grid = GRID_Q8; G(CAT(q8_, VAR))((const dp_bf16*)b.x, b.out, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], (const dp_u8*)b.w[2], b.s[2], (const dp_bf16*)b.w[3], (const dp_bf16*)b.w[4], (const dp_bf16*)b.w[5]); break;
    case 30: grid = GRID_M1; G(CAT(m1_, VAR))((const dp_bf16*)b.x, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], (dp_bf16*)b.out); break;
    case 31: grid = GRID_M8; G(CAT(m8_, VAR))((const dp_bf16*)b.x, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], (dp_bf16*)b.out); break;
    case 40: grid = GRID_U1; G(CAT(u1_, VAR))((const dp_bf16*)b.x, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], (const dp_u8*)b.w[2], b.s[2], (const dp_u8*)b.w[3], b.s[3], b.ex, b.sl, (dp_bf16*)b.h, (dp_bf16*)b.hs, SE, SS, SE, SS); break;
    case 41: grid = GRID_U8; G(CAT(u8_, VAR))((const dp_bf16*)b.x, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], (const dp_u8*)b.w[2], b.s[2], (const dp_u8*)b.w[3], b.s[3], b.ex, b.sl, (dp_bf16*)b.h, (dp_bf16*)b.hs, SE, SS, SE, SS); break;
    case 50: grid = GRID_N1; G(CAT(n1_, VAR))((const dp_bf16*)b.h, (const dp_bf16*)b.hs, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], b.ex, b.sl, b.tw, (dp_bf16*)b.out, 1.0f, SE, SS); break;
    case 51: grid = GRID_N8; G(CAT(n8_, VAR))((const dp_bf16*)b.h, (const dp_bf16*)b.hs, (const dp_u8*)b.w[0], b.s[0], (const dp_u8*)b.w[1], b.s[1], b.ex, b.sl, b.tw, (dp_bf16*)b.out, 1.0f, SE, SS); break;
  }
}
