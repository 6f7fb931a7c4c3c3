// The GPU kernel checks: which model shapes, widths and rows per request are checked, and the kernel
// instances each case needs. Shared by dp_kernel_build (compiles them here, no GPU) and dp_kernel_check
// (runs them on the GPU machine against the float64 reference).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "codegen/kernel.h"

namespace dp::gpucheck {

// The numbers of one model that the decode kernels see (one TP=1 rank).
struct ModelShape {
  std::string name;
  int64_t hidden = 0;
  // KDA
  int64_t heads = 0, head_dim = 128, conv = 4, f_rank = 128, g_rank = 128;  // g_rank 0: full-rank gate (K3)
  bool safe_gate = false;                                                   // K3: alpha = lower_bound * sigmoid(...)
  double lower_bound = -5.0;
  bool onorm_f32 = false;  // K3 keeps o_norm in fp32
  // K3 keeps A_log whole on every rank (a_log_size entries, more than the heads): a_log_rank >= 0 checks
  // the kda_step form of tensor-parallel rank a_log_rank (AR), which reads its heads at rank*heads.
  int64_t a_log_size = 0, a_log_rank = -1;
  // MoE
  int64_t experts = 0, top_k = 0, inter = 0, shared = 0;  // shared: shared-expert width
  int64_t latent = 0;  // K3 latent MoE: the width the routed experts run in (0: none)
  double routed_scaling = 1.0;
  // dense MLP
  int64_t dense_inter = 0;
  bool situ = false;
  double situ_beta = 4.0, situ_linear_beta = 25.0;
  // MLA (NoPE, absorbed): heads, kv_lora_rank, rope/nope/v head dims, K3 output gate; the cache's
  // block size, the KV splits and the longest context the checks draw.
  int64_t mla_heads = 0, lora = 512, rope = 64, nope = 128, v_dim = 128;
  bool mla_gate = false;
  // K3 q-LoRA (0: a plain q_proj): the checked chain is the layer program's, gemm [q_a | kv_a | g] over x,
  // rmsnorm of the q_a columns in place in those rows (q_a_layernorm, S = the row width), gemm q_b_proj.
  int64_t q_lora = 0;
  int64_t block_size = 64, splits = 16, max_context = 0;
  // K3 block attention residuals (0: plain residual): block size and decoder layers.
  int64_t attn_res_block = 0, layers = 0;
  int64_t attn_res_blocks() const { return attn_res_block ? (layers + attn_res_block - 1) / attn_res_block : 0; }

  int64_t proj_size() const { return heads * head_dim; }  // P
  int64_t proj_cols() const {                             // columns of the stacked KDA projections
    return 3 * proj_size() + f_rank + (g_rank > 0 ? g_rank : proj_size()) + heads;
  }
};

// How the host lays out the caches and expert weights the kernels read through their outer strides
// (kda_step state_stride / conv_stride, mla_* cache_stride, moe_up stride_w1 / stride_w3, moe_down
// stride_w2). The kernels are the same instances for every layout; only those arguments differ.
enum class Layout {
  dense,   // every pool and expert stack dense: stride = the size of one slot / block / expert
  padded,  // spare elements after every state slot, conv slot and cache block (poisoned, must stay
           // untouched), vLLM's fused w13 [E, 2I, D] for moe_up, a padded w2 stack for moe_down
  wide,    // padded, and slots / blocks / experts placed beyond 2^32 elements from the base (64-bit
           // address math); the pools span tens of GB on the device, only the used slots are uploaded
};
const char* to_string(Layout l);

struct Case {
  const ModelShape* model = nullptr;
  int64_t width = 1;  // requests
  int64_t q = 1;      // rows per request
  Layout layout = Layout::dense;
  // FP8 block quantization (a `synth --quantize fp8` checkpoint): the weights such a checkpoint stores in
  // e4m3 with fp32 scales per 128 x 128 block are read by the FP8 variants of their kernels (parameter
  // Q8): the KDA q, k, v and o projections, the MLA kv_b, the dense MLP and the routed and shared
  // experts. The router and the KDA gate and beta projections stay bf16. Ops that read no FP8 weight
  // (rmsnorm, kda_step, moe_route, mla_attn) are not checked again in these cases.
  bool fp8 = false;
  // The K3 latent MoE with MXFP4 routed experts (packed E2M1 codes + E8M0 scales, as the K3 checkpoints
  // ship them): router, moe_route, latent down gemm, moe_up / moe_down Q4 in the latent width (no shared
  // expert), RMSNorm of the latent sum (no residual), the shared expert (mlp_up + down gemm) at full
  // width and the latent up gemm with the shared output as addend (AD); only these ops are checked.
  bool mxfp4 = false;
  // FP8 cases: the weight-ring forms (e4m3 weights streamed through shared memory by bulk copies) of the
  // kernels that have one: the gemms with e4m3 segments (not the fused norm; RG 6), the gate/ups' warp
  // tiles (a ring per warp, RG 2), and moe_down at one row (RG 6).
  bool ring = false;
  int64_t rows() const { return width * q; }
  // "kimi-linear-tiny w3 q2", "kimi-linear-tiny w3 q2 padded", "kimi-linear-tiny w3 q2 padded fp8",
  // "kimi-k3 w8 q1 mxfp4", "kimi-linear-tiny w1 q1 fp8 ring"
  std::string name() const;
};

const std::vector<ModelShape>& model_shapes();
std::vector<Case> all_cases();

// The kernels of one case, named after their role in a layer program.
struct CaseKernels {
  codegen::KernelInstance rmsnorm;      // fused add + RMSNorm over the step's rows
  codegen::KernelInstance in_proj;      // gemm: KDA q | k | v | f_a | g_a (g) | b (FP8: q, k, v e4m3)
  codegen::KernelInstance kda;          // kda_step
  codegen::KernelInstance kda_split;    // kda_step VS 4 (Q = 1; op "" otherwise): 4 blocks per head
  codegen::KernelInstance o_proj;       // gemm: [H, P]
  codegen::KernelInstance o_proj_norm;  // the same with the post-attention norm fused (NM 1)
  codegen::KernelInstance router;       // gemm, fp32 out: [E, H]
  codegen::KernelInstance route;        // moe_route
  codegen::KernelInstance router_route; // the router gemm with the routing fused (TK, TR)
  codegen::KernelInstance moe_up;       // moe_up (routed + shared)
  codegen::KernelInstance moe_down;     // moe_down (routed + shared)
  codegen::KernelInstance mlp_up;       // dense gate/up
  codegen::KernelInstance mlp_down;     // gemm: [H, I_dense]
  codegen::KernelInstance mla_prep;     // kv_a_layernorm + cache write + absorbed query
  codegen::KernelInstance mla_attn;     // split-KV attention partials
  codegen::KernelInstance mla_combine;  // merge + W_UV (+ K3 gate)
  codegen::KernelInstance mla_attn_staged;  // mla_attn with TS 4 (DP_CHECK_MLA_TS): tiles in dynamic shared memory
  // q-LoRA models only (op "" otherwise).
  codegen::KernelInstance mla_in;       // gemm: q_a | kv_a_proj_with_mqa | g_proj over x
  codegen::KernelInstance q_norm;       // rmsnorm of the q_a columns of mla_in's rows (S = row width)
  codegen::KernelInstance q_b;          // gemm: q_b_proj [N*(PN+R), q_lora]
  // FP8 cases only (op "" otherwise): gemm over e4m3, bf16 and e4m3 weights [P | 80 | 208, H] (Q8 5),
  // the per-weight choice away from the in_proj's leading bits, rows that end inside a block.
  codegen::KernelInstance mixed;
  // MXFP4 latent-MoE cases only (op "" otherwise); they reuse router, route, moe_up / moe_down (Q4, in
  // the latent width, S = 0), mlp_up and mlp_down (the shared expert: [S, H] gate/up, [H, S] down).
  codegen::KernelInstance lat_down;     // gemm [D, H]: routed_expert_down_proj
  codegen::KernelInstance lat_norm;     // rmsnorm over D, no residual: routed_expert_norm
  codegen::KernelInstance lat_up;       // gemm [H, D] + addend (AD 1): routed_expert_up_proj + shared
  codegen::KernelInstance moe_down_split;  // moe_down over a grid of 264 blocks sharing the tiles (SK; MXFP4, e4m3,
                                           // bf16 from two rows)
  // MXFP4 cases: moe_down through the weight ring at 4, 6 and 8 stages (or the one DP_CHECK_RING names),
  // and moe_up through a ring per warp at 2 and 3 stages, beside the register forms (timed side by side).
  std::vector<codegen::KernelInstance> moe_down_rings;
  std::vector<codegen::KernelInstance> moe_up_rings;
  codegen::KernelInstance moe_down_split_ring;  // the split grid (SK 264) through the ring: MXFP4 cases (RG 8),
                                                // FP8 cases whose shared expert is as wide as I (RG 6)
  // K3 cases (attn_res_block > 0, not FP8; op "" otherwise): attnres at stage 0 (before the input norm,
  // may push), 1 (before the post-attention norm) and 2 (the final norm), at the model's shape, and at
  // Kimi-K3's own (H 7168, block 12, 8 blocks; stage 0) over the same rows.
  codegen::KernelInstance attnres[3];
  codegen::KernelInstance attnres_k3;
  std::vector<codegen::KernelInstance> all() const;  // the instances with an op
};
CaseKernels kernels_of(const Case& c, const std::string& target);

}  // namespace dp::gpucheck
