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

// ---------------------------------------------------------------------------------------------------
// Launch: grid T + N*ceil(L/128) blocks of 256: blocks [0, T) normalise and write one row's latent,
// the rest compute one head's q_lat over 128 latent columns (16 per group) for all rows.
template <int T, int Q, int N, int L, int R, int PN, int V, int BS, int kQ8 = 0>
__device__ __forceinline__ void dp_mla_prep(const dp_bf16* __restrict__ q,             // [T, stride_q] bf16
                                            dp_u32 stride_q,
                                            const dp_bf16* __restrict__ kv,            // [T, stride_kv] bf16
                                            dp_u32 stride_kv,
                                            const dp_bf16* __restrict__ kv_norm_w,     // [L] bf16
                                            const void* kv_b,  // [N*(PN+V), L] bf16 (e4m3 if kQ8)
                                            const dp_i32* __restrict__ seq_lens,       // [W] i32
                                            const dp_i64* __restrict__ slot_mapping,   // [T] i64
                                            dp_bf16* cache,                            // [blocks, cache_stride] bf16
                                            dp_bf16* __restrict__ q_abs,               // [T, N, L+R] bf16
                                            float eps,
                                            dp_u32 cache_stride,    // elements between cache blocks
                                            const float* kv_b_scale = nullptr) {  // kQ8: [ceil(N*(PN+V)/128), ceil(L/128)]
  static_assert(L % 64 == 0 && R % 2 == 0 && PN % 8 == 0, "mla_prep: L multiple of 64, even R");
  static_assert(BS >= 1, "mla_prep: cache block size");
  constexpr int kCols = 4 * DP_GROUP;  // latent columns per absorb block (128)
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
  // ---- absorbed query of head n, latent columns [kCols*tile, +kCols) ----
  // Lane l of every group owns the 4 columns col0 + 4l .. +3 (a group reads whole 128- or 256-byte
  // row segments) and group g takes rows j of W_UK_T[n] in [kJPer*g, +kJPer), all its loads at once;
  // each lane sums over its rows for every query row, and the groups' partial sums meet in shared
  // memory, kRedRows query rows at a time. No cross-lane reduction.
  b -= T;
  constexpr int kGroups = DP_MLA_THREADS / DP_GROUP;
  constexpr int kTiles = (L + kCols - 1) / kCols;
  constexpr int kCPL = kCols / DP_GROUP;                 // columns per lane (4)
  constexpr int kJPer = (PN + kGroups - 1) / kGroups;    // W_UK_T rows per group
  constexpr int kRedRows = T < 4 ? T : 4;                // query rows per shared-memory reduction
  static_assert(kCPL == 4, "mla_prep: 4 columns a lane");
  const int n = b / kTiles, group = tid / DP_GROUP, lane = tid % DP_GROUP;
  const int col0 = (b % kTiles) * kCols;
  const int col = col0 + kCPL * lane;                    // this lane's first column
  __shared__ float qn[T * PN];                           // [T, PN] fp32 q_nope of head n
  __shared__ float red[kGroups * kRedRows * kCols];      // [groups, rows, kCols] fp32 partial sums
  for (int e = tid; e < T * PN; e += DP_MLA_THREADS) {
    const int t = e / PN, j = e % PN;
    qn[e] = dp_bf16_to_f32(q[(dp_u64)t * stride_q + n * (PN + R) + j]);
  }
  const bool cols_in = col < L;  // L is a multiple of 64: a lane's 4 columns are all in or all out
  dp_u32 wv[kJPer][2];           // row j = kJPer*group + i, columns col .. col+3 (e4m3: one word)
  float wsc[kJPer];              // e4m3: the block scale of each row's columns
#pragma unroll
  for (int i = 0; i < kJPer; ++i) {
    const int j = kJPer * group + i;
    const dp_u64 row = (dp_u64)n * (PN + V) + j;  // W_UK_T[n][j], row stride L
    wv[i][0] = wv[i][1] = 0u;
    wsc[i] = 0.0f;
    if (cols_in && j < PN) {
      if constexpr (kQ8 != 0) {
        wv[i][0] = *(const dp_u32*)((const dp_u8*)kv_b + row * L + col);
        wsc[i] = kv_b_scale[(row / 128) * ((L + 127) / 128) + col / 128];
      } else {
        const dp_u32* w = (const dp_u32*)((const dp_bf16*)kv_b + row * L + col);
        wv[i][0] = w[0];
        wv[i][1] = w[1];
      }
    }
  }
  __syncthreads();  // qn
  for (int t0 = 0; t0 < T; t0 += kRedRows) {
    float acc[kRedRows][kCPL];  // [rows, 4] fp32 sums over this group's rows
#pragma unroll
    for (int tt = 0; tt < kRedRows; ++tt)
#pragma unroll
      for (int c = 0; c < kCPL; ++c) acc[tt][c] = 0.0f;
#pragma unroll
    for (int i = 0; i < kJPer; ++i) {
      const int j = kJPer * group + i;
      if (j >= PN) continue;
      float wf[kCPL];
      if constexpr (kQ8 != 0) {
        dp_e4m3x4_to_f32(wv[i][0], wf);
      } else {
        wf[0] = dp_bits_to_f32(wv[i][0] << 16);
        wf[1] = dp_bits_to_f32(wv[i][0] & 0xffff0000u);
        wf[2] = dp_bits_to_f32(wv[i][1] << 16);
        wf[3] = dp_bits_to_f32(wv[i][1] & 0xffff0000u);
      }
#pragma unroll
      for (int tt = 0; tt < kRedRows; ++tt) {
        float qv = t0 + tt < T ? qn[(t0 + tt) * PN + j] : 0.0f;
        if constexpr (kQ8 != 0) qv *= wsc[i];  // the block scale of these weights
#pragma unroll
        for (int c = 0; c < kCPL; ++c) acc[tt][c] += qv * wf[c];
      }
    }
    if (t0 > 0) __syncthreads();  // the previous rows' partials are read
#pragma unroll
    for (int tt = 0; tt < kRedRows; ++tt)
#pragma unroll
      for (int c = 0; c < kCPL; ++c) red[(group * kRedRows + tt) * kCols + kCPL * lane + c] = acc[tt][c];
    __syncthreads();
    for (int e = tid; e < kRedRows * kCols; e += DP_MLA_THREADS) {
      const int tt = e / kCols, c = e % kCols, t = t0 + tt;
      if (t >= T || col0 + c >= L) continue;
      float sum = 0.0f;
#pragma unroll
      for (int g = 0; g < kGroups; ++g) sum += red[(g * kRedRows + tt) * kCols + c];
      q_abs[((dp_u64)t * N + n) * (L + R) + col0 + c] = dp_f32_to_bf16(sum);
    }
  }
  if (b % kTiles == 0)  // q_pe rides along unchanged
    for (int e = tid; e < T * R; e += DP_MLA_THREADS) {
      const int t = e / R, k = e % R;
      q_abs[((dp_u64)t * N + n) * (L + R) + L + k] = q[(dp_u64)t * stride_q + n * (PN + R) + PN + k];
    }
}

// ---------------------------------------------------------------------------------------------------
// Split-KV attention. Launch: grid (ceil(Q*N/16), NS, W) blocks of 256 threads. Block (rb, split, r)
// takes the 16 query rows rho = 16*rb .. 16*rb+15 of request r (rho = i*N + n: draft position i, head
// n; rows past Q*N are empty) and one of NS slices of the request's tokens, walked in tiles of 16 cache
// rows staged in shared memory with an online softmax, and leaves (max, sum, unnormalised o_lat)
// partials per row.
#define DP_MLA_ROWS 16   // query rows (draft position, head) per block
#define DP_MLA_TILE 16   // cache rows per attention tile

#if DP_VENDOR_NVIDIA
// Four 8x8 bf16 matrices from shared memory, transposed (the B operand of a 16x8x16 step from
// row-major K x N data). Lane i gives the address of row i%8 of matrix i/8.
__device__ __forceinline__ void dp_ldmatrix_x4_trans(dp_u32 (&r)[4], const void* smem_row) {
  const unsigned a = (unsigned)__cvta_generic_to_shared(smem_row);
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(a));
}

__device__ __forceinline__ dp_u32 dp_pack2_bf16(float lo, float hi) {
  return (dp_u32)dp_f32_to_bf16(lo).bits | ((dp_u32)dp_f32_to_bf16(hi).bits << 16);
}
#endif

template <int W, int Q, int N, int L, int R, int BS, int NS, int TS = 0>
__device__ __forceinline__ void dp_mla_attn(const dp_bf16* __restrict__ q_abs,       // [W*Q, N, L+R] bf16
                                            const dp_bf16* __restrict__ cache,       // [blocks, cache_stride] bf16
                                            const dp_i32* __restrict__ block_table,  // [W, stride_bt] i32
                                            dp_u32 stride_bt,
                                            const dp_i32* __restrict__ seq_lens,     // [W] i32
                                            float* __restrict__ part_o,              // [W, NS, Q, N, L] fp32
                                            float* __restrict__ part_ml,             // [W, NS, Q, N, 2] fp32
                                            float scale,                             // (PN+R)^-1/2
                                            dp_u32 cache_stride) {                   // elements between blocks
  constexpr int KR = L + R;  // values of a cache row
  static_assert(KR % 16 == 0 && L % 64 == 0, "mla_attn: L a multiple of 64, L + R of 16");
  const int r = (int)blockIdx.z, split = (int)blockIdx.y, rho0 = (int)blockIdx.x * DP_MLA_ROWS;
  const int tid = (int)threadIdx.x, warp = tid / DP_GROUP, lane = tid % DP_GROUP;
  const int len = seq_lens[r];
#if DP_VENDOR_NVIDIA
  const int chunk = ((len + NS - 1) / NS + DP_MLA_TILE - 1) / DP_MLA_TILE * DP_MLA_TILE;  // whole tiles
#else
  const int chunk = (len + NS - 1) / NS;
#endif
  const int begin = split * chunk < len ? split * chunk : len;
  const int end = begin + chunk < len ? begin + chunk : len;
  const float neg_inf = dp_bits_to_f32(0xff800000u);
#if DP_VENDOR_NVIDIA
  // Tensor cores: S = Q_abs C^T (16 rows x 16 tokens, K = L+R split over four warps' K-quarters and
  // two token halves), softmax per row, O += P C (each warp owns L/8 latent columns of all 16 rows).
  constexpr int kStride = KR + 8;         // bf16 per staged cache row (16-byte rows, no bank conflicts)
  constexpr int kSteps = KR / 16;         // 16-deep steps over a cache row
  constexpr int kQSteps = (kSteps + 3) / 4;  // steps per K-quarter
  constexpr int kCols = L / 8;            // latent columns per warp in P C
  constexpr int kNT = kCols / 8;          // 8-column tiles per warp
  constexpr int kPStride = 24;            // bf16 per P row (conflict-free fragment reads)
  // Staged cache rows, [kBufs, 16, L+R+8] bf16: two buffers in static shared memory (TS = 0), or TS in
  // the launch's dynamic shared memory (TS x 16 x (L+R+8) x 2 bytes), so that TS - 1 tiles are in flight
  // while one is computed.
  constexpr int kBufs = TS > 0 ? TS : 2;
  static_assert(TS == 0 || TS >= 2, "mla_attn: TS is 0 (two static buffers) or at least 2");
  __shared__ __align__(16) dp_bf16 tiles_static[2][DP_MLA_TILE * kStride];  // TS = 0 only (else unreferenced)
  dp_bf16 (*tiles)[DP_MLA_TILE * kStride];
  if constexpr (TS == 0) {
    tiles = tiles_static;
  } else {
    extern __shared__ __align__(16) dp_bf16 dp_mla_tiles_dynamic[];
    tiles = reinterpret_cast<dp_bf16 (*)[DP_MLA_TILE * kStride]>(dp_mla_tiles_dynamic);
  }
  __shared__ float sred[4 * DP_MLA_ROWS * DP_MLA_TILE];          // [4, 16, 16] fp32 score partials
  __shared__ __align__(16) dp_bf16 ps[DP_MLA_ROWS * kPStride];   // [16, 24] bf16 probabilities
  __shared__ float alpha_s[DP_MLA_ROWS];                         // [16] rescale of each row's o this tile
  const int g = lane / 4, qd = lane % 4;
  const int kq = warp % 4, nh = warp / 4;  // scores: K-quarter and token half of this warp

  // This warp's A fragments (query rows g, g+8) over its K-quarter, kept for the whole token walk.
  dp_u32 qa[kQSteps][4];
#pragma unroll
  for (int k = 0; k < kQSteps; ++k) {
    const int ks = kq * kQSteps + k;
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      const int rho = rho0 + g + 8 * (h % 2);
      const int col = 16 * ks + 2 * qd + 8 * (h / 2);
      dp_u32 v = 0u;
      if (ks < kSteps && rho < Q * N) {
        const int i = rho / N, n = rho % N;
        v = *(const dp_u32*)(q_abs + ((dp_u64)(r * Q + i) * N + n) * KR + col);
      }
      qa[k][h] = v;
    }
  }
  // Online-softmax state of row sr = tid / 16 (every thread of the row keeps the same copy).
  const int sr = tid / DP_MLA_TILE, st = tid % DP_MLA_TILE;
  const int srho = rho0 + sr;
  const int slast = len - Q + (srho / N);  // the last position row sr attends
  float m_run = neg_inf, l_run = 0.0f;
  float acc[kNT][4];  // o fragments: rows g, g+8; columns warp*kCols + 8*nt + 2*qd (+1)
#pragma unroll
  for (int nt = 0; nt < kNT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.0f;

  // The cache rows go to shared memory by cp.async into kBufs buffers: the next kBufs - 1 tiles are in
  // flight while this one is computed. Splits start at multiples of the tile (chunk above), so with BS a multiple
  // of 16 a tile lies in one cache block: one block-table entry, and every thread copies the same
  // 16-byte pieces of each tile (tokens past the slice are zero-filled: 0 * p stays 0 in P C).
  static_assert(BS % DP_MLA_TILE == 0, "mla_attn: the cache block size must be a multiple of 16");
  constexpr int kPieces = DP_MLA_TILE * (KR / 8);  // 16-byte pieces of a tile
  constexpr int kLoads = (kPieces + DP_MLA_THREADS - 1) / DP_MLA_THREADS;
  auto issue_tile = [&](int p0, int buf) {
    const dp_i32 block = block_table[(dp_u64)r * stride_bt + p0 / BS];
    const dp_bf16* src = cache + (dp_u64)block * cache_stride + (dp_u64)((p0 % BS) * KR);
#pragma unroll
    for (int k = 0; k < kLoads; ++k) {
      const int e = tid + DP_MLA_THREADS * k;
      const int tok = e / (KR / 8), v = e % (KR / 8);
      if (e < kPieces) {
        const unsigned dst = (unsigned)__cvta_generic_to_shared(tiles[buf] + tok * kStride + 8 * v);
        const unsigned bytes = p0 + tok < end ? 16u : 0u;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src + tok * KR + 8 * v),
                     "r"(bytes));
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  // Every iteration commits exactly one group (empty past the slice's end), so when tile i is waited for,
  // the kBufs - 2 groups after it may still be in flight.
  if constexpr (TS == 0) {
    if (begin < end) issue_tile(begin, 0);
  } else {
#pragma unroll
    for (int s = 0; s < kBufs - 1; ++s) {
      if (begin + DP_MLA_TILE * s < end) issue_tile(begin + DP_MLA_TILE * s, s);
      else asm volatile("cp.async.commit_group;");
    }
  }
  int buf = 0;
  for (int p0 = begin; p0 < end; p0 += DP_MLA_TILE, buf = kBufs == 2 ? buf ^ 1 : (buf + 1 == kBufs ? 0 : buf + 1)) {
    const int ntok = end - p0 < DP_MLA_TILE ? end - p0 : DP_MLA_TILE;
    const dp_bf16* tile = tiles[buf];
    asm volatile("cp.async.wait_group %0;" ::"n"(kBufs - 2) : "memory");  // this thread's pieces of this tile landed
    __syncthreads();  // every piece is visible, and the tile before it (its buffer is refilled next) is no longer read
    if constexpr (TS == 0) {
      if (p0 + DP_MLA_TILE < end) issue_tile(p0 + DP_MLA_TILE, buf ^ 1);
    } else {
      const int ahead = p0 + DP_MLA_TILE * (kBufs - 1);
      const int into = buf == 0 ? kBufs - 1 : buf - 1;  // (buf + kBufs - 1) % kBufs: the tile before's buffer
      if (ahead < end) issue_tile(ahead, into);
      else asm volatile("cp.async.commit_group;");
    }
    {  // partial scores of rows g, g+8 x tokens 8*nh + 2*qd (+1) over this warp's K-quarter
      float sc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
      const dp_bf16* crow = tile + (8 * nh + g) * kStride + 2 * qd;
#pragma unroll
      for (int k = 0; k < kQSteps; ++k) {
        const int ks = kq * kQSteps + k;
        if (ks < kSteps) {
          const dp_u32 b0 = *(const dp_u32*)(crow + 16 * ks);
          const dp_u32 b1 = *(const dp_u32*)(crow + 16 * ks + 8);
          dp_mma_16816(sc, qa[k][0], qa[k][1], qa[k][2], qa[k][3], b0, b1);
        }
      }
#pragma unroll
      for (int h = 0; h < 4; ++h)
        sred[(kq * DP_MLA_ROWS + g + 8 * (h / 2)) * DP_MLA_TILE + 8 * nh + 2 * qd + (h % 2)] = sc[h];
    }
    __syncthreads();
    {  // softmax of row sr, token st (16 threads a row, within one warp)
      float s = neg_inf;
      if (st < ntok && p0 + st <= slast && srho < Q * N) {
        float d = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) d += sred[(k * DP_MLA_ROWS + sr) * DP_MLA_TILE + st];
        s = d * scale;
      }
      float m_tile = s;
#pragma unroll
      for (int d = DP_MLA_TILE / 2; d > 0; d >>= 1) {
        const float o = dp_shfl_xor(m_tile, d);
        m_tile = o > m_tile ? o : m_tile;
      }
      // m_tile is uniform over the row's 16 threads (but not over the warp's two rows: the shuffles
      // stay outside the branch).
      const bool any = m_tile != neg_inf;
      const float m_new = any && m_tile > m_run ? m_tile : m_run;
      const float alpha = !any ? 1.0f : m_run == neg_inf ? 0.0f : dp_expf(m_run - m_new);
      const float prob = !any || s == neg_inf ? 0.0f : dp_expf(s - m_new);
      float psum = prob;
#pragma unroll
      for (int d = DP_MLA_TILE / 2; d > 0; d >>= 1) psum += dp_shfl_xor(psum, d);
      if (any) {
        l_run = l_run * alpha + psum;
        m_run = m_new;
      }
      ps[sr * kPStride + st] = dp_f32_to_bf16(prob);
      if (st == 0) alpha_s[sr] = alpha;
    }
    __syncthreads();
    {  // O = alpha O + P C over this warp's columns
      const float a_lo = alpha_s[g], a_hi = alpha_s[g + 8];
#pragma unroll
      for (int nt = 0; nt < kNT; ++nt) {
        acc[nt][0] *= a_lo;
        acc[nt][1] *= a_lo;
        acc[nt][2] *= a_hi;
        acc[nt][3] *= a_hi;
      }
      const dp_u32 pa0 = *(const dp_u32*)(ps + g * kPStride + 2 * qd);
      const dp_u32 pa1 = *(const dp_u32*)(ps + (g + 8) * kPStride + 2 * qd);
      const dp_u32 pa2 = *(const dp_u32*)(ps + g * kPStride + 8 + 2 * qd);
      const dp_u32 pa3 = *(const dp_u32*)(ps + (g + 8) * kPStride + 8 + 2 * qd);
      const int mi = lane / 8, ri = lane % 8;
#pragma unroll
      for (int nt = 0; nt < kNT; nt += 2) {
        const int c = warp * kCols + 8 * nt;
        dp_u32 bm[4];
        dp_ldmatrix_x4_trans(bm, tile + ((mi % 2) * 8 + ri) * kStride + c + (mi / 2) * 8);
        dp_mma_16816(acc[nt], pa0, pa1, pa2, pa3, bm[0], bm[1]);
        if (nt + 1 < kNT) dp_mma_16816(acc[nt + 1], pa0, pa1, pa2, pa3, bm[2], bm[3]);
      }
    }
  }
  // Row stats live in the softmax threads; alpha_s carries nothing further. Write the partials.
  if (st == 0 && srho < Q * N) {
    const int i = srho / N, n = srho % N;
    const dp_u64 pidx = (((dp_u64)r * NS + split) * Q + i) * N + n;
    part_ml[2 * pidx] = m_run;  // -inf: this split saw no token of the row (its o is not read)
    part_ml[2 * pidx + 1] = l_run;
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int rho = rho0 + g + 8 * h;
    if (rho >= Q * N) continue;
    const int i = rho / N, n = rho % N;
    float* po = part_o + ((((dp_u64)r * NS + split) * Q + i) * N + n) * L + warp * kCols + 2 * qd;
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      po[8 * nt] = acc[nt][2 * h];
      po[8 * nt + 1] = acc[nt][2 * h + 1];
    }
  }
#else
  // Lane FMAs, two passes of 8 rows (one per 32-lane group): lane l scores token l of a 32-row tile;
  // the group keeps a running max and sum and the unnormalised o_lat, 16 latent columns per lane
  // (columns 2*lane + 64*k, k < 8; cache rows padded by one word against bank conflicts).
  constexpr int kRowWords = KR / 2;            // 32-bit words of a cache row
  constexpr int kStride = kRowWords + 1;       // padded shared-memory row
  constexpr int kTile = 32;                    // cache rows per tile (one per lane)
  constexpr int kPairs = DP_MLA_THREADS / DP_GROUP;
  constexpr int kColWords = L / 2 / DP_GROUP;  // latent words per lane (8 for L = 512)
  __shared__ dp_u32 tile[kTile * kStride];     // [32, (L+R)/2 + 1] bf16 pairs of cache rows
  __shared__ dp_u32 qs[kPairs * kRowWords];    // [8, (L+R)/2] bf16 pairs of q_abs
  const int pair = warp;
  for (int pass = 0; pass < DP_MLA_ROWS / kPairs; ++pass) {
    const int rho = rho0 + pass * kPairs + pair;
    const bool active = rho < Q * N;
    const int i = active ? rho / N : 0, n = active ? rho % N : 0;
    const int last = len - Q + i;  // the last position this row attends
    __syncthreads();  // the previous pass no longer reads qs
    for (int e = tid; e < kPairs * kRowWords; e += DP_MLA_THREADS) {
      const int p = e / kRowWords, w = e % kRowWords;
      const int prho = rho0 + pass * kPairs + p;
      dp_u32 v = 0u;
      if (prho < Q * N)
        v = ((const dp_u32*)(q_abs + ((dp_u64)(r * Q + prho / N) * N + prho % N) * KR))[w];
      qs[e] = v;
    }
    float m_run = neg_inf, l_run = 0.0f;
    float acc[kColWords][2];  // [8, 2] fp32: columns 2*(lane + 32k) + {0, 1}
#pragma unroll
    for (int k = 0; k < kColWords; ++k) acc[k][0] = acc[k][1] = 0.0f;
    for (int p0 = begin; p0 < end; p0 += kTile) {
      const int ntok = end - p0 < kTile ? end - p0 : kTile;
      __syncthreads();  // the previous tile (and, first time, nothing) is no longer read
      for (int e = tid; e < ntok * (kRowWords / 4); e += DP_MLA_THREADS) {
        const int tok = e / (kRowWords / 4), v = e % (kRowWords / 4);
        const int pos = p0 + tok;
        const dp_i32 block = block_table[(dp_u64)r * stride_bt + pos / BS];
        const dp_u32x4 x = dp_load16(cache + (dp_u64)block * cache_stride + (dp_u64)((pos % BS) * KR + 8 * v));
        dp_u32* dst = tile + tok * kStride + 4 * v;
        dst[0] = x.x;
        dst[1] = x.y;
        dst[2] = x.z;
        dst[3] = x.w;
      }
      __syncthreads();
      if (active) {
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
    if (active) {
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
  }
#endif
}

// ---------------------------------------------------------------------------------------------------
// Merge + W_UV (+ K3 output gate). Launch: grid (N, ceil(V/VB)) blocks of 256 threads, VB = 32:
// block (n, vt) computes outputs v in [VB*vt, VB*vt + VB) of head n for every row. Every block of a
// head merges the head's splits itself (the partials are L2-resident; a few times the bytes of one
// merge) and issues all its W_UV loads before the merge. From 2 rows on NVIDIA the rows' merges run
// in one pass and W_UV is applied on the tensor cores (16-row tiles); with one row, and on AMD, each
// group owns VB/8 of the block's v and sums o_lat . W_UV with lane FMAs, rows in chunks of up to 8
// (measured on the H200, 48B shape: the tensor-core form 18.4 -> 11.2 us at 8 rows, 8.7 -> 9.4 us
// with one row).
// o_lat = sum_s e^(m_s - M) o_s / sum_s e^(m_s - M) l_s, rounded to bf16 (vLLM's attention output),
// then o[v] = o_lat . W_UV[n][:, v], rounded to bf16, times sigmoid(gate) when kGate.
template <int W, int Q, int N, int L, int PN, int V, int NS, int kGate, int kQ8 = 0>
__device__ __forceinline__ void dp_mla_combine(const float* __restrict__ part_o,     // [W, NS, Q, N, L] fp32
                                               const float* __restrict__ part_ml,    // [W, NS, Q, N, 2] fp32
                                               const dp_i32* __restrict__ seq_lens,  // [W] i32
                                               const void* kv_b,  // [N*(PN+V), L] bf16 (e4m3 if kQ8)
                                               const dp_bf16* __restrict__ gate,     // [T, stride_g] bf16, K3
                                               dp_u32 stride_g,
                                               dp_bf16* __restrict__ out,            // [T, N*V] bf16
                                               const float* kv_b_scale = nullptr) {  // kQ8: block scales of kv_b
#if DP_VENDOR_NVIDIA
  if constexpr (W * Q >= 2) {
    // Tensor cores for o_lat . W_UV: the block's 32 outputs v are 4 n-tiles of 8, its 8 warps 4 n-tiles
    // x 2 halves of L; A = the merged o_lat rows (bf16, a 16-row tile, rows past T zero), B = W_UV rows
    // as stored (L contiguous: one row is one B column). The merge is one pass over every row of the
    // tile: (row, 8 columns, group of splits) items over the threads.
    constexpr int T = W * Q;
    constexpr int kChunk = T < 16 ? T : 16;           // rows of a pass: one 16-row tile
    constexpr int kCG = L / 8;                        // 8-column groups of o_lat
    constexpr int kSG = kChunk * kCG >= DP_MLA_THREADS ? 1 : DP_MLA_THREADS / (kChunk * kCG);  // split groups
    constexpr int kOS = L + 8;                        // bf16 per staged o_lat row (conflict-free fragments)
    constexpr int kNT = 4;                            // n-tiles of 8 outputs: 32 per block
    constexpr int kKH = (DP_MLA_THREADS / 32) / kNT;  // halves of L
    constexpr int kKPer = L / 16 / kKH;               // 16-deep steps per warp
    static_assert(L % 256 == 0, "mla_combine: L a multiple of 256 (8-step scale blocks in each half)");
    __shared__ __align__(16) dp_bf16 olat[16 * kOS];  // [16, L+8] bf16 merged o_lat
    __shared__ float wgt[kChunk * NS];                // [chunk, NS] merge weights e^(m_s - M) / sum
    __shared__ float red[kSG > 1 ? kSG * kChunk * L : 1];  // [kSG, chunk, L] fp32 split-group sums
    __shared__ float cpart[kNT * 32 * 4];             // the second half's C fragments
    const int n = (int)blockIdx.x, tid = (int)threadIdx.x, warp = tid / 32, lane = tid % 32;
    const int g = lane / 4, qd = lane % 4, nt = warp % kNT, kh = warp / kNT;
    const int vb = (int)blockIdx.y * (8 * kNT) + 8 * nt;  // this warp's first output
    const float neg_inf = dp_bits_to_f32(0xff800000u);
    const dp_u64 row0 = (dp_u64)n * (PN + V) + PN;       // W_UV[n] row of v = 0
    constexpr int kLB = (L + 127) / 128;                 // scale blocks along L (e4m3)

    // This lane's B words (row v = vb + g, clamped), every step of its half, all in flight before the merge.
    const int vl = vb + g < V ? vb + g : V - 1;
    dp_u32 bw[kKPer][2];
#pragma unroll
    for (int k = 0; k < kKPer; ++k) {
      const int l = 16 * (kh * kKPer + k);
      if constexpr (kQ8 != 0) {
        bw[k][0] = *(const dp_u32*)((const dp_u8*)kv_b + (row0 + vl) * L + l + 4 * qd);
        bw[k][1] = 0u;
      } else {
        const dp_bf16* w = (const dp_bf16*)kv_b + (row0 + vl) * L + l + 2 * qd;
        bw[k][0] = *(const dp_u32*)w;
        bw[k][1] = *(const dp_u32*)(w + 8);
      }
    }
    for (int e = tid; e < (16 - kChunk) * kOS; e += DP_MLA_THREADS) olat[kChunk * kOS + e] = dp_f32_to_bf16(0.0f);

    for (int t0 = 0; t0 < T; t0 += kChunk) {
      const int rows = T - t0 < kChunk ? T - t0 : kChunk;
      __syncthreads();  // the previous pass no longer reads olat, wgt or cpart
      for (int tt = warp; tt < rows; tt += DP_MLA_THREADS / 32) {  // row t0 + tt's merge weights
        const int t = t0 + tt, r = t / Q, i = t % Q;
        const dp_u64 base = ((dp_u64)r * NS * Q + i) * N + n;  // (r, s = 0, i, n); split s adds s*Q*N
        float mx = neg_inf;
        for (int s = lane; s < NS; s += 32) {
          const float m = part_ml[2 * (base + (dp_u64)s * Q * N)];
          mx = m > mx ? m : mx;
        }
#pragma unroll
        for (int d = 16; d > 0; d >>= 1) {
          const float o = dp_shfl_xor(mx, d);
          mx = o > mx ? o : mx;
        }
        float sum = 0.0f;
        for (int s = lane; s < NS; s += 32) {
          const dp_u64 p = base + (dp_u64)s * Q * N;
          const float m = part_ml[2 * p];
          const float w = m == neg_inf ? 0.0f : dp_expf(m - mx);
          wgt[tt * NS + s] = w;
          sum += w * part_ml[2 * p + 1];
        }
        sum = dp_group_sum(sum);
        const float inv = (seq_lens[r] == 0 || mx == neg_inf) ? 0.0f : dp_div(1.0f, sum);
        for (int s = lane; s < NS; s += 32) wgt[tt * NS + s] *= inv;
      }
      __syncthreads();
      for (int it = tid; it < kSG * kChunk * kCG; it += DP_MLA_THREADS) {
        const int sg = it / (kChunk * kCG), tt = it % (kChunk * kCG) / kCG, cg = it % kCG;
        float o[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
        if (tt < rows) {
          const int t = t0 + tt, r = t / Q, i = t % Q;
#pragma unroll 4
          for (int s = sg; s < NS; s += kSG) {
            const float w = wgt[tt * NS + s];
            const float* po = part_o + ((((dp_u64)r * NS + s) * Q + i) * N + n) * L + 8 * cg;
            const dp_u32x4 a = dp_load16(po), c = dp_load16(po + 4);  // 8 fp32
            if (w != 0.0f) {  // a split that saw no token left its o unwritten
              o[0] += w * dp_bits_to_f32(a.x);
              o[1] += w * dp_bits_to_f32(a.y);
              o[2] += w * dp_bits_to_f32(a.z);
              o[3] += w * dp_bits_to_f32(a.w);
              o[4] += w * dp_bits_to_f32(c.x);
              o[5] += w * dp_bits_to_f32(c.y);
              o[6] += w * dp_bits_to_f32(c.z);
              o[7] += w * dp_bits_to_f32(c.w);
            }
          }
        }
        if constexpr (kSG == 1) {
          dp_store16(olat + tt * kOS + 8 * cg, dp_pack8_bf16(o));
        } else {
#pragma unroll
          for (int k = 0; k < 8; ++k) red[(sg * kChunk + tt) * L + 8 * cg + k] = o[k];
        }
      }
      if constexpr (kSG > 1) {
        __syncthreads();
        for (int e = tid; e < kChunk * L; e += DP_MLA_THREADS) {
          float o = 0.0f;
#pragma unroll
          for (int k = 0; k < kSG; ++k) o += red[k * kChunk * L + e];
          olat[(e / L) * kOS + e % L] = dp_f32_to_bf16(o);
        }
      }
      __syncthreads();

      // C = o_lat . W_UV over this warp's half of L (e4m3: each 128-column scale block summed apart and
      // scaled per output column).
      float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
      for (int kb = 0; kb < (kQ8 != 0 ? kKPer / 8 : 1); ++kb) {
        float part[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        constexpr int kSteps = kQ8 != 0 ? 8 : kKPer;
#pragma unroll
        for (int k8 = 0; k8 < kSteps; ++k8) {
          const int k = kb * 8 + k8, l = 16 * (kh * kKPer + k);
          const dp_bf16* a_lo = olat + g * kOS + l;
          const dp_bf16* a_hi = olat + (g + 8) * kOS + l;
          if constexpr (kQ8 != 0) {
            // Columns l + 4qd .. +3 as (0, 2) and (1, 3) pairs, the order dp_e4m3x4_to_bf16x4 gives.
            dp_u32 b0, b1, a0, a1, a2, a3;
            dp_e4m3x4_to_bf16x4(bw[k][0], b0, b1);
            dp_pair_even_odd(*(const dp_u32*)(a_lo + 4 * qd), *(const dp_u32*)(a_lo + 4 * qd + 2), a0, a2);
            dp_pair_even_odd(*(const dp_u32*)(a_hi + 4 * qd), *(const dp_u32*)(a_hi + 4 * qd + 2), a1, a3);
            dp_mma_16816(part, a0, a1, a2, a3, b0, b1);
          } else {
            dp_mma_16816(part, *(const dp_u32*)(a_lo + 2 * qd), *(const dp_u32*)(a_hi + 2 * qd),
                         *(const dp_u32*)(a_lo + 2 * qd + 8), *(const dp_u32*)(a_hi + 2 * qd + 8), bw[k][0], bw[k][1]);
          }
        }
        if constexpr (kQ8 != 0) {
          const int lb = (16 * (kh * kKPer + kb * 8)) / 128;
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int v = vb + 2 * qd + c < V ? vb + 2 * qd + c : V - 1;
            const float sc = kv_b_scale[((row0 + v) / 128) * kLB + lb];
            acc[c] += part[c] * sc;
            acc[c + 2] += part[c + 2] * sc;
          }
        } else {
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[c] = part[c];
        }
      }
      if (kh == 1) {
#pragma unroll
        for (int c = 0; c < 4; ++c) cpart[(nt * 32 + lane) * 4 + c] = acc[c];
      }
      __syncthreads();
      if (kh == 0) {
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int tt = g + 8 * (c / 2), v = vb + 2 * qd + c % 2, t = t0 + tt;
          if (tt >= rows || v >= V) continue;
          float o = dp_round_bf16(acc[c] + cpart[(nt * 32 + lane) * 4 + c]);
          if (kGate) o *= dp_sigmoid(dp_bf16_to_f32(gate[(dp_u64)t * stride_g + n * V + v]));
          if (seq_lens[t / Q] == 0) o = 0.0f;
          out[(dp_u64)t * (N * V) + n * V + v] = dp_f32_to_bf16(o);
        }
      }
    }
  } else
#endif
  {
    constexpr int T = W * Q;
    constexpr int kChunk = T < 8 ? T : 8;
    constexpr int kVecs = kQ8 ? L / 16 : L / 8;  // 16-byte vectors of a W_UV row: 8 bf16 or 16 e4m3
    constexpr int kVecElems = kQ8 ? 16 : 8;
    constexpr int kIters = (kVecs + DP_GROUP - 1) / DP_GROUP;
    constexpr int kVPerGroup = 4;  // output columns per group
    constexpr int kBlockV = kVPerGroup * (DP_MLA_THREADS / DP_GROUP);
    static_assert(L % 8 == 0 && (kQ8 == 0 || L % 16 == 0), "mla_combine: L multiple of 8 (16 for e4m3)");
    __shared__ float olat[kChunk * L];  // [chunk, L] fp32 (bf16 values)
    __shared__ float wgt[kChunk * NS];  // [chunk, NS] merge weights e^(m_s - M) / sum
    const int n = (int)blockIdx.x, tid = (int)threadIdx.x, group = tid / DP_GROUP, lane = tid % DP_GROUP;
    const int v0 = (int)blockIdx.y * kBlockV + group * kVPerGroup;
    const float neg_inf = dp_bits_to_f32(0xff800000u);

    // This group's W_UV rows, all loads in flight before the merge (they do not depend on it).
    dp_u32x4 wv[kVPerGroup][kIters];
    float wsc[kVPerGroup][kIters];  // e4m3: each vector's block scale
#pragma unroll
    for (int k = 0; k < kVPerGroup; ++k) {
      const int v = v0 + k < V ? v0 + k : V - 1;
      const dp_u64 row = (dp_u64)n * (PN + V) + PN + v;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int vec = lane + DP_GROUP * it;
        if (vec < kVecs) {
          wv[k][it] = kQ8 ? dp_load16((const dp_u8*)kv_b + row * L + 16 * vec)
                          : dp_load16((const dp_bf16*)kv_b + row * L + 8 * vec);
        } else {
          wv[k][it].x = wv[k][it].y = wv[k][it].z = wv[k][it].w = 0u;
        }
        wsc[k][it] = kQ8 && vec < kVecs ? kv_b_scale[(row / 128) * ((L + 127) / 128) + 16 * vec / 128] : 0.0f;
      }
    }

    // Merge: group tt < rows takes row t0 + tt's weights (lanes over the splits); then every row's o_lat
    // with the threads split into kSG groups of splits x kCG groups of 8 columns (float4 loads), the split
    // groups summed in a fixed order.
    constexpr int kCG = L / 8;                         // 8-column groups
    constexpr int kSG = kCG >= 256 ? 1 : 256 / kCG;    // split groups
    __shared__ float red[kSG * L];                     // [kSG, L] fp32 split-group partials
    for (int t0 = 0; t0 < T; t0 += kChunk) {
      const int rows = T - t0 < kChunk ? T - t0 : kChunk;
      __syncthreads();
      if (group < rows) {  // whole groups: the shuffles below stay uniform
        const int t = t0 + group, r = t / Q, i = t % Q;
        const dp_u64 base = ((dp_u64)r * NS * Q + i) * N + n;  // (r, s = 0, i, n); split s adds s*Q*N
        float mx = neg_inf;
        for (int s = lane; s < NS; s += DP_GROUP) {
          const float m = part_ml[2 * (base + (dp_u64)s * Q * N)];
          mx = m > mx ? m : mx;
        }
#pragma unroll
        for (int d = DP_GROUP / 2; d > 0; d >>= 1) {
          const float o = dp_shfl_xor(mx, d);
          mx = o > mx ? o : mx;
        }
        float sum = 0.0f;
        for (int s = lane; s < NS; s += DP_GROUP) {
          const dp_u64 p = base + (dp_u64)s * Q * N;
          const float m = part_ml[2 * p];
          const float w = m == neg_inf ? 0.0f : dp_expf(m - mx);
          wgt[group * NS + s] = w;
          sum += w * part_ml[2 * p + 1];
        }
        sum = dp_group_sum(sum);
        const float inv = (seq_lens[r] == 0 || mx == neg_inf) ? 0.0f : dp_div(1.0f, sum);
        for (int s = lane; s < NS; s += DP_GROUP) wgt[group * NS + s] *= inv;
      }
      __syncthreads();
      for (int tt = 0; tt < rows; ++tt) {
        const int t = t0 + tt, r = t / Q, i = t % Q;
        const int sg = tid / kCG < kSG ? tid / kCG : kSG;  // kSG: idle thread
        for (int cg = tid % kCG; sg < kSG && cg < kCG; cg += (kCG >= 256 ? 256 : kCG)) {
          float o[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 4
          for (int s = sg; s < NS; s += kSG) {
            const float w = wgt[tt * NS + s];
            const float* po = part_o + ((((dp_u64)r * NS + s) * Q + i) * N + n) * L + 8 * cg;
            const dp_u32x4 a = dp_load16(po), c = dp_load16(po + 4);  // 8 fp32
            if (w != 0.0f) {  // a split that saw no token left its o unwritten
              o[0] += w * dp_bits_to_f32(a.x);
              o[1] += w * dp_bits_to_f32(a.y);
              o[2] += w * dp_bits_to_f32(a.z);
              o[3] += w * dp_bits_to_f32(a.w);
              o[4] += w * dp_bits_to_f32(c.x);
              o[5] += w * dp_bits_to_f32(c.y);
              o[6] += w * dp_bits_to_f32(c.z);
              o[7] += w * dp_bits_to_f32(c.w);
            }
          }
#pragma unroll
          for (int k = 0; k < 8; ++k) red[sg * L + 8 * cg + k] = o[k];
        }
        __syncthreads();
        for (int l = tid; l < L; l += DP_MLA_THREADS) {
          float o = 0.0f;
#pragma unroll
          for (int k = 0; k < kSG; ++k) o += red[k * L + l];
          olat[tt * L + l] = dp_round_bf16(o);
        }
        __syncthreads();
      }
      // o[v] = o_lat . kv_b[n*(PN+V) + PN + v, :] for this group's v.
      float acc[kVPerGroup][kChunk];
#pragma unroll
      for (int k = 0; k < kVPerGroup; ++k)
#pragma unroll
        for (int tt = 0; tt < kChunk; ++tt) acc[k][tt] = 0.0f;
#pragma unroll
      for (int it = 0; it < kIters; ++it) {
        const int vec = lane + DP_GROUP * it;
        if (vec < kVecs) {
#pragma unroll
          for (int k = 0; k < kVPerGroup; ++k) {
            float wf[kVecElems];
            if constexpr (kQ8 != 0) {
              dp_unpack16_e4m3(wv[k][it], wf);
#pragma unroll
              for (int tt = 0; tt < kChunk; ++tt) {
                float p = 0.0f;
#pragma unroll
                for (int j = 0; j < 16; ++j) p += wf[j] * olat[tt * L + 16 * vec + j];
                acc[k][tt] += p * wsc[k][it];
              }
            } else {
              dp_unpack8_bf16(wv[k][it], wf);
#pragma unroll
              for (int tt = 0; tt < kChunk; ++tt)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[k][tt] += wf[j] * olat[tt * L + 8 * vec + j];
            }
          }
        }
      }
#pragma unroll
      for (int k = 0; k < kVPerGroup; ++k)
#pragma unroll
        for (int tt = 0; tt < kChunk; ++tt) acc[k][tt] = dp_group_sum(acc[k][tt]);
#pragma unroll
      for (int k = 0; k < kVPerGroup; ++k)
#pragma unroll
        for (int tt = 0; tt < kChunk; ++tt) {
          const int v = v0 + k, t = t0 + tt;
          if (lane != (k * kChunk + tt) % DP_GROUP || tt >= rows || v >= V) continue;
          float o = dp_round_bf16(acc[k][tt]);
          if (kGate) o *= dp_sigmoid(dp_bf16_to_f32(gate[(dp_u64)t * stride_g + n * V + v]));
          if (seq_lens[t / Q] == 0) o = 0.0f;
          out[(dp_u64)t * (N * V) + n * V + v] = dp_f32_to_bf16(o);
        }
    }
  }
}
