// Where each kernel parameter's value comes from. The manifest lists every kernel's parameters by name,
// kind, offset and size (the compiler's codegen signature); the runtime packs the parameter block from
// this table, so a parameter it cannot supply is found when the bundle is validated, never at launch.
//
// Names per role:
//   final_norm  hidden, residual, out, residual_out (the call's dp_final_norm_io), weight (the bound
//               final-norm weight), eps (model.rms_norm_eps); K3 attnres (1.7) also blocks and
//               stride_blocks (the bound attn_res buffer), layer (the number of layers), res_norm and
//               res_proj (the bound output_attn_res_norm / output_attn_res_proj weights)
//   lm_head     x, out (the call's dp_lm_head_io hidden and logits), w0 (the weight bound with
//               dp_session_bind_lm_head)
//   prefetch    table, count (the resolved range table of the (point, layer, width))
// Kernels of role "layer" are bound by the manifest's layer programs instead: each argument names
// its source (bundle-format.md 2.5); program_source maps the per-launch ones (dp_layer_io fields, the
// layer's caches and their slot/block strides), the others are fixed at load.
#pragma once

#include <optional>
#include <string>

#include "format/manifest.h"

namespace dp::rt {

enum class ParamSource {
  io_hidden, io_residual, io_out, io_residual_out, io_positions, io_state_indices, io_block_table,
  io_block_table_stride, io_seq_lens, io_slot_mapping, io_num_accepted,
  workspace, error_flag, eps, final_norm_weight, prefetch_table, prefetch_count, io_logits, lm_head_weight,
  kv_kda_state, kv_conv_q, kv_conv_k, kv_conv_v, kv_mla_latent, kda_state_stride, conv_stride, mla_block_stride,
  kv_attn_res, attn_res_stride, num_layers, final_res_norm_weight, final_res_proj_weight,
};

// The source of parameter `name` of kind `kind` ("pointer" | "u32" | "f32") in a kernel of `role`;
// nullopt when the runtime has none (the caller names the kernel in its error).
std::optional<ParamSource> param_source(const std::string& role, const std::string& name, const std::string& kind);

// The per-launch source of a program argument ("io", "kv", "kv_stride"); nullopt for the others.
std::optional<ParamSource> program_source(const format::ProgramArgEntry& a);

// Bytes a parameter of `kind` occupies (8, 4, 4); 0 for an unknown kind.
unsigned param_kind_size(const std::string& kind);

}  // namespace dp::rt
