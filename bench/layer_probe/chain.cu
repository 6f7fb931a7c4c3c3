// The chain: the same four device functions as four kernels (the product's entry points, the norm at
// 256 threads as in the fused form), and the driver that runs both forms and compares them.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common.h"
#include "gemm.h"
#include "moe.h"
#include "norm.h"

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

extern "C" __global__ DP_LAUNCH_BOUNDS(256) void k_norm(FfnArgs a) {
  DP_GRID_DEPENDENCY_ENTRY();
  dp_add_rmsnorm<1, kH, 256>((const dp_bf16*)a.hidden, (const dp_bf16*)a.residual, (const dp_bf16*)a.norm_w,
                             (dp_bf16*)a.x2, (dp_bf16*)a.residual, 1e-6f);
}
extern "C" __global__ DP_KERNEL_BOUNDS(256) void k_router(FfnArgs a) {
  DP_GRID_DEPENDENCY_ENTRY();
  dp_gemm_route<1, kH, kE, 0, 0, 0, 0, 0, 1, 1, 8, 0, 8, 1>((const dp_bf16*)a.x2, a.logits, (const dp_bf16*)a.router_w,
                                                            nullptr, a.bias, a.topk_ids, a.topk_w, a.experts, a.slots,
                                                            a.done);
}
extern "C" __global__ DP_KERNEL_BOUNDS_2(256) void k_up(FfnArgs a) {
  DP_GRID_DEPENDENCY_ENTRY();
  dp_moe_up_q8<1, kH, kI, kE, kTopK, kS, 0, 1, 4, 1>((const dp_bf16*)a.x2, a.w1, a.w1s, a.w3, a.w3s, a.sg, a.sgs, a.su,
                                                     a.sus, a.experts, a.slots, (dp_bf16*)a.h, (dp_bf16*)a.hs,
                                                     kI * kH, 144, kI * kH, 144);
}
extern "C" __global__ DP_KERNEL_BOUNDS_2(256) void k_down(FfnArgs a) {
  DP_GRID_DEPENDENCY_ENTRY();
  dp_moe_down_q8<1, kH, kI, kE, kTopK, kS, 16>((const dp_bf16*)a.h, (const dp_bf16*)a.hs, a.w2, a.w2s, a.sd, a.sds,
                                               a.experts, a.slots, a.topk_w, (dp_bf16*)a.out, 1.0f, kH * kI, 144);
}

// Deterministic fills: e4m3 codes of moderate magnitude (no NaN), scales around 1/64, bf16 around 0.1.
__global__ void fill_u8(uint8_t* p, size_t n, unsigned seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)(i * 2654435761u) ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = (uint8_t)((h & 0x80u) | (0x20u + (h >> 8) % 0x30u));
  }
}
__global__ void fill_f32(float* p, size_t n, float v) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) p[i] = v;
}
__global__ void fill_bf16(uint16_t* p, size_t n, unsigned seed, float scale) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)(i * 2246822519u) ^ seed;
    h ^= h >> 15;
    h *= 0x27d4eb2fu;
    h ^= h >> 13;
    const float f = ((float)(h & 0xffffu) / 65535.0f - 0.5f) * scale;
    unsigned u;
    std::memcpy(&u, &f, 4);
    p[i] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
}

template <typename T>
T* alloc(size_t n) {
  void* p;
  CK(cudaMalloc(&p, n * sizeof(T)));
  CK(cudaMemset(p, 0, n * sizeof(T)));
  return (T*)p;
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  const int layers = 4;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  std::vector<FfnArgs> L(layers);
  std::vector<uint16_t*> residual0(layers);
  const size_t ew = (size_t)kE * kI * kH;
  for (int l = 0; l < layers; ++l) {
    FfnArgs& a = L[l];
    const unsigned s = 1000u * (l + 1);
    uint16_t* hid = alloc<uint16_t>(kH);
    fill_bf16<<<8, 256>>>(hid, kH, s + 1, 2.0f);
    a.hidden = l ? L[l - 1].out : hid;
    a.residual = alloc<uint16_t>(kH);
    residual0[l] = alloc<uint16_t>(kH);
    fill_bf16<<<8, 256>>>(residual0[l], kH, s + 2, 2.0f);
    uint16_t* nw = alloc<uint16_t>(kH);
    fill_bf16<<<8, 256>>>(nw, kH, s + 3, 0.2f);
    a.norm_w = nw;
    a.x2 = alloc<uint16_t>(kH);
    a.logits = alloc<float>(kE);
    uint16_t* rw = alloc<uint16_t>((size_t)kE * kH);
    fill_bf16<<<256, 256>>>(rw, (size_t)kE * kH, s + 4, 0.2f);
    a.router_w = rw;
    a.bias = alloc<float>(kE);
    a.topk_ids = alloc<int>(kTopK);
    a.topk_w = alloc<float>(kTopK);
    a.experts = alloc<int>(1 + kTopK);
    a.slots = alloc<int>(kTopK);
    a.done = alloc<unsigned>(64);
    uint8_t* w;
    float* sc;
    w = alloc<uint8_t>(ew), fill_u8<<<1024, 256>>>(w, ew, s + 5), a.w1 = w;
    w = alloc<uint8_t>(ew), fill_u8<<<1024, 256>>>(w, ew, s + 6), a.w3 = w;
    w = alloc<uint8_t>(ew), fill_u8<<<1024, 256>>>(w, ew, s + 7), a.w2 = w;
    w = alloc<uint8_t>((size_t)kS * kH), fill_u8<<<256, 256>>>(w, (size_t)kS * kH, s + 8), a.sg = w;
    w = alloc<uint8_t>((size_t)kS * kH), fill_u8<<<256, 256>>>(w, (size_t)kS * kH, s + 9), a.su = w;
    w = alloc<uint8_t>((size_t)kS * kH), fill_u8<<<256, 256>>>(w, (size_t)kS * kH, s + 10), a.sd = w;
    for (const float** p : {&a.w1s, &a.w3s, &a.w2s}) {
      sc = alloc<float>((size_t)kE * 144), fill_f32<<<64, 256>>>(sc, (size_t)kE * 144, 1.0f / 64), *p = sc;
    }
    for (const float** p : {&a.sgs, &a.sus, &a.sds}) {
      sc = alloc<float>(144), fill_f32<<<1, 256>>>(sc, 144, 1.0f / 64), *p = sc;
    }
    a.h = alloc<uint16_t>((size_t)kTopK * kI);
    a.hs = alloc<uint16_t>(kS);
    a.out = alloc<uint16_t>(kH);
  }
  unsigned* bar = alloc<unsigned>(64);
  CK(cudaDeviceSynchronize());

  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  auto launch = [&](auto kern, int grid, const FfnArgs& a) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(256);
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CK(cudaLaunchKernelEx(&cfg, kern, a));
  };
  const int per_sm = mega_blocks_per_sm();
  const int mega_grid = per_sm * prop.multiProcessorCount;
  std::printf("device %s, %d SMs; fused grid %d (%d blocks per SM)\n", prop.name, prop.multiProcessorCount, mega_grid,
              per_sm);
  auto chain_body = [&] {
    for (int l = 0; l < layers; ++l) {
      launch(k_norm, 1, L[l]);
      launch(k_router, 16, L[l]);
      launch(k_up, 144, L[l]);
      launch(k_down, 144, L[l]);
    }
  };
  auto mega_body = [&] {
    for (int l = 0; l < layers; ++l) launch_mega(L[l], bar, mega_grid, st, false);
  };
  auto megap_body = [&] {
    for (int l = 0; l < layers; ++l) launch_mega(L[l], bar, mega_grid, st, true);
  };
  const int cg_grid = mega_blocks_per_sm_cg() * prop.multiProcessorCount;
  auto megacg_body = [&] {
    for (int l = 0; l < layers; ++l) launch_mega_cg(L[l], bar, cg_grid, st, true);
  };
  auto reset = [&] {
    for (int l = 0; l < layers; ++l) CK(cudaMemcpyAsync(L[l].residual, residual0[l], kH * 2, cudaMemcpyDeviceToDevice, st));
  };
  auto graph_of = [&](auto&& body) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
    body();
    CK(cudaStreamEndCapture(st, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    return ge;
  };
  cudaGraphExec_t gc = graph_of(chain_body), gm = graph_of(mega_body), gp = graph_of(megap_body),
                  gg = graph_of(megacg_body);
  // Outputs: each form once from the same residual stream, then compared bit for bit.
  auto outputs = [&](cudaGraphExec_t g) {
    reset();
    CK(cudaGraphLaunch(g, st));
    CK(cudaStreamSynchronize(st));
    std::vector<uint16_t> o;
    for (int l = 0; l < layers; ++l) {
      std::vector<uint16_t> v(kH), r(kH);
      std::vector<int> ids(kTopK);
      CK(cudaMemcpy(v.data(), L[l].out, kH * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(r.data(), L[l].residual, kH * 2, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(ids.data(), L[l].topk_ids, kTopK * 4, cudaMemcpyDeviceToHost));
      o.insert(o.end(), v.begin(), v.end());
      o.insert(o.end(), r.begin(), r.end());
      for (int i : ids) o.push_back((uint16_t)i);
    }
    return o;
  };
  const std::vector<uint16_t> oc = outputs(gc), om = outputs(gm), op = outputs(gp), og = outputs(gg), oc2 = outputs(gc);
  size_t diff = 0, diffp = 0, diffg = 0, nonzero = 0;
  for (size_t i = 0; i < oc.size(); ++i) {
    diff += oc[i] != om[i];
    diffp += oc[i] != op[i];
    diffg += oc[i] != og[i];
    nonzero += (oc[i] & 0x7fff) != 0;
  }
  std::printf("outputs: %zu values (4 layers: out, residual, top-k ids), %zu non-zero; fused vs chain: %zu differ; "
              "fused+prefetch vs chain: %zu differ; fused+prefetch, cg loads, vs chain: %zu differ; chain twice: %s\n",
              oc.size(), nonzero, diff, diffp, diffg, oc == oc2 ? "identical" : "DIFFERENT");
  {
    std::vector<int> ids(kTopK);
    CK(cudaMemcpy(ids.data(), L[0].topk_ids, kTopK * 4, cudaMemcpyDeviceToHost));
    std::printf("layer 0 experts:");
    for (int i : ids) std::printf(" %d", i);
    std::printf("\n");
  }
  // Bytes a layer reads: router, 8 experts' gate/up/down, the shared expert, scales (small).
  const double bytes = (double)kE * kH * 2 + 3.0 * kTopK * kI * kH + 3.0 * kS * kH;
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time = [&](cudaGraphExec_t g) {
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
      CK(cudaEventRecord(e0, st));
      CK(cudaGraphLaunch(g, st));
      CK(cudaEventRecord(e1, st));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms * 1000 / layers);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  for (int i = 0; i < 3; ++i) time(gc), time(gm), time(gp), time(gg);
  std::printf("%-14s %10s %10s   (%.2f MB a layer's FFN half)\n", "form", "us/layer", "TB/s", bytes / 1e6);
  for (int pass = 0; pass < 3; ++pass)
    for (int f = 0; f < 4; ++f) {
      const cudaGraphExec_t g[4] = {gc, gm, gp, gg};
      const char* name[4] = {"chain", "fused", "fused+prefetch", "fused+pf+cg"};
      const float us = time(g[f]);
      std::printf("%-14s %10.2f %10.3f\n", name[f], us, bytes / us / 1e6);
    }
  return 0;
}
