// `decodepack synth`: a random checkpoint with the real tensor names, shapes and dtypes of a preset,
// written as safetensors shards + model.safetensors.index.json + config.json.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "common/json.h"
#include "model/ir.h"

namespace dp::model {

enum class CheckpointLayout {
  vllm,          // names and dtypes as the Hub ships them and vLLM loads them
  transformers,  // as HF transformers 5 writes them (layer-0 MLP under block_sparse_moe., fp32 params in bf16)
};

// What `synth --quantize` writes: the preset's own dtypes, or FP8 block quantization (model/quant.h).
enum class SynthQuantize { none, fp8 };

// The quantization_config `synth --quantize fp8` adds to the config of the bf16 model `m`: e4m3 weights,
// dynamic activation scales, 128 x 128 blocks, and modules_to_not_convert naming, by full module name
// (which HF's substring match and vLLM's exact match both read), what stays bf16.
Json fp8_quantization_config(const Model& m);

struct SynthOptions {
  std::string preset;                 // preset name or config path
  std::filesystem::path out;          // output directory (replaced atomically)
  // Write into an existing directory that is not a checkpoint synth wrote (its other entries are
  // kept), or over a file. Without it such an output is refused (Errc::usage).
  bool force = false;
  uint64_t seed = 0;
  uint64_t shard_bytes = 0;           // target shard size; 0: about a third of the model (>= 2 shards)
  CheckpointLayout layout = CheckpointLayout::vllm;
  // fp8: the config gains fp8_quantization_config() and every linear weight it quantizes is written as
  // e4m3 plus its fp32 weight_scale_inv, quantized (quantize_fp8_blocks) from the bf16 values the
  // unquantized checkpoint of the same seed holds.
  SynthQuantize quantize = SynthQuantize::none;
  std::FILE* progress = nullptr;      // progress of the bytes written (common/progress.h) goes here when set
  bool progress_tty = false;
};

struct SynthResult {
  size_t tensors = 0;
  size_t shards = 0;
  uint64_t bytes = 0;
};

// Besides the checkpoint files, synth writes kSynthMarker, {"files": [...], "written_by": "decodepack
// synth"}, listing them: it is how a later synth knows that the directory is its own and may be
// replaced (checkpoint readers skip dot files). A directory without it, or with files it does not
// list, is never replaced.
inline constexpr const char* kSynthMarker = ".decodepack-synth.json";

// The files a synth output lists in its marker (the marker included), or nullopt. Never throws.
std::optional<std::vector<std::string>> synth_own_files(const std::filesystem::path& dir);

SynthResult synthesize(const SynthOptions& opt);

// The deterministic fill of one tensor: a function of (seed, name, shape, dtype) only, so a shard
// layout or tensor order change never changes a tensor's values.
std::vector<uint8_t> synth_tensor(const WeightSpec& w, DType dtype, uint64_t seed);

// The bytes synthesize() writes for weight `w` of model `m` (the synth fill the tools and the CPU
// reference use without a checkpoint): synth_tensor in the IR dtype, except for an FP8 block-quantized
// weight (its e4m3 values) and the scale tensor of one (its fp32 scale_inv), both quantized from the
// bf16 fill of the weight (quantize_fp8_blocks), as `synth --quantize fp8` writes them.
std::vector<uint8_t> synth_weight(const Model& m, const WeightSpec& w, uint64_t seed);

}  // namespace dp::model
