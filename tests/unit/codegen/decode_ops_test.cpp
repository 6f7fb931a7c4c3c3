// The decode-layer ops (gemm, kda_step, moe_route, moe_up, moe_down, mlp_up): names, parameter checks,
// signatures, launch shapes, and a real compile of every op for sm_90a and gfx942 at the shapes of the
// tiny presets, Kimi-Linear-48B and Kimi-K3 (CPU only; correctness on a GPU is tests/gpu/kernels).
#include <gtest/gtest.h>

#include <algorithm>

#include "../backend/backend_test_util.h"
#include "backend/compile.h"
#include "codegen/kernel.h"
#include "compile_check.h"

namespace dp::codegen {
namespace {

using Params = std::map<std::string, int64_t>;

KernelInstance gemm(int64_t w, int64_t k, std::vector<int64_t> n, bool f32 = false, std::string target = "sm_90a") {
  KernelInstance i{"gemm", {{"W", w}, {"K", k}, {"F", f32 ? 1 : 0}}, std::move(target)};
  const char* keys[6] = {"NA", "NB", "NC", "ND", "NE", "NF"};
  for (size_t s = 0; s < 6; ++s) i.params[keys[s]] = s < n.size() ? n[s] : 0;
  return i;
}
KernelInstance kda(int64_t w, int64_t q, int64_t nh, int64_t gr = 128, bool k3 = false, std::string target = "sm_90a") {
  return {"kda_step",
          {{"W", w}, {"Q", q}, {"NH", nh}, {"D", 128}, {"CV", 4}, {"FR", 128}, {"GR", gr}, {"SG", k3}, {"ON", k3}},
          std::move(target)};
}
KernelInstance route(int64_t w, int64_t e, int64_t k, std::string target = "sm_90a") {
  return {"moe_route", {{"W", w}, {"E", e}, {"K", k}, {"RN", 1}}, std::move(target)};
}
KernelInstance moe_up(int64_t w, int64_t d, int64_t i, int64_t e, int64_t k, int64_t s, int64_t act = 0,
                      std::string target = "sm_90a") {
  return {"moe_up", {{"W", w}, {"D", d}, {"I", i}, {"E", e}, {"K", k}, {"S", s}, {"ACT", act}}, std::move(target)};
}
KernelInstance moe_down(int64_t w, int64_t d, int64_t i, int64_t e, int64_t k, int64_t s,
                        std::string target = "sm_90a") {
  return {"moe_down", {{"W", w}, {"D", d}, {"I", i}, {"E", e}, {"K", k}, {"S", s}}, std::move(target)};
}
KernelInstance mlp_up(int64_t w, int64_t d, int64_t i, int64_t act = 0, std::string target = "sm_90a") {
  return {"mlp_up", {{"W", w}, {"D", d}, {"I", i}, {"ACT", act}}, std::move(target)};
}
// MLA at Kimi shapes: L 512, R 64, PN 128, V 128, cache blocks of 64 tokens.
KernelInstance mla_prep(int64_t w, int64_t q, int64_t n, std::string target = "sm_90a") {
  return {"mla_prep",
          {{"W", w}, {"Q", q}, {"N", n}, {"L", 512}, {"R", 64}, {"PN", 128}, {"V", 128}, {"BS", 64}},
          std::move(target)};
}
KernelInstance mla_attn(int64_t w, int64_t q, int64_t n, int64_t ns = 16, std::string target = "sm_90a") {
  return {"mla_attn", {{"W", w}, {"Q", q}, {"N", n}, {"L", 512}, {"R", 64}, {"BS", 64}, {"NS", ns}}, std::move(target)};
}
KernelInstance mla_combine(int64_t w, int64_t q, int64_t n, int64_t og = 0, std::string target = "sm_90a") {
  return {"mla_combine",
          {{"W", w}, {"Q", q}, {"N", n}, {"L", 512}, {"PN", 128}, {"V", 128}, {"NS", 16}, {"OG", og}},
          std::move(target)};
}

TEST(DecodeOps, AreKnown) {
  const std::vector<std::string> ops = known_ops();
  for (const char* op : {"gemm", "kda_step", "mla_attn", "mla_combine", "mla_prep", "mlp_up", "moe_down", "moe_route",
                         "moe_up", "prefetch", "rmsnorm"})
    EXPECT_NE(std::find(ops.begin(), ops.end(), op), ops.end()) << op;
  EXPECT_TRUE(std::is_sorted(ops.begin(), ops.end()));
}

TEST(DecodeOps, NamesAtKimiLinear48bShapes) {
  // The KDA projections stacked in one launch: q, k, v, f_a, g_a, b.
  EXPECT_EQ(kernel_name(gemm(4, 2304, {4096, 4096, 4096, 128, 128, 32})),
            "gemm_w4_k2304_na4096_nb4096_nc4096_nd128_ne128_nf32");
  EXPECT_EQ(kernel_name(gemm(4, 4096, {2304})), "gemm_w4_k4096_na2304");         // o_proj
  EXPECT_EQ(kernel_name(gemm(4, 2304, {256}, true)), "gemm_w4_k2304_na256_f1");  // router logits
  EXPECT_EQ(kernel_name(kda(4, 1, 32)), "kda_step_w4_q1_nh32_d128_cv4_fr128_gr128_sg0_on0");
  EXPECT_EQ(kernel_name(kda(4, 2, 96, 0, true)), "kda_step_w4_q2_nh96_d128_cv4_fr128_gr0_sg1_on1");
  EXPECT_EQ(kernel_name(route(8, 256, 8)), "moe_route_w8_e256_k8_rn1");
  EXPECT_EQ(kernel_name(moe_up(4, 2304, 1024, 256, 8, 1024)), "moe_up_w4_d2304_i1024_e256_k8_s1024_act0");
  EXPECT_EQ(kernel_name(moe_down(4, 2304, 1024, 256, 8, 1024)), "moe_down_w4_d2304_i1024_e256_k8_s1024");
  EXPECT_EQ(kernel_name(mlp_up(4, 2304, 9216)), "mlp_up_w4_d2304_i9216_act0");
  EXPECT_EQ(kernel_name(mla_prep(4, 1, 32)), "mla_prep_w4_q1_n32_l512_r64_pn128_v128_bs64");
  EXPECT_EQ(kernel_name(mla_attn(4, 2, 32)), "mla_attn_w4_q2_n32_l512_r64_bs64_ns16");
  EXPECT_EQ(kernel_name(mla_combine(4, 1, 96, 1)), "mla_combine_w4_q1_n96_l512_pn128_v128_ns16_og1");
  // Omitted zeros never make two instances share a name.
  EXPECT_NE(kernel_name(gemm(4, 2304, {256}, true)), kernel_name(gemm(4, 2304, {256}, false)));
  EXPECT_NE(kernel_name(gemm(4, 2304, {256, 8})), kernel_name(gemm(4, 2304, {2568})));
}

TEST(DecodeOps, RefuseShapesTheTemplatesCannotBuild) {
  using test::expect_error;
  expect_error(
      [] {
        kernel_name(gemm(4, 2304, {256, 0, 32}));
      },
      Errc::input, {"parameter NC = 32 follows NB = 0", "absent weights must be the last"});
  expect_error([] { kernel_name(gemm(4, 2300, {256})); }, Errc::input, {"K = 2300 is not a multiple of 8"});
  expect_error([] { kernel_name(gemm(33, 2304, {256})); }, Errc::input, {"parameter W = 33 is out of range", "1..32"});
  expect_error([] { kernel_name(gemm(4, 2304, {0})); }, Errc::input, {"parameter NA = 0 is out of range"});
  KernelInstance k = kda(1, 1, 32);
  k.params["D"] = 96;
  expect_error([&] { kernel_name(k); }, Errc::input, {"D = 96 is not a multiple of 64"});
  k = kda(1, 1, 32, 100);
  expect_error([&] { kernel_name(k); }, Errc::input, {"GR = 100 is not a multiple of 8"});
  expect_error([] { kernel_name(route(1, 4, 8)); }, Errc::input, {"K = 8 (top-k) exceeds E = 4"});
  expect_error([] { kernel_name(moe_up(4, 2304, 1020, 256, 8, 1024)); }, Errc::input,
               {"I = 1020 is not a multiple of 8"});
  expect_error([] { kernel_name(moe_down(4, 2304, 1024, 256, 8, 1028)); }, Errc::input,
               {"S = 1028 is not a multiple of 8"});
  expect_error([] { kernel_name(mla_prep(8, 8, 32)); }, Errc::input, {"W x Q = 64 rows exceed 32"});
  KernelInstance wide = mla_attn(1, 1, 32);
  wide.params["L"] = 1024;
  wide.params["R"] = 256;
  expect_error([&] { kernel_name(wide); }, Errc::input, {"too wide for the attention tile"});
}

TEST(DecodeOps, SignaturesListOnlyThePresentWeights) {
  KernelSignature s = kernel_signature(gemm(4, 2304, {4096, 4096, 4096}));
  ASSERT_EQ(s.params.size(), 5u);
  const char* names[] = {"x", "out", "w0", "w1", "w2"};
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(s.params[i].name, names[i]);
    EXPECT_EQ(s.params[i].offset, 8 * i);
  }
  EXPECT_EQ(s.params[1].shape, "[4, 12288] bf16");
  EXPECT_EQ(s.params[4].shape, "[4096, 2304] bf16");
  EXPECT_EQ(kernel_signature(gemm(2, 2304, {256}, true)).params[1].shape, "[2, 256] fp32");

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
  const KernelSignature r = kernel_signature(route(8, 256, 8));
  EXPECT_EQ(r.params[4].shape, "[65] i32");  // 1 + min(E, W*K)
  EXPECT_EQ(r.params[5].shape, "[64, 8] i32");
  EXPECT_EQ(kernel_signature(route(1, 256, 8)).params[4].shape, "[9] i32");
}

TEST(DecodeOps, LaunchShapes) {
  // o_proj: 2304 rows; blocks of one 16-row tile (the least), split-K over the 8 groups.
  LaunchShape o = launch_shape(gemm(4, 4096, {2304}));
  EXPECT_EQ(o.block[0], 256u);
  EXPECT_EQ(o.grid[0], 144u);
  // Router: 256 rows -> 16-row blocks, split-K over the 8 groups.
  EXPECT_EQ(launch_shape(gemm(1, 2304, {256}, true)).grid[0], 16u);
  // Stacked KDA projections: every segment gets whole tiles of its own.
  LaunchShape p = launch_shape(gemm(1, 2304, {4096, 4096, 4096, 128, 128, 32}));
  EXPECT_EQ(p.grid[0], 3u * 128u + 4u + 4u + 1u);  // 32 rows per block (2 slots, 4 K-slices)
  // Tall matrices: 128 rows per block (8 slots of one tile), no split-K.
  EXPECT_EQ(launch_shape(gemm(1, 2304, {163840})).grid[0], 1280u);
  LaunchShape k = launch_shape(kda(4, 2, 32));
  EXPECT_EQ(k.grid[0], 32u);
  EXPECT_EQ(k.grid[1], 4u);
  EXPECT_EQ(k.block[0], 512u);
  EXPECT_EQ(launch_shape(route(4, 256, 8)).grid[0], 1u);
  // moe_up, one row: shared tiles + min(E, W*K) experts' tiles, 16 features per block.
  EXPECT_EQ(launch_shape(moe_up(1, 2304, 1024, 256, 8, 1024)).grid[0], 64u + 8u * 64u);
  // From 2 rows: warp tiles of 8 features walked with a grid stride; blocks of 8 warps for the most
  // tiles a step can have (no shared expert, 16 experts x 32 tiles of I = 256 at width 2), at most 264.
  EXPECT_EQ(launch_shape(moe_up(2, 2304, 256, 256, 8, 0)).grid[0], 16u * 32u / 8u);
  EXPECT_EQ(launch_shape(moe_up(2, 2304, 1024, 256, 8, 1024)).grid[0], 264u);  // 272 capped
  EXPECT_EQ(launch_shape(moe_up(64 / 4, 2304, 1024, 256, 8, 1024)).grid[0], 264u);
  // moe_down: M output features per block, the items spread over its groups (M = 4 for one row, then
  // a 16-row tensor-core tile).
  EXPECT_EQ(launch_shape(moe_down(1, 2304, 1024, 256, 8, 1024)).grid[0], 576u);
  EXPECT_EQ(launch_shape(moe_down(4, 2304, 1024, 256, 8, 1024)).grid[0], 144u);
  EXPECT_EQ(launch_shape(moe_down(8, 2304, 1024, 256, 8, 1024)).grid[0], 144u);
  EXPECT_EQ(launch_shape(moe_down(16, 2304, 1024, 256, 8, 1024)).grid[0], 144u);
  EXPECT_EQ(launch_shape(mlp_up(4, 2304, 9216)).grid[0], 576u);
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
  const std::string src = generate_source(kda(4, 2, 32));
  EXPECT_NE(src.find("grid 32 x 4 x 1 blocks"), std::string::npos) << src;
  EXPECT_NE(src.find("dp_kda_step<4, 2, 32, 128, 4, 128, 128, 0, 0>(proj, w_fb,"), std::string::npos) << src;
  EXPECT_NE(src.find("onorm_eps, state_stride, conv_stride);"), std::string::npos) << src;
  const std::string prep_src = generate_source(mla_prep(4, 2, 32));
  EXPECT_NE(prep_src.find("dp_mla_prep<8, 2, 32, 512, 64, 128, 128, 64>("), std::string::npos) << prep_src;
  const std::string g = generate_source(gemm(4, 4096, {2304}));
  EXPECT_NE(g.find("dp_gemm<4, 4096, 2304, 0, 0, 0, 0, 0, 0, 1, 8>(x, out, w0);"), std::string::npos) << g;
  EXPECT_NE(g.find("DP_GRID_DEPENDENCY_ENTRY();"), std::string::npos) << g;
  EXPECT_NE(src.find("DP_GRID_DEPENDENCY_ENTRY();"), std::string::npos) << src;
}

// One real compile per target of every op at the shapes the presets and the big models use.
std::vector<KernelInstance> compile_set(const std::string& t) {
  return {
      // Kimi-Linear tiny preset (hidden 256, 2 KDA heads, 16 experts top-4, I 128, shared 128, dense 512).
      gemm(1, 256, {256, 256, 256, 128, 128, 2}, false, t),
      gemm(2, 256, {256}, false, t),
      gemm(2, 256, {16}, true, t),
      kda(1, 1, 2, 128, false, t),
      kda(8, 2, 2, 128, false, t),
      route(16, 16, 4, t),
      moe_up(16, 256, 128, 16, 4, 128, 0, t),
      moe_down(16, 256, 128, 16, 4, 128, t),
      mlp_up(2, 256, 512, 0, t),
      // Kimi-Linear-48B at width 8, q 2 (16 rows).
      gemm(16, 2304, {4096, 4096, 4096, 128, 128, 32}, false, t),
      gemm(16, 4096, {2304}, false, t),
      kda(8, 2, 32, 128, false, t),
      route(16, 256, 8, t),
      moe_up(16, 2304, 1024, 256, 8, 1024, 0, t),
      moe_down(16, 2304, 1024, 256, 8, 1024, t),
      // Kimi-K3 shapes (full-rank gate, safe gate, fp32 o_norm, SiTU, 896 experts top-16).
      kda(2, 1, 96, 0, true, t),
      route(8, 896, 16, t),
      mlp_up(1, 7168, 33792, 1, t),
      // MLA (Kimi-Linear 32 heads, tiny 2 heads, K3 96 heads with the output gate).
      mla_prep(1, 1, 2, t),
      mla_attn(1, 1, 2, 4, t),
      mla_combine(1, 1, 2, 0, t),
      mla_prep(8, 2, 32, t),
      mla_attn(8, 2, 32, 16, t),
      mla_combine(8, 2, 32, 0, t),
      mla_combine(4, 1, 96, 1, t),
  };
}

void expect_compiles(const std::string& target) { test_util::expect_compiles(compile_set(target), target); }

TEST(DecodeOpsCompile, EveryOpCompilesForSm90a) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  expect_compiles("sm_90a");
}

TEST(DecodeOpsCompile, EveryOpCompilesForGfx942) {
  DP_SKIP_WITHOUT(backend::Vendor::amd);
  expect_compiles("gfx942");
}

}  // namespace
}  // namespace dp::codegen
