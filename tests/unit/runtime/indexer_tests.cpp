// The sparse-attention indexer prefill's C API on host-only sessions (decodepack.h "Sparse-attention
// indexer prefill"): the bundle's figures, dp_indexer_prepare's plan and every refusal, and the checks
// dp_indexer_prefill / dp_indexer_write_keys make before any launch. No GPU: device addresses are fake
// (16-byte aligned where they should be valid), nothing is dereferenced, and a fully valid prefill ends
// in DP_ERR_NO_DEVICE.
//
// Expected figures are derived by hand from the rules the headers state:
//   workspace (compiler/indexer/workspace.h): padded = ceil(max_keys / 64) * 64;
//     world 1: 2^30 + 68 * (max_keys + padded)
//     world W: 2^30 + 68 * ((W + 1) * (ceil(max_keys / W) + max_requests * interleave) + padded)
//   DCP placement (decodepack.h, compiler/indexer/geometry.h): a request of len keys holds on rank q
//     base + clamp(len - base * W - q * I, 0, I) keys, base = (len / I / W) * I, in blocks of B keys
//     (B = kv_cache.block_size, 64 by default); block_table_stride must cover the most any rank holds.
//   query chunks: a scoring pass keeps its fp32 logits tile (rows x the set's longest request) within
//     1 GiB; under DCP each rank scores ceil(n / W) of a pass's n rows.
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "decodepack/decodepack.hpp"
#include "runtime_test_util.h"

namespace dp::rttest {
namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;
constexpr int64_t kBlock = 64;  // kv_cache.block_size: the deploy default (none of the deploys below sets it)

// ---- Bundles: kimi-k3-tiny-indexer (8 index heads, top-k 2048), built once per build tree ----------

struct IndexerBundles {
  fs::path w1;       // world 1: indexer.max_keys_per_chunk 4096, max_requests 16
  fs::path dcp2;     // TP 2, dcp.size 2, dcp.interleave 4, same limits
  fs::path big_w1;   // world 1: max_keys_per_chunk 2^22, max_requests 4 (several query chunks per set)
  fs::path big_dcp2; // TP 2, dcp.size 2, interleave 1, the same big limits
  std::string error;
};

IndexerBundles ensure_indexer_bundles() {
  IndexerBundles b;
  const char* prebuilt = std::getenv("DECODEPACK_TEST_WORK");
  const fs::path dir = prebuilt && *prebuilt ? fs::path(prebuilt) : fs::path(DP_RT_TEST_WORK);
  b.w1 = dir / "indexer-w1.dpk";
  b.dcp2 = dir / "indexer-dcp2.dpk";
  b.big_w1 = dir / "indexer-big-w1.dpk";
  b.big_dcp2 = dir / "indexer-big-dcp2.dpk";
  if (prebuilt && *prebuilt) {
    for (const fs::path& p : {b.w1, b.dcp2, b.big_w1, b.big_dcp2})
      if (!fs::exists(p)) b.error = "DECODEPACK_TEST_WORK=" + dir.string() + " lacks " + p.filename().string();
    return b;
  }
  fs::create_directories(dir);
  // The same lock as ensure_bundles (runtime_test_util.h), with a stamp of its own.
  const int lock = ::open((dir / ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  if (lock >= 0) ::flock(lock, LOCK_EX);
  struct stat st {};
  ::stat(DP_CLI_PATH, &st);
  const std::string stamp = std::string(DP_CLI_PATH) + " " + std::to_string(st.st_size) + " " +
                            std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec) +
                            " indexer v1\n";
  const fs::path stamp_file = dir / "indexer-stamp";
  if (!fs::exists(stamp_file) || read_text(stamp_file) != stamp) {
    fs::remove(stamp_file);
    const fs::path cache = dir / "cache", log = dir / "indexer-build.log";
    const struct {
      const fs::path* out;
      const char* name;
      const char* json;
    } builds[] = {
        {&b.w1, "indexer-w1.json",
         R"({"targets": ["sm_90a"], "widths": [1], "indexer": {"max_keys_per_chunk": 4096, "max_requests": 16}})"},
        {&b.dcp2, "indexer-dcp2.json",
         R"({"targets": ["sm_90a"], "widths": [1], "tensor_parallel": 2, "dcp": {"size": 2, "interleave": 4},
             "indexer": {"max_keys_per_chunk": 4096, "max_requests": 16}})"},
        {&b.big_w1, "indexer-big-w1.json",
         R"({"targets": ["sm_90a"], "widths": [1], "indexer": {"max_keys_per_chunk": 4194304, "max_requests": 4}})"},
        {&b.big_dcp2, "indexer-big-dcp2.json",
         R"({"targets": ["sm_90a"], "widths": [1], "tensor_parallel": 2, "dcp": {"size": 2, "interleave": 1},
             "indexer": {"max_keys_per_chunk": 4194304, "max_requests": 4}})"},
    };
    for (const auto& bd : builds) {
      write_text(dir / bd.name, bd.json);
      const int rc = run_cli({"build", "--model", "kimi-k3-tiny-indexer", "--deploy", (dir / bd.name).string(), "-o",
                              bd.out->string(), "--cache-dir", cache.string(), "-j", "2"},
                             log);
      if (rc != 0) {
        b.error = "decodepack build " + bd.out->filename().string() + " failed (exit " + std::to_string(rc) + "):\n" +
                  read_text(log);
        break;
      }
    }
    if (b.error.empty()) write_text(stamp_file, stamp);
  }
  if (lock >= 0) ::close(lock);
  return b;
}

const IndexerBundles& ix() {
  static const IndexerBundles b = ensure_indexer_bundles();
  return b;
}

const Bundles& bundles() {
  static const Bundles b = ensure_bundles();
  return b;
}

// ctest runs Setup.* first (the fixture of every runtime test): the indexer bundles are built there.
TEST(Setup, BuildIndexerBundles) { ASSERT_TRUE(ix().error.empty()) << ix().error; }

// ---- Helpers --------------------------------------------------------------------------------------

// One request set: keys and query rows per request, its (fake) block table and stride.
struct Set {
  std::vector<int64_t> seq, q;
  int64_t stride = 0;
  uint64_t table = 0x7a0000000000ull;
  dp_indexer_requests c() const {
    dp_indexer_requests r;
    r.num_requests = static_cast<int32_t>(seq.size());
    r.seq_lens = seq.data();
    r.query_lens = q.data();
    r.block_table = table;
    r.block_table_stride = stride;
    return r;
  }
};

// The session-independent parts of a prefill: a valid cache and io (fake, aligned addresses).
dp_indexer_cache valid_cache() {
  dp_indexer_cache c;
  dp_indexer_cache_init(&c);
  c.data = 0x7b0000000000ull;
  c.num_blocks = 1000;
  c.block_stride = kBlock * 68;  // 4352: the least a block takes, a multiple of 16
  c.layout = DP_INDEXER_LAYOUT_SPLIT;
  return c;
}

struct Gather {
  int calls = 0;
  static int32_t fn(void* user, uint64_t, uint64_t, uint64_t, dp_stream) {
    ++static_cast<Gather*>(user)->calls;
    return 0;
  }
};

class IndexerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!ix().error.empty()) GTEST_FAIL() << ix().error;
  }
  void TearDown() override {
    for (dp_indexer_metadata* m : metadata_) dp_indexer_metadata_free(m);  // before their sessions
    for (dp_session* s : sessions_) dp_session_destroy(s);
    for (dp_bundle* b : bundles_) dp_bundle_close(b);
  }

  dp_bundle* open(const fs::path& p) {
    dp_bundle* b = nullptr;
    const Outcome o = outcome(dp_bundle_open(p.c_str(), nullptr, &b));
    EXPECT_TRUE(o.ok()) << o.message;
    if (b) bundles_.push_back(b);
    return b;
  }
  dp_session* session(dp_bundle* b, int32_t rank = 0) {
    dp_session_options so = host_options(rank);
    dp_session* s = nullptr;
    const Outcome o = outcome(dp_session_create(b, &so, &s));
    EXPECT_TRUE(o.ok()) << o.message;
    if (s) sessions_.push_back(s);
    return s;
  }
  dp_bundle_info info(dp_bundle* b) {
    dp_bundle_info i;
    std::memset(&i, 0, sizeof(i));
    i.size = sizeof(i);
    const Outcome o = outcome(dp_bundle_get_info(b, &i));
    EXPECT_TRUE(o.ok()) << o.message;
    return i;
  }

  // dp_indexer_prepare over `sets`; the metadata (if any) is freed at teardown.
  dp_status* prepare(dp_session* s, const std::vector<Set>& sets, int32_t rank = 0, dp_indexer_plan_info* pi = nullptr,
                     dp_indexer_metadata** out = nullptr) {
    std::vector<dp_indexer_requests> reqs;
    for (const Set& set : sets) reqs.push_back(set.c());
    dp_indexer_batch_desc d;
    dp_indexer_batch_desc_init(&d);
    d.num_sets = static_cast<int32_t>(reqs.size());
    d.sets = reqs.data();
    d.dcp_rank = rank;
    dp_indexer_metadata* md = reinterpret_cast<dp_indexer_metadata*>(0x1);  // must be cleared or set
    dp_status* st = dp_indexer_prepare(s, &d, &md, pi);
    if (st) {
      EXPECT_EQ(md, nullptr) << "*out must be NULL after a failure";
    }
    if (md && md != reinterpret_cast<dp_indexer_metadata*>(0x1)) metadata_.push_back(md);
    if (out) *out = st ? nullptr : md;
    return st;
  }
  // The plan of a batch that must be accepted.
  dp_indexer_plan_info plan(dp_session* s, const std::vector<Set>& sets, int32_t rank = 0,
                            dp_indexer_metadata** out = nullptr) {
    dp_indexer_plan_info pi;
    dp_indexer_plan_info_init(&pi);
    DP_EXPECT_OK(prepare(s, sets, rank, &pi, out));
    return pi;
  }

  dp_indexer_prefill_io valid_io(dp_bundle* b) {
    dp_indexer_prefill_io io;
    dp_indexer_prefill_io_init(&io);
    io.q = 0x7c0000000000ull;
    io.weights = 0x7c1000000000ull;
    io.out = 0x7c2000000000ull;
    io.workspace = 0x7c3000000000ull;
    io.workspace_bytes = info(b).indexer_prefill_workspace_bytes;
    return io;
  }

  std::vector<dp_bundle*> bundles_;
  std::vector<dp_session*> sessions_;
  std::vector<dp_indexer_metadata*> metadata_;
};

// The example batch: 2 sets, {seq 1, 37, 300; q 1, 37, 5} and {seq 64; q 64}: 43 + 64 rows, 338 + 64 keys.
// World 1: the 300-key request needs ceil(300 / 64) = 5 block-table entries, the 64-key one 1.
std::vector<Set> example(int64_t stride0 = 5, int64_t stride1 = 1) {
  return {Set{{1, 37, 300}, {1, 37, 5}, stride0}, Set{{64}, {64}, stride1, 0x7a0000100000ull}};
}

// ---- Codes and structs ----------------------------------------------------------------------------

TEST(IndexerCodes, CommunicatorHasItsName) {
  EXPECT_EQ(DP_ERR_COMMUNICATOR, 27);
  EXPECT_STREQ(dp_code_name(DP_ERR_COMMUNICATOR), "DP_ERR_COMMUNICATOR");
  EXPECT_STREQ(dp_code_name(DP_ERR_COMMUNICATOR + 1), "DP_ERR_NCCL_UNAVAILABLE");  // the next code, 28
  EXPECT_STREQ(dp_code_name(DP_ERR_NCCL_UNAVAILABLE + 1), "DP_ERR_?");
  EXPECT_STREQ(dp_code_name(DP_ERR_INTERNAL), "DP_ERR_INTERNAL");  // the table did not shift
}

TEST(IndexerStructs, InitFunctionsSetSizeAndDefaults) {
  dp_indexer_cache c;
  std::memset(&c, 0xAB, sizeof(c));
  dp_indexer_cache_init(&c);
  EXPECT_EQ(c.size, sizeof(c));
  EXPECT_EQ(c.data, 0u);
  EXPECT_EQ(c.num_blocks, 0);
  EXPECT_EQ(c.block_stride, 0);
  EXPECT_EQ(c.layout, DP_INDEXER_LAYOUT_SPLIT);

  dp_indexer_batch_desc d;
  std::memset(&d, 0xAB, sizeof(d));
  dp_indexer_batch_desc_init(&d);
  EXPECT_EQ(d.size, sizeof(d));
  EXPECT_EQ(d.num_sets, 0);
  EXPECT_EQ(d.sets, nullptr);
  EXPECT_EQ(d.dcp_rank, 0);

  dp_indexer_plan_info p;
  std::memset(&p, 0xAB, sizeof(p));
  dp_indexer_plan_info_init(&p);
  EXPECT_EQ(p.size, sizeof(p));
  EXPECT_EQ(p.rows, 0);
  EXPECT_EQ(p.query_chunks, 0);

  dp_indexer_prefill_io io;
  std::memset(&io, 0xAB, sizeof(io));
  dp_indexer_prefill_io_init(&io);
  EXPECT_EQ(io.size, sizeof(io));
  EXPECT_EQ(io.weight_scale, 1.0f);  // "factor on every score (default 1)"
  EXPECT_EQ(io.q, 0u);
  EXPECT_EQ(io.workspace_bytes, 0u);
  EXPECT_EQ(io.all_gather, nullptr);
  EXPECT_EQ(io.all_gather_user, nullptr);

  dp_indexer_cache_init(nullptr);  // NULL is ignored, like the other _init functions
  dp_indexer_metadata_free(nullptr);
}

// ---- Bundle figures -------------------------------------------------------------------------------

TEST_F(IndexerTest, BundleInfoReportsTheIndexerAndItsWorkspace) {
  const dp_bundle_info w1 = info(open(ix().w1));
  EXPECT_EQ(w1.format_major, 1);
  EXPECT_EQ(w1.format_minor, 7);  // K3: its final norm is an attnres kernel (1.7); indexer kernels since 1.2
  EXPECT_STREQ(w1.model_type, "kimi_k3");
  EXPECT_EQ(w1.indexer_heads, 8);
  EXPECT_EQ(w1.indexer_top_k, 2048);
  // World 1, max_keys 4096: padded = 4096.
  EXPECT_EQ(w1.indexer_prefill_workspace_bytes, kGiB + 68 * (4096 + 4096));

  const dp_bundle_info d2 = info(open(ix().dcp2));
  EXPECT_EQ(d2.indexer_heads, 8);
  EXPECT_EQ(d2.indexer_top_k, 2048);
  EXPECT_EQ(d2.tensor_parallel, 2);
  // W 2, interleave 4, 16 requests: local = ceil(4096 / 2) + 16 * 4.
  EXPECT_EQ(d2.indexer_prefill_workspace_bytes, kGiB + 68 * ((2 + 1) * (2048 + 16 * 4) + 4096));

  // 2^22 keys, 4 requests: world 1, and W 2 interleave 1 (local = 2^21 + 4).
  EXPECT_EQ(info(open(ix().big_w1)).indexer_prefill_workspace_bytes, kGiB + 68 * (uint64_t{2} << 22));
  EXPECT_EQ(info(open(ix().big_dcp2)).indexer_prefill_workspace_bytes,
            kGiB + 68 * (3 * ((uint64_t{1} << 21) + 4) + (uint64_t{1} << 22)));
}

TEST_F(IndexerTest, ABundleWithoutAnIndexerRefuses) {
  if (!bundles().error.empty()) GTEST_FAIL() << bundles().error;
  dp_bundle* b = open(bundles().tiny);  // kimi-linear-tiny: no indexer
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(info(b).indexer_heads, 0);
  dp_session* s = session(b);
  ASSERT_NE(s, nullptr);
  DP_EXPECT_STATUS(prepare(s, example()), DP_ERR_NOT_SUPPORTED, "dp_indexer_prepare", "no sparse-attention indexer");
  const dp_indexer_cache c = valid_cache();
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &c, 0x7d0000000000ull, 0x7d1000000000ull, 4, nullptr),
                   DP_ERR_NOT_SUPPORTED, "dp_indexer_write_keys", "no sparse-attention indexer");
}

// ---- dp_indexer_prepare: the plan -----------------------------------------------------------------

TEST_F(IndexerTest, PrepareAcceptsAValidBatch) {
  dp_session* s = session(open(ix().w1));
  ASSERT_NE(s, nullptr);
  dp_indexer_metadata* md = nullptr;
  const dp_indexer_plan_info pi = plan(s, example(), 0, &md);
  EXPECT_NE(md, nullptr);
  EXPECT_EQ(pi.size, sizeof(pi));
  EXPECT_EQ(pi.rows, 43 + 64);
  EXPECT_EQ(pi.sets, 2);
  EXPECT_EQ(pi.keys, 338 + 64);
  // Each set's rows fit one tile: 300 keys x 4 bytes per row, far below 1 GiB.
  EXPECT_EQ(pi.query_chunks, 2);
  // The metadata holds at least each row's request and position (int32).
  EXPECT_GE(pi.device_bytes, uint64_t{8} * (43 + 64));

  // info may be NULL.
  DP_EXPECT_OK(prepare(s, example(), 0, nullptr));
  // A longer block-table row is fine; so are query_len 0 (no rows) and a set of exactly the limits:
  // 16 requests holding 4096 keys.
  std::vector<Set> edge = example(8, 3);
  edge.push_back(Set{{10, 5}, {0, 5}, 1});
  edge.push_back(Set{std::vector<int64_t>(16, 256), std::vector<int64_t>(16, 1), 4});
  const dp_indexer_plan_info e = plan(s, edge);
  EXPECT_EQ(e.sets, 4);
  EXPECT_EQ(e.rows, 43 + 64 + 5 + 16);
  EXPECT_EQ(e.keys, 338 + 64 + 15 + 4096);
  EXPECT_EQ(e.query_chunks, 4);

  // A set whose requests have no query rows needs no scoring pass.
  const dp_indexer_plan_info none = plan(s, {Set{{10, 20}, {0, 0}, 1}});
  EXPECT_EQ(none.rows, 0);
  EXPECT_EQ(none.keys, 30);
  EXPECT_EQ(none.query_chunks, 0);
}

TEST_F(IndexerTest, PlanInfoRespectsTheCallersSize) {
  dp_session* s = session(open(ix().w1));
  ASSERT_NE(s, nullptr);
  // An older caller's dp_indexer_plan_info ended before `keys`: nothing past it may be written.
  unsigned char raw[sizeof(dp_indexer_plan_info)];
  std::memset(raw, 0xAB, sizeof(raw));
  auto* pi = reinterpret_cast<dp_indexer_plan_info*>(raw);
  pi->size = offsetof(dp_indexer_plan_info, keys);
  DP_EXPECT_OK(prepare(s, example(), 0, pi));
  EXPECT_EQ(pi->size, offsetof(dp_indexer_plan_info, keys));
  EXPECT_EQ(pi->rows, 107);
  EXPECT_EQ(pi->sets, 2);
  EXPECT_EQ(pi->query_chunks, 2);
  for (size_t k = offsetof(dp_indexer_plan_info, keys); k < sizeof(raw); ++k) ASSERT_EQ(raw[k], 0xAB) << k;
  pi->size = 0;
  DP_EXPECT_STATUS(prepare(s, example(), 0, pi), DP_ERR_INVALID_ARGUMENT, "info->size is 0");
}

TEST_F(IndexerTest, QueryChunksKeepTheLogitsTileWithinOneGiB) {
  // World 1: rows of a 300000-key request: floor(2^30 / (4 * 300000)) = 894 per tile.
  dp_session* s = session(open(ix().big_w1));
  ASSERT_NE(s, nullptr);
  const int64_t stride = 300000 / kBlock + 1;  // ceil(300000 / 64) = 4688
  EXPECT_EQ(plan(s, {Set{{300000}, {894}, stride}}).query_chunks, 1);
  EXPECT_EQ(plan(s, {Set{{300000}, {895}, stride}}).query_chunks, 2);
  EXPECT_EQ(plan(s, {Set{{300000}, {894}, stride}, Set{{300000}, {895}, stride}}).query_chunks, 3);
  // The tile's row length is the set's longest request, whatever request a row belongs to.
  EXPECT_EQ(plan(s, {Set{{300000, 1000}, {0, 895}, stride}}).query_chunks, 2);
  EXPECT_EQ(plan(s, {Set{{1000}, {895}, 16}}).query_chunks, 1);
  // 10^6 keys: 268 rows per tile, 1000 rows need 4 passes.
  EXPECT_EQ(plan(s, {Set{{1000000}, {1000}, 1000000 / kBlock + 1}}).query_chunks, 4);

  // W 2: each rank scores ceil(n / 2) rows of a pass, so a pass takes 2 x 894 rows.
  dp_bundle* d = open(ix().big_dcp2);
  for (int32_t rank : {0, 1}) {
    SCOPED_TRACE(rank);
    dp_session* r = session(d, rank);
    ASSERT_NE(r, nullptr);
    // interleave 1, 2 ranks: 150000 keys each, ceil(150000 / 64) = 2344 blocks.
    EXPECT_EQ(plan(r, {Set{{300000}, {1788}, 2344}}, rank).query_chunks, 1);
    EXPECT_EQ(plan(r, {Set{{300000}, {1789}, 2344}}, rank).query_chunks, 2);
  }
}

TEST_F(IndexerTest, RequestsLongerThanTheScoringGridArePlanned) {
  // idx_score takes 32 keys per block on a grid of at most 65535 blocks in y and loops over the key blocks
  // beyond that, so a request of more than 65535 x 32 = 2097120 keys is planned like any other.
  dp_session* s = session(open(ix().big_w1));
  ASSERT_NE(s, nullptr);
  // ceil(2097121 / 64) = 32768 block-table entries; 4 << 20 keys need 65536.
  DP_EXPECT_OK(prepare(s, {Set{{2097121}, {1}, 32768}}));
  DP_EXPECT_OK(prepare(s, {Set{{4 << 20}, {1}, 65536}}));
  DP_EXPECT_STATUS(prepare(s, {Set{{4 << 20}, {1}, 65535}}), DP_ERR_SHAPE, "block_table_stride 65535",
                   "expected at least 65536");
}

TEST_F(IndexerTest, PrepareUnderDcpPlansTheSameRowsOnEveryRank) {
  dp_bundle* b = open(ix().dcp2);
  ASSERT_NE(b, nullptr);
  dp_indexer_plan_info w1 = plan(session(open(ix().w1)), example());
  for (int32_t rank : {0, 1}) {
    SCOPED_TRACE(rank);
    dp_session* s = session(b, rank);
    ASSERT_NE(s, nullptr);
    // W 2, I 4: 300 keys -> base (300 / 4 / 2) * 4 = 148; rank 0 holds 148 + 4 = 152 (3 blocks of 64),
    // rank 1 148 (3 blocks). The 64-key request: 32 on each (1 block).
    const dp_indexer_plan_info pi = plan(s, example(3, 1), rank);
    EXPECT_EQ(pi.rows, 107);  // every rank ends with the whole output
    EXPECT_EQ(pi.sets, 2);
    EXPECT_EQ(pi.keys, 402);
    EXPECT_EQ(pi.query_chunks, 2);
    // The selected rows of every rank are all-gathered into metadata memory (the workspace figure has no
    // room for them): at least rows x top_k int32.
    EXPECT_GE(pi.device_bytes, uint64_t{107} * 2048 * 4);
    EXPECT_GT(pi.device_bytes, w1.device_bytes);
    DP_EXPECT_STATUS(prepare(s, example(2, 1), rank), DP_ERR_SHAPE, "sets[0]", "block_table_stride 2",
                     "expected at least 3");
    // 260 keys: base (260 / 4 / 2) * 4 = 128; rank 0 holds 132 (3 blocks), rank 1 128 (2 blocks). The
    // stride covers the most any rank holds, whichever rank asks.
    DP_EXPECT_OK(prepare(s, {Set{{260}, {1}, 3}}, rank));
    DP_EXPECT_STATUS(prepare(s, {Set{{260}, {1}, 2}}, rank), DP_ERR_SHAPE, "block_table_stride 2",
                     "expected at least 3");
    // 256 keys: 128 on each rank, exactly 2 blocks.
    DP_EXPECT_OK(prepare(s, {Set{{256}, {1}, 2}}, rank));
  }
  dp_session* s = session(b, 0);
  DP_EXPECT_STATUS(prepare(s, example(3, 1), 2), DP_ERR_RANK, "dcp_rank 2", "0..1");
  DP_EXPECT_STATUS(prepare(s, example(3, 1), -1), DP_ERR_RANK, "dcp_rank -1");
}

// ---- dp_indexer_prepare: refusals -----------------------------------------------------------------

TEST_F(IndexerTest, PrepareRefusesWhatTheWorkspaceCannotHold) {
  dp_session* s = session(open(ix().w1));
  ASSERT_NE(s, nullptr);
  // Keys: 4096 fit (above), 4097 do not, in one request or over several.
  DP_EXPECT_OK(prepare(s, {Set{{4000, 96}, {1, 1}, 64}}));
  DP_EXPECT_STATUS(prepare(s, {Set{{4000, 97}, {1, 1}, 64}}), DP_ERR_SHAPE, "sets[0]", "4097 keys",
                   "beyond the workspace", "4096");
  DP_EXPECT_STATUS(prepare(s, {Set{{4097}, {1}, 65}}), DP_ERR_SHAPE, "4097 keys", "beyond the workspace", "4096");
  // The limit is per set: the second set names itself.
  DP_EXPECT_STATUS(prepare(s, {Set{{4000}, {1}, 63}, Set{{4000, 100}, {1, 1}, 63}}), DP_ERR_SHAPE, "sets[1]",
                   "beyond the workspace");
  // Requests: 16 fit, 17 do not; nor do 0.
  DP_EXPECT_STATUS(prepare(s, {Set{std::vector<int64_t>(17, 1), std::vector<int64_t>(17, 1), 1}}), DP_ERR_SHAPE,
                   "sets[0]", "num_requests 17", "1..16");
  DP_EXPECT_STATUS(prepare(s, {Set{{}, {}, 1}}), DP_ERR_SHAPE, "num_requests 0");
}

TEST_F(IndexerTest, PrepareRefusesBadRequests) {
  dp_session* s = session(open(ix().w1));
  ASSERT_NE(s, nullptr);
  DP_EXPECT_STATUS(prepare(s, {Set{{5, 0}, {1, 0}, 1}}), DP_ERR_SHAPE, "sets[0]", "request 1", "seq_len 0");
  DP_EXPECT_STATUS(prepare(s, {Set{{-3}, {0}, 1}}), DP_ERR_SHAPE, "request 0", "seq_len -3");
  DP_EXPECT_STATUS(prepare(s, {Set{{5}, {6}, 1}}), DP_ERR_SHAPE, "request 0", "query_len 6", "seq_len 5");
  DP_EXPECT_STATUS(prepare(s, {Set{{5}, {-1}, 1}}), DP_ERR_SHAPE, "query_len -1");
  DP_EXPECT_OK(prepare(s, {Set{{5}, {5}, 1}}));  // every position a query row
  // Block tables: world 1, B = 64: 300 keys need 5 entries, 64 keys 1, 65 keys 2.
  DP_EXPECT_STATUS(prepare(s, example(4, 1)), DP_ERR_SHAPE, "sets[0]", "block_table_stride 4", "expected at least 5");
  DP_EXPECT_STATUS(prepare(s, example(5, 0)), DP_ERR_SHAPE, "sets[1]", "block_table_stride 0", "expected at least 1");
  DP_EXPECT_STATUS(prepare(s, {Set{{65}, {1}, 1}}), DP_ERR_SHAPE, "block_table_stride 1", "expected at least 2");
  Set mis{{64}, {1}, 1, 0x7a0000000008ull};
  DP_EXPECT_STATUS(prepare(s, {mis}), DP_ERR_ALIGNMENT, "sets[0]", "block_table", "0x7a0000000008", "16");
  DP_EXPECT_STATUS(prepare(s, {Set{{64}, {1}, 1}, Set{{64}, {1}, 1, 0x7a0000000004ull}}), DP_ERR_ALIGNMENT, "sets[1]",
                   "block_table");
  Set zero{{64}, {1}, 1, 0};
  DP_EXPECT_STATUS(prepare(s, {zero}), DP_ERR_INVALID_ARGUMENT, "block_table is 0");
}

TEST_F(IndexerTest, PrepareRefusesBadArguments) {
  dp_session* s = session(open(ix().w1));
  ASSERT_NE(s, nullptr);
  // dcp_rank at world 1: only 0.
  DP_EXPECT_STATUS(prepare(s, example(), 1), DP_ERR_RANK, "dcp_rank 1", "0..0");
  DP_EXPECT_STATUS(prepare(s, example(), -1), DP_ERR_RANK, "dcp_rank -1");
  DP_EXPECT_STATUS(prepare(s, {}), DP_ERR_INVALID_ARGUMENT, "num_sets 0");

  std::vector<Set> sets = example();
  std::vector<dp_indexer_requests> reqs = {sets[0].c(), sets[1].c()};
  dp_indexer_batch_desc d;
  dp_indexer_batch_desc_init(&d);
  d.num_sets = 2;
  d.sets = reqs.data();
  dp_indexer_metadata* md = nullptr;
  DP_EXPECT_STATUS(dp_indexer_prepare(nullptr, &d, &md, nullptr), DP_ERR_INVALID_ARGUMENT, "session is NULL");
  DP_EXPECT_STATUS(dp_indexer_prepare(s, nullptr, &md, nullptr), DP_ERR_INVALID_ARGUMENT, "desc is NULL");
  DP_EXPECT_STATUS(dp_indexer_prepare(s, &d, nullptr, nullptr), DP_ERR_INVALID_ARGUMENT, "out is NULL");
  d.sets = nullptr;
  DP_EXPECT_STATUS(dp_indexer_prepare(s, &d, &md, nullptr), DP_ERR_INVALID_ARGUMENT, "num_sets 2", "NULL");
  EXPECT_EQ(md, nullptr);
  d.sets = reqs.data();
  reqs[1].seq_lens = nullptr;
  DP_EXPECT_STATUS(dp_indexer_prepare(s, &d, &md, nullptr), DP_ERR_INVALID_ARGUMENT, "sets[1]", "NULL");
  reqs[1] = sets[1].c();
  reqs[0].query_lens = nullptr;
  DP_EXPECT_STATUS(dp_indexer_prepare(s, &d, &md, nullptr), DP_ERR_INVALID_ARGUMENT, "sets[0]", "NULL");
  reqs[0] = sets[0].c();

  // The versioned struct's size.
  d.size = 0;
  DP_EXPECT_STATUS(dp_indexer_prepare(s, &d, &md, nullptr), DP_ERR_INVALID_ARGUMENT, "dp_indexer_batch_desc.size is 0");
  EXPECT_EQ(md, nullptr);
  // An older caller's struct ended before dcp_rank: whatever lies past its size is not read (rank 0).
  d.size = offsetof(dp_indexer_batch_desc, dcp_rank);
  d.dcp_rank = 5;
  DP_EXPECT_OK(dp_indexer_prepare(s, &d, &md, nullptr));
  ASSERT_NE(md, nullptr);
  dp_indexer_metadata_free(md);
  md = nullptr;
  // A newer caller's longer struct: accepted when the unknown tail is zero.
  struct Longer {
    dp_indexer_batch_desc d;
    uint64_t future;
  } l;
  std::memset(&l, 0, sizeof(l));
  dp_indexer_batch_desc_init(&l.d);
  l.d.size = sizeof(l);
  l.d.num_sets = 2;
  l.d.sets = reqs.data();
  DP_EXPECT_OK(dp_indexer_prepare(s, &l.d, &md, nullptr));
  ASSERT_NE(md, nullptr);
  dp_indexer_metadata_free(md);
  md = nullptr;
  l.future = 1;
  DP_EXPECT_STATUS(dp_indexer_prepare(s, &l.d, &md, nullptr), DP_ERR_INVALID_ARGUMENT, "dp_indexer_batch_desc.size is",
                   "sets fields it does not implement");
  EXPECT_EQ(md, nullptr);
}

// ---- dp_indexer_prefill: checks before any launch -------------------------------------------------

TEST_F(IndexerTest, PrefillChecksItsBuffersThenNeedsADevice) {
  dp_bundle* b = open(ix().w1);
  dp_session* s = session(b);
  ASSERT_NE(s, nullptr);
  dp_indexer_metadata* md = nullptr;
  plan(s, example(), 0, &md);
  ASSERT_NE(md, nullptr);
  const dp_indexer_cache cache = valid_cache();
  const dp_indexer_prefill_io good = valid_io(b);
  ASSERT_EQ(good.workspace_bytes, kGiB + 68 * (4096 + 4096));

  // Everything valid (world 1 needs no all_gather): host-only.
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &cache, &good, nullptr), DP_ERR_NO_DEVICE, "dp_indexer_prefill", "host-only");
  dp_indexer_cache packed = cache;
  packed.layout = DP_INDEXER_LAYOUT_PACKED;
  packed.block_stride = 8192;  // merged pages: more than block_size x 68 is fine
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &packed, &good, nullptr), DP_ERR_NO_DEVICE);
  dp_indexer_prefill_io io = good;
  io.workspace_bytes = good.workspace_bytes + 4096;
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &cache, &io, nullptr), DP_ERR_NO_DEVICE);

  // Misaligned and missing buffers, each named.
  for (const auto& [field, member] : {std::pair{"io.q", &dp_indexer_prefill_io::q},
                                      {"io.weights", &dp_indexer_prefill_io::weights},
                                      {"io.out", &dp_indexer_prefill_io::out},
                                      {"io.workspace", &dp_indexer_prefill_io::workspace}}) {
    SCOPED_TRACE(field);
    io = good;
    io.*member += 8;
    DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &cache, &io, nullptr), DP_ERR_ALIGNMENT, field, "16");
    io.*member = 0;
    DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &cache, &io, nullptr), DP_ERR_INVALID_ARGUMENT, field, "is 0");
  }
  // A workspace below the bundle's figure.
  io = good;
  io.workspace_bytes = good.workspace_bytes - 1;
  const std::string given = std::to_string(good.workspace_bytes - 1), figure = std::to_string(good.workspace_bytes);
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &cache, &io, nullptr), DP_ERR_SHAPE, "io.workspace_bytes", given.c_str(),
                   figure.c_str());

  // The cache (B = 64: at least 4352 bytes per block, a multiple of 16).
  dp_indexer_cache c = cache;
  c.block_stride = 4336;
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &c, &good, nullptr), DP_ERR_LAYOUT, "cache.block_stride 4336", "4352");
  c.block_stride = 4360;
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &c, &good, nullptr), DP_ERR_ALIGNMENT, "cache.block_stride 4360", "16");
  c = cache;
  c.layout = 7;
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &c, &good, nullptr), DP_ERR_INVALID_ARGUMENT, "cache.layout 7");
  c = cache;
  c.num_blocks = 0;
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &c, &good, nullptr), DP_ERR_SHAPE, "cache.num_blocks 0");
  c.num_blocks = int64_t{1} << 31;
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &c, &good, nullptr), DP_ERR_SHAPE, "cache.num_blocks 2147483648");
  c = cache;
  c.data += 4;
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &c, &good, nullptr), DP_ERR_ALIGNMENT, "cache.data");
  c.data = 0;
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &c, &good, nullptr), DP_ERR_INVALID_ARGUMENT, "cache.data is 0");

  // NULLs and versioned sizes.
  DP_EXPECT_STATUS(dp_indexer_prefill(nullptr, md, &cache, &good, nullptr), DP_ERR_INVALID_ARGUMENT, "session is NULL");
  DP_EXPECT_STATUS(dp_indexer_prefill(s, nullptr, &cache, &good, nullptr), DP_ERR_INVALID_ARGUMENT, "metadata is NULL");
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, nullptr, &good, nullptr), DP_ERR_INVALID_ARGUMENT, "cache is NULL");
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &cache, nullptr, nullptr), DP_ERR_INVALID_ARGUMENT, "io is NULL");
  io = good;
  io.size = 0;
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &cache, &io, nullptr), DP_ERR_INVALID_ARGUMENT,
                   "dp_indexer_prefill_io.size is 0");
  c = cache;
  c.size = 4;
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &c, &good, nullptr), DP_ERR_INVALID_ARGUMENT, "dp_indexer_cache.size is 4");

  // Metadata belongs to the session that prepared it.
  dp_session* other = session(b);
  ASSERT_NE(other, nullptr);
  DP_EXPECT_STATUS(dp_indexer_prefill(other, md, &cache, &good, nullptr), DP_ERR_INVALID_ARGUMENT, "another session");
}

TEST_F(IndexerTest, PrefillUnderDcpNeedsTheHostsAllGather) {
  dp_bundle* b = open(ix().dcp2);
  dp_session* s = session(b, 1);
  ASSERT_NE(s, nullptr);
  dp_indexer_metadata* md = nullptr;
  plan(s, example(3, 1), 1, &md);
  ASSERT_NE(md, nullptr);
  const dp_indexer_cache cache = valid_cache();
  dp_indexer_prefill_io io = valid_io(b);
  ASSERT_EQ(io.workspace_bytes, kGiB + 68 * ((2 + 1) * (2048 + 16 * 4) + 4096));
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &cache, &io, nullptr), DP_ERR_INVALID_ARGUMENT, "io.all_gather is NULL",
                   "dcp.size is 2");
  // The world-1 figure is too small here.
  io.workspace_bytes = kGiB + 68 * (4096 + 4096);
  Gather g;
  io.all_gather = &Gather::fn;
  io.all_gather_user = &g;
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &cache, &io, nullptr), DP_ERR_SHAPE, "io.workspace_bytes");
  io.workspace_bytes = info(b).indexer_prefill_workspace_bytes;
  DP_EXPECT_STATUS(dp_indexer_prefill(s, md, &cache, &io, nullptr), DP_ERR_NO_DEVICE, "host-only");
  EXPECT_EQ(g.calls, 0) << "the communicator was called before the checks finished";
}

// ---- dp_indexer_write_keys ------------------------------------------------------------------------

TEST_F(IndexerTest, WriteKeysChecksTheCacheAndBuffers) {
  dp_session* s = session(open(ix().w1));
  ASSERT_NE(s, nullptr);
  const dp_indexer_cache cache = valid_cache();
  const uint64_t keys = 0x7d0000000000ull, slots = 0x7d1000000000ull;
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &cache, keys, slots, 37, nullptr), DP_ERR_NO_DEVICE, "host-only");
  DP_EXPECT_OK(dp_indexer_write_keys(s, &cache, keys, slots, 0, nullptr));  // nothing to write
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &cache, keys, slots, -1, nullptr), DP_ERR_SHAPE, "count -1");
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &cache, keys + 8, slots, 37, nullptr), DP_ERR_ALIGNMENT, "keys");
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &cache, keys, slots + 8, 37, nullptr), DP_ERR_ALIGNMENT, "slot_mapping");
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &cache, 0, slots, 37, nullptr), DP_ERR_INVALID_ARGUMENT, "keys is 0");
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &cache, keys, 0, 37, nullptr), DP_ERR_INVALID_ARGUMENT, "slot_mapping is 0");

  dp_indexer_cache c = cache;
  c.block_stride = kBlock * 68 - 16;
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &c, keys, slots, 37, nullptr), DP_ERR_LAYOUT, "dp_indexer_write_keys",
                   "cache.block_stride 4336", "4352");
  c.block_stride = kBlock * 68 + 4;
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &c, keys, slots, 37, nullptr), DP_ERR_ALIGNMENT, "cache.block_stride 4356");
  c = cache;
  c.layout = 7;
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &c, keys, slots, 37, nullptr), DP_ERR_INVALID_ARGUMENT, "cache.layout 7");
  c.layout = -1;
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &c, keys, slots, 37, nullptr), DP_ERR_INVALID_ARGUMENT, "cache.layout -1");
  c = cache;
  c.num_blocks = 0;
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &c, keys, slots, 37, nullptr), DP_ERR_SHAPE, "cache.num_blocks 0");
  c = cache;
  c.data = 0x7b0000000008ull;
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &c, keys, slots, 37, nullptr), DP_ERR_ALIGNMENT, "cache.data");
  // The cache is checked even when there is nothing to write.
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &c, keys, slots, 0, nullptr), DP_ERR_ALIGNMENT, "cache.data");

  DP_EXPECT_STATUS(dp_indexer_write_keys(nullptr, &cache, keys, slots, 37, nullptr), DP_ERR_INVALID_ARGUMENT,
                   "session is NULL");
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, nullptr, keys, slots, 37, nullptr), DP_ERR_INVALID_ARGUMENT, "cache is NULL");
  c = cache;
  c.size = 0;
  DP_EXPECT_STATUS(dp_indexer_write_keys(s, &c, keys, slots, 37, nullptr), DP_ERR_INVALID_ARGUMENT,
                   "dp_indexer_cache.size is 0");
}

}  // namespace
TEST(IndexerCxx, WrapperPlansAndThrows) {
  // decodepack.hpp: the same calls with RAII metadata and exceptions carrying the code.
  decodepack::Bundle b = decodepack::Bundle::open(ix().w1.string());
  decodepack::SessionOptions o;
  o.c.device = DP_DEVICE_NONE;
  decodepack::Session s(b, o);
  std::vector<int64_t> seq{1, 37, 300}, q{1, 37, 5};
  const std::vector<dp_indexer_requests> sets{
      {3, seq.data(), q.data(), 0x7a0000000000ull, 5}};  // 300 keys in 64-key blocks: 5 entries
  decodepack::IndexerMetadata md = s.indexer_prepare(sets);
  EXPECT_EQ(md.info().rows, 43);
  EXPECT_EQ(md.info().keys, 338);
  dp_indexer_cache c = valid_cache();
  dp_indexer_prefill_io io;
  dp_indexer_prefill_io_init(&io);
  io.q = io.weights = io.out = io.workspace = 0x7c0000000000ull;
  io.workspace_bytes = uint64_t{1} << 40;
  try {
    s.indexer_prefill(md, c, io, nullptr);
    ADD_FAILURE() << "a host-only session ran a prefill";
  } catch (const decodepack::Error& e) {
    EXPECT_EQ(e.code(), DP_ERR_NO_DEVICE) << e.what();
  }
  std::vector<dp_indexer_requests> too_short = sets;
  too_short[0].block_table_stride = 4;
  try {
    s.indexer_prepare(too_short);
    ADD_FAILURE() << "a block table of 4 entries was accepted for 300 keys";
  } catch (const decodepack::Error& e) {
    EXPECT_EQ(e.code(), DP_ERR_SHAPE);
    EXPECT_NE(std::string(e.what()).find("block_table_stride 4, expected at least 5"), std::string::npos) << e.what();
  }
}

}  // namespace dp::rttest
