// tooling/weights: the bytes a rank binds are the bytes its fingerprint hashed at build time, for a
// checkpoint whose dtype differs from the bound one (F32 stored, BF16 bound), NaN included.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>

#include "bundle/fingerprint.h"
#include "common/hash.h"
#include "model/safetensors.h"
#include "model/synth.h"
#include "reference/weights.h"
#include "../test_util.h"
#include "tooling/weights.h"

namespace dp::tools {
namespace {

TEST(Weights, RankBytesHashToTheFingerprints) {
  test::TempDir dir;
  const std::vector<int64_t> shape{4, 6};
  std::vector<float> v(24);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.37f * static_cast<float>(i) - 3.1f;
  v[7] = -std::numeric_limits<float>::quiet_NaN();
  std::vector<uint8_t> bytes(v.size() * 4);
  std::memcpy(bytes.data(), v.data(), bytes.size());
  st::write_file(dir / "model.safetensors", {{"model.w", DType::F32, shape, bytes}}, {});
  const st::Checkpoint ckpt = st::Checkpoint::open(dir.path());

  model::Model m;
  model::WeightSpec w;
  w.name = "model.w";
  w.dtype = DType::BF16;
  w.alt_dtypes = {DType::F32};
  w.shape = shape;
  const WeightSource src(m, &ckpt, 0);
  for (int dim = 0; dim < 2; ++dim)
    for (int64_t rank = 0; rank < 2; ++rank) {
      const int64_t part = shape[static_cast<size_t>(dim)] / 2;
      const std::vector<uint8_t> got = src.rank_bytes(w, dim, part, rank);
      ASSERT_EQ(got.size(), 12u * 2);
      Sha256 h;
      h.update(got.data(), got.size());
      const bundle::ShardRef ref{ckpt.find("model.w"), dim, part * rank, part * (rank + 1), DType::BF16};
      EXPECT_EQ(h.hex(), bundle::fingerprint(ckpt, ref)) << "dim " << dim << " rank " << rank;
    }
  EXPECT_EQ(src.rank_bytes(w, -1, 0, 0), src.full_bytes(w));
}

TEST(Weights, UnconvertibleCheckpointDtypeIsAnInputError) {
  test::TempDir dir;
  st::write_file(dir / "model.safetensors", {{"model.w", DType::I32, {2}, std::vector<uint8_t>(8, 0)}}, {});
  const st::Checkpoint ckpt = st::Checkpoint::open(dir.path());
  model::Model m;
  model::WeightSpec w;
  w.name = "model.w";
  w.shape = {2};
  const WeightSource src(m, &ckpt, 0);
  test::expect_error([&] { src.full_bytes(w); }, Errc::input, {"model.w", "I32", "BF16"});
}

// An FP8 checkpoint (`synth --quantize fp8`): a rank binds the e4m3 bytes and the fp32 scales as they
// are stored, each cut by its own shape and split; without a checkpoint (random weights) the synth fill
// gives the same bytes; the CPU reference reads the dequantised values through lookup().
TEST(Weights, Fp8WeightsAndScalesAreBoundAsStored) {
  test::TempDir dir;
  model::SynthOptions so;
  so.preset = "kimi-linear-tiny";
  so.out = dir / "fp8";
  so.seed = 3;
  so.quantize = model::SynthQuantize::fp8;
  model::synthesize(so);
  const model::Model m = model::load_model(so.out.string());
  const st::Checkpoint ckpt = st::Checkpoint::open(so.out);
  const WeightSource disk(m, &ckpt, 0), fill(m, nullptr, 3);
  const model::WeightSpec* q = m.find("model.layers.1.self_attn.q_proj.weight");
  const model::WeightSpec* s = m.find("model.layers.1.self_attn.q_proj.weight_scale_inv");
  ASSERT_TRUE(q && s);
  ASSERT_EQ(q->dtype, DType::F8_E4M3);
  ASSERT_EQ(s->dtype, DType::F32);
  for (const model::WeightSpec* w : {q, s}) {
    SCOPED_TRACE(w->name);
    const auto stored = ckpt.data(*ckpt.find(w->name));
    const std::vector<uint8_t> full = disk.full_bytes(*w);
    EXPECT_TRUE(std::equal(full.begin(), full.end(), stored.begin(), stored.end()));
    EXPECT_EQ(fill.full_bytes(*w), full);
    // Rank 1 of 2 along dim 0 (q_proj [256, 256] -> rows 128..255, its scale [2, 2] -> row 1), hashed
    // as the build fingerprints it.
    const int64_t part = w->shape[0] / 2;
    const std::vector<uint8_t> r1 = disk.rank_bytes(*w, 0, part, 1);
    const size_t row = static_cast<size_t>(w->shape[1]) * dtype_size(w->dtype);
    ASSERT_EQ(r1.size(), static_cast<size_t>(part) * row);
    EXPECT_TRUE(std::equal(r1.begin(), r1.end(), full.begin() + static_cast<std::ptrdiff_t>(part * row)));
    Sha256 h;
    h.update(r1.data(), r1.size());
    const bundle::ShardRef ref{ckpt.find(w->name), 0, part, 2 * part, w->dtype};
    EXPECT_EQ(h.hex(), bundle::fingerprint(ckpt, ref));
  }
  // Every weight of an MoE layer, experts and their scales included, from the disk and from the fill.
  for (size_t i : m.layers[1].weights)
    ASSERT_EQ(fill.full_bytes(m.weights[i]), disk.full_bytes(m.weights[i])) << m.weights[i].name;
  // The reference over these sources sees e4m3 * scale.
  const ref::LayerWeights a(m, 1, disk.lookup(1)), b = ref::LayerWeights::from_synth(m, 1, 3);
  const std::vector<double>& v = a.get("self_attn.q_proj.weight").data;
  EXPECT_EQ(v, b.get("self_attn.q_proj.weight").data);
  const std::vector<double>& sc = a.get("self_attn.q_proj.weight_scale_inv").data;
  const auto e4 = disk.full_bytes(*q);
  EXPECT_EQ(v[300], static_cast<double>(e4m3_bits_to_f32(e4[300])) * sc[0]);  // row 1, column 44: block (0, 0)
  EXPECT_EQ(v[200 * 256 + 130], static_cast<double>(e4m3_bits_to_f32(e4[200 * 256 + 130])) * sc[3]);  // block (1, 1)
}

}  // namespace
}  // namespace dp::tools
