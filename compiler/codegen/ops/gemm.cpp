// gemm (templates/gemm.h): skinny bf16 GEMM over up to six weights that read one input, stacked in
// one launch. The block layout is in spec.h (shared with moe.cpp).
#include "codegen/ops/spec.h"

#include <fmt/format.h>

#include "common/error.h"

namespace dp::codegen::ops {
namespace {

constexpr int64_t kChunkElems = 32;      // K elements a group consumes per step (four 16-byte vectors per row)
constexpr int64_t kMinSliceChunks = 8;   // chunks a K-slice should have (the loads one lane keeps in flight)

struct GemmGeometry {
  int64_t mt = 1;  // 16-row tiles per slot
  int64_t s = 1;   // K-slices (split-K) per block
  int64_t rows() const { return kGemmGroups / s * kTileRows * mt; }
};

int64_t pow2_floor(int64_t x) {
  int64_t p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

constexpr const char* kGemmSegKeys[6] = {"NA", "NB", "NC", "ND", "NE", "NF"};

int64_t gemm_ntot(const Params& p) {
  int64_t n = 0;
  for (const char* k : kGemmSegKeys) n += p.at(k);
  return n;
}

// Blocks of a launch whose blocks take rb rows of every weight (each weight's tiles apart).
int64_t gemm_blocks(const Params& p, int64_t rb) {
  int64_t blocks = 0;
  for (const char* key : kGemmSegKeys) blocks += (p.at(key) + rb - 1) / rb;
  return blocks;
}

// The split: S K-slices per block, so RB = 128 / S rows a block, where S keeps every slice long enough
// for a lane's loads in flight.
// - One activation row, and more than 8 (one block per SM, gemv_bounds): about kTargetBlocks blocks where
//   the matrix is tall enough, otherwise one tile of 16 rows per block with K split over the 8 groups.
// - 2 to 8 rows (two blocks per SM): of the splits, the one with the fewest waves of kTargetBlocks
//   blocks, and of those the one with the most blocks. A partial last wave costs about a whole one
//   there: the 48B-shaped stacked KDA projection (12576 rows) at 8 rows took 15.7 us as 393 blocks of 32
//   rows (a wave and a half) and 14.8 us as 197 blocks of 64 (one); at one row 15.5 and 15.7 us, and
//   16 rows spill on gfx942 at S = 2 (H100, 2026-12-08, bench/NOTES.md).
GemmGeometry gemm_geometry(const Params& p) {
  const int64_t chunks = (p.at("K") + kChunkElems - 1) / kChunkElems;
  const int64_t s_max = std::min(kGemmGroups, std::max<int64_t>(1, pow2_floor(chunks / kMinSliceChunks)));
  const int64_t t = p.at("W");
  if (t == 1 || t > kMaxTwoBlockRows) {
    const int64_t rb = std::clamp<int64_t>(pow2_floor(std::max<int64_t>(1, gemm_ntot(p) / kTargetBlocks)), kTileRows,
                                           kGemmGroups * kTileRows);
    GemmGeometry g;
    g.s = std::min(kGemmGroups * kTileRows / rb, s_max);
    return g;
  }
  GemmGeometry best;
  int64_t best_waves = 0, best_blocks = 0;
  for (int64_t s = s_max; s >= 1; s /= 2) {
    GemmGeometry g;
    g.s = s;
    const int64_t blocks = gemm_blocks(p, g.rows());
    const int64_t waves = (blocks + kTargetBlocks - 1) / kTargetBlocks;
    if (best_blocks == 0 || waves < best_waves || (waves == best_waves && blocks > best_blocks)) {
      best = g;
      best_waves = waves;
      best_blocks = blocks;
    }
  }
  return best;
}

// One activation row, e4m3 weights, no addend: the first round of weight loads is issued before the
// wait for the previous kernel (dp_gemm_q8, kEarly 1). Measured on the H200 (bench/NOTES.md, 2026-12-04
// third session): the width-1 layers 0.4-1.4 us faster; with 8 rows the layers were up to 3 us slower
// (the activations then come from L2 for every group instead of L1), so only one row takes it.
bool gemm_early(const Params& p) { return p.at("W") == 1 && p.at("Q8") != 0 && !p.at("AD"); }

constexpr const char* kWeightNames[6] = {"w0", "w1", "w2", "w3", "w4", "w5"};
constexpr const char* kScaleNames[6] = {"w0_scale", "w1_scale", "w2_scale", "w3_scale", "w4_scale", "w5_scale"};

uint32_t gemm_grid(const Params& p) { return static_cast<uint32_t>(gemm_blocks(p, gemm_geometry(p).rows())); }

}  // namespace

std::vector<OpSpec> gemm_ops() {
  std::vector<OpSpec> ops{
      {
          // Skinny GEMM over up to six weights that read the same input, stacked in one launch.
          "gemm",
          "gemm.h",
          "dp_gemm",
          {{"W", "w", 1, kMaxGemmRows, "activation rows (requests x q)"},
           {"K", "k", 8, 1 << 20, "input width, a multiple of 8"},
           {"NA", "na", 1, 1 << 20, "rows of weight 0"},
           {"NB", "nb", 0, 1 << 20, "rows of weight 1 (0: absent)", true},
           {"NC", "nc", 0, 1 << 20, "rows of weight 2 (0: absent)", true},
           {"ND", "nd", 0, 1 << 20, "rows of weight 3 (0: absent)", true},
           {"NE", "ne", 0, 1 << 20, "rows of weight 4 (0: absent)", true},
           {"NF", "nf", 0, 1 << 20, "rows of weight 5 (0: absent)", true},
           {"F", "f", 0, 1, "1: fp32 output (router logits), 0: bf16", true},
           {"Q8", "q8", 0, 63, "bit s set: weight s is e4m3 with 128 x 128 block scales (0: all bf16)", true},
           {"AD", "ad", 0, 1, "1: add a bf16 addend of the output's shape (bf16 output)", true},
           {"NM", "nm", 0, 1,
            "1: the residual add + RMSNorm of the output fused (post-attention norm; one weight, bf16 output)",
            true},
           {"TK", "tk", 0, 32, "top-k of the MoE routing fused after the router logits (0: none; one weight, fp32)",
            true},
           {"TR", "tr", 0, 1, "1: the fused routing renormalises its top-k weights", true},
           ring_param("e4m3 segments: the block's weight rows through a shared-memory ring of RG stages (bulk "
                      "copies; 0: register loads)")},
          [](const Params& p, const std::string& who) {
            check_multiple_of_8(p, who, {"K"});
            if (p.at("Q8")) check_multiple_of_16(p, who, {"K"});
            if (p.at("AD") && p.at("F"))
              fail(Errc::input, "{}: parameters AD = 1 and F = 1: the addend form writes bf16", who);
            if (p.at("NM")) {
              if (p.at("F") || p.at("AD") || p.at("NB"))
                fail(Errc::input, "{}: parameter NM = 1 (fused norm) takes one weight with a bf16 output and no "
                     "addend; got F = {}, AD = {}, NB = {}", who, p.at("F"), p.at("AD"), p.at("NB"));
              check_multiple_of_8(p, who, {"NA"});
            }
            if (p.at("TK")) {
              if (!p.at("F") || p.at("AD") || p.at("NM") || p.at("NB"))
                fail(Errc::input, "{}: parameter TK = {} (fused routing) takes one weight with fp32 logits and no "
                     "addend or norm; got F = {}, AD = {}, NM = {}, NB = {}", who, p.at("TK"), p.at("F"), p.at("AD"),
                     p.at("NM"), p.at("NB"));
              if (p.at("TK") > p.at("NA") || p.at("NA") > 1024)
                fail(Errc::input, "{}: parameters TK = {} and NA = {}: the routing takes the top-k of at most 1024 "
                     "experts, k <= experts", who, p.at("TK"), p.at("NA"));
            }
            if (p.at("TR") && !p.at("TK"))
              fail(Errc::input, "{}: parameter TR = 1 without a fused routing (TK = 0)", who);
            check_ring(p, who, !p.at("AD") && !p.at("NM") && !p.at("TK"),
                       "the addend, fused-norm and fused-routing forms read their weights without it");
            for (int i = 0; i < 6; ++i)
              if (((p.at("Q8") >> i) & 1) && p.at(kGemmSegKeys[i]) == 0)
                fail(Errc::input, "{}: parameter Q8 = {} marks weight {} as e4m3, but {} = 0 (absent)", who,
                     p.at("Q8"), i, kGemmSegKeys[i]);
            for (int i = 1; i < 6; ++i)
              if (p.at(kGemmSegKeys[i]) > 0 && p.at(kGemmSegKeys[i - 1]) == 0)
                fail(Errc::input, "{}: parameter {} = {} follows {} = 0 (absent weights must be the last ones)", who,
                     kGemmSegKeys[i], p.at(kGemmSegKeys[i]), kGemmSegKeys[i - 1]);
          },
          [](const Params& p) {
            const GemmGeometry g = gemm_geometry(p);
            std::vector<int64_t> a{p.at("W"),  p.at("K"),  p.at("NA"), p.at("NB"), p.at("NC"), p.at("ND"),
                                   p.at("NE"), p.at("NF"), p.at("F"),  g.mt,       g.s};
            if (p.at("Q8") || p.at("AD") || p.at("NM") || p.at("TK")) a.push_back(p.at("Q8"));
            if (p.at("TK")) {  // dp_gemm_route's KT, kRenorm
              a.push_back(p.at("TK"));
              a.push_back(p.at("TR"));
            }
            if (gemm_early(p) || p.at("RG")) a.push_back(gemm_early(p) ? 1 : 0);  // dp_gemm_q8's kEarly
            if (p.at("RG")) a.push_back(p.at("RG"));                              // its kRing
            return a;
          },
          [](const Params& p) {
            const char* out_t = p.at("F") ? "fp32" : "bf16";
            std::vector<ArgSpec> a{
                {"x", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"W", "K"}, "bf16"), "input rows"},
                {"out", KernelParam::Kind::pointer, "void*", shape({p.at("W"), gemm_ntot(p)}, out_t),
                 "outputs of the weights side by side, in weight order"},
            };
            for (int i = 0; i < 6; ++i) {
              const int64_t n = p.at(kGemmSegKeys[i]);
              if (n == 0) continue;
              if ((p.at("Q8") >> i) & 1) {
                a.push_back({kWeightNames[i], KernelParam::Kind::pointer, "const dp_u8*", shape({n, p.at("K")}, "e4m3"),
                             "weight [out, in], e4m3"});
                a.push_back({kScaleNames[i], KernelParam::Kind::pointer, "const float*", scale_shape(n, p.at("K")),
                             fmt::format("block scales of {}", kWeightNames[i])});
              } else {
                a.push_back({kWeightNames[i], KernelParam::Kind::pointer, "const dp_bf16*",
                             shape({n, p.at("K")}, "bf16"), "weight [out, in]"});
              }
            }
            if (p.at("AD"))
              a.push_back({"add", KernelParam::Kind::pointer, "const dp_bf16*",
                           shape({p.at("W"), gemm_ntot(p)}, "bf16"),
                           "addend: out = bf16(bf16(x W^T) + add) (K3 latent MoE: the shared expert's output)"});
            if (p.at("NM")) {
              const std::string rows = dims(p, {"W", "NA"}, "bf16");
              a.push_back({"residual", KernelParam::Kind::pointer, "const dp_bf16*", rows, "residual stream in"});
              a.push_back({"norm_weight", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"NA"}, "bf16"),
                           "norm weight"});
              a.push_back({"normed", KernelParam::Kind::pointer, "dp_bf16*", rows, "normalised rows"});
              a.push_back({"residual_out", KernelParam::Kind::pointer, "dp_bf16*", rows,
                           "residual stream out (may alias residual)"});
              a.push_back({"eps", KernelParam::Kind::f32, "float", "", "variance epsilon"});
              a.push_back({"done", KernelParam::Kind::pointer, "dp_u32*", "[1] u32",
                           "blocks done (zero before the launch; left zero)"});
            }
            if (p.at("TK")) {
              const int64_t W = p.at("W"), E = p.at("NA"), K = p.at("TK"), U = std::min(E, W * K);
              a.push_back({"bias", KernelParam::Kind::pointer, "const float*", shape({E}, "fp32"),
                           "e_score_correction_bias (selection only)"});
              a.push_back({"topk_ids", KernelParam::Kind::pointer, "dp_i32*", shape({W, K}, "i32"), "chosen experts"});
              a.push_back({"topk_weights", KernelParam::Kind::pointer, "float*", shape({W, K}, "fp32"),
                           "their weights (renormalised when TR, unscaled)"});
              a.push_back({"experts", KernelParam::Kind::pointer, "dp_i32*", shape({1 + U}, "i32"),
                           "count, then the used experts ascending"});
              a.push_back({"expert_slots", KernelParam::Kind::pointer, "dp_i32*", shape({U, W}, "i32"),
                           "top-k position of each used expert per row, or -1"});
              a.push_back({"done", KernelParam::Kind::pointer, "dp_u32*", "[1] u32",
                           "blocks done (zero before the launch; left zero)"});
            }
            return a;
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = gemm_grid(p);
            s.block[0] = kGemmThreads;
            return s;
          },
          [](const Params&) { return kGemmThreads; },
          "DP_KERNEL_BOUNDS",  // replaced by gemv_bounds (below)
          [](const Params& p) {
            DeviceCall c;
            if (!p.at("Q8") && !p.at("AD") && !p.at("NM") && !p.at("TK")) return c;  // dp_gemm, bf16 weights
            c.fn = p.at("TK") ? "dp_gemm_route" : p.at("NM") ? "dp_gemm_norm_q8" : p.at("AD") ? "dp_gemm_add" : "dp_gemm_q8";
            if (p.at("TK")) {
              c.args = {"x",    "out",      "w0",           (p.at("Q8") & 1) ? "w0_scale" : "nullptr",
                        "bias", "topk_ids", "topk_weights", "experts",
                        "expert_slots", "done"};
              return c;
            }
            if (p.at("NM")) {
              c.args = {"x", "out", "w0", (p.at("Q8") & 1) ? "w0_scale" : "nullptr",
                        "residual", "norm_weight", "normed", "residual_out", "eps", "done"};
              return c;
            }
            c.args = {"x", "out"};
            for (int i = 0; i < 6; ++i) {
              const bool present = p.at(kGemmSegKeys[i]) > 0, fp8 = (p.at("Q8") >> i) & 1;
              c.args.push_back(present ? kWeightNames[i] : "nullptr");
              c.args.push_back(fp8 ? kScaleNames[i] : "nullptr");
            }
            if (p.at("AD")) c.args.push_back("add");
            return c;
          },
      },
  };
  for (OpSpec& op : ops) {
    // The fused routing keeps moe_route's scores in registers (2 x E/32 per lane): one block per SM,
    // as moe_route has, so that they fit (Kimi-K3's 896 experts spilled 968 bytes at 128 registers).
    op.bounds_for = [](const Params& p) { return p.at("TK") ? "DP_KERNEL_BOUNDS" : gemv_bounds(p); };
    op.early_weights = gemm_early;
    op.header_for = [](const Params& p) { return p.at("TK") ? "moe.h" : "gemm.h"; };
    // The ring: stages of 128 S columns of the block's rows (dp_fp8_ring_bytes), no more than K has.
    op.dynamic_shared = [](const Params& p, const std::string& target) {
      if (!p.at("RG") || !bulk_copy_target(target)) return uint32_t{0};
      const GemmGeometry g = gemm_geometry(p);
      const int64_t cols = kFp8Block * g.s, stages = std::min(p.at("RG"), (p.at("K") + cols - 1) / cols);
      return ring_bytes(g.rows(), cols, stages);
    };
  }
  return ops;
}

}  // namespace dp::codegen::ops
