#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "bench/result.h"
#include "../test_util.h"

namespace dp::bench {
namespace {

TEST(BenchSummary, PercentilesInterpolateBetweenOrderStatistics) {
  const Summary s = Summary::of({5, 1, 3, 2, 4, 6, 7, 8, 9, 10, 11});
  EXPECT_EQ(s.n, 11);
  EXPECT_DOUBLE_EQ(s.median, 6);
  EXPECT_DOUBLE_EQ(s.p10, 2);
  EXPECT_DOUBLE_EQ(s.p90, 10);
  EXPECT_DOUBLE_EQ(s.min, 1);
  EXPECT_DOUBLE_EQ(s.max, 11);
  EXPECT_DOUBLE_EQ(s.mean, 6);
  const Summary two = Summary::of({1, 2});
  EXPECT_DOUBLE_EQ(two.median, 1.5);
  EXPECT_DOUBLE_EQ(two.p10, 1.1);
  EXPECT_EQ(Summary::of({}).n, 0);
}

TEST(BenchSummary, ShareOfTheCeiling) {
  // 4.49 GB in 1 ms is 4.49 TB/s: all of a 4.49 TB/s ceiling.
  EXPECT_DOUBLE_EQ(share_of(4'490'000'000ull, 1000.0, 4.49e12), 1.0);
  EXPECT_DOUBLE_EQ(share_of(1000, 0, 4.49e12), 0);
  EXPECT_DOUBLE_EQ(share_of(1000, 1, 0), 0);
}

Bytes some_bytes(uint64_t scale) {
  Bytes b;
  b.dense_weights = 80'000'000 * scale;
  b.expert_weights = 113'246'208 * scale;
  b.state_read = 2'170'880 * scale;
  b.state_write = 2'170'880 * scale;
  b.act_read = 9216;
  b.act_write = 9216;
  return b;
}

// A result with every kind of entry: the golden file tests/bench/bench-result-sample.json is this
// result as `bench --json` writes it, and the Python tests check that file against the schema and
// draw it with bench/chart.py.
BenchResult sample_result() {
  BenchResult r;
  r.version = "0.1.0";
  r.bundle = "bench-48b.dpk";
  r.digest = "sha256:0000000000000000000000000000000000000000000000000000000000000000";
  r.model = "bench/configs/kimi-linear-48b-shaped-bench.json";
  r.weights = "random (the synth fill of seed 0)";
  r.device = "NVIDIA H200 (device 0, CUDA driver 13.0)";
  r.target = "sm_90a";
  r.context = 4096;
  r.replays = 100;
  r.l2_bytes = 62'914'560;
  r.sms = 132;
  r.ceiling.method = "read-only stream, 16-byte loads";
  r.ceiling.bytes = 4ull << 30;
  r.ceiling.us = Summary::of({960, 956, 958, 962, 957});
  r.launch_floor = {32, 0.52, 1.9};
  r.widths = {1, 8};
  r.gate = {{1, 40, 0, {}}, {8, 40, 1, {"layer 5 (mla_moe) hidden: 2.1e-02 >= 1e-02"}}};
  for (int w : {1, 8}) {
    ClassResult c;
    c.cls = "kda_moe";
    c.width = w;
    c.layers = {2, 3};
    c.routed_experts = {8 * w - (w > 1), 8 * w};
    c.us_per_layer = Summary::of({100.0 * w, 101.0 * w, 99.0 * w});
    c.bytes = some_bytes(2);
    c.replay_bytes = c.bytes.total();
    c.share = share_of(c.bytes.total(), c.us_per_layer.median * 2, 4.49e12);
    r.classes.push_back(c);
    ClassResult f;
    f.cls = "mla_moe";
    f.width = w;
    f.layers = {5};
    if (w == 8) {
      f.status = "failed";
      f.reason = "the correctness gate failed: layer 5 hidden";
    } else {
      f.us_per_layer = Summary::of({150, 151});
      f.bytes = some_bytes(1);
      f.replay_bytes = f.bytes.total();
      f.share = share_of(f.bytes.total(), 150.5, 4.49e12);
    }
    r.classes.push_back(f);
    StepResult s;
    s.width = w;
    s.layers = 3;
    if (w == 8) {
      s.status = "failed";
      s.reason = "the correctness gate failed";
    } else {
      s.us = Summary::of({400, 402, 399});
      s.bytes = some_bytes(3);
      s.share = share_of(s.bytes.total(), 400, 4.49e12);
      s.tokens_per_s_per_request = 1e6 / 400;
      s.tokens_per_s = 1e6 / 400;
    }
    r.steps.push_back(s);
  }
  KernelBreakdown k;
  k.cls = "kda_moe";
  k.width = 1;
  k.layer = 2;
  k.sequence_mode = "graph";
  k.layer_us = 100;
  for (int i = 0; i < 2; ++i) {
    KernelLaunch l;
    l.index = i;
    l.kernel = i == 0 ? "rmsnorm_w1_h2304" : "moe_down_w1_d2304_i1024_e256_k8_s1024";
    l.op = i == 0 ? "rmsnorm" : "moe_down";
    l.isolated_us = Summary::of({5.0 + 40 * i, 5.2 + 40 * i});
    l.sequence_us = Summary::of({6.0 + 40 * i, 6.1 + 40 * i});
    l.gap_us = l.sequence_us.median - l.isolated_us.median;
    l.bytes = some_bytes(i);
    l.share = share_of(l.bytes.total(), l.isolated_us.median, 4.49e12);
    k.sum_isolated_us += l.isolated_us.median;
    k.sum_sequence_us += l.sequence_us.median;
    k.launches.push_back(l);
  }
  r.kernels.push_back(k);
  KernelBreakdown bad;
  bad.cls = "mla_moe";
  bad.width = 1;
  bad.layer = 5;
  bad.status = "error";
  bad.reason = "cuEventElapsedTime failed: CUDA_ERROR_INVALID_HANDLE (400)";
  r.kernels.push_back(bad);
  r.notes.push_back("MoE bytes count the routing of the checked step");
  return r;
}

TEST(BenchResult, JsonMatchesTheGoldenSample) {
  const std::string got = to_json(sample_result()).dump(2) + "\n";
  const auto path = test::data_dir() / "bench" / "bench-result-sample.json";
  if (std::getenv("UPDATE_GOLDEN")) {
    std::ofstream(path) << got;
    GTEST_SKIP() << "rewrote " << path;
  }
  std::ifstream in(path);
  ASSERT_TRUE(in) << "missing " << path << " (UPDATE_GOLDEN=1 writes it)";
  std::stringstream want;
  want << in.rdbuf();
  EXPECT_EQ(got, want.str()) << "UPDATE_GOLDEN=1 rewrites " << path << " (review the diff)";
}

TEST(BenchResult, TableShowsEveryPart) {
  const std::string t = to_text(sample_result());
  for (const char* frag : {"ceiling", "TB/s", "launch floor", "gate           width 8: 40 checks, 1 failed",
                           "FAIL layer 5 (mla_moe)", "kda_moe", "failed: the correctness gate failed: layer 5 hidden",
                           "whole step", "kernels of layer 2 (kda_moe), width 1", "moe_down_w1",
                           "kernels of layer 5 (mla_moe), width 1: error: cuEventElapsedTime", "note: MoE bytes"})
    EXPECT_NE(t.find(frag), std::string::npos) << frag << "\n" << t;
}

}  // namespace
}  // namespace dp::bench
