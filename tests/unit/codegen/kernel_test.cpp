// Kernel instances, whatever the op: names, parameter checks, parameter-block layout and generated
// sources (no toolchain needed); each op family's own rules are tested in ops/<family>_test.cpp.
#include "codegen/kernel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <set>
#include <sstream>

#include "codegen/ops/spec.h"
#include "codegen/templates.h"
#include "ops/instances.h"
#include "../test_util.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

TEST(KernelName, IsTheOpThenEveryParameterInTheOpsOrder) {
  EXPECT_EQ(kernel_name(rmsnorm(4, 2304)), "rmsnorm_w4_h2304");
  EXPECT_EQ(kernel_name(prefetch(32)), "prefetch_b32");
  // The target is not part of the symbol (one source for every target), but is part of the key.
  EXPECT_EQ(kernel_name(rmsnorm(4, 2304, "gfx942")), "rmsnorm_w4_h2304");
  EXPECT_EQ(instance_key(rmsnorm(4, 2304, "gfx942")), "rmsnorm_w4_h2304.gfx942");
  EXPECT_EQ(instance_key(rmsnorm(4, 2304)), "rmsnorm_w4_h2304.sm_90a");
}

TEST(KernelName, DoesNotDependOnHowTheParametersWereInserted) {
  KernelInstance a{"rmsnorm", {}, "sm_90a"};
  a.params["H"] = 2304;
  a.params["W"] = 4;
  KernelInstance b{"rmsnorm", {}, "sm_90a"};
  b.params["W"] = 4;
  b.params["H"] = 2304;
  EXPECT_EQ(kernel_name(a), kernel_name(b));
  EXPECT_EQ(generate_source(a), generate_source(b));
}

// templates/README.md gives each op's name letters their one meaning; every op and every letter of
// its name, in name order, must be in its row.
TEST(KernelName, EveryLetterIsExplainedInTheTemplatesReadme) {
  std::ifstream in(test::data_dir().parent_path() / "templates" / "README.md");
  std::stringstream text;
  text << in.rdbuf();
  std::vector<std::string> rows;
  for (std::string line; std::getline(text, line);)
    if (line.rfind("| `", 0) == 0) rows.push_back(line);
  for (auto family : {ops::norm_ops, ops::gemm_ops, ops::kda_ops, ops::moe_ops, ops::mla_ops, ops::indexer_ops,
                      ops::prefetch_ops, ops::attnres_ops})
    for (const ops::OpSpec& op : family()) {
      const std::string quoted = std::string("`") + op.name + "`";
      auto row = std::find_if(rows.begin(), rows.end(), [&](const std::string& r) {
        const size_t cell = r.find(" |", 2);
        return r.substr(0, cell).find(quoted) != std::string::npos;
      });
      ASSERT_NE(row, rows.end()) << op.name << " has no row in templates/README.md";
      size_t at = row->find(" |", 2);
      for (const ops::ParamSpec& ps : op.params) {
        at = row->find(std::string("`") + ps.prefix + "`", at);
        ASSERT_NE(at, std::string::npos)
            << op.name << ": letter " << ps.prefix << " missing or out of order in: " << *row;
      }
    }
}

TEST(KernelName, IsUniqueOverAPlausiblePlan) {
  std::set<std::string> names;
  size_t count = 0;
  for (int64_t w = 1; w <= 64; ++w)
    for (int64_t h : {8, 16, 24, 80, 800, 2304, 7168, 8000}) {
      names.insert(kernel_name(rmsnorm(w, h)));
      ++count;
    }
  for (int64_t b = 32; b <= 1024; b += 32) {
    names.insert(kernel_name(prefetch(b)));
    ++count;
  }
  EXPECT_EQ(names.size(), count);
  for (const std::string& n : names)
    EXPECT_EQ(n.find_first_not_of("abcdefghijklmnopqrstuvwxyz0123456789_"), std::string::npos) << n;
}

TEST(KernelInstanceCheck, RefusesWhatTheTemplatesCannotBuild) {
  using test::expect_error;
  expect_error([] { kernel_name({"softmax", {}, "sm_90a"}); }, Errc::input,
               {"unknown op \"softmax\"", "allreduce, attnres, gemm, idx_pack, idx_quant, idx_rows, idx_score, idx_stage, idx_topk, kda_step, "
                "mla_attn, mla_combine, mla_prep, mlp_up, moe_down, moe_route, moe_up, prefetch, rmsnorm"});
  expect_error([] { kernel_name({"rmsnorm", {{"W", 4}}, "sm_90a"}); }, Errc::input, {"missing parameter H"});
  expect_error([] { kernel_name(rmsnorm(0, 2304)); }, Errc::input, {"parameter W = 0 is out of range", "1..4096"});
  expect_error([] { kernel_name({"rmsnorm", {{"W", 4}, {"H", 2304}, {"Q", 1}}, "sm_90a"}); }, Errc::input,
               {"unknown parameter Q for op rmsnorm", "valid: W, H"});
  expect_error([] { instance_key(rmsnorm(4, 2304, "")); }, Errc::input, {"no target"});
  expect_error([] { instance_key(rmsnorm(4, 2304, "../x")); }, Errc::input, {"not a target name"});
  expect_error([] { validate_instance(rmsnorm(4, 12), "plan.json layer 3"); }, Errc::input,
               {"plan.json layer 3: kernel instance rmsnorm(H=12, W=4) for sm_90a"});
}

TEST(KernelSignature, LaysParametersOutLikeTheLaunchApis) {
  KernelSignature s = kernel_signature(rmsnorm(4, 2304));
  ASSERT_EQ(s.params.size(), 6u);
  const char* names[] = {"hidden", "residual", "weight", "out", "residual_out", "eps"};
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(s.params[i].name, names[i]);
    EXPECT_EQ(s.params[i].offset, 8 * i);
  }
  EXPECT_EQ(s.params[0].shape, "[4, 2304] bf16");
  EXPECT_EQ(s.params[2].shape, "[2304] bf16");
  EXPECT_TRUE(s.params[1].nullable);
  EXPECT_EQ(s.params[5].size, 4u);
  EXPECT_EQ(s.bytes, 44u);  // unpadded: what the code objects record
}

TEST(GenerateSource, HasTheBannerIncludesAndOneEntryPoint) {
  const std::string s = generate_source(rmsnorm(4, 2304));
  EXPECT_EQ(s.rfind("// generated by decodepack, do not edit.", 0), 0u) << s;
  EXPECT_NE(s.find("#include \"vendor.h\"\n#include \"norm.h\"\n"), std::string::npos) << s;
  EXPECT_NE(s.find("extern \"C\" __global__ DP_LAUNCH_BOUNDS(192) void rmsnorm_w4_h2304(\n"), std::string::npos) << s;
  EXPECT_NE(s.find("dp_add_rmsnorm<4, 2304, 192>(hidden, residual, weight, out, residual_out, eps);"),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("const dp_bf16* hidden,"), std::string::npos) << s;
  EXPECT_NE(s.find("// +0: [4, 2304] bf16"), std::string::npos) << s;
  EXPECT_NE(s.find("// +40: variance epsilon"), std::string::npos) << s;
  EXPECT_EQ(std::count(s.begin(), s.end(), '{'), 1) << "one function body";
  // One source for every target: the target never appears in it.
  EXPECT_EQ(s, generate_source(rmsnorm(4, 2304, "gfx942")));
  EXPECT_EQ(s.find("sm_90a"), std::string::npos);
}

TEST(TemplateSet, LoadsEveryHeaderOfTemplatesSorted) {
  TemplateSet t = TemplateSet::load(test::data_dir().parent_path() / "templates");
  ASSERT_GE(t.files().size(), 3u);
  for (size_t i = 1; i < t.files().size(); ++i) EXPECT_LT(t.files()[i - 1].name, t.files()[i].name);
  for (const char* h : {"vendor.h", "norm.h", "prefetch.h"}) EXPECT_NE(t.find(h), nullptr) << h;
  EXPECT_EQ(t.digest(), TemplateSet::load(test::data_dir().parent_path() / "templates").digest());
  EXPECT_EQ(t.digest().size(), 64u);
  // The build's default finds the same directory (developer build: the source tree).
  EXPECT_EQ(TemplateSet::load(TemplateSet::default_dir()).digest(), t.digest());
}

TEST(TemplateSet, NamesAMissingDirectoryAndTheWayToFixIt) {
  test::TempDir empty;
  test::expect_error([&] { TemplateSet::load(empty / "nope"); }, Errc::toolchain,
                     {"templates directory not found", "DECODEPACK_TEMPLATES_DIR"});
  test::expect_error([&] { TemplateSet::load(empty.path()); }, Errc::toolchain, {"no vendor.h"});
}

}  // namespace
}  // namespace dp::codegen
