// The target table (runtime/format/targets.h) is the only list of GPU architectures: the deploy reader,
// the compiler backend and both JSON schemas must name exactly its targets.
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "backend/target.h"
#include "common/embedded.h"
#include "common/fs.h"
#include "common/json.h"
#include "deploy/deploy.h"
#include "format/targets.h"

namespace dp::format {
namespace {

std::vector<std::string> table_names() {
  std::vector<std::string> v;
  for (const GpuTarget& t : kGpuTargets) v.emplace_back(t.name);
  return v;
}

TEST(GpuTargets, TheDeployReaderKnowsExactlyTheTable) {
  std::vector<std::string> names;
  for (const deploy::TargetInfo& t : deploy::known_targets()) {
    names.emplace_back(t.name);
    const GpuTarget* g = find_gpu_target(t.name);
    ASSERT_NE(g, nullptr) << t.name;
    EXPECT_EQ(t.vendor == deploy::Vendor::cuda, g->vendor == GpuVendor::nvidia) << t.name;
    EXPECT_EQ(t.min_cuda_major, g->min_cuda_major) << t.name;
    EXPECT_EQ(t.min_llvm_major, g->min_llvm_major) << t.name;
  }
  EXPECT_EQ(names, table_names());
}

// The live bug this table fixed: sm_86, sm_89 and sm_120a passed `plan` and were then refused by the
// build as unknown targets.
TEST(GpuTargets, TheBackendCompilesForEveryTarget) {
  std::set<std::string> names;
  for (const backend::TargetInfo& t : backend::known_targets()) names.emplace(t.name);
  const std::vector<std::string> table = table_names();
  EXPECT_EQ(names, std::set<std::string>(table.begin(), table.end()));
  for (const GpuTarget& g : kGpuTargets) {
    const backend::TargetInfo& t = backend::target_info(g.name);
    EXPECT_EQ(t.vendor == backend::Vendor::nvidia, g.vendor == GpuVendor::nvidia) << g.name;
    EXPECT_EQ(t.sm, g.sm) << g.name;
    EXPECT_EQ(t.file_ext, g.vendor == GpuVendor::nvidia ? ".cubin" : ".hsaco") << g.name;
  }
  for (const char* name : {"sm_86", "sm_89", "sm_120a"}) EXPECT_NO_THROW(backend::target_info(name)) << name;
}

TEST(GpuTargets, BothSchemasEnumerateTheTable) {
  const Json deploy_schema = parse_json(embedded_file("deploy.schema.json").value_or("{}"), "deploy.schema.json");
  EXPECT_EQ(deploy_schema["properties"]["targets"]["items"]["enum"].get<std::vector<std::string>>(), table_names());
  const Json manifest_schema = parse_json(read_text_file(std::string(DP_TEST_DATA_DIR) +
                                                         "/../manifests/bundle-manifest.schema.json"),
                                          "bundle-manifest.schema.json", format::kMaxManifestBytes);
  EXPECT_EQ(manifest_schema["$defs"]["target"]["enum"].get<std::vector<std::string>>(), table_names());
}

}  // namespace
}  // namespace dp::format
