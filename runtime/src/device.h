// One GPU as a session uses it: the few driver operations a session needs, behind an interface so that
// the session is written once for every vendor. The CUDA implementation is complete; for HIP this
// version only describes devices (query_device), and open_device answers DP_ERR_NOT_SUPPORTED.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "decodepack/decodepack.h"
#include "src/status.h"

namespace dp::rt {

// What the driver says about a loaded kernel, to compare with the manifest at load time.
struct FunctionInfo {
  int registers = 0;       // per thread
  int max_threads = 0;     // per block this function can launch with
  int static_shared = 0;   // bytes
  int local_bytes = 0;     // per thread (stack + spills)
  bool has_param_info = false;                       // the driver reports parameter offsets
  std::vector<std::pair<size_t, size_t>> params;     // (offset, size) per parameter
};

struct LaunchSpec {
  void* function = nullptr;
  uint32_t grid[3] = {1, 1, 1};
  uint32_t block[3] = {1, 1, 1};
  uint32_t dynamic_shared = 0;
  void* stream = nullptr;
  void* params = nullptr;       // the packed parameter block ...
  size_t param_bytes = 0;       // ... of this many bytes
  bool high_priority = false;   // launch at the greatest stream priority
  bool programmatic = false;    // programmatic dependent launch: may start before the previous kernel ends
                                // (the kernel waits for it at entry; bundle format 1.3, sm_90+)
};

class Device {
 public:
  virtual ~Device() = default;
  const dp_device_desc& desc() const { return desc_; }

  // Makes the device's context current on this thread until leave(). *pushed says whether a context
  // had to be pushed (leave() pops it): a host such as PyTorch already has the device's primary
  // context current, and then the launch path makes no context call at all.
  virtual Status enter(bool* pushed) = 0;
  virtual void leave() = 0;

  virtual Status load_module(std::span<const uint8_t> image, const std::string& what, void** module) = 0;
  virtual void unload_module(void* module) = 0;
  virtual Status function(void* module, const std::string& name, const std::string& what, void** fn) = 0;
  virtual Status function_info(void* fn, const std::string& what, FunctionInfo* out) = 0;
  // Lets `fn` launch with up to `bytes` of dynamic shared memory (CUDA: beyond the default 48 KiB a
  // function must opt in before its first launch).
  virtual Status allow_dynamic_shared(void* fn, uint32_t bytes, const std::string& what) = 0;

  virtual Status alloc(size_t bytes, const std::string& what, uint64_t* out) = 0;
  virtual void free(uint64_t ptr) = 0;
  virtual Status upload(uint64_t dst, const void* src, size_t bytes, const std::string& what) = 0;
  virtual Status download(void* dst, uint64_t src, size_t bytes, const std::string& what) = 0;
  // Page-locked host memory mapped into the device's address space.
  virtual Status alloc_mapped(size_t bytes, const std::string& what, void** host, uint64_t* device) = 0;
  virtual void free_mapped(void* host) = 0;

  virtual Status create_stream(void** out) = 0;
  virtual void destroy_stream(void* s) = 0;
  virtual Status create_event(void** out) = 0;
  virtual void destroy_event(void* e) = 0;
  virtual Status record(void* event, void* stream) = 0;
  virtual Status wait(void* stream, void* event) = 0;
  virtual Status launch(const LaunchSpec& l, const char* what) = 0;

 protected:
  dp_device_desc desc_{};
};

// Fills `out` from the driver (dp_device_query).
Status query_device(int32_t vendor, int32_t ordinal, dp_device_desc* out);
Status device_count(int32_t vendor, int32_t* out);

// Opens device `ordinal` (retains its primary context).
Result<std::unique_ptr<Device>> open_device(int32_t vendor, int32_t ordinal);

// RAII enter/leave; `status()` says whether entering worked.
class DeviceScope {
 public:
  explicit DeviceScope(Device* d) : d_(d), st_(d ? d->enter(&pushed_) : Status()) {}
  ~DeviceScope() {
    if (d_ && st_.ok() && pushed_) d_->leave();
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  const Status& status() const { return st_; }

 private:
  Device* d_;
  bool pushed_ = false;
  Status st_;
};

}  // namespace dp::rt
