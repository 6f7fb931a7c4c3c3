// Running a device compiler as a child process: posix_spawn (no shell, so no quoting and no
// injection through file names), stdout and stderr captured, optional working directory.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace dp::backend {

struct ProcessResult {
  int exit_code = -1;  // exit status, or -1 when killed by a signal
  int signal = 0;      // the signal that ended it, or 0
  std::string out;     // everything it wrote to stdout
  std::string err;     // everything it wrote to stderr
  bool ok() const { return exit_code == 0 && signal == 0; }
  std::string describe() const;  // "exit status 1" | "killed by signal 9 (Killed)"
};

// Runs argv[0] (searched in PATH when it holds no '/') with argv, stdin from /dev/null, in `cwd`
// when given. The environment is inherited. Throws dp::Error(toolchain) naming the program when it
// cannot be started (not found, not executable); a program that runs and fails is not an error here.
ProcessResult run_process(const std::vector<std::string>& argv, const std::filesystem::path& cwd = {});

// A fresh private directory under $TMPDIR (or /tmp), removed with its contents on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

}  // namespace dp::backend
