// moe_route, moe_up, moe_down, mlp_up (templates/moe.h, compiler/codegen/ops/moe.cpp): names, parameter
// checks, signatures, launch shapes and a real compile for sm_90a and gfx942 (CPU only; correctness on a
// GPU is tests/gpu/kernels).
#include <gtest/gtest.h>

#include <algorithm>

#include "../../backend/backend_test_util.h"
#include "../compile_check.h"
#include "codegen/kernel.h"
#include "instances.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

TEST(MoeOps, AreKnown) {
  const std::vector<std::string> ops = known_ops();
  for (const char* op : {"mlp_up", "moe_down", "moe_route", "moe_up"})
    EXPECT_NE(std::find(ops.begin(), ops.end(), op), ops.end()) << op;
}

TEST(MoeOps, NamesAtKimiLinear48bShapes) {
  EXPECT_EQ(kernel_name(route(8, 256, 8)), "moe_route_w8_e256_k8_rn1");
  EXPECT_EQ(kernel_name(moe_up(4, 2304, 1024, 256, 8, 1024)), "moe_up_w4_d2304_i1024_e256_k8_s1024_act0");
  EXPECT_EQ(kernel_name(moe_down(4, 2304, 1024, 256, 8, 1024)), "moe_down_w4_d2304_i1024_e256_k8_s1024");
  EXPECT_EQ(kernel_name(mlp_up(4, 2304, 9216)), "mlp_up_w4_d2304_i9216_act0");
}

TEST(MoeOps, RefuseShapesTheTemplatesCannotBuild) {
  using test::expect_error;
  expect_error([] { kernel_name(route(1, 4, 8)); }, Errc::input, {"K = 8 (top-k) exceeds E = 4"});
  expect_error([] { kernel_name(moe_up(4, 2304, 1020, 256, 8, 1024)); }, Errc::input,
               {"I = 1020 is not a multiple of 8"});
  expect_error([] { kernel_name(moe_down(4, 2304, 1024, 256, 8, 1028)); }, Errc::input,
               {"S = 1028 is not a multiple of 8"});
}

TEST(MoeOps, Signatures) {
  // moe_up: nine pointers, the expert strides of w1 and w3, then the SiTU betas when ACT = 1.
  const KernelSignature up = kernel_signature(moe_up(4, 2304, 1024, 256, 8, 1024));
  EXPECT_EQ(up.bytes, 9u * 8u + 8u);
  ASSERT_EQ(up.params.size(), 11u);
  EXPECT_EQ(up.params[1].shape, "[256, stride_w1] bf16");
  EXPECT_EQ(up.params[2].shape, "[256, stride_w3] bf16");
  EXPECT_EQ(up.params[9].name, "stride_w1");
  EXPECT_EQ(up.params[10].name, "stride_w3");
  EXPECT_EQ(up.params[10].kind, KernelParam::Kind::u32);
  EXPECT_NE(up.params[9].doc.find("at least 2359296 (dense; fused w13: 4718592)"), std::string::npos)
      << up.params[9].doc;
  const KernelSignature situ = kernel_signature(moe_up(4, 7168, 3072, 896, 16, 6144, 1));
  EXPECT_EQ(situ.bytes, 9u * 8u + 8u + 8u);  // SiTU betas after the strides
  EXPECT_EQ(situ.params[11].name, "act_beta");
  const KernelSignature down = kernel_signature(moe_down(4, 2304, 1024, 256, 8, 1024));
  EXPECT_EQ(down.params[2].shape, "[256, stride_w2] bf16");
  EXPECT_EQ(down.params.back().name, "stride_w2");
  EXPECT_EQ(down.params.back().kind, KernelParam::Kind::u32);
  EXPECT_EQ(down.bytes, 8u * 8u + 4u + 4u);
  const KernelSignature r = kernel_signature(route(8, 256, 8));
  EXPECT_EQ(r.params[4].shape, "[65] i32");  // 1 + min(E, W*K)
  EXPECT_EQ(r.params[5].shape, "[64, 8] i32");
  EXPECT_EQ(kernel_signature(route(1, 256, 8)).params[4].shape, "[9] i32");
}

TEST(MoeOps, LaunchShapes) {
  EXPECT_EQ(launch_shape(route(4, 256, 8)).grid[0], 1u);
  // moe_up, one row: shared tiles + min(E, W*K) experts' tiles, 16 features per block.
  EXPECT_EQ(launch_shape(moe_up(1, 2304, 1024, 256, 8, 1024)).grid[0], 64u + 8u * 64u);
  // From 2 rows: warp tiles of 8 features walked with a grid stride over 264 blocks of 8 warps, dealt
  // warp by warp when the most tiles a step can have fill fewer (no shared expert, 16 experts x 32 tiles
  // of I = 256 at width 2: 512 tiles), block by block otherwise (2176 tiles).
  EXPECT_EQ(launch_shape(moe_up(2, 2304, 256, 256, 8, 0)).grid[0], 264u);
  EXPECT_EQ(launch_shape(moe_up(2, 2304, 1024, 256, 8, 1024)).grid[0], 264u);
  EXPECT_EQ(launch_shape(moe_up(64 / 4, 2304, 1024, 256, 8, 1024)).grid[0], 264u);
  // moe_down: M output features per block, the items spread over its groups (M = 4 for one row, then
  // a 16-row tensor-core tile).
  EXPECT_EQ(launch_shape(moe_down(1, 2304, 1024, 256, 8, 1024)).grid[0], 576u);
  EXPECT_EQ(launch_shape(moe_down(4, 2304, 1024, 256, 8, 1024)).grid[0], 144u);
  EXPECT_EQ(launch_shape(moe_down(8, 2304, 1024, 256, 8, 1024)).grid[0], 144u);
  EXPECT_EQ(launch_shape(moe_down(16, 2304, 1024, 256, 8, 1024)).grid[0], 144u);
  EXPECT_EQ(launch_shape(mlp_up(4, 2304, 9216)).grid[0], 576u);
}

// The warp tiles' walk (dp_warp_tile_first's kWarpTiles, the call's last template argument): warp by
// warp (2) where the step's tiles are fewer than the 264 blocks' warps, so that they spread over every
// SM; block by block (1) otherwise.
TEST(MoeOps, WarpTilesAreDealtWarpByWarpWhenTheyDoNotFillTheGrid) {
  auto call_of = [](const KernelInstance& k) {
    const std::string g = generate_source(k);
    const size_t at = g.find("dp_m");
    return at == std::string::npos ? std::string() : g.substr(at, g.find('(', at) - at);
  };
  KernelInstance up_q8 = moe_up(1, 2304, 1024, 256, 8, 1024);  // 128 + 8 x 128 = 1152 tiles
  up_q8.params["Q8"] = 1;
  EXPECT_EQ(call_of(up_q8), "dp_moe_up_q8<1, 2304, 1024, 256, 8, 1024, 0, 1, 4, 2>");
  KernelInstance mlp_q8 = mlp_up(1, 2304, 9216);  // 1152 tiles
  mlp_q8.params["Q8"] = 1;
  EXPECT_EQ(call_of(mlp_q8), "dp_mlp_up_q8<1, 2304, 9216, 0, 1, 4, 2>");
  EXPECT_EQ(launch_shape(mlp_q8).grid[0], 264u);
  EXPECT_EQ(call_of(moe_up(2, 2304, 1024, 256, 8, 1024)), "dp_moe_up<2, 2304, 1024, 256, 8, 1024, 0, 1, 4, 1>");
  EXPECT_EQ(call_of(moe_up(1, 2304, 1024, 256, 8, 1024)), "dp_moe_up<1, 2304, 1024, 256, 8, 1024, 0, 1, 4, 0>");
}

TEST(MoeOps, GemmShapedOpsTakeTwoBlocksPerSmUpToEightRows) {
  // moe_up, moe_down and mlp_up as gemm (gemm_test): 128 registers, two blocks per SM, up to 8 rows;
  // moe_route (one block) keeps one.
  auto bounds_of = [](const KernelInstance& k) {
    const std::string g = generate_source(k);
    const size_t at = g.find("__global__ ");
    return at == std::string::npos ? std::string() : g.substr(at + 11, g.find('(', at) - at - 11);
  };
  EXPECT_EQ(bounds_of(moe_up(1, 2304, 1024, 256, 8, 1024)), "DP_KERNEL_BOUNDS_2");
  EXPECT_EQ(bounds_of(moe_down(8, 2304, 1024, 256, 8, 1024)), "DP_KERNEL_BOUNDS_2");
  EXPECT_EQ(bounds_of(mlp_up(4, 2304, 9216)), "DP_KERNEL_BOUNDS_2");
  EXPECT_EQ(bounds_of(moe_up(16, 2304, 1024, 256, 8, 1024)), "DP_KERNEL_BOUNDS");
  EXPECT_EQ(bounds_of(moe_down(9, 2304, 1024, 256, 8, 1024)), "DP_KERNEL_BOUNDS");
  EXPECT_EQ(bounds_of(route(8, 256, 8)), "DP_KERNEL_BOUNDS");
}

// Kimi-Linear tiny (16 experts top-4, I 128, shared 128, dense 512), Kimi-Linear-48B at width 8, q 2, and
// Kimi-K3 (SiTU, 896 experts top-16).
std::vector<KernelInstance> compile_set(const std::string& t) {
  return {
      route(16, 16, 4, t),
      moe_up(16, 256, 128, 16, 4, 128, 0, t),
      moe_down(16, 256, 128, 16, 4, 128, t),
      mlp_up(2, 256, 512, 0, t),
      route(16, 256, 8, t),
      moe_up(16, 2304, 1024, 256, 8, 1024, 0, t),
      moe_down(16, 2304, 1024, 256, 8, 1024, t),
      route(8, 896, 16, t),
      mlp_up(1, 7168, 33792, 1, t),
  };
}

TEST(MoeOpsCompile, EveryOpCompilesForSm90a) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  test_util::expect_compiles(compile_set("sm_90a"), "sm_90a");
}

TEST(MoeOpsCompile, EveryOpCompilesForGfx942) {
  DP_SKIP_WITHOUT(backend::Vendor::amd);
  test_util::expect_compiles(compile_set("gfx942"), "gfx942");
}

}  // namespace
}  // namespace dp::codegen
