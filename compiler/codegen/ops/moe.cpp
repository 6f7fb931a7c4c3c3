// moe_route, moe_up, moe_down, mlp_up (templates/moe.h): the MoE FFN (routing, gate/up of the used
// and shared experts, down + weighted sum) and the dense MLP gate/up. GEMM-shaped blocks (spec.h).
#include "codegen/ops/spec.h"

#include <fmt/format.h>

#include <string_view>

#include "common/error.h"

namespace dp::codegen::ops {
namespace {

// MoE / MLP gate-up blocks: S = 4 K-slices, so a block holds 2 slots of 8 features (gate and up rows
// of a feature in one 16-row tile): 16 features per block.
constexpr int64_t kFfnSlices = 4;
constexpr int64_t kFfnFeatures = kGemmGroups / kFfnSlices * (kTileRows / 2);

int64_t moe_max_used(const Params& p) { return std::min(p.at("E"), p.at("W") * p.at("K")); }

// moe_up from 2 activation rows: every warp computes whole 8-feature tiles (gate and up rows in one
// tensor-core tile, over all of D) and walks the step's tiles with a grid stride; one row keeps the
// block tiles of 16 features (4 K-slices, lane FMAs). Measured on the H200 (bench/NOTES.md).
// MXFP4 experts (Q4) take the warp tiles from one row (tensor cores, like the e4m3 ones in moe_down).
// e4m3 experts (Q8) too: their loop is the tensor cores' at one row as well, and the block tiles' grid
// (576 blocks for the 48B shape at width 1) ran as three waves of two blocks per SM: warp tiles 20.4 ->
// 19.4 us (H200, 2026-12-04, bench/gemv_harness). A weight ring (RG) keeps the warp tiles: a ring per
// warp, whose stream runs on across the warp's tiles (block tiles would restart a block ring at each).
bool moe_up_warp_tiles(const Params& p) { return p.at("W") >= 2 || p.at("Q4") || p.at("Q8"); }

// mlp_up with e4m3 weights: the same warp tiles (one expert, no routing), 19.8 -> 18.9 us at width 1
// and 20.4 -> 19.6 us at width 8 for the 48B shape (same run). bf16 keeps the block tiles (not measured).
bool mlp_up_warp_tiles(const Params& p) { return p.at("Q8") != 0; }

// The warp tiles' grid and walk. With at least kTargetBlocks blocks of tiles, kTargetBlocks blocks whose
// warps take tiles block by block with a stride (kWarpTiles 1). With fewer (the 48B shape's e4m3 gate/ups
// at one row: 1152 tiles, 144 blocks of 8), the tiles are dealt warp by warp over kTargetBlocks blocks
// (kWarpTiles 2: warp w of block b takes tile w * blocks + b first), so that every SM holds 8 or 9 busy
// warps where 12 SMs held 16 and the other 120 held 8, and the kernel waited for the 12: the dense and
// routed e4m3 gate/ups -4 to -6% at width 1, the dense one -4% at width 8 (H100, 2026-12-07,
// tests/results/gpu-2026-12-07b).
int64_t warp_tiles_form(int64_t tiles) { return tiles < kTargetBlocks * kGemmGroups ? 2 : 1; }
int64_t moe_up_tiles(const Params& p) {
  return (p.at("S") + 7) / 8 + moe_max_used(p) * ((p.at("I") + 7) / 8);
}

// The gate/up weight ring: one per warp (kGemmGroups), of RG stages of 256 bytes of the warp tile's 16
// rows (two e4m3 blocks or four MXFP4 chunks).
constexpr int64_t kGateUpRingCols = 256;
uint32_t gate_up_ring_bytes(const Params& p, const std::string& target) {
  if (!p.at("RG") || !bulk_copy_target(target)) return 0;
  return kGemmGroups * ring_bytes(kTileRows, kGateUpRingCols, p.at("RG"));
}
// The rings of a block must fit the 227 KiB an sm_90 block may have.
void check_gate_up_ring(const Params& p, const std::string& who) {
  check_ring(p, who, true, "");
  const int64_t bytes = kGemmGroups * ring_bytes(kTileRows, kGateUpRingCols, p.at("RG"));
  if (bytes > 227 * 1024)
    fail(Errc::input, "{}: parameter RG = {}: the warps' rings take {} bytes of shared memory, more than a block's "
         "227 KiB (at most 5 stages)", who, p.at("RG"), bytes);
}

// moe_down: output features per block (M). One activation row: every group keeps 4 x 1 lane-FMA
// accumulators for its items and streams 4 rows of each. From 2 rows, and for e4m3 weights: a 16-row
// tensor-core tile per item (on AMD the lane-FMA loop walks the 16 rows 4 at a time).
int64_t moe_down_rows(const Params& p) { return p.at("W") == 1 && !p.at("Q8") && !p.at("Q4") ? 4 : kTileRows; }

// The e4m3 variants call the device function's _q8 form with every parameter in order.
DeviceCall q8_call(const Params& p, const char* fn) {
  DeviceCall c;
  if (!p.at("Q8")) return c;
  c.fn = fn;
  return c;
}

// MXFP4 routed experts (Q4 = 1, the K3 latent MoE): E2M1 codes two per byte and E8M0 scales, one per 32
// values along a row, as compressed-tensors packs them; the _q4 forms take no shared expert.
ParamSpec q4_param() {
  return ParamSpec{"Q4", "q4", 0, 1, "1: routed expert matrices MXFP4 (packed E2M1 + E8M0 scales per 32); S = 0", true};
}
void check_q4(const Params& p, const std::string& who, const char* k_key) {
  if (!p.at("Q4")) return;
  if (p.at("Q8"))
    fail(Errc::input, "{}: parameters Q4 = 1 and Q8 = {}: the experts are either MXFP4 or e4m3", who, p.at("Q8"));
  if (p.at("S"))
    fail(Errc::input, "{}: parameter S = {} with Q4 = 1: the MXFP4 forms have no shared expert (S must be 0)", who,
         p.at("S"));
  if (p.at(k_key) % kMxfp4Group)
    fail(Errc::input, "{}: parameter {} = {} is not a multiple of {} (MXFP4 rows hold one scale per {} values)", who,
         k_key, p.at(k_key), kMxfp4Group, kMxfp4Group);
}

void check_topk(const Params& p, const std::string& who) {
  if (p.at("K") > p.at("E"))
    fail(Errc::input, "{}: parameter K = {} (top-k) exceeds E = {} experts", who, p.at("K"), p.at("E"));
}

// The MXFP4 forms' arguments: the routed experts' packed codes and scales (u8, stacked by expert with
// byte strides), no shared expert.
std::vector<ArgSpec> moe_up_q4_args(const Params& p) {
  const int64_t W = p.at("W"), D = p.at("D"), I = p.at("I"), E = p.at("E"), K = p.at("K"), U = moe_max_used(p);
  std::vector<ArgSpec> a{
      {"x", KernelParam::Kind::pointer, "const dp_bf16*", shape({W, D}, "bf16"), "expert input rows (K3: the latent)"}};
  for (const char* w : {"w1", "w3"}) {
    const std::string what = std::string(w) == "w1" ? "gate" : "up";
    a.push_back({w, KernelParam::Kind::pointer, "const dp_u8*",
                 fmt::format("[{}, stride_{}] u8", E, w),
                 fmt::format("expert {} weights, MXFP4 packed: expert e's [{}, {}] bytes at e*stride_{} (two E2M1 "
                             "codes per byte, the even column in the low nibble)",
                             what, I, D / 2, w)});
    a.push_back({w == std::string("w1") ? "w1_scale" : "w3_scale", KernelParam::Kind::pointer, "const dp_u8*",
                 fmt::format("[{}, stride_{}_scale] u8", E, w),
                 fmt::format("E8M0 scales of {}: expert e's [{}, {}] at e*stride_{}_scale (2^(s-127) per 32 values)", w,
                             I, D / kMxfp4Group, w)});
  }
  a.push_back({"experts", KernelParam::Kind::pointer, "const dp_i32*", shape({1 + U}, "i32"), "from moe_route"});
  a.push_back({"expert_slots", KernelParam::Kind::pointer, "const dp_i32*", shape({U, W}, "i32"), "from moe_route"});
  a.push_back({"h", KernelParam::Kind::pointer, "dp_bf16*", shape({W, K, I}, "bf16"), "routed activations"});
  for (const char* w : {"w1", "w3"}) {
    const bool g = std::string(w) == "w1";
    a.push_back({g ? "stride_w1" : "stride_w3", KernelParam::Kind::u32, "dp_u32", "",
                 fmt::format("bytes between experts of {}, a multiple of 16, at least {} (dense)", w, I * D / 2)});
    a.push_back({g ? "stride_w1_scale" : "stride_w3_scale", KernelParam::Kind::u32, "dp_u32", "",
                 fmt::format("bytes between experts of {}_scale, at least {} (dense)", w, I * D / kMxfp4Group)});
  }
  if (p.at("ACT")) {
    a.push_back({"act_beta", KernelParam::Kind::f32, "float", "", "SiTU beta"});
    a.push_back({"act_linear_beta", KernelParam::Kind::f32, "float", "", "SiTU linear beta"});
  }
  return a;
}

// moe_down's split grid (SK blocks): the most blocks one tile's units can span (templates/moe.h
// dp_moe_split::kSlots), the partial-sum slots of each tile.
int64_t moe_down_split_slots(const Params& p) {
  const int64_t m = moe_down_rows(p), tiles = (p.at("D") + m - 1) / m;
  return (p.at("SK") + tiles - 1) / tiles + 1;
}

std::vector<ArgSpec> moe_down_q4_args(const Params& p) {
  const int64_t W = p.at("W"), D = p.at("D"), I = p.at("I"), E = p.at("E"), K = p.at("K"), U = moe_max_used(p);
  return {
      {"h", KernelParam::Kind::pointer, "const dp_bf16*", shape({W, K, I}, "bf16"), "from moe_up"},
      {"w2", KernelParam::Kind::pointer, "const dp_u8*", fmt::format("[{}, stride_w2] u8", E),
       fmt::format("expert down weights, MXFP4 packed: expert e's [{}, {}] bytes at e*stride_w2", D, I / 2)},
      {"w2_scale", KernelParam::Kind::pointer, "const dp_u8*", fmt::format("[{}, stride_w2_scale] u8", E),
       fmt::format("E8M0 scales of w2: expert e's [{}, {}] at e*stride_w2_scale", D, I / kMxfp4Group)},
      {"experts", KernelParam::Kind::pointer, "const dp_i32*", shape({1 + U}, "i32"), "from moe_route"},
      {"expert_slots", KernelParam::Kind::pointer, "const dp_i32*", shape({U, W}, "i32"), "from moe_route"},
      {"topk_weights", KernelParam::Kind::pointer, "const float*", shape({W, K}, "fp32"), "from moe_route"},
      {"out", KernelParam::Kind::pointer, "dp_bf16*", shape({W, D}, "bf16"),
       "routed_scaling * the weighted sum of the experts (K3: the latent sum)"},
      {"routed_scaling", KernelParam::Kind::f32, "float", "", "routed_scaling_factor"},
      {"stride_w2", KernelParam::Kind::u32, "dp_u32", "",
       fmt::format("bytes between experts of w2, a multiple of 16, at least {} (dense)", D * I / 2)},
      {"stride_w2_scale", KernelParam::Kind::u32, "dp_u32", "",
       fmt::format("bytes between experts of w2_scale, at least {} (dense)", D * I / kMxfp4Group)},
  };
}

}  // namespace

std::vector<OpSpec> moe_ops() {
  std::vector<OpSpec> ops{
      {
          // MoE routing: sigmoid, correction bias, top-k, renormalise; the step's used-expert list.
          "moe_route",
          "moe.h",
          "dp_moe_route",
          {{"W", "w", 1, 64, "activation rows (requests x q)"},
           {"E", "e", 1, 1024, "routed experts"},
           {"K", "k", 1, 32, "experts per token (top-k)"},
           {"RN", "rn", 0, 1, "1: renormalise the top-k weights"}},
          [](const Params& p, const std::string& who) { check_topk(p, who); },
          [](const Params& p) { return std::vector<int64_t>{p.at("W"), p.at("E"), p.at("K"), p.at("RN")}; },
          [](const Params& p) {
            const int64_t W = p.at("W"), E = p.at("E"), K = p.at("K"), U = moe_max_used(p);
            return std::vector<ArgSpec>{
                {"logits", KernelParam::Kind::pointer, "const float*", shape({W, E}, "fp32"), "router logits"},
                {"bias", KernelParam::Kind::pointer, "const float*", shape({E}, "fp32"),
                 "e_score_correction_bias (selection only)"},
                {"topk_ids", KernelParam::Kind::pointer, "dp_i32*", shape({W, K}, "i32"), "chosen experts"},
                {"topk_weights", KernelParam::Kind::pointer, "float*", shape({W, K}, "fp32"),
                 "their weights (renormalised, unscaled)"},
                {"experts", KernelParam::Kind::pointer, "dp_i32*", shape({1 + U}, "i32"),
                 "count, then the used experts ascending"},
                {"expert_slots", KernelParam::Kind::pointer, "dp_i32*", shape({U, W}, "i32"),
                 "top-k position of each used expert per row, or -1"},
            };
          },
          [](const Params&) {
            LaunchShape s;
            s.block[0] = 256;
            return s;
          },
          [](const Params&) { return uint32_t{256}; },
          "DP_KERNEL_BOUNDS",
      },
      {
          // Gate/up + activation of every used routed expert and of the shared expert, one launch.
          "moe_up",
          "moe.h",
          "dp_moe_up",
          {{"W", "w", 1, kMaxGemmRows, "activation rows (requests x q)"},
           {"D", "d", 8, 1 << 20, "expert input width (hidden, or K3 latent)"},
           {"I", "i", 8, 1 << 20, "expert intermediate width (this rank's shard)"},
           {"E", "e", 1, 1024, "routed experts"},
           {"K", "k", 1, 32, "experts per token (top-k)"},
           {"S", "s", 0, 1 << 20, "shared expert width (this rank's shard); 0: none"},
           {"ACT", "act", 0, 1, "0: silu(gate)*up, 1: K3 SiTU"},
           q8_param("1: every expert matrix (routed and shared) e4m3 with 128 x 128 block scales"),
           q4_param(),
           ring_param("e4m3 or MXFP4: the warp tiles' rows through a shared-memory ring per warp of RG stages "
                      "(bulk copies; 0: register loads)")},
          [](const Params& p, const std::string& who) {
            check_multiple_of_8(p, who, {"D", "I", "S"});
            if (p.at("Q8")) check_multiple_of_16(p, who, {"D", "I", "S"});
            check_q4(p, who, "D");
            check_topk(p, who);
            check_gate_up_ring(p, who);
          },
          [](const Params& p) {
            std::vector<int64_t> a{p.at("W"), p.at("D"), p.at("I"), p.at("E"), p.at("K"), p.at("S"),
                                   p.at("ACT"), 1, kFfnSlices,
                                   moe_up_warp_tiles(p) ? warp_tiles_form(moe_up_tiles(p)) : 0};
            if (p.at("RG")) a.push_back(p.at("RG"));  // dp_moe_up_q8's or _q4's kRing
            return a;
          },
          [](const Params& p) {
            const int64_t W = p.at("W"), D = p.at("D"), I = p.at("I"), E = p.at("E"), K = p.at("K"), S = p.at("S");
            const int64_t U = moe_max_used(p);
            const bool q8 = p.at("Q8") != 0;
            const char* wt = q8 ? "const dp_u8*" : "const dp_bf16*";
            const char* dt = q8 ? "e4m3" : "bf16";
            if (p.at("Q4")) return moe_up_q4_args(p);
            std::vector<ArgSpec> a{
                {"x", KernelParam::Kind::pointer, "const dp_bf16*", shape({W, D}, "bf16"), "post-attention-norm rows"}};
            // A weight, then (e4m3) its scales: the shared expert's [ceil(S/128), ceil(D/128)], the routed
            // experts' stacked like the weights.
            auto weight = [&](const char* name, const char* scale, std::string shp, std::string doc, bool shared) {
              a.push_back({name, KernelParam::Kind::pointer, wt, std::move(shp), std::move(doc), shared});
              if (q8)
                a.push_back({scale, KernelParam::Kind::pointer, "const float*",
                             shared ? scale_shape(S, D) : fmt::format("[{}, stride_{}] fp32", E, scale),
                             fmt::format("block scales of {}", name), shared});
            };
            weight("w1", "w1_scale", fmt::format("[{}, stride_w1] {}", E, dt),
                   fmt::format("expert gate weights: expert e's [{}, {}] at e*stride_w1", I, D), false);
            weight("w3", "w3_scale", fmt::format("[{}, stride_w3] {}", E, dt),
                   fmt::format("expert up weights: expert e's [{}, {}] at e*stride_w3 (fused w13: w1 + {})", I, D,
                               I * D),
                   false);
            weight("shared_gate", "shared_gate_scale", shape({S, D}, dt), "shared expert gate_proj (null when S = 0)",
                   true);
            weight("shared_up", "shared_up_scale", shape({S, D}, dt), "shared expert up_proj (null when S = 0)", true);
            a.push_back({"experts", KernelParam::Kind::pointer, "const dp_i32*", shape({1 + U}, "i32"),
                         "from moe_route"});
            a.push_back({"expert_slots", KernelParam::Kind::pointer, "const dp_i32*", shape({U, W}, "i32"),
                         "from moe_route"});
            a.push_back({"h", KernelParam::Kind::pointer, "dp_bf16*", shape({W, K, I}, "bf16"), "routed activations"});
            a.push_back({"hs", KernelParam::Kind::pointer, "dp_bf16*", shape({W, S}, "bf16"),
                         "shared expert activations (null when S = 0)", true});
            a.push_back({"stride_w1", KernelParam::Kind::u32, "dp_u32", "",
                         fmt::format("elements between experts of w1, a multiple of {}, at least {} (dense; fused "
                                     "w13: {})",
                                     q8 ? 16 : 8, I * D, 2 * I * D)});
            if (q8)
              a.push_back({"stride_w1_scale", KernelParam::Kind::u32, "dp_u32", "",
                           fmt::format("elements between experts of w1_scale, at least {}",
                                       ((I + kFp8Block - 1) / kFp8Block) * ((D + kFp8Block - 1) / kFp8Block))});
            a.push_back({"stride_w3", KernelParam::Kind::u32, "dp_u32", "",
                         fmt::format("elements between experts of w3, a multiple of {}, at least {} (dense; fused "
                                     "w13: {})",
                                     q8 ? 16 : 8, I * D, 2 * I * D)});
            if (q8)
              a.push_back({"stride_w3_scale", KernelParam::Kind::u32, "dp_u32", "",
                           fmt::format("elements between experts of w3_scale, at least {}",
                                       ((I + kFp8Block - 1) / kFp8Block) * ((D + kFp8Block - 1) / kFp8Block))});
            if (p.at("ACT")) {
              a.push_back({"act_beta", KernelParam::Kind::f32, "float", "", "SiTU beta"});
              a.push_back({"act_linear_beta", KernelParam::Kind::f32, "float", "", "SiTU linear beta"});
            }
            return a;
          },
          [](const Params& p) {
            LaunchShape s;
            if (moe_up_warp_tiles(p)) {
              // Warp tiles of 8 features over kTargetBlocks blocks (warp_tiles_form: how the warps take
              // the most tiles a step can have).
              s.grid[0] = static_cast<uint32_t>(kTargetBlocks);
              s.block[0] = kGemmThreads;
              return s;
            }
            const int64_t n_i = (p.at("I") + kFfnFeatures - 1) / kFfnFeatures;
            const int64_t n_s = (p.at("S") + kFfnFeatures - 1) / kFfnFeatures;
            s.grid[0] = static_cast<uint32_t>(n_s + moe_max_used(p) * n_i);
            s.block[0] = kGemmThreads;
            return s;
          },
          [](const Params&) { return kGemmThreads; },
          "DP_KERNEL_BOUNDS",  // replaced by gemv_bounds (below)
          [](const Params& p) { return p.at("Q4") ? DeviceCall{"dp_moe_up_q4", {}} : q8_call(p, "dp_moe_up_q8"); },
      },
      {
          // Down projection of every used expert, weighted sum, routed scaling, plus the shared expert.
          "moe_down",
          "moe.h",
          "dp_moe_down",
          {{"W", "w", 1, kMaxGemmRows, "activation rows (requests x q)"},
           {"D", "d", 8, 1 << 20, "expert output width (hidden, or K3 latent)"},
           {"I", "i", 8, 1 << 20, "expert intermediate width (this rank's shard)"},
           {"E", "e", 1, 1024, "routed experts"},
           {"K", "k", 1, 32, "experts per token (top-k)"},
           {"S", "s", 0, 1 << 20, "shared expert width (this rank's shard); 0: none"},
           q8_param("1: every expert matrix (routed and shared) e4m3 with 128 x 128 block scales"),
           q4_param(),
           {"SK", "sk", 0, 4096,
            "blocks that share every tile's work evenly (the split grid; 0: one block per tile); not bf16 at "
            "one row", true},
           ring_param("the tile's rows of every item through a shared-memory ring of RG stages (bulk copies; 0: "
                      "register loads): over the split grid (SK), or one block per tile (MXFP4 at any width, e4m3 "
                      "at one row)")},
          [](const Params& p, const std::string& who) {
            check_multiple_of_8(p, who, {"D", "I", "S"});
            if (p.at("Q8")) check_multiple_of_16(p, who, {"I", "S"});
            check_q4(p, who, "I");
            check_topk(p, who);
            if (p.at("SK") && moe_down_rows(p) != kTileRows)
              fail(Errc::input, "{}: parameter SK = {} (the split grid) needs the tensor-core tiles: bf16 experts at "
                   "one row (W = 1) take the lane-FMA loop", who, p.at("SK"));
            check_ring(p, who, p.at("Q4") || p.at("SK") || p.at("W") == 1,
                       "the e4m3 ring form with one block per tile (SK = 0) is one row's (W = 1)");
            if (p.at("RG") && p.at("SK") && p.at("Q8") && p.at("S") && p.at("S") != p.at("I"))
              fail(Errc::input, "{}: parameters RG = {} and SK = {} with S = {}: the split ring takes a shared "
                   "expert as wide as the routed ones (I = {})", who, p.at("RG"), p.at("SK"), p.at("S"), p.at("I"));
          },
          [](const Params& p) {
            std::vector<int64_t> a{p.at("W"), p.at("D"), p.at("I"), p.at("E"), p.at("K"), p.at("S"), moe_down_rows(p)};
            if (p.at("SK")) a.push_back(p.at("SK"));  // the split forms' G
            if (p.at("RG")) a.push_back(p.at("RG"));  // dp_moe_down_q8's or _q4's kRing
            return a;
          },
          [](const Params& p) {
            const int64_t W = p.at("W"), D = p.at("D"), I = p.at("I"), E = p.at("E"), K = p.at("K"), S = p.at("S");
            const int64_t U = moe_max_used(p);
            const bool q8 = p.at("Q8") != 0;
            const char* wt = q8 ? "const dp_u8*" : "const dp_bf16*";
            const char* dt = q8 ? "e4m3" : "bf16";
            auto split_args = [&](std::vector<ArgSpec>& a) {
              if (!p.at("SK")) return;
              const int64_t m = moe_down_rows(p), tiles = (D + m - 1) / m;
              a.push_back({"partials", KernelParam::Kind::pointer, "float*",
                           shape({tiles, moe_down_split_slots(p), m, W}, "fp32"),
                           "each tile's sums from the blocks that share it (scratch)"});
              a.push_back({"done", KernelParam::Kind::pointer, "dp_u32*", shape({tiles}, "u32"),
                           "per tile: blocks done (zero before the launch; left zero)"});
            };
            if (p.at("Q4")) {
              std::vector<ArgSpec> a = moe_down_q4_args(p);
              split_args(a);
              return a;
            }
            std::vector<ArgSpec> a{
                {"h", KernelParam::Kind::pointer, "const dp_bf16*", shape({W, K, I}, "bf16"), "from moe_up"},
                {"hs", KernelParam::Kind::pointer, "const dp_bf16*", shape({W, S}, "bf16"),
                 "from moe_up (null when S = 0)", true},
                {"w2", KernelParam::Kind::pointer, wt, fmt::format("[{}, stride_w2] {}", E, dt),
                 fmt::format("expert down weights: expert e's [{}, {}] at e*stride_w2", D, I)}};
            if (q8)
              a.push_back({"w2_scale", KernelParam::Kind::pointer, "const float*",
                           fmt::format("[{}, stride_w2_scale] fp32", E), "block scales of w2"});
            a.push_back({"shared_down", KernelParam::Kind::pointer, wt, shape({D, S}, dt),
                         "shared expert down_proj (null when S = 0)", true});
            if (q8)
              a.push_back({"shared_down_scale", KernelParam::Kind::pointer, "const float*", scale_shape(D, S),
                           "block scales of shared_down", true});
            a.push_back({"experts", KernelParam::Kind::pointer, "const dp_i32*", shape({1 + U}, "i32"),
                         "from moe_route"});
            a.push_back({"expert_slots", KernelParam::Kind::pointer, "const dp_i32*", shape({U, W}, "i32"),
                         "from moe_route"});
            a.push_back({"topk_weights", KernelParam::Kind::pointer, "const float*", shape({W, K}, "fp32"),
                         "from moe_route"});
            a.push_back({"out", KernelParam::Kind::pointer, "dp_bf16*", shape({W, D}, "bf16"), "FFN output"});
            a.push_back({"routed_scaling", KernelParam::Kind::f32, "float", "", "routed_scaling_factor"});
            a.push_back({"stride_w2", KernelParam::Kind::u32, "dp_u32", "",
                         fmt::format("elements between experts of w2, a multiple of {}, at least {} (dense)",
                                     q8 ? 16 : 8, D * I)});
            if (q8)
              a.push_back({"stride_w2_scale", KernelParam::Kind::u32, "dp_u32", "",
                           fmt::format("elements between experts of w2_scale, at least {}",
                                       ((D + kFp8Block - 1) / kFp8Block) * ((I + kFp8Block - 1) / kFp8Block))});
            split_args(a);
            return a;
          },
          [](const Params& p) {
            LaunchShape s;
            const int64_t m = moe_down_rows(p);
            s.grid[0] = static_cast<uint32_t>(p.at("SK") ? p.at("SK") : (p.at("D") + m - 1) / m);
            s.block[0] = kGemmThreads;
            return s;
          },
          [](const Params&) { return kGemmThreads; },
          "DP_KERNEL_BOUNDS",  // replaced by gemv_bounds (below)
          [](const Params& p) {
            if (p.at("SK"))
              return DeviceCall{p.at("Q4") ? "dp_moe_down_q4_split" : p.at("Q8") ? "dp_moe_down_q8_split"
                                                                            : "dp_moe_down_split", {}};
            return p.at("Q4") ? DeviceCall{"dp_moe_down_q4", {}} : q8_call(p, "dp_moe_down_q8");
          },
      },
      {
          // Dense MLP gate/up + activation (its down projection is a gemm).
          "mlp_up",
          "moe.h",
          "dp_mlp_up",
          {{"W", "w", 1, kMaxGemmRows, "activation rows (requests x q)"},
           {"D", "d", 8, 1 << 20, "input width (hidden)"},
           {"I", "i", 8, 1 << 20, "intermediate width (this rank's shard)"},
           {"ACT", "act", 0, 1, "0: silu(gate)*up, 1: K3 SiTU"},
           q8_param("1: gate_proj and up_proj e4m3 with 128 x 128 block scales"),
           ring_param("e4m3: the warp tiles' rows through a shared-memory ring per warp of RG stages (bulk "
                      "copies; 0: register loads)")},
          [](const Params& p, const std::string& who) {
            check_multiple_of_8(p, who, {"D", "I"});
            if (p.at("Q8")) check_multiple_of_16(p, who, {"D"});
            check_gate_up_ring(p, who);
          },
          [](const Params& p) {
            std::vector<int64_t> a{p.at("W"), p.at("D"), p.at("I"), p.at("ACT"), 1, kFfnSlices,
                                   mlp_up_warp_tiles(p) ? warp_tiles_form((p.at("I") + 7) / 8) : 0};
            if (p.at("RG")) a.push_back(p.at("RG"));  // dp_mlp_up_q8's kRing
            return a;
          },
          [](const Params& p) {
            std::vector<ArgSpec> a{
                {"x", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"W", "D"}, "bf16"),
                 "post-attention-norm rows"},
            };
            const bool q8 = p.at("Q8") != 0;
            const char* wt = q8 ? "const dp_u8*" : "const dp_bf16*";
            const char* dt = q8 ? "e4m3" : "bf16";
            a.push_back({"w_gate", KernelParam::Kind::pointer, wt, dims(p, {"I", "D"}, dt), "gate_proj"});
            if (q8)
              a.push_back({"w_gate_scale", KernelParam::Kind::pointer, "const float*",
                           scale_shape(p.at("I"), p.at("D")), "block scales of gate_proj"});
            a.push_back({"w_up", KernelParam::Kind::pointer, wt, dims(p, {"I", "D"}, dt), "up_proj"});
            if (q8)
              a.push_back({"w_up_scale", KernelParam::Kind::pointer, "const float*", scale_shape(p.at("I"), p.at("D")),
                           "block scales of up_proj"});
            a.push_back({"h", KernelParam::Kind::pointer, "dp_bf16*", dims(p, {"W", "I"}, "bf16"),
                         "activations (down_proj input)"});
            if (p.at("ACT")) {
              a.push_back({"act_beta", KernelParam::Kind::f32, "float", "", "SiTU beta"});
              a.push_back({"act_linear_beta", KernelParam::Kind::f32, "float", "", "SiTU linear beta"});
            }
            return a;
          },
          [](const Params& p) {
            LaunchShape s;
            if (mlp_up_warp_tiles(p)) {
              // Warp tiles of 8 features over kTargetBlocks blocks (warp_tiles_form).
              s.grid[0] = static_cast<uint32_t>(kTargetBlocks);
            } else {
              s.grid[0] = static_cast<uint32_t>((p.at("I") + kFfnFeatures - 1) / kFfnFeatures);
            }
            s.block[0] = kGemmThreads;
            return s;
          },
          [](const Params&) { return kGemmThreads; },
          "DP_KERNEL_BOUNDS",  // replaced by gemv_bounds (below)
          [](const Params& p) { return q8_call(p, "dp_mlp_up_q8"); },
      },
  };
  for (OpSpec& op : ops) {
    const std::string_view name = op.name;
    if (name != "moe_route") op.bounds_for = gemv_bounds;
    if (name == "moe_up" || name == "mlp_up") op.dynamic_shared = gate_up_ring_bytes;
    if (name == "moe_down")  // the 16-row tile, 1024-column stages (RG of them: the items are known at run time)
      op.dynamic_shared = [](const Params& p, const std::string& target) {
        if (!p.at("RG") || !bulk_copy_target(target)) return uint32_t{0};
        const int64_t cols = 8 * (p.at("Q4") ? kMxfp4Chunk / 2 : kFp8Block);  // bytes of a row in a stage
        return ring_bytes(kTileRows, cols, p.at("RG"));
      };
  }
  return ops;
}

}  // namespace dp::codegen::ops
