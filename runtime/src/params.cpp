#include "src/params.h"

#include <cstring>

namespace dp::rt {
namespace {

struct Rule {
  const char* name;
  const char* kind;
  ParamSource source;
};

const Rule kFinalNorm[] = {
    {"hidden", "pointer", ParamSource::io_hidden},         {"residual", "pointer", ParamSource::io_residual},
    {"weight", "pointer", ParamSource::final_norm_weight}, {"out", "pointer", ParamSource::io_out},
    {"residual_out", "pointer", ParamSource::io_residual_out}, {"eps", "f32", ParamSource::eps},
};

const Rule kPrefetch[] = {
    {"table", "pointer", ParamSource::prefetch_table},
    {"count", "u32", ParamSource::prefetch_count},
};

const Rule kLayer[] = {
    {"hidden", "pointer", ParamSource::io_hidden},
    {"residual", "pointer", ParamSource::io_residual},
    {"out", "pointer", ParamSource::io_out},
    {"residual_out", "pointer", ParamSource::io_residual_out},
    {"positions", "pointer", ParamSource::io_positions},
    {"state_indices", "pointer", ParamSource::io_state_indices},
    {"block_table", "pointer", ParamSource::io_block_table},
    {"block_table_stride", "u32", ParamSource::io_block_table_stride},
    {"seq_lens", "pointer", ParamSource::io_seq_lens},
    {"slot_mapping", "pointer", ParamSource::io_slot_mapping},
    {"num_accepted", "pointer", ParamSource::io_num_accepted},
    {"workspace", "pointer", ParamSource::workspace},
    {"error_flag", "pointer", ParamSource::error_flag},
    {"eps", "f32", ParamSource::eps},
    {"kda_state", "pointer", ParamSource::kv_kda_state},
    {"conv_q", "pointer", ParamSource::kv_conv_q},
    {"conv_k", "pointer", ParamSource::kv_conv_k},
    {"conv_v", "pointer", ParamSource::kv_conv_v},
    {"mla_latent", "pointer", ParamSource::kv_mla_latent},
    {"kda_state_stride", "u32", ParamSource::kda_state_stride},
    {"conv_stride", "u32", ParamSource::conv_stride},
    {"mla_block_stride", "u32", ParamSource::mla_block_stride},
};

template <size_t N>
std::optional<ParamSource> find(const Rule (&rules)[N], const std::string& name, const std::string& kind) {
  for (const Rule& r : rules)
    if (name == r.name && kind == r.kind) return r.source;
  return std::nullopt;
}

}  // namespace

std::optional<ParamSource> param_source(const std::string& role, const std::string& name, const std::string& kind) {
  if (role == "final_norm") return find(kFinalNorm, name, kind);
  if (role == "prefetch") return find(kPrefetch, name, kind);
  if (role.rfind("layer:", 0) == 0) return find(kLayer, name, kind);
  return std::nullopt;
}

unsigned param_kind_size(const std::string& kind) {
  if (kind == "pointer") return 8;
  if (kind == "u32" || kind == "f32") return 4;
  return 0;
}

}  // namespace dp::rt
