// The FP4 sparse-attention indexer prefill ops (templates/indexer.h, compiler/codegen/ops/indexer.cpp):
// names, parameter checks, parameter blocks, launch shapes, generated sources, and a real compile for
// sm_90a and gfx942 (CPU only; the numbers on a GPU are tests/gpu/indexer).
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <sstream>

#include "../../backend/backend_test_util.h"
#include "backend/compile.h"
#include "codegen/kernel.h"
#include "../compile_check.h"

namespace dp::codegen {
namespace {

KernelInstance idx(std::string op, std::map<std::string, int64_t> params = {}, std::string target = "sm_90a") {
  return {std::move(op), std::move(params), std::move(target)};
}
KernelInstance score(int64_t nh, std::string target = "sm_90a") { return idx("idx_score", {{"NH", nh}}, std::move(target)); }
KernelInstance topk(int64_t k, std::string target = "sm_90a") { return idx("idx_topk", {{"K", k}}, std::move(target)); }

// The six ops as the plan builds them for kimi-k3-tiny-indexer (8 index heads, top-k 2048).
std::vector<KernelInstance> tiny_set(const std::string& target) {
  return {idx("idx_quant", {}, target), idx("idx_pack", {}, target), idx("idx_stage", {}, target), score(8, target),
          topk(2048, target), idx("idx_rows", {}, target)};
}

// The parameter names of `fn`'s definition in templates/indexer.h, in order (comments stripped; the
// last identifier of each comma-separated declaration).
std::vector<std::string> template_params(const std::string& fn) {
  std::ifstream in(test::data_dir().parent_path() / "templates" / "indexer.h");
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const std::string head = " " + fn + "(";
  const size_t at = text.find(head);
  if (at == std::string::npos) return {};
  std::string decl;
  for (size_t i = at + head.size(); i < text.size() && text[i] != ')'; ++i) {
    if (text.compare(i, 2, "//") == 0) {
      i = text.find('\n', i);
      if (i == std::string::npos) break;
      continue;
    }
    decl += text[i];
  }
  std::vector<std::string> names;
  std::stringstream parts(decl);
  std::string part;
  while (std::getline(parts, part, ',')) {
    size_t end = part.size();
    while (end > 0 && !(std::isalnum(static_cast<unsigned char>(part[end - 1])) || part[end - 1] == '_')) --end;
    size_t begin = end;
    while (begin > 0 && (std::isalnum(static_cast<unsigned char>(part[begin - 1])) || part[begin - 1] == '_')) --begin;
    names.push_back(part.substr(begin, end - begin));
  }
  return names;
}

TEST(IndexerOps, AreKnown) {
  const std::vector<std::string> ops = known_ops();
  for (const char* op : {"idx_pack", "idx_quant", "idx_rows", "idx_score", "idx_stage", "idx_topk"})
    EXPECT_NE(std::find(ops.begin(), ops.end(), op), ops.end()) << op;
  EXPECT_TRUE(std::is_sorted(ops.begin(), ops.end()));
}

TEST(IndexerOps, Names) {
  // Parameterless ops are the op name; the others carry every compile-time parameter.
  EXPECT_EQ(kernel_name(idx("idx_quant")), "idx_quant");
  EXPECT_EQ(kernel_name(idx("idx_pack")), "idx_pack");
  EXPECT_EQ(kernel_name(idx("idx_stage")), "idx_stage");
  EXPECT_EQ(kernel_name(idx("idx_rows")), "idx_rows");
  EXPECT_EQ(kernel_name(score(8)), "idx_score_nh8");
  EXPECT_EQ(kernel_name(score(64)), "idx_score_nh64");
  EXPECT_EQ(kernel_name(topk(2048)), "idx_topk_k2048");
  EXPECT_EQ(kernel_name(topk(1)), "idx_topk_k1");
  EXPECT_EQ(kernel_name(topk(4096)), "idx_topk_k4096");
  EXPECT_EQ(instance_key(topk(2048, "gfx942")), "idx_topk_k2048.gfx942");
  EXPECT_EQ(instance_key(idx("idx_quant", {}, "sm_90a")), "idx_quant.sm_90a");
}

TEST(IndexerOps, RefuseWhatTheTemplatesCannotBuild) {
  using test::expect_error;
  // NH: a multiple of 8 (8 head groups per scoring block), at most 64.
  expect_error([] { kernel_name(score(72)); }, Errc::input, {"parameter NH = 72 is out of range", "8..64"});
  expect_error([] { kernel_name(score(12)); }, Errc::input, {"parameter NH = 12 is not a multiple of 8"});
  expect_error([] { kernel_name(score(0)); }, Errc::input, {"parameter NH = 0 is out of range"});
  expect_error([] { kernel_name(idx("idx_score")); }, Errc::input, {"missing parameter NH"});
  // K: 1..4096 (the top-k kernel's shared sort buffer).
  expect_error([] { kernel_name(topk(4097)); }, Errc::input, {"parameter K = 4097 is out of range", "1..4096"});
  expect_error([] { kernel_name(topk(0)); }, Errc::input, {"parameter K = 0 is out of range"});
  expect_error([] { kernel_name(idx("idx_topk", {{"NH", 8}, {"K", 8}})); }, Errc::input,
               {"unknown parameter NH for op idx_topk", "valid: K"});
  expect_error([] { kernel_name(idx("idx_quant", {{"W", 1}})); }, Errc::input, {"unknown parameter W for op idx_quant"});
  expect_error([] { validate_instance(score(12, "gfx942"), "plan"); }, Errc::input,
               {"plan: kernel instance idx_score(NH=12) for gfx942"});
}

TEST(IndexerOps, TopkParameterBlock) {
  // logits, row_position, out: pointers at 0, 8, 16; row_begin, tile_rows, valid_rows, L: u32 at 24..36.
  const KernelSignature s = kernel_signature(topk(2048));
  ASSERT_EQ(s.params.size(), 7u);
  const char* names[] = {"logits", "row_position", "out", "row_begin", "tile_rows", "valid_rows", "L"};
  const uint32_t offsets[] = {0, 8, 16, 24, 28, 32, 36};
  for (size_t i = 0; i < 7; ++i) {
    SCOPED_TRACE(names[i]);
    EXPECT_EQ(s.params[i].name, names[i]);
    EXPECT_EQ(s.params[i].offset, offsets[i]);
    EXPECT_EQ(s.params[i].kind, i < 3 ? KernelParam::Kind::pointer : KernelParam::Kind::u32);
    EXPECT_EQ(s.params[i].size, i < 3 ? 8u : 4u);
    EXPECT_FALSE(s.params[i].nullable);
  }
  EXPECT_EQ(s.bytes, 40u);
  EXPECT_EQ(s.params[2].shape, "[tile_rows, 2048] i32");
  EXPECT_EQ(kernel_signature(topk(7)).params[2].shape, "[tile_rows, 7] i32");
}

TEST(IndexerOps, ParameterBlocksFollowTheDeviceTemplates) {
  // Every op: pointers first (8 bytes each), then 4-byte scalars, so the block has no padding:
  // bytes = 8 x pointers + 4 x scalars. The entry point passes its parameters positionally, so their
  // names and order are those of the device template's definition.
  struct Want {
    KernelInstance k;
    const char* fn;
    size_t pointers, scalars;
  };
  const Want wants[] = {
      {idx("idx_quant"), "dp_idx_quant", 3, 5},  // 44 bytes
      {idx("idx_pack"), "dp_idx_pack", 4, 7},    // 60
      {idx("idx_stage"), "dp_idx_stage", 5, 5},  // 60
      {score(8), "dp_idx_score", 8, 4},          // 80: weight_scale is the f32 at 76
      {topk(2048), "dp_idx_topk", 3, 4},         // 40
      {idx("idx_rows"), "dp_idx_rows", 3, 2},    // 32
  };
  for (const Want& w : wants) {
    SCOPED_TRACE(w.fn);
    const KernelSignature s = kernel_signature(w.k);
    ASSERT_EQ(s.params.size(), w.pointers + w.scalars);
    EXPECT_EQ(s.bytes, 8 * w.pointers + 4 * w.scalars);
    uint32_t at = 0;
    for (size_t i = 0; i < s.params.size(); ++i) {
      const KernelParam& p = s.params[i];
      EXPECT_EQ(p.kind == KernelParam::Kind::pointer, i < w.pointers) << p.name;
      EXPECT_EQ(p.offset, at) << p.name;
      at += p.size;
    }
    std::vector<std::string> names;
    for (const KernelParam& p : s.params) names.push_back(p.name);
    EXPECT_EQ(names, template_params(w.fn));
  }
  const KernelSignature sc = kernel_signature(score(8));
  EXPECT_EQ(sc.params.back().name, "weight_scale");
  EXPECT_EQ(sc.params.back().kind, KernelParam::Kind::f32);
  EXPECT_EQ(sc.params.back().offset, 76u);
  EXPECT_EQ(sc.params[0].shape, "[rows, 8, 128] bf16");
  EXPECT_EQ(kernel_signature(score(64)).params[1].shape, "[rows, 64] fp32");
}

TEST(IndexerOps, LaunchShapesAndSources) {
  // Fixed blocks (the templates' thread counts: 256, and 512 for top-k), grids chosen at run time.
  for (const KernelInstance& k : tiny_set("sm_90a")) {
    SCOPED_TRACE(k.op);
    const LaunchShape l = launch_shape(k);
    EXPECT_EQ(l.block[0], k.op == "idx_topk" ? 512u : 256u);
    EXPECT_EQ(l.block[1], 1u);
    EXPECT_TRUE(l.grid_is_default);
    EXPECT_EQ(op_header(k), "indexer.h");
    const std::string src = generate_source(k);
    EXPECT_NE(src.find("#include \"vendor.h\"\n#include \"indexer.h\"\n"), std::string::npos) << src;
    EXPECT_NE(src.find("DP_LAUNCH_BOUNDS(" + std::to_string(l.block[0]) + ") void " + kernel_name(k) + "(\n"),
              std::string::npos)
        << src;
    EXPECT_EQ(src, generate_source(KernelInstance{k.op, k.params, "gfx942"}));  // one source for every target
  }
  // The block-size template argument of the parameterless ops is the block they are compiled for.
  EXPECT_NE(generate_source(idx("idx_quant")).find("dp_idx_quant<256>(keys, slots, cache, count, num_blocks, "
                                                   "block_size, block_stride, layout);"),
            std::string::npos);
  EXPECT_NE(generate_source(idx("idx_rows")).find("dp_idx_rows<256>(src, map, out, rows, k);"), std::string::npos);
  EXPECT_NE(generate_source(score(16)).find("dp_idx_score<16>(q, w, payload, scales, cu, row_request, row_position, "
                                            "logits, row_begin, tile_rows, L, weight_scale);"),
            std::string::npos);
  EXPECT_NE(generate_source(topk(2048)).find("dp_idx_topk<2048>(logits, row_position, out, row_begin, tile_rows, "
                                             "valid_rows, L);"),
            std::string::npos);
}

// A real compile of every op at the tiny preset's shapes and at the limits (NH 64, K 1 and 4096).
void expect_compiles(const std::string& target) {
  std::vector<KernelInstance> set = tiny_set(target);
  set.push_back(score(64, target));
  set.push_back(topk(1, target));
  set.push_back(topk(4096, target));
  test_util::expect_compiles(set, target);
}

TEST(IndexerOpsCompile, EveryOpCompilesForSm90a) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  expect_compiles("sm_90a");
}

TEST(IndexerOpsCompile, EveryOpCompilesForGfx942) {
  DP_SKIP_WITHOUT(backend::Vendor::amd);
  expect_compiles("gfx942");
}

}  // namespace
}  // namespace dp::codegen
