// Small text helpers for protocol text (HTTP headers, registry replies) and untrusted values in
// messages.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace dp {

// ASCII lower case (other bytes unchanged).
inline char ascii_lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

inline std::string ascii_lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = ascii_lower(c);
  return out;
}

// Without leading spaces and tabs, and without trailing spaces, tabs, CR and LF.
inline std::string_view trim_space(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t' || s.back() == '\r' || s.back() == '\n')) s.remove_suffix(1);
  return s;
}

// Untrusted text for a message: printable ASCII (anything else becomes '?'), at most `max` characters,
// then "...".
inline std::string printable_ascii(std::string_view s, size_t max = 200) {
  std::string out;
  for (char c : s.substr(0, max))
    out += (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) > 0x7e) ? '?' : c;
  if (s.size() > max) out += "...";
  return out;
}

}  // namespace dp
