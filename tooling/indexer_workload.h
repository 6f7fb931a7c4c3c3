// `indexer-run`'s workload: the inputs (random, or read from --inputs DIR), and the plan every rank
// shares (request sets, cache layout and block tables, each rank's DCP slots).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string_view>
#include <vector>

#include "common/fs.h"
#include "indexer/geometry.h"
#include "indexer/key.h"
#include "indexer/reference.h"
#include "tooling/device.h"
#include "tooling/indexer_run.h"

namespace dp::tools::ixrun {

namespace ix = dp::indexer;

// bf16 <-> value, via fp32 like the kernels' and torch's conversion.
uint16_t bf16_bits(double v);
double bf16_value(uint16_t b);

struct Inputs {
  int64_t heads = 0, k = 0;
  double weight_scale = 1.0;
  std::vector<int64_t> seq_lens, query_lens;
  std::vector<uint16_t> keys;  // [T, 128] bf16
  std::vector<uint16_t> q;     // [rows, heads, 128] bf16
  std::vector<float> w;        // [rows, heads]
  int64_t total_keys() const { return static_cast<int64_t>(keys.size()) / ix::kHeadDim; }
  int64_t rows() const { return static_cast<int64_t>(w.size()) / heads; }
};

// The inputs of a run: drawn from o.seed, or read from o.inputs (meta.json, keys.f32, q.f32, w.f32).
Inputs make_inputs(const IndexerRunOptions& o, int64_t heads, int64_t k);

template <class T>
void write_raw(const std::filesystem::path& p, const std::vector<T>& v) {
  write_file_atomic(p, std::string_view(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T)));
}

struct Set {
  ix::PrefillChunk chunk;            // block_table filled in
  int64_t first_request = 0, first_key = 0, first_row = 0;
  int64_t keys = 0, rows = 0, bt_stride = 0;
};

struct Layout {
  int64_t world = 1, interleave = 1, block_size = 64;
  ix::CacheLayout layout = ix::CacheLayout::split;
  int64_t block_stride = 0, num_blocks = 0;
  std::vector<Set> sets;
  std::vector<std::vector<int64_t>> slots;  // [rank][T] slot per key, -1 elsewhere
};

// Request sets of o.set_size requests, the cache layout and stride, shuffled block tables and each
// rank's slot of every key (vLLM's DCP interleave).
Layout plan_layout(const IndexerRunOptions& o, const Inputs& in, const ix::PrefillConfig& cfg, Rng& rng);

}  // namespace dp::tools::ixrun
