// Scalar numerics of the float64 CPU reference: storage-format rounding (bf16, fp32), decoders from
// checkpoint bytes to double, MXFP4 (E2M1 + E8M0) dequantisation, and the scalar activations.
//
// Everything here is exact where the format allows it: bf16 -> double and fp32 -> double are exact,
// round_bf16 / round_fp32 are correctly rounded (round to nearest, ties to even) from double.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/dtype.h"

namespace dp::ref {

// Nearest bf16 value (1 sign, 8 exponent, 7 stored mantissa bits; the fp32 exponent range including
// subnormals), ties to even, returned as a double. Overflow gives +-inf; NaN stays NaN.
// Rounds once from the double (a GPU rounds its fp32 accumulator once: the two agree except where
// the fp32 accumulator itself was already rounded, which the 1e-2 tolerance covers).
double round_bf16(double x);
// Nearest fp32 value, ties to even.
double round_fp32(double x);

// Bit-level conversions (little endian storage).
double bf16_bits_to_double(uint16_t bits);
uint16_t double_to_bf16_bits(double x);  // round_bf16, then the bits
double f32_bits_to_double(uint32_t bits);

// Decodes a whole little-endian tensor to doubles: BF16, F16, F32, F64 and F8_E4M3 by value (an FP8
// block-quantized weight's stored e4m3 values, before its scales: dequant_fp8_blocks); U8 and F8_E8M0
// give the raw byte value 0..255 (MXFP4 packed nibbles and E8M0 scale exponents are decoded by
// dequant_mxfp4, which needs the raw bytes). Any other dtype is dp::Error(input) naming `what`.
std::vector<double> decode_tensor(std::span<const uint8_t> bytes, DType dtype, const std::string& what);

// MXFP4 (OCP microscaling, E2M1 elements with one E8M0 scale per `group` elements along a row).
// E2M1 code -> value: codes 0..7 are {0, 0.5, 1, 1.5, 2, 3, 4, 6}, codes 8..15 the same negated.
double e2m1_value(uint8_t code);
// E8M0 scale byte s -> 2^(s-127); s = 255 is NaN.
double e8m0_value(uint8_t s);
// Dequantises a packed [rows, cols/2] byte matrix (two elements per byte, the LOW nibble is the even
// element 2j, the high nibble the odd element 2j+1) with a [rows, cols/group] scale matrix into a
// row-major [rows, cols] matrix of doubles. `packed` and `scales` hold byte values as decode_tensor
// returns them for U8 / F8_E8M0.
std::vector<double> dequant_mxfp4(std::span<const double> packed, std::span<const double> scales, int64_t rows,
                                  int64_t cols, int64_t group, const std::string& what);

// FP8 block quantization (DeepSeek-style checkpoints, model/quant.h): a [rows, cols] matrix of e4m3
// values (as decode_tensor returns them) times the fp32 scale_inv of its block_rows x block_cols block,
// from a [ceil(rows/block_rows), ceil(cols/block_cols)] row-major scale matrix (the last blocks of a row
// or column may be partial). Exact in double (a 4-bit by 24-bit significand product). dp::Error(input)
// naming `what` when the sizes do not match that shape.
std::vector<double> dequant_fp8_blocks(std::span<const double> values, std::span<const double> scale_inv, int64_t rows,
                                       int64_t cols, int64_t block_rows, int64_t block_cols, const std::string& what);

// Scalar activations, in double.
double sigmoid(double x);
double silu(double x);                                                  // x * sigmoid(x)
double softplus(double x, double beta = 1.0, double threshold = 20.0);  // x where beta*x > threshold
// Kimi-K3 SiTU, replacing silu(gate) * up:
//   a = beta * tanh(gate / beta) * sigmoid(gate);  up' = linear_beta * tanh(up / linear_beta);  a * up'
double situ(double gate, double up, double beta, double linear_beta);

}  // namespace dp::ref
