// The .dpk container's rules (manifests/bundle-format.md §1, §1.2), in one place for the writer and
// every reader: which paths a bundle file may have, and the one walk over a ustar archive that checks
// its structure. The runtime's BundleReader and the compiler's archive functions (list, read one member,
// extract: compiler/bundle/archive.h) both read through walk_archive(); the compiler writes archives
// with libarchive and checks each path with bundle_path_problem() first, so that what it writes every
// reader accepts. The manifest reader holds files[].path to the same rule.
//
// walk_archive() reads headers only (member data is skipped, never read), and refuses, naming the
// archive and the entry: a file shorter than one header; a member whose data or padding is cut off; a
// missing end-of-archive marker; a non-zero byte in or after it, or more than kMaxArchiveTrailingBytes
// of zeros after it; pax/GNU headers; links, devices and FIFOs; a path bundle_path_problem() refuses; a
// name that appears twice (a directory entry may follow files below it) or below a file; more than
// kMaxBundleFiles entries. Errors are FormatError: Kind::schema when the file is not a ustar archive at
// all or holds too many entries, Kind::integrity for everything else, BundleIoError when it cannot be
// read.
//
// Example:
//   walk_archive(fd, size, "tiny.dpk", [&](const ArchiveMember& m) {
//     if (!m.dir && m.path == "manifest.json") manifest = m;   // m.offset: its data, in bytes
//   });
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "format/manifest.h"

namespace dp::format {

// Limits of what a reader accepts, far above real bundles (kimi-k3 at TP 8: a few hundred files of at
// most a few MB) and far below what would exhaust memory or time.
inline constexpr uint64_t kMaxBundleFiles = 65536;                       // files and directories
inline constexpr uint64_t kMaxArchiveTrailingBytes = uint64_t{1} << 20;  // zeros after the end marker

// ustar's limits: a path is a name of at most 100 bytes, optionally preceded by a prefix of at most 155
// bytes joined at a '/'; a size is 11 octal digits.
inline constexpr size_t kUstarNameMax = 100;
inline constexpr size_t kUstarPrefixMax = 155;
inline constexpr uint64_t kUstarSizeMax = 077777777777ULL;  // 8 GiB - 1

// The bundle (or one of its files) cannot be read: missing path, permission, read error.
struct BundleIoError : FormatError {
  explicit BundleIoError(std::string msg) : FormatError(Kind::integrity, std::move(msg)) {}
};

// True if ustar can store `path`: at most kUstarNameMax bytes, or split at some '/' into a prefix of at
// most kUstarPrefixMax bytes and a non-empty name of at most kUstarNameMax.
bool ustar_fits(std::string_view path);

// Why `path` may not name a file of a bundle, or "" when it may: it must be relative and '/'-separated,
// without an empty, '.' or '..' component, a '\' or a NUL byte, and fit ustar. A directory entry's
// trailing '/' is removed before asking.
std::string bundle_path_problem(std::string_view path);

// One entry of an archive, as walk_archive() found it.
struct ArchiveMember {
  std::string path;     // as stored, without a directory's trailing '/'
  bool dir = false;     // a directory entry (a bundle's readers list only files)
  uint64_t size = 0;    // bytes of data; 0 for a directory
  uint64_t offset = 0;  // byte position of the data: contiguous, 512 bytes after the header
};

// Walks the archive open on `fd` (a regular file of `size` bytes; `label` names it in messages) header
// by header, checks it completely (see above) and calls `visit` for every entry in archive order. A
// throw from `visit` ends the walk. The descriptor's offset is moved; pread() is position-independent.
void walk_archive(int fd, uint64_t size, const std::string& label,
                  const std::function<void(const ArchiveMember&)>& visit);

// Streams `m`'s data from the archive open on `fd` to `sink` in chunks of at most 1 MiB. Throws
// FormatError(integrity) if the file now ends before the member does (it changed since the walk),
// BundleIoError if it cannot be read.
void read_member(int fd, const ArchiveMember& m, const std::string& label,
                 const std::function<void(const uint8_t*, size_t)>& sink);

}  // namespace dp::format
