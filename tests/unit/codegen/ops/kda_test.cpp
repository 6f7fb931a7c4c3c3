// kda_step (templates/kda.h, compiler/codegen/ops/kda.cpp): names, parameter checks, signature, launch
// shape and a real compile for sm_90a and gfx942 (CPU only; correctness on a GPU is tests/gpu/kernels).
#include <gtest/gtest.h>

#include <algorithm>

#include "../../backend/backend_test_util.h"
#include "../compile_check.h"
#include "codegen/kernel.h"
#include "instances.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

TEST(KdaOp, AreKnown) {
  const std::vector<std::string> ops = known_ops();
  for (const char* op : {"kda_step"})
    EXPECT_NE(std::find(ops.begin(), ops.end(), op), ops.end()) << op;
}

TEST(KdaOp, NamesAtKimiShapes) {
  EXPECT_EQ(kernel_name(kda(4, 1, 32)), "kda_step_w4_q1_nh32_d128_cv4_fr128_gr128_sg0_on0");
  EXPECT_EQ(kernel_name(kda(4, 2, 96, 0, true)), "kda_step_w4_q2_nh96_d128_cv4_fr128_gr0_sg1_on1");
}

TEST(KdaOp, RefusesShapesTheTemplatesCannotBuild) {
  using test::expect_error;
  KernelInstance k = kda(1, 1, 32);
  k.params["D"] = 96;
  expect_error([&] { kernel_name(k); }, Errc::input, {"D = 96 is not a multiple of 64"});
  k = kda(1, 1, 32, 100);
  expect_error([&] { kernel_name(k); }, Errc::input, {"GR = 100 is not a multiple of 8"});
}

TEST(KdaOp, Signature) {
  KernelSignature k = kernel_signature(kda(4, 2, 32));
  ASSERT_EQ(k.params.size(), 20u);
  EXPECT_EQ(k.params[0].shape, "[8, 12576] bf16");  // 3*4096 + 128 + 128 + 32 columns
  EXPECT_EQ(k.params[9].name, "state");
  EXPECT_EQ(k.params[9].shape, "[slots, state_stride] fp32");
  EXPECT_NE(k.params[9].doc.find("[32, 128, 128] at s*state_stride"), std::string::npos) << k.params[9].doc;
  EXPECT_EQ(k.params[10].shape, "[slots, conv_stride] bf16");
  EXPECT_NE(k.params[10].doc.find("[3, 4096] at s*conv_stride"), std::string::npos) << k.params[10].doc;
  EXPECT_TRUE(k.params[14].nullable);  // num_accepted
  EXPECT_EQ(k.params[16].kind, KernelParam::Kind::f32);
  // The host's slot strides (elements; its pools may pad each slot) follow the existing parameters.
  EXPECT_EQ(k.params[18].name, "state_stride");
  EXPECT_EQ(k.params[18].kind, KernelParam::Kind::u32);
  EXPECT_EQ(k.params[18].offset, 16u * 8u + 8u);
  EXPECT_NE(k.params[18].doc.find("at least 524288"), std::string::npos) << k.params[18].doc;  // 32*128*128
  EXPECT_EQ(k.params[19].name, "conv_stride");
  EXPECT_EQ(k.params[19].kind, KernelParam::Kind::u32);
  EXPECT_NE(k.params[19].doc.find("at least 12288"), std::string::npos) << k.params[19].doc;  // 3*4096
  EXPECT_EQ(k.bytes, 16 * 8 + 4 * 4);
  // K3: full-rank gate columns.
  EXPECT_EQ(kernel_signature(kda(1, 1, 96, 0, true)).params[0].shape, "[1, 49376] bf16");  // 4*12288 + 128 + 96
}

TEST(KdaOp, LaunchShapeAndSource) {
  LaunchShape k = launch_shape(kda(4, 2, 32));
  EXPECT_EQ(k.grid[0], 32u);
  EXPECT_EQ(k.grid[1], 4u);
  EXPECT_EQ(k.block[0], 512u);
  const std::string src = generate_source(kda(4, 2, 32));
  EXPECT_NE(src.find("grid 32 x 4 x 1 blocks"), std::string::npos) << src;
  // kEarly (the trailing 1): the state, conv history and weights are read before the dependency wait, so
  // the entry point only triggers its dependents.
  EXPECT_NE(src.find("dp_kda_step<4, 2, 32, 128, 4, 128, 128, 0, 0, 0, 1, 1>(proj, w_fb,"), std::string::npos) << src;
  EXPECT_NE(src.find("onorm_eps, state_stride, conv_stride);"), std::string::npos) << src;
  EXPECT_NE(src.find("DP_GRID_DEPENDENCY_TRIGGER();"), std::string::npos) << src;
  EXPECT_EQ(src.find("DP_GRID_DEPENDENCY_ENTRY();"), std::string::npos) << src;
}

// K3 at tensor_parallel > 1 (AR): the whole A_log, the rank's heads at rank*NH; a u32 `rank` after the
// existing parameters. AR 0 is the instance without it (same name, signature and device call).
KernelInstance kda_ar(int64_t w, int64_t q, int64_t nh, const std::string& t = "sm_90a") {
  KernelInstance k = kda(w, q, nh, 0, true, t);
  k.params["AR"] = 1;
  return k;
}

TEST(KdaOp, ReplicatedALogByRank) {
  EXPECT_EQ(kernel_name(kda_ar(8, 2, 12)), "kda_step_w8_q2_nh12_d128_cv4_fr128_gr0_sg1_on1_ar1");
  KernelInstance zero = kda(8, 2, 12, 0, true);
  zero.params["AR"] = 0;
  EXPECT_EQ(kernel_name(zero), "kda_step_w8_q2_nh12_d128_cv4_fr128_gr0_sg1_on1");
  EXPECT_EQ(kernel_signature(zero).params.size(), 20u);
  EXPECT_NE(generate_source(zero).find("dp_kda_step<8, 2, 12, 128, 4, 128, 0, 1, 1, 0, 1, 1>("), std::string::npos);
  const KernelSignature k = kernel_signature(kda_ar(8, 2, 12));
  ASSERT_EQ(k.params.size(), 21u);
  EXPECT_EQ(k.params[7].name, "a_log");
  EXPECT_EQ(k.params[7].shape, "[A_log size] fp32");
  EXPECT_EQ(k.params[20].name, "rank");
  EXPECT_EQ(k.params[20].kind, KernelParam::Kind::u32);
  EXPECT_EQ(k.bytes, 16 * 8 + 5 * 4);
  const std::string src = generate_source(kda_ar(8, 2, 12));
  EXPECT_NE(src.find("dp_kda_step<8, 2, 12, 128, 4, 128, 0, 1, 1, 1, 1, 1>(proj, w_fb,"), std::string::npos) << src;
  EXPECT_NE(src.find("state_stride, conv_stride, rank);"), std::string::npos) << src;
}

// VS value splits: VS blocks per (head, request) own D/VS state columns each; the head's last block
// normalises from the workspace. One row per request only, whole groups of 32 columns.
KernelInstance vs(KernelInstance k, int64_t v) {
  k.params["VS"] = v;
  return k;
}

TEST(KdaOp, ValueSplits) {
  const KernelInstance k = vs(kda(1, 1, 32), 4);
  EXPECT_EQ(kernel_name(k), "kda_step_w1_q1_nh32_d128_cv4_fr128_gr128_sg0_on0_vs4");
  const LaunchShape l = launch_shape(k);
  EXPECT_EQ(l.grid[0], 128u);  // 32 heads x 4
  EXPECT_EQ(l.grid[1], 1u);
  EXPECT_EQ(l.block[0], 512u);
  const KernelSignature sig = kernel_signature(k);
  ASSERT_EQ(sig.params.size(), 24u);
  EXPECT_EQ(sig.params[20].name, "o_part");
  EXPECT_EQ(sig.params[20].shape, "[1, 32, 128] fp32");
  EXPECT_EQ(sig.params[22].name, "ss_part");
  EXPECT_EQ(sig.params[22].shape, "[1, 32, 4] fp32");
  EXPECT_EQ(sig.params[23].name, "done");
  EXPECT_EQ(sig.params[23].shape, "[1, 32] u32");
  const std::string src = generate_source(k);
  EXPECT_NE(src.find("dp_kda_step<1, 1, 32, 128, 4, 128, 128, 0, 0, 0, 4>(proj, w_fb, w_gb,"), std::string::npos)
      << src;
  EXPECT_NE(src.find("state_stride, conv_stride, 0u, o_part, g_part, ss_part, done);"), std::string::npos) << src;
  // With the replicated A_log (K3 at tensor_parallel > 1) the rank comes first.
  const std::string ar = generate_source(vs(kda_ar(1, 1, 12), 2));
  EXPECT_NE(ar.find("dp_kda_step<1, 1, 12, 128, 4, 128, 0, 1, 1, 1, 2>("), std::string::npos) << ar;
  EXPECT_NE(ar.find("conv_stride, rank, o_part, g_part, ss_part, done);"), std::string::npos) << ar;
  // Without VS nothing changes.
  EXPECT_EQ(launch_shape(kda(1, 1, 32)).grid[0], 32u);
  EXPECT_EQ(kernel_signature(kda(1, 1, 32)).params.size(), 20u);
  using test::expect_error;
  expect_error([] { kernel_name(vs(kda(1, 2, 32), 4)); }, Errc::input, {"VS = 4 needs one row per request", "Q = 2"});
  expect_error([] { kernel_name(vs(kda(1, 1, 32), 3)); }, Errc::input, {"VS = 3: 0 (one block per head), 2 or 4"});
  KernelInstance small = vs(kda(1, 1, 32), 4);
  small.params["D"] = 64;
  expect_error([&] { kernel_name(small); }, Errc::input, {"splits D = 64 into 16 columns, not whole groups of 32"});
}

// Kimi-Linear tiny (2 heads), Kimi-Linear-48B (32 heads) and Kimi-K3 (96 heads, full-rank gate, safe gate,
// fp32 o_norm; and a TP-8 rank's 12 heads with the replicated A_log).
std::vector<KernelInstance> compile_set(const std::string& t) {
  return {
      kda(1, 1, 2, 128, false, t),
      kda(8, 2, 2, 128, false, t),
      kda(8, 2, 32, 128, false, t),
      kda(2, 1, 96, 0, true, t),
      kda_ar(8, 2, 12, t),
      vs(kda(1, 1, 32, 128, false, t), 4),
      vs(kda(8, 1, 32, 128, false, t), 2),
      vs(kda(1, 1, 96, 0, true, t), 4),
      vs(kda_ar(1, 1, 12, t), 4),
  };
}

TEST(KdaOpCompile, EveryOpCompilesForSm90a) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  test_util::expect_compiles(compile_set("sm_90a"), "sm_90a");
}

TEST(KdaOpCompile, EveryOpCompilesForGfx942) {
  DP_SKIP_WITHOUT(backend::Vendor::amd);
  test_util::expect_compiles(compile_set("gfx942"), "gfx942");
}

}  // namespace
}  // namespace dp::codegen
