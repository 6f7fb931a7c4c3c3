// indexer.h: the FP4 sparse-attention indexer's prefill (model-family.md section 4; behaviour of
// reference/seeds/004). The CPU reference of every stage is compiler/indexer/reference.h; these
// kernels match its bytes (quantise, pack, stage) and its top-k sets (score, top-k; exact score ties
// aside, since fp32 accumulation orders terms differently from the float64 reference).
//
//   dp_idx_quant    keys [T, 128] bf16 -> MXFP4 68-byte keys written into the paged cache at slot[t]
//   dp_idx_pack     one rank's keys of a request set, read through the block table into compact rows
//                   [max_local, 68] (rows past the rank's keys are zero)
//   dp_idx_stage    every rank's packed rows (all-gathered, rank-major) -> 64-key pages in global key
//                   order: payload [pages, 1, 4, 64, 16], scales [pages, 1, 4, 64] (past the last key: 0)
//   dp_idx_score    logits of query rows against the keys each may see (causal, global positions):
//                   weight_scale * sum_h w[h] * relu(q[h] . k_t), into a [rows, L] fp32 tile
//   dp_idx_topk     the K best positions of each logits row, best first, ties to the lower position,
//                   -1 after the last visible key
//   dp_idx_rows     out[i] = src[map[i]] for whole top-k rows (the copy back after the DCP all-gather)
//
// The 68-byte key: bytes 0..63 hold E2M1 pairs (byte j: element 2j in the low nibble, 2j+1 in the high
// nibble), bytes 64..67 the UE8M0 scales of elements 32c..32c+31 (value 2^(byte-127)). Quantisation
// (compiler/indexer/key.h): e = ceil(log2(max(amax, 1e-4) / 6)) per group, code = the E2M1 value nearest
// to x / 2^e, ties to the even code, sign kept.
//
// Cache block layouts (layout parameter): 0 = split, a block's payload rows first (block_size x 64
// bytes) and then its scale rows (block_size x 4 bytes), as the FP8 indexer cache; 1 = packed, one
// 68-byte row per token. Blocks are block_stride bytes apart (at least block_size * 68, a multiple of
// 4). Every buffer is 16-byte aligned; the runtime checks both before any launch.
//
// Integer metadata (cu offsets, block tables, rows) is int32: the deploy limits keep every count far
// below 2^31 (deploy.json's indexer limits are checked against that).
#pragma once

#include "vendor.h"

#define DP_IDX_DIM 128
#define DP_IDX_KEY_BYTES 68
#define DP_IDX_PAGE 64

#if DP_VENDOR_AMD
__device__ __forceinline__ int dp_atomic_add_shared(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
#else
__device__ __forceinline__ int dp_atomic_add_shared(int* p, int v) { return atomicAdd(p, v); }
#endif

// Largest magnitude over the caller's aligned group of `n` lanes (n a power of two <= 32) of a 32-lane
// group: butterflies through dp_shfl_group32, so it means the same on 32- and 64-lane hardware.
template <int n>
__device__ __forceinline__ float dp_idx_group_max(float v) {
  const dp_u32 lane = dp_lane_id() & 31u;
#pragma unroll
  for (int m = 1; m < n; m <<= 1) {
    const float o = dp_bits_to_f32(dp_shfl_group32(dp_f32_to_bits(v), lane ^ (dp_u32)m));
    v = o > v ? o : v;
  }
  return v;
}

// The UE8M0 exponent of a group: the smallest e with max(amax, 1e-4) <= 6 * 2^e. r = amax / 6 rounds
// in fp32, but for bf16 inputs (and the 1e-4 floor) r is a power of two exactly when the real quotient
// is (key.h), so e = ceil(log2 r) is read off r's bits: its exponent, plus one unless the mantissa is 0.
__device__ __forceinline__ int dp_idx_exponent(float amax) {
  const float r = (amax > 1e-4f ? amax : 1e-4f) / 6.0f;
  const dp_u32 b = dp_f32_to_bits(r);
  const int e = (int)((b >> 23) & 0xffu) - 127;
  return (b & 0x7fffffu) ? e + 1 : e;
}

// E2M1 code of x (already divided by the group scale, |x| <= 6): the nearest of {0, .5, 1, 1.5, 2, 3,
// 4, 6}, ties to the even code, bit 3 the sign. Each boundary between codes i and i+1 is passed when
// |x| is above it, or equal to it and i+1 is even.
__device__ __forceinline__ dp_u32 dp_idx_e2m1(float x) {
  const float a = x < 0.0f ? -x : x;
  dp_u32 c = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return c | ((dp_f32_to_bits(x) >> 28) & 8u);
}

// Value of an E2M1 code times 2^(scale byte - 127).
__device__ __forceinline__ float dp_idx_e2m1_value(dp_u32 code, float scale) {
  const float mag[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float v = mag[code & 7u] * scale;
  return (code & 8u) ? -v : v;
}

__device__ __forceinline__ float dp_idx_scale(dp_u32 byte) {
  // 2^(byte - 127) as an fp32 bit pattern; byte 0 (2^-127) is subnormal: spelled out, 255 is NaN.
  if (byte == 0u) return dp_bits_to_f32(0x00400000u);
  return dp_bits_to_f32(byte == 255u ? 0x7fc00000u : byte << 23);
}

// Byte offsets of a cache slot's payload (64 bytes) and scales (4 bytes).
__device__ __forceinline__ dp_u64 dp_idx_payload_at(dp_u64 block, dp_u32 off, dp_u32 block_size, dp_u32 block_stride,
                                                    dp_u32 layout) {
  return block * block_stride + (dp_u64)off * (layout ? DP_IDX_KEY_BYTES : 64u);
}
__device__ __forceinline__ dp_u64 dp_idx_scales_at(dp_u64 block, dp_u32 off, dp_u32 block_size, dp_u32 block_stride,
                                                   dp_u32 layout) {
  return layout ? block * block_stride + (dp_u64)off * DP_IDX_KEY_BYTES + 64u
                : block * block_stride + (dp_u64)block_size * 64u + (dp_u64)off * 4u;
}

// Request of entry `i` of a request-major list with offsets cu[0..n] (cu[r] <= i < cu[r+1]).
__device__ __forceinline__ int dp_idx_find(const dp_i32* __restrict__ cu, int n, int i) {
  int lo = 0, hi = n - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (cu[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

// ---------------------------------------------------------------------------------------------------
// Quantise. One 32-lane group per key: lane l holds elements 4l..4l+3 (lanes 8c..8c+7 are scale group
// c), so the group's amax is a butterfly over 8 lanes and lane l writes payload bytes 2l and 2l+1.
// Tokens with slot -1 (another DCP rank's, or padding) or a slot past the cache are skipped.
template <int kThreads>
__device__ __forceinline__ void dp_idx_quant(const dp_bf16* __restrict__ keys,  // [count, 128] bf16
                                             const dp_i64* __restrict__ slots,  // [count] cache slot, -1 = skip
                                             dp_u8* __restrict__ cache,         // [num_blocks, block_stride] bytes
                                             dp_u32 count, dp_u32 num_blocks, dp_u32 block_size,
                                             dp_u32 block_stride, dp_u32 layout) {
  const dp_u32 token = blockIdx.x * (kThreads / 32) + threadIdx.x / 32;
  const dp_u32 lane = threadIdx.x & 31u;
  if (token >= count) return;  // whole 32-lane groups leave together
  const dp_i64 slot = slots[token];
  if (slot < 0 || slot >= (dp_i64)num_blocks * block_size) return;
  const dp_u32* src = (const dp_u32*)(keys + (dp_u64)token * DP_IDX_DIM) + 2 * lane;
  const dp_u32 w0 = src[0], w1 = src[1];
  const float x[4] = {dp_bits_to_f32(w0 << 16), dp_bits_to_f32(w0 & 0xffff0000u), dp_bits_to_f32(w1 << 16),
                      dp_bits_to_f32(w1 & 0xffff0000u)};
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) amax = (x[i] < 0.0f ? -x[i] : x[i]) > amax ? (x[i] < 0.0f ? -x[i] : x[i]) : amax;
  amax = dp_idx_group_max<8>(amax);
  const int e = dp_idx_exponent(amax);
  const float inv = dp_bits_to_f32((dp_u32)(127 - e) << 23);  // 2^-e, exact: e is in [-15, 127)
  dp_u32 codes = 0;
#pragma unroll
  for (int i = 0; i < 4; ++i) codes |= dp_idx_e2m1(x[i] * inv) << (4 * i);
  const dp_u64 block = (dp_u64)slot / block_size;
  const dp_u32 off = (dp_u32)((dp_u64)slot % block_size);
  dp_u8* payload = cache + dp_idx_payload_at(block, off, block_size, block_stride, layout);
  *(dp_u16*)(payload + 2 * lane) = (dp_u16)codes;
  if ((lane & 7u) == 0u)
    cache[dp_idx_scales_at(block, off, block_size, block_stride, layout) + lane / 8u] = (dp_u8)(e + 127);
}

// ---------------------------------------------------------------------------------------------------
// Pack one rank's keys of a request set: packed row local_cu[r] + j is local key j of request r, read
// from block block_table[r][j / block_size], offset j % block_size. One thread per 4-byte word (17 per
// row). Rows from local_cu[R] to max_local are written as zeros; a block id outside the cache gives a
// zero row (the runtime checked the table's shape, not its contents).
template <int kThreads>
__device__ __forceinline__ void dp_idx_pack(const dp_u8* __restrict__ cache,         // [num_blocks, block_stride]
                                            const dp_i32* __restrict__ block_table,  // [R, bt_stride]
                                            const dp_i32* __restrict__ local_cu,     // [R + 1] this rank's rows
                                            dp_u8* __restrict__ packed,              // [max_local, 68]
                                            dp_u32 num_requests, dp_u32 bt_stride, dp_u32 max_local,
                                            dp_u32 num_blocks, dp_u32 block_size, dp_u32 block_stride,
                                            dp_u32 layout) {
  const dp_u64 id = (dp_u64)blockIdx.x * kThreads + threadIdx.x;
  if (id >= (dp_u64)max_local * 17u) return;
  const dp_u32 row = (dp_u32)(id / 17u), word = (dp_u32)(id % 17u);
  dp_u32 v = 0;
  if ((int)row < local_cu[num_requests]) {
    const int r = dp_idx_find(local_cu, (int)num_requests, (int)row);
    const dp_u32 j = row - (dp_u32)local_cu[r];
    const dp_i32 block = block_table[(dp_u64)r * bt_stride + j / block_size];
    if (block >= 0 && (dp_u32)block < num_blocks) {
      const dp_u32 off = j % block_size;
      const dp_u64 at = word < 16u ? dp_idx_payload_at((dp_u64)block, off, block_size, block_stride, layout) + 4u * word
                                   : dp_idx_scales_at((dp_u64)block, off, block_size, block_stride, layout);
      v = *(const dp_u32*)(cache + at);
    }
  }
  *(dp_u32*)(packed + (dp_u64)row * DP_IDX_KEY_BYTES + 4u * word) = v;
}

// ---------------------------------------------------------------------------------------------------
// Stage a request set's keys into 64-key pages in global order. Key g = cu[r] + p (position p of
// request r) lives on rank o = (p / I) % W at local index (p / (I*W)) * I + p % I, i.e. gathered row
// o * max_local + local_cu[o][r] + that index. One thread per (key slot, 4-byte word): payload word w
// (scale group w / 4) goes to payload[page][0][w / 4][slot][4 * (w % 4)..], word 16 to the four scales.
template <int kThreads>
__device__ __forceinline__ void dp_idx_stage(const dp_u8* __restrict__ gathered,   // [W * max_local, 68]
                                             const dp_i32* __restrict__ cu,         // [R + 1] key offsets
                                             const dp_i32* __restrict__ local_cu,   // [W, R + 1] every rank's rows
                                             dp_u8* __restrict__ payload,           // [pages, 1, 4, 64, 16]
                                             dp_u8* __restrict__ scales,            // [pages, 1, 4, 64]
                                             dp_u32 num_requests, dp_u32 world, dp_u32 interleave,
                                             dp_u32 max_local, dp_u32 pages) {
  const dp_u64 id = (dp_u64)blockIdx.x * kThreads + threadIdx.x;
  if (id >= (dp_u64)pages * DP_IDX_PAGE * 17u) return;
  const dp_u32 g = (dp_u32)(id / 17u), word = (dp_u32)(id % 17u);
  const dp_u32 page = g / DP_IDX_PAGE, slot = g % DP_IDX_PAGE;
  dp_u32 v = 0;
  if ((int)g < cu[num_requests]) {
    const int r = dp_idx_find(cu, (int)num_requests, (int)g);
    const dp_u32 p = g - (dp_u32)cu[r];
    const dp_u32 owner = (p / interleave) % world;
    const dp_u32 local = (p / (interleave * world)) * interleave + p % interleave;
    const dp_u64 row = (dp_u64)owner * max_local + (dp_u32)local_cu[owner * (num_requests + 1) + r] + local;
    v = *(const dp_u32*)(gathered + row * DP_IDX_KEY_BYTES + 4u * word);
  }
  if (word < 16u) {
    const dp_u64 at = (((dp_u64)page * 4u + word / 4u) * DP_IDX_PAGE + slot) * 16u + 4u * (word % 4u);
    *(dp_u32*)(payload + at) = v;
  } else {
#pragma unroll
    for (dp_u32 c = 0; c < 4u; ++c)
      scales[((dp_u64)page * 4u + c) * DP_IDX_PAGE + slot] = (dp_u8)(v >> (8u * c));
  }
}

// ---------------------------------------------------------------------------------------------------
// Score. Block (i, b) (blockIdx.x = row, blockIdx.y = key block) takes query row i of the tile and the
// keys at positions 32b..32b+31 of the row's request (then 32(b + gridDim.y).., for requests longer than
// the grid's y extent); positions past the row's own are not scored (causal) and not written. The 32 keys are
// dequantised into shared memory (rows padded to 129 floats: thread s reads key s, conflict-free), the
// row's q stays bf16 in shared memory (read as broadcasts). Thread (s, hg) sums heads hg*NH/8 .. +NH/8-1
// of key s; the 8 partial sums are added in a fixed order, so the result is deterministic.
#define DP_IDX_SCORE_THREADS 256
#define DP_IDX_SCORE_KEYS 32

template <int NH>
__device__ __forceinline__ void dp_idx_score(const dp_bf16* __restrict__ q,         // [rows, NH, 128] bf16
                                             const float* __restrict__ w,           // [rows, NH] fp32 head weights
                                             const dp_u8* __restrict__ payload,     // staged pages
                                             const dp_u8* __restrict__ scales,      // staged scales
                                             const dp_i32* __restrict__ cu,         // [R + 1] key offsets
                                             const dp_i32* __restrict__ row_request,   // [rows] request of each row
                                             const dp_i32* __restrict__ row_position,  // [rows] its position
                                             float* __restrict__ logits,            // [tile rows, L] fp32
                                             dp_u32 row_begin, dp_u32 tile_rows, dp_u32 L, float weight_scale) {
  static_assert(NH % 8 == 0 && NH <= 64, "dp_idx_score: NH must be a multiple of 8, at most 64");
  constexpr int kKeys = DP_IDX_SCORE_KEYS;
  constexpr int kGroups = DP_IDX_SCORE_THREADS / kKeys;  // 8 head groups
  __shared__ float k_s[kKeys][DP_IDX_DIM + 1];
  __shared__ dp_u32 q_s[NH * DP_IDX_DIM / 2];  // bf16 pairs
  __shared__ float w_s[NH];
  __shared__ float part[kGroups][kKeys];

  const dp_u32 i = blockIdx.x;
  if (i >= tile_rows) return;
  const dp_u32 row = row_begin + i;
  const int r = row_request[row];
  const int pos = row_position[row];
  if (pos < 0 || (int)(blockIdx.y * kKeys) > pos) return;  // nothing visible in this block (uniform per block)
  const dp_u32 tid = threadIdx.x;

  // q row and head weights.
  const dp_u32* qrow = (const dp_u32*)(q + (dp_u64)row * NH * DP_IDX_DIM);
  for (dp_u32 k = tid; k < NH * DP_IDX_DIM / 2; k += DP_IDX_SCORE_THREADS) q_s[k] = qrow[k];
  for (dp_u32 h = tid; h < NH; h += DP_IDX_SCORE_THREADS) w_s[h] = w[(dp_u64)row * NH + h];
  // Key blocks b = blockIdx.y, + gridDim.y, ...: the grid's y extent is capped (65535), requests are not.
  for (dp_u32 t0 = blockIdx.y * kKeys; (int)t0 <= pos; t0 += gridDim.y * kKeys) {
    __syncthreads();  // the previous block's keys and partial sums are read
    // Keys: thread (key s, 8 consecutive payload bytes = 16 elements) dequantises its part.
    {
      const dp_u32 s = tid / 8u, part8 = tid % 8u;  // 32 keys x 8 parts of 16 elements
      const dp_u32 t = t0 + s;
      float* dst = &k_s[s][part8 * 16u];
      if ((int)t <= pos) {
        const dp_u32 g = (dp_u32)cu[r] + t;
        const dp_u32 page = g / DP_IDX_PAGE, slot = g % DP_IDX_PAGE;
        const dp_u32 c = part8 / 2u;  // scale group of these 16 elements
        const float sc = dp_idx_scale(scales[((dp_u64)page * 4u + c) * DP_IDX_PAGE + slot]);
        const dp_u8* src = payload + (((dp_u64)page * 4u + c) * DP_IDX_PAGE + slot) * 16u + 8u * (part8 % 2u);
        const dp_u32 lo = *(const dp_u32*)src, hi = *(const dp_u32*)(src + 4);
#pragma unroll
        for (dp_u32 k = 0; k < 8u; ++k) dst[k] = dp_idx_e2m1_value((lo >> (4u * k)) & 15u, sc);
#pragma unroll
        for (dp_u32 k = 0; k < 8u; ++k) dst[8u + k] = dp_idx_e2m1_value((hi >> (4u * k)) & 15u, sc);
      } else {
#pragma unroll
        for (dp_u32 k = 0; k < 16u; ++k) dst[k] = 0.0f;
      }
    }
    __syncthreads();

    // Thread (s, hg): key s against heads hg*HPG .. hg*HPG + HPG-1, all HPG dot products at once, so
    // each key value read from shared memory feeds HPG multiply-adds (the q pairs are broadcasts).
    constexpr int HPG = NH / kGroups;
    const dp_u32 s = tid % kKeys, hg = tid / kKeys;
    const dp_u32* qg = q_s + hg * HPG * (DP_IDX_DIM / 2);
    float dot[HPG];
#pragma unroll
    for (int h = 0; h < HPG; ++h) dot[h] = 0.0f;
#pragma unroll 4
    for (dp_u32 d2 = 0; d2 < DP_IDX_DIM / 2; ++d2) {
      const float k0 = k_s[s][2 * d2], k1 = k_s[s][2 * d2 + 1];
#pragma unroll
      for (int h = 0; h < HPG; ++h) {
        const dp_u32 qq = qg[h * (DP_IDX_DIM / 2) + d2];
        dot[h] += dp_bits_to_f32(qq << 16) * k0;
        dot[h] += dp_bits_to_f32(qq & 0xffff0000u) * k1;
      }
    }
    float acc = 0.0f;
#pragma unroll
    for (int h = 0; h < HPG; ++h) acc += w_s[hg * HPG + h] * (dot[h] > 0.0f ? dot[h] : 0.0f);
    part[hg][s] = acc;
    __syncthreads();
    if (hg == 0) {
      float sum = 0.0f;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) sum += part[g][s];
      const dp_u32 t = t0 + s;
      if ((int)t <= pos) logits[(dp_u64)i * L + t] = sum * weight_scale;
    }
  }
}

// ---------------------------------------------------------------------------------------------------
// Top-k. One block per logits row: n = position + 1 visible logits. With n <= K every position is a
// candidate; otherwise a radix select over the order-preserving integer image of the scores (4 passes
// of 8 bits, a shared histogram each) finds the K-th largest value T: every score above T is taken, and
// of those equal to T the lowest positions (a block-wide scan in position order, only when more are
// equal to T than are needed). The K candidates are then sorted by (score descending, position
// ascending) with a bitonic sort in shared memory and written out, -1 past n.
#define DP_IDX_TOPK_THREADS 512

// Order-preserving image of a score: a larger float gives a larger integer; -0 counts as +0 (the
// reference compares values, and relu sums can produce either zero).
__device__ __forceinline__ dp_u32 dp_idx_order(float x) {
  dp_u32 u = dp_f32_to_bits(x);
  if (u == 0x80000000u) u = 0u;
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

template <int K>
__device__ __forceinline__ void dp_idx_topk(const float* __restrict__ logits,         // [tile rows, L]
                                            const dp_i32* __restrict__ row_position,  // [rows]
                                            dp_i32* __restrict__ out,                 // [tile rows, K] i32
                                            dp_u32 row_begin, dp_u32 tile_rows, dp_u32 valid_rows, dp_u32 L) {
  constexpr int kThreads = DP_IDX_TOPK_THREADS;
  constexpr int KP = K <= 1 ? 1 : (K <= 2 ? 2 : (K <= 4 ? 4 : (K <= 8 ? 8 : (K <= 16 ? 16 : (K <= 32 ? 32 :
                     (K <= 64 ? 64 : (K <= 128 ? 128 : (K <= 256 ? 256 : (K <= 512 ? 512 : (K <= 1024 ? 1024 :
                     (K <= 2048 ? 2048 : 4096)))))))))));
  static_assert(K >= 1 && K <= 4096, "dp_idx_topk: K must be in 1..4096");
  __shared__ dp_u32 key_s[KP];
  __shared__ dp_i32 pos_s[KP];
  __shared__ int hist[256];
  __shared__ int scan[kThreads];
  __shared__ int shared_int[4];  // 0: candidates taken, 1: remaining, 2: bin, 3: equal-taken

  const dp_u32 i = blockIdx.x;
  if (i >= tile_rows) return;
  const dp_u32 tid = threadIdx.x;
  dp_i32* orow = out + (dp_u64)i * K;
  const int position = i < valid_rows ? row_position[row_begin + i] : -1;
  const int n = position + 1;  // visible keys (0 for padding rows)
  const float* lrow = logits + (dp_u64)i * L;

  for (int k = (int)tid; k < KP; k += kThreads) {
    key_s[k] = 0u;  // below every real score's image (the image of -NaN, never produced by a relu sum)
    pos_s[k] = 0x7fffffff;
  }
  if (tid == 0) shared_int[0] = 0;
  __syncthreads();

  if (n <= K) {
    for (int t = (int)tid; t < n; t += kThreads) {
      key_s[t] = dp_idx_order(lrow[t]);
      pos_s[t] = t;
    }
  } else {
    dp_u32 prefix = 0, mask = 0;
    int remaining = K;  // still to take among the keys matching prefix under mask
    for (int shift = 24; shift >= 0; shift -= 8) {
      for (int b = (int)tid; b < 256; b += kThreads) hist[b] = 0;
      __syncthreads();
      for (int t = (int)tid; t < n; t += kThreads) {
        const dp_u32 u = dp_idx_order(lrow[t]);
        if ((u & mask) == prefix) dp_atomic_add_shared(&hist[(u >> shift) & 255u], 1);
      }
      __syncthreads();
      if (tid == 0) {
        int above = 0, b = 255;
        for (; b > 0; --b) {
          if (above + hist[b] >= remaining) break;
          above += hist[b];
        }
        shared_int[1] = remaining - above;
        shared_int[2] = b;
      }
      __syncthreads();
      remaining = shared_int[1];
      prefix |= (dp_u32)shared_int[2] << shift;
      mask |= 255u << shift;
      __syncthreads();
    }
    // prefix is T; hist[T's low byte] counts the scores equal to T; `remaining` of them are taken.
    const int equal = hist[prefix & 255u];
    for (int t = (int)tid; t < n; t += kThreads) {
      const dp_u32 u = dp_idx_order(lrow[t]);
      if (u > prefix || (u == prefix && equal == remaining)) {
        const int at = dp_atomic_add_shared(&shared_int[0], 1);
        key_s[at] = u;
        pos_s[at] = t;
      }
    }
    if (equal > remaining) {
      // Ties at T: the `remaining` lowest positions, found tile by tile with a prefix sum.
      int taken = 0;  // equal scores taken before this tile (same in every thread)
      for (int base = 0; base < n && taken < remaining; base += kThreads) {
        const int t = base + (int)tid;
        const int flag = t < n && dp_idx_order(lrow[t]) == prefix;
        __syncthreads();
        scan[tid] = flag;
        __syncthreads();
        for (int d = 1; d < kThreads; d <<= 1) {
          const int add = (int)tid >= d ? scan[tid - d] : 0;
          __syncthreads();
          scan[tid] += add;
          __syncthreads();
        }
        const int rank = taken + scan[tid] - flag;  // equal scores before t
        if (flag && rank < remaining) {
          const int at = dp_atomic_add_shared(&shared_int[0], 1);
          key_s[at] = prefix;
          pos_s[at] = t;
        }
        taken += scan[kThreads - 1];
      }
    }
  }
  __syncthreads();

  // Bitonic sort of the candidates, padded to a power of two kp <= KP (a short row sorts only its n
  // entries' power of two): descending key, then ascending position.
  int kp = 1;
  while (kp < (n < K ? n : K)) kp <<= 1;
  for (int size = 2; size <= kp; size <<= 1) {
    for (int stride = size >> 1; stride > 0; stride >>= 1) {
      for (int a = (int)tid; a < kp / 2; a += kThreads) {
        const int lo = 2 * a - (a & (stride - 1));
        const int hi = lo + stride;
        const bool first_before = (key_s[lo] > key_s[hi]) || (key_s[lo] == key_s[hi] && pos_s[lo] < pos_s[hi]);
        const bool descending = (lo & size) == 0;
        if (first_before != descending) {
          const dp_u32 tk = key_s[lo];
          key_s[lo] = key_s[hi];
          key_s[hi] = tk;
          const dp_i32 tp = pos_s[lo];
          pos_s[lo] = pos_s[hi];
          pos_s[hi] = tp;
        }
      }
      __syncthreads();
    }
  }
  for (int k = (int)tid; k < K; k += kThreads) orow[k] = k < n ? pos_s[k] : -1;
}

// ---------------------------------------------------------------------------------------------------
// Row copy: out row i = src row map[i] (map[i] < 0: left as it is). One thread per int32.
template <int kThreads>
__device__ __forceinline__ void dp_idx_rows(const dp_i32* __restrict__ src,  // [src rows, k]
                                            const dp_i32* __restrict__ map,  // [rows]
                                            dp_i32* __restrict__ out,        // [rows, k]
                                            dp_u32 rows, dp_u32 k) {
  const dp_u64 id = (dp_u64)blockIdx.x * kThreads + threadIdx.x;
  if (id >= (dp_u64)rows * k) return;
  const dp_u32 i = (dp_u32)(id / k), j = (dp_u32)(id % k);
  const int from = map[i];
  if (from >= 0) out[id] = src[(dp_u64)from * k + j];
}
