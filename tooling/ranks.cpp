#include "tooling/ranks.h"

#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>
#include <thread>

#include <fmt/ranges.h>

#include "common/error.h"

namespace dp::tools {

namespace fs = std::filesystem;

RankGroup::RankGroup(int size, const std::function<void(int, RankGroup&)>& child) : size_(size) {
  if (size < 1) fail(Errc::internal, "rank group of {} ranks", size);
  std::string tmpl = (fs::temp_directory_path() / "decodepack-ranks-XXXXXX").string();
  if (!::mkdtemp(tmpl.data())) fail(Errc::io, "creating the ranks' rendezvous directory {}: {}", tmpl, std::strerror(errno));
  dir_ = tmpl;
  reaped_.assign(static_cast<size_t>(size), false);
  parent_ = ::getpid();
  std::fflush(stdout);  // nothing buffered is written twice by the children
  std::fflush(stderr);
  for (int r = 1; r < size; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) fail(Errc::io, "starting tensor-parallel rank {}: fork: {}", r, std::strerror(errno));
    if (pid == 0) {
      rank_ = r;
      children_.clear();
      int code = 0;
      try {
        child(r, *this);
      } catch (const std::exception& e) {
        const std::string msg = e.what();
        const fs::path err = file("error", r);
        std::ofstream(err.string() + ".tmp", std::ios::binary) << msg;
        std::error_code ec;
        fs::rename(err.string() + ".tmp", err, ec);
        code = 1;
      }
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(code);  // no destructors: the group and everything else belong to rank 0
    }
    children_.push_back(pid);
  }
}

RankGroup::~RankGroup() {
  if (rank_ != 0) return;
  for (size_t i = 0; i < children_.size(); ++i) {
    if (reaped_[i + 1]) continue;
    ::kill(children_[i], SIGKILL);
    ::waitpid(children_[i], nullptr, 0);
  }
  std::error_code ec;
  fs::remove_all(dir_, ec);
}

fs::path RankGroup::file(const std::string& name, int rank) const { return dir_ / fmt::format("{}.{}", name, rank); }

void RankGroup::publish(const std::string& name, const void* data, size_t bytes) {
  const fs::path p = file(name, rank_), tmp = p.string() + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary);
    if (bytes) out.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
    if (!out) fail(Errc::io, "rank {}: writing {} ({} bytes)", rank_, tmp.string(), bytes);
  }
  std::error_code ec;
  fs::rename(tmp, p, ec);
  if (ec) fail(Errc::io, "rank {}: renaming {}: {}", rank_, tmp.string(), ec.message());
}

void RankGroup::watch() const {
  if (rank_ != 0) {
    if (::getppid() != parent_) fail(Errc::device, "rank {}: rank 0 (process {}) is gone", rank_, parent_);
    return;
  }
  for (size_t i = 0; i < children_.size(); ++i) {
    const int r = static_cast<int>(i) + 1;
    if (reaped_[static_cast<size_t>(r)]) continue;
    int status = 0;
    if (::waitpid(children_[i], &status, WNOHANG) != children_[i]) continue;
    reaped_[static_cast<size_t>(r)] = true;
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
    if (code == 0) continue;  // done: whatever it published stays readable
    std::ifstream in(file("error", r), std::ios::binary);
    const std::string why((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (WIFSIGNALED(status))
      fail(Errc::device, "tensor-parallel rank {} (process {}) died of signal {}", r, children_[i], WTERMSIG(status));
    fail(Errc::device, "tensor-parallel rank {} failed: {}", r, why.empty() ? fmt::format("exit code {}", code) : why);
  }
}

bool RankGroup::wait_for(const std::string& name, const std::vector<int>& ranks) {
  const auto end = std::chrono::steady_clock::now() + wait_bound;
  for (;;) {
    bool all = true;
    for (int r : ranks) all = all && fs::exists(file(name, r));
    if (all) return true;
    watch();
    if (std::chrono::steady_clock::now() > end) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
}

std::vector<std::vector<uint8_t>> RankGroup::gather(const std::string& name) {
  std::vector<int> all;
  for (int r = 0; r < size_; ++r) all.push_back(r);
  if (!wait_for(name, all)) {
    std::vector<int> missing;
    for (int r : all)
      if (!fs::exists(file(name, r))) missing.push_back(r);
    fail(Errc::device, "rank {}: waited {} s for rank{} {} at \"{}\"", rank_, wait_bound.count(),
         missing.size() == 1 ? "" : "s", fmt::join(missing, ", "), name);
  }
  std::vector<std::vector<uint8_t>> out;
  for (int r : all) {
    std::ifstream in(file(name, r), std::ios::binary);
    out.emplace_back((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }
  return out;
}

std::vector<uint8_t> RankGroup::receive(const std::string& name, int from) {
  if (!wait_for(name, {from}))
    fail(Errc::device, "rank {}: waited {} s for rank {} at \"{}\"", rank_, wait_bound.count(), from, name);
  std::ifstream in(file(name, from), std::ios::binary);
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::error_code ec;
  fs::remove(file(name, from), ec);  // read once: a step's dump is not kept
  return b;
}

void RankGroup::join() {
  if (rank_ != 0) return;
  const auto end = std::chrono::steady_clock::now() + wait_bound;
  for (;;) {
    watch();
    bool all = true;
    for (int r = 1; r < size_; ++r) all = all && reaped_[static_cast<size_t>(r)];
    if (all) return;
    if (std::chrono::steady_clock::now() > end)
      fail(Errc::device, "tensor-parallel ranks still running {} s after rank 0 finished", wait_bound.count());
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

}  // namespace dp::tools
