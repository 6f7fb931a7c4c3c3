// chain_probe: what a kernel boundary costs in a decode layer's chain of weight streams, and what
// other launch disciplines would buy. Synthetic ops stand in for the layer's kernels: each streams
// its own weight bytes (16-byte non-coherent loads, four per thread in flight) and depends on the
// previous op's output (read with coherent loads after its dependency wait), as the real GEMVs do.
// The byte counts are those of the 48B-shaped FP8 model's KDA + MoE layer at width 1 (bench output).
// No real arithmetic: it bounds what the boundaries cost, not what a kernel's instructions cost.
//
// Disciplines, each a CUDA graph of 4 layers (distinct weights, 440 MB > L2), replayed:
//   nopdl        one kernel per op, plain stream order
//   pdl          one kernel per op, programmatic dependent launch, wait first (the product today)
//   pdl-early    the same, with each thread's first round of weight loads issued before the wait
//   pdl-early-4  the same with four blocks per SM allowed (the next kernel's blocks fit beside this one's)
//   persist      one kernel per layer, a grid barrier between ops
//   persist-early  the same, each block loading its first round of the next op before the barrier
//   stream       one kernel per layer streaming all its bytes as one op (the floor)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <vector>

#define CK(x)                                                                                  \
  do {                                                                                         \
    cudaError_t e_ = (x);                                                                      \
    if (e_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                            \
    }                                                                                          \
  } while (0)

constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kMaxOps = 16;

__device__ __forceinline__ uint4 ld_weight(const uint4* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}
__device__ __forceinline__ float ld_act(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ unsigned ld_acquire(const unsigned* p) {
  unsigned v;
  asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
// kWork: extra integer instructions per 16-byte vector, standing in for a real kernel's conversion and
// tensor-core work per weight vector (the FP8 GEMVs spend about 75 warp instructions per 16-byte lane load).
template <int kWork>
__device__ __forceinline__ uint32_t fold(uint4 v) {
  uint32_t h = v.x ^ (v.y * 3u) ^ (v.z * 5u) ^ (v.w * 7u);
#pragma unroll
  for (int k = 0; k < kWork / 4; ++k) {
    h = __byte_perm(h, v.x, 0x5140 + k);
    h ^= h >> 7;
    h *= 0x9e3779b1u;
    h += v.y;
  }
  return h;
}

// One op's share for block b of g: vectors b*256 + tid + k*g*256.
struct Round {
  uint4 r[kUnroll];
};
__device__ __forceinline__ void first_round(const uint4* w, size_t vecs, int b, int g, Round& rd) {
  const size_t stride = (size_t)g * kThreads, i0 = (size_t)b * kThreads + threadIdx.x;
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    const size_t i = i0 + k * stride;
    rd.r[k] = i < vecs ? ld_weight(w + i) : make_uint4(0, 0, 0, 0);
  }
}
// The block's result, written to out[b]: the folded weights and the activation it read, summed over the
// block (every thread calls it; the trailing barrier lets the caller reuse shared memory).
__device__ __forceinline__ void block_result(uint32_t acc, float a, float* out, int b) {
  __shared__ float part[kThreads / 32];
  float v = (float)(acc & 0xffu) * 1e-3f + a * 0.5f;
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0;
    for (int k = 0; k < kThreads / 32; ++k) s += part[k];
    out[b] = s;
  }
  __syncthreads();
}

// Streams the rest of the op (after the first round, when `early` holds it) and writes the block's sum
// to out[b].
template <int kWork>
__device__ __forceinline__ void stream_op(const uint4* w, size_t vecs, int b, int g, const float* in, int in_n,
                                          float* out, const Round* early) {
  const size_t stride = (size_t)g * kThreads, i0 = (size_t)b * kThreads + threadIdx.x;
  uint32_t acc = 0;
  size_t i = i0;
  if (early) {
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) acc ^= fold<kWork>(early->r[k]);
    i += kUnroll * stride;
  }
  float a = in_n > 0 ? ld_act(in + threadIdx.x % in_n) : 0.0f;
  for (; i < vecs; i += kUnroll * stride) {
    uint4 r[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const size_t j = i + k * stride;
      r[k] = j < vecs ? ld_weight(w + j) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) acc ^= fold<kWork>(r[k]);
  }
  block_result(acc, a, out, b);
}

template <bool kEarly, int kWork>
__global__ void __launch_bounds__(kThreads) op_kernel(const uint4* w, size_t vecs, const float* in, int in_n,
                                                      float* out) {
  extern __shared__ char pad[];  // limits residency (blocks per SM) as the real kernels' registers do
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  Round rd;
  if (kEarly) first_round(w, vecs, blockIdx.x, gridDim.x, rd);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  stream_op<kWork>(w, vecs, blockIdx.x, gridDim.x, in, in_n, out, kEarly ? &rd : nullptr);
  if (threadIdx.x == 0 && vecs == 0) pad[0] = 0;
}


// ---------------------------------------------------------------------------------------------------
// Bulk form: each block streams one contiguous range of the op's bytes through a ring of kStages chunks
// of kChunk bytes in shared memory, filled by bulk asynchronous copies (one instruction per chunk,
// completion counted on an mbarrier per stage). One thread issues the copies; the first kStages are
// issued before the dependency wait (weights do not depend on the previous kernel).
constexpr int kChunk = 16384;

__device__ __forceinline__ unsigned smem_addr(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* b) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(b)) : "memory");
}
__device__ __forceinline__ void bulk_load(void* dst, const void* src, unsigned bytes, uint64_t* b) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(b)), "r"(bytes) : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(dst)),
               "l"(src), "r"(bytes), "r"(smem_addr(b))
               : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* b, unsigned parity) {
  asm volatile(
      "{\n\t.reg .pred p;\n\tW: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n\t@!p bra W;\n\t}" ::"r"(
          smem_addr(b)),
      "r"(parity)
      : "memory");
}

template <int kStages, int kWork>
__global__ void __launch_bounds__(kThreads) bulk_kernel(const uint4* w, size_t vecs, const float* in, int in_n,
                                                        float* out) {
  extern __shared__ __align__(128) char ring[];  // [kStages][kChunk]
  __shared__ uint64_t full[kStages];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  const size_t bytes = vecs * 16, per = ((bytes + gridDim.x - 1) / gridDim.x + 15) / 16 * 16;
  const size_t lo = per * blockIdx.x, hi = lo + per < bytes ? lo + per : bytes;
  const int chunks = hi > lo ? (int)((hi - lo + kChunk - 1) / kChunk) : 0;
  const char* src = (const char*)w + lo;
  auto issue = [&](int c) {
    const size_t off = (size_t)c * kChunk;
    const unsigned n = (unsigned)((hi - lo - off) < (size_t)kChunk ? (hi - lo - off) : kChunk);
    bulk_load(ring + (c % kStages) * kChunk, src + off, n, &full[c % kStages]);
  };
  if (threadIdx.x == 0) {
    for (int k = 0; k < kStages; ++k) mbar_init(&full[k]);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    for (int c = 0; c < kStages && c < chunks; ++c) issue(c);
  }
  __syncthreads();
  asm volatile("griddepcontrol.wait;" ::: "memory");
  float a = in_n > 0 ? ld_act(in + threadIdx.x % in_n) : 0.0f;
  uint32_t acc = 0;
  for (int c = 0; c < chunks; ++c) {
    mbar_wait(&full[c % kStages], (unsigned)(c / kStages) & 1u);
    const size_t n = (hi - lo - (size_t)c * kChunk) < (size_t)kChunk ? (hi - lo - (size_t)c * kChunk) : kChunk;
    const uint4* v = (const uint4*)(ring + (c % kStages) * kChunk);
    for (int i = threadIdx.x; i < (int)(n / 16); i += kThreads) acc ^= fold<kWork>(v[i]);
    __syncthreads();
    if (threadIdx.x == 0 && c + kStages < chunks) issue(c + kStages);
  }
  block_result(acc, a, out, blockIdx.x);
}

struct Chain {
  const uint4* w[kMaxOps];
  size_t vecs[kMaxOps];
  int grid[kMaxOps];
  float* out[kMaxOps];
  const float* in0;
  int n;
};

// Sense-reversal barrier over every block of the grid (all resident): count, then generation.
__device__ __forceinline__ void grid_barrier(unsigned* count, unsigned* gen, unsigned blocks) {
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned g = ld_acquire(gen);
    __threadfence();
    if (atomicAdd(count, 1u) == blocks - 1) {
      atomicExch(count, 0u);
      __threadfence();
      atomicAdd(gen, 1u);
    } else {
      while (ld_acquire(gen) == g) {
      }
    }
  }
  __syncthreads();
}

template <bool kEarly, int kWork>
__global__ void __launch_bounds__(kThreads) persist_kernel(Chain c, unsigned* bar) {
  extern __shared__ char pad[];
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  Round rd;
  const int b = blockIdx.x;
  if (kEarly && b < c.grid[0]) first_round(c.w[0], c.vecs[0], b, c.grid[0], rd);
  asm volatile("griddepcontrol.wait;" ::: "memory");
  for (int j = 0; j < c.n; ++j) {
    const float* in = j == 0 ? c.in0 : c.out[j - 1];
    const int in_n = j == 0 ? 256 : (c.grid[j - 1] < 256 ? c.grid[j - 1] : 256);
    if (b < c.grid[j]) stream_op<kWork>(c.w[j], c.vecs[j], b, c.grid[j], in, in_n, c.out[j], kEarly ? &rd : nullptr);
    if (j + 1 < c.n) {
      if (kEarly && b < c.grid[j + 1]) first_round(c.w[j + 1], c.vecs[j + 1], b, c.grid[j + 1], rd);
      grid_barrier(bar, bar + 32, gridDim.x);
    }
  }
  if (threadIdx.x == 0 && c.n == 0) pad[0] = 0;
}

__global__ void ceiling_kernel(const uint4* w, size_t vecs, float* out) {
  stream_op<0>(w, vecs, blockIdx.x, gridDim.x, nullptr, 0, out, nullptr);
}

struct OpSpec {
  const char* name;
  double mb;
  int grid;  // 0: every block slot (2 per SM)
};

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 50;
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  // 48B-shaped FP8 KDA + MoE layer, width 1 (MB per kernel, bench 2026-12-05); routing folded into the router.
  const std::vector<OpSpec> layer = {{"rmsnorm", 0.018, 1},  {"qkv", 29.646, 0},    {"kda_step", 6.652, 32},
                                     {"o_proj", 9.439, 0},   {"rmsnorm", 0.014, 1}, {"router", 1.180, 0},
                                     {"moe_up", 42.478, 0},  {"moe_down", 21.243, 0}};
  const int layers = 4, n = (int)layer.size();
  const int slots2 = 2 * sms;
  // Pads: two blocks per SM (the real GEMVs at 128 registers) or four.
  const size_t smem_per_sm = prop.sharedMemPerMultiprocessor;
  const int pad2 = (int)std::min<size_t>(prop.sharedMemPerBlockOptin, smem_per_sm / 2 - 2048);
  const int pad4 = (int)(smem_per_sm / 4 - 2048);

  // Weights: every op of every layer its own buffer; filled once.
  std::vector<std::vector<uint4*>> w(layers, std::vector<uint4*>(n));
  std::vector<std::vector<size_t>> vecs(layers, std::vector<size_t>(n));
  std::vector<std::vector<float*>> outs(layers, std::vector<float*>(n));
  double layer_bytes = 0;
  for (int j = 0; j < n; ++j) layer_bytes += layer[j].mb * 1e6;
  for (int l = 0; l < layers; ++l)
    for (int j = 0; j < n; ++j) {
      vecs[l][j] = (size_t)(layer[j].mb * 1e6 / 16);
      CK(cudaMalloc(&w[l][j], vecs[l][j] * 16));
      CK(cudaMemset(w[l][j], 0x11 * (j + 1), vecs[l][j] * 16));
      CK(cudaMalloc(&outs[l][j], 4096 * sizeof(float)));
      CK(cudaMemset(outs[l][j], 0, 4096 * sizeof(float)));
    }
  float* in0;
  CK(cudaMalloc(&in0, 4096 * sizeof(float)));
  CK(cudaMemset(in0, 0, 4096 * sizeof(float)));
  unsigned* bar;
  CK(cudaMalloc(&bar, 64 * sizeof(unsigned)));
  CK(cudaMemset(bar, 0, 64 * sizeof(unsigned)));
  // One whole layer as one op (the floor): a buffer of the layer's bytes per layer.
  std::vector<uint4*> whole(layers);
  const size_t whole_vecs = (size_t)(layer_bytes / 16);
  for (int l = 0; l < layers; ++l) {
    CK(cudaMalloc(&whole[l], whole_vecs * 16));
    CK(cudaMemset(whole[l], 0x5a, whole_vecs * 16));
  }
  // Ceiling: a read-only stream over 4 GB.
  const size_t ceil_vecs = (size_t)4e9 / 16;
  uint4* big;
  CK(cudaMalloc(&big, ceil_vecs * 16));
  CK(cudaMemset(big, 0x33, ceil_vecs * 16));

  cudaStream_t s;
  CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));

  auto time_graph = [&](auto&& body) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    CK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    body();
    CK(cudaStreamEndCapture(s, &g));
    CK(cudaGraphInstantiate(&ge, g, 0));
    for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(ge, s));
    CK(cudaStreamSynchronize(s));
    std::vector<float> t;
    for (int r = 0; r < reps; ++r) {
      CK(cudaEventRecord(e0, s));
      CK(cudaGraphLaunch(ge, s));
      CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms * 1000.0f);
    }
    CK(cudaGraphExecDestroy(ge));
    CK(cudaGraphDestroy(g));
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  auto launch = [&](auto kern, int grid, int smem, bool pdl, auto... args) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kThreads);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = pdl ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, kern, args...));
  };

  // Ceiling.
  float ceil_us;
  {
    std::vector<float> t;
    for (int r = 0; r < 7; ++r) {
      CK(cudaEventRecord(e0, s));
      ceiling_kernel<<<4 * slots2, kThreads, 0, s>>>(big, ceil_vecs, outs[0][0]);
      CK(cudaEventRecord(e1, s));
      CK(cudaEventSynchronize(e1));
      float ms;
      CK(cudaEventElapsedTime(&ms, e0, e1));
      t.push_back(ms * 1000.0f);
    }
    std::sort(t.begin(), t.end());
    ceil_us = t[t.size() / 2];
  }
  const double ceil_tbs = (double)ceil_vecs * 16 / ceil_us / 1e6;
  std::printf("device %s, %d SMs; ceiling %.3f TB/s (read stream over 4.0 GB)\n", prop.name, sms, ceil_tbs);
  std::printf("layer: %d ops, %.2f MB (%.1f us at the ceiling); %d layers per graph, %d replays, median\n", n,
              layer_bytes / 1e6, layer_bytes / ceil_tbs / 1e6, layers, reps);

  auto table = [&](auto work) {
    constexpr int kW = decltype(work)::value;
    CK(cudaFuncSetAttribute(op_kernel<false, kW>, cudaFuncAttributeMaxDynamicSharedMemorySize, pad2));
    CK(cudaFuncSetAttribute(op_kernel<true, kW>, cudaFuncAttributeMaxDynamicSharedMemorySize, pad2));
    CK(cudaFuncSetAttribute(persist_kernel<false, kW>, cudaFuncAttributeMaxDynamicSharedMemorySize, pad2));
    CK(cudaFuncSetAttribute(persist_kernel<true, kW>, cudaFuncAttributeMaxDynamicSharedMemorySize, pad2));
    std::printf("\nwork %d integer instructions per 16-byte weight vector\n", kW);
  auto sep = [&](bool pdl, bool early, int pad) {
    return [&, pdl, early, pad] {
      for (int l = 0; l < layers; ++l)
        for (int j = 0; j < n; ++j) {
          const int grid = layer[j].grid ? layer[j].grid : slots2;
          const float* in = j ? outs[l][j - 1] : (l ? outs[l - 1][n - 1] : in0);
          const int prev_grid = j ? (layer[j - 1].grid ? layer[j - 1].grid : slots2) : 1;
          const int in_n = std::min(prev_grid, 256);
          if (early)
            launch(op_kernel<true, kW>, grid, pad, pdl, (const uint4*)w[l][j], vecs[l][j], in, in_n, outs[l][j]);
          else
            launch(op_kernel<false, kW>, grid, pad, pdl, (const uint4*)w[l][j], vecs[l][j], in, in_n, outs[l][j]);
        }
    };
  };
  auto per = [&](bool early) {
    return [&, early] {
      for (int l = 0; l < layers; ++l) {
        Chain c = {};
        c.n = n;
        c.in0 = l ? outs[l - 1][n - 1] : in0;
        for (int j = 0; j < n; ++j) {
          c.w[j] = w[l][j];
          c.vecs[j] = vecs[l][j];
          c.grid[j] = layer[j].grid ? layer[j].grid : slots2;
          c.out[j] = outs[l][j];
        }
        if (early)
          launch(persist_kernel<true, kW>, slots2, pad2, true, c, bar);
        else
          launch(persist_kernel<false, kW>, slots2, pad2, true, c, bar);
      }
    };
  };
  auto floor_body = [&] {
    for (int l = 0; l < layers; ++l)
      launch(op_kernel<true, kW>, slots2, pad2, true, (const uint4*)whole[l], whole_vecs, (const float*)in0, 1,
             outs[l][0]);
  };
  struct Row {
    std::string name;
    float us;
  };
  std::vector<Row> rows;
  for (int pass = 0; pass < 2; ++pass) {
    rows.push_back({"nopdl", time_graph(sep(false, false, pad2))});
    rows.push_back({"pdl", time_graph(sep(true, false, pad2))});
    rows.push_back({"pdl-early", time_graph(sep(true, true, pad2))});
    rows.push_back({"pdl-early-4", time_graph(sep(true, true, pad4))});
    rows.push_back({"persist", time_graph(per(false))});
    rows.push_back({"persist-early", time_graph(per(true))});
    rows.push_back({"stream", time_graph(floor_body)});
  }
  std::printf("%-16s %10s %10s %8s\n", "discipline", "us/layer", "TB/s", "share");
  for (const Row& r : rows) {
    const double us = r.us / layers;
    std::printf("%-16s %10.1f %10.3f %7.1f%%\n", r.name.c_str(), us, layer_bytes / us / 1e6,
                100.0 * layer_bytes / us / 1e6 / ceil_tbs);
  }
  };
  table(std::integral_constant<int, 0>{});
  table(std::integral_constant<int, 48>{});

  // Each op alone in a graph of 4 layers' copies (pdl, wait first): its cost in the chain's terms.
  std::printf("\nper op (pdl, wait first, a graph of that op over the 4 layers' copies, us per op)\n");
  for (int j = 0; j < n; ++j) {
    const int grid = layer[j].grid ? layer[j].grid : slots2;
    const float us = time_graph([&] {
      for (int l = 0; l < layers; ++l)
        launch(op_kernel<false, 0>, grid, pad2, true, (const uint4*)w[l][j], vecs[l][j], (const float*)in0, 1, outs[l][j]);
    });
    std::printf("  %-10s %8.3f MB grid %4d  %7.2f us  (%.1f us at the ceiling)\n", layer[j].name, layer[j].mb, grid,
                us / layers, layer[j].mb * 1e6 / ceil_tbs / 1e6);
  }
  // The bulk form: per op and chained (PDL, first copies before the wait), one and two blocks per SM.
  auto bulk_table = [&](auto work) {
    constexpr int kW = decltype(work)::value;
    constexpr int kS1 = 12, kS2 = 6;  // 192 KB a block at one per SM, 96 KB at two
    CK(cudaFuncSetAttribute(bulk_kernel<kS1, kW>, cudaFuncAttributeMaxDynamicSharedMemorySize, kS1 * kChunk));
    CK(cudaFuncSetAttribute(bulk_kernel<kS2, kW>, cudaFuncAttributeMaxDynamicSharedMemorySize, kS2 * kChunk));
    CK(cudaFuncSetAttribute(bulk_kernel<3, kW>, cudaFuncAttributeMaxDynamicSharedMemorySize, 3 * kChunk));
    struct Form {
      const char* name;
      int per_sm, stages;
    };
    const Form forms[] = {{"bulk 1/SM x12", 1, kS1}, {"bulk 2/SM x6", 2, kS2}, {"bulk 2/SM x3 +room", 2, 3}};
    std::printf("\nbulk copies, work %d: per op (us), then the chain (us per layer)\n", kW);
    for (const Form& f : forms) {
      auto go = [&](int l, int j, int grid, const float* in, int in_n) {
        if (f.stages == kS1)
          launch(bulk_kernel<kS1, kW>, grid, kS1 * kChunk, true, (const uint4*)w[l][j], vecs[l][j], in, in_n, outs[l][j]);
        else if (f.stages == kS2)
          launch(bulk_kernel<kS2, kW>, grid, kS2 * kChunk, true, (const uint4*)w[l][j], vecs[l][j], in, in_n, outs[l][j]);
        else
          launch(bulk_kernel<3, kW>, grid, 3 * kChunk, true, (const uint4*)w[l][j], vecs[l][j], in, in_n, outs[l][j]);
      };
      std::printf("  %-20s", f.name);
      for (int j = 0; j < n; ++j) {
        const int grid = layer[j].grid ? std::min(layer[j].grid, f.per_sm * sms) : f.per_sm * sms;
        const float us = time_graph([&] {
          for (int l = 0; l < layers; ++l) go(l, j, grid, (const float*)in0, 1);
        });
        std::printf(" %s %.2f", layer[j].name, us / layers);
      }
      const float chain = time_graph([&] {
        for (int l = 0; l < layers; ++l)
          for (int j = 0; j < n; ++j) {
            const int grid = layer[j].grid ? std::min(layer[j].grid, f.per_sm * sms) : f.per_sm * sms;
            const float* in = j ? outs[l][j - 1] : (l ? outs[l - 1][n - 1] : in0);
            go(l, j, grid, in, 1);
          }
      });
      std::printf("  | chain %.1f us/layer (%.1f%%)\n", chain / layers,
                  100.0 * layer_bytes / (chain / layers) / 1e6 / ceil_tbs);
    }
  };
  bulk_table(std::integral_constant<int, 0>{});
  bulk_table(std::integral_constant<int, 48>{});
  return 0;
}
