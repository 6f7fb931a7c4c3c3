#include "codegen/kernel.h"

#include <fmt/format.h>

#include <algorithm>

#include "codegen/ops/spec.h"
#include "common/error.h"

namespace dp::codegen {
namespace {

using ops::ArgSpec;
using ops::OpSpec;
using ops::ParamSpec;

// Every op of every family, looked up by name (the names are unique; known_ops() sorts them).
const std::vector<OpSpec>& op_table() {
  static const std::vector<OpSpec> table = [] {
    std::vector<OpSpec> all;
    for (auto family : {ops::gemm_ops, ops::kda_ops, ops::moe_ops, ops::mla_ops, ops::indexer_ops, ops::prefetch_ops,
                        ops::norm_ops, ops::allreduce_ops, ops::attnres_ops})
      for (OpSpec& op : family()) all.push_back(std::move(op));
    return all;
  }();
  return table;
}

// An optional parameter (ParamSpec::omit_zero) may be left out of an instance: it is 0.
int64_t param_or_zero(const ops::Params& p, const char* key) {
  auto it = p.find(key);
  return it == p.end() ? 0 : it->second;
}
ops::Params full_params(const OpSpec& op, const ops::Params& given) {
  ops::Params p = given;
  for (const ParamSpec& ps : op.params) p.emplace(ps.key, 0);  // keeps the given ones
  return p;
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
  for (const OpSpec& op : op_table()) {
    if (k.op != op.name) continue;
    for (const ParamSpec& ps : op.params) {
      auto it = k.params.find(ps.key);
      if (it == k.params.end() && ps.omit_zero) continue;  // an optional parameter left out: 0
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
        fail(Errc::input, "{}: unknown parameter {} for op {} ({})", who, key, op.name,
             valid.empty() ? std::string("it takes none") : "valid: " + valid);
      }
    }
    op.check(full_params(op, k.params), who);
    return op;
  }
  std::string valid;
  for (const std::string& n : known_ops()) valid += fmt::format("{}{}", valid.empty() ? "" : ", ", n);
  fail(Errc::input, "{}: unknown op \"{}\" (valid: {})", who, k.op, valid);
}

}  // namespace

std::vector<std::string> known_ops() {
  std::vector<std::string> names;
  for (const OpSpec& op : op_table()) names.emplace_back(op.name);
  std::sort(names.begin(), names.end());
  return names;
}

void validate_instance(const KernelInstance& k, std::string_view where) { (void)spec_of(k, where); }

std::string kernel_name(const KernelInstance& k) {
  const OpSpec& op = spec_of(k, {});
  std::string name = op.name;
  for (const ParamSpec& ps : op.params) {
    const int64_t v = param_or_zero(k.params, ps.key);
    if (ps.omit_zero && v == 0) continue;
    name += fmt::format("_{}{}", ps.prefix, v);
  }
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
  for (ArgSpec& a : op.args(full_params(op, k.params))) {
    KernelParam p;
    p.name = a.name;
    p.kind = a.kind;
    p.c_type = a.c_type;
    p.shape = std::move(a.shape);
    p.doc = std::move(a.doc);
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

LaunchShape launch_shape(const KernelInstance& k) {
  const OpSpec& op = spec_of(k, {});
  LaunchShape s = op.launch(full_params(op, k.params));
  if (op.dynamic_shared) s.dynamic_shared_bytes = op.dynamic_shared(full_params(op, k.params), k.target);
  return s;
}

std::string op_header(const KernelInstance& k) {
  const OpSpec& op = spec_of(k, {});
  return op.header_for ? op.header_for(full_params(op, k.params)) : op.header;
}

std::string generate_source(const KernelInstance& k) {
  const OpSpec& op = spec_of(k, {});
  const std::string name = kernel_name(k);
  const KernelSignature sig = kernel_signature(k);
  const LaunchShape launch = launch_shape(k);

  std::string params_line;
  const ops::Params full = full_params(op, k.params);
  for (const ParamSpec& ps : op.params)  // as given: an optional parameter left out is not listed
    if (k.params.count(ps.key))
      params_line += fmt::format("{}{}={}", params_line.empty() ? "" : ", ", ps.key, k.params.at(ps.key));
  std::string targs;
  for (int64_t v : op.template_args(full)) targs += fmt::format("{}{}", targs.empty() ? "" : ", ", v);

  std::string s;
  s += "// generated by decodepack, do not edit.\n";
  s += "// Reproduce with `decodepack build --emit-source DIR`; change templates/ or compiler/codegen instead.\n";
  s += fmt::format("// kernel {}: op {} ({})\n", name, op.name, params_line);
  std::string grid = std::to_string(launch.grid[0]);
  if (launch.grid[1] > 1 || launch.grid[2] > 1) grid += fmt::format(" x {} x {}", launch.grid[1], launch.grid[2]);
  s += fmt::format("// launch: block {} threads, grid {} blocks{}; parameter block {} bytes\n", launch.block[0], grid,
                   launch.grid_is_default ? " by default" : "", sig.bytes);
  s += "#include \"vendor.h\"\n";
  s += fmt::format("#include \"{}\"\n\n", op.header_for ? op.header_for(full) : op.header);
  s += fmt::format("extern \"C\" __global__ {}({}) void {}(\n", op.bounds_for ? op.bounds_for(full) : op.bounds,
                   op.block_threads(full), name);
  for (size_t i = 0; i < sig.params.size(); ++i) {
    const KernelParam& p = sig.params[i];
    std::string decl = fmt::format("    {} {}{}", p.c_type, p.name, i + 1 < sig.params.size() ? "," : ") {");
    std::string comment = p.shape;
    if (p.nullable) comment += comment.empty() ? "may be null" : ", may be null";
    if (!p.doc.empty()) comment += (comment.empty() ? "" : "; ") + p.doc;
    s += fmt::format("{:<44}  // +{}: {}\n", decl, p.offset, comment);
  }
  ops::DeviceCall call;
  if (op.call) call = op.call(full);
  if (call.fn.empty()) call.fn = op.device_fn;
  if (call.args.empty())
    for (const KernelParam& p : sig.params) call.args.push_back(p.name);
  std::string call_args;
  for (const std::string& a : call.args) call_args += fmt::format("{}{}", call_args.empty() ? "" : ", ", a);
  if (op.early_weights && op.early_weights(full))
    s += "  DP_GRID_DEPENDENCY_TRIGGER();  // programmatic dependent launch; waits after its first weight loads\n";
  else
    s += "  DP_GRID_DEPENDENCY_ENTRY();  // programmatic dependent launch (vendor.h)\n";
  s += fmt::format("  {}<{}>({});\n}}\n", call.fn, targs, call_args);
  return s;
}

}  // namespace dp::codegen
