// The weight-ring forms (RG: e4m3 or MXFP4 weights streamed through shared memory by bulk copies, templates/
// gemm.h dp_ring_stream) of gemm, moe_up, mlp_up and moe_down: names, checks, the device calls, the
// dynamic shared memory per target, and a real compile for sm_90a and gfx942 (CPU only; correctness on a
// GPU is tests/gpu/kernels).
#include <gtest/gtest.h>

#include "../../backend/backend_test_util.h"
#include "../compile_check.h"
#include "codegen/kernel.h"
#include "instances.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

TEST(RingOps, NamesCarryTheStages) {
  EXPECT_EQ(kernel_name(ring(q8(gemm(1, 4096, {2304})))), "gemm_w1_k4096_na2304_q81_rg6");
  EXPECT_EQ(kernel_name(ring(q8(moe_up(1, 2304, 1024, 256, 8, 1024)), 3)),
            "moe_up_w1_d2304_i1024_e256_k8_s1024_act0_q81_rg3");
  EXPECT_EQ(kernel_name(ring(q8(moe_down(1, 2304, 1024, 256, 8, 1024)))),
            "moe_down_w1_d2304_i1024_e256_k8_s1024_q81_rg6");
  // RG = 0 is the kernel of before.
  EXPECT_EQ(kernel_name(ring(q8(gemm(1, 4096, {2304})), 0)), "gemm_w1_k4096_na2304_q81");
}

TEST(RingOps, RefuseWhatTheRingCannotStream) {
  using test::expect_error;
  expect_error([] { kernel_name(ring(gemm(1, 4096, {2304}))); }, Errc::input,
               {"RG = 6 (weight ring) streams e4m3 or MXFP4 weights, but Q8 = 0"});
  expect_error([] { kernel_name(ring(moe_down(1, 2304, 1024, 256, 8, 1024))); }, Errc::input,
               {"RG = 6 (weight ring)", "Q8 = 0 and Q4 = 0"});
  expect_error([] { kernel_name(ring(q8(gemm_norm(1, 4096, 2304)))); }, Errc::input,
               {"RG = 6", "fused-norm"});
  expect_error([] { kernel_name(ring(q8(moe_down(2, 2304, 1024, 256, 8, 1024)))); }, Errc::input,
               {"RG = 6", "one block per tile (SK = 0) is one row's (W = 1)"});
  expect_error([] { kernel_name(split(ring(q8(moe_down(8, 2304, 1024, 256, 8, 512))))); }, Errc::input,
               {"RG = 6 and SK = 264 with S = 512", "as wide as the routed ones (I = 1024)"});
  expect_error([] { kernel_name(ring(q8(gemm(1, 4096, {2304})), 9)); }, Errc::input, {"RG = 9 is out of range"});
  // The gate/ups' rings, one per warp, must fit a block's shared memory.
  expect_error([] { kernel_name(ring(q8(moe_up(1, 2304, 1024, 256, 8, 1024)), 6)); }, Errc::input,
               {"RG = 6", "245760 bytes", "at most 5 stages"});
}

TEST(RingOps, DeviceCallsPassTheStages) {
  // Width 1: kEarly 1, then the ring; from 2 rows kEarly 0 is spelt out before it.
  EXPECT_NE(generate_source(ring(q8(gemm(1, 4096, {2304}))))
                .find("dp_gemm_q8<1, 4096, 2304, 0, 0, 0, 0, 0, 0, 1, 8, 1, 1, 6>("),
            std::string::npos);
  EXPECT_NE(generate_source(ring(q8(gemm(8, 4096, {2304})), 4))
                .find("dp_gemm_q8<8, 4096, 2304, 0, 0, 0, 0, 0, 0, 1, 8, 1, 0, 4>("),
            std::string::npos);
  // The gate/ups keep their warp tiles (kWarpTiles 2 here: fewer tiles than the grid's warps) under the
  // ring, and their grid; the ring's own walk deals them block by block (dp_gate_up_warp_ring).
  EXPECT_NE(generate_source(ring(q8(moe_up(1, 2304, 1024, 256, 8, 1024)), 2))
                .find("dp_moe_up_q8<1, 2304, 1024, 256, 8, 1024, 0, 1, 4, 2, 2>("),
            std::string::npos);
  EXPECT_NE(generate_source(ring(q8(mlp_up(1, 2304, 9216)), 2)).find("dp_mlp_up_q8<1, 2304, 9216, 0, 1, 4, 2, 2>("),
            std::string::npos);
  EXPECT_NE(generate_source(ring(q8(moe_down(1, 2304, 1024, 256, 8, 1024))))
                .find("dp_moe_down_q8<1, 2304, 1024, 256, 8, 1024, 16, 6>("),
            std::string::npos);
  // MXFP4 experts at any width: moe_up keeps its warp tiles (a ring per warp), moe_down the latent sum.
  EXPECT_NE(generate_source(ring(q4(moe_up(1, 3584, 3072, 896, 16, 0, 1)), 2))
                .find("dp_moe_up_q4<1, 3584, 3072, 896, 16, 0, 1, 1, 4, 1, 2>("),
            std::string::npos);
  EXPECT_EQ(launch_shape(ring(q4(moe_up(1, 3584, 3072, 896, 16, 0, 1)), 2)).grid[0],
            launch_shape(q4(moe_up(1, 3584, 3072, 896, 16, 0, 1))).grid[0]);
  EXPECT_NE(generate_source(ring(q4(moe_down(8, 3584, 3072, 896, 16, 0)), 8))
                .find("dp_moe_down_q4<8, 3584, 3072, 896, 16, 0, 16, 8>("),
            std::string::npos);
  // ... and over the split grid (SK): the blocks share the (tile, item) pairs; e4m3 at any width too.
  EXPECT_NE(generate_source(split(ring(q8(moe_down(8, 2304, 1024, 256, 8, 1024)))))
                .find("dp_moe_down_q8_split<8, 2304, 1024, 256, 8, 1024, 16, 264, 6>("),
            std::string::npos);
  EXPECT_NE(generate_source(split(ring(q4(moe_down(4, 3584, 3072, 896, 16, 0)), 8)))
                .find("dp_moe_down_q4_split<4, 3584, 3072, 896, 16, 0, 16, 264, 8>("),
            std::string::npos);
  EXPECT_EQ(launch_shape(ring(q8(moe_up(1, 2304, 1024, 256, 8, 1024)), 2)).grid[0],
            launch_shape(q8(moe_up(1, 2304, 1024, 256, 8, 1024))).grid[0]);
  EXPECT_EQ(launch_shape(ring(q8(mlp_up(1, 2304, 9216)), 2)).grid[0], launch_shape(q8(mlp_up(1, 2304, 9216))).grid[0]);
}

// Stages of 128 S columns of the block's rows, no more than K has (gemm), 256 bytes of each warp tile's
// 16 gate/up rows (a ring per warp), 1024 columns of moe_down's 16-row tile; each row padded by 64 bytes.
// None on gfx942.
TEST(RingOps, DynamicSharedMemoryIsTheRing) {
  EXPECT_EQ(launch_shape(ring(q8(gemm(1, 4096, {2304})))).dynamic_shared_bytes, 4u * 16 * (1024 + 64));
  EXPECT_EQ(launch_shape(ring(q8(gemm(1, 9216, {2304})))).dynamic_shared_bytes, 6u * 16 * (1024 + 64));
  EXPECT_EQ(launch_shape(ring(q8(gemm(1, 2304, {4096, 4096, 4096, 128, 128, 32}), 7))).dynamic_shared_bytes,
            5u * 32 * (512 + 64));
  // The gate/ups: a ring per warp (8), stages of 256 bytes of the warp tile's 16 rows (two e4m3 blocks,
  // four MXFP4 chunks).
  EXPECT_EQ(launch_shape(ring(q8(moe_up(1, 2304, 1024, 256, 8, 1024)), 2)).dynamic_shared_bytes,
            8u * 2 * 16 * (256 + 64));
  EXPECT_EQ(launch_shape(ring(q8(mlp_up(1, 2304, 9216)), 5)).dynamic_shared_bytes, 8u * 5 * 16 * (256 + 64));
  EXPECT_EQ(launch_shape(ring(q8(moe_down(1, 2304, 1024, 256, 8, 1024)), 4)).dynamic_shared_bytes,
            4u * 16 * (1024 + 64));
  EXPECT_EQ(launch_shape(ring(q4(moe_up(2, 3584, 3072, 896, 16, 0, 1)), 2)).dynamic_shared_bytes,
            8u * 2 * 16 * (256 + 64));
  // MXFP4 moe_down: 1024 columns are 512 bytes a row.
  EXPECT_EQ(launch_shape(ring(q4(moe_down(3, 3584, 3072, 896, 16, 0)), 8)).dynamic_shared_bytes,
            8u * 16 * (512 + 64));
  EXPECT_EQ(launch_shape(ring(q4(moe_down(3, 3584, 3072, 896, 16, 0, "gfx942")), 8)).dynamic_shared_bytes, 0u);
  EXPECT_EQ(launch_shape(ring(q8(gemm(1, 4096, {2304}, false, "gfx942")))).dynamic_shared_bytes, 0u);
  EXPECT_EQ(launch_shape(ring(q8(moe_down(1, 2304, 1024, 256, 8, 1024, "gfx942")))).dynamic_shared_bytes, 0u);
  // Six stages keep two blocks per SM (228 KiB a Hopper SM, 1 KiB reserved per block).
  EXPECT_LE(2u * (launch_shape(ring(q8(gemm(1, 9216, {2304})))).dynamic_shared_bytes + 1024 + 1024), 228u * 1024);
}

std::vector<KernelInstance> compile_set(const std::string& t) {
  std::vector<KernelInstance> set{
      ring(q8(gemm(1, 4096, {2304}, false, t))),
      ring(q8(gemm(1, 272, {256}, false, t))),  // K with a partial 128-column block
      ring(q8(gemm(8, 2304, {4096, 4096, 4096, 128, 128, 32}, false, t), 7)),
      ring(q8(gemm(16, 4096, {2304}, false, t))),  // two activation tiles (one block per SM)
      ring(q8(mlp_up(1, 256, 512, 0, t)), 2),
      ring(q8(mlp_up(1, 2304, 9216, 0, t)), 2),
      ring(q8(moe_up(1, 256, 128, 16, 4, 128, 0, t)), 2),
      ring(q8(moe_up(8, 256, 128, 16, 4, 128, 0, t)), 3),
      ring(q8(moe_up(16, 256, 128, 16, 4, 128, 0, t)), 2),
      ring(q8(moe_up(3, 400, 144, 16, 4, 80, 0, t)), 2),  // D with a partial stage and a partial block
      ring(q8(moe_down(1, 256, 144, 16, 4, 128, t))),  // I with a partial block, S of another width
      ring(q8(moe_down(1, 2304, 1024, 256, 8, 0, t))),
      ring(q4(moe_down(1, 3584, 3072, 896, 16, 0, t)), 8),  // the K3 latent sum
      ring(q4(moe_down(8, 3584, 3072, 896, 16, 0, t)), 8),
      ring(q4(moe_down(3, 256, 1056, 16, 4, 0, t))),  // I with a partial stage and a partial chunk
      split(ring(q4(moe_down(1, 3584, 3072, 896, 16, 0, t)), 8)),
      split(ring(q4(moe_down(8, 3584, 3072, 896, 16, 0, t)), 8)),
      split(ring(q4(moe_down(3, 256, 1056, 16, 4, 0, t)), 4)),
      split(ring(q8(moe_down(1, 2304, 1024, 256, 8, 1024, t)))),
      split(ring(q8(moe_down(8, 2304, 1024, 256, 8, 1024, t)))),
      split(ring(q8(moe_down(3, 256, 144, 16, 4, 144, t)), 4)),  // I with a partial stage and block
      ring(q4(moe_up(1, 3584, 3072, 896, 16, 0, 1, t)), 2),
      ring(q4(moe_up(8, 3584, 3072, 896, 16, 0, 1, t)), 3),
      ring(q4(moe_up(3, 1056, 136, 16, 4, 0, 0, t)), 2),  // D with a partial stage and a partial chunk
  };
  // Two activation tiles. (On gfx942 the ring is not there, and the lane-FMA loop's 16-row MXFP4 form
  // keeps its accumulators on the stack: no plan asks for it, the K3 widths are 1-8.)
  if (t == "sm_90a") set.push_back(ring(q4(moe_down(16, 3584, 3072, 896, 16, 0, t)), 8));
  return set;
}

TEST(RingOpsCompile, EveryOpCompilesForSm90a) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  test_util::expect_compiles(compile_set("sm_90a"), "sm_90a");
}

TEST(RingOpsCompile, EveryOpCompilesForGfx942) {
  DP_SKIP_WITHOUT(backend::Vendor::amd);
  test_util::expect_compiles(compile_set("gfx942"), "gfx942");
}

}  // namespace
}  // namespace dp::codegen
