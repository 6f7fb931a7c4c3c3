#include "tooling/indexer_workload.h"

#include <cmath>
#include <cstring>
#include <string>

#include "common/dtype.h"
#include "common/error.h"
#include "common/json.h"
#include "format/untrusted.h"

namespace dp::tools::ixrun {

namespace fs = std::filesystem;
using Options = IndexerRunOptions;

uint16_t bf16_bits(double v) {
  return f32_to_bf16_bits(static_cast<float>(v));
}
double bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

namespace {

// Reads a raw little-endian array of exactly `count` values from a regular file.
template <class T>
std::vector<T> read_raw(const fs::path& p, uint64_t count) {
  uint64_t want = 0;
  if (__builtin_mul_overflow(count, sizeof(T), &want))
    fail(Errc::input, "{}: {} values of {} bytes overflow 64 bits", p.string(), count, sizeof(T));
  std::string bytes;
  bool too_large = false;
  if (std::string why = format::read_regular_file(p, want, bytes, &too_large); !why.empty())
    fail(too_large ? Errc::input : Errc::io, "{}: {} ({} values of {} bytes)", p.string(), why, count, sizeof(T));
  if (bytes.size() != want)
    fail(Errc::input, "{}: {} bytes, expected exactly {} ({} values)", p.string(), bytes.size(), want, count);
  std::vector<T> v(static_cast<size_t>(count));
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

}  // namespace

Inputs make_inputs(const Options& o, int64_t heads, int64_t k) {
  Inputs in;
  in.heads = heads;
  in.k = k;
  if (!o.inputs.empty()) {
    const fs::path dir = o.inputs;
    const fs::path meta_path = dir / "meta.json";
    const Json meta_json = load_json_file(meta_path);
    const JsonReader meta(meta_json, meta_path.string());
    if (meta.integer("heads") != heads || meta.integer("top_k") != k)
      fail(Errc::input, "{}: heads {} and top_k {}, the bundle's indexer has {} and {}", meta_path.string(),
           meta.integer("heads"), meta.integer("top_k"), heads, k);
    in.weight_scale = meta.number_or("weight_scale", 1.0);
    in.seq_lens = meta.int_list("seq_lens");
    in.query_lens = meta.int_list("query_lens");
    if (in.query_lens.size() != in.seq_lens.size())
      fail(Errc::input, "{}: query_lens has {} values, seq_lens {}", meta_path.string(), in.query_lens.size(),
           in.seq_lens.size());
    int64_t T = 0, rows = 0;
    for (size_t r = 0; r < in.seq_lens.size(); ++r) {
      // Key positions are int32: each length and their sums stay below 2^31, so no product below overflows.
      if (in.seq_lens[r] < 0 || in.query_lens[r] < 0 || in.query_lens[r] > in.seq_lens[r] ||
          in.seq_lens[r] > INT32_MAX - T)
        fail(Errc::input, "{}: request {}: seq_lens {} and query_lens {}, expected 0 <= query_lens <= seq_lens and "
             "a total below 2^31", meta_path.string(), r, in.seq_lens[r], in.query_lens[r]);
      T += in.seq_lens[r], rows += in.query_lens[r];
    }
    for (float v : read_raw<float>(dir / "keys.f32", static_cast<uint64_t>(T) * ix::kHeadDim))
      in.keys.push_back(bf16_bits(v));
    for (float v : read_raw<float>(dir / "q.f32", static_cast<uint64_t>(rows) * static_cast<uint64_t>(heads) * ix::kHeadDim))
      in.q.push_back(bf16_bits(v));
    in.w = read_raw<float>(dir / "w.f32", static_cast<uint64_t>(rows) * static_cast<uint64_t>(heads));
    return in;
  }
  in.seq_lens = o.seq_lens;
  in.query_lens = o.query_lens.empty() ? o.seq_lens : o.query_lens;
  if (in.query_lens.size() != in.seq_lens.size())
    fail(Errc::usage, "--query-lens has {} values, --seq-lens {}", in.query_lens.size(), in.seq_lens.size());
  Rng rng(o.seed);
  int64_t T = 0, rows = 0;
  for (size_t r = 0; r < in.seq_lens.size(); ++r) T += in.seq_lens[r], rows += in.query_lens[r];
  in.keys.resize(static_cast<size_t>(T * ix::kHeadDim));
  for (int64_t t = 0; t < T; ++t) {
    uint16_t* key = in.keys.data() + t * ix::kHeadDim;
    if (t % 7 == 6) {  // a repeat of the previous key: equal scores, which must go to the lower position
      std::memcpy(key, key - ix::kHeadDim, ix::kHeadDim * 2);
      continue;
    }
    for (int64_t g = 0; g < ix::kGroups; ++g) {
      const double mag = std::ldexp(1.0, static_cast<int>(rng.below(12)) - 6);  // groups of 2^-6 .. 2^5
      for (int64_t i = 0; i < ix::kGroup; ++i) key[g * ix::kGroup + i] = bf16_bits(rng.uniform(-mag, mag));
    }
  }
  in.q.resize(static_cast<size_t>(rows * heads * ix::kHeadDim));
  for (uint16_t& v : in.q) v = bf16_bits(rng.uniform(-1, 1));
  in.w.resize(static_cast<size_t>(rows * heads));
  for (float& v : in.w) v = static_cast<float>(rng.uniform(-0.5, 1.0));
  return in;
}

Layout plan_layout(const Options& o, const Inputs& in, const ix::PrefillConfig& cfg, Rng& rng) {
  Layout L;
  L.world = cfg.world;
  L.interleave = cfg.interleave;
  L.block_size = cfg.block_size;
  L.layout = o.layout == "packed" ? ix::CacheLayout::packed : ix::CacheLayout::split;
  L.block_stride = cfg.block_size * ix::kKeyBytes + o.stride_pad;
  const int64_t R = static_cast<int64_t>(in.seq_lens.size());
  // Each request gets the blocks its largest rank share needs; block ids are a shuffled 1..N (0 unused).
  std::vector<int64_t> need(R);
  int64_t total_blocks = 0;
  for (int64_t r = 0; r < R; ++r) {
    int64_t most = 0;
    for (int64_t rank = 0; rank < L.world; ++rank)
      most = std::max(most, ix::dcp_local_len(in.seq_lens[r], L.world, rank, L.interleave));
    need[r] = (most + L.block_size - 1) / L.block_size;
    total_blocks += need[r];
  }
  std::vector<int32_t> ids(static_cast<size_t>(total_blocks));
  for (int64_t i = 0; i < total_blocks; ++i) ids[i] = static_cast<int32_t>(i + 1);
  rng.shuffle(ids);
  L.num_blocks = total_blocks + 1;
  std::vector<std::vector<int32_t>> rows(R);
  for (int64_t r = 0, at = 0; r < R; ++r)
    for (int64_t b = 0; b < need[r]; ++b) rows[r].push_back(ids[at++]);

  L.slots.assign(L.world, {});
  for (int64_t rank = 0; rank < L.world; ++rank)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t p = 0; p < in.seq_lens[r]; ++p)
        L.slots[rank].push_back(ix::dcp_slot(rows[r], p, L.block_size, L.world, rank, L.interleave));

  int64_t key = 0, row = 0;
  for (int64_t r0 = 0; r0 < R; r0 += o.set_size) {
    Set s;
    s.first_request = r0;
    s.first_key = key;
    s.first_row = row;
    for (int64_t r = r0; r < std::min(R, r0 + o.set_size); ++r) {
      s.chunk.seq_lens.push_back(in.seq_lens[r]);
      s.chunk.query_lens.push_back(in.query_lens[r]);
      s.chunk.block_table.push_back(rows[r]);
      s.keys += in.seq_lens[r];
      s.rows += in.query_lens[r];
      s.bt_stride = std::max<int64_t>(s.bt_stride, need[r] + 1);  // one spare entry: the stride is honoured
    }
    key += s.keys;
    row += s.rows;
    L.sets.push_back(std::move(s));
  }
  return L;
}

}  // namespace dp::tools::ixrun
