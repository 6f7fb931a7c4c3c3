#include "cuda_driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <type_traits>

#include "common/error.h"

namespace dp::tools::cuda {

const Driver& Driver::get() {
  static std::mutex mu;
  static Driver table;
  static bool ready = false;
  std::lock_guard<std::mutex> lock(mu);
  if (ready) return table;

  const char* env = std::getenv("DECODEPACK_CUDA_LIBRARY");
  const std::string path = env && *env ? env : "libcuda.so.1";
  // Never closed: the function pointers stay in use until the process exits.
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* why = ::dlerror();
    fail(Errc::device,
         "CUDA driver: cannot load {}: {} (decodepack run needs an NVIDIA GPU and its driver; set "
         "DECODEPACK_CUDA_LIBRARY to the driver library if it is installed off the loader path)",
         path, why ? why : "unknown error");
  }
  Driver d;
  d.library = path;
  auto sym = [&](auto& fn, const char* name, const char* fallback = nullptr) {
    void* p = ::dlsym(h, name);
    if (!p && fallback) p = ::dlsym(h, fallback);
    if (!p) fail(Errc::device, "CUDA driver {}: no entry point {} (the driver is too old)", path, name);
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(p);
  };
  sym(d.GetErrorName, "cuGetErrorName");
  sym(d.GetErrorString, "cuGetErrorString");
  sym(d.Init, "cuInit");
  sym(d.DriverGetVersion, "cuDriverGetVersion");
  sym(d.DeviceGetCount, "cuDeviceGetCount");
  sym(d.DeviceGet, "cuDeviceGet");
  sym(d.DeviceGetName, "cuDeviceGetName");
  sym(d.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  sym(d.DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
  sym(d.CtxSetCurrent, "cuCtxSetCurrent");
  sym(d.CtxSynchronize, "cuCtxSynchronize");
  sym(d.MemGetInfo, "cuMemGetInfo_v2");
  sym(d.MemAlloc, "cuMemAlloc_v2");
  sym(d.MemFree, "cuMemFree_v2");
  sym(d.MemcpyHtoD, "cuMemcpyHtoD_v2");
  sym(d.MemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  sym(d.MemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
  sym(d.MemsetD8Async, "cuMemsetD8Async");
  sym(d.StreamCreate, "cuStreamCreate");
  sym(d.StreamDestroy, "cuStreamDestroy_v2");
  sym(d.StreamSynchronize, "cuStreamSynchronize");
  sym(d.EventCreate, "cuEventCreate");
  sym(d.EventDestroy, "cuEventDestroy_v2");
  sym(d.EventRecord, "cuEventRecord");
  sym(d.EventSynchronize, "cuEventSynchronize");
  // CUDA 12.8 added the _v2 name (cuda.h of CUDA 13 maps cuEventElapsedTime to it); older drivers
  // export only the first one. Both take (ms, start, end).
  sym(d.EventElapsedTime, "cuEventElapsedTime_v2", "cuEventElapsedTime");
  sym(d.StreamBeginCapture, "cuStreamBeginCapture_v2");
  sym(d.StreamEndCapture, "cuStreamEndCapture");
  sym(d.GraphInstantiate, "cuGraphInstantiateWithFlags");
  sym(d.GraphLaunch, "cuGraphLaunch");
  sym(d.GraphExecDestroy, "cuGraphExecDestroy");
  sym(d.GraphDestroy, "cuGraphDestroy");
  sym(d.DeviceGetAttribute, "cuDeviceGetAttribute");
  sym(d.ModuleLoadDataEx, "cuModuleLoadDataEx");
  sym(d.ModuleGetFunction, "cuModuleGetFunction");
  sym(d.ModuleUnload, "cuModuleUnload");
  sym(d.LaunchKernel, "cuLaunchKernel");
  sym(d.EventRecordWithFlags, "cuEventRecordWithFlags");
  d.check(d.Init(0), "cuInit", "the CUDA driver " + path + " is installed but found no usable GPU");
  table = d;
  ready = true;
  return table;
}

std::string Driver::error_name(CUresult r) const {
  const char* name = nullptr;
  if (GetErrorName && GetErrorName(r, &name) == CUDA_SUCCESS && name) return name;
  return "CUDA_ERROR_?";
}

void Driver::check(CUresult r, const char* call, const std::string& what) const {
  if (r == CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (!GetErrorString || GetErrorString(r, &text) != CUDA_SUCCESS) text = nullptr;
  fail(Errc::device, "{} failed: {} ({}): {}{}{}", call, error_name(r), r, text ? text : "no description",
       what.empty() ? "" : ": ", what);
}

}  // namespace dp::tools::cuda
