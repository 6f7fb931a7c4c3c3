// GPU driver symbol tables: libcuda.so.1 and libamdhip64.so, opened with dlopen on first use.
//
// One table per vendor, filled once per process and never unloaded. Every entry point the runtime
// calls is listed here, so a driver that lacks one is reported at load time, by name, instead of
// failing later. A failed load is not cached: a later call tries again (e.g. after the host set
// DECODEPACK_CUDA_LIBRARY). The environment variables DECODEPACK_CUDA_LIBRARY and
// DECODEPACK_HIP_LIBRARY replace the default library names (a driver installed off the loader path).
#pragma once

#include <string>

#include "src/cuda_api.h"
#include "src/status.h"

namespace dp::rt {

struct CudaApi {
  std::string library;  // what was opened, for messages
  using R = cu::CUresult;
  R (*cuGetErrorName)(R, const char**);
  R (*cuGetErrorString)(R, const char**);
  R (*cuInit)(unsigned);
  R (*cuDriverGetVersion)(int*);
  R (*cuDeviceGetCount)(int*);
  R (*cuDeviceGet)(cu::CUdevice*, int);
  R (*cuDeviceGetName)(char*, int, cu::CUdevice);
  R (*cuDeviceGetAttribute)(int*, int, cu::CUdevice);
  R (*cuDevicePrimaryCtxRetain)(cu::CUcontext*, cu::CUdevice);
  R (*cuDevicePrimaryCtxRelease)(cu::CUdevice);  // _v2
  R (*cuCtxPushCurrent)(cu::CUcontext);          // _v2
  R (*cuCtxPopCurrent)(cu::CUcontext*);          // _v2
  R (*cuCtxGetCurrent)(cu::CUcontext*);
  R (*cuCtxGetStreamPriorityRange)(int*, int*);
  R (*cuModuleLoadData)(cu::CUmodule*, const void*);
  R (*cuModuleUnload)(cu::CUmodule);
  R (*cuModuleGetFunction)(cu::CUfunction*, cu::CUmodule, const char*);
  R (*cuFuncGetAttribute)(int*, int, cu::CUfunction);
  R (*cuLaunchKernel)(cu::CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                      cu::CUstream, void**, void**);
  R (*cuLaunchKernelEx)(const cu::CUlaunchConfig*, cu::CUfunction, void**, void**);
  R (*cuStreamCreateWithPriority)(cu::CUstream*, unsigned, int);
  R (*cuStreamDestroy)(cu::CUstream);            // _v2
  R (*cuEventCreate)(cu::CUevent*, unsigned);
  R (*cuEventDestroy)(cu::CUevent);              // _v2
  R (*cuEventRecord)(cu::CUevent, cu::CUstream);
  R (*cuStreamWaitEvent)(cu::CUstream, cu::CUevent, unsigned);
  R (*cuMemAlloc)(cu::CUdeviceptr*, size_t);     // _v2
  R (*cuMemFree)(cu::CUdeviceptr);               // _v2
  R (*cuMemcpyHtoD)(cu::CUdeviceptr, const void*, size_t);  // _v2
  R (*cuMemcpyDtoH)(void*, cu::CUdeviceptr, size_t);        // _v2
  R (*cuMemHostAlloc)(void**, size_t, unsigned);
  R (*cuMemFreeHost)(void*);
  R (*cuMemHostGetDevicePointer)(cu::CUdeviceptr*, void*, unsigned);  // _v2
  // Optional (nullptr when the driver predates it): CUDA 12.4.
  R (*cuFuncGetParamInfo)(cu::CUfunction, size_t, size_t*, size_t*);
};

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
