// File helpers: read-only memory maps, whole-file reads of small files, and atomic publication
// (write into a staging name beside the target, fsync, rename) so nothing is ever half-written.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace dp {

// A read-only private mapping of a whole regular file (anything else is refused with dp::Error(io)
// naming its type, without blocking on a FIFO). Pages are faulted in on demand, so mapping a large
// checkpoint shard costs address space, not memory.
class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::filesystem::path& path);  // throws dp::Error(io)
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  std::span<const uint8_t> bytes() const { return {data_, size_}; }
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

// Reads a small file (configs, manifests) completely. Only a regular file is opened (a FIFO or device is
// refused, never waited on); throws dp::Error(io) naming the path and what it is, or dp::Error(input)
// when it holds more than `max_bytes`.
std::string read_text_file(const std::filesystem::path& path, uint64_t max_bytes = UINT64_MAX);

// Whether `path` exists (following links). A path that cannot be examined, e.g. inside a directory
// without search permission, throws dp::Error(io) naming it and the system error: it is not "absent".
bool path_exists(const std::filesystem::path& path);

// Writes `bytes` to `path` atomically: a temporary file in the same directory (named by
// staging_path(), common/output.h), fsync, rename. Errors name `path` and the system's reason.
void write_file_atomic(const std::filesystem::path& path, std::string_view bytes);

// A directory that is removed on destruction unless committed; used to stage outputs before one rename.
// Its name records this process (staging_path(target, "staging")), so the leftovers of a killed
// command can be told from a live one's (remove_stale_staging()).
class StagingDir {
 public:
  // Creates a fresh directory next to `target` (same file system, so the final rename is atomic).
  explicit StagingDir(const std::filesystem::path& target);
  ~StagingDir();
  StagingDir(const StagingDir&) = delete;
  StagingDir& operator=(const StagingDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  // Replaces `target` (file or directory) with the staged contents in one rename: the old one is
  // exchanged with the staged one (renameat2 RENAME_EXCHANGE) and then removed, so `target` always
  // holds the old or the new contents. The caller has checked that whatever is there may go
  // (plan_output()).
  void commit();
  // Publishes into an existing directory that also holds files of others (plan_output()'s
  // write_into): each staged file is renamed over its path in `target` (the files named in `last`
  // last, in that order), then the files of `previous` (the previous output's own, relative) that
  // the new output lacks are removed, with their directories if that empties them. Nothing else in
  // `target` is touched. Not atomic as a whole: each file is.
  void commit_into(const std::vector<std::string>& previous, const std::vector<std::string>& last);

 private:
  std::filesystem::path target_;
  std::filesystem::path path_;
  bool committed_ = false;
};

}  // namespace dp
