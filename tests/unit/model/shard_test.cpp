// The one tensor-parallel cut and dtype conversion (model/shard.h): what a rank binds must be what its
// fingerprint hashed, so the fingerprints (streamed from the checkpoint file) and slice_shard +
// convert_elements (the tools' path to the device) are compared byte for byte here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "bundle/fingerprint.h"
#include "common/hash.h"
#include "model/safetensors.h"
#include "model/shard.h"
#include "reference/numeric.h"
#include "../test_util.h"

namespace dp::model {
namespace {

std::vector<uint8_t> f32_bytes(const std::vector<float>& v) {
  std::vector<uint8_t> b(v.size() * 4);
  std::memcpy(b.data(), v.data(), b.size());
  return b;
}

std::string sha(const std::vector<uint8_t>& b) {
  Sha256 h;
  h.update(b.data(), b.size());
  return h.hex();
}

uint16_t bf16_from_f64(double d) {
  std::vector<uint8_t> in(8), out;
  std::memcpy(in.data(), &d, 8);
  convert_elements(in, DType::F64, DType::BF16, out);
  return static_cast<uint16_t>(out[0] | (out[1] << 8));
}

TEST(Shard, LayoutOfEachDimension) {
  const std::vector<int64_t> shape{4, 6, 2};
  const ShardLayout rows = shard_layout(shape, 2, {0, 2, 4}, "t");
  EXPECT_EQ(rows.outer, 1u);
  EXPECT_EQ(rows.run, 2u * 6 * 2 * 2);
  EXPECT_EQ(rows.first, 2u * 6 * 2 * 2);
  const ShardLayout cols = shard_layout(shape, 2, {1, 3, 6}, "t");
  EXPECT_EQ(cols.outer, 4u);
  EXPECT_EQ(cols.run, 3u * 2 * 2);
  EXPECT_EQ(cols.stride, 6u * 2 * 2);
  EXPECT_EQ(cols.offset(1), 6u * 2 * 2 + 3u * 2 * 2);
  const ShardLayout whole = shard_layout(shape, 2, {}, "t");
  EXPECT_EQ(whole.bytes(), 4u * 6 * 2 * 2);
}

TEST(Shard, RangeOutsideTheTensorIsRefused) {
  const std::vector<int64_t> shape{4, 6};
  test::expect_error([&] { shard_layout(shape, 4, {1, 4, 7}, "w"); }, Errc::verify,
                     {"tensor w", "[4, 6]", "[4, 7)", "dimension 1"});
  test::expect_error([&] { shard_layout(shape, 4, {2, 0, 1}, "w"); }, Errc::verify, {"dimension 2"});
  test::expect_error([&] { shard_layout(shape, 4, {0, 3, 2}, "w"); }, Errc::verify, {"[3, 2)"});
}

TEST(Shard, SliceTakesTheRanksColumns) {
  // [2, 4] of 1-byte elements 0..7; rank 1 of 2 along dimension 1 holds columns 2 and 3 of each row.
  const std::vector<uint8_t> full{0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int64_t> shape{2, 4};
  EXPECT_EQ(slice_shard(full, shape, 1, rank_cut(1, 2, 1), "t"), (std::vector<uint8_t>{2, 3, 6, 7}));
  EXPECT_EQ(slice_shard(full, shape, 1, rank_cut(0, 1, 1), "t"), (std::vector<uint8_t>{4, 5, 6, 7}));
  EXPECT_EQ(slice_shard(full, shape, 1, rank_cut(-1, 0, 0), "t"), full);
}

// The fingerprint of every rank's shard equals the sha256 of the bytes slice_shard and
// convert_elements produce from the whole tensor: both sides of `run --verify-weights`.
TEST(Shard, SliceAndConversionAgreeWithFingerprints) {
  test::TempDir dir;
  std::vector<float> v(6 * 8 * 3);
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.f, 3.f);
  for (float& x : v) x = dist(rng);
  v[5] = std::numeric_limits<float>::quiet_NaN();
  v[17] = -std::numeric_limits<float>::quiet_NaN();
  uint32_t payload_nan = 0x7f800001u;  // rounds to Inf by the plain formula
  std::memcpy(&v[30], &payload_nan, 4);
  v[31] = std::numeric_limits<float>::infinity();
  const std::vector<int64_t> shape{6, 8, 3};
  const std::vector<uint8_t> full = f32_bytes(v);
  st::write_file(dir / "model.safetensors", {{"w", DType::F32, shape, full}}, {});
  const st::Checkpoint ckpt = st::Checkpoint::open(dir.path());
  const st::TensorInfo* t = ckpt.find("w");
  ASSERT_NE(t, nullptr);
  for (DType to : {DType::F32, DType::BF16})
    for (int dim = -1; dim < 3; ++dim)
      for (int tp : {1, 2}) {
        if (dim < 0 && tp > 1) continue;
        const int64_t part = dim < 0 ? 0 : shape[static_cast<size_t>(dim)] / tp;
        for (int rank = 0; rank < tp; ++rank) {
          const ShardCut cut = rank_cut(dim, part, rank);
          std::vector<uint8_t> device;
          convert_elements(slice_shard(full, shape, 4, cut, "w"), DType::F32, to, device);
          const std::string fp = bundle::fingerprint(ckpt, {t, cut.split_dim, cut.begin, cut.end, to});
          EXPECT_EQ(fp, sha(device)) << dtype_name(to) << " dim " << dim << " rank " << rank << " of " << tp;
        }
      }
}

TEST(Convert, Bf16ToF32AndBackIsTheIdentity) {
  for (uint32_t b = 0; b < 0x10000; ++b) {
    const std::vector<uint8_t> in{static_cast<uint8_t>(b), static_cast<uint8_t>(b >> 8)};
    std::vector<uint8_t> f32, back;
    convert_elements(in, DType::BF16, DType::F32, f32);
    ASSERT_EQ(f32.size(), 4u);
    uint32_t u;
    std::memcpy(&u, f32.data(), 4);
    ASSERT_EQ(u, b << 16);  // exact widening, NaN payloads included
    convert_elements(f32, DType::F32, DType::BF16, back);
    const uint16_t r = static_cast<uint16_t>(back[0] | (back[1] << 8));
    const bool nan = (b & 0x7f80) == 0x7f80 && (b & 0x7f);
    if (nan)  // a NaN stays a NaN of its sign (quieted)
      ASSERT_EQ(r, b | 0x40) << std::hex << b;
    else
      ASSERT_EQ(r, b) << std::hex << b;
  }
}

TEST(Convert, F16IsWidenedExactly) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const std::vector<uint8_t> in{static_cast<uint8_t>(h), static_cast<uint8_t>(h >> 8)};
    std::vector<uint8_t> out;
    convert_elements(in, DType::F16, DType::F32, out);
    float f;
    std::memcpy(&f, out.data(), 4);
    const double want = ref::decode_tensor(in, DType::F16, "h")[0];
    if (std::isnan(want)) {
      ASSERT_TRUE(std::isnan(f)) << std::hex << h;
      ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << std::hex << h;
    } else {
      ASSERT_EQ(static_cast<double>(f), want) << std::hex << h;
    }
  }
}

TEST(Convert, F64ToBf16RoundsOnceToNearestEven) {
  // The reference's correctly rounded double -> bf16 is the oracle, over random doubles of every
  // magnitude bf16 has (subnormals, overflow to Inf included), and ties.
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int> exp(-140, 130);
  std::uniform_real_distribution<double> mant(1.0, 2.0);
  for (int i = 0; i < 200000; ++i) {
    const double d = (i & 1 ? -1 : 1) * std::ldexp(mant(rng), exp(rng));
    ASSERT_EQ(bf16_from_f64(d), ref::double_to_bf16_bits(d)) << d;
  }
  // 1 + 2^-8 is a tie (rounds to even 1.0); a hair above it, which an fp32 step would round onto the
  // tie, must round up.
  EXPECT_EQ(bf16_from_f64(1.0 + std::ldexp(1.0, -8)), 0x3f80);
  EXPECT_EQ(bf16_from_f64(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40)), 0x3f81);
  EXPECT_EQ(bf16_from_f64(1e300), 0x7f80);
  EXPECT_EQ(bf16_from_f64(-1e-300), 0x8000);
  const uint16_t n = bf16_from_f64(-std::numeric_limits<double>::quiet_NaN());
  EXPECT_EQ(n & 0xff80, 0xff80);
  EXPECT_NE(n & 0x7f, 0);
}

TEST(Convert, OnlyFloatsNarrowOrWiden) {
  EXPECT_TRUE(can_convert(DType::U8, DType::F8_E8M0));  // E8M0 scales stored as U8
  EXPECT_TRUE(can_convert(DType::F16, DType::BF16));
  EXPECT_FALSE(can_convert(DType::I32, DType::F32));
  EXPECT_FALSE(can_convert(DType::F32, DType::F16));
  std::vector<uint8_t> out;
  test::expect_error([&] { convert_elements({}, DType::I8, DType::BF16, out); }, Errc::internal, {"I8", "BF16"});
}

}  // namespace
}  // namespace dp::model
