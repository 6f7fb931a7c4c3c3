// gemm (templates/gemm.h, compiler/codegen/ops/gemm.cpp): names, parameter checks, signatures, launch
// shapes and a real compile for sm_90a and gfx942 at the presets' and the big models' shapes (CPU only;
// correctness on a GPU is tests/gpu/kernels).
#include <gtest/gtest.h>

#include <algorithm>

#include <fmt/format.h>

#include "../../backend/backend_test_util.h"
#include "../compile_check.h"
#include "codegen/kernel.h"
#include "instances.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

TEST(GemmOp, AreKnown) {
  const std::vector<std::string> ops = known_ops();
  for (const char* op : {"gemm"})
    EXPECT_NE(std::find(ops.begin(), ops.end(), op), ops.end()) << op;
}

TEST(GemmOp, NamesAtKimiLinear48bShapes) {
  // The KDA projections stacked in one launch: q, k, v, f_a, g_a, b.
  EXPECT_EQ(kernel_name(gemm(4, 2304, {4096, 4096, 4096, 128, 128, 32})),
            "gemm_w4_k2304_na4096_nb4096_nc4096_nd128_ne128_nf32");
  EXPECT_EQ(kernel_name(gemm(4, 4096, {2304})), "gemm_w4_k4096_na2304");         // o_proj
  EXPECT_EQ(kernel_name(gemm(4, 2304, {256}, true)), "gemm_w4_k2304_na256_f1");  // router logits
  // Omitted zeros never make two instances share a name.
  EXPECT_NE(kernel_name(gemm(4, 2304, {256}, true)), kernel_name(gemm(4, 2304, {256}, false)));
  EXPECT_NE(kernel_name(gemm(4, 2304, {256, 8})), kernel_name(gemm(4, 2304, {2568})));
}

TEST(GemmOp, RefusesShapesTheTemplatesCannotBuild) {
  using test::expect_error;
  expect_error(
      [] {
        kernel_name(gemm(4, 2304, {256, 0, 32}));
      },
      Errc::input, {"parameter NC = 32 follows NB = 0", "absent weights must be the last"});
  expect_error([] { kernel_name(gemm(4, 2300, {256})); }, Errc::input, {"K = 2300 is not a multiple of 8"});
  expect_error([] { kernel_name(gemm(33, 2304, {256})); }, Errc::input, {"parameter W = 33 is out of range", "1..32"});
  expect_error([] { kernel_name(gemm(4, 2304, {0})); }, Errc::input, {"parameter NA = 0 is out of range"});
}

TEST(GemmOp, SignatureListsOnlyThePresentWeights) {
  KernelSignature s = kernel_signature(gemm(4, 2304, {4096, 4096, 4096}));
  ASSERT_EQ(s.params.size(), 5u);
  const char* names[] = {"x", "out", "w0", "w1", "w2"};
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(s.params[i].name, names[i]);
    EXPECT_EQ(s.params[i].offset, 8 * i);
  }
  EXPECT_EQ(s.params[1].shape, "[4, 12288] bf16");
  EXPECT_EQ(s.params[4].shape, "[4096, 2304] bf16");
  EXPECT_EQ(kernel_signature(gemm(2, 2304, {256}, true)).params[1].shape, "[2, 256] fp32");
}

TEST(GemmOp, LaunchShapes) {
  // o_proj: 2304 rows; blocks of one 16-row tile (the least), split-K over the 8 groups.
  LaunchShape o = launch_shape(gemm(4, 4096, {2304}));
  EXPECT_EQ(o.block[0], 256u);
  EXPECT_EQ(o.grid[0], 144u);
  // Router: 256 rows -> 16-row blocks, split-K over the 8 groups.
  EXPECT_EQ(launch_shape(gemm(1, 2304, {256}, true)).grid[0], 16u);
  // Stacked KDA projections: every segment gets whole tiles of its own.
  LaunchShape p = launch_shape(gemm(1, 2304, {4096, 4096, 4096, 128, 128, 32}));
  EXPECT_EQ(p.grid[0], 3u * 128u + 4u + 4u + 1u);  // 32 rows per block (2 slots, 4 K-slices)
  // Tall matrices: 128 rows per block (8 slots of one tile), no split-K.
  EXPECT_EQ(launch_shape(gemm(1, 2304, {163840})).grid[0], 1280u);
  // 2 to 8 rows: the fewest waves of 264 blocks, then the most blocks. The stacked projections as 197
  // blocks of 64 rows (one wave) instead of 393 of 32 (two); o_proj keeps its 144 blocks of 16 rows (one
  // wave either way, the most blocks); the LM head 1280 blocks of 128 rows (5 waves, the fewest).
  EXPECT_EQ(launch_shape(gemm(8, 2304, {4096, 4096, 4096, 128, 128, 32})).grid[0], 3u * 64u + 2u + 2u + 1u);
  EXPECT_EQ(launch_shape(gemm(2, 2304, {4096, 4096, 4096, 128, 128, 32})).grid[0], 197u);
  EXPECT_EQ(launch_shape(gemm(8, 4096, {2304})).grid[0], 144u);
  EXPECT_EQ(launch_shape(gemm(8, 2304, {6144, 576})).grid[0], 96u * 2u + 18u);
  EXPECT_EQ(launch_shape(gemm(8, 2304, {163840})).grid[0], 1280u);
  // From 9 rows (one block per SM) the one-row rule again.
  EXPECT_EQ(launch_shape(gemm(16, 2304, {4096, 4096, 4096, 128, 128, 32})).grid[0], 393u);
}

TEST(GemmOp, Source) {
  const std::string g = generate_source(gemm(4, 4096, {2304}));
  EXPECT_NE(g.find("dp_gemm<4, 4096, 2304, 0, 0, 0, 0, 0, 0, 1, 8>(x, out, w0);"), std::string::npos) << g;
  EXPECT_NE(g.find("DP_GRID_DEPENDENCY_ENTRY();"), std::string::npos) << g;
}

// `i` with parameter `key` set to `v`.
KernelInstance with(KernelInstance i, const char* key, int64_t v) {
  i.params[key] = v;
  return i;
}

TEST(GemmOp, FusedNormForm) {
  // The o-projection with the post-attention norm: one weight, then the norm's parameters and the
  // block counter.
  const KernelInstance k = gemm_norm(4, 4096, 2304);
  EXPECT_EQ(kernel_name(k), "gemm_w4_k4096_na2304_nm1");
  EXPECT_NE(kernel_name(k), kernel_name(gemm(4, 4096, {2304})));
  const KernelSignature s = kernel_signature(k);
  std::vector<std::string> names;
  for (const KernelParam& p : s.params) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"x", "out", "w0", "residual", "norm_weight", "normed", "residual_out",
                                             "eps", "done"}));
  EXPECT_EQ(s.params[3].shape, "[4, 2304] bf16");
  EXPECT_EQ(s.params[4].shape, "[2304] bf16");
  EXPECT_EQ(s.params[8].shape, "[1] u32");
  EXPECT_EQ(launch_shape(k).grid[0], launch_shape(gemm(4, 4096, {2304})).grid[0]);
  const std::string g = generate_source(k);
  EXPECT_NE(g.find("dp_gemm_norm_q8<4, 4096, 2304, 0, 0, 0, 0, 0, 0, 1, 8, 0>(x, out, w0, nullptr, residual, "
                   "norm_weight, normed, residual_out, eps, done);"),
            std::string::npos)
      << g;
  EXPECT_NE(g.find("DP_GRID_DEPENDENCY_ENTRY();"), std::string::npos) << g;
  // e4m3 at one row: the scales, and the early-weights form (the entry point only triggers).
  KernelInstance f = gemm_norm(1, 4096, 2304);
  f.params["Q8"] = 1;
  const std::string gf = generate_source(f);
  EXPECT_NE(gf.find("dp_gemm_norm_q8<1, 4096, 2304, 0, 0, 0, 0, 0, 0, 1, 8, 1, 1>(x, out, w0, w0_scale, residual, "
                    "norm_weight, normed, residual_out, eps, done);"),
            std::string::npos)
      << gf;
  EXPECT_EQ(gf.find("DP_GRID_DEPENDENCY_ENTRY();"), std::string::npos) << gf;
}

TEST(GemmOp, FusedNormRefusesWhatItCannotNormalise) {
  using test::expect_error;
  expect_error([] { kernel_name(with(gemm_norm(4, 2304, 256), "NB", 8)); }, Errc::input,
               {"parameter NM = 1 (fused norm) takes one weight", "NB = 8"});
  expect_error([] { kernel_name(with(gemm_norm(4, 2304, 256), "F", 1)); }, Errc::input, {"F = 1"});
  expect_error([] { kernel_name(with(gemm_norm(4, 2304, 256), "AD", 1)); }, Errc::input, {"AD = 1"});
  expect_error([] { kernel_name(gemm_norm(4, 2304, 260)); }, Errc::input, {"NA = 260 is not a multiple of 8"});
}

TEST(GemmOp, FusedRoutingForm) {
  // The router with the routing fused: its logits, then moe_route's outputs and the block counter; the
  // device function is moe.h's.
  const KernelInstance k = gemm_route(4, 2304, 256, 8);
  EXPECT_EQ(kernel_name(k), "gemm_w4_k2304_na256_f1_tk8_tr1");
  EXPECT_EQ(op_header(k), "moe.h");
  EXPECT_EQ(op_header(gemm(4, 2304, {256}, true)), "gemm.h");
  const KernelSignature s = kernel_signature(k);
  std::vector<std::string> names;
  for (const KernelParam& p : s.params) names.push_back(p.name);
  EXPECT_EQ(names, (std::vector<std::string>{"x", "out", "w0", "bias", "topk_ids", "topk_weights", "experts",
                                             "expert_slots", "done"}));
  EXPECT_EQ(s.params[1].shape, "[4, 256] fp32");
  EXPECT_EQ(s.params[4].shape, "[4, 8] i32");
  EXPECT_EQ(s.params[6].shape, "[33] i32");     // 1 + min(E, W*K)
  EXPECT_EQ(s.params[7].shape, "[32, 4] i32");  // [U, W]
  EXPECT_EQ(launch_shape(k).grid[0], launch_shape(gemm(4, 2304, {256}, true)).grid[0]);
  const std::string g = generate_source(k);
  // One block per SM (the routing's scores in registers), where the plain router takes two.
  EXPECT_NE(g.find("__global__ DP_KERNEL_BOUNDS(256) void gemm_w4_k2304_na256_f1_tk8_tr1("), std::string::npos) << g;
  EXPECT_NE(g.find("#include \"moe.h\""), std::string::npos) << g;
  EXPECT_NE(g.find("dp_gemm_route<4, 2304, 256, 0, 0, 0, 0, 0, 1, 1, 8, 0, 8, 1>(x, out, w0, nullptr, bias, "
                   "topk_ids, topk_weights, experts, expert_slots, done);"),
            std::string::npos)
      << g;
}

TEST(GemmOp, FusedRoutingRefusesWhatItCannotRoute) {
  using test::expect_error;
  expect_error([] { kernel_name(with(gemm_route(4, 2304, 256, 8), "F", 0)); }, Errc::input,
               {"parameter TK = 8 (fused routing) takes one weight with fp32 logits", "F = 0"});
  expect_error([] { kernel_name(with(gemm_route(4, 2304, 256, 8), "NB", 16)); }, Errc::input, {"NB = 16"});
  expect_error([] { kernel_name(gemm_route(4, 2304, 4, 8)); }, Errc::input, {"TK = 8 and NA = 4"});
  expect_error([] { kernel_name(gemm_route(4, 2304, 2048, 8)); }, Errc::input, {"at most 1024 experts"});
  expect_error([] { kernel_name(with(gemm(4, 2304, {256}, true), "TR", 1)); }, Errc::input,
               {"TR = 1 without a fused routing"});
}

TEST(GemmOp, TwoBlocksPerSmUpToEightRows) {
  // Up to 8 activation rows (one tensor-core column tile) the entry caps registers at 128 so that two
  // blocks share an SM (144-block grids on 132 SMs ran a second wave at one block per SM); from 9 rows
  // it keeps one block per SM, as the second column tile's accumulators would spill at 128.
  for (int64_t w : {1, 8}) {
    const std::string g = generate_source(gemm(w, 9216, {2304}));
    EXPECT_NE(g.find(fmt::format("__global__ DP_KERNEL_BOUNDS_2(256) void gemm_w{}_k9216_na2304(", w)),
              std::string::npos)
        << g;
  }
  const std::string g16 = generate_source(gemm(16, 9216, {2304}));
  EXPECT_NE(g16.find("__global__ DP_KERNEL_BOUNDS(256) void gemm_w16_k9216_na2304("), std::string::npos) << g16;
}

// Kimi-Linear tiny (hidden 256, KDA projections, router) and Kimi-Linear-48B at width 8, q 2.
std::vector<KernelInstance> compile_set(const std::string& t) {
  return {
      gemm(1, 256, {256, 256, 256, 128, 128, 2}, false, t),
      gemm(2, 256, {256}, false, t),
      gemm(2, 256, {16}, true, t),
      gemm(16, 2304, {4096, 4096, 4096, 128, 128, 32}, false, t),
      gemm(16, 4096, {2304}, false, t),
      gemm_norm(2, 256, 256, t),
      gemm_route(1, 256, 16, 4, t),
      gemm_route(16, 2304, 256, 8, t),
      gemm_route(1, 7168, 896, 16, t),  // Kimi-K3's router: 896 experts, top-16
      gemm_route(8, 7168, 896, 16, t),
      gemm_norm(8, 4096, 2304, t),
      [&] {
        KernelInstance f = gemm_norm(1, 4096, 2304, t);  // e4m3, the early-weights form
        f.params["Q8"] = 1;
        return f;
      }(),
  };
}

TEST(GemmOpCompile, EveryOpCompilesForSm90a) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  test_util::expect_compiles(compile_set("sm_90a"), "sm_90a");
}

TEST(GemmOpCompile, EveryOpCompilesForGfx942) {
  DP_SKIP_WITHOUT(backend::Vendor::amd);
  test_util::expect_compiles(compile_set("gfx942"), "gfx942");
}

}  // namespace
}  // namespace dp::codegen
