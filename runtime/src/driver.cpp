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

Status cannot_load(const char* vendor, const std::string& path, const char* why, const char* env) {
  return error(DP_ERR_DRIVER_UNAVAILABLE,
               "{} driver: cannot load {}: {} (no {} driver on this host? set {} to its path; bundles can still "
               "be opened, validated and planned with host-only sessions)",
               vendor, path, why ? why : "unknown error", vendor, env);
}

Status missing_entry_point(const char* vendor, const std::string& path, const char* name) {
  return error(DP_ERR_DRIVER_UNAVAILABLE, "{} driver {}: no entry point {} (the driver is too old or not a {} "
               "driver)", vendor, path, name, vendor);
}

// Opens `library` (or the override in `env`) and fills every slot. The handle is never closed: the
// tables are process-wide and function pointers into the library stay in use until exit.
Status open_library(const char* env, const char* library, std::string& opened, std::vector<Symbol> symbols,
                    const char* vendor) {
  const char* override_path = std::getenv(env);
  const std::string path = override_path && *override_path ? override_path : library;
  void* h = ::dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) return cannot_load(vendor, path, ::dlerror(), env);
  for (const Symbol& s : symbols) {
    *s.slot = ::dlsym(h, s.name);
    if (!*s.slot && s.required) {
      ::dlclose(h);
      return missing_entry_point(vendor, path, s.name);
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
  if (api.GetErrorName(r, &name) != cu::CUDA_SUCCESS) name = nullptr;
  if (api.GetErrorString(r, &text) != cu::CUDA_SUCCESS) text = nullptr;
  return error(DP_ERR_DRIVER, "{} failed: {} ({}): {}{}{}", call, name ? name : "CUDA_ERROR_?", r,
               text ? text : "no description", what.empty() ? "" : ": ", what);
}

Result<const CudaApi*> cuda_api() {
  static std::mutex mu;
  static CudaApi api;
  static bool ready = false;
  std::lock_guard<std::mutex> lock(mu);
  if (ready) return static_cast<const CudaApi*>(&api);
  CudaApi a;
  if (const cu::CudaLoadError e = cu::load_cuda_api(a)) {
    if (e.kind == cu::CudaLoadError::Kind::cannot_load)
      return cannot_load("CUDA", e.library, e.detail.c_str(), "DECODEPACK_CUDA_LIBRARY");
    return missing_entry_point("CUDA", e.library, e.detail.c_str());
  }
  DP_RETURN_IF_ERROR(cuda_check(a, a.Init(0), "cuInit", "the CUDA driver is installed but cannot initialise"));
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
