#include "src/driver.h"

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <vector>

namespace dp::rt {
namespace {

struct Symbol {
  const char* name;  // the exported name (versioned names where cuda.h maps the API name to one)
  void** slot;
  bool required;
};

// Opens `library` (or the override in `env`) and fills every slot. The handle is never closed: the
// tables are process-wide and function pointers into the library stay in use until exit.
Status open_library(const char* env, const char* library, std::string& opened, std::vector<Symbol> symbols,
                    const char* vendor) {
  const char* override_path = std::getenv(env);
  const std::string path = override_path && *override_path ? override_path : library;
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* why = ::dlerror();
    return error(DP_ERR_DRIVER_UNAVAILABLE,
                 "{} driver: cannot load {}: {} (no {} driver on this host? set {} to its path; bundles can still "
                 "be opened, validated and planned with host-only sessions)",
                 vendor, path, why ? why : "unknown error", vendor, env);
  }
  for (const Symbol& s : symbols) {
    *s.slot = ::dlsym(h, s.name);
    if (!*s.slot && s.required) {
      ::dlclose(h);
      return error(DP_ERR_DRIVER_UNAVAILABLE, "{} driver {}: no entry point {} (the driver is too old or not a {} "
                   "driver)", vendor, path, s.name, vendor);
    }
  }
  opened = path;
  return ok();
}

}  // namespace

Status cuda_check(const CudaApi& api, cu::CUresult r, const char* call, const std::string& what) {
  if (r == cu::CUDA_SUCCESS) return ok();
  const char* name = nullptr;
  const char* text = nullptr;
  if (api.cuGetErrorName(r, &name) != cu::CUDA_SUCCESS) name = nullptr;
  if (api.cuGetErrorString(r, &text) != cu::CUDA_SUCCESS) text = nullptr;
  return error(DP_ERR_DRIVER, "{} failed: {} ({}): {}{}{}", call, name ? name : "CUDA_ERROR_?", r,
               text ? text : "no description", what.empty() ? "" : ": ", what);
}

Result<const CudaApi*> cuda_api() {
  static std::mutex mu;
  static CudaApi api;
  static bool ready = false;
  std::lock_guard<std::mutex> lock(mu);
  if (ready) return static_cast<const CudaApi*>(&api);
  CudaApi a{};
  auto slot = [](auto& fn) { return reinterpret_cast<void**>(&fn); };
  std::vector<Symbol> symbols = {
      {"cuGetErrorName", slot(a.cuGetErrorName), true},
      {"cuGetErrorString", slot(a.cuGetErrorString), true},
      {"cuInit", slot(a.cuInit), true},
      {"cuDriverGetVersion", slot(a.cuDriverGetVersion), true},
      {"cuDeviceGetCount", slot(a.cuDeviceGetCount), true},
      {"cuDeviceGet", slot(a.cuDeviceGet), true},
      {"cuDeviceGetName", slot(a.cuDeviceGetName), true},
      {"cuDeviceGetAttribute", slot(a.cuDeviceGetAttribute), true},
      {"cuDevicePrimaryCtxRetain", slot(a.cuDevicePrimaryCtxRetain), true},
      {"cuDevicePrimaryCtxRelease_v2", slot(a.cuDevicePrimaryCtxRelease), true},
      {"cuCtxPushCurrent_v2", slot(a.cuCtxPushCurrent), true},
      {"cuCtxPopCurrent_v2", slot(a.cuCtxPopCurrent), true},
      {"cuCtxGetCurrent", slot(a.cuCtxGetCurrent), true},
      {"cuCtxGetStreamPriorityRange", slot(a.cuCtxGetStreamPriorityRange), true},
      {"cuModuleLoadData", slot(a.cuModuleLoadData), true},
      {"cuModuleUnload", slot(a.cuModuleUnload), true},
      {"cuModuleGetFunction", slot(a.cuModuleGetFunction), true},
      {"cuFuncGetAttribute", slot(a.cuFuncGetAttribute), true},
      {"cuLaunchKernel", slot(a.cuLaunchKernel), true},
      {"cuLaunchKernelEx", slot(a.cuLaunchKernelEx), true},
      {"cuStreamCreateWithPriority", slot(a.cuStreamCreateWithPriority), true},
      {"cuStreamDestroy_v2", slot(a.cuStreamDestroy), true},
      {"cuEventCreate", slot(a.cuEventCreate), true},
      {"cuEventDestroy_v2", slot(a.cuEventDestroy), true},
      {"cuEventRecord", slot(a.cuEventRecord), true},
      {"cuStreamWaitEvent", slot(a.cuStreamWaitEvent), true},
      {"cuMemAlloc_v2", slot(a.cuMemAlloc), true},
      {"cuMemFree_v2", slot(a.cuMemFree), true},
      {"cuMemcpyHtoD_v2", slot(a.cuMemcpyHtoD), true},
      {"cuMemcpyDtoH_v2", slot(a.cuMemcpyDtoH), true},
      {"cuMemHostAlloc", slot(a.cuMemHostAlloc), true},
      {"cuMemFreeHost", slot(a.cuMemFreeHost), true},
      {"cuMemHostGetDevicePointer_v2", slot(a.cuMemHostGetDevicePointer), true},
      {"cuFuncGetParamInfo", slot(a.cuFuncGetParamInfo), false},
  };
  DP_RETURN_IF_ERROR(open_library("DECODEPACK_CUDA_LIBRARY", "libcuda.so.1", a.library, symbols, "CUDA"));
  DP_RETURN_IF_ERROR(cuda_check(a, a.cuInit(0), "cuInit", "the CUDA driver is installed but cannot initialise"));
  api = a;
  ready = true;
  return static_cast<const CudaApi*>(&api);
}

Result<const HipApi*> hip_api() {
  static std::mutex mu;
  static HipApi api;
  static bool ready = false;
  std::lock_guard<std::mutex> lock(mu);
  if (ready) return static_cast<const HipApi*>(&api);
  HipApi a{};
  auto slot = [](auto& fn) { return reinterpret_cast<void**>(&fn); };
  std::vector<Symbol> symbols = {
      {"hipGetErrorName", slot(a.hipGetErrorName), true},
      {"hipInit", slot(a.hipInit), true},
      {"hipDriverGetVersion", slot(a.hipDriverGetVersion), true},
      {"hipGetDeviceCount", slot(a.hipGetDeviceCount), true},
      {"hipDeviceGetName", slot(a.hipDeviceGetName), true},
      {"hipGetDevicePropertiesR0600", slot(a.hipGetDeviceProperties), false},
      {"hipGetDeviceProperties", slot(a.hipGetDevicePropertiesLegacy), false},
  };
  DP_RETURN_IF_ERROR(open_library("DECODEPACK_HIP_LIBRARY", "libamdhip64.so", a.library, symbols, "HIP"));
  if (!a.hipGetDeviceProperties)  // ROCm 5: the unversioned name, whose struct has the same gcnArchName field
    a.hipGetDeviceProperties = a.hipGetDevicePropertiesLegacy;
  if (int r = a.hipInit(0); r != 0)
    return error(DP_ERR_DRIVER, "hipInit failed: {} ({})", a.hipGetErrorName(r), r);
  api = a;
  ready = true;
  return static_cast<const HipApi*>(&api);
}

}  // namespace dp::rt
