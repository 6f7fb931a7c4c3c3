// moe_route, moe_up, moe_down, mlp_up (templates/moe.h): the MoE FFN (routing, gate/up of the used
// and shared experts, down + weighted sum) and the dense MLP gate/up. GEMM-shaped blocks (spec.h).
#include "codegen/ops/spec.h"

#include <fmt/format.h>

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
bool moe_up_warp_tiles(const Params& p) { return p.at("W") >= 2; }

// moe_down: output features per block (M). One activation row: every group keeps 4 x 1 lane-FMA
// accumulators for its items and streams 4 rows of each. From 2 rows: a 16-row tensor-core tile per
// item (on AMD the lane-FMA loop walks the 16 rows 4 at a time).
int64_t moe_down_rows(int64_t t) { return t == 1 ? 4 : kTileRows; }

void check_topk(const Params& p, const std::string& who) {
  if (p.at("K") > p.at("E"))
    fail(Errc::input, "{}: parameter K = {} (top-k) exceeds E = {} experts", who, p.at("K"), p.at("E"));
}

}  // namespace

std::vector<OpSpec> moe_ops() {
  return {
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
           {"ACT", "act", 0, 1, "0: silu(gate)*up, 1: K3 SiTU"}},
          [](const Params& p, const std::string& who) {
            check_multiple_of_8(p, who, {"D", "I", "S"});
            check_topk(p, who);
          },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W"), p.at("D"), p.at("I"), p.at("E"), p.at("K"), p.at("S"),
                                        p.at("ACT"), 1, kFfnSlices, moe_up_warp_tiles(p) ? 1 : 0};
          },
          [](const Params& p) {
            const int64_t W = p.at("W"), D = p.at("D"), I = p.at("I"), E = p.at("E"), K = p.at("K"), S = p.at("S");
            const int64_t U = moe_max_used(p);
            std::vector<ArgSpec> a{
                {"x", KernelParam::Kind::pointer, "const dp_bf16*", shape({W, D}, "bf16"), "post-attention-norm rows"},
                {"w1", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[{}, stride_w1] bf16", E),
                 fmt::format("expert gate weights: expert e's [{}, {}] at e*stride_w1", I, D)},
                {"w3", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[{}, stride_w3] bf16", E),
                 fmt::format("expert up weights: expert e's [{}, {}] at e*stride_w3 (fused w13: w1 + {})", I, D,
                             I * D)},
                {"shared_gate", KernelParam::Kind::pointer, "const dp_bf16*", shape({S, D}, "bf16"),
                 "shared expert gate_proj (null when S = 0)", true},
                {"shared_up", KernelParam::Kind::pointer, "const dp_bf16*", shape({S, D}, "bf16"),
                 "shared expert up_proj (null when S = 0)", true},
                {"experts", KernelParam::Kind::pointer, "const dp_i32*", shape({1 + U}, "i32"), "from moe_route"},
                {"expert_slots", KernelParam::Kind::pointer, "const dp_i32*", shape({U, W}, "i32"), "from moe_route"},
                {"h", KernelParam::Kind::pointer, "dp_bf16*", shape({W, K, I}, "bf16"), "routed activations"},
                {"hs", KernelParam::Kind::pointer, "dp_bf16*", shape({W, S}, "bf16"),
                 "shared expert activations (null when S = 0)", true},
                {"stride_w1", KernelParam::Kind::u32, "dp_u32", "",
                 fmt::format("elements between experts of w1, a multiple of 8, at least {} (dense; fused w13: {})",
                             I * D, 2 * I * D)},
                {"stride_w3", KernelParam::Kind::u32, "dp_u32", "",
                 fmt::format("elements between experts of w3, a multiple of 8, at least {} (dense; fused w13: {})",
                             I * D, 2 * I * D)},
            };
            if (p.at("ACT")) {
              a.push_back({"act_beta", KernelParam::Kind::f32, "float", "", "SiTU beta"});
              a.push_back({"act_linear_beta", KernelParam::Kind::f32, "float", "", "SiTU linear beta"});
            }
            return a;
          },
          [](const Params& p) {
            LaunchShape s;
            if (moe_up_warp_tiles(p)) {
              // Warp tiles of 8 features: enough blocks of 8 warps for the most tiles a step can have,
              // at most kTargetBlocks (the warps walk the tiles with a stride).
              const int64_t tiles = (p.at("S") + 7) / 8 + moe_max_used(p) * ((p.at("I") + 7) / 8);
              s.grid[0] = static_cast<uint32_t>(std::min(kTargetBlocks, (tiles + kGemmGroups - 1) / kGemmGroups));
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
          "DP_KERNEL_BOUNDS",
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
           {"S", "s", 0, 1 << 20, "shared expert width (this rank's shard); 0: none"}},
          [](const Params& p, const std::string& who) {
            check_multiple_of_8(p, who, {"D", "I", "S"});
            check_topk(p, who);
          },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W"), p.at("D"), p.at("I"), p.at("E"), p.at("K"), p.at("S"),
                                        moe_down_rows(p.at("W"))};
          },
          [](const Params& p) {
            const int64_t W = p.at("W"), D = p.at("D"), I = p.at("I"), E = p.at("E"), K = p.at("K"), S = p.at("S");
            const int64_t U = moe_max_used(p);
            return std::vector<ArgSpec>{
                {"h", KernelParam::Kind::pointer, "const dp_bf16*", shape({W, K, I}, "bf16"), "from moe_up"},
                {"hs", KernelParam::Kind::pointer, "const dp_bf16*", shape({W, S}, "bf16"),
                 "from moe_up (null when S = 0)", true},
                {"w2", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[{}, stride_w2] bf16", E),
                 fmt::format("expert down weights: expert e's [{}, {}] at e*stride_w2", D, I)},
                {"shared_down", KernelParam::Kind::pointer, "const dp_bf16*", shape({D, S}, "bf16"),
                 "shared expert down_proj (null when S = 0)", true},
                {"experts", KernelParam::Kind::pointer, "const dp_i32*", shape({1 + U}, "i32"), "from moe_route"},
                {"expert_slots", KernelParam::Kind::pointer, "const dp_i32*", shape({U, W}, "i32"), "from moe_route"},
                {"topk_weights", KernelParam::Kind::pointer, "const float*", shape({W, K}, "fp32"), "from moe_route"},
                {"out", KernelParam::Kind::pointer, "dp_bf16*", shape({W, D}, "bf16"), "FFN output"},
                {"routed_scaling", KernelParam::Kind::f32, "float", "", "routed_scaling_factor"},
                {"stride_w2", KernelParam::Kind::u32, "dp_u32", "",
                 fmt::format("elements between experts of w2, a multiple of 8, at least {} (dense)", D * I)},
            };
          },
          [](const Params& p) {
            LaunchShape s;
            const int64_t m = moe_down_rows(p.at("W"));
            s.grid[0] = static_cast<uint32_t>((p.at("D") + m - 1) / m);
            s.block[0] = kGemmThreads;
            return s;
          },
          [](const Params&) { return kGemmThreads; },
          "DP_KERNEL_BOUNDS",
      },
      {
          // Dense MLP gate/up + activation (its down projection is a gemm).
          "mlp_up",
          "moe.h",
          "dp_mlp_up",
          {{"W", "w", 1, kMaxGemmRows, "activation rows (requests x q)"},
           {"D", "d", 8, 1 << 20, "input width (hidden)"},
           {"I", "i", 8, 1 << 20, "intermediate width (this rank's shard)"},
           {"ACT", "act", 0, 1, "0: silu(gate)*up, 1: K3 SiTU"}},
          [](const Params& p, const std::string& who) { check_multiple_of_8(p, who, {"D", "I"}); },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W"), p.at("D"), p.at("I"), p.at("ACT"), 1, kFfnSlices};
          },
          [](const Params& p) {
            std::vector<ArgSpec> a{
                {"x", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"W", "D"}, "bf16"),
                 "post-attention-norm rows"},
                {"w_gate", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"I", "D"}, "bf16"), "gate_proj"},
                {"w_up", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"I", "D"}, "bf16"), "up_proj"},
                {"h", KernelParam::Kind::pointer, "dp_bf16*", dims(p, {"W", "I"}, "bf16"),
                 "activations (down_proj input)"},
            };
            if (p.at("ACT")) {
              a.push_back({"act_beta", KernelParam::Kind::f32, "float", "", "SiTU beta"});
              a.push_back({"act_linear_beta", KernelParam::Kind::f32, "float", "", "SiTU linear beta"});
            }
            return a;
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = static_cast<uint32_t>((p.at("I") + kFfnFeatures - 1) / kFfnFeatures);
            s.block[0] = kGemmThreads;
            return s;
          },
          [](const Params&) { return kGemmThreads; },
          "DP_KERNEL_BOUNDS",
      },
  };
}

}  // namespace dp::codegen::ops
