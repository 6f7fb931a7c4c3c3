// The OCI registry client, against a real registry server (docker-registry) on loopback.
#include "bundle/registry.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "../test_util.h"
#include "bundle/archive.h"
#include "common/output.h"
#include "format/manifest.h"
#include "common/fs.h"
#include "common/hash.h"
#include "common/json.h"
#include "common/text.h"
#include "registry_server.h"

namespace fs = std::filesystem;
using dp::Errc;
using dp::bundle::parse_reference;
using dp::test::expect_error;
using dp::test::RegistryServer;
using dp::test::TempDir;

namespace {

constexpr const char* kSkipMessage =
    "docker-registry is not installed (Debian package docker-registry): the registry tests need a real "
    "registry server on loopback";

const std::string kHex(64, 'a');

// Sets (or unsets, with nullopt) an environment variable for the lifetime of the object.
class ScopedEnv {
 public:
  ScopedEnv(std::string name, std::optional<std::string> value) : name_(std::move(name)) {
    if (const char* old = std::getenv(name_.c_str())) old_ = old;
    if (value) ::setenv(name_.c_str(), value->c_str(), 1);
    else ::unsetenv(name_.c_str());
  }
  ~ScopedEnv() {
    if (old_) ::setenv(name_.c_str(), old_->c_str(), 1);
    else ::unsetenv(name_.c_str());
  }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

 private:
  std::string name_;
  std::optional<std::string> old_;
};

// No credentials from the developer's environment or ~/.docker leak into a test.
class IsolatedEnv {
 public:
  IsolatedEnv() {
    vars_.push_back(std::make_unique<ScopedEnv>("DOCKER_CONFIG", docker_config_.path().string()));
    for (const char* v : {"DECODEPACK_REGISTRY_USER", "DECODEPACK_REGISTRY_PASSWORD", "DECODEPACK_REGISTRY_TOKEN"})
      vars_.push_back(std::make_unique<ScopedEnv>(v, std::nullopt));
  }
  const fs::path& docker_config_dir() const { return docker_config_.path(); }
  void set(const std::string& name, std::optional<std::string> value) {
    vars_.push_back(std::make_unique<ScopedEnv>(name, std::move(value)));
  }

 private:
  TempDir docker_config_;
  std::vector<std::unique_ptr<ScopedEnv>> vars_;
};

void put(const fs::path& p, std::string_view bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream(p, std::ios::binary) << bytes;
}

std::string random_bytes(size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::string s(n, '\0');
  for (char& c : s) c = static_cast<char>(gen());
  return s;
}

struct TestBundle {
  fs::path dpk;
  std::string manifest_json;
};

// A real bundle: the format 1.0 fixture's, with a data file of random bytes added to its files (larger
// than curl's buffers, so uploads and downloads stream in many pieces) and a tool version naming the
// seed, so that each seed gives another valid bundle.
TestBundle make_bundle(const fs::path& dir, unsigned seed, size_t data_bytes = 3 * 1024 * 1024 + 123) {
  const fs::path src = dir / fmt::format("src-{}", seed);
  dp::bundle::extract_archive(dp::test::data_dir() / "fixtures/bundle-v1/tiny-v1.dpk", src);
  dp::format::Manifest m = dp::format::from_json(
      dp::parse_json(dp::read_text_file(src / "manifest.json"), "manifest.json"), "manifest.json");
  const std::string data = random_bytes(data_bytes, seed);
  put(src / "data/blob.bin", data);
  m.files.push_back({"data/blob.bin", data.size(), dp::sha256_hex(data)});
  std::sort(m.files.begin(), m.files.end(), [](const auto& a, const auto& b) { return a.path < b.path; });
  m.tool_version = fmt::format("0.1.0+test{}", seed);
  TestBundle b;
  b.manifest_json = dp::format::canonical_bytes(m);
  put(src / "manifest.json", b.manifest_json);
  b.dpk = dir / fmt::format("bundle-{}.dpk", seed);
  dp::bundle::write_archive(src, b.dpk);
  return b;
}

std::string slurp(const fs::path& p) { return dp::read_text_file(p); }

bool has_staging_leftovers(const fs::path& dir) {
  for (const auto& de : fs::directory_iterator(dir))
    if (de.path().filename().string().find(".tmp-") != std::string::npos) return true;
  return false;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// References, URLs, challenges, credentials: no server needed.

TEST(RegistryReference, ParsesValidForms) {
  auto r = parse_reference("127.0.0.1:5000/kimi/linear-48b:tp1-w8");
  EXPECT_EQ(r.host, "127.0.0.1:5000");
  EXPECT_EQ(r.repository, "kimi/linear-48b");
  EXPECT_EQ(r.tag, "tp1-w8");
  EXPECT_EQ(r.digest, "");
  EXPECT_EQ(r.str(), "127.0.0.1:5000/kimi/linear-48b:tp1-w8");

  r = parse_reference("localhost/a:B_1.0-rc");
  EXPECT_EQ(r.host, "localhost");
  EXPECT_EQ(r.tag, "B_1.0-rc");

  r = parse_reference("registry.example.com/team/deep/path/x__y.z--w:v1");
  EXPECT_EQ(r.host, "registry.example.com");
  EXPECT_EQ(r.repository, "team/deep/path/x__y.z--w");

  r = parse_reference("[::1]:5000/x@sha256:" + kHex);
  EXPECT_EQ(r.host, "[::1]:5000");
  EXPECT_EQ(r.tag, "");
  EXPECT_EQ(r.digest, "sha256:" + kHex);

  r = parse_reference("reg.io/x:t@sha256:" + kHex);
  EXPECT_EQ(r.tag, "t");
  EXPECT_EQ(r.digest, "sha256:" + kHex);
  EXPECT_EQ(parse_reference(r.str()).str(), r.str());
}

TEST(RegistryReference, RefusesMalformedReferences) {
  struct Case {
    std::string text;
    std::string fragment;
  };
  std::vector<Case> cases = {
      {"", "empty"},
      {"ubuntu:latest", "no registry host"},
      {"library/ubuntu:latest", "does not start with a registry host"},
      {"https://reg.io/x:t", "URL scheme"},
      {"reg.io/x", "no tag or digest"},
      {"reg.io/x:", "empty tag"},
      {"reg.io/x:-bad", "tag '-bad' is invalid"},
      {"reg.io/x:" + std::string(129, 't'), "is invalid"},
      {"reg.io/Upper:t", "component 'Upper'"},
      {"reg.io/a//b:t", "component ''"},
      {"reg.io/a-:t", "component 'a-'"},
      {"reg.io/:t", "no repository"},
      {"reg.io/x@sha256:abc", "64 lowercase hex"},
      {"reg.io/x@sha256:" + std::string(64, 'A'), "64 lowercase hex"},
      {"reg.io/x@md5:" + std::string(32, 'a'), "not sha256"},
      {"reg.io:0/x:t", "port 0 is out of range"},
      {"reg.io:99999/x:t", "port 99999 is out of range"},
      {"reg.io:http/x:t", "port 'http' is not a number"},
      {"-reg.io/x:t", "not a valid host name"},
      {"[::1/x:t", "unclosed '['"},
      {"reg.io/x y:t", "whitespace"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.text);
    expect_error([&] { parse_reference(c.text); }, Errc::usage, {"\"" + c.text + "\"", c.fragment, "host[:port]"});
  }
}

TEST(RegistryReference, PlainHttpOnlyForLoopback) {
  EXPECT_EQ(dp::bundle::registry_base_url(parse_reference("127.0.0.1:5000/x:t"), false), "http://127.0.0.1:5000");
  EXPECT_EQ(dp::bundle::registry_base_url(parse_reference("127.8.9.10/x:t"), false), "http://127.8.9.10");
  EXPECT_EQ(dp::bundle::registry_base_url(parse_reference("localhost:5000/x:t"), false), "http://localhost:5000");
  EXPECT_EQ(dp::bundle::registry_base_url(parse_reference("[::1]:5000/x:t"), false), "http://[::1]:5000");
  EXPECT_EQ(dp::bundle::registry_base_url(parse_reference("reg.example.com/x:t"), false), "https://reg.example.com");
  EXPECT_EQ(dp::bundle::registry_base_url(parse_reference("127.0.0.1.example.com/x:t"), false),
            "https://127.0.0.1.example.com");
  EXPECT_EQ(dp::bundle::registry_base_url(parse_reference("10.0.0.5:5000/x:t"), false), "https://10.0.0.5:5000");
  EXPECT_EQ(dp::bundle::registry_base_url(parse_reference("10.0.0.5:5000/x:t"), true), "http://10.0.0.5:5000");
}

TEST(RegistryAuthChallenge, ParsesBearerAndBasic) {
  auto ch = dp::bundle::parse_auth_challenge(
      R"(Bearer realm="https://auth.example.com/token",service="registry.example.com",scope="repository:a/b:pull,push")");
  ASSERT_TRUE(ch);
  EXPECT_EQ(ch->scheme, "bearer");
  EXPECT_EQ(ch->params["realm"], "https://auth.example.com/token");
  EXPECT_EQ(ch->params["service"], "registry.example.com");
  EXPECT_EQ(ch->params["scope"], "repository:a/b:pull,push");  // the comma inside quotes stays

  ch = dp::bundle::parse_auth_challenge(R"(Basic realm="decodepack \"test\"", charset=UTF-8)");
  ASSERT_TRUE(ch);
  EXPECT_EQ(ch->scheme, "basic");
  EXPECT_EQ(ch->params["realm"], "decodepack \"test\"");
  EXPECT_EQ(ch->params["charset"], "UTF-8");

  EXPECT_FALSE(dp::bundle::parse_auth_challenge(""));
  EXPECT_FALSE(dp::bundle::parse_auth_challenge(R"(Bearer realm="unterminated)"));
}

// Issue 12: malformed registry JSON used to escape as the JSON library's "type must be string" (exit 1).
TEST(RegistryReplies, MalformedManifestsAreRegistryErrorsNamingTheFieldAndUrl) {
  const std::string url = "http://127.0.0.1:5000/v2/kimi/x/manifests/v1";
  const std::string config = R"({"mediaType":"application/vnd.decodepack.bundle.config.v1+json","digest":"sha256:)" +
                             kHex + R"(","size":10})";
  auto manifest = [&](const std::string& media, const std::string& cfg, const std::string& layers) {
    return R"({"schemaVersion":2,"mediaType":)" + media +
           R"(,"artifactType":"application/vnd.decodepack.bundle.v1","config":)" + cfg + R"(,"layers":)" + layers + "}";
  };
  const std::string layer = R"([{"mediaType":"application/vnd.decodepack.bundle.layer.v1.tar","digest":"sha256:)" +
                            kHex + R"(","size":20}])";
  const std::string oci = R"("application/vnd.oci.image.manifest.v1+json")";

  dp::bundle::BundleArtifact a = dp::bundle::parse_bundle_manifest(manifest(oci, config, layer), "", url);
  EXPECT_EQ(a.config.size, 10u);
  EXPECT_EQ(a.layer.size, 20u);
  EXPECT_EQ(a.layer.digest, "sha256:" + kHex);

  struct Case {
    std::string body;
    std::vector<std::string> fragments;
  };
  std::vector<Case> cases = {
      {manifest("5", config, layer), {"field mediaType is an integer (5), expected a string"}},
      {"<html>", {"not valid JSON"}},
      {"[1,2]", {"the manifest is an array, expected a JSON object"}},
      {manifest(oci, "7", layer), {"field config is an integer, expected an object"}},
      {manifest(oci, config, "{}"), {"field layers is an object, expected an array"}},
      {manifest(oci, config, R"([{"mediaType":"application/vnd.decodepack.bundle.layer.v1.tar","digest":5,"size":1}])"),
       {"field layers[0].digest is an integer (5), expected a string"}},
      {manifest(oci, config, R"([{"mediaType":"application/vnd.decodepack.bundle.layer.v1.tar","digest":"md5:x","size":1}])"),
       {"layers[0].digest 'md5:x' is not sha256"}},
      {manifest(oci, config, R"([{"mediaType":"application/vnd.decodepack.bundle.layer.v1.tar","digest":"sha256:)" +
                                 kHex + R"(","size":-3}])"),
       {"field layers[0].size is an integer (-3), expected a non-negative integer"}},
      {manifest(oci, config, R"([{"mediaType":"application/vnd.decodepack.bundle.layer.v1.tar","digest":"sha256:)" +
                                 kHex + R"(","size":"big"}])"),
       {"layers[0].size is a string (big)"}},
      {R"({"mediaType":)" + oci + R"(,"artifactType":[],"config":{},"layers":[]})", {"field artifactType is an array"}},
      {R"({"schemaVersion":"2","mediaType":)" + oci + "}", {"field schemaVersion is a string (2), expected the integer 2"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.body);
    try {
      dp::bundle::parse_bundle_manifest(c.body, "", url);
      ADD_FAILURE() << "accepted";
    } catch (const dp::Error& e) {
      EXPECT_EQ(e.code(), Errc::registry) << e.what();
      EXPECT_NE(std::string(e.what()).find(url), std::string::npos) << e.what();
      for (const std::string& f : c.fragments) EXPECT_NE(std::string(e.what()).find(f), std::string::npos) << e.what();
    }
  }
  // Well formed, but not ours: an input error, as before.
  expect_error([&] { dp::bundle::parse_bundle_manifest(R"({"mediaType":"application/json"})", "", url); }, Errc::input,
               {"not an OCI image manifest"});
  // The Content-Type header stands in for a missing mediaType.
  expect_error([&] { dp::bundle::parse_bundle_manifest("{}", "application/vnd.oci.image.manifest.v1+json; x=y", url); },
               Errc::registry, {"field config is missing"});

  // OCI 1.1: without artifactType, the config's mediaType is the artifact type (what `oras push --config`
  // writes without --artifact-type). Another config type, or another artifactType, is not a bundle.
  auto without_type = [&](const std::string& cfg) {
    return R"({"schemaVersion":2,"mediaType":)" + oci + R"(,"config":)" + cfg + R"(,"layers":)" + layer + "}";
  };
  a = dp::bundle::parse_bundle_manifest(without_type(config), "", url);
  EXPECT_EQ(a.config.size, 10u);
  EXPECT_EQ(a.layer.digest, "sha256:" + kHex);
  const std::string empty_config = R"({"mediaType":"application/vnd.oci.empty.v1+json","digest":"sha256:)" + kHex +
                                   R"(","size":2})";
  expect_error([&] { dp::bundle::parse_bundle_manifest(without_type(empty_config), "", url); }, Errc::input,
               {"not a decodepack bundle", "no artifactType", "application/vnd.oci.empty.v1+json"});
  std::string other = manifest(oci, config, layer);
  other.replace(other.find("application/vnd.decodepack.bundle.v1"), 36, "application/vnd.example.thing.v1xxxx");
  expect_error([&] { dp::bundle::parse_bundle_manifest(other, "", url); }, Errc::input,
               {"artifactType 'application/vnd.example.thing.v1xxxx'", "expected 'application/vnd.decodepack.bundle.v1'"});
}

TEST(RegistryReplies, ErrorDocumentsAreDescribedWithoutThrowing) {
  EXPECT_EQ(dp::bundle::describe_registry_errors(R"({"errors":[{"code":"DENIED","message":"no"}]})"), "DENIED: no");
  EXPECT_EQ(dp::bundle::describe_registry_errors(R"({"errors":[{"code":123}]})"), "123");
  EXPECT_EQ(dp::bundle::describe_registry_errors(R"({"errors":[{"code":null,"message":{"a":1}}]})"), R"(null: {"a":1})");
  EXPECT_EQ(dp::bundle::describe_registry_errors(R"({"errors":"x"})"), R"("{"errors":"x"}")");
  EXPECT_EQ(dp::bundle::describe_registry_errors("bad\x01gateway\n"), "\"bad?gateway\"");
  EXPECT_EQ(dp::bundle::describe_registry_errors(""), "");
  // A huge message is cut.
  std::string huge = R"({"errors":[{"code":"X","message":")" + std::string(1 << 20, 'm') + "\"}]}";
  EXPECT_LT(dp::bundle::describe_registry_errors(huge).size(), 300u);
  EXPECT_LT(dp::bundle::describe_registry_errors(std::string(1 << 20, 'x')).size(), 300u);
}

TEST(RegistryReplies, TokenReplies) {
  const std::string url = "https://auth.example.com/token";
  EXPECT_EQ(dp::bundle::parse_token_reply(R"({"token":"abc","expires_in":60})", url), "abc");
  EXPECT_EQ(dp::bundle::parse_token_reply(R"({"access_token":"xyz"})", url), "xyz");
  EXPECT_EQ(dp::bundle::parse_token_reply(R"({"token":"","access_token":"xyz"})", url), "xyz");
  expect_error([&] { dp::bundle::parse_token_reply(R"({"token":5})", url); }, Errc::registry,
               {url, "field token is an integer (5), expected a string"});
  expect_error([&] { dp::bundle::parse_token_reply("<html>", url); }, Errc::registry, {url, "not valid JSON"});
  expect_error([&] { dp::bundle::parse_token_reply("[]", url); }, Errc::registry, {url, "expected a JSON object"});
  expect_error([&] { dp::bundle::parse_token_reply("{}", url); }, Errc::registry, {url, "no \"token\""});
  expect_error([&] { dp::bundle::parse_token_reply(R"({"token":"a\r\nX-Evil: 1"})", url); }, Errc::registry,
               {"control character"});
}

TEST(RegistryCredentials, EnvironmentThenDockerConfig) {
  IsolatedEnv env;
  EXPECT_FALSE(dp::bundle::find_credentials("reg.example.com:5000").has_basic());

  put(env.docker_config_dir() / "config.json",
      R"({"auths": {"https://reg.example.com:5000/v1/": {"auth": "YWxpY2U6cGE6c3M="},
                    "other.example.com": {"username": "bob", "password": "pw"}},
          "credsStore": "desktop"})");
  auto c = dp::bundle::find_credentials("reg.example.com:5000");
  EXPECT_EQ(c.username, "alice");
  EXPECT_EQ(c.password, "pa:ss");  // only the first ':' separates
  EXPECT_EQ(c.source, (env.docker_config_dir() / "config.json").string());
  EXPECT_EQ(dp::bundle::find_credentials("other.example.com").username, "bob");
  EXPECT_FALSE(dp::bundle::find_credentials("reg.example.com").has_basic());  // the port is part of the key

  env.set("DECODEPACK_REGISTRY_USER", "carol");
  env.set("DECODEPACK_REGISTRY_PASSWORD", "secret");
  c = dp::bundle::find_credentials("reg.example.com:5000");
  EXPECT_EQ(c.username, "carol");
  EXPECT_EQ(c.password, "secret");

  env.set("DECODEPACK_REGISTRY_TOKEN", "tok");
  EXPECT_EQ(dp::bundle::find_credentials("x.io").token, "tok");

  env.set("DECODEPACK_REGISTRY_PASSWORD", std::nullopt);
  expect_error([] { dp::bundle::find_credentials("x.io"); }, Errc::usage,
               {"DECODEPACK_REGISTRY_USER is set but DECODEPACK_REGISTRY_PASSWORD is not"});
}

TEST(RegistryCredentials, MalformedDockerConfigIsNamed) {
  IsolatedEnv env;
  fs::path cfg = env.docker_config_dir() / "config.json";
  put(cfg, "{not json");
  expect_error([] { dp::bundle::find_credentials("x.io"); }, Errc::input, {cfg.string(), "invalid JSON"});
  put(cfg, R"({"auths": {"x.io": {"auth": "Ym9i"}}})");  // base64("bob"): no ':'
  expect_error([] { dp::bundle::find_credentials("x.io"); }, Errc::input, {cfg.string(), "user:password"});
}

TEST(RegistryClient, UnreachableRegistryIsARegistryError) {
  IsolatedEnv env;
  TempDir tmp;
  // Port 1 (tcpmux) is privileged and not served here: the connection is refused at once.
  expect_error([&] { dp::bundle::pull(parse_reference("127.0.0.1:1/a/b:t"), tmp / "x.dpk"); }, Errc::registry,
               {"127.0.0.1:1/a/b:t", "http://127.0.0.1:1/v2/a/b/manifests/t"});
  EXPECT_FALSE(fs::exists(tmp / "x.dpk"));
}

// ---------------------------------------------------------------------------------------------------
// Against docker-registry.

class Registry : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (RegistryServer::find_binary().empty()) return;
    try {
      server_ = new RegistryServer();
    } catch (const std::exception& e) {
      start_error_ = new std::string(e.what());
    }
  }
  static void TearDownTestSuite() {
    delete server_;
    server_ = nullptr;
    delete start_error_;
    start_error_ = nullptr;
  }
  void SetUp() override {
    if (start_error_) GTEST_FAIL() << *start_error_;
    if (!server_) GTEST_SKIP() << kSkipMessage;
    env_ = std::make_unique<IsolatedEnv>();
  }
  dp::bundle::Reference ref(const std::string& repo_and_tag) const {
    return parse_reference(server_->host() + "/" + repo_and_tag);
  }

  static inline RegistryServer* server_ = nullptr;
  static inline std::string* start_error_ = nullptr;
  std::unique_ptr<IsolatedEnv> env_;
  TempDir tmp_;
};

TEST_F(Registry, PushThenPullIsByteIdentical) {
  TestBundle b = make_bundle(tmp_.path(), 1, 20 * 1024 * 1024 + 7);  // 20 MiB: many read/write callbacks
  std::map<std::string, std::string> ann = {{"org.decodepack.model", "kimi_linear"},
                                            {"org.decodepack.targets", "sm_90a,gfx942"},
                                            {"org.decodepack.tensor_parallel", "1"},
                                            {"org.decodepack.widths", "1,2,4,8"}};
  auto r = ref("kimi/roundtrip:v1");
  std::vector<dp::bundle::TransferProgress> events;
  dp::bundle::PushOptions po;
  po.progress = [&](const dp::bundle::TransferProgress& p) { events.push_back(p); };
  dp::bundle::PushResult pushed = dp::bundle::push(b.dpk, b.manifest_json, ann, r, po);
  // Progress is reported for the layer only, ending with one `finished` report of all its bytes.
  ASSERT_FALSE(events.empty());
  EXPECT_TRUE(events.back().finished);
  EXPECT_EQ(events.back().bytes, fs::file_size(b.dpk));
  EXPECT_EQ(events.back().what, "upload layer sha256:" + dp::sha256_file(b.dpk));
  for (size_t i = 0; i + 1 < events.size(); ++i) EXPECT_FALSE(events[i].finished);
  EXPECT_EQ(pushed.uploaded_blobs, 2);
  EXPECT_EQ(pushed.skipped_blobs, 0);
  ASSERT_EQ(pushed.manifest_digest.size(), 71u);

  events.clear();
  dp::bundle::PullOptions pull_options;
  pull_options.progress = po.progress;
  dp::bundle::PullResult pulled = dp::bundle::pull(r, tmp_ / "pulled.dpk", pull_options);
  ASSERT_FALSE(events.empty());
  EXPECT_TRUE(events.back().finished);
  EXPECT_EQ(events.back().what, "download layer sha256:" + dp::sha256_file(b.dpk));
  EXPECT_TRUE(slurp(tmp_ / "pulled.dpk") == slurp(b.dpk)) << "pulled archive differs from the pushed one";
  EXPECT_EQ(pulled.manifest_digest, pushed.manifest_digest);
  EXPECT_EQ(pulled.layer_digest, "sha256:" + dp::sha256_file(b.dpk));
  EXPECT_EQ(pulled.size, fs::file_size(b.dpk));
  EXPECT_EQ(pulled.config_json, b.manifest_json);
  auto with_title = ann;
  with_title["org.opencontainers.image.title"] = "bundle-1.dpk";  // the standard annotation, on the manifest too
  EXPECT_EQ(pulled.annotations, with_title);
  EXPECT_FALSE(has_staging_leftovers(tmp_.path()));
  EXPECT_EQ(dp::bundle::read_archive_member(tmp_ / "pulled.dpk", "manifest.json"), b.manifest_json);

  // What the registry holds is a standard OCI artifact that other tools can read.
  auto raw = server_->http("GET", "/v2/kimi/roundtrip/manifests/v1",
                           {"Accept: application/vnd.oci.image.manifest.v1+json"});
  ASSERT_EQ(raw.status, 200) << raw.body;
  EXPECT_EQ("sha256:" + dp::sha256_hex(raw.body), pushed.manifest_digest);
  dp::Json m = dp::parse_json(raw.body, "manifest");
  EXPECT_EQ(m["schemaVersion"], 2);
  EXPECT_EQ(m["mediaType"], "application/vnd.oci.image.manifest.v1+json");
  EXPECT_EQ(m["artifactType"], "application/vnd.decodepack.bundle.v1");
  EXPECT_EQ(m["config"]["mediaType"], "application/vnd.decodepack.bundle.config.v1+json");
  EXPECT_EQ(m["config"]["digest"], "sha256:" + dp::sha256_hex(b.manifest_json));
  ASSERT_EQ(m["layers"].size(), 1u);
  EXPECT_EQ(m["layers"][0]["mediaType"], "application/vnd.decodepack.bundle.layer.v1.tar");
  EXPECT_EQ(m["layers"][0]["annotations"]["org.opencontainers.image.title"], "bundle-1.dpk");
  EXPECT_EQ(m["annotations"]["org.decodepack.widths"], "1,2,4,8");

  // Pinning the digest pulls the same thing; a wrong digest is refused by the registry.
  auto pinned = ref("kimi/roundtrip@" + pushed.manifest_digest);
  dp::bundle::pull(pinned, tmp_ / "pinned.dpk");
  EXPECT_TRUE(slurp(tmp_ / "pinned.dpk") == slurp(b.dpk));
  expect_error([&] { dp::bundle::pull(ref("kimi/roundtrip@sha256:" + kHex), tmp_ / "wrong.dpk"); }, Errc::registry,
               {"sha256:" + kHex, "HTTP 404", "MANIFEST_UNKNOWN"});
}

TEST_F(Registry, SecondPushSkipsExistingBlobs) {
  TestBundle b = make_bundle(tmp_.path(), 2);
  auto first = dp::bundle::push(b.dpk, b.manifest_json, {}, ref("kimi/skip:a"));
  EXPECT_EQ(first.uploaded_blobs, 2);

  auto again = dp::bundle::push(b.dpk, b.manifest_json, {}, ref("kimi/skip:a"));
  EXPECT_EQ(again.uploaded_blobs, 0);
  EXPECT_EQ(again.skipped_blobs, 2);
  EXPECT_EQ(again.manifest_digest, first.manifest_digest);  // same inputs, same manifest

  auto other_tag = dp::bundle::push(b.dpk, b.manifest_json, {}, ref("kimi/skip:b"));
  EXPECT_EQ(other_tag.skipped_blobs, 2);
  EXPECT_EQ(other_tag.manifest_digest, first.manifest_digest);

  // A different bundle manifest with the same archive uploads only the new config blob.
  std::string changed = R"({"format":"decodepack-bundle","changed":true})";
  auto partial = dp::bundle::push(b.dpk, changed, {}, ref("kimi/skip:c"));
  EXPECT_EQ(partial.uploaded_blobs, 1);
  EXPECT_EQ(partial.skipped_blobs, 1);
  EXPECT_NE(partial.manifest_digest, first.manifest_digest);
}

// Issue 16: the standard OCI annotations, from options only (never the clock), so a push is reproducible.
TEST_F(Registry, StandardAnnotationsAreDeterministic) {
  TestBundle b = make_bundle(tmp_.path(), 7, 1000);
  dp::bundle::PushOptions po;
  po.title = "tiny.dpk";
  po.created = dp::bundle::created_from_epoch("1764583200", "SOURCE_DATE_EPOCH");
  EXPECT_EQ(po.created, "2025-12-01T10:00:00Z");
  po.version = "2025.12-tp1";
  po.source = "https://example.com/kimi/tiny";
  auto first = dp::bundle::push(b.dpk, b.manifest_json, {{"org.decodepack.model", "kimi_linear"}}, ref("kimi/ann:a"), po);
  auto second = dp::bundle::push(b.dpk, b.manifest_json, {{"org.decodepack.model", "kimi_linear"}}, ref("kimi/ann:b"), po);
  EXPECT_EQ(first.manifest_digest, second.manifest_digest);
  auto raw = server_->http("GET", "/v2/kimi/ann/manifests/a", {"Accept: application/vnd.oci.image.manifest.v1+json"});
  ASSERT_EQ(raw.status, 200) << raw.body;
  dp::Json m = dp::parse_json(raw.body, "manifest");
  EXPECT_EQ(m["annotations"]["org.opencontainers.image.title"], "tiny.dpk");
  EXPECT_EQ(m["annotations"]["org.opencontainers.image.created"], "2025-12-01T10:00:00Z");
  EXPECT_EQ(m["annotations"]["org.opencontainers.image.version"], "2025.12-tp1");
  EXPECT_EQ(m["annotations"]["org.opencontainers.image.source"], "https://example.com/kimi/tiny");
  EXPECT_EQ(m["annotations"]["org.decodepack.model"], "kimi_linear");

  po.created = "yesterday";
  expect_error([&] { dp::bundle::push(b.dpk, b.manifest_json, {}, ref("kimi/ann:c"), po); }, Errc::usage,
               {"created 'yesterday'", "RFC 3339"});
  expect_error([&] { dp::bundle::created_from_epoch("-5", "SOURCE_DATE_EPOCH"); }, Errc::usage, {"SOURCE_DATE_EPOCH '-5'"});
  EXPECT_TRUE(dp::bundle::is_rfc3339("2026-12-01T10:00:00.25+01:00"));
  EXPECT_FALSE(dp::bundle::is_rfc3339("2026-12-01T10:00:00"));
  EXPECT_FALSE(dp::bundle::is_rfc3339("2026-12-01"));
}

TEST_F(Registry, PullOfAMissingTagNamesTagAndStatus) {
  TestBundle b = make_bundle(tmp_.path(), 3, 1000);
  dp::bundle::push(b.dpk, b.manifest_json, {}, ref("kimi/missing:present"));
  expect_error([&] { dp::bundle::pull(ref("kimi/missing:absent"), tmp_ / "out.dpk"); }, Errc::registry,
               {"kimi/missing:absent", "manifest absent", "HTTP 404", "MANIFEST_UNKNOWN"});
  expect_error([&] { dp::bundle::pull(ref("no/such/repo:v1"), tmp_ / "out.dpk"); }, Errc::registry,
               {"no/such/repo:v1", "HTTP 404"});
  EXPECT_FALSE(fs::exists(tmp_ / "out.dpk"));
  EXPECT_FALSE(has_staging_leftovers(tmp_.path()));
}

TEST_F(Registry, CorruptedBlobIsRefused) {
  TestBundle b = make_bundle(tmp_.path(), 4);
  auto r = ref("kimi/corrupt:v1");
  dp::bundle::push(b.dpk, b.manifest_json, {}, r);
  std::string layer_digest = "sha256:" + dp::sha256_file(b.dpk);
  fs::path stored = server_->blob_path(layer_digest);
  ASSERT_TRUE(fs::exists(stored)) << stored;

  // Flip one byte in the middle of the stored blob: same size, different content.
  {
    std::fstream f(stored, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(1'000'000);
    char c = 0;
    f.get(c);
    f.seekp(1'000'000);
    f.put(static_cast<char>(c ^ 0x5a));
  }
  std::string actual = "sha256:" + dp::sha256_file(stored);
  fs::create_directories(tmp_ / "out");
  expect_error([&] { dp::bundle::pull(r, tmp_ / "out/x.dpk"); }, Errc::verify,
               {"kimi/corrupt:v1", "layer blob digest mismatch", "expected " + layer_digest, "got " + actual});
  EXPECT_FALSE(fs::exists(tmp_ / "out/x.dpk"));
  EXPECT_FALSE(has_staging_leftovers(tmp_ / "out"));

  // A blob cut short is refused as well.
  fs::resize_file(stored, fs::file_size(stored) / 2);
  expect_error([&] { dp::bundle::pull(r, tmp_ / "out/x.dpk"); }, Errc::verify,
               {"digest mismatch", std::to_string(fs::file_size(stored)) + " bytes"});
  EXPECT_FALSE(fs::exists(tmp_ / "out/x.dpk"));
  EXPECT_FALSE(has_staging_leftovers(tmp_ / "out"));
}

TEST_F(Registry, ForeignArtifactsAreRefused) {
  TestBundle b = make_bundle(tmp_.path(), 5, 1000);
  dp::bundle::push(b.dpk, b.manifest_json, {}, ref("kimi/foreign:ours"));
  // A manifest over the same blobs but claiming another artifact type.
  dp::Json m = {
      {"schemaVersion", 2},
      {"mediaType", "application/vnd.oci.image.manifest.v1+json"},
      {"artifactType", "application/vnd.example.other"},
      {"config", {{"mediaType", "application/vnd.decodepack.bundle.config.v1+json"},
                  {"digest", "sha256:" + dp::sha256_hex(b.manifest_json)},
                  {"size", b.manifest_json.size()}}},
      {"layers", dp::Json::array({{{"mediaType", "application/vnd.decodepack.bundle.layer.v1.tar"},
                                   {"digest", "sha256:" + dp::sha256_file(b.dpk)},
                                   {"size", fs::file_size(b.dpk)}}})},
  };
  auto put_resp = server_->http("PUT", "/v2/kimi/foreign/manifests/theirs",
                                {"Content-Type: application/vnd.oci.image.manifest.v1+json"}, m.dump());
  ASSERT_EQ(put_resp.status, 201) << put_resp.body;
  expect_error([&] { dp::bundle::pull(ref("kimi/foreign:theirs"), tmp_ / "x.dpk"); }, Errc::input,
               {"not a decodepack bundle", "application/vnd.example.other"});
  EXPECT_FALSE(fs::exists(tmp_ / "x.dpk"));
}

// Uploads `bytes` as a blob of `repo` the way oras and other OCI clients do without decodepack's code:
// POST an upload session, then one PUT with ?digest= (a monolithic upload), each a plain HTTP request.
void oras_style_upload(const RegistryServer& server, const std::string& repo, const std::string& bytes) {
  auto post = server.http("POST", "/v2/" + repo + "/blobs/uploads/");
  ASSERT_EQ(post.status, 202) << post.headers << post.body;
  std::string location;
  for (size_t at = 0; at < post.headers.size();) {
    size_t end = post.headers.find("\r\n", at);
    if (end == std::string::npos) end = post.headers.size();
    std::string line = post.headers.substr(at, end - at);
    if (dp::ascii_lower(line.substr(0, 9)) == "location:") location = std::string(dp::trim_space(line.substr(9)));
    at = end + 2;
  }
  ASSERT_FALSE(location.empty()) << post.headers;
  if (size_t v2 = location.find("/v2/"); v2 != std::string::npos) location = location.substr(v2);  // absolute URL
  location += (location.find('?') == std::string::npos ? "?" : "&") + std::string("digest=sha256:") + dp::sha256_hex(bytes);
  auto put = server.http("PUT", location, {"Content-Type: application/octet-stream"}, bytes);
  ASSERT_EQ(put.status, 201) << put.body;
}

// Issue 16: a bundle pushed by `oras push` with the documented media types, made here with plain HTTP
// calls exactly as oras 1.x writes it: no artifactType (oras sets none when --config gives the config's
// type and --artifact-type is not used), the layer titled with its file name, a `created` annotation.
TEST_F(Registry, OrasStylePushIsPulled) {
  TestBundle b = make_bundle(tmp_.path(), 6, 1000);
  const std::string repo = "kimi/oras";
  const std::string layer = slurp(b.dpk);
  oras_style_upload(*server_, repo, b.manifest_json);
  oras_style_upload(*server_, repo, layer);
  const dp::Json m = {
      {"schemaVersion", 2},
      {"mediaType", "application/vnd.oci.image.manifest.v1+json"},
      {"config", {{"mediaType", "application/vnd.decodepack.bundle.config.v1+json"},
                  {"digest", "sha256:" + dp::sha256_hex(b.manifest_json)},
                  {"size", b.manifest_json.size()}}},
      {"layers", dp::Json::array({{{"mediaType", "application/vnd.decodepack.bundle.layer.v1.tar"},
                                   {"digest", "sha256:" + dp::sha256_hex(layer)},
                                   {"size", layer.size()},
                                   {"annotations", {{"org.opencontainers.image.title", "tiny.dpk"}}}}})},
      {"annotations", {{"org.opencontainers.image.created", "2026-12-01T10:00:00Z"}}},
  };
  auto put = server_->http("PUT", "/v2/" + repo + "/manifests/v1",
                           {"Content-Type: application/vnd.oci.image.manifest.v1+json"}, m.dump());
  ASSERT_EQ(put.status, 201) << put.body;

  dp::bundle::PullResult pulled = dp::bundle::pull(ref(repo + ":v1"), tmp_ / "pulled.dpk");
  EXPECT_TRUE(slurp(tmp_ / "pulled.dpk") == layer) << "pulled archive differs from the uploaded one";
  EXPECT_EQ(pulled.manifest_digest, "sha256:" + dp::sha256_hex(m.dump()));
  EXPECT_EQ(pulled.bundle_digest, "sha256:" + dp::sha256_hex(b.manifest_json));
  EXPECT_EQ(pulled.annotations.at("org.opencontainers.image.created"), "2026-12-01T10:00:00Z");

  // oras's default without --config: an empty config typed by artifactType. The bundle manifest is then
  // not in the config blob, so it is not a decodepack artifact; the refusal says what was found.
  dp::Json empty = m;
  oras_style_upload(*server_, repo, "{}");
  empty["config"] = {{"mediaType", "application/vnd.oci.empty.v1+json"}, {"digest", "sha256:" + dp::sha256_hex("{}")},
                     {"size", 2}};
  put = server_->http("PUT", "/v2/" + repo + "/manifests/empty-config",
                      {"Content-Type: application/vnd.oci.image.manifest.v1+json"}, empty.dump());
  ASSERT_EQ(put.status, 201) << put.body;
  expect_error([&] { dp::bundle::pull(ref(repo + ":empty-config"), tmp_ / "x.dpk"); }, Errc::input,
               {"not a decodepack bundle", "no artifactType", "application/vnd.oci.empty.v1+json"});
  EXPECT_FALSE(fs::exists(tmp_ / "x.dpk"));
}

// Puts an OCI manifest for a bundle made of `config` and `layer` (blobs already in the repository)
// under `tag`, as another tool could; returns its digest.
std::string put_manifest(const RegistryServer& server, const std::string& repo, const std::string& tag,
                         const std::string& config, const fs::path& layer) {
  dp::Json m = {
      {"schemaVersion", 2},
      {"mediaType", "application/vnd.oci.image.manifest.v1+json"},
      {"artifactType", "application/vnd.decodepack.bundle.v1"},
      {"config", {{"mediaType", "application/vnd.decodepack.bundle.config.v1+json"},
                  {"digest", "sha256:" + dp::sha256_hex(config)},
                  {"size", config.size()}}},
      {"layers", dp::Json::array({{{"mediaType", "application/vnd.decodepack.bundle.layer.v1.tar"},
                                   {"digest", "sha256:" + dp::sha256_file(layer)},
                                   {"size", fs::file_size(layer)}}})},
  };
  auto r = server.http("PUT", "/v2/" + repo + "/manifests/" + tag,
                       {"Content-Type: application/vnd.oci.image.manifest.v1+json"}, m.dump());
  EXPECT_EQ(r.status, 201) << r.body;
  return "sha256:" + dp::sha256_hex(m.dump());
}

// Issue 12: a pull used to rename the downloaded layer over the output before checking that it was the
// bundle the manifest describes; a non-tar layer (exit 3) or another valid bundle (exit 5) replaced a
// good file.
TEST_F(Registry, AFailedPullLeavesThePreviousFileIntact) {
  TestBundle a = make_bundle(tmp_.path(), 10, 1000);
  TestBundle b = make_bundle(tmp_.path(), 11, 1000);
  dp::bundle::push(a.dpk, a.manifest_json, {}, ref("kimi/keep:a"));
  dp::bundle::push(b.dpk, b.manifest_json, {}, ref("kimi/keep:b"));
  fs::create_directories(tmp_ / "out");
  const fs::path good = tmp_ / "out/good.dpk";
  dp::bundle::PullResult first = dp::bundle::pull(ref("kimi/keep:a"), good);
  EXPECT_EQ(first.bundle_digest, "sha256:" + dp::sha256_hex(a.manifest_json));
  const std::string good_bytes = slurp(good);

  // A 10 KB layer that is not an archive, under a manifest whose config is A's bundle manifest.
  put(tmp_ / "junk.bin", random_bytes(10 * 1024, 3));
  dp::bundle::push(tmp_ / "junk.bin", a.manifest_json, {}, ref("kimi/keep:junk"));
  expect_error([&] { dp::bundle::pull(ref("kimi/keep:junk"), good); }, Errc::input,
               {"kimi/keep:junk", "the layer is not a valid bundle archive",
                "layer blob sha256:" + dp::sha256_file(tmp_ / "junk.bin")});
  EXPECT_TRUE(slurp(good) == good_bytes);
  EXPECT_FALSE(has_staging_leftovers(tmp_ / "out"));

  // A valid bundle, but not the one the config blob describes.
  put_manifest(*server_, "kimi/keep", "mixed", a.manifest_json, b.dpk);
  expect_error([&] { dp::bundle::pull(ref("kimi/keep:mixed"), good); }, Errc::verify,
               {"kimi/keep:mixed", "is not the manifest's config blob"});
  EXPECT_TRUE(slurp(good) == good_bytes);

  // A layer whose archive holds the config blob's manifest but a file that differs from it.
  const fs::path altered = tmp_ / "altered";
  dp::bundle::extract_archive(a.dpk, altered);
  std::string blob = slurp(altered / "data/blob.bin");
  blob[10] ^= 1;
  put(altered / "data/blob.bin", blob);
  dp::bundle::write_archive(altered, tmp_ / "altered.dpk");
  dp::bundle::push(tmp_ / "altered.dpk", a.manifest_json, {}, ref("kimi/keep:altered"));
  expect_error([&] { dp::bundle::pull(ref("kimi/keep:altered"), good); }, Errc::verify,
               {"the pulled bundle does not verify", "data/blob.bin", "sha256"});
  EXPECT_TRUE(slurp(good) == good_bytes);

  // The bundle digest the caller expects.
  dp::bundle::PullOptions pinned;
  pinned.expect_digest = "sha256:" + kHex;
  expect_error([&] { dp::bundle::pull(ref("kimi/keep:b"), good, pinned); }, Errc::verify, {"expected sha256:" + kHex});
  EXPECT_TRUE(slurp(good) == good_bytes);
  EXPECT_FALSE(has_staging_leftovers(tmp_ / "out"));

  // And the good bundle B does replace it.
  pinned.expect_digest = "sha256:" + dp::sha256_hex(b.manifest_json);
  dp::bundle::pull(ref("kimi/keep:b"), good, pinned);
  EXPECT_TRUE(slurp(good) == slurp(b.dpk));
}

TEST_F(Registry, PullReplacesOnlyABundleUnlessForced) {
  TestBundle a = make_bundle(tmp_.path(), 12, 1000);
  dp::bundle::push(a.dpk, a.manifest_json, {}, ref("kimi/force:a"));
  put(tmp_ / "notes.txt", "the user's notes");
  expect_error([&] { dp::bundle::pull(ref("kimi/force:a"), tmp_ / "notes.txt"); }, Errc::usage,
               {(tmp_ / "notes.txt").string(), "not a bundle archive", "--force"});
  EXPECT_EQ(slurp(tmp_ / "notes.txt"), "the user's notes");
  dp::bundle::PullOptions force;
  force.force = true;
  dp::bundle::pull(ref("kimi/force:a"), tmp_ / "notes.txt", force);
  EXPECT_TRUE(slurp(tmp_ / "notes.txt") == slurp(a.dpk));
  fs::create_directories(tmp_ / "dir.dpk");
  expect_error([&] { dp::bundle::pull(ref("kimi/force:a"), tmp_ / "dir.dpk", force); }, Errc::usage,
               {"is a directory"});
}

TEST_F(Registry, PullRemovesTheStagingFilesOfKilledPulls) {
  TestBundle a = make_bundle(tmp_.path(), 13, 1000);
  dp::bundle::push(a.dpk, a.manifest_json, {}, ref("kimi/stale:a"));
  fs::create_directories(tmp_ / "out");
  // A staging file as a pull killed with SIGKILL leaves it: named by a process that no longer exists.
  const fs::path live = dp::staging_path(tmp_ / "out/x.dpk", "tmp");
  std::string name = live.filename().string();
  pid_t child = ::fork();
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  const std::string me = fmt::format("-{}-", ::getpid());
  name.replace(name.find(me), me.size(), fmt::format("-{}-", child));
  put(tmp_ / "out" / name, "half a layer");
  put(live, "a live pull's");
  dp::bundle::pull(ref("kimi/stale:a"), tmp_ / "out/x.dpk");
  EXPECT_FALSE(fs::exists(tmp_ / "out" / name));
  EXPECT_TRUE(fs::exists(live));
}

TEST_F(Registry, PushNeedsATagAndValidInputs) {
  TestBundle b = make_bundle(tmp_.path(), 6, 100);
  expect_error([&] { dp::bundle::push(b.dpk, b.manifest_json, {}, ref("kimi/x@sha256:" + kHex)); }, Errc::usage,
               {"push needs a reference with a tag"});
  expect_error([&] { dp::bundle::push(b.dpk, "{broken", {}, ref("kimi/x:t")); }, Errc::input, {"invalid JSON"});
  expect_error([&] { dp::bundle::push(tmp_ / "missing.dpk", b.manifest_json, {}, ref("kimi/x:t")); }, Errc::io,
               {"missing.dpk"});
}

// ---------------------------------------------------------------------------------------------------
// Basic authentication (htpasswd), from the environment and from a docker config file.

TEST(RegistryAuth, BasicCredentialsFromEnvironmentAndDockerConfig) {
  if (RegistryServer::find_binary().empty()) GTEST_SKIP() << kSkipMessage;
  // bcrypt (cost 5) of "s3cret-pass", made once with python3 crypt.crypt(); a test fixture.
  RegistryServer::Options opts;
  opts.htpasswd = "decodepack:$2b$05$yxSGvJPOuEU4tr4mV4CEcuOSS7G2.9lkRckDtcqvGTvBSitaZ8Rwi\n";
  RegistryServer server(opts);
  IsolatedEnv env;
  TempDir tmp;
  TestBundle b = make_bundle(tmp.path(), 7, 5000);
  auto r = parse_reference(server.host() + "/secure/bundle:v1");

  expect_error([&] { dp::bundle::push(b.dpk, b.manifest_json, {}, r); }, Errc::registry,
               {"HTTP 401", "no credentials for " + server.host()});
  expect_error([&] { dp::bundle::pull(r, tmp / "x.dpk"); }, Errc::registry,
               {"HTTP 401", "UNAUTHORIZED", "no credentials for " + server.host()});

  env.set("DECODEPACK_REGISTRY_USER", "decodepack");
  env.set("DECODEPACK_REGISTRY_PASSWORD", "wrong");
  expect_error([&] { dp::bundle::push(b.dpk, b.manifest_json, {}, r); }, Errc::registry,
               {"HTTP 401", "were not accepted"});

  env.set("DECODEPACK_REGISTRY_PASSWORD", "s3cret-pass");
  auto pushed = dp::bundle::push(b.dpk, b.manifest_json, {}, r);
  EXPECT_EQ(pushed.uploaded_blobs, 2);

  // Pull with the docker config file instead ("auth" is base64 of decodepack:s3cret-pass).
  env.set("DECODEPACK_REGISTRY_USER", std::nullopt);
  env.set("DECODEPACK_REGISTRY_PASSWORD", std::nullopt);
  put(env.docker_config_dir() / "config.json",
      fmt::format(R"({{"auths": {{"{}": {{"auth": "ZGVjb2RlcGFjazpzM2NyZXQtcGFzcw=="}}}}}})", server.host()));
  dp::bundle::pull(r, tmp / "pulled.dpk");
  EXPECT_TRUE(slurp(tmp / "pulled.dpk") == slurp(b.dpk));
}

// ---------------------------------------------------------------------------------------------------
// Bearer tokens (the docker token flow): the real registry checks real JWTs; the token service, which
// Debian does not package, is a few lines below that hands out one pre-signed token to the right user.
//
// Fixture, made once with python3-cryptography (kept here so it can be made again):
//   key = ec.generate_private_key(ec.SECP256R1()); self-signed cert, CN decodepack-test-token-issuer,
//     valid 2000-01-01..2099-12-31, BasicConstraints(ca=True) -> kTokenCertPem
//   kid = libtrust key id: base32(sha256(DER SubjectPublicKeyInfo)[:30]) without '=', in groups of 4 joined by ':'
//   header {"typ":"JWT","alg":"ES256","kid":kid}
//   claims {"iss":"decodepack-test-issuer","sub":"decodepack","aud":"decodepack-test-registry",
//           "exp":4102444800,"nbf":946684800,"iat":946684800,"jti":"decodepack-test",
//           "access":[{"type":"repository","name":"secure/token","actions":["pull","push"]}]}
//   token = b64url(header) "." b64url(claims) "." b64url(r || s)   (ES256: 32-byte big-endian r and s)

namespace {

constexpr const char* kTokenCertPem = R"(-----BEGIN CERTIFICATE-----
MIIBUDCB+KADAgECAgEBMAoGCCqGSM49BAMCMCcxJTAjBgNVBAMMHGRlY29kZXBh
Y2stdGVzdC10b2tlbi1pc3N1ZXIwIBcNMDAwMTAxMDAwMDAwWhgPMjA5OTEyMzEw
MDAwMDBaMCcxJTAjBgNVBAMMHGRlY29kZXBhY2stdGVzdC10b2tlbi1pc3N1ZXIw
WTATBgcqhkjOPQIBBggqhkjOPQMBBwNCAATXVpG6KLK9vlj60/AIi77iP9vUyxVA
J52WXHdKFTh23jsb9OqCkK0HDbBBBjD80FGpkN7mNhHUlgopixZGwHouoxMwETAP
BgNVHRMBAf8EBTADAQH/MAoGCCqGSM49BAMCA0cAMEQCIG2SWvaXcoVgW47DPheS
M8CM5dQVoCGldacexdlQzloDAiAiso54vj3o+fq4oMWzQj09orp8nD0V6U2nMb3/
UUz52A==
-----END CERTIFICATE-----
)";
constexpr const char* kToken = "eyJ0eXAiOiJKV1QiLCJhbGciOiJFUzI1NiIsImtpZCI6IkVUM1Q6WU43NzpLN0ZCOk1PV1E6NEo2VzpJVDQzOlBYTlg6RFdFRjpQVkZQOkhHRlM6SlNVVDpNSlRQIn0.eyJpc3MiOiJkZWNvZGVwYWNrLXRlc3QtaXNzdWVyIiwic3ViIjoiZGVjb2RlcGFjayIsImF1ZCI6ImRlY29kZXBhY2stdGVzdC1yZWdpc3RyeSIsImV4cCI6NDEwMjQ0NDgwMCwibmJmIjo5NDY2ODQ4MDAsImlhdCI6OTQ2Njg0ODAwLCJqdGkiOiJkZWNvZGVwYWNrLXRlc3QiLCJhY2Nlc3MiOlt7InR5cGUiOiJyZXBvc2l0b3J5IiwibmFtZSI6InNlY3VyZS90b2tlbiIsImFjdGlvbnMiOlsicHVsbCIsInB1c2giXX1dfQ.TPiefweRkBkCBlDnQdfMuKguL98zeWBOOKS5g0cz3-OdgeaqUUllfhYuw_h917CRhQKgvQxC6T7qMky3yoaYqQ";

// Answers GET /token?service=..&scope=.. with {"token": kToken} when the request carries the expected
// basic credentials, 401 otherwise; records the query strings it saw.
class TokenServer {
 public:
  explicit TokenServer(std::string expected_authorization) : expected_(std::move(expected_authorization)) {
    fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    if (fd_ < 0 || ::bind(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd_, 16) != 0 ||
        ::getsockname(fd_, reinterpret_cast<sockaddr*>(&a), &len) != 0)
      throw std::runtime_error("token server: cannot listen on loopback");
    port_ = ntohs(a.sin_port);
    thread_ = std::thread([this] { serve(); });
  }
  ~TokenServer() {
    stopping_ = true;
    ::shutdown(fd_, SHUT_RDWR);  // wakes accept()
    thread_.join();
    ::close(fd_);
  }
  std::string realm() const { return "http://127.0.0.1:" + std::to_string(port_) + "/token"; }
  std::vector<std::string> requests() const {
    std::lock_guard<std::mutex> lock(mu_);
    return requests_;
  }

 private:
  void serve() {
    while (!stopping_) {
      int c = ::accept(fd_, nullptr, nullptr);
      if (c < 0) continue;
      std::string req;
      char buf[4096];
      while (req.find("\r\n\r\n") == std::string::npos) {
        ssize_t n = ::recv(c, buf, sizeof buf, 0);
        if (n <= 0) break;
        req.append(buf, static_cast<size_t>(n));
      }
      std::string target = req.substr(0, req.find("\r\n"));
      bool authorized = req.find("Authorization: " + expected_ + "\r\n") != std::string::npos;
      {
        std::lock_guard<std::mutex> lock(mu_);
        requests_.push_back(target);
      }
      std::string body = authorized ? fmt::format(R"({{"token":"{}","expires_in":3600}})", kToken)
                                    : R"({"errors":[{"code":"UNAUTHORIZED","message":"bad credentials"}]})";
      std::string resp = fmt::format("HTTP/1.1 {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n"
                                     "Connection: close\r\n\r\n{}",
                                     authorized ? "200 OK" : "401 Unauthorized", body.size(), body);
      ::send(c, resp.data(), resp.size(), MSG_NOSIGNAL);
      ::close(c);
    }
  }

  std::string expected_;
  int fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread thread_;
  mutable std::mutex mu_;
  std::vector<std::string> requests_;
};

}  // namespace

TEST(RegistryAuth, BearerTokenFlowAndStaticToken) {
  if (RegistryServer::find_binary().empty()) GTEST_SKIP() << kSkipMessage;
  TokenServer tokens("Basic dG9rZW51c2VyOnRva2VucGFzcw==");  // base64("tokenuser:tokenpass")
  RegistryServer::Options opts;
  opts.token = {tokens.realm(), "decodepack-test-registry", "decodepack-test-issuer", kTokenCertPem};
  RegistryServer server(opts);
  IsolatedEnv env;
  TempDir tmp;
  TestBundle b = make_bundle(tmp.path(), 8, 5000);
  auto r = parse_reference(server.host() + "/secure/token:v1");

  // Without credentials the token service refuses, and the message says where that happened.
  expect_error([&] { dp::bundle::pull(r, tmp / "x.dpk"); }, Errc::registry,
               {"token request to " + tokens.realm() + " refused", "HTTP 401"});

  // Basic credentials buy a token from the realm named in the challenge.
  env.set("DECODEPACK_REGISTRY_USER", "tokenuser");
  env.set("DECODEPACK_REGISTRY_PASSWORD", "tokenpass");
  auto pushed = dp::bundle::push(b.dpk, b.manifest_json, {}, r);
  EXPECT_EQ(pushed.uploaded_blobs, 2);
  ASSERT_FALSE(tokens.requests().empty());
  for (const std::string& q : tokens.requests()) {
    EXPECT_NE(q.find("service=decodepack-test-registry"), std::string::npos) << q;
    EXPECT_NE(q.find("scope=repository%3Asecure%2Ftoken%3Apull"), std::string::npos) << q;
  }

  // A token the repository's scope does not cover is refused after one attempt, not retried forever.
  auto other = parse_reference(server.host() + "/secure/other:v1");
  expect_error([&] { dp::bundle::push(b.dpk, b.manifest_json, {}, other); }, Errc::registry,
               {"secure/other:v1", "HTTP 401", "were not accepted"});

  // A static token from the environment is sent unasked: no token request at all.
  env.set("DECODEPACK_REGISTRY_USER", std::nullopt);
  env.set("DECODEPACK_REGISTRY_PASSWORD", std::nullopt);
  env.set("DECODEPACK_REGISTRY_TOKEN", kToken);
  size_t before = tokens.requests().size();
  dp::bundle::pull(r, tmp / "pulled.dpk");
  EXPECT_TRUE(slurp(tmp / "pulled.dpk") == slurp(b.dpk));
  EXPECT_EQ(tokens.requests().size(), before);
}
