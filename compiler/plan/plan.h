// The build plan: everything `decodepack build` will produce for a (model, deploy) pair, computed
// without a GPU or a compiler. `decodepack plan` prints it; the bundle writer records it.
//
// Per rank: the layers and their layer class, each weight's TP shard (dimension, range, bytes), the
// bytes one decode step reads at each width, the L2 prefetch points, and the workspace sizes. Across
// ranks: the kernel instances to build (layer class x width x q x target), named deterministically.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "codegen/kernel.h"
#include "common/json.h"
#include "deploy/deploy.h"
#include "model/ir.h"
#include "plan/program.h"

namespace dp::plan {

// What one decoder layer's program replaces: its mixer and FFN (final_norm closes the model).
enum class LayerClass { kda_dense, kda_moe, kda_latent_moe, mla_dense, mla_moe, mla_latent_moe, final_norm };
const char* to_string(LayerClass c);
LayerClass layer_class(const model::LayerSpec& l);

// One kernel to build: one code object (an op of templates/ specialised for a width and shape) for one
// target. Layer programs, the final norm and the prefetch tables launch them. `params` are the
// compile-time constants (for display); `name` is codegen::kernel_name: the symbol, the file stem and
// the manifest key (with ".<target>" appended).
struct KernelInstance {
  std::string op;                                      // "rmsnorm", "gemm", "kda_step", "prefetch", ...
  std::vector<std::pair<std::string, int64_t>> params;  // e.g. {"w",4},{"h",2304}
  std::string target;                                  // "sm_90a", "gfx942"
  std::string name;
  std::string role;                                    // "final_norm", "lm_head", "prefetch", "layer" (programs only), "indexer"
  int64_t width = 0;                                   // requests; 0 for width-independent kernels
  codegen::KernelInstance codegen;
  int64_t param(std::string_view key) const;           // -1 when absent
};

struct WeightShard {
  size_t weight = 0;        // index into Model::weights
  std::string name;         // checkpoint name; expert tensors are grouped as "...experts.{e}.w1.weight"
  int64_t experts = 0;      // > 0: this entry stands for that many per-expert tensors of equal shape
  int split_dim = -1;       // -1: replicated
  int64_t begin = 0, end = 0;  // range along split_dim held by the rank (whole dim when replicated)
  std::vector<int64_t> shape;  // the shard's shape
  uint64_t bytes = 0;       // per tensor (per expert when experts > 0)
};

struct StepBytes {
  int64_t width = 0;
  uint64_t weights = 0;      // weights read: routed experts counted as min(E, rows*top_k) distinct per layer
  uint64_t state_read = 0;   // KDA recurrent + conv states read
  uint64_t state_write = 0;  // and written back
  uint64_t kv_read = 0;      // MLA latent cache read at the planned context length
  uint64_t kv_write = 0;     // new cache rows
  uint64_t activations = 0;  // layer inputs and outputs
  uint64_t total_read() const { return weights + state_read + kv_read + activations; }
};

struct PrefetchRange {
  size_t weight = 0;  // index into Model::weights
  std::string name;
  uint64_t bytes = 0; // bytes of the shard pulled (after the cap)
};

// One prefetch table: at `point` of `layer`, for these widths, pull these ranges into L2.
struct PrefetchTable {
  std::string point;             // "attention_oproj" | "oproj_down" | "attention_moe" | "next_attention"
  int layer = 0;
  std::vector<int64_t> widths;
  bool critical = false;         // highest stream priority, largest shared-memory carveout
  int grid = 32;                 // blocks of the prefetch kernel (32 threads each)
  std::vector<PrefetchRange> ranges;
  uint64_t bytes() const;
};

struct Workspace {
  int64_t width = 0;
  uint64_t bytes = 0;            // device scratch one step at this width needs, 256-byte aligned parts
};

struct LayerPlan {
  int index = 0;
  model::Mixer mixer;
  model::Ffn ffn;
  LayerClass cls;
};

struct RankPlan {
  int64_t rank = 0;
  std::vector<LayerPlan> layers;
  std::vector<WeightShard> shards;
  uint64_t weight_bytes = 0;     // everything the rank holds (all experts)
  std::vector<StepBytes> step_bytes;
  std::vector<PrefetchTable> prefetch;
  std::vector<Workspace> workspace;
};

inline constexpr int64_t kMaxContext = int64_t{1} << 24;  // tokens: far above any context window

struct PlanOptions {
  int64_t context = 4096;        // tokens per request assumed for the KV bytes of step_bytes (1..kMaxContext)
};

struct Plan {
  PlanOptions options;
  std::vector<RankPlan> ranks;
  std::vector<KernelInstance> kernels;  // sorted by (target, name); the same for every rank
  // One per (layer class of the model, width), sorted by (class name, width); unavailable ones carry
  // the reason and no steps. The same for every rank and target.
  std::vector<LayerProgram> programs;
};

// The indexer prefill kernels (templates/indexer.h) for a model with an indexer: idx_quant, idx_pack,
// idx_stage, idx_score{NH}, idx_topk{K}, idx_rows. indexer_kernel_gap says why a model's indexer has no
// kernels ("" when it has them; every model without an indexer gets "the model has no indexer").
std::vector<codegen::KernelInstance> indexer_kernel_instances(const model::Model& m);
std::string indexer_kernel_gap(const model::Model& m);
inline bool indexer_kernels_supported(const model::Model& m) { return indexer_kernel_gap(m).empty(); }

// The LM head's GEMM at `width` (op gemm, W = width x q, K = hidden, NA = the rank's vocabulary rows,
// F = 1: fp32 logits), role "lm_head" (format 1.5). lm_head_kernel_gap says why a width has none ("" when
// it has one): more rows than one GEMM launch takes, or a vocabulary that tensor_parallel does not divide.
std::string lm_head_kernel_gap(const model::Model& m, const deploy::Deploy& d, int64_t width);
codegen::KernelInstance lm_head_kernel(const model::Model& m, const deploy::Deploy& d, int64_t width);

// Checks the deploy against the model first (deploy::check_against_model), then plans.
Plan make_plan(const model::Model& m, const deploy::Deploy& d, const std::string& deploy_where,
               const PlanOptions& opt = {});

// The weights a rank's bundle table lists (decode weights; the embeddings and LM head stay with the
// host), counted as README.md "Weight counts" names them: entries as a host binds them (an expert group
// is one entry: dp_bundle_weight_count), the tensors they hold (each expert counted) and their bytes.
struct DecodeWeights {
  uint64_t entries = 0, tensors = 0, bytes = 0;
};
DecodeWeights decode_weights(const RankPlan& r, const model::Model& m);

Json to_json(const Plan& p, const model::Model& m, const deploy::Deploy& d);
std::string to_text(const Plan& p, const model::Model& m, const deploy::Deploy& d);

}  // namespace dp::plan
