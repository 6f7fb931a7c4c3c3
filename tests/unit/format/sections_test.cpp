// The manifest's typed sections (runtime/format/sections.h): `deploy` and `model.details` go
// struct -> JSON -> struct unchanged, every bound is refused by a message naming the field, and the
// sections the compiler writes (deploy::to_json, bundle::manifest_details) are exactly what the
// runtime's reader returns, for every preset and every deploy file the tests use.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "bundle/build.h"
#include "common/json.h"
#include "deploy/deploy.h"
#include "format/sections.h"
#include "model/ir.h"
#include "../test_util.h"

namespace dp::format {
namespace {

const std::string kWhere = "x.dpk: manifest.json";

Deploy full_deploy() {
  Deploy d;
  d.targets = {"gfx942", "sm_90a"};
  d.tensor_parallel = 8;
  d.ranks = {0, 3, 7};
  d.widths = {1, 2, 8, 64};
  d.num_speculative_tokens = 3;
  d.kv_cache = {KvCacheDtype::fp8, 128};
  d.kda_state = {KdaStateDtype::float32, KdaStateLayout::vk};
  d.conv_state = {ConvStateDtype::float32, ConvStateLayout::ds};
  d.dcp = {4, 32};
  d.prefetch.enabled = false;
  d.prefetch.cap_bytes = 1 << 20;
  d.prefetch.max_rows = 16;
  d.prefetch.width_cap_bytes = {{2, 0}, {64, 4096}};
  d.prefetch.points = {"oproj_down", "next_attention"};
  d.indexer = {12345, 17};
  return d;
}

ModelDetails full_details() {
  ModelDetails d;
  d.prefix = "language_model.model.";
  d.activation = "situ";
  d.attn_res_block = 12;
  d.dense_intermediate = 33792;
  d.kda = {96, 128, 4, 128, true, -5.0};
  d.mla = {96, 1536, 512, 128, 64, 128, true};
  d.moe = {896, 8, 3072, 2, 2.446, true, 3584, "mxfp4"};
  return d;
}

TEST(Sections, DeployRoundTripsThroughJson) {
  const Deploy d = full_deploy();
  EXPECT_EQ(deploy_from_json(to_json(d), kWhere), d);
  Deploy plain;  // defaults plus what every deploy has
  plain.targets = {"sm_90a"};
  plain.ranks = {0};
  plain.widths = {1};
  EXPECT_EQ(deploy_from_json(to_json(plain), kWhere), plain);
}

TEST(Sections, ModelDetailsRoundTripThroughJson) {
  const ModelDetails d = full_details();
  EXPECT_EQ(details_from_json(to_json(d), kWhere), d);
  ModelDetails no_bound = d;
  no_bound.kda.gate_lower_bound.reset();
  const Json j = to_json(no_bound);
  EXPECT_FALSE(j["kda"].contains("gate_lower_bound"));
  EXPECT_EQ(details_from_json(j, kWhere), no_bound);
}

// Manifests before format 1.4 have no prefetch.points; the reader takes them as none.
TEST(Sections, DeployBeforePrefetchPointsReadsAsNoPoints) {
  Json j = to_json(full_deploy());
  j["prefetch"].erase("points");
  EXPECT_TRUE(deploy_from_json(j, kWhere).prefetch.points.empty());
}

void expect_refused(const Json& j, bool details, const std::vector<std::string>& fragments) {
  try {
    if (details) details_from_json(j, kWhere);
    else deploy_from_json(j, kWhere);
    ADD_FAILURE() << "accepted " << j.dump();
  } catch (const FormatError& e) {
    EXPECT_EQ(e.kind, FormatError::Kind::schema);
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(kWhere, 0), 0u) << msg;
    for (const std::string& f : fragments) EXPECT_NE(msg.find(f), std::string::npos) << "no \"" << f << "\" in: " << msg;
  }
}

struct Case {
  Json patch;                          // merged into the valid section
  std::vector<std::string> fragments;  // the field, the value, the bound
};

TEST(Sections, EveryDeployBoundIsRefusedNamingTheField) {
  const Json base = to_json(full_deploy());  // tensor_parallel 8, block 128, dcp 4 x 32
  const std::vector<Case> cases = {
      {{{"tensor_parallel", 16}}, {"deploy.tensor_parallel", "16", "1..8"}},
      {{{"tensor_parallel", 0}}, {"deploy.tensor_parallel", "0", "1..8"}},
      {{{"tensor_parallel", 6}, {"dcp", {{"size", 1}}}}, {"deploy.tensor_parallel", "6", "power of two"}},
      {{{"ranks", {0, 8}}}, {"deploy.ranks[1]", "8", "0..7"}},
      {{{"ranks", Json::array()}}, {"deploy.ranks", "empty"}},
      {{{"ranks", {3, 1}}}, {"deploy.ranks", "sorted"}},
      {{{"widths", {1, 65}}}, {"deploy.widths[1]", "65", "1..64"}},
      {{{"widths", {0, 1}}}, {"deploy.widths[0]", "0", "1..64"}},
      {{{"widths", {2, 2}}}, {"deploy.widths", "each once"}},
      {{{"widths", {1, 2.0}}}, {"deploy.widths[1]", "expected an integer"}},
      {{{"num_speculative_tokens", 8}}, {"deploy.num_speculative_tokens", "8", "0..7"}},
      {{{"num_speculative_tokens", -1}}, {"deploy.num_speculative_tokens", "-1", "0..7"}},
      {{{"kv_cache", {{"block_size", 8}}}}, {"deploy.kv_cache.block_size", "8", "16..65536"}},
      {{{"kv_cache", {{"block_size", 65536 + 16}}}}, {"deploy.kv_cache.block_size", "65552", "16..65536"}},
      {{{"kv_cache", {{"block_size", 136}}}}, {"deploy.kv_cache.block_size", "136", "multiple of 16"}},
      {{{"kv_cache", {{"dtype", "fp8_e5m2"}}}}, {"deploy.kv_cache.dtype", "fp8_e5m2", "bf16, fp8"}},
      {{{"kda_state", {{"dtype", "bf16"}}}}, {"deploy.kda_state.dtype", "bf16", "float32"}},
      {{{"kda_state", {{"layout", "KV"}}}}, {"deploy.kda_state.layout", "KV", "kv, vk"}},
      {{{"conv_state", {{"dtype", "fp16"}}}}, {"deploy.conv_state.dtype", "fp16", "bf16, float32"}},
      {{{"conv_state", {{"layout", "xy"}}}}, {"deploy.conv_state.layout", "xy", "sd, ds"}},
      {{{"dcp", {{"size", 16}}}}, {"deploy.dcp.size", "16", "1..8"}},
      {{{"tensor_parallel", 2}, {"ranks", {0, 1}}, {"dcp", {{"size", 4}}}}, {"deploy.dcp.size", "4", "tensor_parallel 2"}},
      {{{"dcp", {{"interleave", 0}}}}, {"deploy.dcp.interleave", "0", "1..65536"}},
      {{{"dcp", {{"interleave", 48}}}}, {"deploy.dcp.interleave", "48", "block_size 128"}},
      {{{"prefetch", {{"cap_bytes", (int64_t{1} << 30) + 1}}}}, {"deploy.prefetch.cap_bytes", "1073741825", "0..1073741824"}},
      {{{"prefetch", {{"max_rows", 513}}}}, {"deploy.prefetch.max_rows", "513", "0..512"}},
      {{{"prefetch", {{"width_cap_bytes", {{"3", 1}}}}}}, {"deploy.prefetch.width_cap_bytes", "\"3\"", "widths"}},
      {{{"prefetch", {{"width_cap_bytes", {{"2", -1}}}}}}, {"deploy.prefetch.width_cap_bytes.2", "-1", "0..1073741824"}},
      {{{"prefetch", {{"points", {"next_attention", "oproj_down"}}}}}, {"deploy.prefetch.points[1]", "oproj_down", "in that order"}},
      {{{"prefetch", {{"points", {"everywhere"}}}}}, {"deploy.prefetch.points[0]", "everywhere", "attention_oproj"}},
      {{{"prefetch", {{"enabled", 1}}}}, {"deploy.prefetch.enabled", "true or false"}},
      {{{"indexer", {{"max_keys_per_chunk", 0}}}}, {"deploy.indexer.max_keys_per_chunk", "0", "1..2147483584"}},
      {{{"indexer", {{"max_keys_per_chunk", kMaxIndexerKeys + 1}}}}, {"deploy.indexer.max_keys_per_chunk", "2147483585"}},
      {{{"indexer", {{"max_requests", kMaxIndexerLimit + 1}}}}, {"deploy.indexer.max_requests", "2147483648", "1..2147483647"}},
      {{{"targets", {"sm_90a", "sm_99"}}}, {"deploy.targets[1]", "sm_99", "sm_90a"}},
      {{{"targets", {"sm_90a", "gfx942"}}}, {"deploy.targets[1]", "gfx942", "sorted"}},
      {{{"targets", Json::array()}}, {"deploy.targets", "empty"}},
      {{{"max_num_seqs", 4}}, {"unknown field deploy.max_num_seqs"}},
      {{{"kv_cache", {{"scale", 1}}}}, {"unknown field deploy.kv_cache.scale"}},
  };
  for (const Case& c : cases) {
    Json j = base;
    j.merge_patch(c.patch);
    SCOPED_TRACE(c.patch.dump());
    expect_refused(j, false, c.fragments);
    expect_refused(Json::parse(j.dump()), false, c.fragments);  // as read from a file: unsigned integers
  }
  for (const char* key : {"targets", "tensor_parallel", "ranks", "widths", "num_speculative_tokens", "kv_cache",
                          "kda_state", "conv_state", "dcp", "prefetch", "indexer"}) {
    Json j = base;
    j.erase(key);
    SCOPED_TRACE(key);
    expect_refused(j, false, {std::string("missing field deploy.") + key});
  }
}

TEST(Sections, EveryDetailsBoundIsRefusedNamingTheField) {
  const Json base = to_json(full_details());
  const int64_t big = kMaxModelDim + 1;
  const std::vector<Case> cases = {
      {{{"activation", "gelu"}}, {"model.details.activation", "gelu", "silu, situ"}},
      {{{"attn_res_block", -1}}, {"model.details.attn_res_block", "-1"}},
      {{{"dense_intermediate", big}}, {"model.details.dense_intermediate", std::to_string(big)}},
      {{{"kda", {{"num_heads", big}}}}, {"model.details.kda.num_heads", std::to_string(big)}},
      {{{"kda", {{"head_dim", -1}}}}, {"model.details.kda.head_dim", "-1"}},
      {{{"kda", {{"conv_kernel", 65}}}}, {"model.details.kda.conv_kernel", "65", "0..64"}},
      {{{"kda", {{"gate_rank", big}}}}, {"model.details.kda.gate_rank"}},
      {{{"kda", {{"full_rank_gate", "yes"}}}}, {"model.details.kda.full_rank_gate", "true or false"}},
      {{{"kda", {{"gate_lower_bound", "low"}}}}, {"model.details.kda.gate_lower_bound", "a number"}},
      {{{"mla", {{"num_heads", big}}}}, {"model.details.mla.num_heads"}},
      {{{"mla", {{"q_lora_rank", -2}}}}, {"model.details.mla.q_lora_rank", "-2"}},
      {{{"mla", {{"kv_lora_rank", big}}}}, {"model.details.mla.kv_lora_rank"}},
      {{{"mla", {{"qk_nope_head_dim", big}}}}, {"model.details.mla.qk_nope_head_dim"}},
      {{{"mla", {{"qk_rope_head_dim", -1}}}}, {"model.details.mla.qk_rope_head_dim"}},
      {{{"mla", {{"v_head_dim", big}}}}, {"model.details.mla.v_head_dim"}},
      {{{"mla", {{"output_gate", 0}}}}, {"model.details.mla.output_gate"}},
      {{{"moe", {{"num_experts", kMaxExperts + 1}}}}, {"model.details.moe.num_experts", std::to_string(kMaxExperts + 1)}},
      {{{"moe", {{"top_k", 897}}}}, {"model.details.moe.top_k", "897", "0..896"}},
      {{{"moe", {{"intermediate", big}}}}, {"model.details.moe.intermediate"}},
      {{{"moe", {{"num_shared", -1}}}}, {"model.details.moe.num_shared"}},
      {{{"moe", {{"routed_scaling", "2"}}}}, {"model.details.moe.routed_scaling", "a number"}},
      {{{"moe", {{"renormalize", nullptr}}}}, {"missing field model.details.moe.renormalize"}},
      {{{"moe", {{"latent_dim", kMaxHiddenSize + 1}}}}, {"model.details.moe.latent_dim"}},
      {{{"moe", {{"expert_format", "fp4"}}}}, {"model.details.moe.expert_format", "fp4", "bf16, mxfp4"}},
      {{{"prefix", 1}}, {"model.details.prefix", "a string"}},
      {{{"extra", 1}}, {"unknown field model.details.extra"}},
  };
  for (const Case& c : cases) {
    Json j = base;
    j.merge_patch(c.patch);
    SCOPED_TRACE(c.patch.dump());
    expect_refused(j, true, c.fragments);
    expect_refused(Json::parse(j.dump()), true, c.fragments);
  }
}

// The writer and the reader share the type: what the bundle writer records for every preset and every
// deploy file of the tests is read back by the runtime's reader into the same values, and writing those
// again gives the same JSON (so the manifest bytes do not depend on which side wrote them).
TEST(Sections, TheCompilersSectionsAreWhatTheRuntimeReads) {
  for (const std::string& preset : model::preset_names()) {
    SCOPED_TRACE(preset);
    const model::Model m = model::load_model(preset);
    const ModelDetails written = bundle::manifest_details(m);
    const Json j = to_json(written);
    const ModelDetails read = details_from_json(j, kWhere);
    EXPECT_EQ(read, written);
    EXPECT_EQ(to_json(read).dump(), j.dump());
    EXPECT_EQ(read.moe.expert_format, model::to_string(m.moe.expert_format));
    EXPECT_EQ(read.kda.num_heads, m.kda.num_heads);
    EXPECT_EQ(read.mla.kv_lora_rank, m.mla.kv_lora_rank);
  }
  std::vector<std::string> deploys = {"default"};
  for (const auto& e : std::filesystem::directory_iterator(test::data_dir() / "cli"))
    if (e.path().filename().string().starts_with("deploy-") && e.path().extension() == ".json")
      deploys.push_back(e.path().string());
  ASSERT_GT(deploys.size(), 5u);
  for (const std::string& spec : deploys) {
    SCOPED_TRACE(spec);
    const deploy::Deploy d = deploy::load_deploy(spec);
    const Json j = deploy::to_json(d);
    const Deploy read = deploy_from_json(j, kWhere);
    EXPECT_EQ(read, d);
    EXPECT_EQ(to_json(read).dump(), j.dump());
  }
}

}  // namespace
}  // namespace dp::format
