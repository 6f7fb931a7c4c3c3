#include "format/ustar_header.h"

#include <algorithm>
#include <optional>
#include <string_view>

#include <fmt/format.h>

namespace dp::format::ustar {
namespace {

// Field offsets and lengths of a ustar header.
constexpr size_t kName = 0, kNameLen = 100;
constexpr size_t kSize = 124, kSizeLen = 12;
constexpr size_t kChksum = 148, kChksumLen = 8;
constexpr size_t kTypeflag = 156;
constexpr size_t kLinkname = 157, kLinknameLen = 100;
constexpr size_t kMagic = 257;  // 6 bytes of magic, then 2 of version
constexpr size_t kPrefix = 345, kPrefixLen = 155;

// A NUL-terminated (or full-length) text field.
std::string text_field(const uint8_t* b, size_t at, size_t len) {
  const char* p = reinterpret_cast<const char*>(b + at);
  return std::string(p, std::find(p, p + len, '\0'));
}

// An octal number field: optional leading spaces, octal digits, then only NULs or spaces. Base-256
// (GNU's binary numbers, first byte with the high bit set) is not ustar and is refused.
std::optional<uint64_t> octal_field(const uint8_t* b, size_t at, size_t len) {
  size_t i = at, end = at + len;
  while (i < end && b[i] == ' ') ++i;
  uint64_t v = 0;
  size_t digits = 0;
  for (; i < end && b[i] >= '0' && b[i] <= '7'; ++i, ++digits) {
    if (v >> 61) return std::nullopt;  // would overflow 64 bits (no field is that long, but be exact)
    v = v * 8 + (b[i] - '0');
  }
  if (digits == 0) return std::nullopt;
  for (; i < end; ++i)
    if (b[i] != '\0' && b[i] != ' ') return std::nullopt;
  return v;
}

std::string show_field(const uint8_t* b, size_t at, size_t len) {
  std::string s;
  for (size_t i = at; i < at + len; ++i) {
    const uint8_t c = b[i];
    if (c >= 0x20 && c < 0x7f) s += static_cast<char>(c);
    else s += fmt::format("\\x{:02x}", c);
  }
  return s;
}

}  // namespace

bool is_zero_block(const uint8_t* block) { return std::all_of(block, block + kBlock, [](uint8_t c) { return c == 0; }); }

std::string parse_header(const uint8_t* b, Header* out) {
  // The checksum covers the whole block with its own field read as spaces; historic writers summed
  // signed chars, so either sum is accepted.
  const std::optional<uint64_t> stored = octal_field(b, kChksum, kChksumLen);
  if (!stored) return fmt::format("header checksum field '{}' is not an octal number", show_field(b, kChksum, kChksumLen));
  uint64_t unsigned_sum = 0;
  int64_t signed_sum = 0;
  for (size_t i = 0; i < kBlock; ++i) {
    const uint8_t c = i >= kChksum && i < kChksum + kChksumLen ? ' ' : b[i];
    unsigned_sum += c;
    signed_sum += static_cast<int8_t>(c);
  }
  if (*stored != unsigned_sum && static_cast<int64_t>(*stored) != signed_sum)
    return fmt::format("header checksum {} does not match the header's bytes (they sum to {})", *stored, unsigned_sum);

  Header h;
  const std::string_view magic(reinterpret_cast<const char*>(b + kMagic), 8);
  if (magic == std::string_view("ustar\0" "00", 8)) {
    h.plain_ustar = true;
  } else if (magic == std::string_view("ustar  \0", 8)) {
    h.dialect = "GNU tar";
  } else if (magic.substr(0, 6) == std::string_view("ustar\0", 6)) {
    h.dialect = fmt::format("ustar version '{}'", show_field(b, kMagic + 6, 2));
  } else {
    h.dialect = "pre-POSIX tar";
  }
  h.path = text_field(b, kName, kNameLen);
  if (h.plain_ustar) {
    const std::string prefix = text_field(b, kPrefix, kPrefixLen);
    if (!prefix.empty()) h.path = prefix + "/" + h.path;
  }
  h.link = text_field(b, kLinkname, kLinknameLen);
  h.typeflag = static_cast<char>(b[kTypeflag]);
  switch (h.typeflag) {
    case '0': case '\0': case '7': h.type = Type::file; break;
    case '5': h.type = Type::directory; break;
    case '1': h.type = Type::hard_link; break;
    case '2': h.type = Type::symbolic_link; break;
    case '3': case '4': case '6': h.type = Type::special; break;
    case 'x': case 'g': case 'L': case 'K': h.type = Type::extended; break;
    default: h.type = Type::other; break;
  }
  const std::optional<uint64_t> size = octal_field(b, kSize, kSizeLen);
  if (!size)
    return fmt::format("entry '{}': size field '{}' is not an octal number", h.path.substr(0, 200),
                       show_field(b, kSize, kSizeLen));
  h.size = *size;
  *out = std::move(h);
  return {};
}

std::string type_name(const Header& h) {
  switch (h.type) {
    case Type::file: return "regular file";
    case Type::directory: return "directory";
    case Type::hard_link: return "hard link";
    case Type::symbolic_link: return "symbolic link";
    case Type::special: return "device, fifo or socket";
    case Type::extended:
      return h.typeflag == 'x' || h.typeflag == 'g' ? "pax extended header" : "GNU long-name header";
    case Type::other: break;
  }
  return fmt::format("file of unknown type '{}'", show_field(reinterpret_cast<const uint8_t*>(&h.typeflag), 0, 1));
}

}  // namespace dp::format::ustar
