#include "common/json.h"

#include <cmath>

#include "common/error.h"
#include "common/fs.h"

namespace dp {

Json parse_json(std::string_view text, std::string_view what, uint64_t max_bytes) {
  try {
    return format::parse_json_text(text, format::JsonLimits{max_bytes});
  } catch (const format::JsonTextError& e) {
    fail(Errc::input, "{}: {}", what, e.what());
  }
}

Json load_json_file(const std::filesystem::path& path, uint64_t max_bytes) {
  return parse_json(read_text_file(path, max_bytes), path.string(), max_bytes);
}

std::string canonical_json(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::strict); }

std::string_view json_type_name(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null: return "null";
    case Json::value_t::boolean: return "a boolean";
    case Json::value_t::number_integer:
    case Json::value_t::number_unsigned: return "an integer";
    case Json::value_t::number_float: return "a number";
    case Json::value_t::string: return "a string";
    case Json::value_t::array: return "an array";
    case Json::value_t::object: return "an object";
    default: return "binary";
  }
}

JsonReader::JsonReader(const Json& obj, std::string where, std::string path)
    : obj_(obj), where_(std::move(where)), path_(std::move(path)) {
  if (!obj_.is_object())
    fail(Errc::input, "{}: {} is {}, expected an object", where_, path_.empty() ? "top level" : path_,
         json_type_name(obj_));
}

std::string JsonReader::field(std::string_view key) const {
  return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
}

bool JsonReader::has(std::string_view key) const {
  auto it = obj_.find(key);
  return it != obj_.end() && !it->is_null();
}

const Json& JsonReader::get(std::string_view key) const {
  auto it = obj_.find(key);
  if (it == obj_.end() || it->is_null()) fail(Errc::input, "{}: missing field {}", where_, field(key));
  return *it;
}

const Json& JsonReader::raw(std::string_view key) const { return get(key); }

int64_t JsonReader::integer(std::string_view key) const {
  const Json& v = get(key);
  if (v.is_number_integer()) return v.get<int64_t>();
  if (v.is_number_float()) {
    // A whole number within int64 (2^63 is exact as a double; anything at or beyond it, or NaN, is not).
    const double d = v.get<double>();
    if (d >= -0x1p63 && d < 0x1p63 && d == std::trunc(d)) return static_cast<int64_t>(d);
  }
  fail(Errc::input, "{}: field {} is {} ({}), expected an integer", where_, field(key), json_type_name(v), json_excerpt(v));
}

int64_t JsonReader::integer_or(std::string_view key, int64_t def) const { return has(key) ? integer(key) : def; }

double JsonReader::number(std::string_view key) const {
  const Json& v = get(key);
  if (!v.is_number())
    fail(Errc::input, "{}: field {} is {} ({}), expected a number", where_, field(key), json_type_name(v), json_excerpt(v));
  return v.get<double>();
}

double JsonReader::number_or(std::string_view key, double def) const { return has(key) ? number(key) : def; }

bool JsonReader::boolean_or(std::string_view key, bool def) const {
  if (!has(key)) return def;
  const Json& v = get(key);
  if (!v.is_boolean())
    fail(Errc::input, "{}: field {} is {} ({}), expected true or false", where_, field(key), json_type_name(v),
         json_excerpt(v));
  return v.get<bool>();
}

std::string JsonReader::string(std::string_view key) const {
  const Json& v = get(key);
  if (!v.is_string())
    fail(Errc::input, "{}: field {} is {} ({}), expected a string", where_, field(key), json_type_name(v), json_excerpt(v));
  return v.get<std::string>();
}

std::string JsonReader::string_or(std::string_view key, std::string_view def) const {
  return has(key) ? string(key) : std::string(def);
}

std::vector<int64_t> JsonReader::int_list(std::string_view key) const {
  const Json& v = get(key);
  if (!v.is_array())
    fail(Errc::input, "{}: field {} is {}, expected a list of integers", where_, field(key), json_type_name(v));
  std::vector<int64_t> out;
  for (size_t i = 0; i < v.size(); ++i) {
    if (!v[i].is_number_integer())
      fail(Errc::input, "{}: field {}[{}] is {} ({}), expected an integer", where_, field(key), i,
           json_type_name(v[i]), json_excerpt(v[i]));
    out.push_back(v[i].get<int64_t>());
  }
  return out;
}

JsonReader JsonReader::object(std::string_view key) const { return JsonReader(get(key), where_, field(key)); }

}  // namespace dp
