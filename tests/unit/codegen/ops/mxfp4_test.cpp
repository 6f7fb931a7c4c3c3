// The MXFP4 forms (Q4) of moe_up / moe_down and gemm's addend form (AD), the ops of the K3 latent MoE:
// names, checks, signatures, the device calls the entry points make, and a real compile for sm_90a and
// gfx942 (CPU only; correctness on a GPU is tests/gpu/kernels, the "mxfp4" cases).
#include <gtest/gtest.h>

#include "../../backend/backend_test_util.h"
#include "../compile_check.h"
#include "codegen/kernel.h"
#include "instances.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

KernelInstance ad(KernelInstance k, int64_t v = 1) {
  k.params["AD"] = v;
  return k;
}

std::vector<std::string> names(const KernelSignature& s) {
  std::vector<std::string> n;
  for (const KernelParam& p : s.params) n.push_back(p.name);
  return n;
}

TEST(Mxfp4Ops, NamesCarryTheFormAndOthersDoNot) {
  EXPECT_EQ(kernel_name(q4(moe_up(8, 3584, 3072, 896, 16, 0, 1))), "moe_up_w8_d3584_i3072_e896_k16_s0_act1_q41");
  EXPECT_EQ(kernel_name(q4(moe_down(1, 3584, 3072, 896, 16, 0))), "moe_down_w1_d3584_i3072_e896_k16_s0_q41");
  EXPECT_EQ(kernel_name(ad(gemm(4, 3584, {7168}))), "gemm_w4_k3584_na7168_ad1");
  // Q4 = 0 and AD = 0, given or not, are the kernels of before.
  EXPECT_EQ(kernel_name(q4(moe_up(2, 2304, 1024, 256, 8, 1024), 0)), "moe_up_w2_d2304_i1024_e256_k8_s1024_act0");
  EXPECT_EQ(kernel_name(ad(gemm(4, 4096, {2304}), 0)), "gemm_w4_k4096_na2304");
  EXPECT_NE(generate_source(ad(gemm(4, 4096, {2304}), 0)).find("dp_gemm<4, 4096, 2304, 0, 0, 0, 0, 0, 0, 1, 8>(x, "
                                                               "out, w0);"),
            std::string::npos);
  EXPECT_EQ(kernel_signature(q4(moe_down(2, 2304, 1024, 256, 8, 1024), 0)).bytes,
            kernel_signature(moe_down(2, 2304, 1024, 256, 8, 1024)).bytes);
  EXPECT_NE(generate_source(q4(moe_down(2, 2304, 1024, 256, 8, 1024), 0)).find("dp_moe_down<2, 2304, 1024, 256, 8, "
                                                                              "1024, 16>(h, hs, w2, shared_down, "),
            std::string::npos);
}

TEST(Mxfp4Ops, RefuseWhatTheTemplatesCannotRead) {
  using test::expect_error;
  expect_error([] { kernel_name(q4(moe_up(1, 3584, 3072, 896, 16, 6144, 1))); }, Errc::input,
               {"S = 6144 with Q4 = 1", "no shared expert"});
  expect_error([] { kernel_name(q4(moe_up(1, 3592, 3072, 896, 16, 0, 1))); }, Errc::input,
               {"D = 3592 is not a multiple of 32"});
  expect_error([] { kernel_name(q4(moe_down(1, 3584, 3080, 896, 16, 0))); }, Errc::input,
               {"I = 3080 is not a multiple of 32"});
  KernelInstance both = q4(moe_up(1, 256, 128, 16, 4, 0));
  both.params["Q8"] = 1;
  expect_error([&] { kernel_name(both); }, Errc::input, {"Q4 = 1 and Q8 = 1"});
  expect_error([] { kernel_name(q4(moe_up(1, 256, 128, 16, 4, 0), 2)); }, Errc::input, {"Q4 = 2 is out of range"});
  expect_error([] { kernel_name(ad(gemm(1, 256, {16}, true))); }, Errc::input, {"AD = 1 and F = 1"});
}

TEST(Mxfp4Ops, ExpertSignaturesAndCalls) {
  const KernelInstance up = q4(moe_up(8, 3584, 3072, 896, 16, 0, 1));
  const KernelSignature s = kernel_signature(up);
  EXPECT_EQ(names(s), (std::vector<std::string>{"x", "w1", "w1_scale", "w3", "w3_scale", "experts", "expert_slots",
                                                "h", "stride_w1", "stride_w1_scale", "stride_w3", "stride_w3_scale",
                                                "act_beta", "act_linear_beta"}));
  EXPECT_EQ(s.params[1].c_type, "const dp_u8*");
  EXPECT_EQ(s.params[1].shape, "[896, stride_w1] u8");
  EXPECT_EQ(s.params[2].c_type, "const dp_u8*");
  EXPECT_EQ(s.params[2].shape, "[896, stride_w1_scale] u8");
  EXPECT_NE(s.params[1].doc.find("[3072, 1792] bytes"), std::string::npos) << s.params[1].doc;
  EXPECT_NE(s.params[2].doc.find("[3072, 112]"), std::string::npos) << s.params[2].doc;
  EXPECT_NE(s.params[8].doc.find("at least 5505024"), std::string::npos) << s.params[8].doc;  // 3072 * 1792
  EXPECT_NE(generate_source(up).find("dp_moe_up_q4<8, 3584, 3072, 896, 16, 0, 1, 1, 4, 1>(x, w1, w1_scale, w3, "
                                     "w3_scale, experts, expert_slots, h, stride_w1, stride_w1_scale, stride_w3, "
                                     "stride_w3_scale, act_beta, act_linear_beta);"),
            std::string::npos)
      << generate_source(up);
  // One row: warp tiles (tensor cores) like the other rows; a grid of at most 264 blocks.
  EXPECT_NE(generate_source(q4(moe_up(1, 3584, 3072, 896, 16, 0, 1))).find("dp_moe_up_q4<1, 3584, 3072, 896, 16, 0, "
                                                                          "1, 1, 4, 1>"),
            std::string::npos);
  EXPECT_EQ(launch_shape(q4(moe_up(1, 3584, 3072, 896, 16, 0, 1))).grid[0], 264u);  // 16 x 384 tiles
  EXPECT_EQ(launch_shape(q4(moe_up(8, 3584, 3072, 896, 16, 0, 1))).grid[0], 264u);

  const KernelInstance down = q4(moe_down(1, 3584, 3072, 896, 16, 0));
  EXPECT_EQ(names(kernel_signature(down)),
            (std::vector<std::string>{"h", "w2", "w2_scale", "experts", "expert_slots", "topk_weights", "out",
                                      "routed_scaling", "stride_w2", "stride_w2_scale"}));
  EXPECT_EQ(kernel_signature(down).params[1].shape, "[896, stride_w2] u8");
  // One row: 16-row tensor-core tiles, as for e4m3 (the bf16 form takes 4 rows of lane FMAs).
  EXPECT_EQ(launch_shape(down).grid[0], 3584u / 16);
  EXPECT_NE(generate_source(down).find("dp_moe_down_q4<1, 3584, 3072, 896, 16, 0, 16>(h, w2, w2_scale, experts, "
                                       "expert_slots, topk_weights, out, routed_scaling, stride_w2, "
                                       "stride_w2_scale);"),
            std::string::npos);
}

// The split grid (SK): G blocks share every tile's units; each tile's sums meet in `partials` (up to
// ceil(G / tiles) + 1 slots a tile) and its last block writes the rows.
KernelInstance split(KernelInstance k, int64_t g) {
  k.params["SK"] = g;
  return k;
}

TEST(Mxfp4Ops, DownSplitGridSignatureAndCall) {
  const KernelInstance k = split(q4(moe_down(8, 3584, 3072, 896, 16, 0)), 264);
  EXPECT_EQ(kernel_name(k), "moe_down_w8_d3584_i3072_e896_k16_s0_q41_sk264");
  const KernelSignature s = kernel_signature(k);
  EXPECT_EQ(names(s), (std::vector<std::string>{"h", "w2", "w2_scale", "experts", "expert_slots", "topk_weights",
                                                "out", "routed_scaling", "stride_w2", "stride_w2_scale", "partials",
                                                "done"}));
  EXPECT_EQ(s.params[10].shape, "[224, 3, 16, 8] fp32");  // 224 tiles, ceil(264 / 224) + 1 slots
  EXPECT_EQ(s.params[11].shape, "[224] u32");
  EXPECT_EQ(launch_shape(k).grid[0], 264u);
  EXPECT_NE(generate_source(k).find("dp_moe_down_q4_split<8, 3584, 3072, 896, 16, 0, 16, 264>(h, w2, w2_scale, "
                                    "experts, expert_slots, topk_weights, out, routed_scaling, stride_w2, "
                                    "stride_w2_scale, partials, done);"),
            std::string::npos)
      << generate_source(k);
  // Few tiles, many blocks: a tile's units spread over up to ceil(264 / 8) + 1 blocks.
  EXPECT_EQ(kernel_signature(split(q4(moe_down(1, 128, 128, 16, 4, 0)), 264)).params[10].shape,
            "[8, 34, 16, 1] fp32");
  // bf16 experts at one row take the lane-FMA loop (4 rows a block): no split grid there.
  test::expect_error([] { kernel_name(split(moe_down(1, 2304, 1024, 256, 8, 1024), 264)); }, Errc::input,
               {"parameter SK = 264 (the split grid) needs the tensor-core tiles", "W = 1"});
}

// The bf16 (from two rows) and e4m3 forms take the same split grid, with the shared expert's units first.
TEST(Mxfp4Ops, DownSplitGridOfTheBf16AndE4m3Experts) {
  const KernelInstance bf = split(moe_down(8, 2304, 1024, 256, 8, 1024), 264);
  EXPECT_EQ(kernel_name(bf), "moe_down_w8_d2304_i1024_e256_k8_s1024_sk264");
  const KernelSignature sb = kernel_signature(bf);
  EXPECT_EQ(names(sb), (std::vector<std::string>{"h", "hs", "w2", "shared_down", "experts", "expert_slots",
                                                 "topk_weights", "out", "routed_scaling", "stride_w2", "partials",
                                                 "done"}));
  EXPECT_EQ(sb.params[10].shape, "[144, 3, 16, 8] fp32");  // 144 tiles, ceil(264 / 144) + 1 slots
  EXPECT_EQ(launch_shape(bf).grid[0], 264u);
  EXPECT_NE(generate_source(bf).find("dp_moe_down_split<8, 2304, 1024, 256, 8, 1024, 16, 264>(h, hs, w2, "
                                     "shared_down, experts, expert_slots, topk_weights, out, routed_scaling, "
                                     "stride_w2, partials, done);"),
            std::string::npos)
      << generate_source(bf);
  const KernelInstance f8 = split(q8(moe_down(1, 2304, 1024, 256, 8, 1024)), 264);
  EXPECT_EQ(kernel_name(f8), "moe_down_w1_d2304_i1024_e256_k8_s1024_q81_sk264");
  const KernelSignature s8 = kernel_signature(f8);
  EXPECT_EQ(s8.params.back().name, "done");
  EXPECT_EQ(s8.params[s8.params.size() - 2].shape, "[144, 3, 16, 1] fp32");
  EXPECT_NE(generate_source(f8).find("dp_moe_down_q8_split<1, 2304, 1024, 256, 8, 1024, 16, 264>(h, hs, w2, "
                                     "w2_scale, shared_down, shared_down_scale, experts, expert_slots, topk_weights, "
                                     "out, routed_scaling, stride_w2, stride_w2_scale, partials, done);"),
            std::string::npos)
      << generate_source(f8);
  // The forms without SK keep their names and calls.
  EXPECT_EQ(kernel_name(q8(moe_down(1, 2304, 1024, 256, 8, 1024))), "moe_down_w1_d2304_i1024_e256_k8_s1024_q81");
}

TEST(Mxfp4Ops, GemmAddendSignatureAndCall) {
  const KernelInstance k = ad(gemm(4, 3584, {7168}));
  const KernelSignature s = kernel_signature(k);
  EXPECT_EQ(names(s), (std::vector<std::string>{"x", "out", "w0", "add"}));
  EXPECT_EQ(s.params[3].shape, "[4, 7168] bf16");
  EXPECT_FALSE(s.params[3].nullable);
  // 224 blocks of 32 rows (S = 4): one wave, where 16-row blocks would be 448.
  EXPECT_NE(generate_source(k).find("dp_gemm_add<4, 3584, 7168, 0, 0, 0, 0, 0, 0, 1, 4, 0>(x, out, w0, nullptr, "
                                    "nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, "
                                    "nullptr, add);"),
            std::string::npos)
      << generate_source(k);
}

std::vector<KernelInstance> compile_set(const std::string& t) {
  return {
      q4(moe_up(1, 128, 128, 16, 4, 0, 1, t)),
      q4(moe_up(8, 128, 128, 16, 4, 0, 1, t)),
      q4(moe_up(4, 3584, 3072, 896, 16, 0, 1, t)),
      q4(moe_up(16, 160, 96, 16, 4, 0, 0, t)),  // D with a partial 128-column chunk
      q4(moe_down(1, 128, 128, 16, 4, 0, t)),
      q4(moe_down(8, 3584, 3072, 896, 16, 0, t)),
      q4(moe_down(16, 136, 160, 16, 4, 0, t)),  // I with a partial chunk
      split(q4(moe_down(1, 3584, 3072, 896, 16, 0, t)), 264),
      split(q4(moe_down(8, 128, 128, 16, 4, 0, t)), 264),
      split(moe_down(8, 2304, 1024, 256, 8, 1024, t), 264),      // bf16, from two rows
      split(q8(moe_down(1, 2304, 1024, 256, 8, 1024, t)), 264),  // e4m3 at one row and at 8
      split(q8(moe_down(8, 2304, 1024, 256, 8, 1024, t)), 264),
      ad(gemm(1, 128, {256}, false, t)),
      ad(gemm(8, 3584, {7168}, false, t)),
  };
}

TEST(Mxfp4OpsCompile, EveryFormCompilesForSm90a) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  test_util::expect_compiles(compile_set("sm_90a"), "sm_90a");
}

TEST(Mxfp4OpsCompile, EveryFormCompilesForGfx942) {
  DP_SKIP_WITHOUT(backend::Vendor::amd);
  test_util::expect_compiles(compile_set("gfx942"), "gfx942");
}

}  // namespace
}  // namespace dp::codegen
