#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>

#include "common/dtype.h"
#include "common/json.h"

#include "common/hash.h"
#include "model/inventory.h"
#include "model/safetensors.h"
#include "model/synth.h"
#include "../test_util.h"

namespace dp::model {
namespace {

namespace fs = std::filesystem;

std::map<std::string, std::string> digests(const fs::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::directory_iterator(dir)) out[e.path().filename().string()] = sha256_file(e.path());
  return out;
}

SynthResult synth(const std::string& preset, const fs::path& out, uint64_t seed,
                  CheckpointLayout layout = CheckpointLayout::vllm, SynthQuantize quantize = SynthQuantize::none) {
  SynthOptions o;
  o.preset = preset;
  o.out = out;
  o.seed = seed;
  o.layout = layout;
  o.quantize = quantize;
  return synthesize(o);
}

SynthResult synth_fp8(const fs::path& out, uint64_t seed, CheckpointLayout layout = CheckpointLayout::vllm) {
  return synth("kimi-linear-tiny", out, seed, layout, SynthQuantize::fp8);
}

TEST(Synth, DeterministicForASeedAndDifferentAcrossSeeds) {
  test::TempDir t;
  synth("kimi-linear-tiny", t / "a", 7);
  synth("kimi-linear-tiny", t / "b", 7);
  synth("kimi-linear-tiny", t / "c", 8);
  auto a = digests(t / "a"), b = digests(t / "b"), c = digests(t / "c");
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.at("config.json"), c.at("config.json"));
  EXPECT_NE(a.at("model-00001-of-00004.safetensors"), c.at("model-00001-of-00004.safetensors"));
}

TEST(Synth, WritesSeveralShardsAnIndexAndTheRealDtypes) {
  test::TempDir t;
  SynthResult r = synth("kimi-linear-tiny", t / "m", 0);
  EXPECT_GE(r.shards, 2u);
  ASSERT_TRUE(fs::exists(t / "m" / "model.safetensors.index.json"));
  st::Checkpoint ck = st::Checkpoint::open(t / "m");
  EXPECT_EQ(ck.tensors().size(), r.tensors);
  EXPECT_EQ(ck.find("model.layers.0.self_attn.A_log")->dtype, DType::F32);
  EXPECT_EQ(ck.find("model.layers.0.self_attn.q_conv1d.weight")->dtype, DType::F32);
  EXPECT_EQ(ck.find("model.layers.0.self_attn.q_proj.weight")->dtype, DType::BF16);
  Model m = load_model((t / "m").string());
  Inventory inv = check_inventory(m, ck);
  EXPECT_TRUE(inv.ok()) << (inv.issues.empty() ? "" : inv.issues[0].message());
}

TEST(Synth, K3TinyHasMxfp4ExpertsAndPassesInventory) {
  test::TempDir t;
  synth("kimi-k3-tiny", t / "k3", 1);
  st::Checkpoint ck = st::Checkpoint::open(t / "k3");
  const st::TensorInfo* p = ck.find("language_model.model.layers.1.block_sparse_moe.experts.3.w2.weight_packed");
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(p->dtype, DType::U8);
  EXPECT_EQ(p->shape, (std::vector<int64_t>{128, 64}));
  Inventory inv = check_inventory(load_model((t / "k3").string()), ck);
  EXPECT_TRUE(inv.ok()) << (inv.issues.empty() ? "" : inv.issues[0].message());
}

TEST(Synth, TransformersLayoutIsAcceptedByTheInventory) {
  test::TempDir t;
  synth("kimi-linear-tiny", t / "hf", 3, CheckpointLayout::transformers);
  st::Checkpoint ck = st::Checkpoint::open(t / "hf");
  EXPECT_NE(ck.find("model.layers.0.block_sparse_moe.up_proj.weight"), nullptr);
  EXPECT_EQ(ck.find("model.layers.0.mlp.up_proj.weight"), nullptr);
  EXPECT_EQ(ck.find("model.layers.1.self_attn.A_log")->dtype, DType::BF16);
  Model m = load_model((t / "hf").string());
  Inventory inv = check_inventory(m, ck);
  EXPECT_TRUE(inv.ok()) << (inv.issues.empty() ? "" : inv.issues[0].message());
  // Both layouts hold the same values for the same seed (bf16 params convert exactly from f32 ones only
  // when the f32 values are bf16-representable, so compare a bf16 tensor).
  synth("kimi-linear-tiny", t / "hub", 3);
  st::Checkpoint hub = st::Checkpoint::open(t / "hub");
  auto a = ck.data(*ck.find("model.layers.0.block_sparse_moe.up_proj.weight"));
  auto b = hub.data(*hub.find("model.layers.0.mlp.up_proj.weight"));
  ASSERT_EQ(a.size(), b.size());
  EXPECT_TRUE(std::equal(a.begin(), a.end(), b.begin()));
}

// Writes a checkpoint holding the tiny model's tensors, edited by `edit`, and returns its inventory.
Inventory inventory_after(const test::TempDir& t, const std::function<void(std::vector<st::TensorData>&)>& edit) {
  Model m = load_model("kimi-linear-tiny");
  std::vector<st::TensorData> ts;
  for (const WeightSpec& w : m.weights) ts.push_back({w.name, w.dtype, w.shape, synth_tensor(w, w.dtype, 0)});
  edit(ts);
  fs::create_directories(t / "ck");
  st::write_file(t / "ck" / "model.safetensors", ts, {});
  return check_inventory(m, st::Checkpoint::open(t / "ck"));
}

TEST(Inventory, ReportsMissingUnexpectedShapeAndDtypeByName) {
  test::TempDir t;
  Inventory inv = inventory_after(t, [](std::vector<st::TensorData>& ts) {
    for (auto it = ts.begin(); it != ts.end();) {
      if (it->name == "model.layers.2.self_attn.b_proj.weight") it = ts.erase(it);
      else ++it;
    }
    for (st::TensorData& x : ts) {
      if (x.name == "model.layers.1.self_attn.o_proj.weight") {
        x.shape = {256, 128};
        x.bytes.resize(256 * 128 * 2);
      }
      if (x.name == "model.layers.1.self_attn.dt_bias") {
        x.dtype = DType::F16;
        x.bytes.resize(x.bytes.size() / 2);
      }
    }
    ts.push_back({"model.layers.1.self_attn.extra.weight", DType::BF16, {4}, std::vector<uint8_t>(8)});
  });
  ASSERT_EQ(inv.issues.size(), 4u);
  std::string all;
  for (const InventoryIssue& i : inv.issues) all += i.message() + "\n";
  EXPECT_NE(all.find("missing tensor model.layers.2.self_attn.b_proj.weight: expected [2, 256] BF16"), std::string::npos) << all;
  EXPECT_NE(all.find("tensor model.layers.1.self_attn.o_proj.weight (in model.safetensors): shape [256, 128], expected [256, 256]"), std::string::npos) << all;
  EXPECT_NE(all.find("tensor model.layers.1.self_attn.dt_bias (in model.safetensors): dtype F16, expected F32 or BF16"), std::string::npos) << all;
  EXPECT_NE(all.find("unexpected tensor model.layers.1.self_attn.extra.weight"), std::string::npos) << all;
  test::expect_error([&] { require_inventory(inv, "ck/"); }, Errc::verify, {"ck/", "4 problems", "b_proj"});
}

TEST(SynthFp8, WritesE4m3WeightsWithBlockScalesOfTheBf16Values) {
  test::TempDir t;
  synth_fp8(t / "q", 4);
  synth("kimi-linear-tiny", t / "b", 4);
  const Json cfg = load_json_file(t / "q" / "config.json");
  const Json& qc = cfg.at("quantization_config");
  EXPECT_EQ(qc.at("quant_method"), "fp8");
  EXPECT_EQ(qc.at("fmt"), "e4m3");
  EXPECT_EQ(qc.at("activation_scheme"), "dynamic");
  EXPECT_EQ(qc.at("weight_block_size"), Json({128, 128}));
  // Full module names: the embeddings, the LM head, each MoE layer's router, each KDA layer's five gate
  // and beta projections.
  const Json& kept = qc.at("modules_to_not_convert");
  ASSERT_EQ(kept.size(), 2u + 3u + 3u * 5u) << kept.dump();
  EXPECT_EQ(kept[0], "model.embed_tokens");
  EXPECT_EQ(kept[1], "lm_head");
  for (const char* n : {"model.layers.1.block_sparse_moe.gate", "model.layers.3.block_sparse_moe.gate",
                        "model.layers.0.self_attn.f_a_proj", "model.layers.2.self_attn.b_proj"})
    EXPECT_NE(std::find(kept.begin(), kept.end(), Json(n)), kept.end()) << n;
  EXPECT_EQ(std::find(kept.begin(), kept.end(), Json("model.layers.3.self_attn.b_proj")), kept.end());  // MLA

  const Model m = load_model((t / "q").string());
  ASSERT_EQ(m.quant.method, QuantMethod::fp8_block);
  st::Checkpoint q = st::Checkpoint::open(t / "q"), b = st::Checkpoint::open(t / "b");
  Inventory inv = check_inventory(m, q);
  EXPECT_TRUE(inv.ok()) << (inv.issues.empty() ? "" : inv.issues[0].message());

  // An MoE expert projection [128, 256]: 1 x 2 blocks; the MLA kv_b_proj [2 x 256, 512]: 4 x 4.
  const std::string up = "model.layers.1.block_sparse_moe.experts.3.w3";
  const st::TensorInfo* w = q.find(up + ".weight");
  const st::TensorInfo* s = q.find(up + ".weight_scale_inv");
  ASSERT_TRUE(w && s);
  EXPECT_EQ(w->dtype, DType::F8_E4M3);
  EXPECT_EQ(s->dtype, DType::F32);
  EXPECT_EQ(s->shape, (std::vector<int64_t>{(w->shape[0] + 127) / 128, (w->shape[1] + 127) / 128}));
  EXPECT_EQ(q.find("model.layers.3.self_attn.kv_b_proj.weight_scale_inv")->shape, (std::vector<int64_t>{4, 4}));
  // Kept bf16: the ignore list's KDA gate projections, the router, norms, embeddings, LM head; f32 vectors.
  for (const char* n : {"model.layers.1.self_attn.b_proj.weight", "model.layers.1.self_attn.f_a_proj.weight",
                        "model.layers.1.self_attn.g_b_proj.weight", "model.layers.1.block_sparse_moe.gate.weight",
                        "model.embed_tokens.weight", "lm_head.weight", "model.layers.1.input_layernorm.weight"}) {
    ASSERT_NE(q.find(n), nullptr) << n;
    EXPECT_EQ(q.find(n)->dtype, DType::BF16) << n;
    EXPECT_EQ(q.find(std::string(n).substr(0, std::strlen(n) - 7) + ".weight_scale_inv"), nullptr) << n;
    auto x = q.data(*q.find(n)), y = b.data(*b.find(n));
    EXPECT_TRUE(std::equal(x.begin(), x.end(), y.begin(), y.end())) << n;
  }
  EXPECT_EQ(q.find("model.layers.1.self_attn.A_log")->dtype, DType::F32);

  // fp8 * scale_inv gives back the bf16 checkpoint's values within half an e4m3 step, and the scale
  // is the block maximum over 448.
  auto wv = q.data(*w), sv = q.data(*s), bv = b.data(*b.find(up + ".weight"));
  const int64_t rows = w->shape[0], cols = w->shape[1], bc = s->shape[1];
  std::vector<float> scale(static_cast<size_t>(s->shape[0] * bc)), amax(scale.size(), 0.0f);
  std::memcpy(scale.data(), sv.data(), sv.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      uint16_t h;
      std::memcpy(&h, &bv[static_cast<size_t>(2 * (r * cols + c))], 2);
      const float x = bf16_bits_to_f32(h);
      const size_t blk = static_cast<size_t>((r / 128) * bc + c / 128);
      amax[blk] = std::max(amax[blk], std::fabs(x));
      const float back = e4m3_bits_to_f32(wv[static_cast<size_t>(r * cols + c)]) * scale[blk];
      ASSERT_LE(std::fabs(back - x), std::max(std::fabs(x) * 0x1p-4f, scale[blk] * 0x1p-10f) * 1.0001f) << r << "," << c;
    }
  for (size_t i = 0; i < scale.size(); ++i) EXPECT_FLOAT_EQ(scale[i], amax[i] / 448) << i;
}

TEST(SynthFp8, DeterministicAndRefusedForQuantizedOrK3Presets) {
  test::TempDir t;
  synth_fp8(t / "a", 9);
  synth_fp8(t / "b", 9);
  synth_fp8(t / "c", 10);
  auto a = digests(t / "a"), b = digests(t / "b"), c = digests(t / "c");
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  test::expect_error([&] { synth("kimi-k3-tiny", t / "k3", 0, CheckpointLayout::vllm, SynthQuantize::fp8); },
                     Errc::usage, {"--quantize fp8", "kimi_linear models, not kimi_k3"});
  test::expect_error([&] { synth((t / "a").string(), t / "again", 0, CheckpointLayout::vllm, SynthQuantize::fp8); },
                     Errc::usage, {"--quantize fp8", "already has a quantization_config (fp8 e4m3 128x128 blocks)"});
}

TEST(SynthFp8, TransformersLayoutPassesTheInventory) {
  test::TempDir t;
  synth_fp8(t / "hf", 2, CheckpointLayout::transformers);
  st::Checkpoint ck = st::Checkpoint::open(t / "hf");
  EXPECT_EQ(ck.find("model.layers.0.block_sparse_moe.up_proj.weight")->dtype, DType::F8_E4M3);
  EXPECT_NE(ck.find("model.layers.0.block_sparse_moe.up_proj.weight_scale_inv"), nullptr);
  Inventory inv = check_inventory(load_model((t / "hf").string()), ck);
  EXPECT_TRUE(inv.ok()) << (inv.issues.empty() ? "" : inv.issues[0].message());
}

// The FP8 tiny checkpoint as one file, edited by `edit`; its inventory against its own config.
Inventory fp8_inventory_after(const test::TempDir& t, const std::function<void(std::vector<st::TensorData>&)>& edit) {
  synth_fp8(t / "src", 0);
  st::Checkpoint src = st::Checkpoint::open(t / "src");
  std::vector<st::TensorData> ts;
  for (const st::TensorInfo& x : src.tensors()) {
    auto d = src.data(x);
    ts.push_back({x.name, x.dtype, x.shape, std::vector<uint8_t>(d.begin(), d.end())});
  }
  edit(ts);
  fs::create_directories(t / "ck");
  fs::copy_file(t / "src" / "config.json", t / "ck" / "config.json");
  st::write_file(t / "ck" / "model.safetensors", ts, {});
  return check_inventory(load_model((t / "ck").string()), st::Checkpoint::open(t / "ck"));
}

std::string all_messages(const Inventory& inv) {
  std::string all;
  for (const InventoryIssue& i : inv.issues) all += i.message() + "\n";
  return all;
}

TEST(SynthFp8, InventoryNamesAMissingScaleAndItsWeightsFile) {
  test::TempDir t;
  const std::string s = "model.layers.2.self_attn.q_proj.weight_scale_inv";
  Inventory inv = fp8_inventory_after(t, [&](std::vector<st::TensorData>& ts) {
    std::erase_if(ts, [&](const st::TensorData& x) { return x.name == s; });
  });
  ASSERT_EQ(inv.issues.size(), 1u) << all_messages(inv);
  EXPECT_EQ(inv.issues[0].message(),
            "missing tensor " + s + ": expected [2, 2] F32 (the fp32 weight_scale_inv of FP8 weight "
            "model.layers.2.self_attn.q_proj.weight [256, 256]: one scale per 128x128 block; the weight is in "
            "model.safetensors)");
  test::expect_error([&] { require_inventory(inv, "ck/"); }, Errc::verify, {"ck/", "1 problem", s});
}

TEST(SynthFp8, InventoryNamesAMisShapedOrMisTypedScale) {
  test::TempDir t;
  Inventory inv = fp8_inventory_after(t, [](std::vector<st::TensorData>& ts) {
    for (st::TensorData& x : ts) {
      if (x.name == "model.layers.1.block_sparse_moe.experts.0.w2.weight_scale_inv") x.shape = {1, 2};  // [2, 1]: same bytes
      if (x.name == "model.layers.1.self_attn.o_proj.weight_scale_inv") {  // bf16 bits in half the bytes
        x.dtype = DType::BF16;
        x.bytes.resize(x.bytes.size() / 2);
      }
    }
  });
  ASSERT_EQ(inv.issues.size(), 2u) << all_messages(inv);
  const std::string all = all_messages(inv);
  EXPECT_NE(all.find("tensor model.layers.1.block_sparse_moe.experts.0.w2.weight_scale_inv (in model.safetensors): shape "
                     "[1, 2], expected [2, 1] (the fp32 weight_scale_inv of FP8 weight "
                     "model.layers.1.block_sparse_moe.experts.0.w2.weight [256, 128]: one scale per 128x128 block, "
                     "ceil(256/128) x ceil(128/128))"), std::string::npos) << all;
  EXPECT_NE(all.find("tensor model.layers.1.self_attn.o_proj.weight_scale_inv (in model.safetensors): dtype BF16, "
                     "expected F32 (the fp32 weight_scale_inv of FP8 weight model.layers.1.self_attn.o_proj.weight"),
            std::string::npos) << all;
}

TEST(SynthFp8, InventoryNamesAnExtraScaleAndAnUnquantizedWeight) {
  test::TempDir t;
  Inventory inv = fp8_inventory_after(t, [](std::vector<st::TensorData>& ts) {
    // A scale for a weight the ignore list keeps bf16, and an FP8 weight written in bf16 (its scale kept).
    ts.push_back({"model.layers.1.self_attn.b_proj.weight_scale_inv", DType::F32, {1, 2}, std::vector<uint8_t>(8)});
    for (st::TensorData& x : ts)
      if (x.name == "model.layers.3.self_attn.o_proj.weight") {
        x.dtype = DType::BF16;
        x.bytes.resize(x.bytes.size() * 2);
      }
  });
  ASSERT_EQ(inv.issues.size(), 2u) << all_messages(inv);
  const std::string all = all_messages(inv);
  EXPECT_NE(all.find("unexpected tensor model.layers.1.self_attn.b_proj.weight_scale_inv (in model.safetensors): "
                     "found [1, 2] F32, not part of the model (model.layers.1.self_attn.b_proj.weight is in the ignore "
                     "list (modules_to_not_convert / ignored_layers) and stays BF16)"), std::string::npos) << all;
  EXPECT_NE(all.find("tensor model.layers.3.self_attn.o_proj.weight (in model.safetensors): dtype BF16, expected "
                     "F8_E4M3 (quantization_config: fp8 e4m3 128x128 blocks stores model.layers.3.self_attn.o_proj as "
                     "e4m3 with a weight_scale_inv"), std::string::npos) << all;
}

}  // namespace
}  // namespace dp::model
