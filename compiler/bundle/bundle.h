// Reading a bundle, whether a directory or a .dpk archive: its manifest, its digest and its files.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/fs.h"
#include "format/manifest.h"

namespace dp::bundle {

class Bundle {
 public:
  // Opens a bundle directory or .dpk file. Archive structure (truncation, unsafe paths) and the manifest
  // (format version first, then schema) are checked here; file contents are not (see verify()).
  // Throws dp::Error: io (cannot read), input (not a bundle, bad manifest, unsupported version), verify
  // (truncated archive).
  static Bundle open(const std::filesystem::path& path);

  const format::Manifest& manifest() const { return manifest_; }
  const std::string& manifest_bytes() const { return manifest_bytes_; }
  std::string digest() const;  // "sha256:<hex>" of manifest.json's bytes
  bool is_archive() const { return archive_; }
  const std::filesystem::path& path() const { return path_; }

  // Files present in the bundle other than manifest.json, sorted.
  std::vector<std::string> files() const;
  bool has(const std::string& rel) const;
  // Contents of one file (a view into the archive's mapping, or the file read from the directory).
  std::span<const uint8_t> file(const std::string& rel) const;

 private:
  std::filesystem::path path_;
  bool archive_ = false;
  MappedFile map_;                                     // the .dpk
  std::map<std::string, std::pair<uint64_t, uint64_t>> members_;  // archive: path -> (offset, size)
  mutable std::map<std::string, std::vector<uint8_t>> dir_cache_;
  std::string manifest_bytes_;
  format::Manifest manifest_;
};

// Converts the format library's errors into dp::Error with the CLI's codes.
[[noreturn]] void rethrow_format_error(const format::FormatError& e);

}  // namespace dp::bundle
