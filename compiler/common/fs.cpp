#include "common/fs.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <random>
#include <utility>

#include "common/error.h"
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

static std::string random_suffix() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}", rd(), rd());
}

void write_file_atomic(const fs::path& path, std::string_view bytes) {
  fs::path dir = path.parent_path().empty() ? fs::path(".") : path.parent_path();
  fs::path tmp = dir / fmt::format(".{}.tmp-{}", path.filename().string(), random_suffix());
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) fail(Errc::io, "{}: cannot create: {}", tmp.string(), std::strerror(errno));
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      int e = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      fail(Errc::io, "{}: write failed: {}", tmp.string(), std::strerror(e));
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    fail(Errc::io, "{}: cannot flush: {}", tmp.string(), std::strerror(e));
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    int e = errno;
    ::unlink(tmp.c_str());
    fail(Errc::io, "{}: cannot rename into place: {}", path.string(), std::strerror(e));
  }
}

StagingDir::StagingDir(const fs::path& target) : target_(target) {
  fs::path abs = fs::absolute(target);
  fs::path dir = abs.parent_path();
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail(Errc::io, "{}: cannot create directory: {}", dir.string(), ec.message());
  path_ = dir / fmt::format(".{}.staging-{}", abs.filename().string(), random_suffix());
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
  fs::path abs = fs::absolute(target_);
  // rename(2) replaces a file or an empty directory atomically; a non-empty old directory is first
  // moved aside (one rename), then the new one is renamed in, then the old one is removed.
  if (fs::is_directory(abs, ec) && !fs::is_empty(abs, ec)) {
    fs::path old = abs.parent_path() / fmt::format(".{}.old-{}", abs.filename().string(), random_suffix());
    if (::rename(abs.c_str(), old.c_str()) != 0)
      fail(Errc::io, "{}: cannot move previous output aside: {}", abs.string(), std::strerror(errno));
    if (::rename(path_.c_str(), abs.c_str()) != 0) {
      int e = errno;
      ::rename(old.c_str(), abs.c_str());
      fail(Errc::io, "{}: cannot publish: {}", abs.string(), std::strerror(e));
    }
    fs::remove_all(old, ec);
  } else if (::rename(path_.c_str(), abs.c_str()) != 0) {
    fail(Errc::io, "{}: cannot publish: {}", abs.string(), std::strerror(errno));
  }
  committed_ = true;
}

}  // namespace dp
