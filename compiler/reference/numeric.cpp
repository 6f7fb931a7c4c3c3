#include "reference/numeric.h"

#include <cmath>
#include <cstring>
#include <limits>

#include "common/error.h"

namespace dp::ref {

double round_bf16(double x) {
  if (!std::isfinite(x) || x == 0) return x;
  // bf16 keeps 8 significant bits; below the smallest normal (2^-126) the quantum stays 2^-133.
  int e = std::ilogb(x);  // |x| in [2^e, 2^(e+1))
  if (e < -126) e = -126;
  const double quantum = std::ldexp(1.0, e - 7);
  double r = std::nearbyint(x / quantum) * quantum;  // exact scaling; nearbyint ties to even
  const double max_bf16 = std::ldexp(255.0, 120);    // 0x7F7F: (2 - 2^-7) * 2^127
  if (std::fabs(r) > max_bf16) r = std::copysign(std::numeric_limits<double>::infinity(), x);
  return r;
}

double round_fp32(double x) { return static_cast<double>(static_cast<float>(x)); }

double bf16_bits_to_double(uint16_t bits) { return f32_bits_to_double(static_cast<uint32_t>(bits) << 16); }

uint16_t double_to_bf16_bits(double x) {
  if (std::isnan(x)) return 0x7FC0;
  const float f = static_cast<float>(round_bf16(x));  // exact: a bf16 value is an fp32 value
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

double f32_bits_to_double(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, 4);
  return static_cast<double>(f);
}

namespace {

double f16_bits_to_double(uint16_t h) {
  const int sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  double v;
  if (exp == 0)
    v = std::ldexp(static_cast<double>(man), -24);
  else if (exp == 31)
    v = man ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else
    v = std::ldexp(static_cast<double>(man | 0x400), exp - 25);
  return sign ? -v : v;
}

}  // namespace

std::vector<double> decode_tensor(std::span<const uint8_t> bytes, DType dtype, const std::string& what) {
  const uint32_t size = dtype_size(dtype);
  if (bytes.size() % size)
    fail(Errc::input, "{}: {} bytes is not a whole number of {} elements", what, bytes.size(), dtype_name(dtype));
  const size_t n = bytes.size() / size;
  std::vector<double> out(n);
  const uint8_t* p = bytes.data();
  switch (dtype) {
    case DType::BF16:
      for (size_t i = 0; i < n; ++i)
        out[i] = bf16_bits_to_double(static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8)));
      break;
    case DType::F16:
      for (size_t i = 0; i < n; ++i) out[i] = f16_bits_to_double(static_cast<uint16_t>(p[2 * i] | (p[2 * i + 1] << 8)));
      break;
    case DType::F32:
      for (size_t i = 0; i < n; ++i) {
        uint32_t u;
        std::memcpy(&u, p + 4 * i, 4);
        out[i] = f32_bits_to_double(u);
      }
      break;
    case DType::F64:
      for (size_t i = 0; i < n; ++i) std::memcpy(&out[i], p + 8 * i, 8);
      break;
    case DType::F8_E4M3:
      for (size_t i = 0; i < n; ++i) out[i] = e4m3_bits_to_f32(p[i]);  // exact
      break;
    case DType::U8:
    case DType::F8_E8M0:
      for (size_t i = 0; i < n; ++i) out[i] = p[i];
      break;
    default:
      fail(Errc::input,
           "{}: dtype {} has no decoder in the CPU reference (expected BF16, F16, F32, F64, F8_E4M3, U8 or F8_E8M0)",
           what, dtype_name(dtype));
  }
  return out;
}

double e2m1_value(uint8_t code) {
  static constexpr double kMag[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};
  const double m = kMag[code & 7];
  return (code & 8) ? -m : m;
}

double e8m0_value(uint8_t s) {
  if (s == 255) return std::numeric_limits<double>::quiet_NaN();
  return std::ldexp(1.0, static_cast<int>(s) - 127);
}

std::vector<double> dequant_mxfp4(std::span<const double> packed, std::span<const double> scales, int64_t rows,
                                  int64_t cols, int64_t group, const std::string& what) {
  if (cols % 2 || group <= 0 || cols % group)
    fail(Errc::input, "{}: MXFP4 width {} must be even and a multiple of the group size {}", what, cols, group);
  if (static_cast<int64_t>(packed.size()) != rows * cols / 2)
    fail(Errc::input, "{}: packed MXFP4 data has {} bytes, expected [{}, {}] = {}", what, packed.size(), rows, cols / 2,
         rows * cols / 2);
  if (static_cast<int64_t>(scales.size()) != rows * (cols / group))
    fail(Errc::input, "{}: MXFP4 scales have {} bytes, expected [{}, {}] = {}", what, scales.size(), rows, cols / group,
         rows * (cols / group));
  std::vector<double> out(static_cast<size_t>(rows * cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const auto byte = static_cast<uint8_t>(packed[r * (cols / 2) + c / 2]);
      const uint8_t code = (c % 2 == 0) ? (byte & 0x0f) : (byte >> 4);
      const auto s = static_cast<uint8_t>(scales[r * (cols / group) + c / group]);
      out[r * cols + c] = e2m1_value(code) * e8m0_value(s);
    }
  }
  return out;
}

std::vector<double> dequant_fp8_blocks(std::span<const double> values, std::span<const double> scale_inv, int64_t rows,
                                       int64_t cols, int64_t block_rows, int64_t block_cols, const std::string& what) {
  if (rows < 0 || cols < 0 || block_rows <= 0 || block_cols <= 0)
    fail(Errc::input, "{}: FP8 blocks of {}x{} over [{}, {}]", what, block_rows, block_cols, rows, cols);
  if (static_cast<int64_t>(values.size()) != rows * cols)
    fail(Errc::input, "{}: FP8 weight has {} values, expected [{}, {}] = {}", what, values.size(), rows, cols,
         rows * cols);
  const int64_t br = (rows + block_rows - 1) / block_rows, bc = (cols + block_cols - 1) / block_cols;
  if (static_cast<int64_t>(scale_inv.size()) != br * bc)
    fail(Errc::input, "{}: FP8 block scales have {} values, expected [ceil({}/{}), ceil({}/{})] = [{}, {}] = {}", what,
         scale_inv.size(), rows, block_rows, cols, block_cols, br, bc, br * bc);
  std::vector<double> out(values.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      out[r * cols + c] = values[r * cols + c] * scale_inv[(r / block_rows) * bc + c / block_cols];
  return out;
}

double sigmoid(double x) {
  // Two branches so that neither exp overflows.
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

double silu(double x) { return x * sigmoid(x); }

double softplus(double x, double beta, double threshold) {
  if (beta * x > threshold) return x;
  return std::log1p(std::exp(beta * x)) / beta;
}

double situ(double gate, double up, double beta, double linear_beta) {
  const double a = beta * std::tanh(gate / beta) * sigmoid(gate);
  const double u = linear_beta * std::tanh(up / linear_beta);
  return a * u;
}

}  // namespace dp::ref
