// allreduce (templates/allreduce.h): the one-shot in-kernel all-reduce of a [W, H] bf16 partial over R
// tensor-parallel ranks through exchange buffers every rank maps, with bounded waits.
#include "codegen/ops/spec.h"

#include "common/error.h"

namespace dp::codegen::ops {
namespace {

constexpr uint32_t kAllreduceThreads = 256;
constexpr int64_t kAllreduceMaxBlocks = 64;  // DP_AR_MAX_BLOCKS: one flag line per block index

}  // namespace

// Blocks of an all-reduce launch: one per 256 16-byte vectors of [W, H] (one vector per thread), at
// most 64 (each block index has its own flag line per rank). Every rank launches the same grid.
uint32_t allreduce_blocks(int64_t rows, int64_t h) {
  const int64_t vecs = rows * h / 8;
  const int64_t blocks = (vecs + kAllreduceThreads - 1) / kAllreduceThreads;
  return static_cast<uint32_t>(std::clamp<int64_t>(blocks, 1, kAllreduceMaxBlocks));
}

std::vector<OpSpec> allreduce_ops() {
  return {
      {
          "allreduce",
          "allreduce.h",
          "dp_allreduce",
          {{"W", "w", 1, 256, "rows (batch width x rows per request)"},
           {"H", "h", 8, 1 << 20, "row length (hidden size), a multiple of 8"},
           {"R", "r", 2, 8, "tensor-parallel ranks"}},
          [](const Params& p, const std::string& who) { check_multiple_of_8(p, who, {"H"}); },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W"), p.at("H"), p.at("R"), kAllreduceThreads,
                                        allreduce_blocks(p.at("W"), p.at("H"))};
          },
          [](const Params& p) {
            return std::vector<ArgSpec>{
                {"partial", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "this rank's partial sum"},
                {"out", KernelParam::Kind::pointer, "dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "the sum over every rank (may alias partial)"},
                {"peers", KernelParam::Kind::pointer, "const dp_u64*", shape({p.at("R")}, "u64"),
                 "every rank's exchange buffer, by rank"},
                {"flag", KernelParam::Kind::pointer, "dp_u32*", "[1] u32", "the session's error flag word"},
                {"rank", KernelParam::Kind::u32, "dp_u32", "", "this rank"},
                {"layer", KernelParam::Kind::u32, "dp_u32", "", "decoder layer (recorded when a wait gives up)"},
                {"op", KernelParam::Kind::u32, "dp_u32", "", "0: after the o-projection, 1: after the FFN"},
                {"timeout_us", KernelParam::Kind::u32, "dp_u32", "", "bound of each wait, microseconds"},
            };
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = allreduce_blocks(p.at("W"), p.at("H"));
            s.block[0] = kAllreduceThreads;
            return s;
          },
          [](const Params&) { return kAllreduceThreads; },
      },
  };
}

}  // namespace dp::codegen::ops
