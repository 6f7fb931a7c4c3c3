// mla.h: NoPE MLA decode with absorbed weights over the paged latent cache (model-family.md 3b), for
// every request and head of a layer in three launches:
//
//   dp_mla_prep     kv_a_layernorm of the new latent, its cache-row write at slot_mapping, and the
//                   absorbed query q_lat = q_nope . W_UK_T per head (q_pe appended)
//   dp_mla_attn     split-KV attention: each block takes one request, a few heads and one of NS
//                   slices of the request's tokens, and leaves (max, sum, unnormalised o_lat) partials
//   dp_mla_combine  merges the NS partials of every (row, head), rounds o_lat to bf16, multiplies by
//                   W_UV and applies the K3 output gate: the o_proj input
//
// Layouts (TP shard of this rank: N heads):
//   q        [T, stride_q] bf16, row t: head n at n*(PN+R): [q_nope PN | q_pe R] (no rotary: NoPE)
//   kv       [T, stride_kv] bf16, row t: [c L | k_pe R], the kv_a_proj_with_mqa output
//   kv_b     [N*(PN+V), L] bf16, kv_b_proj as stored: row n*(PN+V)+j is W_UK_T[n][j][:] for j < PN and
//            W_UV[n][:][j-PN] for j >= PN (vLLM derives W_UK_T (N,PN,L) and W_UV (N,L,V) from it)
//   cache    vLLM's paged MLA cache: block b holds [BS, L+R] bf16 at b*cache_stride (elements; dense:
//            BS*(L+R), larger when the host pads its blocks), row [c (normed) L | k_pe R] per token;
//            token o of block b at b*cache_stride + o*(L+R). Block offsets are computed in 64 bits.
//            mla_attn reads rows with 16-byte loads: cache_stride must be a multiple of 8 and the
//            cache 16-byte aligned. Padding after a block's BS rows is never read or written.
//   block_table [W, stride_bt] i32, seq_lens [W] i32 (tokens of the request including its Q new
//            ones; 0 = padded request: no cache write, zero output rows), slot_mapping [T] i64
//            (cache slot block*BS + offset of each new token; -1 = not written, vLLM PAD_SLOT_ID)
//   q_abs    [T, N, L+R] bf16 workspace: [q_lat L | q_pe R] per head (vLLM rounds q_lat to bf16)
//   part_o   [W, NS, Q, N, L] fp32 and part_ml [W, NS, Q, N, 2] fp32 workspace: split partials
//   out      [T, N*V] bf16: concat over heads of o_lat . W_UV (times sigmoid(gate) for K3)
// Row t = r*Q + i is draft position i of request r; it attends positions 0 .. seq_len - Q + i.
#pragma once

#include "vendor.h"
#include "gemm.h"  // DP_KERNEL_BOUNDS, dp_group_sum, dp_sigmoid, dp_round_bf16, dp_div

#define DP_MLA_THREADS 256
#define DP_MLA_TILE 32  // cache rows per attention tile (one per lane)

// ---------------------------------------------------------------------------------------------------
// Launch: grid T + N*ceil(L/512) blocks of 256: blocks [0, T) normalise and write one row's latent,
// the rest compute one head's q_lat over 512 latent columns (two per thread) for all rows.
template <int T, int Q, int N, int L, int R, int PN, int V, int BS>
__device__ __forceinline__ void dp_mla_prep(const dp_bf16* __restrict__ q,             // [T, stride_q] bf16
                                            dp_u32 stride_q,
                                            const dp_bf16* __restrict__ kv,            // [T, stride_kv] bf16
                                            dp_u32 stride_kv,
                                            const dp_bf16* __restrict__ kv_norm_w,     // [L] bf16
                                            const dp_bf16* __restrict__ kv_b,          // [N*(PN+V), L] bf16
                                            const dp_i32* __restrict__ seq_lens,       // [W] i32
                                            const dp_i64* __restrict__ slot_mapping,   // [T] i64
                                            dp_bf16* cache,                            // [blocks, cache_stride] bf16
                                            dp_bf16* __restrict__ q_abs,               // [T, N, L+R] bf16
                                            float eps,
                                            dp_u32 cache_stride) {  // elements between cache blocks
  static_assert(L % 64 == 0 && R % 2 == 0 && PN % 8 == 0, "mla_prep: L multiple of 64, even R");
  static_assert(BS >= 1, "mla_prep: cache block size");
  constexpr int kCols = 2 * DP_MLA_THREADS;  // latent columns per absorb block
  const int tid = (int)threadIdx.x;
  int b = (int)blockIdx.x;
  if (b < T) {
    // ---- latent row t: RMSNorm(c) * w, cache write ----
    const int t = b;
    const dp_i64 slot = slot_mapping[t];
    if (seq_lens[t / Q] == 0 || slot < 0) return;  // padded request or PAD_SLOT_ID: nothing to write
    const dp_bf16* row = kv + (dp_u64)t * stride_kv;
    __shared__ float red[DP_MLA_THREADS / DP_GROUP];
    float ss = 0.0f;
    for (int l = tid; l < L; l += DP_MLA_THREADS) {
      const float c = dp_bf16_to_f32(row[l]);
      ss += c * c;
    }
    ss = dp_group_sum(ss);
    if (tid % DP_GROUP == 0) red[tid / DP_GROUP] = ss;
    __syncthreads();
    float tot = 0.0f;
#pragma unroll
    for (int g = 0; g < DP_MLA_THREADS / DP_GROUP; ++g) tot += red[g];
    const float rstd = dp_rsqrtf(tot * (1.0f / (float)L) + eps);
    const dp_u64 block = (dp_u64)slot / BS, offset = (dp_u64)slot % BS;
    dp_bf16* dst = cache + block * cache_stride + offset * (L + R);  // [L+R] bf16
    for (int l = tid; l < L; l += DP_MLA_THREADS)
      dst[l] = dp_f32_to_bf16(dp_bf16_to_f32(row[l]) * rstd * dp_bf16_to_f32(kv_norm_w[l]));
    for (int e = tid; e < R; e += DP_MLA_THREADS) dst[L + e] = row[L + e];
    return;
  }
  // ---- absorbed query of head n, latent columns [col0, col0 + 512) ----
  b -= T;
  constexpr int kTiles = (L + kCols - 1) / kCols;
  const int n = b / kTiles;
  const int col = (b % kTiles) * kCols + 2 * tid;  // this thread's two columns
  __shared__ float qn[T * PN];                     // [T, PN] fp32 q_nope of head n
  for (int e = tid; e < T * PN; e += DP_MLA_THREADS) {
    const int t = e / PN, j = e % PN;
    qn[e] = dp_bf16_to_f32(q[(dp_u64)t * stride_q + n * (PN + R) + j]);
  }
  __syncthreads();
  if (col < L) {
    float acc[T][2];  // [T, 2] fp32
#pragma unroll
    for (int t = 0; t < T; ++t) acc[t][0] = acc[t][1] = 0.0f;
    const dp_bf16* wk = kv_b + (dp_u64)n * (PN + V) * L + col;  // W_UK_T[n][j][col], row stride L
#pragma unroll 4
    for (int j = 0; j < PN; ++j) {
      const dp_u32 w2 = *(const dp_u32*)(wk + (dp_u64)j * L);  // two bf16, little-endian
      const float w0 = dp_bits_to_f32(w2 << 16), w1 = dp_bits_to_f32(w2 & 0xffff0000u);
#pragma unroll
      for (int t = 0; t < T; ++t) {
        acc[t][0] += qn[t * PN + j] * w0;
        acc[t][1] += qn[t * PN + j] * w1;
      }
    }
#pragma unroll
    for (int t = 0; t < T; ++t) {
      dp_bf16* dst = q_abs + ((dp_u64)t * N + n) * (L + R) + col;
      dst[0] = dp_f32_to_bf16(acc[t][0]);
      dst[1] = dp_f32_to_bf16(acc[t][1]);
    }
  }
  if (b % kTiles == 0)  // q_pe rides along unchanged
    for (int e = tid; e < T * R; e += DP_MLA_THREADS) {
      const int t = e / R, k = e % R;
      q_abs[((dp_u64)t * N + n) * (L + R) + L + k] = q[(dp_u64)t * stride_q + n * (PN + R) + PN + k];
    }
}

// ---------------------------------------------------------------------------------------------------
// Split-KV attention. Launch: grid (N/HB, NS, W) blocks of 256 threads. A block holds Q*HB (row, head)
// pairs, one per 32-lane group (HB = heads per block), and walks its slice of the request's tokens in
// tiles of 32 cache rows staged in shared memory: lane l of a group scores token l of the tile for its
// pair, the group keeps a running max and sum (online softmax) and accumulates the unnormalised
// o_lat, 16 latent columns per lane (columns 2*lane + 64*k, k < 8: consecutive lanes read consecutive
// shared-memory words, no bank conflicts; cache rows are padded by one word for the same reason).
template <int W, int Q, int N, int L, int R, int BS, int NS, int HB>
__device__ __forceinline__ void dp_mla_attn(const dp_bf16* __restrict__ q_abs,       // [W*Q, N, L+R] bf16
                                            const dp_bf16* __restrict__ cache,       // [blocks, cache_stride] bf16
                                            const dp_i32* __restrict__ block_table,  // [W, stride_bt] i32
                                            dp_u32 stride_bt,
                                            const dp_i32* __restrict__ seq_lens,     // [W] i32
                                            float* __restrict__ part_o,              // [W, NS, Q, N, L] fp32
                                            float* __restrict__ part_ml,             // [W, NS, Q, N, 2] fp32
                                            float scale,                             // (PN+R)^-1/2
                                            dp_u32 cache_stride) {                   // elements between blocks
  constexpr int kRowWords = (L + R) / 2;       // 32-bit words of a cache row
  constexpr int kStride = kRowWords + 1;       // padded shared-memory row
  constexpr int kPairs = Q * HB;
  constexpr int kColWords = L / 2 / DP_GROUP;  // latent words per lane (8 for L = 512)
  static_assert(kPairs <= DP_MLA_THREADS / DP_GROUP, "mla_attn: Q * heads per block must be at most 8");
  static_assert((L + R) % 8 == 0 && L % 64 == 0 && N % HB == 0, "mla_attn: shapes");
  __shared__ dp_u32 tile[DP_MLA_TILE * kStride];  // [32, (L+R)/2 + 1] bf16 pairs of cache rows
  __shared__ dp_u32 qs[kPairs * kRowWords];       // [pairs, (L+R)/2] bf16 pairs of q_abs

  const int r = (int)blockIdx.z, split = (int)blockIdx.y, h0 = (int)blockIdx.x * HB;
  const int tid = (int)threadIdx.x, pair = tid / DP_GROUP, lane = tid % DP_GROUP;
  const int i = pair / HB, n = h0 + pair % HB;  // this group's (draft position, head)
  const bool active = pair < kPairs;
  const int len = seq_lens[r];
  const int chunk = (len + NS - 1) / NS;
  const int begin = split * chunk;
  const int end = begin + chunk < len ? begin + chunk : len;
  const int last = len - Q + i;  // the last position this row attends

  for (int e = tid; e < kPairs * kRowWords; e += DP_MLA_THREADS) {
    const int p = e / kRowWords, w = e % kRowWords;
    const int row = r * Q + p / HB, head = h0 + p % HB;
    qs[e] = ((const dp_u32*)(q_abs + ((dp_u64)row * N + head) * (L + R)))[w];
  }
  const float neg_inf = dp_bits_to_f32(0xff800000u);
  float m_run = neg_inf, l_run = 0.0f;
  float acc[kColWords][2];  // [8, 2] fp32: columns 2*(lane + 32k) + {0, 1}
#pragma unroll
  for (int k = 0; k < kColWords; ++k) acc[k][0] = acc[k][1] = 0.0f;

  for (int p0 = begin; p0 < end; p0 += DP_MLA_TILE) {
    const int ntok = end - p0 < DP_MLA_TILE ? end - p0 : DP_MLA_TILE;
    __syncthreads();  // the previous tile (and, first time, nothing) is no longer read
    for (int e = tid; e < ntok * (kRowWords / 4); e += DP_MLA_THREADS) {
      const int tok = e / (kRowWords / 4), v = e % (kRowWords / 4);
      const int pos = p0 + tok;
      const dp_i32 block = block_table[(dp_u64)r * stride_bt + pos / BS];
      const dp_u32x4 x =
          dp_load16(cache + (dp_u64)block * cache_stride + (dp_u64)((pos % BS) * (L + R) + 8 * v));
      dp_u32* dst = tile + tok * kStride + 4 * v;
      dst[0] = x.x;
      dst[1] = x.y;
      dst[2] = x.z;
      dst[3] = x.w;
    }
    __syncthreads();
    if (active) {
      // Score of token lane for this pair.
      float s = neg_inf;
      const int pos = p0 + lane;
      if (lane < ntok && pos <= last) {
        const dp_u32* qrow = qs + pair * kRowWords;
        const dp_u32* crow = tile + lane * kStride;
        float dot = 0.0f;
#pragma unroll 8
        for (int w = 0; w < kRowWords; ++w) {
          const dp_u32 a = qrow[w], c = crow[w];
          dot += dp_bits_to_f32(a << 16) * dp_bits_to_f32(c << 16) +
                 dp_bits_to_f32(a & 0xffff0000u) * dp_bits_to_f32(c & 0xffff0000u);
        }
        s = dot * scale;
      }
      float m_tile = s;
#pragma unroll
      for (int d = DP_GROUP / 2; d > 0; d >>= 1) {
        const float o = dp_shfl_xor(m_tile, d);
        m_tile = o > m_tile ? o : m_tile;
      }
      if (m_tile != neg_inf) {  // uniform over the group
        const float m_new = m_tile > m_run ? m_tile : m_run;
        const float alpha = m_run == neg_inf ? 0.0f : dp_expf(m_run - m_new);
        const float prob = s == neg_inf ? 0.0f : dp_expf(s - m_new);
        l_run = l_run * alpha + dp_group_sum(prob);
        m_run = m_new;
#pragma unroll
        for (int k = 0; k < kColWords; ++k) {
          acc[k][0] *= alpha;
          acc[k][1] *= alpha;
        }
        for (int tok = 0; tok < ntok; ++tok) {
          const float pt = dp_bits_to_f32(dp_shfl_group32(dp_f32_to_bits(prob), (dp_u32)tok));
          const dp_u32* crow = tile + tok * kStride;
#pragma unroll
          for (int k = 0; k < kColWords; ++k) {
            const dp_u32 c = crow[lane + DP_GROUP * k];
            acc[k][0] += pt * dp_bits_to_f32(c << 16);
            acc[k][1] += pt * dp_bits_to_f32(c & 0xffff0000u);
          }
        }
      }
    }
  }
  if (!active) return;
  const dp_u64 pidx = (((dp_u64)r * NS + split) * Q + i) * N + n;  // (r, split, i, n)
  float* po = part_o + pidx * L;
  if (m_run != neg_inf) {
#pragma unroll
    for (int k = 0; k < kColWords; ++k) {
      po[2 * (lane + DP_GROUP * k)] = acc[k][0];
      po[2 * (lane + DP_GROUP * k) + 1] = acc[k][1];
    }
  }
  if (lane == 0) {
    part_ml[2 * pidx] = m_run;  // -inf: this split saw no token of the row (its o is not written)
    part_ml[2 * pidx + 1] = l_run;
  }
}

// ---------------------------------------------------------------------------------------------------
// Merge + W_UV (+ K3 output gate). Launch: grid N blocks of 256 threads, one per head; rows in chunks
// of 8. o_lat = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s, rounded to bf16 (vLLM's attention output),
// then o[v] = o_lat . W_UV[n][:, v], rounded to bf16, times sigmoid(gate) when kGate.
template <int W, int Q, int N, int L, int PN, int V, int NS, int kGate>
__device__ __forceinline__ void dp_mla_combine(const float* __restrict__ part_o,     // [W, NS, Q, N, L] fp32
                                               const float* __restrict__ part_ml,    // [W, NS, Q, N, 2] fp32
                                               const dp_i32* __restrict__ seq_lens,  // [W] i32
                                               const dp_bf16* __restrict__ kv_b,     // [N*(PN+V), L] bf16
                                               const dp_bf16* __restrict__ gate,     // [T, stride_g] bf16, K3
                                               dp_u32 stride_g,
                                               dp_bf16* __restrict__ out) {          // [T, N*V] bf16
  constexpr int T = W * Q;
  constexpr int kChunk = 8;
  constexpr int kGroups = DP_MLA_THREADS / DP_GROUP;
  constexpr int kVecs = L / 8;
  constexpr int kIters = (kVecs + DP_GROUP - 1) / DP_GROUP;
  static_assert(L % 8 == 0, "mla_combine: L multiple of 8");
  __shared__ float olat[kChunk * L];  // [8, L] fp32 (bf16 values)
  __shared__ float wgt[kChunk * NS];  // [8, NS] merge weights e^(m_s - M) / sum
  const int n = (int)blockIdx.x, tid = (int)threadIdx.x, group = tid / DP_GROUP, lane = tid % DP_GROUP;
  const float neg_inf = dp_bits_to_f32(0xff800000u);

  for (int t0 = 0; t0 < T; t0 += kChunk) {
    const int rows = T - t0 < kChunk ? T - t0 : kChunk;
    __syncthreads();
    if (tid < rows) {
      const int t = t0 + tid, r = t / Q, i = t % Q;
      float mx = neg_inf;
      for (int s = 0; s < NS; ++s) {
        const float m = part_ml[2 * ((((dp_u64)r * NS + s) * Q + i) * N + n)];
        mx = m > mx ? m : mx;
      }
      float sum = 0.0f;
      for (int s = 0; s < NS; ++s) {
        const dp_u64 p = (((dp_u64)r * NS + s) * Q + i) * N + n;
        const float m = part_ml[2 * p];
        const float w = m == neg_inf ? 0.0f : dp_expf(m - mx);
        wgt[tid * NS + s] = w;
        sum += w * part_ml[2 * p + 1];
      }
      const float inv = (seq_lens[r] == 0 || mx == neg_inf) ? 0.0f : dp_div(1.0f, sum);
      for (int s = 0; s < NS; ++s) wgt[tid * NS + s] *= inv;
    }
    __syncthreads();
    for (int e = tid; e < rows * L; e += DP_MLA_THREADS) {
      const int tt = e / L, l = e % L, t = t0 + tt, r = t / Q, i = t % Q;
      float o = 0.0f;
      for (int s = 0; s < NS; ++s) {
        const float w = wgt[tt * NS + s];
        if (w != 0.0f) o += w * part_o[((((dp_u64)r * NS + s) * Q + i) * N + n) * L + l];
      }
      olat[e] = dp_round_bf16(o);
    }
    __syncthreads();
    // o[v] = o_lat . kv_b[n*(PN+V) + PN + v, :]: group g takes v = g, g+8, ...
    for (int v = group; v < V; v += kGroups) {
      const dp_bf16* wrow = kv_b + ((dp_u64)n * (PN + V) + PN + v) * L;
      float acc[kChunk];
#pragma unroll
      for (int tt = 0; tt < kChunk; ++tt) acc[tt] = 0.0f;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int vec = lane + DP_GROUP * it;
        if (vec < kVecs) {
          float wf[8];
          dp_unpack8_bf16(dp_load16(wrow + 8 * vec), wf);
#pragma unroll
          for (int tt = 0; tt < kChunk; ++tt)
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[tt] += wf[k] * olat[tt * L + 8 * vec + k];
        }
      }
#pragma unroll
      for (int tt = 0; tt < kChunk; ++tt) acc[tt] = dp_group_sum(acc[tt]);
      if (lane < rows) {
#pragma unroll
        for (int tt = 0; tt < kChunk; ++tt) {
          if (tt != lane) continue;
          const int t = t0 + tt;
          float o = dp_round_bf16(acc[tt]);
          if (kGate) o *= dp_sigmoid(dp_bf16_to_f32(gate[(dp_u64)t * stride_g + n * V + v]));
          if (seq_lens[t / Q] == 0) o = 0.0f;
          out[(dp_u64)t * (N * V) + n * V + v] = dp_f32_to_bf16(o);
        }
      }
    }
  }
}
