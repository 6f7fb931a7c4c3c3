// vendor.h: one CUDA-style device source, compiled for NVIDIA (NVRTC or nvcc, sm_90a) and for AMD
// (clang -x hip, gfx942/gfx90a) without forking the op headers.
//
// Device code only. Nothing here includes a system, CUDA or ROCm header: NVRTC has no system include
// path by default, and the HIP build runs with -nogpuinc -nogpulib (no ROCm install, no device
// libraries), so everything below is a compiler builtin, inline PTX/GCN, or plain C++.
//
// What the op headers may use (and nothing vendor-specific besides):
//   types        dp_u8 .. dp_u64, dp_i32, dp_i64, dp_bf16 (16-bit storage), dp_u32x4 (16-byte vector)
//   qualifiers   __global__ __device__ __shared__ __forceinline__, DP_LAUNCH_BOUNDS(n) (__restrict__ is a
//                GNU keyword both compilers know)
//   indexing     threadIdx/blockIdx/blockDim/gridDim .x .y .z (CUDA names on both vendors)
//   sync         __syncthreads()
//   warp         DP_WARP_SIZE (32 NVIDIA, 64 AMD gfx9), dp_lane_id(), dp_shfl_xor(), dp_shfl_down(),
//                dp_shfl_group32() (read a lane of the caller's 32-lane group), dp_warp_sum(),
//                dp_block_sum<kThreads>()
//   numbers      dp_bf16_to_f32(), dp_f32_to_bf16() (round to nearest even), dp_expf/logf/rsqrtf
//   memory       dp_load16() (one 16-byte load), dp_store16(), dp_prefetch_l2()
//   cross-rank   dp_load16_coherent(), dp_load_f32_coherent(), dp_fence_system(), dp_load_acquire_system(),
//                dp_store_release_system(), dp_cas_system(), dp_or_system(), dp_timer_ns() (the in-kernel
//                all-reduce's mailboxes; allreduce.h says why each is needed)
//   grid         dp_fence_device(), dp_arrive_device() (the last block of a grid finds out that it is the
//                last: gemm.h's fused norm)
#pragma once

#if defined(__HIP__)
#define DP_VENDOR_AMD 1
#elif defined(__CUDACC__)
#define DP_VENDOR_NVIDIA 1
#else
#error "vendor.h: compile as CUDA (NVRTC/nvcc) or as HIP (clang -x hip)"
#endif

// ---------------------------------------------------------------------------------------------------
// Fixed-width types. <stdint.h> is not reachable from NVRTC or from -nogpuinc, so spell them out; the
// sizes hold on every target we compile for (LP64 host ABI mirrored by both device ABIs).
typedef unsigned char dp_u8;
typedef unsigned short dp_u16;
typedef unsigned int dp_u32;
typedef unsigned long long dp_u64;
typedef int dp_i32;
typedef long long dp_i64;
static_assert(sizeof(dp_u16) == 2 && sizeof(dp_u32) == 4 && sizeof(dp_u64) == 8, "vendor.h: type sizes");
static_assert(sizeof(void*) == 8, "vendor.h: device pointers are 64-bit");

#if DP_VENDOR_AMD
// ===================================================================================================
// AMD (clang HIP mode, no HIP headers). clang knows the CUDA attributes but -nogpuinc leaves out the
// wrapper header that spells them as keywords, so define those spellings here.
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __host__ __attribute__((host))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __forceinline__ inline __attribute__((always_inline))
// HIP's equivalent of __launch_bounds__: the flat work-group size range lets the register allocator
// use the whole budget for blocks of at most n threads.
#define DP_LAUNCH_BOUNDS(n) __attribute__((amdgpu_flat_work_group_size(1, n)))

// Wavefront size: gfx9 (gfx90a, gfx942, gfx950) runs wave64. clang tells us through this macro; the
// fallback keeps older/newer clangs that drop it compiling for the gfx9 targets we support.
#if defined(__AMDGCN_WAVEFRONT_SIZE__)
#define DP_WARP_SIZE __AMDGCN_WAVEFRONT_SIZE__
#else
#define DP_WARP_SIZE 64
#endif

struct dp_dim3 {
  dp_u32 x, y, z;
};
// threadIdx.x etc. as the CUDA spelling: each use builds a small value whose unused components are
// dead code (the builtins are pure), so `threadIdx.x` costs exactly one register read.
#define threadIdx                                                                                   \
  (dp_dim3{__builtin_amdgcn_workitem_id_x(), __builtin_amdgcn_workitem_id_y(),                     \
           __builtin_amdgcn_workitem_id_z()})
#define blockIdx                                                                                    \
  (dp_dim3{__builtin_amdgcn_workgroup_id_x(), __builtin_amdgcn_workgroup_id_y(),                   \
           __builtin_amdgcn_workgroup_id_z()})
#define blockDim                                                                                    \
  (dp_dim3{(dp_u32)__builtin_amdgcn_workgroup_size_x(), (dp_u32)__builtin_amdgcn_workgroup_size_y(), \
           (dp_u32)__builtin_amdgcn_workgroup_size_z()})
// The dispatch gives the grid in work-items; CUDA's gridDim counts blocks. Kernels are launched with
// uniform work-group sizes (grid a multiple of the block), so the division is exact.
#define gridDim                                                                                     \
  (dp_dim3{__builtin_amdgcn_grid_size_x() / (dp_u32)__builtin_amdgcn_workgroup_size_x(),          \
           __builtin_amdgcn_grid_size_y() / (dp_u32)__builtin_amdgcn_workgroup_size_y(),          \
           __builtin_amdgcn_grid_size_z() / (dp_u32)__builtin_amdgcn_workgroup_size_z()})

// Block barrier with the same memory semantics as CUDA's __syncthreads(): LDS and global writes made
// before it by any thread of the block are visible to every thread of the block after it.
__device__ __forceinline__ void __syncthreads() {
  __builtin_amdgcn_fence(__ATOMIC_RELEASE, "workgroup");
  __builtin_amdgcn_s_barrier();
  __builtin_amdgcn_fence(__ATOMIC_ACQUIRE, "workgroup");
}

__device__ __forceinline__ float dp_bits_to_f32(dp_u32 u) { return __builtin_bit_cast(float, u); }
__device__ __forceinline__ dp_u32 dp_f32_to_bits(float f) { return __builtin_bit_cast(dp_u32, f); }

// Lane index within the wavefront: mbcnt counts the set bits of the all-ones mask below this lane.
__device__ __forceinline__ dp_u32 dp_lane_id() {
  return __builtin_amdgcn_mbcnt_hi(~0u, __builtin_amdgcn_mbcnt_lo(~0u, 0u));
}

// Cross-lane moves through ds_bpermute (LDS crossbar, no LDS allocation): every lane reads the value
// of lane `src`; the address operand is in bytes (lane * 4).
__device__ __forceinline__ dp_u32 dp_lane_read(dp_u32 v, dp_u32 src) {
  return (dp_u32)__builtin_amdgcn_ds_bpermute((int)(src << 2), (int)v);
}

// 16-byte vector: clang's ext_vector_type gives .x .y .z .w and lowers a 16-byte aligned access to
// one global_load_dwordx4 / global_store_dwordx4.
typedef dp_u32 dp_u32x4 __attribute__((ext_vector_type(4)));

__device__ __forceinline__ dp_u32x4 dp_load16(const void* p) { return *(const dp_u32x4*)p; }
__device__ __forceinline__ void dp_store16(void* p, dp_u32x4 v) { *(dp_u32x4*)p = v; }

// Math without device libraries (-nogpulib): these builtins lower to hardware instructions plus
// inline range scaling in the AMDGPU backend (v_exp_f32 / v_log_f32 / v_rsq_f32), never to a
// libcall; a libcall would fail to link, so a compile of these templates is the check.
__device__ __forceinline__ float dp_expf(float x) { return __builtin_expf(x); }
__device__ __forceinline__ float dp_logf(float x) { return __builtin_logf(x); }
__device__ __forceinline__ float dp_rsqrtf(float x) { return __builtin_amdgcn_rsqf(x); }

// L2 prefetch on gfx942/gfx90a.
//
// CDNA has no prefetch instruction for the vector memory path (s_prefetch_data arrives with gfx12,
// and scalar loads go through the scalar cache). The closest real equivalent is an ordinary load
// whose result is discarded: a miss allocates the 128-byte line in the L2 of the XCD running the
// prefetch block and, on MI300 (gfx942), in the Infinity Cache (MALL) that all XCDs share, which is
// what a consumer kernel on another XCD then hits. Choices and why:
//   * one 4-byte load per 128-byte line: the line, not the bytes, is the unit that gets allocated;
//   * cache-policy bits left at their defaults (sc0=0, sc1=0, nt=0): `nt` would mark the line
//     streaming (evict first), the opposite of what a prefetch wants, and sc1 (device scope) asks
//     for a coherent read that the L2 may serve without keeping the line. The default policy also
//     allocates in the CU's L1, which only the prefetch kernel's own CUs ever see;
//   * the loop has a constant trip count and is unrolled, and the loaded words are folded together
//     and handed to an empty asm statement: the compiler can neither drop the loads nor wait on each
//     one, so a thread's loads for one chunk are all in flight together and it waits once per chunk.
// The range is 16-byte aligned and a line never crosses a page, so touching the line that holds the
// last byte never faults.
#define DP_PREFETCH_LINE_BYTES 128
// Bytes one dp_prefetch_l2 call covers at most (16 lines, i.e. 16 loads in flight per thread).
#define DP_PREFETCH_CHUNK_BYTES 2048
__device__ __forceinline__ void dp_prefetch_l2(const void* p, dp_u32 bytes /* <= DP_PREFETCH_CHUNK_BYTES */) {
  typedef const __attribute__((address_space(1))) dp_u32 global_u32;  // global, not flat: no LDS check
  const dp_u64 first = (dp_u64)p & ~(dp_u64)(DP_PREFETCH_LINE_BYTES - 1);
  const dp_u64 last = ((dp_u64)p + (bytes ? bytes - 1 : 0)) & ~(dp_u64)(DP_PREFETCH_LINE_BYTES - 1);
  dp_u32 sink = 0;
  // One more line than a chunk holds (an unaligned chunk straddles one more boundary). Lines past
  // the end re-touch the last line instead of branching: branch-free loads issue back to back.
#pragma unroll
  for (int i = 0; i <= DP_PREFETCH_CHUNK_BYTES / DP_PREFETCH_LINE_BYTES; ++i) {
    dp_u64 a = first + (dp_u64)i * DP_PREFETCH_LINE_BYTES;
    a = a < last ? a : last;
    sink ^= *(global_u32*)a;
  }
  __asm__ volatile("" ::"v"(sink));
}

#else  // DP_VENDOR_NVIDIA
// ===================================================================================================
// NVIDIA (NVRTC or nvcc). The CUDA keywords, threadIdx & co., __syncthreads, uint4 and the __expf
// family are built into the compiler; only the portable names are added here.
#define DP_WARP_SIZE 32
#define DP_LAUNCH_BOUNDS(n) __launch_bounds__(n)

__device__ __forceinline__ float dp_bits_to_f32(dp_u32 u) { return __uint_as_float(u); }
__device__ __forceinline__ dp_u32 dp_f32_to_bits(float f) { return __float_as_uint(f); }

__device__ __forceinline__ dp_u32 dp_lane_id() { return threadIdx.x & (DP_WARP_SIZE - 1); }

typedef uint4 dp_u32x4;

// Loads through the read-only (non-coherent) path. Safe because no op reads an address after any
// thread of the same launch has written it (in-place ops read each element before writing it, in
// the same thread).
__device__ __forceinline__ dp_u32x4 dp_load16(const void* p) { return __ldg((const uint4*)p); }
__device__ __forceinline__ void dp_store16(void* p, dp_u32x4 v) { *(uint4*)p = v; }

// Fast-math intrinsics (MUFU.EX2 / MUFU.LG2 / MUFU.RSQ with a scale): about 2 ulp, which the ops'
// fp32 accumulation and bf16 outputs absorb.
__device__ __forceinline__ float dp_expf(float x) { return __expf(x); }
__device__ __forceinline__ float dp_logf(float x) { return __logf(x); }
__device__ __forceinline__ float dp_rsqrtf(float x) { return rsqrtf(x); }

// L2 prefetch. sm_90 has a bulk prefetch (one instruction for a whole chunk, executed by the TMA
// unit, so a thread issues it and moves on without waiting); older parts get one prefetch.global.L2
// per 128-byte line. Both are hints: they never fault and never return data. The bulk form needs a
// 16-byte aligned global address and a size that is a multiple of 16: the range table guarantees
// the alignment, and the size is rounded up (the rounded tail stays inside the last 16-byte block).
#define DP_PREFETCH_LINE_BYTES 128
// Bytes one dp_prefetch_l2 call covers at most: enough chunks per range to spread a weight matrix
// over all the prefetch threads, few enough instructions that issuing them is never the limit.
#define DP_PREFETCH_CHUNK_BYTES 4096
__device__ __forceinline__ void dp_prefetch_l2(const void* p, dp_u32 bytes /* <= DP_PREFETCH_CHUNK_BYTES */) {
#if __CUDA_ARCH__ >= 900
  const dp_u64 global = (dp_u64)__cvta_generic_to_global(p);
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(global), "r"((bytes + 15u) & ~15u)
               : "memory");
#else
  const char* c = (const char*)p;
  for (dp_u32 off = 0; off < bytes; off += DP_PREFETCH_LINE_BYTES)
    asm volatile("prefetch.global.L2 [%0];" ::"l"(c + off));
#endif
}

// Bulk copies into shared memory (sm_90: the TMA unit copies a contiguous range, one instruction, and
// counts the bytes it wrote on an mbarrier in shared memory). The pattern: one thread initialises the
// barrier for one arrival (dp_mbar_init, then dp_mbar_init_fence and a block barrier); a producer
// announces a stage's bytes (dp_mbar_expect_bytes, the one arrival) and issues the copies
// (dp_bulk_copy_shared: 16-byte aligned addresses, size a multiple of 16); consumers wait for the phase
// (dp_mbar_wait with its parity, 0 on the first use, flipping on each reuse; it traps if the phase never
// completes).
#if __CUDA_ARCH__ >= 900
#define DP_HAS_BULK_COPY 1
__device__ __forceinline__ dp_u32 dp_smem_addr(const void* p) { return (dp_u32)__cvta_generic_to_shared(p); }
__device__ __forceinline__ dp_u32 dp_dynamic_smem_bytes() {  // the launch's dynamic shared memory
  dp_u32 n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}
__device__ __forceinline__ void dp_mbar_init(dp_u64* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(dp_smem_addr(bar)) : "memory");
}
__device__ __forceinline__ void dp_mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void dp_mbar_expect_bytes(dp_u64* bar, dp_u32 bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(dp_smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void dp_bulk_copy_shared(void* dst, const void* src, dp_u32 bytes, dp_u64* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          dp_smem_addr(dst)),
      "l"((dp_u64)__cvta_generic_to_global(src)), "r"(bytes), "r"(dp_smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ bool dp_mbar_try_wait(dp_u64* bar, dp_u32 parity) {  // true once the phase is done
  dp_u32 done;
  asm volatile(
      "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\tselp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(done)
      : "r"(dp_smem_addr(bar)), "r"(parity)
      : "memory");
  return done != 0;
}
// A phase that has not completed after about 2^34 cycles (several seconds; its copies take microseconds)
// never will: the kernel traps, a launch error the host sees, rather than hanging the stream.
__device__ __forceinline__ void dp_mbar_wait(dp_u64* bar, dp_u32 parity) {
  if (dp_mbar_try_wait(bar, parity)) return;
  const long long start = clock64();
  while (!dp_mbar_try_wait(bar, parity))
    if (clock64() - start > (1ll << 34)) __trap();
}
#endif
#endif  // vendor
#ifndef DP_HAS_BULK_COPY
#define DP_HAS_BULK_COPY 0  // AMD, and NVIDIA before sm_90
#endif

// Programmatic dependent launch (sm_90+): every generated entry point starts with this. It lets the
// next kernel of the stream be scheduled once every block of this one has started, and waits until
// the previous kernel has finished and its writes are visible before this one reads anything, so a
// kernel launched with the attribute behaves as in plain stream order, minus the launch gap. Without
// the attribute (and on AMD) both are no-ops.
// One exception (codegen gemm_early): the width-1 e4m3 gemm's entry point only triggers, and the
// device function issues its first round of weight loads, then every thread waits before it reads an
// activation (with ld.global.cg: coherent, never through the SM's L1) or writes anything. Weights are
// read-only for the bundle's life, so loading them early is safe; the activations through
// ld.global.nc after a wait inside the loop gave wrong outputs (bench/NOTES.md, 2026-12-02/03).
// (Waiting later, after an L2 prefetch of the block's weights, was measured slower on the H200: the
// prefetch requests cost more than the overlap won; bench/NOTES.md.)
#if DP_VENDOR_NVIDIA && __CUDA_ARCH__ >= 900
#define DP_GRID_DEPENDENCY_TRIGGER() asm volatile("griddepcontrol.launch_dependents;" ::: "memory")
__device__ __forceinline__ void dp_grid_dependency_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
#else
#define DP_GRID_DEPENDENCY_TRIGGER() \
  do {                               \
  } while (0)
__device__ __forceinline__ void dp_grid_dependency_wait() {}
#endif
#define DP_GRID_DEPENDENCY_ENTRY() \
  do {                             \
    DP_GRID_DEPENDENCY_TRIGGER();  \
    dp_grid_dependency_wait();     \
  } while (0)

// Between the blocks of one grid ("device" / "agent" scope). The pattern: every thread of a block
// stores its outputs, then dp_fence_device() and a barrier; one thread counts the block in with
// dp_arrive_device(); the block that sees the count reach the grid's size knows every other block's
// stores are done, and after a barrier and its own dp_fence_device() it reads them with
// dp_load16_coherent().
#if DP_VENDOR_AMD
__device__ __forceinline__ void dp_fence_device() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, "agent"); }
// Adds 1 to *counter; returns the value before.
__device__ __forceinline__ dp_u32 dp_arrive_device(dp_u32* counter) {
  return __hip_atomic_fetch_add(counter, 1u, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_AGENT);
}
#else
__device__ __forceinline__ void dp_fence_device() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ dp_u32 dp_arrive_device(dp_u32* counter) {
  dp_u32 old;
  asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], 1;" : "=r"(old) : "l"(counter) : "memory");
  return old;
}
#endif

// ===================================================================================================
// Cross-rank memory operations (templates/allreduce.h): words and buffers that kernels of other ranks
// write, on this device or on a peer device (CUDA IPC / HIP IPC mappings). "System" scope, because a
// peer device's threads are outside the GPU ("agent") scope; within one device it is merely stronger
// than needed. Each is one instruction (or a short fixed sequence) on both vendors.
#if DP_VENDOR_AMD
// A sequentially consistent fence at system scope: makes this thread's earlier stores visible to
// every agent before any later store (writes back dirty L2 lines for remote readers, waits for the
// stores to complete) and invalidates the CU's L1 so later loads see other agents' stores.
__device__ __forceinline__ void dp_fence_system() { __builtin_amdgcn_fence(__ATOMIC_SEQ_CST, ""); }
__device__ __forceinline__ dp_u32 dp_load_acquire_system(const dp_u32* p) {
  return __hip_atomic_load(p, __ATOMIC_ACQUIRE, __HIP_MEMORY_SCOPE_SYSTEM);
}
__device__ __forceinline__ void dp_store_release_system(dp_u32* p, dp_u32 v) {
  __hip_atomic_store(p, v, __ATOMIC_RELEASE, __HIP_MEMORY_SCOPE_SYSTEM);
}
// Stores `desired` if *p == expected; returns the value found.
__device__ __forceinline__ dp_u32 dp_cas_system(dp_u32* p, dp_u32 expected, dp_u32 desired) {
  __hip_atomic_compare_exchange_strong(p, &expected, desired, __ATOMIC_RELAXED, __ATOMIC_RELAXED,
                                       __HIP_MEMORY_SCOPE_SYSTEM);
  return expected;
}
__device__ __forceinline__ void dp_or_system(dp_u32* p, dp_u32 bits) {
  __hip_atomic_fetch_or(p, bits, __ATOMIC_RELAXED, __HIP_MEMORY_SCOPE_SYSTEM);
}
// A 16-byte load of data another agent stored, made visible by a dp_fence_system() of this thread
// before it (on gfx9 that fence invalidates the CU's L1, so a plain load then reads L2 / memory).
__device__ __forceinline__ dp_u32x4 dp_load16_coherent(const void* p) { return *(const dp_u32x4*)p; }
__device__ __forceinline__ float dp_load_f32_coherent(const float* p) { return *p; }
__device__ __forceinline__ dp_u16 dp_load_u16_coherent(const void* p) { return *(const dp_u16*)p; }
// Nanoseconds of a constant-rate clock shared by the device: s_memrealtime counts the 100 MHz
// reference clock on gfx9 (gfx90a, gfx942), whatever the shader clock does.
__device__ __forceinline__ dp_u64 dp_timer_ns() { return __builtin_amdgcn_s_memrealtime() * 10ull; }
#else
__device__ __forceinline__ void dp_fence_system() { asm volatile("fence.sc.sys;" ::: "memory"); }
__device__ __forceinline__ dp_u32 dp_load_acquire_system(const dp_u32* p) {
  dp_u32 v;
  asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void dp_store_release_system(dp_u32* p, dp_u32 v) {
  asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
// Inline PTX rather than atomicCAS_system / atomicOr_system: those instantiate a helper template
// whose static member lands in every code object that includes this header, used or not.
__device__ __forceinline__ dp_u32 dp_cas_system(dp_u32* p, dp_u32 expected, dp_u32 desired) {
  dp_u32 old;
  asm volatile("atom.cas.sys.global.b32 %0, [%1], %2, %3;" : "=r"(old) : "l"(p), "r"(expected), "r"(desired) : "memory");
  return old;
}
__device__ __forceinline__ void dp_or_system(dp_u32* p, dp_u32 bits) {
  asm volatile("red.or.sys.global.b32 [%0], %1;" ::"l"(p), "r"(bits) : "memory");
}
// A 16-byte load of data another agent stored, made visible by a dp_fence_system() of this thread
// before it. ld.global.cg caches in L2 only, never in the SM's L1, which is not coherent with other
// agents (and never through the read-only path dp_load16 uses).
__device__ __forceinline__ dp_u32x4 dp_load16_coherent(const void* p) {
  dp_u32x4 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p)
               : "memory");
  return v;
}
__device__ __forceinline__ float dp_load_f32_coherent(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ dp_u16 dp_load_u16_coherent(const void* p) {
  dp_u16 v;
  asm volatile("ld.global.cg.u16 %0, [%1];" : "=h"(v) : "l"(p) : "memory");
  return v;
}
// %globaltimer: nanoseconds, the same clock on every SM (updated about every microsecond).
__device__ __forceinline__ dp_u64 dp_timer_ns() {
  dp_u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
#endif

// ===================================================================================================
// Common to both vendors.

// Warp shuffles with CUDA's semantics for a full warp: dp_shfl_xor reads lane (lane ^ mask);
// dp_shfl_down reads lane (lane + delta) and keeps the caller's own value past the last lane.
// Every lane of the warp/wavefront must call them (no divergent use).
__device__ __forceinline__ float dp_shfl_xor(float v, int mask) {
#if DP_VENDOR_AMD
  return dp_bits_to_f32(dp_lane_read(dp_f32_to_bits(v), dp_lane_id() ^ (dp_u32)mask));
#else
  return __shfl_xor_sync(0xffffffffu, v, mask);
#endif
}
__device__ __forceinline__ float dp_shfl_down(float v, int delta) {
#if DP_VENDOR_AMD
  const dp_u32 lane = dp_lane_id();
  const dp_u32 src = lane + (dp_u32)delta < DP_WARP_SIZE ? lane + (dp_u32)delta : lane;
  return dp_bits_to_f32(dp_lane_read(dp_f32_to_bits(v), src));
#else
  return __shfl_down_sync(0xffffffffu, v, delta);
#endif
}

// Lane j of the caller's aligned group of 32 lanes (lanes 32k..32k+31 of a warp or wavefront).
// Groups of 32 exist on both vendors, so code built on them needs no DP_WARP_SIZE cases, and on
// wave64 a half-populated wavefront (a 32-thread block) only ever reads lanes that exist.
__device__ __forceinline__ dp_u32 dp_shfl_group32(dp_u32 v, dp_u32 j) {
#if DP_VENDOR_AMD
  return dp_lane_read(v, (dp_lane_id() & ~31u) | (j & 31u));
#else
  return __shfl_sync(0xffffffffu, v, (int)j, 32);
#endif
}
__device__ __forceinline__ dp_u64 dp_shfl_group32(dp_u64 v, dp_u32 j) {
  return (dp_u64)dp_shfl_group32((dp_u32)v, j) | ((dp_u64)dp_shfl_group32((dp_u32)(v >> 32), j) << 32);
}

// Sum over the warp/wavefront; every lane gets the total (butterfly, log2(DP_WARP_SIZE) steps).
__device__ __forceinline__ float dp_warp_sum(float v) {
#pragma unroll
  for (int m = DP_WARP_SIZE / 2; m > 0; m >>= 1) v += dp_shfl_xor(v, m);
  return v;
}

// bf16 as a 16-bit storage type with our own conversions, identical on both vendors (no cuda_bf16.h,
// no hip_bf16.h): widening is exact; narrowing rounds to nearest, ties to even, like the hardware
// cvt.rn.bf16.f32 and like torch. NaN stays NaN (quieted) instead of rounding into infinity.
struct dp_bf16 {
  dp_u16 bits;
};
static_assert(sizeof(dp_bf16) == 2, "vendor.h: dp_bf16 is 2 bytes");

__device__ __forceinline__ float dp_bf16_to_f32(dp_bf16 h) { return dp_bits_to_f32((dp_u32)h.bits << 16); }

__device__ __forceinline__ dp_bf16 dp_f32_to_bf16(float f) {
  dp_u32 u = dp_f32_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return dp_bf16{(dp_u16)((u >> 16) | 0x0040u)};
  u += 0x7fffu + ((u >> 16) & 1u);
  return dp_bf16{(dp_u16)(u >> 16)};
}

// Eight bf16 packed in a 16-byte vector, little-endian: element 2k is the low half of word k.
__device__ __forceinline__ void dp_unpack8_bf16(dp_u32x4 v, float out[8]) {
  const dp_u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[2 * k] = dp_bits_to_f32(w[k] << 16);
    out[2 * k + 1] = dp_bits_to_f32(w[k] & 0xffff0000u);
  }
}
__device__ __forceinline__ dp_u32x4 dp_pack8_bf16(const float in[8]) {
  dp_u32 w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] = (dp_u32)dp_f32_to_bf16(in[2 * k]).bits | ((dp_u32)dp_f32_to_bf16(in[2 * k + 1]).bits << 16);
  dp_u32x4 v;
  v.x = w[0];
  v.y = w[1];
  v.z = w[2];
  v.w = w[3];
  return v;
}

// Sum over a block of kThreads threads (a multiple of the warp size), returned to every thread.
// Two levels: warp butterflies, then every warp adds the per-warp partials from shared memory.
// Works unchanged for 32-lane warps and 64-lane wavefronts because both levels use DP_WARP_SIZE.
// The partials live in one static shared array per kThreads, so two calls in one kernel need a
// __syncthreads() between them (the second call's writes would race the first call's reads).
template <int kThreads>
__device__ __forceinline__ float dp_block_sum(float v) {
  static_assert(kThreads % DP_WARP_SIZE == 0, "dp_block_sum: block must be whole warps");
  constexpr int kWarps = kThreads / DP_WARP_SIZE;
  static_assert(kWarps <= DP_WARP_SIZE, "dp_block_sum: at most DP_WARP_SIZE warps per block");
  __shared__ float partial[kWarps];  // [kWarps] fp32, one per warp
  v = dp_warp_sum(v);
  if (kWarps == 1) return v;
  const int warp = (int)threadIdx.x / DP_WARP_SIZE;
  const int lane = (int)dp_lane_id();
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  float t = lane < kWarps ? partial[lane] : 0.0f;
  t = dp_warp_sum(t);  // every warp reduces the partials itself: no second barrier, no broadcast
  return t;
}
