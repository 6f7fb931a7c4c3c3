#include "common/fs.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <set>
#include <sstream>
#include <utility>

#include "common/error.h"
#include "common/output.h"
#include "format/untrusted.h"

namespace fs = std::filesystem;

namespace dp {

MappedFile::MappedFile(const fs::path& path) : path_(path) {
  std::string why;
  uint64_t size = 0;
  const int fd = format::open_regular_file(path, &size, &why);
  if (fd < 0) fail(Errc::io, "{}: {}", path.string(), why);
  size_ = static_cast<size_t>(size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd);
      fail(Errc::io, "{}: cannot map {} bytes: {}", path.string(), size_, std::strerror(e));
    }
    data_ = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
}

MappedFile::MappedFile(MappedFile&& o) noexcept
    : path_(std::move(o.path_)), data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
    path_ = std::move(o.path_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

std::string read_text_file(const fs::path& path, uint64_t max_bytes) {
  std::string out;
  bool too_large = false;
  if (std::string why = format::read_regular_file(path, max_bytes, out, &too_large); !why.empty())
    fail(too_large ? Errc::input : Errc::io, "{}: {}", path.string(), why);
  return out;
}

bool path_exists(const fs::path& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0) return true;
  if (errno == ENOENT || errno == ENOTDIR) return false;
  fail(Errc::io, "{}: cannot examine: {}", path.string(), std::strerror(errno));
}

void write_file_atomic(const fs::path& path, std::string_view bytes) {
  const fs::path tmp = staging_path(path, "tmp");
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) fail(Errc::io, "{}: cannot create a temporary file in {}: {}", path.string(), tmp.parent_path().string(),
                   std::strerror(errno));
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail(Errc::io, "{}: write failed after {} of {} bytes: {}", path.string(), bytes.size() - left, bytes.size(),
           std::strerror(e));
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    fail(Errc::io, "{}: cannot flush {} bytes to disk: {}", path.string(), bytes.size(), std::strerror(e));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    fail(Errc::io, "{}: cannot rename into place: {}", path.string(), std::strerror(e));
  }
}

StagingDir::StagingDir(const fs::path& target) : target_(target) {
  path_ = staging_path(target, "staging");
  const fs::path dir = path_.parent_path();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(Errc::io, "{}: cannot create directory: {}", dir.string(), ec.message());
  if (!fs::create_directory(path_, ec) || ec)
    fail(Errc::io, "{}: cannot create staging directory: {}", path_.string(), ec.message());
}

StagingDir::~StagingDir() {
  if (!committed_) {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
}

void StagingDir::commit() {
  std::error_code ec;
  fs::path dst = fs::absolute(target_).lexically_normal();
  if (dst.filename().empty()) dst = dst.parent_path();  // "out/"
  // Nothing there, or an empty directory: one rename.
  if (::rename(path_.c_str(), dst.c_str()) == 0) {
    committed_ = true;
    return;
  }
  if (errno != EEXIST && errno != ENOTEMPTY && errno != ENOTDIR && errno != EISDIR)
    fail(Errc::io, "{}: cannot publish: {}", dst.string(), std::strerror(errno));
  // Something there: exchange the two atomically, then remove the old one (now at the staging name).
  if (::renameat2(AT_FDCWD, path_.c_str(), AT_FDCWD, dst.c_str(), RENAME_EXCHANGE) == 0) {
    committed_ = true;
    fs::remove_all(path_, ec);
    return;
  }
  if (errno != EINVAL && errno != ENOSYS && errno != EOPNOTSUPP)
    fail(Errc::io, "{}: cannot publish: {}", dst.string(), std::strerror(errno));
  // A file system without RENAME_EXCHANGE: move the old one aside (one rename), rename the new one
  // in, remove the old one. A command killed in between leaves the old one at an "old" staging name,
  // which the next one puts back (remove_stale_staging()).
  const fs::path old = staging_path(dst, "old");
  if (::rename(dst.c_str(), old.c_str()) != 0)
    fail(Errc::io, "{}: cannot move the previous output aside: {}", dst.string(), std::strerror(errno));
  if (::rename(path_.c_str(), dst.c_str()) != 0) {
    int e = errno;
    ::rename(old.c_str(), dst.c_str());
    fail(Errc::io, "{}: cannot publish: {}", dst.string(), std::strerror(e));
  }
  committed_ = true;
  fs::remove_all(old, ec);
}

namespace {

// Makes every component of `rel` below `root` a directory, creating missing ones; a component that
// is a file or a symbolic link is an error (following a link could write outside `root`).
void ensure_real_directories(const fs::path& root, const fs::path& rel) {
  fs::path cur = root;
  for (const fs::path& c : rel) {
    cur /= c;
    struct stat st {};
    if (::lstat(cur.c_str(), &st) == 0) {
      if (S_ISDIR(st.st_mode)) continue;
      fail(Errc::io, "{}: is not a directory, and the output needs one here; move it away or choose another output",
           cur.string());
    }
    if (errno != ENOENT || (::mkdir(cur.c_str(), 0755) != 0 && errno != EEXIST))
      fail(Errc::io, "{}: cannot create directory: {}", cur.string(), std::strerror(errno));
  }
}

// Removes root/rel if it is a regular file reached through real directories only, then the
// directories above it that this leaves empty (never `root`). Anything else is left alone.
void remove_owned_file(const fs::path& root, const std::string& rel) {
  if (!is_safe_relative_path(rel)) return;
  const fs::path r(rel);
  fs::path cur = root;
  for (const fs::path& c : r.parent_path()) {
    cur /= c;
    struct stat st {};
    if (::lstat(cur.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) return;
  }
  const fs::path file = root / r;
  struct stat st {};
  if (::lstat(file.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || ::unlink(file.c_str()) != 0) return;
  for (fs::path d = r.parent_path(); !d.empty(); d = d.parent_path())
    if (::rmdir((root / d).c_str()) != 0) break;
}

}  // namespace

void StagingDir::commit_into(const std::vector<std::string>& previous, const std::vector<std::string>& last) {
  fs::path dst = fs::absolute(target_).lexically_normal();
  if (dst.filename().empty()) dst = dst.parent_path();
  std::vector<std::string> staged;
  std::error_code ec;
  for (fs::recursive_directory_iterator it(path_, ec), end; !ec && it != end; it.increment(ec))
    if (it->is_regular_file()) staged.push_back(it->path().lexically_relative(path_).generic_string());
  if (ec) fail(Errc::io, "{}: cannot list: {}", path_.string(), ec.message());
  std::sort(staged.begin(), staged.end());
  std::vector<std::string> order;
  for (const std::string& f : staged)
    if (std::find(last.begin(), last.end(), f) == last.end()) order.push_back(f);
  for (const std::string& f : last)
    if (std::binary_search(staged.begin(), staged.end(), f)) order.push_back(f);
  for (const std::string& rel : order) {
    const fs::path r(rel);
    ensure_real_directories(dst, r.parent_path());
    const fs::path to = dst / r;
    struct stat st {};
    if (::lstat(to.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
      fail(Errc::io, "{}: is a directory where the output has a file; move it away or choose another output",
           to.string());
    if (::rename((path_ / r).c_str(), to.c_str()) != 0)
      fail(Errc::io, "{}: cannot publish: {}", to.string(), std::strerror(errno));
  }
  const std::set<std::string> now(staged.begin(), staged.end());
  for (const std::string& rel : previous)
    if (!now.count(rel)) remove_owned_file(dst, rel);
  committed_ = true;
  fs::remove_all(path_, ec);
}

}  // namespace dp
