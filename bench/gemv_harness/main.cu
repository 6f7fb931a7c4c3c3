// Times variants of the FP8 48B-shaped GEMV kernels (widths 1 and 8) against this GPU's HBM read ceiling
// measured in the same run; checks every variant's outputs against variant 0's.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cmath>
#include <algorithm>
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1); } } while (0)
struct Buf { void* x; void* out; void* w[6]; float* s[6]; void* h; void* hs; int* ex; int* sl; float* tw; float* part; unsigned* done; };
extern "C" { int harness_pdl = 0; }
typedef void (*RunFn)(int, int, const Buf&);
#define DECL(v) extern "C" void run_##v(int, int, const Buf&);
VARIANT_DECLS
struct V { const char* name; RunFn run; };
static V variants[] = { VARIANT_LIST };
__global__ void fill(uint8_t* p, size_t n, uint32_t seed, int mode) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    uint32_t h = (uint32_t)i * 2654435761u ^ seed; h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    if (mode == 0) { uint8_t b = (uint8_t)h; if ((b & 0x7F) == 0x7F) b ^= 1; p[i] = b; }  // e4m3, no NaN
    else if (mode == 1) { if (i % 4 == 0) { float f = 0.002f + (h % 1000) * 1e-5f; memcpy(p + i, &f, 4); } }  // fp32 scales
    else { if (i % 2 == 0) { float f = ((h & 0xffff) / 65536.0f) * 4.0f - 2.0f; uint32_t b; memcpy(&b, &f, 4); uint16_t v = (uint16_t)((b + 0x8000) >> 16); memcpy(p + i, &v, 2); } }
  }
}
__global__ void readbw(const uint4* p, size_t n, unsigned* out) {
  unsigned s = 0;
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) { uint4 v = __ldg(p + i); s ^= v.x ^ v.y ^ v.z ^ v.w; }
  if (s == 0x12345678u) out[0] = s;
}
static float bf2f(uint16_t b) { uint32_t u = (uint32_t)b << 16; float f; memcpy(&f, &u, 4); return f; }
static double relerr(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double n = 0, d = 0; for (size_t i = 0; i < a.size(); ++i) { double x = bf2f(a[i]), y = bf2f(b[i]); n += (x - y) * (x - y); d += y * y; }
  return d > 0 ? std::sqrt(n / d) : (n > 0 ? 1e30 : 0);
}
static void* dalloc(size_t n, uint32_t seed, int mode) { void* p; CK(cudaMalloc(&p, n)); fill<<<1024, 256>>>((uint8_t*)p, n, seed, mode); return p; }
int main() {
  const size_t SE = 1024ull * 2304, NE = 256;
  // gemm weights: two sets of six 24 MB buffers (e4m3 or bf16) and scales
  Buf g[2], m[2];
  void *x = dalloc(8 * 9216 * 2, 7, 2), *out; CK(cudaMalloc(&out, 8 * 16384 * 2));
  void *hh = dalloc(8 * 8 * 1024 * 2, 8, 2), *hs = dalloc(8 * 1024 * 2, 9, 2);
  void* wexp[3]; float* sexp[3];
  for (int i = 0; i < 3; ++i) { wexp[i] = dalloc(NE * SE, 100 + i, 0); sexp[i] = (float*)dalloc(NE * 144 * 4, 110 + i, 1); }
  int *ex, *sl; float* tw; CK(cudaMalloc(&ex, 2 * 65 * 4)); CK(cudaMalloc(&sl, 2 * 512 * 4)); CK(cudaMalloc(&tw, 64 * 4));
  std::vector<float> twh(64, 0.125f); CK(cudaMemcpy(tw, twh.data(), 256, cudaMemcpyHostToDevice));
  float* part; unsigned* done;  // the split moe_down's scratch (its counters start and end at zero)
  CK(cudaMalloc(&part, 144 * 3 * 16 * 8 * 4)); CK(cudaMalloc(&done, 144 * 4)); CK(cudaMemset(done, 0, 144 * 4));
  for (int s = 0; s < 2; ++s) {
    g[s].part = part; g[s].done = done;
    g[s].x = x; g[s].out = out; g[s].h = hh; g[s].hs = hs; g[s].tw = tw;
    for (int i = 0; i < 6; ++i) { g[s].w[i] = dalloc(24u << 20, 10 + 10 * s + i, i >= 3 ? 2 : 0); g[s].s[i] = (float*)dalloc(72 * 72 * 4, 30 + 10 * s + i, 1); }
    m[s] = g[s];
    m[s].ex = ex + 65 * s; m[s].sl = sl + 512 * s;
  }
  unsigned* dummy; CK(cudaMalloc(&dummy, 4));
  CK(cudaDeviceSynchronize());
  cudaEvent_t e0, e1; cudaEventCreate(&e0); cudaEventCreate(&e1);
  float best = 1e9;
  for (int r = 0; r < 7; ++r) { cudaEventRecord(e0); readbw<<<132 * 8, 512>>>((const uint4*)wexp[0], NE * SE / 16, dummy); cudaEventRecord(e1); cudaEventSynchronize(e1); float ms; cudaEventElapsedTime(&ms, e0, e1); best = std::min(best, ms); }
  const double ceil_gbs = NE * SE / (best * 1e-3) / 1e9;
  printf("HBM read ceiling: %.0f GB/s\n", ceil_gbs);
  const char* names[6] = {"o_proj k4096", "down k9216", "qkv q87", "mlp_up", "moe_up", "moe_down"};
  const int nv = sizeof(variants) / sizeof(variants[0]);
  for (int T : {1, 8}) {
    const int U = 8 * T;
    for (int s = 0; s < 2; ++s) {
      std::vector<int> exh(1 + U), slh(U * T, -1);
      exh[0] = U;
      for (int u = 0; u < U; ++u) { exh[1 + u] = u + s * 128; slh[u * T + u / 8] = u % 8; }
      CK(cudaMemcpy(ex + 65 * s, exh.data(), exh.size() * 4, cudaMemcpyHostToDevice));
      CK(cudaMemcpy(sl + 512 * s, slh.data(), slh.size() * 4, cudaMemcpyHostToDevice));
      // moe: expert stacks and two copies of the shared expert
      m[s].w[0] = wexp[0]; m[s].s[0] = sexp[0]; m[s].w[1] = wexp[1]; m[s].s[1] = sexp[1];
      m[s].w[2] = g[s].w[0]; m[s].s[2] = g[s].s[0]; m[s].w[3] = g[s].w[1]; m[s].s[3] = g[s].s[1];
    }
    for (int which = 0; which < 6; ++which) {
      Buf b[2] = {g[0], g[1]};
      if (which == 4) { b[0] = m[0]; b[1] = m[1]; }
      if (which == 5) { b[0] = m[0]; b[1] = m[1]; for (int s = 0; s < 2; ++s) { b[s].w[0] = wexp[2]; b[s].s[0] = sexp[2]; b[s].w[1] = g[s].w[0]; b[s].s[1] = g[s].s[0]; } }
      double bytes = 0;
      switch (which) {
        case 0: bytes = 2304.0 * 4096; break;
        case 1: bytes = 2304.0 * 9216; break;
        case 2: bytes = 3 * 4096.0 * 2304 + 288.0 * 2304 * 2; break;
        case 3: bytes = 2 * 9216.0 * 2304; break;
        case 4: bytes = (U + 1) * 2.0 * SE; break;
        case 5: bytes = (U + 1) * 1.0 * SE; break;
      }
      std::vector<uint16_t> ref;
      for (int v = 0; v < nv; ++v) {
        const int reps = 20;
        float ms = 0, ms_pdl = 0;
        for (int pdl = 0; pdl < 2; ++pdl) {
          harness_pdl = pdl;
          for (int pass = 0; pass < 2; ++pass) {
            cudaEventRecord(e0);
            for (int r = 0; r < reps; ++r) variants[v].run(which, T, b[r % 2]);
            cudaEventRecord(e1); CK(cudaEventSynchronize(e1)); cudaEventElapsedTime(pdl ? &ms_pdl : &ms, e0, e1);
          }
        }
        harness_pdl = 0;
        CK(cudaGetLastError());
        CK(cudaMemset(out, 0, 8 * 16384 * 2)); CK(cudaMemset(hh, 0, 8 * 8 * 1024 * 2));
        if (which == 5) CK(cudaMemcpy(hh, x, 8 * 8 * 1024 * 2, cudaMemcpyDeviceToDevice));  // a nonzero input
        variants[v].run(which, T, b[0]);
        const size_t n = which == 4 ? (size_t)T * 8 * 1024 : which == 3 ? (size_t)T * 9216 : which == 2 ? (size_t)T * 12576 : (size_t)T * 2304;
        std::vector<uint16_t> o(n);
        CK(cudaMemcpy(o.data(), which == 4 ? hh : out, n * 2, cudaMemcpyDeviceToHost));
        if (v == 0) ref = o;
        const double t = ms / reps * 1e3;
        const double tp = ms_pdl / reps * 1e3;
        printf("w%d %-13s %-16s %7.2f us %5.1f%% | PDL %7.2f us %5.1f%%  vs v0 %.2e\n", T, names[which], variants[v].name, t,
               100 * bytes / t / 1e3 / ceil_gbs, tp, 100 * bytes / tp / 1e3 / ceil_gbs, relerr(o, ref));
      }
    }
  }
  return 0;
}
