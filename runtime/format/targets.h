// The GPU architectures decodepack knows: the one table the deploy reader, the compiler backend, the
// runtime's compatibility checks and both JSON schemas (deploy.schema.json, bundle-manifest.schema.json)
// agree with (tests/unit/format/targets_test.cpp fails when one of them does not).
#pragma once

#include <array>
#include <string_view>

namespace dp::format {

enum class GpuVendor { nvidia, amd };

struct GpuTarget {
  std::string_view name;   // "sm_90a", "gfx942": the spelling nvcc --gpu-architecture / clang --offload-arch take
  GpuVendor vendor;
  int sm = 0;              // NVIDIA compute capability x10 (90 for sm_90 and sm_90a); 0 on AMD
  int min_cuda_major = 0;  // NVIDIA: first CUDA toolkit that targets it
  int min_cuda_minor = 0;
  int min_llvm_major = 0;  // AMD: first LLVM release whose AMDGPU backend knows the processor
  std::string_view gpus;   // examples, for messages
};

// Sorted by name. gfx90a and gfx942 build with the project's clang-19; gfx950 needs LLVM 20.
inline constexpr std::array kGpuTargets = {
    GpuTarget{"gfx90a", GpuVendor::amd, 0, 0, 0, 13, "MI210, MI250X"},
    GpuTarget{"gfx942", GpuVendor::amd, 0, 0, 0, 17, "MI300X, MI325X"},
    GpuTarget{"gfx950", GpuVendor::amd, 0, 0, 0, 20, "MI350X, MI355X"},
    GpuTarget{"sm_100a", GpuVendor::nvidia, 100, 12, 8, 0, "B200, GB200"},
    GpuTarget{"sm_120a", GpuVendor::nvidia, 120, 12, 8, 0, "RTX 5090, RTX PRO 6000 Blackwell"},
    GpuTarget{"sm_80", GpuVendor::nvidia, 80, 11, 0, 0, "A100"},
    GpuTarget{"sm_86", GpuVendor::nvidia, 86, 11, 1, 0, "A10, RTX 3090"},
    GpuTarget{"sm_89", GpuVendor::nvidia, 89, 11, 8, 0, "L40S, RTX 4090"},
    GpuTarget{"sm_90", GpuVendor::nvidia, 90, 11, 8, 0, "H100, H200 (without wgmma/setmaxnreg)"},
    GpuTarget{"sm_90a", GpuVendor::nvidia, 90, 12, 0, 0, "H100, H200"},
};

constexpr bool gpu_targets_sorted() {
  for (size_t i = 1; i < kGpuTargets.size(); ++i)
    if (!(kGpuTargets[i - 1].name < kGpuTargets[i].name)) return false;
  return true;
}
static_assert(gpu_targets_sorted(), "kGpuTargets must be sorted by name, without repeats");

// The target of that name, or nullptr.
constexpr const GpuTarget* find_gpu_target(std::string_view name) {
  for (const GpuTarget& t : kGpuTargets)
    if (t.name == name) return &t;
  return nullptr;
}

}  // namespace dp::format
