#include "bundle/build.h"

#include <chrono>
#include <thread>

#include "backend/compile.h"
#include "bundle/archive.h"
#include "bundle/bundle.h"
#include "bundle/fingerprint.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/hash.h"
#include "common/output.h"
#include "common/progress.h"
#include "indexer/workspace.h"
#include "deploy/deploy.h"
#include "format/manifest.h"
#include "model/inventory.h"
#include "model/ir.h"
#include "model/safetensors.h"
#include "plan/plan.h"

namespace fs = std::filesystem;

namespace dp::bundle {
namespace {

std::string file_ext(const std::string& target) {
  const deploy::TargetInfo* t = deploy::find_target(target);
  return t && t->vendor == deploy::Vendor::hip ? ".hsaco" : ".cubin";
}

}  // namespace

format::ModelDetails manifest_details(const model::Model& m) {
  format::ModelDetails d;
  d.prefix = m.prefix;
  d.activation = model::to_string(m.activation);
  d.attn_res_block = m.attn_res_block;
  d.dense_intermediate = m.dense_intermediate;
  d.kda = {m.kda.num_heads, m.kda.head_dim, m.kda.conv_kernel, m.kda.gate_rank, m.kda.full_rank_gate,
           m.kda.gate_lower_bound};
  d.mla = {m.mla.num_heads,        m.mla.q_lora_rank,      m.mla.kv_lora_rank, m.mla.qk_nope_head_dim,
           m.mla.qk_rope_head_dim, m.mla.v_head_dim,       m.mla.output_gate};
  d.moe = {m.moe.num_experts,    m.moe.top_k,       m.moe.intermediate, m.moe.num_shared,
           m.moe.routed_scaling, m.moe.renormalize, m.moe.latent_dim,   model::to_string(m.moe.expert_format)};
  return d;
}

BuildResult build_bundle(const BuildOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  auto log = [&](const std::string& s) {
    if (o.log) o.log(s);
  };
  const unsigned jobs = o.jobs ? o.jobs : std::max(1u, std::thread::hardware_concurrency());
  if (o.out.empty()) fail(Errc::usage, "build: -o/--output is required");

  // The output is checked before any work, and again just before publishing (it may have changed
  // meanwhile): a build never writes over its inputs, nor over anything that is not a bundle.
  const bool archive = o.out.extension() == ".dpk";
  const OutputKind out_kind = archive ? OutputKind::file : OutputKind::directory;
  refuse_output_over_input(o.out, o.model, "input model");
  if (o.deploy != "default") refuse_output_over_input(o.out, o.deploy, "deploy config");
  const fs::path cache_dir = !o.use_cache ? fs::path() : !o.cache_dir.empty() ? o.cache_dir : backend::CompileCache::default_dir();
  for (const auto& [dir, flag] : {std::pair{cache_dir, "compile cache (--cache-dir)"},
                                  std::pair{o.emit_source, "--emit-source directory"}})
    if (!dir.empty() && paths_overlap(dir, o.out))
      fail(Errc::usage, "{}: the output and the {} {} overlap; publishing the bundle would replace one with the other: "
                        "choose separate paths", o.out.string(), flag, dir.string());
  plan_output(o.out, out_kind, o.force, "a bundle", bundle_own_files);
  for (const fs::path& stale : remove_stale_staging(o.out))
    log(fmt::format("removed {}, left by a build that was killed", stale.string()));

  model::Model m = model::load_model(o.model);
  deploy::Deploy d = deploy::load_deploy(o.deploy);
  plan::PlanOptions po;
  po.context = o.context;
  plan::Plan p = plan::make_plan(m, d, o.deploy, po);

  // Weights: inventory, then one fingerprint per shard (per expert for expert groups) per rank.
  std::error_code ec;
  const bool have_ckpt = o.weights && fs::is_directory(o.model, ec) && st::Checkpoint::present(o.model);
  std::optional<st::Checkpoint> ckpt;
  model::Inventory inv;
  if (have_ckpt) {
    ckpt.emplace(st::Checkpoint::open(o.model));
    inv = model::check_inventory(m, *ckpt);
    model::require_inventory(inv, o.model);
  }

  format::Manifest man;
  man.tool_version = DP_VERSION_STRING;
  man.model.model_type = m.model_type;
  man.model.architecture = m.architecture;
  man.model.config_digest = "sha256:" + m.config_digest;
  man.model.hidden_size = m.hidden;
  man.model.num_layers = m.num_layers;
  man.model.vocab_size = m.vocab;
  man.model.rms_norm_eps = m.rms_norm_eps;
  man.model.details = format::to_json(manifest_details(m));
  man.deploy = deploy::to_json(d);
  man.weights_fingerprinted = have_ckpt;
  for (const plan::LayerPlan& l : p.ranks.front().layers)
    man.layers.push_back({l.index, model::to_string(l.mixer), model::to_string(l.ffn), plan::to_string(l.cls)});

  // Rank weight tables (decode weights only: embeddings and the LM head stay with the host).
  std::vector<ShardRef> refs;
  std::vector<std::pair<size_t, size_t>> ref_slots;  // (rank index, weight entry index) per ref
  for (size_t ri = 0; ri < p.ranks.size(); ++ri) {
    const plan::RankPlan& rp = p.ranks[ri];
    format::RankEntry re;
    re.rank = rp.rank;
    for (const plan::WeightShard& s : rp.shards) {
      const model::WeightSpec& w = m.weights[s.weight];
      if (!w.decode) continue;
      format::WeightEntry we;
      we.name = s.name;
      we.dtype = std::string(dtype_name(w.dtype));
      we.shape = s.shape;
      we.split_dim = s.split_dim;
      we.begin = s.split_dim >= 0 ? s.begin : 0;
      we.end = s.split_dim >= 0 ? s.end : 0;
      we.experts = s.experts;
      we.layer = w.layer;
      if (have_ckpt) {
        const size_t n = s.experts > 0 ? static_cast<size_t>(s.experts) : 1;
        for (size_t e = 0; e < n; ++e) {
          // Expert e's tensor is the e-th per-expert copy of the IR entry (IR order: experts consecutive
          // per key, so locate by name).
          size_t wi = s.weight;
          if (s.experts > 0) {
            std::string name = s.name;
            name.replace(name.find("{e}"), 3, std::to_string(e));
            const model::WeightSpec* ws = m.find(name);
            wi = static_cast<size_t>(ws - m.weights.data());
          }
          refs.push_back({inv.resolved[wi], s.split_dim, s.begin, s.end, w.dtype});
          ref_slots.push_back({ri, re.weights.size()});
        }
      }
      re.weights.push_back(std::move(we));
    }
    man.ranks.push_back(std::move(re));
  }
  if (have_ckpt) {
    Progress bar(o.log ? stderr : nullptr, o.progress_tty, fmt::format("fingerprinting weight shards ({} threads)", jobs),
                 refs.size());
    std::vector<std::string> digests = fingerprint_all(*ckpt, refs, jobs, &bar);
    bar.finish();
    for (size_t i = 0; i < refs.size(); ++i)
      man.ranks[ref_slots[i].first].weights[ref_slots[i].second].sha256.push_back(digests[i]);
  }

  for (const plan::PrefetchTable& t : p.ranks.front().prefetch) {
    format::PrefetchEntry pe{t.point, t.layer, t.widths, t.critical, t.grid, {}};
    for (const plan::PrefetchRange& r : t.ranges) pe.ranges.push_back({r.name, r.bytes});
    man.prefetch.push_back(std::move(pe));
  }
  for (const plan::Workspace& w : p.ranks.front().workspace) man.workspace.push_back({w.width, w.bytes});
  if (m.indexer.present())
    man.indexer = {m.indexer.num_heads, m.indexer.head_dim, m.indexer.top_k, indexer::prefill_workspace_bytes(d)};
  size_t not_built = 0;
  for (const plan::LayerProgram& lp : p.programs) {
    format::ProgramEntry pe;
    pe.cls = plan::to_string(lp.cls);
    pe.width = lp.width;
    pe.reason = lp.unavailable;
    not_built += !lp.unavailable.empty();
    for (const plan::ProgramStep& s : lp.steps) {
      format::ProgramStepEntry se;
      if (s.collective.empty()) se.kernel = s.name;
      se.collective = s.collective;
      se.elements = s.elements;
      for (const plan::ProgramArg& a : s.args) se.args.push_back({a.param, plan::to_string(a.from), a.name, a.offset, a.value});
      pe.steps.push_back(std::move(se));
    }
    man.programs.push_back(std::move(pe));
  }
  man.format_version.minor = format::written_minor(man);

  // Kernels.
  std::vector<codegen::KernelInstance> instances;
  std::vector<const plan::KernelInstance*> planned;
  BuildResult res;
  res.planned_only = not_built;
  for (const plan::KernelInstance& k : p.kernels) {
    instances.push_back(k.codegen);
    planned.push_back(&k);
  }
  backend::CompileOptions co;
  co.jobs = jobs;
  co.cache_dir = o.cache_dir;
  co.use_cache = o.use_cache;
  co.toolchains = o.toolchains;
  if (o.log) co.progress = backend::progress_printer(stderr, o.progress_tty);
  log(fmt::format("compiling {} kernels for {} layer programs{}", instances.size(), p.programs.size() - not_built,
                  not_built ? fmt::format(" ({} planned programs are not built by this version: `decodepack plan` "
                                          "says why)", not_built)
                            : std::string()));
  backend::CompileReport report = backend::compile_all(instances, co);
  man.toolchains = Json::object();
  for (const auto& [vendor, version] : report.toolchains) man.toolchains[vendor] = version;
  man.templates_digest = report.templates_digest;

  StagingDir stage(o.out);
  for (size_t i = 0; i < report.kernels.size(); ++i) {
    const backend::CompiledKernel& ck = report.kernels[i];
    const plan::KernelInstance& pk = *planned[i];
    for (const std::string& n : ck.notes) log(fmt::format("note: {}: {}", ck.key, n));
    for (const std::string& w : ck.warnings) {  // each names its kernel key already
      log(fmt::format("warning: {}", w));
      res.warnings.push_back(w);
    }
    format::KernelEntry e;
    e.key = ck.key;
    e.name = ck.name;
    e.op = pk.op;
    e.role = pk.role;
    e.target = pk.target;
    e.width = pk.width;
    e.q = pk.width ? d.q() : 0;
    e.file = "kernels/" + pk.target + "/" + ck.key + file_ext(pk.target);
    e.sha256 = ck.sha256;
    e.param_bytes = ck.signature.bytes;
    for (const codegen::KernelParam& kp : ck.signature.params)
      e.params.push_back({kp.name,
                          kp.kind == codegen::KernelParam::Kind::pointer ? "pointer"
                          : kp.kind == codegen::KernelParam::Kind::u32   ? "u32"
                                                                         : "f32",
                          kp.offset, kp.size, kp.shape, kp.nullable});
    for (int a = 0; a < 3; ++a) e.grid[a] = ck.launch.grid[a], e.block[a] = ck.launch.block[a];
    e.shared_bytes = ck.usage.shared_bytes;
    e.dynamic_shared_bytes = ck.launch.dynamic_shared_bytes;
    e.registers = ck.usage.registers;
    e.stack_bytes = ck.usage.stack_bytes;
    e.spill_bytes = ck.usage.spill_bytes;
    fs::create_directories(stage.path() / fs::path(e.file).parent_path());
    write_file_atomic(stage.path() / e.file,
                      std::string_view(reinterpret_cast<const char*>(ck.code_object.data()), ck.code_object.size()));
    man.files.push_back({e.file, ck.code_object.size(), ck.sha256});
    man.kernels.push_back(std::move(e));
    if (!o.emit_source.empty()) {
      fs::create_directories(o.emit_source);
      write_file_atomic(o.emit_source / (ck.key + ".cu"), ck.source);
    }
  }
  std::sort(man.kernels.begin(), man.kernels.end(),
            [](const format::KernelEntry& a, const format::KernelEntry& b) { return a.key < b.key; });
  std::sort(man.files.begin(), man.files.end(),
            [](const format::FileEntry& a, const format::FileEntry& b) { return a.path < b.path; });
  man.format_version.minor = format::written_minor(man);  // again: the kernels can raise it (attnres 1.7, dynamic shared memory 1.9)
  try {
    format::validate(man, "manifest");
  } catch (const format::FormatError& e) {
    fail(Errc::internal, "build produced an invalid manifest: {}", e.what());
  }
  const std::string bytes = format::canonical_bytes(man);
  write_file_atomic(stage.path() / format::kManifestFile, bytes);

  const OutputPlan publish = plan_output(o.out, out_kind, o.force, "a bundle", bundle_own_files);
  if (archive) {
    write_archive(stage.path(), o.out);  // staged under a temporary name and renamed by write_archive
  } else if (publish.action == OutputPlan::Action::write_into) {
    stage.commit_into(publish.previous, {format::kManifestFile});
    std::string others;
    for (size_t i = 0; i < publish.others.size() && i < 5; ++i) others += (i ? ", " : "") + publish.others[i];
    log(fmt::format("warning: {} also holds entries that are not part of the bundle ({}{}), kept as --force asks; "
                    "`decodepack verify` and the runtime refuse a bundle directory with files its manifest does not "
                    "list", o.out.string(), others, publish.others.size() > 5 ? ", ..." : ""));
  } else {
    stage.commit();
  }
  res.out = o.out;
  res.digest = "sha256:" + sha256_hex(bytes);
  res.kernels = man.kernels.size();
  res.fingerprinted = have_ckpt;
  res.fingerprints = refs.size();
  res.cache = report.cache;
  res.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return res;
}

}  // namespace dp::bundle
