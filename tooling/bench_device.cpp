#include "tooling/bench_device.h"

#include <cstring>

#include "tooling/bench_ptx.h"

namespace dp::tools {

DeviceBuffer::DeviceBuffer(const Driver& d, size_t bytes, const std::string& what) : d_(d), bytes_(bytes) {
  const cuda::CUresult r = d.MemAlloc(&p_, std::max<size_t>(bytes, 16));
  if (r != cuda::CUDA_SUCCESS) {
    size_t free = 0, total = 0;
    d.MemGetInfo(&free, &total);
    d.check(r, "cuMemAlloc", fmt::format("{} ({}; {} free of {})", what, human_bytes(bytes), human_bytes(free),
                                         human_bytes(total)));
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (p_) d_.MemFree(p_);
}

BenchKernels::BenchKernels(const Driver& d) : d_(d) {
  char log[8192] = {};
  cuda::CUjit_option opts[2] = {cuda::CU_JIT_ERROR_LOG_BUFFER, cuda::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
  void* values[2] = {log, reinterpret_cast<void*>(static_cast<uintptr_t>(sizeof log))};
  const cuda::CUresult r = d.ModuleLoadDataEx(&module_, kBenchPtx, 2, opts, values);
  d.check(r, "cuModuleLoadDataEx", fmt::format("the bench kernels' PTX (tooling/bench_ptx.h){}{}",
                                               log[0] ? ": " : "", log));
  d.check(d.ModuleGetFunction(&read_, module_, "dp_bench_read"), "cuModuleGetFunction", "dp_bench_read");
  d.check(d.ModuleGetFunction(&empty_, module_, "dp_bench_empty"), "cuModuleGetFunction", "dp_bench_empty");
}

BenchKernels::~BenchKernels() {
  if (module_) d_.ModuleUnload(module_);
}

void BenchKernels::read(cuda::CUstream s, CUdeviceptr src, size_t bytes, CUdeviceptr sink, unsigned blocks) const {
  uint64_t src_arg = src, n16 = bytes / 16, sink_arg = sink;
  uint32_t magic = 0x9E3779B9u;  // a thread's XOR equals it with probability 2^-32; then it writes 4 bytes
  void* params[4] = {&src_arg, &n16, &sink_arg, &magic};
  d_.check(d_.LaunchKernel(read_, blocks, 1, 1, 256, 1, 1, 0, s, params, nullptr), "cuLaunchKernel", "dp_bench_read");
}

void BenchKernels::empty(cuda::CUstream s) const {
  d_.check(d_.LaunchKernel(empty_, 1, 1, 1, 32, 1, 1, 0, s, nullptr, nullptr), "cuLaunchKernel", "dp_bench_empty");
}

EventPool::EventPool(const Driver& d, size_t n) : d_(d) {
  ev_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    cuda::CUevent e = nullptr;
    d.check(d.EventCreate(&e, 0), "cuEventCreate");
    ev_.push_back(e);
  }
}

EventPool::~EventPool() {
  for (cuda::CUevent e : ev_) d_.EventDestroy(e);
}

double EventPool::us(size_t from, size_t to) const {
  float ms = 0;
  d_.check(d_.EventElapsedTime(&ms, ev_.at(from), ev_.at(to)), "cuEventElapsedTime");
  return static_cast<double>(ms) * 1e3;
}

std::vector<double> time_graph(const Driver& d, cuda::CUstream s, const Graph& g, int replays, int warmup,
                               const EventPool& events) {
  if (static_cast<size_t>(replays) + 1 > events.size())
    fail(Errc::internal, "time_graph: {} replays need {} events, the pool has {}", replays, replays + 1, events.size());
  for (int i = 0; i < warmup; ++i) d.check(d.GraphLaunch(g.exec, s), "cuGraphLaunch");
  d.check(d.StreamSynchronize(s), "cuStreamSynchronize", "graph warm-up replays");
  d.check(d.EventRecord(events[0], s), "cuEventRecord");
  for (int i = 0; i < replays; ++i) {
    d.check(d.GraphLaunch(g.exec, s), "cuGraphLaunch");
    d.check(d.EventRecord(events[static_cast<size_t>(i) + 1], s), "cuEventRecord");
  }
  d.check(d.StreamSynchronize(s), "cuStreamSynchronize", "timed graph replays");
  std::vector<double> us;
  for (int i = 0; i < replays; ++i) us.push_back(events.us(static_cast<size_t>(i), static_cast<size_t>(i) + 1));
  return us;
}

}  // namespace dp::tools
