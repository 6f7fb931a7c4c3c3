// One POSIX ustar header block (POSIX.1-1988; bundle-format.md §1.1 gives the fields a writer sets),
// parsed without any archive library: a .dpk is an uncompressed ustar archive whose member data lies
// contiguously after each header, so its readers (walk_archive() in format/ustar.h) need nothing more
// than this and pread().
//
// parse_header() checks the block's own consistency (checksum, numeric fields) and reports what kind of
// header it is; whether that kind is allowed in a bundle (only plain ustar regular files and
// directories are) is the caller's decision, so that its message can name the entry. Nothing here
// throws; nothing reads beyond the 512 bytes given.
//
// Example:
//   uint8_t block[dp::format::ustar::kBlock];  // read at a header's offset
//   dp::format::ustar::Header h;
//   if (std::string why = dp::format::ustar::parse_header(block, &h); !why.empty()) ...  // not a header
//   if (h.type == Type::file) data = [offset + 512, offset + 512 + h.size)
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dp::format::ustar {

inline constexpr size_t kBlock = 512;  // headers and data padding

enum class Type {
  file,           // typeflag '0', NUL (pre-POSIX) or '7' (contiguous file: a regular file for readers)
  directory,      // '5'
  hard_link,      // '1'
  symbolic_link,  // '2'
  special,        // '3', '4', '6': character or block device, FIFO
  extended,       // pax 'x' / 'g', GNU 'L' / 'K' (long names): headers that change the next entry
  other,          // any other typeflag (vendor extensions)
};

struct Header {
  std::string path;     // `prefix` + '/' + `name` when the prefix is set (ustar), else `name`
  std::string link;     // `linkname`: a hard or symbolic link's target
  Type type = Type::other;
  char typeflag = 0;
  uint64_t size = 0;    // of the member's data, before padding to a multiple of kBlock
  // "ustar\0" magic with version "00": the only dialect a bundle may use. `dialect` names the others
  // for messages ("GNU tar", "pre-POSIX tar", "ustar version 'xx'").
  bool plain_ustar = false;
  std::string dialect;
};

// True when all kBlock bytes are zero (a block of the end-of-archive marker).
bool is_zero_block(const uint8_t* block);

// Parses the kBlock bytes at `block` into `out`. Returns "" on success, else why the block is not a tar
// header (a checksum that does not match, a malformed size), in words fit for an error message.
std::string parse_header(const uint8_t* block, Header* out);

// Words for a header type in messages: "symbolic link", "pax extended header", ...
std::string type_name(const Header& h);

}  // namespace dp::format::ustar
