// The deploy block's bounds (runtime/format/deploy_limits.h) are the deploy reader's: each bound is
// accepted and one past it refused, so that every bundle the compiler writes is one the runtime's
// manifest reader accepts (tests/unit/runtime/planning_tests.cpp holds the runtime to the same bounds).
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/error.h"
#include "common/json.h"
#include "deploy/deploy.h"
#include "format/deploy_limits.h"

namespace dp::format {
namespace {

struct Bound {
  std::string field;  // as the deploy reader's messages name it
  Json at;            // merged into a minimal deploy file: the bound itself
  Json past;          // one step past it
};

Json minimal(const Json& patch) {
  Json j = {{"targets", {"sm_90a"}}, {"max_num_seqs", 4}};
  j.merge_patch(patch);
  return j;
}

TEST(DeployLimits, TheDeployReaderAcceptsEachBoundAndRefusesOnePast) {
  const std::vector<Bound> bounds = {
      {"tensor_parallel", {{"tensor_parallel", kMaxTensorParallel}}, {{"tensor_parallel", 2 * kMaxTensorParallel}}},
      {"num_speculative_tokens", {{"num_speculative_tokens", kMaxSpeculativeTokens}},
       {{"num_speculative_tokens", kMaxSpeculativeTokens + 1}}},
      {"max_num_seqs", {{"max_num_seqs", kMaxWidth}}, {{"max_num_seqs", kMaxWidth + 1}}},
      {"widths", {{"max_num_seqs", nullptr}, {"widths", {kMaxWidth}}},
       {{"max_num_seqs", nullptr}, {"widths", {kMaxWidth + 1}}}},
      {"kv_cache.block_size", {{"kv_cache", {{"block_size", kMaxBlockSize}}}},
       {{"kv_cache", {{"block_size", kMaxBlockSize + 16}}}}},
      {"kv_cache.block_size", {{"kv_cache", {{"block_size", kMinBlockSize}}}},
       {{"kv_cache", {{"block_size", kMinBlockSize - 1}}}}},
      {"dcp.size", {{"tensor_parallel", kMaxTensorParallel}, {"dcp", {{"size", kMaxDcpSize}}}},
       {{"tensor_parallel", kMaxTensorParallel}, {"dcp", {{"size", kMaxDcpSize + 1}}}}},
      {"dcp.interleave",
       {{"kv_cache", {{"block_size", kMaxBlockSize}}}, {"dcp", {{"interleave", kMaxDcpInterleave}}}},
       {{"kv_cache", {{"block_size", kMaxBlockSize}}}, {"dcp", {{"interleave", kMaxDcpInterleave + 1}}}}},
      {"indexer.max_keys_per_chunk", {{"indexer", {{"max_keys_per_chunk", kMaxIndexerKeys}}}},
       {{"indexer", {{"max_keys_per_chunk", kMaxIndexerKeys + 1}}}}},
      {"indexer.max_requests", {{"indexer", {{"max_requests", kMaxIndexerLimit}}}},
       {{"indexer", {{"max_requests", kMaxIndexerLimit + 1}}}}},
  };
  for (const Bound& b : bounds) {
    SCOPED_TRACE(b.at.dump());
    EXPECT_NO_THROW(deploy::parse_deploy(minimal(b.at), "deploy.json"));
    try {
      deploy::parse_deploy(minimal(b.past), "deploy.json");
      ADD_FAILURE() << "accepted " << b.past.dump();
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), Errc::input) << e.what();
      const std::string leaf = b.field.substr(b.field.rfind('.') + 1);
      EXPECT_NE(std::string(e.what()).find(leaf), std::string::npos) << e.what();
    }
  }
}

}  // namespace
}  // namespace dp::format
