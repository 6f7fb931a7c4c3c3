// The HBM traffic one decode step must make, layer by layer and kernel by kernel: the numerator of
// every "share of the ceiling" that `decodepack bench` reports (DESIGN.md section 9, issue 14).
//
// Unlike `plan`, which assumes the worst case (min(E, rows x top_k) distinct experts per MoE layer, every
// request at --context tokens), these functions count what one real step touched: the distinct experts
// its rows were routed to, and each request's own sequence length. Everything a step must move at least
// once is counted, reads and writes alike:
//   weights       every non-expert weight of the layer that decode reads (norms, projections, conv
//                 taps, gates, router, shared expert), plus one expert's w1 + w3 + w2 per distinct
//                 routed expert, each in its stored dtype: an FP8 block-quantized weight is one byte
//                 per e4m3 value, and its fp32 scale tensor (a weight of its own in the IR, with the
//                 weight's layer and expert) is counted beside it;
//   KDA states    per request the recurrent and conv states read from one slot and written to q slots;
//   MLA latent    per request seq_len rows read (the attention reads the whole context, this step's
//                 rows included) and q rows written;
//   activations   the [rows, H] bf16 rows in (hidden, and residual after layer 0) and out (out,
//                 residual_out). Scratch that stays inside a layer program (workspace) is not counted.
// Tensor parallelism 1 and decode context parallelism 1 (the bench runs one GPU).
#pragma once

#include <cstdint>
#include <vector>

#include "format/manifest.h"
#include "model/ir.h"

namespace dp::bench {

// Bytes per element of the caches, from the deploy config (kda_state, conv_state, kv_cache dtypes).
struct CacheElems {
  uint64_t state = 4;  // KDA recurrent state (fp32)
  uint64_t conv = 2;   // KDA conv state (bf16)
  uint64_t kv = 2;     // MLA latent cache (bf16)
};

// What one step of one layer touched.
struct StepTraffic {
  int64_t q = 1;                 // rows per request
  std::vector<int64_t> seq_lens; // per real request: its tokens including this step's q rows
  int64_t routed_experts = 0;    // distinct experts the step's rows were routed to (MoE layers)
  int64_t rows() const { return q * static_cast<int64_t>(seq_lens.size()); }
};

struct Bytes {
  uint64_t dense_weights = 0;
  uint64_t expert_weights = 0;
  uint64_t state_read = 0, state_write = 0;
  uint64_t kv_read = 0, kv_write = 0;
  uint64_t act_read = 0, act_write = 0;

  uint64_t weights() const { return dense_weights + expert_weights; }
  uint64_t total() const;
  Bytes& operator+=(const Bytes& o);
};

// One expert's w1 + w3 + w2 bytes in layer `layer` (0 for a dense layer).
uint64_t expert_bytes(const model::Model& m, int layer);

// Everything one step of decoder layer `layer` must move. dp::Error(input) for a layer index out of range.
Bytes layer_bytes(const model::Model& m, int layer, const CacheElems& e, const StepTraffic& t);

// The final norm of the model: reads hidden + residual and the norm weight, writes out + residual_out.
Bytes final_norm_bytes(const model::Model& m, int64_t rows);

// One kernel of layer `layer`'s program (a manifest program step): the bytes its bound arguments name.
// A weight argument counts the weight (an expert group counts t.routed_experts experts of it); a cache
// argument counts the slots or rows the kernel reads or writes: the KDA state and conv caches are read
// and written for the step's slots by the kernel that gets the state indices; the MLA latent is read
// (every request's seq_len rows) by the kernel that gets the block table and written (q rows per
// request) by the kernel that gets the slot mapping; io rows (hidden, residual in; out, residual_out
// out) count [rows, H] bf16 each. Workspace arguments count nothing. Two kernels naming the same weight
// both count it, so the kernels of a layer may sum to more than layer_bytes().
Bytes kernel_bytes(const model::Model& m, int layer, const format::ProgramStepEntry& step, const CacheElems& e,
                   const StepTraffic& t);

}  // namespace dp::bench
