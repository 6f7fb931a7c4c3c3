// The continuous-batching host logic of `decodepack generate` (tooling/batcher.h), without a GPU: joins,
// leaves, width changes, padding rows, slot and block assignment, and the prompts file reader.
#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include "../test_util.h"
#include "decodepack/decodepack.h"
#include "tooling/batcher.h"

namespace dp::tools {
namespace {

// A fake model for the steps: row results are a function of (request's input token, position), so a
// test can tell which request ran in which row.
std::vector<RowResult> results_for(const BatchStep& s) {
  std::vector<RowResult> out(static_cast<size_t>(s.width));
  for (int r = 0; r < s.width; ++r)
    out[static_cast<size_t>(r)] = {static_cast<int32_t>(s.request[r] < 0 ? 999 : 100 * (s.request[r] + 1) + s.positions[r]),
                                   0.5f};
  return out;
}

TEST(Batcher, SizingCoversEveryFedTokenOfEveryRequest) {
  // Fed tokens: prompt + max_new - 1 = 3 + 4 - 1 = 6 -> 2 blocks of 4; 1 + 1 - 1 = 1 -> 1 block.
  const BatchSizing s = batch_sizing({{{1, 2, 3}, 4}, {{7}, 1}}, 4);
  EXPECT_EQ(s.slots, 3);   // the null slot + one per request
  EXPECT_EQ(s.blocks, 4);  // the null block + 2 + 1
  EXPECT_EQ(s.cols, 2);
}

TEST(Batcher, PrefillThenGenerationFeedsPromptThenGeneratedTokens) {
  Batcher b({1, 2, 4}, 0, 2, 3, 2, 4);
  const int id = b.join({{11, 12, 13}, 3});
  EXPECT_EQ(id, 0);
  EXPECT_EQ(b.slot_of(id), 1);
  EXPECT_EQ(b.blocks_of(id), (std::vector<int32_t>{1, 2}));  // 3 + 3 - 1 = 5 tokens: 2 blocks of 4
  std::vector<int32_t> fed;
  int steps = 0;
  while (!b.idle()) {
    const BatchStep s = b.next();
    ASSERT_EQ(s.width, 1);
    EXPECT_EQ(s.requests, 1);
    EXPECT_EQ(s.positions[0], steps);
    EXPECT_EQ(s.seq_lens[0], steps + 1);
    EXPECT_EQ(s.state_indices[0], 1);
    // Position p lives in block p / 4 of the request, at offset p % 4.
    EXPECT_EQ(s.slot_mapping[0], int64_t{b.blocks_of(id)[static_cast<size_t>(steps / 4)]} * 4 + steps % 4);
    EXPECT_EQ(s.fresh_slots, steps == 0 ? std::vector<int32_t>{1} : std::vector<int32_t>{});
    fed.push_back(s.tokens[0]);
    const std::vector<RowResult> res = results_for(s);
    const std::vector<int> left = b.complete(s, res);
    ++steps;
    EXPECT_EQ(left.empty(), steps < 5);
  }
  // 3 prompt tokens, then the first two generated ones (the third is never fed).
  EXPECT_EQ(fed, (std::vector<int32_t>{11, 12, 13, 102, 103}));
  EXPECT_EQ(b.generated(id), (std::vector<int32_t>{102, 103, 104}));
  EXPECT_EQ(b.predictions(id).size(), 5u);  // one per fed position, the prompt's included
  EXPECT_TRUE(b.finished(id));
  EXPECT_EQ(b.free_slots(), 1);  // given back
  EXPECT_EQ(b.free_blocks(), 2);
}

TEST(Batcher, RequestsLeaveAndTheWidthShrinksToTheNextBuiltWidth) {
  Batcher b({1, 2, 4}, 0, 5, 5, 1, 16);
  // Steps each request runs: prompt + max_new - 1 = 1, 2, 3, 4.
  for (int n = 1; n <= 4; ++n) b.join({{static_cast<int32_t>(n)}, n});
  std::vector<int> widths, requests;
  std::vector<std::vector<int>> rows;
  while (!b.idle()) {
    const BatchStep s = b.next();
    widths.push_back(s.width);
    requests.push_back(s.requests);
    rows.push_back(s.request);
    b.complete(s, results_for(s));
  }
  EXPECT_EQ(widths, (std::vector<int>{4, 4, 2, 1}));
  EXPECT_EQ(requests, (std::vector<int>{4, 3, 2, 1}));
  // Rows pack the remaining requests in join order; the rest of the width is padding (-1).
  EXPECT_EQ(rows[0], (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(rows[1], (std::vector<int>{1, 2, 3, -1}));
  EXPECT_EQ(rows[2], (std::vector<int>{2, 3}));
  EXPECT_EQ(rows[3], (std::vector<int>{3}));
  for (int id = 0; id < 4; ++id) EXPECT_EQ(b.generated(id).size(), static_cast<size_t>(id + 1));
}

TEST(Batcher, PaddingRowsCarryTheNullSentinels) {
  Batcher b({1, 2, 4}, 0, 4, 4, 1, 8);
  b.join({{5, 6}, 2});
  b.join({{7}, 1});
  b.join({{8}, 1});
  const BatchStep s = b.next();
  ASSERT_EQ(s.width, 4);
  EXPECT_EQ(s.requests, 3);
  EXPECT_EQ(s.request[3], -1);
  EXPECT_EQ(s.state_indices[3], DP_NULL_BLOCK_ID);
  EXPECT_EQ(s.slot_mapping[3], DP_PAD_SLOT_ID);
  EXPECT_EQ(s.seq_lens[3], 0);
  EXPECT_EQ(s.num_accepted[3], 1);
  EXPECT_EQ(s.block_table[3], DP_NULL_BLOCK_ID);
  // Real rows: distinct non-null slots and blocks.
  std::set<int32_t> slots(s.state_indices.begin(), s.state_indices.begin() + 3);
  std::set<int32_t> blocks(s.block_table.begin(), s.block_table.begin() + 3);
  EXPECT_EQ(slots, (std::set<int32_t>{1, 2, 3}));
  EXPECT_EQ(blocks, (std::set<int32_t>{1, 2, 3}));
  EXPECT_EQ(s.fresh_slots, (std::vector<int32_t>{1, 2, 3}));
}

TEST(Batcher, AFixedWidthPadsEveryStep) {
  Batcher b({1, 2, 4}, 4, 3, 3, 1, 8);
  b.join({{1}, 1});
  b.join({{2}, 3});
  std::vector<int> widths;
  while (!b.idle()) {
    const BatchStep s = b.next();
    widths.push_back(s.width);
    b.complete(s, results_for(s));
  }
  EXPECT_EQ(widths, (std::vector<int>{4, 4, 4}));
}

TEST(Batcher, AFreedSlotAndItsBlocksGoToTheNextRequestThatJoins) {
  Batcher b({1, 2}, 0, 3, 3, 1, 4);
  const int a = b.join({{1}, 1});  // one step
  const int c = b.join({{2}, 3});  // three steps
  EXPECT_EQ(b.cannot_join({{3}, 1}), "the batch holds 2 requests, the widest width");
  BatchStep s = b.next();
  EXPECT_EQ(b.complete(s, results_for(s)), (std::vector<int>{a}));
  EXPECT_EQ(b.active(), 1);
  // The joining request gets the slot and block the first one gave back, and starts from a fresh state.
  const int d = b.join({{3}, 1});
  EXPECT_EQ(b.slot_of(d), b.slot_of(a));
  EXPECT_EQ(b.blocks_of(d), b.blocks_of(a));
  s = b.next();
  EXPECT_EQ(s.width, 2);
  EXPECT_EQ(s.request, (std::vector<int>{c, d}));
  EXPECT_EQ(s.positions, (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(s.fresh_slots, (std::vector<int32_t>{b.slot_of(a)}));
  EXPECT_EQ(b.complete(s, results_for(s)), (std::vector<int>{d}));
  s = b.next();
  EXPECT_EQ(s.width, 1);
  EXPECT_EQ(s.request, (std::vector<int>{c}));
}

TEST(Batcher, JoinRefusesWhatTheCachesCannotHold) {
  Batcher b({4}, 0, 2, 3, 2, 4);  // one slot, two blocks, two columns
  EXPECT_EQ(b.cannot_join({{1, 2, 3, 4, 5, 6, 7, 8, 9}, 1}), "it needs 3 cache blocks, a block-table row holds 2");
  EXPECT_EQ(b.cannot_join({{}, 1}), "the prompt is empty");
  EXPECT_EQ(b.cannot_join({{1}, 0}), "max_new_tokens 0 (expected >= 1)");
  b.join({{1}, 1});
  EXPECT_EQ(b.cannot_join({{1}, 1}), "no free KDA state slot");
  test::expect_error([&] { b.join({{1}, 1}); }, Errc::internal, {"no free KDA state slot"});
}

TEST(Batcher, CompleteChecksTheStepItIsGiven) {
  Batcher b({2}, 0, 3, 3, 1, 4);
  b.join({{1}, 2});
  const BatchStep s = b.next();
  const std::vector<RowResult> one(1);
  test::expect_error([&] { b.complete(s, one); }, Errc::internal, {"1 row results for a step of width 2"});
  b.complete(s, results_for(s));
  test::expect_error([&] { b.complete(s, results_for(s)); }, Errc::internal, {"did not run"});
}

// ---- the prompts file ----------------------------------------------------------------------------

std::string write_prompts(const test::TempDir& d, const std::string& text) {
  const std::string path = (d / "prompts.txt").string();
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

TEST(Prompts, OneRequestPerLineOfWhitespaceSeparatedIds) {
  test::TempDir d;
  const std::string p = write_prompts(d, "1 2 3\n  7\t8 \r\n1023\n");
  EXPECT_EQ(read_prompts(p, 1024, 8, "w"), (std::vector<std::vector<int32_t>>{{1, 2, 3}, {7, 8}, {1023}}));
}

TEST(Prompts, BadFilesAreRefusedNamingFileLineAndValue) {
  test::TempDir d;
  auto refused = [&](const std::string& text, std::initializer_list<std::string> frags) {
    const std::string p = write_prompts(d, text);
    test::expect_error([&] { read_prompts(p, 1024, 2, "the widest width of b.dpk"); }, Errc::input, frags);
  };
  refused("1 2\n3 x4\n", {"prompts.txt:2:", "'x4' is not a token id", "0..1023"});
  refused("1 2.5\n", {"prompts.txt:1:", "'2.5' is not a token id"});
  refused("1 1024\n", {"prompts.txt:1:", "token id 1024 is outside the vocabulary (0..1023)"});
  refused("-1\n", {"prompts.txt:1:", "token id -1 is outside the vocabulary"});
  refused("99999999999999999999999\n", {"prompts.txt:1:", "outside the vocabulary"});
  refused("1\n\n2\n", {"prompts.txt:2:", "empty request"});
  refused("1\n \t\n", {"prompts.txt:2:", "empty request"});
  refused("", {"prompts.txt", "no requests"});
  refused("1\n2\n3\n", {"prompts.txt:3:", "request 3 does not fit: at most 2 requests", "the widest width of b.dpk"});
  test::expect_error([&] { read_prompts((d / "absent.txt").string(), 1024, 2, "w"); }, Errc::io, {"absent.txt"});
}

}  // namespace
}  // namespace dp::tools
