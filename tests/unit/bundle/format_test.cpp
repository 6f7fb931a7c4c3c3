// Bundle format v1 (manifests/bundle-format.md): the checked-in 1.0 fixture stays readable, the version
// gate, the manifest round trip, and one hand-made broken manifest per validate() rule with its message.
#include <gtest/gtest.h>

#include <cctype>
#include <fstream>
#include <functional>

#include <fmt/format.h>

#include "bundle/archive.h"
#include "bundle/bundle.h"
#include "bundle/verify.h"
#include "common/fs.h"
#include "common/json.h"
#include "format/manifest.h"
#include "../test_util.h"

namespace dp::bundle {
namespace {

namespace fs = std::filesystem;
using format::FormatError;
using format::Manifest;

// tests/fixtures/bundle-v1/README.md records how the fixture was made and this digest.
constexpr const char* kFixtureDigest = "sha256:22e8fbbf43de8c7726bc0ac8574874d77d189ce5101271af5b8288683bcff224";

fs::path fixture() { return test::data_dir() / "fixtures/bundle-v1/tiny-v1.dpk"; }

Json fixture_json() { return parse_json(read_archive_member(fixture(), "manifest.json"), "tiny-v1.dpk:manifest.json"); }

// Runs f, expects a FormatError of `kind` whose message contains every fragment.
void expect_format_error(const std::function<void()>& f, FormatError::Kind kind,
                         std::initializer_list<std::string> fragments) {
  try {
    f();
    ADD_FAILURE() << "expected a FormatError, none was thrown";
  } catch (const FormatError& e) {
    EXPECT_EQ(static_cast<int>(e.kind), static_cast<int>(kind)) << e.what();
    for (const std::string& frag : fragments)
      EXPECT_NE(std::string(e.what()).find(frag), std::string::npos) << "message lacks \"" << frag << "\": " << e.what();
  }
}

void expect_invalid(const Manifest& m, std::initializer_list<std::string> fragments) {
  expect_format_error([&] { format::validate(m, "m.json"); }, FormatError::Kind::schema, fragments);
}

// ---------------------------------------------------------------------------------------------------
// (a) The 1.0 fixture opens and verifies, as an archive and extracted into a directory.

TEST(BundleFormat, FixtureOpensAndVerifiesWithItsRecordedDigest) {
  Bundle b = Bundle::open(fixture());
  EXPECT_TRUE(b.is_archive());
  EXPECT_EQ(b.digest(), kFixtureDigest);
  const Manifest& m = b.manifest();
  EXPECT_EQ(m.format_version.major, 1);
  EXPECT_EQ(m.format_version.minor, 0);
  EXPECT_EQ(m.model.model_type, "kimi_linear");
  EXPECT_TRUE(m.weights_fingerprinted);
  ASSERT_EQ(m.ranks.size(), 1u);
  EXPECT_EQ(m.ranks[0].weights.size(), 86u);
  EXPECT_EQ(m.kernels.size(), 4u);

  VerifyReport r = verify_bundle(b, {"", kFixtureDigest, 2});
  EXPECT_TRUE(r.ok()) << (r.problems.empty() ? "" : r.problems[0].message);
  EXPECT_EQ(r.files_checked, 4u);
  EXPECT_EQ(r.kernels_checked, 4u);

  test::TempDir t;
  extract_archive(fixture(), t / "dir");
  Bundle d = Bundle::open(t / "dir");
  EXPECT_FALSE(d.is_archive());
  EXPECT_EQ(d.digest(), kFixtureDigest);
  VerifyReport rd = verify_bundle(d, {"", kFixtureDigest, 1});
  EXPECT_TRUE(rd.ok()) << (rd.problems.empty() ? "" : rd.problems[0].message);
}

// ---------------------------------------------------------------------------------------------------
// (b) Version gate: same major, minor <= the reader's; the message gives both versions and the range.

TEST(BundleFormat, VersionGateAcceptsOwnMajorAndOlderMinors) {
  EXPECT_NO_THROW(format::check_version({1, 0}, "m.json"));
  EXPECT_NO_THROW(format::from_json(fixture_json(), "m.json"));
}

TEST(BundleFormat, VersionGateRefusesNewerMinorAndOtherMajors) {
  expect_format_error([] { format::check_version({1, 99}, "m.json"); }, FormatError::Kind::version,
                      {"m.json", "version 1.99", "format 1.9", "supported: 1.0 to 1.9", "upgrade decodepack"});
  expect_format_error([] { format::check_version({2, 0}, "m.json"); }, FormatError::Kind::version,
                      {"m.json", "version 2.0", "format 1.9", "supported: 1.0 to 1.9"});
  expect_format_error([] { format::check_version({0, 3}, "m.json"); }, FormatError::Kind::version,
                      {"version 0.3", "supported: 1.0 to 1.9", "rebuild the bundle"});

  for (auto [major, minor] : {std::pair{1, 99}, std::pair{2, 0}}) {
    SCOPED_TRACE(major * 100 + minor);
    Json j = fixture_json();
    j["format_version"] = {{"major", major}, {"minor", minor}};
    expect_format_error([&] { format::from_json(j, "m.json"); }, FormatError::Kind::version,
                        {fmt::format("version {}.{}", major, minor), "supported: 1.0 to 1.9"});
  }
}

// Writers record the lowest minor a bundle needs: 1.5, 1.6 with a tp source, 1.7 with K3 attention
// residuals (source layer, cache kind attn_res, an attnres kernel), 1.8 with a collective step, so older
// bundles keep their bytes.
TEST(BundleFormat, WritersRecordTheLowestMinorTheBundleNeeds) {
  format::Manifest m;
  EXPECT_EQ(format::written_minor(m), format::kMinWrittenMinor);
  format::ProgramEntry p;
  p.cls = "kda_moe";
  p.width = 1;
  format::ProgramStepEntry st;
  st.kernel = "rmsnorm_w1_h256";
  st.args.push_back({"hidden", "io", "hidden", 0, 0});
  st.args.push_back({"blocks", "kv", "mla_latent", 0, 0});
  p.steps.push_back(st);
  m.programs.push_back(p);
  EXPECT_EQ(format::written_minor(m), 5);
  m.programs[0].steps[0].args.push_back({"rank", "tp", "rank", 0, 0});
  EXPECT_EQ(format::written_minor(m), 6);
  format::Manifest a = m, b = m, c = m;
  a.programs[0].steps[0].args.push_back({"layer", "layer", "", 0, 0});
  b.programs[0].steps[0].args[1].name = "attn_res";
  format::KernelEntry k;
  k.op = "attnres";
  c.kernels.push_back(k);
  for (const format::Manifest* x : {&a, &b, &c}) EXPECT_EQ(format::written_minor(*x), 7);
  // 1.8: a collective step (the NCCL all-reduce path), whatever else the bundle uses.
  format::ProgramStepEntry nccl;
  nccl.collective = "nccl_allreduce";
  nccl.elements = 256;
  for (format::Manifest x : {m, a}) {
    x.programs[0].steps.push_back(nccl);
    EXPECT_EQ(format::written_minor(x), 8);
  }
  EXPECT_EQ(format::kFormatMinor, 9);
}

TEST(BundleFormat, VersionIsCheckedBeforeAnyOtherField) {
  // A 2.0 manifest may look like anything else; the reader must say "version", not "missing field".
  Json j = {{"format", "decodepack-bundle"}, {"format_version", {{"major", 2}, {"minor", 0}}}, {"v2", true}};
  expect_format_error([&] { format::from_json(j, "m.json"); }, FormatError::Kind::version,
                      {"version 2.0", "supported: 1.0 to 1.9"});
  j["format"] = "something-else";
  expect_format_error([&] { format::from_json(j, "m.json"); }, FormatError::Kind::schema,
                      {"field format is \"something-else\", expected \"decodepack-bundle\""});
}

TEST(BundleFormat, BundleOpenRefusesANewerMinorAsInput) {
  test::TempDir t;
  extract_archive(fixture(), t / "b");
  Json j = fixture_json();
  j["format_version"]["minor"] = 99;
  std::ofstream(t / "b/manifest.json", std::ios::trunc) << j.dump() << "\n";
  test::expect_error([&] { Bundle::open(t / "b"); }, Errc::input,
                     {"manifest.json", "version 1.99", "format 1.9", "supported: 1.0 to 1.9"});
}

// ---------------------------------------------------------------------------------------------------
// (c) Round trip: the reader keeps every field, so the canonical bytes come back unchanged.

TEST(BundleFormat, ManifestRoundTripsExactly) {
  const Json j = fixture_json();
  const Manifest m = format::from_json(j, "m.json");
  EXPECT_EQ(format::to_json(m), j);
  EXPECT_EQ(format::canonical_bytes(m), read_archive_member(fixture(), "manifest.json"));
  EXPECT_EQ(format::to_json(format::from_json(format::to_json(m), "m.json")), j);
}

// ---------------------------------------------------------------------------------------------------
// (d) validate(): one broken manifest per rule, each with its message.

class BrokenManifest : public ::testing::Test {
 protected:
  void SetUp() override { m_ = format::from_json(fixture_json(), "m.json"); }
  size_t expert_group() const {
    for (size_t i = 0; i < m_.ranks[0].weights.size(); ++i)
      if (m_.ranks[0].weights[i].experts > 0) return i;
    ADD_FAILURE() << "the fixture has no expert group";
    return 0;
  }
  Manifest m_;
};

TEST_F(BrokenManifest, FixtureIsValid) { EXPECT_NO_THROW(format::validate(m_, "m.json")); }

TEST_F(BrokenManifest, UnsortedKernels) {
  std::swap(m_.kernels[0], m_.kernels[1]);
  expect_invalid(m_, {"m.json: kernels[1] (prefetch_b32.gfx942) is not after kernels[0] (prefetch_b32.sm_90a)",
                      "keys must be sorted and unique"});
}

TEST_F(BrokenManifest, DuplicateKernel) {
  m_.kernels[1] = m_.kernels[0];
  expect_invalid(m_, {"kernels[1] (prefetch_b32.gfx942) is not after kernels[0]", "sorted and unique"});
}

TEST_F(BrokenManifest, KernelKeyIsNotNameDotTarget) {
  m_.kernels[0].key = "prefetch_b32.sm_90a";
  expect_invalid(m_, {"kernels[0]: key \"prefetch_b32.sm_90a\", expected \"prefetch_b32.gfx942\" (name.target)"});
}

TEST_F(BrokenManifest, KernelFileNotInFiles) {
  m_.kernels[2].file = "kernels/gfx942/missing.gfx942.hsaco";
  expect_invalid(m_, {"kernels[2] (rmsnorm_w1_h256.gfx942): file kernels/gfx942/missing.gfx942.hsaco is not listed in files"});
}

TEST_F(BrokenManifest, BadFileSha256) {
  m_.files[0].sha256 = "ABC";
  expect_invalid(m_, {"files[0] (kernels/gfx942/prefetch_b32.gfx942.hsaco): sha256 \"ABC\" is not 64 hex digits"});
  m_ = format::from_json(fixture_json(), "m.json");
  std::string upper = m_.files[1].sha256;
  for (char& c : upper) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  m_.files[1].sha256 = upper;
  expect_invalid(m_, {"files[1]", "is not 64 hex digits"});
}

TEST_F(BrokenManifest, BadKernelSha256) {
  m_.kernels[3].sha256 = std::string(63, 'a');
  expect_invalid(m_, {"kernels[3] (rmsnorm_w1_h256.sm_90a): sha256 \"" + std::string(63, 'a') + "\" is not 64 hex digits"});
}

TEST_F(BrokenManifest, BadFingerprint) {
  m_.ranks[0].weights[0].sha256[0] = std::string(64, 'g');
  expect_invalid(m_, {"ranks[0] weight " + m_.ranks[0].weights[0].name, "is not 64 hex digits"});
}

TEST_F(BrokenManifest, BadConfigAndTemplatesDigest) {
  m_.model.config_digest = m_.model.config_digest.substr(7);  // "sha256:" prefix missing
  expect_invalid(m_, {"model.config_digest", "is not \"sha256:<64 hex digits>\""});
  m_ = format::from_json(fixture_json(), "m.json");
  m_.templates_digest = "sha256:" + m_.templates_digest;
  expect_invalid(m_, {"templates_digest", "is not 64 hex digits"});
}

TEST_F(BrokenManifest, UnsafePaths) {
  for (const char* bad : {"../x", "/abs", "kernels/../x", "kernels//x", "./x", "kernels/", "a\\b", ""}) {
    SCOPED_TRACE(bad);
    m_ = format::from_json(fixture_json(), "m.json");
    m_.files[0].path = bad;
    expect_invalid(m_, {fmt::format("files[0].path \"{}\" is not a safe relative path", bad)});
  }
}

TEST_F(BrokenManifest, FilesListManifestItself) {
  m_.files.push_back({"manifest.json", 1, std::string(64, '0')});
  expect_invalid(m_, {"files[4] lists manifest.json itself"});
}

TEST_F(BrokenManifest, UnsortedFiles) {
  std::swap(m_.files[0], m_.files[3]);
  expect_invalid(m_, {"files[1] (kernels/gfx942/rmsnorm_w1_h256.gfx942.hsaco) is not after files[0] "
                      "(kernels/sm_90a/rmsnorm_w1_h256.sm_90a.cubin): paths must be sorted and unique"});
}

TEST_F(BrokenManifest, WrongFingerprintCount) {
  const size_t g = expert_group();
  format::WeightEntry& w = m_.ranks[0].weights[g];
  ASSERT_EQ(w.experts, 16);
  w.sha256.pop_back();
  expect_invalid(m_, {"ranks[0] weight " + w.name + ": 15 fingerprints, expected 16"});

  m_ = format::from_json(fixture_json(), "m.json");
  format::WeightEntry& single = m_.ranks[0].weights[0];
  single.sha256.push_back(single.sha256[0]);
  expect_invalid(m_, {"ranks[0] weight " + single.name + ": 2 fingerprints, expected 1"});

  m_ = format::from_json(fixture_json(), "m.json");
  m_.weights_fingerprinted = false;  // a config-only bundle carries no fingerprints
  expect_invalid(m_, {"ranks[0] weight " + m_.ranks[0].weights[0].name + ": 1 fingerprints, expected 0"});
}

TEST_F(BrokenManifest, SplitDimBeyondShape) {
  format::WeightEntry& w = m_.ranks[0].weights[0];  // model.layers.0.input_layernorm.weight, [256]
  w.split_dim = 1;
  expect_invalid(m_, {"ranks[0] weight " + w.name + ": split_dim 1 beyond its 1 dims"});
}

TEST_F(BrokenManifest, RanksOutOfOrder) {
  m_.ranks.push_back(m_.ranks[0]);
  expect_invalid(m_, {"ranks[1]: rank 0 out of order"});
}

TEST_F(BrokenManifest, KernelWidthNotInDeploy) {
  m_.kernels[2].width = 2;
  expect_invalid(m_, {"kernels[2] (rmsnorm_w1_h256.gfx942): width 2 is not one of the deploy's widths"});
}

TEST_F(BrokenManifest, ParamsDoNotEndAtParamBytes) {
  m_.kernels[3].param_bytes = 48;
  expect_invalid(m_, {"kernels[3] (rmsnorm_w1_h256.sm_90a): params end at byte 44, param_bytes is 48"});
}

TEST_F(BrokenManifest, ParamSmallerThanItsKindWouldOverflowTheBlock) {
  // The runtime writes 8 bytes for a pointer: a 4-byte pointer param at the end of the block would have it
  // write past param_bytes.
  format::KernelEntry& k = m_.kernels[3];
  format::KernelParamEntry* ptr = nullptr;
  for (auto& p : k.params)
    if (p.kind == "pointer") ptr = &p;
  ASSERT_NE(ptr, nullptr);
  ptr->size = 4;
  expect_invalid(m_, {"kernels[3] (rmsnorm_w1_h256.sm_90a): param " + ptr->name + " (pointer) at offset",
                      "with size 4, expected size 8 at a multiple of 8"});
}

TEST_F(BrokenManifest, NumbersOutOfTheReadersBounds) {
  // Read bounds (manifest.h kMax*): each is refused by from_json naming the field, the value and the range.
  auto refused = [&](const std::function<void(Json&)>& edit, const std::string& fragment) {
    Json j = format::to_json(m_);
    edit(j);
    test::expect_error([&] {
      try {
        format::from_json(j, "m.json");
      } catch (const format::FormatError& e) {
        rethrow_format_error(e);
      }
    }, Errc::input, {fragment});
  };
  refused([](Json& j) { j["ranks"][0]["weights"][0]["shape"][0] = int64_t{1} << 41; },
          "field ranks[0].weights[0].shape[0] is 2199023255552, expected 0..1099511627776");
  refused([](Json& j) { j["ranks"][0]["weights"][0]["experts"] = int64_t{1} << 62; },
          "field ranks[0].weights[0].experts is 4611686018427387904, expected 0..65536");
  refused([](Json& j) { j["workspace"][0]["bytes"] = uint64_t{1} << 50; },
          "field workspace[0].bytes is 1125899906842624, expected 0..1099511627776");
  refused([](Json& j) { j["kernels"][0]["param_bytes"] = 1 << 20; },
          "field kernels[0].param_bytes is 1048576, expected 0..32764");
  refused([](Json& j) { j["model"]["hidden_size"] = int64_t{1} << 40; },
          "field model.hidden_size is 1099511627776, expected 1..65536");
  refused([](Json& j) { j["files"][0]["size"] = uint64_t{1} << 40; },
          "field files[0].size is 1099511627776, expected 0..8589934591");
  refused([](Json& j) { j["ranks"][0]["weights"][0]["shape"] = Json::array({1 << 20, 1 << 20, 1 << 20}); },
          "shape [1048576, 1048576, 1048576] x 2 bytes is more than 281474976710656 bytes");
}

TEST_F(BrokenManifest, PrefetchRangeNamesNoWeightOrIsMisaligned) {
  ASSERT_FALSE(m_.prefetch.empty());
  m_.prefetch[0].ranges[0].weight = "model.layers.9.nothing.weight";
  expect_invalid(m_, {"prefetch[0]: weight model.layers.9.nothing.weight is not a weight of the bundle"});
  m_ = format::from_json(fixture_json(), "m.json");
  m_.prefetch[1].ranges[0].bytes = 100;
  expect_invalid(m_, {"prefetch[1]: 100 bytes of " + m_.prefetch[1].ranges[0].weight + " is not a multiple of 16"});
}

// Kernels of role "indexer" (the sparse-attention indexer's prefill ops) exist since 1.2, and only in a
// manifest whose `indexer` is present.
TEST_F(BrokenManifest, IndexerKernelsNeedFormat12AndAnIndexer) {
  auto with_indexer = [](Manifest m, int minor) {
    m.format_version = {1, minor};
    m.indexer = {8, 128, 2048, (uint64_t{1} << 30) + 68 * (4096 + 4096)};
    m.kernels[0].role = "indexer";  // prefetch_b32.gfx942 stands in for an indexer op
    return m;
  };
  const Manifest ok = with_indexer(m_, 2);
  EXPECT_NO_THROW(format::validate(ok, "m.json"));
  // It survives the manifest's JSON form.
  const Manifest again = format::from_json(format::to_json(ok), "m.json");
  EXPECT_EQ(again.kernels[0].role, "indexer");
  EXPECT_EQ(again.indexer.heads, 8);
  EXPECT_NO_THROW(format::validate(again, "m.json"));

  expect_invalid(with_indexer(m_, 1), {"m.json", "kernels[0] (prefetch_b32.gfx942)", "role indexer", "1.1 manifest",
                                       "since 1.2"});
  expect_invalid(with_indexer(m_, 0), {"kernels[0] (prefetch_b32.gfx942)", "1.0 manifest", "since 1.2"});
  Manifest none = with_indexer(m_, 2);
  none.indexer = {};
  expect_invalid(none, {"kernels[0] (prefetch_b32.gfx942)", "role indexer", "1.2 manifest", "no indexer"});
  // The reader applies the same rule.
  Json j = format::to_json(with_indexer(m_, 2));
  j["format_version"]["minor"] = 1;
  expect_format_error([&] { format::validate(format::from_json(j, "m.json"), "m.json"); }, FormatError::Kind::schema,
                      {"role indexer", "since 1.2"});
  // Other roles are still refused, and the message lists indexer among the known ones.
  Manifest other = ok;
  other.kernels[0].role = "indexr";
  expect_invalid(other, {"role \"indexr\"", "expected final_norm, lm_head, prefetch, layer or indexer"});
}

// Kernels of role "lm_head" (the LM head GEMM of one width) exist since 1.5.
TEST_F(BrokenManifest, LmHeadKernelsNeedFormat15AndAWidth) {
  auto with_head = [](Manifest m, int minor) {
    m.format_version = {1, minor};
    for (format::KernelEntry& k : m.kernels)
      if (k.width == 1) k.role = "lm_head";  // the fixture's final norms stand in for LM heads
    return m;
  };
  const Manifest ok = with_head(m_, 5);
  EXPECT_NO_THROW(format::validate(ok, "m.json"));
  const Manifest again = format::from_json(format::to_json(ok), "m.json");
  EXPECT_NO_THROW(format::validate(again, "m.json"));
  expect_invalid(with_head(m_, 4), {"m.json", "role lm_head in a 1.4 manifest (since 1.5)"});
  Manifest no_width = ok;
  for (format::KernelEntry& k : no_width.kernels)
    if (k.role == "lm_head") k.width = 0;
  expect_invalid(no_width, {"role lm_head with width 0"});
}

// Kernels that take dynamic shared memory (`dynamic_shared_bytes`) exist since 1.9; the field is written
// only when not 0, so every other kernel keeps its bytes, and the writer records 1.9 only for a bundle
// that has one.
TEST_F(BrokenManifest, DynamicSharedMemoryNeedsFormat19) {
  EXPECT_LT(format::written_minor(m_), 9);
  EXPECT_FALSE(format::to_json(m_)["kernels"][3].contains("dynamic_shared_bytes"));
  Manifest ok = m_;
  ok.kernels[3].dynamic_shared_bytes = 75776;
  EXPECT_EQ(format::written_minor(ok), 9);
  ok.format_version.minor = 9;
  EXPECT_NO_THROW(format::validate(ok, "m.json"));
  const Json j = format::to_json(ok);
  EXPECT_EQ(j["kernels"][3]["dynamic_shared_bytes"], 75776);
  const Manifest again = format::from_json(j, "m.json");
  EXPECT_EQ(again.kernels[3].dynamic_shared_bytes, 75776u);
  EXPECT_EQ(again.kernels[2].dynamic_shared_bytes, 0u);
  EXPECT_EQ(format::to_json(again), j);

  Manifest old = ok;
  old.format_version.minor = 8;
  expect_invalid(old, {"m.json", "kernels[3] (rmsnorm_w1_h256.sm_90a)", "dynamic_shared_bytes 75776",
                       "1.8 manifest (since 1.9)"});
  // Written, the field is never 0; a reader refuses 0 and values beyond its bound.
  for (const Json& bad : {Json(0), Json(uint64_t{1} << 30), Json("4096")}) {
    Json k = j;
    k["kernels"][3]["dynamic_shared_bytes"] = bad;
    expect_format_error([&] { format::from_json(k, "m.json"); }, FormatError::Kind::schema,
                        {"kernels[3].dynamic_shared_bytes"});
  }
}

// from_json's type and range checks name the field path, the actual and the expected value.
TEST(BundleFormat, ReaderNamesTheFieldOfATypeError) {
  struct Case {
    std::function<void(Json&)> edit;
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {[](Json& j) { j["model"]["hidden_size"] = "256"; },
       {"m.json: field model.hidden_size is string (\"256\"), expected an integer"}},
      {[](Json& j) { j["model"]["hidden_size"] = 256.0; }, {"field model.hidden_size is number (256.0), expected an integer"}},
      {[](Json& j) { j.erase("workspace"); }, {"m.json: missing field workspace"}},
      {[](Json& j) { j["kernels"][0].erase("grid"); }, {"missing field kernels[0].grid"}},
      {[](Json& j) { j["kernels"][0]["block"] = {32, 1}; }, {"field kernels[0].block has 2 entries, expected 3"}},
      {[](Json& j) { j["kernels"][0]["grid"][1] = 0; }, {"field kernels[0].grid[1] is 0, expected >= 1"}},
      {[](Json& j) { j["kernels"][0]["q"] = 65; }, {"field kernels[0].q is 65, expected 0..64"}},
      {[](Json& j) { j["ranks"][0]["weights"][0]["split_dim"] = -2; },
       {"field ranks[0].weights[0].split_dim is -2, expected -1..7"}},
      {[](Json& j) { j["ranks"][0]["weights"][0]["sha256"] = "abc"; },
       {"field ranks[0].weights[0].sha256 is string, expected an array"}},
      {[](Json& j) { j["files"][0]["size"] = -1; }, {"field files[0].size is -1, expected 0.."}},
      {[](Json& j) { j["weights_fingerprinted"] = 1; }, {"field weights_fingerprinted is number, expected true or false"}},
      {[](Json& j) { j["layers"] = Json::object(); }, {"field layers is object, expected an array"}},
      {[](Json& j) { j["deploy"] = Json::array(); }, {"field deploy is not an object"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE(i);
    Json j = fixture_json();
    cases[i].edit(j);
    try {
      format::from_json(j, "m.json");
      ADD_FAILURE() << "accepted";
    } catch (const FormatError& e) {
      EXPECT_EQ(static_cast<int>(e.kind), static_cast<int>(FormatError::Kind::schema)) << e.what();
      for (const std::string& f : cases[i].fragments)
        EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << "message lacks \"" << f << "\": " << e.what();
    }
  }
}

}  // namespace
}  // namespace dp::bundle
