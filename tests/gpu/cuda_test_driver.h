// The CUDA driver calls the GPU tests make themselves (allocations, copies, streams, graph capture),
// through the project's one driver table (runtime/driver/cuda.h, opened with dlopen like libdecodepack),
// so that the test binaries also start on hosts without a driver and skip there with a message. The
// tests' own types and constants come from the toolkit's cuda.h (compile time only).
#pragma once

#include <cuda.h>

#include <cstdio>
#include <string>

#include "driver/cuda.h"

namespace dp::gputest {

// The project's one CUDA table (runtime/driver/cuda.h; its handle types are cuda.h's), opened the way
// the tests need it: no throwing, a reason to print when there is no usable GPU.
struct Cu : dp::cu::CudaApi {
  CUcontext ctx = nullptr;
  std::string why_not;  // non-empty: no usable GPU here (the reason, printed by the skip)

  // Opens the driver and makes device 0's primary context current on this thread.
  bool open() {
    if (const dp::cu::CudaLoadError e = dp::cu::load_cuda_api(*this)) {
      why_not = e.kind == dp::cu::CudaLoadError::Kind::cannot_load
                    ? "no CUDA driver on this host (" + e.library + ": " + e.detail + ")"
                    : "the CUDA driver lacks " + e.detail;
      return false;
    }
    if (const int r = Init(0); r != dp::cu::CUDA_SUCCESS) {
      why_not = "cuInit failed: " + name(r) + " (no GPU visible?)";
      return false;
    }
    int n = 0;
    if (DeviceGetCount(&n) != dp::cu::CUDA_SUCCESS || n == 0) {
      why_not = "no CUDA device visible";
      return false;
    }
    CUdevice dev = 0;
    if (DeviceGet(&dev, 0) != dp::cu::CUDA_SUCCESS || DevicePrimaryCtxRetain(&ctx, dev) != dp::cu::CUDA_SUCCESS ||
        CtxSetCurrent(ctx) != dp::cu::CUDA_SUCCESS) {
      why_not = "cannot make device 0's primary context current";
      return false;
    }
    return true;
  }

  std::string name(int r) const {
    const char* s = nullptr;
    if (GetErrorName && GetErrorName(r, &s) == dp::cu::CUDA_SUCCESS && s) return s;
    return "CUresult " + std::to_string(r);
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
    const int cu_r_ = (call);                                                            \
    ASSERT_EQ(cu_r_, 0) << #call << ": " << ::dp::gputest::cu().name(cu_r_);             \
  } while (0)
