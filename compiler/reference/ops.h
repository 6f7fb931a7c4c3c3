// Op-level pieces of the float64 CPU reference, each the math of one decode-kernel op (model-family.md
// section 3), in plain double loops. layer.h composes them into whole decoder layers; GPU op tests can
// call them directly.
//
// Rows are tokens of the step in vLLM's order: request-major, row t = r*q + i is draft position i of
// request r (W requests x q rows, q = 1 + num_speculative_tokens).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "reference/weights.h"

namespace dp::ref {

// Row-major [rows, cols] matrix of doubles.
struct Mat {
  int64_t rows = 0, cols = 0;
  std::vector<double> v;

  Mat() = default;
  Mat(int64_t r, int64_t c, double fill = 0.0) : rows(r), cols(c), v(static_cast<size_t>(r * c), fill) {}
  double& operator()(int64_t r, int64_t c) { return v[static_cast<size_t>(r * cols + c)]; }
  double operator()(int64_t r, int64_t c) const { return v[static_cast<size_t>(r * cols + c)]; }
  std::span<double> row(int64_t r) { return {v.data() + r * cols, static_cast<size_t>(cols)}; }
  std::span<const double> row(int64_t r) const { return {v.data() + r * cols, static_cast<size_t>(cols)}; }
};

// Where the reference rounds to the storage format, i.e. where vLLM's decode path writes a tensor to
// memory in bf16 (or the fp32 KDA state). Every point is a separate switch; vllm() turns all of them
// on except router_logits, none() turns all off (pure float64 math, for closed-form tests).
// GPU kernels that fuse several ops keep the intermediates in fp32 registers: compare them with the
// default (vllm()) at 1e-2 relative error; the differences are then one bf16 ulp per fused-away point.
struct Rounding {
  bool residual = true;        // bf16: the residual stream after each fused add (input / post-attention /
                               //   final norm: residual = h + residual, written back in bf16)
  bool norm = true;            // bf16: every RMSNorm output (input/post-attention/final norm,
                               //   kv_a_layernorm, q_a_layernorm, routed_expert_norm)
  bool norm_before_weight = true;  // the fused add + RMSNorm (input/post-attention/final norm) also
                               //   rounds x * rsqrt(mean + eps) to bf16 before the weight multiply, as
                               //   vLLM's fused_add_rms_norm kernel and HF's `weight * x.to(bf16)` do
  bool linear = true;          // bf16: every bf16 GEMM output (q/k/v/f_a/f_b/b/g_a/g_b/g projections,
                               //   q_proj, q_a/q_b, kv_a_proj, o_proj, MLP gate/up/down, expert w1/w3,
                               //   shared expert, latent down/up; the MoE router only with router_logits)
  bool conv = true;            // bf16: KDA short-conv output (after SiLU), causal_conv1d_update's output
  bool kda_out = true;         // bf16: KDA recurrent output o (the fused recurrent kernel writes bf16)
  bool gated_norm = true;      // bf16: FusedRMSNormGated output (input of KDA o_proj)
  bool mla_q_absorbed = true;  // bf16: q_nope . W_UK_T (torch.bmm output)
  bool mla_attn_out = true;    // bf16: o_lat, the MQA-over-latent kernel output
  bool mla_v_up = true;        // bf16: o_lat . W_UV per head (torch.bmm output, input of o_proj)
  bool mla_gate = true;        // bf16: K3 output gate product concat(o) * sigmoid(g)
  bool act = true;             // bf16: silu(gate)*up / SiTU output (SiluAndMul, fused_moe intermediate)
  bool moe_weighted = true;    // bf16: w_i * E_i(x), the fused-MoE second GEMM epilogue output
  bool moe_sum = true;         // bf16: sum over the top-k (moe_sum), and the routed_scaling product
  bool ffn_out = true;         // bf16: FFN output (routed + shared), and every all-reduce result
  bool kda_state = true;       // fp32: KDA recurrent state as stored (after each token)
  bool cache = true;           // bf16: conv-state and MLA latent-cache entries as stored
  bool attn_res = true;        // bf16: the K3 attention-residual mix h = sum pi_k b_k + pi_p p (the input of
                               //   the RMSNorm that follows it; the blocks and p are residual-stream values)
  bool router_logits = false;  // bf16 router logits (vLLM computes them in fp32; off by default)

  static Rounding vllm() { return {}; }
  static Rounding none();
};

// Rounds every element in place when `on`.
void round_bf16_if(bool on, std::span<double> x);
void round_bf16_if(bool on, Mat& m);

// y = x W^T: x [T, in], W [out, in] (row-major, PyTorch convention) -> [T, out]. Exact double sums.
Mat linear(const Mat& x, const Tensor& w);
// Same for a raw [out, in] row-major matrix.
Mat linear(const Mat& x, std::span<const double> w, int64_t out, int64_t in);

// RMSNorm(x) = x * rsqrt(mean(x^2) + eps) * w over one vector; the weight is used as is (no 1+w).
void rms_norm(std::span<const double> x, std::span<const double> w, double eps, std::span<double> out);

// vLLM's fused add + RMSNorm on [T, H] rows:
//   residual' = hidden + residual (or hidden when residual is absent: layer 0), rounded (residual);
//   x = RMSNorm(residual') rounded (norm).
struct AddNorm {
  Mat x;         // [T, H] normed
  Mat residual;  // [T, H] the new residual
};
AddNorm fused_add_rms_norm(const Mat& hidden, const Mat* residual, std::span<const double> w, double eps,
                           const Rounding& rnd);

// ---- KDA (model-family.md 3a) -------------------------------------------------------------------

// Forget gate (log-decay) of one channel:
//   Kimi-Linear: alpha = -exp(A_log) * softplus(f + dt_bias)            (softplus beta 1, threshold 20)
//   K3 (lower_bound set): alpha = lower_bound * sigmoid(exp(A_log) * (f + dt_bias))
double kda_alpha(double f, double dt_bias, double a_log, std::optional<double> lower_bound);

// One causal depthwise conv step of one channel: history = the K-1 previous pre-conv inputs, oldest
// first; w = the K taps (w[K-1] multiplies x_new). Returns silu(sum).
double kda_conv_step(std::span<const double> history, double x_new, std::span<const double> w);

// In place: x / sqrt(sum(x^2) + eps) * scale.
void l2_normalize(std::span<double> x, double eps, double scale = 1.0);

// One gated-delta-rule token on one head's state S [d_k][d_v] (k-major, S[k*d_v + v]):
//   S <- diag(exp(alpha)) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q.
// q and k already L2-normalised (q also scaled by d^-1/2). Writes o [d_v].
void kda_delta_step(std::span<double> S, std::span<const double> q, std::span<const double> k,
                    std::span<const double> v, std::span<const double> alpha, double beta, std::span<double> o);

// FusedRMSNormGated (sigmoid): out = RMSNorm_d(o) * w * sigmoid(g) over one head.
void gated_rms_norm(std::span<const double> o, std::span<const double> g, std::span<const double> w, double eps,
                    std::span<double> out);

// ---- MoE (model-family.md 3c) -------------------------------------------------------------------

struct Routing {
  std::vector<int64_t> experts;  // top-k expert ids, in order of decreasing selection score
  std::vector<double> weights;   // their weights: sigmoid scores, renormalised when configured
};
// Sigmoid router with correction bias for selection only, optional grouped stage
// (num_expert_group > 1: group score = sum of the top-2 biased scores in the group, keep topk_group
// groups), top-k by biased score (ties: the lower expert index first), weights = unbiased sigmoid
// scores of the chosen experts, renormalised to sum 1 when cfg.renormalize (no epsilon). The routed
// scaling factor is NOT applied here (vLLM Kimi-Linear applies it to the summed expert output).
Routing route(std::span<const double> logits, std::span<const double> correction_bias, const model::MoeConfig& cfg);

// ---- K3 block attention residuals (model-family.md 3d) ------------------------------------------

// h = sum_k pi_k b_k + pi_p p with pi = softmax over logits l = (x . w_eff) * rsqrt(mean(x^2) + eps)
// for each stored block x = b_k and for the partial sum x = p; w_eff = res_norm.weight * res_proj.weight.
// The mix is of the raw (un-normalised) vectors. With no blocks, h = p.
void attn_res_mix(std::span<const std::span<const double>> blocks, std::span<const double> p,
                  std::span<const double> w_eff, double eps, std::span<double> out);

// The attnres op (templates/attnres.h), the K3 form of the fused add + RMSNorm, on [T, H] rows:
//   p = hidden + residual, rounded (residual) (no residual: p = hidden, layer 0's embedding);
//   h = attn_res_mix(row t of every stored block, p, res_norm * res_proj, eps), rounded (attn_res);
//   push: p is appended to `blocks` as the newest block and the partial sum restarts at 0: the
//         returned residual is 0 (otherwise it is p);
//   x = RMSNorm(h) * weight, rounded like fused_add_rms_norm (norm, norm_before_weight).
// blocks: the stored blocks, oldest first, each [T, H] (bf16 values as stored). res_proj is the [1, H]
// projection's data. eps serves both the mix's inv_rms and the norm (rms_norm_eps).
AddNorm attn_res_add_norm(const Mat& hidden, const Mat* residual, std::vector<Mat>& blocks, bool push,
                          std::span<const double> res_norm, std::span<const double> res_proj,
                          std::span<const double> weight, double eps, const Rounding& rnd);

}  // namespace dp::ref
