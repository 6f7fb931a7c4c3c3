// The float64 CPU reference of ONE decode step of a Kimi-Linear / Kimi-K3 decoder layer, with vLLM's
// decode-step semantics (model-family.md 3.0-3.c, DESIGN.md section 7 "Contract of a layer program").
// GPU tests and `decodepack run --check` compare kernels against it: bf16 paths at 1e-2 relative error,
// the fp32 KDA state at 1e-4.
//
// Inputs and outputs
//   hidden_states, residual: Mat [W*q, H], bf16 values, rows request-major (row t = r*q + i is draft
//   position i of request r). `residual` is absent for layer 0 (vLLM: residual = None).
//   The layer returns vLLM's new pair: hidden = the FFN output, residual = the residual after the
//   post-attention add. The final norm of the model is final_norm(hidden, residual).
//
// Layer:  residual = hidden + residual (bf16);  x  = RMSNorm_in(residual)      (fused add + norm)
//         a = Mixer(x)  [KDA or MLA; o_proj; all-reduce under TP]
//         residual = a + residual (bf16);       x2 = RMSNorm_post(residual)
//         hidden = FFN(x2) [dense MLP, MoE or K3 latent MoE; all-reduce under TP]
// Every RMSNorm here: x * rsqrt(mean(x^2) + eps) * w (eps = rms_norm_eps), computed exactly, rounded
// to bf16 at the output (Rounding::norm). The rounding points are listed in ops.h (struct Rounding).
//
// Tensor parallelism: every function taking one LayerWeights computes that rank's SHARD (heads of
// KDA/MLA, intermediate features of the MLPs and experts divided as the IR's Split rules say); its
// o_proj / down_proj / expert output is then the rank's PARTIAL SUM, which vLLM all-reduces. The
// decoder_layer_tp() composition sums the partials of all ranks (the all-reduce, rounded as
// Rounding::ffn_out) between the stages, so its result is the TP=1 result up to rounding.
//
// K3 (attn_res_block B > 0, model-family.md 3d): block attention residuals replace the plain residual.
// The pair keeps its meaning with `residual` = the partial sum p of the current block (without this
// layer's FFN output, which the next layer adds, as the plain form defers its residual add), and the
// step carries the stored blocks across its layers in an AttnResState (the device's attn_res buffer):
//   p = hidden + residual (bf16);  h = Mix(blocks, p; self_attention_res) (bf16)
//   if layer % B == 0: push p (the new block), p = 0            (layer 0 stores the embedding)
//   x = RMSNorm_in(h);  a = Mixer(x)
//   p = a + p (bf16);  h2 = Mix(blocks, p; mlp_res) (bf16);  x2 = RMSNorm_post(h2)
//   hidden = FFN(x2);  residual = p
// and the model closes with final_norm_attn_res: p = hidden + residual; h = Mix(blocks, p;
// output_attn_res); RMSNorm_final(h). Mix: attn_res_add_norm in ops.h (w_eff = res_norm * res_proj,
// logits (x . w_eff) * rsqrt(mean(x^2) + eps), softmax over the blocks and p, h = sum pi x).
//
// Not modelled: decode context parallelism, fp8 KV caches, RoPE (Kimi MLA is NoPE).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "reference/ops.h"
#include "reference/weights.h"

namespace dp::ref {

inline constexpr int64_t kNullBlockId = 0;  // vLLM NULL_BLOCK_ID: a padded request's KDA state slot
inline constexpr int64_t kPadSlotId = -1;   // vLLM PAD_SLOT_ID: a token whose latent is not written

// The metadata of one decode step (vLLM attention metadata of a uniform decode batch), per request.
struct StepMeta {
  int64_t num_requests = 0;  // W
  int64_t q = 1;             // rows per request: 1 + num_speculative_tokens

  // ---- KDA layers (the Mamba-type KV-cache group) ----
  // kda_slots[r]: state slots of request r, one per draft position ([W][q]; vLLM's mamba block-table
  // row block_table[r, 0:q]; q = 1: the single slot block_table[r, 0]). A request whose first slot is
  // kNullBlockId (0) is PADDED: its KDA states are neither read nor written and its KDA output rows
  // are zero (vLLM zero-fills the recurrent output; RMSNorm(0) = 0; o_proj(0) = 0). Any write to
  // slot 0 is skipped as well.
  std::vector<std::vector<int64_t>> kda_slots;
  // num_accepted[r] in 1..q: tokens of request r accepted in the previous step (1 without spec decode;
  // vLLM pads with 1).
  std::vector<int64_t> num_accepted;

  // ---- MLA layers (the attention KV-cache group) ----
  std::vector<std::vector<int64_t>> block_table;  // [W][blocks]: physical block of logical block b
  std::vector<int64_t> seq_lens;                  // [W]: tokens of request r including its q new ones; 0 = padded
                                                  //   request (no attention, no cache write, zero MLA output rows)
  std::vector<int64_t> slot_mapping;              // [W*q]: cache slot (block*block_size + offset) of each new
                                                  //   token; kPadSlotId (-1) = not written

  int64_t rows() const { return num_requests * q; }
  // vLLM-consistent metadata for tests: request r gets KDA slots kda_slot_base + r*q + i (i < q), blocks
  // [first_block + r*blocks_per_req, ...) and the slot mapping that follows from them.
  static StepMeta simple(int64_t num_requests, int64_t q, const std::vector<int64_t>& seq_lens, int64_t block_size,
                         int64_t blocks_per_request, int64_t first_block = 1, int64_t kda_slot_base = 1);
};

// How a spec-decode step (q > 1) reads and writes the KDA conv state. [version-dependent in vLLM]
enum class ConvSpecLayout {
  // Default. The conv state is [slots][dim][K-1] like the recurrent state: one slot per draft position.
  // Token i reads the history left by token i-1 (token 0: slot kda_slots[r][num_accepted-1]) and
  // writes its own history (the last K-1 inputs up to and including x_i) to kda_slots[r][i].
  // This matches vLLM's kda_state_shape, whose conv state is K-1 wide whatever num_spec.
  per_slot,
  // vLLM's GDN layout: one slot per request (kda_slots[r][0]) holding K-2+q inputs, oldest first.
  // The history of token 0 is state[off .. off+K-2], off = num_accepted-1; the state is rewritten as
  // [state[off+1 .. off+K-2], x_0 .. x_{q-1}]. For q = 1 both layouts are the same.
  window,
};

// KDA states of one layer on one rank (heads and channels are the rank's shard).
struct KdaState {
  int64_t num_slots = 0;
  int64_t heads = 0;       // h / tp
  int64_t head_dim = 0;    // d (d_k = d_v = d)
  int64_t conv_dim = 0;    // P / tp = heads * head_dim channels, per conv tensor
  int64_t conv_width = 0;  // K-1 (per_slot, and q = 1), or K-2+q (window)
  // [num_slots][heads][d_k][d_v], k-major (S[k][v], FLA fused_recurrent layout), fp32 values.
  std::vector<double> recurrent;
  // [num_slots][conv_dim][conv_width], oldest input first, bf16 values: the PRE-conv projection outputs.
  std::vector<double> conv_q, conv_k, conv_v;

  static KdaState zeros(const model::Model& m, Shard shard, int64_t num_slots, int64_t conv_width);
  // The conv width a layout needs: K-1 (per_slot, or q = 1), K-2+q (window).
  static int64_t conv_width_for(const model::Model& m, ConvSpecLayout layout, int64_t q);
  std::span<double> slot_state(int64_t slot, int64_t head);                            // [d_k * d_v]
  std::span<double> conv(int which /*0 q, 1 k, 2 v*/, int64_t slot, int64_t channel);  // [conv_width]
};

// The MLA latent cache of one layer (one rank's copy: the latent is replicated under TP).
struct MlaCache {
  int64_t num_blocks = 0;
  int64_t block_size = 0;
  int64_t row = 0;  // L + R: [c (kv_lora_rank, normed) | k_pe (qk_rope_head_dim, raw)]
  // [num_blocks][block_size][row], bf16 values.
  std::vector<double> data;

  static MlaCache zeros(const model::Model& m, int64_t num_blocks, int64_t block_size);
  std::span<double> slot(int64_t slot);  // [row]
};

// The state a layer reads and updates: kda for KDA layers, mla for MLA layers.
struct LayerState {
  KdaState kda;
  MlaCache mla;
};

// K3 block attention residuals: what one decode step carries from layer to layer (replicated on every
// TP rank). Starts empty at layer 0; layer i expects attn_res_blocks(i, B) blocks on entry.
struct AttnResState {
  std::vector<Mat> blocks;  // the stored blocks, oldest first, each [W*q, H] (bf16 values)
};

// Blocks stored before `layer`'s first mix (and before the final mix when layer = num_layers): the
// layers j < layer with j % block == 0. Layer `layer`'s second mix sees attn_res_blocks(layer + 1, block).
constexpr int64_t attn_res_blocks(int64_t layer, int64_t block) { return (layer + block - 1) / block; }

struct Options {
  Rounding rounding = Rounding::vllm();
  ConvSpecLayout conv_spec = ConvSpecLayout::per_slot;
  double l2norm_eps = 1e-6;            // KDA q/k L2 normalisation
  double kda_onorm_eps = 1e-5;         // FusedRMSNormGated (layer default, not read from the config)
  std::optional<double> mla_norm_eps;  // kv_a / q_a layernorm eps (default: rms_norm_eps)
};

// Named intermediates of one layer step, for op-level comparisons and debugging (optional).
// Keys: "x" (normed input), "residual", "mixer_out"; KDA "q", "k", "v" (projections, [T, P]),
// "q_conv", "k_conv", "v_conv", "f", "alpha" ([T, P]), "beta" ([T, h]), "g" ([T, P]), "o" ([T, P]),
// "o_gated" ([T, P]); MLA "q" ([T, N*(Pn+R)]), "kv" ([T, L+R]), "c" ([T, L]), "ql" ([T, N*L]),
// "o_lat" ([T, N*L]), "o_heads" ([T, N*V], after the K3 gate), "mla_gate" ([T, N*V], K3 gate logits);
// FFN "x2", "residual2", "router_logits" ([T, E]), "topk_ids", "topk_weights" ([T, k]), "routed"
// ([T, D], rank partial), "shared" ([T, H]), K3 "latent" ([T, D]) and "latent_up" ([T, H]), "ffn_out".
// Under TP the per-rank entries are those of the last rank run.
struct Trace {
  std::map<std::string, Mat> t;
  void put(const std::string& name, const Mat& m) { t[name] = m; }
  const Mat& at(const std::string& name) const;
};

// ---- stages, one rank ----

// KDA mixer (model-family.md 3a) on x [T, H] (normed): projections, short conv, gates, delta rule,
// gated RMSNorm, o_proj. Returns [T, H], the rank's partial o_proj output. Updates `state`.
Mat kda_mixer(const LayerWeights& w, const Mat& x, const StepMeta& meta, KdaState& state, const Options& opt,
              Trace* trace = nullptr);

// MLA mixer (model-family.md 3b): q (or q-LoRA), kv_a + kv_a_layernorm, latent-cache write at
// slot_mapping, absorbed attention over positions 0..pos of the request (pos = seq_len - q + i: causal
// within the request's new rows), W_UV, optional K3 output gate, o_proj. The cache is written for
// all rows before any row attends (as vLLM does). Returns [T, H] (partial under TP).
Mat mla_mixer(const LayerWeights& w, const Mat& x, const StepMeta& meta, MlaCache& cache, const Options& opt,
              Trace* trace = nullptr);

// Dense MLP: down(act(gate x, up x)), act = silu(g)*u (or K3 SiTU). [T, H] partial under TP.
Mat dense_mlp(const LayerWeights& w, const Mat& x, const Options& opt, Trace* trace = nullptr);

// Kimi-Linear MoE: routed experts (route() in ops.h) * routed_scaling + shared expert. [T, H] partial
// under TP. For K3 latent MoE use ffn() (it needs the cross-rank latent sum before its norm).
Mat moe(const LayerWeights& w, const Mat& x, const Options& opt, Trace* trace = nullptr);

// The FFN of the layer over all ranks (one LayerWeights per rank, ranks in order), all-reduced.
// Latent MoE (K3): latent = W_down_lat x; experts in the latent width; sum * routed_scaling; all-reduce;
// routed_expert_norm (when configured); W_up_lat; + shared expert (all-reduced).
Mat ffn(std::span<const LayerWeights* const> ranks, const Mat& x, const Options& opt, Trace* trace = nullptr);

// The second half of a layer, from the residual stream after the post-attention add (K3: the partial
// sum p): x2 = RMSNorm_post(residual) (K3: the mlp_res mix of the stored blocks, as they stand after
// this layer's push, and p; then the norm), hidden = ffn(ranks, x2). decoder_layer_tp computes the same
// from its own residual, bit for bit. `run --check` feeds it the GPU's residual output, so a layer's
// FFN half is compared on the GPU's own input (as every layer is compared on the GPU's own layer
// input) instead of compounding the mixer half's rounding differences into it. `attn_res` is the
// step's block state after the layer ran (K3), null otherwise. Trace keys: "x2", "residual2",
// "ffn_out" and the FFN's.
Mat post_attention_ffn(std::span<const LayerWeights* const> ranks, const Mat& residual, const Options& opt = {},
                       Trace* trace = nullptr, const AttnResState* attn_res = nullptr);

// ---- whole layers ----

struct LayerOutput {
  Mat hidden;    // [W*q, H] the FFN output (bf16 values)
  Mat residual;  // [W*q, H] the residual after the post-attention add
};

// One decoder layer at TP=1 (w.shard().tp must be 1). K3 (attn_res_block > 0) needs `attn_res`, the
// step's block state (updated: the layer may push a block); other models take none.
LayerOutput decoder_layer(const LayerWeights& w, const Mat& hidden, const Mat* residual, const StepMeta& meta,
                          LayerState& state, const Options& opt = {}, Trace* trace = nullptr,
                          AttnResState* attn_res = nullptr);

// One decoder layer over tp ranks: ranks[i] holds rank i's shard (Shard{tp, i}), states[i] its state.
// Partial mixer and FFN outputs are summed across ranks (the all-reduce).
LayerOutput decoder_layer_tp(std::span<const LayerWeights* const> ranks, const Mat& hidden, const Mat* residual,
                             const StepMeta& meta, std::span<LayerState* const> states, const Options& opt = {},
                             Trace* trace = nullptr, AttnResState* attn_res = nullptr);

// The model's final norm: RMSNorm(hidden + residual) * w (fused add + norm; the bf16 output).
Mat final_norm(const model::Model& m, const Mat& hidden, const Mat& residual, std::span<const double> norm_weight,
               const Options& opt = {});

// K3's close of the model: p = hidden + residual; h = Mix(blocks, p; output_attn_res_norm/proj); the
// final norm of h (attn_res_add_norm without a push). `st` must hold attn_res_blocks(num_layers, B).
Mat final_norm_attn_res(const model::Model& m, const Mat& hidden, const Mat& residual, const AttnResState& st,
                        std::span<const double> res_norm, std::span<const double> res_proj,
                        std::span<const double> norm_weight, const Options& opt = {});

// Relative error ||a - b|| / ||b|| (Frobenius); NaN anywhere gives +inf. Rows with mask[t] == false are
// skipped when a mask is given (padded requests' rows are don't-care for a kernel).
double rel_error(std::span<const double> a, std::span<const double> b);
double rel_error(const Mat& a, const Mat& b, const std::vector<bool>* row_mask = nullptr);

// Rows that carry a real request for a layer of this mixer (KDA: first state slot != 0; MLA: seq_len > 0).
std::vector<bool> valid_rows(const StepMeta& meta, model::Mixer mixer);

}  // namespace dp::ref
