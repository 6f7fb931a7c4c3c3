// The e4m3 forms (Q8) of the ops that read weights: names, checks, signatures, the device calls the
// entry points make, and a real compile for sm_90a and gfx942 (CPU only; correctness on a GPU is
// tests/gpu/kernels).
#include <gtest/gtest.h>

#include "../../backend/backend_test_util.h"
#include "../compile_check.h"
#include "codegen/kernel.h"
#include "instances.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

std::vector<std::string> names(const KernelSignature& s) {
  std::vector<std::string> n;
  for (const KernelParam& p : s.params) n.push_back(p.name);
  return n;
}

TEST(Fp8Ops, NamesCarryTheFormAndBf16NamesDoNot) {
  EXPECT_EQ(kernel_name(q8(gemm(4, 2304, {4096, 4096, 4096, 128, 128, 32}), 7)),
            "gemm_w4_k2304_na4096_nb4096_nc4096_nd128_ne128_nf32_q87");
  // Q8 = 0, given or not, is the bf16 kernel of before.
  EXPECT_EQ(kernel_name(q8(gemm(4, 4096, {2304}), 0)), "gemm_w4_k4096_na2304");
  EXPECT_EQ(kernel_name(gemm(4, 4096, {2304})), "gemm_w4_k4096_na2304");
  EXPECT_EQ(kernel_name(q8(moe_up(2, 2304, 1024, 256, 8, 1024))), "moe_up_w2_d2304_i1024_e256_k8_s1024_act0_q81");
  EXPECT_EQ(kernel_name(q8(mla_prep(1, 1, 32))), "mla_prep_w1_q1_n32_l512_r64_pn128_v128_bs64_q81");
}

TEST(Fp8Ops, RefuseWhatTheTemplatesCannotRead) {
  using test::expect_error;
  expect_error([] { kernel_name(q8(gemm(4, 2304, {256}), 2)); }, Errc::input,
               {"Q8 = 2 marks weight 1 as e4m3", "NB = 0 (absent)"});
  expect_error([] { kernel_name(q8(gemm(4, 2312, {256}))); }, Errc::input, {"K = 2312 is not a multiple of 16"});
  expect_error([] { kernel_name(q8(gemm(4, 2304, {256}), 64)); }, Errc::input, {"Q8 = 64 is out of range"});
  expect_error([] { kernel_name(q8(mlp_up(1, 264, 512))); }, Errc::input, {"D = 264 is not a multiple of 16"});
  expect_error([] { kernel_name(q8(moe_down(1, 256, 136, 16, 4, 0))); }, Errc::input,
               {"I = 136 is not a multiple of 16"});
}

TEST(Fp8Ops, GemmSignatureAndCallPerSegment) {
  // q, k, v e4m3; f_a, g_a, b bf16 (the KDA projections of an FP8 checkpoint).
  const KernelInstance k = q8(gemm(4, 2304, {4096, 4096, 4096, 128, 128, 32}), 7);
  const KernelSignature s = kernel_signature(k);
  EXPECT_EQ(names(s), (std::vector<std::string>{"x", "out", "w0", "w0_scale", "w1", "w1_scale", "w2", "w2_scale",
                                                "w3", "w4", "w5"}));
  EXPECT_EQ(s.params[2].shape, "[4096, 2304] e4m3");
  EXPECT_EQ(s.params[2].c_type, "const dp_u8*");
  EXPECT_EQ(s.params[3].shape, "[32, 18] fp32");
  EXPECT_EQ(s.params[8].shape, "[128, 2304] bf16");
  const std::string src = generate_source(k);
  // Four rows: 197 blocks of 64 rows (S = 2), one wave of two blocks per SM (gemm_geometry).
  EXPECT_NE(src.find("dp_gemm_q8<4, 2304, 4096, 4096, 4096, 128, 128, 32, 0, 1, 2, 7>(x, out, w0, w0_scale, w1, "
                     "w1_scale, w2, w2_scale, w3, nullptr, w4, nullptr, w5, nullptr);"),
            std::string::npos)
      << src;
  // Absent segments pass null for the weight and the scales.
  EXPECT_NE(generate_source(q8(gemm(1, 4096, {2304}))).find("(x, out, w0, w0_scale, nullptr, nullptr, nullptr"),
            std::string::npos);
  // Q8 = 0 given: the bf16 kernel's call.
  EXPECT_NE(generate_source(q8(gemm(4, 4096, {2304}), 0)).find("dp_gemm<4, 4096, 2304, 0, 0, 0, 0, 0, 0, 1, 8>(x, out, w0);"),
            std::string::npos);
}

TEST(Fp8Ops, ExpertSignatures) {
  const KernelSignature up = kernel_signature(q8(moe_up(2, 2304, 1024, 256, 8, 1024)));
  EXPECT_EQ(names(up), (std::vector<std::string>{"x", "w1", "w1_scale", "w3", "w3_scale", "shared_gate",
                                                 "shared_gate_scale", "shared_up", "shared_up_scale", "experts",
                                                 "expert_slots", "h", "hs", "stride_w1", "stride_w1_scale",
                                                 "stride_w3", "stride_w3_scale"}));
  EXPECT_EQ(up.params[6].shape, "[8, 18] fp32");
  EXPECT_TRUE(up.params[6].nullable);
  const KernelSignature down = kernel_signature(q8(moe_down(1, 2304, 1024, 256, 8, 1024)));
  EXPECT_EQ(names(down), (std::vector<std::string>{"h", "hs", "w2", "w2_scale", "shared_down", "shared_down_scale",
                                                   "experts", "expert_slots", "topk_weights", "out",
                                                   "routed_scaling", "stride_w2", "stride_w2_scale"}));
  // One activation row: the e4m3 form takes 16-row tensor-core tiles (the bf16 one 4 rows of lane FMAs).
  EXPECT_EQ(launch_shape(q8(moe_down(1, 2304, 1024, 256, 8, 1024))).grid[0], 2304u / 16);
  EXPECT_EQ(launch_shape(moe_down(1, 2304, 1024, 256, 8, 1024)).grid[0], 2304u / 4);
  EXPECT_EQ(names(kernel_signature(q8(mlp_up(1, 2304, 9216)))),
            (std::vector<std::string>{"x", "w_gate", "w_gate_scale", "w_up", "w_up_scale", "h"}));
  EXPECT_NE(generate_source(q8(moe_up(2, 2304, 1024, 256, 8, 1024))).find("dp_moe_up_q8<"), std::string::npos);
  const KernelSignature comb = kernel_signature(q8(mla_combine(1, 1, 32)));
  EXPECT_EQ(comb.params.back().name, "kv_b_scale");
  EXPECT_EQ(comb.params.back().shape, "[64, 4] fp32");  // 32 heads x 256 rows, 512 columns
}

// e4m3 gate/up takes the warp tiles from one row (dense and routed): one warp per 8-feature tile over
// 264 blocks (two per SM), dealt warp by warp where the tiles are fewer than the blocks' warps (1152 for
// the 48B shape), block by block where they are not (4224 for K3's dense MLP).
TEST(Fp8Ops, GateUpTakesWarpTilesFromOneRow) {
  EXPECT_EQ(launch_shape(q8(mlp_up(1, 2304, 9216))).grid[0], 264u);
  EXPECT_EQ(launch_shape(q8(mlp_up(8, 2304, 9216))).grid[0], 264u);
  EXPECT_EQ(launch_shape(q8(mlp_up(1, 7168, 33792))).grid[0], 264u);
  EXPECT_EQ(launch_shape(mlp_up(1, 2304, 9216)).grid[0], 576u);  // bf16: the block tiles
  EXPECT_EQ(launch_shape(q8(moe_up(1, 2304, 1024, 256, 8, 1024))).grid[0], 264u);
  EXPECT_NE(generate_source(q8(mlp_up(1, 2304, 9216))).find("dp_mlp_up_q8<1, 2304, 9216, 0, 1, 4, 2>"),
            std::string::npos);
  EXPECT_NE(generate_source(q8(mlp_up(1, 7168, 33792))).find("dp_mlp_up_q8<1, 7168, 33792, 0, 1, 4, 1>"),
            std::string::npos);
  EXPECT_NE(generate_source(mlp_up(1, 2304, 9216)).find("dp_mlp_up<1, 2304, 9216, 0, 1, 4, 0>"), std::string::npos);
}

std::vector<KernelInstance> compile_set(const std::string& t) {
  return {
      q8(gemm(1, 256, {256, 256, 256, 128, 128, 2}, false, t), 7),
      q8(gemm(8, 272, {256}, false, t)),  // K with a partial 128-column block
      q8(gemm(16, 2304, {4096, 4096, 4096, 128, 128, 32}, false, t), 7),
      q8(mlp_up(1, 256, 512, 0, t)),
      q8(mlp_up(8, 256, 512, 0, t)),
      q8(moe_up(1, 256, 128, 16, 4, 128, 0, t)),
      q8(moe_up(8, 256, 128, 16, 4, 128, 0, t)),
      q8(moe_down(1, 256, 128, 16, 4, 128, t)),
      q8(moe_down(8, 256, 128, 16, 4, 0, t)),
      q8(mla_prep(2, 2, 2, t)),
      q8(mla_combine(2, 2, 2, 0, t)),
  };
}

TEST(Fp8OpsCompile, EveryOpCompilesForSm90a) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  test_util::expect_compiles(compile_set("sm_90a"), "sm_90a");
}

TEST(Fp8OpsCompile, EveryOpCompilesForGfx942) {
  DP_SKIP_WITHOUT(backend::Vendor::amd);
  test_util::expect_compiles(compile_set("gfx942"), "gfx942");
}

}  // namespace
}  // namespace dp::codegen
