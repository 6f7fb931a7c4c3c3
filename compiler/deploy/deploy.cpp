#include "deploy/deploy.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <limits>
#include <optional>
#include <set>

#include <fmt/ranges.h>

#include "common/embedded.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/suggest.h"
#include "format/manifest.h"
#include "format/targets.h"
#include "indexer/workspace.h"
#include "model/ir.h"

namespace dp::deploy {
namespace {

// ---- Tables ----------------------------------------------------------------------------------------

// The target table is runtime/format/targets.h's, in this module's types; sorted by name
// (find_target and the "valid:" lists rely on it).
constexpr std::array<TargetInfo, format::kGpuTargets.size()> make_targets() {
  std::array<TargetInfo, format::kGpuTargets.size()> out{};
  for (size_t i = 0; i < out.size(); ++i) {
    const format::GpuTarget& t = format::kGpuTargets[i];
    out[i] = TargetInfo{t.name, t.vendor == format::GpuVendor::nvidia ? Vendor::cuda : Vendor::hip, t.min_cuda_major,
                        t.min_cuda_minor, t.min_llvm_major, t.gpus};
  }
  return out;
}
constexpr auto kTargets = make_targets();

constexpr std::array<int64_t, 4> kTensorParallel = {1, 2, 4, 8};
static_assert(kTensorParallel.back() == format::kMaxTensorParallel, "the largest TP is runtime/format's bound");

// Every field, per object. parse_deploy rejects anything else and known_keys() lists exactly these, so
// the reader, the schema test and the "valid fields" messages share one list.
struct Section {
  std::string_view name;  // "" for the top level
  std::vector<std::string_view> keys;
};
const std::vector<Section>& sections() {
  static const std::vector<Section> s = {
      {"", {"targets", "tensor_parallel", "ranks", "max_num_seqs", "widths", "num_speculative_tokens",
            "kv_cache", "kda_state", "conv_state", "dcp", "prefetch", "indexer", "allreduce"}},
      {"kv_cache", {"dtype", "block_size"}},
      {"kda_state", {"dtype", "layout"}},
      {"conv_state", {"dtype", "layout"}},
      {"dcp", {"size", "interleave"}},
      {"prefetch", {"enabled", "cap_bytes", "max_rows", "width_cap_bytes", "points"}},
      {"indexer", {"max_keys_per_chunk", "max_requests"}},
  };
  return s;
}

// Hints for spellings people carry over from vLLM flags (the spellings are format/sections.h's).
using format::kConvStateDtypes;
using format::kConvStateLayouts;
using format::kKdaStateDtypes;
using format::kKdaStateLayouts;
using format::kKvCacheDtypes;
using format::Spelling;
struct Hint {
  std::string_view given;
  std::string_view advice;
};

constexpr std::array kKvCacheHints = {
    Hint{"auto", "vLLM's \"auto\" means the model dtype: write bf16"},
    Hint{"bfloat16", "write bf16"},
    Hint{"fp8_e4m3", "write fp8 (e4m3 is what fp8 means here)"},
    Hint{"fp8_e5m2", "only e4m3 is supported, written fp8"},
    Hint{"fp8_ds_mla", "fp8_ds_mla is the DeepSeek sparse-MLA page layout; Kimi's MLA is dense, use fp8"},
    Hint{"float16", "the Kimi models are bf16"},
    Hint{"fp16", "the Kimi models are bf16"},
};
constexpr std::array kKdaStateHints = {
    Hint{"bf16", "vLLM keeps the KDA recurrent state in float32 whatever mamba_cache_dtype says, and the "
                 "delta-rule update needs it"},
    Hint{"float16", "vLLM keeps the KDA recurrent state in float32 whatever mamba_cache_dtype says"},
    Hint{"fp32", "write float32"},
};
constexpr std::array kConvStateHints = {
    Hint{"auto", "vLLM's \"auto\" means the model dtype: write bf16"},
    Hint{"fp32", "write float32"},
    Hint{"bfloat16", "write bf16"},
};
constexpr std::array<Hint, 2> kLayoutHints = {
    Hint{"SD", "write it in lower case: sd"},
    Hint{"DS", "write it in lower case: ds"},
};

// ---- Formatting --------------------------------------------------------------------------------------

std::string join(const std::vector<int64_t>& v) {
  std::string s;
  for (int64_t x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

// "1..8" for a contiguous run, "1, 2, 4" otherwise.
std::string compact(const std::vector<int64_t>& v) {
  if (v.size() > 2 && v.back() - v.front() + 1 == static_cast<int64_t>(v.size()))
    return fmt::format("{}..{}", v.front(), v.back());
  return join(v);
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) out.push_back(i);
  return out;
}

// Tensor-parallel sizes are powers of two, so the useful "valid" values for a quantity are the powers
// of two that divide it (32 → 1, 2, 4, 8, 16, 32).
std::vector<int64_t> pow2_divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t p = 1; n > 0 && p <= n; p *= 2)
    if (n % p == 0) out.push_back(p);
  return out;
}

// ---- Reading -----------------------------------------------------------------------------------------

// One JSON object of the deploy file being read: knows the file name and its own dotted path.
class Obj {
 public:
  Obj(const Json& j, const std::string& where, std::string path) : j_(j), where_(where), path_(std::move(path)) {
    if (!j_.is_object())
      fail(Errc::input, "{}: {} is {} ({}), expected an object", where_, path_.empty() ? "the top level" : path_,
           json_type_name(j_), json_excerpt(j_));
    check_keys();
  }

  std::string field(std::string_view key) const {
    return path_.empty() ? std::string(key) : path_ + "." + std::string(key);
  }
  bool has(std::string_view key) const { return j_.contains(key); }
  const Json& at(std::string_view key) const { return j_.at(key); }
  const std::string& where() const { return where_; }

  int64_t integer(std::string_view key, int64_t def, int64_t lo, int64_t hi) const {
    if (!has(key)) return def;
    return checked_integer(at(key), field(key), lo, hi);
  }

  // Any JSON integer that fits int64 (8.0 counts: JSON Schema calls it the integer 8).
  int64_t integer_value(const Json& v, const std::string& name) const {
    if (v.is_number_unsigned()) {
      uint64_t u = v.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail(Errc::input, "{}: {} {} is out of range (too large for a 64-bit integer)", where_, name, u);
      return static_cast<int64_t>(u);
    }
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float()) {
      double x = v.get<double>();
      if (std::isfinite(x) && std::floor(x) == x && std::fabs(x) < 9.0e15) return static_cast<int64_t>(x);
    }
    fail(Errc::input, "{}: {} is {} ({}), expected an integer", where_, name, json_type_name(v), json_excerpt(v));
  }

  int64_t checked_integer(const Json& v, const std::string& name, int64_t lo, int64_t hi) const {
    int64_t x = integer_value(v, name);
    if (x < lo || x > hi) fail(Errc::input, "{}: {} {} is out of range (valid: {}..{})", where_, name, x, lo, hi);
    return x;
  }

  bool boolean(std::string_view key, bool def) const {
    if (!has(key)) return def;
    const Json& v = at(key);
    if (!v.is_boolean())
      fail(Errc::input, "{}: {} is {} ({}), expected true or false", where_, field(key), json_type_name(v), json_excerpt(v));
    return v.get<bool>();
  }

  std::string string(const Json& v, const std::string& name) const {
    if (!v.is_string())
      fail(Errc::input, "{}: {} is {} ({}), expected a string", where_, name, json_type_name(v), json_excerpt(v));
    return v.get<std::string>();
  }

  const Json& array(std::string_view key) const {
    const Json& v = at(key);
    if (!v.is_array())
      fail(Errc::input, "{}: {} is {} ({}), expected a list", where_, field(key), json_type_name(v), json_excerpt(v));
    if (v.empty()) fail(Errc::input, "{}: {} is an empty list, expected at least one entry", where_, field(key));
    return v;
  }

  template <typename E, size_t N, size_t H>
  E enumeration(std::string_view key, E def, const std::array<Spelling<E>, N>& table,
                const std::array<Hint, H>& hints) const {
    if (!has(key)) return def;
    std::string s = string(at(key), field(key));
    for (const auto& e : table)
      if (e.name == s) return e.value;
    std::string valid;
    for (const auto& e : table) valid += (valid.empty() ? "" : ", ") + std::string(e.name);
    for (const Hint& h : hints)
      if (h.given == s)
        fail(Errc::input, "{}: {} \"{}\" is not supported (valid: {}; {})", where_, field(key), excerpt(s), valid, h.advice);
    fail(Errc::input, "{}: {} \"{}\" is not supported (valid: {})", where_, field(key), excerpt(s), valid);
  }

  // A nested object; absent means "all defaults" and reads as an empty object.
  Obj object(std::string_view key) const {
    static const Json empty = Json::object();
    return Obj(has(key) ? at(key) : empty, where_, field(key));
  }

 private:
  // Unknown fields are errors (they are typos far more often than forward-compatible additions), and
  // null is not "default": the schema does not allow it, and leaving the field out already says that.
  void check_keys() const {
    const Section* sec = nullptr;
    for (const Section& s : sections())
      if (s.name == path_) sec = &s;
    if (!sec) fail(Errc::internal, "deploy: no field table for {}", path_);
    for (auto it = j_.begin(); it != j_.end(); ++it) {
      const std::string& k = it.key();
      if (std::find(sec->keys.begin(), sec->keys.end(), k) == sec->keys.end()) {
        std::vector<std::string_view> sorted = sec->keys;
        std::sort(sorted.begin(), sorted.end());
        std::string valid;
        for (std::string_view s : sorted) valid += (valid.empty() ? "" : ", ") + std::string(s);
        std::string_view best;
        size_t best_d = 3;  // suggest only close matches
        if (k.size() <= 64)  // a typo, not a hostile key: the distance costs O(key length)
          for (std::string_view s : sorted)
            if (size_t d = edit_distance(k, s); d < best_d) best = s, best_d = d;
        std::string where_in = path_.empty() ? "the top level" : path_;
        if (!best.empty())
          fail(Errc::input, "{}: unknown field {}: did you mean {}? (valid fields of {}: {})", where_, excerpt(field(k)),
               field(best), where_in, valid);
        fail(Errc::input, "{}: unknown field {} (valid fields of {}: {})", where_, excerpt(field(k)), where_in, valid);
      }
      if (it->is_null())
        fail(Errc::input, "{}: {} is null; leave it out to get the default", where_, field(k));
    }
  }

  const Json& j_;
  const std::string& where_;
  std::string path_;
};

std::string valid_targets() {
  std::string s;
  for (const TargetInfo& t : kTargets) s += (s.empty() ? "" : ", ") + std::string(t.name);
  return s;
}

std::vector<std::string> read_targets(const Obj& top) {
  if (!top.has("targets"))
    fail(Errc::input, "{}: missing field targets (a list of GPU architectures; valid: {})", top.where(),
         valid_targets());
  const Json& a = top.array("targets");
  std::vector<std::string> out;
  for (size_t i = 0; i < a.size(); ++i) {
    std::string name = fmt::format("targets[{}]", i);
    std::string t = top.string(a[i], name);
    if (!find_target(t))
      fail(Errc::input, "{}: {} \"{}\" is not a known target (valid: {})", top.where(), name, excerpt(t), valid_targets());
    if (std::find(out.begin(), out.end(), t) != out.end())
      fail(Errc::input, "{}: {} \"{}\" is listed twice (each target once)", top.where(), name, excerpt(t));
    out.push_back(t);
  }
  // Order carries no meaning; sorting makes ["gfx942","sm_90a"] and its reverse the same bundle.
  std::sort(out.begin(), out.end());
  return out;
}

// A list of distinct integers in [lo, hi], returned sorted.
std::vector<int64_t> read_int_set(const Obj& o, std::string_view key, int64_t lo, int64_t hi,
                                  std::string_view what) {
  const Json& a = o.array(key);
  std::vector<int64_t> out;
  for (size_t i = 0; i < a.size(); ++i) {
    std::string name = fmt::format("{}[{}]", o.field(key), i);
    int64_t x = o.checked_integer(a[i], name, lo, hi);
    if (std::find(out.begin(), out.end(), x) != out.end())
      fail(Errc::input, "{}: {} {} is listed twice (each {} once)", o.where(), name, x, what);
    out.push_back(x);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<int64_t> read_widths(const Obj& top) {
  bool seqs = top.has("max_num_seqs"), list = top.has("widths");
  if (seqs && list)
    fail(Errc::input,
         "{}: give either max_num_seqs or widths, not both (max_num_seqs N means widths 1..N; widths lists "
         "them explicitly)",
         top.where());
  if (!seqs && !list)
    fail(Errc::input, "{}: missing field max_num_seqs (the largest batch width, 1..{}), or an explicit widths list",
         top.where(), kMaxWidth);
  if (list) return read_int_set(top, "widths", 1, kMaxWidth, "width");
  int64_t n = top.integer_value(top.at("max_num_seqs"), "max_num_seqs");
  if (n < 1 || n > kMaxWidth)
    fail(Errc::input,
         "{}: max_num_seqs {} is out of range (valid: 1..{}; steps wider than the largest built width fall back "
         "to the host's own layers, so the host may run with a larger max_num_seqs)",
         top.where(), n, kMaxWidth);
  std::vector<int64_t> out;
  for (int64_t w = 1; w <= n; ++w) out.push_back(w);
  return out;
}

std::optional<int64_t> width_key(const std::string& k) {
  if (k.empty() || k.size() > 6 || k[0] < '1' || k[0] > '9') return std::nullopt;
  int64_t x = 0;
  for (char c : k) {
    if (c < '0' || c > '9') return std::nullopt;
    x = x * 10 + (c - '0');
  }
  return x;
}

// `allreduce`: the all-reduce path of tensor parallelism, "in_kernel" or "nccl" for every width, or an
// object mapping widths to one of them (widths left out take the default). The default is in_kernel at
// every width: it is the only path measured so far (one H200, ranks as processes; bench/NOTES.md), and
// choosing NCCL by width from multi-GPU measurement is the next step. At tensor_parallel 1 no step
// all-reduces, so nothing is recorded. Returns the NCCL widths, sorted.
std::vector<int64_t> read_allreduce(const Obj& top, const Deploy& d) {
  if (!top.has("allreduce")) return {};
  const Json& v = top.at("allreduce");
  const std::string where = top.where();
  auto path = [&](const Json& s, const std::string& name) {
    if (s.is_string())
      for (const auto& e : format::kAllreducePaths)
        if (e.name == s.get<std::string>()) return e.value;
    fail(Errc::input, "{}: {} is {}, expected \"in_kernel\" or \"nccl\"{}", where, name,
         s.is_string() ? fmt::format("\"{}\"", excerpt(s.get<std::string>())) : json_excerpt(s),
         name == "allreduce" ? " (for every width), or an object mapping widths to one of them" : "");
  };
  std::vector<int64_t> nccl;
  if (v.is_object()) {
    if (v.empty()) fail(Errc::input, "{}: allreduce is an empty object, expected widths mapped to \"in_kernel\" or \"nccl\"", where);
    for (auto it = v.begin(); it != v.end(); ++it) {
      const std::string name = "allreduce." + excerpt(it.key());
      std::optional<int64_t> w = width_key(it.key());
      if (!w)
        fail(Errc::input, "{}: allreduce key \"{}\" is not a width (valid: {})", where, excerpt(it.key()), compact(d.widths));
      if (!std::binary_search(d.widths.begin(), d.widths.end(), *w))
        fail(Errc::input, "{}: {} names width {}, which is not built (valid: {})", where, name, *w, compact(d.widths));
      if (path(it.value(), name) == format::Allreduce::nccl) nccl.push_back(*w);
    }
    std::sort(nccl.begin(), nccl.end());
  } else if (path(v, "allreduce") == format::Allreduce::nccl) {
    nccl = d.widths;
  }
  if (d.tensor_parallel == 1) return {};
  return nccl;
}

// ---- Model checks ------------------------------------------------------------------------------------

bool uses(const model::Model& m, model::Mixer mixer, bool fallback) {
  if (m.layers.empty()) return fallback;  // hand-built models without a layer list: trust the config
  return std::any_of(m.layers.begin(), m.layers.end(), [&](const model::LayerSpec& l) { return l.mixer == mixer; });
}
bool uses(const model::Model& m, model::Ffn ffn, bool fallback) {
  if (m.layers.empty()) return fallback;
  return std::any_of(m.layers.begin(), m.layers.end(), [&](const model::LayerSpec& l) { return l.ffn == ffn; });
}

std::string shape_str(const std::vector<int64_t>& s) { return "[" + join(s) + "]"; }

// The first way `tp` fails to fit the model, as a message without the file prefix; nullopt if it fits.
std::optional<std::string> tp_problem(int64_t tp, const model::Model& m) {
  auto divides = [&](int64_t n) { return n % tp == 0; };
  auto msg = [&](std::string_view what, int64_t n) {
    return fmt::format("tensor_parallel {} does not divide {} {} (valid: {})", tp, what, n, join(pow2_divisors(n)));
  };
  bool moe = uses(m, model::Ffn::moe, m.moe.num_experts > 0) || uses(m, model::Ffn::latent_moe, false);
  bool dense = uses(m, model::Ffn::dense, m.dense_intermediate > 0);

  if (uses(m, model::Mixer::kda, m.kda.num_heads > 0) && !divides(m.kda.num_heads))
    return msg("kda num_heads", m.kda.num_heads);
  if (uses(m, model::Mixer::mla, m.mla.num_heads > 0) && !divides(m.mla.num_heads))
    return msg("mla num_heads", m.mla.num_heads);
  if (moe && !divides(m.moe.num_experts)) return msg("moe num_experts", m.moe.num_experts);
  if (dense && !divides(m.dense_intermediate)) return msg("dense intermediate_size", m.dense_intermediate);
  // The shared expert's width is num_shared * moe_intermediate_size, so this also covers it; the split
  // weights below check the actual tensors (including MXFP4 scale groups) in any case.
  if (moe && !divides(m.moe.intermediate)) return msg("moe_intermediate_size", m.moe.intermediate);

  for (const model::WeightSpec& w : m.weights) {
    if (w.split.kind != model::Split::Kind::dim) continue;
    if (w.split.dim < 0 || w.split.dim >= static_cast<int>(w.shape.size()))
      fail(Errc::internal, "model IR: {} {} is split along dim {}, which it does not have", w.name,
           shape_str(w.shape), w.split.dim);
    int64_t n = w.shape[static_cast<size_t>(w.split.dim)];
    if (!divides(n))
      return fmt::format("tensor_parallel {} does not divide dim {} ({}) of {} {} (valid: {})", tp, w.split.dim, n,
                         w.name, shape_str(w.shape), join(pow2_divisors(n)));
    // A rank's shard of a block-quantized weight must start and end on a block edge, so that each scale
    // belongs to one rank.
    if (!w.quant.block.empty() && w.quant.method == model::QuantMethod::fp8_block && tp > 1) {
      const int64_t b = w.quant.block[static_cast<size_t>(w.split.dim)];
      if ((n / tp) % b != 0) {
        std::vector<int64_t> valid;
        for (int64_t p : pow2_divisors(n))
          if ((n / p) % b == 0 || p == 1) valid.push_back(p);
        return fmt::format("tensor_parallel {} splits dim {} ({}) of {} {} into {} rows per rank, not a multiple of "
                           "its FP8 block of {} (valid: {})", tp, w.split.dim, n, w.name, shape_str(w.shape), n / tp, b,
                           join(valid));
      }
    }
  }
  return std::nullopt;
}

}  // namespace

// ---- Public ------------------------------------------------------------------------------------------

const char* to_string(Vendor v) { return v == Vendor::cuda ? "cuda" : "hip"; }

DType element_dtype(KvCacheDtype d) { return d == KvCacheDtype::bf16 ? DType::BF16 : DType::F8_E4M3; }
DType element_dtype(KdaStateDtype) { return DType::F32; }
DType element_dtype(ConvStateDtype d) { return d == ConvStateDtype::bf16 ? DType::BF16 : DType::F32; }

std::span<const TargetInfo> known_targets() { return kTargets; }

const TargetInfo* find_target(std::string_view name) {
  for (const TargetInfo& t : kTargets)
    if (t.name == name) return &t;
  return nullptr;
}

Deploy parse_deploy(const Json& j, const std::string& where) {
  Obj top(j, where, "");
  Deploy d;

  d.targets = read_targets(top);

  // vLLM tensor_parallel_size defaults to 1. Only powers of two up to one node's 8 GPUs: every model in
  // the family has power-of-two head and expert counts, and the all-reduce kernels assume one node.
  d.tensor_parallel = top.has("tensor_parallel") ? top.integer_value(top.at("tensor_parallel"), "tensor_parallel") : 1;
  if (std::find(kTensorParallel.begin(), kTensorParallel.end(), d.tensor_parallel) == kTensorParallel.end())
    fail(Errc::input, "{}: tensor_parallel {} is not supported (valid: 1, 2, 4, 8)", where, d.tensor_parallel);

  if (top.has("ranks")) {
    const Json& a = top.array("ranks");
    for (size_t i = 0; i < a.size(); ++i) {
      std::string name = fmt::format("ranks[{}]", i);
      int64_t r = top.integer_value(a[i], name);
      if (r < 0 || r >= d.tensor_parallel)
        fail(Errc::input, "{}: {} {} is not a rank of tensor_parallel {} (valid: 0..{})", where, name, r,
             d.tensor_parallel, d.tensor_parallel - 1);
    }
    d.ranks = read_int_set(top, "ranks", 0, d.tensor_parallel - 1, "rank");
  } else {
    for (int64_t r = 0; r < d.tensor_parallel; ++r) d.ranks.push_back(r);  // all ranks
  }

  d.widths = read_widths(top);
  d.num_speculative_tokens = top.integer("num_speculative_tokens", 0, 0, kMaxSpeculativeTokens);

  {
    Obj o = top.object("kv_cache");
    d.kv_cache.dtype = o.enumeration("dtype", KvCacheDtype::bf16, kKvCacheDtypes, kKvCacheHints);
    d.kv_cache.block_size = o.integer("block_size", 64, format::kMinBlockSize, kMaxBlockSize);
    if (d.kv_cache.block_size % 16 != 0)
      fail(Errc::input, "{}: kv_cache.block_size {} is not a multiple of 16 (valid: 16, 32, 48, ..., {}; 64 is "
           "FlashMLA's)", where, d.kv_cache.block_size, kMaxBlockSize);
  }
  {
    Obj o = top.object("kda_state");
    d.kda_state.dtype = o.enumeration("dtype", KdaStateDtype::float32, kKdaStateDtypes, kKdaStateHints);
    d.kda_state.layout = o.enumeration("layout", KdaStateLayout::kv, kKdaStateLayouts, std::array<Hint, 0>{});
  }
  {
    Obj o = top.object("conv_state");
    d.conv_state.dtype = o.enumeration("dtype", ConvStateDtype::bf16, kConvStateDtypes, kConvStateHints);
    d.conv_state.layout = o.enumeration("layout", ConvStateLayout::sd, kConvStateLayouts, kLayoutHints);
  }
  {
    // vLLM: decode_context_parallel_size 1, cp_kv_cache_interleave_size 1, and the same two rules.
    Obj o = top.object("dcp");
    d.dcp.size = o.integer("size", 1, 1, format::kMaxDcpSize);
    if (d.tensor_parallel % d.dcp.size != 0)
      fail(Errc::input, "{}: dcp.size {} does not divide tensor_parallel {} (valid: {})", where, d.dcp.size,
           d.tensor_parallel, join(divisors(d.tensor_parallel)));
    d.dcp.interleave = o.integer("interleave", 1, 1, format::kMaxDcpInterleave);
    if (d.kv_cache.block_size % d.dcp.interleave != 0)
      fail(Errc::input, "{}: dcp.interleave {} does not divide kv_cache.block_size {} (valid: {})", where,
           d.dcp.interleave, d.kv_cache.block_size, join(divisors(d.kv_cache.block_size)));
  }
  {
    Obj o = top.object("prefetch");
    d.prefetch.enabled = o.boolean("enabled", true);
    d.prefetch.cap_bytes = o.integer("cap_bytes", 24 << 20, 0, kMaxPrefetchCapBytes);
    d.prefetch.max_rows = o.integer("max_rows", 8, 0, kMaxWidth * (1 + kMaxSpeculativeTokens));
    if (o.has("width_cap_bytes")) {
      const Json& m = o.at("width_cap_bytes");
      std::string name = o.field("width_cap_bytes");
      if (!m.is_object())
        fail(Errc::input, "{}: {} is {} ({}), expected an object mapping widths to byte caps", where, name,
             json_type_name(m), json_excerpt(m));
      for (auto it = m.begin(); it != m.end(); ++it) {
        std::optional<int64_t> w = width_key(it.key());
        if (!w)
          fail(Errc::input, "{}: {} key \"{}\" is not a width (valid: {})", where, name, excerpt(it.key()), compact(d.widths));
        if (!std::binary_search(d.widths.begin(), d.widths.end(), *w))
          fail(Errc::input, "{}: {}.{} names width {}, which is not built (valid: {})", where, name, it.key(), *w,
               compact(d.widths));
        d.prefetch.width_cap_bytes[*w] =
            o.checked_integer(it.value(), name + "." + it.key(), 0, kMaxPrefetchCapBytes);
      }
    }
    std::vector<std::string_view> valid(format::kPrefetchPoints.begin(), format::kPrefetchPoints.end());
    if (o.has("points")) {
      const Json& a = o.at("points");
      const std::string name = o.field("points");
      if (!a.is_array())
        fail(Errc::input, "{}: {} is {} ({}), expected an array of prefetch points ({})", where, name, json_type_name(a),
             json_excerpt(a), fmt::format("{}", fmt::join(valid, ", ")));
      std::set<std::string> listed;
      for (size_t i = 0; i < a.size(); ++i) {
        const std::string v = a[i].is_string() ? a[i].get<std::string>() : json_excerpt(a[i]);
        if (!a[i].is_string() || std::find(valid.begin(), valid.end(), v) == valid.end()) {
          std::vector<std::string> names(valid.begin(), valid.end());
          const std::string near = closest_name(v, names, 4);
          fail(Errc::input, "{}: {}[{}] is \"{}\", expected one of {}{}", where, name, i, excerpt(v), fmt::format("{}", fmt::join(valid, ", ")),
               near.empty() ? "" : fmt::format(" (did you mean {}?)", near));
        }
        if (!listed.insert(v).second) fail(Errc::input, "{}: {}[{}]: \"{}\" is listed twice", where, name, i, v);
      }
      for (std::string_view p : valid)  // canonical order: the format's
        if (listed.count(std::string(p))) d.prefetch.points.emplace_back(p);
    } else if (d.tensor_parallel > 1) {
      d.prefetch.points = {"oproj_down", "attention_moe", "next_attention"};
    }
  }
  {
    Obj o = top.object("indexer");
    d.indexer.max_keys_per_chunk = o.integer("max_keys_per_chunk", 40 * 163840, 1, kMaxIndexerKeys);
    d.indexer.max_requests = o.integer("max_requests", 1024, 1, kMaxIndexerLimit);
    // Under DCP every rank stages the all-gather of all ranks' packed keys at once (seed 004
    // prefill_workspace_bytes): dcp.size rows of the per-rank bound, which the kernels index with int32.
    if (d.dcp.size > 1) {
      const int64_t local = indexer::local_keys_bound(d.indexer.max_keys_per_chunk, d.indexer.max_requests,
                                                      d.dcp.size, d.dcp.interleave);
      if (local > kMaxIndexerLimit / d.dcp.size)
        fail(Errc::input,
             "{}: indexer.max_keys_per_chunk {} and indexer.max_requests {} with dcp.size {} and dcp.interleave {}: "
             "each rank packs up to ceil({} / {}) + {} x {} = {} keys and stages all {} ranks' keys, {} rows, above "
             "{} (the prefill kernels index keys with int32); lower indexer.max_requests or "
             "indexer.max_keys_per_chunk",
             where, d.indexer.max_keys_per_chunk, d.indexer.max_requests, d.dcp.size, d.dcp.interleave,
             d.indexer.max_keys_per_chunk, d.dcp.size, d.indexer.max_requests, d.dcp.interleave, local, d.dcp.size,
             local * d.dcp.size, kMaxIndexerLimit);  // local < 2^48 and size <= 8: no overflow
    }
  }
  d.allreduce_nccl = read_allreduce(top, d);
  return d;
}

Deploy load_deploy(const std::string& spec) {
  if (spec == "default") {
    constexpr std::string_view name = "deploy-default.json";
    std::optional<std::string_view> text = embedded_file(name);
    if (!text) fail(Errc::internal, "built-in {} is missing from this build", name);
    return parse_deploy(parse_json(*text, name), std::string(name));
  }
  // A file that is not there: say what --deploy takes (a path, or `default`), with the same exit code.
  if (!path_exists(spec))
    fail(Errc::io, "--deploy {}: no such file{} (give a deploy JSON file, or `default` for the built-in deploy)",
         excerpt(spec), spec.size() < 16 && edit_distance(spec, "default") <= 2 ? "; did you mean `default`?" : "");
  std::error_code ec;
  if (std::filesystem::is_directory(spec, ec))
    fail(Errc::io, "--deploy {}: is a directory (give a deploy JSON file, or `default` for the built-in deploy)",
         excerpt(spec));
  return parse_deploy(load_json_file(spec), spec);
}

std::vector<std::string> known_keys() {
  std::vector<std::string> out;
  for (const Section& s : sections())
    for (std::string_view k : s.keys)
      out.push_back(s.name.empty() ? std::string(k) : fmt::format("{}.{}", s.name, k));
  std::sort(out.begin(), out.end());
  return out;
}

void check_against_model(const Deploy& d, const model::Model& m, const std::string& where) {
  if (d.tensor_parallel < 1) fail(Errc::internal, "{}: tensor_parallel {} was not validated", where, d.tensor_parallel);
  if (auto p = tp_problem(d.tensor_parallel, m)) fail(Errc::input, "{}: {}", where, *p);

  bool mla = uses(m, model::Mixer::mla, m.mla.num_heads > 0);
  if (d.dcp.size < 1 || d.tensor_parallel % d.dcp.size != 0)
    fail(Errc::input, "{}: dcp.size {} does not divide tensor_parallel {} (valid: {})", where, d.dcp.size,
         d.tensor_parallel, join(divisors(d.tensor_parallel)));
  // DCP spreads the MLA latent cache over ranks; a model without MLA layers has nothing to spread.
  if (d.dcp.size > 1 && !mla)
    fail(Errc::input, "{}: dcp.size {} needs MLA layers, and the model has none (valid: 1)", where, d.dcp.size);
  if (mla && (d.kv_cache.block_size < 16 || d.kv_cache.block_size % 16 != 0))
    fail(Errc::input, "{}: kv_cache.block_size {} is not a positive multiple of 16, which the MLA cache needs "
         "(valid: 16, 32, 48, ...; 64 is FlashMLA's)", where, d.kv_cache.block_size);
}

std::vector<int64_t> valid_tensor_parallel(const model::Model& m) {
  std::vector<int64_t> out;
  for (int64_t tp : kTensorParallel)
    if (!tp_problem(tp, m)) out.push_back(tp);
  return out;
}

}  // namespace dp::deploy
