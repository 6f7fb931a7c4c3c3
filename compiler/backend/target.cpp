#include "backend/target.h"

#include <fmt/format.h>

#include "common/error.h"

namespace dp::backend {

const char* to_string(Vendor v) { return v == Vendor::nvidia ? "nvidia" : "amd"; }

std::span<const TargetInfo> known_targets() {
  // min_llvm_major: the LLVM release that added the processor to the AMDGPU backend (gfx90a: 13,
  // gfx942: 17, gfx950: 20). A clang older than that rejects --offload-arch outright, so the table
  // lets us refuse up front with the version to install rather than relay clang's parse error.
  static const TargetInfo table[] = {
      {"sm_80", Vendor::nvidia, 80, 0, ".cubin"},
      {"sm_90", Vendor::nvidia, 90, 0, ".cubin"},
      {"sm_90a", Vendor::nvidia, 90, 0, ".cubin"},
      {"sm_100a", Vendor::nvidia, 100, 0, ".cubin"},
      {"gfx90a", Vendor::amd, 0, 13, ".hsaco"},
      {"gfx942", Vendor::amd, 0, 17, ".hsaco"},
      {"gfx950", Vendor::amd, 0, 20, ".hsaco"},
  };
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
