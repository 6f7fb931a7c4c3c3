// The deployment config: what a bundle is built for (targets, tensor parallelism, batch widths,
// speculative decoding, cache formats, prefetch caps, indexer limits, the all-reduce path per width).
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
#include "format/sections.h"

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

// The deploy config is the manifest's typed deploy section (runtime/format/sections.h): one type that
// this reader fills, the bundle writer records (to_json) and the runtime reads back.
using format::ConvState;
using format::ConvStateDtype;
using format::ConvStateLayout;
using format::Dcp;
using format::Deploy;
using format::Indexer;
using format::KdaState;
using format::KdaStateDtype;
using format::KdaStateLayout;
using format::KvCache;
using format::KvCacheDtype;
using format::Prefetch;
using format::to_string;  // "bf16", "float32", "kv", "sd", ...

// The element type a cache holds, as the checkpoint dtype enum names it.
DType element_dtype(KvCacheDtype d);   // BF16 | F8_E4M3
DType element_dtype(KdaStateDtype d);  // F32
DType element_dtype(ConvStateDtype d); // BF16 | F32

// Limits that are ours rather than vLLM's; those the runtime's manifest reader also checks live in
// runtime/format/deploy_limits.h.
using format::kMaxWidth;
using format::kMaxSpeculativeTokens;
using format::kMaxBlockSize;
using format::kMaxIndexerLimit;
using format::kMaxIndexerKeys;
using format::kMaxPrefetchCapBytes;

// ---- Reading and writing ---------------------------------------------------------------------------

// Checks `j` completely and fills in every default. `where` names the file in messages.
// Throws dp::Error(input).
Deploy parse_deploy(const Json& j, const std::string& where);

// `spec` is a path to a deploy JSON file, or the literal "default" for the built-in
// manifests/deploy-default.json (write "./default" for a file of that name).
// Throws dp::Error(io) when the file cannot be read, dp::Error(input) when it is wrong.
Deploy load_deploy(const std::string& spec);

// The canonical deploy config (format::to_json): every field present with its value or default, widths
// and ranks as explicit lists (never max_num_seqs), keys sorted. parse_deploy(to_json(d)) == d, and two
// deploy files that mean the same build give the same JSON. This is what the bundle manifest records,
// and format::deploy_from_json reads it back.
using format::to_json;

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
