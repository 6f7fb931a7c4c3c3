#include "format/bundle_reader.h"
#include "format/ustar.h"

#include <openssl/evp.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <set>

#include <fmt/format.h>

namespace fs = std::filesystem;

namespace dp::format {

// What open() found: the open archive (its descriptor) or the directory, and where each file is.
struct BundleReader::Source {
  struct Member {
    uint64_t offset = 0;  // archive: byte position of the data
    uint64_t size = 0;
  };
  std::string label;
  bool archive = false;
  int fd = -1;  // archive
  fs::path root;  // directory
  std::map<std::string, Member> files;  // every file but manifest.json
  std::mutex mu;  // guards `loaded`
  std::map<std::string, std::vector<uint8_t>> loaded;  // file() results; map nodes never move

  Source() = default;
  Source(const Source&) = delete;
  Source& operator=(const Source&) = delete;
  ~Source() {
    if (fd >= 0) ::close(fd);
  }

  // Streams file `rel` (`m` its entry) to `sink` in chunks; exactly m.size bytes or a FormatError.
  void read(const std::string& rel, const Member& m, const std::function<void(const uint8_t*, size_t)>& sink) const;
};

namespace {

constexpr uint64_t kBlock = 512;        // tar's unit: headers and data padding
constexpr size_t kChunk = size_t{1} << 20;  // read size: no file is read whole unless asked for

[[noreturn]] void integrity(const std::string& msg) { throw FormatError(FormatError::Kind::integrity, msg); }
[[noreturn]] void schema(const std::string& msg) { throw FormatError(FormatError::Kind::schema, msg); }

// Why `p` may not be a member path (bundle-format.md §1), or "" if it may.
std::string path_problem(const std::string& p) {
  if (p.empty()) return "empty path";
  if (p.front() == '/') return "absolute path";
  if (p.find('\\') != std::string::npos) return "backslash in path";
  size_t start = 0;
  while (true) {
    const size_t end = p.find('/', start);
    const std::string part = p.substr(start, end == std::string::npos ? std::string::npos : end - start);
    if (part.empty()) return "empty path component";
    if (part == ".") return "'.' path component";
    if (part == "..") return "'..' path component";
    if (end == std::string::npos) return {};
    start = end + 1;
  }
}

// Reads exactly n bytes at `offset` of `fd`; false if the file ends first.
bool pread_all(int fd, uint8_t* out, size_t n, uint64_t offset, const std::string& label) {
  while (n > 0) {
    const ssize_t r = ::pread(fd, out, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw BundleIoError(fmt::format("{}: read failed at byte {}: {}", label, offset, std::strerror(errno)));
    if (r == 0) return false;
    out += r, n -= static_cast<size_t>(r), offset += static_cast<uint64_t>(r);
  }
  return true;
}

// Walks the ustar archive open on `src.fd` (of `size` bytes) header by header and records its regular
// members in src.files; returns manifest.json's entry (size 0 and offset 0 when absent). Member data is
// contiguous 512 bytes after its header (no extended headers are allowed), so the walk tracks where each
// header must be and can say exactly what is missing when the file is cut short; data is skipped, never
// read. Headers are parsed by format/ustar.h: the runtime links no archive library.
BundleReader::Source::Member walk_archive(BundleReader::Source& src, uint64_t size, bool* has_manifest) {
  const std::string& label = src.label;
  if (size < kBlock)
    integrity(fmt::format("{}: truncated archive: the first header needs {} bytes, {} present", label, kBlock, size));

  BundleReader::Source::Member manifest;
  std::map<std::string, bool> seen;  // path -> is a directory (explicit or implied by a member below it)
  uint64_t at = 0, entries = 0;
  std::string last;
  auto after = [&] { return last.empty() ? std::string("at the start") : "after entry " + last; };
  uint8_t block[kBlock];
  while (true) {
    const uint64_t left = size - at;
    bool end_marker = false;
    if (left >= kBlock) {
      if (!pread_all(src.fd, block, kBlock, at, label))
        integrity(fmt::format("{}: truncated archive: the file shrank while being read", label));
      end_marker = format::ustar::is_zero_block(block);
    } else {
      // Less than a block left: zeros are a cut end-of-archive marker, anything else a cut header.
      if (!pread_all(src.fd, block, static_cast<size_t>(left), at, label))
        integrity(fmt::format("{}: truncated archive: the file shrank while being read", label));
      end_marker = std::all_of(block, block + left, [](uint8_t b) { return b == 0; });
      if (!end_marker)
        integrity(fmt::format("{}: truncated archive: the header {} needs {} bytes at byte {}, {} present", label,
                              after(), kBlock, at, left));
    }
    if (end_marker) {
      // The end-of-archive marker: two zero blocks, then at most kMaxArchiveTrailingBytes of zeros.
      if (at + 2 * kBlock > size)
        integrity(fmt::format("{}: truncated archive: the end-of-archive marker {} needs {} bytes at byte {}, {} "
                              "present", label, after(), 2 * kBlock, at, left));
      if (left > 2 * kBlock + kMaxArchiveTrailingBytes)
        integrity(fmt::format("{}: corrupt archive: {} bytes from the end-of-archive marker at byte {} to the end of "
                              "the file, expected at most {} (the marker and up to {} bytes of zero padding)", label,
                              left, at, 2 * kBlock + kMaxArchiveTrailingBytes, kMaxArchiveTrailingBytes));
      std::vector<uint8_t> tail(static_cast<size_t>(left));
      if (!pread_all(src.fd, tail.data(), tail.size(), at, label))
        integrity(fmt::format("{}: truncated archive: the file shrank while being read", label));
      auto nz = std::find_if(tail.begin(), tail.end(), [](uint8_t b) { return b != 0; });
      if (nz != tail.end())
        integrity(fmt::format("{}: corrupt archive: non-zero byte at {} in or after the end-of-archive marker "
                              "(expected only zeros from byte {})", label, at + (nz - tail.begin()), at));
      return manifest;
    }
    format::ustar::Header h;
    if (std::string why = format::ustar::parse_header(block, &h); !why.empty()) {
      if (last.empty()) schema(fmt::format("{}: not a tar archive: {}", label, why));
      integrity(fmt::format("{}: corrupt archive: header {} at byte {}: {}", label, after(), at, why));
    }
    std::string path = std::move(h.path);
    if (h.type == format::ustar::Type::extended || !h.plain_ustar)
      integrity(fmt::format("{}: entry {}: written as {}, expected plain ustar without extended headers", label,
                            excerpt(path), h.plain_ustar ? "a " + format::ustar::type_name(h) : h.dialect));
    if (h.type == format::ustar::Type::hard_link)
      integrity(fmt::format("{}: entry {}: is a hard link; a bundle holds only regular files", label, excerpt(path)));
    if (h.type != format::ustar::Type::file && h.type != format::ustar::Type::directory)
      integrity(fmt::format("{}: entry {}: is a {}; a bundle holds only regular files", label, excerpt(path),
                            format::ustar::type_name(h)));
    const bool dir = h.type == format::ustar::Type::directory;
    if (dir && !path.empty() && path.back() == '/') path.pop_back();
    if (std::string why = path_problem(path); !why.empty())
      integrity(fmt::format("{}: entry '{}': refused: {}", label, excerpt(path), why));
    if (++entries > kMaxBundleFiles)
      schema(fmt::format("{}: entry {}: more than {} entries, expected at most {} (a bundle holds a few hundred files)",
                         label, excerpt(path), kMaxBundleFiles, kMaxBundleFiles));
    for (size_t s = path.find('/'); s != std::string::npos; s = path.find('/', s + 1)) {
      auto [it, fresh] = seen.emplace(path.substr(0, s), true);
      if (!fresh && !it->second)
        integrity(fmt::format("{}: entry {}: its parent {} is a file", label, excerpt(path), excerpt(it->first)));
    }
    if (auto it = seen.find(path); it != seen.end() && !(dir && it->second))
      integrity(fmt::format("{}: entry {}: duplicate entry (the name appears twice)", label, excerpt(path)));
    seen[path] = dir;

    const uint64_t len = dir ? 0 : h.size;
    const uint64_t data_at = at + kBlock;
    const uint64_t padded = (len + kBlock - 1) / kBlock * kBlock;
    if (data_at + padded > size)
      integrity(fmt::format("{}: truncated archive: entry {} needs {} bytes ({} of data, padded to {}) at byte {}, "
                            "{} present", label, excerpt(path), padded, len, kBlock, data_at, size - data_at));
    if (!dir) {
      if (path == kManifestFile) {
        manifest = {data_at, len};
        *has_manifest = true;
      } else {
        src.files.emplace(path, BundleReader::Source::Member{data_at, len});
      }
    }
    at = data_at + padded;  // the data is skipped, never read
    last = path;
  }
}

// Lists a directory bundle's files (regular files only) into src.files, manifest.json included.
void list_directory(BundleReader::Source& src) {
  const fs::path& root = src.root;
  std::error_code ec;
  fs::recursive_directory_iterator it(root, fs::directory_options::none, ec), end;
  if (ec) throw BundleIoError(fmt::format("{}: cannot list: {}", root.string(), ec.message()));
  uint64_t count = 0;
  for (; it != end; it.increment(ec)) {
    if (ec) break;
    const std::string rel = it->path().lexically_relative(root).generic_string();
    if (++count > kMaxBundleFiles)
      schema(fmt::format("{}: {}: more than {} files and directories, expected at most {} (a bundle holds a few "
                         "hundred files)", root.string(), excerpt(rel), kMaxBundleFiles, kMaxBundleFiles));
    const fs::file_status st = it->symlink_status(ec);
    if (ec) throw BundleIoError(fmt::format("{}: cannot stat: {}", it->path().string(), ec.message()));
    if (fs::is_directory(st)) continue;
    if (fs::is_symlink(st))
      integrity(fmt::format("{}: {} is a symbolic link; a bundle holds only regular files", root.string(), excerpt(rel)));
    if (!fs::is_regular_file(st))
      integrity(fmt::format("{}: {} is {}; a bundle holds only regular files", root.string(), excerpt(rel),
                            file_type_name(st.type())));
    const uint64_t size = it->file_size(ec);
    if (ec) throw BundleIoError(fmt::format("{}: cannot stat: {}", it->path().string(), ec.message()));
    src.files.emplace(rel, BundleReader::Source::Member{0, size});
  }
  if (ec) throw BundleIoError(fmt::format("{}: cannot list: {}", root.string(), ec.message()));
}

class Sha256Stream {
 public:
  Sha256Stream() : ctx_(EVP_MD_CTX_new()) {
    if (!ctx_ || EVP_DigestInit_ex(ctx_, EVP_sha256(), nullptr) != 1) throw std::runtime_error("OpenSSL sha256 init failed");
  }
  ~Sha256Stream() { EVP_MD_CTX_free(ctx_); }
  Sha256Stream(const Sha256Stream&) = delete;
  Sha256Stream& operator=(const Sha256Stream&) = delete;
  void update(const uint8_t* p, size_t n) {
    if (EVP_DigestUpdate(ctx_, p, n) != 1) throw std::runtime_error("OpenSSL sha256 update failed");
  }
  std::string hex() {
    unsigned char md[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    if (EVP_DigestFinal_ex(ctx_, md, &n) != 1 || n != 32) throw std::runtime_error("OpenSSL sha256 final failed");
    static const char* digits = "0123456789abcdef";
    std::string out(64, '0');
    for (unsigned i = 0; i < 32; ++i) {
      out[2 * i] = digits[md[i] >> 4];
      out[2 * i + 1] = digits[md[i] & 15];
    }
    return out;
  }

 private:
  EVP_MD_CTX* ctx_;
};

}  // namespace

void BundleReader::Source::read(const std::string& rel, const Member& m,
                                const std::function<void(const uint8_t*, size_t)>& sink) const {
  std::vector<uint8_t> buf(static_cast<size_t>(std::min<uint64_t>(kChunk, std::max<uint64_t>(m.size, 1))));
  if (archive) {
    for (uint64_t done = 0; done < m.size;) {
      const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), m.size - done));
      if (!pread_all(fd, buf.data(), n, m.offset + done, label))
        integrity(fmt::format("{}: file {}: the archive ends after {} of its {} bytes (it changed since it was opened)",
                              label, rel, done, m.size));
      sink(buf.data(), n);
      done += n;
    }
    return;
  }
  const fs::path p = root / rel;
  std::string why;
  uint64_t size = 0;
  const int f = open_regular_file(p, &size, &why);
  if (f < 0) throw BundleIoError(fmt::format("{}: {}", p.string(), why));
  uint64_t done = 0;
  try {
    while (done <= m.size) {
      const ssize_t n = ::read(f, buf.data(), buf.size());
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw BundleIoError(fmt::format("{}: read failed: {}", p.string(), std::strerror(errno)));
      if (n == 0) break;
      const size_t use = static_cast<size_t>(std::min<uint64_t>(static_cast<uint64_t>(n), m.size - std::min(done, m.size)));
      if (use) sink(buf.data(), use);
      done += static_cast<uint64_t>(n);
    }
  } catch (...) {
    ::close(f);
    throw;
  }
  ::close(f);
  if (done != m.size)
    integrity(fmt::format("{}: file {}: {} bytes when read, {} when the bundle was opened (it changed meanwhile)",
                          label, rel, done > m.size ? fmt::format("more than {}", m.size) : std::to_string(done),
                          m.size));
}

std::string sha256_hex(std::span<const uint8_t> data) {
  Sha256Stream h;
  h.update(data.data(), data.size());
  return h.hex();
}

BundleReader BundleReader::open(const fs::path& path) {
  BundleReader b;
  b.label_ = path.string();
  auto src = std::make_shared<Source>();
  src->label = b.label_;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st))
    throw BundleIoError(fmt::format("{}: no such bundle (expected a directory or a .dpk file)", b.label_));
  std::string where;
  if (fs::is_directory(st)) {
    src->root = path;
    list_directory(*src);
    auto it = src->files.find(kManifestFile);
    if (it == src->files.end()) schema(fmt::format("{}: not a bundle: no {} file", b.label_, kManifestFile));
    src->files.erase(it);
    where = (path / kManifestFile).string();
    bool too_large = false;
    if (std::string why = read_regular_file(path / kManifestFile, kMaxManifestBytes, b.manifest_bytes_, &too_large);
        !why.empty()) {
      if (too_large) schema(fmt::format("{}: {}", where, why));
      throw BundleIoError(fmt::format("{}: {}", where, why));
    }
  } else {
    // Opened before anything else is asked of it, and checked on the descriptor: a FIFO neither blocks
    // nor is read, and what is read is the file that was checked.
    std::string why;
    uint64_t size = 0;
    src->fd = open_regular_file(path, &size, &why);
    if (src->fd < 0)
      throw BundleIoError(fmt::format("{}: {} (a bundle is a directory or a .dpk file)", b.label_, why));
    b.archive_ = true;
    src->archive = true;
    bool has_manifest = false;
    const Source::Member m = walk_archive(*src, size, &has_manifest);
    if (!has_manifest) schema(fmt::format("{}: not a bundle: no {} member", b.label_, kManifestFile));
    where = b.label_ + ":" + kManifestFile;
    if (m.size > kMaxManifestBytes)
      schema(fmt::format("{}: {} bytes, expected at most {}", where, m.size, kMaxManifestBytes));
    b.manifest_bytes_.resize(static_cast<size_t>(m.size));
    if (!pread_all(src->fd, reinterpret_cast<uint8_t*>(b.manifest_bytes_.data()), b.manifest_bytes_.size(), m.offset,
                   b.label_))
      integrity(fmt::format("{}: the archive ends inside the member (it changed while being read)", where));
  }
  b.src_ = std::move(src);
  b.digest_ = "sha256:" + sha256_hex({reinterpret_cast<const uint8_t*>(b.manifest_bytes_.data()),
                                      b.manifest_bytes_.size()});

  Json j;
  try {
    j = parse_json_text(b.manifest_bytes_, JsonLimits{kMaxManifestBytes});
  } catch (const JsonTextError& e) {
    schema(fmt::format("{}: {}", where, e.what()));
  }
  b.manifest_ = from_json(j, where);  // format name and version first, then every field
  return b;
}

bool BundleReader::has(const std::string& rel) const { return src_ && src_->files.count(rel) > 0; }

uint64_t BundleReader::size(const std::string& rel) const {
  auto it = src_->files.find(rel);
  if (it == src_->files.end()) integrity(fmt::format("{}: file {}: missing", label_, rel));
  return it->second.size;
}

std::string BundleReader::sha256(const std::string& rel) const {
  auto it = src_->files.find(rel);
  if (it == src_->files.end()) integrity(fmt::format("{}: file {}: missing", label_, rel));
  Sha256Stream h;
  src_->read(rel, it->second, [&](const uint8_t* p, size_t n) { h.update(p, n); });
  return h.hex();
}

void BundleReader::verify() const { check_files(false); }

void BundleReader::load() const { check_files(true); }

void BundleReader::check_files(bool keep) const {
  std::set<std::string> listed;
  for (const FileEntry& f : manifest_.files) {
    listed.insert(f.path);
    auto it = src_->files.find(f.path);
    if (it == src_->files.end())
      integrity(fmt::format("{}: file {}: listed in the manifest but missing", label_, f.path));
    if (it->second.size != f.size)
      integrity(fmt::format("{}: file {}: {} bytes, expected {}", label_, f.path, it->second.size, f.size));
    if (keep) {
      file(f.path);  // checks the size and sha256 as it loads
      continue;
    }
    const std::string got = sha256(f.path);
    if (got != f.sha256)
      integrity(fmt::format("{}: file {}: sha256 {}, expected {} (the file was altered)", label_, f.path, got,
                            f.sha256));
  }
  for (const auto& [path, member] : src_->files)
    if (!listed.count(path))
      integrity(fmt::format("{}: file {}: present but not listed in the manifest (a bundle holds only its listed "
                            "files)", label_, excerpt(path)));
  for (const KernelEntry& k : manifest_.kernels)
    for (const FileEntry& f : manifest_.files)
      if (f.path == k.file && f.sha256 != k.sha256)
        integrity(fmt::format("{}: kernel {}: sha256 {}, but its file {} has {}", label_, k.key, k.sha256, f.path,
                              f.sha256));
}

std::vector<std::string> BundleReader::files() const {
  std::vector<std::string> out;
  for (const auto& [p, _] : src_->files) out.push_back(p);
  return out;
}

std::span<const uint8_t> BundleReader::file(const std::string& rel) const {
  auto it = src_->files.find(rel);
  if (it == src_->files.end()) integrity(fmt::format("{}: file {}: missing", label_, rel));
  std::lock_guard<std::mutex> lock(src_->mu);
  if (auto l = src_->loaded.find(rel); l != src_->loaded.end()) return l->second;
  const Source::Member& m = it->second;
  if (m.size > kMaxLoadedFileBytes)
    integrity(fmt::format("{}: file {}: {} bytes, expected at most {} (a code object is a few MB)", label_, rel, m.size,
                          kMaxLoadedFileBytes));
  // A listed file must still be what the manifest says: the bundle may have been edited since verify().
  auto listed = std::lower_bound(manifest_.files.begin(), manifest_.files.end(), rel,
                                 [](const FileEntry& f, const std::string& p) { return f.path < p; });
  const bool is_listed = listed != manifest_.files.end() && listed->path == rel;
  if (is_listed && listed->size != m.size)
    integrity(fmt::format("{}: file {}: {} bytes, expected {}", label_, rel, m.size, listed->size));
  std::vector<uint8_t> data;
  data.reserve(static_cast<size_t>(m.size));
  src_->read(rel, m, [&](const uint8_t* p, size_t n) { data.insert(data.end(), p, p + n); });
  if (is_listed) {
    const std::string got = sha256_hex(data);
    if (got != listed->sha256)
      integrity(fmt::format("{}: file {}: sha256 {}, expected {} (the file was altered)", label_, rel, got,
                            listed->sha256));
  }
  return src_->loaded.emplace(rel, std::move(data)).first->second;
}

}  // namespace dp::format
