// RankGroup: tensor-parallel ranks as forked processes meeting in a rendezvous directory (no GPU).
#include "tooling/ranks.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <chrono>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>

#include "common/error.h"

namespace dp::tools {
namespace {

std::string text(const std::vector<uint8_t>& b) { return std::string(b.begin(), b.end()); }

TEST(RankGroup, EveryRankGathersEveryBlobInRankOrder) {
  RankGroup g(3, [](int rank, RankGroup& group) {
    group.publish("hello", std::string("rank" + std::to_string(rank)).data(), 5);
    const auto all = group.gather("hello");
    for (int r = 0; r < 3; ++r)
      if (text(all[static_cast<size_t>(r)]) != "rank" + std::to_string(r)) throw std::runtime_error("wrong blob");
    group.barrier("done");
  });
  EXPECT_EQ(g.rank(), 0);
  EXPECT_EQ(g.size(), 3);
  g.publish("hello", "rank0", 5);
  const auto all = g.gather("hello");
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(text(all[0]), "rank0");
  EXPECT_EQ(text(all[1]), "rank1");
  EXPECT_EQ(text(all[2]), "rank2");
  g.barrier("done");
  g.join();  // both children exited 0 (a child that saw a wrong blob would fail it)
}

TEST(RankGroup, ReceiveReadsOneRanksBlobOnce) {
  RankGroup g(2, [](int, RankGroup& group) {
    std::vector<uint8_t> big(3 << 20);
    for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<uint8_t>(i * 7);
    group.publish("dump", big);
  });
  const std::vector<uint8_t> got = g.receive("dump", 1);
  ASSERT_EQ(got.size(), size_t{3} << 20);
  for (size_t i = 0; i < got.size(); i += 4099) ASSERT_EQ(got[i], static_cast<uint8_t>(i * 7));
  g.join();
  g.wait_bound = std::chrono::seconds(1);
  EXPECT_THROW(g.receive("dump", 1), Error);  // consumed, and rank 1 is gone
}

TEST(RankGroup, AFailingRankIsReportedWithItsMessage) {
  RankGroup g(2, [](int, RankGroup&) { throw std::runtime_error("binding layer 3 cache: no memory"); });
  try {
    g.gather("never");
    FAIL() << "gather returned although rank 1 failed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 failed: binding layer 3 cache: no memory"), std::string::npos)
        << e.what();
  }
}

TEST(RankGroup, AWaitPastTheBoundNamesTheMissingRanks) {
  RankGroup g(3, [](int rank, RankGroup& group) {
    if (rank == 1) group.publish("x", "1", 1);
    std::this_thread::sleep_for(std::chrono::seconds(30));  // rank 2 never publishes; killed by rank 0
  });
  g.wait_bound = std::chrono::seconds(1);
  g.publish("x", "0", 1);
  const auto t0 = std::chrono::steady_clock::now();
  try {
    g.gather("x");
    FAIL() << "gather returned without rank 2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("for rank 2 at \"x\""), std::string::npos) << e.what();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(10));
}  // the destructor kills the sleeping children: the test does not take 30 s

}  // namespace
}  // namespace dp::tools
