// common/progress.h: the one reporter of long steps.
#include "common/progress.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

namespace dp {
namespace {

// Runs `body` against a reporter writing into memory; returns what it wrote.
template <typename F>
std::string capture(bool tty, uint64_t total, Progress::Unit unit, F body) {
  char* buf = nullptr;
  size_t size = 0;
  std::FILE* f = open_memstream(&buf, &size);
  {
    Progress p(f, tty, "step", total, unit);
    body(p);
  }
  std::fclose(f);
  std::string out(buf, size);
  std::free(buf);
  return out;
}

size_t count_lines(const std::string& s) {
  size_t n = 0;
  for (char c : s) n += c == '\n';
  return n;
}

TEST(Progress, LineSaysPercentCountElapsedAndEta) {
  EXPECT_EQ(Progress::line("compiling kernels", 12, 48, Progress::Unit::items, 3.0, false),
            "compiling kernels: 25% (12/48), 3.0 s, ETA 9.0 s");
  EXPECT_EQ(Progress::line("compiling kernels", 48, 48, Progress::Unit::items, 125.0, true, "40 from the cache"),
            "compiling kernels: 100% (48/48) in 2 min 05 s; 40 from the cache");
  EXPECT_EQ(Progress::line("upload", 1 << 20, 4 << 20, Progress::Unit::bytes, 2.0, false),
            "upload: 25% (1.0 MiB of 4.0 MiB), 2.0 s, 512.0 KiB/s, ETA 6.0 s");
  EXPECT_EQ(Progress::line("hashing", 7, 0, Progress::Unit::items, 1.0, false), "hashing: 7 done, 1.0 s");
  EXPECT_EQ(Progress::line("binding", 3, 4, Progress::Unit::items, 7200.0, false),
            "binding: 75% (3/4), 2 h 00 min, ETA 40 min 00 s");
}

TEST(Progress, OffATerminalOneLinePerTenPercentAndTheEnd) {
  const std::string out = capture(false, 1000, Progress::Unit::items, [](Progress& p) {
    for (int i = 0; i < 1000; ++i) p.advance();
    p.finish();
  });
  EXPECT_EQ(count_lines(out), 10u) << out;
  EXPECT_EQ(out.find('\r'), std::string::npos);
  for (int k = 1; k <= 9; ++k) EXPECT_NE(out.find("step: " + std::to_string(10 * k) + "% ("), std::string::npos) << out;
  EXPECT_NE(out.find("step: 100% (1000/1000) in "), std::string::npos) << out;
}

TEST(Progress, FewItemsGiveAtMostOneLineEach) {
  const std::string out = capture(false, 3, Progress::Unit::items, [](Progress& p) {
    for (int i = 0; i < 3; ++i) p.advance();
    p.finish();
    p.finish();  // a second finish writes nothing
  });
  EXPECT_EQ(count_lines(out), 3u) << out;  // 33%, 66%, then the final line
}

TEST(Progress, ThreadsShareOneReporter) {
  const std::string out = capture(false, 8000, Progress::Unit::items, [](Progress& p) {
    std::vector<std::thread> pool;
    for (int t = 0; t < 8; ++t)
      pool.emplace_back([&p] {
        for (int i = 0; i < 1000; ++i) p.advance();
      });
    for (std::thread& t : pool) t.join();
    p.finish();
  });
  EXPECT_EQ(count_lines(out), 10u) << out;
  EXPECT_NE(out.find("(8000/8000)"), std::string::npos) << out;
}

TEST(Progress, OnATerminalOneLineRedrawnThenClosed) {
  const std::string out = capture(true, 10, Progress::Unit::items, [](Progress& p) {
    for (int i = 0; i < 10; ++i) p.advance(1, "k" + std::to_string(i));
    p.finish();
  });
  EXPECT_EQ(count_lines(out), 1u) << out;
  EXPECT_EQ(out.rfind("\r\033[2Kstep: 10% (1/10), ", 0), 0u) << out;
  EXPECT_NE(out.find("[k0]"), std::string::npos) << out;
  EXPECT_NE(out.find("\r\033[2Kstep: 100% (10/10) in "), std::string::npos) << out;
}

TEST(Progress, AnUnfinishedTerminalLineIsClosed) {
  const std::string out = capture(true, 10, Progress::Unit::items, [](Progress& p) { p.advance(); });
  EXPECT_EQ(out.back(), '\n') << out;
}

TEST(Progress, NoOutputNoReport) {
  Progress p(nullptr, false, "step", 10);
  p.advance(5);
  p.finish();  // nothing to check but that it does not crash
}

}  // namespace
}  // namespace dp
