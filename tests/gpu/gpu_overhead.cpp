// Host overhead of libdecodepack's per-step calls on a real GPU (ctest label gpu; also a standalone
// program): dp_plan with full step metadata, the launch of one layer's program from the host (the
// final-norm program: the only per-width program bundles carry today; a layer program's launch runs
// the same path with more kernels), the prefetch fork/join pair, and dp_plan + launch together, per
// width. Prints a table and one JSON line per width; `--json FILE` also writes them to FILE.
//
// Baselines, measured the same way: the same rmsnorm code object launched straight through the driver
// (cuLaunchKernel with the same parameter block), and a bare fork/join (event record, stream wait,
// prefetch-sized launch, record, wait) through the driver: the library's own cost is the difference.
//
// Timing: wall clock around N calls (std::chrono::steady_clock), the median of R repetitions, in
// microseconds per call. Launch timings include the driver's enqueue; the stream is synchronised
// between repetitions so that the queue never fills.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "gpu_test_util.h"

using namespace dp::gputest;

namespace {

constexpr int kCalls = 200;  // per repetition: few enough that the launch queue never fills
constexpr int kReps = 51;

double median_us(CUstream stream, const std::function<void()>& call) {
  std::vector<double> per_call;
  for (int r = 0; r < kReps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < kCalls; ++i) call();
    const auto t1 = std::chrono::steady_clock::now();
    per_call.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count() / kCalls);
    cu().StreamSynchronize(stream);
  }
  std::sort(per_call.begin(), per_call.end());
  return per_call[per_call.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  std::string json_path;
  for (int i = 1; i + 1 < argc; ++i)
    if (std::strcmp(argv[i], "--json") == 0) json_path = argv[i + 1];
  if (!cu().why_not.empty()) {
    std::printf("SKIPPED: %s\n", cu().why_not.c_str());
    return 77;  // ctest SKIP_RETURN_CODE
  }
  const dp::rttest::Bundles bundles = dp::rttest::ensure_bundles();
  if (!bundles.error.empty()) {
    std::fprintf(stderr, "%s\n", bundles.error.c_str());
    return 1;
  }
  cu().CtxSetCurrent(cu().ctx);
  DeviceSession ds;
  if (std::string err = ds.open(bundles.tiny.string()); !err.empty()) {
    std::fprintf(stderr, "session: %s\n", err.c_str());
    return 1;
  }
  CUstream stream = nullptr;
  cu().StreamCreate(&stream, CU_STREAM_NON_BLOCKING);
  dp_device_desc dev;
  dp_device_desc_init(&dev);
  dp_device_query(DP_VENDOR_CUDA, 0, &dev);
  std::printf("libdecodepack %s on %s (%s, driver %d); %d calls x %d repetitions, median, microseconds per call\n",
              dp_version_string(), dev.name, dev.arch, dev.driver_version, kCalls, kReps);
  // What the library adds around each launch: one cuCtxGetCurrent (no push/pop when the host already
  // has the device's context current, as here and under PyTorch), and the C boundary itself.
  {
    CUcontext c = nullptr;
    const double get_us = median_us(stream, [&] { cu().CtxGetCurrent(&c); });
    uint32_t v = 0;
    const double abi_us = median_us(stream, [&] { dp_status_free(dp_session_error_flag(ds.s, nullptr, &v)); });
    std::printf("cuCtxGetCurrent %.3f us; a trivial dp_ call (dp_session_error_flag) %.3f us\n", get_us, abi_us);
  }
  std::printf("%5s %10s %14s %14s %16s %16s %14s %14s\n", "width", "dp_plan", "launch(norm)", "raw launch",
              "fork+join(crit)", "fork+join(next)", "raw fork+join", "plan+launch");
  CUevent ev_fork = nullptr, ev_join = nullptr;
  CUstream side = nullptr;
  cu().EventCreate(&ev_fork, CU_EVENT_DISABLE_TIMING);
  cu().EventCreate(&ev_join, CU_EVENT_DISABLE_TIMING);
  cu().StreamCreate(&side, CU_STREAM_NON_BLOCKING);

  std::vector<std::string> lines;
  bool failed = false;
  for (int32_t w : ds.widths) {
    std::vector<int32_t> q(w, 1), acc(w, 1), st(w), bt(static_cast<size_t>(w) * 16, 0);
    for (int32_t i = 0; i < w; ++i) {
      st[i] = 1 + i;
      bt[static_cast<size_t>(i) * 16] = 1 + i;
    }
    dp_step_desc d;
    dp_step_desc_init(&d);
    d.num_requests = w;
    d.query_lens = q.data();
    d.num_accepted = acc.data();
    d.state_indices = st.data();
    d.block_table = bt.data();
    d.block_table_stride = 16;
    d.block_table_cols = 16;
    d.graph_mode = DP_GRAPH_NONE;
    dp_plan_result r;
    dp_plan_result_init(&r);
    dp_plan(ds.s, &d, &r);
    if (r.reason != DP_REASON_NONE) {
      std::fprintf(stderr, "width %d: %s\n", w, r.message);
      return 1;
    }
    const size_t n = static_cast<size_t>(r.rows) * ds.hidden;
    const CUdeviceptr h = ds.alloc(n * 2), res = ds.alloc(n * 2);
    cu().MemsetD8(h, 0, n * 2);
    cu().MemsetD8(res, 0, n * 2);
    dp_final_norm_io io;
    dp_final_norm_io_init(&io);
    io.hidden = io.out = h;
    io.residual = io.residual_out = res;
    auto checked = [&](dp_status* s) {
      if (s) {
        std::fprintf(stderr, "%s\n", dp_status_message(s));
        dp_status_free(s);
        failed = true;
      }
    };
    const double plan_us = median_us(stream, [&] { checked(dp_plan(ds.s, &d, &r)); });
    const double launch_us = median_us(stream, [&] { checked(dp_launch_final_norm(ds.s, r.step, &io, stream)); });
    // The same code object, launched straight through the driver.
    const std::string cubin = dp::rttest::read_text(bundles.tiny_dir / "kernels/sm_90a" /
                                                    ("rmsnorm_w" + std::to_string(r.rows) + "_h256.sm_90a.cubin"));
    CUmodule mod = nullptr;
    CUfunction fn = nullptr;
    if (cu().ModuleLoadData(&mod, cubin.data()) != CUDA_SUCCESS ||
        cu().ModuleGetFunction(&fn, mod, ("rmsnorm_w" + std::to_string(r.rows) + "_h256").c_str()) != CUDA_SUCCESS) {
      std::fprintf(stderr, "width %d: cannot load the rmsnorm code object directly\n", w);
      return 1;
    }
    struct {
      CUdeviceptr hidden, residual, weight, out, residual_out;
      float eps;
    } params{h, res, h, h, res, ds.eps};
    size_t param_bytes = 44;
    void* extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &params, CU_LAUNCH_PARAM_BUFFER_SIZE, &param_bytes, CU_LAUNCH_PARAM_END};
    const double raw_us = median_us(stream, [&] {
      if (cu().LaunchKernel(fn, r.rows, 1, 1, 64, 1, 1, 0, stream, nullptr, extra) != CUDA_SUCCESS) failed = true;
    });
    const double raw_fork_us = median_us(stream, [&] {
      cu().EventRecord(ev_fork, stream);
      cu().StreamWaitEvent(side, ev_fork, 0);
      cu().LaunchKernel(fn, r.rows, 1, 1, 64, 1, 1, 0, side, nullptr, extra);
      cu().EventRecord(ev_join, side);
      cu().StreamWaitEvent(stream, ev_join, 0);
    });
    const bool has_critical = w >= 3;  // oproj_down tables exist from width 3
    const double crit_us = has_critical ? median_us(stream, [&] {
      checked(dp_prefetch_fork(ds.s, DP_PREFETCH_OPROJ_DOWN, 1, w, stream, nullptr));
      checked(dp_prefetch_join(ds.s, stream));
    }) : 0.0;
    const double next_us = median_us(stream, [&] {
      checked(dp_prefetch_fork(ds.s, DP_PREFETCH_NEXT_ATTENTION, 1, w, stream, nullptr));
      checked(dp_prefetch_join(ds.s, stream));
    });
    const double both_us = median_us(stream, [&] {
      checked(dp_plan(ds.s, &d, &r));
      checked(dp_launch_final_norm(ds.s, r.step, &io, stream));
    });
    std::printf("%5d %10.3f %14.3f %14.3f %16.3f %16.3f %14.3f %14.3f\n", w, plan_us, launch_us, raw_us, crit_us,
                next_us, raw_fork_us, both_us);
    char line[768];
    std::snprintf(line, sizeof(line),
                  "{\"width\": %d, \"device\": \"%s\", \"plan_us\": %.4f, \"launch_final_norm_us\": %.4f, "
                  "\"prefetch_fork_join_critical_us\": %.4f, \"prefetch_fork_join_next_attention_us\": %.4f, "
                  "\"plan_plus_launch_us\": %.4f, \"raw_driver_launch_us\": %.4f, \"raw_fork_join_us\": %.4f}",
                  w, dev.name, plan_us, launch_us, crit_us, next_us, both_us, raw_us, raw_fork_us);
    lines.push_back(line);
  }
  for (const std::string& l : lines) std::printf("%s\n", l.c_str());
  if (!json_path.empty()) {
    std::ofstream out(json_path);
    for (const std::string& l : lines) out << l << "\n";
  }
  cu().StreamSynchronize(stream);
  cu().StreamDestroy(stream);
  return failed ? 1 : 0;
}
