// Quantization descriptions in a checkpoint config: HF `quantization_config` (its `quant_method`) and
// MLX's `quantization`. Each is either recognised, and then carried into the IR (model::Quantization
// for the model, model::TensorQuant per weight), or refused with one message naming the key, the
// method and what is supported. Supported:
//   - compressed-tensors "mxfp4-pack-quantized" (Kimi-K3): routed experts in MXFP4, E2M1 pairs in U8
//     `weight_packed` plus one E8M0 `weight_scale` byte per 32 inputs; every other linear layer in the
//     config's `ignore` list (bf16);
//   - "fp8" with e4m3 weights and `weight_block_size` [128, 128] (the DeepSeek-style FP8 layout HF and
//     vLLM load): every linear layer outside the config's `modules_to_not_convert` / `ignored_layers`
//     holds e4m3 weights and an fp32 `weight_scale_inv` per 128 x 128 block; the rest stays bf16.
#pragma once

#include <string>
#include <string_view>

#include "common/json.h"
#include "model/ir.h"

namespace dp::model {

// Reads the quantization description of a config. `top` is the whole config, `text` the object holding
// the decoder's hyper-parameters (the same object for kimi_linear, `text_config` for kimi_k3), `where`
// the file. Returns method none when the config has no description. Throws dp::Error(input):
//   config.json: quantization_config.quant_method "awq" is not supported (supported: ...)
Quantization read_quantization(const Json& top, const Json& text, const std::string& where);

// Whether the module `module` (a weight's name without ".weight") is in the ignore list `patterns`:
// an entry "re:<regex>" matches a module the regex matches from its start (Python's re.match, as
// compressed-tensors and vLLM do; the regex subset is quant.cpp's: no groups or counted repeats); any
// other entry matches a module whose dot-separated components contain the entry's components in a row
// ("lm_head" matches "language_model.lm_head", "layers.1.mlp" matches "model.layers.1.mlp.up_proj",
// not "model.layers.10.mlp.up_proj").
bool module_ignored(std::string_view module, const std::vector<std::string>& patterns);

// Whether `key`, a weight's name relative to its layer, is the weight of a linear layer that a
// quantization config applies to (projections and expert matrices; not norms, convolutions, biases,
// the MoE router or the attention-residual projections, which stay in their own dtype).
bool is_quantizable_linear(std::string_view key);

// How a config describes its quantization, for messages and the plan ("fp8 e4m3, 128x128 blocks").
std::string describe(const Quantization& q);

// FP8 block quantization of a [rows, cols] row-major matrix, as DeepSeek-style FP8 checkpoints store it:
// per block of `block` x `block` values (the last ones in a row or column may be partial), scale_inv =
// the block's largest magnitude / 448, and each value stored as the e4m3 nearest to value / scale_inv
// (f32_to_e4m3_bits: round to nearest even, saturating), so that value ~ e4m3 * scale_inv. An all-zero
// block gets scale_inv 1. `scale_inv` is [ceil(rows / block), ceil(cols / block)] row-major.
struct Fp8Blocks {
  std::vector<uint8_t> values;   // rows * cols e4m3 bytes
  std::vector<float> scale_inv;  // one per block
};
Fp8Blocks quantize_fp8_blocks(const std::vector<float>& values, int64_t rows, int64_t cols, int64_t block);

}  // namespace dp::model
