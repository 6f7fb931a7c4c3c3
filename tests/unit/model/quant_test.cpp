// Quantization descriptions (compiler/model/quant.h): each is recognised and carried into the IR per
// tensor, or refused naming the key, the method and what is supported.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "common/dtype.h"

#include "common/embedded.h"
#include "common/json.h"
#include "deploy/deploy.h"
#include "model/ir.h"
#include "model/quant.h"
#include "plan/plan.h"
#include "../test_util.h"

namespace dp::model {
namespace {

Json preset(const std::string& name) { return parse_json(*embedded_file("presets/" + name + ".json"), name); }

Json with_quant(const Json& q, const std::string& base = "kimi-linear-48b-a3b") {
  Json c = preset(base);
  c["quantization_config"] = q;
  return c;
}

const Json kFp8 = {{"quant_method", "fp8"}, {"fmt", "e4m3"}, {"activation_scheme", "dynamic"},
                   {"weight_block_size", {128, 128}}};

TEST(Quant, Bf16ConfigHasNoQuantization) {
  const Model m = model_from_config(preset("kimi-linear-48b-a3b"), "config.json");
  EXPECT_EQ(m.quant.method, QuantMethod::none);
  for (const WeightSpec& w : m.weights) {
    EXPECT_EQ(w.quant.method, QuantMethod::none) << w.name;
    EXPECT_TRUE(w.scale_of.empty()) << w.name;
  }
}

TEST(Quant, Fp8BlockWeightsCarryTheirScalesIntoTheIr) {
  Json q = kFp8;
  q["modules_to_not_convert"] = {"lm_head", "model.layers.0.mlp"};
  const Model m = model_from_config(with_quant(q), "config.json");
  EXPECT_EQ(m.quant.method, QuantMethod::fp8_block);
  EXPECT_EQ(m.quant.block, (std::vector<int64_t>{128, 128}));
  EXPECT_EQ(m.moe.expert_format, ExpertFormat::bf16);

  const WeightSpec* w = m.find("model.layers.1.block_sparse_moe.experts.5.w1.weight");
  ASSERT_NE(w, nullptr);
  EXPECT_EQ(w->dtype, DType::F8_E4M3);
  EXPECT_TRUE(w->alt_dtypes.empty());
  EXPECT_EQ(w->quant.method, QuantMethod::fp8_block);
  EXPECT_EQ(w->quant.block, (std::vector<int64_t>{128, 128}));
  EXPECT_EQ(w->quant.scale, "model.layers.1.block_sparse_moe.experts.5.w1.weight_scale_inv");
  EXPECT_EQ(w->quant.scale_dtype, DType::F32);
  const WeightSpec* s = m.find(w->quant.scale);
  ASSERT_NE(s, nullptr);
  EXPECT_EQ(s->dtype, DType::F32);
  EXPECT_EQ(s->shape, (std::vector<int64_t>{8, 18}));  // [1024, 2304] in 128 x 128 blocks
  EXPECT_EQ(s->split, w->split);
  EXPECT_EQ(s->expert, 5);
  EXPECT_EQ(s->scale_of, w->name);
  EXPECT_EQ(s->key, "block_sparse_moe.experts.5.w1.weight_scale_inv");

  // A partial last block gets its own scale: kv_a_proj_with_mqa is [576, 2304].
  EXPECT_EQ(m.find("model.layers.3.self_attn.kv_a_proj_with_mqa.weight_scale_inv")->shape,
            (std::vector<int64_t>{5, 18}));
  // Not linear layers, and the router: as they were.
  for (const char* n : {"model.layers.1.self_attn.q_conv1d.weight", "model.layers.1.block_sparse_moe.gate.weight",
                        "model.layers.1.input_layernorm.weight", "model.embed_tokens.weight", "lm_head.weight"}) {
    ASSERT_NE(m.find(n), nullptr) << n;
    EXPECT_NE(m.find(n)->dtype, DType::F8_E4M3) << n;
    EXPECT_EQ(m.find(n)->quant.method, QuantMethod::none) << n;
  }
  // The ignore list: layer 0's dense MLP stays bf16, without scales, and says so.
  const WeightSpec* up0 = m.find("model.layers.0.mlp.up_proj.weight");
  ASSERT_NE(up0, nullptr);
  EXPECT_EQ(up0->dtype, DType::BF16);
  EXPECT_TRUE(up0->quant.excluded);
  EXPECT_EQ(m.find("model.layers.0.mlp.up_proj.weight_scale_inv"), nullptr);
  EXPECT_EQ(m.find("model.layers.0.self_attn.q_proj.weight")->dtype, DType::F8_E4M3);

  // Bytes: e4m3 halves every quantized weight, the scales add 4 bytes per block.
  const Model bf16 = model_from_config(preset("kimi-linear-48b-a3b"), "config.json");
  uint64_t expect = bf16.total_weight_bytes();
  for (const WeightSpec& x : m.weights) {
    if (x.quant.method == QuantMethod::fp8_block) expect -= x.bytes();  // 2 bytes -> 1 byte per value
    if (!x.scale_of.empty()) expect += x.bytes();
  }
  EXPECT_EQ(m.total_weight_bytes(), expect);
  EXPECT_LT(m.total_weight_bytes(), bf16.total_weight_bytes() * 55 / 100);
}

TEST(Quant, Fp8IgnoredLayersAndRegexesAreRead) {
  Json q = kFp8;
  q["ignored_layers"] = {"re:.*self_attn.*", "shared_experts"};
  const Model m = model_from_config(with_quant(q), "config.json");
  EXPECT_TRUE(m.find("model.layers.1.self_attn.q_proj.weight")->quant.excluded);
  EXPECT_TRUE(m.find("model.layers.1.block_sparse_moe.shared_experts.up_proj.weight")->quant.excluded);
  EXPECT_EQ(m.find("model.layers.1.block_sparse_moe.experts.0.w2.weight")->dtype, DType::F8_E4M3);
}

TEST(Quant, ModuleIgnoredMatchesWholeComponentsAndAnchoredRegexes) {
  EXPECT_TRUE(module_ignored("lm_head", {"lm_head"}));
  EXPECT_TRUE(module_ignored("language_model.lm_head", {"lm_head"}));
  EXPECT_TRUE(module_ignored("model.layers.1.mlp.up_proj", {"layers.1.mlp"}));
  EXPECT_FALSE(module_ignored("model.layers.10.mlp.up_proj", {"layers.1.mlp"}));
  EXPECT_FALSE(module_ignored("model.layers.1.mlp_res_proj", {"mlp"}));
  EXPECT_TRUE(module_ignored("a.b.gate", {"re:.*gate$"}));
  EXPECT_FALSE(module_ignored("a.b.gate_proj", {"re:.*gate$"}));
  EXPECT_TRUE(module_ignored("a.b.gate_proj", {"re:.*gate"}));       // re.match: a prefix match
  EXPECT_FALSE(module_ignored("x.a.b.gate_proj", {"re:a.*gate"}));   // anchored at the start
  EXPECT_TRUE(module_ignored("model.layers.12.mlp.up_proj", {"re:model\\.layers\\.[0-9]+\\.mlp\\..*"}));
  EXPECT_FALSE(module_ignored("model.layers.x.mlp.up_proj", {"re:model\\.layers\\.[0-9]+\\.mlp"}));
  EXPECT_TRUE(module_ignored("m.k_proj", {"re:nothing|.*k_proj$"}));
  EXPECT_TRUE(module_ignored("m.k_proj", {"re:m.k_?proj"}));
  EXPECT_TRUE(module_ignored("m.kproj", {"re:m.k_?proj"}));
}

TEST(Quant, KimiK3Mxfp4ExpertsGoThroughTheSamePath) {
  const Model m = load_model("kimi-k3-tiny");
  EXPECT_EQ(m.quant.method, QuantMethod::mxfp4_experts);
  EXPECT_EQ(m.quant.quant_method, "compressed-tensors");
  EXPECT_EQ(m.moe.expert_format, ExpertFormat::mxfp4);
  size_t packed = 0, excluded = 0;
  for (const WeightSpec& w : m.weights) {
    if (w.quant.method == QuantMethod::mxfp4_experts) {
      ++packed;
      EXPECT_EQ(w.dtype, DType::U8) << w.name;
      EXPECT_EQ(w.quant.block, (std::vector<int64_t>{1, 32})) << w.name;
      const WeightSpec* s = m.find(w.quant.scale);
      ASSERT_NE(s, nullptr) << w.quant.scale;
      EXPECT_EQ(s->scale_of, w.name);
      EXPECT_TRUE(w.name.ends_with(".weight_packed")) << w.name;
      EXPECT_TRUE(s->name.ends_with(".weight_scale")) << s->name;
    }
    excluded += w.quant.excluded;
    if (is_quantizable_linear(w.key)) {
      EXPECT_TRUE(w.quant.excluded) << w.name;  // bf16, in the ignore list
    }
  }
  size_t moe_layers = 0;
  for (const LayerSpec& l : m.layers) moe_layers += l.ffn != Ffn::dense;
  EXPECT_GT(moe_layers, 0u);
  EXPECT_EQ(packed, static_cast<size_t>(m.moe.num_experts) * 3 * moe_layers);
  EXPECT_GT(excluded, 0u);
}

TEST(Quant, Mxfp4ThatWouldQuantizeMoreThanTheExpertsIsRefused) {
  Json c = preset("kimi-k3-tiny");
  c["quantization_config"]["ignore"] = {"lm_head"};
  test::expect_error([&] { model_from_config(c, "config.json"); }, Errc::input,
                     {"config.json: quantization_config (compressed-tensors mxfp4-pack-quantized) quantizes",
                      "self_attn", "routed experts only"});
}

TEST(Quant, UnsupportedDescriptionsAreRefusedNamingKeyMethodAndWhatIsSupported) {
  const std::string supported = "supported: quant_method \"fp8\" with fmt e4m3 and weight_block_size [128, 128]";
  struct Case {
    Json q;
    std::vector<std::string> fragments;
  };
  Json block64 = kFp8, fmt = kFp8, per_tensor = kFp8, fixed = kFp8, one_d = kFp8;
  block64["weight_block_size"] = {64, 64};
  fmt["fmt"] = "e5m2";
  per_tensor.erase("weight_block_size");
  fixed["activation_scheme"] = "static";
  one_d["weight_block_size"] = {128};
  const std::vector<Case> cases = {
      {block64, {"quantization_config.weight_block_size is [64,64]", "[128, 128] blocks only"}},
      {one_d, {"quantization_config.weight_block_size is [128]"}},
      {fmt, {"quantization_config.fmt is \"e5m2\"", "e4m3 weights only"}},
      {per_tensor, {"quantization_config.weight_block_size is missing", "one scale per tensor"}},
      {fixed, {"quantization_config.activation_scheme is \"static\""}},
      {{{"quant_method", "awq"}, {"bits", 4}, {"group_size", 128}},
       {"quantization_config.quant_method \"awq\" is not supported", "AWQ"}},
      {{{"quant_method", "gptq"}, {"bits", 4}}, {"quantization_config.quant_method \"gptq\" is not supported"}},
      {{{"quant_method", "bitsandbytes"}, {"load_in_4bit", true}},
       {"quantization_config.quant_method \"bitsandbytes\" is not supported"}},
      {{{"quant_method", "mxfp4"}}, {"quantization_config.quant_method \"mxfp4\" is not supported", "gpt-oss"}},
      {{{"quant_method", "somethingnew"}}, {"quantization_config.quant_method \"somethingnew\" is not supported"}},
      {{{"bits", 4}}, {"quantization_config.quant_method is missing"}},
      {"fp8", {"quantization_config is \"fp8\", expected an object"}},
      {{{"quant_method", "compressed-tensors"}, {"format", "float-quantized"}},
       {"quantization_config.format is \"float-quantized\"", "mxfp4-pack-quantized only"}},
      {Json::parse(R"({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "pack-quantized",
                       "weights": {"num_bits": 4, "type": "int"}}}})"),
       {"quantization_config.config_groups.g.format is \"pack-quantized\""}},
      {Json::parse(R"({"quant_method": "compressed-tensors", "config_groups": {"g": {"format": "mxfp4-pack-quantized",
                       "weights": {"num_bits": 8, "type": "float"}}}})"),
       {"quantization_config.config_groups.g.weights"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.q.dump());
    std::vector<std::string> f = c.fragments;
    f.push_back(supported);
    try {
      model_from_config(with_quant(c.q), "config.json");
      ADD_FAILURE() << "accepted";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::input);
      const std::string msg = e.what();
      EXPECT_EQ(msg.rfind("config.json: ", 0), 0u) << msg;
      for (const std::string& x : f) EXPECT_NE(msg.find(x), std::string::npos) << "no \"" << x << "\" in: " << msg;
    }
  }
}

TEST(Quant, IgnoreRegexesOutsideTheSubsetAreRefused) {
  Json q = kFp8;
  q["ignored_layers"] = {"lm_head", "re:(a|b)"};
  test::expect_error([&] { model_from_config(with_quant(q), "config.json"); }, Errc::input,
                     {"config.json: quantization_config.ignored_layers[1] \"re:(a|b)\"", "groups"});
}

TEST(Quant, MlxQuantizationIsRefused) {
  Json c = preset("kimi-linear-48b-a3b");
  c["quantization"] = {{"group_size", 64}, {"bits", 4}, {"mode", "affine"}};
  c["quantization_config"] = c["quantization"];
  test::expect_error([&] { model_from_config(c, "config.json"); }, Errc::input,
                     {"config.json: quantization is {", "an MLX quantization (mode \"affine\")", "not supported",
                      "supported: quant_method \"fp8\""});
  Json k3 = preset("kimi-k3-tiny");
  k3["text_config"]["quantization"] = {{"group_size", 32}, {"bits", 4}, {"mode", "mxfp4"}};
  test::expect_error([&] { model_from_config(k3, "config.json"); }, Errc::input,
                     {"text_config.quantization is", "mode \"mxfp4\""});
}

// The plan counts the FP8 bytes, and the programs read the e4m3 weights through the ops' e4m3 forms
// except where an op has none: with only lm_head kept bf16, the KDA gate projection f_b_proj is e4m3,
// which kda_step reads as bf16, so the KDA classes have no program and say why (tests/unit/plan has
// the programs of a checkpoint that keeps them bf16).
TEST(Quant, Fp8PlanCountsBytesAndBuildsProgramsWhereOpsReadE4m3) {
  Json q = kFp8;
  q["modules_to_not_convert"] = {"lm_head"};
  const Model m = model_from_config(with_quant(q), "config.json");
  const deploy::Deploy d = deploy::load_deploy("default");
  const plan::Plan p = plan::make_plan(m, d, "default");
  ASSERT_FALSE(p.programs.empty());
  for (const plan::LayerProgram& pr : p.programs) {
    if (pr.cls == plan::LayerClass::mla_moe) {
      EXPECT_EQ(pr.unavailable, "");
      continue;
    }
    EXPECT_TRUE(pr.steps.empty());
    EXPECT_NE(pr.unavailable.find("FP8 weight self_attn.f_b_proj.weight is stored e4m3"), std::string::npos)
        << pr.unavailable;
  }
  for (const auto& k : p.kernels) {
    if (k.role == "layer" && k.op == "gemm" && k.name.find("_f1") == std::string::npos) {
      EXPECT_NE(k.name.find("_q8"), std::string::npos) << k.name;  // every projection but the router is e4m3
    }
  }
  const Json j = plan::to_json(p, m, d);
  EXPECT_EQ(j["model"]["quantization"]["method"], "fp8");
  EXPECT_EQ(j["model"]["checkpoint_bytes"], m.total_weight_bytes());
  // The e4m3 bytes and the scale bytes, counted apart: one byte per value, 4 per 128x128 block.
  uint64_t values = 0, scales = 0;
  size_t n = 0;
  for (const WeightSpec& w : m.weights)
    if (w.quant.method == QuantMethod::fp8_block) {
      ++n;
      values += static_cast<uint64_t>(w.shape[0] * w.shape[1]);
      scales += static_cast<uint64_t>((w.shape[0] + 127) / 128 * ((w.shape[1] + 127) / 128) * 4);
    }
  const Json& jq = j["model"]["quantization"];
  EXPECT_EQ(jq["quantized_bytes"], values);
  EXPECT_EQ(jq["scale_bytes"], scales);
  EXPECT_EQ(jq["scales"], n);
  EXPECT_EQ(jq["quantized_weights"], n);
  const std::string text = plan::to_text(p, m, d);
  EXPECT_NE(text.find(fmt::format("quant     fp8 e4m3 128x128 blocks: {} quantized weights (", n)), std::string::npos)
      << text.substr(0, 400);
}

TEST(Quant, Fp8ShardsMustKeepWholeBlocksPerRank) {
  Json q = kFp8;
  q["modules_to_not_convert"] = {"b_proj"};  // [32, 2304]: one block row, which no TP > 1 can split
  const Model m = model_from_config(with_quant(q), "config.json");
  deploy::Deploy d = deploy::load_deploy("default");
  d.tensor_parallel = 8;
  d.ranks = {0, 1, 2, 3, 4, 5, 6, 7};
  // Every other split dimension is 8 x a multiple of 128 (the dense MLP's 9216 rows: 8 x 9 x 128).
  EXPECT_NO_THROW(deploy::check_against_model(d, m, "deploy.json"));

  d.tensor_parallel = 2;
  d.ranks = {0, 1};
  const Model all = model_from_config(with_quant(kFp8), "config.json");
  test::expect_error([&] { deploy::check_against_model(d, all, "deploy.json"); }, Errc::input,
                     {"deploy.json: tensor_parallel 2 splits dim 0 (32) of model.layers.0.self_attn.b_proj.weight "
                      "[32, 2304] into 16 rows per rank, not a multiple of its FP8 block of 128 (valid: 1)"});

  // MLA q_proj of 2 heads x (32 + 64) = 192 rows: 2 scale rows split 1 + 1, but 96 rows per rank would cut
  // a block in two.
  Json c = with_quant(q);
  c["num_attention_heads"] = 2;
  c["qk_nope_head_dim"] = 32;
  const Model small = model_from_config(c, "config.json");
  test::expect_error([&] { deploy::check_against_model(d, small, "deploy.json"); }, Errc::input,
                     {"deploy.json: tensor_parallel 2 splits dim 0 (192) of", "q_proj.weight [192, 2304] into 96 rows "
                      "per rank, not a multiple of its FP8 block of 128 (valid: 1)"});
}

TEST(Quant, Fp8BlocksScaleByTheBlockMaximumOver448) {
  // A 3 x 3 matrix in blocks of 2: full, partial column, partial row, and a one-value corner block.
  const std::vector<float> v = {1, -2, 0.5f,  //
                                4, 0.25f, 0,  //
                                0, 0, 896};
  const Fp8Blocks q = quantize_fp8_blocks(v, 3, 3, 2);
  ASSERT_EQ(q.scale_inv.size(), 4u);
  EXPECT_FLOAT_EQ(q.scale_inv[0], 4.0f / 448);    // rows 0-1, columns 0-1: max |4|
  EXPECT_FLOAT_EQ(q.scale_inv[1], 0.5f / 448);    // rows 0-1, column 2
  EXPECT_FLOAT_EQ(q.scale_inv[2], 1.0f);          // row 2, columns 0-1: all zero
  EXPECT_FLOAT_EQ(q.scale_inv[3], 896.0f / 448);  // row 2, column 2
  // 1 / (4/448) = 112 = 7/4 * 2^6 -> 0x6e; -224 -> 0xf6; 448 -> 0x7e; 28 = 7/4 * 2^4 -> 0x5e.
  const std::vector<uint8_t> want = {0x6e, 0xf6, 0x7e, 0x7e, 0x5e, 0x00, 0x00, 0x00, 0x7e};
  EXPECT_EQ(q.values, want);
  for (size_t i = 0; i < v.size(); ++i) {
    const size_t block = (i / 3 / 2) * 2 + (i % 3) / 2;
    EXPECT_FLOAT_EQ(e4m3_bits_to_f32(q.values[i]) * q.scale_inv[block], v[i]) << i;
  }
  test::expect_error([] { quantize_fp8_blocks({1, 2}, 3, 3, 2); }, Errc::internal, {"2 values for [3, 3]"});
}

TEST(Quant, Fp8BlocksDequantiseWithinHalfAStep) {
  // 130 x 260: blocks of 128 with partial ones on both edges; every value comes back within e4m3's
  // relative step (2^-4 of the value, or of the block's smallest normal for tiny ones).
  std::vector<float> v(130 * 260);
  for (size_t i = 0; i < v.size(); ++i) v[i] = std::sin(static_cast<float>(i) * 0.37f) * (1 + static_cast<float>(i % 7));
  const Fp8Blocks q = quantize_fp8_blocks(v, 130, 260, 128);
  ASSERT_EQ(q.scale_inv.size(), 2u * 3u);
  for (int64_t r = 0; r < 130; ++r)
    for (int64_t c = 0; c < 260; ++c) {
      const float s = q.scale_inv[static_cast<size_t>((r / 128) * 3 + c / 128)];
      const float x = v[static_cast<size_t>(r * 260 + c)];
      const float back = e4m3_bits_to_f32(q.values[static_cast<size_t>(r * 260 + c)]) * s;
      EXPECT_LE(std::fabs(back - x), std::max(std::fabs(x) * 0x1p-4f, s * 0x1p-10f) * 1.0001f) << r << "," << c;
    }
}

}  // namespace
}  // namespace dp::model
