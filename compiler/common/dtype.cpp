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
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return sign | 0x7f;
  const double a = std::fabs(static_cast<double>(f));
  if (a >= kE4m3Max) return sign | 0x7e;  // saturate (also +-Inf): e4m3fn has no infinity
  // Below 2^-6 the values are subnormal, m * 2^-9 for m in 0..7: the bits are the rounded multiple of
  // 2^-9 itself, and a round up to 8 is exactly the smallest normal (exponent field 1, mantissa 0).
  // Scaling by a power of two is exact, so nearbyint (round half to even) sees the exact quotient.
  if (a < 0x1p-6) return sign | static_cast<uint8_t>(std::nearbyint(std::ldexp(a, 9)));
  int e = 0;
  std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1): the unbiased e4m3 exponent is e - 1
  const int exp = e - 1;  // -6..8
  // The significand in eighths: [8, 16); a round up to 16 carries into the exponent, which the sum
  // below does by itself (16 - 8 = 8 = one exponent step of the field).
  const int q = static_cast<int>(std::nearbyint(std::ldexp(a, 3 - exp)));
  const int bits = ((exp + 7) << 3) + (q - 8);
  return sign | static_cast<uint8_t>(bits > 0x7e ? 0x7e : bits);  // 448 < a < 464 rounds to 448 anyway
}

float e4m3_bits_to_f32(uint8_t b) {
  const float sign = (b & 0x80) ? -1.0f : 1.0f;
  const int exp = (b >> 3) & 0xf, mant = b & 0x7;
  if (exp == 0xf && mant == 0x7) return std::copysign(std::nanf(""), sign);
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);
}

}  // namespace dp
