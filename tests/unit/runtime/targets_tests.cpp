// The runtime's compatibility rules (runtime/src/targets.h) against the target table
// (runtime/format/targets.h): every target the compiler can build parses, runs on its own
// architecture, and needs the driver of the CUDA toolkit that first targets it.
#include <gtest/gtest.h>

#include <string>

#include "format/targets.h"
#include "src/targets.h"

namespace dp::rt {
namespace {

TEST(RuntimeTargets, EveryTableTargetIsKnownToTheRuntime) {
  for (const format::GpuTarget& g : format::kGpuTargets) {
    SCOPED_TRACE(std::string(g.name));
    const ArchId a = parse_arch(g.name);
    if (g.vendor == format::GpuVendor::nvidia) {
      ASSERT_EQ(a.vendor, TargetVendor::cuda);
      EXPECT_EQ(a.major * 10 + a.minor, g.sm);
      EXPECT_EQ(min_driver_for_arch(g.name), g.min_cuda_major * 1000 + g.min_cuda_minor * 10);
      std::string why;
      EXPECT_TRUE(target_runs_on(g.name, "sm_" + std::to_string(g.sm), &why)) << why;
    } else {
      ASSERT_EQ(a.vendor, TargetVendor::hip);
      EXPECT_EQ(a.base, g.name);
      std::string why;
      EXPECT_TRUE(target_runs_on(g.name, std::string(g.name) + ":sramecc+:xnack-", &why)) << why;
    }
  }
}

}  // namespace
}  // namespace dp::rt
