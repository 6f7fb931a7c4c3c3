#include "format/manifest.h"
#include "format/fields.h"
#include "format/untrusted.h"
#include "format/ustar.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <set>
#include <tuple>

#include <fmt/format.h>
#include <fmt/ranges.h>

namespace dp::format {
namespace {

using fields::Obj;
using fields::schema_error;

// The safetensors dtypes and their element sizes in bytes.
const std::map<std::string, uint64_t> kDtypes = {
    {"BOOL", 1}, {"U8", 1},  {"I8", 1},  {"U16", 2}, {"I16", 2}, {"F16", 2},     {"BF16", 2},    {"U32", 4},
    {"I32", 4},  {"F32", 4}, {"U64", 8}, {"I64", 8}, {"F64", 8}, {"F8_E4M3", 1}, {"F8_E5M2", 1}, {"F8_E8M0", 1}};
const std::set<std::string> kKinds = {"final_norm", "lm_head", "prefetch", "layer", "indexer"};

bool is_hex64(const std::string& s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
}

const std::set<std::string> kIoFields = {"hidden",        "residual", "out",          "residual_out",
                                         "positions",     "state_indices", "block_table", "block_table_stride",
                                         "seq_lens",      "slot_mapping",  "num_accepted"};
const std::set<std::string> kKvKinds = {"kda_state", "conv_q", "conv_k", "conv_v", "mla_latent", "attn_res"};
// Tensor-parallel sources (1.6) and their parameter kinds.
const std::map<std::string, std::string> kTpSources = {
    {"peers", "pointer"}, {"flag", "pointer"}, {"rank", "u32"}, {"layer", "u32"}, {"timeout_us", "u32"}};

// A collective step (1.8): "nccl_allreduce" at a width the deploy lists under allreduce.nccl, `send` a
// workspace range and `recv` one or the dp_layer_io field "out", each `elements` bf16 values.
template <typename Bad>
void validate_collective(const Manifest& m, const ProgramEntry& p, const ProgramStepEntry& st, const std::string& at,
                         bool nccl_width, const std::map<int64_t, uint64_t>& ws, Bad&& bad) {
  if (m.format_version.minor < 8)
    bad(fmt::format("{}: collective \"{}\" in a format {}.{} bundle (since 1.8)", at, st.collective,
                    m.format_version.major, m.format_version.minor));
  if (st.collective != "nccl_allreduce")
    bad(fmt::format("{}: collective \"{}\", expected nccl_allreduce", at, st.collective));
  if (!st.kernel.empty()) bad(fmt::format("{}: a collective step names kernel {}, expected none", at, st.kernel));
  if (!nccl_width)
    bad(fmt::format("{}: an NCCL all-reduce at width {}, which deploy.allreduce does not give to nccl", at, p.width));
  if (st.elements == 0 || st.elements > kMaxDeviceBytes / 2)
    bad(fmt::format("{}: elements {}, expected 1..{}", at, st.elements, kMaxDeviceBytes / 2));
  const auto w = ws.find(p.width);
  const uint64_t ws_bytes = w == ws.end() ? 0 : w->second;
  if (st.args.size() != 2 || st.args[0].param != "send" || st.args[1].param != "recv") {
    bad(fmt::format("{}: {} args, expected two: send, recv", at, st.args.size()));
    return;
  }
  for (const ProgramArgEntry& arg : st.args) {
    if (arg.from == "workspace") {
      if (arg.offset % 16 || arg.offset > ws_bytes || st.elements * 2 > ws_bytes - arg.offset)
        bad(fmt::format("{}: {} at workspace offset {} ({} bytes) does not fit the width's {} workspace bytes at a "
                        "16-byte multiple", at, arg.param, arg.offset, st.elements * 2, ws_bytes));
    } else if (!(arg.param == "recv" && arg.from == "io" && arg.name == "out")) {
      bad(fmt::format("{}: {} from {} \"{}\", expected workspace{}", at, arg.param, arg.from, arg.name,
                      arg.param == "recv" ? " or io \"out\"" : ""));
    }
  }
}

// The cross-field rules of `programs` (bundle-format.md 2.5): every step names a kernel present for
// every target, binds each of its parameters once, in order, from a source of the parameter's kind.
template <typename Bad>
void validate_programs(const Manifest& m, const std::set<int64_t>& widths, Bad&& bad) {
  std::vector<std::string> targets;
  if (m.deploy.contains("targets") && m.deploy["targets"].is_array())
    for (const Json& t : m.deploy["targets"])
      if (t.is_string()) targets.push_back(t.get<std::string>());
  std::set<std::string> classes;
  for (const LayerEntry& l : m.layers) classes.insert(l.cls);
  std::map<std::string, const KernelEntry*> by_key;
  for (const KernelEntry& k : m.kernels) by_key[k.key] = &k;
  std::map<int64_t, uint64_t> ws;
  for (const WorkspaceEntry& w : m.workspace) ws[w.width] = w.bytes;
  std::set<int64_t> nccl_widths;  // deploy.allreduce's keys (1.8); the deploy reader checks its shape
  if (m.deploy.contains("allreduce") && m.deploy["allreduce"].is_object())
    for (auto it = m.deploy["allreduce"].begin(); it != m.deploy["allreduce"].end(); ++it)
      if (it.value() == "nccl" && !it.key().empty() && it.key().size() <= 6 &&
          std::all_of(it.key().begin(), it.key().end(), [](char c) { return c >= '0' && c <= '9'; }))
        nccl_widths.insert(std::stoll(it.key()));
  for (size_t i = 0; i < m.programs.size(); ++i) {
    const ProgramEntry& p = m.programs[i];
    const std::string who = fmt::format("programs[{}] ({} width {})", i, p.cls, p.width);
    if (i > 0 && !(std::tie(m.programs[i - 1].cls, m.programs[i - 1].width) < std::tie(p.cls, p.width)))
      bad(fmt::format("{}: not after programs[{}]: programs must be sorted by (class, width) and unique", who, i - 1));
    if (!classes.count(p.cls)) bad(fmt::format("{}: no layer has class {}", who, p.cls));
    if (!widths.empty() && !widths.count(p.width)) bad(fmt::format("{}: width is not one of the deploy's widths", who));
    if (p.steps.empty() == p.reason.empty())
      bad(fmt::format("{}: {} steps and reason \"{}\": a program has steps or a reason, not both", who, p.steps.size(),
                      p.reason));
    const bool nccl_width = nccl_widths.count(p.width) != 0;
    for (size_t s = 0; s < p.steps.size(); ++s) {
      const ProgramStepEntry& st = p.steps[s];
      if (!st.collective.empty()) {
        validate_collective(m, p, st, fmt::format("{} step {}", who, s), nccl_width, ws, bad);
        continue;
      }
      if (nccl_width)
        for (const ProgramArgEntry& arg : st.args)
          if (arg.from == "tp")
            bad(fmt::format("{} step {} ({}): binds tp source \"{}\", but width {} all-reduces with NCCL "
                            "(deploy.allreduce)", who, s, st.kernel, arg.name, p.width));
      for (const std::string& t : targets) {
        auto it = by_key.find(st.kernel + "." + t);
        if (it == by_key.end()) {
          bad(fmt::format("{} step {}: kernel {} has no entry for target {}", who, s, st.kernel, t));
          continue;
        }
        const KernelEntry& k = *it->second;
        if (k.params.size() != st.args.size())
          bad(fmt::format("{} step {} ({}): {} args for {} parameters", who, s, k.key, st.args.size(), k.params.size()));
        for (size_t a = 0; a < std::min(k.params.size(), st.args.size()); ++a) {
          const KernelParamEntry& kp = k.params[a];
          const ProgramArgEntry& arg = st.args[a];
          const std::string at = fmt::format("{} step {} ({}) arg {}", who, s, k.key, a);
          if (arg.param != kp.name) bad(fmt::format("{}: binds {}, the parameter is {}", at, arg.param, kp.name));
          std::string kind;
          if (arg.from == "io") {
            if (!kIoFields.count(arg.name)) bad(fmt::format("{}: io field \"{}\" is not a dp_layer_io field", at, arg.name));
            kind = arg.name == "block_table_stride" ? "u32" : "pointer";
          } else if (arg.from == "weight" || arg.from == "expert_stride") {
            if (arg.name.empty()) bad(fmt::format("{}: {} without a weight name", at, arg.from));
            kind = arg.from == "weight" ? "pointer" : "u32";
          } else if (arg.from == "kv" || arg.from == "kv_stride") {
            if (!kKvKinds.count(arg.name)) bad(fmt::format("{}: cache kind \"{}\" is not one of kda_state, conv_q, "
                                                           "conv_k, conv_v, mla_latent, attn_res", at, arg.name));
            if (arg.name == "attn_res" && m.format_version.minor < 7)
              bad(fmt::format("{}: cache kind attn_res in a format {}.{} bundle (since 1.7)", at,
                              m.format_version.major, m.format_version.minor));
            kind = arg.from == "kv" ? "pointer" : "u32";
          } else if (arg.from == "workspace") {
            kind = "pointer";
            const auto w = ws.find(p.width);
            if (arg.offset % 16 || w == ws.end() || arg.offset >= w->second)
              bad(fmt::format("{}: workspace offset {} is not a 16-byte multiple inside the width's {} workspace bytes",
                              at, arg.offset, w == ws.end() ? 0 : w->second));
          } else if (arg.from == "f32" || arg.from == "u32") {
            kind = arg.from;
            if (arg.from == "u32" && (arg.value < 0 || arg.value > 4294967295.0 || arg.value != std::floor(arg.value)))
              bad(fmt::format("{}: u32 value {} is not an integer in [0, 2^32)", at, arg.value));
          } else if (arg.from == "tp") {
            const auto it = kTpSources.find(arg.name);
            if (m.format_version.minor < 6)
              bad(fmt::format("{}: source tp in a format {}.{} bundle (since 1.6)", at, m.format_version.major,
                              m.format_version.minor));
            if (it == kTpSources.end())
              bad(fmt::format("{}: tp source \"{}\" is not one of peers, flag, rank, layer, timeout_us", at, arg.name));
            else
              kind = it->second;
          } else if (arg.from == "layer") {
            kind = "u32";
            if (m.format_version.minor < 7)
              bad(fmt::format("{}: source layer in a format {}.{} bundle (since 1.7)", at, m.format_version.major,
                              m.format_version.minor));
          } else if (arg.from == "null") {
            kind = "pointer";
            if (!kp.nullable) bad(fmt::format("{}: null for parameter {}, which is not nullable", at, kp.name));
          } else {
            bad(fmt::format("{}: from \"{}\", expected io, weight, expert_stride, workspace, kv, kv_stride, f32, u32, "
                            "null, tp or layer", at, arg.from));
          }
          if (!kind.empty() && kind != kp.kind)
            bad(fmt::format("{}: a {} source ({}) for parameter {} of kind {}", at, kind, arg.from, kp.name, kp.kind));
        }
      }
    }
  }
}

}  // namespace

int written_minor(const Manifest& m) {
  for (const KernelEntry& k : m.kernels)
    if (k.dynamic_shared_bytes > 0) return 9;
  for (const ProgramEntry& p : m.programs)
    for (const ProgramStepEntry& st : p.steps)
      if (!st.collective.empty()) return 8;
  for (const KernelEntry& k : m.kernels)
    if (k.op == "attnres") return 7;
  bool tp = false;
  for (const ProgramEntry& p : m.programs)
    for (const ProgramStepEntry& st : p.steps)
      for (const ProgramArgEntry& a : st.args) {
        if (a.from == "layer" || ((a.from == "kv" || a.from == "kv_stride") && a.name == "attn_res")) return 7;
        tp |= a.from == "tp";
      }
  return tp ? 6 : kMinWrittenMinor;
}

void check_version(const Version& v, const std::string& where) {
  if (v.major != kFormatMajor || v.minor > kFormatMinor)
    throw FormatError(FormatError::Kind::version,
                      fmt::format("{}: bundle format version {}.{} is not supported by this reader (format {}.{}; "
                                  "supported: {}.0 to {}.{}){}",
                                  where, v.major, v.minor, kFormatMajor, kFormatMinor, kFormatMajor, kFormatMajor,
                                  kFormatMinor,
                                  v.major > kFormatMajor || (v.major == kFormatMajor && v.minor > kFormatMinor)
                                      ? ": upgrade decodepack, or rebuild the bundle with this version"
                                      : ": rebuild the bundle with this version of decodepack"));
}

Manifest from_json(const Json& j, const std::string& where) {
  Obj top(j, where, "");
  Manifest m;
  m.format = top.str("format");
  if (m.format != kFormatName)
    schema_error(where, fmt::format("field format is \"{}\", expected \"{}\"", m.format, kFormatName));
  Obj fv = top.obj("format_version");
  fv.only({"major", "minor"});
  m.format_version = {fv.num<int>("major", 0, 1 << 20), fv.num<int>("minor", 0, 1 << 20)};
  check_version(m.format_version, where);
  if (m.format_version.minor >= 1)
    top.only({"format", "format_version", "tool_version", "toolchains", "templates_digest", "model", "deploy",
              "weights_fingerprinted", "layers", "kernels", "programs", "indexer", "ranks", "prefetch", "workspace",
              "files"});
  else
    top.only({"format", "format_version", "tool_version", "toolchains", "templates_digest", "model", "deploy",
              "weights_fingerprinted", "layers", "kernels", "ranks", "prefetch", "workspace", "files"});

  m.tool_version = top.str("tool_version");
  m.toolchains = top.get("toolchains");
  if (!m.toolchains.is_object()) schema_error(where, "field toolchains is not an object");
  for (auto it = m.toolchains.begin(); it != m.toolchains.end(); ++it)  // vendor -> compiler version
    if (!it->is_string())
      schema_error(where, fmt::format("field toolchains.{} is {} ({}), expected a string", excerpt(it.key()),
                                      it->type_name(), json_excerpt(*it)));
  m.templates_digest = top.str("templates_digest");

  Obj mo = top.obj("model");
  mo.only({"model_type", "architecture", "config_digest", "hidden_size", "num_layers", "vocab_size", "rms_norm_eps",
           "details"});
  m.model.model_type = mo.str("model_type");
  m.model.architecture = mo.str("architecture");
  m.model.config_digest = mo.str("config_digest");
  m.model.hidden_size = mo.num<int64_t>("hidden_size", 1, kMaxHiddenSize);
  m.model.num_layers = mo.num<int64_t>("num_layers", 1, kMaxLayers);
  m.model.vocab_size = mo.num<int64_t>("vocab_size", 1, kMaxVocabSize);
  m.model.rms_norm_eps = mo.num<double>("rms_norm_eps");
  m.model.details = mo.get("details");
  m.deploy = top.get("deploy");
  if (!m.deploy.is_object()) schema_error(where, "field deploy is not an object");
  m.weights_fingerprinted = top.boolean("weights_fingerprinted");

  for (size_t i = 0; i < top.array("layers").size(); ++i) {
    Obj l = top.at("layers", i);
    l.only({"index", "mixer", "ffn", "class"});
    m.layers.push_back({l.num<int>("index", 0, kMaxLayers - 1), l.str("mixer"), l.str("ffn"), l.str("class")});
  }
  for (size_t i = 0; i < top.array("kernels").size(); ++i) {
    Obj k = top.at("kernels", i);
    k.only({"key", "name", "op", "role", "target", "width", "q", "file", "sha256", "param_bytes", "params", "grid",
            "block", "shared_bytes", "dynamic_shared_bytes", "registers", "stack_bytes", "spill_bytes"});
    KernelEntry e;
    e.key = k.str("key");
    e.name = k.str("name");
    e.op = k.str("op");
    e.role = k.str("role");
    e.target = k.str("target");
    e.width = k.num<int64_t>("width", 0, 1 << 16);
    e.q = k.num<int64_t>("q", 0, 64);
    e.file = k.str("file");
    e.sha256 = k.str("sha256");
    e.param_bytes = k.num<uint32_t>("param_bytes", 0, kMaxParamBytes);
    for (size_t p = 0; p < k.array("params").size(); ++p) {
      Obj po = k.at("params", p);
      po.only({"name", "kind", "offset", "size", "shape", "nullable"});
      e.params.push_back({po.str("name"), po.str("kind"), po.num<uint32_t>("offset", 0, kMaxParamBytes),
                          po.num<uint32_t>("size", 0, kMaxParamBytes), po.str("shape"), po.boolean("nullable")});
    }
    k.dim3("grid", e.grid);
    k.dim3("block", e.block);
    e.shared_bytes = k.num<uint32_t>("shared_bytes", 0, kMaxKernelResource);
    if (k.has("dynamic_shared_bytes"))  // since 1.9, present only when not 0
      e.dynamic_shared_bytes = k.num<uint32_t>("dynamic_shared_bytes", 1, kMaxKernelResource);
    e.registers = k.num<uint32_t>("registers", 0, kMaxKernelResource);
    e.stack_bytes = k.num<uint32_t>("stack_bytes", 0, kMaxKernelResource);
    e.spill_bytes = k.num<uint32_t>("spill_bytes", 0, kMaxKernelResource);
    m.kernels.push_back(std::move(e));
  }
  if (m.format_version.minor >= 1) {
    Obj ix = top.obj("indexer");
    ix.only({"heads", "head_dim", "top_k", "prefill_workspace_bytes"});
    m.indexer = {ix.num<int64_t>("heads", 0, 1 << 20), ix.num<int64_t>("head_dim", 0, 1 << 20),
                 ix.num<int64_t>("top_k", 0, int64_t{1} << 40), ix.num<uint64_t>("prefill_workspace_bytes", 0, kMaxDeviceBytes)};
    for (size_t i = 0; i < top.array("programs").size(); ++i) {
      Obj p = top.at("programs", i);
      p.only({"class", "width", "steps", "reason"});
      ProgramEntry pe;
      pe.cls = p.str("class");
      pe.width = p.num<int64_t>("width", 1, 1 << 16);
      pe.reason = p.str("reason");
      for (size_t s = 0; s < p.array("steps").size(); ++s) {
        Obj so = p.at("steps", s);
        so.only({"kernel", "args", "collective", "elements"});
        ProgramStepEntry st;
        if (so.has("collective")) {  // since 1.8: no kernel
          st.collective = so.str("collective");
          st.elements = so.num<uint64_t>("elements", 1, kMaxDeviceBytes);
          if (so.has("kernel")) st.kernel = so.str("kernel");
        } else {
          st.kernel = so.str("kernel");
        }
        for (size_t a = 0; a < so.array("args").size(); ++a) {
          Obj ao = so.at("args", a);
          ao.only({"param", "from", "name", "offset", "value"});
          st.args.push_back({ao.str("param"), ao.str("from"), ao.str("name"),
                             ao.num<uint64_t>("offset", 0, kMaxDeviceBytes), ao.num<double>("value")});
        }
        pe.steps.push_back(std::move(st));
      }
      m.programs.push_back(std::move(pe));
    }
  }
  for (size_t i = 0; i < top.array("ranks").size(); ++i) {
    Obj r = top.at("ranks", i);
    r.only({"rank", "weights"});
    RankEntry re;
    re.rank = r.num<int64_t>("rank", 0, 1023);
    for (size_t w = 0; w < r.array("weights").size(); ++w) {
      Obj wo = r.at("weights", w);
      wo.only({"name", "dtype", "shape", "split_dim", "begin", "end", "experts", "layer", "sha256"});
      WeightEntry we;
      we.name = wo.str("name");
      we.dtype = wo.str("dtype");
      we.shape = wo.ints("shape", 0, kMaxDimension);
      if (static_cast<int64_t>(we.shape.size()) > kMaxDims)
        schema_error(where, fmt::format("field {} has {} dimensions, expected at most {}", wo.field("shape"),
                                        we.shape.size(), kMaxDims));
      we.split_dim = wo.num<int>("split_dim", -1, kMaxDims - 1);
      we.begin = wo.num<int64_t>("begin", 0, kMaxDimension);
      we.end = wo.num<int64_t>("end", 0, kMaxDimension);
      we.experts = wo.num<int64_t>("experts", 0, kMaxExperts);
      we.layer = wo.num<int>("layer", -1, kMaxLayers - 1);
      we.sha256 = wo.strs("sha256");
      re.weights.push_back(std::move(we));
    }
    m.ranks.push_back(std::move(re));
  }
  for (size_t i = 0; i < top.array("prefetch").size(); ++i) {
    Obj p = top.at("prefetch", i);
    p.only({"point", "layer", "widths", "critical", "grid", "ranges"});
    PrefetchEntry pe;
    pe.point = p.str("point");
    pe.layer = p.num<int>("layer", 0, kMaxLayers - 1);
    pe.widths = p.ints("widths", 1, 1 << 16);
    pe.critical = p.boolean("critical");
    pe.grid = p.num<int>("grid", 1, 65535);
    for (size_t r = 0; r < p.array("ranges").size(); ++r) {
      Obj ro = p.at("ranges", r);
      ro.only({"weight", "bytes"});
      pe.ranges.push_back({ro.str("weight"), ro.num<uint64_t>("bytes", 0, kMaxDeviceBytes)});
    }
    m.prefetch.push_back(std::move(pe));
  }
  for (size_t i = 0; i < top.array("workspace").size(); ++i) {
    Obj w = top.at("workspace", i);
    w.only({"width", "bytes"});
    m.workspace.push_back({w.num<int64_t>("width", 1, 1 << 16), w.num<uint64_t>("bytes", 0, kMaxDeviceBytes)});
  }
  for (size_t i = 0; i < top.array("files").size(); ++i) {
    Obj f = top.at("files", i);
    f.only({"path", "size", "sha256"});
    m.files.push_back({f.str("path"), f.num<uint64_t>("size", 0, kMaxFileBytes), f.str("sha256")});
  }
  validate(m, where);
  return m;
}

Json to_json(const Manifest& m) {
  Json j;
  j["format"] = m.format;
  j["format_version"] = {{"major", m.format_version.major}, {"minor", m.format_version.minor}};
  j["tool_version"] = m.tool_version;
  j["toolchains"] = m.toolchains;
  j["templates_digest"] = m.templates_digest;
  j["model"] = {{"model_type", m.model.model_type},   {"architecture", m.model.architecture},
                {"config_digest", m.model.config_digest}, {"hidden_size", m.model.hidden_size},
                {"num_layers", m.model.num_layers},   {"vocab_size", m.model.vocab_size},
                {"rms_norm_eps", m.model.rms_norm_eps}, {"details", m.model.details}};
  j["deploy"] = m.deploy;
  j["weights_fingerprinted"] = m.weights_fingerprinted;
  j["layers"] = Json::array();
  for (const LayerEntry& l : m.layers)
    j["layers"].push_back({{"index", l.index}, {"mixer", l.mixer}, {"ffn", l.ffn}, {"class", l.cls}});
  j["kernels"] = Json::array();
  for (const KernelEntry& k : m.kernels) {
    Json params = Json::array();
    for (const KernelParamEntry& p : k.params)
      params.push_back({{"name", p.name}, {"kind", p.kind}, {"offset", p.offset}, {"size", p.size},
                        {"shape", p.shape}, {"nullable", p.nullable}});
    j["kernels"].push_back({{"key", k.key}, {"name", k.name}, {"op", k.op}, {"role", k.role}, {"target", k.target},
                            {"width", k.width}, {"q", k.q}, {"file", k.file}, {"sha256", k.sha256},
                            {"param_bytes", k.param_bytes}, {"params", std::move(params)},
                            {"grid", {k.grid[0], k.grid[1], k.grid[2]}}, {"block", {k.block[0], k.block[1], k.block[2]}},
                            {"shared_bytes", k.shared_bytes}, {"registers", k.registers},
                            {"stack_bytes", k.stack_bytes}, {"spill_bytes", k.spill_bytes}});
    if (k.dynamic_shared_bytes > 0) j["kernels"].back()["dynamic_shared_bytes"] = k.dynamic_shared_bytes;
  }
  if (m.format_version.minor >= 1) {
    j["indexer"] = {{"heads", m.indexer.heads}, {"head_dim", m.indexer.head_dim}, {"top_k", m.indexer.top_k},
                    {"prefill_workspace_bytes", m.indexer.prefill_workspace_bytes}};
    j["programs"] = Json::array();
    for (const ProgramEntry& p : m.programs) {
      Json steps = Json::array();
      for (const ProgramStepEntry& s : p.steps) {
        Json args = Json::array();
        for (const ProgramArgEntry& a : s.args)
          args.push_back({{"param", a.param}, {"from", a.from}, {"name", a.name}, {"offset", a.offset}, {"value", a.value}});
        if (s.collective.empty())
          steps.push_back({{"kernel", s.kernel}, {"args", std::move(args)}});
        else
          steps.push_back({{"collective", s.collective}, {"elements", s.elements}, {"args", std::move(args)}});
      }
      j["programs"].push_back({{"class", p.cls}, {"width", p.width}, {"steps", std::move(steps)}, {"reason", p.reason}});
    }
  }
  j["ranks"] = Json::array();
  for (const RankEntry& r : m.ranks) {
    Json ws = Json::array();
    for (const WeightEntry& w : r.weights)
      ws.push_back({{"name", w.name}, {"dtype", w.dtype}, {"shape", w.shape}, {"split_dim", w.split_dim},
                    {"begin", w.begin}, {"end", w.end}, {"experts", w.experts}, {"layer", w.layer},
                    {"sha256", w.sha256}});
    j["ranks"].push_back({{"rank", r.rank}, {"weights", std::move(ws)}});
  }
  j["prefetch"] = Json::array();
  for (const PrefetchEntry& p : m.prefetch) {
    Json ranges = Json::array();
    for (const PrefetchRangeEntry& r : p.ranges) ranges.push_back({{"weight", r.weight}, {"bytes", r.bytes}});
    j["prefetch"].push_back({{"point", p.point}, {"layer", p.layer}, {"widths", p.widths}, {"critical", p.critical},
                             {"grid", p.grid}, {"ranges", std::move(ranges)}});
  }
  j["workspace"] = Json::array();
  for (const WorkspaceEntry& w : m.workspace) j["workspace"].push_back({{"width", w.width}, {"bytes", w.bytes}});
  j["files"] = Json::array();
  for (const FileEntry& f : m.files) j["files"].push_back({{"path", f.path}, {"size", f.size}, {"sha256", f.sha256}});
  return j;
}

std::string canonical_bytes(const Manifest& m) { return to_json(m).dump() + "\n"; }

void validate(const Manifest& m, const std::string& where) {
  auto bad = [&](const std::string& msg) { schema_error(where, msg); };
  if (m.format != kFormatName) bad(fmt::format("format is \"{}\", expected \"{}\"", m.format, kFormatName));
  check_version(m.format_version, where);
  if (m.model.config_digest.rfind("sha256:", 0) != 0 || !is_hex64(m.model.config_digest.substr(7)))
    bad(fmt::format("model.config_digest \"{}\" is not \"sha256:<64 hex digits>\"", m.model.config_digest));
  if (!m.templates_digest.empty() && !is_hex64(m.templates_digest))
    bad(fmt::format("templates_digest \"{}\" is not 64 hex digits", m.templates_digest));

  std::set<std::string> files;
  uint64_t total = 0;  // each size is at most kMaxFileBytes < 2^33: no overflow in 2^16 files
  for (size_t i = 0; i < m.files.size(); ++i) {
    const FileEntry& f = m.files[i];
    total += f.size;
    if (total > kMaxBundleBytes)
      bad(fmt::format("files[{}] ({}): the files up to here hold {} bytes, expected at most {} in all", i, f.path, total,
                      kMaxBundleBytes));
    if (std::string why = bundle_path_problem(f.path); !why.empty())
      bad(fmt::format("files[{}].path \"{}\" is not a safe relative path ({})", i, excerpt(f.path), why));
    if (f.path == kManifestFile) bad(fmt::format("files[{}] lists {} itself", i, kManifestFile));
    if (!is_hex64(f.sha256)) bad(fmt::format("files[{}] ({}): sha256 \"{}\" is not 64 hex digits", i, f.path, f.sha256));
    if (i > 0 && !(m.files[i - 1].path < f.path))
      bad(fmt::format("files[{}] ({}) is not after files[{}] ({}): paths must be sorted and unique", i, f.path, i - 1,
                      m.files[i - 1].path));
    files.insert(f.path);
  }
  std::set<int64_t> widths;
  if (m.deploy.contains("widths") && m.deploy["widths"].is_array())
    for (const Json& w : m.deploy["widths"])
      if (w.is_number_integer()) widths.insert(w.get<int64_t>());
  for (size_t i = 0; i < m.kernels.size(); ++i) {
    const KernelEntry& k = m.kernels[i];
    if (k.key != k.name + "." + k.target)
      bad(fmt::format("kernels[{}]: key \"{}\", expected \"{}.{}\" (name.target)", i, k.key, k.name, k.target));
    if (i > 0 && !(m.kernels[i - 1].key < k.key))
      bad(fmt::format("kernels[{}] ({}) is not after kernels[{}] ({}): keys must be sorted and unique", i, k.key,
                      i - 1, m.kernels[i - 1].key));
    if (!files.count(k.file)) bad(fmt::format("kernels[{}] ({}): file {} is not listed in files", i, k.key, k.file));
    if (!is_hex64(k.sha256)) bad(fmt::format("kernels[{}] ({}): sha256 \"{}\" is not 64 hex digits", i, k.key, k.sha256));
    if (k.width != 0 && !widths.empty() && !widths.count(k.width))
      bad(fmt::format("kernels[{}] ({}): width {} is not one of the deploy's widths", i, k.key, k.width));
    auto listed = std::find_if(m.files.begin(), m.files.end(), [&](const FileEntry& f) { return f.path == k.file; });
    if (listed != m.files.end() && listed->sha256 != k.sha256)
      bad(fmt::format("kernels[{}] ({}): sha256 {} differs from files[] entry {} for {}", i, k.key, k.sha256,
                      listed->sha256, k.file));
    if (!kKinds.count(k.role))
      bad(fmt::format("kernels[{}] ({}): role \"{}\", expected final_norm, lm_head, prefetch, layer or indexer", i, k.key,
                      k.role));
    if (k.role == "lm_head" && (m.format_version.minor < 5 || k.width == 0))
      bad(fmt::format("kernels[{}] ({}): role lm_head {}", i, k.key,
                      k.width == 0 ? "with width 0 (an LM head serves one width)"
                                   : fmt::format("in a {}.{} manifest (since 1.5)", m.format_version.major,
                                                 m.format_version.minor)));
    if (k.dynamic_shared_bytes > 0 && m.format_version.minor < 9)
      bad(fmt::format("kernels[{}] ({}): dynamic_shared_bytes {} in a {}.{} manifest (since 1.9)", i, k.key,
                      k.dynamic_shared_bytes, m.format_version.major, m.format_version.minor));
    if (k.role == "indexer" && (m.indexer.heads == 0 || m.format_version.minor < 2))
      bad(fmt::format("kernels[{}] ({}): role indexer in a {}.{} manifest {}", i, k.key, m.format_version.major,
                      m.format_version.minor, m.indexer.heads == 0 ? "whose model has no indexer" : "(since 1.2)"));
    uint64_t end = 0;
    for (const KernelParamEntry& p : k.params) {
      if (p.kind != "pointer" && p.kind != "u32" && p.kind != "f32")
        bad(fmt::format("kernels[{}] ({}): param {} kind \"{}\", expected pointer, u32 or f32", i, k.key, p.name, p.kind));
      // The runtime writes a pointer as 8 bytes and a u32 or f32 as 4 at `offset` of a param_bytes block:
      // a smaller size would let that write pass the block's end.
      const uint32_t want = p.kind == "pointer" ? 8 : 4;
      if (p.size != want || p.offset % want)
        bad(fmt::format("kernels[{}] ({}): param {} ({}) at offset {} with size {}, expected size {} at a multiple of {}",
                        i, k.key, p.name, p.kind, p.offset, p.size, want, want));
      end = std::max<uint64_t>(end, uint64_t{p.offset} + p.size);
    }
    if (!k.params.empty() && end != k.param_bytes)
      bad(fmt::format("kernels[{}] ({}): params end at byte {}, param_bytes is {}", i, k.key, end, k.param_bytes));
  }
  for (size_t i = 0; i < m.ranks.size(); ++i) {
    const RankEntry& r = m.ranks[i];
    if (i > 0 && m.ranks[i - 1].rank >= r.rank) bad(fmt::format("ranks[{}]: rank {} out of order", i, r.rank));
    std::set<std::string> names;
    for (const WeightEntry& w : r.weights) {
      if (!names.insert(w.name).second) bad(fmt::format("ranks[{}]: weight {} listed twice", i, w.name));
      auto dt = kDtypes.find(w.dtype);
      if (dt == kDtypes.end())
        bad(fmt::format("ranks[{}] weight {}: dtype \"{}\" is not a safetensors dtype", i, w.name, excerpt(w.dtype)));
      // Each dimension is bounded by the reader; their product is checked here, before anyone sizes by it.
      uint64_t bytes = dt->second;
      for (int64_t d : w.shape)
        if (__builtin_mul_overflow(bytes, static_cast<uint64_t>(d), &bytes) || bytes > kMaxShardBytes)
          bad(fmt::format("ranks[{}] weight {}: shape [{}] x {} bytes is more than {} bytes", i, w.name,
                          fmt::join(w.shape, ", "), dt->second, kMaxShardBytes));
      const bool grouped = w.name.find("{e}") != std::string::npos;
      if (grouped != (w.experts > 0))
        bad(fmt::format("ranks[{}] weight {}: experts {} but the name {} \"{{e}}\"", i, w.name, w.experts,
                        grouped ? "contains" : "lacks"));
      if (w.split_dim >= 0 && w.split_dim < static_cast<int>(w.shape.size()) &&
          (w.begin > w.end || w.shape[static_cast<size_t>(w.split_dim)] != w.end - w.begin))
        bad(fmt::format("ranks[{}] weight {}: range [{}, {}) does not match shard dim {} of {}", i, w.name, w.begin,
                        w.end, w.split_dim, w.shape[static_cast<size_t>(w.split_dim)]));
      size_t want = m.weights_fingerprinted ? (w.experts > 0 ? static_cast<size_t>(w.experts) : 1) : 0;
      if (w.sha256.size() != want)
        bad(fmt::format("ranks[{}] weight {}: {} fingerprints, expected {}", i, w.name, w.sha256.size(), want));
      for (const std::string& h : w.sha256)
        if (!is_hex64(h)) bad(fmt::format("ranks[{}] weight {}: fingerprint \"{}\" is not 64 hex digits", i, w.name, h));
      if (w.split_dim >= static_cast<int>(w.shape.size()))
        bad(fmt::format("ranks[{}] weight {}: split_dim {} beyond its {} dims", i, w.name, w.split_dim, w.shape.size()));
    }
  }
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const LayerEntry& l = m.layers[i];
    if (l.index != static_cast<int>(i))
      bad(fmt::format("layers[{}]: index {}, expected {} (layers in order)", i, l.index, i));
    if (l.mixer != "kda" && l.mixer != "mla") bad(fmt::format("layers[{}]: mixer \"{}\", expected kda or mla", i, l.mixer));
    if (l.ffn != "dense" && l.ffn != "moe" && l.ffn != "latent_moe")
      bad(fmt::format("layers[{}]: ffn \"{}\", expected dense, moe or latent_moe", i, l.ffn));
  }
  if (static_cast<int64_t>(m.layers.size()) != m.model.num_layers)
    bad(fmt::format("layers has {} entries, model.num_layers is {}", m.layers.size(), m.model.num_layers));
  for (size_t i = 0; i < m.prefetch.size(); ++i) {
    if (m.prefetch[i].layer < 0 || m.prefetch[i].layer >= m.model.num_layers)
      bad(fmt::format("prefetch[{}]: layer {} outside [0, {})", i, m.prefetch[i].layer, m.model.num_layers));
    for (int64_t w : m.prefetch[i].widths)
      if (!widths.empty() && !widths.count(w))
        bad(fmt::format("prefetch[{}]: width {} is not one of the deploy's widths", i, w));
  }
  for (size_t i = 0; i < m.workspace.size(); ++i)
    if (!widths.empty() && !widths.count(m.workspace[i].width))
      bad(fmt::format("workspace[{}]: width {} is not one of the deploy's widths", i, m.workspace[i].width));
  if (m.deploy.contains("ranks") && m.deploy["ranks"].is_array()) {
    std::set<int64_t> deploy_ranks;
    for (const Json& r : m.deploy["ranks"])
      if (r.is_number_integer()) deploy_ranks.insert(r.get<int64_t>());
    for (const RankEntry& r : m.ranks)
      if (!deploy_ranks.count(r.rank)) bad(fmt::format("ranks: rank {} is not in deploy.ranks", r.rank));
  }
  validate_programs(m, widths, bad);
  const IndexerEntry& ix = m.indexer;
  if ((ix.heads == 0) != (ix.head_dim == 0) || (ix.heads == 0) != (ix.top_k == 0) ||
      (ix.heads == 0) != (ix.prefill_workspace_bytes == 0))
    bad(fmt::format("indexer: heads {}, head_dim {}, top_k {}, prefill_workspace_bytes {}: all zero (no indexer) or all "
                    "positive", ix.heads, ix.head_dim, ix.top_k, ix.prefill_workspace_bytes));
  if (!m.ranks.empty()) {
    std::set<std::string> names;
    for (const WeightEntry& w : m.ranks[0].weights) names.insert(w.name);
    for (size_t i = 0; i < m.prefetch.size(); ++i)
      for (const PrefetchRangeEntry& r : m.prefetch[i].ranges) {
        if (!names.count(r.weight)) bad(fmt::format("prefetch[{}]: weight {} is not a weight of the bundle", i, r.weight));
        if (r.bytes % 16) bad(fmt::format("prefetch[{}]: {} bytes of {} is not a multiple of 16", i, r.bytes, r.weight));
      }
  }
}

}  // namespace dp::format
