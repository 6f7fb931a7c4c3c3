// Where each kernel parameter's value comes from. The manifest lists every kernel's parameters by name,
// kind, offset and size (the compiler's codegen signature); the runtime packs the parameter block from
// this table, so a parameter it cannot supply is found when the bundle is validated, never at launch.
//
// Names per role:
//   final_norm  hidden, residual, out, residual_out (the call's dp_final_norm_io), weight (the bound
//               final-norm weight), eps (model.rms_norm_eps)
//   prefetch    table, count (the resolved range table of the (point, layer, width))
//   layer:*     the dp_layer_io fields by name (hidden, residual, out, residual_out, positions,
//               state_indices, block_table, block_table_stride, seq_lens, slot_mapping, num_accepted),
//               workspace, error_flag, eps, and the layer's caches: kda_state, conv_q, conv_k, conv_v,
//               mla_latent (addresses) with kda_state_stride, conv_stride, mla_block_stride (u32,
//               elements between slots/blocks). Layer programs that need weights will add their
//               parameter names here together with the kernels (the kernel issue); until then a layer
//               program with another parameter is not run: that layer runs on the host, and
//               dp_launch_layer's DP_ERR_NO_KERNEL names the parameter. (Another parameter of a
//               final_norm or prefetch kernel is refused at validation: DP_ERR_NOT_SUPPORTED.)
#pragma once

#include <optional>
#include <string>

namespace dp::rt {

enum class ParamSource {
  io_hidden, io_residual, io_out, io_residual_out, io_positions, io_state_indices, io_block_table,
  io_block_table_stride, io_seq_lens, io_slot_mapping, io_num_accepted,
  workspace, error_flag, eps, final_norm_weight, prefetch_table, prefetch_count,
  kv_kda_state, kv_conv_q, kv_conv_k, kv_conv_v, kv_mla_latent, kda_state_stride, conv_stride, mla_block_stride,
};

// The source of parameter `name` of kind `kind` ("pointer" | "u32" | "f32") in a kernel of `role`;
// nullopt when the runtime has none (the caller names the kernel in its error).
std::optional<ParamSource> param_source(const std::string& role, const std::string& name, const std::string& kind);

// Bytes a parameter of `kind` occupies (8, 4, 4); 0 for an unknown kind.
unsigned param_kind_size(const std::string& kind);

}  // namespace dp::rt
