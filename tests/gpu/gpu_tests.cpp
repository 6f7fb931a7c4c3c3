// GPU tests of libdecodepack (ctest label gpu): a real bundle on the device, random weights, the final
// norm kernel eager and under CUDA-graph capture and replay against the CPU reference, prefetch
// fork/join inside a captured graph, the error flag written by the device. On a host without a
// driver or GPU every test skips with the reason.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "gpu_test_util.h"

namespace dp::gputest {
namespace {

const rttest::Bundles& bundles() {
  static const rttest::Bundles b = rttest::ensure_bundles();
  return b;
}

class Gpu : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cu().why_not.empty()) GTEST_SKIP() << "GPU test skipped: " << cu().why_not;
    ASSERT_TRUE(bundles().error.empty()) << bundles().error;
    CU_OK(cu().CtxSetCurrent(cu().ctx));
    CU_OK(cu().StreamCreate(&stream_, CU_STREAM_NON_BLOCKING));
  }
  void TearDown() override {
    if (stream_) cu().StreamDestroy(stream_);
  }

  // Uploads random rows, runs `launch` (which enqueues on stream_), and compares the outputs with the
  // CPU reference. Aliasing as vLLM does: out = hidden, residual_out = residual.
  struct Buffers {
    CUdeviceptr hidden = 0, residual = 0;
    std::vector<uint16_t> h, r;
  };
  Buffers upload(DeviceSession& ds, int rows, std::mt19937& rng, bool with_residual) {
    Buffers b;
    const size_t n = static_cast<size_t>(rows) * ds.hidden;
    b.h = random_bf16(n, rng, -2.f, 2.f);
    b.hidden = ds.alloc(n * 2);
    cu().MemcpyHtoD(b.hidden, b.h.data(), n * 2);
    if (with_residual) {
      b.r = random_bf16(n, rng, -2.f, 2.f);
    } else {
      b.r.assign(n, 0x7fc0);  // poison (NaN): without a residual the kernel must not read it
    }
    b.residual = ds.alloc(n * 2);
    cu().MemcpyHtoD(b.residual, b.r.data(), n * 2);
    return b;
  }
  void check(DeviceSession& ds, const Buffers& b, int rows, bool with_residual, const char* what) {
    const size_t n = static_cast<size_t>(rows) * ds.hidden;
    std::vector<uint16_t> out(n), res(n), ref_out, ref_res;
    CU_OK(cu().MemcpyDtoH(out.data(), b.hidden, n * 2));
    CU_OK(cu().MemcpyDtoH(res.data(), b.residual, n * 2));
    final_norm_reference(b.h, with_residual ? &b.r : nullptr, ds.norm_weight, rows, ds.hidden, ds.eps, ref_out, ref_res);
    size_t off_by_one = 0;
    for (size_t i = 0; i < n; ++i) {
      ASSERT_EQ(res[i], ref_res[i]) << what << ": residual_out[" << i << "] (row " << i / ds.hidden << ")";
      const float g = from_bf16(out[i]), e = from_bf16(ref_out[i]);
      // Two bf16 roundings around a fast rsqrt: allow 2 units in the last place (2^-6 relative).
      ASSERT_LE(std::fabs(g - e), std::ldexp(std::fabs(e), -6) + 1e-6f)
          << what << ": out[" << i << "] (row " << i / ds.hidden << ") " << g << " vs reference " << e;
      off_by_one += out[i] != ref_out[i];
    }
    EXPECT_LE(off_by_one, n / 50) << what << ": " << off_by_one << " of " << n << " outputs differ by rounding";
  }

  CUstream stream_ = nullptr;
};

TEST_F(Gpu, DeviceQueryAndValidity) {
  dp_device_desc d;
  dp_device_desc_init(&d);
  DP_EXPECT_OK(dp_device_query(DP_VENDOR_CUDA, 0, &d));
  std::printf("device 0: %s, %s, driver %d, %d SMs, L2 %lld bytes\n", d.name, d.arch, d.driver_version,
              d.multiprocessors, static_cast<long long>(d.l2_bytes));
  EXPECT_EQ(std::string(d.arch).rfind("sm_", 0), 0u);
  EXPECT_GT(d.driver_version, 0);
  EXPECT_GT(d.max_threads_per_block, 0);
  dp_bundle* b = nullptr;
  DP_EXPECT_OK(dp_bundle_open(bundles().tiny.c_str(), nullptr, &b));
  const rttest::Outcome v = outcome(dp_bundle_query_validity(b, &d, 0));
  if (std::string(d.arch) == "sm_90") EXPECT_TRUE(v.ok()) << v.message;
  else std::printf("validity on %s: %s\n", d.arch, v.ok() ? "ok" : v.message.c_str());
  int32_t n = 0;
  DP_EXPECT_OK(dp_device_count(DP_VENDOR_CUDA, &n));
  EXPECT_GE(n, 1);
  DP_EXPECT_STATUS(dp_device_query(DP_VENDOR_CUDA, 9999, &d), DP_ERR_NO_DEVICE, "CUDA device 9999: no such device");
  dp_bundle_close(b);
}

TEST_F(Gpu, LoadOrderIsEnforced) {
  dp_bundle* b = nullptr;
  DP_EXPECT_OK(dp_bundle_open(bundles().tiny.c_str(), nullptr, &b));
  dp_session_options o;
  dp_session_options_init(&o);
  dp_session* s = nullptr;
  DP_EXPECT_OK(dp_session_create(b, &o, &s));
  EXPECT_STREQ(dp_session_target(s), "sm_90a");
  DP_EXPECT_STATUS(dp_session_load_kernels(s), DP_ERR_STATE, "before dp_session_finalize_weights");
  ASSERT_TRUE(rttest::bind_all_weights(b, s, 0).ok());  // fake addresses: nothing below dereferences them
  DP_EXPECT_OK(dp_session_finalize_weights(s));
  dp_step_desc d;
  dp_step_desc_init(&d);
  d.num_requests = 1;
  dp_plan_result r;
  dp_plan_result_init(&r);
  DP_EXPECT_STATUS(dp_plan(s, &d, &r), DP_ERR_STATE, "before dp_session_load_kernels");
  dp_session_destroy(s);
  dp_bundle_close(b);
}

TEST_F(Gpu, FinalNormEagerEveryWidth) {
  DeviceSession ds;
  const std::string err = ds.open(bundles().tiny.string());
  ASSERT_TRUE(err.empty()) << err;
  std::mt19937 rng(7);
  for (int32_t w : ds.widths) {
    for (bool with_residual : {true, false}) {
      SCOPED_TRACE("width " + std::to_string(w) + (with_residual ? "" : " without residual"));
      const dp_plan_result p = ds.plan(w);
      ASSERT_TRUE(ds.last_plan.ok()) << ds.last_plan.message;
      ASSERT_EQ(p.reason, DP_REASON_NONE) << p.message;
      ASSERT_EQ(p.width, w);
      Buffers b = upload(ds, p.rows, rng, with_residual);
      dp_final_norm_io io;
      dp_final_norm_io_init(&io);
      io.hidden = io.out = b.hidden;  // in place, as vLLM calls it
      io.residual = with_residual ? b.residual : 0;
      io.residual_out = b.residual;
      DP_EXPECT_OK(dp_launch_final_norm(ds.s, p.step, &io, stream_));
      CU_OK(cu().StreamSynchronize(stream_));
      check(ds, b, p.rows, with_residual, "eager");
    }
  }
  DP_EXPECT_OK(dp_after_step(ds.s));
}

TEST_F(Gpu, FinalNormSeparateOutputs) {
  DeviceSession ds;
  const std::string err = ds.open(bundles().tiny.string());
  ASSERT_TRUE(err.empty()) << err;
  std::mt19937 rng(8);
  const dp_plan_result p = ds.plan(3);
  ASSERT_EQ(p.reason, DP_REASON_NONE) << p.message;
  Buffers in = upload(ds, p.rows, rng, true);
  const size_t n = static_cast<size_t>(p.rows) * ds.hidden;
  const CUdeviceptr out = ds.alloc(n * 2), res = ds.alloc(n * 2);
  dp_final_norm_io io;
  dp_final_norm_io_init(&io);
  io.hidden = in.hidden;
  io.residual = in.residual;
  io.out = out;
  io.residual_out = res;
  DP_EXPECT_OK(dp_launch_final_norm(ds.s, p.step, &io, stream_));
  CU_OK(cu().StreamSynchronize(stream_));
  Buffers o{out, res, in.h, in.r};
  check(ds, o, p.rows, true, "separate outputs");
  // The call's own arguments are the only thing checked at launch.
  io.out = out + 8;
  DP_EXPECT_STATUS(dp_launch_final_norm(ds.s, p.step, &io, stream_), DP_ERR_ALIGNMENT, "out", "not a multiple of 16");
  io.out = 0;
  DP_EXPECT_STATUS(dp_launch_final_norm(ds.s, p.step, &io, stream_), DP_ERR_INVALID_ARGUMENT, "out is 0");
}

TEST_F(Gpu, FinalNormCapturedAndReplayed) {
  DeviceSession ds;
  const std::string err = ds.open(bundles().tiny.string());
  ASSERT_TRUE(err.empty()) << err;
  std::mt19937 rng(9);
  for (int32_t w : {1, 4, 8}) {
    SCOPED_TRACE("width " + std::to_string(w));
    // vLLM plans at capture only; the plan is baked into the graph.
    const dp_plan_result p = ds.plan(w, DP_GRAPH_FULL);
    ASSERT_EQ(p.reason, DP_REASON_NONE) << p.message;
    Buffers b = upload(ds, p.rows, rng, true);
    dp_final_norm_io io;
    dp_final_norm_io_init(&io);
    io.hidden = io.out = b.hidden;
    io.residual = io.residual_out = b.residual;
    CU_OK(cu().StreamBeginCapture(stream_, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    const rttest::Outcome launched = outcome(dp_launch_final_norm(ds.s, p.step, &io, stream_));
    CUgraph graph = nullptr;
    CU_OK(cu().StreamEndCapture(stream_, &graph));
    ASSERT_TRUE(launched.ok()) << launched.message;
    CUgraphExec exec = nullptr;
    CU_OK(cu().GraphInstantiate(&exec, graph, 0));
    // Replay three times with new inputs each time: the graph reads the buffers at replay.
    for (int replay = 0; replay < 3; ++replay) {
      b.h = random_bf16(b.h.size(), rng, -2.f, 2.f);
      b.r = random_bf16(b.r.size(), rng, -2.f, 2.f);
      CU_OK(cu().MemcpyHtoD(b.hidden, b.h.data(), b.h.size() * 2));
      CU_OK(cu().MemcpyHtoD(b.residual, b.r.data(), b.r.size() * 2));
      CU_OK(cu().GraphLaunch(exec, stream_));
      CU_OK(cu().StreamSynchronize(stream_));
      check(ds, b, p.rows, true, "graph replay");
    }
    cu().GraphExecDestroy(exec);
    cu().GraphDestroy(graph);
  }
}

TEST_F(Gpu, PrefetchForkJoinEager) {
  DeviceSession ds;
  const std::string err = ds.open(bundles().tiny.string());
  ASSERT_TRUE(err.empty()) << err;
  int32_t launched = -1;
  // next_attention of layer 1 exists at every width; oproj_down (critical: priority + carveout) at 3..8.
  DP_EXPECT_OK(dp_prefetch_fork(ds.s, DP_PREFETCH_NEXT_ATTENTION, 1, 2, stream_, &launched));
  EXPECT_EQ(launched, 1);
  DP_EXPECT_OK(dp_prefetch_fork(ds.s, DP_PREFETCH_OPROJ_DOWN, 1, 4, stream_, &launched));
  EXPECT_EQ(launched, 1);
  DP_EXPECT_OK(dp_prefetch_fork(ds.s, DP_PREFETCH_OPROJ_DOWN, 1, 1, stream_, &launched));
  EXPECT_EQ(launched, 0);  // no table below width 3
  DP_EXPECT_OK(dp_prefetch_fork(ds.s, DP_PREFETCH_ATTENTION_MOE, 1, 8, stream_, &launched));
  EXPECT_EQ(launched, 0);  // TP 8 only
  DP_EXPECT_OK(dp_prefetch_join(ds.s, stream_));
  DP_EXPECT_OK(dp_prefetch_join(ds.s, stream_));  // nothing pending: no-op
  CU_OK(cu().StreamSynchronize(stream_));
  CU_OK(cu().CtxSynchronize());  // the side stream's kernels finished without a fault
}

TEST_F(Gpu, PrefetchInsideACapturedGraph) {
  DeviceSession ds;
  const std::string err = ds.open(bundles().tiny.string());
  ASSERT_TRUE(err.empty()) << err;
  std::mt19937 rng(10);
  const dp_plan_result p = ds.plan(4, DP_GRAPH_FULL);
  ASSERT_EQ(p.reason, DP_REASON_NONE) << p.message;
  Buffers b = upload(ds, p.rows, rng, true);
  dp_final_norm_io io;
  dp_final_norm_io_init(&io);
  io.hidden = io.out = b.hidden;
  io.residual = io.residual_out = b.residual;

  CU_OK(cu().StreamBeginCapture(stream_, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
  int32_t l1 = 0, l2 = 0;
  const rttest::Outcome f1 = outcome(dp_prefetch_fork(ds.s, DP_PREFETCH_OPROJ_DOWN, 1, 4, stream_, &l1));
  const rttest::Outcome f2 = outcome(dp_prefetch_fork(ds.s, DP_PREFETCH_NEXT_ATTENTION, 2, 4, stream_, &l2));
  const rttest::Outcome n = outcome(dp_launch_final_norm(ds.s, p.step, &io, stream_));
  const rttest::Outcome j = outcome(dp_prefetch_join(ds.s, stream_));
  CUgraph graph = nullptr;
  // Ending the capture fails (CUDA_ERROR_STREAM_CAPTURE_UNJOINED) unless join brought the side stream back.
  const int end = cu().StreamEndCapture(stream_, &graph);
  ASSERT_TRUE(f1.ok()) << f1.message;
  ASSERT_TRUE(f2.ok()) << f2.message;
  ASSERT_TRUE(n.ok()) << n.message;
  ASSERT_TRUE(j.ok()) << j.message;
  EXPECT_EQ(l1, 1);
  EXPECT_EQ(l2, 1);
  ASSERT_EQ(end, CUDA_SUCCESS) << cu().name(end);
  CUgraphExec exec = nullptr;
  CU_OK(cu().GraphInstantiate(&exec, graph, 0));
  for (int replay = 0; replay < 2; ++replay) {
    b.h = random_bf16(b.h.size(), rng, -2.f, 2.f);
    CU_OK(cu().MemcpyHtoD(b.hidden, b.h.data(), b.h.size() * 2));
    CU_OK(cu().MemcpyHtoD(b.residual, b.r.data(), b.r.size() * 2));
    CU_OK(cu().GraphLaunch(exec, stream_));
    CU_OK(cu().StreamSynchronize(stream_));
    check(ds, b, p.rows, true, "replay with prefetch");
  }
  cu().GraphExecDestroy(exec);
  cu().GraphDestroy(graph);
}

TEST_F(Gpu, PrefetchOffLaunchesNothing) {
  DeviceSession ds;
  const std::string err = ds.open(bundles().tiny.string(), DP_SESSION_NO_PREFETCH);
  ASSERT_TRUE(err.empty()) << err;
  int32_t launched = -1;
  DP_EXPECT_OK(dp_prefetch_fork(ds.s, DP_PREFETCH_NEXT_ATTENTION, 1, 2, stream_, &launched));
  EXPECT_EQ(launched, 0);
  DP_EXPECT_OK(dp_prefetch_join(ds.s, stream_));
}

TEST_F(Gpu, ErrorFlagWrittenByTheDevice) {
  DeviceSession ds;
  const std::string err = ds.open(bundles().tiny.string());
  ASSERT_TRUE(err.empty()) << err;
  uint64_t addr = 0;
  uint32_t value = 1;
  DP_EXPECT_OK(dp_session_error_flag(ds.s, &addr, &value));
  ASSERT_NE(addr, 0u);
  EXPECT_EQ(value, 0u);
  DP_EXPECT_OK(dp_after_step(ds.s));
  // What a layer program's kernel does when it gives up a wait in layer 2: a device-side write.
  CU_OK(cu().MemsetD32Async(addr, DP_FLAG_WAIT_TIMEOUT | (3u << 16), 1, stream_));
  CU_OK(cu().StreamSynchronize(stream_));
  DP_EXPECT_STATUS(dp_after_step(ds.s), DP_ERR_ABORTED, "error flag 0x00030001", "first in layer 2");
}

TEST_F(Gpu, WeightsAgainstFingerprints) {
  const auto checkpoint = read_checkpoint(bundles().model);
  ASSERT_FALSE(checkpoint.empty()) << "no safetensors in " << bundles().model;
  DeviceSession ds;
  const std::string err = ds.open(bundles().tiny.string(), 0, &checkpoint);
  ASSERT_TRUE(err.empty()) << err;
  DP_EXPECT_OK(dp_session_verify_weights(ds.s));  // the checkpoint the bundle was built from
  // One expert of one group altered on the device: named in the refusal.
  const std::string victim = "model.layers.2.block_sparse_moe.experts.5.w2.weight";
  ASSERT_EQ(ds.bound.count(victim), 1u);
  CU_OK(cu().MemsetD8(ds.bound[victim], 0xAB, 16));
  DP_EXPECT_STATUS(dp_session_verify_weights(ds.s), DP_ERR_INTEGRITY, "1 of 221 weight shards differ",
                   "model.layers.2.block_sparse_moe.experts.{e}.w2.weight (expert 5)");
  DeviceSession other;  // random weights (no checkpoint): everything differs but the final norm
  const std::string err2 = other.open(bundles().tiny.string());
  ASSERT_TRUE(err2.empty()) << err2;
  DP_EXPECT_STATUS(dp_session_verify_weights(other.s), DP_ERR_INTEGRITY, "weight shards differ from the bundle's fingerprints",
                   "model.layers.0.input_layernorm.weight", "and");
  dp_bundle* nofp = nullptr;
  DP_EXPECT_OK(dp_bundle_open(bundles().spec.c_str(), nullptr, &nofp));
  dp_session_options o;
  dp_session_options_init(&o);
  o.num_speculative_tokens = 1;
  dp_session* s = nullptr;
  DP_EXPECT_OK(dp_session_create(nofp, &o, &s));
  ASSERT_TRUE(rttest::bind_all_weights(nofp, s, 0).ok());
  DP_EXPECT_OK(dp_session_finalize_weights(s));
  DP_EXPECT_STATUS(dp_session_verify_weights(s), DP_ERR_NOT_SUPPORTED, "no weight fingerprints");
  dp_session_destroy(s);
  dp_bundle_close(nofp);
}

TEST_F(Gpu, LayerWithoutProgram) {
  DeviceSession ds;
  // The spec bundle's deploy has no program for any class (KDA state layout "vk", an fp8 MLA cache):
  // every layer says why.
  const std::string err = ds.open(bundles().spec.string());
  ASSERT_TRUE(err.empty()) << err;
  const dp_plan_result p = ds.plan(2, DP_GRAPH_NONE, /*rows=*/2);
  ASSERT_EQ(p.reason, DP_REASON_NONE) << p.message;
  int32_t without = 0;
  for (int32_t l = 0; l < ds.num_layers; ++l) without += dp_step_layer_kernel(p.step, l) == 0;
  ASSERT_EQ(without, ds.num_layers);
  for (int32_t l = 0; l < ds.num_layers; ++l) {
    dp_layer_io io;
    dp_layer_io_init(&io);
    io.hidden = io.out = io.residual = io.residual_out = ds.alloc(4096);
    DP_EXPECT_STATUS(dp_launch_layer(ds.s, p.step, l, &io, stream_), DP_ERR_NO_KERNEL, "the host runs its own layer",
                     "the build made no program: k");  // "kda_state.layout" or "kv_cache.dtype fp8"
  }
}

}  // namespace
}  // namespace dp::gputest
