#include "format/ustar.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "format/untrusted.h"
#include "format/ustar_header.h"

namespace dp::format {
namespace {

constexpr uint64_t kBlock = 512;            // tar's unit: headers and data padding
constexpr size_t kChunk = size_t{1} << 20;  // read size: no member is read whole unless asked for

[[noreturn]] void integrity(const std::string& msg) { throw FormatError(FormatError::Kind::integrity, msg); }
[[noreturn]] void schema(const std::string& msg) { throw FormatError(FormatError::Kind::schema, msg); }

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

// The end-of-archive marker at `at` must be present, and only zeros (at most kMaxArchiveTrailingBytes
// past the marker) may follow it. A missing marker means a cut-off file.
void check_end(int fd, uint64_t size, uint64_t at, const std::string& label, const std::string& after) {
  if (at + 2 * kBlock > size)
    integrity(fmt::format("{}: truncated archive: the end-of-archive marker {} needs {} bytes at byte {}, {} "
                          "present", label, after, 2 * kBlock, at, at > size ? 0 : size - at));
  if (size - at > 2 * kBlock + kMaxArchiveTrailingBytes)
    integrity(fmt::format("{}: corrupt archive: {} bytes from the end-of-archive marker at byte {} to the end of "
                          "the file, expected at most {} (the marker and up to {} bytes of zero padding)", label,
                          size - at, at, 2 * kBlock + kMaxArchiveTrailingBytes, kMaxArchiveTrailingBytes));
  std::vector<uint8_t> tail(static_cast<size_t>(size - at));
  if (!pread_all(fd, tail.data(), tail.size(), at, label))
    integrity(fmt::format("{}: truncated archive: the file shrank while being read", label));
  auto nz = std::find_if(tail.begin(), tail.end(), [](uint8_t b) { return b != 0; });
  if (nz != tail.end())
    integrity(fmt::format("{}: corrupt archive: non-zero byte at {} in or after the end-of-archive marker "
                          "(expected only zeros from byte {})", label, at + (nz - tail.begin()), at));
}

}  // namespace

bool ustar_fits(std::string_view p) {
  if (p.size() <= kUstarNameMax) return true;
  for (size_t s = p.find('/'); s != std::string_view::npos; s = p.find('/', s + 1)) {
    const size_t name_len = p.size() - s - 1;
    if (s <= kUstarPrefixMax && name_len > 0 && name_len <= kUstarNameMax) return true;
  }
  return false;
}

std::string bundle_path_problem(std::string_view p) {
  if (p.empty()) return "empty path";
  if (p.front() == '/') return "absolute path";
  if (p.find('\\') != std::string_view::npos) return "backslash in path";
  if (p.find('\0') != std::string_view::npos) return "NUL byte in path";
  for (size_t start = 0;;) {
    const size_t end = p.find('/', start);
    const std::string_view part = p.substr(start, end == std::string_view::npos ? std::string_view::npos : end - start);
    if (part.empty()) return "empty path component";
    if (part == ".") return "'.' path component";
    if (part == "..") return "'..' path component";
    if (end == std::string_view::npos) break;
    start = end + 1;
  }
  if (!ustar_fits(p))
    return fmt::format("{} bytes, more than ustar stores ({} bytes, or a prefix of at most {} and a name of at most "
                       "{} split at a '/')", p.size(), kUstarNameMax, kUstarPrefixMax, kUstarNameMax);
  return {};
}

// Member data is contiguous 512 bytes after its header (no extended headers are allowed), so the walk
// reads each header where it must be and can say exactly what is missing when the file is cut short.
void walk_archive(int fd, uint64_t size, const std::string& label,
                  const std::function<void(const ArchiveMember&)>& visit) {
  if (size < kBlock)
    integrity(fmt::format("{}: truncated archive: the first header needs {} bytes, {} present", label, kBlock, size));
  // Every name once, except that a directory entry may follow files below it (the directory was then
  // implied); nothing below a file.
  enum class Seen { file, dir_implied, dir_entry };
  std::map<std::string, Seen> seen;
  uint64_t at = 0, entries = 0;
  std::string last;
  auto after = [&] { return last.empty() ? std::string("at the start") : "after entry " + last; };
  uint8_t block[kBlock];
  while (true) {
    if (at == size) check_end(fd, size, at, label, after());  // the file ends where the marker should be
    if (at + kBlock > size)
      integrity(fmt::format("{}: truncated archive: the header {} needs {} bytes at byte {}, {} present", label,
                            after(), kBlock, at, size - at));
    if (!pread_all(fd, block, kBlock, at, label))
      integrity(fmt::format("{}: truncated archive: the file shrank while being read", label));
    if (ustar::is_zero_block(block)) {
      check_end(fd, size, at, label, after());
      return;
    }
    ustar::Header h;
    if (std::string why = ustar::parse_header(block, &h); !why.empty()) {
      if (last.empty()) schema(fmt::format("{}: not a tar archive: {}", label, why));
      integrity(fmt::format("{}: corrupt archive: header {} at byte {}: {}", label, after(), at, why));
    }
    ArchiveMember m;
    m.path = h.path;
    // Extended headers would make the data offset differ from header + 512 and can carry host data
    // (times, owners); decodepack writes none, so their presence means a foreign or altered file.
    if (h.type == ustar::Type::extended)
      integrity(fmt::format("{}: entry {}: a {} (at byte {}), expected plain ustar without extended headers", label,
                            excerpt(m.path), ustar::type_name(h), at));
    if (!h.plain_ustar)
      integrity(fmt::format("{}: entry {}: written as {}, expected plain ustar without extended headers", label,
                            excerpt(m.path), h.dialect));
    if (h.type == ustar::Type::hard_link || h.type == ustar::Type::symbolic_link)
      integrity(fmt::format("{}: entry {}: is a {} to {}; a bundle holds only regular files", label, excerpt(m.path),
                            ustar::type_name(h), excerpt(h.link)));
    if (h.type != ustar::Type::file && h.type != ustar::Type::directory)
      integrity(fmt::format("{}: entry {}: is a {}; a bundle holds only regular files", label, excerpt(m.path),
                            ustar::type_name(h)));
    m.dir = h.type == ustar::Type::directory;
    if (m.dir && !m.path.empty() && m.path.back() == '/') m.path.pop_back();
    if (std::string why = bundle_path_problem(m.path); !why.empty())
      integrity(fmt::format("{}: entry '{}': refused: {}", label, excerpt(m.path), why));
    if (++entries > kMaxBundleFiles)
      schema(fmt::format("{}: entry {}: more than {} entries, expected at most {} (a bundle holds a few hundred files)",
                         label, excerpt(m.path), kMaxBundleFiles, kMaxBundleFiles));
    for (size_t s = m.path.find('/'); s != std::string::npos; s = m.path.find('/', s + 1)) {
      auto [it, fresh] = seen.emplace(m.path.substr(0, s), Seen::dir_implied);
      if (!fresh && it->second == Seen::file)
        integrity(fmt::format("{}: entry {}: its parent {} is a file", label, excerpt(m.path), excerpt(it->first)));
    }
    auto [it, fresh] = seen.emplace(m.path, m.dir ? Seen::dir_entry : Seen::file);
    if (!fresh) {
      if (!(m.dir && it->second == Seen::dir_implied))
        integrity(fmt::format("{}: entry {}: duplicate entry (the name appears twice)", label, excerpt(m.path)));
      it->second = Seen::dir_entry;
    }

    m.size = m.dir ? 0 : h.size;
    if (m.size > kUstarSizeMax)
      integrity(fmt::format("{}: entry {}: size {} bytes, more than ustar stores ({})", label, excerpt(m.path), m.size,
                            kUstarSizeMax));
    m.offset = at + kBlock;
    const uint64_t padded = (m.size + kBlock - 1) / kBlock * kBlock;
    if (m.offset + padded > size)
      integrity(fmt::format("{}: truncated archive: entry {} needs {} bytes ({} of data, padded to {}) at byte {}, "
                            "{} present", label, excerpt(m.path), padded, m.size, kBlock, m.offset, size - m.offset));
    visit(m);
    at = m.offset + padded;
    last = std::move(m.path);
  }
}

void read_member(int fd, const ArchiveMember& m, const std::string& label,
                 const std::function<void(const uint8_t*, size_t)>& sink) {
  std::vector<uint8_t> buf(static_cast<size_t>(std::min<uint64_t>(kChunk, std::max<uint64_t>(m.size, 1))));
  for (uint64_t done = 0; done < m.size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(buf.size(), m.size - done));
    if (!pread_all(fd, buf.data(), n, m.offset + done, label))
      integrity(fmt::format("{}: file {}: the archive ends after {} of its {} bytes (it changed since it was opened)",
                            label, m.path, done, m.size));
    sink(buf.data(), n);
    done += n;
  }
}

}  // namespace dp::format
