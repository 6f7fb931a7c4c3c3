// The CUDA driver calls the GPU tests make themselves (allocations, copies, streams, graph capture),
// through dlopen like libdecodepack, so that the test binaries also start on hosts without a driver
// and skip there with a message. Types come from the toolkit's cuda.h (compile time only).
#pragma once

#include <cuda.h>
#include <dlfcn.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace dp::gputest {

struct Cu {
  decltype(&::cuGetErrorName) GetErrorName = nullptr;
  decltype(&::cuInit) Init = nullptr;
  decltype(&::cuDeviceGetCount) DeviceGetCount = nullptr;
  decltype(&::cuDeviceGet) DeviceGet = nullptr;
  decltype(&::cuDevicePrimaryCtxRetain) DevicePrimaryCtxRetain = nullptr;
  decltype(&::cuCtxSetCurrent) CtxSetCurrent = nullptr;
  decltype(&::cuCtxSynchronize) CtxSynchronize = nullptr;
  decltype(&::cuMemAlloc) MemAlloc = nullptr;
  decltype(&::cuMemFree) MemFree = nullptr;
  decltype(&::cuMemcpyHtoD) MemcpyHtoD = nullptr;
  decltype(&::cuMemcpyDtoH) MemcpyDtoH = nullptr;
  decltype(&::cuMemsetD8) MemsetD8 = nullptr;
  decltype(&::cuMemsetD32Async) MemsetD32Async = nullptr;
  decltype(&::cuStreamCreate) StreamCreate = nullptr;
  decltype(&::cuStreamDestroy) StreamDestroy = nullptr;
  decltype(&::cuStreamSynchronize) StreamSynchronize = nullptr;
  decltype(&::cuStreamBeginCapture) StreamBeginCapture = nullptr;
  decltype(&::cuStreamEndCapture) StreamEndCapture = nullptr;
  decltype(&::cuGraphInstantiate) GraphInstantiate = nullptr;
  decltype(&::cuGraphLaunch) GraphLaunch = nullptr;
  decltype(&::cuGraphExecDestroy) GraphExecDestroy = nullptr;
  decltype(&::cuGraphDestroy) GraphDestroy = nullptr;
  decltype(&::cuModuleLoadData) ModuleLoadData = nullptr;
  decltype(&::cuModuleGetFunction) ModuleGetFunction = nullptr;
  decltype(&::cuLaunchKernel) LaunchKernel = nullptr;
  decltype(&::cuEventCreate) EventCreate = nullptr;
  decltype(&::cuEventRecord) EventRecord = nullptr;
  decltype(&::cuStreamWaitEvent) StreamWaitEvent = nullptr;
  decltype(&::cuCtxGetCurrent) CtxGetCurrent = nullptr;

  CUcontext ctx = nullptr;
  std::string why_not;  // non-empty: no usable GPU here (the reason, printed by the skip)

  // Opens the driver and makes device 0's primary context current on this thread.
  bool open() {
    void* h = ::dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = ::dlerror();
      why_not = std::string("no CUDA driver on this host (libcuda.so.1: ") + (e ? e : "?") + ")";
      return false;
    }
    bool all = true;
    auto sym = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(h, name));
      if (!fn) {
        why_not = std::string("the CUDA driver lacks ") + name;
        all = false;
      }
    };
    sym(GetErrorName, "cuGetErrorName");
    sym(Init, "cuInit");
    sym(DeviceGetCount, "cuDeviceGetCount");
    sym(DeviceGet, "cuDeviceGet");
    sym(DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
    sym(CtxSetCurrent, "cuCtxSetCurrent");
    sym(CtxSynchronize, "cuCtxSynchronize");
    sym(MemAlloc, "cuMemAlloc_v2");
    sym(MemFree, "cuMemFree_v2");
    sym(MemcpyHtoD, "cuMemcpyHtoD_v2");
    sym(MemcpyDtoH, "cuMemcpyDtoH_v2");
    sym(MemsetD8, "cuMemsetD8_v2");
    sym(MemsetD32Async, "cuMemsetD32Async");
    sym(StreamCreate, "cuStreamCreate");
    sym(StreamDestroy, "cuStreamDestroy_v2");
    sym(StreamSynchronize, "cuStreamSynchronize");
    sym(StreamBeginCapture, "cuStreamBeginCapture_v2");
    sym(StreamEndCapture, "cuStreamEndCapture");
    sym(GraphInstantiate, "cuGraphInstantiateWithFlags");
    sym(GraphLaunch, "cuGraphLaunch");
    sym(GraphExecDestroy, "cuGraphExecDestroy");
    sym(GraphDestroy, "cuGraphDestroy");
    sym(ModuleLoadData, "cuModuleLoadData");
    sym(ModuleGetFunction, "cuModuleGetFunction");
    sym(LaunchKernel, "cuLaunchKernel");
    sym(EventCreate, "cuEventCreate");
    sym(EventRecord, "cuEventRecord");
    sym(StreamWaitEvent, "cuStreamWaitEvent");
    sym(CtxGetCurrent, "cuCtxGetCurrent");
    if (!all) return false;
    if (CUresult r = Init(0); r != CUDA_SUCCESS) {
      why_not = "cuInit failed: " + name(r) + " (no GPU visible?)";
      return false;
    }
    int n = 0;
    if (DeviceGetCount(&n) != CUDA_SUCCESS || n == 0) {
      why_not = "no CUDA device visible";
      return false;
    }
    CUdevice dev = 0;
    if (DeviceGet(&dev, 0) != CUDA_SUCCESS || DevicePrimaryCtxRetain(&ctx, dev) != CUDA_SUCCESS ||
        CtxSetCurrent(ctx) != CUDA_SUCCESS) {
      why_not = "cannot make device 0's primary context current";
      return false;
    }
    return true;
  }

  std::string name(CUresult r) const {
    const char* s = nullptr;
    if (GetErrorName && GetErrorName(r, &s) == CUDA_SUCCESS && s) return s;
    return "CUresult " + std::to_string(static_cast<int>(r));
  }
};

// The process's driver table (opened once).
inline Cu& cu() {
  static Cu c;
  static const bool opened = c.open();
  (void)opened;
  return c;
}

}  // namespace dp::gputest

// gtest helper: a driver call that must succeed.
#define CU_OK(call)                                                                      \
  do {                                                                                   \
    const CUresult cu_r_ = (call);                                                       \
    ASSERT_EQ(cu_r_, CUDA_SUCCESS) << #call << ": " << ::dp::gputest::cu().name(cu_r_); \
  } while (0)
