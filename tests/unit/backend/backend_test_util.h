// Shared by the backend tests: the real toolchains (skipped only where one is absent) and one
// compile of a standard instance set per process, reused through copies of its cache.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/compile.h"
#include "backend/toolchain.h"
#include "codegen/kernel.h"
#include "../test_util.h"

namespace dp::test {

inline codegen::KernelInstance rmsnorm(int64_t w, int64_t h, const std::string& target) {
  return {"rmsnorm", {{"W", w}, {"H", h}}, target};
}
inline codegen::KernelInstance prefetch(int64_t b, const std::string& target) {
  return {"prefetch", {{"B", b}}, target};
}

// The instances the tests compile for a target: the prefetch kernel at the default block size and
// a wave-sized one, and RMSNorm at Kimi-Linear's hidden size over a few widths plus Kimi-K3's.
inline std::vector<codegen::KernelInstance> standard_instances(const std::string& target) {
  return {prefetch(32, target), prefetch(64, target), rmsnorm(1, 2304, target), rmsnorm(4, 2304, target),
          rmsnorm(8, 2304, target), rmsnorm(2, 7168, target)};
}

// Why a toolchain is unusable on this machine, or nullopt when it works.
inline std::optional<std::string> toolchain_absent(backend::Vendor v) {
  try {
    if (v == backend::Vendor::nvidia)
      backend::make_cuda_toolchain({});
    else
      backend::make_hip_toolchain({});
    return std::nullopt;
  } catch (const Error& e) {
    if (e.code() != Errc::toolchain) throw;
    return std::string(e.what());
  }
}

#define DP_SKIP_WITHOUT(vendor)                                                                  \
  do {                                                                                           \
    if (auto why = ::dp::test::toolchain_absent(vendor)) GTEST_SKIP() << "toolchain absent: " << *why; \
  } while (0)

// One cold compile of standard_instances() for sm_90a and gfx942 into a private cache, shared by
// every test in the process (the expensive part). Tests that change the cache work on a copy.
struct CompiledSet {
  TempDir cache;
  std::vector<codegen::KernelInstance> instances;
  backend::CompileReport report;
};

inline const CompiledSet& compiled_set(const std::string& target) {
  static std::map<std::string, std::unique_ptr<CompiledSet>> sets;
  auto& slot = sets[target];
  if (!slot) {
    slot = std::make_unique<CompiledSet>();
    slot->instances = standard_instances(target);
    backend::CompileOptions o;
    o.jobs = 2;
    o.cache_dir = slot->cache.path();
    slot->report = backend::compile_all(slot->instances, o);
  }
  return *slot;
}

inline void copy_tree(const std::filesystem::path& from, const std::filesystem::path& to) {
  std::filesystem::copy(from, to, std::filesystem::copy_options::recursive);
}

}  // namespace dp::test
