// The C ABI's plumbing: versions, status objects, names, versioned structs, argument checks, bundle
// queries, lifetimes; and the C++ wrapper over it.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <set>

#include <nlohmann/json.hpp>

#include "decodepack/decodepack.hpp"
#include "format/bundle_reader.h"
#include "runtime_test_util.h"

namespace dp::rttest {
namespace {

const Bundles& bundles() {
  static const Bundles b = ensure_bundles();
  return b;
}

class CApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!bundles().error.empty()) GTEST_FAIL() << bundles().error;
    ASSERT_TRUE(outcome(dp_bundle_open(bundles().tiny.c_str(), nullptr, &b_)).ok());
  }
  void TearDown() override { dp_bundle_close(b_); }
  dp_bundle* b_ = nullptr;
};

// Builds the test bundles once (ctest runs this first, as the fixture of every other runtime test).
TEST(Setup, BuildBundles) { ASSERT_TRUE(bundles().error.empty()) << bundles().error; }

TEST(CApiVersion, MacrosAndFunctionAgree) {
  EXPECT_EQ(dp_version(), static_cast<uint32_t>(DP_VERSION_NUMBER));
  EXPECT_EQ(std::string(dp_version_string()), std::to_string(DP_VERSION_MAJOR) + "." +
                                                  std::to_string(DP_VERSION_MINOR) + "." +
                                                  std::to_string(DP_VERSION_PATCH));
  EXPECT_EQ(DP_BUNDLE_FORMAT_MAJOR, 1);
}

TEST(CApiStatus, NullIsSuccess) {
  EXPECT_EQ(dp_status_code(nullptr), DP_OK);
  EXPECT_STREQ(dp_status_message(nullptr), "");
  dp_status_free(nullptr);
}

TEST(CApiStatus, CodeNamesAreStableAndDistinct) {
  // The numbers are part of the ABI: spot-check a few, and that every code has its own name.
  EXPECT_EQ(DP_ERR_INVALID_ARGUMENT, 1);
  EXPECT_EQ(DP_ERR_TARGET, 10);
  EXPECT_EQ(DP_ERR_REBIND, 21);
  EXPECT_EQ(DP_ERR_INTERNAL, 26);
  std::set<std::string> names;
  for (int32_t c = DP_OK; c <= DP_ERR_INTERNAL; ++c) {
    const std::string n = dp_code_name(c);
    EXPECT_EQ(n.rfind("DP_", 0), 0u) << c;
    EXPECT_NE(n, "DP_ERR_?") << c;
    names.insert(n);
  }
  EXPECT_EQ(names.size(), static_cast<size_t>(DP_ERR_INTERNAL + 1));
  EXPECT_STREQ(dp_code_name(DP_ERR_SHAPE), "DP_ERR_SHAPE");
  EXPECT_STREQ(dp_code_name(999), "DP_ERR_?");
  EXPECT_STREQ(dp_code_name(-1), "DP_ERR_?");
  EXPECT_STREQ(dp_reason_name(DP_REASON_PIECEWISE), "DP_REASON_PIECEWISE");
  EXPECT_STREQ(dp_reason_name(42), "DP_REASON_?");
}

TEST(CApiTypes, DtypesAndTensors) {
  EXPECT_STREQ(dp_dtype_name(DP_DTYPE_BF16), "BF16");
  EXPECT_STREQ(dp_dtype_name(DP_DTYPE_F8_E4M3), "F8_E4M3");
  EXPECT_STREQ(dp_dtype_name(77), "?");
  EXPECT_EQ(dp_dtype_size(DP_DTYPE_BF16), 2u);
  EXPECT_EQ(dp_dtype_size(DP_DTYPE_F32), 4u);
  EXPECT_EQ(dp_dtype_size(DP_DTYPE_U8), 1u);
  EXPECT_EQ(dp_dtype_size(77), 0u);
  const int64_t shape[3] = {2, 3, 4};
  dp_tensor t;
  dp_tensor_init(&t, 0x1000, DP_DTYPE_F32, 3, shape);
  EXPECT_EQ(t.data, 0x1000u);
  EXPECT_EQ(t.ndim, 3);
  EXPECT_EQ(t.strides[0], 12);
  EXPECT_EQ(t.strides[1], 4);
  EXPECT_EQ(t.strides[2], 1);
}

TEST(CApiStructs, InitFunctionsSetSizeAndDefaults) {
  dp_session_options o;
  std::memset(&o, 0xAB, sizeof(o));
  dp_session_options_init(&o);
  EXPECT_EQ(o.size, sizeof(o));
  EXPECT_EQ(o.vendor, DP_VENDOR_CUDA);
  EXPECT_EQ(o.device, 0);
  EXPECT_EQ(o.num_speculative_tokens, -1);
  EXPECT_EQ(o.target, nullptr);
  dp_step_desc d;
  dp_step_desc_init(&d);
  EXPECT_EQ(d.size, sizeof(d));
  EXPECT_EQ(d.graph_mode, DP_GRAPH_NONE);
  EXPECT_EQ(d.query_lens, nullptr);
}

TEST_F(CApiTest, NullArgumentsAreNamed) {
  dp_bundle* b = reinterpret_cast<dp_bundle*>(0x1);
  DP_EXPECT_STATUS(dp_bundle_open(nullptr, nullptr, &b), DP_ERR_INVALID_ARGUMENT, "dp_bundle_open", "path is NULL");
  EXPECT_EQ(b, nullptr);  // *out is cleared on failure
  DP_EXPECT_STATUS(dp_bundle_open("x", nullptr, nullptr), DP_ERR_INVALID_ARGUMENT, "out is NULL");
  DP_EXPECT_STATUS(dp_bundle_get_info(nullptr, nullptr), DP_ERR_INVALID_ARGUMENT, "bundle is NULL");
  DP_EXPECT_STATUS(dp_bundle_get_info(b_, nullptr), DP_ERR_INVALID_ARGUMENT, "out is NULL");
  DP_EXPECT_STATUS(dp_session_create(nullptr, nullptr, nullptr), DP_ERR_INVALID_ARGUMENT, "out is NULL");
  dp_session* s = nullptr;
  DP_EXPECT_STATUS(dp_session_create(nullptr, nullptr, &s), DP_ERR_INVALID_ARGUMENT, "bundle is NULL");
  DP_EXPECT_STATUS(dp_session_bind_weight(nullptr, "x", nullptr), DP_ERR_INVALID_ARGUMENT, "session is NULL");
  DP_EXPECT_STATUS(dp_plan(nullptr, nullptr, nullptr), DP_ERR_INVALID_ARGUMENT, "session is NULL");
  DP_EXPECT_STATUS(dp_after_step(nullptr), DP_ERR_INVALID_ARGUMENT, "session is NULL");
  DP_EXPECT_STATUS(dp_device_count(DP_VENDOR_CUDA, nullptr), DP_ERR_INVALID_ARGUMENT, "count is NULL");
  dp_session_destroy(nullptr);
  dp_bundle_close(nullptr);
}

TEST_F(CApiTest, OptionsSizeIsChecked) {
  dp_bundle_open_options o;
  dp_bundle_open_options_init(&o);
  dp_bundle* b = nullptr;
  o.size = 4;
  DP_EXPECT_STATUS(dp_bundle_open(bundles().tiny.c_str(), &o, &b), DP_ERR_INVALID_ARGUMENT,
                   "dp_bundle_open_options.size is 4", "call dp_bundle_open_options_init");
  o.size = sizeof(o);
  o.flags = 3;
  DP_EXPECT_STATUS(dp_bundle_open(bundles().tiny.c_str(), &o, &b), DP_ERR_INVALID_ARGUMENT, "flags 0x3, expected 0");
}

TEST_F(CApiTest, NewerCallersStructIsAcceptedWhenItsTailIsZero) {
  // A program built against a later header passes a longer struct; fields this library does not know
  // must be at their zero defaults.
  struct Longer {
    dp_session_options o;
    uint64_t future_field;
  } l;
  std::memset(&l, 0, sizeof(l));
  dp_session_options_init(&l.o);
  l.o.size = sizeof(l);
  l.o.device = DP_DEVICE_NONE;
  dp_session* s = nullptr;
  DP_EXPECT_OK(dp_session_create(b_, &l.o, &s));
  dp_session_destroy(s);
  l.future_field = 1;
  DP_EXPECT_STATUS(dp_session_create(b_, &l.o, &s), DP_ERR_INVALID_ARGUMENT, "dp_session_options.size is",
                   "sets fields it does not implement");
  EXPECT_EQ(s, nullptr);
}

TEST_F(CApiTest, OlderCallersStructGetsDefaults) {
  // A program built against an earlier header knew only the fields up to `rank`: the rest defaults.
  dp_session_options o;
  dp_session_options_init(&o);
  o.device = DP_DEVICE_NONE;
  o.tensor_parallel = 99;  // beyond the old size: must be ignored
  o.size = offsetof(dp_session_options, tensor_parallel);
  dp_session* s = nullptr;
  DP_EXPECT_OK(dp_session_create(b_, &o, &s));
  dp_session_destroy(s);
}

TEST_F(CApiTest, BundleInfo) {
  dp_bundle_info i;
  i.size = sizeof(i);
  DP_EXPECT_OK(dp_bundle_get_info(b_, &i));
  EXPECT_EQ(i.format_major, 1);
  EXPECT_EQ(i.format_minor, 5);
  EXPECT_EQ(i.indexer_heads, 0);  // kimi-linear has no sparse-attention indexer
  EXPECT_EQ(i.indexer_prefill_workspace_bytes, 0u);
  EXPECT_EQ(std::string(i.digest).rfind("sha256:", 0), 0u);
  EXPECT_STREQ(i.model_type, "kimi_linear");
  EXPECT_EQ(i.num_layers, 4);
  EXPECT_EQ(i.hidden_size, 256);
  EXPECT_DOUBLE_EQ(i.rms_norm_eps, 1e-5);
  EXPECT_EQ(i.tensor_parallel, 1);
  ASSERT_EQ(i.num_ranks, 1);
  EXPECT_EQ(i.ranks[0], 0);
  ASSERT_EQ(i.num_widths, 8);
  for (int w = 0; w < 8; ++w) EXPECT_EQ(i.widths[w], w + 1);
  EXPECT_EQ(i.q, 1);
  ASSERT_EQ(i.num_targets, 2);
  EXPECT_STREQ(i.targets[0], "gfx942");
  EXPECT_STREQ(i.targets[1], "sm_90a");
  EXPECT_EQ(i.weights_fingerprinted, 1);
  // What a host needs without opening the bundle again: the model config's digest, the deploy block
  // and manifest.json itself (whose sha256 is the bundle digest).
  ASSERT_NE(i.config_digest, nullptr);
  EXPECT_EQ(std::string(i.config_digest).rfind("sha256:", 0), 0u);
  EXPECT_EQ(std::strlen(i.config_digest), 7u + 64u);
  ASSERT_NE(i.deploy_json, nullptr);
  const auto deploy = nlohmann::json::parse(i.deploy_json);
  EXPECT_EQ(deploy.at("tensor_parallel"), 1);
  EXPECT_EQ(deploy.at("targets"), nlohmann::json::parse(R"(["gfx942", "sm_90a"])"));
  ASSERT_NE(i.manifest_json, nullptr);
  const auto manifest = nlohmann::json::parse(i.manifest_json);
  EXPECT_EQ(manifest.at("deploy"), deploy);
  EXPECT_EQ(manifest.at("model").at("config_digest"), i.config_digest);
  EXPECT_EQ(i.vocab_size, manifest.at("model").at("vocab_size").get<int64_t>());
  EXPECT_GT(i.vocab_size, 0);
  EXPECT_EQ(dp::format::sha256_hex({reinterpret_cast<const uint8_t*>(i.manifest_json), std::strlen(i.manifest_json)}),
            std::string(i.digest).substr(7));
}

TEST_F(CApiTest, OutputStructsRespectTheCallersSize) {
  // An older caller's dp_bundle_info ended before `digest`: nothing past its size may be written.
  unsigned char raw[sizeof(dp_bundle_info)];
  std::memset(raw, 0xAB, sizeof(raw));
  auto* i = reinterpret_cast<dp_bundle_info*>(raw);
  i->size = offsetof(dp_bundle_info, digest);
  DP_EXPECT_OK(dp_bundle_get_info(b_, i));
  EXPECT_EQ(i->format_major, 1);
  for (size_t k = offsetof(dp_bundle_info, digest); k < sizeof(raw); ++k) ASSERT_EQ(raw[k], 0xAB) << k;
  i->size = 0;
  DP_EXPECT_STATUS(dp_bundle_get_info(b_, i), DP_ERR_INVALID_ARGUMENT, "out->size is 0");
}

TEST_F(CApiTest, LayersAndWeights) {
  dp_layer_info l;
  l.size = sizeof(l);
  DP_EXPECT_OK(dp_bundle_get_layer(b_, 0, &l));
  EXPECT_EQ(l.mixer, DP_MIXER_KDA);
  EXPECT_STREQ(l.layer_class, "kda_dense");
  DP_EXPECT_OK(dp_bundle_get_layer(b_, 3, &l));
  EXPECT_EQ(l.mixer, DP_MIXER_MLA);
  EXPECT_STREQ(l.ffn, "moe");
  DP_EXPECT_STATUS(dp_bundle_get_layer(b_, 4, &l), DP_ERR_INVALID_ARGUMENT, "layer 4, expected 0..3");

  EXPECT_EQ(dp_bundle_weight_count(b_, 0), 86);
  EXPECT_EQ(dp_bundle_weight_count(b_, 1), -1);
  bool group = false, norm = false;
  for (int32_t i = 0; i < 86; ++i) {
    dp_weight_info w;
    w.size = sizeof(w);
    DP_EXPECT_OK(dp_bundle_get_weight(b_, 0, i, &w));
    if (std::string(w.name) == "model.layers.1.block_sparse_moe.experts.{e}.w1.weight") {
      group = true;
      EXPECT_EQ(w.experts, 16);
      EXPECT_EQ(w.ndim, 2);
      EXPECT_EQ(w.shape[0], 128);
      EXPECT_EQ(w.shape[1], 256);
      EXPECT_EQ(w.dtype, DP_DTYPE_BF16);
      EXPECT_EQ(w.layer, 1);
    }
    if (std::string(w.name) == "model.norm.weight") {
      norm = true;
      EXPECT_EQ(w.layer, -1);
    }
  }
  EXPECT_TRUE(group);
  EXPECT_TRUE(norm);
  dp_weight_info w;
  w.size = sizeof(w);
  DP_EXPECT_STATUS(dp_bundle_get_weight(b_, 0, 86, &w), DP_ERR_INVALID_ARGUMENT, "index 86", "0..85");
  DP_EXPECT_STATUS(dp_bundle_get_weight(b_, 2, 0, &w), DP_ERR_RANK, "rank 2 is not in the bundle");
}

TEST_F(CApiTest, OpenErrorsCarryTheirCodes) {
  dp_bundle* b = nullptr;
  DP_EXPECT_STATUS(dp_bundle_open("/nonexistent/x.dpk", nullptr, &b), DP_ERR_IO, "/nonexistent/x.dpk", "no such bundle");
  const fs::path d = fs::temp_directory_path() / ("dp-capi-" + std::to_string(::getpid()));
  fs::remove_all(d);
  fs::copy(bundles().tiny_dir, d, fs::copy_options::recursive);
  std::string m = read_text(d / "manifest.json");
  const std::string v = "\"format_version\":{\"major\":1,\"minor\":5}";
  m.replace(m.find(v), v.size(), "\"format_version\":{\"major\":2,\"minor\":1}");
  write_text(d / "manifest.json", m);
  DP_EXPECT_STATUS(dp_bundle_open(d.c_str(), nullptr, &b), DP_ERR_FORMAT_VERSION, "2.1", "supported: 1.0 to 1.9");
  m.replace(m.find("\"major\":2"), 9, "\"major\":1");
  const std::string field = "\"hidden_size\":256,";
  m.erase(m.find(field), field.size());
  write_text(d / "manifest.json", m);
  DP_EXPECT_STATUS(dp_bundle_open(d.c_str(), nullptr, &b), DP_ERR_FORMAT, "missing field model.hidden_size");
  fs::remove_all(d);
  fs::copy(bundles().tiny_dir, d, fs::copy_options::recursive);
  write_text(d / "kernels/sm_90a/prefetch_b32.sm_90a.cubin", "tampered");
  DP_EXPECT_STATUS(dp_bundle_open(d.c_str(), nullptr, &b), DP_ERR_INTEGRITY, "prefetch_b32.sm_90a.cubin");
  EXPECT_EQ(b, nullptr);
  fs::remove_all(d);
}

TEST_F(CApiTest, SessionsKeepTheBundleAlive) {
  dp_bundle* b = nullptr;
  DP_EXPECT_OK(dp_bundle_open(bundles().tiny.c_str(), nullptr, &b));
  dp_session_options o = host_options();
  dp_session* s = nullptr;
  DP_EXPECT_OK(dp_session_create(b, &o, &s));
  dp_bundle_close(b);  // the session still holds it
  EXPECT_STREQ(dp_session_target(s), "gfx942");
  const Outcome bound = bind_all_weights(b_, s, 0);  // b_: another handle of the same bundle
  EXPECT_TRUE(bound.ok()) << bound.message;
  DP_EXPECT_OK(dp_session_finalize_weights(s));
  dp_tensor t;
  DP_EXPECT_OK(dp_session_kv_layout(s, 0, DP_KV_KDA_STATE, 4, &t));
  dp_session_destroy(s);
}

TEST_F(CApiTest, CppWrapper) {
  auto bundle = decodepack::Bundle::open(bundles().tiny.string());
  EXPECT_EQ(bundle.info().num_layers, 4);
  EXPECT_EQ(bundle.weights(0).size(), 86u);
  EXPECT_EQ(bundle.layer(3).mixer, DP_MIXER_MLA);
  try {
    decodepack::Bundle::open("/nonexistent.dpk");
    ADD_FAILURE() << "no exception";
  } catch (const decodepack::Error& e) {
    EXPECT_EQ(e.code(), DP_ERR_IO);
    EXPECT_STREQ(e.code_name(), "DP_ERR_IO");
  }
  decodepack::SessionOptions o;
  o.c.device = DP_DEVICE_NONE;
  decodepack::Session s(bundle, o);
  try {
    s.bind_weight("model.nope", decodepack::tensor(0x1000, DP_DTYPE_BF16, {256}));
    ADD_FAILURE() << "no exception";
  } catch (const decodepack::Error& e) {
    EXPECT_EQ(e.code(), DP_ERR_UNKNOWN_TENSOR);
  }
  ASSERT_TRUE(bind_all_weights(bundle.get(), s.get(), 0).ok());
  s.finalize_weights();
  dp_step_desc d;
  dp_step_desc_init(&d);
  d.num_requests = 2;
  decodepack::Plan p = s.plan(d);
  EXPECT_EQ(p.reason(), DP_REASON_NO_KV);
  ASSERT_TRUE(bind_all_kv(bundle.get(), s.get(), 16, 16).ok());
  p = s.plan(d);
  EXPECT_EQ(p.reason(), DP_REASON_NONE) << p.message();
  EXPECT_EQ(p.width(), 2);
  EXPECT_TRUE(p.layer_kernel(0));
  decodepack::Session moved = std::move(s);
  EXPECT_EQ(s.get(), nullptr);
  EXPECT_NE(moved.get(), nullptr);
  EXPECT_EQ(moved.exchange_bytes(), 0u);  // TP 1

  // Tensor parallelism: the exchange buffers of a TP 2 bundle.
  auto tp2 = decodepack::Bundle::open(bundles().tp2.string());
  o.c.rank = 1;
  decodepack::Session r1(tp2, o);
  EXPECT_GT(r1.exchange_bytes(), 0u);
  try {
    r1.set_peers({0x7f0000100000ull}, 1000);
    ADD_FAILURE() << "no exception";
  } catch (const decodepack::Error& e) {
    EXPECT_EQ(e.code(), DP_ERR_INVALID_ARGUMENT);
    EXPECT_NE(std::string(e.what()).find("1 exchange buffers, expected 2"), std::string::npos) << e.what();
  }
  r1.set_peers({0x7f0000100000ull, 0x7f0000200000ull}, 1000);
}

}  // namespace
}  // namespace dp::rttest
