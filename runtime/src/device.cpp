#include "src/device.h"

#include <cstdio>
#include <cstring>
#include <vector>

#include "src/driver.h"

namespace dp::rt {
namespace {

using namespace cu;

class CudaDevice final : public Device {
 public:
  CudaDevice(const CudaApi* api, CUdevice dev, CUcontext ctx) : api_(api), dev_(dev), ctx_(ctx) {}
  ~CudaDevice() override { api_->DevicePrimaryCtxRelease(dev_); }

  dp_device_desc& mutable_desc() { return desc_; }
  // cuCtxGetStreamPriorityRange's "greatest" (numerically lowest) priority, for critical launches.
  void set_greatest_priority(int p) { greatest_priority_ = p; }

  Status enter(bool* pushed) override {
    CUcontext current = nullptr;
    *pushed = false;
    if (api_->CtxGetCurrent(&current) == CUDA_SUCCESS && current == ctx_) return ok();
    DP_RETURN_IF_ERROR(check(api_->CtxPushCurrent(ctx_), "cuCtxPushCurrent"));
    *pushed = true;
    return ok();
  }
  void leave() override {
    CUcontext popped = nullptr;
    api_->CtxPopCurrent(&popped);
  }

  Status load_module(std::span<const uint8_t> image, const std::string& what, void** module) override {
    CUmodule m = nullptr;
    DP_RETURN_IF_ERROR(check(api_->ModuleLoadData(&m, image.data()), "cuModuleLoadData", what));
    *module = m;
    return ok();
  }
  void unload_module(void* module) override { api_->ModuleUnload(static_cast<CUmodule>(module)); }

  Status function(void* module, const std::string& name, const std::string& what, void** fn) override {
    CUfunction f = nullptr;
    DP_RETURN_IF_ERROR(check(api_->ModuleGetFunction(&f, static_cast<CUmodule>(module), name.c_str()),
                             "cuModuleGetFunction", what));
    *fn = f;
    return ok();
  }

  Status allow_dynamic_shared(void* fn, uint32_t bytes, const std::string& what) override {
    return check(api_->FuncSetAttribute(static_cast<CUfunction>(fn), CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        static_cast<int>(bytes)),
                 "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)", what);
  }

  Status function_info(void* fn, const std::string& what, FunctionInfo* out) override {
    CUfunction f = static_cast<CUfunction>(fn);
    DP_RETURN_IF_ERROR(check(api_->FuncGetAttribute(&out->registers, CU_FUNC_ATTRIBUTE_NUM_REGS, f),
                             "cuFuncGetAttribute(NUM_REGS)", what));
    DP_RETURN_IF_ERROR(check(api_->FuncGetAttribute(&out->max_threads, CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK, f),
                             "cuFuncGetAttribute(MAX_THREADS_PER_BLOCK)", what));
    DP_RETURN_IF_ERROR(check(api_->FuncGetAttribute(&out->static_shared, CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES, f),
                             "cuFuncGetAttribute(SHARED_SIZE_BYTES)", what));
    DP_RETURN_IF_ERROR(check(api_->FuncGetAttribute(&out->local_bytes, CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, f),
                             "cuFuncGetAttribute(LOCAL_SIZE_BYTES)", what));
    out->has_param_info = false;
    out->params.clear();
    if (api_->FuncGetParamInfo) {
      // Parameters are numbered from 0; the driver answers CUDA_ERROR_INVALID_VALUE past the last one.
      for (size_t i = 0; i < 4096; ++i) {
        size_t offset = 0, size = 0;
        if (api_->FuncGetParamInfo(f, i, &offset, &size) != CUDA_SUCCESS) break;
        out->params.emplace_back(offset, size);
      }
      out->has_param_info = true;
    }
    return ok();
  }

  Status alloc(size_t bytes, const std::string& what, uint64_t* out) override {
    CUdeviceptr p = 0;
    DP_RETURN_IF_ERROR(check(api_->MemAlloc(&p, bytes), "cuMemAlloc", what));
    *out = p;
    return ok();
  }
  void free(uint64_t ptr) override { api_->MemFree(ptr); }
  Status upload(uint64_t dst, const void* src, size_t bytes, const std::string& what) override {
    return check(api_->MemcpyHtoD(dst, src, bytes), "cuMemcpyHtoD", what);
  }
  Status download(void* dst, uint64_t src, size_t bytes, const std::string& what) override {
    return check(api_->MemcpyDtoH(dst, src, bytes), "cuMemcpyDtoH", what);
  }
  Status alloc_mapped(size_t bytes, const std::string& what, void** host, uint64_t* device) override {
    void* h = nullptr;
    DP_RETURN_IF_ERROR(check(api_->MemHostAlloc(&h, bytes, CU_MEMHOSTALLOC_DEVICEMAP | CU_MEMHOSTALLOC_PORTABLE),
                             "cuMemHostAlloc", what));
    std::memset(h, 0, bytes);
    CUdeviceptr d = 0;
    if (Status s = check(api_->MemHostGetDevicePointer(&d, h, 0), "cuMemHostGetDevicePointer", what); !s.ok()) {
      api_->MemFreeHost(h);
      return s;
    }
    *host = h;
    *device = d;
    return ok();
  }
  void free_mapped(void* host) override { api_->MemFreeHost(host); }

  Status create_stream(void** out) override {
    CUstream s = nullptr;
    // Non-blocking: the side stream must not serialise with the legacy default stream the host may use.
    DP_RETURN_IF_ERROR(check(api_->StreamCreateWithPriority(&s, CU_STREAM_NON_BLOCKING, 0), "cuStreamCreateWithPriority"));
    *out = s;
    return ok();
  }
  void destroy_stream(void* s) override { api_->StreamDestroy(static_cast<CUstream>(s)); }
  Status create_event(void** out) override {
    CUevent e = nullptr;
    DP_RETURN_IF_ERROR(check(api_->EventCreate(&e, CU_EVENT_DISABLE_TIMING), "cuEventCreate"));
    *out = e;
    return ok();
  }
  void destroy_event(void* e) override { api_->EventDestroy(static_cast<CUevent>(e)); }
  Status record(void* event, void* stream) override {
    return check(api_->EventRecord(static_cast<CUevent>(event), static_cast<CUstream>(stream)), "cuEventRecord");
  }
  Status wait(void* stream, void* event) override {
    return check(api_->StreamWaitEvent(static_cast<CUstream>(stream), static_cast<CUevent>(event), 0),
                 "cuStreamWaitEvent");
  }

  Status launch(const LaunchSpec& l, const char* what) override {
    size_t bytes = l.param_bytes;
    void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, l.params, CU_LAUNCH_PARAM_BUFFER_SIZE, &bytes, CU_LAUNCH_PARAM_END};
    if (!l.high_priority && !l.programmatic)
      return check(api_->LaunchKernel(static_cast<CUfunction>(l.function), l.grid[0], l.grid[1], l.grid[2], l.block[0],
                                        l.block[1], l.block[2], l.dynamic_shared, static_cast<CUstream>(l.stream),
                                        nullptr, extra),
                   "cuLaunchKernel", what);
    // Launch attributes need the extended launch (the stream's own priority would apply otherwise).
    CUlaunchAttribute attrs[2];
    std::memset(attrs, 0, sizeof(attrs));
    unsigned n = 0;
    if (l.high_priority) {
      attrs[n].id = CU_LAUNCH_ATTRIBUTE_PRIORITY;
      attrs[n++].value.priority = greatest_priority_;
    }
    if (l.programmatic) {
      attrs[n].id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
      attrs[n++].value.programmaticStreamSerializationAllowed = 1;
    }
    CUlaunchConfig cfg{};
    cfg.gridDimX = l.grid[0];
    cfg.gridDimY = l.grid[1];
    cfg.gridDimZ = l.grid[2];
    cfg.blockDimX = l.block[0];
    cfg.blockDimY = l.block[1];
    cfg.blockDimZ = l.block[2];
    cfg.sharedMemBytes = l.dynamic_shared;
    cfg.hStream = static_cast<CUstream>(l.stream);
    cfg.attrs = attrs;
    cfg.numAttrs = n;
    return check(api_->LaunchKernelEx(&cfg, static_cast<CUfunction>(l.function), nullptr, extra), "cuLaunchKernelEx",
                 what);
  }

 private:
  Status check(CUresult r, const char* call, const std::string& what = {}) const {
    return r == CUDA_SUCCESS ? Status() : cuda_check(*api_, r, call, what);
  }

  const CudaApi* api_;
  CUdevice dev_;
  CUcontext ctx_;
  int greatest_priority_ = 0;
};

Status cuda_device(const CudaApi& api, int32_t ordinal, CUdevice* dev) {
  int count = 0;
  DP_RETURN_IF_ERROR(cuda_check(api, api.DeviceGetCount(&count), "cuDeviceGetCount"));
  if (ordinal < 0 || ordinal >= count)
    return error(DP_ERR_NO_DEVICE, "CUDA device {}: no such device ({} device{} visible: valid ordinals 0..{})", ordinal,
                 count, count == 1 ? "" : "s", count - 1);
  return cuda_check(api, api.DeviceGet(dev, ordinal), "cuDeviceGet");
}

Status cuda_describe(const CudaApi& api, CUdevice dev, dp_device_desc* out) {
  dp_device_desc d;
  dp_device_desc_init(&d);
  d.vendor = DP_VENDOR_CUDA;
  DP_RETURN_IF_ERROR(cuda_check(api, api.DriverGetVersion(&d.driver_version), "cuDriverGetVersion"));
  DP_RETURN_IF_ERROR(cuda_check(api, api.DeviceGetName(d.name, sizeof(d.name) - 1, dev), "cuDeviceGetName"));
  auto attr = [&](int a, auto* v, const char* name) {
    int x = 0;
    Status s = cuda_check(api, api.DeviceGetAttribute(&x, a, dev), "cuDeviceGetAttribute", name);
    *v = x;
    return s;
  };
  int major = 0, minor = 0;
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, &major, "COMPUTE_CAPABILITY_MAJOR"));
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, &minor, "COMPUTE_CAPABILITY_MINOR"));
  std::snprintf(d.arch, sizeof(d.arch), "sm_%d%d", major, minor);
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK, &d.max_threads_per_block, "MAX_THREADS_PER_BLOCK"));
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X, &d.max_block_dim[0], "MAX_BLOCK_DIM_X"));
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y, &d.max_block_dim[1], "MAX_BLOCK_DIM_Y"));
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z, &d.max_block_dim[2], "MAX_BLOCK_DIM_Z"));
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X, &d.max_grid_dim[0], "MAX_GRID_DIM_X"));
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y, &d.max_grid_dim[1], "MAX_GRID_DIM_Y"));
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z, &d.max_grid_dim[2], "MAX_GRID_DIM_Z"));
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK, &d.max_registers_per_block, "MAX_REGISTERS_PER_BLOCK"));
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK, &d.max_shared_per_block, "MAX_SHARED_MEMORY_PER_BLOCK"));
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, &d.max_shared_per_block_optin,
                          "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN"));
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, &d.multiprocessors, "MULTIPROCESSOR_COUNT"));
  DP_RETURN_IF_ERROR(attr(CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, &d.l2_bytes, "L2_CACHE_SIZE"));
  // Keep the caller's size: write only what its struct holds.
  const size_t n = out->size < sizeof(d) ? out->size : sizeof(d);
  d.size = out->size;
  std::memcpy(out, &d, n);
  return ok();
}

// AMD: name, driver version and processor. Limits stay 0 ("not checked"): HIP's attribute numbering is
// not declared here. The processor comes from hipDeviceProp_t.gcnArchName ("gfx942:sramecc+:xnack-");
// rather than hard-coding that field's offset in a struct whose layout changed between ROCm releases,
// the filled struct is searched for the one string that starts with "gfx" followed by a digit.
// (Not exercised on an AMD GPU by this project's tests.)
Status hip_describe(const HipApi& api, int32_t ordinal, dp_device_desc* out) {
  int count = 0;
  if (int r = api.hipGetDeviceCount(&count); r != 0)
    return error(DP_ERR_DRIVER, "hipGetDeviceCount failed: {} ({})", api.hipGetErrorName(r), r);
  if (ordinal < 0 || ordinal >= count)
    return error(DP_ERR_NO_DEVICE, "HIP device {}: no such device ({} visible)", ordinal, count);
  dp_device_desc d;
  dp_device_desc_init(&d);
  d.vendor = DP_VENDOR_HIP;
  if (int r = api.hipDriverGetVersion(&d.driver_version); r != 0)
    return error(DP_ERR_DRIVER, "hipDriverGetVersion failed: {} ({})", api.hipGetErrorName(r), r);
  if (int r = api.hipDeviceGetName(d.name, sizeof(d.name) - 1, ordinal); r != 0)
    return error(DP_ERR_DRIVER, "hipDeviceGetName failed: {} ({})", api.hipGetErrorName(r), r);
  if (!api.hipGetDeviceProperties)
    return error(DP_ERR_DRIVER_UNAVAILABLE, "HIP driver {}: no entry point hipGetDevicePropertiesR0600 or "
                 "hipGetDeviceProperties", api.library);
  std::vector<char> props(64 * 1024, 0);  // far larger than any hipDeviceProp_t
  if (int r = api.hipGetDeviceProperties(props.data(), ordinal); r != 0)
    return error(DP_ERR_DRIVER, "hipGetDeviceProperties failed: {} ({})", api.hipGetErrorName(r), r);
  for (size_t i = 0; i + 4 < props.size(); ++i) {
    if ((i == 0 || props[i - 1] == 0) && std::strncmp(&props[i], "gfx", 3) == 0 && props[i + 3] >= '0' &&
        props[i + 3] <= '9') {
      std::snprintf(d.arch, sizeof(d.arch), "%s", &props[i]);
      break;
    }
  }
  if (!d.arch[0]) return error(DP_ERR_DRIVER, "HIP device {}: the device properties name no gfx processor", ordinal);
  const size_t n = out->size < sizeof(d) ? out->size : sizeof(d);
  d.size = out->size;
  std::memcpy(out, &d, n);
  return ok();
}

}  // namespace

Status device_count(int32_t vendor, int32_t* out) {
  *out = 0;
  if (vendor == DP_VENDOR_CUDA) {
    auto api = cuda_api();
    if (!api.ok()) return api.status();
    int n = 0;
    DP_RETURN_IF_ERROR(cuda_check(**api, (*api)->DeviceGetCount(&n), "cuDeviceGetCount"));
    *out = n;
    return ok();
  }
  if (vendor == DP_VENDOR_HIP) {
    auto api = hip_api();
    if (!api.ok()) return api.status();
    int n = 0;
    if (int r = (*api)->hipGetDeviceCount(&n); r != 0)
      return error(DP_ERR_DRIVER, "hipGetDeviceCount failed: {} ({})", (*api)->hipGetErrorName(r), r);
    *out = n;
    return ok();
  }
  return error(DP_ERR_INVALID_ARGUMENT, "vendor {} is not DP_VENDOR_CUDA ({}) or DP_VENDOR_HIP ({})", vendor,
               static_cast<int>(DP_VENDOR_CUDA), static_cast<int>(DP_VENDOR_HIP));
}

Status query_device(int32_t vendor, int32_t ordinal, dp_device_desc* out) {
  if (vendor == DP_VENDOR_CUDA) {
    auto api = cuda_api();
    if (!api.ok()) return api.status();
    CUdevice dev = 0;
    DP_RETURN_IF_ERROR(cuda_device(**api, ordinal, &dev));
    return cuda_describe(**api, dev, out);
  }
  if (vendor == DP_VENDOR_HIP) {
    auto api = hip_api();
    if (!api.ok()) return api.status();
    return hip_describe(**api, ordinal, out);
  }
  return error(DP_ERR_INVALID_ARGUMENT, "vendor {} is not DP_VENDOR_CUDA ({}) or DP_VENDOR_HIP ({})", vendor,
               static_cast<int>(DP_VENDOR_CUDA), static_cast<int>(DP_VENDOR_HIP));
}

Result<std::unique_ptr<Device>> open_device(int32_t vendor, int32_t ordinal) {
  if (vendor == DP_VENDOR_HIP) {
    auto api = hip_api();
    if (!api.ok()) return api.status();
    return error(DP_ERR_NOT_SUPPORTED, "HIP device {}: device sessions on AMD GPUs are not implemented in libdecodepack "
                 "{}; host-only sessions (device DP_DEVICE_NONE, target gfx942) open, validate and plan", ordinal,
                 dp_version_string());
  }
  if (vendor != DP_VENDOR_CUDA)
    return error(DP_ERR_INVALID_ARGUMENT, "session options: vendor {} is not DP_VENDOR_CUDA ({}) or DP_VENDOR_HIP ({})",
                 vendor, static_cast<int>(DP_VENDOR_CUDA), static_cast<int>(DP_VENDOR_HIP));
  auto api = cuda_api();
  if (!api.ok()) return api.status();
  const CudaApi& a = **api;
  CUdevice dev = 0;
  DP_RETURN_IF_ERROR(cuda_device(a, ordinal, &dev));
  dp_device_desc desc;
  dp_device_desc_init(&desc);
  DP_RETURN_IF_ERROR(cuda_describe(a, dev, &desc));
  CUcontext ctx = nullptr;
  DP_RETURN_IF_ERROR(cuda_check(a, a.DevicePrimaryCtxRetain(&ctx, dev), "cuDevicePrimaryCtxRetain"));
  auto d = std::make_unique<CudaDevice>(&a, dev, ctx);  // owns the retain from here
  d->mutable_desc() = desc;
  int least = 0, greatest = 0;
  {
    DeviceScope scope(d.get());
    DP_RETURN_IF_ERROR(scope.status());
    DP_RETURN_IF_ERROR(cuda_check(a, a.CtxGetStreamPriorityRange(&least, &greatest), "cuCtxGetStreamPriorityRange"));
  }
  d->set_greatest_priority(greatest);
  return std::unique_ptr<Device>(std::move(d));
}

}  // namespace dp::rt
