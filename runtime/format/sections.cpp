#include "format/sections.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "format/fields.h"
#include "format/targets.h"
#include "format/untrusted.h"

namespace dp::format {
namespace {

using fields::Obj;
using fields::schema_error;

template <typename E, size_t N>
const char* enum_name(const std::array<Spelling<E>, N>& table, E v) {
  for (const auto& e : table)
    if (e.value == v) return e.name.data();  // the names are literals, so NUL-terminated
  return "?";
}

template <typename E, size_t N>
E enum_value(const Obj& o, std::string_view key, const std::array<Spelling<E>, N>& table) {
  const std::string s = o.str(key);
  for (const auto& e : table)
    if (e.name == s) return e.value;
  std::vector<std::string_view> names;
  for (const auto& e : table) names.push_back(e.name);
  schema_error(o.where(), fmt::format("field {} is \"{}\", expected one of {}", o.field(key), excerpt(s),
                                      fmt::join(names, ", ")));
}

template <size_t N>
std::string one_of(const Obj& o, std::string_view key, const std::array<std::string_view, N>& names) {
  const std::string s = o.str(key);
  if (std::find(names.begin(), names.end(), s) == names.end())
    schema_error(o.where(), fmt::format("field {} is \"{}\", expected one of {}", o.field(key), excerpt(s),
                                        fmt::join(names, ", ")));
  return s;
}

// A list of integers in lo..hi, non-empty, strictly increasing (sorted, each once).
std::vector<int64_t> int_set(const Obj& o, std::string_view key, int64_t lo, int64_t hi) {
  std::vector<int64_t> v = o.ints(key, lo, hi);
  if (v.empty()) schema_error(o.where(), fmt::format("field {} is empty, expected at least one entry", o.field(key)));
  for (size_t i = 1; i < v.size(); ++i)
    if (v[i] <= v[i - 1])
      schema_error(o.where(), fmt::format("field {} is [{}], expected values sorted, each once", o.field(key),
                                          fmt::join(v, ", ")));
  return v;
}

double finite(const Obj& o, std::string_view key) {
  const double x = o.num<double>(key);
  if (!std::isfinite(x)) schema_error(o.where(), fmt::format("field {} is not a finite number", o.field(key)));
  return x;
}

}  // namespace

const char* to_string(KvCacheDtype d) { return enum_name(kKvCacheDtypes, d); }
const char* to_string(KdaStateDtype d) { return enum_name(kKdaStateDtypes, d); }
const char* to_string(KdaStateLayout l) { return enum_name(kKdaStateLayouts, l); }
const char* to_string(ConvStateDtype d) { return enum_name(kConvStateDtypes, d); }
const char* to_string(ConvStateLayout l) { return enum_name(kConvStateLayouts, l); }
const char* to_string(Allreduce a) { return enum_name(kAllreducePaths, a); }

Allreduce Deploy::allreduce(int64_t width) const {
  return std::binary_search(allreduce_nccl.begin(), allreduce_nccl.end(), width) ? Allreduce::nccl : Allreduce::in_kernel;
}

bool Deploy::prefetch_point(std::string_view name) const {
  return prefetch.enabled && std::find(prefetch.points.begin(), prefetch.points.end(), name) != prefetch.points.end();
}

int64_t Deploy::prefetch_cap(int64_t width) const {
  if (!prefetch.enabled) return 0;
  if (auto it = prefetch.width_cap_bytes.find(width); it != prefetch.width_cap_bytes.end()) return it->second;
  return width * q() <= prefetch.max_rows ? prefetch.cap_bytes : 0;
}

Json to_json(const Deploy& d) {
  Json caps = Json::object();
  for (const auto& [w, c] : d.prefetch.width_cap_bytes) caps[std::to_string(w)] = c;
  // nlohmann::json keeps object keys sorted, so dump() of this is already in canonical key order.
  Json j{
      {"targets", d.targets},
      {"tensor_parallel", d.tensor_parallel},
      {"ranks", d.ranks},
      {"widths", d.widths},
      {"num_speculative_tokens", d.num_speculative_tokens},
      {"kv_cache", {{"dtype", to_string(d.kv_cache.dtype)}, {"block_size", d.kv_cache.block_size}}},
      {"kda_state", {{"dtype", to_string(d.kda_state.dtype)}, {"layout", to_string(d.kda_state.layout)}}},
      {"conv_state", {{"dtype", to_string(d.conv_state.dtype)}, {"layout", to_string(d.conv_state.layout)}}},
      {"dcp", {{"size", d.dcp.size}, {"interleave", d.dcp.interleave}}},
      {"prefetch",
       {{"enabled", d.prefetch.enabled},
        {"cap_bytes", d.prefetch.cap_bytes},
        {"max_rows", d.prefetch.max_rows},
        {"width_cap_bytes", caps},
        {"points", d.prefetch.points}}},
      {"indexer",
       {{"max_keys_per_chunk", d.indexer.max_keys_per_chunk}, {"max_requests", d.indexer.max_requests}}},
  };
  // Only when some width uses NCCL (format 1.8): every other deploy keeps its canonical bytes.
  // The deploy file's own per-width form, so that parse_deploy(to_json(d)) == d holds.
  if (!d.allreduce_nccl.empty()) {
    Json a = Json::object();
    for (int64_t w : d.allreduce_nccl) a[std::to_string(w)] = to_string(Allreduce::nccl);
    j["allreduce"] = std::move(a);
  }
  return j;
}

Deploy deploy_from_json(const Json& j, const std::string& where) {
  Obj top(j, where, "deploy");
  top.only({"targets", "tensor_parallel", "ranks", "widths", "num_speculative_tokens", "kv_cache", "kda_state",
            "conv_state", "dcp", "prefetch", "indexer", "allreduce"});
  Deploy d;

  d.targets = top.strs("targets");
  if (d.targets.empty()) schema_error(where, "field deploy.targets is empty, expected at least one target");
  for (size_t i = 0; i < d.targets.size(); ++i) {
    if (!find_gpu_target(d.targets[i])) {
      std::vector<std::string_view> names;
      for (const GpuTarget& t : kGpuTargets) names.push_back(t.name);
      schema_error(where, fmt::format("field deploy.targets[{}] is \"{}\", expected one of {}", i,
                                      excerpt(d.targets[i]), fmt::join(names, ", ")));
    }
    if (i > 0 && !(d.targets[i - 1] < d.targets[i]))
      schema_error(where, fmt::format("field deploy.targets[{}] is \"{}\", expected targets sorted, each once", i,
                                      d.targets[i]));
  }
  d.tensor_parallel = top.num<int64_t>("tensor_parallel", 1, kMaxTensorParallel);
  if ((d.tensor_parallel & (d.tensor_parallel - 1)) != 0)
    schema_error(where, fmt::format("field deploy.tensor_parallel is {}, expected a power of two up to {}",
                                    d.tensor_parallel, kMaxTensorParallel));
  d.ranks = int_set(top, "ranks", 0, d.tensor_parallel - 1);
  d.widths = int_set(top, "widths", 1, kMaxWidth);
  d.num_speculative_tokens = top.num<int64_t>("num_speculative_tokens", 0, kMaxSpeculativeTokens);
  {
    Obj o = top.obj("kv_cache");
    o.only({"dtype", "block_size"});
    d.kv_cache.dtype = enum_value(o, "dtype", kKvCacheDtypes);
    d.kv_cache.block_size = o.num<int64_t>("block_size", kMinBlockSize, kMaxBlockSize);
    if (d.kv_cache.block_size % 16 != 0)
      schema_error(where, fmt::format("field deploy.kv_cache.block_size is {}, expected a multiple of 16",
                                      d.kv_cache.block_size));
  }
  {
    Obj o = top.obj("kda_state");
    o.only({"dtype", "layout"});
    d.kda_state.dtype = enum_value(o, "dtype", kKdaStateDtypes);
    d.kda_state.layout = enum_value(o, "layout", kKdaStateLayouts);
  }
  {
    Obj o = top.obj("conv_state");
    o.only({"dtype", "layout"});
    d.conv_state.dtype = enum_value(o, "dtype", kConvStateDtypes);
    d.conv_state.layout = enum_value(o, "layout", kConvStateLayouts);
  }
  {
    Obj o = top.obj("dcp");
    o.only({"size", "interleave"});
    d.dcp.size = o.num<int64_t>("size", 1, kMaxDcpSize);
    if (d.tensor_parallel % d.dcp.size != 0)
      schema_error(where, fmt::format("field deploy.dcp.size is {}, which does not divide tensor_parallel {}",
                                      d.dcp.size, d.tensor_parallel));
    d.dcp.interleave = o.num<int64_t>("interleave", 1, kMaxDcpInterleave);
    if (d.kv_cache.block_size % d.dcp.interleave != 0)
      schema_error(where, fmt::format("field deploy.dcp.interleave is {}, which does not divide kv_cache.block_size {}",
                                      d.dcp.interleave, d.kv_cache.block_size));
  }
  {
    Obj o = top.obj("prefetch");
    o.only({"enabled", "cap_bytes", "max_rows", "width_cap_bytes", "points"});
    d.prefetch.enabled = o.boolean("enabled");
    d.prefetch.cap_bytes = o.num<int64_t>("cap_bytes", 0, kMaxPrefetchCapBytes);
    d.prefetch.max_rows = o.num<int64_t>("max_rows", 0, kMaxWidth * (1 + kMaxSpeculativeTokens));
    const Json& caps = o.get("width_cap_bytes");
    if (!caps.is_object())
      schema_error(where, fmt::format("field deploy.prefetch.width_cap_bytes is {}, expected an object",
                                      caps.type_name()));
    Obj co(caps, where, o.field("width_cap_bytes"));
    for (auto it = caps.begin(); it != caps.end(); ++it) {
      const std::string& k = it.key();
      const bool digits = !k.empty() && k.size() <= 6 && k[0] != '0' &&
                          std::all_of(k.begin(), k.end(), [](char c) { return c >= '0' && c <= '9'; });
      const int64_t w = digits ? std::stoll(k) : 0;
      if (!std::binary_search(d.widths.begin(), d.widths.end(), w))
        schema_error(where, fmt::format("field deploy.prefetch.width_cap_bytes has key \"{}\", expected one of the "
                                        "widths [{}]", excerpt(k), fmt::join(d.widths, ", ")));
      d.prefetch.width_cap_bytes[w] = co.num<int64_t>(k, 0, kMaxPrefetchCapBytes);
    }
    if (o.has("points")) {  // since 1.4
      size_t next = 0;      // canonical order: kPrefetchPoints'
      const std::vector<std::string> points = o.strs("points");
      for (size_t i = 0; i < points.size(); ++i) {
        const auto it = std::find(kPrefetchPoints.begin(), kPrefetchPoints.end(), points[i]);
        const size_t at = static_cast<size_t>(it - kPrefetchPoints.begin());
        if (it == kPrefetchPoints.end() || at < next)
          schema_error(where, fmt::format("field deploy.prefetch.points[{}] is \"{}\", expected one of {}, in that "
                                          "order, each once", i, excerpt(points[i]), fmt::join(kPrefetchPoints, ", ")));
        next = at + 1;
      }
      d.prefetch.points = points;
    }
  }
  {
    Obj o = top.obj("indexer");
    o.only({"max_keys_per_chunk", "max_requests"});
    d.indexer.max_keys_per_chunk = o.num<int64_t>("max_keys_per_chunk", 1, kMaxIndexerKeys);
    d.indexer.max_requests = o.num<int64_t>("max_requests", 1, kMaxIndexerLimit);
  }
  if (top.has("allreduce")) {  // since 1.8, only when some width all-reduces with NCCL
    const Json& a = top.get("allreduce");
    if (!a.is_object() || a.empty())
      schema_error(where, fmt::format("field deploy.allreduce is {}, expected an object mapping widths to \"nccl\"",
                                      a.is_object() ? "empty" : a.type_name()));
    if (d.tensor_parallel == 1)
      schema_error(where, "field deploy.allreduce is set at tensor_parallel 1, expected it absent (no step all-reduces)");
    for (auto it = a.begin(); it != a.end(); ++it) {
      const std::string& k = it.key();
      const bool digits = !k.empty() && k.size() <= 6 && k[0] != '0' &&
                          std::all_of(k.begin(), k.end(), [](char c) { return c >= '0' && c <= '9'; });
      const int64_t w = digits ? std::stoll(k) : 0;
      if (!std::binary_search(d.widths.begin(), d.widths.end(), w))
        schema_error(where, fmt::format("field deploy.allreduce has key \"{}\", expected one of the widths [{}]",
                                        excerpt(k), fmt::join(d.widths, ", ")));
      if (it.value() != to_string(Allreduce::nccl))
        schema_error(where, fmt::format("field deploy.allreduce.{} is {}, expected \"nccl\" (in_kernel widths are left "
                                        "out)", k, excerpt(it.value().dump())));
      d.allreduce_nccl.push_back(w);
    }
    std::sort(d.allreduce_nccl.begin(), d.allreduce_nccl.end());
  }
  return d;
}

Json to_json(const ModelDetails& d) {
  Json kda = {{"num_heads", d.kda.num_heads},     {"head_dim", d.kda.head_dim},
              {"conv_kernel", d.kda.conv_kernel}, {"gate_rank", d.kda.gate_rank},
              {"full_rank_gate", d.kda.full_rank_gate}};
  if (d.kda.gate_lower_bound) kda["gate_lower_bound"] = *d.kda.gate_lower_bound;
  return {{"prefix", d.prefix},
          {"activation", d.activation},
          {"attn_res_block", d.attn_res_block},
          {"dense_intermediate", d.dense_intermediate},
          {"kda", kda},
          {"mla",
           {{"num_heads", d.mla.num_heads},
            {"q_lora_rank", d.mla.q_lora_rank},
            {"kv_lora_rank", d.mla.kv_lora_rank},
            {"qk_nope_head_dim", d.mla.qk_nope_head_dim},
            {"qk_rope_head_dim", d.mla.qk_rope_head_dim},
            {"v_head_dim", d.mla.v_head_dim},
            {"output_gate", d.mla.output_gate}}},
          {"moe",
           {{"num_experts", d.moe.num_experts},
            {"top_k", d.moe.top_k},
            {"intermediate", d.moe.intermediate},
            {"num_shared", d.moe.num_shared},
            {"routed_scaling", d.moe.routed_scaling},
            {"renormalize", d.moe.renormalize},
            {"latent_dim", d.moe.latent_dim},
            {"expert_format", d.moe.expert_format}}}};
}

ModelDetails details_from_json(const Json& j, const std::string& where) {
  Obj top(j, where, "model.details");
  top.only({"prefix", "activation", "attn_res_block", "dense_intermediate", "kda", "mla", "moe"});
  ModelDetails d;
  d.prefix = top.str("prefix");
  d.activation = one_of(top, "activation", kActivations);
  d.attn_res_block = top.num<int64_t>("attn_res_block", 0, kMaxLayers);
  d.dense_intermediate = top.num<int64_t>("dense_intermediate", 0, kMaxModelDim);
  {
    Obj o = top.obj("kda");
    o.only({"num_heads", "head_dim", "conv_kernel", "gate_rank", "full_rank_gate", "gate_lower_bound"});
    d.kda.num_heads = o.num<int64_t>("num_heads", 0, kMaxModelDim);
    d.kda.head_dim = o.num<int64_t>("head_dim", 0, kMaxModelDim);
    d.kda.conv_kernel = o.num<int64_t>("conv_kernel", 0, kMaxConvKernel);
    d.kda.gate_rank = o.num<int64_t>("gate_rank", 0, kMaxModelDim);
    d.kda.full_rank_gate = o.boolean("full_rank_gate");
    if (o.has("gate_lower_bound")) d.kda.gate_lower_bound = finite(o, "gate_lower_bound");
  }
  {
    Obj o = top.obj("mla");
    o.only({"num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "output_gate"});
    d.mla.num_heads = o.num<int64_t>("num_heads", 0, kMaxModelDim);
    d.mla.q_lora_rank = o.num<int64_t>("q_lora_rank", 0, kMaxModelDim);
    d.mla.kv_lora_rank = o.num<int64_t>("kv_lora_rank", 0, kMaxModelDim);
    d.mla.qk_nope_head_dim = o.num<int64_t>("qk_nope_head_dim", 0, kMaxModelDim);
    d.mla.qk_rope_head_dim = o.num<int64_t>("qk_rope_head_dim", 0, kMaxModelDim);
    d.mla.v_head_dim = o.num<int64_t>("v_head_dim", 0, kMaxModelDim);
    d.mla.output_gate = o.boolean("output_gate");
  }
  {
    Obj o = top.obj("moe");
    o.only({"num_experts", "top_k", "intermediate", "num_shared", "routed_scaling", "renormalize", "latent_dim",
            "expert_format"});
    d.moe.num_experts = o.num<int64_t>("num_experts", 0, kMaxExperts);
    d.moe.top_k = o.num<int64_t>("top_k", 0, d.moe.num_experts);
    d.moe.intermediate = o.num<int64_t>("intermediate", 0, kMaxModelDim);
    d.moe.num_shared = o.num<int64_t>("num_shared", 0, kMaxModelDim);
    d.moe.routed_scaling = finite(o, "routed_scaling");
    d.moe.renormalize = o.boolean("renormalize");
    d.moe.latent_dim = o.num<int64_t>("latent_dim", 0, kMaxHiddenSize);
    d.moe.expert_format = one_of(o, "expert_format", kExpertFormats);
  }
  return d;
}

}  // namespace dp::format
