// The bundle format version is dp::format::kFormatMajor/kFormatMinor (runtime/format/manifest.h);
// decodepack.h's DP_BUNDLE_FORMAT_* are tied to it by a static assertion (runtime/src/c_api.cpp), and
// the spec's title and the manifest schema must say the same version.
#include <gtest/gtest.h>

#include <fmt/format.h>

#include <string>
#include <vector>

#include "common/fs.h"
#include "common/json.h"
#include "format/manifest.h"

namespace dp::format {
namespace {

std::string source_file(const std::string& rel) { return read_text_file(std::string(DP_TEST_DATA_DIR) + "/../" + rel); }

TEST(FormatVersion, TheSpecTitleSaysTheReadersVersion) {
  const std::string spec = source_file("manifests/bundle-format.md");
  const std::string title = spec.substr(0, spec.find('\n'));
  EXPECT_EQ(title, fmt::format("# decodepack bundle format, version {}.{}", kFormatMajor, kFormatMinor));
}

TEST(FormatVersion, TheSchemaAcceptsExactlyTheVersionsTheReaderReads) {
  const Json schema = parse_json(source_file("manifests/bundle-manifest.schema.json"), "bundle-manifest.schema.json",
                                 kMaxManifestBytes);
  const Json& v = schema["properties"]["format_version"]["properties"];
  EXPECT_EQ(v["major"]["const"].get<int>(), kFormatMajor);
  std::vector<int> minors;
  for (int m = 0; m <= kFormatMinor; ++m) minors.push_back(m);
  EXPECT_EQ(v["minor"]["enum"].get<std::vector<int>>(), minors);
}

}  // namespace
}  // namespace dp::format
