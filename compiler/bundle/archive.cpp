#include "bundle/archive.h"

#include <archive.h>
#include <archive_entry.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"
#include "common/output.h"
#include "format/untrusted.h"
#include "format/ustar.h"

namespace fs = std::filesystem;

namespace dp::bundle {
namespace {

constexpr size_t kChunk = size_t{1} << 20;  // streaming buffer: large files never sit in memory

struct ArchiveFree {
  void operator()(struct archive* a) const {
    if (a) archive_free(a);  // also closes; errors at this point have already been reported
  }
};
using ArchivePtr = std::unique_ptr<struct archive, ArchiveFree>;

struct EntryFree {
  void operator()(struct archive_entry* e) const { archive_entry_free(e); }
};
using EntryPtr = std::unique_ptr<struct archive_entry, EntryFree>;

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int release() { return std::exchange(fd_, -1); }
  void reset(int fd) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }

 private:
  int fd_;
};

// Writes all of [p, p+n) to fd, retrying short writes.
void write_all(int fd, const char* p, size_t n, const fs::path& what) {
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail(Errc::io, "{}: write failed: {}", what.string(), std::strerror(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

// ---------------------------------------------------------------------------------------------------
// Writing

struct SourceFile {
  std::string rel;  // archive path
  fs::path abs;
  uint64_t size;
};

std::vector<SourceFile> collect_files(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) fail(Errc::io, "{}: not a directory", dir.string());
  std::vector<SourceFile> files;
  // The iterator does not follow directory symlinks; every entry's own type is checked below.
  fs::recursive_directory_iterator it(dir, fs::directory_options::none, ec), end;
  if (ec) fail(Errc::io, "{}: cannot list: {}", dir.string(), ec.message());
  for (; it != end; it.increment(ec)) {
    if (ec) break;
    const fs::path& p = it->path();
    fs::file_status st = it->symlink_status(ec);
    if (ec) fail(Errc::io, "{}: cannot stat: {}", p.string(), ec.message());
    if (fs::is_directory(st)) continue;
    if (fs::is_symlink(st))
      fail(Errc::input, "{}: is a symbolic link; a bundle archive holds only regular files", p.string());
    if (!fs::is_regular_file(st))
      fail(Errc::input, "{}: is not a regular file (device, fifo or socket); a bundle archive holds only "
                        "regular files", p.string());
    std::string rel = p.lexically_relative(dir).generic_string();
    if (!format::ustar_fits(rel))
      fail(Errc::input,
           "{}: archive path '{}' is {} bytes; ustar stores at most {} bytes, or {} bytes split at a '/' "
           "into a prefix of at most {} and a name of at most {}",
           p.string(), rel, rel.size(), kUstarNameMax, kUstarPrefixMax + 1 + kUstarNameMax, kUstarPrefixMax,
           kUstarNameMax);
    // What every reader refuses (format/ustar.h), e.g. a '\\' in a file name, is never written.
    if (std::string why = format::bundle_path_problem(rel); !why.empty())
      fail(Errc::input, "{}: cannot archive as '{}': {}", p.string(), rel, why);
    uint64_t size = fs::file_size(p, ec);
    if (ec) fail(Errc::io, "{}: cannot stat: {}", p.string(), ec.message());
    if (size > kUstarSizeMax)
      fail(Errc::input, "{}: {} bytes; a ustar member holds at most {} bytes", p.string(), size, kUstarSizeMax);
    files.push_back({std::move(rel), p, size});
  }
  if (ec) fail(Errc::io, "{}: cannot list: {}", dir.string(), ec.message());
  // std::string's ordering is char_traits<char>::compare, i.e. memcmp: bytewise and locale-free.
  std::sort(files.begin(), files.end(), [](const SourceFile& a, const SourceFile& b) { return a.rel < b.rel; });
  return files;
}

// libarchive's message for a failed write(2) is only "Write error": the system's reason comes from its errno.
[[noreturn]] void fail_write(struct archive* a, const fs::path& out, std::string_view what) {
  std::string why = archive_error_string(a) ? archive_error_string(a) : "unknown libarchive error";
  if (int e = archive_errno(a); e > 0 && why.find(std::strerror(e)) == std::string::npos) why += fmt::format(": {}", std::strerror(e));
  fail(Errc::io, "{}: cannot write archive ({}): {}", out.string(), what, why);
}

void write_entries(struct archive* a, const std::vector<SourceFile>& files, const fs::path& out) {
  std::vector<char> buf(kChunk);
  for (const SourceFile& f : files) {
    EntryPtr e(archive_entry_new());
    // The raw bytes of the path (copy_pathname, not the wide or UTF-8 setters) so that no locale-dependent
    // conversion can change what is written.
    archive_entry_copy_pathname(e.get(), f.rel.c_str());
    archive_entry_set_filetype(e.get(), AE_IFREG);
    archive_entry_set_perm(e.get(), 0644);
    archive_entry_set_size(e.get(), static_cast<la_int64_t>(f.size));
    archive_entry_set_mtime(e.get(), 0, 0);
    archive_entry_set_uid(e.get(), 0);
    archive_entry_set_gid(e.get(), 0);
    // uname/gname stay unset: ustar writes them empty.
    if (archive_write_header(a, e.get()) != ARCHIVE_OK) fail_write(a, out, "header of " + f.rel);

    Fd in(::open(f.abs.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW));
    if (in.get() < 0) fail(Errc::io, "{}: cannot open: {}", f.abs.string(), std::strerror(errno));
    uint64_t done = 0;
    while (true) {
      ssize_t n = ::read(in.get(), buf.data(), buf.size());
      if (n < 0) {
        if (errno == EINTR) continue;
        fail(Errc::io, "{}: read failed: {}", f.abs.string(), std::strerror(errno));
      }
      if (n == 0) break;
      done += static_cast<uint64_t>(n);
      if (done > f.size) break;
      if (archive_write_data(a, buf.data(), static_cast<size_t>(n)) != n) fail_write(a, out, "data of " + f.rel);
    }
    // The header already promised f.size bytes; a file that changed meanwhile would corrupt the archive.
    if (done != f.size)
      fail(Errc::io, "{}: changed while being archived (was {} bytes, read {})", f.abs.string(), f.size, done);
  }
}

// ---------------------------------------------------------------------------------------------------
// Reading: through the format's one archive walk (format/ustar.h), its errors as dp::Error.

[[noreturn]] void rethrow(const format::FormatError& e) {
  if (dynamic_cast<const format::BundleIoError*>(&e)) fail(Errc::io, "{}", e.what());
  fail(Errc::verify, "{}", e.what());
}

// An archive opened (a regular file only: a FIFO is refused, not waited on) and checked completely.
class Archive {
 public:
  explicit Archive(const fs::path& file) : name_(file.string()) {
    std::string why;
    fd_.reset(format::open_regular_file(file, &size_, &why));
    if (fd_.get() < 0) fail(Errc::io, "{}: {}", name_, why);
    try {
      format::walk_archive(fd_.get(), size_, name_, [&](const format::ArchiveMember& m) { members_.push_back(m); });
    } catch (const format::FormatError& e) {
      rethrow(e);
    }
  }

  const std::string& name() const { return name_; }
  const std::vector<format::ArchiveMember>& members() const { return members_; }

  void read(const format::ArchiveMember& m, const std::function<void(const char*, size_t)>& sink) const {
    try {
      format::read_member(fd_.get(), m, name_,
                          [&](const uint8_t* p, size_t n) { sink(reinterpret_cast<const char*>(p), n); });
    } catch (const format::FormatError& e) {
      rethrow(e);
    }
  }

 private:
  std::string name_;
  Fd fd_;
  uint64_t size_ = 0;
  std::vector<format::ArchiveMember> members_;
};

}  // namespace

void write_archive(const fs::path& dir, const fs::path& out_file) {
  std::vector<SourceFile> files = collect_files(dir);

  std::error_code ec;
  fs::path out_abs = fs::weakly_canonical(fs::absolute(out_file), ec);
  fs::path dir_abs = fs::weakly_canonical(fs::absolute(dir), ec);
  fs::path rel = out_abs.lexically_relative(dir_abs);
  if (!rel.empty() && *rel.begin() != "..")
    fail(Errc::usage, "{}: the archive may not be written inside the directory it archives ({})",
         out_file.string(), dir.string());

  // Staging name in the destination directory, so the final rename stays on one file system.
  fs::path parent = out_abs.parent_path();
  fs::path tmp = staging_path(out_abs, "tmp");
  Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
  if (fd.get() < 0)
    fail(Errc::io, "{}: cannot create a staging file in {}: {}", out_file.string(), parent.string(),
         std::strerror(errno));
  try {
    ArchivePtr a(archive_write_new());
    if (!a) fail(Errc::internal, "{}: libarchive: out of memory", out_file.string());
    if (archive_write_set_format_ustar(a.get()) != ARCHIVE_OK || archive_write_add_filter_none(a.get()) != ARCHIVE_OK ||
        // Large writes (the default 10 KiB records mean many syscalls for a multi-GB bundle), and no
        // padding after the end-of-archive marker: the archive is exactly its entries plus 1024 bytes,
        // whatever the record size.
        archive_write_set_bytes_per_block(a.get(), static_cast<int>(kChunk)) != ARCHIVE_OK ||
        archive_write_set_bytes_in_last_block(a.get(), 1) != ARCHIVE_OK)
      fail_write(a.get(), out_file, "setup");
    if (archive_write_open_fd(a.get(), fd.get()) != ARCHIVE_OK) fail_write(a.get(), out_file, "open");
    write_entries(a.get(), files, out_file);
    if (archive_write_close(a.get()) != ARCHIVE_OK) fail_write(a.get(), out_file, "close");
    if (::fsync(fd.get()) != 0) fail(Errc::io, "{}: cannot flush to disk: {}", out_file.string(), std::strerror(errno));
    if (::close(fd.release()) != 0) fail(Errc::io, "{}: cannot close: {}", out_file.string(), std::strerror(errno));
    if (::rename(tmp.c_str(), out_abs.c_str()) != 0)
      fail(Errc::io, "{}: cannot rename into place: {}", out_file.string(), std::strerror(errno));
  } catch (...) {
    ::unlink(tmp.c_str());
    throw;
  }
}

std::vector<ArchiveEntry> list_archive(const fs::path& file) {
  const Archive a(file);
  std::vector<ArchiveEntry> out;
  for (const format::ArchiveMember& m : a.members())
    if (!m.dir) out.push_back({m.path, m.size, m.offset});
  return out;
}

std::string read_archive_member(const fs::path& file, std::string_view name, uint64_t max_bytes) {
  const Archive a(file);
  for (const format::ArchiveMember& m : a.members()) {
    if (m.dir || m.path != name) continue;
    if (m.size > max_bytes)
      fail(Errc::input, "{}: member {} is {} bytes, expected at most {}", a.name(), m.path, m.size, max_bytes);
    std::string data;
    data.reserve(m.size);
    a.read(m, [&](const char* p, size_t n) { data.append(p, n); });
    return data;
  }
  fail(Errc::verify, "{}: archive has no member {}", a.name(), name);
}

void extract_archive(const fs::path& file, const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(dir, ec)) && !(fs::is_directory(dir, ec) && fs::is_empty(dir, ec)))
    fail(Errc::io, "{}: cannot extract {} here: the path exists and is not an empty directory", dir.string(),
         file.string());
  const Archive a(file);  // checked completely before anything is created
  StagingDir staging(dir);
  for (const format::ArchiveMember& m : a.members()) {
    // Paths were checked by the walk (relative, no '.', '..' or empty components, no links anywhere in
    // the archive), so joining them below the staging directory cannot leave it.
    fs::path target = staging.path() / fs::path(m.path);
    if (m.dir) {
      fs::create_directories(target, ec);
      if (ec) fail(Errc::io, "{}: cannot create directory: {}", target.string(), ec.message());
      continue;
    }
    fs::create_directories(target.parent_path(), ec);
    if (ec) fail(Errc::io, "{}: cannot create directory: {}", target.parent_path().string(), ec.message());
    Fd out(::open(target.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (out.get() < 0) fail(Errc::io, "{}: cannot create: {}", target.string(), std::strerror(errno));
    a.read(m, [&](const char* p, size_t n) { write_all(out.get(), p, n, target); });
    // Flushed before the directory is renamed into place, so a crash cannot publish empty files.
    if (::fsync(out.get()) != 0 || ::close(out.release()) != 0)
      fail(Errc::io, "{}: cannot flush: {}", target.string(), std::strerror(errno));
  }
  // An existing empty directory is replaced by the staged one.
  staging.commit();
}

}  // namespace dp::bundle
