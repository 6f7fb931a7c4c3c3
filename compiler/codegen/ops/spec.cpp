#include "codegen/ops/spec.h"

#include <fmt/format.h>

#include "common/error.h"

namespace dp::codegen::ops {

void check_multiple_of_8(const Params& p, const std::string& who, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (p.at(k) % 8 != 0)
      fail(Errc::input, "{}: parameter {} = {} is not a multiple of 8 (rows are read as 16-byte bf16 vectors)", who, k,
           p.at(k));
}

ParamSpec q8_param(const char* doc) { return ParamSpec{"Q8", "q8", 0, 1, doc, true}; }

ParamSpec ring_param(const char* doc) { return ParamSpec{"RG", "rg", 0, 8, doc, true}; }

bool bulk_copy_target(const std::string& target) {
  if (target.rfind("sm_", 0) != 0) return false;
  int arch = 0;
  for (size_t i = 3; i < target.size() && target[i] >= '0' && target[i] <= '9'; ++i)
    arch = arch * 10 + (target[i] - '0');
  return arch >= 90;
}

void check_ring(const Params& p, const std::string& who, bool allowed, const char* what) {
  if (!p.at("RG")) return;
  const bool q4 = p.count("Q4") && p.at("Q4");
  if (!p.at("Q8") && !q4)
    fail(Errc::input, "{}: parameter RG = {} (weight ring) streams e4m3 or MXFP4 weights, but Q8 = 0{}", who,
         p.at("RG"), p.count("Q4") ? " and Q4 = 0" : "");
  if (!allowed) fail(Errc::input, "{}: parameter RG = {} (weight ring): {}", who, p.at("RG"), what);
}

std::string scale_shape(int64_t rows, int64_t cols) {
  return shape({(rows + kFp8Block - 1) / kFp8Block, (cols + kFp8Block - 1) / kFp8Block}, "fp32");
}

void check_multiple_of_16(const Params& p, const std::string& who, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (p.at(k) % 16 != 0)
      fail(Errc::input, "{}: parameter {} = {} is not a multiple of 16 (e4m3 rows are read as 16-byte vectors)", who,
           k, p.at(k));
}

std::string shape(std::initializer_list<int64_t> d, const char* dtype) {
  std::string s = "[";
  for (int64_t x : d) s += fmt::format("{}{}", s.size() > 1 ? ", " : "", x);
  return s + "] " + dtype;
}

std::string dims(const Params& p, std::initializer_list<const char*> keys, const char* dtype) {
  std::string s = "[";
  for (const char* k : keys) {
    if (s.size() > 1) s += ", ";
    s += std::to_string(p.at(k));
  }
  return s + "] " + dtype;
}

}  // namespace dp::codegen::ops
