// The inside of `decodepack bench` (bench.h says what a run measures), shared by its three files:
// bench.cpp (the run: ceiling, launch floor, widths, whole steps and layer classes), bench_kernels.cpp
// (one layer kernel by kernel through the launch observer) and bench_prefetch.cpp (the prefetch sweep).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "bench/bytes.h"
#include "bench/result.h"
#include "common/dtype.h"
#include "format/manifest.h"
#include "tooling/bench.h"
#include "tooling/bench_device.h"
#include "tooling/harness.h"

namespace dp::tools::bench_detail {

inline constexpr int kCeilingPasses = 15;
inline constexpr int kFloorKernels = 64;
inline constexpr int kFloorReps = 10;
inline constexpr int kWarmup = 3;
inline constexpr size_t kMaxKernelsPerLayer = 64;
// Events of the prefetch launches in the sequence: 2 per point (before, after), after the kernels'.
inline constexpr size_t kPrefetchEvents = kMaxKernelsPerLayer + 1;
inline constexpr int kPrefetchPoints = static_cast<int>(format::kPrefetchPoints.size());  // dp_prefetch_point
inline std::string point_name(int p) { return std::string(format::kPrefetchPoints[static_cast<size_t>(p)]); }
// next_attention caps the sweep tries below the bundle's (bytes per table).
inline constexpr uint64_t kSweepCaps[] = {uint64_t{2} << 20, uint64_t{4} << 20, uint64_t{8} << 20, uint64_t{16} << 20};
inline constexpr int kSweepRounds = 5;

// What the launch observer does around each kernel of one layer (dp_session_set_launch_observer).
//   isolated: before kernel i an L2 flush (a read stream over a few times the L2) and event 2i, after
//             it event 2i+1: the kernel alone, L2-cold;
//   sequence: after kernel i event i+1 (the caller records event 0 before the layer), as an event node
//             when `capturing`: the layer's own sequence, gaps included.
struct Observer {
  enum class Mode { off, isolated, sequence };
  Mode mode = Mode::off;
  bool capturing = false;
  int layer = -1;
  const Driver* d = nullptr;
  const BenchKernels* kernels = nullptr;
  const EventPool* events = nullptr;
  CUdeviceptr flush = 0, sink = 0;
  size_t flush_bytes = 0;
  unsigned blocks = 0;
  std::vector<std::string> names;  // kernel names by program index, as the runtime reported them
  int last_done = -1;              // the last kernel launched (sequence mode)
  std::array<int, kPrefetchPoints> prefetch_after{-1, -1, -1, -1};  // per point launched: the kernel before it
  std::array<bool, kPrefetchPoints> prefetch_seen{};
  std::string error;               // the first failure inside the callback (it must not throw)
  // dp_launch_observer: events around kernels and prefetch launches as `mode` says (bench_kernels.cpp).
  static void call(void* user, int32_t layer, int32_t index, const char* kernel, int32_t after, dp_stream stream);
};

inline int64_t bytes_per_elem(DType t) { return static_cast<int64_t>(dtype_size(t)); }

class Bench {
 public:
  explicit Bench(const BenchOptions& o) : o_(o), ro_(o.run) {}
  bench::BenchResult run();

 private:
  void log(const std::string& s) const {
    if (o_.run.log) o_.run.log(s);
  }
  void measure_ceiling();
  void measure_launch_floor();
  void measure_width(int width);
  void sweep_prefetch(int width, const dp_step* step);
  uint64_t prefetch_bytes(int point, int width, uint64_t cap, int layer) const;
  bench::StepTraffic traffic(int layer) const;
  bench::KernelBreakdown breakdown(const std::string& cls, int layer, int width, double layer_us);
  double ceiling() const { return res_.ceiling.bytes_per_s(); }

  const BenchOptions& o_;
  RunOptions ro_;
  RunResult rr_;
  bench::BenchResult res_;
  bench::CacheElems elems_;
  unsigned blocks_ = 0;  // grid of the read stream: 8 blocks of 256 threads per SM

  // Destroyed in reverse: device objects first, then the harness (session, memory, context).
  std::unique_ptr<Harness> h_;
  std::unique_ptr<BenchKernels> kernels_;
  std::unique_ptr<EventPool> events_;
  std::unique_ptr<DeviceBuffer> sink_, flush_;
};

}  // namespace dp::tools::bench_detail
