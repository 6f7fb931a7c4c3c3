// Reading untrusted input: the helpers every reader of a file decodepack did not write goes through, in
// the compiler (config.json, deploy files, safetensors headers and indexes) and in the runtime (bundle
// manifests and archives). Nothing here throws dp::Error or FormatError: callers turn the results into
// their own error types, so that the compiler and the runtime refuse the same inputs with the same words.
//
// - excerpt(): how a value taken from input appears in a message: control bytes and malformed UTF-8
//   escaped, cut to a bounded length with a note of the full length, so that a hostile file cannot
//   flood a terminal or a log with a 100 MB string or forge extra lines.
// - parse_json_text(): nlohmann::json's parse with limits. Its DOM copies, compares and serialises
//   recursively, so a document nested 100000 deep overflows the stack after a successful parse; and it
//   silently keeps one of two equal keys. This refuses, before building anything, a text larger than
//   the limit or nested deeper than the limit, then any syntax error and any key repeated in an object.
// - open_regular_file() / read_regular_file(): open only regular files, checked on the opened
//   descriptor (opened with O_NONBLOCK, so that a FIFO cannot block the open itself), and read at most
//   a given number of bytes.
//
// Example:
//   std::string text;
//   if (std::string why = read_regular_file(path, kMaxConfigBytes, text); !why.empty()) ... // "<why>"
//   Json j = parse_json_text(text, JsonLimits{kMaxConfigBytes});   // throws JsonTextError
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <string_view>

namespace dp::format {

using Json = nlohmann::json;

// ---- Messages -----------------------------------------------------------------------------------------

// Longest excerpt of an input value that a message quotes (bytes of the escaped text).
inline constexpr size_t kExcerptMax = 200;

// `s` as a message may quote it: well-formed UTF-8 kept, control bytes, DEL and stray high bytes
// written as \xNN; when longer than `max`, cut there and followed by "... (N bytes)", N the full length.
std::string excerpt(std::string_view s, size_t max = kExcerptMax);
// A JSON value's text (compact, invalid UTF-8 replaced) as excerpt() quotes it; a long string costs
// O(max), not a copy of it.
std::string json_excerpt(const Json& v, size_t max = kExcerptMax);

// ---- JSON ---------------------------------------------------------------------------------------------

// Nesting depth that every document decodepack reads stays within (the real ones nest at most 6 deep).
inline constexpr int kMaxJsonDepth = 64;

// Largest documents, far above the real ones and far below what would exhaust memory once parsed.
inline constexpr uint64_t kMaxConfigBytes = uint64_t{16} << 20;    // config.json, deploy files (a few KB)
inline constexpr uint64_t kMaxIndexBytes = uint64_t{256} << 20;    // model.safetensors.index.json (K3: ~50 MB)
inline constexpr uint64_t kMaxManifestBytes = uint64_t{512} << 20; // manifest.json (K3 TP 8 fingerprinted: ~270 MB)

struct JsonLimits {
  uint64_t max_bytes = kMaxConfigBytes;
  int max_depth = kMaxJsonDepth;
};

// A text parse_json_text() refuses. what() is "<detail>" (no file name: callers prefix their own);
// `offset` is the 0-based byte of the text where the problem was found (0 for too_large and
// duplicate_key). For duplicate_key, `key` is the repeated key's dotted path (raw: excerpt() it before
// quoting) and `key_depth` its object's depth (1: the top-level object).
struct JsonTextError : std::runtime_error {
  enum class Kind { too_large, too_deep, syntax, duplicate_key };
  JsonTextError(Kind k, uint64_t at, std::string detail) : std::runtime_error(std::move(detail)), kind(k), offset(at) {}
  Kind kind;
  uint64_t offset;
  std::string key;
  size_t key_depth = 0;
};

// Parses `text` within `limits`; throws JsonTextError. Messages:
//   too_large:     "<N> bytes, expected at most <max>"
//   too_deep:      "arrays and objects nested deeper than <max> levels at byte <b> (at most <max> are allowed)"
//   syntax:        "invalid JSON at byte <b>: <nlohmann's explanation, excerpted>"
//   duplicate_key: "key <dotted.path> appears more than once in one object (JSON objects must not repeat a key)"
Json parse_json_text(std::string_view text, const JsonLimits& limits);

// ---- Files --------------------------------------------------------------------------------------------

// "a FIFO (named pipe)", "a directory", "a socket", ... for a stat(2) st_mode or a std::filesystem type.
std::string_view file_type_name(unsigned mode);
std::string_view file_type_name(std::filesystem::file_type type);

// Opens `path` read-only (O_CLOEXEC) if it is a regular file; returns the descriptor and sets *size.
// On failure returns -1 and sets *why to "cannot open: <system error>" or "is <type>, expected a regular
// file". A FIFO, socket or device never blocks or is read.
int open_regular_file(const std::filesystem::path& path, uint64_t* size, std::string* why);

// Reads the regular file `path` whole into `out` if it holds at most `max_bytes`. Returns "" on success;
// otherwise why not, as open_regular_file() says, or "<N> bytes, expected at most <max>" (then *too_large
// is set when given: the caller may call that bad input rather than an I/O failure).
std::string read_regular_file(const std::filesystem::path& path, uint64_t max_bytes, std::string& out,
                              bool* too_large = nullptr);

}  // namespace dp::format
