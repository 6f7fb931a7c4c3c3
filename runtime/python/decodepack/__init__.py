"""Python binding of libdecodepack (ctypes over the C ABI in decodepack.h; no build step).

Install with `pip install runtime/python` (or from an installed tree, `pip install
<prefix>/share/decodepack/python`). The library is found through, in order: the environment variable
DECODEPACK_LIBRARY (a path to libdecodepack.so), a libdecodepack.so* beside this file (inside the
package directory), the library of the installed tree this package came with
(<prefix>/share/decodepack/python -> <prefix>/lib*/libdecodepack.so.*), then the system loader.
`__version__` is the version of this binding; version() that of the library it loaded.

Device addresses are integers (a torch tensor's data_ptr(), a cudaMalloc result); wherever a tensor
is expected, a torch.Tensor is accepted too when PyTorch is importable (its data_ptr, dtype, shape
and stride are used). Streams are integers (torch.cuda.Stream.cuda_stream) or None for the default
stream. Failing calls raise DecodepackError with the library's stable code and message; planning
refusals are results (Plan.reason), not exceptions.

    import decodepack as dp
    bundle = dp.Bundle("tiny.dpk")
    session = dp.Session(bundle, device=0, rank=0)
    for w in bundle.weights(0):
        session.bind_weight(w.name, model_tensors[w.name])      # groups: bind_expert_weights
    session.finalize_weights()
    session.load_kernels()                                       # before graph capture
    ...
    plan = session.plan(num_requests=3, query_lens=[1, 1, 1], graph_mode=dp.GRAPH_FULL)
    if dp.agree(plan, group=tp_cpu_group)[0] == dp.REASON_NONE:  # all-gathers every rank's reason
        session.launch_final_norm(plan, hidden=h, residual=r, out=h, residual_out=r, stream=s)
"""

import ctypes
import ctypes.util
import glob
import json
import os

__version__ = "0.1.0"  # kept equal to the project's version (CMake checks it, as for decodepack.h)

__all__ = [
    "__version__", "DecodepackError", "Bundle", "Session", "Plan", "agree", "version", "device_count", "query_device",
    "device_desc", "dtype_name",
]

# ---- Constants (decodepack.h) ------------------------------------------------------------------------

OK = 0
CODES = [
    "DP_OK", "DP_ERR_INVALID_ARGUMENT", "DP_ERR_OUT_OF_MEMORY", "DP_ERR_IO", "DP_ERR_FORMAT_VERSION",
    "DP_ERR_FORMAT", "DP_ERR_INTEGRITY", "DP_ERR_DRIVER_UNAVAILABLE", "DP_ERR_DRIVER", "DP_ERR_NO_DEVICE",
    "DP_ERR_TARGET", "DP_ERR_DRIVER_VERSION", "DP_ERR_DEVICE_LIMITS", "DP_ERR_RANK", "DP_ERR_CONFIG",
    "DP_ERR_UNKNOWN_TENSOR", "DP_ERR_MISSING_TENSOR", "DP_ERR_DTYPE", "DP_ERR_SHAPE", "DP_ERR_LAYOUT",
    "DP_ERR_ALIGNMENT", "DP_ERR_REBIND", "DP_ERR_STATE", "DP_ERR_NO_KERNEL", "DP_ERR_ABORTED",
    "DP_ERR_NOT_SUPPORTED", "DP_ERR_INTERNAL", "DP_ERR_COMMUNICATOR", "DP_ERR_NCCL_UNAVAILABLE",
]
for _i, _n in enumerate(CODES):
    globals()[_n[3:]] = _i  # ERR_SHAPE = 18, ...

REASON_NONE, REASON_NO_KV, REASON_PP_STAGE_INPUT, REASON_PIECEWISE = 0, 1, 2, 3
REASON_TOO_MANY_REQUESTS, REASON_NOT_UNIFORM, REASON_BAD_METADATA, REASON_INVALID = 4, 5, 6, 7
REASON_NO_COMMUNICATOR = 8

DTYPE_BF16, DTYPE_F16, DTYPE_F32, DTYPE_F64, DTYPE_U8, DTYPE_I8, DTYPE_I16 = 1, 2, 3, 4, 5, 6, 7
DTYPE_I32, DTYPE_I64, DTYPE_F8_E4M3, DTYPE_F8_E5M2, DTYPE_F8_E8M0, DTYPE_BOOL = 8, 9, 10, 11, 12, 13
_DTYPES_BY_NAME = {
    "BF16": DTYPE_BF16, "F16": DTYPE_F16, "F32": DTYPE_F32, "F64": DTYPE_F64, "U8": DTYPE_U8, "I8": DTYPE_I8,
    "I16": DTYPE_I16, "I32": DTYPE_I32, "I64": DTYPE_I64, "F8_E4M3": DTYPE_F8_E4M3, "F8_E5M2": DTYPE_F8_E5M2,
    "F8_E8M0": DTYPE_F8_E8M0, "BOOL": DTYPE_BOOL,
}

VENDOR_CUDA, VENDOR_HIP = 1, 2
DEVICE_NONE = -1
MIXER_KDA, MIXER_MLA = 1, 2
KV_KDA_STATE, KV_CONV_Q, KV_CONV_K, KV_CONV_V, KV_MLA_LATENT, KV_ATTN_RES = 1, 2, 3, 4, 5, 6
LAYER_MODEL = -1  # the layer of a model-level binding (KV_ATTN_RES)
GRAPH_NONE, GRAPH_PIECEWISE, GRAPH_FULL = 0, 1, 2
PREFETCH_OPROJ_DOWN, PREFETCH_ATTENTION_MOE, PREFETCH_NEXT_ATTENTION, PREFETCH_ATTENTION_OPROJ = 0, 1, 2, 3
SESSION_NO_PREFETCH = 0x1
FLAG_WAIT_TIMEOUT, FLAG_PEER_ABORT = 0x1, 0x2
NULL_BLOCK_ID, PAD_SLOT_ID = 0, -1
MAX_DIMS = 8

# ---- Structs (same layout as decodepack.h) ------------------------------------------------------------

_i32, _u32, _i64, _u64, _sz, _p = ctypes.c_int32, ctypes.c_uint32, ctypes.c_int64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p
_cstr = ctypes.c_char_p


class _Tensor(ctypes.Structure):
    _fields_ = [("data", _u64), ("dtype", _i32), ("ndim", _i32), ("shape", _i64 * MAX_DIMS),
                ("strides", _i64 * MAX_DIMS)]


class _DeviceDesc(ctypes.Structure):
    _fields_ = [("size", _sz), ("vendor", _i32), ("arch", ctypes.c_char * 64), ("name", ctypes.c_char * 128),
                ("driver_version", _i32), ("max_threads_per_block", _i32), ("max_block_dim", _i32 * 3),
                ("max_grid_dim", _i32 * 3), ("max_registers_per_block", _i32), ("max_shared_per_block", _i64),
                ("max_shared_per_block_optin", _i64), ("multiprocessors", _i32), ("l2_bytes", _i64)]


class _OpenOptions(ctypes.Structure):
    _fields_ = [("size", _sz), ("flags", _u32)]


class _BundleInfo(ctypes.Structure):
    _fields_ = [("size", _sz), ("format_major", _i32), ("format_minor", _i32), ("digest", _cstr),
                ("tool_version", _cstr), ("model_type", _cstr), ("num_layers", _i32), ("hidden_size", _i64),
                ("rms_norm_eps", ctypes.c_double), ("tensor_parallel", _i32), ("num_ranks", _i32),
                ("ranks", ctypes.POINTER(_i32)), ("num_widths", _i32), ("widths", ctypes.POINTER(_i32)),
                ("q", _i32), ("num_targets", _i32), ("targets", ctypes.POINTER(_cstr)),
                ("weights_fingerprinted", _i32), ("indexer_heads", _i32), ("indexer_top_k", _i32),
                ("indexer_prefill_workspace_bytes", _u64), ("config_digest", _cstr), ("deploy_json", _cstr),
                ("manifest_json", _cstr), ("vocab_size", _i64)]


class _LayerInfo(ctypes.Structure):
    _fields_ = [("size", _sz), ("index", _i32), ("mixer", _i32), ("ffn", _cstr), ("layer_class", _cstr)]


class _WeightInfo(ctypes.Structure):
    _fields_ = [("size", _sz), ("name", _cstr), ("dtype", _i32), ("ndim", _i32), ("shape", _i64 * MAX_DIMS),
                ("experts", _i32), ("layer", _i32), ("split_dim", _i32)]


class _SessionOptions(ctypes.Structure):
    _fields_ = [("size", _sz), ("vendor", _i32), ("device", _i32), ("rank", _i32), ("tensor_parallel", _i32),
                ("num_speculative_tokens", _i32), ("flags", _u32), ("target", _cstr),
                ("device_desc", ctypes.POINTER(_DeviceDesc))]


class _StepDesc(ctypes.Structure):
    _fields_ = [("size", _sz), ("num_requests", _i32), ("query_lens", ctypes.POINTER(_i32)),
                ("num_accepted", ctypes.POINTER(_i32)), ("state_indices", ctypes.POINTER(_i32)),
                ("state_indices_stride", _i32), ("block_table", ctypes.POINTER(_i32)),
                ("block_table_stride", _i32), ("block_table_cols", _i32), ("graph_mode", _i32),
                ("pp_stage_input", _i32)]


class _PlanResult(ctypes.Structure):
    _fields_ = [("size", _sz), ("reason", _i32), ("width", _i32), ("q", _i32), ("rows", _i32), ("step", _p),
                ("message", ctypes.c_char * 256)]


class _LayerIo(ctypes.Structure):
    _fields_ = [("size", _sz), ("hidden", _u64), ("residual", _u64), ("out", _u64), ("residual_out", _u64),
                ("positions", _u64), ("state_indices", _u64), ("block_table", _u64), ("block_table_stride", _i32),
                ("reserved0", _i32), ("seq_lens", _u64), ("slot_mapping", _u64), ("num_accepted", _u64)]


class _FinalNormIo(ctypes.Structure):
    _fields_ = [("size", _sz), ("hidden", _u64), ("residual", _u64), ("out", _u64), ("residual_out", _u64)]


class _LmHeadIo(ctypes.Structure):
    _fields_ = [("size", _sz), ("hidden", _u64), ("logits", _u64)]


class _IndexerCache(ctypes.Structure):
    _fields_ = [("size", _sz), ("data", _u64), ("num_blocks", _i64), ("block_stride", _i64), ("layout", _i32)]


class _IndexerRequests(ctypes.Structure):
    _fields_ = [("num_requests", _i32), ("seq_lens", ctypes.POINTER(_i64)), ("query_lens", ctypes.POINTER(_i64)),
                ("block_table", _u64), ("block_table_stride", _i64)]


class _IndexerBatchDesc(ctypes.Structure):
    _fields_ = [("size", _sz), ("num_sets", _i32), ("sets", ctypes.POINTER(_IndexerRequests)), ("dcp_rank", _i32),
                ("max_tile_bytes", _u64)]


class _IndexerPlanInfo(ctypes.Structure):
    _fields_ = [("size", _sz), ("rows", _i64), ("sets", _i32), ("query_chunks", _i32), ("keys", _i64),
                ("device_bytes", _u64)]


# int32 (*)(void* user, uint64 send, uint64 recv, uint64 bytes, dp_stream stream)
_ALL_GATHER = ctypes.CFUNCTYPE(_i32, _p, _u64, _u64, _u64, _p)


class _IndexerPrefillIo(ctypes.Structure):
    _fields_ = [("size", _sz), ("q", _u64), ("weights", _u64), ("weight_scale", ctypes.c_float), ("out", _u64),
                ("workspace", _u64), ("workspace_bytes", _u64), ("all_gather", _ALL_GATHER),
                ("all_gather_user", _p)]


# ---- Library ------------------------------------------------------------------------------------------

_LIB = None


def _candidates():
    env = os.environ.get("DECODEPACK_LIBRARY")
    if env:
        return [env]
    here = os.path.dirname(os.path.abspath(__file__))
    beside = sorted(glob.glob(os.path.join(here, "libdecodepack.so*")))
    prefix = os.path.normpath(os.path.join(here, "..", "..", "..", ".."))  # <prefix>/share/decodepack/python/decodepack
    found = beside + sorted(glob.glob(os.path.join(prefix, "lib*", "libdecodepack.so*")) +
                            glob.glob(os.path.join(prefix, "lib", "*", "libdecodepack.so*")))
    system = ctypes.util.find_library("decodepack")
    return found + ([system] if system else []) + ["libdecodepack.so.0"]


def _declare(lib):
    S = _p  # dp_status*
    sigs = {
        "dp_version": (_u32, []), "dp_version_string": (_cstr, []),
        "dp_status_code": (_i32, [_p]), "dp_status_message": (_cstr, [_p]), "dp_status_free": (None, [_p]),
        "dp_code_name": (_cstr, [_i32]), "dp_reason_name": (_cstr, [_i32]), "dp_dtype_name": (_cstr, [_i32]),
        "dp_dtype_size": (_sz, [_i32]),
        "dp_tensor_init": (None, [ctypes.POINTER(_Tensor), _u64, _i32, _i32, ctypes.POINTER(_i64)]),
        "dp_device_desc_init": (None, [ctypes.POINTER(_DeviceDesc)]),
        "dp_device_query": (S, [_i32, _i32, ctypes.POINTER(_DeviceDesc)]),
        "dp_device_count": (S, [_i32, ctypes.POINTER(_i32)]),
        "dp_bundle_open_options_init": (None, [ctypes.POINTER(_OpenOptions)]),
        "dp_bundle_open": (S, [_cstr, ctypes.POINTER(_OpenOptions), ctypes.POINTER(_p)]),
        "dp_bundle_close": (None, [_p]),
        "dp_bundle_get_info": (S, [_p, ctypes.POINTER(_BundleInfo)]),
        "dp_bundle_get_layer": (S, [_p, _i32, ctypes.POINTER(_LayerInfo)]),
        "dp_bundle_weight_count": (_i32, [_p, _i32]),
        "dp_bundle_get_weight": (S, [_p, _i32, _i32, ctypes.POINTER(_WeightInfo)]),
        "dp_bundle_query_validity": (S, [_p, ctypes.POINTER(_DeviceDesc), _i32]),
        "dp_session_options_init": (None, [ctypes.POINTER(_SessionOptions)]),
        "dp_session_create": (S, [_p, ctypes.POINTER(_SessionOptions), ctypes.POINTER(_p)]),
        "dp_session_target": (_cstr, [_p]),
        "dp_session_destroy": (None, [_p]),
        "dp_session_bind_weight": (S, [_p, _cstr, ctypes.POINTER(_Tensor)]),
        "dp_session_bind_expert_weights": (S, [_p, _cstr, ctypes.POINTER(_u64), _i32, ctypes.POINTER(_Tensor)]),
        "dp_session_finalize_weights": (S, [_p]),
        "dp_session_verify_weights": (S, [_p]),
        "dp_session_load_kernels": (S, [_p]),
        "dp_session_bind_kv": (S, [_p, _i32, _i32, ctypes.POINTER(_Tensor)]),
        "dp_session_release_kv": (S, [_p]),
        "dp_session_kv_layout": (S, [_p, _i32, _i32, _i64, ctypes.POINTER(_Tensor)]),
        "dp_step_desc_init": (None, [ctypes.POINTER(_StepDesc)]),
        "dp_plan_result_init": (None, [ctypes.POINTER(_PlanResult)]),
        "dp_plan": (S, [_p, ctypes.POINTER(_StepDesc), ctypes.POINTER(_PlanResult)]),
        "dp_step_width": (_i32, [_p]), "dp_step_q": (_i32, [_p]), "dp_step_layer_kernel": (_i32, [_p, _i32]),
        "dp_agree": (_i32, [ctypes.POINTER(_i32), _i32, ctypes.POINTER(_i32)]),
        "dp_after_step": (S, [_p]),
        "dp_session_error_flag": (S, [_p, ctypes.POINTER(_u64), ctypes.POINTER(_u32)]),
        "dp_session_raise_error_flag": (S, [_p, _u32]),
        "dp_session_exchange_bytes": (_u64, [_p]),
        "dp_session_set_peers": (S, [_p, ctypes.POINTER(_u64), _i32, _u32]),
        "dp_session_nccl_widths": (_i32, [_p, ctypes.POINTER(_i32), _i32]),
        "dp_nccl_get_unique_id": (S, [_cstr, ctypes.POINTER(ctypes.c_uint8)]),
        "dp_session_init_nccl": (S, [_p, ctypes.POINTER(ctypes.c_uint8), _cstr]),
        "dp_session_set_nccl_comm": (S, [_p, _p, _cstr]),
        "dp_layer_io_init": (None, [ctypes.POINTER(_LayerIo)]),
        "dp_launch_layer": (S, [_p, _p, _i32, ctypes.POINTER(_LayerIo), _p]),
        "dp_final_norm_io_init": (None, [ctypes.POINTER(_FinalNormIo)]),
        "dp_launch_final_norm": (S, [_p, _p, ctypes.POINTER(_FinalNormIo), _p]),
        "dp_session_bind_lm_head": (S, [_p, ctypes.POINTER(_Tensor)]),
        "dp_step_lm_head": (_i32, [_p]),
        "dp_lm_head_io_init": (None, [ctypes.POINTER(_LmHeadIo)]),
        "dp_launch_lm_head": (S, [_p, _p, ctypes.POINTER(_LmHeadIo), _p]),
        "dp_prefetch_fork": (S, [_p, _i32, _i32, _i32, _p, ctypes.POINTER(_i32)]),
        "dp_prefetch_join": (S, [_p, _p]),
        "dp_prefetch_set_cap": (S, [_p, _i32, _i32, _u64]),
        "dp_indexer_cache_init": (None, [ctypes.POINTER(_IndexerCache)]),
        "dp_indexer_write_keys": (S, [_p, ctypes.POINTER(_IndexerCache), _u64, _u64, _i64, _p]),
        "dp_indexer_batch_desc_init": (None, [ctypes.POINTER(_IndexerBatchDesc)]),
        "dp_indexer_plan_info_init": (None, [ctypes.POINTER(_IndexerPlanInfo)]),
        "dp_indexer_prepare": (S, [_p, ctypes.POINTER(_IndexerBatchDesc), ctypes.POINTER(_p),
                                   ctypes.POINTER(_IndexerPlanInfo)]),
        "dp_indexer_metadata_free": (None, [_p]),
        "dp_indexer_prefill_io_init": (None, [ctypes.POINTER(_IndexerPrefillIo)]),
        "dp_indexer_prefill": (S, [_p, _p, ctypes.POINTER(_IndexerCache), ctypes.POINTER(_IndexerPrefillIo), _p]),
    }
    for name, (res, args) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args


def _lib():
    global _LIB
    if _LIB is None:
        errors = []
        for path in _candidates():
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                errors.append("%s: %s" % (path, e))
                continue
            _declare(lib)
            _LIB = lib
            break
        else:
            raise ImportError("libdecodepack not found (set DECODEPACK_LIBRARY to its path); tried: " +
                              "; ".join(errors))
    return _LIB


class DecodepackError(Exception):
    """A failed libdecodepack call: `code` (a stable number), `code_name` ("DP_ERR_SHAPE") and the message."""

    def __init__(self, code, message):
        super().__init__("%s: %s" % (CODES[code] if 0 <= code < len(CODES) else code, message))
        self.code = code
        self.code_name = CODES[code] if 0 <= code < len(CODES) else "DP_ERR_?"
        self.message = message


def _check(status):
    if status:
        lib = _lib()
        code = lib.dp_status_code(status)
        message = lib.dp_status_message(status).decode("utf-8", "replace")
        lib.dp_status_free(status)
        raise DecodepackError(code, message)


def version():
    """The loaded library's version string ("0.1.0")."""
    return _lib().dp_version_string().decode()


def dtype_name(dtype):
    return _lib().dp_dtype_name(dtype).decode()


def dtype_size(dtype):
    """Bytes per element of a DTYPE_* code."""
    return _lib().dp_dtype_size(dtype)


# ---- Tensors ------------------------------------------------------------------------------------------

def _torch_dtype(t):
    import torch  # only reached for torch tensors
    table = {torch.bfloat16: DTYPE_BF16, torch.float16: DTYPE_F16, torch.float32: DTYPE_F32,
             torch.float64: DTYPE_F64, torch.uint8: DTYPE_U8, torch.int8: DTYPE_I8, torch.int16: DTYPE_I16,
             torch.int32: DTYPE_I32, torch.int64: DTYPE_I64, torch.bool: DTYPE_BOOL}
    for name, code in (("float8_e4m3fn", DTYPE_F8_E4M3), ("float8_e5m2", DTYPE_F8_E5M2),
                       ("float8_e8m0fnu", DTYPE_F8_E8M0)):
        if hasattr(torch, name):
            table[getattr(torch, name)] = code
    if t.dtype not in table:
        raise DecodepackError(ERR_DTYPE, "torch dtype %s has no decodepack equivalent" % t.dtype)
    return table[t.dtype]


def _is_torch(x):
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr") and hasattr(x, "stride")


def _dtype_code(dtype):
    if isinstance(dtype, str):
        if dtype.upper() not in _DTYPES_BY_NAME:
            raise DecodepackError(ERR_INVALID_ARGUMENT, "dtype %r is not one of %s" % (dtype, sorted(_DTYPES_BY_NAME)))
        return _DTYPES_BY_NAME[dtype.upper()]
    return int(dtype)


def _tensor(x, dtype=None, shape=None, strides=None):
    """A dp_tensor from a torch tensor, or from an integer address plus dtype and shape (and strides,
    in elements; row-major contiguous when omitted)."""
    t = _Tensor()
    if _is_torch(x):
        data, code = x.data_ptr(), _torch_dtype(x)
        shape, strides = tuple(x.shape), tuple(x.stride())
    else:
        if dtype is None or shape is None:
            raise DecodepackError(ERR_INVALID_ARGUMENT, "an integer address needs dtype= and shape=")
        data, code = int(x), _dtype_code(dtype)
    shape = tuple(int(s) for s in shape)
    if len(shape) > MAX_DIMS:
        raise DecodepackError(ERR_INVALID_ARGUMENT, "%d dimensions, at most %d" % (len(shape), MAX_DIMS))
    arr = (_i64 * max(len(shape), 1))(*shape)
    _lib().dp_tensor_init(ctypes.byref(t), data, code, len(shape), arr)
    if strides is not None:
        strides = tuple(int(s) for s in strides)
        if len(strides) != len(shape):
            raise DecodepackError(ERR_INVALID_ARGUMENT, "%d strides for %d dimensions" % (len(strides), len(shape)))
        for i, s in enumerate(strides):
            t.strides[i] = s
    return t


def _from_c_tensor(t):
    return {"dtype": t.dtype, "shape": tuple(t.shape[: t.ndim]), "strides": tuple(t.strides[: t.ndim])}


def _stream(stream):
    if stream is None:
        return None
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return int(stream.cuda_stream)
    return int(stream)


def _address(x):
    if x is None:
        return 0
    if _is_torch(x):
        return x.data_ptr()
    return int(x)


def _i32_array(values):
    if values is None:
        return None, None
    if _is_torch(values):
        values = values.flatten().tolist()
    flat = []

    def walk(v):  # a row-major [rows, cols] array may come as a list of rows
        if isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        else:
            flat.append(int(v))
    walk(values)
    values = flat
    arr = (_i32 * max(len(values), 1))(*values)
    return arr, ctypes.cast(arr, ctypes.POINTER(_i32))


# ---- Devices ------------------------------------------------------------------------------------------

def device_count(vendor=VENDOR_CUDA):
    """Number of devices: 0 on a host without the vendor's driver (DP_ERR_DRIVER_UNAVAILABLE), so that
    a serving host can ask before deciding; other failures (a driver that does not initialise) raise
    DecodepackError. query_device() and Session still raise without a driver, naming what is missing."""
    n = _i32(0)
    st = _lib().dp_device_count(vendor, ctypes.byref(n))
    if st and _lib().dp_status_code(st) == ERR_DRIVER_UNAVAILABLE:
        _lib().dp_status_free(st)
        return 0
    _check(st)
    return n.value


def device_desc(arch, driver_version=0, vendor=None, name="", **limits):
    """A hand-made device description (validation without the device). Limits are dp_device_desc
    field names: max_threads_per_block, max_registers_per_block, max_shared_per_block, ..."""
    d = _DeviceDesc()
    _lib().dp_device_desc_init(ctypes.byref(d))
    d.vendor = vendor if vendor is not None else (VENDOR_HIP if arch.startswith("gfx") else VENDOR_CUDA)
    d.arch = arch.encode()
    d.name = name.encode()
    d.driver_version = driver_version
    for k, v in limits.items():
        if not hasattr(d, k):
            raise TypeError("dp_device_desc has no field %r" % k)
        if isinstance(v, (tuple, list)):
            getattr(d, k)[:] = v
        else:
            setattr(d, k, v)
    return d


def query_device(ordinal=0, vendor=VENDOR_CUDA):
    d = _DeviceDesc()
    _lib().dp_device_desc_init(ctypes.byref(d))
    _check(_lib().dp_device_query(vendor, ordinal, ctypes.byref(d)))
    return d


# ---- Bundles ------------------------------------------------------------------------------------------

class WeightInfo:
    def __init__(self, w):
        self.name = w.name.decode()
        self.dtype = w.dtype
        self.dtype_name = dtype_name(w.dtype)
        self.shape = tuple(w.shape[: w.ndim])
        self.experts = w.experts
        self.layer = w.layer
        self.split_dim = w.split_dim

    def __repr__(self):
        return "WeightInfo(%s, %s, %s%s)" % (self.name, self.dtype_name, list(self.shape),
                                            ", experts=%d" % self.experts if self.experts else "")


class _Handle:
    """An owned C handle (self._h), freed by the C function named _free: close(), del, or `with`."""
    _free = None
    _h = None

    def close(self):
        if self._h:
            getattr(_lib(), self._free)(self._h)
            self._h = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Bundle(_Handle):
    """An open, verified bundle (directory or .dpk)."""
    _free = "dp_bundle_close"

    def __init__(self, path):
        self._h = None
        h = _p()
        _check(_lib().dp_bundle_open(os.fsencode(path), None, ctypes.byref(h)))
        self._h = h


    @property
    def info(self):
        i = _BundleInfo()
        i.size = ctypes.sizeof(i)
        _check(_lib().dp_bundle_get_info(self._h, ctypes.byref(i)))
        return {
            "format_version": (i.format_major, i.format_minor), "digest": i.digest.decode(),
            "tool_version": i.tool_version.decode(), "model_type": i.model_type.decode(),
            "num_layers": i.num_layers, "hidden_size": i.hidden_size, "rms_norm_eps": i.rms_norm_eps,
            "tensor_parallel": i.tensor_parallel, "ranks": [i.ranks[k] for k in range(i.num_ranks)],
            "widths": [i.widths[k] for k in range(i.num_widths)], "q": i.q,
            "targets": [i.targets[k].decode() for k in range(i.num_targets)],
            "weights_fingerprinted": bool(i.weights_fingerprinted),
            "indexer": {"heads": i.indexer_heads, "top_k": i.indexer_top_k,
                        "prefill_workspace_bytes": i.indexer_prefill_workspace_bytes},
            # None from a library older than these fields (it leaves them as the binding zeroed them)
            "config_digest": i.config_digest.decode() if i.config_digest else None,
            "deploy": json.loads(i.deploy_json) if i.deploy_json else None,
            "vocab_size": i.vocab_size or None,
        }

    @property
    def manifest(self):
        """manifest.json as the library opened and checked it (a dict)."""
        i = _BundleInfo()
        i.size = ctypes.sizeof(i)
        _check(_lib().dp_bundle_get_info(self._h, ctypes.byref(i)))
        return json.loads(i.manifest_json) if i.manifest_json else None

    def layer(self, index):
        li = _LayerInfo()
        li.size = ctypes.sizeof(li)
        _check(_lib().dp_bundle_get_layer(self._h, index, ctypes.byref(li)))
        return {"index": li.index, "mixer": "kda" if li.mixer == MIXER_KDA else "mla", "ffn": li.ffn.decode(),
                "class": li.layer_class.decode()}

    def weights(self, rank=0):
        """The rank's weight entries as a host binds them (dp_bundle_weight_count): an expert group is one
        entry of `experts` tensors, bound with bind_expert_weights. weight_counts() counts them the other
        ways too."""
        n = _lib().dp_bundle_weight_count(self._h, rank)
        if n < 0:
            _check(_lib().dp_bundle_query_validity(self._h, None, rank))
        out = []
        for k in range(n):
            w = _WeightInfo()
            w.size = ctypes.sizeof(w)
            _check(_lib().dp_bundle_get_weight(self._h, rank, k, ctypes.byref(w)))
            out.append(WeightInfo(w))
        return out

    def weight_counts(self, rank=0):
        """The rank's decode weights counted as `decodepack inspect --json` and `plan --json` count them:
        {"weight_entries": entries to bind (an expert group is one), "decode_tensors": the tensors they hold
        (each expert counted), "decode_bytes": their bytes}. A checkpoint has more tensors than this (the
        embeddings and LM head stay with the host: plan's model.checkpoint_tensors)."""
        entries = self.weights(rank)
        tensors = nbytes = 0
        for w in entries:
            n = dtype_size(w.dtype)
            for s in w.shape:
                n *= s
            count = w.experts if w.experts > 0 else 1
            tensors += count
            nbytes += n * count
        return {"weight_entries": len(entries), "decode_tensors": tensors, "decode_bytes": nbytes}

    def query_validity(self, device=None, rank=-1):
        """Raises DecodepackError when the bundle would not run on `device` (a device_desc() or
        query_device() result; None: no device checks) as `rank` (-1: not checked)."""
        _check(_lib().dp_bundle_query_validity(self._h, ctypes.byref(device) if device is not None else None, rank))


# ---- Sessions -----------------------------------------------------------------------------------------

class Plan:
    """dp_plan's result. `step` is owned by the session (valid while it lives)."""

    def __init__(self, r):
        self.reason = r.reason
        self.reason_name = _lib().dp_reason_name(r.reason).decode()
        self.width, self.q, self.rows = r.width, r.q, r.rows
        self.step = r.step
        self.message = r.message.decode("utf-8", "replace")

    def layer_kernel(self, layer):
        """True when the bundle has layer `layer`'s program at this width."""
        return bool(self.step) and _lib().dp_step_layer_kernel(self.step, layer) != 0

    def lm_head(self):
        """True when the bundle has the LM head's GEMM at this width (format 1.5 bundles)."""
        return bool(self.step) and _lib().dp_step_lm_head(self.step) != 0

    def __repr__(self):
        if self.reason == REASON_NONE:
            return "Plan(width=%d, q=%d)" % (self.width, self.q)
        return "Plan(%s: %s)" % (self.reason_name, self.message)


def _all_gather(value, group):
    """Every rank's `value` (a picklable object), in rank order, over a torch.distributed process group.
    torch is imported here, so the binding itself imports without it."""
    try:
        import torch.distributed as dist
    except ImportError as e:
        raise ImportError("decodepack: agree/after_step with group= needs torch.distributed (%s)" % e) from e

    out = [None] * dist.get_world_size(group=group)
    dist.all_gather_object(out, value, group=group)
    return out


def agree(reasons, group=None):
    """The TP verdict: (reason, refusing_rank), the same on every rank.

    Without `group`, `reasons` is every rank's plan reason in rank order (the host all-gathered them).
    With `group` (a torch.distributed process group over the TP ranks, e.g. a gloo group on the CPU),
    `reasons` is this rank's own reason (an int or a Plan): every rank of the group must call it; the
    reasons are all-gathered over the group, then reduced by dp_agree."""
    if group is not None:
        own = reasons.reason if isinstance(reasons, Plan) else int(reasons)
        reasons = [int(r) for r in _all_gather(own, group)]
    arr, ptr = _i32_array(reasons)
    who = _i32(-1)
    verdict = _lib().dp_agree(ptr, len(reasons) if reasons is not None else 0, ctypes.byref(who))
    return verdict, who.value


def _enc(text):
    return text.encode() if text else None


def nccl_unique_id(library=None):
    """A new NCCL unique id (128 bytes; ncclGetUniqueId through the runtime's NCCL): rank 0 makes it and
    broadcasts it to the other ranks, who pass it to Session.init_nccl. `library`: None for
    $DECODEPACK_NCCL_LIBRARY or libnccl.so.2."""
    buf = (ctypes.c_uint8 * 128)()
    _check(_lib().dp_nccl_get_unique_id(_enc(library), buf))
    return bytes(buf)


def broadcast_nccl_unique_id(group=None, library=None, device=None):
    """The unique id, the same on every rank of the torch.distributed `group` (None: the default group):
    the group's first rank makes it (nccl_unique_id) and broadcasts its 128 bytes as a uint8 tensor, as
    vLLM's PyNcclCommunicator does. `device`: where the tensor travels (None: the CPU, for gloo groups;
    pass the rank's torch.device for an NCCL group). Every rank of the group must call it."""
    try:
        import torch
        import torch.distributed as dist
    except ImportError as e:
        raise ImportError("decodepack: broadcast_nccl_unique_id needs torch.distributed (%s)" % e) from e
    src = dist.get_global_rank(group, 0) if group is not None else 0
    t = torch.zeros(128, dtype=torch.uint8, device=device or "cpu")
    if dist.get_rank() == src:
        t.copy_(torch.frombuffer(bytearray(nccl_unique_id(library)), dtype=torch.uint8))
    dist.broadcast(t, src=src, group=group)
    return bytes(t.cpu().tolist())


class Session(_Handle):
    """One (device, rank) session. device=None makes a host-only session (binds, checks, plans)."""
    _free = "dp_session_destroy"

    def __init__(self, bundle, device=0, rank=0, tensor_parallel=0, num_speculative_tokens=-1, target=None,
                 device_desc=None, vendor=VENDOR_CUDA, prefetch=True):
        self._h = None
        o = _SessionOptions()
        _lib().dp_session_options_init(ctypes.byref(o))
        o.vendor = vendor
        o.device = DEVICE_NONE if device is None else device
        o.rank = rank
        o.tensor_parallel = tensor_parallel
        o.num_speculative_tokens = num_speculative_tokens
        o.flags = 0 if prefetch else SESSION_NO_PREFETCH
        o.target = target.encode() if target else None
        if device_desc is not None:
            o.device_desc = ctypes.pointer(device_desc)
        h = _p()
        _check(_lib().dp_session_create(bundle._h, ctypes.byref(o), ctypes.byref(h)))
        self._h = h
        self.bundle = bundle  # the C session holds its own reference; this keeps the Python object alive too


    @property
    def target(self):
        return _lib().dp_session_target(self._h).decode()

    # Weights
    def bind_weight(self, name, tensor, dtype=None, shape=None, strides=None):
        t = _tensor(tensor, dtype, shape, strides)
        _check(_lib().dp_session_bind_weight(self._h, name.encode(), ctypes.byref(t)))

    def bind_expert_weights(self, group, experts, dtype=None, shape=None, strides=None):
        """`experts`: a list of addresses or tensors (one per expert), or one stacked torch tensor
        [E, ...] whose rows are the experts."""
        if _is_torch(experts):
            first = experts[0]
            ptrs = [experts[e].data_ptr() for e in range(experts.shape[0])]
        else:
            experts = list(experts)
            first = experts[0] if experts else 0
            ptrs = [_address(e) for e in experts]
        t = _tensor(first, dtype, shape, strides)
        arr = (_u64 * max(len(ptrs), 1))(*ptrs)
        _check(_lib().dp_session_bind_expert_weights(self._h, group.encode(), arr, len(ptrs), ctypes.byref(t)))

    def finalize_weights(self):
        _check(_lib().dp_session_finalize_weights(self._h))

    def verify_weights(self):
        """Reads the bound weights back and checks them against the bundle's fingerprints."""
        _check(_lib().dp_session_verify_weights(self._h))

    def load_kernels(self):
        _check(_lib().dp_session_load_kernels(self._h))

    # KV caches
    def kv_layout(self, layer, kind, count):
        t = _Tensor()
        _check(_lib().dp_session_kv_layout(self._h, layer, kind, count, ctypes.byref(t)))
        return _from_c_tensor(t)

    def bind_kv(self, layer, kind, tensor, dtype=None, shape=None, strides=None):
        t = _tensor(tensor, dtype, shape, strides)
        _check(_lib().dp_session_bind_kv(self._h, layer, kind, ctypes.byref(t)))

    def release_kv(self):
        _check(_lib().dp_session_release_kv(self._h))

    # Steps
    def plan(self, num_requests, query_lens=None, num_accepted=None, state_indices=None, state_indices_stride=0,
             block_table=None, block_table_stride=0, block_table_cols=0, graph_mode=GRAPH_NONE, pp_stage_input=False):
        """Plans a step from its host metadata (lists or CPU tensors; a 2-D array such as the block table
        may be a list of rows); returns a Plan."""
        d = _StepDesc()
        _lib().dp_step_desc_init(ctypes.byref(d))
        keep = []
        d.num_requests = num_requests
        for field, values in (("query_lens", query_lens), ("num_accepted", num_accepted),
                              ("state_indices", state_indices), ("block_table", block_table)):
            arr, ptr = _i32_array(values)
            if arr is not None:
                keep.append(arr)
                setattr(d, field, ptr)
        d.state_indices_stride = state_indices_stride
        d.block_table_stride = block_table_stride
        d.block_table_cols = block_table_cols
        d.graph_mode = graph_mode
        d.pp_stage_input = 1 if pp_stage_input else 0
        r = _PlanResult()
        _lib().dp_plan_result_init(ctypes.byref(r))
        _check(_lib().dp_plan(self._h, ctypes.byref(d), ctypes.byref(r)))
        return Plan(r)

    def after_step(self, group=None):
        """Raises DecodepackError once a wait of the in-kernel all-reduce gave up (the error flag).

        With `group` (the TP ranks' torch.distributed process group) every rank's outcome is
        all-gathered first, so that all ranks raise in the same step, each naming the first failing rank
        (a rank that finished the step before a peer gave up would otherwise see it one step later)."""
        try:
            _check(_lib().dp_after_step(self._h))
            mine = None
        except DecodepackError as e:
            if group is None:
                raise
            mine = (e.code, e.message)
        if group is None:
            return
        for rank, got in enumerate(_all_gather(mine, group)):
            if got is not None:
                raise DecodepackError(got[0], "rank %d: %s" % (rank, got[1]))

    # Tensor parallelism (bundle format 1.6)
    def exchange_bytes(self):
        """Bytes of this rank's exchange buffer for the in-kernel all-reduce (0: the bundle has none)."""
        return _lib().dp_session_exchange_bytes(self._h)

    def set_peers(self, exchange, timeout_us=10_000_000):
        """Every rank's exchange buffer (device addresses or tensors, in rank order, this rank's own
        included), before load_kernels; zeroes this rank's buffer. Then barrier the group."""
        addrs = [t if isinstance(t, int) else t.data_ptr() for t in exchange]
        arr = (_u64 * max(1, len(addrs)))(*addrs)
        _check(_lib().dp_session_set_peers(self._h, arr, len(addrs), timeout_us))

    # NCCL all-reduce (bundle format 1.8)
    def nccl_widths(self):
        """The widths whose programs all-reduce with NCCL (sorted; [] when none)."""
        n = _lib().dp_session_nccl_widths(self._h, None, 0)
        arr = (_i32 * max(1, n))()
        _lib().dp_session_nccl_widths(self._h, arr, n)
        return list(arr)[:n]

    def init_nccl(self, unique_id=None, group=None, library=None, device=None):
        """Creates the session's NCCL communicator (a collective: every rank calls it). `unique_id`: the
        128 bytes rank 0 made (nccl_unique_id); or None with `group`, a torch.distributed group over the TP
        ranks, to make and broadcast it here (broadcast_nccl_unique_id). NCCL needs one GPU per rank."""
        if unique_id is None:
            unique_id = broadcast_nccl_unique_id(group, library, device)
        if len(unique_id) != 128:
            raise ValueError("decodepack: an NCCL unique id is 128 bytes, got %d" % len(unique_id))
        buf = (ctypes.c_uint8 * 128)(*bytes(unique_id))
        _check(_lib().dp_session_init_nccl(self._h, buf, _enc(library)))

    def set_nccl_comm(self, comm, library=None):
        """Uses the host's ncclComm_t (an int address) of `library`; the host keeps and destroys it."""
        _check(_lib().dp_session_set_nccl_comm(self._h, ctypes.c_void_p(comm), _enc(library)))

    def error_flag(self):
        """(device address of the flag word, its value)."""
        addr, value = _u64(0), _u32(0)
        _check(_lib().dp_session_error_flag(self._h, ctypes.byref(addr), ctypes.byref(value)))
        return addr.value, value.value

    def raise_error_flag(self, bits):
        _check(_lib().dp_session_raise_error_flag(self._h, bits))

    # Launch
    @staticmethod
    def _step(plan):
        return plan.step if isinstance(plan, Plan) else plan

    def launch_layer(self, plan, layer, stream=None, **io):
        """io: hidden, residual, out, residual_out, positions, state_indices, block_table,
        block_table_stride, seq_lens, slot_mapping, num_accepted (addresses or tensors)."""
        s = _LayerIo()
        _lib().dp_layer_io_init(ctypes.byref(s))
        for k, v in io.items():
            if k == "block_table_stride":
                s.block_table_stride = int(v)
            elif k in dict(_LayerIo._fields_) and k not in ("size", "reserved0"):
                setattr(s, k, _address(v))
            else:
                raise TypeError("dp_layer_io has no field %r" % k)
        _check(_lib().dp_launch_layer(self._h, self._step(plan), layer, ctypes.byref(s), _stream(stream)))

    def launch_final_norm(self, plan, hidden, out, residual_out, residual=None, stream=None):
        s = _FinalNormIo()
        _lib().dp_final_norm_io_init(ctypes.byref(s))
        s.hidden, s.residual = _address(hidden), _address(residual)
        s.out, s.residual_out = _address(out), _address(residual_out)
        _check(_lib().dp_launch_final_norm(self._h, self._step(plan), ctypes.byref(s), _stream(stream)))

    def bind_lm_head(self, tensor, dtype=None, shape=None, strides=None):
        """The host's LM head weight [vocab / tp, hidden] bf16 (format 1.5 bundles carry its GEMM)."""
        t = _tensor(tensor, dtype, shape, strides)
        _check(_lib().dp_session_bind_lm_head(self._h, ctypes.byref(t)))

    def launch_lm_head(self, plan, hidden, logits, stream=None):
        """fp32 logits [rows, vocab / tp] of the final norm's output rows."""
        s = _LmHeadIo()
        _lib().dp_lm_head_io_init(ctypes.byref(s))
        s.hidden, s.logits = _address(hidden), _address(logits)
        _check(_lib().dp_launch_lm_head(self._h, self._step(plan), ctypes.byref(s), _stream(stream)))

    def prefetch_fork(self, point, layer, width, stream=None):
        launched = _i32(0)
        _check(_lib().dp_prefetch_fork(self._h, point, layer, width, _stream(stream), ctypes.byref(launched)))
        return bool(launched.value)

    def prefetch_join(self, stream=None):
        _check(_lib().dp_prefetch_join(self._h, _stream(stream)))

    def prefetch_set_cap(self, point, width, nbytes):
        """Limits the point's tables at `width` to their first `nbytes` (0: off); see dp_prefetch_set_cap."""
        _check(_lib().dp_prefetch_set_cap(self._h, point, width, nbytes))

    # Sparse-attention indexer prefill (decodepack.h "Sparse-attention indexer prefill")
    @staticmethod
    def _indexer_cache(cache):
        """cache: IndexerCache, or a dict with data, num_blocks, block_stride and optionally layout."""
        if isinstance(cache, IndexerCache):
            cache = cache.__dict__
        c = _IndexerCache()
        _lib().dp_indexer_cache_init(ctypes.byref(c))
        c.data = _address(cache["data"])
        c.num_blocks = int(cache["num_blocks"])
        c.block_stride = int(cache["block_stride"])
        c.layout = int(cache.get("layout", INDEXER_LAYOUT_SPLIT))
        return c

    def indexer_write_keys(self, cache, keys, slot_mapping, count=None, stream=None):
        """Quantises keys (BF16 [count, 128]) into the MXFP4 cache at slot_mapping (I64 [count], -1 skips)."""
        if count is None:
            count = keys.shape[0] if _is_torch(keys) else None
        if count is None:
            raise TypeError("indexer_write_keys: pass count when keys is an address")
        c = self._indexer_cache(cache)
        _check(_lib().dp_indexer_write_keys(self._h, ctypes.byref(c), _address(keys), _address(slot_mapping),
                                            int(count), _stream(stream)))

    def indexer_prepare(self, sets, dcp_rank=0, max_tile_bytes=0):
        """sets: a list of dicts with seq_lens, query_lens (lists), block_table (device address or tensor) and
        block_table_stride. Returns the IndexerMetadata of one attention group (free it, or use `with`)."""
        keep = []
        arr = (_IndexerRequests * max(len(sets), 1))()
        for i, st in enumerate(sets):
            seq = (_i64 * max(len(st["seq_lens"]), 1))(*[int(v) for v in st["seq_lens"]])
            qry = (_i64 * max(len(st["query_lens"]), 1))(*[int(v) for v in st["query_lens"]])
            if len(st["seq_lens"]) != len(st["query_lens"]):
                raise ValueError("indexer_prepare: set %d has %d seq_lens and %d query_lens" %
                                 (i, len(st["seq_lens"]), len(st["query_lens"])))
            keep += [seq, qry]
            arr[i].num_requests = len(st["seq_lens"])
            arr[i].seq_lens = ctypes.cast(seq, ctypes.POINTER(_i64))
            arr[i].query_lens = ctypes.cast(qry, ctypes.POINTER(_i64))
            arr[i].block_table = _address(st["block_table"])
            bt = st.get("block_table_stride")
            if bt is None and _is_torch(st["block_table"]):
                bt = st["block_table"].stride(0)
            arr[i].block_table_stride = int(bt or 0)
        d = _IndexerBatchDesc()
        _lib().dp_indexer_batch_desc_init(ctypes.byref(d))
        d.num_sets = len(sets)
        d.sets = ctypes.cast(arr, ctypes.POINTER(_IndexerRequests))
        d.dcp_rank = dcp_rank
        d.max_tile_bytes = max_tile_bytes
        info = _IndexerPlanInfo()
        _lib().dp_indexer_plan_info_init(ctypes.byref(info))
        h = _p()
        _check(_lib().dp_indexer_prepare(self._h, ctypes.byref(d), ctypes.byref(h), ctypes.byref(info)))
        return IndexerMetadata(h, info, self)

    def indexer_prefill(self, metadata, cache, q, weights, out, workspace, workspace_bytes=None, weight_scale=1.0,
                        all_gather=None, stream=None):
        """One layer's prefill. all_gather(send, recv, nbytes, stream) -> None: the host's communicator over the
        DCP group (ints: device addresses, bytes per rank, the stream); required when dcp.size > 1. An
        exception it raises fails the call (DP_ERR_COMMUNICATOR) and is re-raised here."""
        c = self._indexer_cache(cache)
        io = _IndexerPrefillIo()
        _lib().dp_indexer_prefill_io_init(ctypes.byref(io))
        io.q, io.weights, io.out, io.workspace = _address(q), _address(weights), _address(out), _address(workspace)
        if workspace_bytes is None:
            workspace_bytes = workspace.numel() * workspace.element_size() if _is_torch(workspace) else 0
        io.workspace_bytes = int(workspace_bytes)
        io.weight_scale = weight_scale
        raised = []
        if all_gather is not None:
            def trampoline(_user, send, recv, nbytes, strm):
                try:
                    all_gather(int(send), int(recv), int(nbytes), strm)
                    return 0
                except BaseException as e:  # noqa: B902 (no exception may cross into C)
                    raised.append(e)
                    return -1
            io.all_gather = _ALL_GATHER(trampoline)
        status = _lib().dp_indexer_prefill(self._h, metadata._h, ctypes.byref(c), ctypes.byref(io), _stream(stream))
        if raised:
            if status:
                _lib().dp_status_free(status)
            raise raised[0]
        _check(status)


INDEXER_LAYOUT_SPLIT, INDEXER_LAYOUT_PACKED = 0, 1


class IndexerCache:
    """One rank's MXFP4 index-key cache: data (address or tensor), num_blocks, block_stride (bytes), layout."""

    def __init__(self, data, num_blocks, block_stride, layout=INDEXER_LAYOUT_SPLIT):
        self.data, self.num_blocks, self.block_stride, self.layout = data, num_blocks, block_stride, layout


class IndexerMetadata(_Handle):
    """dp_indexer_prepare's plan of one attention group; valid while its session lives."""
    _free = "dp_indexer_metadata_free"

    def __init__(self, h, info, session):
        self._h = h
        self._session = session  # freed before the session
        self.info = {"rows": info.rows, "sets": info.sets, "query_chunks": info.query_chunks, "keys": info.keys,
                     "device_bytes": info.device_bytes}
