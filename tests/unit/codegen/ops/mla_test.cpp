// mla_prep, mla_attn, mla_combine (templates/mla.h, compiler/codegen/ops/mla.cpp): names, parameter
// checks, signatures, launch shapes and a real compile for sm_90a and gfx942 at Kimi shapes (L 512, R 64,
// PN 128, V 128, cache blocks of 64 tokens; CPU only; correctness on a GPU is tests/gpu/kernels).
#include <gtest/gtest.h>

#include <algorithm>

#include "../../backend/backend_test_util.h"
#include "../compile_check.h"
#include "codegen/kernel.h"
#include "instances.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

TEST(MlaOps, AreKnown) {
  const std::vector<std::string> ops = known_ops();
  for (const char* op : {"mla_attn", "mla_combine", "mla_prep"})
    EXPECT_NE(std::find(ops.begin(), ops.end(), op), ops.end()) << op;
}

TEST(MlaOps, NamesAtKimiShapes) {
  EXPECT_EQ(kernel_name(mla_prep(4, 1, 32)), "mla_prep_w4_q1_n32_l512_r64_pn128_v128_bs64");
  EXPECT_EQ(kernel_name(mla_attn(4, 2, 32)), "mla_attn_w4_q2_n32_l512_r64_bs64_ns16");
  EXPECT_EQ(kernel_name(mla_combine(4, 1, 96, 1)), "mla_combine_w4_q1_n96_l512_pn128_v128_ns16_og1");
}

TEST(MlaOps, RefuseShapesTheTemplatesCannotBuild) {
  using test::expect_error;
  expect_error([] { kernel_name(mla_prep(8, 8, 32)); }, Errc::input, {"W x Q = 64 rows exceed 32"});
  KernelInstance wide = mla_attn(1, 1, 32);
  wide.params["L"] = 1024;
  wide.params["R"] = 256;
  expect_error([&] { kernel_name(wide); }, Errc::input, {"too wide for the attention tile"});
}

TEST(MlaOps, Signatures) {
  // MLA: the cache's block stride follows the existing parameters of prep and attn.
  const KernelSignature prep = kernel_signature(mla_prep(4, 1, 32));
  EXPECT_EQ(prep.params[8].name, "cache");
  EXPECT_EQ(prep.params[8].shape, "[blocks, cache_stride] bf16");
  EXPECT_EQ(prep.params.back().name, "cache_stride");
  EXPECT_EQ(prep.params.back().kind, KernelParam::Kind::u32);
  EXPECT_NE(prep.params.back().doc.find("at least 36864"), std::string::npos) << prep.params.back().doc;  // 64*576
  const KernelSignature attn = kernel_signature(mla_attn(4, 2, 32));
  EXPECT_EQ(attn.params[1].shape, "[blocks, cache_stride] bf16");
  EXPECT_EQ(attn.params.back().name, "cache_stride");
  EXPECT_EQ(attn.params.back().kind, KernelParam::Kind::u32);
}

TEST(MlaOps, LaunchShapesAndSource) {
  // MLA: one block per (16 query rows, split, request); rows are (draft position, head) pairs.
  LaunchShape a = launch_shape(mla_attn(4, 2, 32));
  EXPECT_EQ(a.grid[0], 4u);  // 2 x 32 rows in blocks of 16
  EXPECT_EQ(a.grid[1], 16u);
  EXPECT_EQ(a.grid[2], 4u);
  EXPECT_EQ(launch_shape(mla_attn(1, 1, 32)).grid[0], 2u);
  EXPECT_EQ(launch_shape(mla_attn(1, 1, 2)).grid[0], 1u);  // tiny: both heads in one block
  // mla_prep: one block per row's latent, then 128 latent columns of one head per block.
  EXPECT_EQ(launch_shape(mla_prep(4, 2, 32)).grid[0], 8u + 32u * 4u);
  // mla_combine: one block per (head, 32 output columns).
  LaunchShape c = launch_shape(mla_combine(4, 2, 32));
  EXPECT_EQ(c.grid[0], 32u);
  EXPECT_EQ(c.grid[1], 4u);
  const std::string prep_src = generate_source(mla_prep(4, 2, 32));
  EXPECT_NE(prep_src.find("dp_mla_prep<8, 2, 32, 512, 64, 128, 128, 64>("), std::string::npos) << prep_src;
}

// TS stages the cache tiles in the launch's dynamic shared memory on NVIDIA (TS x 16 rows of L+R+8 bf16);
// the AMD code does not stage, and launches without any. TS = 0 is left out of the name and of the
// template arguments, so those kernels keep their code.
KernelInstance staged(KernelInstance k, int64_t ts) {
  k.params["TS"] = ts;
  return k;
}

TEST(MlaOps, StagedAttentionTakesDynamicSharedMemoryOnNvidiaOnly) {
  const KernelInstance k = staged(mla_attn(1, 1, 32, 64), 4);
  EXPECT_EQ(kernel_name(k), "mla_attn_w1_q1_n32_l512_r64_bs64_ns64_ts4");
  EXPECT_EQ(launch_shape(k).dynamic_shared_bytes, 4u * 16u * (512u + 64u + 8u) * 2u);
  EXPECT_EQ(launch_shape(staged(mla_attn(1, 1, 32, 64, "gfx942"), 4)).dynamic_shared_bytes, 0u);
  EXPECT_EQ(launch_shape(mla_attn(1, 1, 32, 64)).dynamic_shared_bytes, 0u);
  EXPECT_EQ(launch_shape(staged(mla_attn(1, 1, 32, 64), 0)).dynamic_shared_bytes, 0u);
  EXPECT_EQ(kernel_name(staged(mla_attn(1, 1, 32, 64), 0)), "mla_attn_w1_q1_n32_l512_r64_bs64_ns64");
  const std::string src = generate_source(k);
  EXPECT_NE(src.find("dp_mla_attn<1, 1, 32, 512, 64, 64, 64, 4>("), std::string::npos) << src;
  EXPECT_NE(generate_source(mla_attn(1, 1, 32, 64)).find("dp_mla_attn<1, 1, 32, 512, 64, 64, 64>("), std::string::npos);
  // 12 tiles (224256 bytes) and the 4928 static bytes fit sm_90's 232448; 13 do not. One stage is no stage.
  EXPECT_EQ(launch_shape(staged(mla_attn(1, 1, 32, 64), 12)).dynamic_shared_bytes, 224256u);
  test::expect_error([&] { kernel_name(staged(mla_attn(1, 1, 32, 64), 13)); }, Errc::input,
                     {"TS = 13 tiles of 18688 bytes", "4928 bytes of static shared memory", "exceed the 232448"});
  test::expect_error([&] { kernel_name(staged(mla_attn(1, 1, 32, 64), 1)); }, Errc::input,
                     {"TS = 1 stages no tile ahead"});
}

// Kimi-Linear (32 heads), tiny (2 heads) and K3 (96 heads with the output gate).
std::vector<KernelInstance> compile_set(const std::string& t) {
  return {
      mla_prep(1, 1, 2, t),
      mla_attn(1, 1, 2, 4, t),
      mla_combine(1, 1, 2, 0, t),
      mla_prep(8, 2, 32, t),
      mla_attn(8, 2, 32, 16, t),
      mla_combine(8, 2, 32, 0, t),
      mla_combine(4, 1, 96, 1, t),
      staged(mla_attn(1, 1, 32, 64, t), 4),
      staged(mla_attn(8, 1, 32, 16, t), 6),
  };
}

TEST(MlaOpsCompile, EveryOpCompilesForSm90a) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  test_util::expect_compiles(compile_set("sm_90a"), "sm_90a");
}

TEST(MlaOpsCompile, EveryOpCompilesForGfx942) {
  DP_SKIP_WITHOUT(backend::Vendor::amd);
  test_util::expect_compiles(compile_set("gfx942"), "gfx942");
}

}  // namespace
}  // namespace dp::codegen
