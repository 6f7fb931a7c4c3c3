/* decodepack.h: the C ABI of libdecodepack, the decodepack runtime.
 *
 * libdecodepack loads a decodepack bundle (a directory or .dpk file that `decodepack build` wrote: the
 * specialised decode kernels of one model and deploy config, for every target and batch width) on a
 * serving host, validates it against the GPU, the bound weights and the KV caches, plans each decode
 * step (the bundle's kernels, or the host's own layers with a reason), and launches the kernels,
 * including the L2 weight prefetch on a side stream. No compiler ever runs here.
 *
 * This header is the whole contract: C (C99 and C++), no C++ types, no exceptions across it. A
 * header-only C++ RAII wrapper is decodepack.hpp; a Python (ctypes) binding ships in python/.
 *
 * ---------------------------------------------------------------------------------------------------
 * Lifecycle (what a host does, in order)
 *
 *   1. dp_bundle_open                open, check format version, every file's sha256 (no GPU needed)
 *      dp_bundle_query_validity      optional: would it run on this device / description, this rank?
 *   2. dp_session_create             one per (device, rank); checks targets, driver, device limits
 *   3. dp_session_bind_weight        every weight the bundle lists for the rank (device pointers)
 *      dp_session_bind_expert_weights  (expert groups: one call for all experts of a tensor)
 *      dp_session_finalize_weights   every weight bound? (missing ones are named)
 *      dp_session_verify_weights     optional: the bound bytes against the bundle's fingerprints
 *      dp_session_set_peers          tensor_parallel > 1 (format 1.6): every rank's exchange buffer, when
 *                                    some width all-reduces in-kernel (dp_session_exchange_bytes > 0)
 *      dp_session_init_nccl          tensor_parallel > 1 (format 1.8): the NCCL communicator, when some
 *                                    width all-reduces with NCCL (dp_session_nccl_widths > 0)
 *   4. dp_session_load_kernels       every width's code objects, prefetch tables, workspace; call it
 *                                    BEFORE the host profiles memory or captures graphs
 *   5. dp_session_bind_kv            KDA recurrent + conv states and MLA latent caches, per layer;
 *                                    again after a cache grows in place; dp_session_release_kv first
 *                                    when the host frees a cache and allocates another elsewhere
 *   6. per step: dp_plan -> (all-gather reasons, dp_agree) -> per layer dp_step_layer_kernel ?
 *                dp_launch_layer : the host's layer; dp_prefetch_fork/join around them;
 *                dp_launch_final_norm; dp_launch_lm_head (optional: the bundle's LM head, format 1.5,
 *                once dp_session_bind_lm_head bound the host's LM head weight); dp_after_step once the
 *                step was executed
 *
 * Weights are never copied or owned: the library records device addresses. Weight reloads are not
 * supported (binding another address for a bound weight is refused).
 *
 * Errors. Every fallible function returns a dp_status*: NULL on success, otherwise an object that the
 * caller owns and frees with dp_status_free, holding a stable numeric code (dp_code, below) and a
 * message that names the object (file, tensor, kernel, layer), the field, the actual value and the
 * expected value or range, e.g.
 *   "weight model.layers.1.self_attn.q_proj.weight (rank 0): shape [256, 128], expected [256, 256]"
 * Codes never change meaning; new codes may be added.
 *
 * Threads. Functions on one dp_session must not run concurrently (a host drives a session from its
 * model-runner thread). Different sessions, and read-only functions of one dp_bundle, may be used from
 * any threads. dp_status objects are independent of everything else.
 *
 * Driver. libcuda.so.1 (NVIDIA) and libamdhip64.so (AMD) are opened at run time with dlopen, never
 * linked, so the library loads, opens and validates bundles on a host without a GPU driver; a GPU
 * session on such a host fails with DP_ERR_DRIVER_UNAVAILABLE naming the library that is missing.
 *
 * Units. Sizes in bytes, shapes and strides in elements (PyTorch's convention), device addresses as
 * uint64_t (a CUdeviceptr / hipDeviceptr_t, or torch's tensor.data_ptr()), streams as dp_stream
 * (a CUstream / hipStream_t; NULL is the legacy default stream).
 *
 * Structs with a leading `size` field are versioned: set size to sizeof(the struct) (the _init
 * functions do that and fill the defaults). The library reads or writes only the first `size` bytes,
 * so a program built against an older header keeps working with a newer library; a larger size than
 * the library knows is accepted when the unknown tail is zero, and refused otherwise.
 *
 * ---------------------------------------------------------------------------------------------------
 * Worked example (error handling shortened to CHECK, which prints dp_status_message and exits):
 *
 *   dp_bundle* bundle;
 *   CHECK(dp_bundle_open("tiny.dpk", NULL, &bundle));
 *
 *   dp_session_options so;  dp_session_options_init(&so);
 *   so.device = 0;  so.rank = 0;  so.tensor_parallel = 1;
 *   dp_session* s;
 *   CHECK(dp_session_create(bundle, &so, &s));   // e.g. DP_ERR_TARGET: "... add sm_100a to the deploy config's \"targets\" ..."
 *
 *   dp_tensor t;   // one call per weight the bundle lists (dp_bundle_get_weight enumerates them)
 *   int64_t shape[1] = {256};
 *   dp_tensor_init(&t, norm_weight_ptr, DP_DTYPE_BF16, 1, shape);   // contiguous strides
 *   CHECK(dp_session_bind_weight(s, "model.norm.weight", &t));
 *   ...
 *   CHECK(dp_session_finalize_weights(s));
 *   CHECK(dp_session_load_kernels(s));           // before memory profiling and graph capture
 *   ...   bind every KDA layer's state and conv states, every MLA layer's latent cache
 *
 *   // each decode step (host metadata; `reasons` all-gathered over the TP group by the host):
 *   dp_step_desc d;  dp_step_desc_init(&d);
 *   d.num_requests = 3;  d.query_lens = qlens;  d.graph_mode = DP_GRAPH_FULL;
 *   dp_plan_result p;  dp_plan_result_init(&p);
 *   CHECK(dp_plan(s, &d, &p));
 *   all_gather(&p.reason, reasons);                  // the host's communicator
 *   if (dp_agree(reasons, tp, NULL) == DP_REASON_NONE) {
 *     for (int l = 0; l < num_layers; ++l)
 *       if (dp_step_layer_kernel(p.step, l)) CHECK(dp_launch_layer(s, p.step, l, &io, stream));
 *       else host_layer(l);
 *     dp_final_norm_io n;  dp_final_norm_io_init(&n);  n.hidden = ...;  n.out = ...;
 *     CHECK(dp_launch_final_norm(s, p.step, &n, stream));
 *   } else { ... the host's own layers for the whole step ... }
 *   ...
 *   CHECK(dp_after_step(s));                          // after the step ran: peers' aborts surface here
 *
 *   dp_session_destroy(s);  dp_bundle_close(bundle);
 */
#ifndef DECODEPACK_H_
#define DECODEPACK_H_

#include <stddef.h>
#include <stdint.h>

/* ---- Export ---------------------------------------------------------------------------------------- */

#if defined(_WIN32)
#  if defined(DP_BUILDING_LIBRARY)
#    define DP_API __declspec(dllexport)
#  else
#    define DP_API __declspec(dllimport)
#  endif
#else
#  define DP_API __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ---- Versions ------------------------------------------------------------------------------------- */

/* The version of this header. dp_version() returns the library's, which may be newer. */
#define DP_VERSION_MAJOR 0
#define DP_VERSION_MINOR 1
#define DP_VERSION_PATCH 0
#define DP_VERSION_NUMBER (DP_VERSION_MAJOR * 10000 + DP_VERSION_MINOR * 100 + DP_VERSION_PATCH)

/* The bundle format this library reads: major DP_BUNDLE_FORMAT_MAJOR, minor 0 to DP_BUNDLE_FORMAT_MINOR
 * (manifests/bundle-format.md). A bundle outside that range is refused with DP_ERR_FORMAT_VERSION before
 * any other field is read, the message giving both versions and the supported range. */
#define DP_BUNDLE_FORMAT_MAJOR 1
#define DP_BUNDLE_FORMAT_MINOR 9

/* The loaded library's version as MAJOR * 10000 + MINOR * 100 + PATCH. This signature never changes. */
DP_API uint32_t dp_version(void);
/* "MAJOR.MINOR.PATCH". Static storage. */
DP_API const char* dp_version_string(void);

/* ---- Status --------------------------------------------------------------------------------------- */

/* Stable numeric codes. The message says which object and field, the actual and the expected value. */
typedef enum dp_code {
  DP_OK = 0,
  DP_ERR_INVALID_ARGUMENT = 1,   /* NULL handle or pointer, unknown enum value, bad options size */
  DP_ERR_OUT_OF_MEMORY = 2,      /* host memory allocation failed */
  DP_ERR_IO = 3,                 /* the bundle cannot be read: no such file, permission */
  DP_ERR_FORMAT_VERSION = 4,     /* bundle format version outside 1.0 .. 1.DP_BUNDLE_FORMAT_MINOR */
  DP_ERR_FORMAT = 5,             /* not a bundle, or the manifest breaks the format's rules */
  DP_ERR_INTEGRITY = 6,          /* a file is missing, extra, truncated, or its size/sha256 differs */
  DP_ERR_DRIVER_UNAVAILABLE = 7, /* the GPU driver library cannot be opened or lacks an entry point */
  DP_ERR_DRIVER = 8,             /* a driver call failed: message names the call and its result code */
  DP_ERR_NO_DEVICE = 9,          /* no such device; or GPU work asked of a host-only session */
  DP_ERR_TARGET = 10,            /* the bundle has no code object this device can run (says what to add) */
  DP_ERR_DRIVER_VERSION = 11,    /* the driver is older than the bundle's code objects need */
  DP_ERR_DEVICE_LIMITS = 12,     /* a kernel needs more threads/registers/shared memory than the device
                                    has, or its code object disagrees with the manifest */
  DP_ERR_RANK = 13,              /* rank not built into the bundle, or tensor-parallel size differs */
  DP_ERR_CONFIG = 14,            /* a host setting (speculative tokens, ...) differs from the deploy */
  DP_ERR_UNKNOWN_TENSOR = 15,    /* a bound name is not a weight of the rank; a cache kind the layer lacks */
  DP_ERR_MISSING_TENSOR = 16,    /* weights the rank needs were not bound (finalize names them) */
  DP_ERR_DTYPE = 17,             /* element type differs from the bundle's */
  DP_ERR_SHAPE = 18,             /* shape differs from the bundle's (or the deploy's cache shape) */
  DP_ERR_LAYOUT = 19,            /* strides the kernels cannot read (they read dense rows) */
  DP_ERR_ALIGNMENT = 20,         /* a device address (or a slot/block stride) not a multiple of 16 bytes */
  DP_ERR_REBIND = 21,            /* a bound weight bound at another address (reloads are not supported);
                                    a bound cache moved without dp_session_release_kv */
  DP_ERR_STATE = 22,             /* call out of order (e.g. dp_plan before dp_session_load_kernels) */
  DP_ERR_NO_KERNEL = 23,         /* the bundle has no program for this layer and width: the host runs it */
  DP_ERR_ABORTED = 24,           /* a rank gave up an in-kernel wait; the session can run no more steps */
  DP_ERR_NOT_SUPPORTED = 25,     /* a feature this build of the library does not implement */
  DP_ERR_INTERNAL = 26,          /* a bug in libdecodepack: please report the message */
  DP_ERR_COMMUNICATOR = 27,      /* the host's communicator callback (all-gather) or an NCCL call reported a
                                    failure (the message names the call and NCCL's text) */
  DP_ERR_NCCL_UNAVAILABLE = 28   /* libnccl.so.2 cannot be opened, lacks an entry point, or is older than
                                    2.10 (the message names the library and the version) */
} dp_code;

/* An error: NULL means success. Owned by the caller of the function that returned it. */
typedef struct dp_status dp_status;

/* DP_OK for NULL. */
DP_API dp_code dp_status_code(const dp_status* status);
/* The message ("" for NULL). Valid until dp_status_free. */
DP_API const char* dp_status_message(const dp_status* status);
/* Frees a status; NULL is ignored. */
DP_API void dp_status_free(dp_status* status);
/* "DP_ERR_SHAPE", ...; "DP_ERR_?" for an unknown value. Static storage. */
DP_API const char* dp_code_name(int32_t code);

/* ---- Element types and tensors -------------------------------------------------------------------- */

/* Names (dp_dtype_name) are the safetensors spellings that the bundle manifest uses. */
typedef enum dp_dtype {
  DP_DTYPE_INVALID = 0,
  DP_DTYPE_BF16 = 1,
  DP_DTYPE_F16 = 2,
  DP_DTYPE_F32 = 3,
  DP_DTYPE_F64 = 4,
  DP_DTYPE_U8 = 5,
  DP_DTYPE_I8 = 6,
  DP_DTYPE_I16 = 7,
  DP_DTYPE_I32 = 8,
  DP_DTYPE_I64 = 9,
  DP_DTYPE_F8_E4M3 = 10,
  DP_DTYPE_F8_E5M2 = 11,
  DP_DTYPE_F8_E8M0 = 12,
  DP_DTYPE_BOOL = 13
} dp_dtype;

/* "BF16", "F32", ...; "?" for an unknown value. Static storage. */
DP_API const char* dp_dtype_name(int32_t dtype);
/* Bytes per element; 0 for an unknown value. */
DP_API size_t dp_dtype_size(int32_t dtype);

#define DP_MAX_DIMS 8

/* A strided view of device memory. The library keeps the address and the numbers, never the memory. */
typedef struct dp_tensor {
  uint64_t data;                /* device address of element [0, ..., 0] */
  int32_t dtype;                /* dp_dtype */
  int32_t ndim;                 /* 0 .. DP_MAX_DIMS */
  int64_t shape[DP_MAX_DIMS];   /* elements per dimension; entries >= ndim are ignored */
  int64_t strides[DP_MAX_DIMS]; /* in elements, as torch.Tensor.stride() */
} dp_tensor;

/* Fills a tensor with row-major contiguous strides (shape copied from `shape[0 .. ndim)`). */
DP_API void dp_tensor_init(dp_tensor* t, uint64_t data, int32_t dtype, int32_t ndim, const int64_t* shape);

/* ---- Devices -------------------------------------------------------------------------------------- */

typedef enum dp_vendor { DP_VENDOR_CUDA = 1, DP_VENDOR_HIP = 2 } dp_vendor;

/* What validation needs to know about a GPU. dp_device_query fills it from the driver; a host without
 * the GPU may fill it by hand to ask whether a bundle would run there. Zero means "unknown, not
 * checked" for every limit. */
typedef struct dp_device_desc {
  size_t size;
  int32_t vendor;                      /* dp_vendor */
  char arch[64];                       /* "sm_90" (CUDA: sm_<major><minor>), "gfx942" (HIP, features cut) */
  char name[128];                      /* marketing name, for messages */
  int32_t driver_version;              /* cuDriverGetVersion / hipDriverGetVersion, e.g. 13000 = CUDA 13.0 */
  int32_t max_threads_per_block;
  int32_t max_block_dim[3];
  int32_t max_grid_dim[3];
  int32_t max_registers_per_block;     /* 32-bit registers */
  int64_t max_shared_per_block;        /* bytes, without opting in */
  int64_t max_shared_per_block_optin;  /* bytes, with cuFuncSetAttribute opt-in */
  int32_t multiprocessors;
  int64_t l2_bytes;
} dp_device_desc;

DP_API void dp_device_desc_init(dp_device_desc* d);
/* Asks the driver (dlopen'ed on first use) about device `ordinal`. DP_ERR_DRIVER_UNAVAILABLE on a host
 * without the vendor's driver library, DP_ERR_NO_DEVICE for an ordinal out of range. For DP_VENDOR_HIP
 * only vendor, arch, name and driver_version are filled (limits stay 0: not checked); sessions on AMD
 * devices are not implemented in this version (dp_session_create answers DP_ERR_NOT_SUPPORTED), while
 * host-only sessions plan gfx targets. */
DP_API dp_status* dp_device_query(int32_t vendor, int32_t ordinal, dp_device_desc* out);
/* Number of devices of `vendor` (0 without a driver; the status says why). */
DP_API dp_status* dp_device_count(int32_t vendor, int32_t* count);

/* ---- Bundles -------------------------------------------------------------------------------------- */

typedef struct dp_bundle dp_bundle;

typedef struct dp_bundle_open_options {
  size_t size;
  uint32_t flags; /* reserved, 0 */
} dp_bundle_open_options;

DP_API void dp_bundle_open_options_init(dp_bundle_open_options* o);

/* Opens a bundle directory or .dpk archive and checks, in this order: the archive's structure (plain
 * ustar, no links, safe unique paths, nothing cut off), the manifest's format name and version, its
 * schema, then the size and sha256 of every file it lists and that no other file is present. All files
 * are read into memory (a bundle is a few MB of code objects), so the path may go away afterwards.
 * A hostile bundle cannot crash or exhaust the host: only a directory or a regular file is opened (a
 * FIFO or device is refused without blocking), manifest.json is read only up to 512 MiB and nested at
 * most 64 deep, a member that is not listed is never read, and all files together may hold at most
 * 4 GiB (runtime/format/bundle_reader.h). `options` may be NULL. On success *out is a new bundle; on failure *out is NULL.
 * Codes: DP_ERR_IO, DP_ERR_FORMAT_VERSION, DP_ERR_FORMAT, DP_ERR_INTEGRITY. */
DP_API dp_status* dp_bundle_open(const char* path, const dp_bundle_open_options* options, dp_bundle** out);
/* Drops the caller's reference. Sessions hold their own, so a bundle may be closed while its sessions
 * live; it is freed with the last of them. NULL is ignored. */
DP_API void dp_bundle_close(dp_bundle* bundle);

typedef struct dp_bundle_info {
  size_t size;
  int32_t format_major, format_minor;
  const char* digest;           /* "sha256:<hex>" of manifest.json: the bundle's identity */
  const char* tool_version;     /* decodepack version that built it */
  const char* model_type;       /* "kimi_linear" | "kimi_k3" */
  int32_t num_layers;
  int64_t hidden_size;
  double rms_norm_eps;
  int32_t tensor_parallel;
  int32_t num_ranks;            /* ranks built into the bundle ... */
  const int32_t* ranks;         /* ... [num_ranks], sorted */
  int32_t num_widths;           /* batch widths (requests per step) with kernels ... */
  const int32_t* widths;        /* ... [num_widths], sorted */
  int32_t q;                    /* query rows per request: 1 + num_speculative_tokens */
  int32_t num_targets;
  const char* const* targets;   /* [num_targets], e.g. "gfx942", "sm_90a" */
  int32_t weights_fingerprinted;
  /* The sparse-attention indexer (bundle format 1.1; all 0 when the model has none, or in 1.0 bundles): */
  int32_t indexer_heads;        /* index_n_heads */
  int32_t indexer_top_k;        /* index_topk */
  uint64_t indexer_prefill_workspace_bytes; /* peak scratch of one prefill chunk at the deploy's
                                   indexer.max_keys_per_chunk / max_requests and dcp size / interleave */
  /* What a host needs beyond the fields above without reading the bundle again (libdecodepack 0.1.0
   * builds from this field on; a caller whose `size` ends before them gets none of them): */
  const char* config_digest;    /* "sha256:<hex>" of the canonical model config the bundle was built from
                                   (manifest model.config_digest): which checkpoint or preset it needs */
  const char* deploy_json;      /* the deploy config the bundle was built for (manifest `deploy`), as
                                   compact JSON text: cache layouts and dtypes, block size, limits */
  const char* manifest_json;    /* manifest.json's bytes as opened and checked (NUL-terminated; its
                                   sha256 is `digest`): the kernel, program and prefetch tables */
  int64_t vocab_size;           /* the model's vocabulary (the LM head has vocab_size / tensor_parallel
                                   rows per rank) */
} dp_bundle_info;

/* Every pointer in *out points into the bundle and lives as long as it does. */
DP_API dp_status* dp_bundle_get_info(const dp_bundle* bundle, dp_bundle_info* out);

typedef enum dp_mixer { DP_MIXER_KDA = 1, DP_MIXER_MLA = 2 } dp_mixer;

typedef struct dp_layer_info {
  size_t size;
  int32_t index;
  int32_t mixer;                /* dp_mixer */
  const char* ffn;              /* "dense" | "moe" | "latent_moe" */
  const char* layer_class;      /* "kda_moe", ... */
} dp_layer_info;

DP_API dp_status* dp_bundle_get_layer(const dp_bundle* bundle, int32_t layer, dp_layer_info* out);

typedef struct dp_weight_info {
  size_t size;
  const char* name;             /* checkpoint name; groups contain "{e}" for the expert index */
  int32_t dtype;                /* dp_dtype as bound on the device */
  int32_t ndim;
  int64_t shape[DP_MAX_DIMS];   /* the rank's shard (of one expert, for a group) */
  int32_t experts;              /* tensors in the group; 0 for a single tensor */
  int32_t layer;                /* -1 outside the decoder layers (the final norm) */
  int32_t split_dim;            /* -1 replicated; else the dimension cut for tensor parallelism */
} dp_weight_info;

/* Weights rank `rank` holds (what dp_session_bind_weight expects), or -1 if the rank is not built. */
DP_API int32_t dp_bundle_weight_count(const dp_bundle* bundle, int32_t rank);
DP_API dp_status* dp_bundle_get_weight(const dp_bundle* bundle, int32_t rank, int32_t index, dp_weight_info* out);

/* Would the bundle run on `device` as rank `rank`? NULL `device` skips the device checks; rank -1
 * skips the rank check. Checks the target (the device's architecture against the bundle's targets:
 * an sm_90a code object runs only on compute capability 9.0; the message says which target to add to
 * the deploy config), the driver version (a cubin's toolkit major, and the first driver that knows the
 * architecture), every kernel's block shape, registers and shared memory against the device limits,
 * and the rank against the bundle's ranks. The library loads and answers without any GPU driver.
 * Codes: DP_ERR_TARGET, DP_ERR_DRIVER_VERSION, DP_ERR_DEVICE_LIMITS, DP_ERR_RANK. */
DP_API dp_status* dp_bundle_query_validity(const dp_bundle* bundle, const dp_device_desc* device, int32_t rank);

/* ---- Sessions ------------------------------------------------------------------------------------- */

typedef struct dp_session dp_session;

#define DP_DEVICE_NONE (-1)

/* dp_session_options.flags */
#define DP_SESSION_NO_PREFETCH 0x1u /* dp_prefetch_fork launches nothing (prefetch off, for comparisons) */
#define DP_SESSION_NO_PDL 0x2u      /* launch without programmatic dependent launch (for comparisons; it is
                                       used on sm_90+ devices with bundles of format 1.3 or later) */

typedef struct dp_session_options {
  size_t size;
  int32_t vendor;                  /* dp_vendor; default DP_VENDOR_CUDA */
  int32_t device;                  /* device ordinal (default 0), or DP_DEVICE_NONE: a host-only session
                                      that binds, checks and plans but launches nothing */
  int32_t rank;                    /* tensor-parallel rank (default 0); must be built into the bundle */
  int32_t tensor_parallel;         /* the host's TP size; 0 (default): not checked */
  int32_t num_speculative_tokens;  /* the host's; -1 (default): not checked */
  uint32_t flags;                  /* DP_SESSION_* */
  const char* target;              /* host-only: the bundle target whose kernels plans assume (NULL: the
                                      first of the bundle's targets); device sessions: NULL, or the
                                      target to use, which must suit the device */
  const dp_device_desc* device_desc; /* host-only: also validate against this description (may be NULL) */
} dp_session_options;

DP_API void dp_session_options_init(dp_session_options* o);

/* Creates a session on (device, rank): runs dp_bundle_query_validity against the device, retains the
 * device's primary context. On failure *out is NULL. The session holds a reference to the bundle. */
DP_API dp_status* dp_session_create(dp_bundle* bundle, const dp_session_options* options, dp_session** out);
/* The bundle target whose code objects the session uses ("sm_90a"). Lives as long as the session. */
DP_API const char* dp_session_target(const dp_session* session);
/* Frees the session's device resources (modules, streams, events, workspace). The caller must make
 * sure no work it launched is still running or captured in a graph that will be replayed. NULL ignored. */
DP_API void dp_session_destroy(dp_session* session);

/* ---- Weights -------------------------------------------------------------------------------------- */

/* Binds one weight the bundle lists for the session's rank (dp_bundle_get_weight): `name` is its
 * checkpoint name; for a member of an expert group, the group's name with "{e}" replaced by the expert
 * index ("model.layers.1.block_sparse_moe.experts.7.w1.weight"). Checked here, each error naming the
 * tensor: a name the rank does not hold (DP_ERR_UNKNOWN_TENSOR), dtype (DP_ERR_DTYPE), shape
 * (DP_ERR_SHAPE: the rank's shard), strides (DP_ERR_LAYOUT: the kernels read weights densely, so they
 * must be row-major contiguous), address (DP_ERR_ALIGNMENT: 16 bytes; DP_ERR_INVALID_ARGUMENT: 0).
 * Binding a bound weight again at the same address with the same description is accepted (no-op); at
 * another address it is refused with DP_ERR_REBIND, as weight reloads are not supported. */
DP_API dp_status* dp_session_bind_weight(dp_session* session, const char* name, const dp_tensor* tensor);

/* Binds every expert of a group in one call: `group` is the name with "{e}" as listed in the bundle,
 * `data[e]` the device address of expert e (count = the group's expert count), and `expert` the dtype,
 * shape and strides of one expert (its data field is ignored). For a stacked tensor (vLLM's FusedMoE
 * [E, N, K]) pass data[e] = base + e * expert_stride_bytes. Same checks and codes as bind_weight.
 * The kernels read a group as one stacked tensor: however its experts were bound (this call or
 * dp_session_bind_weight per expert), expert e must lie at data[0] + e * stride for one positive
 * stride that is a whole number of elements (it may exceed one expert's size, e.g. each half of
 * vLLM's fused w13 [E, 2N, K] tensor); dp_session_finalize_weights refuses other bindings with
 * DP_ERR_LAYOUT. */
DP_API dp_status* dp_session_bind_expert_weights(dp_session* session, const char* group, const uint64_t* data,
                                                 int32_t count, const dp_tensor* expert);

/* Ends weight binding: DP_ERR_MISSING_TENSOR when any weight of the rank is unbound, naming them (the
 * first few and the count); DP_ERR_LAYOUT when an expert group is not one stacked tensor (see
 * dp_session_bind_expert_weights). Afterwards weights may only be re-bound at the same addresses. */
DP_API dp_status* dp_session_finalize_weights(dp_session* session);

/* Optional, after finalize: reads every bound weight back from the device and compares the SHA-256 of
 * each shard (each expert of a group) with the bundle's fingerprints (bundle-format.md section 4), so a
 * host can prove it bound the weights the bundle was built from, sharded for this rank. Copies all of
 * the rank's weights to the host once: seconds for a real model, so not for every start.
 * DP_ERR_INTEGRITY names the shards that differ; DP_ERR_NOT_SUPPORTED when the bundle has no
 * fingerprints (built with --no-weights); DP_ERR_NO_DEVICE on a host-only session. */
DP_API dp_status* dp_session_verify_weights(dp_session* session);

/* ---- Kernels -------------------------------------------------------------------------------------- */

/* Loads the code object of every kernel of every width for the session's target (cuModuleLoadData),
 * resolves their entry points and checks them against the manifest (parameter block size and offsets
 * where the driver reports them, registers, threads per block); resolves every prefetch table into a
 * device range table ({u64 address, u64 bytes} per weight range: 16-byte aligned addresses, lengths
 * capped by the bundle's bytes and by the tensor's extent computed from its shape and strides); and
 * allocates the step workspace (largest width, zeroed) and the error flag word. Requires finalized weights.
 * Call it before the host profiles memory or captures CUDA graphs: nothing is loaded or allocated
 * later, so launches can be captured. Host-only sessions: DP_ERR_NO_DEVICE. */
DP_API dp_status* dp_session_load_kernels(dp_session* session);

/* ---- KV caches ------------------------------------------------------------------------------------ */

/* What dp_session_bind_kv binds. Let S = slots (the host's state pool: vLLM's mamba cache blocks),
 * B = cache blocks, h = KDA heads, d = KDA head dim, P = h * d, K = KDA conv kernel size, tp = tensor
 * parallel size, L = kv_lora_rank, R = qk_rope_head_dim, block = deploy kv_cache.block_size:
 *
 *   DP_KV_KDA_STATE   KDA layers  [S, h/tp, d, d]  F32; element order per the deploy's kda_state.layout:
 *                                 "kv" [head][k][v] (FLA, vLLM), "vk" [head][v][k]
 *   DP_KV_CONV_Q/K/V  KDA layers  conv_state.layout "sd": [S, K-1, P/tp]; "ds": [S, P/tp, K-1];
 *                                 dtype conv_state.dtype (BF16 by default, or F32)
 *   DP_KV_MLA_LATENT  MLA layers  [B, block, L+R] in kv_cache.dtype (BF16, or F8_E4M3 for "fp8");
 *                                 each token's row is [latent L | rope key R]
 *   DP_KV_ATTN_RES    Kimi-K3 block attention residuals (bundle format 1.7; layer -1: one buffer for
 *                     the model)  [N, NB, H] BF16, N >= the largest width x q (a row per row of the
 *                     step), NB = ceil(num_hidden_layers / attn_res_block_size), H = hidden size: the
 *                     stored blocks of each row of the current step, written by the layers that push
 *                     (layer 0 stores the embedding) and read by every later layer and the final norm.
 *                     Nothing in it outlives a step; a host that runs some layers itself keeps its own
 *                     block list in the same place (row t's block k at t*stride + k*H).
 *
 * Every dimension but the first must be dense (row-major); the first (slot/block) stride may be
 * larger, e.g. when a state shares each slot's page with another (vLLM's hybrid allocator), but must
 * cover the rest and be a multiple of 16 bytes. S and B are the host's and may grow. */
typedef enum dp_kv_kind {
  DP_KV_KDA_STATE = 1,
  DP_KV_CONV_Q = 2,
  DP_KV_CONV_K = 3,
  DP_KV_CONV_V = 4,
  DP_KV_MLA_LATENT = 5,
  DP_KV_ATTN_RES = 6
} dp_kv_kind;

/* Binds one cache tensor of one layer; shapes and strides are checked against the table above
 * (DP_ERR_UNKNOWN_TENSOR for a kind the layer does not have, DP_ERR_DTYPE, DP_ERR_SHAPE, DP_ERR_LAYOUT,
 * DP_ERR_ALIGNMENT). Binding again at the same address is accepted with any number of slots/blocks
 * (an extensible cache that grew re-binds its views there); at another address it is refused with
 * DP_ERR_REBIND: call dp_session_release_kv first (e.g. after vLLM's memory-profiling cache is freed,
 * before the real one is bound). Steps plan DP_REASON_NO_KV until every cache of every layer is bound.
 * Bound caches appear as kernel parameters captured into graphs, so a host must not move a cache
 * after capturing graphs that use it. */
DP_API dp_status* dp_session_bind_kv(dp_session* session, int32_t layer, int32_t kind, const dp_tensor* tensor);
/* Forgets every KV binding (nothing on the device changes). */
DP_API dp_status* dp_session_release_kv(dp_session* session);
/* The expected description of a cache of `count` slots (or blocks): dtype, ndim, shape and contiguous
 * strides (data 0). DP_ERR_UNKNOWN_TENSOR for a kind the layer does not have. */
DP_API dp_status* dp_session_kv_layout(const dp_session* session, int32_t layer, int32_t kind, int64_t count,
                                       dp_tensor* out);

/* ---- Planning ------------------------------------------------------------------------------------- */

/* vLLM's CUDA-graph runtime modes. */
typedef enum dp_graph_mode { DP_GRAPH_NONE = 0, DP_GRAPH_PIECEWISE = 1, DP_GRAPH_FULL = 2 } dp_graph_mode;

/* Why a step runs the host's layers instead of the bundle's. Stable numbers. */
typedef enum dp_reason {
  DP_REASON_NONE = 0,              /* the bundle's kernels run the step */
  DP_REASON_NO_KV = 1,             /* some layer's caches are not bound (profiling, dummy runs) */
  DP_REASON_PP_STAGE_INPUT = 2,    /* a pipeline-parallel stage input (intermediate tensors) */
  DP_REASON_PIECEWISE = 3,         /* captured PIECEWISE: no attention metadata inside the graph */
  DP_REASON_TOO_MANY_REQUESTS = 4, /* more requests than the largest width built */
  DP_REASON_NOT_UNIFORM = 5,       /* not a pure uniform decode / spec-verify step: some request does not
                                      have exactly q rows (prefill, chunked prefill, mixed) or none */
  DP_REASON_BAD_METADATA = 6,      /* a state index, accepted count or block id outside the bound
                                      caches: served by nobody safely, a host bug */
  DP_REASON_INVALID = 7,           /* dp_agree got no reasons, or a value that is not a dp_reason */
  DP_REASON_NO_COMMUNICATOR = 8    /* the width's layer programs all-reduce with NCCL (format 1.8) and the
                                      session has no communicator yet (dp_session_init_nccl) */
} dp_reason;

/* vLLM's padding sentinels: block 0 is the null block, so a request whose state index is
 * DP_NULL_BLOCK_ID (or DP_PAD_SLOT_ID) is padding; its rows are computed like real ones and their
 * results ignored, so a graph captured at width W replays with fewer real requests. */
#define DP_NULL_BLOCK_ID 0
#define DP_PAD_SLOT_ID (-1)

/* One step's metadata as the host's scheduler has it, in host memory. Only num_requests and
 * query_lens are required; each other array is checked when given (NULL: skipped). */
typedef struct dp_step_desc {
  size_t size;
  int32_t num_requests;         /* requests in the step, padded ones included */
  const int32_t* query_lens;    /* [num_requests] new rows (tokens) per request; NULL: all q (the host
                                   vouches that the step is a uniform decode) */
  const int32_t* num_accepted;  /* [num_requests] tokens accepted in the previous step, 1 .. q; NULL */
  const int32_t* state_indices; /* [num_requests, state_indices_stride] KDA state slot per request (and
                                   per draft position when q > 1: the first q columns); NULL */
  int32_t state_indices_stride; /* elements between rows; 0 means q */
  const int32_t* block_table;   /* [num_requests, block_table_stride] MLA cache block ids; NULL */
  int32_t block_table_stride;   /* elements between rows */
  int32_t block_table_cols;     /* leading entries of each row to check (the rest is not read) */
  int32_t graph_mode;           /* dp_graph_mode the host runs this step under */
  int32_t pp_stage_input;       /* non-zero: the step's input comes from a previous PP stage */
} dp_step_desc;

DP_API void dp_step_desc_init(dp_step_desc* d);

/* A planned step: a width whose kernels run it. Owned by the session (one per width, made at load),
 * valid until dp_session_destroy; so a plan baked into a captured graph stays valid. */
typedef struct dp_step dp_step;

typedef struct dp_plan_result {
  size_t size;
  int32_t reason;        /* dp_reason; DP_REASON_NONE when the kernels run the step */
  int32_t width;         /* requests the kernels compute: the smallest built width >= num_requests
                            (pad the rest: DP_NULL_BLOCK_ID state, one accepted token); else 0 */
  int32_t q;             /* rows per request */
  int32_t rows;          /* width * q: rows of hidden/residual the kernels read and write */
  const dp_step* step;   /* NULL unless reason == DP_REASON_NONE */
  char message[256];     /* why not, naming the request and value ("" when reason == DP_REASON_NONE) */
} dp_plan_result;

DP_API void dp_plan_result_init(dp_plan_result* r);

/* Plans a step: a refusal is a result (out->reason), not an error; errors are misuse (DP_ERR_STATE:
 * weights not finalized, or kernels not loaded on a device session; DP_ERR_ABORTED after an abort).
 * Checks, in order: PP stage input, every cache bound, graph mode, request count, uniform rows, the
 * metadata arrays against the bound caches, and (format 1.8) the NCCL communicator when the planned
 * width all-reduces with NCCL. Under FULL graphs a host plans at capture only; the plan
 * is baked into the graph. Allocates nothing. */
DP_API dp_status* dp_plan(dp_session* session, const dp_step_desc* desc, dp_plan_result* out);

DP_API int32_t dp_step_width(const dp_step* step);
DP_API int32_t dp_step_q(const dp_step* step);
/* 1: the bundle has layer `layer`'s program at this width (launch it with dp_launch_layer); 0: it does
 * not, or `layer` is out of range, and the host runs its own layer. */
DP_API int32_t dp_step_layer_kernel(const dp_step* step, int32_t layer);

/* The tensor-parallel verdict: every rank must take the same path, since the kernels' cross-rank
 * waits need every rank in them. The host all-gathers each rank's dp_plan_result.reason over the TP
 * group and passes the array (in rank order); the result is DP_REASON_NONE if every entry is, otherwise
 * the reason of the lowest-numbered refusing rank (stored in *refusing_rank when not NULL; -1 if none),
 * identical on every rank. NULL or n <= 0, or an entry that is not a dp_reason: DP_REASON_INVALID. */
DP_API int32_t dp_agree(const int32_t* reasons, int32_t n, int32_t* refusing_rank);

DP_API const char* dp_reason_name(int32_t reason); /* "DP_REASON_NO_KV", ...; static storage */

/* ---- Error flag and after_step -------------------------------------------------------------------- *
 *
 * Layer programs that wait on other ranks (all-reduce mailboxes) wait a bounded time. Protocol:
 *  - Each session owns one 32-bit error flag word, in page-locked host memory mapped into the device
 *    (the host reads it without a copy or a synchronisation, also under graph replay).
 *  - A kernel that gives up a wait records DP_FLAG_WAIT_TIMEOUT with the layer, the op and the peer
 *    it waited for in its rank's word (system-scope compare-and-swap from 0, so the first record keeps
 *    its fields and later ones only OR their bit; then a system fence), then writes an abort mark into
 *    every rank's exchange buffer and finishes the step without waiting again. A kernel that finds an
 *    abort mark records DP_FLAG_PEER_ABORT with the rank that gave up (as `peer`) the same way and
 *    skips its waits. So once any rank gives up, every rank that runs another all-reduce gets a
 *    non-zero word; a rank that had already finished the step sees it in its next one (a host that
 *    wants every rank to fail the same step all-gathers dp_after_step's outcome, as the Python
 *    binding's after_step(group) does). Kernels never clear it.
 *    Fields: DP_FLAG_OP (1: the all-reduce after the o-projection, 2: after the FFN; 0: none),
 *    DP_FLAG_PEER (rank + 1; 0: none), DP_FLAG_LAYER (decoder layer + 1; 0: none).
 *  - dp_after_step (once per executed step, e.g. from vLLM's compute_logits) reads the word and fails
 *    with DP_ERR_ABORTED when it is non-zero, on every rank. The read is asynchronous: a give-up in
 *    step N is reported by the first dp_after_step after the device wrote the word (at the latest the
 *    one following the host's next synchronisation with the stream). The state is sticky: later
 *    dp_plan and dp_after_step calls fail too; the host must tear the session down.
 * Host-only sessions keep the word in ordinary memory. */
#define DP_FLAG_WAIT_TIMEOUT 0x1u
#define DP_FLAG_PEER_ABORT 0x2u
#define DP_FLAG_OP(v) (((v) >> 2) & 0x3u)
#define DP_FLAG_PEER(v) (((v) >> 8) & 0xffu)
#define DP_FLAG_LAYER(v) ((v) >> 16)

DP_API dp_status* dp_after_step(dp_session* session);
/* The flag word's device address (0 for host-only sessions) and current value (either may be NULL). */
DP_API dp_status* dp_session_error_flag(const dp_session* session, uint64_t* device_address, uint32_t* value);
/* ORs `bits` into the word from the host: for tests, and for a host whose own communicator timed out. */
DP_API dp_status* dp_session_raise_error_flag(dp_session* session, uint32_t bits);

/* ---- Tensor parallelism (bundle format 1.6) ------------------------------------------------------- *
 *
 * A bundle built for tensor_parallel R > 1 runs each rank's shard of every layer and sums the partial
 * outputs of the o-projection and of the FFN inside the layer program (templates/allreduce.h): every
 * rank pushes its partial rows into every rank's exchange buffer and waits, a bounded time, for the
 * others' flags. The host provides the buffers:
 *   1. each rank allocates dp_session_exchange_bytes bytes of device memory (cuMemAlloc; 16-byte
 *      aligned), exports an IPC handle (cuIpcGetMemHandle / hipIpcGetMemHandle), and all-gathers the
 *      handles over its process group;
 *   2. each rank opens the others' handles (cuIpcOpenMemHandle; peers on other devices need peer
 *      access) and calls dp_session_set_peers with the R device addresses in rank order (its own at
 *      index rank) and the bound of every wait, before dp_session_load_kernels;
 *   3. a barrier on the host's group: dp_session_set_peers zeroes this rank's buffer (synchronously),
 *      and no rank may launch a layer before every rank has.
 * The buffers must outlive the session and every graph that captured its launches. */

/* Bytes of one rank's exchange buffer; 0 when the bundle's programs do not all-reduce in-kernel
 * (tensor_parallel 1, no program built, or every width all-reduces with NCCL, format 1.8). */
DP_API uint64_t dp_session_exchange_bytes(const dp_session* session);

/* Sets every rank's exchange buffer (`exchange[r]`: rank r's, as this process maps it; num_ranks = the
 * bundle's tensor_parallel) and the bound of each in-kernel wait in microseconds (>= 1; ranks sharing
 * one device are time-sliced, so give them at least a second). Once per session, before
 * dp_session_load_kernels, which refuses a bundle with in-kernel all-reduces without it (DP_ERR_STATE). Errors:
 * DP_ERR_INVALID_ARGUMENT (the bundle does not all-reduce; num_ranks other than tensor_parallel; an
 * address 0 or used twice; timeout 0), DP_ERR_ALIGNMENT, DP_ERR_STATE (after load), DP_ERR_REBIND
 * (second call), device errors from the table upload or the zeroing. Host-only sessions keep the
 * addresses and check them. */
DP_API dp_status* dp_session_set_peers(dp_session* session, const uint64_t* exchange, int32_t num_ranks,
                                       uint32_t timeout_us);

/* ---- NCCL all-reduce (bundle format 1.8) --------------------------------------------------------- *
 *
 * The deploy's "allreduce" may give some widths (or all) to NCCL instead of the in-kernel all-reduce:
 * those widths' layer programs hold nccl_allreduce steps, which the launch runs as ncclAllReduce (bf16,
 * sum) of the rank's partial rows on the launch's stream, between the layer's kernels; ncclAllReduce is
 * capturable, so a step still captures into one CUDA graph. The communicator is the session's:
 *   1. rank 0 calls dp_nccl_get_unique_id and broadcasts the 128 bytes over the host's group (the
 *      Python binding: torch.distributed.broadcast of a uint8 tensor);
 *   2. every rank calls dp_session_init_nccl with them (a collective: it returns once all
 *      tensor_parallel ranks have called it); the session creates its communicator (rank = the
 *      session's rank, ranks = tensor_parallel) on the session's device and destroys it with the session.
 *   Or a host that already holds a communicator of the same library, ranks and order hands it over with
 *   dp_session_set_nccl_comm (the host keeps it, and destroys it after the session).
 * NCCL refuses two ranks on one GPU: each rank needs its own device. libnccl.so.2 (or `library`, or
 * $DECODEPACK_NCCL_LIBRARY) is opened with dlopen on first use; DP_ERR_NCCL_UNAVAILABLE names it when it
 * is missing, lacks an entry point or is older than 2.10. Until the session has a communicator, steps at
 * NCCL widths plan DP_REASON_NO_COMMUNICATOR and dp_launch_layer of their programs fails (DP_ERR_STATE).
 * An NCCL-only bundle needs no exchange buffers (dp_session_exchange_bytes is 0, no dp_session_set_peers). */

/* How many of the bundle's widths all-reduce with NCCL (0: none; then no NCCL call is ever made). When
 * `widths` is not NULL, the first min(count, capacity) of them are stored there, sorted. */
DP_API int32_t dp_session_nccl_widths(const dp_session* session, int32_t* widths, int32_t capacity);

/* Rank 0's part of step 1: a new ncclUniqueId's 128 bytes (ncclGetUniqueId). `library`: NULL or "" for
 * $DECODEPACK_NCCL_LIBRARY or libnccl.so.2. Errors: DP_ERR_NCCL_UNAVAILABLE, DP_ERR_COMMUNICATOR. */
DP_API dp_status* dp_nccl_get_unique_id(const char* library, uint8_t unique_id[128]);

/* Creates the session's communicator (ncclCommInitRank on the session's device). Once per session, before
 * or after dp_session_load_kernels. Errors: DP_ERR_INVALID_ARGUMENT (the bundle has no NCCL width, or
 * unique_id NULL), DP_ERR_REBIND (it already has a communicator), DP_ERR_NO_DEVICE (host-only session),
 * DP_ERR_NCCL_UNAVAILABLE, DP_ERR_COMMUNICATOR (NCCL's error, e.g. another rank on the same GPU). */
DP_API dp_status* dp_session_init_nccl(dp_session* session, const uint8_t unique_id[128], const char* library);

/* Uses the host's communicator `comm` (an ncclComm_t of `library`, the same library the host's NCCL calls
 * go to: load the host's first). The host keeps ownership. Same errors as dp_session_init_nccl. */
DP_API dp_status* dp_session_set_nccl_comm(dp_session* session, void* comm, const char* library);

/* ---- Launch --------------------------------------------------------------------------------------- *
 *
 * Launch functions enqueue on `stream` and return: no allocation, no synchronisation, no check that
 * could have been made at load; they may be captured into a CUDA graph (stream capture) and replayed.
 * They check only this call's own arguments (the step belongs to the session, addresses are non-zero
 * and 16-byte aligned). The device pointers in the io structs are rows of the step: [rows, hidden]
 * BF16, row-major, rows = dp_step_width * dp_step_q. */

typedef void* dp_stream;

/* Inputs and outputs of one decoder layer's program (vLLM's decoder-layer contract). Device addresses;
 * 0 where absent. Not every program reads every field. */
typedef struct dp_layer_io {
  size_t size;
  uint64_t hidden;              /* [rows, H] BF16 in: the previous layer's output */
  uint64_t residual;            /* [rows, H] BF16 in: the residual stream; 0 for layer 0 */
  uint64_t out;                 /* [rows, H] BF16 out (may alias hidden) */
  uint64_t residual_out;        /* [rows, H] BF16 out (may alias residual) */
  uint64_t positions;           /* [rows] I64 token positions */
  uint64_t state_indices;       /* [width, q] I32 KDA state slots */
  uint64_t block_table;         /* [width, block_table_stride] I32 MLA block ids */
  int32_t block_table_stride;
  int32_t reserved0;
  uint64_t seq_lens;            /* [width] I32 tokens per request including this step's */
  uint64_t slot_mapping;        /* [rows] I64 cache slot of each new token (DP_PAD_SLOT_ID: skip) */
  uint64_t num_accepted;        /* [width] I32 */
} dp_layer_io;

DP_API void dp_layer_io_init(dp_layer_io* io);

/* Launches layer `layer`'s program for the step's width. DP_ERR_NO_KERNEL when the bundle has none
 * (dp_step_layer_kernel returned 0): the host runs its own layer. */
DP_API dp_status* dp_launch_layer(dp_session* session, const dp_step* step, int32_t layer, const dp_layer_io* io,
                                  dp_stream stream);

/* The final norm: residual_out = hidden + residual; out = RMSNorm(residual_out) * w, where w is the
 * model's bound final-norm weight ("model.norm.weight") and eps the manifest's rms_norm_eps. */
typedef struct dp_final_norm_io {
  size_t size;
  uint64_t hidden;              /* [rows, H] BF16 in */
  uint64_t residual;            /* [rows, H] BF16 in, or 0 (then residual_out = hidden) */
  uint64_t out;                 /* [rows, H] BF16 out (may alias hidden) */
  uint64_t residual_out;        /* [rows, H] BF16 out (may alias residual) */
} dp_final_norm_io;

DP_API void dp_final_norm_io_init(dp_final_norm_io* io);
DP_API dp_status* dp_launch_final_norm(dp_session* session, const dp_step* step, const dp_final_norm_io* io,
                                       dp_stream stream);

/* ---- LM head (bundle format 1.5) --------------------------------------------------------------------- *
 *
 * The bundle carries the LM head of every width (a GEMM; none where width x q exceeds 32 rows, or where
 * tensor_parallel does not divide the vocabulary, and none in bundles older than 1.5): fp32 logits of the
 * step's rows against the rank's vocabulary shard, rows [rank * V/tp, (rank + 1) * V/tp) of the
 * checkpoint's lm_head.weight (V = dp_bundle_info.vocab_size); the host all-gathers the shards. The
 * weight is the host's, like the embedding (the bundle's weight tables list decode weights only): bind
 * it once, [V/tp, hidden] BF16 and contiguous (a model with tie_word_embeddings binds its embedding's
 * shard). Binding again at another address is refused (DP_ERR_REBIND), as for weights. Binding works
 * on host-only sessions too (it checks the tensor). */
DP_API dp_status* dp_session_bind_lm_head(dp_session* session, const dp_tensor* weight);
/* 1: the bundle has the LM head at the step's width (launch it with dp_launch_lm_head); 0: it has not. */
DP_API int32_t dp_step_lm_head(const dp_step* step);

typedef struct dp_lm_head_io {
  size_t size;
  uint64_t hidden;              /* [rows, H] BF16 in: the final norm's output */
  uint64_t logits;              /* [rows, V/tp] F32 out */
} dp_lm_head_io;

DP_API void dp_lm_head_io_init(dp_lm_head_io* io);
/* DP_ERR_NO_KERNEL when the bundle has no LM head at the step's width; DP_ERR_STATE before
 * dp_session_bind_lm_head or dp_session_load_kernels. */
DP_API dp_status* dp_launch_lm_head(dp_session* session, const dp_step* step, const dp_lm_head_io* io,
                                    dp_stream stream);

/* ---- Launch observer (profilers; off by default) --------------------------------------------------- *
 *
 * For tools that time a layer program kernel by kernel (`decodepack bench`): once set, `fn` is called
 * around every kernel that dp_launch_layer, dp_launch_final_norm and dp_launch_lm_head enqueue, on the calling thread,
 * with after = 0 right before the kernel is enqueued on `stream` and after = 1 right after (also when
 * the launch failed). `layer` is the decoder layer (-1: the final norm, index 0, and the LM head, index 1), `index` the kernel's position
 * in the layer's program (0-based), `kernel` its name (valid during the call). The callback may enqueue
 * work on `stream` (record an event, launch a kernel of its own), also during stream capture; it must
 * not call this session's functions. Prefetch launches are reported too, with index = -1 - point
 * (dp_prefetch_point) and `stream` the session's side stream. A NULL `fn` turns the observer off (the
 * default): a launch then costs one pointer test more. Serving hosts have no use for it. */
typedef void (*dp_launch_observer_fn)(void* user, int32_t layer, int32_t index, const char* kernel, int32_t after,
                                      dp_stream stream);
DP_API dp_status* dp_session_set_launch_observer(dp_session* session, dp_launch_observer_fn fn, void* user);

/* ---- L2 weight prefetch --------------------------------------------------------------------------- *
 *
 * At fixed points of a layer the session launches a small kernel on its own side stream that pulls the
 * byte ranges of the weights the next kernels read into L2, so they start warm. The host forks a point
 * before it launches the layer; the fork is armed, and dp_launch_layer of that layer starts it right
 * after the kernel the point names (below): it records an event on `stream` there that the side stream
 * waits on (the prefetch starts once that kernel finished, and overlaps the kernels after it), then
 * launches the prefetch kernel on the side stream. A fork whose layer is not the next one launched
 * starts at the next dp_launch_layer, dp_launch_final_norm or dp_prefetch_join, whichever comes first.
 * Critical tables (the MoE front, the o-projection) launch with the greatest stream priority (a
 * cuLaunchKernelEx attribute; not the 100% shared-memory carveout vLLM's module also sets, which cost 3 to
 * 24% of a step on the H200). join makes `stream` wait for the side stream, so a captured
 * graph always rejoins it: call it once at the end of every step in which fork launched, in the same
 * capture. */
typedef enum dp_prefetch_point {
  DP_PREFETCH_OPROJ_DOWN = 0,     /* after the o-projection: the MoE front (router [+ latent down]) */
  DP_PREFETCH_ATTENTION_MOE = 1,  /* TP 8: after the attention input projection (KDA) or the attention
                                     core (MLA): front + shared expert */
  DP_PREFETCH_NEXT_ATTENTION = 2, /* after the routed experts' first kernel: the next layer's attention
                                     weights */
  DP_PREFETCH_ATTENTION_OPROJ = 3 /* after the kernel before the attention core (format 1.4 bundles): the
                                     layer's o-projection, pulled while the core reads the caches */
} dp_prefetch_point;

/* *launched (may be NULL) is 1 when a table exists for (point, layer, width) and the fork will launch
 * it (see above), 0 when there is none (prefetch is not worth it there, or it was capped to 0) or the
 * session has DP_SESSION_NO_PREFETCH. */
DP_API dp_status* dp_prefetch_fork(dp_session* session, int32_t point, int32_t layer, int32_t width,
                                   dp_stream stream, int32_t* launched);
DP_API dp_status* dp_prefetch_join(dp_session* session, dp_stream stream);
/* Limits every table of `point` at `width` to its first `bytes` (in table order, 16-byte units) from now
 * on; 0 turns the point off at that width, and a cap at or above a table's size restores it. For
 * measuring and tuning without a rebuild (`decodepack bench --prefetch sweep`); the bundle's tables
 * (deploy `prefetch`) are the defaults. Not between a fork and its join, nor during a capture (it
 * allocates device memory for the clipped tables). */
DP_API dp_status* dp_prefetch_set_cap(dp_session* session, int32_t point, int32_t width, uint64_t bytes);

/* ---- Sparse-attention indexer prefill ------------------------------------------------------------- *
 *
 * For bundles whose model has a DeepSeek-V3.2-style indexer (dp_bundle_info.indexer_heads > 0; format
 * 1.2 kernels of role "indexer"). The indexer's keys are stored as MXFP4: 68 bytes per 128-value key
 * (64 bytes of E2M1 pairs, the low nibble the even element, then 4 UE8M0 scales, one per 32 values).
 * A prefill selects, for every query row, the top_k key positions of its request by
 *   score(t) = weight_scale * sum_h w[h] * relu(q[h] . k_t),   t = 0 .. the row's own position,
 * best first, ties to the lower position, -1 after the last visible key.
 *
 * Order of calls (a host's prefill step, per attention group: the layers sharing one block table):
 *   dp_indexer_write_keys      per layer, as the step's keys are produced (any time before the prefill)
 *   dp_indexer_prepare         once per attention group and step: checks every request set against the
 *                              deploy's limits, plans the query chunks and uploads the metadata
 *   dp_indexer_prefill         per layer of the group, with that layer's q, weights, cache and output
 *   dp_indexer_metadata_free   after the group's last prefill has run (stream-ordered work may still use
 *                              the metadata's device memory until then), and before the session is
 *                              destroyed (the metadata's device memory is the session's device's)
 *
 * Decode context parallelism (deploy dcp.size W > 1, dcp.interleave I): position p of a request lives on
 * rank (p / I) % W at local index (p / (I*W)) * I + p % I, in the block block_table[req][local / B] of
 * that rank's cache (B = kv_cache.block_size; the block table is shared, each rank's cache has its own
 * memory). Every rank calls the same functions with the same request sets; the prefill all-gathers the
 * packed keys (once per request set) and the selected rows (once per call) through the host's
 * communicator (dp_all_gather_fn: NCCL's ncclAllGather, torch.distributed's all_gather_into_tensor on
 * the DCP group), so every rank ends with the whole [rows, top_k] output.
 *
 * Workspace: dp_indexer_prefill uses a device buffer of dp_bundle_info.indexer_prefill_workspace_bytes
 * that the host allocates once (1 GiB of logits tile plus the staged keys) and may reuse between calls
 * on the same stream.
 *
 * Every device address here (keys, slot_mapping, q, weights, out, workspace, block tables, the cache) must
 * be a multiple of 16 bytes (DP_ERR_ALIGNMENT otherwise). The indexer's kernels load with
 * dp_session_load_kernels, or at the first indexer call on a session that has not loaded them. */

typedef enum dp_indexer_layout {
  DP_INDEXER_LAYOUT_SPLIT = 0,  /* a block's 64-byte payload rows, then its 4-byte scale rows */
  DP_INDEXER_LAYOUT_PACKED = 1  /* one 68-byte row per key */
} dp_indexer_layout;

/* One rank's index-key cache: num_blocks blocks of kv_cache.block_size keys, block_stride bytes apart. */
typedef struct dp_indexer_cache {
  size_t size;
  uint64_t data;         /* device address, 16-byte aligned */
  int64_t num_blocks;    /* 1 .. 2^31 - 1 */
  int64_t block_stride;  /* bytes between blocks: >= block_size * 68, a multiple of 16 */
  int32_t layout;        /* dp_indexer_layout */
} dp_indexer_cache;

DP_API void dp_indexer_cache_init(dp_indexer_cache* c);

/* Quantises keys (BF16 [count, 128], the normed and roped index keys) to MXFP4 into the cache at
 * slot_mapping[t] (I64 [count]: block * block_size + offset; -1 skips the token: another DCP rank's, or
 * padding; a slot past the cache is skipped too). */
DP_API dp_status* dp_indexer_write_keys(dp_session* session, const dp_indexer_cache* cache, uint64_t keys,
                                        uint64_t slot_mapping, int64_t count, dp_stream stream);

/* Requests whose keys are staged once and scored together (one "chunk" of the host's prefill). Rows are
 * request-major: request r contributes query_lens[r] rows, its newest positions. */
typedef struct dp_indexer_requests {
  int32_t num_requests;        /* 1 .. deploy indexer.max_requests */
  const int64_t* seq_lens;     /* host [num_requests]: keys of each request (context + new), >= 1; their
                                  sum at most deploy indexer.max_keys_per_chunk */
  const int64_t* query_lens;   /* host [num_requests]: query rows, 0 .. seq_len */
  uint64_t block_table;        /* device I32 [num_requests, block_table_stride], 16-byte aligned */
  int64_t block_table_stride;  /* entries per row: at least the blocks any rank holds of the request */
} dp_indexer_requests;

typedef struct dp_indexer_batch_desc {
  size_t size;
  int32_t num_sets;                  /* >= 1 */
  const dp_indexer_requests* sets;   /* host [num_sets]; output rows follow the sets in order */
  int32_t dcp_rank;                  /* this session's rank in the DCP group: 0 .. dcp.size - 1 */
  uint64_t max_tile_bytes;           /* logits tile of one query chunk: 0 = 1 GiB (the workspace's); a
                                        smaller value splits the rows into more chunks (at least one
                                        row of the longest request: 4 bytes per key) */
} dp_indexer_batch_desc;

DP_API void dp_indexer_batch_desc_init(dp_indexer_batch_desc* d);

typedef struct dp_indexer_metadata dp_indexer_metadata;

typedef struct dp_indexer_plan_info {
  size_t size;
  int64_t rows;         /* output rows: the sum of every set's query rows */
  int32_t sets;
  int32_t query_chunks; /* scoring passes (each keeps its logits tile under 1 GiB) */
  int64_t keys;         /* keys staged over all sets */
  uint64_t device_bytes;  /* device memory the metadata holds */
} dp_indexer_plan_info;

DP_API void dp_indexer_plan_info_init(dp_indexer_plan_info* i);

/* Checks every request set (DP_ERR_SHAPE naming the set, request, field, value and limit: more keys or
 * requests than the workspace holds, an empty request, more query rows than keys, a block-table row
 * too short; DP_ERR_ALIGNMENT, DP_ERR_INVALID_ARGUMENT) and builds the metadata: the geometry of every
 * set, the query chunks, and their device arrays (uploaded here, synchronously). info may be NULL. */
DP_API dp_status* dp_indexer_prepare(dp_session* session, const dp_indexer_batch_desc* desc,
                                     dp_indexer_metadata** out, dp_indexer_plan_info* info);
DP_API void dp_indexer_metadata_free(dp_indexer_metadata* metadata);

/* The host's all-gather over the DCP group: every rank sends `bytes` bytes from `send` and receives all
 * ranks' contributions, rank-major, at `recv` (W * bytes), ordered on `stream`. Returns 0 on success;
 * anything else fails the prefill with DP_ERR_COMMUNICATOR carrying that value. */
typedef int32_t (*dp_all_gather_fn)(void* user, uint64_t send, uint64_t recv, uint64_t bytes, dp_stream stream);

typedef struct dp_indexer_prefill_io {
  size_t size;
  uint64_t q;                  /* BF16 [rows, heads, 128]: the indexer queries (roped) */
  uint64_t weights;            /* F32 [rows, heads]: per-head weights with their scales folded in */
  float weight_scale;          /* factor on every score (default 1) */
  uint64_t out;                /* I32 [rows, top_k]: selected positions within each row's request */
  uint64_t workspace;          /* device scratch, 16-byte aligned ... */
  uint64_t workspace_bytes;    /* ... of at least dp_bundle_info.indexer_prefill_workspace_bytes */
  dp_all_gather_fn all_gather; /* required when dcp.size > 1 */
  void* all_gather_user;
} dp_indexer_prefill_io;

DP_API void dp_indexer_prefill_io_init(dp_indexer_prefill_io* io);

/* One layer's prefill over every set of `metadata` (stream-ordered on `stream`; the host's
 * communicator, when called, is ordered on the same stream). Buffers are checked before any launch. */
DP_API dp_status* dp_indexer_prefill(dp_session* session, const dp_indexer_metadata* metadata,
                                     const dp_indexer_cache* cache, const dp_indexer_prefill_io* io,
                                     dp_stream stream);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* DECODEPACK_H_ */
