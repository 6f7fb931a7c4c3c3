#include "common/crash_note.h"

#include <signal.h>
#include <unistd.h>

#include <cstring>
#include <mutex>

namespace dp {
namespace {

thread_local const CrashNote* t_note = nullptr;  // static TLS: decodepack's libraries are linked in

constexpr int kSignals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};

const char* signal_name(int sig) {
  switch (sig) {
    case SIGSEGV: return "SIGSEGV";
    case SIGBUS: return "SIGBUS";
    case SIGILL: return "SIGILL";
    case SIGFPE: return "SIGFPE";
    case SIGABRT: return "SIGABRT";
    default: return "a fatal signal";
  }
}

void write_all(const char* s, size_t n) {
  while (n > 0) {
    const ssize_t w = ::write(STDERR_FILENO, s, n);
    if (w <= 0) return;
    s += w;
    n -= static_cast<size_t>(w);
  }
}

void install_once() {
  static std::once_flag once;
  std::call_once(once, [] {
    struct sigaction sa;
    std::memset(&sa, 0, sizeof(sa));
    sa.sa_handler = crash_note_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESETHAND;  // a second fault in the handler takes the default action
    for (int sig : kSignals) sigaction(sig, &sa, nullptr);
  });
}

}  // namespace

// Async-signal-safe: reads the thread's note, write(2), _exit(2); without a note, the default action.
void crash_note_signal(int sig) {
  const CrashNote* n = t_note;
  if (!n) {
    signal(sig, SIG_DFL);
    raise(sig);
    return;
  }
  write_all(n->line_.data(), n->line_.size());
  const char* name = signal_name(sig);
  write_all(name, std::strlen(name));
  write_all(")\n", 2);
  _exit(n->exit_code_);
}

CrashNote::CrashNote(std::string message, int exit_code)
    : line_("decodepack: " + std::move(message) + " ("), exit_code_(exit_code), outer_(t_note) {
  install_once();
  t_note = this;
}

CrashNote::~CrashNote() { t_note = outer_; }

}  // namespace dp
