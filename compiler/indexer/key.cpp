#include "indexer/key.h"

#include <cmath>

#include "common/error.h"
#include "reference/numeric.h"

namespace dp::indexer {

uint8_t e2m1_code(double v) {
  static constexpr double kMag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  if (std::isnan(v)) fail(Errc::input, "E2M1 encode: value is NaN");
  const double a = std::fabs(v);
  uint8_t best = 7;
  if (a < 6) {
    // The magnitudes increase with the code, so the nearest is one of the two around a; on a tie the
    // even code wins (its mantissa bit is 0).
    uint8_t hi = 1;
    while (kMag[hi] < a) ++hi;
    const uint8_t lo = static_cast<uint8_t>(hi - 1);
    const double dlo = a - kMag[lo], dhi = kMag[hi] - a;
    best = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
  }
  return static_cast<uint8_t>(best | (std::signbit(v) ? 8 : 0));
}

int ue8m0_exponent(double amax) {
  if (!(amax >= 0) || !std::isfinite(amax))
    fail(Errc::input, "UE8M0 scale: group amax {} is not a finite non-negative value", amax);
  const double a = std::max(amax, kAmaxFloor);
  // 6 * 2^e is exact in double, so the comparisons are exact; ilogb gives a start within one step.
  int e = std::ilogb(a / 6.0);
  while (std::ldexp(6.0, e) < a) ++e;
  while (std::ldexp(6.0, e - 1) >= a) --e;
  if (e > 127)
    fail(Errc::input, "UE8M0 scale: group amax {} needs scale 2^{}, above the largest UE8M0 scale 2^127", amax, e);
  return e;  // >= ceil(log2(1e-4 / 6)) = -15, so never below -127
}

KeyBytes quantise_key(std::span<const double> x) {
  if (static_cast<int64_t>(x.size()) != kHeadDim)
    fail(Errc::input, "MXFP4 key: {} values, expected {}", x.size(), kHeadDim);
  KeyBytes out{};
  for (int64_t c = 0; c < kGroups; ++c) {
    double amax = 0;
    for (int64_t i = c * kGroup; i < (c + 1) * kGroup; ++i) {
      if (!std::isfinite(x[i])) fail(Errc::input, "MXFP4 key: element {} is {}, expected a finite value", i, x[i]);
      amax = std::max(amax, std::fabs(x[i]));
    }
    const int e = ue8m0_exponent(amax);
    out[kPayloadBytes + c] = static_cast<uint8_t>(e + 127);
    for (int64_t i = c * kGroup; i < (c + 1) * kGroup; i += 2) {
      const uint8_t lo = e2m1_code(std::ldexp(x[i], -e));  // exact scaling by a power of two
      const uint8_t hi = e2m1_code(std::ldexp(x[i + 1], -e));
      out[i / 2] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
  return out;
}

std::array<double, kHeadDim> dequantise_key(std::span<const uint8_t> key) {
  if (static_cast<int64_t>(key.size()) != kKeyBytes)
    fail(Errc::input, "MXFP4 key: {} bytes, expected {}", key.size(), kKeyBytes);
  std::array<double, kHeadDim> out{};
  for (int64_t i = 0; i < kHeadDim; ++i) {
    const uint8_t byte = key[i / 2];
    const uint8_t code = (i % 2 == 0) ? (byte & 0x0f) : (byte >> 4);
    out[i] = ref::e2m1_value(code) * ref::e8m0_value(key[kPayloadBytes + i / kGroup]);
  }
  return out;
}

}  // namespace dp::indexer
