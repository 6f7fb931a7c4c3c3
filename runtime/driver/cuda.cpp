#include "driver/cuda.h"

#include <dlfcn.h>

#include <cstdlib>
#include <vector>

namespace dp::cu {
namespace {

struct Symbol {
  void** slot;
  const char* name;  // the exported name: the versioned one where cuda.h maps the API name to it
  const char* fallback = nullptr;  // an older name with the same signature, tried when `name` is absent
  bool required = true;
};

}  // namespace

CudaLoadError load_cuda_api(CudaApi& api) {
  const char* env = std::getenv("DECODEPACK_CUDA_LIBRARY");
  const std::string path = env && *env ? env : "libcuda.so.1";
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* why = ::dlerror();
    return {CudaLoadError::Kind::cannot_load, path, why ? why : "unknown error"};
  }
  CudaApi a;
  auto slot = [](auto& fn) { return reinterpret_cast<void**>(&fn); };
  const std::vector<Symbol> symbols = {
      {slot(a.GetErrorName), "cuGetErrorName"},
      {slot(a.GetErrorString), "cuGetErrorString"},
      {slot(a.Init), "cuInit"},
      {slot(a.DriverGetVersion), "cuDriverGetVersion"},
      {slot(a.DeviceGetCount), "cuDeviceGetCount"},
      {slot(a.DeviceGet), "cuDeviceGet"},
      {slot(a.DeviceGetName), "cuDeviceGetName"},
      {slot(a.DeviceGetAttribute), "cuDeviceGetAttribute"},
      {slot(a.DevicePrimaryCtxRetain), "cuDevicePrimaryCtxRetain"},
      {slot(a.DevicePrimaryCtxRelease), "cuDevicePrimaryCtxRelease_v2"},
      {slot(a.CtxPushCurrent), "cuCtxPushCurrent_v2"},
      {slot(a.CtxPopCurrent), "cuCtxPopCurrent_v2"},
      {slot(a.CtxGetCurrent), "cuCtxGetCurrent"},
      {slot(a.CtxSetCurrent), "cuCtxSetCurrent"},
      {slot(a.CtxSynchronize), "cuCtxSynchronize"},
      {slot(a.CtxGetStreamPriorityRange), "cuCtxGetStreamPriorityRange"},
      {slot(a.ModuleLoadData), "cuModuleLoadData"},
      {slot(a.ModuleLoadDataEx), "cuModuleLoadDataEx"},
      {slot(a.ModuleUnload), "cuModuleUnload"},
      {slot(a.ModuleGetFunction), "cuModuleGetFunction"},
      {slot(a.FuncGetAttribute), "cuFuncGetAttribute"},
      {slot(a.FuncSetAttribute), "cuFuncSetAttribute"},
      {slot(a.FuncGetParamInfo), "cuFuncGetParamInfo", nullptr, false},
      {slot(a.LaunchKernel), "cuLaunchKernel"},
      {slot(a.LaunchKernelEx), "cuLaunchKernelEx"},
      {slot(a.StreamCreate), "cuStreamCreate"},
      {slot(a.StreamCreateWithPriority), "cuStreamCreateWithPriority"},
      {slot(a.StreamDestroy), "cuStreamDestroy_v2"},
      {slot(a.StreamSynchronize), "cuStreamSynchronize"},
      {slot(a.StreamWaitEvent), "cuStreamWaitEvent"},
      {slot(a.StreamBeginCapture), "cuStreamBeginCapture_v2"},
      {slot(a.StreamEndCapture), "cuStreamEndCapture"},
      {slot(a.EventCreate), "cuEventCreate"},
      {slot(a.EventDestroy), "cuEventDestroy_v2"},
      {slot(a.EventRecord), "cuEventRecord"},
      {slot(a.EventRecordWithFlags), "cuEventRecordWithFlags"},
      {slot(a.EventSynchronize), "cuEventSynchronize"},
      // CUDA 12.8 added the _v2 name (cuda.h of CUDA 13 maps cuEventElapsedTime to it); older drivers
      // export only the first one. Both take (ms, start, end).
      {slot(a.EventElapsedTime), "cuEventElapsedTime_v2", "cuEventElapsedTime"},
      {slot(a.GraphInstantiate), "cuGraphInstantiateWithFlags"},
      {slot(a.GraphLaunch), "cuGraphLaunch"},
      {slot(a.GraphExecDestroy), "cuGraphExecDestroy"},
      {slot(a.GraphDestroy), "cuGraphDestroy"},
      {slot(a.MemGetInfo), "cuMemGetInfo_v2"},
      {slot(a.MemAlloc), "cuMemAlloc_v2"},
      {slot(a.MemFree), "cuMemFree_v2"},
      {slot(a.MemcpyHtoD), "cuMemcpyHtoD_v2"},
      {slot(a.MemcpyDtoH), "cuMemcpyDtoH_v2"},
      {slot(a.MemcpyHtoDAsync), "cuMemcpyHtoDAsync_v2"},
      {slot(a.MemcpyDtoHAsync), "cuMemcpyDtoHAsync_v2"},
      {slot(a.MemsetD8), "cuMemsetD8_v2"},
      {slot(a.MemsetD8Async), "cuMemsetD8Async"},
      {slot(a.MemsetD32Async), "cuMemsetD32Async"},
      {slot(a.MemHostAlloc), "cuMemHostAlloc"},
      {slot(a.MemFreeHost), "cuMemFreeHost"},
      {slot(a.MemHostGetDevicePointer), "cuMemHostGetDevicePointer_v2"},
      {slot(a.IpcGetMemHandle), "cuIpcGetMemHandle", nullptr, false},
      {slot(a.IpcOpenMemHandle), "cuIpcOpenMemHandle_v2", "cuIpcOpenMemHandle", false},
      {slot(a.IpcCloseMemHandle), "cuIpcCloseMemHandle", nullptr, false},
  };
  for (const Symbol& s : symbols) {
    *s.slot = ::dlsym(h, s.name);
    if (!*s.slot && s.fallback) *s.slot = ::dlsym(h, s.fallback);
    if (!*s.slot && s.required) {
      ::dlclose(h);
      return {CudaLoadError::Kind::missing_entry_point, path, s.name};
    }
  }
  a.library = path;
  api = a;
  return {};
}

std::string cuda_error_name(const CudaApi& api, CUresult r) {
  const char* name = nullptr;
  if (api.GetErrorName && api.GetErrorName(r, &name) == CUDA_SUCCESS && name) return name;
  return "CUDA_ERROR_?";
}

}  // namespace dp::cu
