// Step planning on host-only sessions against real bundles: a table of step cases per reason code,
// widths and padding, the tensor-parallel verdict, the error flag and after_step, and the launch
// functions' answers where no device or no layer program exists.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include <algorithm>
#include <functional>
#include <stdexcept>

#include <fmt/format.h>

#include <nlohmann/json.hpp>

#include "runtime_test_util.h"

namespace dp::rttest {
namespace {

const Bundles& bundles() {
  static const Bundles b = ensure_bundles();
  return b;
}

constexpr int64_t kSlots = 64, kBlocks = 32;

class PlanningTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!bundles().error.empty()) GTEST_FAIL() << bundles().error;
    open(bundles().tiny);
  }
  void TearDown() override { close(); }
  void open(const fs::path& bundle, bool bind_kv = true) {
    close();
    ASSERT_TRUE(outcome(dp_bundle_open(bundle.c_str(), nullptr, &b_)).ok());
    dp_session_options o = host_options(0);
    ASSERT_TRUE(outcome(dp_session_create(b_, &o, &s_)).ok());
    const Outcome w = bind_all_weights(b_, s_, 0);
    ASSERT_TRUE(w.ok()) << w.message;
    ASSERT_TRUE(outcome(dp_session_finalize_weights(s_)).ok());
    if (bind_kv) {
      const Outcome k = bind_all_kv(b_, s_, kSlots, kBlocks);
      ASSERT_TRUE(k.ok()) << k.message;
    }
  }
  void close() {
    dp_session_destroy(s_);
    dp_bundle_close(b_);
    s_ = nullptr;
    b_ = nullptr;
  }
  dp_plan_result plan(const dp_step_desc& d) {
    dp_plan_result r;
    dp_plan_result_init(&r);
    const Outcome o = outcome(dp_plan(s_, &d, &r));
    EXPECT_TRUE(o.ok()) << o.message;
    return r;
  }
  dp_bundle* b_ = nullptr;
  dp_session* s_ = nullptr;
};

// One step description, owning its arrays.
struct Step {
  std::vector<int32_t> qlens, accepted, states, blocks;
  int32_t graph = DP_GRAPH_FULL, pp = 0, block_cols = 0, block_stride = 0;
  int32_t n = -1;  // num_requests when the arrays are left out
  dp_step_desc desc() const {
    dp_step_desc d;
    dp_step_desc_init(&d);
    d.num_requests = n >= 0 ? n : static_cast<int32_t>(qlens.size());
    d.query_lens = qlens.empty() ? nullptr : qlens.data();
    d.num_accepted = accepted.empty() ? nullptr : accepted.data();
    d.state_indices = states.empty() ? nullptr : states.data();
    d.block_table = blocks.empty() ? nullptr : blocks.data();
    d.block_table_cols = block_cols;
    d.block_table_stride = block_stride;
    d.graph_mode = graph;
    d.pp_stage_input = pp;
    return d;
  }
};

Step decode(int n) {
  Step s;
  for (int i = 0; i < n; ++i) {
    s.qlens.push_back(1);
    s.accepted.push_back(1);
    s.states.push_back(1 + i);
  }
  return s;
}

struct Case {
  const char* name;
  Step step;
  int32_t reason;
  int32_t width;
  const char* fragment;  // in the message
};

TEST_F(PlanningTest, TableOfStepCases) {
  auto with = [](Step s, auto f) {
    f(s);
    return s;
  };
  const std::vector<Case> cases = {
      {"one request", decode(1), DP_REASON_NONE, 1, ""},
      {"three requests", decode(3), DP_REASON_NONE, 3, ""},
      {"the largest width", decode(8), DP_REASON_NONE, 8, ""},
      {"eager (no graph)", with(decode(2), [](Step& s) { s.graph = DP_GRAPH_NONE; }), DP_REASON_NONE, 2, ""},
      {"only the request count (the host vouches for uniform rows)",
       with(decode(4), [](Step& s) { s.qlens.clear(); s.accepted.clear(); s.states.clear(); s.n = 4; }), DP_REASON_NONE,
       4, ""},
      {"pipeline stage input", with(decode(2), [](Step& s) { s.pp = 1; }), DP_REASON_PP_STAGE_INPUT, 0,
       "previous pipeline-parallel stage"},
      {"piecewise graph", with(decode(2), [](Step& s) { s.graph = DP_GRAPH_PIECEWISE; }), DP_REASON_PIECEWISE, 0,
       "PIECEWISE graph mode"},
      {"more requests than width 8", decode(9), DP_REASON_TOO_MANY_REQUESTS, 0, "9 requests, the largest width built is 8"},
      {"no requests", Step{}, DP_REASON_NOT_UNIFORM, 0, "0 requests: not a decode step"},
      {"a prefill", with(decode(3), [](Step& s) { s.qlens[1] = 17; }), DP_REASON_NOT_UNIFORM, 0,
       "request 1 has 17 query rows, expected q = 1"},
      {"a zero-length row", with(decode(3), [](Step& s) { s.qlens[2] = 0; }), DP_REASON_NOT_UNIFORM, 0,
       "request 2 has 0 query rows"},
      {"padded tail (NULL_BLOCK_ID)", with(decode(4), [](Step& s) { s.states[2] = s.states[3] = 0; }), DP_REASON_NONE, 4,
       ""},
      {"padded tail (PAD_SLOT_ID)", with(decode(4), [](Step& s) { s.states[3] = -1; }), DP_REASON_NONE, 4, ""},
      {"padded request accepted 2", with(decode(2), [](Step& s) { s.states[1] = 0; s.accepted[1] = 2; }),
       DP_REASON_BAD_METADATA, 0, "request 1: padded (state index 0) with num_accepted 2, expected 1"},
      {"accepted beyond q", with(decode(2), [](Step& s) { s.accepted[0] = 2; }), DP_REASON_BAD_METADATA, 0,
       "request 0: num_accepted 2, expected 1..1"},
      {"state index beyond the cache", with(decode(2), [](Step& s) { s.states[1] = kSlots; }), DP_REASON_BAD_METADATA, 0,
       "request 1: state index 64 at draft position 0, expected 1..63 (the bound KDA state has 64 slots"},
      {"negative state index", with(decode(2), [](Step& s) { s.states[0] = -5; }), DP_REASON_BAD_METADATA, 0,
       "state index -5"},
      {"block table inside the cache",
       with(decode(2), [](Step& s) { s.blocks = {1, 2, 0, 0, 3, 31, 0, 0}; s.block_cols = 3; s.block_stride = 4; }),
       DP_REASON_NONE, 2, ""},
      {"block id beyond the cache",
       with(decode(2), [](Step& s) { s.blocks = {1, 2, 0, 0, 3, 32, 0, 0}; s.block_cols = 2; s.block_stride = 4; }),
       DP_REASON_BAD_METADATA, 0, "request 1: block table entry 1 is 32, expected 0..31"},
      {"padded rows' block tables are not read",
       with(decode(2), [](Step& s) { s.states[1] = 0; s.blocks = {1, 0, 999, 999}; s.block_cols = 2; s.block_stride = 2; }),
       DP_REASON_NONE, 2, ""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const dp_step_desc d = c.step.desc();
    const dp_plan_result r = plan(d);
    EXPECT_EQ(dp_reason_name(r.reason), std::string(dp_reason_name(c.reason))) << r.message;
    EXPECT_EQ(r.width, c.width);
    EXPECT_NE(std::string(r.message).find(c.fragment), std::string::npos) << r.message;
    if (c.reason == DP_REASON_NONE) {
      ASSERT_NE(r.step, nullptr);
      EXPECT_EQ(r.rows, c.width);
      EXPECT_EQ(r.q, 1);
      EXPECT_EQ(dp_step_width(r.step), c.width);
      EXPECT_STREQ(r.message, "");
    } else {
      EXPECT_EQ(r.step, nullptr);
    }
  }
}

TEST_F(PlanningTest, NoKvBoundYet) {
  open(bundles().tiny, false);
  const Step step = decode(2);  // owns the arrays the description points into
  const dp_step_desc d = step.desc();
  dp_plan_result r = plan(d);
  EXPECT_EQ(r.reason, DP_REASON_NO_KV);
  EXPECT_NE(std::string(r.message).find("no KV cache bound yet: layer 0 DP_KV_KDA_STATE and 12 more"), std::string::npos)
      << r.message;
  // Pipeline-stage inputs are reported first, as the reference orders its checks.
  Step pp = decode(2);
  pp.pp = 1;
  EXPECT_EQ(plan(pp.desc()).reason, DP_REASON_PP_STAGE_INPUT);
  // Partly bound is still "no KV": the missing cache is named.
  ASSERT_TRUE(bind_all_kv(b_, s_, kSlots, kBlocks).ok());
  DP_EXPECT_OK(dp_session_release_kv(s_));
  dp_tensor t;
  DP_EXPECT_OK(dp_session_kv_layout(s_, 3, DP_KV_MLA_LATENT, 8, &t));
  t.data = 0x7c0000000000ull;
  DP_EXPECT_OK(dp_session_bind_kv(s_, 3, DP_KV_MLA_LATENT, &t));
  r = plan(d);
  EXPECT_EQ(r.reason, DP_REASON_NO_KV);
  EXPECT_NE(std::string(r.message).find("layer 0 DP_KV_KDA_STATE and 11 more"), std::string::npos) << r.message;
}

TEST_F(PlanningTest, SpeculativeDecodeStepsHaveQRowsPerRequest) {
  open(bundles().spec);  // q = 2, widths 1, 2, 4
  Step s;
  for (int i = 0; i < 3; ++i) {
    s.qlens.push_back(2);
    s.accepted.push_back(i == 0 ? 2 : 1);
    s.states.push_back(10 + 2 * i);  // one slot per draft position: [request, q]
    s.states.push_back(11 + 2 * i);
  }
  dp_plan_result r = plan(s.desc());
  EXPECT_EQ(r.reason, DP_REASON_NONE) << r.message;
  EXPECT_EQ(r.width, 4);  // smallest built width >= 3
  EXPECT_EQ(r.q, 2);
  EXPECT_EQ(r.rows, 8);
  EXPECT_EQ(dp_step_q(r.step), 2);

  Step one = s;
  one.qlens[1] = 1;  // a request without its draft token: not a uniform spec-verify step
  r = plan(one.desc());
  EXPECT_EQ(r.reason, DP_REASON_NOT_UNIFORM);
  EXPECT_NE(std::string(r.message).find("request 1 has 1 query rows, expected q = 2"), std::string::npos) << r.message;

  Step acc = s;
  acc.accepted[2] = 3;
  r = plan(acc.desc());
  EXPECT_EQ(r.reason, DP_REASON_BAD_METADATA);
  EXPECT_NE(std::string(r.message).find("num_accepted 3, expected 1..2"), std::string::npos) << r.message;

  Step pad = s;
  pad.states[4] = 0;  // padded request whose draft slot is not padding
  r = plan(pad.desc());
  EXPECT_EQ(r.reason, DP_REASON_BAD_METADATA);
  EXPECT_NE(std::string(r.message).find("request 2: state index 15 at draft position 1 in a padded request"),
            std::string::npos) << r.message;
  pad.states[5] = 0;
  pad.accepted[2] = 1;
  EXPECT_EQ(plan(pad.desc()).reason, DP_REASON_NONE);

  // state_indices_stride: rows of a wider host tensor.
  Step wide = s;
  wide.states = {10, 11, -9, 12, 13, -9, 14, 15, -9};
  dp_step_desc d = wide.desc();
  d.state_indices_stride = 3;
  EXPECT_EQ(plan(d).reason, DP_REASON_NONE);
  d.state_indices_stride = 1;
  dp_plan_result bad;
  dp_plan_result_init(&bad);
  DP_EXPECT_STATUS(dp_plan(s_, &d, &bad), DP_ERR_INVALID_ARGUMENT, "state_indices_stride 1, expected 0 or >= q = 2");
  EXPECT_EQ(plan(decode(5).desc()).reason, DP_REASON_TOO_MANY_REQUESTS);
}

TEST_F(PlanningTest, StepsAreOwnedBySessionAndStable) {
  const dp_plan_result a = plan(decode(3).desc());
  const dp_plan_result b = plan(decode(3).desc());
  EXPECT_EQ(a.step, b.step);  // one step object per width: a plan baked into a graph stays valid
  const dp_plan_result c = plan(decode(4).desc());
  EXPECT_NE(a.step, c.step);
  for (int l = 0; l < 4; ++l) EXPECT_EQ(dp_step_layer_kernel(a.step, l), 1) << l;  // every class has its program
  EXPECT_EQ(dp_step_layer_kernel(a.step, 99), 0);
  EXPECT_EQ(dp_step_layer_kernel(nullptr, 0), 0);
  EXPECT_EQ(dp_step_width(nullptr), 0);
  EXPECT_EQ(dp_step_lm_head(a.step), 1);  // format 1.5: the LM head of every width of at most 32 rows
  EXPECT_EQ(dp_step_lm_head(c.step), 1);
  EXPECT_EQ(dp_step_lm_head(nullptr), 0);
}

TEST_F(PlanningTest, ArgumentErrors) {
  dp_plan_result r;
  dp_plan_result_init(&r);
  Step s = decode(2);
  dp_step_desc d = s.desc();
  d.graph_mode = 7;
  DP_EXPECT_STATUS(dp_plan(s_, &d, &r), DP_ERR_INVALID_ARGUMENT, "graph_mode 7");
  d = s.desc();
  s.blocks = {1, 2};
  d = s.desc();
  d.block_table_cols = 3;
  d.block_table_stride = 2;
  DP_EXPECT_STATUS(dp_plan(s_, &d, &r), DP_ERR_INVALID_ARGUMENT, "block_table_cols 3 and block_table_stride 2");
  d = s.desc();
  d.size = 0;
  DP_EXPECT_STATUS(dp_plan(s_, &d, &r), DP_ERR_INVALID_ARGUMENT, "dp_step_desc.size is 0");
  d = s.desc();
  DP_EXPECT_STATUS(dp_plan(s_, &d, nullptr), DP_ERR_INVALID_ARGUMENT, "out is NULL");
}

TEST_F(PlanningTest, OlderPlanResultIsFilledUpToItsSize) {
  unsigned char raw[sizeof(dp_plan_result)];
  std::memset(raw, 0xCD, sizeof(raw));
  auto* r = reinterpret_cast<dp_plan_result*>(raw);
  r->size = offsetof(dp_plan_result, message);
  const Step step = decode(9);  // owns the arrays the description points into
  const dp_step_desc d = step.desc();
  DP_EXPECT_OK(dp_plan(s_, &d, r));
  EXPECT_EQ(r->reason, DP_REASON_TOO_MANY_REQUESTS);
  for (size_t k = offsetof(dp_plan_result, message); k < sizeof(raw); ++k) ASSERT_EQ(raw[k], 0xCD);
}

TEST(Agree, EveryRankGetsTheSameVerdict) {
  const int32_t all_ok[4] = {0, 0, 0, 0};
  int32_t who = 7;
  EXPECT_EQ(dp_agree(all_ok, 4, &who), DP_REASON_NONE);
  EXPECT_EQ(who, -1);
  const int32_t one[4] = {0, 0, DP_REASON_BAD_METADATA, 0};
  EXPECT_EQ(dp_agree(one, 4, &who), DP_REASON_BAD_METADATA);
  EXPECT_EQ(who, 2);
  const int32_t two[4] = {0, DP_REASON_NO_KV, DP_REASON_NOT_UNIFORM, 0};
  EXPECT_EQ(dp_agree(two, 4, &who), DP_REASON_NO_KV);  // the lowest refusing rank's reason, everywhere
  EXPECT_EQ(who, 1);
  // Every rank computes it from the same gathered array: rotate the caller, same answer.
  for (int caller = 0; caller < 4; ++caller) EXPECT_EQ(dp_agree(two, 4, nullptr), DP_REASON_NO_KV);
  const int32_t junk[2] = {0, 99};
  EXPECT_EQ(dp_agree(junk, 2, &who), DP_REASON_INVALID);
  EXPECT_EQ(who, 1);
  EXPECT_EQ(dp_agree(nullptr, 4, &who), DP_REASON_INVALID);
  EXPECT_EQ(dp_agree(all_ok, 0, &who), DP_REASON_INVALID);
  EXPECT_EQ(dp_agree(all_ok, 1, nullptr), DP_REASON_NONE);
}

TEST_F(PlanningTest, ErrorFlagAbortsEveryLaterStep) {
  uint64_t addr = 1;
  uint32_t value = 1;
  DP_EXPECT_OK(dp_session_error_flag(s_, &addr, &value));
  EXPECT_EQ(addr, 0u);  // host-only: the word is host memory
  EXPECT_EQ(value, 0u);
  DP_EXPECT_OK(dp_after_step(s_));
  // A kernel of layer 5 gave up its wait (what a layer program writes), as the protocol describes.
  DP_EXPECT_OK(dp_session_raise_error_flag(s_, DP_FLAG_WAIT_TIMEOUT | (6u << 16)));
  DP_EXPECT_OK(dp_session_error_flag(s_, nullptr, &value));
  EXPECT_EQ(value, 0x00060001u);
  DP_EXPECT_STATUS(dp_after_step(s_), DP_ERR_ABORTED, "error flag 0x00060001", "gave up a bounded wait",
                   "first in layer 5", "every rank reports this");
  DP_EXPECT_STATUS(dp_after_step(s_), DP_ERR_ABORTED);  // sticky
  const Step step = decode(1);  // owns the arrays the description points into
  const dp_step_desc d = step.desc();
  dp_plan_result r;
  dp_plan_result_init(&r);
  DP_EXPECT_STATUS(dp_plan(s_, &d, &r), DP_ERR_ABORTED, "can run no more steps");
}

TEST_F(PlanningTest, PeerAbortIsReported) {
  DP_EXPECT_OK(dp_session_raise_error_flag(s_, DP_FLAG_PEER_ABORT));
  DP_EXPECT_STATUS(dp_after_step(s_), DP_ERR_ABORTED, "a peer rank announced that it gave up");
}

// The launch observer (profilers): off by default, settable and clearable, and a launch refused
// before any kernel is enqueued never calls it. (GPU runs of `decodepack bench` exercise the calls.)
TEST_F(PlanningTest, LaunchObserverIsCalledOnlyAroundEnqueuedKernels) {
  int calls = 0;
  const dp_launch_observer_fn count = [](void* user, int32_t, int32_t, const char*, int32_t, dp_stream) {
    ++*static_cast<int*>(user);
  };
  DP_EXPECT_OK(dp_session_set_launch_observer(s_, count, &calls));
  const dp_plan_result r = plan(decode(2).desc());
  ASSERT_NE(r.step, nullptr);
  dp_layer_io io;
  dp_layer_io_init(&io);
  io.hidden = io.out = io.residual = io.residual_out = 0x7a0000000000ull;
  DP_EXPECT_STATUS(dp_launch_layer(s_, r.step, 1, &io, nullptr), DP_ERR_NO_DEVICE, "host-only");
  dp_final_norm_io n;
  dp_final_norm_io_init(&n);
  DP_EXPECT_STATUS(dp_launch_final_norm(s_, r.step, &n, nullptr), DP_ERR_NO_DEVICE, "host-only");
  EXPECT_EQ(calls, 0);
  DP_EXPECT_OK(dp_session_set_launch_observer(s_, nullptr, nullptr));
  DP_EXPECT_STATUS(dp_session_set_launch_observer(nullptr, count, &calls), DP_ERR_INVALID_ARGUMENT,
                   "dp_session_set_launch_observer: session is NULL");
}

TEST_F(PlanningTest, LaunchesOnAHostOnlySession) {
  const dp_plan_result r = plan(decode(2).desc());
  ASSERT_NE(r.step, nullptr);
  dp_layer_io io;
  dp_layer_io_init(&io);
  io.hidden = io.out = io.residual = io.residual_out = 0x7a0000000000ull;
  DP_EXPECT_STATUS(dp_launch_layer(s_, r.step, 1, &io, nullptr), DP_ERR_NO_DEVICE, "host-only");
  DP_EXPECT_STATUS(dp_launch_layer(s_, r.step, 4, &io, nullptr), DP_ERR_INVALID_ARGUMENT, "layer 4, expected 0..3");
  DP_EXPECT_STATUS(dp_launch_layer(s_, nullptr, 0, &io, nullptr), DP_ERR_INVALID_ARGUMENT, "the step is NULL");
  dp_final_norm_io n;
  dp_final_norm_io_init(&n);
  DP_EXPECT_STATUS(dp_launch_final_norm(s_, r.step, &n, nullptr), DP_ERR_NO_DEVICE, "host-only");
  int32_t launched = 5;
  DP_EXPECT_STATUS(dp_prefetch_fork(s_, DP_PREFETCH_NEXT_ATTENTION, 1, 2, nullptr, &launched), DP_ERR_NO_DEVICE);
  EXPECT_EQ(launched, 0);
  DP_EXPECT_STATUS(dp_prefetch_fork(s_, 4, 1, 2, nullptr, &launched), DP_ERR_INVALID_ARGUMENT, "point 4");
  DP_EXPECT_STATUS(dp_prefetch_join(s_, nullptr), DP_ERR_NO_DEVICE);
  DP_EXPECT_STATUS(dp_prefetch_set_cap(s_, DP_PREFETCH_ATTENTION_OPROJ, 2, 1 << 20), DP_ERR_NO_DEVICE, "host-only");
  DP_EXPECT_STATUS(dp_prefetch_set_cap(s_, -1, 2, 0), DP_ERR_INVALID_ARGUMENT, "point -1");

  // A step of another session is refused.
  dp_session* other = nullptr;
  dp_session_options o = host_options();
  DP_EXPECT_OK(dp_session_create(b_, &o, &other));
  DP_EXPECT_STATUS(dp_launch_layer(other, r.step, 0, &io, nullptr), DP_ERR_INVALID_ARGUMENT, "another session's");
  dp_session_destroy(other);
}

}  // namespace
}  // namespace dp::rttest

namespace dp::rttest {
namespace {

// A copy of the tiny bundle (directory form) whose manifest the test edits: programs are data, so what
// the runtime does with an edited program is what it does with a bundle from another build.
class LayerProgramTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!bundles().error.empty()) GTEST_FAIL() << bundles().error;
    dir_ = fs::temp_directory_path() / ("dp-rt-layers-" + std::to_string(::getpid()));
    fs::remove_all(dir_);
    fs::copy(bundles().tiny_dir, dir_, fs::copy_options::recursive);
    m_ = nlohmann::json::parse(read_text(dir_ / "manifest.json"));
  }
  void TearDown() override { fs::remove_all(dir_); }
  nlohmann::json& program(const std::string& cls, int width) {
    for (auto& p : m_["programs"])
      if (p["class"] == cls && p["width"] == width) return p;
    throw std::runtime_error("no program " + cls);
  }
  void save() { write_text(dir_ / "manifest.json", m_.dump() + "\n"); }
  // A host-only session on the edited bundle with every weight and cache bound, planned at `width`.
  const dp_step* plan_width(int width) {
    EXPECT_EQ(outcome(dp_bundle_open(dir_.c_str(), nullptr, &b_)).message, "");
    if (!b_) return nullptr;
    dp_session_options o = host_options(0, "sm_90a");
    EXPECT_EQ(outcome(dp_session_create(b_, &o, &s_)).message, "");
    EXPECT_TRUE(bind_all_weights(b_, s_, 0).ok());
    DP_EXPECT_OK(dp_session_finalize_weights(s_));
    EXPECT_TRUE(bind_all_kv(b_, s_, kSlots, kBlocks).ok());
    step_ = decode(width);
    const dp_step_desc d = step_.desc();
    dp_plan_result r;
    dp_plan_result_init(&r);
    DP_EXPECT_OK(dp_plan(s_, &d, &r));
    EXPECT_EQ(r.width, width) << r.message;
    return r.step;
  }
  void close() {
    dp_session_destroy(s_);
    dp_bundle_close(b_);
    s_ = nullptr;
    b_ = nullptr;
  }
  fs::path dir_;
  nlohmann::json m_;
  dp_bundle* b_ = nullptr;
  dp_session* s_ = nullptr;
  Step step_;
};

TEST_F(LayerProgramTest, AProgramWithoutStepsFallsBackForItsLayersOnly) {
  auto& p = program("kda_moe", 1);
  p["steps"] = nlohmann::json::array();
  p["reason"] = "kda_moe left out for this test";
  save();
  const dp_step* step = plan_width(1);
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(dp_step_layer_kernel(step, 0), 1);  // kda_dense
  EXPECT_EQ(dp_step_layer_kernel(step, 1), 0);  // kda_moe: no program
  EXPECT_EQ(dp_step_layer_kernel(step, 2), 0);
  EXPECT_EQ(dp_step_layer_kernel(step, 3), 1);  // mla_moe
  dp_layer_io io;
  dp_layer_io_init(&io);
  io.hidden = io.out = io.residual = io.residual_out = 0x7a0000000000ull;
  DP_EXPECT_STATUS(dp_launch_layer(s_, step, 2, &io, nullptr), DP_ERR_NO_KERNEL, "layer 2 (kda_moe) at width 1",
                   "the build made no program: kda_moe left out for this test", "the host runs its own layer");
  DP_EXPECT_STATUS(dp_launch_layer(s_, step, 0, &io, nullptr), DP_ERR_NO_DEVICE, "host-only");
  close();
}

TEST_F(LayerProgramTest, BrokenProgramsAreRefusedWhenTheBundleOpens) {
  struct Case {
    const char* what;
    std::function<void(nlohmann::json&)> edit;
    std::vector<std::string> fragments;
  };
  const std::vector<Case> cases = {
      {"unknown source", [](nlohmann::json& p) { p["steps"][0]["args"][0]["from"] = "register"; },
       {"from \"register\", expected io, weight"}},
      {"unknown io field", [](nlohmann::json& p) { p["steps"][0]["args"][0] = {{"param", "hidden"}, {"from", "io"},
                                                   {"name", "hiden"}, {"offset", 0}, {"value", 0}}; },
       {"io field \"hiden\" is not a dp_layer_io field"}},
      {"wrong parameter", [](nlohmann::json& p) { p["steps"][0]["args"][0]["param"] = "x"; }, {"binds x, the parameter is hidden"}},
      {"missing argument", [](nlohmann::json& p) { p["steps"][0]["args"].erase(0); }, {"5 args for 6 parameters"}},
      {"kind mismatch", [](nlohmann::json& p) { p["steps"][0]["args"][5] = {{"param", "eps"}, {"from", "u32"}, {"name", ""},
                                                {"offset", 0}, {"value", 3}}; },
       {"a u32 source (u32) for parameter eps of kind f32"}},
      {"null for a required pointer", [](nlohmann::json& p) { p["steps"][0]["args"][0]["from"] = "null"; },
       {"null for parameter hidden, which is not nullable"}},
      {"workspace outside", [](nlohmann::json& p) { p["steps"][1]["args"][0]["offset"] = 1u << 30; },
       {"workspace offset 1073741824 is not a 16-byte multiple inside"}},
      {"kernel not built", [](nlohmann::json& p) { p["steps"][0]["kernel"] = "rmsnorm_w1_h512"; },
       {"kernel rmsnorm_w1_h512 has no entry for target"}},
      {"steps and reason", [](nlohmann::json& p) { p["reason"] = "both"; }, {"a program has steps or a reason, not both"}},
      {"tp source in a 1.5 bundle", [](nlohmann::json& p) { p["steps"][0]["args"][0] = {{"param", "hidden"}, {"from", "tp"},
                                                            {"name", "peers"}, {"offset", 0}, {"value", 0}}; },
       {"source tp in a format 1.5 bundle (since 1.6)"}},
  };
  const nlohmann::json original = m_;
  for (const Case& c : cases) {
    m_ = original;
    c.edit(program("kda_dense", 1));
    save();
    dp_bundle* b = nullptr;
    const Outcome o = outcome(dp_bundle_open(dir_.c_str(), nullptr, &b));
    EXPECT_EQ(o.code, DP_ERR_FORMAT) << c.what << ": " << o.message;
    for (const std::string& f : c.fragments) EXPECT_NE(o.message.find(f), std::string::npos) << c.what << ": " << o.message;
    EXPECT_NE(o.message.find("programs["), std::string::npos) << c.what << ": " << o.message;
    dp_bundle_close(b);
  }
}

TEST_F(LayerProgramTest, ExpertGroupsMustBeOneStackedTensor) {
  ASSERT_TRUE(outcome(dp_bundle_open(dir_.c_str(), nullptr, &b_)).ok());
  dp_session_options o = host_options(0, "sm_90a");
  ASSERT_TRUE(outcome(dp_session_create(b_, &o, &s_)).ok());
  // Every weight at its own place, then one group re-bound with a gap before its last expert.
  const char* group = "model.layers.1.block_sparse_moe.experts.{e}.w1.weight";
  dp_weight_info wi;
  wi.size = sizeof(wi);
  const int32_t n = dp_bundle_weight_count(b_, 0);
  dp_tensor one;
  int32_t experts = 0;
  for (int32_t i = 0; i < n; ++i) {
    DP_EXPECT_OK(dp_bundle_get_weight(b_, 0, i, &wi));
    if (std::string(wi.name) == group) {
      dp_tensor_init(&one, 0, wi.dtype, wi.ndim, wi.shape);
      experts = wi.experts;
    }
  }
  ASSERT_GT(experts, 2);
  const uint64_t bytes = static_cast<uint64_t>(one.shape[0] * one.shape[1]) * 2;
  std::vector<uint64_t> ptrs;
  for (int32_t e = 0; e < experts; ++e) ptrs.push_back(0x7e0000000000ull + e * bytes + (e == experts - 1 ? 256 : 0));
  DP_EXPECT_OK(dp_session_bind_expert_weights(s_, group, ptrs.data(), experts, &one));
  const Outcome w = bind_all_weights(b_, s_, 0, 0x7f0000000000ull, group);  // the rest
  ASSERT_TRUE(w.ok()) << w.message;
  const std::string last = fmt::format("expert {} at", experts - 1);
  DP_EXPECT_STATUS(dp_session_finalize_weights(s_), DP_ERR_LAYOUT, group, "one stacked tensor", last.c_str());
  close();
}

TEST_F(LayerProgramTest, BundlesBeforeFormat11HaveNoPrograms) {
  const fs::path v10 = fs::path(DP_TEST_DATA_DIR) / "fixtures/bundle-v1/tiny-v1.dpk";
  ASSERT_TRUE(outcome(dp_bundle_open(v10.c_str(), nullptr, &b_)).ok());
  dp_session_options o = host_options(0, "sm_90a");
  ASSERT_TRUE(outcome(dp_session_create(b_, &o, &s_)).ok());
  ASSERT_TRUE(bind_all_weights(b_, s_, 0).ok());
  DP_EXPECT_OK(dp_session_finalize_weights(s_));
  ASSERT_TRUE(bind_all_kv(b_, s_, kSlots, kBlocks).ok());
  const Step one = decode(1);
  const dp_step_desc d = one.desc();
  dp_plan_result r;
  dp_plan_result_init(&r);
  DP_EXPECT_OK(dp_plan(s_, &d, &r));
  ASSERT_NE(r.step, nullptr) << r.message;
  EXPECT_EQ(dp_step_layer_kernel(r.step, 0), 0);
  dp_layer_io io;
  dp_layer_io_init(&io);
  io.hidden = io.out = io.residual = io.residual_out = 0x7a0000000000ull;
  DP_EXPECT_STATUS(dp_launch_layer(s_, r.step, 0, &io, nullptr), DP_ERR_NO_KERNEL,
                   "the bundle (format 1.0) predates layer programs (format 1.1)");
  close();
}

// The manifest's deploy block is held to the deploy reader's bounds (runtime/format/deploy_limits.h):
// a bundle outside them was not written by decodepack and is refused when it opens.
TEST_F(LayerProgramTest, DeployBlockOutsideTheDeployReadersBoundsIsRefused) {
  struct Case {
    const char* field;
    nlohmann::json value;
    std::string fragment;
  };
  nlohmann::json wider = m_["deploy"]["widths"];  // the built widths (kernels must name one) and one past the bound
  wider.push_back(65);
  const std::vector<Case> cases = {
      {"num_speculative_tokens", 8, "field deploy.num_speculative_tokens is 8, expected 0..7"},
      {"tensor_parallel", 16, "field deploy.tensor_parallel is 16, expected 1..8"},
      {"widths", wider, fmt::format("field deploy.widths[{}] is 65, expected 1..64", wider.size() - 1)},
      {"kda_state", {{"dtype", "float32"}, {"layout", "KV"}}, "field deploy.kda_state.layout is \"KV\", expected one of kv, vk"},
      {"max_num_seqs", 8, "unknown field deploy.max_num_seqs"},
  };
  const nlohmann::json original = m_;
  for (const Case& c : cases) {
    m_ = original;
    m_["deploy"][c.field] = c.value;
    save();
    dp_bundle* b = nullptr;
    const Outcome o = outcome(dp_bundle_open(dir_.c_str(), nullptr, &b));
    EXPECT_EQ(o.code, DP_ERR_FORMAT) << c.field << ": " << o.message;
    EXPECT_NE(o.message.find(c.fragment), std::string::npos) << o.message;
    dp_bundle_close(b);
  }
  m_ = original;
  m_["deploy"]["kv_cache"]["block_size"] = 8;
  save();
  dp_bundle* b = nullptr;
  const Outcome o = outcome(dp_bundle_open(dir_.c_str(), nullptr, &b));
  EXPECT_EQ(o.code, DP_ERR_FORMAT) << o.message;
  EXPECT_NE(o.message.find("field deploy.kv_cache.block_size is 8, expected 16..65536"), std::string::npos) << o.message;
  dp_bundle_close(b);

  // model.details likewise (format::details_from_json).
  m_ = original;
  m_["model"]["details"]["kda"]["conv_kernel"] = 65;
  save();
  const Outcome d = outcome(dp_bundle_open(dir_.c_str(), nullptr, &b));
  EXPECT_EQ(d.code, DP_ERR_FORMAT) << d.message;
  EXPECT_NE(d.message.find("field model.details.kda.conv_kernel is 65, expected 0..64"), std::string::npos) << d.message;
  dp_bundle_close(b);
}

}  // namespace
}  // namespace dp::rttest

namespace dp::rttest {
namespace {

// A bundle of an FP8 checkpoint (synth --quantize fp8): its weight table lists the e4m3 weights and their
// fp32 scales as they are bound, and every layer has its program (the ops' e4m3 forms read them).
TEST(Fp8Bundle, ListsWeightsAndScalesAndEveryLayerHasItsProgram) {
  if (!bundles().error.empty()) GTEST_FAIL() << bundles().error;
  dp_bundle* b = nullptr;
  ASSERT_EQ(outcome(dp_bundle_open(bundles().fp8.c_str(), nullptr, &b)).message, "");
  bool weight = false, scale = false;
  for (int32_t i = 0; i < dp_bundle_weight_count(b, 0); ++i) {
    dp_weight_info w;
    w.size = sizeof(w);
    DP_EXPECT_OK(dp_bundle_get_weight(b, 0, i, &w));
    const std::string name = w.name;
    if (name == "model.layers.1.self_attn.q_proj.weight") {
      weight = true;
      EXPECT_EQ(w.dtype, DP_DTYPE_F8_E4M3);
    }
    if (name == "model.layers.1.self_attn.q_proj.weight_scale_inv") {
      scale = true;
      EXPECT_EQ(w.dtype, DP_DTYPE_F32);
      ASSERT_EQ(w.ndim, 2);
      EXPECT_EQ(w.shape[0], 2);
      EXPECT_EQ(w.shape[1], 2);
    }
    if (name == "model.layers.1.self_attn.b_proj.weight") {  // the ignore list keeps it bf16
      EXPECT_EQ(w.dtype, DP_DTYPE_BF16);
    }
  }
  EXPECT_TRUE(weight && scale);

  dp_session* s = nullptr;
  dp_session_options o = host_options(0);
  ASSERT_EQ(outcome(dp_session_create(b, &o, &s)).message, "");
  const Outcome w = bind_all_weights(b, s, 0);
  ASSERT_TRUE(w.ok()) << w.message;
  DP_EXPECT_OK(dp_session_finalize_weights(s));
  ASSERT_TRUE(bind_all_kv(b, s, kSlots, kBlocks).ok());
  const Step step = decode(2);
  const dp_step_desc d = step.desc();
  dp_plan_result r;
  dp_plan_result_init(&r);
  DP_EXPECT_OK(dp_plan(s, &d, &r));
  EXPECT_EQ(r.width, 2) << r.message;
  ASSERT_NE(r.step, nullptr);
  for (int32_t l = 0; l < 4; ++l) EXPECT_EQ(dp_step_layer_kernel(r.step, l), 1) << l;
  dp_session_destroy(s);
  dp_bundle_close(b);
}

}  // namespace
}  // namespace dp::rttest
