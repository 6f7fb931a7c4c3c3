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
    {"blocks", "pointer", ParamSource::kv_attn_res},       {"stride_blocks", "u32", ParamSource::attn_res_stride},
    {"layer", "u32", ParamSource::num_layers},             {"res_norm", "pointer", ParamSource::final_res_norm_weight},
    {"res_proj", "pointer", ParamSource::final_res_proj_weight},
};

const Rule kLmHead[] = {
    {"x", "pointer", ParamSource::io_hidden},
    {"out", "pointer", ParamSource::io_logits},
    {"w0", "pointer", ParamSource::lm_head_weight},
};

const Rule kPrefetch[] = {
    {"table", "pointer", ParamSource::prefetch_table},
    {"count", "u32", ParamSource::prefetch_count},
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
  if (role == "lm_head") return find(kLmHead, name, kind);
  return std::nullopt;
}

std::optional<ParamSource> program_source(const format::ProgramArgEntry& a) {
  static const std::pair<const char*, ParamSource> io[] = {
      {"hidden", ParamSource::io_hidden},         {"residual", ParamSource::io_residual},
      {"out", ParamSource::io_out},               {"residual_out", ParamSource::io_residual_out},
      {"positions", ParamSource::io_positions},   {"state_indices", ParamSource::io_state_indices},
      {"block_table", ParamSource::io_block_table}, {"block_table_stride", ParamSource::io_block_table_stride},
      {"seq_lens", ParamSource::io_seq_lens},     {"slot_mapping", ParamSource::io_slot_mapping},
      {"num_accepted", ParamSource::io_num_accepted}};
  static const std::pair<const char*, ParamSource> kv[] = {
      {"kda_state", ParamSource::kv_kda_state}, {"conv_q", ParamSource::kv_conv_q}, {"conv_k", ParamSource::kv_conv_k},
      {"conv_v", ParamSource::kv_conv_v},       {"mla_latent", ParamSource::kv_mla_latent},
      {"attn_res", ParamSource::kv_attn_res}};
  static const std::pair<const char*, ParamSource> kv_stride[] = {
      {"kda_state", ParamSource::kda_state_stride}, {"conv_q", ParamSource::conv_stride},
      {"conv_k", ParamSource::conv_stride},         {"conv_v", ParamSource::conv_stride},
      {"mla_latent", ParamSource::mla_block_stride}, {"attn_res", ParamSource::attn_res_stride}};
  auto look = [&](const auto& table) -> std::optional<ParamSource> {
    for (const auto& [n, src] : table)
      if (a.name == n) return src;
    return std::nullopt;
  };
  if (a.from == "io") return look(io);
  if (a.from == "kv") return look(kv);
  if (a.from == "kv_stride") return look(kv_stride);
  return std::nullopt;
}

unsigned param_kind_size(const std::string& kind) {
  if (kind == "pointer") return 8;
  if (kind == "u32" || kind == "f32") return 4;
  return 0;
}

}  // namespace dp::rt
