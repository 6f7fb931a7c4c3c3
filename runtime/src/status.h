// Results inside libdecodepack: a Status (a dp_code and a message) or a value, returned, never thrown.
// The C boundary (c_api.cpp) turns a failed Status into the dp_status object of the ABI; exceptions
// from the format library and the standard library are converted there and in bundle.cpp, so none
// crosses the ABI.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <variant>

#include <fmt/format.h>

#include "decodepack/decodepack.h"

namespace dp::rt {

class [[nodiscard]] Status {
 public:
  Status() = default;  // success
  Status(dp_code code, std::string message) : code_(code), message_(std::move(message)) {}

  bool ok() const { return code_ == DP_OK; }
  dp_code code() const { return code_; }
  const std::string& message() const { return message_; }

 private:
  dp_code code_ = DP_OK;
  std::string message_;
};

inline Status ok() { return {}; }

template <typename... Args>
Status error(dp_code code, fmt::format_string<Args...> f, Args&&... args) {
  return Status(code, fmt::format(f, std::forward<Args>(args)...));
}

// A value or the Status saying why there is none.
template <typename T>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::move(value)) {}          // NOLINT: implicit, as std::expected
  Result(Status s) : v_(std::move(s)) {}             // NOLINT: must not be ok()
  bool ok() const { return std::holds_alternative<T>(v_); }
  T& value() { return std::get<T>(v_); }
  const T& value() const { return std::get<T>(v_); }
  T& operator*() { return value(); }
  T* operator->() { return &value(); }
  Status status() const { return ok() ? Status() : std::get<Status>(v_); }

 private:
  std::variant<T, Status> v_;
};

}  // namespace dp::rt

// Returns the Status of `expr` from the enclosing function when it failed.
#define DP_RETURN_IF_ERROR(expr)                   \
  do {                                             \
    ::dp::rt::Status dp_status_ = (expr);          \
    if (!dp_status_.ok()) return dp_status_;       \
  } while (0)
