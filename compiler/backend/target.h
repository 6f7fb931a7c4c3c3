// Device targets decodepack compiles for, and what each needs from a toolchain.
#pragma once

#include <span>
#include <string>
#include <string_view>

namespace dp::backend {

enum class Vendor { nvidia, amd };
const char* to_string(Vendor v);

struct TargetInfo {
  std::string_view name;  // as in deploy.json "targets": "sm_90a", "gfx942", ...
  Vendor vendor;
  int sm = 0;              // NVIDIA compute capability x10 (90 for sm_90a); 0 on AMD
  int min_llvm_major = 0;  // AMD: first LLVM release whose AMDGPU backend knows the processor
  std::string_view file_ext;  // code-object file extension: ".cubin" | ".hsaco"
};

// Every target this build knows (runtime/format/targets.h), NVIDIA first by compute capability, then AMD by name.
std::span<const TargetInfo> known_targets();
// Looks a target up; an unknown name is dp::Error(input) listing the valid ones, prefixed by `where`.
const TargetInfo& target_info(std::string_view name, std::string_view where = {});

}  // namespace dp::backend
