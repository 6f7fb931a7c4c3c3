// Compiles a set of kernel instances for one target (through the real toolchain, a fresh compile cache)
// and checks each code object: one kernel, the generated symbol, the parameter block the signature
// says, no register spills or stack, at most 48 KiB of static shared memory and, with the launch's dynamic
// shared memory, at most what a block may have (sm_90 with opt-in: 227 KiB; gfx942: 64 KiB of LDS), no
// compiler warnings.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "../backend/backend_test_util.h"
#include "backend/compile.h"
#include "codegen/kernel.h"

namespace dp::codegen::test_util {

inline void expect_compiles(const std::vector<KernelInstance>& set, const std::string& target) {
  test::TempDir cache;
  backend::CompileOptions o;
  o.jobs = 2;
  o.cache_dir = cache.path();
  const backend::CompileReport report = backend::compile_all(set, o);
  ASSERT_EQ(report.kernels.size(), set.size());
  for (const backend::CompiledKernel& k : report.kernels) {
    SCOPED_TRACE(k.key);
    auto kernels = backend::inspect_code_object(k.code_object, target, k.file_name);
    ASSERT_EQ(kernels.size(), 1u);
    EXPECT_EQ(kernels[0].symbol, k.name);
    EXPECT_EQ(kernels[0].param_bytes, k.signature.bytes);
    EXPECT_LE(kernels[0].shared_bytes, 48u * 1024) << "static shared memory beyond 48 KiB";
    const uint32_t limit = target.rfind("sm_", 0) == 0 ? 227u * 1024 : 64u * 1024;
    EXPECT_LE(kernels[0].shared_bytes + k.launch.dynamic_shared_bytes, limit)
        << kernels[0].shared_bytes << " static + " << k.launch.dynamic_shared_bytes << " dynamic bytes";
    EXPECT_EQ(k.usage.spill_bytes, 0u) << k.log;
    EXPECT_EQ(k.usage.stack_bytes, 0u) << k.log;  // no register array went to local memory
    EXPECT_TRUE(k.warnings.empty()) << k.warnings.front();
  }
}

}  // namespace dp::codegen::test_util
