#include "tooling/cuda_driver.h"

#include <mutex>

#include "common/error.h"

namespace dp::tools {

const Driver& Driver::get() {
  static std::mutex mu;
  static Driver table;
  static bool ready = false;
  std::lock_guard<std::mutex> lock(mu);
  if (ready) return table;

  Driver d;
  if (const cu::CudaLoadError e = cu::load_cuda_api(d)) {
    if (e.kind == cu::CudaLoadError::Kind::cannot_load)
      fail(Errc::device,
           "CUDA driver: cannot load {}: {} (decodepack run needs an NVIDIA GPU and its driver; set "
           "DECODEPACK_CUDA_LIBRARY to the driver library if it is installed off the loader path)",
           e.library, e.detail);
    fail(Errc::device, "CUDA driver {}: no entry point {} (the driver is too old)", e.library, e.detail);
  }
  d.check(d.Init(0), "cuInit", "the CUDA driver " + d.library + " is installed but found no usable GPU");
  table = d;
  ready = true;
  return table;
}

void Driver::check(cu::CUresult r, const char* call, const std::string& what) const {
  if (r == cu::CUDA_SUCCESS) return;
  const char* text = nullptr;
  if (!GetErrorString || GetErrorString(r, &text) != cu::CUDA_SUCCESS) text = nullptr;
  fail(Errc::device, "{} failed: {} ({}): {}{}{}", call, error_name(r), r, text ? text : "no description",
       what.empty() ? "" : ": ", what);
}

}  // namespace dp::tools
