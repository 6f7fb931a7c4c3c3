// GPU driver symbol tables: libcuda.so.1 (driver/cuda.h's table) and libamdhip64.so, opened with dlopen on
// first use.
//
// One table per vendor, filled once per process and never unloaded. Every entry point the runtime
// calls is listed here, so a driver that lacks one is reported at load time, by name, instead of
// failing later. A failed load is not cached: a later call tries again (e.g. after the host set
// DECODEPACK_CUDA_LIBRARY). The environment variables DECODEPACK_CUDA_LIBRARY and
// DECODEPACK_HIP_LIBRARY replace the default library names (a driver installed off the loader path).
#pragma once

#include <string>

#include "driver/cuda.h"
#include "src/status.h"

namespace dp::rt {

// The CUDA table is the project's one (driver/cuda.h), shared with the tools and the GPU tests.
using CudaApi = cu::CudaApi;

// The process's CUDA table, with cuInit(0) done. DP_ERR_DRIVER_UNAVAILABLE names the library or the
// missing entry point; DP_ERR_DRIVER a failing cuInit (e.g. CUDA_ERROR_NO_DEVICE).
Result<const CudaApi*> cuda_api();

// DP_OK for CUDA_SUCCESS; else DP_ERR_DRIVER: "<call> failed: CUDA_ERROR_X (n): <driver's text>[: what]".
Status cuda_check(const CudaApi& api, cu::CUresult r, const char* call, const std::string& what = {});

// AMD: the entry points needed to find and describe devices. HIP device sessions are not implemented
// in this version (DP_ERR_NOT_SUPPORTED); host-only sessions plan gfx targets.
struct HipApi {
  std::string library;
  using R = int;  // hipError_t
  const char* (*hipGetErrorName)(R);
  R (*hipInit)(unsigned);
  R (*hipDriverGetVersion)(int*);
  R (*hipGetDeviceCount)(int*);
  R (*hipDeviceGetName)(char*, int, int);
  // hipGetDevicePropertiesR0600 (ROCm 6+; hipGetDeviceProperties before): fills a hipDeviceProp_t,
  // used only for its gcnArchName (see device.cpp). Optional: nullptr when neither is exported.
  R (*hipGetDeviceProperties)(void*, int);
  R (*hipGetDevicePropertiesLegacy)(void*, int);  // "hipGetDeviceProperties" (ROCm 5 layout), optional
};

Result<const HipApi*> hip_api();

}  // namespace dp::rt
