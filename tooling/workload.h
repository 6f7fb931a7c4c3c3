// The workload of one batch width: the bound caches (and the harness's host mirrors of them), the step
// metadata (block tables, state slots, sequence lengths), and element access to bf16 / f32 buffers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/dtype.h"
#include "decodepack/decodepack.h"
#include "reference/layer.h"
#include "tooling/device.h"

namespace dp::tools {

// One bound cache tensor.
struct Cache {
  int32_t kind = 0;
  dp_tensor desc{};
  DType dtype = DType::F32;
  size_t elem = 0;
  size_t slot_bytes = 0;  // bytes per slot (KDA) or block (MLA)
  int64_t count = 0;      // slots or blocks
  CUdeviceptr ptr = 0;
  std::vector<uint8_t> host;  // the device contents as the harness last knew them (checks only)
  size_t bytes() const { return slot_bytes * static_cast<size_t>(count); }
};

struct LayerCaches {
  bool kda = false;
  std::vector<Cache> c;  // KDA: state, conv q, conv k, conv v; MLA: latent
  Cache* find(int32_t kind) {
    for (Cache& x : c)
      if (x.kind == kind) return &x;
    return nullptr;
  }
};

// The metadata of one step at width W (requests beyond the real ones are padding).
struct Meta {
  int W = 0, q = 1, stride = 0;  // stride: block-table columns
  int64_t block_size = 0;
  std::vector<bool> real;        // [W]
  std::vector<int32_t> state_indices, num_accepted, seq_lens, block_table;
  std::vector<int64_t> positions, slot_mapping;
  int64_t slots = 0, blocks = 0;  // cache sizes the metadata needs

  int rows() const { return W * q; }
  void refresh();            // positions and slot mapping from seq_lens and the block table
  void advance(Rng& rng);    // the next decode step: seq_len += tokens accepted
  ref::StepMeta step_meta() const;
};

struct CacheLayouts {
  std::string kda_state = "kv";  // "kv": [slot][head][k][v]; "vk": [slot][head][v][k]
  std::string conv = "sd";       // "sd": [slot][K-1][dim]; "ds": [slot][dim][K-1]
};

// Random metadata of W requests (`requests` real, the rest padding) of q tokens each: context lengths
// in [context/2, context], all different where the range allows (uniform: exactly `context`), distinct
// non-zero KDA slots and MLA blocks (enough for `steps` decode steps), num_accepted in 1..q.
Meta make_meta(int W, int requests, int q, int steps, int64_t context, int64_t block_size, bool uniform, Rng& rng);

// One stored element of a bf16 or f32 buffer (little endian) as a double, and back (rounded to nearest
// even).
void put_bf16(uint8_t* p, double v);
void put_f32(uint8_t* p, double v);
double get_bf16(const uint8_t* p);
double get_f32(const uint8_t* p);
double get_value(const uint8_t* p, DType t);
void put_value(uint8_t* p, DType t, double v);

}  // namespace dp::tools
