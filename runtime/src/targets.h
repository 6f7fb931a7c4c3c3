// Which code objects run on which device, and which driver they need. Pure functions of names and
// numbers, so the rules are tested on any host.
//
// NVIDIA (cubins: SASS, never PTX, so no JIT and no PTX-ISA rule applies):
//   sm_XY   runs on compute capability X.y for every y >= Y (binary compatibility within a major);
//   sm_XYa  runs on exactly X.Y (arch-specific features, e.g. Hopper's wgmma and setmaxnreg);
//   sm_XYf  runs on the family X.y, y >= Y (CUDA 12.9+).
//   Driver: a cubin from a CUDA X.y toolkit needs a driver for CUDA X.0 or newer (minor-version
//   compatibility holds within a major only), and a driver that knows the architecture at all.
// AMD (code objects for one processor): gfxNNN runs only on gfxNNN; the device's feature suffix
//   (":sramecc+:xnack-") is ignored because decodepack compiles with both features "any".
#pragma once

#include <string>
#include <string_view>

namespace dp::rt {

enum class TargetVendor { unknown, cuda, hip };

struct ArchId {
  TargetVendor vendor = TargetVendor::unknown;
  int major = 0, minor = 0;  // CUDA compute capability
  char suffix = 0;           // CUDA: 0, 'a' or 'f'
  std::string base;          // HIP: "gfx942" (features removed); CUDA: the name as given
};

// Parses "sm_90a", "sm_100", "sm_103f", "gfx942", "gfx942:sramecc+:xnack-". vendor unknown if neither.
ArchId parse_arch(std::string_view name);

// True if a code object for `target` runs on a device of architecture `device` ("sm_90" for CUDA:
// from the compute capability). Otherwise false, and `why` says why in one clause.
bool target_runs_on(std::string_view target, std::string_view device, std::string* why);

// The target to add to a deploy config so that a bundle runs on `device`: "sm_100a" for "sm_100"
// (arch-specific, what the decode kernels are tuned for), the processor name for AMD.
std::string suggested_target(std::string_view device);

// The oldest CUDA driver (cuDriverGetVersion: 1000 * major + 10 * minor) that knows `target`; 0 if this
// table does not know the architecture (no check).
int min_driver_for_arch(std::string_view target);

// The oldest driver for code objects from `toolchain` (the manifest's toolchains.nvidia, e.g.
// "nvrtc 13.0 (libnvrtc.so.13, ...)"): 1000 * its major version; 0 if it names no version.
int min_driver_for_toolchain(std::string_view toolchain);

// 13000 -> "13.0", 12040 -> "12.4".
std::string cuda_version_text(int v);

}  // namespace dp::rt
