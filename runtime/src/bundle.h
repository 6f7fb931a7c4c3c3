// dp_bundle: an open, verified bundle plus what the runtime derives from its manifest once (the deploy
// settings, the model shapes the caches follow, each rank's weight index). Immutable after open, so
// any number of sessions and threads may read it.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "decodepack/decodepack.h"
#include "format/bundle_reader.h"
#include "src/status.h"

namespace dp::rt {

// The model shapes and deploy settings the caches and planner depend on.
struct DeploySettings {
  int tensor_parallel = 1;
  int q = 1;                                   // 1 + num_speculative_tokens
  std::vector<int32_t> ranks, widths;          // sorted
  std::vector<std::string> targets;            // sorted
  dp_dtype kv_dtype = DP_DTYPE_BF16;           // MLA latent cache element
  int64_t block_size = 64;
  std::string kda_state_layout = "kv";
  dp_dtype conv_dtype = DP_DTYPE_BF16;
  std::string conv_layout = "sd";
  // Model (from model.details)
  int64_t kda_heads = 0, kda_head_dim = 0, conv_kernel = 0;
  int64_t mla_kv_lora_rank = 0, mla_rope_dim = 0;
  // K3 block attention residuals (attn_res_block 0: none): the attn_res buffer is [rows, blocks, hidden].
  int64_t attn_res_block = 0, attn_res_blocks = 0, hidden = 0;
  // Sparse-attention indexer (read only when the manifest has one): deploy dcp and indexer limits.
  int64_t dcp_size = 1, dcp_interleave = 1;
  int64_t indexer_max_keys = 0, indexer_max_requests = 0;
};

// One weight of a rank, as the manifest lists it, with its dtype parsed.
struct WeightSpec {
  const format::WeightEntry* entry = nullptr;
  dp_dtype dtype = DP_DTYPE_INVALID;
};

struct RankWeights {
  int32_t rank = 0;
  std::vector<WeightSpec> weights;            // manifest order
  std::map<std::string, size_t> by_name;      // exact names, groups with "{e}"
  std::vector<std::string> names;             // for dp_weight_info.name (stable storage)
};

// Parses "BF16" (safetensors) or "bf16" / "float32" / "fp8" (deploy spellings); DP_DTYPE_INVALID if unknown.
dp_dtype dtype_from_name(const std::string& s);

}  // namespace dp::rt

struct dp_bundle {
  std::atomic<int> refs{1};
  dp::format::BundleReader reader;
  dp::rt::DeploySettings deploy;
  std::vector<dp::rt::RankWeights> ranks;
  std::vector<const char*> target_names;  // points into deploy.targets, for dp_bundle_info
  std::string tool_version, model_type;
  std::string deploy_json;  // the manifest's deploy block as compact JSON text, for dp_bundle_info

  const dp::format::Manifest& manifest() const { return reader.manifest(); }
  // The weights of `rank`, or nullptr if the bundle has no such rank.
  const dp::rt::RankWeights* rank_weights(int32_t rank) const;

  // Opens and verifies (bundle_reader), then derives the tables above. Never throws.
  static dp::rt::Result<dp_bundle*> open(const std::string& path);
  void retain() { refs.fetch_add(1, std::memory_order_relaxed); }
  void release() {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) delete this;
  }
};
