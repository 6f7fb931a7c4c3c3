#include "format/bundle_reader.h"

#include <archive.h>
#include <archive_entry.h>
#include <openssl/evp.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>
#include <set>

#include <fmt/format.h>

namespace fs = std::filesystem;

namespace dp::format {
namespace {

constexpr uint64_t kBlock = 512;  // tar's unit: headers and data padding

[[noreturn]] void integrity(const std::string& msg) { throw FormatError(FormatError::Kind::integrity, msg); }
[[noreturn]] void schema(const std::string& msg) { throw FormatError(FormatError::Kind::schema, msg); }

std::vector<uint8_t> read_whole(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) throw BundleIoError(fmt::format("{}: cannot open: {}", p.string(), std::strerror(errno)));
  std::vector<uint8_t> out;
  in.seekg(0, std::ios::end);
  const std::streamoff n = in.tellg();
  if (n < 0) throw BundleIoError(fmt::format("{}: cannot determine its size", p.string()));
  in.seekg(0, std::ios::beg);
  out.resize(static_cast<size_t>(n));
  if (n > 0 && !in.read(reinterpret_cast<char*>(out.data()), n))
    throw BundleIoError(fmt::format("{}: read failed after {} of {} bytes", p.string(), in.gcount(), n));
  return out;
}

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

struct ArchiveDeleter {
  void operator()(struct archive* a) const { archive_read_free(a); }
};

// Walks a ustar archive held in memory and fills `files` with its regular members. Member data is
// contiguous 512 bytes after its header (no extended headers are allowed), so the walk tracks where
// each header must be and can say exactly what is missing when the file is cut short.
void read_archive(const std::string& label, const std::vector<uint8_t>& bytes,
                  std::map<std::string, std::vector<uint8_t>>& files) {
  const uint64_t size = bytes.size();
  if (size < kBlock)
    integrity(fmt::format("{}: truncated archive: the first header needs {} bytes, {} present", label, kBlock, size));
  std::unique_ptr<struct archive, ArchiveDeleter> a(archive_read_new());
  if (!a) throw std::bad_alloc();
  archive_read_support_format_tar(a.get());  // uncompressed tar only: anything else is not a .dpk
  if (archive_read_open_memory(a.get(), bytes.data(), bytes.size()) != ARCHIVE_OK)
    schema(fmt::format("{}: not a tar archive: {}", label, archive_error_string(a.get())));

  std::map<std::string, bool> seen;  // path -> is a directory (explicit or implied by a member below it)
  uint64_t next_header = 0;
  std::string last;
  auto after = [&] { return last.empty() ? std::string("at the start") : "after entry " + last; };
  while (true) {
    struct archive_entry* e = nullptr;
    const int r = archive_read_next_header(a.get(), &e);
    const uint64_t at = next_header;
    if (r == ARCHIVE_EOF) {
      // libarchive accepts a missing end-of-archive marker; for a bundle it means a cut-off file.
      if (at + 2 * kBlock > size)
        integrity(fmt::format("{}: truncated archive: the end-of-archive marker {} needs {} bytes at byte {}, {} "
                              "present", label, after(), 2 * kBlock, at, at > size ? 0 : size - at));
      auto nz = std::find_if(bytes.begin() + static_cast<std::ptrdiff_t>(at), bytes.end(), [](uint8_t b) { return b; });
      if (nz != bytes.end())
        integrity(fmt::format("{}: corrupt archive: non-zero byte at {} in or after the end-of-archive marker "
                              "(expected only zeros from byte {})", label, nz - bytes.begin(), at));
      return;
    }
    if (r != ARCHIVE_OK) {
      if (at + kBlock > size)
        integrity(fmt::format("{}: truncated archive: the header {} needs {} bytes at byte {}, {} present", label,
                              after(), kBlock, at, size - at));
      if (last.empty()) schema(fmt::format("{}: not a ustar archive: {}", label, archive_error_string(a.get())));
      integrity(fmt::format("{}: corrupt archive: header {} at byte {}: {}", label, after(), at,
                            archive_error_string(a.get())));
    }
    const char* raw = archive_entry_pathname(e);
    std::string path = raw ? raw : "";
    if (archive_format(a.get()) != ARCHIVE_FORMAT_TAR_USTAR)
      integrity(fmt::format("{}: entry {}: written as {}, expected plain ustar without extended headers", label,
                            path, archive_format_name(a.get())));
    if (archive_entry_hardlink(e))
      integrity(fmt::format("{}: entry {}: is a hard link; a bundle holds only regular files", label, path));
    const auto type = archive_entry_filetype(e);
    if (type != AE_IFREG && type != AE_IFDIR)
      integrity(fmt::format("{}: entry {}: is a {}; a bundle holds only regular files", label, path,
                            type == AE_IFLNK ? "symbolic link" : "device, fifo or socket"));
    const bool dir = type == AE_IFDIR;
    if (dir && !path.empty() && path.back() == '/') path.pop_back();
    if (std::string why = path_problem(path); !why.empty())
      integrity(fmt::format("{}: entry '{}': refused: {}", label, path, why));
    for (size_t s = path.find('/'); s != std::string::npos; s = path.find('/', s + 1)) {
      auto [it, fresh] = seen.emplace(path.substr(0, s), true);
      if (!fresh && !it->second)
        integrity(fmt::format("{}: entry {}: its parent {} is a file", label, path, it->first));
    }
    if (auto it = seen.find(path); it != seen.end() && !(dir && it->second))
      integrity(fmt::format("{}: entry {}: duplicate entry (the name appears twice)", label, path));
    seen[path] = dir;

    const uint64_t len = dir ? 0 : static_cast<uint64_t>(archive_entry_size(e));
    const uint64_t data_at = at + kBlock;
    const uint64_t padded = (len + kBlock - 1) / kBlock * kBlock;
    if (static_cast<uint64_t>(archive_read_header_position(a.get())) != at)
      integrity(fmt::format("{}: entry {}: header at byte {}, expected {} (extended headers are not allowed)", label,
                            path, archive_read_header_position(a.get()), at));
    if (data_at + padded > size)
      integrity(fmt::format("{}: truncated archive: entry {} needs {} bytes ({} of data, padded to {}) at byte {}, "
                            "{} present", label, path, padded, len, kBlock, data_at, size - data_at));
    if (!dir)
      files.emplace(path, std::vector<uint8_t>(bytes.begin() + static_cast<std::ptrdiff_t>(data_at),
                                               bytes.begin() + static_cast<std::ptrdiff_t>(data_at + len)));
    archive_read_data_skip(a.get());
    next_header = data_at + padded;
    last = path;
  }
}

void read_directory(const fs::path& root, std::map<std::string, std::vector<uint8_t>>& files) {
  std::error_code ec;
  fs::recursive_directory_iterator it(root, fs::directory_options::none, ec), end;
  if (ec) throw BundleIoError(fmt::format("{}: cannot list: {}", root.string(), ec.message()));
  for (; it != end; it.increment(ec)) {
    if (ec) break;
    const fs::file_status st = it->symlink_status(ec);
    if (ec) throw BundleIoError(fmt::format("{}: cannot stat: {}", it->path().string(), ec.message()));
    if (fs::is_directory(st)) continue;
    const std::string rel = it->path().lexically_relative(root).generic_string();
    if (fs::is_symlink(st))
      integrity(fmt::format("{}: {} is a symbolic link; a bundle holds only regular files", root.string(), rel));
    if (!fs::is_regular_file(st))
      integrity(fmt::format("{}: {} is not a regular file; a bundle holds only regular files", root.string(), rel));
    files.emplace(rel, read_whole(it->path()));
  }
  if (ec) throw BundleIoError(fmt::format("{}: cannot list: {}", root.string(), ec.message()));
}

}  // namespace

std::string sha256_hex(std::span<const uint8_t> data) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  if (EVP_Digest(data.data(), data.size(), md, &n, EVP_sha256(), nullptr) != 1 || n != 32)
    throw std::runtime_error("OpenSSL EVP_Digest(sha256) failed");
  static const char* hex = "0123456789abcdef";
  std::string out(64, '0');
  for (unsigned i = 0; i < 32; ++i) {
    out[2 * i] = hex[md[i] >> 4];
    out[2 * i + 1] = hex[md[i] & 15];
  }
  return out;
}

BundleReader BundleReader::open(const fs::path& path) {
  BundleReader b;
  b.label_ = path.string();
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);
  if (ec || !fs::exists(st))
    throw BundleIoError(fmt::format("{}: no such bundle (expected a directory or a .dpk file)", b.label_));
  if (fs::is_directory(st)) {
    read_directory(path, b.files_);
  } else if (fs::is_regular_file(st)) {
    b.archive_ = true;
    read_archive(b.label_, read_whole(path), b.files_);
  } else {
    throw BundleIoError(fmt::format("{}: neither a directory nor a regular file", b.label_));
  }

  auto it = b.files_.find(kManifestFile);
  if (it == b.files_.end())
    schema(fmt::format("{}: not a bundle: no {} {}", b.label_, kManifestFile, b.archive_ ? "member" : "file"));
  b.manifest_bytes_.assign(it->second.begin(), it->second.end());
  b.files_.erase(it);
  b.digest_ = "sha256:" + sha256_hex({reinterpret_cast<const uint8_t*>(b.manifest_bytes_.data()),
                                      b.manifest_bytes_.size()});

  const std::string where = b.archive_ ? b.label_ + ":" + kManifestFile : (path / kManifestFile).string();
  Json j;
  try {
    j = Json::parse(b.manifest_bytes_);
  } catch (const Json::parse_error& e) {
    schema(fmt::format("{}: not JSON: {}", where, e.what()));
  }
  b.manifest_ = from_json(j, where);  // format name and version first, then every field
  return b;
}

void BundleReader::verify() const {
  std::set<std::string> listed;
  for (const FileEntry& f : manifest_.files) {
    listed.insert(f.path);
    auto it = files_.find(f.path);
    if (it == files_.end())
      integrity(fmt::format("{}: file {}: listed in the manifest but missing", label_, f.path));
    if (it->second.size() != f.size)
      integrity(fmt::format("{}: file {}: {} bytes, expected {}", label_, f.path, it->second.size(), f.size));
    const std::string got = sha256_hex(it->second);
    if (got != f.sha256)
      integrity(fmt::format("{}: file {}: sha256 {}, expected {} (the file was altered)", label_, f.path, got,
                            f.sha256));
  }
  for (const auto& [path, data] : files_)
    if (!listed.count(path))
      integrity(fmt::format("{}: file {}: present but not listed in the manifest (a bundle holds only its listed "
                            "files)", label_, path));
  for (const KernelEntry& k : manifest_.kernels)
    for (const FileEntry& f : manifest_.files)
      if (f.path == k.file && f.sha256 != k.sha256)
        integrity(fmt::format("{}: kernel {}: sha256 {}, but its file {} has {}", label_, k.key, k.sha256, f.path,
                              f.sha256));
}

std::vector<std::string> BundleReader::files() const {
  std::vector<std::string> out;
  for (const auto& [p, _] : files_) out.push_back(p);
  return out;
}

std::span<const uint8_t> BundleReader::file(const std::string& rel) const {
  auto it = files_.find(rel);
  if (it == files_.end()) integrity(fmt::format("{}: file {}: missing", label_, rel));
  return it->second;
}

}  // namespace dp::format
