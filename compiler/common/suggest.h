// "Did you mean ...?" for names a user typed: deploy fields, subcommands.
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>

namespace dp {

// Levenshtein distance (insertions, deletions, substitutions), O(|a| x |b|).
size_t edit_distance(std::string_view a, std::string_view b);

// The candidate nearest to `word` if it is within `max_distance` edits, else "" (the first of equals
// wins). Words longer than 64 characters are not typos and get no suggestion.
std::string closest_name(std::string_view word, std::span<const std::string> candidates, size_t max_distance = 2);

}  // namespace dp
