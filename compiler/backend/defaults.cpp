// Toolchain locations found by cmake/DecodepackToolchains.cmake when decodepack was built. They are
// only the last fallback (after flags and environment variables), so a binary copied to another
// machine still works there when told where its toolchains are.
#include "backend/toolchain.h"

namespace dp::backend {

std::filesystem::path built_cuda_root() {
#ifdef DP_BUILT_CUDA_ROOT
  return DP_BUILT_CUDA_ROOT;
#else
  return {};
#endif
}

std::filesystem::path built_hip_clang() {
#ifdef DP_BUILT_HIP_CLANG
  return DP_BUILT_HIP_CLANG;
#else
  return {};
#endif
}

}  // namespace dp::backend
