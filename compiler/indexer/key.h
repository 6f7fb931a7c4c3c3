// The MXFP4 index key of the sparse-attention indexer (model-family.md 4.2): 128 values in 68 bytes.
//
//   bytes  0..63   E2M1 pairs: byte j holds element 2j in its LOW nibble and element 2j+1 in its high
//                  nibble, so bytes 16c..16c+15 hold the 32 elements of scale group c
//   bytes 64..67   UE8M0 scales, byte 64+c for elements 32c..32c+31: value 2^(byte-127); 255 is NaN
//
// E2M1 codes 0..7 are {0, 0.5, 1, 1.5, 2, 3, 4, 6}; bit 3 is the sign (codes 8..15 are the negatives).
//
// Quantisation, our definition (the GPU kernels must match it byte for byte):
//   amax  = max |x| over the group, floored at kAmaxFloor (so an all-zero group gets a finite scale);
//   e     = the smallest integer with amax <= 6 * 2^e, i.e. ceil(log2(amax / 6)) computed exactly;
//           for bf16 inputs an fp32 kernel computing ceil(log2(amax / 6.0f)) gets the same e, since
//           amax / 6 is a power of two only when amax = 3 * 2^(e+1), which fp32 divides exactly;
//   code  = the E2M1 value nearest to x / 2^e (|x / 2^e| <= 6, never saturates), ties to the even
//           code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4), the sign
//           bit kept (a negative value that rounds to zero is code 8, -0).
// Query heads on the FP4 path use the same format (one 68-byte row per head).
#pragma once

#include <array>
#include <cstdint>
#include <span>

namespace dp::indexer {

inline constexpr int64_t kHeadDim = 128;      // values per key (index_head_dim)
inline constexpr int64_t kGroup = 32;         // values per UE8M0 scale
inline constexpr int64_t kGroups = kHeadDim / kGroup;       // 4
inline constexpr int64_t kPayloadBytes = kHeadDim / 2;      // 64: E2M1 pairs
inline constexpr int64_t kGroupBytes = kGroup / 2;          // 16: payload bytes of one scale group
inline constexpr int64_t kKeyBytes = kPayloadBytes + kGroups;  // 68
inline constexpr int64_t kPageKeys = 64;      // keys per staged page
inline constexpr double kAmaxFloor = 1e-4;    // smallest group amax used for the scale

using KeyBytes = std::array<uint8_t, kKeyBytes>;

// E2M1 code of the value nearest to v (|v| clamped to 6), ties to the even code, sign bit kept.
// v must not be NaN.
uint8_t e2m1_code(double v);

// The UE8M0 exponent e for a group whose largest magnitude is `amax` (>= 0, finite): the smallest e
// with max(amax, kAmaxFloor) <= 6 * 2^e. Throws dp::Error(input) when e exceeds 127 (no UE8M0 byte).
int ue8m0_exponent(double amax);

// Quantises 128 values (finite; dp::Error(input) otherwise) into one 68-byte key.
KeyBytes quantise_key(std::span<const double> x);

// The 128 values a 68-byte key holds (scale byte 255 gives NaN).
std::array<double, kHeadDim> dequantise_key(std::span<const uint8_t> key);

}  // namespace dp::indexer
