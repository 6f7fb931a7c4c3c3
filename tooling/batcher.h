// The host side of continuous batching, as `decodepack generate` drives libdecodepack: which request
// runs in which row of a step, at which width, with which KDA state slot, MLA cache blocks, position
// and input token; and what each request generated. Pure CPU logic, no GPU (tests/unit/tooling).
//
// A request is a prompt (token ids) and a number of tokens to generate. Prompts are fed one token per
// step (a correct if slow prefill through decode steps, for KDA and MLA alike); the step that feeds a
// request's last prompt token yields its first generated token, and every later step feeds the token
// generated before. A request that has generated its tokens leaves the batch at once: its slot and
// blocks are free for a request that joins, and the next step runs at the smallest width the bundle
// holds for the requests left (or at the fixed width, with padded rows).
//
// Rows: the active requests in the order they joined, packed into rows 0..n-1; rows n..width-1 are
// padding (vLLM's convention: state index DP_NULL_BLOCK_ID, block table row of null blocks, sequence
// length 0, slot DP_PAD_SLOT_ID, one accepted token), computed like real rows and ignored. A request's
// state lives in its slot and blocks, not in its row, so rows may move between steps.
//
// Caches: KDA state slot 0 and MLA block 0 are the null slot/block. A request takes the lowest free
// slot and the lowest free blocks when it joins (enough blocks for every token it will feed), and gives
// them back when it leaves. A slot that a request starts in is listed in the step's fresh_slots: the
// host zeroes its recurrent and conv states before the step (a new sequence starts from zero state).
#pragma once

#include <cstdint>
#include <set>
#include <span>
#include <string>
#include <vector>

namespace dp::tools {

struct BatchRequest {
  std::vector<int32_t> prompt;  // >= 1 token ids
  int max_new_tokens = 1;       // >= 1
  // Tokens the request feeds: the prompt, then every generated token but the last.
  int64_t tokens_fed() const { return static_cast<int64_t>(prompt.size()) + max_new_tokens - 1; }
};

// What one row of a finished step produced: the argmax of its logits and the gap to the runner-up.
struct RowResult {
  int32_t token = 0;
  float gap = 0;  // logit(top 1) - logit(top 2)
};

// The metadata of one step, in dp_layer_io / dp_step_desc order (q = 1: one row per request).
struct BatchStep {
  int width = 0;
  int requests = 0;                    // real requests (rows 0..requests-1)
  std::vector<int> request;            // [width] request id of each row, -1: padding
  std::vector<int32_t> tokens;         // [width] input token of each row (0 on padding)
  std::vector<int64_t> positions;      // [width]
  std::vector<int32_t> state_indices;  // [width]
  std::vector<int32_t> block_table;    // [width, cols]
  int32_t cols = 0;                    // block-table columns (the stride)
  std::vector<int32_t> seq_lens;       // [width] tokens including this step's
  std::vector<int64_t> slot_mapping;   // [width] cache slot of each row's token
  std::vector<int32_t> num_accepted;   // [width] all 1
  std::vector<int32_t> fresh_slots;    // KDA slots whose request starts in this step: zero them first
};

// What a set of requests needs when they all run at once: KDA slots and MLA blocks (null ones
// included) and block-table columns.
struct BatchSizing {
  int64_t slots = 1, blocks = 1;
  int32_t cols = 1;
};
BatchSizing batch_sizing(const std::vector<BatchRequest>& requests, int64_t block_size);

class Batcher {
 public:
  // widths: the bundle's widths; fixed_width > 0: every step runs at that width (one of widths).
  // slots, blocks, cols: the bound caches (batch_sizing). block_size: MLA tokens per block.
  Batcher(std::vector<int32_t> widths, int fixed_width, int64_t slots, int64_t blocks, int32_t cols,
          int64_t block_size);

  // "" when `r` can join now; else why not (the batch is at its widest, no free slot or blocks).
  std::string cannot_join(const BatchRequest& r) const;
  // Adds the request (dp::Error(internal) when cannot_join says no); returns its id (0, 1, ...).
  int join(BatchRequest r);

  int active() const { return static_cast<int>(active_.size()); }
  bool idle() const { return active_.empty(); }
  // The width a step with n requests runs at: the fixed width, or the smallest width >= n.
  int width_for(int n) const;

  // The next step for the active requests (none: dp::Error(internal)).
  BatchStep next() const;
  // Records the step's results (one per row; padding rows ignored); marks the fresh slots used.
  // Requests that generated their last token leave; returns their ids in row order.
  std::vector<int> complete(const BatchStep& step, std::span<const RowResult> rows);

  // Per request: the generated tokens, and per fed position the argmax and gap (teacher-forced
  // predictions along the prompt, then the generation).
  const std::vector<int32_t>& generated(int id) const { return all_[static_cast<size_t>(id)].generated; }
  const std::vector<RowResult>& predictions(int id) const { return all_[static_cast<size_t>(id)].predictions; }
  bool finished(int id) const { return all_[static_cast<size_t>(id)].finished; }
  int32_t slot_of(int id) const { return all_[static_cast<size_t>(id)].slot; }
  const std::vector<int32_t>& blocks_of(int id) const { return all_[static_cast<size_t>(id)].blocks; }
  int64_t free_slots() const { return static_cast<int64_t>(free_slots_.size()); }
  int64_t free_blocks() const { return static_cast<int64_t>(free_blocks_.size()); }

 private:
  struct Request {
    BatchRequest r;
    int32_t slot = 0;
    std::vector<int32_t> blocks;
    int64_t fed = 0;
    std::vector<int32_t> generated;
    std::vector<RowResult> predictions;
    bool finished = false;
  };
  int64_t blocks_needed(const BatchRequest& r) const;

  std::vector<int32_t> widths_;
  int fixed_width_ = 0;
  int32_t cols_ = 1;
  int64_t block_size_ = 1;
  std::set<int32_t> free_slots_, free_blocks_;
  std::vector<Request> all_;
  std::vector<int> active_;  // request ids in join order
};

// Reads a prompts file: one request per line, token ids separated by whitespace. Refuses (dp::Error
// input, naming the file, the line and the value) a token that is not a decimal integer, an id outside
// 0..vocab-1, an empty line (an empty request), no requests at all, and more than max_requests lines.
// `why_max` says what max_requests is (e.g. "the widest width of tiny.dpk"). Unreadable: dp::Error io.
std::vector<std::vector<int32_t>> read_prompts(const std::string& path, int64_t vocab, int max_requests,
                                               const std::string& why_max);

}  // namespace dp::tools
