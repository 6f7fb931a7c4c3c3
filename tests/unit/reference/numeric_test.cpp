// Scalar numerics of the CPU reference: bf16 rounding, decoders, MXFP4, activations.
#include "reference/numeric.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>

#include "../test_util.h"

namespace dp::ref {
namespace {

// Round-to-nearest-even through fp32 bits: an independent bf16 rounding for values that are fp32.
uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fff + ((u >> 16) & 1);
  return static_cast<uint16_t>(u >> 16);
}

TEST(RefNumeric, Bf16RoundingTiesToEven) {
  EXPECT_EQ(round_bf16(1.0), 1.0);
  EXPECT_EQ(round_bf16(1.0 + std::ldexp(1.0, -8)), 1.0);                                // tie -> even (1.0)
  EXPECT_EQ(round_bf16(1.0 + 3 * std::ldexp(1.0, -8)), 1.0 + std::ldexp(1.0, -6));      // tie -> even
  EXPECT_EQ(round_bf16(1.0 + std::ldexp(1.0, -8) + 1e-12), 1.0 + std::ldexp(1.0, -7));  // above the tie
  EXPECT_EQ(round_bf16(-3.0), -3.0);
  EXPECT_EQ(round_bf16(0.0), 0.0);
  EXPECT_TRUE(std::isinf(round_bf16(1e39)));
  EXPECT_TRUE(std::isnan(round_bf16(std::nan(""))));
  // Subnormal range: the quantum stays 2^-133.
  EXPECT_EQ(round_bf16(std::ldexp(1.0, -133)), std::ldexp(1.0, -133));
  EXPECT_EQ(round_bf16(std::ldexp(1.4, -133)), std::ldexp(1.0, -133));
}

TEST(RefNumeric, Bf16AgreesWithFp32BitRounding) {
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> u(-100.f, 100.f);
  for (int i = 0; i < 100000; ++i) {
    const float f = u(rng) * std::ldexp(1.0f, static_cast<int>(rng() % 40) - 20);
    ASSERT_EQ(double_to_bf16_bits(f), float_to_bf16_bits(f)) << f;
    ASSERT_EQ(round_bf16(f), bf16_bits_to_double(float_to_bf16_bits(f))) << f;
  }
}

TEST(RefNumeric, DecodeTensor) {
  const uint8_t bf16[4] = {0x80, 0x3f, 0x40, 0xc0};  // 1.0, -3.0
  EXPECT_EQ(decode_tensor(bf16, DType::BF16, "t"), (std::vector<double>{1.0, -3.0}));
  float f[2] = {0.1f, -2.5f};
  std::vector<double> d = decode_tensor({reinterpret_cast<uint8_t*>(f), 8}, DType::F32, "t");
  EXPECT_EQ(d, (std::vector<double>{static_cast<double>(0.1f), -2.5}));
  const uint8_t u8[3] = {0, 127, 255};
  EXPECT_EQ(decode_tensor(u8, DType::U8, "t"), (std::vector<double>{0, 127, 255}));
  const uint8_t f16[2] = {0x00, 0x3c};  // 1.0
  EXPECT_EQ(decode_tensor(f16, DType::F16, "t"), (std::vector<double>{1.0}));
  test::expect_error([&] { decode_tensor(u8, DType::I8, "weird.weight"); }, Errc::input, {"weird.weight", "I8"});
  test::expect_error([&] { decode_tensor(u8, DType::BF16, "odd.weight"); }, Errc::input, {"odd.weight"});
}

TEST(RefNumeric, Mxfp4LowNibbleIsEvenElement) {
  EXPECT_EQ(e2m1_value(0x0), 0.0);
  EXPECT_EQ(e2m1_value(0x1), 0.5);
  EXPECT_EQ(e2m1_value(0x7), 6.0);
  EXPECT_EQ(e2m1_value(0xB), -1.5);
  EXPECT_EQ(e8m0_value(127), 1.0);
  EXPECT_EQ(e8m0_value(125), 0.25);
  EXPECT_TRUE(std::isnan(e8m0_value(255)));
  // One row of 32 elements: byte j = (hi << 4) | lo; element 2j = lo, 2j+1 = hi; scale 2^(128-127) = 2.
  std::vector<double> packed(16), scales = {128};
  for (int j = 0; j < 16; ++j) packed[j] = static_cast<double>(((j % 8) << 4) | ((j + 1) % 16));
  std::vector<double> v = dequant_mxfp4(packed, scales, 1, 32, 32, "w");
  for (int j = 0; j < 16; ++j) {
    EXPECT_EQ(v[2 * j], 2.0 * e2m1_value(static_cast<uint8_t>((j + 1) % 16))) << j;
    EXPECT_EQ(v[2 * j + 1], 2.0 * e2m1_value(static_cast<uint8_t>(j % 8))) << j;
  }
  test::expect_error([&] { dequant_mxfp4(packed, scales, 1, 30, 32, "w"); }, Errc::input, {"group"});
}

TEST(RefNumeric, Activations) {
  EXPECT_DOUBLE_EQ(sigmoid(0), 0.5);
  EXPECT_EQ(sigmoid(-1000), 0.0);
  EXPECT_EQ(sigmoid(1000), 1.0);
  EXPECT_DOUBLE_EQ(silu(2.0), 2.0 / (1 + std::exp(-2.0)));
  EXPECT_DOUBLE_EQ(softplus(0.0), std::log(2.0));
  EXPECT_EQ(softplus(25.0), 25.0);  // above the threshold: linear
  EXPECT_DOUBLE_EQ(softplus(19.0), std::log1p(std::exp(19.0)));
  EXPECT_EQ(softplus(-1000.0), 0.0);
  // SiTU: beta tanh(g/beta) sigmoid(g) * lb tanh(u/lb).
  const double g = 1.5, u = -30.0;
  EXPECT_DOUBLE_EQ(situ(g, u, 4.0, 25.0), 4.0 * std::tanh(g / 4.0) * sigmoid(g) * 25.0 * std::tanh(u / 25.0));
  EXPECT_NEAR(situ(1e-3, 1e-3, 4.0, 25.0), silu(1e-3) * 1e-3, 1e-9);  // near 0 SiTU ~ silu(g)*u
}

}  // namespace
}  // namespace dp::ref
