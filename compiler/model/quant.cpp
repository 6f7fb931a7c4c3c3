#include "model/quant.h"

#include <algorithm>
#include <array>
#include <bitset>
#include <cctype>
#include <cmath>
#include <optional>
#include <thread>

#include <fmt/ranges.h>

#include "common/dtype.h"
#include "common/error.h"
#include "common/parallel.h"

namespace dp::model {
namespace {

// What a refusal lists as supported: the same sentence for every method refused.
constexpr std::string_view kSupported =
    "supported: quant_method \"fp8\" with fmt e4m3 and weight_block_size [128, 128], and \"compressed-tensors\" "
    "with format mxfp4-pack-quantized for the routed experts (Kimi-K3); a bf16 checkpoint has no "
    "quantization_config";

// Methods people meet on the Hub, with what they are, so that the refusal says why as well as no.
struct Known {
  std::string_view method;
  std::string_view what;
};
constexpr std::array kRefused = {
    Known{"awq", "4-bit integer weights with per-group scales and zero points (AWQ)"},
    Known{"gptq", "integer weights with per-group scales (GPTQ)"},
    Known{"bitsandbytes", "bitsandbytes 4/8-bit weights, quantized when loaded"},
    Known{"mxfp4", "gpt-oss-style MXFP4 (`_blocks` / `_scales` tensors)"},
    Known{"fbgemm_fp8", "per-channel FP8 (FBGEMM)"},
    Known{"modelopt", "NVIDIA ModelOpt FP8/FP4"},
    Known{"hqq", "HQQ integer weights"},
    Known{"eetq", "EETQ int8 weights"},
    Known{"quanto", "optimum-quanto weights"},
    Known{"torchao", "torchao weights"},
    Known{"gguf", "GGUF blocks"},
};

// The regular expressions of ignore lists ("re:.*self_attn.*", "re:.*gate$"), matched as Python's
// re.match does (anchored at the start). Only a subset is read: characters, `.`, classes `[...]`, the
// quantifiers `*`, `+`, `?`, escapes `\x`, `^` first, `$` last and `|` between alternatives; groups,
// counted repeats and back references are refused. It runs as a set of pattern positions (linear in
// pattern x name), so no pattern a config holds can make the match slow.
struct Atom {
  std::bitset<256> chars;
  bool star = false, optional = false;  // x* or x? (x+ is read as x x*)
};
using Alternative = std::vector<Atom>;
struct Regex {
  std::vector<Alternative> alts;
  std::vector<bool> to_end;  // per alternative: ends with `$`
};

// Reads `re`; returns why it is not in the subset, or nothing.
std::optional<std::string> parse_regex(std::string_view re, Regex& out) {
  size_t i = 0;
  out.alts.assign(1, {});
  out.to_end.assign(1, false);
  if (i < re.size() && re[i] == '^') ++i;
  while (i < re.size()) {
    const char c = re[i];
    if (out.to_end.back() && c != '|') return "`$` is only read at the end of an alternative";
    if (c == '|') {
      out.alts.emplace_back();
      out.to_end.push_back(false);
      ++i;
      if (i < re.size() && re[i] == '^') ++i;
      continue;
    }
    if (c == '$') {
      out.to_end.back() = true;
      ++i;
      continue;
    }
    if (c == '(' || c == ')' || c == '{' || c == '}')
      return fmt::format("`{}` at offset {}: groups and counted repeats are not read (characters, `.`, `[...]`, `*`, "
                         "`+`, `?`, `^`, `$` and `|` are)", c, i);
    if (c == '*' || c == '+' || c == '?') return fmt::format("`{}` at offset {} repeats nothing", c, i);
    Atom a;
    if (c == '.') {
      a.chars.set();
      ++i;
    } else if (c == '\\') {
      if (i + 1 >= re.size()) return "a trailing `\\`";
      const char e = re[i + 1];
      if (std::isalnum(static_cast<unsigned char>(e))) return fmt::format("the escape `\\{}` is not read", e);
      a.chars.set(static_cast<unsigned char>(e));
      i += 2;
    } else if (c == '[') {
      size_t j = i + 1;
      const bool negate = j < re.size() && re[j] == '^';
      if (negate) ++j;
      std::bitset<256> set;
      bool first = true;
      while (j < re.size() && (re[j] != ']' || first)) {
        unsigned char lo = static_cast<unsigned char>(re[j]);
        if (re[j] == '\\' && j + 1 < re.size()) lo = static_cast<unsigned char>(re[++j]);
        if (j + 2 < re.size() && re[j + 1] == '-' && re[j + 2] != ']') {
          const unsigned char hi = static_cast<unsigned char>(re[j + 2]);
          for (unsigned x = lo; x <= hi; ++x) set.set(x);
          j += 3;
        } else {
          set.set(lo);
          ++j;
        }
        first = false;
      }
      if (j >= re.size()) return "an unclosed `[`";
      a.chars = negate ? ~set : set;
      i = j + 1;
    } else {
      a.chars.set(static_cast<unsigned char>(c));
      ++i;
    }
    if (i < re.size() && (re[i] == '*' || re[i] == '+' || re[i] == '?')) {
      if (re[i] == '+') out.alts.back().push_back(a);
      a.star = re[i] != '?';
      a.optional = re[i] == '?';
      ++i;
      if (i < re.size() && (re[i] == '*' || re[i] == '+' || re[i] == '?' || re[i] == '{'))
        return fmt::format("`{}` at offset {} repeats a repeat", re[i], i);
    }
    out.alts.back().push_back(a);
  }
  return std::nullopt;
}

bool match_alternative(const Alternative& a, bool to_end, std::string_view s) {
  const size_t n = a.size();
  std::vector<char> cur(n + 1, 0), next(n + 1, 0);
  auto close = [&](std::vector<char>& st) {  // skip optional atoms: moves only go forward
    for (size_t i = 0; i < n; ++i)
      if (st[i] && (a[i].star || a[i].optional)) st[i + 1] = 1;
  };
  cur[0] = 1;
  close(cur);
  for (char ch : s) {
    if (!to_end && cur[n]) return true;
    std::fill(next.begin(), next.end(), 0);
    bool any = false;
    for (size_t i = 0; i < n; ++i)
      if (cur[i] && a[i].chars.test(static_cast<unsigned char>(ch))) {
        next[a[i].star ? i : i + 1] = 1;
        any = true;
      }
    if (!any) return false;
    close(next);
    cur.swap(next);
  }
  return cur[n] != 0;
}

bool regex_matches(const Regex& r, std::string_view s) {
  for (size_t i = 0; i < r.alts.size(); ++i)
    if (match_alternative(r.alts[i], r.to_end[i], s)) return true;
  return false;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

class Reader {
 public:
  Reader(const Json& q, std::string where, std::string path) : q_(q), where_(std::move(where)), path_(std::move(path)) {}

  [[noreturn]] void refuse(const std::string& what) const { fail(Errc::input, "{}: {}", where_, what); }
  std::string field(std::string_view k) const { return path_ + "." + std::string(k); }
  const Json* find(std::string_view k) const {
    auto it = q_.find(k);
    return it == q_.end() || it->is_null() ? nullptr : &*it;
  }
  std::string string(std::string_view k) const {
    const Json* v = find(k);
    if (!v || !v->is_string())
      refuse(fmt::format("{} is {}, expected a string", field(k), v ? json_excerpt(*v) : "missing"));
    return v->get<std::string>();
  }
  // An ignore list: absent or null is empty; otherwise a list of strings.
  std::vector<std::string> names(std::string_view k) const {
    std::vector<std::string> out;
    const Json* v = find(k);
    if (!v) return out;
    if (!v->is_array()) refuse(fmt::format("{} is {}, expected a list of module names", field(k), json_excerpt(*v)));
    for (size_t i = 0; i < v->size(); ++i) {
      const Json& e = (*v)[i];
      if (!e.is_string() || e.get<std::string>().empty() || e.get<std::string>().size() > 256)
        refuse(fmt::format("{}[{}] is {}, expected a module name or \"re:<regex>\" of 1..256 characters", field(k), i,
                           json_excerpt(e)));
      const std::string s = e.get<std::string>();
      Regex re;
      if (s.starts_with("re:"))
        if (std::optional<std::string> why = parse_regex(std::string_view(s).substr(3), re))
          refuse(fmt::format("{}[{}] \"{}\" is not a regular expression this reader takes: {}", field(k), i,
                             excerpt(s), *why));
      out.push_back(s);
    }
    return out;
  }
  const std::string& where() const { return where_; }
  const std::string& path() const { return path_; }
  const Json& json() const { return q_; }

 private:
  const Json& q_;
  std::string where_, path_;
};

Quantization read_fp8(const Reader& r) {
  Quantization q;
  q.method = QuantMethod::fp8_block;
  q.quant_method = "fp8";
  if (const Json* f = r.find("fmt"); f && (!f->is_string() || lower(f->get<std::string>()) != "e4m3"))
    r.refuse(fmt::format("{} is {}: quant_method \"fp8\" is supported with e4m3 weights only ({})", r.field("fmt"),
                         json_excerpt(*f), kSupported));
  if (const Json* a = r.find("activation_scheme"); a && (!a->is_string() || a->get<std::string>() != "dynamic"))
    r.refuse(fmt::format("{} is {}: quant_method \"fp8\" is supported with dynamic activation scales only (static "
                         "input scales are not read; {})", r.field("activation_scheme"), json_excerpt(*a), kSupported));
  const Json* b = r.find("weight_block_size");
  if (!b)
    r.refuse(fmt::format("{} is missing: quant_method \"fp8\" without blocks means one scale per tensor, which is not "
                         "supported ({})", r.field("weight_block_size"), kSupported));
  if (!b->is_array() || b->size() != 2 || !(*b)[0].is_number_integer() || !(*b)[1].is_number_integer() ||
      (*b)[0].get<int64_t>() != kFp8Block || (*b)[1].get<int64_t>() != kFp8Block)
    r.refuse(fmt::format("{} is {}: quant_method \"fp8\" is supported with [{}, {}] blocks only ({})",
                         r.field("weight_block_size"), json_excerpt(*b), kFp8Block, kFp8Block, kSupported));
  q.block = {kFp8Block, kFp8Block};
  // HF transformers writes modules_to_not_convert, vLLM's FP8 config reads ignored_layers.
  for (const char* k : {"modules_to_not_convert", "ignored_layers"})
    for (std::string& s : r.names(k)) q.ignore.push_back(std::move(s));
  return q;
}

// compressed-tensors: only the MXFP4 pack format (Kimi-K3's routed experts).
Quantization read_compressed_tensors(const Reader& r) {
  Quantization q;
  q.method = QuantMethod::mxfp4_experts;
  q.quant_method = "compressed-tensors";
  q.block = {1, 32};
  auto check_format = [&](const Json& o, const std::string& path) {
    auto it = o.find("format");
    if (it == o.end() || it->is_null()) return;
    if (!it->is_string() || it->get<std::string>() != "mxfp4-pack-quantized")
      r.refuse(fmt::format("{}.format is {}: compressed-tensors is supported with format mxfp4-pack-quantized only "
                           "({})", path, json_excerpt(*it), kSupported));
  };
  check_format(r.json(), r.path());
  bool any_format = r.find("format") != nullptr;
  if (const Json* g = r.find("config_groups")) {
    if (!g->is_object() || g->empty())
      r.refuse(fmt::format("{} is {}, expected an object of quantization groups", r.field("config_groups"),
                           json_excerpt(*g)));
    for (auto it = g->begin(); it != g->end(); ++it) {
      const std::string path = r.field("config_groups") + "." + excerpt(it.key());
      if (!it->is_object()) r.refuse(fmt::format("{} is {}, expected an object", path, json_excerpt(*it)));
      check_format(*it, path);
      any_format = any_format || it->contains("format");
      // The weights of an MXFP4 group: 4-bit floats in groups of 32.
      if (auto w = it->find("weights"); w != it->end() && w->is_object()) {
        const bool fp4 = w->value("num_bits", Json()) == Json(4) && w->value("type", Json()) == Json("float") &&
                         w->value("group_size", Json(32)) == Json(32);
        if (!fp4)
          r.refuse(fmt::format("{}.weights is {}: compressed-tensors is supported for 4-bit float weights in groups of "
                               "32 (MXFP4) only ({})", path, json_excerpt(*w), kSupported));
      }
      if (auto in = it->find("input_activations"); in != it->end() && !in->is_null())
        r.refuse(fmt::format("{}.input_activations is {}: quantized activations are not supported ({})", path,
                             json_excerpt(*in), kSupported));
    }
  }
  if (!any_format)
    r.refuse(fmt::format("{} has no format: compressed-tensors is supported with format mxfp4-pack-quantized only ({})",
                         r.path(), kSupported));
  q.ignore = r.names("ignore");
  return q;
}

}  // namespace

bool module_ignored(std::string_view module, const std::vector<std::string>& patterns) {
  auto split = [](std::string_view s) {
    std::vector<std::string_view> out;
    size_t start = 0;
    while (true) {
      const size_t dot = s.find('.', start);
      out.push_back(s.substr(start, dot == std::string_view::npos ? std::string_view::npos : dot - start));
      if (dot == std::string_view::npos) return out;
      start = dot + 1;
    }
  };
  const std::vector<std::string_view> parts = split(module);
  for (const std::string& p : patterns) {
    if (p.starts_with("re:")) {
      // compressed-tensors and vLLM match with Python's re.match: anchored at the start only.
      Regex r;
      if (!parse_regex(std::string_view(p).substr(3), r) && regex_matches(r, module)) return true;
      continue;
    }
    const std::vector<std::string_view> want = split(p);
    if (want.size() > parts.size()) continue;
    for (size_t i = 0; i + want.size() <= parts.size(); ++i)
      if (std::equal(want.begin(), want.end(), parts.begin() + static_cast<std::ptrdiff_t>(i))) return true;
  }
  return false;
}

bool is_quantizable_linear(std::string_view key) {
  static constexpr std::array<std::string_view, 23> kLinear = {
      "q_proj",  "k_proj",  "v_proj",    "o_proj",     "b_proj",   "f_a_proj",  "f_b_proj",  "g_proj",
      "g_a_proj", "g_b_proj", "q_a_proj", "q_b_proj",  "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj",
      "down_proj", "routed_expert_down_proj", "routed_expert_up_proj", "w1", "w2", "w3", "wq_b"};
  if (!key.ends_with(".weight")) return false;
  std::string_view module = key.substr(0, key.size() - 7);
  const size_t dot = module.rfind('.');
  const std::string_view last = dot == std::string_view::npos ? module : module.substr(dot + 1);
  if (last == "wk") return true;  // the indexer's key projection
  return std::find(kLinear.begin(), kLinear.end(), last) != kLinear.end();
}

std::string describe(const Quantization& q) {
  switch (q.method) {
    case QuantMethod::none: return "bf16";
    case QuantMethod::mxfp4_experts: return "mxfp4";
    case QuantMethod::fp8_block: return fmt::format("fp8 e4m3 {}x{} blocks", q.block[0], q.block[1]);
  }
  return "?";
}

Fp8Blocks quantize_fp8_blocks(const std::vector<float>& values, int64_t rows, int64_t cols, int64_t block) {
  if (rows < 0 || cols < 0 || block < 1 || static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols) != values.size())
    fail(Errc::internal, "quantize_fp8_blocks: {} values for [{}, {}] in blocks of {}", values.size(), rows, cols, block);
  const int64_t br = (rows + block - 1) / block, bc = (cols + block - 1) / block;
  Fp8Blocks out;
  out.values.resize(values.size());
  out.scale_inv.assign(static_cast<size_t>(br * bc), 1.0f);
  auto block_row = [&](int64_t bi) {
    for (int64_t bj = 0; bj < bc; ++bj) {
      const int64_t r1 = std::min(rows, (bi + 1) * block), c1 = std::min(cols, (bj + 1) * block);
      float amax = 0;
      for (int64_t r = bi * block; r < r1; ++r)
        for (int64_t c = bj * block; c < c1; ++c) amax = std::max(amax, std::fabs(values[r * cols + c]));
      const float s = amax > 0 ? amax / kE4m3Max : 1.0f;
      out.scale_inv[bi * bc + bj] = s;
      for (int64_t r = bi * block; r < r1; ++r)
        for (int64_t c = bj * block; c < c1; ++c) out.values[r * cols + c] = f32_to_e4m3_bits(values[r * cols + c] / s);
    }
  };
  // Rows of blocks are independent: big matrices (a synthetic checkpoint's, the reference's) are cut
  // over the cores, the same bytes whatever the count.
  const unsigned threads = values.size() < (1u << 20) ? 1u : std::max(1u, std::thread::hardware_concurrency());
  parallel_for(static_cast<size_t>(br), threads, [&](size_t bi) { block_row(static_cast<int64_t>(bi)); });
  return out;
}

Quantization read_quantization(const Json& top, const Json& text, const std::string& where) {
  // MLX (mlx-lm) writes `quantization` (and often the same object again as quantization_config).
  for (const Json* o : {&top, &text}) {
    auto it = o->find("quantization");
    if (it == o->end() || it->is_null()) continue;
    const std::string key = o == &top ? "quantization" : "text_config.quantization";
    std::string mode = "affine";
    if (it->is_object() && it->contains("mode") && (*it)["mode"].is_string()) mode = (*it)["mode"].get<std::string>();
    fail(Errc::input,
         "{}: {} is {}: an MLX quantization (mode \"{}\"), which is not supported; MLX checkpoints store packed "
         "integer weights with per-group scales and biases that these kernels do not read ({}; convert from the "
         "original Hugging Face checkpoint)",
         where, key, json_excerpt(*it), excerpt(mode), kSupported);
  }
  const Json* q = nullptr;
  std::string path = "quantization_config";
  if (auto it = top.find("quantization_config"); it != top.end() && !it->is_null()) q = &*it;
  else if (auto jt = text.find("quantization_config"); &text != &top && jt != text.end() && !jt->is_null())
    q = &*jt, path = "text_config.quantization_config";
  if (!q) return {};
  if (!q->is_object())
    fail(Errc::input, "{}: {} is {}, expected an object ({})", where, path, json_excerpt(*q), kSupported);
  Reader r(*q, where, path);
  const Json* m = r.find("quant_method");
  if (!m || !m->is_string())
    r.refuse(fmt::format("{} is {}, expected the name of the quantization method ({})", r.field("quant_method"),
                         m ? json_excerpt(*m) : "missing", kSupported));
  const std::string method = lower(m->get<std::string>());
  if (method == "fp8") return read_fp8(r);
  if (method == "compressed-tensors") return read_compressed_tensors(r);
  for (const Known& k : kRefused)
    if (method == k.method)
      r.refuse(fmt::format("{} \"{}\" is not supported: {} ({})", r.field("quant_method"), excerpt(m->get<std::string>()),
                           k.what, kSupported));
  r.refuse(fmt::format("{} \"{}\" is not supported ({})", r.field("quant_method"), excerpt(m->get<std::string>()),
                       kSupported));
}

}  // namespace dp::model
