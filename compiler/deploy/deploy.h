// The deployment config: what a bundle is built for (targets, tensor parallelism, batch widths,
// speculative decoding, cache formats, prefetch caps, indexer limits).
//
// A deploy file is JSON (schema: manifests/deploy.schema.json; example: manifests/deploy-default.json):
//
//   { "targets": ["sm_90a", "gfx942"], "tensor_parallel": 1, "max_num_seqs": 8,
//     "num_speculative_tokens": 0, "kv_cache": {"dtype": "bf16", "block_size": 64} }
//
// `targets` and one of `max_num_seqs` / `widths` are required; every other field has a default, and
// where vLLM has a default for the same setting we use vLLM's, so that a bundle built from a short
// deploy file matches a vLLM host started with default flags. Unknown fields are errors (they are
// almost always typos), and every error names the file, the field, the value and what would be valid.
//
// parse_deploy checks everything that depends on the deploy file alone; check_against_model adds the
// checks that need the model (tensor parallelism dividing heads, experts, widths of every split weight).
#pragma once

#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/json.h"
#include "format/deploy_limits.h"

namespace dp::model {
struct Model;
}

namespace dp::deploy {

// ---- Targets ---------------------------------------------------------------------------------------

enum class Vendor { cuda, hip };
const char* to_string(Vendor v);  // "cuda", "hip"

// One GPU architecture decodepack can compile for. The minimum toolchain versions are those whose
// device compiler first knew the architecture; the backend compares them with what it finds.
struct TargetInfo {
  std::string_view name;    // "sm_90a", "gfx942": the spelling nvcc --gpu-architecture / clang --offload-arch take
  Vendor vendor;
  int min_cuda_major = 0;   // CUDA only: first CUDA toolkit that targets it
  int min_cuda_minor = 0;
  int min_llvm_major = 0;   // HIP only: first LLVM release whose AMDGPU backend knows the processor
  std::string_view gpus;    // examples, for messages and `decodepack doctor`
};

// Sorted by name. Lookup returns nullptr for an unknown name.
std::span<const TargetInfo> known_targets();
const TargetInfo* find_target(std::string_view name);

// ---- Config ----------------------------------------------------------------------------------------

// Cache and state element types and layouts. Names are the JSON spellings (see to_string below).
enum class KvCacheDtype { bf16, fp8 };      // fp8: e4m3 with a per-tensor scale (vLLM "fp8")
enum class KdaStateDtype { float32 };       // vLLM always keeps the KDA recurrent state in fp32
enum class KdaStateLayout { kv, vk };       // kv: [heads, k, v] (FLA / vLLM); vk: [heads, v, k]
enum class ConvStateDtype { bf16, float32 };
enum class ConvStateLayout { sd, ds };      // sd: [K-1, dim] (vLLM default); ds: [dim, K-1]

const char* to_string(KvCacheDtype d);
const char* to_string(KdaStateDtype d);
const char* to_string(KdaStateLayout l);
const char* to_string(ConvStateDtype d);
const char* to_string(ConvStateLayout l);

// The element type a cache holds, as the checkpoint dtype enum names it.
DType element_dtype(KvCacheDtype d);   // BF16 | F8_E4M3
DType element_dtype(KdaStateDtype d);  // F32
DType element_dtype(ConvStateDtype d); // BF16 | F32

// MLA latent cache (one [L + R] row per token, paged).
struct KvCache {
  KvCacheDtype dtype = KvCacheDtype::bf16;  // vLLM kv_cache_dtype "auto" = the model dtype, bf16
  // Tokens per page as the attention kernels see it (vLLM's kernel block size). 64 is FlashMLA's
  // block and vLLM's choice for MLA on Hopper; it must be a multiple of 16 (the MMA tile of every
  // split-KV attention kernel).
  int64_t block_size = 64;
  bool operator==(const KvCache&) const = default;
};

// KDA recurrent state, [heads/tp, d, d] per request and KDA layer.
struct KdaState {
  KdaStateDtype dtype = KdaStateDtype::float32;
  KdaStateLayout layout = KdaStateLayout::kv;
  bool operator==(const KdaState&) const = default;
};

// KDA short-convolution state: the last K-1 inputs of q, k and v per request and KDA layer.
struct ConvState {
  ConvStateDtype dtype = ConvStateDtype::bf16;   // vLLM mamba_cache_dtype "auto" = model dtype
  ConvStateLayout layout = ConvStateLayout::sd;  // vLLM VLLM_SSM_CONV_STATE_LAYOUT default "SD"
  bool operator==(const ConvState&) const = default;
};

// Decode context parallelism (vLLM decode_context_parallel_size / cp_kv_cache_interleave_size):
// the MLA cache's tokens are spread over `size` of the TP ranks, token p on rank (p / interleave) % size.
struct Dcp {
  int64_t size = 1;
  int64_t interleave = 1;
  bool operator==(const Dcp&) const = default;
};

// L2 weight prefetch on a side stream (runtime/ prefetch controller). Caps bound the bytes one
// prefetch point may pull per layer on each rank.
struct Prefetch {
  bool enabled = true;
  // Cap for a width without an override. 24 MiB: the K3 vLLM module's cap before the attention
  // all-reduce, and under half of an H100/H200's 50 MB L2, so the prefetch does not evict the lines the
  // running kernels still read.
  int64_t cap_bytes = 24 << 20;
  // Widths whose rows (width * q) exceed this get no prefetch unless overridden: above 8 rows the
  // HBM-bound expert GEMMs lose more bandwidth than the attention gains (vLLM K3: rows <= 8).
  int64_t max_rows = 8;
  // Per-width caps that replace the rule above; 0 turns prefetch off at that width.
  std::map<int64_t, int64_t> width_cap_bytes;
  // The points the plan makes tables for (format::kPrefetchPoints names, in that order). Default from
  // measurement: none at tensor_parallel 1, where no point paid on the H200 at widths 1-8 (bench
  // --prefetch sweep: every point within noise of prefetch off; bench/NOTES.md); at TP 2-8 the K3 vLLM
  // module's oproj_down, attention_moe and next_attention (not measured here).
  std::vector<std::string> points;
  bool operator==(const Prefetch&) const = default;
};

// Limits of the sparse-attention indexer's prefill path (DeepSeek-V3.2-style DSA models; the Kimi
// models have no indexer, and then these only size nothing). They bound the prefill workspace
// (indexer/workspace.h). With dcp.size > 1 the staged all-gather, dcp.size x (ceil(max_keys_per_chunk /
// dcp.size) + max_requests x dcp.interleave) key rows, must stay within int32 (checked).
struct Indexer {
  // Keys one prefill chunk may hold. vLLM sizes its buffer as max_model_len * 40; this default is that
  // for a 160K-token context (DeepSeek-V3.2's 163840).
  int64_t max_keys_per_chunk = 40 * 163840;
  // Requests in one prefill chunk: vLLM's max_num_seqs default on H100/H200-class GPUs.
  int64_t max_requests = 1024;
  bool operator==(const Indexer&) const = default;
};

struct Deploy {
  std::vector<std::string> targets;  // sorted, unique, each in known_targets()
  int64_t tensor_parallel = 1;       // 1, 2, 4 or 8 (vLLM tensor_parallel_size default 1)
  std::vector<int64_t> ranks;        // ranks to build, sorted, unique, each < tensor_parallel
  std::vector<int64_t> widths;       // batch widths (requests per step), sorted, unique, 1..kMaxWidth
  int64_t num_speculative_tokens = 0;  // 0..kMaxSpeculativeTokens (vLLM default: no spec decode)
  KvCache kv_cache;
  KdaState kda_state;
  ConvState conv_state;
  Dcp dcp;
  Prefetch prefetch;
  Indexer indexer;

  // Query rows per request in a decode or spec-verify step (vLLM uniform_decode_query_len).
  int64_t q() const { return 1 + num_speculative_tokens; }
  int64_t max_width() const { return widths.empty() ? 0 : widths.back(); }
  // Effective prefetch cap at `width` in bytes; 0 means no prefetch at that width.
  int64_t prefetch_cap(int64_t width) const;
  // Whether the plan makes tables for prefetch point `name` (enabled and listed in prefetch.points).
  bool prefetch_point(std::string_view name) const;

  bool operator==(const Deploy&) const = default;
};

// Limits that are ours rather than vLLM's; those the runtime's manifest reader also checks live in
// runtime/format/deploy_limits.h.
using format::kMaxWidth;
using format::kMaxSpeculativeTokens;
using format::kMaxBlockSize;
using format::kMaxIndexerLimit;
using format::kMaxIndexerKeys;
inline constexpr int64_t kMaxPrefetchCapBytes = int64_t{1} << 30;  // more than any GPU's L2

// ---- Reading and writing ---------------------------------------------------------------------------

// Checks `j` completely and fills in every default. `where` names the file in messages.
// Throws dp::Error(input).
Deploy parse_deploy(const Json& j, const std::string& where);

// `spec` is a path to a deploy JSON file, or the literal "default" for the built-in
// manifests/deploy-default.json (write "./default" for a file of that name).
// Throws dp::Error(io) when the file cannot be read, dp::Error(input) when it is wrong.
Deploy load_deploy(const std::string& spec);

// The canonical deploy config: every field present with its value or default, widths and ranks as
// explicit lists (never max_num_seqs), keys sorted. parse_deploy(to_json(d)) == d, and two deploy files
// that mean the same build give the same JSON. This is what the bundle manifest records.
Json to_json(const Deploy& d);

// Every field parse_deploy accepts, as dotted paths ("kv_cache.block_size"), objects included
// ("kv_cache"). The schema test compares this with manifests/deploy.schema.json.
std::vector<std::string> known_keys();

// The model-dependent checks: tensor_parallel divides the KDA and MLA head counts, the number of
// experts, the dense, expert and shared-expert intermediate sizes, and the split dimension of every
// weight split along a dimension. `where` names the deploy file in messages. Throws dp::Error(input):
//   deploy.json: tensor_parallel 8 does not divide kda num_heads 12 (valid: 1, 2, 4)
void check_against_model(const Deploy& d, const dp::model::Model& m, const std::string& where);

// Tensor-parallel sizes (of 1, 2, 4, 8) that check_against_model would accept for `m`.
std::vector<int64_t> valid_tensor_parallel(const dp::model::Model& m);

}  // namespace dp::deploy
