// Errors inside the compiler library.
//
// Library code reports a failure by throwing dp::Error: a category (which is also the CLI's exit code,
// see README.md "Exit codes") and a message that names the file, object, field, the actual value and
// what was expected. Only tools/ catches it and turns it into an exit code. The runtime library never
// throws across its C ABI; it converts to a status object instead (runtime/include/decodepack).
#pragma once

#include <fmt/format.h>

#include <stdexcept>
#include <string>

namespace dp {

// Stable: these values are the CLI's documented exit codes.
enum class Errc : int {
  internal = 1,   // a bug in decodepack
  usage = 2,      // bad command line
  input = 3,      // bad model, checkpoint, deploy config or bundle contents
  io = 4,         // a file could not be read or written
  verify = 5,     // a digest, fingerprint or inventory check failed
  registry = 6,   // registry/network failure
  toolchain = 7,  // a device compiler is missing or failed
  device = 8,     // no GPU, or the GPU refused (run/bench/doctor)
};

const char* errc_name(Errc c);

class Error : public std::runtime_error {
 public:
  Error(Errc code, std::string message) : std::runtime_error(std::move(message)), code_(code) {}
  Errc code() const { return code_; }

 private:
  Errc code_;
};

template <typename... Args>
[[noreturn]] void fail(Errc code, fmt::format_string<Args...> f, Args&&... args) {
  throw Error(code, fmt::format(f, std::forward<Args>(args)...));
}

}  // namespace dp
