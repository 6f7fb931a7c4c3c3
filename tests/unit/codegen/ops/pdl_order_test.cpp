// Programmatic dependent launch (templates/vendor.h): every entry point lets the next kernel launch, then
// waits for the previous one (griddepcontrol.wait) before it touches memory another kernel writes. The
// kernels read their predecessors' outputs with non-coherent loads (ld.global.nc), whose data must not
// change while they can be issued: a load or store placed before the wait would read a half-written
// input or clobber one still being read (bench/NOTES.md, 2026-12-04: an early wait with activation loads
// gave wrong outputs). This compiles instances of the decode-layer ops (norm, gemm, routing, gate/up,
// down, KDA step, MLA; not yet attnres, the indexer, the all-reduce or prefetch) for sm_90a and checks in
// their PTX that no global load, store, atomic or cp.async comes before the first griddepcontrol.wait.
// The exception (codegen gemm_early, templates/gemm.h dp_gemm_q8 with kEarly 1): the width-1 e4m3 gemm issues
// its first weight loads before the wait; then only the weights' non-coherent loads and their scales
// may come first, no store, and the activations are read coherently (ld.global.cg) after the wait. (Its
// two earlier forms, with activations read through ld.global.nc after a wait inside the loop, gave
// wrong outputs; bench/NOTES.md.) And kda_step (codegen kda_early, templates/kda.h kEarly): its own state,
// conv history and weights before the wait, the projection rows coherently after it.
#include <gtest/gtest.h>

#include <cstring>
#include <initializer_list>
#include <iterator>
#include <sstream>
#include <string>
#include <vector>

#include "../../backend/backend_test_util.h"
#include "backend/compile.h"
#include "instances.h"

namespace dp::codegen {
namespace {

using namespace test_ops;

// One pass over the PTX: the first instruction before the first griddepcontrol.wait that starts with one
// of `flagged` (by default every global memory access) and not with one of `allowed` ("" if none),
// whether there is a wait, and whether a coherent load (ld.global.cg) follows it.
struct WaitScan {
  std::string before;
  bool waited = false, coherent_after = false;
};
constexpr std::initializer_list<const char*> kGlobalAccess = {"ld.global", "st.global",         "atom.",
                                                              "red.",      "cp.async",          "ld.volatile.global"};
WaitScan scan_wait(const std::string& ptx, std::initializer_list<const char*> allowed = {},
                   std::initializer_list<const char*> flagged = kGlobalAccess) {
  WaitScan r;
  std::istringstream in(ptx);
  for (std::string line; std::getline(in, line);) {
    const size_t b = line.find_first_not_of(" \t");
    if (b == std::string::npos) continue;
    const std::string op = line.substr(b);
    if (op.rfind("griddepcontrol.wait", 0) == 0) r.waited = true;
    if (r.waited) {
      r.coherent_after = r.coherent_after || op.rfind("ld.global.cg", 0) == 0;
      continue;
    }
    bool ok = false;
    for (const char* a : allowed) ok = ok || op.rfind(a, 0) == 0;
    if (ok || !r.before.empty()) continue;
    for (const char* m : flagged)
      if (op.rfind(m, 0) == 0) r.before = op;
  }
  return r;
}

// The first memory instruction of the PTX before its first griddepcontrol.wait ("" if none), or
// "no griddepcontrol.wait" if the wait is missing.
std::string memory_before_wait(const std::string& ptx) {
  const WaitScan r = scan_wait(ptx);
  if (!r.before.empty()) return r.before;
  return r.waited ? "" : "no griddepcontrol.wait";
}

// Every instance of `set` compiled for sm_90a with its PTX.
backend::CompileReport compile_with_ptx(const std::vector<KernelInstance>& set) {
  test::TempDir cache;
  backend::CompileOptions o;
  o.jobs = 2;
  o.cache_dir = cache.path();
  o.emit_ptx = true;
  return backend::compile_all(set, o);
}

TEST(PdlOrderCompile, NoKernelTouchesGlobalMemoryBeforeItsDependencyWait) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  const std::vector<KernelInstance> set = {
      rmsnorm(1, 2304),
      gemm(1, 2304, {4096}),
      gemm(8, 2304, {4096, 4096, 4096, 128, 128, 32}),
      q8(gemm(8, 4096, {2304})),
      q8(gemm(8, 2304, {4096, 4096, 4096, 128, 128, 32}), 7),
      gemm(1, 2304, {256}, /*f32=*/true),
      gemm_norm(8, 4096, 2304),
      q8(gemm_norm(8, 4096, 2304)),
      gemm_route(1, 2304, 256, 8),
      route(1, 256, 8),
      mlp_up(1, 2304, 9216),
      q8(mlp_up(1, 2304, 9216)),
      moe_up(1, 2304, 1024, 256, 8, 1024),
      q8(moe_up(8, 2304, 1024, 256, 8, 1024)),
      moe_down(1, 2304, 1024, 256, 8, 1024),
      q8(moe_down(1, 2304, 1024, 256, 8, 1024)),
      mla_prep(1, 1, 32),
      mla_attn(1, 1, 32),
      mla_combine(1, 1, 32),
  };
  const backend::CompileReport report = compile_with_ptx(set);
  ASSERT_EQ(report.kernels.size(), set.size());
  for (const backend::CompiledKernel& k : report.kernels) {
    ASSERT_FALSE(k.ptx.empty()) << k.key;
    EXPECT_EQ(memory_before_wait(k.ptx), "") << k.key << ": a global memory access before the dependency wait";
  }
}

// For the early-weights form: the first access before the wait that is not a weight load (a store, an
// atomic, a copy, a coherent or plain vector load: an activation), "" if none; "no griddepcontrol.wait"
// if the wait is missing, "no coherent activation load" if nothing is read with ld.global.cg after it.
std::string early_violation(const std::string& ptx) {
  const WaitScan r = scan_wait(ptx, {"ld.global.nc", "ld.global.f32"});  // weights, their scales
  if (!r.waited) return "no griddepcontrol.wait";
  if (!r.before.empty()) return r.before;
  return r.coherent_after ? "" : "no coherent activation load";
}

TEST(PdlOrderCompile, TheEarlyWeightsGemmLoadsOnlyWeightsBeforeItsWait) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  const std::vector<KernelInstance> set = {
      q8(gemm(1, 4096, {2304})),
      q8(gemm(1, 9216, {2304})),
      q8(gemm(1, 2304, {6144, 576}), 3),
      q8(gemm_norm(1, 4096, 2304)),
  };
  const backend::CompileReport report = compile_with_ptx(set);
  ASSERT_EQ(report.kernels.size(), set.size());
  for (const backend::CompiledKernel& k : report.kernels) {
    ASSERT_FALSE(k.ptx.empty()) << k.key;
    EXPECT_NE(k.ptx.find("griddepcontrol.launch_dependents"), std::string::npos) << k.key;
    EXPECT_EQ(early_violation(k.ptx), "") << k.key;
    // The general check sees the weight loads before the wait: the exception is real.
    EXPECT_NE(memory_before_wait(k.ptx), "") << k.key;
  }
}

// The weight rings (RG; templates/gemm.h dp_ring_stream, dp_warp_ring_stream): every ring form copies
// its weights by bulk copies counted on mbarriers, none by the per-lane cp.async of the MXFP4 register
// loop (so a kernel named for a ring cannot be the register form under another name). The ring forms
// of moe_up, mlp_up and moe_down read routed or produced data, so nothing global comes before their
// wait; the width-1 e4m3 gemm (kEarly) issues only its weights' bulk copies before it.
TEST(PdlOrderCompile, TheWeightRingsCopyByBulkCopiesAndWaitFirstUnlessEarly) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  const std::vector<KernelInstance> waits_first = {
      split(ring(q4(moe_down(4, 3584, 3072, 896, 16, 0)), 8)),
      split(ring(q8(moe_down(1, 2304, 1024, 256, 8, 1024)))),
      ring(q4(moe_down(1, 3584, 3072, 896, 16, 0)), 8),
      ring(q4(moe_down(8, 3584, 3072, 896, 16, 0)), 4),
      ring(q4(moe_up(1, 3584, 3072, 896, 16, 0, 1)), 2),
      ring(q8(moe_up(1, 2304, 1024, 256, 8, 1024)), 2),
      ring(q8(mlp_up(1, 2304, 9216)), 2),
      ring(q8(moe_down(1, 2304, 1024, 256, 8, 1024))),
      ring(q8(gemm(8, 4096, {2304}))),
  };
  const std::vector<KernelInstance> early = {ring(q8(gemm(1, 4096, {2304}))),
                                             ring(q8(gemm(1, 2304, {6144, 576}), 3))};
  std::vector<KernelInstance> set = waits_first;
  set.insert(set.end(), early.begin(), early.end());
  const backend::CompileReport report = compile_with_ptx(set);
  ASSERT_EQ(report.kernels.size(), set.size());
  for (size_t i = 0; i < report.kernels.size(); ++i) {
    const backend::CompiledKernel& k = report.kernels[i];
    ASSERT_FALSE(k.ptx.empty()) << k.key;
    EXPECT_NE(k.ptx.find("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"), std::string::npos)
        << k.key;
    EXPECT_NE(k.ptx.find("mbarrier.try_wait.parity"), std::string::npos) << k.key;
    EXPECT_EQ(k.ptx.find("cp.async.cg.shared.global"), std::string::npos) << k.key << ": a per-lane copy";
    if (i < waits_first.size()) {
      EXPECT_EQ(memory_before_wait(k.ptx), "") << k.key << ": a global memory access before the dependency wait";
    } else {
      const WaitScan r = scan_wait(k.ptx, {"cp.async.bulk"});
      EXPECT_TRUE(r.waited) << k.key;
      EXPECT_EQ(r.before, "") << k.key << ": more than the weights' bulk copies before the dependency wait";
      EXPECT_NE(memory_before_wait(k.ptx), "") << k.key << ": no weights in flight during the wait";
    }
  }
}

// The early form of kda_step (templates/kda.h, kEarly): before the wait it loads only what no kernel before
// it in the step writes (its own recurrent state and conv history, weights, the step's slots; PTX cannot
// tell those addresses apart, so the check is that nothing is stored, counted or read coherently before
// the wait), and the projection rows, the previous kernel's output, after it with coherent loads
// (ld.global.cg). Its value-split form (VS) waits first.
std::string early_state_violation(const std::string& ptx) {
  const WaitScan r = scan_wait(ptx, {"cp.async.bulk.prefetch"},
                               {"st.global", "atom.", "red.", "ld.global.cg", "ld.volatile.global", "cp.async"});
  if (!r.waited) return "no griddepcontrol.wait";
  if (!r.before.empty()) return r.before;
  return r.coherent_after ? "" : "no coherent load after the wait";
}

TEST(PdlOrderCompile, TheEarlyKdaStepStoresNothingBeforeItsWait) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  KernelInstance vs = kda(1, 1, 32);
  vs.params["VS"] = 4;
  const std::vector<KernelInstance> set = {kda(1, 1, 32), kda(8, 2, 32), kda(1, 1, 96, 0, true), vs};
  const backend::CompileReport report = compile_with_ptx(set);
  ASSERT_EQ(report.kernels.size(), set.size());
  for (size_t i = 0; i < report.kernels.size(); ++i) {
    const backend::CompiledKernel& k = report.kernels[i];
    ASSERT_FALSE(k.ptx.empty()) << k.key;
    if (i + 1 < set.size()) {
      EXPECT_EQ(early_state_violation(k.ptx), "") << k.key;
      EXPECT_NE(memory_before_wait(k.ptx), "") << k.key << ": nothing in flight during the wait";
      EXPECT_NE(k.ptx.find("cp.async.bulk.prefetch.L2.global"), std::string::npos) << k.key << ": no gate rows to L2";
    } else {
      EXPECT_EQ(memory_before_wait(k.ptx), "") << k.key << ": the split form reads before its wait";
    }
  }
}

// The early-state check: a store, an atomic or a coherent load before the wait is found; loads and the L2
// prefetch are not; a missing wait or no coherent load after it is named.
TEST(PdlOrder, TheEarlyStateCheckFindsStoresBeforeTheWait) {
  const std::string after = "\tgriddepcontrol.wait;\n\tld.global.cg.u16 %rs1, [%rd9];\n";
  EXPECT_EQ(early_state_violation("\tld.global.f32 %f1, [%rd1];\n\tld.global.nc.u32 %r1, [%rd2];\n"
                                  "\tcp.async.bulk.prefetch.L2.global [%rd3], 256;\n" + after), "");
  EXPECT_EQ(early_state_violation("\tst.global.u16 [%rd1], %rs1;\n" + after), "st.global.u16 [%rd1], %rs1;");
  EXPECT_EQ(early_state_violation("\tld.global.cg.u16 %rs1, [%rd1];\n" + after), "ld.global.cg.u16 %rs1, [%rd1];");
  EXPECT_EQ(early_state_violation("\tld.global.f32 %f1, [%rd1];\n"), "no griddepcontrol.wait");
  EXPECT_EQ(early_state_violation("\tgriddepcontrol.wait;\n\tld.global.nc.u16 %rs1, [%rd1];\n"),
            "no coherent load after the wait");
}

// The hand-off between blocks of the fused tails (gemm NM 1, dp_gemm_norm_tail; TK, dp_moe_route_tail; kda_step
// VS; moe_down SK), in
// PTX order: the dependency
// wait; every thread's release fence after its stores of the projection and a barrier before the one
// block-counting atomic; after it a barrier, the acquire fence, then the coherent (L2) loads of the other
// blocks' rows. "" when so, else the first step missing.
std::string norm_handoff_violation(const std::string& ptx) {
  const char* steps[] = {"griddepcontrol.wait", "st.global", "fence.acq_rel.gpu", "bar.sync",
                         "atom.relaxed.gpu.global.add.u32", "bar.sync", "fence.acq_rel.gpu", "ld.global.cg"};
  std::istringstream in(ptx);
  size_t next = 0;
  for (std::string line; next < std::size(steps) && std::getline(in, line);) {
    const size_t b = line.find_first_not_of(" \t");
    if (b != std::string::npos && line.compare(b, std::strlen(steps[next]), steps[next]) == 0) ++next;
  }
  return next == std::size(steps) ? "" : steps[next];
}

TEST(PdlOrderCompile, TheFusedTailsCountTheBlockAfterItsStoresAndReadTheOutputCoherently) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  // Also the other last-block hand-offs: kda_step's value splits (VS) and moe_down's split grid (SK).
  KernelInstance kda_vs = kda(1, 1, 32);
  kda_vs.params["VS"] = 4;
  KernelInstance down_sk = moe_down(8, 2304, 1024, 256, 8, 1024), down_sk8 = q8(moe_down(1, 2304, 1024, 256, 8, 1024));
  down_sk.params["SK"] = down_sk8.params["SK"] = 264;
  const std::vector<KernelInstance> set = {gemm_norm(1, 4096, 2304),     gemm_norm(8, 4096, 2304),
                                           q8(gemm_norm(1, 4096, 2304)), q8(gemm_norm(8, 9216, 2304)),
                                           gemm_route(1, 2304, 256, 8),  gemm_route(8, 2304, 256, 8),
                                           kda_vs,                       down_sk,
                                           down_sk8};
  const backend::CompileReport report = compile_with_ptx(set);
  ASSERT_EQ(report.kernels.size(), set.size());
  for (const backend::CompiledKernel& k : report.kernels) {
    ASSERT_FALSE(k.ptx.empty()) << k.key;
    EXPECT_EQ(norm_handoff_violation(k.ptx), "") << k.key << ": the step missing (in order)";
  }
}

// The MXFP4 register loop (templates/gemm.h dp_mma_rows_fp4) loads a chunk's activation columns one chunk
// ahead: in PTX order, a 16-byte global load (the next chunk's activations; the scale bytes are single
// bytes) lies between every tensor-core step that precedes a ring wait and that wait. "" when so, else
// the first wait without one, with its line number. The final `wait_group 0` (nothing left in flight) is
// not a step of the loop; a wait with no tensor-core step before it (the first chunk) is not checked.
std::string loads_ahead_violation(const std::string& ptx) {
  std::istringstream in(ptx);
  bool mma_seen = false, load_since_mma = false;
  int n = 0;
  for (std::string line; std::getline(in, line);) {
    ++n;
    const size_t b = line.find_first_not_of(" \t");
    if (b == std::string::npos) continue;
    const std::string op = line.substr(b);
    if (op.rfind("mma.sync", 0) == 0) {
      mma_seen = true;
      load_since_mma = false;
    } else if (op.rfind("ld.global", 0) == 0 && op.find(".v4.") != std::string::npos) {
      load_since_mma = true;
    } else if (op.rfind("cp.async.wait_group", 0) == 0 && op.rfind("cp.async.wait_group 0;", 0) != 0) {
      if (mma_seen && !load_since_mma) return "line " + std::to_string(n) + ": " + op;
    }
  }
  return "";
}

TEST(PdlOrderCompile, TheMxfp4LoopIssuesTheNextActivationsBeforeItWaitsForWeights) {
  DP_SKIP_WITHOUT(backend::Vendor::nvidia);
  // K3's expert shapes (I = 3072 up, D = 3072 latent down): 24 chunks a row, so the loop is not fully
  // unrolled and the check sees its steady state.
  const std::vector<KernelInstance> set = {
      q4(moe_up(1, 3072, 3072, 896, 16, 0, 1)),
      q4(moe_down(1, 3072, 3072, 896, 16, 0)),
      q4(moe_down(4, 3072, 3072, 896, 16, 0)),
      q4(moe_up(8, 3072, 3072, 896, 16, 0, 1)),
  };
  const backend::CompileReport report = compile_with_ptx(set);
  ASSERT_EQ(report.kernels.size(), set.size());
  for (const backend::CompiledKernel& k : report.kernels) {
    ASSERT_FALSE(k.ptx.empty()) << k.key;
    ASSERT_NE(k.ptx.find("cp.async.wait_group"), std::string::npos) << k.key << ": not the register loop";
    EXPECT_EQ(loads_ahead_violation(k.ptx), "") << k.key << ": a ring wait with no activation load ahead of it";
  }
}

// The loads-ahead check: a wait right after a tensor-core step (activations loaded after the wait) is
// found; a 16-byte load in between, the first wait and the final wait_group 0 pass.
TEST(PdlOrder, TheLoadsAheadCheckFindsAWaitBeforeItsLoads) {
  const std::string ahead =
      "\tcp.async.wait_group 3;\n\tld.global.nc.v4.u32 {%r1,%r2,%r3,%r4}, [%rd1];\n\tmma.sync.aligned.m16n8k16;\n"
      "\tld.global.nc.u8 %rs1, [%rd2];\n\tld.global.nc.v4.u32 {%r5,%r6,%r7,%r8}, [%rd3];\n"
      "\tcp.async.wait_group 3;\n\tmma.sync.aligned.m16n8k16;\n\tcp.async.wait_group 0;\n";
  EXPECT_EQ(loads_ahead_violation(ahead), "");
  const std::string behind =
      "\tcp.async.wait_group 3;\n\tld.global.nc.v4.u32 {%r1,%r2,%r3,%r4}, [%rd1];\n\tmma.sync.aligned.m16n8k16;\n"
      "\tld.global.nc.u8 %rs1, [%rd2];\n\tcp.async.wait_group 3;\n";
  EXPECT_EQ(loads_ahead_violation(behind), "line 5: cp.async.wait_group 3;");
}

TEST(PdlOrder, TheHandoffCheckNamesTheMissingStep) {
  const std::string ok =
      "\tgriddepcontrol.wait;\n\tst.global.u16 [a], r;\n\tfence.acq_rel.gpu;\n\tbar.sync 0;\n"
      "\tatom.relaxed.gpu.global.add.u32 r, [c], 1;\n\tbar.sync 0;\n\tfence.acq_rel.gpu;\n\tld.global.cg.v4.u32 {}, [h];\n";
  EXPECT_EQ(norm_handoff_violation(ok), "");
  // The counting atomic before the fence: the fence after it does not count for the release.
  const std::string early =
      "\tgriddepcontrol.wait;\n\tst.global.u16 [a], r;\n\tbar.sync 0;\n\tatom.relaxed.gpu.global.add.u32 r, [c], 1;\n"
      "\tfence.acq_rel.gpu;\n\tbar.sync 0;\n\tld.global.cg.v4.u32 {}, [h];\n";
  EXPECT_NE(norm_handoff_violation(early), "");
  EXPECT_EQ(norm_handoff_violation("\tgriddepcontrol.wait;\n"), "st.global");
}

// The check itself: a load before the wait is found, one after it is not, and a missing wait is named.
TEST(PdlOrder, TheCheckFindsALoadBeforeTheWait) {
  EXPECT_EQ(memory_before_wait("\tld.param.u64 %rd1, [p];\n\tgriddepcontrol.launch_dependents;\n"
                               "\tgriddepcontrol.wait;\n\tld.global.nc.v4.u32 {%r1,%r2,%r3,%r4}, [%rd1];\n"),
            "");
  EXPECT_EQ(memory_before_wait("\tgriddepcontrol.launch_dependents;\n\tld.global.nc.v4.u32 {%r1}, [%rd1];\n"
                               "\tgriddepcontrol.wait;\n"),
            "ld.global.nc.v4.u32 {%r1}, [%rd1];");
  EXPECT_EQ(memory_before_wait("\tcp.async.cg.shared.global [%r1], [%rd1], 16;\n\tgriddepcontrol.wait;\n"),
            "cp.async.cg.shared.global [%r1], [%rd1], 16;");
  EXPECT_EQ(memory_before_wait("\tld.global.f32 %f1, [%rd1];\n"), "ld.global.f32 %f1, [%rd1];");
  EXPECT_EQ(memory_before_wait("\tret;\n"), "no griddepcontrol.wait");
}

// The early-weights check: weight loads may come first, activation loads and stores may not, and the
// activations must be read coherently after the wait.
TEST(PdlOrder, TheEarlyCheckAllowsOnlyWeightLoadsBeforeTheWait) {
  const std::string after = "\tgriddepcontrol.wait;\n\tld.global.cg.v4.u32 {%r5}, [%rd2];\n";
  EXPECT_EQ(early_violation("\tld.global.nc.v4.u32 {%r1}, [%rd1];\n\tld.global.f32 %f1, [%rd3];\n" + after), "");
  EXPECT_EQ(early_violation("\tld.global.v4.u32 {%r1}, [%rd1];\n" + after), "ld.global.v4.u32 {%r1}, [%rd1];");
  EXPECT_EQ(early_violation("\tld.global.cg.v4.u32 {%r1}, [%rd1];\n" + after), "ld.global.cg.v4.u32 {%r1}, [%rd1];");
  EXPECT_EQ(early_violation("\tst.global.u16 [%rd1], %rs1;\n" + after), "st.global.u16 [%rd1], %rs1;");
  EXPECT_EQ(early_violation("\tgriddepcontrol.wait;\n\tld.global.nc.v4.u32 {%r1}, [%rd1];\n"),
            "no coherent activation load");
  EXPECT_EQ(early_violation("\tld.global.nc.v4.u32 {%r1}, [%rd1];\n"), "no griddepcontrol.wait");
}

}  // namespace
}  // namespace dp::codegen
