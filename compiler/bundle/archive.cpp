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
#include <map>
#include <utility>
#include <vector>

#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"
#include "common/output.h"
#include "format/bundle_reader.h"

namespace fs = std::filesystem;

namespace dp::bundle {
namespace {

constexpr uint64_t kBlock = 512;          // tar's record unit
constexpr size_t kChunk = size_t{1} << 20;  // streaming buffer: large files never sit in memory

uint64_t padded(uint64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

// Why `p` may not name an archive member, or "" when it may. Shared by writer and readers so that what
// one writes the other accepts. Directory entries conventionally end in '/', which is allowed there.
std::string path_problem(std::string_view p, bool is_dir) {
  if (is_dir && !p.empty() && p.back() == '/') p.remove_suffix(1);
  if (p.empty()) return "empty path";
  if (p.front() == '/') return "absolute path";
  size_t start = 0;
  while (true) {
    size_t end = p.find('/', start);
    std::string_view c = p.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
    if (c.empty()) return "empty path component";
    if (c == ".") return "'.' path component";
    if (c == "..") return "'..' path component (leaves the extraction directory)";
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  return {};
}

// ustar stores a path as `name` (<= 100 bytes) or as `prefix` '/' `name` with prefix <= 155 bytes, so
// a longer path fits only if some '/' splits it that way.
bool ustar_fits(std::string_view p) {
  if (p.size() <= kUstarNameMax) return true;
  for (size_t s = p.find('/'); s != std::string_view::npos; s = p.find('/', s + 1)) {
    size_t name_len = p.size() - s - 1;
    if (s <= kUstarPrefixMax && name_len > 0 && name_len <= kUstarNameMax) return true;
  }
  return false;
}

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
    if (std::string why = path_problem(rel, false); !why.empty())
      fail(Errc::internal, "{}: cannot archive as '{}': {}", p.string(), rel, why);
    if (!ustar_fits(rel))
      fail(Errc::input,
           "{}: archive path '{}' is {} bytes; ustar stores at most {} bytes, or {} bytes split at a '/' "
           "into a prefix of at most {} and a name of at most {}",
           p.string(), rel, rel.size(), kUstarNameMax, kUstarPrefixMax + 1 + kUstarNameMax, kUstarPrefixMax,
           kUstarNameMax);
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
// Reading

enum class Kind { file, dir };

struct Header {
  std::string path;
  Kind kind = Kind::file;
  uint64_t size = 0;
  uint64_t offset = 0;  // of the data
};

// Walks an archive header by header and checks everything a bundle archive must satisfy: plain ustar,
// only files and directories, safe unique paths, every member's data and padding present, and the
// end-of-archive marker present with nothing but zeros after it.
class Reader {
 public:
  explicit Reader(const fs::path& file) : name_(file.string()) {
    // Checked on the descriptor, opened without blocking: a FIFO is refused, not waited on.
    std::string why;
    fd_.reset(format::open_regular_file(file, &file_size_, &why));
    if (fd_.get() < 0) fail(Errc::io, "{}: {}", name_, why);
    // libarchive cannot even recognise a cut-off first block; say what it is.
    if (file_size_ < kBlock)
      fail(Errc::verify, "{}: truncated archive: the first header needs {} bytes, {} present", name_, kBlock,
           file_size_);

    a_.reset(archive_read_new());
    if (!a_) fail(Errc::internal, "{}: libarchive: out of memory", name_);
    // Only uncompressed tar: a compressed or foreign container is not a .dpk.
    archive_read_support_format_tar(a_.get());
    if (archive_read_open_fd(a_.get(), fd_.get(), kChunk) != ARCHIVE_OK)
      fail(Errc::verify, "{}: not a tar archive: {}", name_, error_text());
  }

  // Reads the next header into `h`; returns false once the end-of-archive marker was reached and checked.
  bool next(Header& h) {
    struct archive_entry* e = nullptr;
    int r = archive_read_next_header(a_.get(), &e);
    // Without extended headers every header sits right after the previous member's padded data, so its
    // position is known even when libarchive fails (it reports no position then).
    uint64_t header_pos = next_header_;
    if (r == ARCHIVE_EOF) {
      check_end(header_pos);
      return false;
    }
    if (r != ARCHIVE_OK) {
      // libarchive reports a cut-off header as a generic error; say what is missing instead.
      if (header_pos + kBlock > file_size_)
        fail(Errc::verify, "{}: truncated archive: the header (or end-of-archive marker) {} needs {} bytes at "
                           "byte {}, {} present", name_, entry_after(), kBlock, header_pos, file_size_ - header_pos);
      if (count_ == 0) fail(Errc::verify, "{}: not a ustar archive: {}", name_, error_text());
      fail(Errc::verify, "{}: corrupt archive: header {} at byte {}: {}", name_, entry_after(), header_pos,
           error_text());
    }

    const char* raw = archive_entry_pathname(e);
    if (!raw) fail(Errc::verify, "{}: corrupt archive: header {} has no path", name_, entry_after());
    h.path = raw;
    // Extended headers would make the data offset differ from header + 512 and can carry host data
    // (times, owners); decodepack writes none, so their presence means a foreign or altered file.
    if (archive_format(a_.get()) != ARCHIVE_FORMAT_TAR_USTAR)
      fail(Errc::verify, "{}: entry {}: written as {}, but a bundle archive is plain ustar without extended "
                         "headers", name_, h.path, archive_format_name(a_.get()));

    if (const char* link = archive_entry_hardlink(e))
      fail(Errc::verify, "{}: entry {}: is a hard link to {}; a bundle archive holds only regular files", name_,
           h.path, link);
    switch (archive_entry_filetype(e)) {
      case AE_IFREG: h.kind = Kind::file; break;
      case AE_IFDIR: h.kind = Kind::dir; break;
      case AE_IFLNK:
        fail(Errc::verify, "{}: entry {}: is a symbolic link to {}; a bundle archive holds only regular files",
             name_, h.path, archive_entry_symlink(e) ? archive_entry_symlink(e) : "?");
      default:
        fail(Errc::verify, "{}: entry {}: is a device, fifo or socket; a bundle archive holds only regular "
                           "files", name_, h.path);
    }
    if (std::string why = path_problem(h.path, h.kind == Kind::dir); !why.empty())
      fail(Errc::verify, "{}: entry {}: refused: {}", name_, excerpt(h.path), why);
    if (count_ >= format::kMaxBundleFiles)
      fail(Errc::input, "{}: entry {}: more than {} entries, expected at most {} (a bundle holds a few hundred files)",
           name_, excerpt(h.path), format::kMaxBundleFiles, format::kMaxBundleFiles);
    if (h.kind == Kind::dir && h.path.back() == '/') h.path.pop_back();
    check_unique(h);

    h.size = archive_entry_size_is_set(e) ? static_cast<uint64_t>(archive_entry_size(e)) : 0;
    h.offset = header_pos + kBlock;
    if (h.kind == Kind::dir) h.size = 0;
    // Check before reading so the message can say exactly what is missing.
    uint64_t need = padded(h.size);
    if (h.offset + need > file_size_)
      fail(Errc::verify, "{}: truncated archive: entry {} needs {} bytes ({} of data, padded to {}-byte blocks) "
                         "at byte {}, {} present", name_, h.path, need, h.size, kBlock, h.offset,
           file_size_ - h.offset);
    // A mismatch would mean libarchive consumed headers that ustar does not have.
    if (static_cast<uint64_t>(archive_read_header_position(a_.get())) != header_pos)
      fail(Errc::verify, "{}: entry {}: header found at byte {}, expected {}", name_, h.path,
           archive_read_header_position(a_.get()), header_pos);
    next_header_ = h.offset + need;
    ++count_;
    last_ = h.path;
    return true;
  }

  // Streams the current entry's data to `sink` in chunks.
  void read_data(const Header& h, const std::function<void(const char*, size_t)>& sink) {
    std::vector<char> buf(std::min<uint64_t>(kChunk, std::max<uint64_t>(h.size, 1)));
    uint64_t done = 0;
    while (true) {
      la_ssize_t n = archive_read_data(a_.get(), buf.data(), buf.size());
      if (n < 0) fail(Errc::verify, "{}: corrupt archive: entry {}: {}", name_, h.path, error_text());
      if (n == 0) break;
      done += static_cast<uint64_t>(n);
      sink(buf.data(), static_cast<size_t>(n));
    }
    if (done != h.size)
      fail(Errc::verify, "{}: truncated archive: entry {} needs {} bytes, {} present", name_, h.path, h.size, done);
  }

  const std::string& name() const { return name_; }

 private:
  std::string error_text() const {
    const char* s = archive_error_string(a_.get());
    return s ? s : "unknown libarchive error";
  }

  std::string entry_after() const {
    return count_ == 0 ? std::string("of the first entry") : fmt::format("after entry {}", last_);
  }

  void check_unique(const Header& h) {
    // Every parent of a member is a directory; a name may appear once, except that a directory entry
    // may follow a file below it (the directory was then implied).
    enum Seen { file, dir_implied, dir_entry };
    for (size_t s = h.path.find('/'); s != std::string::npos; s = h.path.find('/', s + 1)) {
      std::string parent = h.path.substr(0, s);
      auto [it, fresh] = seen_.emplace(parent, dir_implied);
      if (!fresh && it->second == file)
        fail(Errc::verify, "{}: entry {}: its parent {} is a file entry", name_, h.path, parent);
    }
    auto [it, fresh] = seen_.emplace(h.path, h.kind == Kind::file ? file : dir_entry);
    if (fresh) return;
    if (h.kind == Kind::dir && it->second == dir_implied) {
      it->second = dir_entry;
      return;
    }
    fail(Errc::verify, "{}: entry {}: duplicate entry (the name appears twice)", name_, h.path);
  }

  // libarchive treats a missing end-of-archive marker as a clean end (some writers omit it), but for a
  // bundle its absence means the file was cut short at an entry boundary.
  void check_end(uint64_t pos) {
    if (pos + 2 * kBlock > file_size_)
      fail(Errc::verify, "{}: truncated archive: end-of-archive marker {} needs {} bytes at byte {}, {} present",
           name_, count_ == 0 ? std::string("of an empty archive") : fmt::format("after entry {}", last_),
           2 * kBlock, pos, pos > file_size_ ? 0 : file_size_ - pos);
    if (file_size_ - pos > 2 * kBlock + format::kMaxArchiveTrailingBytes)
      fail(Errc::verify, "{}: corrupt archive: {} bytes from the end-of-archive marker at byte {} to the end of the "
                         "file, expected at most {} (the marker and up to {} bytes of zero padding)", name_,
           file_size_ - pos, pos, 2 * kBlock + format::kMaxArchiveTrailingBytes, format::kMaxArchiveTrailingBytes);
    std::vector<char> buf(std::min<uint64_t>(kChunk, file_size_ - pos));
    for (uint64_t at = pos; at < file_size_;) {
      size_t want = static_cast<size_t>(std::min<uint64_t>(buf.size(), file_size_ - at));
      ssize_t n = ::pread(fd_.get(), buf.data(), want, static_cast<off_t>(at));
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail(Errc::io, "{}: read failed at byte {}: {}", name_, at, n < 0 ? std::strerror(errno) : "end of file");
      auto nz = std::find_if(buf.begin(), buf.begin() + n, [](char c) { return c != 0; });
      if (nz != buf.begin() + n) {
        uint64_t where = at + static_cast<uint64_t>(nz - buf.begin());
        if (where < pos + 2 * kBlock)
          fail(Errc::verify, "{}: corrupt archive: non-zero byte {} in the end-of-archive marker or an "
                             "unreadable header after entry {}", name_, where, last_);
        fail(Errc::verify, "{}: corrupt archive: {} bytes of data after the end-of-archive marker (first non-zero "
                           "byte at {})", name_, file_size_ - pos - 2 * kBlock, where);
      }
      at += static_cast<uint64_t>(n);
    }
  }

  std::string name_;
  Fd fd_;
  ArchivePtr a_;
  uint64_t file_size_ = 0;
  uint64_t next_header_ = 0;
  size_t count_ = 0;
  std::string last_;
  std::map<std::string, int> seen_;
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
  Reader r(file);
  std::vector<ArchiveEntry> out;
  Header h;
  while (r.next(h))
    if (h.kind == Kind::file) out.push_back({h.path, h.size, h.offset});
  return out;
}

std::string read_archive_member(const fs::path& file, std::string_view name, uint64_t max_bytes) {
  Reader r(file);
  std::string data;
  bool found = false;
  Header h;
  while (r.next(h)) {
    if (h.kind != Kind::file || h.path != name) continue;
    if (h.size > max_bytes)
      fail(Errc::input, "{}: member {} is {} bytes, expected at most {}", r.name(), h.path, h.size, max_bytes);
    data.reserve(h.size);
    r.read_data(h, [&](const char* p, size_t n) { data.append(p, n); });
    found = true;
  }
  if (!found) fail(Errc::verify, "{}: archive has no member {}", r.name(), name);
  return data;
}

void extract_archive(const fs::path& file, const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(fs::symlink_status(dir, ec)) && !(fs::is_directory(dir, ec) && fs::is_empty(dir, ec)))
    fail(Errc::io, "{}: cannot extract {} here: the path exists and is not an empty directory", dir.string(),
         file.string());
  Reader r(file);
  StagingDir staging(dir);
  Header h;
  while (r.next(h)) {
    // Paths were checked by the reader (relative, no '.', '..' or empty components, no links anywhere in
    // the archive), so joining them below the staging directory cannot leave it.
    fs::path target = staging.path() / fs::path(h.path);
    if (h.kind == Kind::dir) {
      fs::create_directories(target, ec);
      if (ec) fail(Errc::io, "{}: cannot create directory: {}", target.string(), ec.message());
      continue;
    }
    fs::create_directories(target.parent_path(), ec);
    if (ec) fail(Errc::io, "{}: cannot create directory: {}", target.parent_path().string(), ec.message());
    Fd out(::open(target.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644));
    if (out.get() < 0) fail(Errc::io, "{}: cannot create: {}", target.string(), std::strerror(errno));
    r.read_data(h, [&](const char* p, size_t n) { write_all(out.get(), p, n, target); });
    // Flushed before the directory is renamed into place, so a crash cannot publish empty files.
    if (::fsync(out.get()) != 0 || ::close(out.release()) != 0)
      fail(Errc::io, "{}: cannot flush: {}", target.string(), std::strerror(errno));
  }
  // An existing empty directory is replaced by the staged one.
  staging.commit();
}

}  // namespace dp::bundle
