// rmsnorm (templates/norm.h, compiler/codegen/ops/norm.cpp): parameter checks and the block shape.
// The generic naming, layout and source rules are shown with rmsnorm in ../kernel_test.cpp.
#include <gtest/gtest.h>

#include "../../test_util.h"
#include "codegen/kernel.h"
#include "instances.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

TEST(NormOp, RefusesRowsTheTemplateCannotRead) {
  test::expect_error([] { kernel_name(rmsnorm(4, 2300)); }, Errc::input, {"H = 2300 is not a multiple of 8"});
}

TEST(NormOp, IsOneBlockPerRowOfWholeWavefronts) {
  for (int64_t h : {8, 64, 512, 2304, 4096, 7168, 16384, 65536}) {
    LaunchShape s = launch_shape(rmsnorm(3, h));
    EXPECT_EQ(s.grid[0], 3u);
    EXPECT_EQ(s.block[0] % 64, 0u) << h;
    EXPECT_LE(s.block[0], 256u) << h;
    EXPECT_GE(s.block[0] * ((h / 8 + s.block[0] - 1) / s.block[0]), static_cast<uint64_t>(h / 8));
  }
  EXPECT_EQ(launch_shape(rmsnorm(4, 2304)).block[0], 192u);
}

}  // namespace
}  // namespace dp::codegen
