#include "tooling/workload.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "common/error.h"
#include "reference/numeric.h"

namespace dp::tools {

void put_bf16(uint8_t* p, double v) {
  const uint16_t b = ref::double_to_bf16_bits(v);
  std::memcpy(p, &b, 2);
}
void put_f32(uint8_t* p, double v) {
  const float f = static_cast<float>(v);
  std::memcpy(p, &f, 4);
}
double get_bf16(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return ref::bf16_bits_to_double(b);
}
double get_f32(const uint8_t* p) {
  float f;
  std::memcpy(&f, p, 4);
  return f;
}
// One stored element of a bf16 or f32 cache / activation as a double.
double get_value(const uint8_t* p, DType t) { return t == DType::F32 ? get_f32(p) : get_bf16(p); }
void put_value(uint8_t* p, DType t, double v) { t == DType::F32 ? put_f32(p, v) : put_bf16(p, v); }

Meta make_meta(int W, int requests, int q, int steps, int64_t context, int64_t block_size, bool uniform, Rng& rng) {
  Meta m;
  m.W = W;
  m.q = q;
  m.block_size = block_size;
  m.real.assign(static_cast<size_t>(W), false);
  for (int r = 0; r < requests; ++r) m.real[r] = true;
  // Context lengths: different per request where [context/2, context] has room for them (uniform:
  // exactly `context` each).
  const int64_t lo = uniform ? context : context / 2, span = context - lo + 1;
  std::vector<int64_t> ctx;
  std::set<int64_t> used;
  for (int r = 0; r < requests; ++r) {
    int64_t c = lo + rng.below(span);
    for (int tries = 0; !uniform && used.count(c) && tries < 64 && span >= requests; ++tries) c = lo + rng.below(span);
    used.insert(c);
    ctx.push_back(c);
  }
  // KDA slots: a random permutation of 1..S-1 (0 is the null block), W spare slots nobody uses.
  m.slots = 1 + static_cast<int64_t>(W) * q + W;
  std::vector<int32_t> perm(static_cast<size_t>(m.slots - 1));
  for (size_t i = 0; i < perm.size(); ++i) perm[i] = static_cast<int32_t>(i + 1);
  rng.shuffle(perm);
  m.state_indices.assign(static_cast<size_t>(W * q), DP_NULL_BLOCK_ID);
  for (int r = 0; r < requests; ++r)
    for (int i = 0; i < q; ++i) m.state_indices[static_cast<size_t>(r * q + i)] = perm[static_cast<size_t>(r * q + i)];
  // MLA blocks: enough for the context and every step's rows, a random permutation, 2 spare blocks.
  std::vector<int64_t> need(static_cast<size_t>(W), 0);
  int64_t total = 0;
  for (int r = 0; r < requests; ++r) {
    need[r] = std::max<int64_t>(1, (ctx[r] + static_cast<int64_t>(steps) * q + block_size - 1) / block_size);
    total += need[r];
  }
  m.stride = static_cast<int>(std::max<int64_t>(1, *std::max_element(need.begin(), need.end())));
  m.blocks = 1 + total + 2;
  std::vector<int32_t> bperm(static_cast<size_t>(m.blocks - 1));
  for (size_t i = 0; i < bperm.size(); ++i) bperm[i] = static_cast<int32_t>(i + 1);
  rng.shuffle(bperm);
  m.block_table.assign(static_cast<size_t>(W * m.stride), DP_NULL_BLOCK_ID);
  size_t next = 0;
  for (int r = 0; r < requests; ++r)
    for (int64_t b = 0; b < need[r]; ++b) m.block_table[static_cast<size_t>(r * m.stride + b)] = bperm[next++];
  m.num_accepted.assign(static_cast<size_t>(W), 1);
  m.seq_lens.assign(static_cast<size_t>(W), 0);
  for (int r = 0; r < requests; ++r) {
    m.num_accepted[r] = q > 1 ? static_cast<int32_t>(1 + rng.below(q)) : 1;
    m.seq_lens[r] = static_cast<int32_t>(ctx[r] + q);
  }
  m.refresh();
  return m;
}

void Meta::refresh() {
  positions.assign(static_cast<size_t>(rows()), 0);
  slot_mapping.assign(static_cast<size_t>(rows()), ref::kPadSlotId);
  for (int r = 0; r < W; ++r) {
    if (!real[r]) continue;
    for (int i = 0; i < q; ++i) {
      const int64_t pos = seq_lens[r] - q + i;
      const size_t t = static_cast<size_t>(r * q + i);
      positions[t] = pos;
      slot_mapping[t] = static_cast<int64_t>(block_table[static_cast<size_t>(r * stride + pos / block_size)]) * block_size +
                        pos % block_size;
    }
  }
}

void Meta::advance(Rng& rng) {
  for (int r = 0; r < W; ++r) {
    if (!real[r]) continue;
    const int32_t a = q > 1 ? static_cast<int32_t>(1 + rng.below(q)) : 1;
    num_accepted[r] = a;
    seq_lens[r] += a;  // the previous step's q rows minus the rejected ones, plus q new rows
  }
  refresh();
}

ref::StepMeta Meta::step_meta() const {
  ref::StepMeta m;
  m.num_requests = W;
  m.q = q;
  for (int r = 0; r < W; ++r) {
    std::vector<int64_t> slots, bt;
    for (int i = 0; i < q; ++i) slots.push_back(state_indices[static_cast<size_t>(r * q + i)]);
    for (int c = 0; c < stride; ++c) bt.push_back(block_table[static_cast<size_t>(r * stride + c)]);
    m.kda_slots.push_back(slots);
    m.block_table.push_back(bt);
    m.num_accepted.push_back(num_accepted[r]);
    m.seq_lens.push_back(seq_lens[r]);
  }
  m.slot_mapping = slot_mapping;
  return m;
}

}  // namespace dp::tools
