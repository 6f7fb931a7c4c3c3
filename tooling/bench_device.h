// Device helpers of `decodepack bench`: its own kernels (bench_ptx.h) loaded through the driver, a device
// buffer, and event-timed replays of a CUDA graph.
#pragma once

#include <string>
#include <vector>

#include "tooling/device.h"

namespace dp::tools {

// One device allocation, freed with the object.
class DeviceBuffer {
 public:
  DeviceBuffer(const Driver& d, size_t bytes, const std::string& what);
  ~DeviceBuffer();
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  CUdeviceptr ptr() const { return p_; }
  size_t bytes() const { return bytes_; }

 private:
  const Driver& d_;
  CUdeviceptr p_ = 0;
  size_t bytes_ = 0;
};

// The bench kernels, compiled by the driver for the current context's device.
class BenchKernels {
 public:
  explicit BenchKernels(const Driver& d);
  ~BenchKernels();
  BenchKernels(const BenchKernels&) = delete;
  BenchKernels& operator=(const BenchKernels&) = delete;

  // dp_bench_read over `bytes` (a multiple of 16) at `src`: grid `blocks` x 256 threads.
  void read(cuda::CUstream s, CUdeviceptr src, size_t bytes, CUdeviceptr sink, unsigned blocks) const;
  void empty(cuda::CUstream s) const;

 private:
  const Driver& d_;
  cuda::CUmodule module_ = nullptr;
  cuda::CUfunction read_ = nullptr, empty_ = nullptr;
};

// A pool of timing events (created once, reused by every measurement).
class EventPool {
 public:
  EventPool(const Driver& d, size_t n);
  ~EventPool();
  EventPool(const EventPool&) = delete;
  EventPool& operator=(const EventPool&) = delete;
  cuda::CUevent operator[](size_t i) const { return ev_.at(i); }
  size_t size() const { return ev_.size(); }
  // Milliseconds between two recorded events, in microseconds.
  double us(size_t from, size_t to) const;

 private:
  const Driver& d_;
  std::vector<cuda::CUevent> ev_;
};

// `replays` launches of `g` back to back on `s` (after `warmup` untimed ones), an event between
// consecutive launches: each replay's device time in µs (it includes the graph's launch on the device).
std::vector<double> time_graph(const Driver& d, cuda::CUstream s, const Graph& g, int replays, int warmup,
                               const EventPool& events);

}  // namespace dp::tools
