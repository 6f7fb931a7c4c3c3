// The .dpk container: a deterministic, uncompressed POSIX ustar archive of a bundle directory.
//
// Writing: every regular file under the directory becomes one entry, in bytewise order of its relative
// path, with mtime 0, uid/gid 0, empty user/group names, mode 0644 and no extended (pax/GNU) headers,
// so the same directory contents give the same bytes whatever the clock, umask, locale, file creation
// order or output path. Empty directories are not recorded (a bundle is its files). The archive ends
// with the two zero blocks of the end-of-archive marker and no further padding.
//
// Reading: the readers open only a regular file (a FIFO is refused, not waited on) and check its whole
// structure with the format's one archive walk (runtime/format/ustar.h, the runtime's reader walks it
// too), before any member is read: at most format::kMaxBundleFiles entries and
// format::kMaxArchiveTrailingBytes of zeros after the end-of-archive marker, only what a bundle may
// contain (regular files and directories with paths format::bundle_path_problem accepts, each named
// once). So a truncated, padded-with-garbage or hostile archive is refused with a message that names the
// file and the entry instead of yielding a partial bundle. Every failure is a dp::Error: Errc::io when
// the file cannot be read or written, Errc::verify when its contents are not a valid bundle archive,
// Errc::input when the directory to be archived holds something a bundle cannot (a link, a device, a
// path the readers refuse or ustar cannot store) or a member is larger than asked for.
//
// Example:
//   dp::bundle::write_archive("out/.staging", "tiny.dpk");
//   std::string manifest = dp::bundle::read_archive_member("tiny.dpk", "manifest.json");
//   for (const auto& e : dp::bundle::list_archive("tiny.dpk")) ...   // e.offset: data, in bytes
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "format/untrusted.h"
#include "format/ustar.h"

namespace dp::bundle {

// ustar's limits (runtime/format/ustar.h).
using format::kUstarNameMax;
using format::kUstarPrefixMax;
using format::kUstarSizeMax;

// Archives every regular file under `dir` into `out_file` (see above). The archive is written under a
// temporary name in out_file's directory and renamed into place, so `out_file` is either the previous
// file or the complete new one. `out_file` must not lie inside `dir`.
void write_archive(const std::filesystem::path& dir, const std::filesystem::path& out_file);

// One regular file of an archive. `offset` is the byte position of its data in the archive file, so a
// reader may map the member directly (the data is contiguous: ustar stores no holes).
struct ArchiveEntry {
  std::string path;  // relative, '/'-separated, as stored
  uint64_t size = 0;
  uint64_t offset = 0;
};

// Lists the regular files in archive order (directory entries are validated but not listed).
std::vector<ArchiveEntry> list_archive(const std::filesystem::path& file);

// Extracts `file` into `dir`, which must not exist or be empty. Extraction goes into a staging directory
// beside `dir` that is renamed into place only after every entry was read and checked, so a refused or
// interrupted extraction leaves no partial bundle. Files are created with mode 0644 (less the umask).
void extract_archive(const std::filesystem::path& file, const std::filesystem::path& dir);

// Returns the contents of member `name` (e.g. "manifest.json") without extracting anything; a member of
// more than `max_bytes` is refused (Errc::input) before it is read. The whole archive is still checked,
// so a truncated bundle is refused here too.
std::string read_archive_member(const std::filesystem::path& file, std::string_view name,
                                uint64_t max_bytes = format::kMaxManifestBytes);

}  // namespace dp::bundle
