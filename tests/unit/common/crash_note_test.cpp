// CrashNote (compiler/common/crash_note.h): a fatal signal raised while a note lives on the thread ends
// the process with the note's line and exit code; without a note the signal does what it always did.
#include <gtest/gtest.h>

#include <csignal>
#include <thread>

#include "common/crash_note.h"

namespace dp {
namespace {

TEST(CrashNoteDeathTest, ASignalUnderANoteExitsWithItsLineAndCode) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const CrashNote note("NVRTC 13.0 crashed compiling kernel k.sm_90a", 7);
        std::raise(SIGSEGV);
      },
      testing::ExitedWithCode(7), "^decodepack: NVRTC 13.0 crashed compiling kernel k\\.sm_90a \\(SIGSEGV\\)\n$");
  EXPECT_EXIT(
      {
        const CrashNote note("in the compiler", 7);
        std::abort();
      },
      testing::ExitedWithCode(7), "decodepack: in the compiler \\(SIGABRT\\)");
}

TEST(CrashNoteDeathTest, TheInnermostNoteSpeaksAndTheOuterOneIsBackAfterIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        const CrashNote outer("outer", 4);
        { const CrashNote inner("inner", 7); }
        std::raise(SIGBUS);
      },
      testing::ExitedWithCode(4), "decodepack: outer \\(SIGBUS\\)");
  EXPECT_EXIT(
      {
        const CrashNote outer("outer", 4);
        const CrashNote inner("inner", 7);
        std::raise(SIGFPE);
      },
      testing::ExitedWithCode(7), "decodepack: inner \\(SIGFPE\\)");
}

TEST(CrashNoteDeathTest, WithoutANoteTheSignalKillsAsBefore) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  // Once a note was made (handlers installed), a signal outside any note still kills by the signal.
  EXPECT_EXIT(
      {
        { const CrashNote note("gone", 7); }
        std::raise(SIGSEGV);
      },
      testing::KilledBySignal(SIGSEGV), "");
  // A note is the thread's own: another thread's signal is not reported as it.
  EXPECT_EXIT(
      {
        const CrashNote note("main thread", 7);
        std::thread t([] { std::raise(SIGSEGV); });
        t.join();
      },
      testing::KilledBySignal(SIGSEGV), "");
}

}  // namespace
}  // namespace dp
