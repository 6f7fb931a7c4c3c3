// What codegen knows about an op: its parameters (the kernel name), its checks, its entry point's
// arguments, its launch shape and the device template it calls. Internal to codegen/.
//
// One file per op family, beside the family's device header: ops/norm.cpp for templates/norm.h,
// ops/gemm.cpp for gemm.h, and so on. Each returns its ops' entries; kernel.cpp joins them into the one
// table that names, checks and instantiates every kernel.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <map>
#include <string>
#include <vector>

#include "codegen/kernel.h"

namespace dp::codegen::ops {

using Params = std::map<std::string, int64_t>;

struct ParamSpec {
  const char* key;     // "W": the name in KernelInstance::params
  const char* prefix;  // "w": its spelling in the kernel name
  int64_t min, max;    // inclusive
  const char* doc;     // what the letter means for this op (templates/README.md lists them all)
  // Left out of the kernel name when 0 (optional segments, flags that are usually off). Only for
  // parameters whose zero is unambiguous from the others (trailing GEMM segments, the f32 flag). Such a
  // parameter may also be left out of an instance: it is 0 (the e4m3 flag Q8 of instances made before it).
  bool omit_zero = false;
};

// A parameter of the entry point before layout (offsets are computed in kernel_signature()).
struct ArgSpec {
  const char* name;
  KernelParam::Kind kind;
  const char* c_type;
  std::string shape;
  std::string doc;
  bool nullable = false;
};

struct DeviceCall {
  std::string fn;
  std::vector<std::string> args;
};

struct OpSpec {
  const char* name;
  const char* header;     // in templates/
  const char* device_fn;  // the device template the entry point calls
  std::vector<ParamSpec> params;  // fixed order: the order of the kernel name
  std::function<void(const Params&, const std::string& who)> check;  // op-specific constraints
  std::function<std::vector<int64_t>(const Params&)> template_args;   // device template arguments
  std::function<std::vector<ArgSpec>(const Params&)> args;
  std::function<LaunchShape(const Params&)> launch;
  std::function<uint32_t(const Params&)> block_threads;
  // The launch-bounds macro of the entry point (vendor.h, or the op header's own).
  const char* bounds = "DP_LAUNCH_BOUNDS";
  // The device call when it is not device_fn<template args>(every parameter, in order): the device
  // function (empty: device_fn) and its argument expressions (parameter names, "nullptr" for one this
  // instance lacks; empty: every parameter in order). No function here: the default call.
  std::function<DeviceCall(const Params&)> call = {};
  // When set, the launch-bounds macro by instance instead of `bounds` (set after the initializer).
  std::function<const char*(const Params&)> bounds_for = {};
  // When set, the header by instance instead of `header` (an op whose fused forms live in another
  // family's header: gemm's fused routing is in moe.h).
  std::function<const char*(const Params&)> header_for = {};
  // When set and true for an instance: its entry point only triggers its dependents, and the device
  // function waits for the previous kernel itself, after its first loads of what no earlier kernel of
  // the step writes (weights; kda_step also its own state; vendor.h).
  std::function<bool(const Params&)> early_weights = {};
  // When set: the dynamic shared memory an instance is launched with on `target` (launch_shape; 0 where
  // the target's code does not use it).
  std::function<uint32_t(const Params&, const std::string& target)> dynamic_shared = {};
};

// The families, one per templates/ header.
std::vector<OpSpec> norm_ops();      // rmsnorm
std::vector<OpSpec> attnres_ops();   // attnres
std::vector<OpSpec> gemm_ops();      // gemm
std::vector<OpSpec> kda_ops();       // kda_step
std::vector<OpSpec> moe_ops();       // moe_route, moe_up, moe_down, mlp_up
std::vector<OpSpec> mla_ops();       // mla_prep, mla_attn, mla_combine
std::vector<OpSpec> indexer_ops();   // idx_quant, idx_pack, idx_stage, idx_score, idx_topk, idx_rows
std::vector<OpSpec> prefetch_ops();  // prefetch
std::vector<OpSpec> allreduce_ops(); // allreduce

// Blocks of an allreduce launch over [rows, h] (its grid; the exchange buffer has a flag line per block).
uint32_t allreduce_blocks(int64_t rows, int64_t h);

// ---- GEMM-shaped blocks (templates/gemm.h, moe.h) -----------------------------------------------
// Every GEMM-shaped block is 256 threads = 8 groups of 32 lanes; a group owns a slot of 16*MT weight
// rows (MT tiles of 16 rows, the tensor-core tile height on NVIDIA) and one of S K-slices (split-K), so
// a block covers (8/S)*16*MT rows. These are functions of the named parameters (never of the target),
// so the kernel name stays a function of its parameters.
inline constexpr uint32_t kGemmThreads = 256;
inline constexpr int64_t kGemmGroups = 8;
inline constexpr int64_t kTileRows = 16;       // weight rows of one tensor-core tile
inline constexpr int64_t kMaxGemmRows = 32;    // activation rows (W*q) of one launch
inline constexpr int64_t kTargetBlocks = 264;  // about two blocks per SM of a 132-SM H200

// Launch bounds of the GEMM-shaped ops (gemm, mlp_up, moe_up, moe_down): at most 128 registers, two
// blocks per SM, up to 8 activation rows (one tensor-core column tile); their grids have more blocks
// than SMs, and at one block per SM the rest ran as a second wave (templates/gemm.h). From 9 rows the
// second column tile's accumulators do not fit 128 registers (spills), so one block per SM.
inline constexpr int64_t kMaxTwoBlockRows = 8;  // activation rows up to which they take two blocks per SM
inline const char* gemv_bounds(const Params& p) {
  return p.at("W") <= kMaxTwoBlockRows ? "DP_KERNEL_BOUNDS_2" : "DP_KERNEL_BOUNDS";
}

// ---- Weight ring (templates/gemm.h, dp_ring_stream) ----------------------------------------------
// RG > 0: the e4m3 (or MXFP4) weights of a GEMM-shaped block stream through a ring of RG stages in shared memory,
// filled by bulk asynchronous copies (NVIDIA from sm_90; elsewhere the template reads weights as without
// it, and the launch takes no dynamic shared memory). A stage holds `rows` weight rows of `cols` bytes,
// each padded by 64 bytes.
ParamSpec ring_param(const char* doc);
bool bulk_copy_target(const std::string& target);  // "sm_90a" and later NVIDIA targets
inline uint32_t ring_bytes(int64_t rows, int64_t cols, int64_t stages) {
  return static_cast<uint32_t>(stages * rows * (cols + 64));
}
// Fails unless RG (when set) has the e4m3 or MXFP4 weights it streams and the form `what` allows it.
void check_ring(const Params& p, const std::string& who, bool allowed, const char* what);

// ---- Messages and shapes ------------------------------------------------------------------------
// FP8 block-quantized weights (e4m3 values, fp32 scales per 128 x 128 block): the "Q8" parameter of the
// ops that read weights (0: bf16), the scale argument of an e4m3 weight argument ("w0" -> "w0_scale")
// and its shape.
inline constexpr int64_t kFp8Block = 128;
inline constexpr int64_t kMxfp4Group = 32;   // MXFP4: values per E8M0 scale (Q4 forms)
inline constexpr int64_t kMxfp4Chunk = 128;  // MXFP4: columns of a chunk, the K unit of the tensor-core loops
ParamSpec q8_param(const char* doc);
std::string scale_shape(int64_t rows, int64_t cols);  // "[ceil(rows/128), ceil(cols/128)] fp32"
// Fails unless `keys` are multiples of 16 (rows read as 16-byte e4m3 vectors).
void check_multiple_of_16(const Params& p, const std::string& who, std::initializer_list<const char*> keys);

// Fails naming each of `keys` that is not a multiple of 8 (rows read as 16-byte bf16 vectors).
void check_multiple_of_8(const Params& p, const std::string& who, std::initializer_list<const char*> keys);
// "[4, 2304] bf16" from numbers, or from the parameters named by `keys`.
std::string shape(std::initializer_list<int64_t> d, const char* dtype);
std::string dims(const Params& p, std::initializer_list<const char*> keys, const char* dtype);

}  // namespace dp::codegen::ops
