// prefetch (templates/prefetch.h, compiler/codegen/ops/prefetch.cpp): parameter check, parameter block,
// default launch and generated source.
#include <gtest/gtest.h>

#include "../../test_util.h"
#include "codegen/kernel.h"
#include "instances.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

TEST(PrefetchOp, RefusesBlocksOfPartialWarps) {
  test::expect_error([] { kernel_name(prefetch(48)); }, Errc::input, {"B = 48 is not a multiple of 32"});
}

TEST(PrefetchOp, ParameterBlock) {
  KernelSignature p = kernel_signature(prefetch(32));
  ASSERT_EQ(p.params.size(), 2u);
  EXPECT_EQ(p.params[1].offset, 8u);
  EXPECT_EQ(p.bytes, 12u);
}

TEST(PrefetchOp, LaunchIsADefaultTheRuntimeMayChange) {
  LaunchShape p = launch_shape(prefetch(32));
  EXPECT_EQ(p.grid[0], 32u);
  EXPECT_EQ(p.block[0], 32u);
  EXPECT_TRUE(p.grid_is_default);
}

TEST(PrefetchOp, Source) {
  const std::string p = generate_source(prefetch(64));
  EXPECT_NE(p.find("#include \"prefetch.h\""), std::string::npos) << p;
  EXPECT_NE(p.find("void prefetch_b64(\n"), std::string::npos) << p;
  EXPECT_NE(p.find("dp_prefetch_ranges<64>(table, count);"), std::string::npos) << p;
  EXPECT_EQ(op_header(prefetch(64)), "prefetch.h");
}

}  // namespace
}  // namespace dp::codegen
