// Pieces the GPU subcommands (`run`, `indexer-run`) share: libdecodepack statuses as dp::Error, a
// portable random stream, and RAII holders of the driver objects they create (device memory, the
// device's primary context made current, a stream, events, graphs, a bundle + session).
#pragma once

#include <algorithm>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/error.h"
#include "common/rng.h"
#include "tooling/cuda_driver.h"
#include "decodepack/decodepack.h"

namespace dp::tools {

using cuda::CUdeviceptr;

// ---- libdecodepack status -> dp::Error ------------------------------------------------------------

inline Errc errc_of(dp_code c) {
  switch (c) {
    case DP_ERR_IO: return Errc::io;
    case DP_ERR_FORMAT_VERSION:
    case DP_ERR_FORMAT:
    case DP_ERR_NO_KERNEL: return Errc::input;
    case DP_ERR_INTEGRITY: return Errc::verify;
    case DP_ERR_RANK:
    case DP_ERR_CONFIG: return Errc::usage;
    case DP_ERR_DRIVER_UNAVAILABLE:
    case DP_ERR_DRIVER:
    case DP_ERR_NO_DEVICE:
    case DP_ERR_TARGET:
    case DP_ERR_DRIVER_VERSION:
    case DP_ERR_DEVICE_LIMITS:
    case DP_ERR_ABORTED:
    case DP_ERR_NOT_SUPPORTED: return Errc::device;
    default: return Errc::internal;  // binding/launch refusals: `run` itself got something wrong
  }
}

// Throws for a non-NULL status (and frees it), prefixing what `run` was doing.
inline void rt(dp_status* s, const std::string& doing) {
  if (!s) return;
  const dp_code code = dp_status_code(s);
  const std::string message = dp_status_message(s);
  dp_status_free(s);
  fail(errc_of(code), "{}: {} ({})", doing, message, dp_code_name(code));
}

// dp_bundle_open for a subcommand: a bundle that cannot be opened is reported with the reader's own
// message (it names the path and what is wrong), as the compiler's commands report it, and the
// matching exit code.
inline dp_bundle* open_bundle(const std::string& path) {
  dp_bundle* b = nullptr;
  if (dp_status* s = dp_bundle_open(path.c_str(), nullptr, &b)) {
    const dp_code code = dp_status_code(s);
    const std::string message = dp_status_message(s);
    dp_status_free(s);
    fail(errc_of(code), "{}", message);
  }
  return b;
}

using dp::Rng;  // common/rng.h: the inputs' random stream

inline std::string human_bytes(uint64_t b) {
  if (b >= (1ull << 30)) return fmt::format("{:.2f} GiB", static_cast<double>(b) / double(1ull << 30));
  if (b >= (1ull << 20)) return fmt::format("{:.1f} MiB", static_cast<double>(b) / double(1ull << 20));
  if (b >= (1ull << 10)) return fmt::format("{:.1f} KiB", static_cast<double>(b) / double(1ull << 10));
  return fmt::format("{} B", b);
}

// ---- device objects ---------------------------------------------------------------------------------

class DeviceMemory {
 public:
  explicit DeviceMemory(const Driver& d) : d_(d) {}
  ~DeviceMemory() {
    for (CUdeviceptr p : ptrs_) d_.MemFree(p);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;

  CUdeviceptr alloc(size_t bytes, const std::string& what) {
    CUdeviceptr p = 0;
    const cuda::CUresult r = d_.MemAlloc(&p, std::max<size_t>(bytes, 16));
    if (r != cuda::CUDA_SUCCESS) {
      size_t free = 0, total = 0;
      d_.MemGetInfo(&free, &total);
      d_.check(r, "cuMemAlloc", fmt::format("{} ({}; {} free of {}, {} allocated by run so far)", what,
                                            human_bytes(bytes), human_bytes(free), human_bytes(total),
                                            human_bytes(total_)));
    }
    ptrs_.push_back(p);
    total_ += bytes;
    return p;
  }
  uint64_t total() const { return total_; }

 private:
  const Driver& d_;
  std::vector<CUdeviceptr> ptrs_;
  uint64_t total_ = 0;
};

// The primary context of the device, current on this thread (the one libdecodepack's session uses).
class Context {
 public:
  Context(const Driver& d, int ordinal) : d_(d) {
    int count = 0;
    d.check(d.DeviceGetCount(&count), "cuDeviceGetCount");
    if (count == 0) fail(Errc::device, "no CUDA device visible (cuDeviceGetCount: 0)");
    if (ordinal < 0 || ordinal >= count)
      fail(Errc::device, "--device {}: this host has {} CUDA device{} (ordinals 0..{})", ordinal, count,
           count == 1 ? "" : "s", count - 1);
    d.check(d.DeviceGet(&dev_, ordinal), "cuDeviceGet");
    char name[256] = {};
    d.check(d.DeviceGetName(name, sizeof name, dev_), "cuDeviceGetName");
    name_ = name;
    d.check(d.DevicePrimaryCtxRetain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
    d.check(d.CtxSetCurrent(ctx_), "cuCtxSetCurrent");
  }
  ~Context() {
    if (ctx_) d_.DevicePrimaryCtxRelease(dev_);
  }
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  const std::string& name() const { return name_; }

 private:
  const Driver& d_;
  cuda::CUdevice dev_ = 0;
  cuda::CUcontext ctx_ = nullptr;
  std::string name_;
};

struct Stream {
  const Driver& d;
  cuda::CUstream s = nullptr;
  explicit Stream(const Driver& drv) : d(drv) { d.check(d.StreamCreate(&s, cuda::CU_STREAM_NON_BLOCKING), "cuStreamCreate"); }
  ~Stream() {
    if (s) d.StreamDestroy(s);
  }
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;
};

struct Event {
  const Driver& d;
  cuda::CUevent e = nullptr;
  explicit Event(const Driver& drv) : d(drv) { d.check(d.EventCreate(&e, 0), "cuEventCreate"); }
  ~Event() {
    if (e) d.EventDestroy(e);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

struct Graph {
  const Driver& d;
  cuda::CUgraph g = nullptr;
  cuda::CUgraphExec exec = nullptr;
  explicit Graph(const Driver& drv) : d(drv) {}
  ~Graph() {
    if (exec) d.GraphExecDestroy(exec);
    if (g) d.GraphDestroy(g);
  }
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
};

struct SessionHandle {
  dp_bundle* b = nullptr;
  dp_session* s = nullptr;
  ~SessionHandle() {
    dp_session_destroy(s);
    dp_bundle_close(b);
  }
};

}  // namespace dp::tools
