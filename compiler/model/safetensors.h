// safetensors checkpoints: a fully validating header parser, a sharded-checkpoint reader over memory
// maps, and a writer (used by `decodepack synth` and by tests).
//
// File format (https://huggingface.co/docs/safetensors, "Format"):
//
//   [0, 8)        N, the header length: unsigned 64-bit little endian
//   [8, 8+N)      the header: a UTF-8 JSON object
//                   { "__metadata__": {"format": "pt", ...},            (optional, strings only)
//                     "<tensor name>": {"dtype": "BF16", "shape": [9216, 256],
//                                       "data_offsets": [begin, end]}, ... }
//                 possibly followed by spaces (writers pad so that the data is 8-byte aligned)
//   [8+N, EOF)    the data section; data_offsets are relative to its start, little-endian, row major
//
// What parse_header() accepts is what the reference implementation's `validate` accepts: the tensors'
// byte ranges MUST cover the data section exactly (no overlap, no hole, no trailing bytes), every range
// MUST hold exactly numel * dtype size bytes, and every tensor name MUST appear once. Every violation is
// a dp::Error(Errc::input) whose message names the file, the tensor, the field, the actual value and the
// expected one, e.g.
//   shard-00001.safetensors: tensor model.layers.0.mlp.up_proj.weight: data_offsets [0, 100) hold
//   100 bytes, expected 4718592 (shape [9216, 256] x BF16 2 bytes)
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/dtype.h"
#include "common/fs.h"

namespace dp::st {

// Headers larger than this are refused before any JSON is parsed (the reference implementation's limit).
inline constexpr uint64_t kMaxHeaderSize = 100'000'000;

struct TensorInfo {
  std::string name;
  DType dtype = DType::BF16;
  std::vector<int64_t> shape;  // [] is a scalar (one element); a 0 dim makes an empty tensor
  uint64_t offset = 0;         // absolute byte offset of the first element in the file
  uint64_t size = 0;           // bytes = numel * dtype_size(dtype)
  size_t file = 0;             // index into Checkpoint's files (always 0 from parse_header)

  uint64_t numel() const;  // cannot overflow: parse_header checked it
};

struct Header {
  std::vector<TensorInfo> tensors;  // in data order (ascending offset), not in JSON key order
  std::map<std::string, std::string> metadata;
  uint64_t data_start = 0;  // absolute offset of the data section, 8 + N
};

// Validates a whole safetensors file held in memory (or mapped) and returns its table of contents.
// `where` names the file in messages. Throws dp::Error(Errc::input) on the first violation.
Header parse_header(std::span<const uint8_t> file_bytes, const std::string& where);

// A checkpoint directory opened read-only: every shard is memory-mapped and its header validated once
// at open time, so data() never fails and never copies. The mapped pages stay valid for the lifetime
// of the Checkpoint (moving it keeps them valid; spans from data() die with it).
//
// Layout, first match wins:
//   1. model.safetensors.index.json (HF sharded): its weight_map {tensor name: shard file name} MUST
//      list every tensor of every shard it names, and each tensor MUST be in the shard it names;
//   2. model.safetensors;
//   3. every *.safetensors file in the directory, in sorted name order.
// A tensor name found in two shards is an error naming both files.
class Checkpoint {
 public:
  static Checkpoint open(const std::filesystem::path& dir);
  // Whether `dir` holds anything open() would read (an index or at least one *.safetensors file).
  // A model directory with only config.json is legitimate: bundles then carry no weight fingerprints.
  static bool present(const std::filesystem::path& dir);

  Checkpoint(Checkpoint&&) noexcept = default;
  Checkpoint& operator=(Checkpoint&&) noexcept = default;

  // Shard by shard (files in the order above), each in data order.
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(std::string_view name) const;  // nullptr if absent
  // The tensor's bytes inside the shard's mapping (no copy).
  std::span<const uint8_t> data(const TensorInfo& t) const;
  size_t num_files() const { return files_.size(); }
  const std::filesystem::path& file_path(size_t file) const;
  std::filesystem::path dir() const { return dir_; }
  // The index file's path when the checkpoint came from one, otherwise empty.
  const std::filesystem::path& index_path() const { return index_path_; }

 private:
  Checkpoint() = default;
  void add_shard(const std::filesystem::path& path);

  std::filesystem::path dir_;
  std::filesystem::path index_path_;
  std::vector<MappedFile> files_;
  std::vector<std::filesystem::path> paths_;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t, std::less<>> by_name_;  // name -> index into tensors_
};

// Writing ------------------------------------------------------------------------------------------

struct TensorData {
  std::string name;
  DType dtype = DType::BF16;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;  // little endian, row major; size MUST be numel * dtype size
};

// Serialises a conformant file: header JSON padded with spaces so that the data section starts at a
// multiple of 8, tensors stored contiguously in the given order. Inconsistent input (wrong byte count,
// duplicate or reserved name) is a caller bug: dp::Error(Errc::internal). Returns the file's bytes.
std::string serialize(const std::vector<TensorData>& tensors, const std::map<std::string, std::string>& metadata);

// serialize() published atomically at `path` (dp::write_file_atomic).
void write_file(const std::filesystem::path& path, const std::vector<TensorData>& tensors,
                const std::map<std::string, std::string>& metadata);

// Writes <dir>/model.safetensors.index.json in the Hugging Face layout:
//   {"metadata": {"total_size": N}, "weight_map": {"<tensor>": "<shard file name>", ...}}
void write_index(const std::filesystem::path& dir, const std::map<std::string, std::string>& weight_map,
                 uint64_t total_size);

// "[9216, 256]" as used in messages.
std::string shape_string(std::span<const int64_t> shape);

}  // namespace dp::st
