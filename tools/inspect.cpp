// decodepack inspect: what a bundle holds, without a GPU.
#include <cstdio>
#include <map>
#include <set>

#include "bundle/bundle.h"
#include "commands.h"
#include "common/error.h"
#include "common/json.h"
#include "tooling/json_output.h"

namespace dp::tools {
namespace {

std::string human(uint64_t b) {
  if (b >= (1ull << 30)) return fmt::format("{:.2f} GiB", b / double(1ull << 30));
  if (b >= (1ull << 20)) return fmt::format("{:.1f} MiB", b / double(1ull << 20));
  if (b >= (1ull << 10)) return fmt::format("{:.1f} KiB", b / double(1ull << 10));
  return fmt::format("{} B", b);
}

// A rank's weights counted the three ways README.md "Weight counts" names: the manifest's entries (an
// expert group is one entry: what a host binds), the tensors the decode kernels read (each expert
// counted), and their bytes.
struct WeightCounts {
  uint64_t entries = 0, tensors = 0, bytes = 0;
};

WeightCounts weight_counts(const format::RankEntry& r) {
  WeightCounts c;
  for (const format::WeightEntry& w : r.weights) {
    uint64_t n = 1;
    for (int64_t x : w.shape) n *= static_cast<uint64_t>(x);
    const uint64_t per = n * (w.dtype == "F32" ? 4 : w.dtype == "BF16" || w.dtype == "F16" ? 2 : 1);
    const uint64_t count = w.experts > 0 ? static_cast<uint64_t>(w.experts) : 1;
    c.entries += 1;
    c.bytes += per * count;
    c.tensors += count;
  }
  return c;
}

std::string text(const bundle::Bundle& b) {
  const format::Manifest& m = b.manifest();
  std::string out;
  auto line = [&](const std::string& s) { out += s + "\n"; };
  line(fmt::format("bundle    {} ({})", b.path().string(), b.is_archive() ? "archive" : "directory"));
  line(fmt::format("digest    {}", b.digest()));
  line(fmt::format("format    {} {}.{}, written by decodepack {}", m.format, m.format_version.major,
                   m.format_version.minor, m.tool_version));
  std::string tc;
  for (const auto& [k, v] : m.toolchains.items()) tc += fmt::format("{}{}: {}", tc.empty() ? "" : "; ", k, v.get<std::string>());
  line(fmt::format("toolchain {}", tc.empty() ? "-" : tc));
  line("");
  line(fmt::format("model     {} ({}), {} layers, hidden {}, config {}", m.model.model_type, m.model.architecture,
                   m.model.num_layers, m.model.hidden_size, m.model.config_digest));
  std::map<std::string, int> classes;
  for (const format::LayerEntry& l : m.layers) classes[l.cls]++;
  std::string cls;
  for (const auto& [c, n] : classes) cls += fmt::format("{}{} x{}", cls.empty() ? "" : ", ", c, n);
  line(fmt::format("layers    {}", cls));
  const deploy::Deploy& d = b.deploy();  // checked by Bundle::open, unlike the manifest's raw deploy JSON
  line(fmt::format("deploy    targets {}; tensor_parallel {}; ranks {}; widths {}; q {}; kv {} block {}",
                   Json(d.targets).dump(), d.tensor_parallel, Json(d.ranks).dump(), Json(d.widths).dump(), d.q(),
                   deploy::to_string(d.kv_cache.dtype), d.kv_cache.block_size));
  if (!d.allreduce_nccl.empty())  // format 1.8; in-kernel everywhere else (the default, not printed)
    line(fmt::format("          all-reduce by NCCL at widths {}, in-kernel at the others", Json(d.allreduce_nccl).dump()));
  line("");
  // Entries: what a host binds (an expert group is one); tensors: what the decode kernels read.
  line(fmt::format("{:<6} {:>8} {:>8} {:>12}  {}", "rank", "entries", "tensors", "bytes", "fingerprints"));
  for (const format::RankEntry& r : m.ranks) {
    const WeightCounts c = weight_counts(r);
    line(fmt::format("{:<6} {:>8} {:>8} {:>12}  {}", r.rank, c.entries, c.tensors, human(c.bytes),
                     m.weights_fingerprinted ? "yes" : "no (built without weights)"));
  }
  line("");
  std::map<std::string, size_t> per_target;
  for (const format::KernelEntry& k : m.kernels) per_target[k.target]++;
  std::string counts;
  for (const auto& [t, n] : per_target) counts += fmt::format("{}{} {}", counts.empty() ? "" : ", ", t, n);
  line(fmt::format("kernels   {} code objects ({})", m.kernels.size(), counts));
  // Layer programs: one row per class, one column per width ("9" launches, or "-" not built).
  std::map<std::string, std::map<int64_t, std::string>> programs;
  std::set<int64_t> widths;
  std::map<std::string, std::string> reasons;
  for (const format::ProgramEntry& p : m.programs) {
    widths.insert(p.width);
    programs[p.cls][p.width] = p.steps.empty() ? "-" : std::to_string(p.steps.size());
    if (p.steps.empty()) reasons[p.cls] = p.reason;
  }
  if (programs.empty()) {
    line(fmt::format("programs  none (format {}.{}{})", m.format_version.major, m.format_version.minor,
                     m.format_version.minor < 1 ? ": layer programs came with format 1.1" : ""));
  } else {
    std::string head = fmt::format("programs  {:<10}", "class");
    for (int64_t w : widths) head += fmt::format(" {:>3}", fmt::format("w{}", w));
    line(head + "   (launches per layer; - not built)");
    for (const auto& [cls, per] : programs) {
      std::string row = fmt::format("          {:<10}", cls);
      for (int64_t w : widths) row += fmt::format(" {:>3}", per.count(w) ? per.at(w) : std::string("?"));
      line(row);
    }
    for (const auto& [cls, why] : reasons) line(fmt::format("          {} not built: {}", cls, why));
  }
  uint32_t max_regs = 0, spills = 0;
  for (const format::KernelEntry& k : m.kernels) max_regs = std::max(max_regs, k.registers), spills += k.spill_bytes > 0;
  line(fmt::format("          max registers {}; kernels with spills {}", max_regs, spills));
  line("");
  std::map<std::string, std::pair<int, uint64_t>> pf;
  for (const format::PrefetchEntry& p : m.prefetch) {
    uint64_t bytes = 0;
    for (const auto& r : p.ranges) bytes += r.bytes;
    pf[p.point].first++, pf[p.point].second += bytes;
  }
  line(fmt::format("prefetch  {} tables", m.prefetch.size()));
  for (const auto& [point, v] : pf) line(fmt::format("          {:<16} {:>4} tables {:>12}", point, v.first, human(v.second)));
  std::string ws;
  for (const format::WorkspaceEntry& w : m.workspace) ws += fmt::format("{}w{}: {}", ws.empty() ? "" : ", ", w.width, human(w.bytes));
  line(fmt::format("workspace {}", ws));
  if (m.indexer.heads > 0)
    line(fmt::format("indexer   {} heads x {}, top-k {}; prefill chunk scratch {}", m.indexer.heads, m.indexer.head_dim,
                     m.indexer.top_k, human(m.indexer.prefill_workspace_bytes)));
  uint64_t total = b.manifest_bytes().size();
  std::map<std::string, uint64_t> per_dir;
  for (const format::FileEntry& f : m.files) {
    total += f.size;
    per_dir[f.path.substr(0, f.path.rfind('/'))] += f.size;
  }
  line(fmt::format("size      {} in {} files (manifest {})", human(total), m.files.size() + 1, human(b.manifest_bytes().size())));
  for (const auto& [dir, bytes] : per_dir) line(fmt::format("          {:<24} {:>12}", dir + "/", human(bytes)));
  return out;
}

}  // namespace

void add_inspect(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("inspect", "Show what a bundle holds (no GPU needed)");
  struct Opts {
    std::string bundle;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("bundle", o->bundle, "Bundle directory or .dpk file")->required();
  cmd->add_flag("--json", o->json, "Print {bundle, digest, archive, ranks, manifest} as JSON");
  cmd->callback([o, &action] {
    action = [o] {
      bundle::Bundle b = bundle::Bundle::open(o->bundle);
      if (o->json) {
        Json ranks = Json::array();
        for (const format::RankEntry& r : b.manifest().ranks) {
          const WeightCounts c = weight_counts(r);
          ranks.push_back({{"rank", r.rank}, {"weight_entries", c.entries}, {"decode_tensors", c.tensors},
                           {"decode_bytes", c.bytes}});
        }
        print_json({{"bundle", o->bundle}, {"digest", b.digest()}, {"archive", b.is_archive()}, {"ranks", ranks},
                    {"manifest", format::to_json(b.manifest())}});
      } else {
        std::fputs(text(b).c_str(), stdout);
      }
      return 0;
    };
  });
}

}  // namespace dp::tools
