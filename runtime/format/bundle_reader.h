// Reading a bundle (manifests/bundle-format.md §1, §2.2, §5): a directory or a .dpk ustar archive.
//
// The runtime's reader: it depends on nothing under compiler/. It holds every file of the bundle in
// memory (code objects are small; a host may delete or replace the bundle path once it is open).
//
// open() checks the container and the manifest: for an archive, the structure rules of §1.2 (plain
// ustar, only regular files and directories, safe unique paths, data and padding present, the
// end-of-archive marker present and only zeros after it); for a directory, only regular files (no
// links, devices); then manifest.json's format name and version (before any other field) and its schema
// (format::from_json). verify() checks what the manifest promises about the files: every listed file is
// present with its size and sha256, and no other file is present.
//
// Every failure throws FormatError naming the bundle, the entry or field, the actual and the expected
// value: Kind::version (unsupported format version), Kind::schema (not a bundle, bad manifest),
// Kind::integrity (truncated or corrupt archive, missing/extra/altered files). A file that cannot be
// read at all throws BundleIoError (a FormatError of Kind::integrity whose type says "I/O").
//
// Example:
//   auto b = dp::format::BundleReader::open("tiny.dpk");
//   b.verify();
//   std::span<const uint8_t> cubin = b.file(b.manifest().kernels[0].file);
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "format/manifest.h"

namespace dp::format {

// The bundle (or one of its files) cannot be read: missing path, permission, read error.
struct BundleIoError : FormatError {
  explicit BundleIoError(std::string msg) : FormatError(Kind::integrity, std::move(msg)) {}
};

class BundleReader {
 public:
  static BundleReader open(const std::filesystem::path& path);

  // Sizes and sha256 of every listed file; no unlisted file. Throws FormatError(integrity).
  void verify() const;

  const Manifest& manifest() const { return manifest_; }
  const std::string& manifest_bytes() const { return manifest_bytes_; }
  // "sha256:<64 hex>" of manifest.json's bytes: the bundle digest (§2.2).
  const std::string& digest() const { return digest_; }
  bool is_archive() const { return archive_; }
  const std::string& label() const { return label_; }  // the path, for messages

  // Files present other than manifest.json, sorted bytewise.
  std::vector<std::string> files() const;
  bool has(const std::string& rel) const { return files_.count(rel) > 0; }
  // One file's bytes; throws FormatError(integrity) naming the bundle and the file if it is absent.
  std::span<const uint8_t> file(const std::string& rel) const;

 private:
  std::string label_;
  bool archive_ = false;
  std::map<std::string, std::vector<uint8_t>> files_;  // relative path -> contents
  std::string manifest_bytes_;
  std::string digest_;
  Manifest manifest_;
};

// Lowercase hex SHA-256 (OpenSSL libcrypto).
std::string sha256_hex(std::span<const uint8_t> data);

}  // namespace dp::format
