#include <gtest/gtest.h>

#include <fstream>

#include "bundle/archive.h"
#include "bundle/build.h"
#include "bundle/bundle.h"
#include "bundle/verify.h"
#include "common/fs.h"
#include "common/hash.h"
#include "model/synth.h"
#include "../test_util.h"

namespace dp::bundle {
namespace {

namespace fs = std::filesystem;

// One tiny checkpoint and deploy (2 widths, both targets) shared by the tests of this file.
class BundleBuild : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new test::TempDir();
    model::SynthOptions so;
    so.preset = "kimi-linear-tiny";
    so.out = *dir_ / "model";
    model::synthesize(so);
    std::ofstream(*dir_ / "deploy.json") << R"({"targets": ["sm_90a", "gfx942"], "tensor_parallel": 1,
      "widths": [1, 2], "num_speculative_tokens": 0, "kv_cache": {"dtype": "bf16", "block_size": 64}})";
  }
  static void TearDownTestSuite() { delete dir_; }

  static BuildResult build(const fs::path& out, unsigned jobs, const fs::path& cache, bool weights = true) {
    BuildOptions o;
    o.model = (*dir_ / "model").string();
    o.deploy = (*dir_ / "deploy.json").string();
    o.out = out;
    o.jobs = jobs;
    o.cache_dir = cache;
    o.weights = weights;
    return build_bundle(o);
  }
  static test::TempDir* dir_;
};
test::TempDir* BundleBuild::dir_ = nullptr;

TEST_F(BundleBuild, SameInputsGiveTheSameBytesWhateverJobsCacheAndPath) {
  test::TempDir t;
  BuildResult a = build(t / "a/x.dpk", 1, t / "cache");           // cold cache, one job
  BuildResult b = build(t / "elsewhere/y.dpk", 4, t / "cache");   // warm cache, four jobs, other path
  BuildResult c = build(t / "c/z.dpk", 2, t / "cache2");          // another cold cache
  EXPECT_EQ(a.digest, b.digest);
  EXPECT_EQ(a.digest, c.digest);
  EXPECT_EQ(b.cache.hits, b.kernels);
  EXPECT_EQ(sha256_file(t / "a/x.dpk"), sha256_file(t / "elsewhere/y.dpk"));
  EXPECT_EQ(sha256_file(t / "a/x.dpk"), sha256_file(t / "c/z.dpk"));
  // A directory bundle holds the same manifest.
  BuildResult d = build(t / "dir", 2, t / "cache");
  EXPECT_EQ(d.digest, a.digest);
  EXPECT_TRUE(a.fingerprinted);
}

TEST_F(BundleBuild, IndexerWorkspaceIsRecorded) {
  test::TempDir t;
  std::ofstream(t / "deploy.json") << R"({"targets": ["sm_90a"], "widths": [1],
    "indexer": {"max_keys_per_chunk": 100000, "max_requests": 16}})";
  BuildOptions o;
  o.model = "kimi-k3-tiny-indexer";
  o.deploy = (t / "deploy.json").string();
  o.out = t / "b";
  o.jobs = 2;
  o.cache_dir = t / "cache";
  o.weights = false;
  build_bundle(o);
  const format::Manifest m = Bundle::open(t / "b").manifest();
  EXPECT_EQ(m.indexer.heads, 8);
  EXPECT_EQ(m.indexer.head_dim, 128);
  EXPECT_EQ(m.indexer.top_k, 2048);
  // World 1: 2^30 + 68 * (keys + keys padded to 64-key pages) = 2^30 + 68 * (100000 + 100032).
  EXPECT_EQ(m.indexer.prefill_workspace_bytes, (uint64_t{1} << 30) + 68u * (100000 + 100032));
}

TEST_F(BundleBuild, ArchiveHasNoHostPathsOrTimes) {
  test::TempDir t;
  build(t / "x.dpk", 2, t / "cache");
  std::string bytes = read_text_file(t / "x.dpk");
  EXPECT_EQ(bytes.find(t.path().string()), std::string::npos);
  EXPECT_EQ(bytes.find(dir_->path().string()), std::string::npos);
  for (const ArchiveEntry& e : list_archive(t / "x.dpk")) EXPECT_NE(e.path[0], '/');
}

TEST_F(BundleBuild, VerifyPassesThenCatchesEveryTamper) {
  test::TempDir t;
  build(t / "b", 2, t / "cache");
  {
    VerifyReport r = verify_bundle(Bundle::open(t / "b"), {(*dir_ / "model").string(), "", 2});
    EXPECT_TRUE(r.ok()) << (r.problems.empty() ? "" : r.problems[0].message);
    EXPECT_GT(r.weights_checked, 100u);
  }
  const format::Manifest man = Bundle::open(t / "b").manifest();
  // Flip one byte of every file in turn.
  for (const format::FileEntry& f : man.files) {
    SCOPED_TRACE(f.path);
    fs::copy(t / "b", t / "flip", fs::copy_options::recursive);
    std::string s = read_text_file(t / "flip" / f.path);
    s[s.size() / 2] ^= 0x40;
    std::ofstream(t / "flip" / f.path, std::ios::binary | std::ios::trunc) << s;
    VerifyReport r = verify_bundle(Bundle::open(t / "flip"), {});
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.problems[0].message.find(f.path), std::string::npos) << r.problems[0].message;
    EXPECT_NE(r.problems[0].message.find(f.sha256), std::string::npos) << r.problems[0].message;
    fs::remove_all(t / "flip");
  }
  // Delete a file; add an unlisted one.
  fs::copy(t / "b", t / "del", fs::copy_options::recursive);
  fs::remove(t / "del" / man.files[0].path);
  std::ofstream(t / "del" / "extra.bin") << "x";
  VerifyReport r = verify_bundle(Bundle::open(t / "del"), {});
  ASSERT_EQ(r.problems.size(), 2u);
  EXPECT_NE(r.problems[0].message.find("missing file " + man.files[0].path), std::string::npos);
  EXPECT_NE(r.problems[1].message.find("extra.bin is not listed"), std::string::npos);
}

TEST_F(BundleBuild, EditedManifestIsCaught) {
  test::TempDir t;
  BuildResult built = build(t / "b", 2, t / "cache");
  // Same content, different bytes: no longer canonical, so its digest is not the manifest's digest.
  Json j = Json::parse(read_text_file(t / "b/manifest.json"));
  std::ofstream(t / "b/manifest.json", std::ios::trunc) << j.dump(1);
  VerifyReport r = verify_bundle(Bundle::open(t / "b"), {});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.problems[0].message.find("not in canonical form"), std::string::npos) << r.problems[0].message;
  // A canonical edit (a kernel's register count) passes the self-checks but not the expected digest.
  j["kernels"][0]["registers"] = 1;
  std::ofstream(t / "b/manifest.json", std::ios::trunc) << j.dump() << "\n";
  r = verify_bundle(Bundle::open(t / "b"), {"", built.digest, 1});
  ASSERT_EQ(r.problems.size(), 1u);
  EXPECT_NE(r.problems[0].message.find("expected " + built.digest), std::string::npos) << r.problems[0].message;
  // A broken edit is a format error naming the field.
  j["kernels"][0]["param_bytes"] = "many";
  std::ofstream(t / "b/manifest.json", std::ios::trunc) << j.dump() << "\n";
  test::expect_error([&] { Bundle::open(t / "b"); }, Errc::input, {"manifest.json", "kernels[0].param_bytes", "string (\"many\")", "expected an integer"});
}

TEST_F(BundleBuild, TruncatedArchiveIsRefusedNamingTheFile) {
  test::TempDir t;
  build(t / "x.dpk", 2, t / "cache");
  const std::string bytes = read_text_file(t / "x.dpk");
  for (size_t cut : {bytes.size() - 1, bytes.size() - 1024, bytes.size() / 2, size_t{700}, size_t{100}}) {
    SCOPED_TRACE(cut);
    std::ofstream(t / "cut.dpk", std::ios::binary | std::ios::trunc) << bytes.substr(0, cut);
    try {
      Bundle b = Bundle::open(t / "cut.dpk");
      VerifyReport r = verify_bundle(b, {});
      EXPECT_FALSE(r.ok());
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("cut.dpk"), std::string::npos) << e.what();
    }
  }
}

TEST_F(BundleBuild, WeightFingerprintMismatchNamesTheTensor) {
  test::TempDir t;
  build(t / "b", 2, t / "cache");
  model::SynthOptions so;
  so.preset = "kimi-linear-tiny";
  so.out = t / "other";
  so.seed = 99;
  model::synthesize(so);
  VerifyReport r = verify_bundle(Bundle::open(t / "b"), {(t / "other").string(), "", 2});
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.problems[0].message.find("weight model.layers.0."), std::string::npos) << r.problems[0].message;
  EXPECT_NE(r.problems[0].message.find("bundle expects"), std::string::npos);
}

TEST_F(BundleBuild, ConfigOnlyBuildOfThe48bPreset) {
  test::TempDir t;
  std::ofstream(t / "d.json") << R"({"targets": ["sm_90a", "gfx942"], "tensor_parallel": 2, "max_num_seqs": 2,
      "num_speculative_tokens": 0, "kv_cache": {"dtype": "bf16", "block_size": 64}})";
  BuildOptions o;
  o.model = "kimi-linear-48b-a3b";
  o.deploy = (t / "d.json").string();
  o.out = t / "k48.dpk";
  o.cache_dir = t / "cache";
  BuildResult r = build_bundle(o);
  EXPECT_FALSE(r.fingerprinted);
  Bundle b = Bundle::open(t / "k48.dpk");
  EXPECT_EQ(b.manifest().ranks.size(), 2u);
  EXPECT_EQ(b.manifest().layers.size(), 27u);
  EXPECT_TRUE(verify_bundle(b, {}).ok());
  test::TempDir m;
  VerifyReport r2 = verify_bundle(b, {"x", "", 1});
  ASSERT_FALSE(r2.ok());
  EXPECT_NE(r2.problems[0].message.find("built without weights"), std::string::npos);
}

}  // namespace
}  // namespace dp::bundle
