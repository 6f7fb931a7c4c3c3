// attnres (templates/attnres.h, compiler/codegen/ops/attnres.cpp): name, parameter block, launch shape,
// checks, and a real compile for both vendors at the K3 shapes.
#include <gtest/gtest.h>

#include "../../test_util.h"
#include "../compile_check.h"
#include "codegen/kernel.h"

namespace dp::codegen {
namespace {

KernelInstance attnres(int64_t w, int64_t h, int64_t b, int64_t nb, int64_t s, const std::string& target = "sm_90a") {
  return {"attnres", {{"W", w}, {"H", h}, {"B", b}, {"NB", nb}, {"S", s}}, target};
}

TEST(AttnResOp, IsNamedByRowsHiddenBlockSizeBlocksAndStage) {
  EXPECT_EQ(kernel_name(attnres(4, 7168, 12, 8, 0)), "attnres_w4_h7168_b12_n8_s0");
  EXPECT_EQ(kernel_name(attnres(1, 256, 2, 3, 2)), "attnres_w1_h256_b2_n3_s2");
}

TEST(AttnResOp, TakesTheRmsnormParametersAndTheBlockBuffer) {
  const KernelSignature s = kernel_signature(attnres(4, 7168, 12, 8, 1));
  const char* names[] = {"hidden", "residual", "blocks", "stride_blocks", "layer", "res_norm",
                         "res_proj", "weight", "out", "residual_out", "eps"};
  ASSERT_EQ(s.params.size(), 11u);
  for (size_t i = 0; i < 11; ++i) EXPECT_EQ(s.params[i].name, names[i]);
  EXPECT_EQ(s.params[2].shape, "[4, 8, 7168] bf16");
  EXPECT_EQ(s.params[3].kind, KernelParam::Kind::u32);
  EXPECT_EQ(s.params[4].kind, KernelParam::Kind::u32);
  EXPECT_EQ(s.params[6].shape, "[1, 7168] bf16");
  EXPECT_TRUE(s.params[1].nullable);
  EXPECT_FALSE(s.params[2].nullable);
  EXPECT_EQ(s.params[10].kind, KernelParam::Kind::f32);
}

TEST(AttnResOp, IsOneBlockPerRowLikeRmsnorm) {
  for (int64_t h : {256, 2304, 7168}) {
    const LaunchShape a = launch_shape(attnres(3, h, 12, 8, 0));
    const LaunchShape r = launch_shape({"rmsnorm", {{"W", 3}, {"H", h}}, "sm_90a"});
    EXPECT_EQ(a.grid[0], 3u);
    EXPECT_EQ(a.block[0], r.block[0]) << h;
  }
}

TEST(AttnResOp, RefusesWhatTheTemplateCannotRead) {
  test::expect_error([] { kernel_name(attnres(4, 2300, 12, 8, 0)); }, Errc::input, {"H = 2300", "multiple of 8"});
  test::expect_error([] { kernel_name(attnres(4, 256, 2, 3, 3)); }, Errc::input, {"S = 3", "0..2"});
  test::expect_error([] { kernel_name(attnres(4, 256, 2, 0, 0)); }, Errc::input, {"NB = 0", "1..64"});
}

std::vector<KernelInstance> compile_set(const std::string& target) {
  return {attnres(8, 7168, 12, 8, 0, target), attnres(8, 7168, 12, 8, 1, target), attnres(1, 7168, 12, 8, 2, target),
          attnres(3, 256, 2, 3, 0, target)};
}

TEST(AttnResOpCompile, CompilesForSm90a) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  test_util::expect_compiles(compile_set("sm_90a"), "sm_90a");
}

TEST(AttnResOpCompile, CompilesForGfx942) {
  DP_SKIP_WITHOUT(backend::Vendor::amd);
  test_util::expect_compiles(compile_set("gfx942"), "gfx942");
}

}  // namespace
}  // namespace dp::codegen
