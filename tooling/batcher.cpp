#include "tooling/batcher.h"

#include <algorithm>
#include <charconv>
#include <sstream>

#include <fmt/format.h>

#include "common/error.h"
#include "common/fs.h"
#include "decodepack/decodepack.h"

namespace dp::tools {

BatchSizing batch_sizing(const std::vector<BatchRequest>& requests, int64_t block_size) {
  BatchSizing s;
  s.slots = 1 + static_cast<int64_t>(requests.size());
  for (const BatchRequest& r : requests) {
    const int64_t need = (r.tokens_fed() + block_size - 1) / block_size;
    s.blocks += need;
    s.cols = std::max<int32_t>(s.cols, static_cast<int32_t>(need));
  }
  return s;
}

Batcher::Batcher(std::vector<int32_t> widths, int fixed_width, int64_t slots, int64_t blocks, int32_t cols,
                 int64_t block_size)
    : widths_(std::move(widths)), fixed_width_(fixed_width), cols_(cols), block_size_(block_size) {
  std::sort(widths_.begin(), widths_.end());
  if (widths_.empty()) fail(Errc::internal, "batcher: no widths");
  if (fixed_width_ > 0 && !std::binary_search(widths_.begin(), widths_.end(), fixed_width_))
    fail(Errc::internal, "batcher: fixed width {} is not one of the widths", fixed_width_);
  if (block_size_ < 1 || cols_ < 1) fail(Errc::internal, "batcher: block size {}, {} columns", block_size_, cols_);
  for (int64_t s = 1; s < slots; ++s) free_slots_.insert(static_cast<int32_t>(s));
  for (int64_t b = 1; b < blocks; ++b) free_blocks_.insert(static_cast<int32_t>(b));
}

int64_t Batcher::blocks_needed(const BatchRequest& r) const { return (r.tokens_fed() + block_size_ - 1) / block_size_; }

int Batcher::width_for(int n) const {
  if (fixed_width_ > 0) return n <= fixed_width_ ? fixed_width_ : 0;
  for (int32_t w : widths_)
    if (w >= n) return w;
  return 0;
}

std::string Batcher::cannot_join(const BatchRequest& r) const {
  if (r.prompt.empty()) return "the prompt is empty";
  if (r.max_new_tokens < 1) return fmt::format("max_new_tokens {} (expected >= 1)", r.max_new_tokens);
  const int widest = fixed_width_ > 0 ? fixed_width_ : widths_.back();
  if (active() + 1 > widest) return fmt::format("the batch holds {} requests, the widest width", widest);
  if (free_slots_.empty()) return "no free KDA state slot";
  const int64_t need = blocks_needed(r);
  if (need > cols_) return fmt::format("it needs {} cache blocks, a block-table row holds {}", need, cols_);
  if (need > free_blocks()) return fmt::format("it needs {} cache blocks, {} are free", need, free_blocks());
  return {};
}

int Batcher::join(BatchRequest r) {
  if (const std::string why = cannot_join(r); !why.empty()) fail(Errc::internal, "batcher: a request cannot join: {}", why);
  Request q;
  q.slot = *free_slots_.begin();
  free_slots_.erase(free_slots_.begin());
  for (int64_t i = blocks_needed(r); i > 0; --i) {
    q.blocks.push_back(*free_blocks_.begin());
    free_blocks_.erase(free_blocks_.begin());
  }
  q.r = std::move(r);
  all_.push_back(std::move(q));
  active_.push_back(static_cast<int>(all_.size()) - 1);
  return active_.back();
}

BatchStep Batcher::next() const {
  if (active_.empty()) fail(Errc::internal, "batcher: a step without requests");
  BatchStep s;
  s.requests = active();
  s.width = width_for(s.requests);
  if (s.width == 0) fail(Errc::internal, "batcher: {} requests fit no width", s.requests);
  s.cols = cols_;
  const size_t W = static_cast<size_t>(s.width);
  s.request.assign(W, -1);
  s.tokens.assign(W, 0);
  s.positions.assign(W, 0);
  s.state_indices.assign(W, DP_NULL_BLOCK_ID);
  s.block_table.assign(W * static_cast<size_t>(cols_), DP_NULL_BLOCK_ID);
  s.seq_lens.assign(W, 0);
  s.slot_mapping.assign(W, DP_PAD_SLOT_ID);
  s.num_accepted.assign(W, 1);
  for (size_t row = 0; row < active_.size(); ++row) {
    const Request& q = all_[static_cast<size_t>(active_[row])];
    const int64_t pos = q.fed, prompt = static_cast<int64_t>(q.r.prompt.size());
    s.request[row] = active_[row];
    s.tokens[row] = pos < prompt ? q.r.prompt[static_cast<size_t>(pos)] : q.generated[static_cast<size_t>(pos - prompt)];
    s.positions[row] = pos;
    s.state_indices[row] = q.slot;
    std::copy(q.blocks.begin(), q.blocks.end(), s.block_table.begin() + static_cast<std::ptrdiff_t>(row * cols_));
    s.seq_lens[row] = static_cast<int32_t>(pos + 1);
    s.slot_mapping[row] = int64_t{q.blocks[static_cast<size_t>(pos / block_size_)]} * block_size_ + pos % block_size_;
    if (pos == 0) s.fresh_slots.push_back(q.slot);
  }
  return s;
}

std::vector<int> Batcher::complete(const BatchStep& step, std::span<const RowResult> rows) {
  if (rows.size() != static_cast<size_t>(step.width))
    fail(Errc::internal, "batcher: {} row results for a step of width {}", rows.size(), step.width);
  std::vector<int> left;
  for (int row = 0; row < step.width; ++row) {
    const int id = step.request[static_cast<size_t>(row)];
    if (id < 0) continue;
    Request& q = all_[static_cast<size_t>(id)];
    if (q.finished || q.fed != step.positions[static_cast<size_t>(row)])
      fail(Errc::internal, "batcher: request {} completed a step it did not run (position {}, fed {})", id,
           step.positions[static_cast<size_t>(row)], q.fed);
    const RowResult& res = rows[static_cast<size_t>(row)];
    q.predictions.push_back(res);
    ++q.fed;
    if (q.fed < static_cast<int64_t>(q.r.prompt.size())) continue;  // still reading its prompt
    q.generated.push_back(res.token);
    if (static_cast<int>(q.generated.size()) < q.r.max_new_tokens) continue;
    q.finished = true;
    left.push_back(id);
    free_slots_.insert(q.slot);
    free_blocks_.insert(q.blocks.begin(), q.blocks.end());
  }
  std::erase_if(active_, [&](int id) { return all_[static_cast<size_t>(id)].finished; });
  return left;
}

std::vector<std::vector<int32_t>> read_prompts(const std::string& path, int64_t vocab, int max_requests,
                                               const std::string& why_max) {
  const std::string text = read_text_file(path, uint64_t{1} << 30);
  std::vector<std::vector<int32_t>> out;
  std::istringstream lines(text);
  std::string line;
  int number = 0;
  while (std::getline(lines, line)) {
    ++number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::istringstream words(line);
    std::vector<int32_t> ids;
    std::string w;
    while (words >> w) {
      int64_t v = -1;
      const auto [end, ec] = std::from_chars(w.data(), w.data() + w.size(), v);
      const std::string shown = w.size() > 40 ? w.substr(0, 40) + "..." : w;
      if (ec == std::errc::result_out_of_range || (ec == std::errc() && end == w.data() + w.size() && (v < 0 || v >= vocab)))
        fail(Errc::input, "{}:{}: token id {} is outside the vocabulary (0..{})", path, number, shown, vocab - 1);
      if (ec != std::errc() || end != w.data() + w.size())
        fail(Errc::input, "{}:{}: '{}' is not a token id (expected an integer 0..{})", path, number, shown, vocab - 1);
      ids.push_back(static_cast<int32_t>(v));
    }
    if (ids.empty())
      fail(Errc::input, "{}:{}: empty request (every line is one request: at least one token id)", path, number);
    if (static_cast<int>(out.size()) == max_requests)
      fail(Errc::input, "{}:{}: request {} does not fit: at most {} request{}, {}", path, number, number, max_requests,
           max_requests == 1 ? "" : "s", why_max);
    out.push_back(std::move(ids));
  }
  if (out.empty()) fail(Errc::input, "{}: no requests (one request per line: token ids separated by spaces)", path);
  return out;
}

}  // namespace dp::tools
