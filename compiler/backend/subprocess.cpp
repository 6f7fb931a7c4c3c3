#include "backend/subprocess.h"

#include <fcntl.h>
#include <poll.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/error.h"

extern char** environ;

namespace dp::backend {

std::string ProcessResult::describe() const {
  if (signal) return fmt::format("killed by signal {} ({})", signal, strsignal(signal));
  return fmt::format("exit status {}", exit_code);
}

namespace {

// Closes what it holds on every path out of run_process.
struct Fd {
  int fd = -1;
  ~Fd() { reset(); }
  void reset() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
};

struct SpawnActions {
  posix_spawn_file_actions_t a;
  SpawnActions() { posix_spawn_file_actions_init(&a); }
  ~SpawnActions() { posix_spawn_file_actions_destroy(&a); }
};

}  // namespace

ProcessResult run_process(const std::vector<std::string>& argv, const std::filesystem::path& cwd) {
  if (argv.empty()) fail(Errc::internal, "run_process: empty argument list");
  // O_CLOEXEC: other threads spawn compilers at the same time, and a pipe end leaking into their
  // children would keep our pipe open and hang the read loop below.
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) fail(Errc::io, "pipe: {}", std::strerror(errno));
  Fd out_r{out_pipe[0]}, out_w{out_pipe[1]};
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) fail(Errc::io, "pipe: {}", std::strerror(errno));
  Fd err_r{err_pipe[0]}, err_w{err_pipe[1]};

  SpawnActions actions;
  posix_spawn_file_actions_addopen(&actions.a, 0, "/dev/null", O_RDONLY, 0);
  posix_spawn_file_actions_adddup2(&actions.a, out_w.fd, 1);  // dup2 clears O_CLOEXEC on the copy
  posix_spawn_file_actions_adddup2(&actions.a, err_w.fd, 2);
  if (!cwd.empty()) posix_spawn_file_actions_addchdir_np(&actions.a, cwd.c_str());

  std::vector<char*> args;
  for (const std::string& s : argv) args.push_back(const_cast<char*>(s.c_str()));
  args.push_back(nullptr);

  pid_t pid = 0;
  const bool has_slash = argv[0].find('/') != std::string::npos;
  int rc = has_slash ? posix_spawn(&pid, argv[0].c_str(), &actions.a, nullptr, args.data(), environ)
                     : posix_spawnp(&pid, argv[0].c_str(), &actions.a, nullptr, args.data(), environ);
  if (rc != 0) fail(Errc::toolchain, "{}: cannot run: {}", argv[0], std::strerror(rc));
  out_w.reset();
  err_w.reset();

  ProcessResult r;
  pollfd fds[2] = {{out_r.fd, POLLIN, 0}, {err_r.fd, POLLIN, 0}};
  std::string* sinks[2] = {&r.out, &r.err};
  int open_fds = 2;
  char buf[16384];
  while (open_fds > 0) {
    if (::poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      ssize_t n = ::read(fds[i].fd, buf, sizeof buf);
      if (n > 0) {
        sinks[i]->append(buf, static_cast<size_t>(n));
      } else if (n == 0 || errno != EINTR) {
        fds[i].fd = -1;  // poll ignores negative descriptors
        --open_fds;
      }
    }
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
    if (errno != EINTR) fail(Errc::internal, "{}: waitpid: {}", argv[0], std::strerror(errno));
  }
  if (WIFEXITED(status)) {
    r.exit_code = WEXITSTATUS(status);
  } else if (WIFSIGNALED(status)) {
    r.signal = WTERMSIG(status);
  }
  // A program that could not be executed after the fork shows up as status 127 with nothing on
  // stdout; posix_spawn reports exec failures for us on glibc, so this is only a safety net.
  return r;
}

TempDir::TempDir(const std::string& prefix) {
  const char* base = std::getenv("TMPDIR");
  std::string templ = std::string(base && *base ? base : "/tmp") + "/" + prefix + "-XXXXXX";
  if (!::mkdtemp(templ.data())) fail(Errc::io, "{}: cannot create temporary directory: {}", templ, std::strerror(errno));
  path_ = templ;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

}  // namespace dp::backend
