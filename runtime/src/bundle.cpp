#include "src/bundle.h"

#include <algorithm>
#include <new>

#include "format/sections.h"

namespace dp::rt {
namespace {

Status derive(dp_bundle& b) {
  const format::Manifest& m = b.manifest();
  const std::string where = b.reader.label() + ": manifest.json";
  // The deploy block and model.details through the one typed reader the compiler's writer shares
  // (format/sections.h): every field present, typed and within deploy_limits.h's bounds.
  format::Deploy dep;
  format::ModelDetails det;
  try {
    dep = format::deploy_from_json(m.deploy, where);
    det = format::details_from_json(m.model.details, where);
  } catch (const format::FormatError& e) {
    return Status(DP_ERR_FORMAT, e.what());
  }
  DeploySettings& d = b.deploy;
  d.tensor_parallel = static_cast<int>(dep.tensor_parallel);
  d.q = static_cast<int>(dep.q());
  for (int64_t r : dep.ranks) d.ranks.push_back(static_cast<int32_t>(r));
  for (int64_t w : dep.widths) d.widths.push_back(static_cast<int32_t>(w));
  d.targets = dep.targets;
  d.kv_dtype = dep.kv_cache.dtype == format::KvCacheDtype::fp8 ? DP_DTYPE_F8_E4M3 : DP_DTYPE_BF16;
  d.block_size = dep.kv_cache.block_size;
  d.kda_state_layout = format::to_string(dep.kda_state.layout);
  d.conv_dtype = dep.conv_state.dtype == format::ConvStateDtype::bf16 ? DP_DTYPE_BF16 : DP_DTYPE_F32;
  d.conv_layout = format::to_string(dep.conv_state.layout);
  d.kda_heads = det.kda.num_heads;
  d.kda_head_dim = det.kda.head_dim;
  d.conv_kernel = det.kda.conv_kernel;
  d.mla_kv_lora_rank = det.mla.kv_lora_rank;
  d.mla_rope_dim = det.mla.qk_rope_head_dim;
  d.hidden = m.model.hidden_size;
  d.attn_res_block = det.attn_res_block;
  if (d.attn_res_block > 0) d.attn_res_blocks = (m.model.num_layers + d.attn_res_block - 1) / d.attn_res_block;
  if (m.indexer.heads > 0) {
    d.dcp_size = dep.dcp.size;
    d.dcp_interleave = dep.dcp.interleave;
    d.indexer_max_keys = dep.indexer.max_keys_per_chunk;
    d.indexer_max_requests = dep.indexer.max_requests;
  }
  for (const format::LayerEntry& l : m.layers) {
    if (l.mixer != "kda" && l.mixer != "mla")
      return error(DP_ERR_FORMAT, "{}: layers[{}].mixer \"{}\", expected \"kda\" or \"mla\"", where, l.index, format::excerpt(l.mixer));
    if (l.mixer == "kda" && (d.kda_heads % d.tensor_parallel || d.kda_heads == 0 || d.kda_head_dim == 0 || d.conv_kernel < 2))
      return error(DP_ERR_FORMAT, "{}: model.details.kda (num_heads {}, head_dim {}, conv_kernel {}) does not describe a "
                   "KDA layer split over tensor_parallel {}", where, d.kda_heads, d.kda_head_dim, d.conv_kernel,
                   d.tensor_parallel);
    if (l.mixer == "mla" && (d.mla_kv_lora_rank == 0))
      return error(DP_ERR_FORMAT, "{}: model.details.mla.kv_lora_rank is 0 but layer {} is an MLA layer", where, l.index);
  }
  for (size_t i = 0; i < m.layers.size(); ++i)
    if (m.layers[i].index != static_cast<int>(i))
      return error(DP_ERR_FORMAT, "{}: layers[{}].index is {}, expected {}", where, i, m.layers[i].index, i);
  for (const std::string& t : d.targets) b.target_names.push_back(t.c_str());

  for (const format::RankEntry& r : m.ranks) {
    RankWeights rw;
    rw.rank = static_cast<int32_t>(r.rank);
    for (const format::WeightEntry& w : r.weights) {
      WeightSpec s{&w, dtype_from_name(w.dtype)};
      if (s.dtype == DP_DTYPE_INVALID)
        return error(DP_ERR_FORMAT, "{}: rank {} weight {}: dtype \"{}\" is not one this runtime knows", where, r.rank,
                     w.name, w.dtype);
      if (w.shape.size() > DP_MAX_DIMS)
        return error(DP_ERR_FORMAT, "{}: rank {} weight {}: {} dimensions, at most {} supported", where, r.rank, w.name,
                     w.shape.size(), DP_MAX_DIMS);
      const bool group = w.name.find("{e}") != std::string::npos;
      if (group != (w.experts > 0))
        return error(DP_ERR_FORMAT, "{}: rank {} weight {}: experts {} but the name {} \"{{e}}\"", where, r.rank, w.name,
                     w.experts, group ? "contains" : "lacks");
      if (!rw.by_name.emplace(w.name, rw.weights.size()).second)
        return error(DP_ERR_FORMAT, "{}: rank {} lists weight {} twice", where, r.rank, w.name);
      rw.weights.push_back(s);
      rw.names.push_back(w.name);
    }
    b.ranks.push_back(std::move(rw));
  }
  for (int32_t r : d.ranks)
    if (!b.rank_weights(r))
      return error(DP_ERR_FORMAT, "{}: deploy.ranks lists rank {} but ranks[] has no entry for it", where, r);
  b.tool_version = m.tool_version;
  b.model_type = m.model.model_type;
  b.deploy_json = m.deploy.dump();
  return ok();
}

}  // namespace

dp_dtype dtype_from_name(const std::string& s) {
  static const std::pair<const char*, dp_dtype> names[] = {
      {"BF16", DP_DTYPE_BF16}, {"F16", DP_DTYPE_F16},         {"F32", DP_DTYPE_F32},         {"F64", DP_DTYPE_F64},
      {"U8", DP_DTYPE_U8},     {"I8", DP_DTYPE_I8},           {"I16", DP_DTYPE_I16},         {"I32", DP_DTYPE_I32},
      {"I64", DP_DTYPE_I64},   {"F8_E4M3", DP_DTYPE_F8_E4M3}, {"F8_E5M2", DP_DTYPE_F8_E5M2}, {"F8_E8M0", DP_DTYPE_F8_E8M0},
      {"BOOL", DP_DTYPE_BOOL}, {"bf16", DP_DTYPE_BF16},       {"float32", DP_DTYPE_F32},     {"fp8", DP_DTYPE_F8_E4M3},
  };
  for (const auto& [n, t] : names)
    if (s == n) return t;
  return DP_DTYPE_INVALID;
}

}  // namespace dp::rt

const dp::rt::RankWeights* dp_bundle::rank_weights(int32_t rank) const {
  for (const auto& r : ranks)
    if (r.rank == rank) return &r;
  return nullptr;
}

dp::rt::Result<dp_bundle*> dp_bundle::open(const std::string& path) {
  using namespace dp::rt;
  std::unique_ptr<dp_bundle> b;
  try {
    b = std::make_unique<dp_bundle>();
    b->reader = dp::format::BundleReader::open(path);
    b->reader.load();  // verified and held in memory: the path may go away once the bundle is open
  } catch (const dp::format::BundleIoError& e) {
    return Status(DP_ERR_IO, e.what());
  } catch (const dp::format::FormatError& e) {
    switch (e.kind) {
      case dp::format::FormatError::Kind::version: return Status(DP_ERR_FORMAT_VERSION, e.what());
      case dp::format::FormatError::Kind::schema: return Status(DP_ERR_FORMAT, e.what());
      case dp::format::FormatError::Kind::integrity: return Status(DP_ERR_INTEGRITY, e.what());
    }
    return Status(DP_ERR_FORMAT, e.what());
  } catch (const std::bad_alloc&) {
    return error(DP_ERR_OUT_OF_MEMORY, "{}: out of host memory while reading the bundle", path);
  } catch (const std::exception& e) {
    return error(DP_ERR_INTERNAL, "{}: unexpected error while reading the bundle: {}", path, e.what());
  }
  if (Status s = derive(*b); !s.ok()) return s;
  return b.release();
}
