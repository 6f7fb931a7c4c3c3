// Prefill workspace sizing (compiler/indexer/workspace.h) against values worked out by hand from the
// seed's definition:
//   padded = ceil(max_keys / 64) * 64
//   world 1: 2^30 + 68 * (max_keys + padded)
//   world W: local = ceil(max_keys / W) + max_requests * interleave; 2^30 + 68 * ((W + 1) * local + padded)
#include <gtest/gtest.h>

#include "common/json.h"
#include "deploy/deploy.h"
#include "indexer/workspace.h"
#include "../test_util.h"

namespace dp::indexer {
namespace {

constexpr uint64_t GiB = 1073741824;

TEST(IndexerWorkspace, PaddedKeys) {
  EXPECT_EQ(padded_keys(0), 0);
  EXPECT_EQ(padded_keys(1), 64);
  EXPECT_EQ(padded_keys(64), 64);
  EXPECT_EQ(padded_keys(65), 128);
  EXPECT_EQ(padded_keys(6553600), 6553600);  // 102400 pages exactly
}

TEST(IndexerWorkspace, WorldOne) {
  // 4096 keys: padded 4096; 68 * (4096 + 4096) = 68 * 8192 = 557056.
  EXPECT_EQ(prefill_workspace_bytes(4096, 8, 1, 1), GiB + 557056);
  // 100 keys: padded 128; 68 * (100 + 128) = 68 * 228 = 15504.
  EXPECT_EQ(prefill_workspace_bytes(100, 3, 1, 1), GiB + 15504);
  // One key: padded 64; 68 * 65 = 4420.
  EXPECT_EQ(prefill_workspace_bytes(1, 1, 1, 1), GiB + 4420);
  // The default deploy: 6553600 keys, padded the same; 68 * 13107200 = 891289600.
  EXPECT_EQ(prefill_workspace_bytes(6553600, 1024, 1, 1), GiB + 891289600);
  // At world 1 the requests and the interleave do not matter.
  EXPECT_EQ(prefill_workspace_bytes(100, 1000, 1, 64), prefill_workspace_bytes(100, 1, 1, 1));
  EXPECT_EQ(local_keys_bound(100, 1000, 1, 64), 100);
}

TEST(IndexerWorkspace, WorldAboveOne) {
  // 100 keys, 3 requests, W 2, I 4: local = 50 + 3 * 4 = 62; padded 128;
  // 68 * (3 * 62 + 128) = 68 * 314 = 21352.
  EXPECT_EQ(local_keys_bound(100, 3, 2, 4), 62);
  EXPECT_EQ(prefill_workspace_bytes(100, 3, 2, 4), GiB + 21352);
  // 1000 keys, 5 requests, W 3, I 2: local = ceil(1000 / 3) + 10 = 334 + 10 = 344; padded 1024;
  // 68 * (4 * 344 + 1024) = 68 * 2400 = 163200.
  EXPECT_EQ(local_keys_bound(1000, 5, 3, 2), 344);
  EXPECT_EQ(prefill_workspace_bytes(1000, 5, 3, 2), GiB + 163200);
  // 64 keys, 1 request, W 2, I 1: local = 32 + 1 = 33; padded 64; 68 * (3 * 33 + 64) = 68 * 163 = 11084.
  EXPECT_EQ(prefill_workspace_bytes(64, 1, 2, 1), GiB + 11084);
  // 65 keys, 2 requests, W 4, I 16: local = 17 + 32 = 49; padded 128; 68 * (5 * 49 + 128) = 68 * 373 = 25364.
  EXPECT_EQ(prefill_workspace_bytes(65, 2, 4, 16), GiB + 25364);
  // 6553600 keys, 1024 requests, W 8, I 64: local = 819200 + 65536 = 884736; padded 6553600;
  // 68 * (9 * 884736 + 6553600) = 68 * (7962624 + 6553600) = 68 * 14516224 = 987103232.
  EXPECT_EQ(prefill_workspace_bytes(6553600, 1024, 8, 64), GiB + 987103232);
}

TEST(IndexerWorkspace, FromADeployConfig) {
  deploy::Deploy d = deploy::parse_deploy(
      Json{{"targets", {"sm_90a"}}, {"max_num_seqs", 4}, {"tensor_parallel", 4},
           {"dcp", {{"size", 2}, {"interleave", 4}}}, {"indexer", {{"max_keys_per_chunk", 100}, {"max_requests", 3}}}},
      "deploy.json");
  EXPECT_EQ(prefill_workspace_bytes(d), GiB + 21352);  // as WorldAboveOne's first case
  deploy::Deploy def = deploy::load_deploy("default");
  EXPECT_EQ(prefill_workspace_bytes(def), GiB + 891289600);
}

TEST(IndexerWorkspace, BadArgumentsAndOverflowAreRefused) {
  test::expect_error([] { prefill_workspace_bytes(0, 1, 1, 1); }, Errc::input, {"max_keys 0", "at least 1"});
  test::expect_error([] { prefill_workspace_bytes(10, 1, 0, 1); }, Errc::input, {"world 0"});
  test::expect_error([] { local_keys_bound(10, -1, 2, 1); }, Errc::input, {"max_requests -1"});
  test::expect_error([] { prefill_workspace_bytes(int64_t{1} << 62, int64_t{1} << 62, 8, int64_t{1} << 20); },
                     Errc::input, {"overflows"});
}

}  // namespace
}  // namespace dp::indexer
