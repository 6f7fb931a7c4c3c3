// fp32 -> bf16 conversion shared by synth, fingerprints and the tools.
#include <gtest/gtest.h>

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

}  // namespace
}  // namespace dp
