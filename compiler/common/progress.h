// Progress of one long step (compiling kernels, fingerprinting weights, binding weights, moving a
// blob), on stderr: every command reports its long steps through this one reporter.
//
//   dp::Progress p(stderr, tty, "compiling kernels", instances.size());
//   for (...) p.advance(1, key);   // from any thread
//   p.finish();                    // "compiling kernels: 100% (48/48) in 6.1 s"
//
// On a terminal one line is redrawn in place (at most 10 times a second) with the percentage, the
// count, the elapsed time, the ETA and what finished last, and closed by the final line. Off a terminal
// (a log, a CI job) a plain line is written each time the step passes another 10% and once when it
// ends: at most 11 lines a step, whatever its size. A reporter given no output file prints nothing.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>

namespace dp {

class Progress {
 public:
  enum class Unit { items, bytes };

  // `out` null: report nothing. `total` 0: the percentage and ETA are left out.
  Progress(std::FILE* out, bool tty, std::string step, uint64_t total, Unit unit = Unit::items);
  ~Progress();  // an unfinished step on a terminal gets its line closed, so later output starts clean
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;

  // Thread-safe. `detail` (e.g. the kernel just compiled) is shown on a terminal only.
  void advance(uint64_t n = 1, std::string_view detail = {});
  void update(uint64_t done, std::string_view detail = {});
  // The final line; `note` is appended ("48 kernels, 40 cache hits"). Later calls do nothing.
  void finish(std::string_view note = {});

  // When the step really began, if before this reporter was made (a transfer reported from its first
  // progress call); the elapsed time, rate and ETA count from there.
  void started(std::chrono::steady_clock::time_point t);

  // The line text without terminal control characters, for a given state (tests, and the reporter).
  static std::string line(std::string_view step, uint64_t done, uint64_t total, Unit unit, double elapsed_s,
                          bool finished, std::string_view note = {});

 private:
  void report_locked(std::string_view detail);

  std::FILE* out_;
  bool tty_;
  std::string step_;
  uint64_t total_;
  Unit unit_;
  std::chrono::steady_clock::time_point start_;
  std::chrono::steady_clock::time_point last_draw_{};
  std::mutex mu_;
  uint64_t done_ = 0;
  int decile_ = 0;  // the last 10% mark written off a terminal
  bool drawn_ = false, finished_ = false;
};

// Whether stderr is a terminal (the reporters' `tty` for stderr).
bool stderr_is_terminal();

}  // namespace dp
