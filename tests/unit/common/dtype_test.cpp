// fp32 -> bf16 and fp32 <-> e4m3 conversions shared by synth, fingerprints and the tools.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "common/dtype.h"

namespace dp {
namespace {

TEST(DType, F32ToBf16RoundsToNearestEvenAndKeepsNaN) {
  auto bits = [](uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f32_to_bf16_bits(f);
  };
  EXPECT_EQ(bits(0x3f800000u), 0x3f80);  // 1.0 exactly
  EXPECT_EQ(bits(0x3f808000u), 0x3f80);  // a tie rounds to the even 0x3f80
  EXPECT_EQ(bits(0x3f818000u), 0x3f82);  // a tie rounds to the even 0x3f82
  EXPECT_EQ(bits(0x3f808001u), 0x3f81);  // above the tie rounds up
  EXPECT_EQ(bits(0x7f800000u), 0x7f80);  // +Inf stays
  EXPECT_EQ(bits(0xff800000u), 0xff80);  // -Inf stays
  EXPECT_EQ(bits(0x7f7fffffu), 0x7f80);  // the largest float rounds to Inf, as torch does
  // A NaN whose payload sits in the low bits would round to Inf by the plain formula; it stays a NaN.
  const uint16_t n = bits(0x7f800001u);
  EXPECT_EQ(n & 0x7f80, 0x7f80);
  EXPECT_NE(n & 0x007f, 0);
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

TEST(DType, F32ToE4m3HandComputedValues) {
  EXPECT_EQ(f32_to_e4m3_bits(1.0f), 0x38);        // exponent field 7 (bias 7), mantissa 0
  EXPECT_EQ(f32_to_e4m3_bits(-1.0f), 0xb8);
  EXPECT_EQ(f32_to_e4m3_bits(0.1f), 0x1d);        // 1.6 * 2^-4 -> 13/8 * 2^-4 = 0.1015625
  EXPECT_EQ(f32_to_e4m3_bits(240.0f), 0x77);      // 15/8 * 2^7
  EXPECT_EQ(f32_to_e4m3_bits(416.0f), 0x7d);      // 13/8 * 2^8
  EXPECT_EQ(f32_to_e4m3_bits(448.0f), 0x7e);      // the largest finite value
  EXPECT_EQ(f32_to_e4m3_bits(-448.0f), 0xfe);
  EXPECT_EQ(f32_to_e4m3_bits(0x1p-6f), 0x08);     // the smallest normal
  // Ties round to even: 1 + 1/16 lies halfway between 1 (mantissa 0) and 1.125 (mantissa 1).
  EXPECT_EQ(f32_to_e4m3_bits(1.0625f), 0x38);
  EXPECT_EQ(f32_to_e4m3_bits(1.1875f), 0x3a);     // between 1.125 and 1.25: to mantissa 2
  EXPECT_EQ(f32_to_e4m3_bits(432.0f), 0x7e);      // between 416 and 448: to the even 448
  EXPECT_EQ(f32_to_e4m3_bits(1.0625001f), 0x39);  // just above the tie rounds up
}

TEST(DType, F32ToE4m3Subnormals) {
  EXPECT_EQ(f32_to_e4m3_bits(0x1p-9f), 0x01);          // the smallest subnormal
  EXPECT_EQ(f32_to_e4m3_bits(7 * 0x1p-9f), 0x07);      // the largest subnormal
  EXPECT_EQ(f32_to_e4m3_bits(-3 * 0x1p-9f), 0x83);
  EXPECT_EQ(f32_to_e4m3_bits(0x1p-10f), 0x00);         // halfway to the smallest: to the even 0
  EXPECT_EQ(f32_to_e4m3_bits(-0x1p-10f), 0x80);        // ... keeping the sign
  EXPECT_EQ(f32_to_e4m3_bits(3 * 0x1p-10f), 0x02);     // 1.5 * 2^-9: to the even 2
  EXPECT_EQ(f32_to_e4m3_bits(1.2f * 0x1p-10f), 0x01);  // above half: up to the smallest
  EXPECT_EQ(f32_to_e4m3_bits(7.5f * 0x1p-9f), 0x08);   // halfway between 7 * 2^-9 and 2^-6: to the normal
  EXPECT_EQ(f32_to_e4m3_bits(1e-30f), 0x00);           // far below: zero
  EXPECT_FLOAT_EQ(e4m3_bits_to_f32(0x01), 0x1p-9f);
  EXPECT_FLOAT_EQ(e4m3_bits_to_f32(0x87), -7 * 0x1p-9f);
}

TEST(DType, F32ToE4m3ZerosSaturationAndNaN) {
  EXPECT_EQ(f32_to_e4m3_bits(0.0f), 0x00);
  EXPECT_EQ(f32_to_e4m3_bits(-0.0f), 0x80);
  EXPECT_TRUE(std::signbit(e4m3_bits_to_f32(0x80)));
  EXPECT_EQ(e4m3_bits_to_f32(0x80), 0.0f);
  // Beyond 448 every value saturates (e4m3fn has no infinity; 0x7f would be NaN).
  EXPECT_EQ(f32_to_e4m3_bits(449.0f), 0x7e);
  EXPECT_EQ(f32_to_e4m3_bits(464.0f), 0x7e);
  EXPECT_EQ(f32_to_e4m3_bits(1e30f), 0x7e);
  EXPECT_EQ(f32_to_e4m3_bits(-1e30f), 0xfe);
  EXPECT_EQ(f32_to_e4m3_bits(from_bits(0x7f800000u)), 0x7e);  // +Inf
  EXPECT_EQ(f32_to_e4m3_bits(from_bits(0xff800000u)), 0xfe);  // -Inf
  EXPECT_EQ(f32_to_e4m3_bits(std::nanf("")), 0x7f);
  EXPECT_TRUE(std::isnan(e4m3_bits_to_f32(0x7f)));
  EXPECT_TRUE(std::isnan(e4m3_bits_to_f32(0xff)));
}

TEST(DType, E4m3RoundTripsEveryValueAndRoundsToTheNearest) {
  for (int b = 0; b < 256; ++b) {
    if ((b & 0x7f) == 0x7f) continue;  // NaN
    const float v = e4m3_bits_to_f32(static_cast<uint8_t>(b));
    EXPECT_EQ(f32_to_e4m3_bits(v), b) << b;
  }
  EXPECT_EQ(e4m3_bits_to_f32(0x7e), 448.0f);
  // Against a brute-force nearest over every finite value (ties excluded by the irrational step).
  for (float x = -500.0f; x < 500.0f; x += 0.0137f * (1.0f + std::fabs(x) / 16)) {
    int best = -1;
    float err = 1e9f;
    for (int b = 0; b < 256; ++b) {
      if ((b & 0x7f) == 0x7f) continue;
      const float e = std::fabs(e4m3_bits_to_f32(static_cast<uint8_t>(b)) - std::clamp(x, -448.0f, 448.0f));
      if (e < err) err = e, best = b;
    }
    const float got = e4m3_bits_to_f32(f32_to_e4m3_bits(x));
    EXPECT_EQ(std::fabs(got - std::clamp(x, -448.0f, 448.0f)), err) << x << " -> " << got << ", nearest "
                                                                    << e4m3_bits_to_f32(static_cast<uint8_t>(best));
  }
}

// The conversion works on the float's bits; this is the definition it must equal, on exact values:
// saturate at 448, round half to even to a multiple of 2^-9 below 2^-6, to 3 mantissa bits above.
uint8_t e4m3_by_definition(float f) {
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return sign | 0x7f;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= 448.0) return sign | 0x7e;
  if (a < 0x1p-6) return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, 9)));
  int e = 0;
  std::frexp(a, &e);
  const int q = static_cast<int>(std::nearbyint(std::ldexp(a, 4 - e)));
  const int bits = ((e + 6) << 3) + (q - 8);
  return sign | static_cast<uint8_t>(bits > 0x7e ? 0x7e : bits);
}

TEST(DType, F32ToE4m3EqualsTheDefinitionOnBitPatterns) {
  // Every 4099th float bit pattern (about a million, both signs, NaN and Inf included), and every e4m3
  // value's neighbourhood: the value, the midpoints to its neighbours and one float step either side.
  // (All 2^32 patterns were compared once when the bit form replaced the frexp one: none differed.)
  size_t bad = 0;
  auto check = [&](uint32_t u) {
    const float f = from_bits(u);
    if (f32_to_e4m3_bits(f) != e4m3_by_definition(f) && bad++ < 10)
      ADD_FAILURE() << std::hex << "bits " << u << ": " << int(f32_to_e4m3_bits(f)) << ", expected "
                    << int(e4m3_by_definition(f));
  };
  for (uint64_t u = 0; u < (1ull << 32); u += 4099) check(static_cast<uint32_t>(u));
  for (int b = 0; b < 127; ++b) {
    const float v = e4m3_bits_to_f32(static_cast<uint8_t>(b));
    const float next = b < 126 ? e4m3_bits_to_f32(static_cast<uint8_t>(b + 1)) : 464.0f;
    for (float x : {v, (v + next) / 2}) {
      uint32_t u;
      std::memcpy(&u, &x, 4);
      for (uint32_t d : {u - 1, u, u + 1})
        if (d < 0x7f800000u) check(d), check(d | 0x80000000u);
    }
  }
  EXPECT_EQ(bad, 0u);
}

}  // namespace
}  // namespace dp
