// The bundle manifest (manifest.json): one C++ type that the compiler writes and the runtime reads.
//
// The normative description is manifests/bundle-format.md; the JSON Schema is
// manifests/bundle-manifest.schema.json. Both sides go through from_json()/to_json() below, and
// validate() holds every rule the schema cannot express (cross references, sorted tables, digests'
// shape), so a manifest the writer accepts is exactly one the reader accepts.
//
// Versioning: format_version {major, minor}. A reader accepts its own major and any minor <= its own;
// anything else is refused before any other field is read, with both versions and the supported range.
#pragma once

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dp::format {

using Json = nlohmann::json;

inline constexpr const char* kFormatName = "decodepack-bundle";
inline constexpr int kFormatMajor = 1;
// 1.1 added `programs` and `indexer`, 1.2 indexer kernels, 1.3 kernels that take programmatic dependent
// launch (NVIDIA sm_90+: every entry point waits for the previous kernel of the stream before it reads),
// 1.4 the prefetch point attention_oproj, 1.5 kernels of role lm_head (manifests/bundle-format.md §2.6),
// 1.6 the program source `tp` (tensor-parallel all-reduce steps), 1.7 K3 block attention residuals
// (the program source `layer`, the cache kind `attn_res`, attnres final-norm kernels), 1.8 collective
// program steps (`nccl_allreduce`: the NCCL all-reduce path, with the deploy's `allreduce`), 1.9 kernels
// that take dynamic shared memory (`dynamic_shared_bytes`, launched with that much; above 48 KiB the
// runtime opts the function in first). A writer
// records the lowest minor whose features the bundle uses, never below 1.5 (kMinWrittenMinor): a bundle
// without `tp` sources stays 1.5, byte for byte what 1.5 writers made, one without K3 attention residuals
// stays at most 1.6, one without NCCL widths at most 1.7, and one without dynamic shared memory at most 1.8.
inline constexpr int kFormatMinor = 9;
inline constexpr int kMinWrittenMinor = 5;
inline constexpr const char* kManifestFile = "manifest.json";

// Bounds the reader puts on the manifest's numbers: far above any real bundle (kimi-k3: hidden 7168, 93
// layers, 896 experts, shards of a few hundred MB), low enough that no size, offset or product the
// runtime forms from them overflows and no allocation sized by them is absurd. A field outside its
// bound is a schema error naming the field, its value and the bound.
inline constexpr int64_t kMaxHiddenSize = int64_t{1} << 16;
inline constexpr int64_t kMaxLayers = 1024;
inline constexpr int64_t kMaxVocabSize = int64_t{1} << 22;
inline constexpr int64_t kMaxDims = 8;                          // dimensions of a weight (DP_MAX_DIMS)
inline constexpr int64_t kMaxDimension = int64_t{1} << 40;      // one dimension, a shard range's ends
inline constexpr uint64_t kMaxShardBytes = uint64_t{1} << 48;   // one weight shard (one expert's)
inline constexpr int64_t kMaxExperts = int64_t{1} << 16;        // tensors of one expert group
inline constexpr uint64_t kMaxDeviceBytes = uint64_t{1} << 40;  // a workspace, a prefetch range, an offset
inline constexpr uint32_t kMaxParamBytes = 32764;               // a kernel's parameters (CUDA's limit)
inline constexpr uint32_t kMaxKernelResource = 1u << 24;        // shared, stack and spill bytes; registers
inline constexpr uint64_t kMaxFileBytes = 077777777777ULL;      // a file of the bundle (ustar's limit)
inline constexpr uint64_t kMaxBundleBytes = uint64_t{4} << 30;  // all files of the bundle together

// Thrown by the reader and validator; `what()` names the file, field, actual and expected value.
struct FormatError : std::runtime_error {
  enum class Kind { version, schema, integrity };
  FormatError(Kind k, std::string msg) : std::runtime_error(std::move(msg)), kind(k) {}
  Kind kind;
};

struct Version {
  int major = kFormatMajor;
  int minor = kFormatMinor;
};

struct FileEntry {
  std::string path;    // relative, '/'-separated, no "..", sorted bytewise in the manifest
  uint64_t size = 0;
  std::string sha256;  // 64 lowercase hex digits
};

struct ModelInfo {
  std::string model_type;     // "kimi_linear" | "kimi_k3"
  std::string architecture;
  std::string config_digest;  // "sha256:<hex>" of the canonical config.json
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t vocab_size = 0;
  double rms_norm_eps = 0;
  Json details;               // the IR's hyper-parameters (kda, mla, moe blocks), for tools and the runtime
};

struct LayerEntry {
  int index = 0;
  std::string mixer;  // "kda" | "mla"
  std::string ffn;    // "dense" | "moe" | "latent_moe"
  std::string cls;    // layer class, e.g. "kda_moe"
};

struct KernelParamEntry {
  std::string name;
  std::string kind;   // "pointer" | "u32" | "f32"
  uint32_t offset = 0;
  uint32_t size = 0;
  std::string shape;  // pointers: "[4, 2304] bf16"
  bool nullable = false;
};

struct KernelEntry {
  std::string key;        // "<name>.<target>": the table's sort key, unique
  std::string name;       // entry-point symbol
  std::string op;         // "rmsnorm", "prefetch", layer class, ...
  std::string role;       // what it is used for: "final_norm", "prefetch", "layer:kda_moe", ...
  std::string target;     // "sm_90a", "gfx942"
  int64_t width = 0;      // 0: width-independent
  int64_t q = 0;          // query rows per request (0: independent)
  std::string file;       // "kernels/<target>/<key>.cubin|hsaco"
  std::string sha256;     // of the code object (also in files[])
  uint32_t param_bytes = 0;
  std::vector<KernelParamEntry> params;
  uint32_t grid[3] = {1, 1, 1};
  uint32_t block[3] = {1, 1, 1};
  uint32_t shared_bytes = 0;
  uint32_t dynamic_shared_bytes = 0;  // since 1.9: launched with this much dynamic shared memory (0: none)
  uint32_t registers = 0;
  uint32_t stack_bytes = 0;
  uint32_t spill_bytes = 0;
};

struct WeightEntry {
  std::string name;            // checkpoint name; "...experts.{e}..." stands for `experts` tensors
  std::string dtype;           // as bound on the device: "BF16", "F32", "U8", ...
  std::vector<int64_t> shape;  // the rank's shard
  int split_dim = -1;          // -1: replicated
  int64_t begin = 0, end = 0;  // range along split_dim in the full tensor
  int64_t experts = 0;         // > 0 for per-expert groups
  int layer = -1;
  std::vector<std::string> sha256;  // fingerprints: one, or one per expert; empty without weights
};

struct RankEntry {
  int64_t rank = 0;
  std::vector<WeightEntry> weights;
};

// The prefetch points, indexed by decodepack.h's dp_prefetch_point (the runtime asserts the order):
// where in a layer the runtime starts a table (runtime/src/prefetch_points.h) and what it pulls.
inline constexpr std::array<std::string_view, 4> kPrefetchPoints = {"oproj_down", "attention_moe", "next_attention",
                                                                   "attention_oproj"};

struct PrefetchRangeEntry {
  std::string weight;  // checkpoint name (a rank's shard of it)
  uint64_t bytes = 0;  // from the start of the shard, 16-byte multiple
};

struct PrefetchEntry {
  std::string point;   // "attention_oproj" (since 1.4) | "oproj_down" | "attention_moe" | "next_attention"
  int layer = 0;
  std::vector<int64_t> widths;
  bool critical = false;
  int grid = 32;
  std::vector<PrefetchRangeEntry> ranges;
};

// One kernel parameter of a program step and where its value comes from (bundle-format.md 2.5).
struct ProgramArgEntry {
  std::string param;    // the kernel's parameter name
  std::string from;     // io | weight | expert_stride | workspace | kv | kv_stride | f32 | u32 | null | tp (1.6) |
                        // layer (1.7)
  std::string name;     // io: dp_layer_io field; weight, expert_stride: layer-relative weight key; kv, kv_stride: cache kind
  uint64_t offset = 0;  // workspace, weight: bytes added to the address
  double value = 0;     // f32, u32: the constant
};

// A step is a kernel launch, or (since 1.8) a collective the runtime calls between kernels: then
// `kernel` is empty, `collective` is "nccl_allreduce" (ncclAllReduce, bf16, sum, on the session's
// communicator and the launch's stream) and `args` bind its two buffers, "send" and "recv", of `elements`
// bf16 values each.
struct ProgramStepEntry {
  std::string kernel;   // kernel name (target-independent): kernels[] holds "<kernel>.<target>" for every target
  std::vector<ProgramArgEntry> args;  // one per kernel parameter, in parameter order
  std::string collective;  // "" for a kernel step
  uint64_t elements = 0;   // collective steps: bf16 values summed
};

// A layer program: what runs every layer of class `cls` at `width` requests. `steps` is empty when
// the build made none, and `reason` says why (the runtime reports it and the host runs the layer).
struct ProgramEntry {
  std::string cls;
  int64_t width = 0;
  std::vector<ProgramStepEntry> steps;
  std::string reason;
};

// The sparse-attention indexer (since 1.1): all zero when the model has none.
struct IndexerEntry {
  int64_t heads = 0, head_dim = 0, top_k = 0;
  uint64_t prefill_workspace_bytes = 0;  // peak scratch of one prefill chunk (compiler/indexer/workspace.h)
};

struct WorkspaceEntry {
  int64_t width = 0;
  uint64_t bytes = 0;
};

struct Manifest {
  std::string format = kFormatName;
  Version format_version;
  std::string tool_version;         // decodepack version that wrote it
  Json toolchains = Json::object(); // vendor -> compiler version string
  std::string templates_digest;     // sha256 of the device templates used
  ModelInfo model;
  Json deploy;                      // the canonical deploy config
  bool weights_fingerprinted = false;
  std::vector<LayerEntry> layers;
  std::vector<KernelEntry> kernels;     // sorted by key
  std::vector<RankEntry> ranks;         // sorted by rank
  std::vector<PrefetchEntry> prefetch;  // prefetch tables, identical for every rank
  std::vector<ProgramEntry> programs;   // sorted by (class, width); empty in 1.0 manifests
  IndexerEntry indexer;                 // zero in 1.0 manifests
  std::vector<WorkspaceEntry> workspace;
  std::vector<FileEntry> files;         // every file of the bundle but manifest.json, sorted by path
};

// Checks format name and version first (FormatError::Kind::version), then parses every field.
Manifest from_json(const Json& j, const std::string& where);
Json to_json(const Manifest& m);

// The canonical bytes of a manifest (sorted keys, no whitespace, trailing newline). The bundle digest
// is sha256 of exactly these bytes; manifest.json holds them.
std::string canonical_bytes(const Manifest& m);

// Cross-field rules: sorted unique keys and paths, kernel files listed in files[], digests well formed,
// prefetch ranges naming weights of rank 0, kernel/prefetch/workspace widths among the deploy's widths,
// layers in order, ranks among deploy.ranks, consistent shard ranges, known dtypes, "{e}" exactly in
// expert groups, kernel digests equal to their files[] entries. Throws FormatError(schema).
void validate(const Manifest& m, const std::string& where);

// The minor version a writer records for `m`: 9 when a kernel takes dynamic shared memory, else 8 when a
// program has a collective step, else 7 when it
// uses K3 block attention residuals (a program source `layer`, a cache kind `attn_res` or an `attnres`
// kernel), else 6 when a program binds a `tp` source, else kMinWrittenMinor.
int written_minor(const Manifest& m);

// Reader's version gate, callable on a bare {major, minor}.
void check_version(const Version& v, const std::string& where);

}  // namespace dp::format
