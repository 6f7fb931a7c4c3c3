#include "model/shard.h"

#include <cmath>
#include <cstring>

#include "common/error.h"
#include "model/safetensors.h"

namespace dp::model {
namespace {

bool is_float(DType t) { return t == DType::BF16 || t == DType::F16 || t == DType::F32 || t == DType::F64; }

bool same_bytes(DType from, DType to) {
  const auto byte_scale = [](DType t) { return t == DType::U8 || t == DType::F8_E8M0; };  // E8M0 scales stored as U8
  return from == to || (byte_scale(from) && byte_scale(to));
}

uint16_t load16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
void store16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// IEEE half -> fp32, exact (every half value is an fp32 value); a NaN stays a quiet NaN of its sign.
float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  const int exp = (h >> 10) & 0x1f;
  const uint32_t man = h & 0x3ff;
  if (exp == 31) return bits_f32(sign | 0x7f800000u | (man ? 0x00400000u | (man << 13) : 0u));
  const float mag = exp == 0 ? std::ldexp(static_cast<float>(man), -24)
                             : std::ldexp(static_cast<float>(man | 0x400), exp - 25);
  return sign ? -mag : mag;
}

// double -> fp32 rounded to odd (truncated, with the lowest bit set when anything was dropped). A bf16
// rounding (to nearest even) of that fp32 equals the bf16 rounding of the double itself: fp32 keeps at
// least 16 more bits than bf16 at every exponent, so the sticky bit decides ties as the double would.
float f64_to_f32_round_odd(double d) {
  float f = static_cast<float>(d);
  if (!std::isfinite(d) || static_cast<double>(f) == d) return f;
  if (std::fabs(static_cast<double>(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);  // toward zero (Inf -> max)
  return bits_f32(f32_bits(f) | 1u);
}

// One source element as an fp32 value from which a single rounding gives the bf16 result.
float to_f32_for_bf16(const uint8_t* p, DType from) {
  switch (from) {
    case DType::F16: return f16_to_f32(load16(p));
    case DType::F32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    default: {  // F64
      double d;
      std::memcpy(&d, p, 8);
      return f64_to_f32_round_odd(d);
    }
  }
}

}  // namespace

ShardLayout shard_layout(std::span<const int64_t> shape, uint64_t elem, const ShardCut& cut, std::string_view what) {
  const int ndim = static_cast<int>(shape.size());
  if (cut.split_dim >= ndim ||
      (cut.split_dim >= 0 && (cut.begin < 0 || cut.begin > cut.end || cut.end > shape[static_cast<size_t>(cut.split_dim)])))
    fail(Errc::verify, "tensor {}: shape {} has no range [{}, {}) along dimension {}", what, st::shape_string(shape),
         cut.begin, cut.end, cut.split_dim);
  ShardLayout l;
  if (cut.split_dim < 0) {
    l.run = elem;
    for (int64_t d : shape) l.run *= static_cast<uint64_t>(d);
    l.stride = l.run;
    return l;
  }
  uint64_t inner = elem;
  for (int d = 0; d < cut.split_dim; ++d) l.outer *= static_cast<uint64_t>(shape[static_cast<size_t>(d)]);
  for (int d = cut.split_dim + 1; d < ndim; ++d) inner *= static_cast<uint64_t>(shape[static_cast<size_t>(d)]);
  l.run = static_cast<uint64_t>(cut.end - cut.begin) * inner;
  l.stride = static_cast<uint64_t>(shape[static_cast<size_t>(cut.split_dim)]) * inner;
  l.first = static_cast<uint64_t>(cut.begin) * inner;
  return l;
}

std::vector<uint8_t> slice_shard(std::span<const uint8_t> full, std::span<const int64_t> shape, uint64_t elem,
                                 const ShardCut& cut, std::string_view what) {
  const ShardLayout l = shard_layout(shape, elem, cut, what);
  const uint64_t whole = l.outer * l.stride;
  if (full.size() != whole)
    fail(Errc::internal, "tensor {}: {} bytes for shape {} of {}-byte elements ({} bytes)", what, full.size(),
         st::shape_string(shape), elem, whole);
  std::vector<uint8_t> out(l.bytes());
  for (uint64_t o = 0; o < l.outer; ++o)
    if (l.run) std::memcpy(out.data() + o * l.run, full.data() + l.offset(o), l.run);
  return out;
}

bool can_convert(DType from, DType to) {
  return same_bytes(from, to) || (is_float(from) && (to == DType::BF16 || to == DType::F32));
}

void convert_elements(std::span<const uint8_t> src, DType from, DType to, std::vector<uint8_t>& out) {
  if (!can_convert(from, to))
    fail(Errc::internal, "no conversion of {} elements to {}", dtype_name(from), dtype_name(to));
  if (same_bytes(from, to)) {
    out.assign(src.begin(), src.end());
    return;
  }
  const size_t in = dtype_size(from), n = src.size() / in;
  out.resize(n * dtype_size(to));
  const uint8_t* p = src.data();
  uint8_t* q = out.data();
  if (to == DType::F32) {
    for (size_t i = 0; i < n; ++i, p += in, q += 4) {
      if (from == DType::BF16) {  // exact widening, as bits (a NaN's payload kept as it is)
        const uint32_t u = static_cast<uint32_t>(load16(p)) << 16;
        std::memcpy(q, &u, 4);
        continue;
      }
      float f;
      if (from == DType::F64) {
        double d;
        std::memcpy(&d, p, 8);
        f = static_cast<float>(d);  // nearest even
      } else {
        f = to_f32_for_bf16(p, from);  // F16: exact
      }
      std::memcpy(q, &f, 4);
    }
    return;
  }
  for (size_t i = 0; i < n; ++i, p += in, q += 2) store16(q, f32_to_bf16_bits(to_f32_for_bf16(p, from)));
}

}  // namespace dp::model
