#include "common/error.h"

namespace dp {

const char* errc_name(Errc c) {
  switch (c) {
    case Errc::internal: return "internal";
    case Errc::usage: return "usage";
    case Errc::input: return "input";
    case Errc::io: return "io";
    case Errc::verify: return "verify";
    case Errc::registry: return "registry";
    case Errc::toolchain: return "toolchain";
    case Errc::device: return "device";
  }
  return "unknown";
}

}  // namespace dp
