#include "common/progress.h"

#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace dp {
namespace {

constexpr auto kRedrawInterval = std::chrono::milliseconds(100);

std::string bytes_text(uint64_t b) {
  if (b >= (1ull << 30)) return fmt::format("{:.2f} GiB", b / double(1ull << 30));
  if (b >= (1ull << 20)) return fmt::format("{:.1f} MiB", b / double(1ull << 20));
  if (b >= (1ull << 10)) return fmt::format("{:.1f} KiB", b / double(1ull << 10));
  return fmt::format("{} B", b);
}

std::string seconds_text(double s) {
  if (!std::isfinite(s) || s < 0) s = 0;
  if (s < 60) return fmt::format("{:.1f} s", s);
  const auto whole = static_cast<uint64_t>(s);
  if (whole < 3600) return fmt::format("{} min {:02} s", whole / 60, whole % 60);
  return fmt::format("{} h {:02} min", whole / 3600, whole % 3600 / 60);
}

}  // namespace

Progress::Progress(std::FILE* out, bool tty, std::string step, uint64_t total, Unit unit)
    : out_(out), tty_(tty), step_(std::move(step)), total_(total), unit_(unit),
      start_(std::chrono::steady_clock::now()) {}

Progress::~Progress() {
  if (out_ && tty_ && drawn_ && !finished_) {
    std::fputc('\n', out_);
    std::fflush(out_);
  }
}

std::string Progress::line(std::string_view step, uint64_t done, uint64_t total, Unit unit, double elapsed_s,
                           bool finished, std::string_view note) {
  const bool bytes = unit == Unit::bytes;
  std::string s = fmt::format("{}: ", step);
  if (total > 0) {
    const uint64_t shown = std::min(done, total);
    s += fmt::format("{:.0f}% ", std::floor(100.0 * static_cast<double>(shown) / static_cast<double>(total)));
    s += bytes ? fmt::format("({} of {})", bytes_text(done), bytes_text(total)) : fmt::format("({}/{})", done, total);
  } else {
    s += bytes ? bytes_text(done) : fmt::format("{} done", done);
  }
  s += finished ? fmt::format(" in {}", seconds_text(elapsed_s)) : fmt::format(", {}", seconds_text(elapsed_s));
  if (bytes && elapsed_s > 0) s += fmt::format(", {}/s", bytes_text(static_cast<uint64_t>(done / elapsed_s)));
  if (!finished && total > 0 && done > 0 && done < total)
    s += fmt::format(", ETA {}", seconds_text(elapsed_s * static_cast<double>(total - done) / static_cast<double>(done)));
  if (!note.empty()) s += fmt::format("; {}", note);
  return s;
}

void Progress::started(std::chrono::steady_clock::time_point t) {
  std::lock_guard<std::mutex> lock(mu_);
  start_ = t;
}

void Progress::advance(uint64_t n, std::string_view detail) {
  if (!out_) return;
  std::lock_guard<std::mutex> lock(mu_);
  done_ += n;
  report_locked(detail);
}

void Progress::update(uint64_t done, std::string_view detail) {
  if (!out_) return;
  std::lock_guard<std::mutex> lock(mu_);
  done_ = done;
  report_locked(detail);
}

void Progress::report_locked(std::string_view detail) {
  if (finished_) return;
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - start_).count();
  if (tty_) {
    if (drawn_ && now - last_draw_ < kRedrawInterval) return;
    last_draw_ = now;
    drawn_ = true;
    std::string s = line(step_, done_, total_, unit_, elapsed, false);
    if (!detail.empty()) s += fmt::format(" [{}]", detail);
    std::fprintf(out_, "\r\033[2K%s", s.c_str());
  } else {
    // One line per 10% passed; the end is finish()'s line.
    if (total_ == 0) return;
    const int decile = static_cast<int>(std::min<uint64_t>(done_, total_) * 10 / total_);
    if (decile <= decile_ || decile >= 10) return;
    decile_ = decile;
    std::fprintf(out_, "%s\n", line(step_, done_, total_, unit_, elapsed, false).c_str());
  }
  std::fflush(out_);
}

void Progress::finish(std::string_view note) {
  if (!out_) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  finished_ = true;
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const std::string s = line(step_, done_, total_, unit_, elapsed, true, note);
  std::fprintf(out_, "%s%s\n", tty_ ? "\r\033[2K" : "", s.c_str());
  std::fflush(out_);
}

bool stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

}  // namespace dp
