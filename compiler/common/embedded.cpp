#include "common/embedded.h"

namespace dp {

std::optional<std::string_view> embedded_file(std::string_view path) {
  for (const EmbeddedFile& f : embedded_files())
    if (f.path == path) return f.data;
  return std::nullopt;
}

}  // namespace dp
