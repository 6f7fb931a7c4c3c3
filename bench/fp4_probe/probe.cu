// The MXFP4 expert GEMV core, two ways, side by side on the GPU (bench/fp4_probe/README.md):
//   bf16  the product's loop (templates/gemm.h dp_mma_rows_fp4): E2M1 codes converted to bf16 with the
//         group scale folded in, bf16 activations, mma.m16n8k16;
//   e4m3  E2M1 codes converted to e4m3 (bit moves only: the value times 2^-6, subnormals included),
//         activations given as e4m3 hi + lo pairs under one power-of-two scale per row (what a producer
//         kernel would write), mma.m16n8k32 over one 32-column scale group at a time, the group scales
//         applied to the fp32 products.
// Each warp computes 16-row tiles of expert matrices [N, K] against up to 8 activation rows, over the
// whole K, tiles handed out grid-stride; 2 blocks of 8 warps per SM. Both read the same packed bytes.
// Output: time, GB/s on the packed bytes (codes + scales), share of a read ceiling measured in the same
// process, and each form's relative L2 error against a float64 reference on the host.
//   usage: fp4_probe [REPS [BLOCKS]]      (BLOCKS: the grid, default 2 per SM)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "vendor.h"
#include "gemm.h"

#define CK(x)                                                                              \
  do {                                                                                     \
    cudaError_t e_ = (x);                                                                  \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

constexpr int kWarps = 8;  // per block

// ---- the product's loop ----------------------------------------------------------------------------
// Expert e's matrix at w + e*N*K/2 (codes) and s + e*N*K/32 (scales); its activation rows at
// x + e*x_expert + t*K (x_expert 0: every expert reads the same rows), W of them; y[e][t][N] fp32.
template <int K>
__global__ __launch_bounds__(256, 2) void bf16_core(const dp_u8* w, const dp_u8* s, const dp_bf16* x, float* y, int N,
                                                     int E, int W, long x_expert) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int tpe = N / 16, tiles = E * tpe;
  for (int tile = blockIdx.x * kWarps + warp; tile < tiles; tile += gridDim.x * kWarps) {
    const int e = tile / tpe, r0 = (tile % tpe) * 16;
    const dp_u8* we = w + (size_t)e * N * (K / 2);
    const dp_u8* se = s + (size_t)e * N * (K / 32);
    const dp_bf16* xe = x + (size_t)e * x_expert;
    float acc[1][1][4] = {{{0.f, 0.f, 0.f, 0.f}}};
    dp_mma_rows_fp4<K, 1, 1>([&](int m) { return dp_fp4_matrix_row<K>(we, se, r0 + m); },
                             [&](int t) -> const dp_bf16* { return t < W ? xe + (size_t)t * K : nullptr; }, 0,
                             K / DP_FP4_CHUNK, acc);
    float* ye = y + (size_t)e * 8 * N;
    if (2 * q < W) ye[(size_t)(2 * q) * N + r0 + g] = acc[0][0][0], ye[(size_t)(2 * q) * N + r0 + g + 8] = acc[0][0][2];
    if (2 * q + 1 < W)
      ye[(size_t)(2 * q + 1) * N + r0 + g] = acc[0][0][1], ye[(size_t)(2 * q + 1) * N + r0 + g + 8] = acc[0][0][3];
  }
}

// ---- the e4m3 form ----------------------------------------------------------------------------------
// Eight E2M1 codes (element 0 in the low nibble) as e4m3 bytes times 2^-6: lo holds elements 0, 2, 4, 6,
// hi 1, 3, 5, 7. The sign moves to bit 7, the three magnitude bits to bits 2..4.
__device__ __forceinline__ void e2m1x8_to_e4m3(dp_u32 w, dp_u32& lo, dp_u32& hi) {
  lo = ((w << 4) & 0x80808080u) | ((w << 2) & 0x1C1C1C1Cu);
  hi = (w & 0x80808080u) | ((w >> 2) & 0x1C1C1C1Cu);
}
__device__ __forceinline__ void mma_e4m3(float (&c)[4], dp_u32 a0, dp_u32 a1, dp_u32 a2, dp_u32 a3, dp_u32 b0,
                                         dp_u32 b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
// Activations: row t of an expert, as xq[t][K/128 chunks][4 lanes q][4 groups j][16 bytes]: for group j of
// chunk c, lane q's 16 bytes are hi(elements 32j' + 8q + {0,2,4,6}), hi(+{1,3,5,7}), lo(same), lo(same)
// (j' = 4c + j), so one 16-byte load a group gives a lane both MMAs' b operands. xs[t]: the row's scale.
// The weights stream through the warp's ring (cp.async, kStages chunks ahead) as the product's do; a lane
// copies group q of rows g and g + 8 of its chunk, at a slot swizzled so that the transposed reads
// (lane q reads word q of every group j) fall in distinct banks.
template <int K>
__global__ __launch_bounds__(256, 2) void e4m3_core(const dp_u8* w, const dp_u8* s, const dp_u8* xq, const float* xs,
                                                     float* y, int N, int E, int W, long x_expert) {
  constexpr int kChunks = K / 128, kStages = 4;
  __shared__ __align__(16) dp_u32 ring[kWarps][kStages][2][32 * 4];  // 4 KB a warp
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
  const int tpe = N / 16, tiles = E * tpe;
  const int sw = (g >> 1) & 3;  // the swizzle of row g's four slots
  for (int tile = blockIdx.x * kWarps + warp; tile < tiles; tile += gridDim.x * kWarps) {
    const int e = tile / tpe, r0 = (tile % tpe) * 16;
    const dp_u8* wr[2] = {w + ((size_t)e * N + r0 + g) * (K / 2) + 16 * q,
                          w + ((size_t)e * N + r0 + g + 8) * (K / 2) + 16 * q};
    const dp_u8* sr[2] = {s + ((size_t)e * N + r0 + g) * (K / 32), s + ((size_t)e * N + r0 + g + 8) * (K / 32)};
    const dp_u8* xr = g < W ? xq + (size_t)e * x_expert * 2 + (size_t)g * 2 * K + 64 * q : nullptr;
    dp_u32 scr[kStages][2];
    auto issue = [&](int c, int st) {
      const bool in = c < kChunks;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const dp_u32 dst = (dp_u32)__cvta_generic_to_shared(&ring[warp][st][r][4 * (4 * g + (q ^ sw))]);
        if (in) asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(wr[r] + 64 * c));
        scr[st][r] = in ? *(const dp_u32*)(sr[r] + 4 * c) : 0u;
      }
      asm volatile("cp.async.commit_group;");
    };
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int st = 0; st < kStages; ++st) issue(st, st);
    dp_u32x4 xn[4];  // the next chunk's activation operands, one chunk ahead
    auto load_x = [&](int c) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (xr && c < kChunks) {
          xn[j] = dp_load16(xr + 256 * c + 16 * j);
        } else {
          xn[j].x = xn[j].y = xn[j].z = xn[j].w = 0u;
        }
      }
    };
    load_x(0);
    for (int cb = 0; cb < kChunks; cb += kStages) {
#pragma unroll
      for (int st = 0; st < kStages; ++st) {
        const int c = cb + st;
        if (c < kChunks) {
          dp_u32x4 xv[4];
#pragma unroll
          for (int j = 0; j < 4; ++j) xv[j] = xn[j];
          load_x(c + 1);
          asm volatile("cp.async.wait_group %0;" ::"n"(kStages - 1));
          __syncwarp();
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            dp_u32 a[2][2];  // [row g / g+8][lo, hi]
#pragma unroll
            for (int r = 0; r < 2; ++r) e2m1x8_to_e4m3(ring[warp][st][r][4 * (4 * g + (j ^ sw)) + q], a[r][0], a[r][1]);
            float cj[4] = {0.f, 0.f, 0.f, 0.f};
            mma_e4m3(cj, a[0][0], a[1][0], a[0][1], a[1][1], xv[j].x, xv[j].y);  // hi
            mma_e4m3(cj, a[0][0], a[1][0], a[0][1], a[1][1], xv[j].z, xv[j].w);  // lo
            // 2^(s - 127) of rows g and g + 8, group j (the 2^6 of the codes is applied at the end).
            const float f0 = __uint_as_float(((scr[st][0] >> (8 * j)) & 0xffu) << 23);
            const float f1 = __uint_as_float(((scr[st][1] >> (8 * j)) & 0xffu) << 23);
            acc[0] = fmaf(cj[0], f0, acc[0]);
            acc[1] = fmaf(cj[1], f0, acc[1]);
            acc[2] = fmaf(cj[2], f1, acc[2]);
            acc[3] = fmaf(cj[3], f1, acc[3]);
          }
          __syncwarp();
          issue(c + kStages, st);
        }
      }
    }
    asm volatile("cp.async.wait_group 0;");
    float* ye = y + (size_t)e * 8 * N;
    const float x0 = 2 * q < W ? xs[(size_t)e * (x_expert ? 8 : 0) + 2 * q] * 64.0f : 0.f;
    const float x1 = 2 * q + 1 < W ? xs[(size_t)e * (x_expert ? 8 : 0) + 2 * q + 1] * 64.0f : 0.f;
    if (2 * q < W) ye[(size_t)(2 * q) * N + r0 + g] = acc[0] * x0, ye[(size_t)(2 * q) * N + r0 + g + 8] = acc[2] * x0;
    if (2 * q + 1 < W)
      ye[(size_t)(2 * q + 1) * N + r0 + g] = acc[1] * x1, ye[(size_t)(2 * q + 1) * N + r0 + g + 8] = acc[3] * x1;
  }
}

__global__ void ceiling_kernel(const uint4* p, size_t n, unsigned* out) {
  unsigned v = 0;
  const size_t stride = (size_t)gridDim.x * blockDim.x;
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    const uint4 a = __ldcs(p + i), b = __ldcs(p + i + stride), c = __ldcs(p + i + 2 * stride),
                d = __ldcs(p + i + 3 * stride);
    v ^= a.x ^ b.y ^ c.z ^ d.w;
  }
  for (; i < n; i += stride) v ^= __ldcs(p + i).x;
  if (v == 0x12345678u) *out = v;
}

// ---- host ---------------------------------------------------------------------------------------------
static float bf16_to_f32(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static uint16_t f32_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (uint16_t)(u >> 16);
}
static const float kE2M1[8] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f};
// e4m3 (bias 7, no infinities) of v, round to nearest even, |v| <= 448.
static uint8_t to_e4m3(double v) {
  uint8_t best = 0;
  double bd = 1e300;
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;  // NaN
    const int e = (b >> 3) & 15, m = b & 7;
    double x = e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6);
    if (b & 0x80) x = -x;
    const double d = std::fabs(x - v);
    if (d < bd || (d == bd && (b & 1) == 0)) bd = d, best = (uint8_t)b;
  }
  return best;
}
static double e4m3_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const double x = e ? std::ldexp(1.0 + m / 8.0, e - 7) : std::ldexp(m / 8.0, -6);
  return (b & 0x80) ? -x : x;
}

struct Shape {
  const char* name;
  int N, K, E, W;
  bool shared_x;  // every expert reads the same activation rows (moe_up), else its own (moe_down)
};

template <int K>
static void run_shape(const Shape& sh, int reps, double ceil_gbs, int grid) {
  const int N = sh.N, E = sh.E, W = sh.W;
  const size_t codes = (size_t)E * N * K / 2, scales = (size_t)E * N * K / 32, bytes = codes + scales;
  const int xsets = sh.shared_x ? 1 : E;
  std::mt19937 rng(1234 + K + N);
  std::vector<uint8_t> hw(codes), hs(scales);
  for (auto& b : hw) b = (uint8_t)(rng() & 0xff);
  for (auto& b : hs) b = (uint8_t)(120 + rng() % 10);
  // Activations: bf16, heavy-ish tails (normal times an occasional x8).
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<uint16_t> hx((size_t)xsets * W * K);
  for (auto& v : hx) v = f32_to_bf16(nd(rng) * ((rng() % 16) ? 1.f : 8.f));
  // The e4m3 activation form: per row a power-of-two scale with max|x| / scale in [128, 256).
  std::vector<uint8_t> hq((size_t)xsets * 8 * 2 * K, 0);
  std::vector<float> hxs((size_t)xsets * 8, 0.f);
  double worst_rep = 0;
  for (int st = 0; st < xsets; ++st)
    for (int t = 0; t < W; ++t) {
      const uint16_t* row = &hx[((size_t)st * W + t) * K];
      double mx = 0;
      for (int k = 0; k < K; ++k) mx = std::max(mx, (double)std::fabs(bf16_to_f32(row[k])));
      const int ex = mx > 0 ? (int)std::floor(std::log2(mx)) - 7 : 0;
      const double sc = std::ldexp(1.0, ex);
      hxs[(size_t)st * 8 + t] = (float)sc;
      uint8_t* out = &hq[((size_t)st * 8 + t) * 2 * K];
      for (int k = 0; k < K; ++k) {
        const double v = bf16_to_f32(row[k]) / sc;
        const uint8_t hi = to_e4m3(v), lo = to_e4m3(v - e4m3_value(hi));
        worst_rep = std::max(worst_rep, std::fabs(v - e4m3_value(hi) - e4m3_value(lo)) * sc);
        const int c = k / 128, j = (k / 32) % 4, q = (k % 32) / 8, i = k % 8;
        uint8_t* slot = out + 256 * c + 64 * q + 16 * j;  // [hi b0 | hi b1 | lo b0 | lo b1]
        const int word = i % 2, byte = i / 2;
        slot[4 * word + byte] = hi;
        slot[8 + 4 * word + byte] = lo;
      }
    }
  // Reference (float64) of every output.
  std::vector<double> ref((size_t)E * 8 * N, 0.0);
  std::vector<double> wrow(K), xd((size_t)xsets * W * K);
  for (size_t i = 0; i < xd.size(); ++i) xd[i] = bf16_to_f32(hx[i]);
  for (int e = 0; e < E; ++e)
    for (int n = 0; n < N; ++n) {
      const uint8_t* wr = &hw[((size_t)e * N + n) * (K / 2)];
      const uint8_t* sr = &hs[((size_t)e * N + n) * (K / 32)];
      for (int k = 0; k < K; ++k) {
        const int code = (wr[k / 2] >> (4 * (k % 2))) & 15;
        wrow[k] = (code & 8 ? -1.0 : 1.0) * kE2M1[code & 7] * std::ldexp(1.0, sr[k / 32] - 127);
      }
      for (int t = 0; t < W; ++t) {
        const double* xr = &xd[((size_t)(sh.shared_x ? 0 : e) * W + t) * K];
        double sum = 0;
        for (int k = 0; k < K; ++k) sum += wrow[k] * xr[k];
        ref[((size_t)e * 8 + t) * N + n] = sum;
      }
    }
  // Two copies of the weights, alternated, so that no launch finds them in L2.
  dp_u8 *dw[2], *ds[2], *dq;
  dp_bf16* dx;
  float *dxs, *dy;
  for (int i = 0; i < 2; ++i) {
    CK(cudaMalloc(&dw[i], codes));
    CK(cudaMalloc(&ds[i], scales));
    CK(cudaMemcpy(dw[i], hw.data(), codes, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(ds[i], hs.data(), scales, cudaMemcpyHostToDevice));
  }
  CK(cudaMalloc(&dx, std::max<size_t>(hx.size(), (size_t)xsets * 8 * K) * 2));
  CK(cudaMemset(dx, 0, std::max<size_t>(hx.size(), (size_t)xsets * 8 * K) * 2));
  CK(cudaMemcpy(dx, hx.data(), hx.size() * 2, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dq, hq.size()));
  CK(cudaMemcpy(dq, hq.data(), hq.size(), cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dxs, hxs.size() * 4));
  CK(cudaMemcpy(dxs, hxs.data(), hxs.size() * 4, cudaMemcpyHostToDevice));
  CK(cudaMalloc(&dy, ref.size() * 4));
  const long xe_bf16 = sh.shared_x ? 0 : (long)W * K;  // elements between experts' rows
  const long xe_q = sh.shared_x ? 0 : (long)8 * K;      // (times 2 bytes in the kernel)
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  auto time = [&](auto launch) {
    std::vector<float> t;
    for (int r = 0; r < reps + 2; ++r) {
      CK(cudaEventRecord(e0));
      launch(r % 2);
      CK(cudaEventRecord(e1));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 2) t.push_back(ms * 1000.f);
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  auto error = [&]() {
    std::vector<float> hy(ref.size());
    CK(cudaMemcpy(hy.data(), dy, hy.size() * 4, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    for (int e = 0; e < E; ++e)
      for (int t = 0; t < W; ++t)
        for (int n = 0; n < N; ++n) {
          const size_t i = ((size_t)e * 8 + t) * N + n;
          num += (hy[i] - ref[i]) * (hy[i] - ref[i]);
          den += ref[i] * ref[i];
        }
    return std::sqrt(num / den);
  };
  CK(cudaMemset(dy, 0, ref.size() * 4));
  const float tb = time([&](int i) { bf16_core<K><<<grid, 256>>>(dw[i], ds[i], dx, dy, N, E, W, xe_bf16); });
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  const double errb = error();
  CK(cudaMemset(dy, 0, ref.size() * 4));
  const float tq = time([&](int i) { e4m3_core<K><<<grid, 256>>>(dw[i], ds[i], dq, dxs, dy, N, E, W, xe_q); });
  CK(cudaGetLastError());
  CK(cudaDeviceSynchronize());
  const double errq = error();
  const double mb = bytes / 1e6;
  std::printf("%-9s N %5d K %5d E %3d W %d grid %3d %7.1f MB | bf16 %7.2f us %6.0f GB/s %5.1f%% err %.2e | e4m3 %7.2f us "
              "%6.0f GB/s %5.1f%% err %.2e | x8 residual max %.1e\n",
              sh.name, N, K, E, W, grid, mb, tb, bytes / tb / 1e3, 100.0 * bytes / tb / 1e3 / ceil_gbs, errb, tq,
              bytes / tq / 1e3, 100.0 * bytes / tq / 1e3 / ceil_gbs, errq, worst_rep);
  for (int i = 0; i < 2; ++i) {
    CK(cudaFree(dw[i]));
    CK(cudaFree(ds[i]));
  }
  CK(cudaFree(dx));
  CK(cudaFree(dq));
  CK(cudaFree(dxs));
  CK(cudaFree(dy));
}

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 20;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int grid = argc > 2 ? std::atoi(argv[2]) : 2 * prop.multiProcessorCount;
  // Read ceiling: a streaming read over 4 GiB, median of 5.
  const size_t cbytes = (size_t)4 << 30;
  uint4* big;
  unsigned* sink;
  CK(cudaMalloc(&big, cbytes));
  CK(cudaMalloc(&sink, 4));
  CK(cudaMemset(big, 1, cbytes));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ct;
  for (int r = 0; r < 6; ++r) {
    CK(cudaEventRecord(e0));
    ceiling_kernel<<<prop.multiProcessorCount * 4, 512>>>(big, cbytes / 16, sink);
    CK(cudaEventRecord(e1));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    if (r) ct.push_back(ms);
  }
  std::sort(ct.begin(), ct.end());
  const double ceil_gbs = cbytes / (ct[ct.size() / 2] * 1e-3) / 1e9;
  CK(cudaFree(big));
  std::printf("device %s, %d SMs; read ceiling %.0f GB/s; %d launches per figure (median), weights alternated\n",
              prop.name, prop.multiProcessorCount, ceil_gbs, reps);
  // Kimi-K3's latent MoE: moe_down (the expert's own rows; N = latent 3584, K = I 3072) and moe_up (shared
  // rows; N = 2 I = 6144, K = 3584), 16 experts (one token's top 16), 1 and 8 activation rows.
  const Shape down1{"moe_down", 3584, 3072, 16, 1, false}, down8{"moe_down", 3584, 3072, 16, 8, false};
  const Shape up1{"moe_up", 6144, 3584, 16, 1, true}, up8{"moe_up", 6144, 3584, 16, 8, true};
  run_shape<3072>(down1, reps, ceil_gbs, grid);
  run_shape<3072>(down8, reps, ceil_gbs, grid);
  run_shape<3584>(up1, reps, ceil_gbs, grid);
  run_shape<3584>(up8, reps, ceil_gbs, grid);
  return 0;
}
