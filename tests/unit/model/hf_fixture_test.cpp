// The checkpoint in tests/fixtures/hf-kimi-linear/checkpoint was written by HF transformers 5.17's own
// save_pretrained (tests/fixtures/hf-kimi-linear/make_fixture.py): flat config keys with layer_types and
// mlp_layer_types, layer 0's dense MLP under block_sparse_moe., every tensor in bf16.
#include <gtest/gtest.h>

#include "model/inventory.h"
#include "model/safetensors.h"
#include "../test_util.h"

namespace dp::model {
namespace {

const std::string kFixture = (test::data_dir() / "fixtures" / "hf-kimi-linear" / "checkpoint").string();

TEST(HfFixture, ConfigReadsIntoTheSameLayerStructure) {
  Model m = load_model(kFixture);
  EXPECT_EQ(m.type, ModelType::kimi_linear);
  ASSERT_EQ(m.layers.size(), 4u);
  EXPECT_EQ(m.layers[0].mixer, Mixer::kda);
  EXPECT_EQ(m.layers[3].mixer, Mixer::mla);
  EXPECT_EQ(m.layers[0].ffn, Ffn::dense);
  EXPECT_EQ(m.layers[1].ffn, Ffn::moe);
  EXPECT_EQ(m.kda.head_dim, 32);
  EXPECT_EQ(m.kda.num_heads, 2);
  EXPECT_EQ(m.moe.num_experts, 8);
}

TEST(HfFixture, InventoryAcceptsTransformersNamesAndBf16Params) {
  Model m = load_model(kFixture);
  st::Checkpoint ck = st::Checkpoint::open(kFixture);
  Inventory inv = check_inventory(m, ck);
  for (const InventoryIssue& i : inv.issues) ADD_FAILURE() << i.message();
  const WeightSpec* up = m.find("model.layers.0.mlp.up_proj.weight");
  ASSERT_NE(up, nullptr);
  const st::TensorInfo* t = inv.resolved[static_cast<size_t>(up - m.weights.data())];
  ASSERT_NE(t, nullptr);
  EXPECT_EQ(t->name, "model.layers.0.block_sparse_moe.up_proj.weight");
  EXPECT_EQ(ck.find("model.layers.1.self_attn.A_log")->dtype, DType::BF16);
}

}  // namespace
}  // namespace dp::model
