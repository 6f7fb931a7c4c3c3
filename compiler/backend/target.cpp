#include "backend/target.h"

#include <algorithm>
#include <vector>

#include <fmt/format.h>

#include "common/error.h"
#include "format/targets.h"

namespace dp::backend {

const char* to_string(Vendor v) { return v == Vendor::nvidia ? "nvidia" : "amd"; }

std::span<const TargetInfo> known_targets() {
  // runtime/format/targets.h's table, NVIDIA first (by compute capability, then name), then AMD by name. min_llvm_major: a clang older than
  // the release that added the processor rejects --offload-arch outright, so the table lets us refuse
  // up front with the version to install rather than relay clang's parse error.
  static const std::vector<TargetInfo> table = [] {
    std::vector<TargetInfo> v;
    for (const format::GpuTarget& t : format::kGpuTargets) {
      const bool nvidia = t.vendor == format::GpuVendor::nvidia;
      v.push_back({t.name, nvidia ? Vendor::nvidia : Vendor::amd, t.sm, t.min_llvm_major, nvidia ? ".cubin" : ".hsaco"});
    }
    std::stable_sort(v.begin(), v.end(), [](const TargetInfo& a, const TargetInfo& b) {
      if (a.vendor != b.vendor) return a.vendor == Vendor::nvidia;
      return a.sm != b.sm ? a.sm < b.sm : a.name < b.name;
    });
    return v;
  }();
  return table;
}

const TargetInfo& target_info(std::string_view name, std::string_view where) {
  for (const TargetInfo& t : known_targets())
    if (t.name == name) return t;
  std::string valid;
  for (const TargetInfo& t : known_targets()) valid += fmt::format("{}{}", valid.empty() ? "" : ", ", t.name);
  fail(Errc::input, "{}{}unknown target \"{}\" (valid: {})", where, where.empty() ? "" : ": ", name, valid);
}

}  // namespace dp::backend
