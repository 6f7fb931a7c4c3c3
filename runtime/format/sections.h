// The typed sections of the manifest that manifest.h keeps as JSON: `deploy` (the canonical deploy
// config) and `model.details` (the model IR's hyper-parameters). One type each, with one writer
// (to_json) and one reader (*_from_json): the compiler's deploy reader fills a Deploy and the bundle
// writer records to_json of it and of the ModelDetails it fills from the IR; the runtime reads both back
// through the same functions (runtime/src/bundle.cpp). Bounds are deploy_limits.h's.
//
// The readers take the canonical form only: every field present (but deploy.prefetch.points, which
// manifests before 1.4 lack), integers as JSON integers, lists sorted without repeats, no unknown field.
// A value outside its bound is a FormatError(schema) naming the field ("deploy.kv_cache.block_size"),
// the value and the bound. The user-facing deploy file, with defaults, hints and max_num_seqs, is the
// compiler's (compiler/deploy/deploy.h), which returns this same Deploy.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "format/deploy_limits.h"
#include "format/manifest.h"

namespace dp::format {

// ---- deploy ----------------------------------------------------------------------------------------

// Cache and state element types and layouts; the names are the JSON spellings (kKvCacheDtypes, ...).
enum class KvCacheDtype { bf16, fp8 };      // fp8: e4m3 with a per-tensor scale (vLLM "fp8")
enum class KdaStateDtype { float32 };       // vLLM always keeps the KDA recurrent state in fp32
enum class KdaStateLayout { kv, vk };       // kv: [heads, k, v] (FLA / vLLM); vk: [heads, v, k]
enum class ConvStateDtype { bf16, float32 };
enum class ConvStateLayout { sd, ds };      // sd: [K-1, dim] (vLLM default); ds: [dim, K-1]

template <typename E>
struct Spelling {
  E value;
  std::string_view name;
};
inline constexpr std::array kKvCacheDtypes = {Spelling<KvCacheDtype>{KvCacheDtype::bf16, "bf16"},
                                              Spelling<KvCacheDtype>{KvCacheDtype::fp8, "fp8"}};
inline constexpr std::array kKdaStateDtypes = {Spelling<KdaStateDtype>{KdaStateDtype::float32, "float32"}};
inline constexpr std::array kKdaStateLayouts = {Spelling<KdaStateLayout>{KdaStateLayout::kv, "kv"},
                                                Spelling<KdaStateLayout>{KdaStateLayout::vk, "vk"}};
inline constexpr std::array kConvStateDtypes = {Spelling<ConvStateDtype>{ConvStateDtype::bf16, "bf16"},
                                                Spelling<ConvStateDtype>{ConvStateDtype::float32, "float32"}};
inline constexpr std::array kConvStateLayouts = {Spelling<ConvStateLayout>{ConvStateLayout::sd, "sd"},
                                                 Spelling<ConvStateLayout>{ConvStateLayout::ds, "ds"}};

const char* to_string(KvCacheDtype d);
const char* to_string(KdaStateDtype d);
const char* to_string(KdaStateLayout l);
const char* to_string(ConvStateDtype d);
const char* to_string(ConvStateLayout l);

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
  // The points the plan makes tables for (kPrefetchPoints names, in that order). Default from
  // measurement: none at tensor_parallel 1, where no point paid on the H200 at widths 1-8 (bench
  // --prefetch sweep: every point within noise of prefetch off; bench/NOTES.md); at TP 2-8 the K3 vLLM
  // module's oproj_down, attention_moe and next_attention (not measured here).
  std::vector<std::string> points;
  bool operator==(const Prefetch&) const = default;
};

// Limits of the sparse-attention indexer's prefill path (DeepSeek-V3.2-style DSA models; the Kimi
// models have no indexer, and then these only size nothing). They bound the prefill workspace
// (compiler/indexer/workspace.h).
struct Indexer {
  // Keys one prefill chunk may hold. vLLM sizes its buffer as max_model_len * 40; this default is that
  // for a 160K-token context (DeepSeek-V3.2's 163840).
  int64_t max_keys_per_chunk = 40 * 163840;
  // Requests in one prefill chunk: vLLM's max_num_seqs default on H100/H200-class GPUs.
  int64_t max_requests = 1024;
  bool operator==(const Indexer&) const = default;
};

// Which all-reduce path a width's layer programs take at tensor_parallel > 1 (the deploy's
// `allreduce`): the in-kernel one-shot all-reduce over IPC-mapped exchange buffers (templates/allreduce.h),
// or ncclAllReduce between kernels on the session's communicator (format 1.8).
enum class Allreduce { in_kernel, nccl };
inline constexpr std::array kAllreducePaths = {Spelling<Allreduce>{Allreduce::in_kernel, "in_kernel"},
                                               Spelling<Allreduce>{Allreduce::nccl, "nccl"}};
const char* to_string(Allreduce a);

// What a bundle is built for: the manifest's `deploy`.
struct Deploy {
  std::vector<std::string> targets;  // sorted, unique, each in kGpuTargets
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
  // Widths whose programs all-reduce with NCCL (sorted, unique, among `widths`); every other width uses
  // the in-kernel path. Empty at tensor_parallel 1 and by default. The canonical JSON records it
  // (`"allreduce": {"<width>": "nccl", ...}`, the deploy file's per-width form) only when non-empty, so
  // bundles that do not use NCCL keep their bytes.
  std::vector<int64_t> allreduce_nccl;

  // Query rows per request in a decode or spec-verify step (vLLM uniform_decode_query_len).
  int64_t q() const { return 1 + num_speculative_tokens; }
  int64_t max_width() const { return widths.empty() ? 0 : widths.back(); }
  // Effective prefetch cap at `width` in bytes; 0 means no prefetch at that width.
  int64_t prefetch_cap(int64_t width) const;
  // Whether the plan makes tables for prefetch point `name` (enabled and listed in prefetch.points).
  bool prefetch_point(std::string_view name) const;
  // The all-reduce path of `width`'s programs.
  Allreduce allreduce(int64_t width) const;

  bool operator==(const Deploy&) const = default;
};

// The canonical JSON: every field, widths and ranks as explicit lists; nlohmann::json sorts the keys.
// deploy_from_json(to_json(d)) == d for every Deploy within the bounds.
Json to_json(const Deploy& d);

// Reads a manifest's `deploy`; `where` names the manifest in messages ("x.dpk: manifest.json").
// Throws FormatError(schema): "<where>: field deploy.widths[1] is 65, expected 1..64".
Deploy deploy_from_json(const Json& j, const std::string& where);

// ---- model.details ---------------------------------------------------------------------------------

// Bounds of the hyper-parameters: far above the real models (K3: 96 heads of 128, kv_lora_rank 512,
// 896 experts), low enough that nothing the runtime sizes from them overflows.
inline constexpr int64_t kMaxModelDim = int64_t{1} << 20;  // heads, head and LoRA dims, widths
inline constexpr int64_t kMaxConvKernel = 64;               // KDA short_conv_kernel_size

inline constexpr std::array<std::string_view, 2> kActivations = {"silu", "situ"};
inline constexpr std::array<std::string_view, 2> kExpertFormats = {"bf16", "mxfp4"};

struct KdaDetails {
  int64_t num_heads = 0, head_dim = 0, conv_kernel = 0, gate_rank = 0;
  bool full_rank_gate = false;
  std::optional<double> gate_lower_bound;  // only for a "safe gate" model
  bool operator==(const KdaDetails&) const = default;
};

struct MlaDetails {
  int64_t num_heads = 0, q_lora_rank = 0, kv_lora_rank = 0, qk_nope_head_dim = 0, qk_rope_head_dim = 0,
          v_head_dim = 0;
  bool output_gate = false;
  bool operator==(const MlaDetails&) const = default;
};

struct MoeDetails {
  int64_t num_experts = 0, top_k = 0, intermediate = 0, num_shared = 0;
  double routed_scaling = 1.0;
  bool renormalize = true;
  int64_t latent_dim = 0;
  std::string expert_format = "bf16";  // one of kExpertFormats
  bool operator==(const MoeDetails&) const = default;
};

// The manifest's `model.details`.
struct ModelDetails {
  std::string prefix;               // checkpoint name prefix of the decoder, "model."
  std::string activation = "silu";  // one of kActivations
  int64_t attn_res_block = 0;       // 0: plain residual
  int64_t dense_intermediate = 0;
  KdaDetails kda;
  MlaDetails mla;
  MoeDetails moe;
  bool operator==(const ModelDetails&) const = default;
};

Json to_json(const ModelDetails& d);

// Reads a manifest's `model.details`; throws FormatError(schema) naming "model.details.<field>".
ModelDetails details_from_json(const Json& j, const std::string& where);

}  // namespace dp::format
