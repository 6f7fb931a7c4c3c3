#include <gtest/gtest.h>

#include <fstream>

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
                  CheckpointLayout layout = CheckpointLayout::vllm) {
  SynthOptions o;
  o.preset = preset;
  o.out = out;
  o.seed = seed;
  o.layout = layout;
  return synthesize(o);
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

}  // namespace
}  // namespace dp::model
