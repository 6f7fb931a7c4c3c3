// crash_note.h: one line instead of "Segmentation fault" when in-process third-party code crashes.
//
// decodepack runs NVRTC in its own process (compiler/backend/cuda.cpp); a compiler bug that crashes
// it on some input (seen: NVRTC 13.0 on a lambda taking an array reference, inside a lambda) would
// otherwise end the build with the shell's "Segmentation fault" and nothing that names the kernel.
// While a CrashNote lives on a thread, a fatal signal raised by that thread (SIGSEGV, SIGBUS, SIGILL,
// SIGFPE, SIGABRT) writes "decodepack: <message> (<signal>)" to stderr and exits with the note's code
// (the toolchain's, 7); on threads without a note the signal does what it did before (the default
// action). The build stages its output and renames it into place only when complete, so nothing
// half-written is left at the destination. With --json the crash prints this line only, not the
// JSON error object (the handler may not format one).
#pragma once

#include <string>

namespace dp {

void crash_note_signal(int sig);  // the handler CrashNote installs (internal)

class CrashNote {
 public:
  CrashNote(std::string message, int exit_code);
  ~CrashNote();
  CrashNote(const CrashNote&) = delete;
  CrashNote& operator=(const CrashNote&) = delete;

 private:
  std::string line_;      // the whole stderr line, written as is by the handler
  int exit_code_;
  const CrashNote* outer_;  // the thread's enclosing note, restored on destruction
  friend void crash_note_signal(int);
};

}  // namespace dp
