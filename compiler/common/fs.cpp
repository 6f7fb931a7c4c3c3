#include "common/fs.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <utility>

#include "common/error.h"

namespace fs = std::filesystem;

namespace dp {

MappedFile::MappedFile(const fs::path& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(Errc::io, "{}: cannot open: {}", path.string(), std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int e = errno;
    ::close(fd);
    fail(Errc::io, "{}: cannot stat: {}", path.string(), std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail(Errc::io, "{}: not a regular file", path.string());
  }
  size_ = static_cast<size_t>(st.st_size);
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

std::string read_text_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail(Errc::io, "{}: cannot open for reading", path.string());
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail(Errc::io, "{}: read error", path.string());
  return ss.str();
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
