#include <gtest/gtest.h>

#include <fstream>

#include "common/embedded.h"
#include "model/ir.h"
#include "../test_util.h"

namespace dp::model {
namespace {

Json preset_json(const std::string& name) { return parse_json(*embedded_file("presets/" + name + ".json"), name); }

TEST(Config, Kimi48bLayersMatchTheReleasedPattern) {
  Model m = load_model("kimi-linear-48b-a3b");
  EXPECT_EQ(m.type, ModelType::kimi_linear);
  EXPECT_EQ(m.prefix, "model.");
  ASSERT_EQ(m.layers.size(), 27u);
  EXPECT_EQ(m.count(Mixer::kda), 20);
  EXPECT_EQ(m.count(Mixer::mla), 7);
  // full_attn_layers [4,8,...,24,27] are 1-based: 0-based 3, 7, ..., 23, 26.
  for (int i : {3, 7, 11, 15, 19, 23, 26}) EXPECT_EQ(m.layers[i].mixer, Mixer::mla) << i;
  for (int i : {0, 1, 2, 4, 25}) EXPECT_EQ(m.layers[i].mixer, Mixer::kda) << i;
  EXPECT_EQ(m.layers[0].ffn, Ffn::dense);
  for (int i = 1; i < 27; ++i) EXPECT_EQ(m.layers[i].ffn, Ffn::moe) << i;
  EXPECT_EQ(m.kda.projection_size(), 4096);
  EXPECT_EQ(m.mla.cache_row(), 576);
}

TEST(Config, Kimi48bWeightShapesDtypesAndSplits) {
  Model m = load_model("kimi-linear-48b-a3b");
  const WeightSpec* q = m.find("model.layers.0.self_attn.q_proj.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->shape, (std::vector<int64_t>{4096, 2304}));
  EXPECT_EQ(q->split, Split::along(0));
  const WeightSpec* alog = m.find("model.layers.1.self_attn.A_log");
  ASSERT_NE(alog, nullptr);
  EXPECT_EQ(alog->shape, (std::vector<int64_t>{1, 1, 32, 1}));
  EXPECT_EQ(alog->dtype, DType::F32);
  EXPECT_EQ(alog->split, Split::along(2));
  const WeightSpec* conv = m.find("model.layers.1.self_attn.k_conv1d.weight");
  ASSERT_NE(conv, nullptr);
  EXPECT_EQ(conv->shape, (std::vector<int64_t>{4096, 1, 4}));
  EXPECT_EQ(conv->dtype, DType::F32);
  const WeightSpec* o = m.find("model.layers.3.self_attn.o_proj.weight");
  ASSERT_NE(o, nullptr);
  EXPECT_EQ(o->shape, (std::vector<int64_t>{2304, 4096}));
  EXPECT_EQ(o->split, Split::along(1));
  const WeightSpec* kvb = m.find("model.layers.3.self_attn.kv_b_proj.weight");
  ASSERT_NE(kvb, nullptr);
  EXPECT_EQ(kvb->shape, (std::vector<int64_t>{8192, 512}));
  const WeightSpec* w2 = m.find("model.layers.26.block_sparse_moe.experts.255.w2.weight");
  ASSERT_NE(w2, nullptr);
  EXPECT_EQ(w2->shape, (std::vector<int64_t>{2304, 1024}));
  EXPECT_EQ(w2->expert, 255);
  EXPECT_EQ(w2->split, Split::along(1));
  const WeightSpec* up = m.find("model.layers.0.mlp.up_proj.weight");
  ASSERT_NE(up, nullptr);
  ASSERT_EQ(up->aliases.size(), 1u);
  EXPECT_EQ(up->aliases[0], "model.layers.0.block_sparse_moe.up_proj.weight");
  EXPECT_EQ(m.find("model.layers.0.block_sparse_moe.gate.weight"), nullptr);
  ASSERT_NE(m.find("lm_head.weight"), nullptr);
  EXPECT_FALSE(m.find("lm_head.weight")->decode);
  // 26 MoE layers x 256 experts x 3 matrices of 1024 x 2304: the ~47.1 B expert parameters.
  uint64_t expert_params = 0;
  for (const WeightSpec& w : m.weights)
    if (w.expert >= 0) expert_params += static_cast<uint64_t>(w.numel());
  EXPECT_EQ(expert_params, 26ull * 256 * 3 * 1024 * 2304);
}

TEST(Config, KimiK3TextConfigPrefixLatentMoeAndMxfp4) {
  Model m = load_model("kimi-k3");
  EXPECT_EQ(m.type, ModelType::kimi_k3);
  EXPECT_EQ(m.prefix, "language_model.model.");
  ASSERT_EQ(m.layers.size(), 93u);
  EXPECT_EQ(m.count(Mixer::mla), 24);
  EXPECT_EQ(m.layers[91].mixer, Mixer::mla);  // 92 and 93 (1-based) are both MLA
  EXPECT_EQ(m.layers[92].mixer, Mixer::mla);
  EXPECT_EQ(m.layers[1].ffn, Ffn::latent_moe);
  EXPECT_EQ(m.moe.expert_format, ExpertFormat::mxfp4);
  EXPECT_EQ(m.activation, Activation::situ);
  EXPECT_TRUE(m.kda.full_rank_gate);
  ASSERT_TRUE(m.kda.gate_lower_bound.has_value());
  EXPECT_DOUBLE_EQ(*m.kda.gate_lower_bound, -5.0);
  const std::string l1 = "language_model.model.layers.1.";
  ASSERT_NE(m.find(l1 + "self_attn.g_proj.weight"), nullptr);
  EXPECT_EQ(m.find(l1 + "self_attn.g_a_proj.weight"), nullptr);
  EXPECT_EQ(m.find(l1 + "self_attn.A_log")->shape, (std::vector<int64_t>{128}));
  const WeightSpec* w1 = m.find(l1 + "block_sparse_moe.experts.7.w1.weight_packed");
  ASSERT_NE(w1, nullptr);
  EXPECT_EQ(w1->shape, (std::vector<int64_t>{3072, 1792}));
  EXPECT_EQ(w1->dtype, DType::U8);
  EXPECT_EQ(m.find(l1 + "block_sparse_moe.experts.7.w1.weight_scale")->shape, (std::vector<int64_t>{3072, 112}));
  EXPECT_EQ(m.find(l1 + "block_sparse_moe.experts.7.w2.weight_packed")->shape, (std::vector<int64_t>{3584, 1536}));
  EXPECT_EQ(m.find(l1 + "block_sparse_moe.routed_expert_down_proj.weight")->shape,
            (std::vector<int64_t>{3584, 7168}));
  EXPECT_EQ(m.find(l1 + "self_attention_res_proj.weight")->shape, (std::vector<int64_t>{1, 7168}));
  const std::string l3 = "language_model.model.layers.3.";  // MLA with q-LoRA and output gate
  EXPECT_EQ(m.find(l3 + "self_attn.q_b_proj.weight")->shape, (std::vector<int64_t>{18432, 1536}));
  EXPECT_EQ(m.find(l3 + "self_attn.g_proj.weight")->shape, (std::vector<int64_t>{12288, 7168}));
  ASSERT_NE(m.find("language_model.lm_head.weight"), nullptr);
  ASSERT_NE(m.find("language_model.model.output_attn_res_proj.weight"), nullptr);
  EXPECT_TRUE(m.layers[0].attn_res_push);
  EXPECT_TRUE(m.layers[12].attn_res_push);
  EXPECT_FALSE(m.layers[13].attn_res_push);
}

TEST(Config, TransformersLayerTypesGiveTheSameLayers) {
  Json hub = preset_json("kimi-linear-tiny");
  Json hf = hub;
  hf.erase("linear_attn_config");
  hf["linear_num_heads"] = 2;
  hf["linear_head_dim"] = 128;
  hf["linear_conv_kernel_dim"] = 4;
  hf["layer_types"] = {"linear_attention", "linear_attention", "linear_attention", "full_attention"};
  hf["mlp_layer_types"] = {"dense", "sparse", "sparse", "sparse"};
  Model a = model_from_config(hub, "hub.json"), b = model_from_config(hf, "hf.json");
  ASSERT_EQ(a.layers.size(), b.layers.size());
  for (size_t i = 0; i < a.layers.size(); ++i) {
    EXPECT_EQ(a.layers[i].mixer, b.layers[i].mixer);
    EXPECT_EQ(a.layers[i].ffn, b.layers[i].ffn);
  }
  ASSERT_EQ(a.weights.size(), b.weights.size());
  for (size_t i = 0; i < a.weights.size(); ++i) EXPECT_EQ(a.weights[i].name, b.weights[i].name);
}

TEST(Config, LayerTypesMustAgreeWithLinearAttnConfig) {
  Json j = preset_json("kimi-linear-tiny");
  j["layer_types"] = {"linear_attention", "full_attention", "linear_attention", "full_attention"};
  test::expect_error([&] { model_from_config(j, "cfg.json"); }, Errc::input,
                     {"cfg.json", "layer_types[1]", "full_attention", "kda"});
}

TEST(Config, IntegerFieldsRefuseNumbersBeyondInt64) {
  // A float that is a whole number is an integer; one beyond int64 (found by the config fuzzer: 2.5e90
  // was cast to int64, undefined behaviour) is refused like any other non-integer.
  Json j = preset_json("kimi-linear-tiny");
  j["hidden_size"] = 256.0;
  EXPECT_EQ(model_from_config(j, "cfg.json").hidden, 256);
  for (double bad : {2.5e90, -2.5e90, 9223372036854775808.0, 0.5}) {
    SCOPED_TRACE(bad);
    j["hidden_size"] = bad;
    test::expect_error([&] { model_from_config(j, "cfg.json"); }, Errc::input, {"cfg.json", "hidden_size", "integer"});
  }
}

TEST(Config, DigestIsOfTheCanonicalJson) {
  Json j = preset_json("kimi-linear-tiny");
  Json reordered = Json::parse(j.dump(4));
  EXPECT_EQ(model_from_config(j, "a").config_digest, model_from_config(reordered, "b").config_digest);
  j["rms_norm_eps"] = 1e-6;
  EXPECT_NE(model_from_config(j, "a").config_digest, model_from_config(reordered, "b").config_digest);
}

TEST(Config, UnknownPresetListsPresets) {
  test::expect_error([] { load_model("kimi-nonexistent"); }, Errc::usage,
                     {"--model kimi-nonexistent", "kimi-linear-48b-a3b", "kimi-k3-tiny"});
  test::expect_error([] { load_model("kimi-linear-tiyn", "--preset"); }, Errc::usage,
                     {"--preset kimi-linear-tiyn", "did you mean kimi-linear-tiny?"});
}

// tests/corpus/config/expected.txt: "<file>\t<fragment>[\t<fragment>...]", one broken config per line.
TEST(Config, BrokenCorpus) {
  const auto dir = test::data_dir() / "corpus" / "config";
  std::ifstream list(dir / "expected.txt");
  ASSERT_TRUE(list) << "missing " << (dir / "expected.txt");
  std::string line;
  int cases = 0;
  while (std::getline(list, line)) {
    if (line.empty() || line[0] == '#') continue;
    std::vector<std::string> parts;
    size_t start = 0, tab;
    while ((tab = line.find('\t', start)) != std::string::npos) parts.push_back(line.substr(start, tab - start)), start = tab + 1;
    parts.push_back(line.substr(start));
    SCOPED_TRACE(parts[0]);
    try {
      load_model((dir / parts[0]).string());
      ADD_FAILURE() << parts[0] << ": accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::input) << e.what();
      for (size_t i = 1; i < parts.size(); ++i)
        EXPECT_NE(std::string(e.what()).find(parts[i]), std::string::npos) << e.what() << "\nlacks: " << parts[i];
      // A message quotes input through excerpt(): a 100 KB value appears cut, never whole.
      EXPECT_LT(std::string(e.what()).size(), 1000u) << std::string(e.what()).substr(0, 1000);
    }
    ++cases;
  }
  EXPECT_GE(cases, 10);
}

}  // namespace
}  // namespace dp::model
