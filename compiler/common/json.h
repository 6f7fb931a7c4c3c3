// JSON loading with messages that name the file and the field path.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

#include "format/untrusted.h"

namespace dp {

using Json = nlohmann::json;
using OrderedJson = nlohmann::ordered_json;

// How messages quote a value taken from input: escaped and cut (format/untrusted.h).
using format::excerpt;
using format::json_excerpt;

// Parses `text` within the limits of format/untrusted.h (size, nesting depth of 64, no repeated key);
// anything refused becomes dp::Error(input) "<what>: <detail>", e.g. "<what>: invalid JSON at byte N: ...".
Json parse_json(std::string_view text, std::string_view what, uint64_t max_bytes = format::kMaxConfigBytes);
// Reads a regular file of at most `max_bytes` (dp::Error(io) if it cannot be read or is not a regular
// file, dp::Error(input) if it is larger) and parses it as parse_json() does.
Json load_json_file(const std::filesystem::path& path, uint64_t max_bytes = format::kMaxConfigBytes);

// Canonical serialisation: keys sorted (nlohmann::json keeps them sorted), no spaces, UTF-8.
// Used for every digest taken over JSON.
std::string canonical_json(const Json& j);

std::string_view json_type_name(const Json& j);

// Typed field access: `where` is the file name and `path` the dotted field path, both only used in
// messages such as "config.json: field text_config.hidden_size is a string, expected an integer".
class JsonReader {
 public:
  JsonReader(const Json& obj, std::string where, std::string path = {});
  bool has(std::string_view key) const;
  int64_t integer(std::string_view key) const;
  int64_t integer_or(std::string_view key, int64_t def) const;
  double number(std::string_view key) const;
  double number_or(std::string_view key, double def) const;
  bool boolean_or(std::string_view key, bool def) const;
  std::string string(std::string_view key) const;
  std::string string_or(std::string_view key, std::string_view def) const;
  std::vector<int64_t> int_list(std::string_view key) const;
  JsonReader object(std::string_view key) const;
  const Json& raw(std::string_view key) const;  // throws if missing
  const Json& json() const { return obj_; }
  std::string field(std::string_view key) const;  // "text_config.hidden_size"
  const std::string& where() const { return where_; }

 private:
  const Json& get(std::string_view key) const;
  const Json& obj_;
  std::string where_;
  std::string path_;
};

}  // namespace dp
