// Element types of checkpoint tensors, named as safetensors names them.
#pragma once

#include <cstdint>
#include <optional>
#include <string_view>

namespace dp {

enum class DType : uint8_t {
  BOOL, U8, I8, U16, I16, F16, BF16, U32, I32, F32, U64, I64, F64,
  F8_E4M3, F8_E5M2, F8_E8M0,
};

// "BF16", "F8_E4M3", ... exactly as in a safetensors header.
std::string_view dtype_name(DType t);
std::optional<DType> dtype_from_name(std::string_view name);
// Bytes per element (all family dtypes are whole bytes; MXFP4 is stored as U8 pairs).
uint32_t dtype_size(DType t);

// fp32 -> bf16 bits, rounded to nearest even as the device kernels and torch convert; a NaN stays a
// quiet NaN (it never rounds to Inf), infinities stay infinite. The one such conversion of the
// compiler and the tools (synth, fingerprints, the tools' inputs).
uint16_t f32_to_bf16_bits(float f);
float bf16_bits_to_f32(uint16_t b);

// FP8 e4m3 (the "e4m3fn" of torch and the OCP FP8 spec: 1 sign, 4 exponent bits of bias 7, 3 mantissa
// bits; no infinities; S.1111.111 is the only NaN; largest finite 448 = 0x7e; subnormals m * 2^-9).
// fp32 -> e4m3 rounds to nearest even and saturates: every finite value and +-Inf beyond +-448 becomes
// +-448 (0x7e / 0xfe), never NaN; a NaN becomes the e4m3 NaN of its sign; -0 stays -0 (0x80).
uint8_t f32_to_e4m3_bits(float f);
// e4m3 -> fp32, exact (every e4m3 value is an fp32 value); 0x7f / 0xff are NaN.
float e4m3_bits_to_f32(uint8_t b);
inline constexpr float kE4m3Max = 448.0f;

}  // namespace dp
