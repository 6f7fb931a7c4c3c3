// kda.h: one decode step of Kimi Delta Attention (model-family.md 3a, steps 2-6) for every request and
// head of a layer in one launch: short causal conv + SiLU with the conv-state update, forget gate,
// beta, L2-normalised q/k, the gated delta rule on the fp32 state in place, and the gated RMSNorm with
// the sigmoid output gate. Its input is the stacked projection GEMM's output (gemm.h), its output the
// o_proj GEMM's input.
//
// Layouts (TP shard of this rank: NH heads, P = NH*D channels):
//   proj   [W*Q, NP] bf16, NP = 3P + FR + G + NH, G = GR (low-rank output gate) or P (K3 full rank):
//          columns [q P | k P | v P | f_a FR | g_a GR (or g P) | b NH], the concatenated outputs of the
//          q/k/v/f_a/g_a(g)/b projections (one gemm launch with those six segments in this order).
//   state  the recurrent-state pool: slot s holds [NH, D, D] fp32 at s*state_stride (fp32 elements;
//          dense: state_stride = NH*D*D, larger when the host pads its slots, as vLLM's mamba pools
//          do), k-major: S[k][v] at k*D + v (FLA fused_recurrent / vLLM kda.py@1d03ed8f; newer
//          kernels that use [v][k] need a transposed binding). Elements between a slot's NH*D*D
//          values and the next slot are never read or written.
//   conv   three pools (q, k, v): slot s of each holds [CK-1, P] bf16 at s*conv_stride (elements;
//          dense: (CK-1)*P; one stride for all three): the last CK-1 PRE-conv inputs, oldest first,
//          channel-contiguous ("SD", the layout of vLLM's three-tensor conv state). Padding after a
//          slot's (CK-1)*P values is never read or written.
//   Slot offsets are computed in 64 bits (slot * stride may exceed 2^32 elements).
//   slots  [W, Q] i32: request r's state slot for draft position i (vLLM's mamba block-table row
//          block_table[r, 0:Q]); slots[r][0] == 0 (NULL_BLOCK_ID) marks a padded request, which
//          reads and writes no state and gets zero output rows. A zero slot at i > 0 is not written.
//   Spec decode (Q > 1): draft position i reads the state left by position i-1 (position 0: the slot
//   of position num_accepted[r]-1) and writes its own state, recurrent and conv, to slots[r][i]
//   (reference ConvSpecLayout::per_slot; for Q = 1 this is vLLM's read-modify-write of one slot).
//
// Alignment: weight rows (w_fb, w_gb) are read with 16-byte loads: their base pointers must be 16-byte
// aligned (FR and GR are multiples of 8). proj, the states and out need only their element alignment,
// and state_stride / conv_stride may be any value >= the dense one (states are read one element at a
// time).
//
// Block: 4*D threads (512 for D = 128), one block per (head, request): grid (NH, W). The block keeps
// the head's D x D state in registers, 32 fp32 values per thread: thread (group g, lane) holds column
// v = lane + 32*(g % (D/32)) of rows [ks*D/4, (ks+1)*D/4), ks = g / (D/32). The state is read once,
// carried through the Q draft positions and written once per position.
//
// VS > 1 (value splits, Q = 1): VS blocks per (head, request), grid (NH*VS, W), each owning D/VS state
// columns (the delta rule is column by column) with 4*VS k-slices of D/(4*VS) rows; every block computes
// the whole q, k and forget gate. The gated RMSNorm needs the whole head's o: each block stores its
// columns' o and sigmoid(g) and its sum of o^2 in the workspace and counts itself in on the head's word
// of `done`; the last block of the head normalises the D values (the splits' sums added in order, so
// that VS = 4 gives the VS = 1 kernel's output bits) and writes the q and k conv states, which every
// block read before it arrived. At one request the 32 heads of Kimi-Linear filled 32 of 132 SMs.
//
// Rounding follows vLLM's storage points where it costs nothing: conv outputs, f = W_fb f_a,
// g = W_gb g_a and the recurrent output o are rounded to bf16 before use (torch writes them as bf16
// tensors); everything else stays fp32 (L2 norms, gates, the state update, the gated norm).
#pragma once

#include "vendor.h"
#include "gemm.h"  // dp_group_sum, dp_sigmoid, dp_silu, dp_round_bf16

#define DP_KDA_L2_EPS 1e-6f  // q/k L2 normalisation epsilon (FLA l2norm)

template <int D>
struct dp_kda_geometry {
  static_assert(D % 64 == 0 && D <= 256, "kda: head dim must be a multiple of 64, at most 256");
  static constexpr int kThreads = 4 * D;
  static constexpr int kVGroups = D / DP_GROUP;  // groups across the D value columns
  static constexpr int kKRows = D / 4;           // state rows per thread
};

template <int W, int Q, int NH, int D, int CK, int FR, int GR, int kSafeGate, int kOnormF32, int kALogByRank = 0,
          int VS = 1, int kEarly = 0>
__device__ __forceinline__ void dp_kda_step(
    const dp_bf16* __restrict__ proj,        // [W*Q, NP] bf16: q | k | v | f_a | g_a (or g) | b
    const dp_bf16* __restrict__ w_fb,        // [P, FR] bf16 f_b_proj
    const dp_bf16* __restrict__ w_gb,        // [P, GR] bf16 g_b_proj; null when GR == 0 (full-rank gate)
    const float* __restrict__ conv_wq,       // [P, CK] fp32 q_conv1d (as [P, 1, CK])
    const float* __restrict__ conv_wk,       // [P, CK] fp32 k_conv1d
    const float* __restrict__ conv_wv,       // [P, CK] fp32 v_conv1d
    const float* __restrict__ dt_bias,       // [P] fp32
    const float* __restrict__ a_log,         // [NH] fp32: this rank's heads; kALogByRank: the whole
                                             //   replicated A_log (K3 stores more entries than heads),
                                             //   this rank's heads at rank*NH
    const void* __restrict__ o_norm,         // [D] bf16 (fp32 when kOnormF32) o_norm.weight
    float* state,                            // [slots, state_stride] fp32: [NH, D, D] per slot, in place
    dp_bf16* conv_q,                         // [slots, conv_stride] bf16: [CK-1, P] per slot, in place
    dp_bf16* conv_k,                         // [slots, conv_stride] bf16
    dp_bf16* conv_v,                         // [slots, conv_stride] bf16
    const dp_i32* __restrict__ slots,        // [W, Q] i32
    const dp_i32* __restrict__ num_accepted, // [W] i32 in 1..Q; null when Q == 1
    dp_bf16* __restrict__ out,               // [W*Q, P] bf16: gated RMSNorm output (o_proj input)
    float lower_bound,                       // K3 safe gate lower bound (used when kSafeGate)
    float onorm_eps,                         // gated RMSNorm epsilon (1e-5)
    dp_u32 state_stride,                     // fp32 elements between state slots (dense: NH*D*D)
    dp_u32 conv_stride,                      // elements between conv-state slots (dense: (CK-1)*P)
    dp_u32 rank = 0,                         // kALogByRank: the tensor-parallel rank
    float* o_part = nullptr,                 // VS > 1: [W, NH, D] fp32 o (bf16 values) of every block's columns
    float* g_part = nullptr,                 // VS > 1: [W, NH, D] fp32 sigmoid of the output gate
    float* ss_part = nullptr,                // VS > 1: [W, NH, VS] fp32 each block's sum of o^2
    dp_u32* done = nullptr) {                // VS > 1: [W, NH] u32 blocks done, zero between launches
  typedef dp_kda_geometry<D> G;
  static_assert(VS == 1 || ((VS == 2 || VS == 4) && Q == 1 && (D / VS) % DP_GROUP == 0),
                "kda: value splits are 2 or 4 blocks of whole groups of columns, one row per request");
  constexpr int CB = D / VS;      // state columns of this block
  constexpr int KS = 4 * VS;      // k-slices
  constexpr int KR = D / KS;      // state rows per thread
  constexpr int P = NH * D;
  constexpr int kGW = GR > 0 ? GR : P;
  constexpr int NP = 3 * P + FR + kGW + NH;
  constexpr int kFaCol = 3 * P, kGCol = 3 * P + FR, kBCol = 3 * P + FR + kGW;
  constexpr int CH = CK - 1;  // conv history length
  static_assert(FR > 0 && FR % 8 == 0 && GR % 8 == 0 && FR + GR <= 2048,
                "kda: gate ranks must be multiples of 8, at most 2048 together");
  static_assert(CK >= 2 && CK <= 8, "kda: conv kernel 2..8");

  __shared__ float qs[D];            // [D] conv'd q (bf16 values), raw (before the L2 norm)
  __shared__ float ks[D];            // [D] conv'd k, raw
  __shared__ float vs[D];            // [D] conv'd v
  __shared__ float dec[D];           // [D] exp(alpha): per-key-channel decay
  __shared__ float gs[D];            // [D] output gate logits (bf16 values)
  __shared__ float red[KS][CB];      // [KS, CB] k-slice partials of S^T k
  __shared__ float red2[KS][CB];     // [KS, CB] k-slice partials of S^T q
  __shared__ float sums[3][G::kThreads / DP_GROUP];  // per-group partial sums of q^2, k^2, o^2
  __shared__ float gate_in[FR + GR];  // [FR + GR] f_a and g_a of the current row (fp32 copies)
  __shared__ float beta_s;

  const int j = VS == 1 ? (int)blockIdx.x : (int)blockIdx.x / VS;  // head
  const int v0 = VS == 1 ? 0 : ((int)blockIdx.x % VS) * CB;          // this block's first state column
  const int r = (int)blockIdx.y;   // request
  const int tid = (int)threadIdx.x;
  const int group = tid / DP_GROUP, lane = tid % DP_GROUP;
  const int role = tid / D;        // phase A: 0 q channel, 1 k channel + forget gate, 2 v channel, 3 output gate
  const int c = tid % D;           // channel within the head for phase A
  const int ch = j * D + c;        // channel within the rank's P
  // State column of this thread and its k-slice (rows [kslice*KR, (kslice+1)*KR)); col: within the block.
  const int vcol = VS == 1 ? lane + DP_GROUP * (group % G::kVGroups) : v0 + tid % CB;
  const int col = vcol - v0;
  const int kslice = VS == 1 ? group / G::kVGroups : tid / CB;
  // Phase A threads that have work: q and k channels, and the v and gate channels of this block's columns.
  const bool mine = VS == 1 || role < 2 || (c >= v0 && c < v0 + CB);

  const dp_i32 first = slots[r * Q];
  const dp_i32 acc = (Q > 1 && num_accepted) ? num_accepted[r] : 1;
  const dp_i32 read_slot = (acc >= 1 && acc <= Q) ? slots[r * Q + acc - 1] : 0;
  if (first == 0 || read_slot == 0) {
    // Padded request (NULL_BLOCK_ID): no state read or written, zero output rows.
    if constexpr (kEarly != 0) dp_grid_dependency_wait();  // out may still be read by the kernel before
    if (tid < CB)
      for (int i = 0; i < Q; ++i) out[(dp_u64)(r * Q + i) * P + j * D + v0 + tid] = dp_f32_to_bf16(0.0f);
    return;
  }

  // Conv history of this thread's channel (phase A roles 0..2) and its taps, in registers.
  float hist[CH > 0 ? CH : 1];
  float taps[CK];
  dp_bf16* conv_state = role == 0 ? conv_q : role == 1 ? conv_k : conv_v;
  if (role < 3 && mine) {
    const float* cw = (role == 0 ? conv_wq : role == 1 ? conv_wk : conv_wv) + (dp_u64)ch * CK;
#pragma unroll
    for (int i = 0; i < CK; ++i) taps[i] = cw[i];
#pragma unroll
    for (int i = 0; i < CH; ++i)
      hist[i] = dp_bf16_to_f32(conv_state[(dp_u64)read_slot * conv_stride + (dp_u64)(i * P + ch)]);
  }
  const float a_exp = dp_expf(kALogByRank ? a_log[(dp_u64)rank * NH + j] : a_log[j]);

  // The head's state, D/4 rows of one column per thread.
  float s[KR];  // [KR] fp32: S[kslice*KR + kk][vcol]
  {
    const float* src = state + (dp_u64)read_slot * state_stride + (dp_u64)j * D * D;
#pragma unroll
    for (int kk = 0; kk < KR; ++kk) s[kk] = src[(kslice * KR + kk) * D + vcol];
  }
  if constexpr (kEarly != 0) {
    // Everything above is this layer's own state (written by this kernel in an earlier step), the
    // weights or the host's step inputs: none of it is written by the kernels before this one in the
    // step, so it is read before the wait (the entry point only triggered its dependents). The gate
    // projections' weight rows go to L2 now; proj, the previous kernel's output, is read after the
    // wait with coherent loads.
    if (role == 1) dp_prefetch_l2(w_fb + (dp_u64)ch * FR, FR * 2);
    if constexpr (GR > 0)
      if (role == 3 && mine) dp_prefetch_l2(w_gb + (dp_u64)ch * GR, GR * 2);
    dp_grid_dependency_wait();
  }
  // proj element e of the current row (bf16 bits): coherent after an early wait.
  auto proj_at = [&](const dp_bf16* row, int e) -> float {
    if constexpr (kEarly != 0) return dp_bits_to_f32((dp_u32)dp_load_u16_coherent(row + e) << 16);
    else return dp_bf16_to_f32(row[e]);
  };

  for (int i = 0; i < Q; ++i) {
    const int t = r * Q + i;
    const dp_i32 write_slot = slots[r * Q + i];
    const dp_bf16* row = proj + (dp_u64)t * NP;  // [NP] bf16
    // f_a and g_a through shared memory: every forget/output-gate thread reads all of them, and proj
    // rows are only 2-byte aligned (NP need not be a multiple of 8), so no 16-byte loads from proj.
    for (int e = tid; e < FR + GR; e += G::kThreads) gate_in[e] = proj_at(row, kFaCol + e);
    __syncthreads();

    // ---- Phase A: conv + SiLU (q, k, v), forget gate (k threads), output gate, beta ----
    float sq = 0.0f;
    if (role < 3 && mine) {
      const float xn = proj_at(row, role * P + ch);
      float y = taps[CK - 1] * xn;
#pragma unroll
      for (int k = 0; k < CH; ++k) y += taps[k] * hist[k];
      y = dp_round_bf16(dp_silu(y));
#pragma unroll
      for (int k = 0; k + 1 < CH; ++k) hist[k] = hist[k + 1];
      if (CH > 0) hist[CH - 1] = xn;
      if (write_slot != 0 && (VS == 1 || role == 2)) {  // VS > 1: q and k by the head's last block
#pragma unroll
        for (int k = 0; k < CH; ++k)
          conv_state[(dp_u64)write_slot * conv_stride + (dp_u64)(k * P + ch)] = dp_f32_to_bf16(hist[k]);
      }
      if (role == 0) qs[c] = y;
      if (role == 1) ks[c] = y;
      if (role == 2) vs[c] = y;
      sq = y * y;
    }
    if (role == 1) {
      // f = W_fb f_a (bf16), alpha = log-decay of key channel c.
      const dp_bf16* wr = w_fb + (dp_u64)ch * FR;
      float f = 0.0f;
#pragma unroll 4
      for (int v = 0; v < FR / 8; ++v) {
        float a[8];
        dp_unpack8_bf16(dp_load16(wr + 8 * v), a);
#pragma unroll
        for (int k = 0; k < 8; ++k) f += a[k] * gate_in[8 * v + k];
      }
      const float z = dp_round_bf16(f) + dt_bias[ch];
      float alpha;
      if (kSafeGate) {
        alpha = lower_bound * dp_sigmoid(a_exp * z);
      } else {
        const float sp = z > 20.0f ? z : dp_logf(1.0f + dp_expf(z));  // softplus, beta 1, threshold 20
        alpha = -a_exp * sp;
      }
      dec[c] = dp_expf(alpha);
    }
    if (role == 3 && mine) {
      float g;
      if (GR > 0) {
        const dp_bf16* wr = w_gb + (dp_u64)ch * (GR > 0 ? GR : 8);
        g = 0.0f;
#pragma unroll 4
        for (int v = 0; v < GR / 8; ++v) {
          float a[8];
          dp_unpack8_bf16(dp_load16(wr + 8 * v), a);
#pragma unroll
          for (int k = 0; k < 8; ++k) g += a[k] * gate_in[FR + 8 * v + k];
        }
        g = dp_round_bf16(g);
      } else {
        g = proj_at(row, kGCol + ch);
      }
      gs[c] = g;
      if (c == v0) beta_s = dp_sigmoid(proj_at(row, kBCol + j));
    }
    sq = dp_group_sum(sq);  // groups never straddle roles (D is a multiple of 64)
    if (lane == 0 && role < 2) sums[role][group % G::kVGroups] = sq;
    __syncthreads();

    float q2 = 0.0f, k2 = 0.0f;
#pragma unroll
    for (int g = 0; g < G::kVGroups; ++g) {
      q2 += sums[0][g];
      k2 += sums[1][g];
    }
    // q scaled by D^-1/2 on top of the L2 norm; both scales applied to the sums, not the vectors.
    const float inv_q = dp_rsqrtf(q2 + DP_KDA_L2_EPS) * dp_rsqrtf((float)D);
    const float inv_k = dp_rsqrtf(k2 + DP_KDA_L2_EPS);
    const float beta = beta_s;

    // ---- Phase B: gated delta rule on this thread's slice of the state ----
    //   S <- diag(exp(alpha)) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
    float p = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KR; ++kk) {
      const int krow = kslice * KR + kk;
      s[kk] *= dec[krow];
      p += s[kk] * ks[krow];
    }
    red[kslice][col] = p;
    __syncthreads();
    float kv = 0.0f;
#pragma unroll
    for (int k = 0; k < KS; ++k) kv += red[k][col];
    const float u = beta * (vs[vcol] - kv * inv_k);
    float p2 = 0.0f;
#pragma unroll
    for (int kk = 0; kk < KR; ++kk) {
      const int krow = kslice * KR + kk;
      s[kk] += ks[krow] * inv_k * u;
      p2 += s[kk] * qs[krow];
    }
    red2[kslice][col] = p2;
    if (write_slot != 0) {
      float* dst = state + (dp_u64)write_slot * state_stride + (dp_u64)j * D * D;
#pragma unroll
      for (int kk = 0; kk < KR; ++kk) dst[(kslice * KR + kk) * D + vcol] = s[kk];
    }
    __syncthreads();

    // ---- Phase C: o = S^T q (bf16), gated RMSNorm over the head, sigmoid output gate ----
    float o2 = 0.0f;
    float o = 0.0f;
    if (tid < CB) {  // kslice 0 threads: one per column
      float acc_o = 0.0f;
#pragma unroll
      for (int k = 0; k < KS; ++k) acc_o += red2[k][col];
      o = dp_round_bf16(acc_o * inv_q);
      o2 = o * o;
    }
    o2 = dp_group_sum(o2);
    if (lane == 0 && tid < CB) sums[2][group] = o2;
    __syncthreads();
    if constexpr (VS > 1) {
      // This block's columns and its sum of o^2 to the workspace; the head's last block normalises.
      const dp_u64 hd = (dp_u64)r * NH + j;
      if (tid < CB) {
        o_part[hd * D + vcol] = o;
        g_part[hd * D + vcol] = dp_sigmoid(gs[vcol]);
      }
      if (tid == 0) {
        float ss = 0.0f;
#pragma unroll
        for (int g = 0; g < CB / DP_GROUP; ++g) ss += sums[2][g];
        ss_part[hd * VS + v0 / CB] = ss;
      }
      dp_fence_device();  // this block's values are visible before it is counted
      __syncthreads();
      __shared__ dp_u32 last;
      if (tid == 0) last = dp_arrive_device(done + hd) == (dp_u32)(VS - 1) ? 1u : 0u;
      __syncthreads();
      if (last) {
        dp_fence_device();
        if (tid == 0) done[hd] = 0u;
        float ss = 0.0f;
#pragma unroll
        for (int b = 0; b < VS; ++b) ss += dp_load_f32_coherent(ss_part + hd * VS + b);
        const float rstd = dp_rsqrtf(ss * (1.0f / (float)D) + onorm_eps);
        if (tid < D) {
          const float oo = dp_load_f32_coherent(o_part + hd * D + tid);
          const float sg = dp_load_f32_coherent(g_part + hd * D + tid);
          const float w = kOnormF32 ? ((const float*)o_norm)[tid] : dp_bf16_to_f32(((const dp_bf16*)o_norm)[tid]);
          out[(dp_u64)t * P + j * D + tid] = dp_f32_to_bf16(oo * rstd * w * sg);
        }
        // The q and k conv states: every block of the head read them before it arrived.
        if (role < 2 && write_slot != 0) {
#pragma unroll
          for (int k = 0; k < CH; ++k)
            conv_state[(dp_u64)write_slot * conv_stride + (dp_u64)(k * P + ch)] = dp_f32_to_bf16(hist[k]);
        }
      }
    } else if (tid < D) {
      float ss = 0.0f;
#pragma unroll
      for (int g = 0; g < G::kVGroups; ++g) ss += sums[2][g];
      const float rstd = dp_rsqrtf(ss * (1.0f / (float)D) + onorm_eps);
      const float w = kOnormF32 ? ((const float*)o_norm)[vcol] : dp_bf16_to_f32(((const dp_bf16*)o_norm)[vcol]);
      const float y = o * rstd * w * dp_sigmoid(gs[vcol]);
      out[(dp_u64)t * P + j * D + vcol] = dp_f32_to_bf16(y);
    }
    __syncthreads();  // shared buffers are rewritten by the next draft position
  }
}
