// The CUDA driver calls `decodepack run` makes itself (device memory, a stream, events, graph capture),
// opened at run time with dlopen like libdecodepack does, so that the tool starts on hosts without a
// GPU driver and says what is missing only when a subcommand needs the GPU.
//
// The declarations are NVIDIA's documented driver ABI (cuda.h): opaque handles, the exported
// (versioned) entry-point names, and the two enum values used here. No toolkit header is needed to
// build the tool. DECODEPACK_CUDA_LIBRARY replaces the library name, as for libdecodepack.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dp::tools::cuda {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = struct CUctx_st*;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUgraph = struct CUgraph_st*;
using CUgraphExec = struct CUgraphExec_st*;
using CUmodule = struct CUmod_st*;
using CUfunction = struct CUfunc_st*;
using CUjit_option = int;  // an enum in cuda.h

inline constexpr CUresult CUDA_SUCCESS = 0;
inline constexpr unsigned CU_STREAM_NON_BLOCKING = 0x1;
inline constexpr int CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1;
inline constexpr unsigned CU_EVENT_RECORD_EXTERNAL = 0x1;  // during capture: an event record node
inline constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
inline constexpr int CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38;
inline constexpr CUjit_option CU_JIT_ERROR_LOG_BUFFER = 5;
inline constexpr CUjit_option CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6;

struct Driver {
  std::string library;  // what was opened, for messages
  CUresult (*GetErrorName)(CUresult, const char**) = nullptr;
  CUresult (*GetErrorString)(CUresult, const char**) = nullptr;
  CUresult (*Init)(unsigned) = nullptr;
  CUresult (*DriverGetVersion)(int*) = nullptr;
  CUresult (*DeviceGetCount)(int*) = nullptr;
  CUresult (*DeviceGet)(CUdevice*, int) = nullptr;
  CUresult (*DeviceGetName)(char*, int, CUdevice) = nullptr;
  CUresult (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  CUresult (*DevicePrimaryCtxRelease)(CUdevice) = nullptr;  // _v2
  CUresult (*CtxSetCurrent)(CUcontext) = nullptr;
  CUresult (*CtxSynchronize)() = nullptr;
  CUresult (*MemGetInfo)(size_t*, size_t*) = nullptr;                              // _v2
  CUresult (*MemAlloc)(CUdeviceptr*, size_t) = nullptr;                            // _v2
  CUresult (*MemFree)(CUdeviceptr) = nullptr;                                      // _v2
  CUresult (*MemcpyHtoD)(CUdeviceptr, const void*, size_t) = nullptr;              // _v2
  CUresult (*MemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;  // _v2
  CUresult (*MemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream) = nullptr;     // _v2
  CUresult (*MemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
  CUresult (*StreamCreate)(CUstream*, unsigned) = nullptr;
  CUresult (*StreamDestroy)(CUstream) = nullptr;  // _v2
  CUresult (*StreamSynchronize)(CUstream) = nullptr;
  CUresult (*EventCreate)(CUevent*, unsigned) = nullptr;
  CUresult (*EventDestroy)(CUevent) = nullptr;  // _v2
  CUresult (*EventRecord)(CUevent, CUstream) = nullptr;
  CUresult (*EventSynchronize)(CUevent) = nullptr;
  CUresult (*EventElapsedTime)(float*, CUevent, CUevent) = nullptr;  // _v2 where exported
  CUresult (*StreamBeginCapture)(CUstream, int) = nullptr;           // _v2
  CUresult (*StreamEndCapture)(CUstream, CUgraph*) = nullptr;
  CUresult (*GraphInstantiate)(CUgraphExec*, CUgraph, unsigned long long) = nullptr;  // ...WithFlags
  CUresult (*GraphLaunch)(CUgraphExec, CUstream) = nullptr;
  CUresult (*GraphExecDestroy)(CUgraphExec) = nullptr;
  CUresult (*GraphDestroy)(CUgraph) = nullptr;
  // `decodepack bench`'s own kernels (PTX, compiled by the driver) and its timing.
  CUresult (*DeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  CUresult (*ModuleLoadDataEx)(CUmodule*, const void*, unsigned, CUjit_option*, void**) = nullptr;
  CUresult (*ModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  CUresult (*ModuleUnload)(CUmodule) = nullptr;
  CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                           void**, void**) = nullptr;
  CUresult (*EventRecordWithFlags)(CUevent, CUstream, unsigned) = nullptr;

  // The process's table with cuInit(0) done. Throws dp::Error(device) naming the library that cannot
  // be loaded, the missing entry point, or cuInit's error (e.g. CUDA_ERROR_NO_DEVICE).
  static const Driver& get();

  // Throws dp::Error(device) "<call> failed: CUDA_ERROR_X (n): <text>[: what]" unless r is CUDA_SUCCESS.
  void check(CUresult r, const char* call, const std::string& what = {}) const;
  std::string error_name(CUresult r) const;
};

}  // namespace dp::tools::cuda
