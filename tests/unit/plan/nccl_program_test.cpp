// The NCCL all-reduce path, chosen per width at build time: the deploy's `allreduce` (values, defaults,
// the canonical form that keeps existing bundles' bytes), the layer programs' nccl_allreduce steps in
// place of the allreduce kernel at NCCL widths (same buffers, nothing compiled for them), and the
// manifest's collective steps (format 1.8 only where used, and the validator's rules).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common/error.h"
#include "common/json.h"
#include "deploy/deploy.h"
#include "format/manifest.h"
#include "format/sections.h"
#include "model/ir.h"
#include "../deploy/deploy_errors.h"
#include "plan/plan.h"

namespace dp::plan {
namespace {
using dp::test::deploy_error_of;

Json deploy_json(const Json& patch = Json::object()) {
  Json j = {{"targets", {"sm_90a"}}, {"tensor_parallel", 2}, {"max_num_seqs", 4}};
  j.merge_patch(patch);
  return j;
}
deploy::Deploy parse(const Json& j) { return deploy::parse_deploy(j, "deploy.json"); }

TEST(DeployAllreduce, DefaultIsInKernelEverywhereAndLeavesTheCanonicalFormAlone) {
  const deploy::Deploy d = parse(deploy_json());
  EXPECT_TRUE(d.allreduce_nccl.empty());
  for (int64_t w : d.widths) EXPECT_EQ(d.allreduce(w), format::Allreduce::in_kernel);
  EXPECT_FALSE(deploy::to_json(d).contains("allreduce"));
  // An explicit in_kernel is the default, byte for byte.
  EXPECT_EQ(deploy::to_json(parse(deploy_json({{"allreduce", "in_kernel"}}))).dump(), deploy::to_json(d).dump());
  EXPECT_EQ(deploy::to_json(parse(deploy_json({{"allreduce", {{"2", "in_kernel"}}}}))).dump(), deploy::to_json(d).dump());
}

TEST(DeployAllreduce, NcclForEveryWidthOrPerWidth) {
  const deploy::Deploy all = parse(deploy_json({{"allreduce", "nccl"}}));
  EXPECT_EQ(all.allreduce_nccl, (std::vector<int64_t>{1, 2, 3, 4}));
  const deploy::Deploy some = parse(deploy_json({{"allreduce", {{"4", "nccl"}, {"1", "in_kernel"}, {"2", "nccl"}}}}));
  EXPECT_EQ(some.allreduce_nccl, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(some.allreduce(2), format::Allreduce::nccl);
  EXPECT_EQ(some.allreduce(3), format::Allreduce::in_kernel);
  // Canonical: only the NCCL widths, read back to the same Deploy by the runtime's reader.
  const Json c = deploy::to_json(some);
  EXPECT_EQ(c["allreduce"], Json({{"2", "nccl"}, {"4", "nccl"}}));
  EXPECT_EQ(format::deploy_from_json(c, "m.json"), some);
  EXPECT_EQ(parse(c), some);  // and by the deploy file's reader
  // At tensor_parallel 1 nothing all-reduces: accepted, not recorded.
  EXPECT_TRUE(parse(deploy_json({{"tensor_parallel", 1}, {"allreduce", "nccl"}})).allreduce_nccl.empty());
}

TEST(DeployAllreduce, BadValuesAreNamed) {
  EXPECT_MSG(deploy_json({{"allreduce", "ncll"}}), "allreduce is \"ncll\", expected \"in_kernel\" or \"nccl\"");
  EXPECT_MSG(deploy_json({{"allreduce", 1}}), "allreduce is 1, expected \"in_kernel\" or \"nccl\" (for every width)");
  EXPECT_MSG(deploy_json({{"allreduce", {{"2", "fast"}}}}), "allreduce.2 is \"fast\", expected \"in_kernel\" or \"nccl\"");
  EXPECT_MSG(deploy_json({{"allreduce", {{"9", "nccl"}}}}), "allreduce.9 names width 9, which is not built (valid: 1..4)");
  EXPECT_MSG(deploy_json({{"allreduce", {{"two", "nccl"}}}}), "allreduce key \"two\" is not a width");
  EXPECT_MSG(deploy_json({{"allreduce", Json::object()}}), "allreduce is an empty object");
  EXPECT_MSG(deploy_json({{"allreduse", "nccl"}}), "did you mean allreduce?");
  // The manifest's reader: widths outside the deploy's, or at tensor_parallel 1.
  Json c = deploy::to_json(parse(deploy_json()));
  c["allreduce"] = {{"5", "nccl"}};
  EXPECT_THROW(format::deploy_from_json(c, "m.json"), format::FormatError);
  c["allreduce"] = {{"1", "in_kernel"}};
  EXPECT_THROW(format::deploy_from_json(c, "m.json"), format::FormatError);
  c["allreduce"] = {{"1", "nccl"}};
  c["tensor_parallel"] = 1;
  c["ranks"] = {0};
  EXPECT_THROW(format::deploy_from_json(c, "m.json"), format::FormatError);
}

const ProgramArg& arg(const ProgramStep& s, const std::string& name) {
  for (const ProgramArg& a : s.args)
    if (a.param == name) return a;
  throw std::runtime_error(s.name + ": no arg " + name);
}

// At an NCCL width each allreduce step becomes an nccl_allreduce step over the same buffers (the
// partial it sums, the output it writes) and the kernels around it are unchanged; in-kernel widths keep
// the allreduce kernel; no allreduce kernel is compiled for a width that does not launch it.
TEST(NcclPrograms, NcclWidthsSumTheSameBuffersBetweenKernels) {
  const model::Model m = model::load_model("kimi-linear-48b-a3b");
  const Plan in_kernel = make_plan(m, parse(deploy_json()), "deploy.json");
  const Plan mixed = make_plan(m, parse(deploy_json({{"allreduce", {{"2", "nccl"}, {"4", "nccl"}}}})), "deploy.json");
  ASSERT_EQ(in_kernel.programs.size(), mixed.programs.size());
  for (size_t i = 0; i < mixed.programs.size(); ++i) {
    const LayerProgram &a = in_kernel.programs[i], &b = mixed.programs[i];
    SCOPED_TRACE(fmt::format("{} w{}", to_string(b.cls), b.width));
    ASSERT_EQ(a.steps.size(), b.steps.size());
    EXPECT_EQ(a.workspace, b.workspace);
    const bool nccl = b.width == 2 || b.width == 4;
    int collectives = 0;
    for (size_t k = 0; k < b.steps.size(); ++k) {
      const ProgramStep &x = a.steps[k], &y = b.steps[k];
      if (x.kernel.op != "allreduce" || !nccl) {
        EXPECT_EQ(y.name, x.name);
        EXPECT_TRUE(y.collective.empty());
        continue;
      }
      ++collectives;
      EXPECT_EQ(y.collective, "nccl_allreduce");
      EXPECT_EQ(y.name, "nccl_allreduce");
      EXPECT_EQ(y.elements, static_cast<uint64_t>(x.kernel.params.at("W") * x.kernel.params.at("H")));
      EXPECT_EQ(y.elements, static_cast<uint64_t>(b.width * 2304));
      ASSERT_EQ(y.args.size(), 2u);
      EXPECT_EQ(y.args[0].param, "send");
      EXPECT_EQ(y.args[1].param, "recv");
      EXPECT_EQ(y.args[0].from, arg(x, "partial").from);
      EXPECT_EQ(y.args[0].offset, arg(x, "partial").offset);
      EXPECT_EQ(y.args[1].from, arg(x, "out").from);
      EXPECT_EQ(y.args[1].name, arg(x, "out").name);
      EXPECT_EQ(y.args[1].offset, arg(x, "out").offset);
    }
    EXPECT_EQ(collectives, nccl ? 2 : 0);  // after the o-projection and after the FFN
  }
  std::vector<std::string> reduce_kernels;
  for (const KernelInstance& k : mixed.kernels)
    if (k.op == "allreduce") reduce_kernels.push_back(k.name);
  EXPECT_EQ(reduce_kernels, (std::vector<std::string>{"allreduce_w1_h2304_r2", "allreduce_w3_h2304_r2"}));
  for (const KernelInstance& k : mixed.kernels) EXPECT_NE(k.op, "nccl_allreduce");
}

// A minimal manifest with one program at width 1 whose one step is `st`.
format::Manifest manifest_with(const format::ProgramStepEntry& st, const Json& nccl_widths) {
  format::Manifest m;
  m.model.config_digest = "sha256:" + std::string(64, '0');
  m.model.num_layers = 1;
  m.deploy = {{"targets", {"sm_90a"}}, {"tensor_parallel", 2}, {"widths", {1}}};
  if (!nccl_widths.is_null())
    for (const Json& w : nccl_widths) m.deploy["allreduce"][std::to_string(w.get<int>())] = "nccl";
  m.layers.push_back({0, "kda", "moe", "kda_moe"});
  m.workspace.push_back({1, 8192});
  format::ProgramEntry p;
  p.cls = "kda_moe";
  p.width = 1;
  p.steps.push_back(st);
  m.programs.push_back(p);
  return m;
}

format::ProgramStepEntry nccl_step() {
  format::ProgramStepEntry st;
  st.collective = "nccl_allreduce";
  st.elements = 2304;
  st.args = {{"send", "workspace", "", 0, 0}, {"recv", "io", "out", 0, 0}};
  return st;
}

// The problems validate() reports for the programs (the rest of the minimal manifest is not ours).
std::string program_problems(format::Manifest m) {
  m.format_version.minor = format::written_minor(m);
  try {
    format::validate(m, "m.json");
  } catch (const format::FormatError& e) {
    return e.what();
  }
  return {};
}

TEST(NcclManifest, CollectiveStepsAreFormat18AndRoundTrip) {
  format::Manifest m = manifest_with(nccl_step(), Json::array({1}));
  EXPECT_EQ(format::written_minor(m), 8);
  EXPECT_EQ(format::kFormatMinor, 9);
  m.format_version.minor = 8;
  const Json j = format::to_json(m);
  const Json& step = j["programs"][0]["steps"][0];
  EXPECT_EQ(step, Json({{"collective", "nccl_allreduce"},
                        {"elements", 2304},
                        {"args", {{{"param", "send"}, {"from", "workspace"}, {"name", ""}, {"offset", 0}, {"value", 0.0}},
                                  {{"param", "recv"}, {"from", "io"}, {"name", "out"}, {"offset", 0}, {"value", 0.0}}}}}));
  // A kernel step keeps its 1.0 form: no collective or elements keys.
  format::ProgramStepEntry k;
  k.kernel = "rmsnorm_w1_h256";
  EXPECT_FALSE(format::to_json(manifest_with(k, Json())).dump().find("collective") != std::string::npos);
}

TEST(NcclManifest, ValidatorNamesBadCollectiveSteps) {
  auto problems = [](const format::ProgramStepEntry& st, const Json& widths = Json::array({1})) {
    return program_problems(manifest_with(st, widths));
  };
  EXPECT_EQ(problems(nccl_step()).find("step 0"), std::string::npos) << problems(nccl_step());
  format::ProgramStepEntry s = nccl_step();
  s.collective = "nccl_allgather";
  EXPECT_NE(problems(s).find("collective \"nccl_allgather\", expected nccl_allreduce"), std::string::npos) << problems(s);
  EXPECT_NE(problems(nccl_step(), Json::array({2})).find("which deploy.allreduce does not give to nccl"), std::string::npos);
  s = nccl_step();
  s.elements = 8192;  // 16 KiB from offset 0 of an 8 KiB workspace
  EXPECT_NE(problems(s).find("does not fit the width's 8192 workspace bytes"), std::string::npos) << problems(s);
  s = nccl_step();
  s.args[0] = {"send", "io", "hidden", 0, 0};
  EXPECT_NE(problems(s).find("send from io \"hidden\", expected workspace"), std::string::npos) << problems(s);
  s = nccl_step();
  s.args.pop_back();
  EXPECT_NE(problems(s).find("1 args, expected two: send, recv"), std::string::npos) << problems(s);
  s = nccl_step();
  s.kernel = "allreduce_w1_h2304_r2";
  EXPECT_NE(problems(s).find("a collective step names kernel allreduce_w1_h2304_r2"), std::string::npos) << problems(s);
  // An in-kernel allreduce step at a width the deploy gives to NCCL.
  format::ProgramStepEntry k;
  k.kernel = "allreduce_w1_h2304_r2";
  k.args = {{"peers", "tp", "peers", 0, 0}};
  EXPECT_NE(problems(k).find("binds tp source \"peers\", but width 1 all-reduces with NCCL"), std::string::npos)
      << problems(k);
}

}  // namespace
}  // namespace dp::plan
