// The CUDA driver as the tools call it: the project's one entry-point table (runtime/driver/cuda.h,
// also libdecodepack's and the GPU tests'), opened on first use with dlopen so that the tool starts on
// hosts without a GPU driver and says what is missing only when a subcommand needs the GPU, with
// failures thrown as dp::Error(device). DECODEPACK_CUDA_LIBRARY replaces the library name, as for
// libdecodepack.
#pragma once

#include <string>

#include "driver/cuda.h"

namespace dp::tools {

namespace cuda = dp::cu;

struct Driver : cu::CudaApi {
  // The process's table with cuInit(0) done. Throws dp::Error(device) naming the library that cannot
  // be loaded, the missing entry point, or cuInit's error (e.g. CUDA_ERROR_NO_DEVICE).
  static const Driver& get();

  // Throws dp::Error(device) "<call> failed: CUDA_ERROR_X (n): <text>[: what]" unless r is CUDA_SUCCESS.
  void check(cu::CUresult r, const char* call, const std::string& what = {}) const;
  std::string error_name(cu::CUresult r) const { return cu::cuda_error_name(*this, r); }
};

}  // namespace dp::tools
