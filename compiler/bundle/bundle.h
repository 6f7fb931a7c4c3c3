// Reading a bundle (a directory or a .dpk archive) in the compiler: a thin wrapper over the runtime's
// reader (runtime/format/bundle_reader.h), which owns the format, that turns its errors into dp::Error
// with the CLI's exit codes.
#pragma once

#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "deploy/deploy.h"
#include "format/bundle_reader.h"
#include "format/manifest.h"

namespace dp::bundle {

class Bundle {
 public:
  // Archive structure (truncation, unsafe paths, links) and the manifest (format version first, then
  // schema) are checked here, reading only the headers and manifest.json; file contents are not (see
  // verify_bundle()). The manifest's deploy block is checked as a deploy file would be. Throws dp::Error:
  // io (cannot read, not a directory or regular file), input (bad manifest, unsupported version, limits of
  // format/bundle_reader.h), verify (damaged or truncated archive).
  static Bundle open(const std::filesystem::path& path);

  const format::Manifest& manifest() const { return reader_.manifest(); }
  // The manifest's deploy block, read as a deploy file is: tools use this, never the raw JSON.
  const deploy::Deploy& deploy() const { return deploy_; }
  const std::string& manifest_bytes() const { return reader_.manifest_bytes(); }
  const std::string& digest() const { return reader_.digest(); }  // "sha256:<hex>" of manifest.json
  bool is_archive() const { return reader_.is_archive(); }
  const std::filesystem::path& path() const { return path_; }
  std::vector<std::string> files() const { return reader_.files(); }  // all but manifest.json, sorted
  bool has(const std::string& rel) const { return reader_.has(rel); }
  // The size and the sha256 (read in chunks) of a present file; a whole file is read only by file().
  uint64_t size(const std::string& rel) const;
  std::string sha256(const std::string& rel) const;
  std::span<const uint8_t> file(const std::string& rel) const;

 private:
  Bundle(std::filesystem::path p, format::BundleReader r, deploy::Deploy d)
      : path_(std::move(p)), reader_(std::move(r)), deploy_(std::move(d)) {}
  std::filesystem::path path_;
  format::BundleReader reader_;
  deploy::Deploy deploy_;
};

// Whether `path` is a bundle that decodepack wrote, for deciding what a build may replace (plan_output(),
// common/output.h): a directory whose manifest.json has this format's name ("format":
// "decodepack-bundle"), or a ustar archive holding such a manifest.json. Any format version counts;
// nothing else is checked. Returns the bundle's own files (manifest.json and the paths its `files`
// list names; empty for an archive), or nullopt. Never throws.
std::optional<std::vector<std::string>> bundle_own_files(const std::filesystem::path& path);

// Converts the format library's errors into dp::Error with the CLI's codes.
[[noreturn]] void rethrow_format_error(const format::FormatError& e);

}  // namespace dp::bundle
