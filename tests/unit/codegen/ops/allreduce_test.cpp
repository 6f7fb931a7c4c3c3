// allreduce (templates/allreduce.h, compiler/codegen/ops/allreduce.cpp): name, parameter block, launch
// shape, checks, the generated call, and a real compile for both vendors.
#include <gtest/gtest.h>

#include "../../test_util.h"
#include "../compile_check.h"
#include "codegen/kernel.h"
#include "instances.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

TEST(AllreduceOp, IsNamedByRowsHiddenAndRanks) {
  EXPECT_EQ(kernel_name(allreduce(4, 2304, 2)), "allreduce_w4_h2304_r2");
  EXPECT_EQ(instance_key(allreduce(32, 7168, 8, "gfx942")), "allreduce_w32_h7168_r8.gfx942");
}

TEST(AllreduceOp, TakesPartialOutPeersFlagAndTheRuntimeWords) {
  const KernelSignature s = kernel_signature(allreduce(4, 2304, 4));
  const char* names[] = {"partial", "out", "peers", "flag", "rank", "layer", "op", "timeout_us"};
  const KernelParam::Kind kinds[] = {KernelParam::Kind::pointer, KernelParam::Kind::pointer, KernelParam::Kind::pointer,
                                     KernelParam::Kind::pointer, KernelParam::Kind::u32,     KernelParam::Kind::u32,
                                     KernelParam::Kind::u32,     KernelParam::Kind::u32};
  const uint32_t offsets[] = {0, 8, 16, 24, 32, 36, 40, 44};
  ASSERT_EQ(s.params.size(), 8u);
  for (size_t i = 0; i < 8; ++i) {
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(s.params[i].name, names[i]);
    EXPECT_EQ(s.params[i].kind, kinds[i]);
    EXPECT_EQ(s.params[i].offset, offsets[i]);
    EXPECT_FALSE(s.params[i].nullable);
  }
  EXPECT_EQ(s.params[0].shape, "[4, 2304] bf16");
  EXPECT_EQ(s.params[2].shape, "[4] u64");
  EXPECT_EQ(s.bytes, 48u);
}

TEST(AllreduceOp, LaunchesOneBlockPer256VectorsUpToTheFlagLines) {
  // [1, 2304]: 288 vectors -> 2 blocks; [8, 2304]: 2304 -> 9; [32, 7168]: 28672 -> capped at 64.
  EXPECT_EQ(launch_shape(allreduce(1, 2304, 2)).grid[0], 2u);
  EXPECT_EQ(launch_shape(allreduce(8, 2304, 2)).grid[0], 9u);
  EXPECT_EQ(launch_shape(allreduce(32, 7168, 8)).grid[0], 64u);
  EXPECT_EQ(launch_shape(allreduce(1, 8, 2)).grid[0], 1u);
  for (int64_t w : {1, 2, 3, 8, 16, 32}) {
    const LaunchShape s = launch_shape(allreduce(w, 2304, 4));
    EXPECT_EQ(s.block[0], 256u);
    EXPECT_EQ(s.grid[1] * s.grid[2], 1u);
    EXPECT_FALSE(s.grid_is_default) << "every rank must launch the same grid";
  }
  // The rank count changes the name, never the grid (block b meets block b of every peer).
  EXPECT_EQ(launch_shape(allreduce(8, 2304, 2)).grid[0], launch_shape(allreduce(8, 2304, 8)).grid[0]);
}

TEST(AllreduceOp, RefusesWhatTheExchangeCannotHold) {
  test::expect_error([] { kernel_name(allreduce(4, 2300, 2)); }, Errc::input, {"H = 2300 is not a multiple of 8"});
  test::expect_error([] { kernel_name(allreduce(4, 2304, 1)); }, Errc::input, {"parameter R = 1 is out of range", "2..8"});
  test::expect_error([] { kernel_name(allreduce(4, 2304, 16)); }, Errc::input, {"parameter R = 16 is out of range"});
  test::expect_error([] { kernel_name(allreduce(257, 2304, 2)); }, Errc::input, {"parameter W = 257 is out of range"});
}

TEST(AllreduceOp, GeneratesOneCallWithTheBlockCount) {
  const std::string s = generate_source(allreduce(8, 2304, 4));
  EXPECT_NE(s.find("#include \"allreduce.h\""), std::string::npos) << s;
  EXPECT_NE(s.find("DP_LAUNCH_BOUNDS(256) void allreduce_w8_h2304_r4("), std::string::npos) << s;
  EXPECT_NE(s.find("dp_allreduce<8, 2304, 4, 256, 9>(partial, out, peers, flag, rank, layer, op, timeout_us);"),
            std::string::npos)
      << s;
}

std::vector<KernelInstance> compile_set(const std::string& target) {
  return {allreduce(1, 2304, 2, target), allreduce(8, 2304, 4, target), allreduce(32, 7168, 8, target),
          allreduce(3, 256, 2, target)};
}

TEST(AllreduceOpCompile, CompilesForSm90a) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  test_util::expect_compiles(compile_set("sm_90a"), "sm_90a");
}

TEST(AllreduceOpCompile, CompilesForGfx942) {
  DP_SKIP_WITHOUT(backend::Vendor::amd);
  test_util::expect_compiles(compile_set("gfx942"), "gfx942");
}

}  // namespace
}  // namespace dp::codegen
