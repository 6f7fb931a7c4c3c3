// Files of manifests/ compiled into the binary (see cmake/EmbedFiles.cmake).
#pragma once

#include <optional>
#include <span>
#include <string_view>

namespace dp {

struct EmbeddedFile {
  std::string_view path;  // relative to manifests/, e.g. "presets/kimi-linear-48b-a3b.json"
  std::string_view data;
};

std::span<const EmbeddedFile> embedded_files();
std::optional<std::string_view> embedded_file(std::string_view path);

}  // namespace dp
