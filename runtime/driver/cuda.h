// The project's one table of CUDA driver entry points (libcuda.so.1), opened with dlopen so that nothing
// links a GPU library: libdecodepack (src/driver.cpp), the tools (tooling/cuda_driver.h) and the GPU
// tests (tests/gpu/cuda_test_driver.h) all call the driver through it, each with its own error policy
// around load_cuda_api().
//
// Types, constants and struct layouts are NVIDIA's documented ABI (cuda.h); tests/gpu/cuda_api_check.cpp
// compares every one with the toolkit's cuda.h where one is installed. Entry points are stored under
// their API names without the `cu` prefix (cuda.h defines many cuXxx names as macros for versioned
// symbols, which would rename members in a file that also includes it); the exported, versioned symbol
// each one is loaded from is in cuda.cpp.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

// The driver's opaque handle types, declared at global scope exactly as cuda.h declares them, so that
// code which also includes cuda.h passes its own handles to the table unchanged.
struct CUctx_st;
struct CUmod_st;
struct CUfunc_st;
struct CUstream_st;
struct CUevent_st;
struct CUgraph_st;
struct CUgraphExec_st;

// cuda.h defines these five names as macros: saved and undefined here, restored at the end, so that
// this header may follow cuda.h in a file that includes both.
#pragma push_macro("CU_MEMHOSTALLOC_PORTABLE")
#undef CU_MEMHOSTALLOC_PORTABLE
#pragma push_macro("CU_MEMHOSTALLOC_DEVICEMAP")
#undef CU_MEMHOSTALLOC_DEVICEMAP
#pragma push_macro("CU_LAUNCH_PARAM_END")
#undef CU_LAUNCH_PARAM_END
#pragma push_macro("CU_LAUNCH_PARAM_BUFFER_POINTER")
#undef CU_LAUNCH_PARAM_BUFFER_POINTER
#pragma push_macro("CU_LAUNCH_PARAM_BUFFER_SIZE")
#undef CU_LAUNCH_PARAM_BUFFER_SIZE

namespace dp::cu {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUcontext = ::CUctx_st*;
using CUmodule = ::CUmod_st*;
using CUfunction = ::CUfunc_st*;
using CUstream = ::CUstream_st*;
using CUevent = ::CUevent_st*;
using CUgraph = ::CUgraph_st*;
using CUgraphExec = ::CUgraphExec_st*;
using CUjit_option = int;  // an enum in cuda.h

inline constexpr CUresult CUDA_SUCCESS = 0;
inline constexpr CUresult CUDA_ERROR_NO_DEVICE = 100;
inline constexpr CUresult CUDA_ERROR_INVALID_DEVICE = 101;

// CUdevice_attribute
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 1;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X = 2;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y = 3;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z = 4;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X = 5;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y = 6;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z = 7;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK = 8;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK = 12;
inline constexpr int CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT = 16;
inline constexpr int CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY = 19;
inline constexpr int CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75;
inline constexpr int CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76;
inline constexpr int CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97;

// CUfunction_attribute
inline constexpr int CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0;
inline constexpr int CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES = 1;
inline constexpr int CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES = 3;
inline constexpr int CU_FUNC_ATTRIBUTE_NUM_REGS = 4;
inline constexpr int CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;

// Flags and modes
inline constexpr unsigned CU_STREAM_NON_BLOCKING = 0x1;
inline constexpr int CU_STREAM_CAPTURE_MODE_THREAD_LOCAL = 1;
inline constexpr unsigned CU_EVENT_DISABLE_TIMING = 0x2;
inline constexpr unsigned CU_EVENT_RECORD_EXTERNAL = 0x1;  // during capture: an event record node
inline constexpr unsigned CU_MEMHOSTALLOC_PORTABLE = 0x01;
inline constexpr unsigned CU_MEMHOSTALLOC_DEVICEMAP = 0x02;
inline constexpr unsigned CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 0x1;
inline constexpr CUjit_option CU_JIT_ERROR_LOG_BUFFER = 5;
inline constexpr CUjit_option CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6;

// cuLaunchKernel's `extra` array: the parameter block passed as one buffer.
inline void* const CU_LAUNCH_PARAM_END = reinterpret_cast<void*>(0x00);
inline void* const CU_LAUNCH_PARAM_BUFFER_POINTER = reinterpret_cast<void*>(0x01);
inline void* const CU_LAUNCH_PARAM_BUFFER_SIZE = reinterpret_cast<void*>(0x02);

// CUlaunchAttributeID values used by the prefetch launches.
inline constexpr int CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6;
inline constexpr int CU_LAUNCH_ATTRIBUTE_PRIORITY = 8;
inline constexpr int CU_LAUNCH_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT = 14;

// CUlaunchAttributeValue: a 64-byte union; its members include pointers (8-byte alignment).
union CUlaunchAttributeValue {
  char pad[64];
  int priority;
  unsigned int sharedMemCarveout;
  int programmaticStreamSerializationAllowed;
  void* align_as_pointer_;
};

struct CUlaunchAttribute {
  int id;  // CUlaunchAttributeID
  char pad[8 - sizeof(int)];
  CUlaunchAttributeValue value;
};

struct CUlaunchConfig {
  unsigned int gridDimX, gridDimY, gridDimZ;
  unsigned int blockDimX, blockDimY, blockDimZ;
  unsigned int sharedMemBytes;
  CUstream hStream;
  CUlaunchAttribute* attrs;
  unsigned int numAttrs;
};

static_assert(sizeof(CUlaunchAttributeValue) == 64);
static_assert(sizeof(CUlaunchAttribute) == 72);
static_assert(offsetof(CUlaunchConfig, hStream) == 32);

// CUipcMemHandle: 64 opaque bytes, passed by value.
struct CUipcMemHandle {
  char reserved[64];
};

// Every entry point any part of the project calls. All are required except those marked optional
// (nullptr when the driver predates them).
struct CudaApi {
  std::string library;  // what was opened, for messages
  using R = CUresult;
  R (*GetErrorName)(R, const char**) = nullptr;
  R (*GetErrorString)(R, const char**) = nullptr;
  R (*Init)(unsigned) = nullptr;
  R (*DriverGetVersion)(int*) = nullptr;
  // Devices and contexts
  R (*DeviceGetCount)(int*) = nullptr;
  R (*DeviceGet)(CUdevice*, int) = nullptr;
  R (*DeviceGetName)(char*, int, CUdevice) = nullptr;
  R (*DeviceGetAttribute)(int*, int, CUdevice) = nullptr;
  R (*DevicePrimaryCtxRetain)(CUcontext*, CUdevice) = nullptr;
  R (*DevicePrimaryCtxRelease)(CUdevice) = nullptr;
  R (*CtxPushCurrent)(CUcontext) = nullptr;
  R (*CtxPopCurrent)(CUcontext*) = nullptr;
  R (*CtxGetCurrent)(CUcontext*) = nullptr;
  R (*CtxSetCurrent)(CUcontext) = nullptr;
  R (*CtxSynchronize)() = nullptr;
  R (*CtxGetStreamPriorityRange)(int*, int*) = nullptr;
  // Modules and launches
  R (*ModuleLoadData)(CUmodule*, const void*) = nullptr;
  R (*ModuleLoadDataEx)(CUmodule*, const void*, unsigned, CUjit_option*, void**) = nullptr;
  R (*ModuleUnload)(CUmodule) = nullptr;
  R (*ModuleGetFunction)(CUfunction*, CUmodule, const char*) = nullptr;
  R (*FuncGetAttribute)(int*, int, CUfunction) = nullptr;
  R (*FuncSetAttribute)(CUfunction, int, int) = nullptr;
  R (*FuncGetParamInfo)(CUfunction, size_t, size_t*, size_t*) = nullptr;  // optional: CUDA 12.4
  R (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                    void**, void**) = nullptr;
  R (*LaunchKernelEx)(const CUlaunchConfig*, CUfunction, void**, void**) = nullptr;
  // Streams, events, graphs
  R (*StreamCreate)(CUstream*, unsigned) = nullptr;
  R (*StreamCreateWithPriority)(CUstream*, unsigned, int) = nullptr;
  R (*StreamDestroy)(CUstream) = nullptr;
  R (*StreamSynchronize)(CUstream) = nullptr;
  R (*StreamWaitEvent)(CUstream, CUevent, unsigned) = nullptr;
  R (*StreamBeginCapture)(CUstream, int) = nullptr;
  R (*StreamEndCapture)(CUstream, CUgraph*) = nullptr;
  R (*EventCreate)(CUevent*, unsigned) = nullptr;
  R (*EventDestroy)(CUevent) = nullptr;
  R (*EventRecord)(CUevent, CUstream) = nullptr;
  R (*EventRecordWithFlags)(CUevent, CUstream, unsigned) = nullptr;
  R (*EventSynchronize)(CUevent) = nullptr;
  R (*EventElapsedTime)(float*, CUevent, CUevent) = nullptr;
  R (*GraphInstantiate)(CUgraphExec*, CUgraph, unsigned long long) = nullptr;
  R (*GraphLaunch)(CUgraphExec, CUstream) = nullptr;
  R (*GraphExecDestroy)(CUgraphExec) = nullptr;
  R (*GraphDestroy)(CUgraph) = nullptr;
  // Memory
  R (*MemGetInfo)(size_t*, size_t*) = nullptr;
  R (*MemAlloc)(CUdeviceptr*, size_t) = nullptr;
  R (*MemFree)(CUdeviceptr) = nullptr;
  R (*MemcpyHtoD)(CUdeviceptr, const void*, size_t) = nullptr;
  R (*MemcpyDtoH)(void*, CUdeviceptr, size_t) = nullptr;
  R (*MemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  R (*MemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  R (*MemsetD8)(CUdeviceptr, unsigned char, size_t) = nullptr;
  R (*MemsetD8Async)(CUdeviceptr, unsigned char, size_t, CUstream) = nullptr;
  R (*MemsetD32Async)(CUdeviceptr, unsigned int, size_t, CUstream) = nullptr;
  R (*MemHostAlloc)(void**, size_t, unsigned) = nullptr;
  R (*MemFreeHost)(void*) = nullptr;
  R (*MemHostGetDevicePointer)(CUdeviceptr*, void*, unsigned) = nullptr;
  // Inter-process memory (tensor-parallel ranks as processes; optional)
  R (*IpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr) = nullptr;
  R (*IpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned) = nullptr;
  R (*IpcCloseMemHandle)(CUdeviceptr) = nullptr;
};

// Why load_cuda_api() failed (kind none: it did not).
struct CudaLoadError {
  enum class Kind { none, cannot_load, missing_entry_point } kind = Kind::none;
  std::string library;  // the library it tried
  std::string detail;   // dlerror()'s text, or the missing symbol's name
  explicit operator bool() const { return kind != Kind::none; }
};

// Opens the driver library (DECODEPACK_CUDA_LIBRARY when set and not empty, else libcuda.so.1) and
// fills every entry point of `api`. cuInit is not called. The library stays loaded for the life of the
// process (function pointers into it stay in use), except after a missing entry point.
CudaLoadError load_cuda_api(CudaApi& api);

// "CUDA_ERROR_X" for r, or "CUDA_ERROR_?" when the driver has no name for it (or is not loaded).
std::string cuda_error_name(const CudaApi& api, CUresult r);

}  // namespace dp::cu

#pragma pop_macro("CU_MEMHOSTALLOC_PORTABLE")
#pragma pop_macro("CU_MEMHOSTALLOC_DEVICEMAP")
#pragma pop_macro("CU_LAUNCH_PARAM_END")
#pragma pop_macro("CU_LAUNCH_PARAM_BUFFER_POINTER")
#pragma pop_macro("CU_LAUNCH_PARAM_BUFFER_SIZE")
