// The float64 CPU reference over FP8 block-quantized checkpoints (DeepSeek-style: e4m3 weights and an
// fp32 weight_scale_inv per 128 x 128 block): a weight's real values are e4m3 * the scale of its block,
// whether the weight comes from a checkpoint on disk or the synth fill, dense or routed expert, whole
// or one rank's shard, and a whole layer computed from them is the layer of those values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "../test_util.h"
#include "common/dtype.h"
#include "common/embedded.h"
#include "common/json.h"
#include "model/quant.h"
#include "model/safetensors.h"
#include "model/synth.h"
#include "reference/layer.h"
#include "reference/numeric.h"

namespace dp::ref {
namespace {

using model::Model;

const Model& bf16_tiny() {
  static const Model m = model::load_model("kimi-linear-tiny");
  return m;
}
// The tiny preset with the quantization_config `synth --quantize fp8` writes.
const Model& fp8_tiny() {
  static const Model m = [] {
    Json cfg = parse_json(*embedded_file("presets/kimi-linear-tiny.json"), "kimi-linear-tiny");
    cfg["quantization_config"] = model::fp8_quantization_config(bf16_tiny());
    return model::model_from_config(cfg, "kimi-linear-tiny with --quantize fp8");
  }();
  return m;
}

std::vector<double> rand_vec(size_t n, uint64_t seed, double scale) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-scale, scale);
  std::vector<double> v(n);
  for (double& e : v) e = round_bf16(u(rng));
  return v;
}
Mat rand_mat(int64_t rows, int64_t cols, uint64_t seed, double scale = 1.0) {
  Mat m(rows, cols);
  m.v = rand_vec(m.v.size(), seed, scale);
  return m;
}

// What the synth fill's FP8 weight `key` of `layer` holds, dequantised here by hand from the bf16 fill
// (quantize_fp8_blocks of the same values, then e4m3 * scale per element).
std::vector<double> hand_dequant(const Model& m, int layer, const std::string& key, uint64_t seed) {
  const model::WeightSpec& w = find_weight(m, layer, key);
  const std::vector<uint8_t> bf = model::synth_tensor(w, DType::BF16, seed);
  std::vector<float> v(bf.size() / 2);
  for (size_t i = 0; i < v.size(); ++i) {
    uint16_t b;
    std::memcpy(&b, &bf[2 * i], 2);
    v[i] = bf16_bits_to_f32(b);
  }
  const int64_t rows = w.shape[0], cols = w.shape[1], bc = (cols + 127) / 128;
  const model::Fp8Blocks q = model::quantize_fp8_blocks(v, rows, cols, 128);
  std::vector<double> out(v.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[static_cast<size_t>(r * cols + c)] = static_cast<double>(e4m3_bits_to_f32(q.values[r * cols + c])) *
                                               static_cast<double>(q.scale_inv[(r / 128) * bc + c / 128]);
  return out;
}

// A lookup for the bf16 model that returns, for every weight the FP8 model quantizes, the FP8 model's
// dequantised values (a bf16-model checkpoint holding exactly the FP8 checkpoint's real values), and
// the bf16 fill for everything else.
WeightLookup dequantised_as_bf16(int layer, uint64_t seed) {
  return [layer, seed](const std::string& key) {
    const model::WeightSpec& q = find_weight(fp8_tiny(), layer, key);
    if (q.quant.method == model::QuantMethod::fp8_block)
      return real_values(fp8_tiny(), q, synth_lookup(fp8_tiny(), layer, seed));
    return synth_lookup(bf16_tiny(), layer, seed)(key);
  };
}

Options none() {
  Options o;
  o.rounding = Rounding::none();
  return o;
}

TEST(ReferenceFp8, DecodesE4m3BytesByValue) {
  // 0, 1, -1, 1.5, the largest (448), the smallest normal (2^-6), the smallest subnormal (2^-9), -0.
  const std::vector<uint8_t> bytes{0x00, 0x38, 0xB8, 0x3C, 0x7E, 0x08, 0x01, 0x80};
  const std::vector<double> v = decode_tensor(bytes, DType::F8_E4M3, "w");
  EXPECT_EQ(v, (std::vector<double>{0.0, 1.0, -1.0, 1.5, 448.0, 0x1p-6, 0x1p-9, -0.0}));
  EXPECT_TRUE(std::signbit(v[7]));
  EXPECT_TRUE(std::isnan(decode_tensor(std::vector<uint8_t>{0x7F}, DType::F8_E4M3, "w")[0]));
  test::expect_error([] { decode_tensor(std::vector<uint8_t>{1, 2}, DType::F8_E5M2, "model.x.weight"); }, Errc::input,
                     {"model.x.weight", "F8_E5M2", "F8_E4M3"});
}

TEST(ReferenceFp8, DequantMultipliesEachValueByItsBlocksScale) {
  // [3, 5] values in 2 x 2 blocks: scales [2, 3], the last block row and column partial.
  const std::vector<double> v{1, 2, 3, 4, 5,  //
                              6, 7, 8, 9, 10,  //
                              -1, -2, -3, -4, 0.5};
  const std::vector<double> s{0.5, 2, 0x1p-10,  //
                              3, 0.25, 1e-3};
  const std::vector<double> want{0.5, 1, 6, 8, 5 * 0x1p-10,  //
                                 3, 3.5, 16, 18, 10 * 0x1p-10,  //
                                 -3, -6, -0.75, -1, 0.5e-3};
  EXPECT_EQ(dequant_fp8_blocks(v, s, 3, 5, 2, 2, "w"), want);
  // The real layout: 128 x 128 blocks over [200, 136] (partial blocks in both dimensions).
  std::vector<double> big(200 * 136), sc{2.0, 3.0, 5.0, 7.0};
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<double>(i % 7) - 3;
  const std::vector<double> d = dequant_fp8_blocks(big, sc, 200, 136, 128, 128, "w");
  EXPECT_EQ(d[0 * 136 + 127], big[127] * 2);
  EXPECT_EQ(d[0 * 136 + 128], big[128] * 3);
  EXPECT_EQ(d[127 * 136 + 135], big[127 * 136 + 135] * 3);
  EXPECT_EQ(d[128 * 136 + 0], big[128 * 136] * 5);
  EXPECT_EQ(d[199 * 136 + 135], big[199 * 136 + 135] * 7);
  const std::vector<double> two{1.0, 2.0};
  test::expect_error([&] { dequant_fp8_blocks(big, two, 200, 136, 128, 128, "model.q.weight"); }, Errc::input,
                     {"model.q.weight", "2 values", "[2, 2] = 4"});
  test::expect_error([&] { dequant_fp8_blocks(v, s, 3, 4, 2, 2, "model.q.weight"); }, Errc::input,
                     {"model.q.weight", "15 values", "[3, 4] = 12"});
}

TEST(ReferenceFp8, LayerWeightsAreE4m3TimesTheBlockScale) {
  const Model& m = fp8_tiny();
  ASSERT_EQ(find_weight(m, 1, "self_attn.q_proj.weight").quant.method, model::QuantMethod::fp8_block);
  LayerWeights w = LayerWeights::from_synth(m, 1, 7);
  const LayerWeights b = LayerWeights::from_synth(bf16_tiny(), 1, 7);
  for (const char* key : {"self_attn.q_proj.weight", "self_attn.o_proj.weight",
                          "block_sparse_moe.shared_experts.down_proj.weight"}) {
    SCOPED_TRACE(key);
    const Tensor& t = w.get(key);
    EXPECT_EQ(t.shape, find_weight(m, 1, key).shape);
    EXPECT_EQ(t.data, hand_dequant(m, 1, key, 7));
    // Within the quantization error of the bf16 values the FP8 weights were made from (half an e4m3
    // step: 2^-4 relative, or the block's subnormal step), and not equal to them.
    const Tensor& o = b.get(key);
    ASSERT_EQ(o.data.size(), t.data.size());
    const std::vector<double>& s = w.get(std::string(key).substr(0, std::strlen(key) - 7) + ".weight_scale_inv").data;
    const int64_t bc = (t.cols() + 127) / 128;
    int64_t differ = 0;
    for (int64_t r = 0; r < t.rows(); ++r)
      for (int64_t c = 0; c < t.cols(); ++c) {
        const double x = o.at(r, c), y = t.at(r, c), sc = s[static_cast<size_t>((r / 128) * bc + c / 128)];
        ASSERT_LE(std::fabs(x - y), std::max(std::fabs(x) * 0x1p-4, sc * 0x1p-10) * 1.0001) << r << "," << c;
        differ += x != y;
      }
    EXPECT_GT(differ, t.numel() / 4);
  }
  // Kept bf16 by the ignore list: the stored values themselves.
  EXPECT_EQ(w.get("self_attn.f_a_proj.weight").data, b.get("self_attn.f_a_proj.weight").data);
  EXPECT_EQ(w.get("block_sparse_moe.gate.weight").data, b.get("block_sparse_moe.gate.weight").data);
  // A scale tensor asked for by its own key: as stored, [ceil(rows/128), ceil(cols/128)].
  EXPECT_EQ(w.get("self_attn.q_proj.weight_scale_inv").shape, (std::vector<int64_t>{2, 2}));
  // Routed experts, loaded one at a time: dequantised too, and the lookups name weight, then scale.
  const Tensor e = w.expert(5, "w2");
  EXPECT_EQ(e.shape, (std::vector<int64_t>{m.hidden, m.moe.intermediate}));
  EXPECT_EQ(e.data, hand_dequant(m, 1, "block_sparse_moe.experts.5.w2.weight", 7));
  ASSERT_GE(w.lookups().size(), 2u);
  EXPECT_EQ(w.lookups()[w.lookups().size() - 2], "block_sparse_moe.experts.5.w2.weight");
  EXPECT_EQ(w.lookups().back(), "block_sparse_moe.experts.5.w2.weight_scale_inv");
}

TEST(ReferenceFp8, ShardsAreCutFromTheDequantisedTensor) {
  const Model& m = fp8_tiny();
  const LayerWeights full = LayerWeights::from_synth(m, 1, 3);
  const LayerWeights r1 = LayerWeights::from_synth(m, 1, 3, {2, 1});
  // An expert's w1 [128, 256] split along dim 0 at tp 2: 64 rows per rank, inside one 128-row block
  // (a build refuses this split; the reference still cuts the real values, each with its own scale).
  const Tensor a = full.expert(2, "w1"), b = r1.expert(2, "w1");
  ASSERT_EQ(b.shape, (std::vector<int64_t>{64, 256}));
  for (int64_t r = 0; r < 64; ++r)
    for (int64_t c = 0; c < 256; ++c) ASSERT_EQ(b.at(r, c), a.at(64 + r, c)) << r << "," << c;
  // o_proj [256, 256] row-parallel: columns [128, 256), the second block column's scales.
  const Tensor& o = r1.get("self_attn.o_proj.weight");
  ASSERT_EQ(o.shape, (std::vector<int64_t>{256, 128}));
  EXPECT_EQ(o.at(200, 3), full.get("self_attn.o_proj.weight").at(200, 131));
}

TEST(ReferenceFp8, CheckpointOnDiskMatchesTheSynthFill) {
  test::TempDir dir;
  model::SynthOptions so;
  so.preset = "kimi-linear-tiny";
  so.out = dir / "fp8";
  so.seed = 5;
  so.quantize = model::SynthQuantize::fp8;
  model::synthesize(so);
  const Model m = model::load_model(so.out.string());
  ASSERT_EQ(m.quant.method, model::QuantMethod::fp8_block);
  const st::Checkpoint ck = st::Checkpoint::open(so.out);
  int64_t fp8 = 0, scales = 0;
  for (int layer = 0; layer < 4; ++layer) {
    const LayerWeights a = LayerWeights::from_checkpoint(m, ck, layer), b = LayerWeights::from_synth(m, layer, 5);
    for (size_t i : m.layers[static_cast<size_t>(layer)].weights) {
      const model::WeightSpec& w = m.weights[i];
      // synth_weight gives the bytes synthesize() wrote, weights and scales alike.
      const st::TensorInfo* t = ck.find(w.name);
      ASSERT_TRUE(t) << w.name;
      const auto on_disk = ck.data(*t);
      const std::vector<uint8_t> fill = model::synth_weight(m, w, 5);
      ASSERT_TRUE(std::equal(on_disk.begin(), on_disk.end(), fill.begin(), fill.end())) << w.name;
      ASSERT_EQ(a.get(w.key).data, b.get(w.key).data) << w.key;
      fp8 += w.quant.method == model::QuantMethod::fp8_block;
      scales += !w.scale_of.empty();
    }
  }
  EXPECT_GT(fp8, 50);
  EXPECT_EQ(fp8, scales);
}

// A layer of the FP8 model is the layer of a bf16 model holding the dequantised values (so every weight
// the layer reads, routed experts included, went through its scales), and close to the layer of the
// bf16 weights the FP8 ones were quantized from.
TEST(ReferenceFp8, LayerEqualsTheLayerOfTheDequantisedValues) {
  const int64_t W = 3, q = 2, H = fp8_tiny().hidden, bs = 4;
  for (int layer = 0; layer < 4; ++layer) {
    SCOPED_TRACE(fmt::format("layer {}", layer));
    const LayerWeights f = LayerWeights::from_synth(fp8_tiny(), layer, 11);
    const LayerWeights d(bf16_tiny(), layer, dequantised_as_bf16(layer, 11));
    const LayerWeights o = LayerWeights::from_synth(bf16_tiny(), layer, 11);
    StepMeta meta = StepMeta::simple(W, q, {5, 9, 3}, bs, 3);
    meta.num_accepted = {2, 1, 2};
    LayerState s0;
    s0.kda = KdaState::zeros(fp8_tiny(), {}, 1 + W * q, fp8_tiny().kda.conv_kernel - 1);
    s0.kda.recurrent = rand_vec(s0.kda.recurrent.size(), 1, 0.5);
    s0.kda.conv_q = rand_vec(s0.kda.conv_q.size(), 2, 1.0);
    s0.kda.conv_k = rand_vec(s0.kda.conv_k.size(), 3, 1.0);
    s0.kda.conv_v = rand_vec(s0.kda.conv_v.size(), 4, 1.0);
    s0.mla = MlaCache::zeros(fp8_tiny(), 10, bs);
    s0.mla.data = rand_vec(s0.mla.data.size(), 5, 1.0);
    const Mat hid = rand_mat(W * q, H, 20), res = rand_mat(W * q, H, 21);
    LayerState sf = s0, sd = s0, so = s0;
    Trace tf, to;
    const LayerOutput of = decoder_layer(f, hid, &res, meta, sf, {}, &tf);
    const LayerOutput od = decoder_layer(d, hid, &res, meta, sd, {});
    const LayerOutput oo = decoder_layer(o, hid, &res, meta, so, {}, &to);
    EXPECT_EQ(of.hidden.v, od.hidden.v);
    EXPECT_EQ(of.residual.v, od.residual.v);
    EXPECT_EQ(sf.kda.recurrent, sd.kda.recurrent);
    EXPECT_EQ(sf.mla.data, sd.mla.data);
    // The quantization error of the weights (up to 2^-4 relative each) moves the mixer output by a few
    // percent, never more (the FFN is left out: its routing may differ between the two on near-ties).
    const double e = rel_error(tf.at("mixer_out"), to.at("mixer_out"));
    EXPECT_GT(e, 1e-3);
    EXPECT_LT(e, 0.1);
    if (layer == 0) {
      const double h = rel_error(of.hidden, oo.hidden);
      EXPECT_GT(h, 1e-3);
      EXPECT_LT(h, 0.1);
    }
  }
}

// Tensor parallelism over FP8 weights: the ranks' partials sum to the whole layer (exact math).
TEST(ReferenceFp8, TensorParallelPartialsSumToTp1) {
  const Model& m = fp8_tiny();
  const int64_t W = 2, q = 1, H = m.hidden;
  for (int layer : {0, 1, 3}) {
    SCOPED_TRACE(fmt::format("layer {}", layer));
    const LayerWeights full = LayerWeights::from_synth(m, layer, 13);
    const LayerWeights r0 = LayerWeights::from_synth(m, layer, 13, {2, 0});
    const LayerWeights r1 = LayerWeights::from_synth(m, layer, 13, {2, 1});
    const Mat x = rand_mat(W * q, H, 30);
    const Mat f0 = m.layers[layer].ffn == model::Ffn::dense ? dense_mlp(r0, x, none()) : moe(r0, x, none());
    Mat f1 = m.layers[layer].ffn == model::Ffn::dense ? dense_mlp(r1, x, none()) : moe(r1, x, none());
    const Mat ff = m.layers[layer].ffn == model::Ffn::dense ? dense_mlp(full, x, none()) : moe(full, x, none());
    for (size_t i = 0; i < f1.v.size(); ++i) f1.v[i] += f0.v[i];
    EXPECT_LT(rel_error(f1, ff), 1e-13);
    EXPECT_GT(rel_error(f0, ff), 0.1);
  }
}

TEST(ReferenceFp8, AScaleOfTheWrongSizeIsAnInputError) {
  const Model& m = fp8_tiny();
  const WeightLookup base = synth_lookup(m, 1, 3);
  const LayerWeights w(m, 1, [&](const std::string& key) {
    std::vector<double> v = base(key);
    if (key == "self_attn.k_proj.weight_scale_inv") v.pop_back();
    return v;
  });
  test::expect_error([&] { w.get("self_attn.k_proj.weight"); }, Errc::input,
                     {"model.layers.1.self_attn.k_proj.weight", "3 values", "[2, 2] = 4"});
}

}  // namespace
}  // namespace dp::ref
