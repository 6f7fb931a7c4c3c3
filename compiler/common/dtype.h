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

}  // namespace dp
