#include "common/dtype.h"

#include <cmath>
#include <cstring>

#include <array>
#include <utility>

namespace dp {
namespace {
struct Info {
  DType type;
  std::string_view name;
  uint32_t size;
};
constexpr std::array<Info, 16> kInfo{{
    {DType::BOOL, "BOOL", 1}, {DType::U8, "U8", 1},       {DType::I8, "I8", 1},
    {DType::U16, "U16", 2},   {DType::I16, "I16", 2},     {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2}, {DType::U32, "U32", 4},     {DType::I32, "I32", 4},
    {DType::F32, "F32", 4},   {DType::U64, "U64", 8},     {DType::I64, "I64", 8},
    {DType::F64, "F64", 8},   {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
    {DType::F8_E8M0, "F8_E8M0", 1},
}};
}  // namespace

std::string_view dtype_name(DType t) { return kInfo[static_cast<size_t>(t)].name; }

uint32_t dtype_size(DType t) { return kInfo[static_cast<size_t>(t)].size; }

std::optional<DType> dtype_from_name(std::string_view name) {
  for (const Info& i : kInfo)
    if (i.name == name) return i.type;
  return std::nullopt;
}

uint16_t f32_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u | 0x00400000u) >> 16);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

float bf16_bits_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

uint8_t f32_to_e4m3_bits(float f) {
  // On the float's bits (a quantizer's inner loop: an FP8 checkpoint is billions of these), with the
  // same results as rounding the exact value: round half to even, saturating.
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7f;   // NaN
  if (a >= 0x43e00000u) return sign | 0x7e;  // >= 448 (also +-Inf): e4m3fn has no infinity, saturate
  if (a < 0x3c800000u) {
    // Below 2^-6 the values are subnormal, m * 2^-9 for m in 0..7: the bits are the rounded multiple of
    // 2^-9 itself (a * 2^9 is exact), and a round up to 8 is exactly the smallest normal (exponent field
    // 1, mantissa 0).
    float m;
    std::memcpy(&m, &a, 4);
    return sign | static_cast<uint8_t>(std::nearbyint(m * 512.0f));
  }
  // Normal: drop 20 of the 23 mantissa bits, rounding half to even on the whole pattern, so that a
  // round up of the mantissa carries into the exponent; then rebias the exponent (127 -> 7).
  const uint32_t r = (a + 0x7ffffu + ((a >> 20) & 1u)) >> 20;
  const uint32_t bits = r - ((127u - 7u) << 3);
  return sign | static_cast<uint8_t>(bits > 0x7eu ? 0x7eu : bits);  // 448 < a < 464 rounds to 448 anyway
}

float e4m3_bits_to_f32(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b >> 3) & 0xf, mant = b & 0x7;
  if (exp == 0xf && mant == 0x7) return std::copysign(std::nanf(""), sign);
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);
}

}  // namespace dp
