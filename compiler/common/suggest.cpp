#include "common/suggest.h"

#include <algorithm>
#include <vector>

namespace dp {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

std::string closest_name(std::string_view word, std::span<const std::string> candidates, size_t max_distance) {
  if (word.size() > 64) return {};
  std::string best;
  size_t best_d = max_distance + 1;
  for (const std::string& c : candidates)
    if (size_t d = edit_distance(word, c); d < best_d) best = c, best_d = d;
  return best;
}

}  // namespace dp
