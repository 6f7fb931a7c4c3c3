#include "backend/compile.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include "common/error.h"
#include "common/hash.h"
#include "common/progress.h"

namespace dp::backend {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Compiler warnings worth surfacing: clang's "warning:" diagnostics and NVRTC's. ptxas -v "info"
// lines are not warnings.
void collect_compiler_warnings(const std::string& key, const std::string& log, std::vector<std::string>* out) {
  size_t pos = 0;
  while (pos < log.size()) {
    size_t end = log.find('\n', pos);
    if (end == std::string::npos) end = log.size();
    std::string_view line(log.data() + pos, end - pos);
    if (line.find("warning") != std::string_view::npos) out->push_back(fmt::format("{}: {}", key, line));
    pos = end + 1;
  }
}

struct Shared {
  const codegen::TemplateSet* templates;
  CompileCache* cache;  // null when caching is off
  bool emit_ptx;
};

CompiledKernel build_one(const codegen::KernelInstance& inst, const DeviceToolchain& tc, const Shared& sh) {
  const auto t0 = Clock::now();
  const TargetInfo& target = target_info(inst.target);
  CompiledKernel k;
  k.instance = inst;
  k.name = codegen::kernel_name(inst);
  k.key = codegen::instance_key(inst);
  k.file_name = k.key + std::string(target.file_ext);
  k.source = codegen::generate_source(inst);
  k.signature = codegen::kernel_signature(inst);
  k.launch = codegen::launch_shape(inst);
  k.toolchain = tc.version();

  CompileJob job;
  job.stem = k.key;
  job.source = k.source;
  job.headers = sh.templates->files();
  job.target = &target;
  job.want_ptx = sh.emit_ptx && target.vendor == Vendor::nvidia;

  const std::string ckey = compile_cache_key(k.source, job.headers, tc.flags(target, job.want_ptx),
                                             std::string(target.name), tc.version(), job.stem);
  std::optional<CacheEntry> hit = sh.cache ? sh.cache->get(ckey) : std::nullopt;
  if (hit) {
    // An entry with a valid checksum can still hold another kernel's code object (an entry copied or
    // edited by hand, a cache shared with a broken build): it is checked as a compile result would be,
    // and one that does not hold this kernel is compiled again and overwritten.
    try {
      k.usage = require_kernel(inspect_code_object(hit->code_object, inst.target, k.file_name), k.name, k.file_name,
                               k.signature.bytes);
      k.cache_hit = true;
      k.code_object = std::move(hit->code_object);
      k.log = std::move(hit->log);
      k.ptx = std::move(hit->ptx);
    } catch (const Error& e) {
      sh.cache->mark_unusable();
      k.notes.push_back(fmt::format("compile cache entry {} does not hold this kernel ({}); compiled it again",
                                    sh.cache->entry_path(ckey).string(), e.what()));
      hit.reset();
    }
  }
  if (!hit) {
    CompileOutput out = tc.compile(job);
    k.code_object = std::move(out.code_object);
    k.log = std::move(out.log);
    k.ptx = std::move(out.ptx);
    // The entry point must be in the code object with the parameter size the host will pack. A
    // mismatch means compiler/codegen and templates/ disagree: a decodepack bug, not a user error.
    const auto kernels = inspect_code_object(k.code_object, inst.target, k.file_name);
    try {
      k.usage = require_kernel(kernels, k.name, k.file_name, k.signature.bytes);
    } catch (const Error& e) {
      fail(Errc::internal, "{} (the signature in compiler/codegen and the template in templates/ disagree)", e.what());
    }
    if (sh.cache) sh.cache->put(ckey, {k.code_object, k.log, k.ptx});
  }
  k.sha256 = sha256_hex(std::span<const uint8_t>(k.code_object));
  if (target.vendor == Vendor::nvidia) {
    auto usage = parse_ptxas_log(k.log);
    if (auto it = usage.find(k.name); it != usage.end()) {
      k.usage.spill_bytes = it->second.spill_store_bytes;
      if (k.usage.registers == 0) k.usage.registers = it->second.registers;
    }
  }
  if (k.usage.spill_bytes > 0)
    k.warnings.push_back(fmt::format("{}: spills {} bytes per thread to local memory ({} registers); expect it to be "
                                     "slower than its register budget suggests",
                                     k.key, k.usage.spill_bytes, k.usage.registers));
  collect_compiler_warnings(k.key, k.log, &k.warnings);
  k.seconds = seconds_since(t0);
  return k;
}

}  // namespace

CompileReport compile_all(const std::vector<codegen::KernelInstance>& instances, const CompileOptions& options) {
  const auto t0 = Clock::now();
  CompileReport report;

  // 1. Everything that can be refused is refused before any compile starts.
  std::vector<std::string> keys(instances.size());
  std::vector<size_t> distinct;          // index of the first instance with each key
  std::vector<size_t> slot(instances.size());
  std::map<std::string, size_t> slot_of_key;
  bool need_nvidia = false, need_amd = false;
  for (size_t i = 0; i < instances.size(); ++i) {
    const std::string where = fmt::format("kernel instance #{}", i);
    codegen::validate_instance(instances[i], where);
    keys[i] = codegen::instance_key(instances[i]);
    const TargetInfo& t = target_info(instances[i].target, keys[i]);
    (t.vendor == Vendor::nvidia ? need_nvidia : need_amd) = true;
    auto [it, fresh] = slot_of_key.emplace(keys[i], distinct.size());
    if (fresh) distinct.push_back(i);
    slot[i] = it->second;
  }
  std::unique_ptr<DeviceToolchain> nvidia, amd;
  if (need_nvidia) nvidia = make_cuda_toolchain(options.toolchains);
  if (need_amd) amd = make_hip_toolchain(options.toolchains);
  if (nvidia) report.toolchains["nvidia"] = nvidia->version();
  if (amd) report.toolchains["amd"] = amd->version();
  std::map<std::string, bool> checked;
  for (size_t i : distinct) {
    const TargetInfo& t = target_info(instances[i].target);
    if (checked.emplace(std::string(t.name), true).second) (t.vendor == Vendor::nvidia ? *nvidia : *amd).check_target(t);
  }

  const codegen::TemplateSet templates = codegen::TemplateSet::load(
      options.templates_dir.empty() ? codegen::TemplateSet::default_dir() : options.templates_dir);
  report.templates_digest = templates.digest();
  for (size_t i : distinct) {
    const std::string header = codegen::op_header(instances[i]);
    if (!templates.find(header))
      fail(Errc::toolchain, "{}: {} has no {} (needed by op {}); is it the templates/ of this decodepack version?",
           keys[i], templates.dir().string(), header, instances[i].op);
  }

  std::optional<CompileCache> cache;
  if (options.use_cache)
    cache.emplace(options.cache_dir.empty() ? CompileCache::default_dir() : options.cache_dir);
  const Shared shared{&templates, cache ? &*cache : nullptr, options.emit_ptx};

  // 2. Compile on a pool. Workers take distinct instances in input order; after a failure no new
  // ones start, and the error reported is the failing instance that comes first in the input.
  std::vector<CompiledKernel> built(distinct.size());
  std::vector<std::exception_ptr> errors(distinct.size());
  std::atomic<size_t> next{0};
  std::atomic<bool> stop{false};
  std::mutex progress_mu;
  size_t finished = 0;
  auto worker = [&] {
    for (;;) {
      if (stop.load()) return;
      const size_t u = next.fetch_add(1);
      if (u >= distinct.size()) return;
      const codegen::KernelInstance& inst = instances[distinct[u]];
      try {
        const DeviceToolchain& tc = target_info(inst.target).vendor == Vendor::nvidia ? *nvidia : *amd;
        built[u] = build_one(inst, tc, shared);
      } catch (...) {
        errors[u] = std::current_exception();
        stop.store(true);
        continue;
      }
      std::lock_guard<std::mutex> lock(progress_mu);
      ++finished;
      if (options.progress)
        options.progress({finished, distinct.size(), built[u].key, built[u].cache_hit, built[u].seconds});
    }
  };
  unsigned jobs = options.jobs ? options.jobs : std::max(1u, std::thread::hardware_concurrency());
  jobs = static_cast<unsigned>(std::min<size_t>(jobs, std::max<size_t>(1, distinct.size())));
  std::vector<std::thread> pool;
  for (unsigned j = 1; j < jobs; ++j) pool.emplace_back(worker);
  worker();  // the calling thread is worker 0
  for (std::thread& t : pool) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);

  report.kernels.reserve(instances.size());
  for (size_t i = 0; i < instances.size(); ++i) report.kernels.push_back(built[slot[i]]);
  if (cache) report.cache = cache->stats();
  report.seconds = seconds_since(t0);
  return report;
}

std::function<void(const CompileProgress&)> progress_printer(std::FILE* out, bool tty) {
  // The reporter starts with the first report, which brings the total.
  auto bar = std::make_shared<std::unique_ptr<Progress>>();
  auto hits = std::make_shared<size_t>(0);
  return [out, tty, bar, hits](const CompileProgress& p) {
    if (!*bar) *bar = std::make_unique<Progress>(out, tty, "compiling kernels", p.total);
    *hits += p.cache_hit;
    (*bar)->update(p.done, p.cache_hit ? p.key + " (cache hit)" : fmt::format("{} ({:.2f} s)", p.key, p.seconds));
    if (p.done == p.total) (*bar)->finish(fmt::format("{} from the cache", *hits));
  };
}

}  // namespace dp::backend
