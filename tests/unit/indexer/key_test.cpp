// The MXFP4 index key (compiler/indexer/key.h): closed-form codes, scales, byte layout, round trips.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "indexer/key.h"
#include "../test_util.h"

namespace dp::indexer {
namespace {

TEST(IndexKey, LayoutConstants) {
  EXPECT_EQ(kHeadDim, 128);
  EXPECT_EQ(kPayloadBytes, 64);
  EXPECT_EQ(kGroups, 4);
  EXPECT_EQ(kKeyBytes, 68);
  EXPECT_EQ(kPageKeys, 64);
}

TEST(IndexKey, E2M1CodesOfRepresentableValues) {
  const double mags[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (uint8_t c = 0; c < 8; ++c) {
    EXPECT_EQ(e2m1_code(mags[c]), c) << mags[c];
    EXPECT_EQ(e2m1_code(-mags[c]), c | 8) << -mags[c];
  }
}

TEST(IndexKey, E2M1RoundsToNearestTiesToEvenCode) {
  // Midpoints: the even code (mantissa bit 0) wins.
  EXPECT_EQ(e2m1_code(0.25), 0);  // 0 (code 0) vs 0.5 (code 1)
  EXPECT_EQ(e2m1_code(0.75), 2);  // 0.5 (1) vs 1 (2)
  EXPECT_EQ(e2m1_code(1.25), 2);  // 1 (2) vs 1.5 (3)
  EXPECT_EQ(e2m1_code(1.75), 4);  // 1.5 (3) vs 2 (4)
  EXPECT_EQ(e2m1_code(2.5), 4);   // 2 (4) vs 3 (5)
  EXPECT_EQ(e2m1_code(3.5), 6);   // 3 (5) vs 4 (6)
  EXPECT_EQ(e2m1_code(5.0), 6);   // 4 (6) vs 6 (7)
  EXPECT_EQ(e2m1_code(-5.0), 14);
  // Off the midpoints: the nearest.
  EXPECT_EQ(e2m1_code(0.26), 1);
  EXPECT_EQ(e2m1_code(2.49), 4);
  EXPECT_EQ(e2m1_code(5.01), 7);
  EXPECT_EQ(e2m1_code(100.0), 7);  // saturates
  // The sign survives a rounding to zero: -0 is code 8.
  EXPECT_EQ(e2m1_code(-0.1), 8);
  EXPECT_EQ(e2m1_code(-0.0), 8);
  test::expect_error([] { e2m1_code(std::nan("")); }, Errc::input, {"NaN"});
}

TEST(IndexKey, Ue8m0ExponentIsTheSmallestThatCoversAmax) {
  EXPECT_EQ(ue8m0_exponent(6.0), 0);               // 6 <= 6 * 2^0
  EXPECT_EQ(ue8m0_exponent(std::nextafter(6.0, 7.0)), 1);
  EXPECT_EQ(ue8m0_exponent(3.0), -1);              // 3 <= 6 * 2^-1 = 3
  EXPECT_EQ(ue8m0_exponent(1.0), -2);              // 6 * 2^-3 = 0.75 < 1 <= 1.5
  EXPECT_EQ(ue8m0_exponent(12.0), 1);
  EXPECT_EQ(ue8m0_exponent(12.5), 2);
  // amax is floored at 1e-4: 6 * 2^-16 = 9.2e-5 < 1e-4 <= 6 * 2^-15 = 1.8e-4.
  EXPECT_EQ(ue8m0_exponent(0.0), -15);
  EXPECT_EQ(ue8m0_exponent(1e-9), -15);
  EXPECT_EQ(ue8m0_exponent(std::ldexp(6.0, 127)), 127);
  test::expect_error([] { ue8m0_exponent(std::ldexp(6.0, 127) * 1.5); }, Errc::input, {"2^128", "2^127"});
  test::expect_error([] { ue8m0_exponent(-1.0); }, Errc::input, {"amax -1"});
}

TEST(IndexKey, QuantiseKnownKeyByteByByte) {
  std::vector<double> x(128, 0.0);
  // Group 0 (amax 6, scale 2^0 = byte 127): x0 = 0.5 (code 1), x1 = -6 (code 15): byte 0 = 0xF1.
  x[0] = 0.5, x[1] = -6.0, x[2] = 3.0, x[3] = -1.5;  // byte 1: low 3 (code 5), high -1.5 (code 11) = 0xB5
  // Group 1 (elements 32..63): amax 0.75 = 6 * 2^-3, scale byte 124; x32 = 0.75 -> 6 (code 7),
  // x33 = -0.125 -> -1 (code 10): byte 16 = 0xA7.
  x[32] = 0.75, x[33] = -0.125;
  // Group 2 all zero: amax floored at 1e-4, scale 2^-15 (byte 112), codes 0.
  // Group 3: amax 3 -> scale 2^-1 (byte 126); x127 = 3 -> 6 (code 7) in the high nibble of byte 63.
  x[127] = 3.0, x[126] = 0.25;  // 0.25 / 0.5 = 0.5: code 1 in the low nibble: byte 63 = 0x71
  const KeyBytes k = quantise_key(x);
  EXPECT_EQ(k[0], 0xF1);
  EXPECT_EQ(k[1], 0xB5);
  EXPECT_EQ(k[16], 0xA7);
  EXPECT_EQ(k[63], 0x71);
  EXPECT_EQ(k[64], 127);
  EXPECT_EQ(k[65], 124);
  EXPECT_EQ(k[66], 112);
  EXPECT_EQ(k[67], 126);
  for (int i : {2, 15, 17, 31, 32, 47, 62}) EXPECT_EQ(k[i], 0) << i;
  // Every value above is representable at its group's scale: the round trip is exact.
  const auto back = dequantise_key(k);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(back[i], x[i]) << i;
}

TEST(IndexKey, RepresentableValuesRoundTripExactly) {
  // Per group, E2M1 values times 2^e, with the group's largest magnitude 6 * 2^e (so the scale is 2^e).
  std::mt19937_64 rng(11);
  const double mags[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<double> x(128);
    for (int c = 0; c < 4; ++c) {
      // 2^-15 and up: 6 * 2^-15 is above the amax floor (1e-4), so the scale is exactly 2^e.
      const int e = static_cast<int>(rng() % 36) - 15;
      for (int i = 0; i < 32; ++i) {
        const double v = mags[rng() % 8] * ((rng() & 1) ? -1 : 1);
        x[c * 32 + i] = std::ldexp(v, e);
      }
      x[c * 32 + static_cast<int>(rng() % 32)] = std::ldexp((rng() & 1) ? 6.0 : -6.0, e);
    }
    const KeyBytes k = quantise_key(x);
    const auto back = dequantise_key(k);
    for (int i = 0; i < 128; ++i) ASSERT_EQ(back[i], x[i]) << "trial " << trial << " element " << i;
    EXPECT_EQ(quantise_key(std::vector<double>(back.begin(), back.end())), k);
  }
}

TEST(IndexKey, RandomValuesAreWithinHalfAStepAndRequantiseToTheSameBytes) {
  std::mt19937_64 rng(3);
  std::normal_distribution<double> n(0.0, 1.7);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<double> x(128);
    for (double& v : x) v = n(rng);
    const KeyBytes k = quantise_key(x);
    const auto back = dequantise_key(k);
    for (int c = 0; c < 4; ++c) {
      const double scale = std::ldexp(1.0, k[64 + c] - 127);
      double amax = 0;
      for (int i = c * 32; i < c * 32 + 32; ++i) amax = std::max(amax, std::fabs(x[i]));
      EXPECT_LE(amax, 6 * scale);
      EXPECT_GT(amax, 3 * scale);  // the smallest covering scale: half of it would not cover amax
      for (int i = c * 32; i < c * 32 + 32; ++i) {
        // E2M1 steps are 0.5 below 2, 1 up to 4, 2 up to 6: the error is at most half the step.
        const double a = std::fabs(x[i]) / scale, step = a < 2 ? 0.5 : a < 4 ? 1.0 : 2.0;
        EXPECT_LE(std::fabs(back[i] - x[i]), step / 2 * scale) << i;
      }
    }
    // Dequantised values are representable, so quantising them again keeps them (the bytes may differ:
    // a group whose amax rounded down to 3 * scale gets half the scale and twice the codes).
    const auto again = dequantise_key(quantise_key(std::vector<double>(back.begin(), back.end())));
    for (int i = 0; i < 128; ++i) EXPECT_EQ(again[i], back[i]) << i;
  }
}

TEST(IndexKey, LowNibbleIsTheEvenElement) {
  std::vector<double> x(128, 0.0);
  x[64] = 6.0;  // group 2, scale 2^0; element 64 is byte 32's low nibble
  x[65] = 1.0;  // high nibble: code 2
  const KeyBytes k = quantise_key(x);
  EXPECT_EQ(k[32], 0x27);
}

TEST(IndexKey, BadInputIsRefused) {
  test::expect_error([] { quantise_key(std::vector<double>(127, 0.0)); }, Errc::input, {"127 values", "128"});
  std::vector<double> x(128, 0.0);
  x[5] = std::numeric_limits<double>::infinity();
  test::expect_error([&] { quantise_key(x); }, Errc::input, {"element 5", "finite"});
  test::expect_error([] { dequantise_key(std::vector<uint8_t>(64, 0)); }, Errc::input, {"64 bytes", "68"});
  KeyBytes nan_scale{};
  nan_scale[64] = 255;
  EXPECT_TRUE(std::isnan(dequantise_key(nan_scale)[0]));
}

}  // namespace
}  // namespace dp::indexer
