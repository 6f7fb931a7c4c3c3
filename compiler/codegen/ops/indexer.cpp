// idx_quant, idx_pack, idx_stage, idx_score, idx_topk, idx_rows (templates/indexer.h): the FP4
// sparse-attention indexer prefill. Grids are chosen at run time from the chunk.
#include "codegen/ops/spec.h"

#include <fmt/format.h>

#include "common/error.h"

namespace dp::codegen::ops {
namespace {

// Indexer ops: fixed blocks, grids from the chunk at run time (the manifest's grid is a default).
constexpr int64_t kIdxThreads = 256;
LaunchShape idx_launch(uint32_t threads) {
  LaunchShape s;
  s.block[0] = threads;
  s.grid_is_default = true;
  return s;
}

// An indexer op without compile-time parameters: blocks of kIdxThreads, the same arguments always.
OpSpec indexer_op(const char* name, const char* device_fn, std::vector<ArgSpec> args) {
  return {name,
          "indexer.h",
          device_fn,
          {},
          [](const Params&, const std::string&) {},
          [](const Params&) { return std::vector<int64_t>{kIdxThreads}; },
          [args](const Params&) { return args; },
          [](const Params&) { return idx_launch(kIdxThreads); },
          [](const Params&) { return static_cast<uint32_t>(kIdxThreads); }};
}

}  // namespace

std::vector<OpSpec> indexer_ops() {
  return {
      indexer_op("idx_quant", "dp_idx_quant",
                 {
                   {"keys", KernelParam::Kind::pointer, "const dp_bf16*", "[count, 128] bf16", "index keys (normed, roped)"},
                   {"slots", KernelParam::Kind::pointer, "const dp_i64*", "[count] i64", "cache slot per key, -1 = skip"},
                   {"cache", KernelParam::Kind::pointer, "dp_u8*", "[num_blocks, block_stride] u8", "MXFP4 key cache"},
                   {"count", KernelParam::Kind::u32, "dp_u32", "", "keys"},
                   {"num_blocks", KernelParam::Kind::u32, "dp_u32", "", "cache blocks"},
                   {"block_size", KernelParam::Kind::u32, "dp_u32", "", "keys per cache block"},
                   {"block_stride", KernelParam::Kind::u32, "dp_u32", "", "bytes between cache blocks"},
                   {"layout", KernelParam::Kind::u32, "dp_u32", "", "0: split, 1: packed"},
                 }),
      indexer_op("idx_pack", "dp_idx_pack",
                 {
                   {"cache", KernelParam::Kind::pointer, "const dp_u8*", "[num_blocks, block_stride] u8", "this rank's key cache"},
                   {"block_table", KernelParam::Kind::pointer, "const dp_i32*", "[R, bt_stride] i32", "request set's blocks"},
                   {"local_cu", KernelParam::Kind::pointer, "const dp_i32*", "[R + 1] i32", "this rank's packed row offsets"},
                   {"packed", KernelParam::Kind::pointer, "dp_u8*", "[max_local, 68] u8", "compact keys"},
                   {"num_requests", KernelParam::Kind::u32, "dp_u32", "", "R"},
                   {"bt_stride", KernelParam::Kind::u32, "dp_u32", "", "entries per block-table row"},
                   {"max_local", KernelParam::Kind::u32, "dp_u32", "", "packed rows (zero past the rank's keys)"},
                   {"num_blocks", KernelParam::Kind::u32, "dp_u32", "", "cache blocks"},
                   {"block_size", KernelParam::Kind::u32, "dp_u32", "", "keys per cache block"},
                   {"block_stride", KernelParam::Kind::u32, "dp_u32", "", "bytes between cache blocks"},
                   {"layout", KernelParam::Kind::u32, "dp_u32", "", "0: split, 1: packed"},
                 }),
      indexer_op("idx_stage", "dp_idx_stage",
                 {
                   {"gathered", KernelParam::Kind::pointer, "const dp_u8*", "[W * max_local, 68] u8", "every rank's packed rows"},
                   {"cu", KernelParam::Kind::pointer, "const dp_i32*", "[R + 1] i32", "key offsets"},
                   {"local_cu", KernelParam::Kind::pointer, "const dp_i32*", "[W, R + 1] i32", "every rank's row offsets"},
                   {"payload", KernelParam::Kind::pointer, "dp_u8*", "[pages, 1, 4, 64, 16] u8", "staged payload"},
                   {"scales", KernelParam::Kind::pointer, "dp_u8*", "[pages, 1, 4, 64] u8", "staged scales"},
                   {"num_requests", KernelParam::Kind::u32, "dp_u32", "", "R"},
                   {"world", KernelParam::Kind::u32, "dp_u32", "", "DCP world size"},
                   {"interleave", KernelParam::Kind::u32, "dp_u32", "", "DCP interleave"},
                   {"max_local", KernelParam::Kind::u32, "dp_u32", "", "packed rows per rank"},
                   {"pages", KernelParam::Kind::u32, "dp_u32", "", "64-key pages"},
                 }),
      {
          "idx_score",
          "indexer.h",
          "dp_idx_score",
          {{"NH", "nh", 8, 64, "index heads, a multiple of 8"}},
          [](const Params& p, const std::string& who) {
            if (p.at("NH") % 8 != 0)
              fail(Errc::input, "{}: parameter NH = {} is not a multiple of 8 (8 head groups per block)", who, p.at("NH"));
          },
          [](const Params& p) { return std::vector<int64_t>{p.at("NH")}; },
          [](const Params& p) {
            const int64_t NH = p.at("NH");
            return std::vector<ArgSpec>{
                {"q", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[rows, {}, 128] bf16", NH), "index queries"},
                {"w", KernelParam::Kind::pointer, "const float*", fmt::format("[rows, {}] fp32", NH), "head weights"},
                {"payload", KernelParam::Kind::pointer, "const dp_u8*", "[pages, 1, 4, 64, 16] u8", "staged payload"},
                {"scales", KernelParam::Kind::pointer, "const dp_u8*", "[pages, 1, 4, 64] u8", "staged scales"},
                {"cu", KernelParam::Kind::pointer, "const dp_i32*", "[R + 1] i32", "key offsets"},
                {"row_request", KernelParam::Kind::pointer, "const dp_i32*", "[rows] i32", "request of each row"},
                {"row_position", KernelParam::Kind::pointer, "const dp_i32*", "[rows] i32", "position of each row"},
                {"logits", KernelParam::Kind::pointer, "float*", "[tile_rows, L] fp32", "scores"},
                {"row_begin", KernelParam::Kind::u32, "dp_u32", "", "first row of the tile"},
                {"tile_rows", KernelParam::Kind::u32, "dp_u32", "", "rows scored"},
                {"L", KernelParam::Kind::u32, "dp_u32", "", "logits row stride (longest request)"},
                {"weight_scale", KernelParam::Kind::f32, "float", "", "factor on every score"},
            };
          },
          [](const Params&) { return idx_launch(256); },
          [](const Params&) { return uint32_t{256}; },
      },
      {
          "idx_topk",
          "indexer.h",
          "dp_idx_topk",
          {{"K", "k", 1, 4096, "positions selected per row"}},
          [](const Params&, const std::string&) {},
          [](const Params& p) { return std::vector<int64_t>{p.at("K")}; },
          [](const Params& p) {
            return std::vector<ArgSpec>{
                {"logits", KernelParam::Kind::pointer, "const float*", "[tile_rows, L] fp32", "scores"},
                {"row_position", KernelParam::Kind::pointer, "const dp_i32*", "[rows] i32", "position of each row"},
                {"out", KernelParam::Kind::pointer, "dp_i32*", fmt::format("[tile_rows, {}] i32", p.at("K")),
                 "positions, best first, -1 padded"},
                {"row_begin", KernelParam::Kind::u32, "dp_u32", "", "first row of the tile"},
                {"tile_rows", KernelParam::Kind::u32, "dp_u32", "", "rows written"},
                {"valid_rows", KernelParam::Kind::u32, "dp_u32", "", "rows with a query (the rest: -1)"},
                {"L", KernelParam::Kind::u32, "dp_u32", "", "logits row stride"},
            };
          },
          [](const Params&) { return idx_launch(512); },
          [](const Params&) { return uint32_t{512}; },
      },
      indexer_op("idx_rows", "dp_idx_rows",
                 {
                   {"src", KernelParam::Kind::pointer, "const dp_i32*", "[src_rows, k] i32", "gathered selections"},
                   {"map", KernelParam::Kind::pointer, "const dp_i32*", "[rows] i32", "source row per row, -1: none"},
                   {"out", KernelParam::Kind::pointer, "dp_i32*", "[rows, k] i32", "selections in row order"},
                   {"rows", KernelParam::Kind::u32, "dp_u32", "", "rows"},
                   {"k", KernelParam::Kind::u32, "dp_u32", "", "entries per row"},
                 }),
  };
}

}  // namespace dp::codegen::ops
