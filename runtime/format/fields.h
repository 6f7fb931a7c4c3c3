// The strict JSON field reader behind the manifest's readers (manifest.cpp, sections.cpp): every
// failure is a FormatError(schema) naming the field's dotted path, the value and what was expected.
// Internal to dp_format.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fmt/format.h>

#include "format/manifest.h"
#include "format/untrusted.h"

namespace dp::format::fields {

// Every manifest message ends here. Values from the manifest are quoted through excerpt() where they are
// formatted; the whole message is cut again so that no field a message names unquoted (a weight or file
// name) can make it unbounded.
[[noreturn]] inline void schema_error(const std::string& where, const std::string& msg) {
  throw FormatError(FormatError::Kind::schema, where + ": " + excerpt(msg, 8 * kExcerptMax));
}

// Strict field reader over one JSON object, with the field path for messages.
class Obj {
 public:
  Obj(const Json& j, std::string where, std::string path) : j_(j), where_(std::move(where)), path_(std::move(path)) {
    if (!j_.is_object()) schema_error(where_, fmt::format("{} is {}, expected an object", label(), j_.type_name()));
  }
  std::string field(std::string_view k) const { return path_.empty() ? std::string(k) : path_ + "." + std::string(k); }
  const Json& get(std::string_view k) const {
    auto it = j_.find(k);
    if (it == j_.end()) schema_error(where_, fmt::format("missing field {}", field(k)));
    return *it;
  }
  bool has(std::string_view k) const { return j_.contains(k); }
  std::string str(std::string_view k) const {
    const Json& v = get(k);
    if (!v.is_string()) schema_error(where_, fmt::format("field {} is {}, expected a string", field(k), v.type_name()));
    return v.get<std::string>();
  }
  template <typename T>
  T num(std::string_view k, T lo = std::numeric_limits<T>::lowest(), T hi = std::numeric_limits<T>::max()) const {
    const Json& v = get(k);
    if (!v.is_number() || (std::is_integral_v<T> && !v.is_number_integer()))
      schema_error(where_, fmt::format("field {} is {} ({}), expected {}", field(k), v.type_name(), json_excerpt(v),
                                       std::is_integral_v<T> ? "an integer" : "a number"));
    if constexpr (std::is_integral_v<T>) {
      // A parsed non-negative integer is unsigned: it is held to the lower bound too (1 for a size).
      if (v.is_number_unsigned() ? (v.get<uint64_t>() > static_cast<uint64_t>(hi) ||
                                    (lo > 0 && v.get<uint64_t>() < static_cast<uint64_t>(lo)))
                                 : (v.get<int64_t>() < static_cast<int64_t>(lo) || v.get<int64_t>() > static_cast<int64_t>(hi)))
        schema_error(where_, fmt::format("field {} is {}, expected {}..{}", field(k), json_excerpt(v), lo, hi));
    }
    return v.get<T>();
  }
  bool boolean(std::string_view k) const {
    const Json& v = get(k);
    if (!v.is_boolean()) schema_error(where_, fmt::format("field {} is {}, expected true or false", field(k), v.type_name()));
    return v.get<bool>();
  }
  const Json& array(std::string_view k) const {
    const Json& v = get(k);
    if (!v.is_array()) schema_error(where_, fmt::format("field {} is {}, expected an array", field(k), v.type_name()));
    return v;
  }
  Obj obj(std::string_view k) const { return Obj(get(k), where_, field(k)); }
  Obj at(std::string_view k, size_t i) const { return Obj(array(k)[i], where_, fmt::format("{}[{}]", field(k), i)); }
  std::vector<int64_t> ints(std::string_view k, int64_t lo = INT64_MIN, int64_t hi = INT64_MAX) const {
    std::vector<int64_t> out;
    const Json& a = array(k);
    for (size_t i = 0; i < a.size(); ++i) {
      if (!a[i].is_number_integer() || (a[i].is_number_unsigned() && a[i].get<uint64_t>() > INT64_MAX))
        schema_error(where_, fmt::format("field {}[{}] is {} ({}), expected an integer", field(k), i,
                                         a[i].type_name(), json_excerpt(a[i])));
      const int64_t v = a[i].get<int64_t>();
      if (v < lo || v > hi) schema_error(where_, fmt::format("field {}[{}] is {}, expected {}..{}", field(k), i, v, lo, hi));
      out.push_back(v);
    }
    return out;
  }
  std::vector<std::string> strs(std::string_view k) const {
    std::vector<std::string> out;
    const Json& a = array(k);
    for (size_t i = 0; i < a.size(); ++i) {
      if (!a[i].is_string())
        schema_error(where_, fmt::format("field {}[{}] is {}, expected a string", field(k), i, a[i].type_name()));
      out.push_back(a[i].get<std::string>());
    }
    return out;
  }
  void dim3(std::string_view k, uint32_t out[3]) const {
    std::vector<int64_t> v = ints(k);
    if (v.size() != 3) schema_error(where_, fmt::format("field {} has {} entries, expected 3", field(k), v.size()));
    for (int i = 0; i < 3; ++i) {
      if (v[i] < 1 || v[i] > 0x7fffffff) schema_error(where_, fmt::format("field {}[{}] is {}, expected >= 1", field(k), i, v[i]));
      out[i] = static_cast<uint32_t>(v[i]);
    }
  }
  const std::string& where() const { return where_; }
  std::string label() const { return path_.empty() ? "top level" : path_; }
  // A reader of this version knows every field of every manifest it accepts (newer minors are refused
  // before this runs), so an unknown field is an edit or a bug, never a newer writer.
  void only(std::initializer_list<std::string_view> keys) const {
    for (auto it = j_.begin(); it != j_.end(); ++it)
      if (std::find(keys.begin(), keys.end(), it.key()) == keys.end())
        schema_error(where_, fmt::format("unknown field {}", excerpt(field(it.key()))));
  }

 private:
  const Json& j_;
  std::string where_, path_;
};

}  // namespace dp::format::fields
