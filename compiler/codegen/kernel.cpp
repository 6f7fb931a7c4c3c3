#include "codegen/kernel.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>

#include "common/error.h"

namespace dp::codegen {
namespace {

using Params = std::map<std::string, int64_t>;

struct ParamSpec {
  const char* key;     // "W": the name in KernelInstance::params
  const char* prefix;  // "w": its spelling in the kernel name
  int64_t min, max;    // inclusive
  const char* doc;
};

// A parameter of the entry point before layout (offsets are computed in kernel_signature()).
struct ArgSpec {
  const char* name;
  KernelParam::Kind kind;
  const char* c_type;
  std::string shape;
  const char* doc;
  bool nullable = false;
};

struct OpSpec {
  const char* name;
  const char* header;     // in templates/
  const char* device_fn;  // the device template the entry point calls
  std::vector<ParamSpec> params;  // fixed order: the order of the kernel name
  std::function<void(const Params&, const std::string& who)> check;  // op-specific constraints
  std::function<std::vector<int64_t>(const Params&)> template_args;   // device template arguments
  std::function<std::vector<ArgSpec>(const Params&)> args;
  std::function<LaunchShape(const Params&)> launch;
  std::function<uint32_t(const Params&)> block_threads;
};

// rmsnorm block size: enough threads that each holds at most a few 16-byte vectors of the row in
// registers (at most 256 threads, then more vectors per thread), rounded to whole wave64
// wavefronts so that one block shape serves both vendors. H = 2304 gives 192 threads x 2 vectors.
uint32_t rmsnorm_threads(int64_t h) {
  const int64_t vecs = h / 8;
  const int64_t per = (vecs + 255) / 256;
  const int64_t threads = (vecs + per - 1) / per;
  return static_cast<uint32_t>(std::max<int64_t>(64, (threads + 63) / 64 * 64));
}

std::string dims(const Params& p, std::initializer_list<const char*> keys, const char* dtype) {
  std::string s = "[";
  for (const char* k : keys) {
    if (s.size() > 1) s += ", ";
    s += std::to_string(p.at(k));
  }
  return s + "] " + dtype;
}

const std::vector<OpSpec>& ops() {
  static const std::vector<OpSpec> table = {
      {
          "prefetch",
          "prefetch.h",
          "dp_prefetch_ranges",
          {{"B", "b", 32, 1024, "threads per block (multiple of 32)"}},
          [](const Params& p, const std::string& who) {
            if (p.at("B") % 32 != 0)
              fail(Errc::input, "{}: parameter B = {} is not a multiple of 32 (valid: 32, 64, ..., 1024)", who,
                   p.at("B"));
          },
          [](const Params& p) { return std::vector<int64_t>{p.at("B")}; },
          [](const Params&) {
            return std::vector<ArgSpec>{
                {"table", KernelParam::Kind::pointer, "const dp_prefetch_range*", "[count] {u64 addr, u64 bytes}",
                 "ranges to prefetch, 16-byte aligned"},
                {"count", KernelParam::Kind::u32, "dp_u32", "", "entries in table"},
            };
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = 32;  // default; the kernel adapts to any grid (DESIGN.md: 32 x 32 by default)
            s.block[0] = static_cast<uint32_t>(p.at("B"));
            s.grid_is_default = true;
            return s;
          },
          [](const Params& p) { return static_cast<uint32_t>(p.at("B")); },
      },
      {
          "rmsnorm",
          "norm.h",
          "dp_add_rmsnorm",
          {{"W", "w", 1, 4096, "rows (batch width x rows per request)"},
           {"H", "h", 8, 1 << 20, "row length (hidden size), a multiple of 8"}},
          [](const Params& p, const std::string& who) {
            if (p.at("H") % 8 != 0)
              fail(Errc::input, "{}: parameter H = {} is not a multiple of 8 (rows are read as 16-byte bf16 vectors)",
                   who, p.at("H"));
          },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W"), p.at("H"), rmsnorm_threads(p.at("H"))};
          },
          [](const Params& p) {
            return std::vector<ArgSpec>{
                {"hidden", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "this layer's mixer/FFN output"},
                {"residual", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "residual stream in (layer 0 has none)", true},
                {"weight", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"H"}, "bf16"), "norm weight"},
                {"out", KernelParam::Kind::pointer, "dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "normalised rows (may alias hidden)"},
                {"residual_out", KernelParam::Kind::pointer, "dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "residual stream out (may alias residual)"},
                {"eps", KernelParam::Kind::f32, "float", "", "variance epsilon"},
            };
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = static_cast<uint32_t>(p.at("W"));
            s.block[0] = rmsnorm_threads(p.at("H"));
            return s;
          },
          [](const Params& p) { return rmsnorm_threads(p.at("H")); },
      },
  };
  return table;
}

std::string describe(const KernelInstance& k) {
  std::string s = k.op.empty() ? std::string("kernel instance") : "kernel instance " + k.op;
  std::string ps;
  for (const auto& [key, v] : k.params) ps += fmt::format("{}{}={}", ps.empty() ? "" : ", ", key, v);
  s += "(" + ps + ")";
  if (!k.target.empty()) s += " for " + k.target;
  return s;
}

const OpSpec& spec_of(const KernelInstance& k, std::string_view where) {
  const std::string who = where.empty() ? describe(k) : fmt::format("{}: {}", where, describe(k));
  for (const OpSpec& op : ops()) {
    if (k.op != op.name) continue;
    for (const ParamSpec& ps : op.params) {
      auto it = k.params.find(ps.key);
      if (it == k.params.end())
        fail(Errc::input, "{}: missing parameter {} ({}; valid range {}..{})", who, ps.key, ps.doc, ps.min, ps.max);
      if (it->second < ps.min || it->second > ps.max)
        fail(Errc::input, "{}: parameter {} = {} is out of range (valid: {}..{}, {})", who, ps.key, it->second,
             ps.min, ps.max, ps.doc);
    }
    for (const auto& [key, v] : k.params) {
      bool known = std::any_of(op.params.begin(), op.params.end(), [&](const ParamSpec& ps) { return key == ps.key; });
      if (!known) {
        std::string valid;
        for (const ParamSpec& ps : op.params) valid += fmt::format("{}{}", valid.empty() ? "" : ", ", ps.key);
        fail(Errc::input, "{}: unknown parameter {} for op {} (valid: {})", who, key, op.name, valid);
      }
    }
    op.check(k.params, who);
    return op;
  }
  std::string valid;
  for (const std::string& n : known_ops()) valid += fmt::format("{}{}", valid.empty() ? "" : ", ", n);
  fail(Errc::input, "{}: unknown op \"{}\" (valid: {})", who, k.op, valid);
}

}  // namespace

std::vector<std::string> known_ops() {
  std::vector<std::string> names;
  for (const OpSpec& op : ops()) names.emplace_back(op.name);
  std::sort(names.begin(), names.end());
  return names;
}

void validate_instance(const KernelInstance& k, std::string_view where) { (void)spec_of(k, where); }

std::string kernel_name(const KernelInstance& k) {
  const OpSpec& op = spec_of(k, {});
  std::string name = op.name;
  for (const ParamSpec& ps : op.params) name += fmt::format("_{}{}", ps.prefix, k.params.at(ps.key));
  return name;
}

std::string instance_key(const KernelInstance& k) {
  if (k.target.empty()) fail(Errc::input, "{}: no target given", describe(k));
  for (char c : k.target)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'))
      fail(Errc::input, "{}: target \"{}\" is not a target name (lower-case letters, digits, '_')", describe(k),
           k.target);
  return kernel_name(k) + "." + k.target;
}

KernelSignature kernel_signature(const KernelInstance& k) {
  const OpSpec& op = spec_of(k, {});
  KernelSignature sig;
  uint32_t offset = 0;
  for (ArgSpec& a : op.args(k.params)) {
    KernelParam p;
    p.name = a.name;
    p.kind = a.kind;
    p.c_type = a.c_type;
    p.shape = std::move(a.shape);
    p.doc = a.doc;
    p.nullable = a.nullable;
    p.size = p.align = a.kind == KernelParam::Kind::pointer ? 8u : 4u;
    offset = (offset + p.align - 1) / p.align * p.align;
    p.offset = offset;
    offset += p.size;
    sig.params.push_back(std::move(p));
  }
  sig.bytes = offset;
  return sig;
}

LaunchShape launch_shape(const KernelInstance& k) { return spec_of(k, {}).launch(k.params); }

std::string op_header(const KernelInstance& k) { return spec_of(k, {}).header; }

std::string generate_source(const KernelInstance& k) {
  const OpSpec& op = spec_of(k, {});
  const std::string name = kernel_name(k);
  const KernelSignature sig = kernel_signature(k);
  const LaunchShape launch = launch_shape(k);

  std::string params_line;
  for (const ParamSpec& ps : op.params)
    params_line += fmt::format("{}{}={}", params_line.empty() ? "" : ", ", ps.key, k.params.at(ps.key));
  std::string targs;
  for (int64_t v : op.template_args(k.params)) targs += fmt::format("{}{}", targs.empty() ? "" : ", ", v);

  std::string s;
  s += "// generated by decodepack, do not edit.\n";
  s += "// Reproduce with `decodepack build --emit-source DIR`; change templates/ or compiler/codegen instead.\n";
  s += fmt::format("// kernel {}: op {} ({})\n", name, op.name, params_line);
  s += fmt::format("// launch: block {} threads, grid {} blocks{}; parameter block {} bytes\n", launch.block[0],
                   launch.grid[0], launch.grid_is_default ? " by default" : "", sig.bytes);
  s += "#include \"vendor.h\"\n";
  s += fmt::format("#include \"{}\"\n\n", op.header);
  s += fmt::format("extern \"C\" __global__ DP_LAUNCH_BOUNDS({}) void {}(\n", op.block_threads(k.params), name);
  for (size_t i = 0; i < sig.params.size(); ++i) {
    const KernelParam& p = sig.params[i];
    std::string decl = fmt::format("    {} {}{}", p.c_type, p.name, i + 1 < sig.params.size() ? "," : ") {");
    std::string comment = p.shape;
    if (p.nullable) comment += comment.empty() ? "may be null" : ", may be null";
    if (!p.doc.empty()) comment += (comment.empty() ? "" : "; ") + p.doc;
    s += fmt::format("{:<44}  // +{}: {}\n", decl, p.offset, comment);
  }
  std::string call_args;
  for (const KernelParam& p : sig.params) call_args += fmt::format("{}{}", call_args.empty() ? "" : ", ", p.name);
  s += fmt::format("  {}<{}>({});\n}}\n", op.device_fn, targs, call_args);
  return s;
}

}  // namespace dp::codegen
