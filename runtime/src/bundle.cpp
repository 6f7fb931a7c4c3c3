#include "src/bundle.h"

#include <algorithm>
#include <new>

#include "format/deploy_limits.h"

namespace dp::rt {
namespace {

// Reads the opaque JSON blocks of the manifest (deploy, model.details) field by field, so that a bundle
// whose writer left something out is refused here, by field name, rather than misread later.
class Fields {
 public:
  Fields(const std::string& where) : where_(where) {}
  const format::Json* at(const format::Json& root, const std::string& path, Status& st) const {
    const format::Json* j = &root;
    size_t start = 0;
    while (start <= path.size()) {
      const size_t dot = path.find('.', start);
      const std::string key = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      if (!j->is_object() || !j->contains(key)) {
        st = error(DP_ERR_FORMAT, "{}: missing field {}", where_, path);
        return nullptr;
      }
      j = &(*j)[key];
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    return j;
  }
  int64_t integer(const format::Json& root, const std::string& path, int64_t lo, int64_t hi, Status& st) const {
    const format::Json* j = at(root, path, st);
    if (!j) return 0;
    if (!j->is_number_integer() || j->get<int64_t>() < lo || j->get<int64_t>() > hi) {
      if (st.ok()) st = error(DP_ERR_FORMAT, "{}: field {} is {}, expected an integer in {}..{}", where_, path, format::json_excerpt(*j), lo, hi);
      return 0;
    }
    return j->get<int64_t>();
  }
  std::string string(const format::Json& root, const std::string& path, Status& st) const {
    const format::Json* j = at(root, path, st);
    if (!j) return {};
    if (!j->is_string()) {
      if (st.ok()) st = error(DP_ERR_FORMAT, "{}: field {} is {}, expected a string", where_, path, format::json_excerpt(*j));
      return {};
    }
    return j->get<std::string>();
  }
  std::vector<int64_t> ints(const format::Json& root, const std::string& path, Status& st) const {
    const format::Json* j = at(root, path, st);
    std::vector<int64_t> out;
    if (!j) return out;
    if (!j->is_array()) {
      if (st.ok()) st = error(DP_ERR_FORMAT, "{}: field {} is {}, expected an array of integers", where_, path, format::json_excerpt(*j));
      return out;
    }
    for (const auto& v : *j) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (1 << 20)) {
        if (st.ok()) st = error(DP_ERR_FORMAT, "{}: field {} holds {}, expected integers 0..{}", where_, path, format::json_excerpt(v), 1 << 20);
        return {};
      }
      out.push_back(v.get<int64_t>());
    }
    return out;
  }

 private:
  std::string where_;
};

Status derive(dp_bundle& b) {
  const format::Manifest& m = b.manifest();
  const std::string where = b.reader.label() + ": manifest.json";
  Fields f(where);
  Status st;
  DeploySettings& d = b.deploy;
  d.tensor_parallel = static_cast<int>(f.integer(m.deploy, "tensor_parallel", 1, format::kMaxTensorParallel, st));
  d.q = 1 + static_cast<int>(f.integer(m.deploy, "num_speculative_tokens", 0, format::kMaxSpeculativeTokens, st));
  for (int64_t r : f.ints(m.deploy, "ranks", st)) d.ranks.push_back(static_cast<int32_t>(r));
  for (int64_t w : f.ints(m.deploy, "widths", st)) d.widths.push_back(static_cast<int32_t>(w));
  if (const format::Json* t = f.at(m.deploy, "targets", st); t && t->is_array())
    for (const auto& v : *t)
      if (v.is_string()) d.targets.push_back(v.get<std::string>());
  const std::string kv = f.string(m.deploy, "kv_cache.dtype", st);
  d.block_size = f.integer(m.deploy, "kv_cache.block_size", format::kMinBlockSize, format::kMaxBlockSize, st);
  d.kda_state_layout = f.string(m.deploy, "kda_state.layout", st);
  const std::string kda_dtype = f.string(m.deploy, "kda_state.dtype", st);
  const std::string conv = f.string(m.deploy, "conv_state.dtype", st);
  d.conv_layout = f.string(m.deploy, "conv_state.layout", st);
  const format::Json& det = m.model.details;
  d.kda_heads = f.integer(det, "kda.num_heads", 0, 1 << 20, st);
  d.kda_head_dim = f.integer(det, "kda.head_dim", 0, 1 << 20, st);
  d.conv_kernel = f.integer(det, "kda.conv_kernel", 0, 64, st);
  d.mla_kv_lora_rank = f.integer(det, "mla.kv_lora_rank", 0, 1 << 20, st);
  d.mla_rope_dim = f.integer(det, "mla.qk_rope_head_dim", 0, 1 << 20, st);
  if (m.indexer.heads > 0) {
    d.dcp_size = f.integer(m.deploy, "dcp.size", 1, format::kMaxDcpSize, st);
    d.dcp_interleave = f.integer(m.deploy, "dcp.interleave", 1, format::kMaxDcpInterleave, st);
    d.indexer_max_keys = f.integer(m.deploy, "indexer.max_keys_per_chunk", 1, format::kMaxIndexerKeys, st);
    d.indexer_max_requests = f.integer(m.deploy, "indexer.max_requests", 1, format::kMaxIndexerLimit, st);
  }
  DP_RETURN_IF_ERROR(st);
  if (d.block_size % d.dcp_interleave != 0)
    return error(DP_ERR_FORMAT, "{}: deploy.dcp.interleave {} does not divide kv_cache.block_size {}", where,
                 d.dcp_interleave, d.block_size);

  d.kv_dtype = kv == "fp8" ? DP_DTYPE_F8_E4M3 : dtype_from_name(kv);
  if (d.kv_dtype == DP_DTYPE_INVALID)
    return error(DP_ERR_FORMAT, "{}: deploy.kv_cache.dtype \"{}\" is not one this runtime knows (bf16, fp8)", where, format::excerpt(kv));
  if (dtype_from_name(kda_dtype) != DP_DTYPE_F32)
    return error(DP_ERR_FORMAT, "{}: deploy.kda_state.dtype \"{}\", expected \"float32\"", where, format::excerpt(kda_dtype));
  d.conv_dtype = dtype_from_name(conv);
  if (d.conv_dtype != DP_DTYPE_BF16 && d.conv_dtype != DP_DTYPE_F32)
    return error(DP_ERR_FORMAT, "{}: deploy.conv_state.dtype \"{}\", expected \"bf16\" or \"float32\"", where, format::excerpt(conv));
  if (d.kda_state_layout != "kv" && d.kda_state_layout != "vk")
    return error(DP_ERR_FORMAT, "{}: deploy.kda_state.layout \"{}\", expected \"kv\" or \"vk\"", where, format::excerpt(d.kda_state_layout));
  if (d.conv_layout != "sd" && d.conv_layout != "ds")
    return error(DP_ERR_FORMAT, "{}: deploy.conv_state.layout \"{}\", expected \"sd\" or \"ds\"", where, format::excerpt(d.conv_layout));
  if (d.widths.empty()) return error(DP_ERR_FORMAT, "{}: deploy.widths is empty, expected at least one width", where);
  if (!std::is_sorted(d.widths.begin(), d.widths.end()) || std::count(d.widths.begin(), d.widths.end(), 0))
    return error(DP_ERR_FORMAT, "{}: deploy.widths is not sorted and positive", where);
  if (d.widths.back() > format::kMaxWidth)
    return error(DP_ERR_FORMAT, "{}: deploy.widths holds {}, expected widths 1..{}", where, d.widths.back(),
                 format::kMaxWidth);
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
