// The sparse-attention indexer in the model IR: config keys, weights, the indexer preset and its
// synthetic checkpoint.
#include <gtest/gtest.h>

#include "common/embedded.h"
#include "model/inventory.h"
#include "model/ir.h"
#include "model/safetensors.h"
#include "model/synth.h"
#include "../test_util.h"

namespace dp::model {
namespace {

Json preset_json(const std::string& name) { return parse_json(*embedded_file("presets/" + name + ".json"), name); }

void expect_config_error(const Json& j, std::initializer_list<std::string> fragments) {
  test::expect_error([&] { model_from_config(j, "config.json"); }, Errc::input, fragments);
}

TEST(IndexerConfig, KimiPresetsHaveNone) {
  for (const char* p : {"kimi-linear-tiny", "kimi-k3-tiny", "kimi-linear-48b-a3b"}) {
    Model m = load_model(p);
    EXPECT_FALSE(m.indexer.present()) << p;
    for (const LayerSpec& l : m.layers) EXPECT_FALSE(l.indexer) << p << " layer " << l.index;
    for (const WeightSpec& w : m.weights) EXPECT_EQ(w.key.find("indexer"), std::string::npos) << w.name;
  }
}

TEST(IndexerConfig, PresetReadsTheFieldsAndPutsAnIndexerOnEveryMlaLayer) {
  Model m = load_model("kimi-k3-tiny-indexer");
  ASSERT_TRUE(m.indexer.present());
  EXPECT_EQ(m.indexer.num_heads, 8);
  EXPECT_EQ(m.indexer.head_dim, 128);
  EXPECT_EQ(m.indexer.top_k, 2048);
  ASSERT_EQ(m.layers.size(), 5u);
  for (const LayerSpec& l : m.layers) EXPECT_EQ(l.indexer, l.mixer == Mixer::mla) << l.index;

  // Layer 3 (MLA): hidden 256, q_lora_rank 128, 8 index heads of 128.
  const std::string p = "language_model.model.layers.3.self_attn.indexer.";
  struct Expect {
    const char* key;
    std::vector<int64_t> shape;
  };
  for (const Expect& e : {Expect{"wq_b.weight", {8 * 128, 128}}, Expect{"wk.weight", {128, 256}},
                          Expect{"k_norm.weight", {128}}, Expect{"k_norm.bias", {128}},
                          Expect{"weights_proj.weight", {8, 256}}}) {
    const WeightSpec* w = m.find(p + e.key);
    ASSERT_NE(w, nullptr) << e.key;
    EXPECT_EQ(w->shape, e.shape) << e.key;
    EXPECT_EQ(w->dtype, DType::BF16) << e.key;
    EXPECT_EQ(w->split, Split::replicated()) << e.key;  // vLLM: ReplicatedLinear / LayerNorm on every rank
    EXPECT_FALSE(w->decode) << e.key;                   // the host computes q_idx, k and w
    EXPECT_EQ(w->layer, 3);
  }
  EXPECT_EQ(m.find("language_model.model.layers.0.self_attn.indexer.wk.weight"), nullptr);  // KDA layer

  // Everything else is the plain tiny K3: 5 indexer tensors on each of the 2 MLA layers more.
  Model base = load_model("kimi-k3-tiny");
  EXPECT_EQ(m.weights.size(), base.weights.size() + 2 * 5);
}

TEST(IndexerConfig, TopLevelKeysOfAKimiLinearConfigWork) {
  Json j = preset_json("kimi-linear-tiny");
  j["q_lora_rank"] = 64;
  j["index_n_heads"] = 4;
  j["index_head_dim"] = 128;
  j["index_topk"] = 512;
  Model m = model_from_config(j, "config.json");
  EXPECT_EQ(m.indexer.num_heads, 4);
  EXPECT_EQ(m.indexer.top_k, 512);
  const WeightSpec* q = m.find("model.layers.3.self_attn.indexer.wq_b.weight");
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(q->shape, (std::vector<int64_t>{4 * 128, 64}));
}

TEST(IndexerConfig, BadFieldsAreRefusedNamingTheField) {
  Json base = preset_json("kimi-k3-tiny-indexer");
  auto with = [&](const char* key, const Json& v) {
    Json j = base;
    if (v.is_null()) j["text_config"].erase(key);
    else j["text_config"][key] = v;
    return j;
  };
  expect_config_error(with("index_topk", nullptr),
                      {"config.json", "missing field text_config.index_topk",
                       "index_n_heads, index_head_dim and index_topk"});
  expect_config_error(with("index_head_dim", 64), {"text_config.index_head_dim is 64", "expected 128", "68"});
  expect_config_error(with("index_n_heads", 0), {"text_config.index_n_heads is 0", "positive"});
  expect_config_error(with("index_n_heads", 4096), {"text_config.index_n_heads is 4096", "at most 1024"});
  expect_config_error(with("index_topk", -1), {"text_config.index_topk is -1", "positive"});
  expect_config_error(with("index_topk", "2048"), {"text_config.index_topk", "a string"});
  expect_config_error(with("q_lora_rank", 0), {"text_config.q_lora_rank is 0", "wq_b", "q-LoRA"});
  // Only an indexer key, without the other two, is refused as well (the first missing one is named).
  Json tiny = preset_json("kimi-linear-tiny");
  tiny["index_topk"] = 2048;
  expect_config_error(tiny, {"missing field index_n_heads"});
}

TEST(IndexerConfig, SynthWritesTheIndexerPresetAndItPassesInventory) {
  test::TempDir t;
  SynthOptions o;
  o.preset = "kimi-k3-tiny-indexer";
  o.out = t / "ck";
  o.seed = 5;
  SynthResult r = synthesize(o);
  st::Checkpoint ck = st::Checkpoint::open(t / "ck");
  EXPECT_EQ(ck.tensors().size(), r.tensors);
  const st::TensorInfo* wq = ck.find("language_model.model.layers.4.self_attn.indexer.wq_b.weight");
  ASSERT_NE(wq, nullptr);
  EXPECT_EQ(wq->dtype, DType::BF16);
  EXPECT_EQ(wq->shape, (std::vector<int64_t>{1024, 128}));
  Model m = load_model((t / "ck").string());
  EXPECT_TRUE(m.indexer.present());  // config.json carries the index_* keys
  Inventory inv = check_inventory(m, ck);
  EXPECT_TRUE(inv.ok()) << (inv.issues.empty() ? "" : inv.issues[0].message());

  // The indexer tensors are not part of the plain K3 model: its inventory names them unexpected.
  Inventory plain = check_inventory(load_model("kimi-k3-tiny"), ck);
  ASSERT_EQ(plain.issues.size(), 10u);
  for (const InventoryIssue& i : plain.issues) {
    EXPECT_EQ(i.kind, InventoryIssue::Kind::unexpected);
    EXPECT_NE(i.name.find(".indexer."), std::string::npos) << i.name;
  }
}

}  // namespace
}  // namespace dp::model
