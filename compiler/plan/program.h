// Layer programs: the ordered kernel launches that run one decoder layer of a layer class at one width,
// with every kernel parameter bound to where its value comes from (templates/README.md lists them).
//
// A program is target-independent (the same kernel names compile for every target) and
// layer-independent: weights are named by their key relative to the layer ("self_attn.q_proj.weight"),
// so one program serves every layer of its class. The bundle records programs in its manifest and the
// runtime interprets them; adding a layer class never needs a runtime change.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "codegen/kernel.h"
#include "deploy/deploy.h"
#include "model/ir.h"

namespace dp::plan {

enum class LayerClass;

// Where one kernel parameter's value comes from.
struct ProgramArg {
  enum class From {
    io,             // a field of the launch's dp_layer_io (`name`: "hidden", "block_table_stride", ...)
    weight,         // the layer's bound weight `name` (layer-relative key; expert groups: expert 0) + `offset` bytes
    expert_stride,  // u32: elements between consecutive experts of the bound group `name`
    workspace,      // the step workspace + `offset` bytes
    kv,             // the layer's bound cache `name` ("kda_state", "conv_q", "conv_k", "conv_v", "mla_latent"),
                    // or the step's K3 attention-residual block buffer "attn_res" (format 1.7)
    kv_stride,      // u32: elements between consecutive slots / blocks of the bound cache `name`
    f32,            // the constant `value`
    u32,            // the constant `value`
    null,           // a null pointer (nullable parameters only)
    tp,             // tensor parallelism, bound by the runtime (format 1.6): pointers "peers" (the device
                    // table of every rank's exchange buffer) and "flag" (the session's error flag word);
                    // u32 "rank", "layer" (the launch's decoder layer), "timeout_us" (the wait bound)
    layer,          // u32: the decoder layer the program runs as (format 1.7; `name` empty). A program serves
                    // every layer of its class; ops whose work depends on the layer index (K3's attnres:
                    // how many attention-residual blocks are stored, whether this layer pushes) read it.
  };
  std::string param;
  From from = From::null;
  std::string name;
  uint64_t offset = 0;
  double value = 0;
};
const char* to_string(ProgramArg::From f);

// A kernel launch, or a collective between kernels (format 1.8): `collective` "nccl_allreduce" sums
// `elements` bf16 values over the ranks with ncclAllReduce, from `args` "send" into "recv"; its `kernel`
// holds only the op name (nothing is compiled) and `name` is the collective's.
struct ProgramStep {
  codegen::KernelInstance kernel;  // target left empty
  std::string name;                // codegen::kernel_name(kernel), or the collective
  std::vector<ProgramArg> args;    // one per kernel parameter, in signature order
  std::string collective;          // "" for a kernel launch
  uint64_t elements = 0;           // collective steps: bf16 values summed
};

struct LayerProgram {
  LayerClass cls;
  int64_t width = 0;
  std::vector<ProgramStep> steps;  // empty when unavailable
  uint64_t workspace = 0;          // bytes of scratch the steps use (256-byte aligned parts)
  uint64_t counter_bytes = 0;      // counter words its ops take from the start of the workspace (below)
  std::string unavailable;         // why this version builds no program for it ("" when it does)
};

// The program of layer class `cls` at `width` requests. Every layer of the class must hold the
// weights it names with equal shapes (checked: dp::Error(input) otherwise). A class this version
// cannot run (K3 parts, fp8 caches, other state layouts, too many rows) gets a program with no steps
// and the reason. At tensor_parallel > 1 the shapes are one rank's shard (equal on every rank) and the
// o-projection and the FFN's down projection write partial sums that an `allreduce` step sums over the
// ranks before the next residual add (templates/allreduce.h), or, at the widths the deploy's
// `allreduce` gives to NCCL, an `nccl_allreduce` collective step over the same buffers.
//
// Counter words: ops whose last block to finish does more work count their blocks in words that must be
// zero when they launch, and leave them at zero (templates/gemm.h dp_gemm_last_block). The runtime zeroes
// the step workspace once, and one workspace serves every program, so no program may write scratch where
// another keeps counters: with `counter_reserve` > 0 every program's scratch starts there and its ops'
// counter words lie below it (from offset 0; launches on one stream run one after another, so ops share
// them). plan() builds the programs once, and again with the largest counter_bytes reserved when some
// program takes counter words. With counter_reserve 0 a program that takes counter words has them under its
// own scratch: such a program is only good for sizing the reserve.
LayerProgram layer_program(const model::Model& m, const deploy::Deploy& d, LayerClass cls, int64_t width,
                           uint64_t counter_reserve = 0);

}  // namespace dp::plan
