#include "src/targets.h"

#include <cctype>
#include <cstring>

#include <fmt/format.h>

namespace dp::rt {

ArchId parse_arch(std::string_view name) {
  ArchId id;
  id.base = std::string(name);
  if (name.rfind("sm_", 0) == 0) {
    std::string_view rest = name.substr(3);
    size_t n = 0;
    while (n < rest.size() && std::isdigit(static_cast<unsigned char>(rest[n]))) ++n;
    if (n < 2) return id;  // "sm_9": not an architecture
    const std::string_view suffix = rest.substr(n);
    if (suffix.size() > 1 || (suffix.size() == 1 && suffix[0] != 'a' && suffix[0] != 'f')) return id;
    // The last digit is the minor version: sm_90 = 9.0, sm_100 = 10.0, sm_103 = 10.3, sm_120 = 12.0.
    id.major = std::stoi(std::string(rest.substr(0, n - 1)));
    id.minor = rest[n - 1] - '0';
    id.suffix = suffix.empty() ? 0 : suffix[0];
    id.vendor = TargetVendor::cuda;
    return id;
  }
  if (name.rfind("gfx", 0) == 0 && name.size() > 3) {
    id.base = std::string(name.substr(0, name.find(':')));
    id.vendor = TargetVendor::hip;
  }
  return id;
}

bool target_runs_on(std::string_view target, std::string_view device, std::string* why) {
  const ArchId t = parse_arch(target), d = parse_arch(device);
  auto fail = [&](std::string s) {
    if (why) *why = std::move(s);
    return false;
  };
  if (t.vendor == TargetVendor::unknown) return fail(fmt::format("{} is not a GPU architecture this runtime knows", target));
  if (d.vendor == TargetVendor::unknown) return fail(fmt::format("device architecture {} is not one this runtime knows", device));
  if (t.vendor != d.vendor)
    return fail(fmt::format("{} is {} code and the device is {}", target, t.vendor == TargetVendor::cuda ? "NVIDIA" : "AMD",
                            d.vendor == TargetVendor::cuda ? "NVIDIA" : "AMD"));
  if (t.vendor == TargetVendor::hip) {
    if (t.base == d.base) return true;
    return fail(fmt::format("a {} code object runs only on {} processors", t.base, t.base));
  }
  switch (t.suffix) {
    case 'a':
      if (t.major == d.major && t.minor == d.minor) return true;
      return fail(fmt::format("an {} code object runs only on compute capability {}.{} (arch-specific target)", target,
                              t.major, t.minor));
    case 'f':
      if (t.major == d.major && d.minor >= t.minor) return true;
      return fail(fmt::format("an {} code object runs only on compute capability {}.{} to {}.9 (family target)", target,
                              t.major, t.minor, t.major));
    default:
      if (t.major == d.major && d.minor >= t.minor) return true;
      return fail(fmt::format("an {} code object runs only on compute capability {}.{} to {}.9 (SASS is compatible "
                              "within a major version only)", target, t.major, t.minor, t.major));
  }
}

std::string suggested_target(std::string_view device) {
  const ArchId d = parse_arch(device);
  if (d.vendor == TargetVendor::cuda) return fmt::format("sm_{}{}a", d.major, d.minor);
  return d.base;
}

int min_driver_for_arch(std::string_view target) {
  const ArchId t = parse_arch(target);
  if (t.vendor != TargetVendor::cuda) return 0;
  if (t.suffix == 'f') return 12090;  // family targets arrived with CUDA 12.9
  struct Row { int major, minor, a, plain; };  // first CUDA version with sm_XY[a] / sm_XY
  static const Row rows[] = {
      {7, 0, 0, 9000},  {7, 5, 0, 10000}, {8, 0, 0, 11000}, {8, 6, 0, 11010}, {8, 7, 0, 11040},
      {8, 9, 0, 11080}, {9, 0, 12000, 11080}, {10, 0, 12080, 12080}, {10, 1, 12080, 12080},
      {10, 3, 12090, 12090}, {12, 0, 12080, 12080}, {12, 1, 12090, 12090},
  };
  for (const Row& r : rows)
    if (r.major == t.major && r.minor == t.minor) return t.suffix == 'a' ? r.a : r.plain;
  return 0;
}

int min_driver_for_toolchain(std::string_view toolchain) {
  // The first "<major>.<minor>" in the string: "nvrtc 13.0 (...)", "nvcc 12.8".
  for (size_t i = 0; i < toolchain.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(toolchain[i]))) continue;
    if (i > 0 && (std::isalnum(static_cast<unsigned char>(toolchain[i - 1])) || toolchain[i - 1] == '.')) continue;
    size_t j = i;
    while (j < toolchain.size() && std::isdigit(static_cast<unsigned char>(toolchain[j]))) ++j;
    if (j + 1 < toolchain.size() && toolchain[j] == '.' && std::isdigit(static_cast<unsigned char>(toolchain[j + 1]))) {
      const int major = std::stoi(std::string(toolchain.substr(i, j - i)));
      if (major >= 1 && major < 100) return major * 1000;
    }
    i = j;
  }
  return 0;
}

std::string cuda_version_text(int v) { return fmt::format("{}.{}", v / 1000, (v % 1000) / 10); }

}  // namespace dp::rt
