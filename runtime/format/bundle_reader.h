// Reading a bundle (manifests/bundle-format.md §1, §2.2, §5): a directory or a .dpk ustar archive.
//
// The runtime's reader: it depends on nothing under compiler/. Bundles may come from anywhere, so what
// it reads is bounded before the manifest is validated: open() walks the archive's headers without
// reading member data (a 6 GB member costs nothing), reads only manifest.json (at most
// kMaxManifestBytes), and refuses more than kMaxBundleFiles files or more than kMaxArchiveTrailingBytes
// of zeros after the end-of-archive marker. Other files are read when asked for: verify() hashes them in
// chunks, file() loads one (at most kMaxLoadedFileBytes) on first use and keeps it, load() loads them
// all. An archive stays open (its descriptor is held), so the host may delete or replace the .dpk by
// rename once it is open; a file loaded later is checked against the manifest's size and sha256, so an
// edit in place is refused, never used.
//
// open() checks the container and the manifest: for an archive, the structure rules of §1.2 (plain
// ustar, only regular files and directories, safe unique paths, data and padding present, the
// end-of-archive marker present and only zeros after it: format/ustar.h's walk_archive); for a directory, only regular files (no
// links, devices, FIFOs); then manifest.json's format name and version (before any other field) and its
// schema (format::from_json). verify() checks what the manifest promises about the files: every listed
// file is present with its size and sha256, and no other file is present.
//
// Every failure throws FormatError naming the bundle, the entry or field, the actual and the expected
// value: Kind::version (unsupported format version), Kind::schema (not a bundle, bad manifest),
// Kind::integrity (truncated or corrupt archive, missing/extra/altered files). A file that cannot be
// read at all throws BundleIoError (a FormatError of Kind::integrity whose type says "I/O").
//
// Thread safety: every const member may be called from any number of threads.
//
// Example:
//   auto b = dp::format::BundleReader::open("tiny.dpk");
//   b.verify();
//   std::span<const uint8_t> cubin = b.file(b.manifest().kernels[0].file);
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "format/manifest.h"
#include "format/untrusted.h"
#include "format/ustar.h"  // kMaxBundleFiles, kMaxArchiveTrailingBytes, BundleIoError, the archive walk

namespace dp::format {

// Limit of what file() loads, far above a real code object (a few MB).
inline constexpr uint64_t kMaxLoadedFileBytes = uint64_t{256} << 20;

class BundleReader {
 public:
  static BundleReader open(const std::filesystem::path& path);

  // Sizes and sha256 of every listed file (streamed); no unlisted file. Throws FormatError(integrity).
  void verify() const;
  // What verify() checks, keeping every listed file in memory (as file() loads it), so that the bundle
  // no longer needs its path: libdecodepack's dp_bundle_open. The manifest bounds the total
  // (kMaxBundleBytes).
  void load() const;

  const Manifest& manifest() const { return manifest_; }
  const std::string& manifest_bytes() const { return manifest_bytes_; }
  // "sha256:<64 hex>" of manifest.json's bytes: the bundle digest (§2.2).
  const std::string& digest() const { return digest_; }
  bool is_archive() const { return archive_; }
  const std::string& label() const { return label_; }  // the path, for messages

  // Files present other than manifest.json, sorted bytewise.
  std::vector<std::string> files() const;
  bool has(const std::string& rel) const;
  // Size in bytes of a present file; throws FormatError(integrity) naming the file if it is absent.
  uint64_t size(const std::string& rel) const;
  // Lowercase hex sha256 of a present file, read in chunks (never held whole).
  std::string sha256(const std::string& rel) const;
  // One file's bytes, read on first use (at most kMaxLoadedFileBytes) and kept while any copy of this
  // reader lives. A file the manifest lists must still have its listed size and sha256. Throws
  // FormatError(integrity) naming the bundle and the file if it is absent, too large or altered.
  std::span<const uint8_t> file(const std::string& rel) const;

  struct Source;  // the open archive or directory, its file table and the loaded files

 private:
  void check_files(bool keep) const;

  std::string label_;
  bool archive_ = false;
  std::shared_ptr<Source> src_;
  std::string manifest_bytes_;
  std::string digest_;
  Manifest manifest_;
};

// Lowercase hex SHA-256 (OpenSSL libcrypto).
std::string sha256_hex(std::span<const uint8_t> data);

}  // namespace dp::format
