// NVIDIA backend: NVRTC loaded at run time (dlopen), nvcc as a subprocess where NVRTC is missing.
//
// NVRTC is preferred: no temporary files, no host compiler, no process start per kernel, and the
// headers are handed over in memory under their bare names, so nothing of the build machine's file
// system reaches the cubin. decodepack does not link libnvrtc: a build without the CUDA toolkit
// still runs (AMD-only bundles) and says what is missing only when an sm_XX target is asked for.
#include <dlfcn.h>

#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <sstream>

#include "backend/subprocess.h"
#include "backend/toolchain.h"
#include "common/crash_note.h"
#include "common/error.h"
#include "common/fs.h"

namespace fs = std::filesystem;

namespace dp::backend {
namespace {

// The slice of nvrtc.h we call, declared here so that building decodepack needs no CUDA headers.
// These signatures are NVRTC's stable C API (unchanged since CUDA 11.1).
using nvrtcResult = int;
using nvrtcProgram = struct _nvrtcProgram*;
constexpr nvrtcResult NVRTC_SUCCESS = 0;

struct NvrtcApi {
  const char* (*GetErrorString)(nvrtcResult);
  nvrtcResult (*Version)(int*, int*);
  nvrtcResult (*GetNumSupportedArchs)(int*);
  nvrtcResult (*GetSupportedArchs)(int*);
  nvrtcResult (*CreateProgram)(nvrtcProgram*, const char*, const char*, int, const char* const*, const char* const*);
  nvrtcResult (*DestroyProgram)(nvrtcProgram*);
  nvrtcResult (*CompileProgram)(nvrtcProgram, int, const char* const*);
  nvrtcResult (*GetPTXSize)(nvrtcProgram, size_t*);
  nvrtcResult (*GetPTX)(nvrtcProgram, char*);
  nvrtcResult (*GetCUBINSize)(nvrtcProgram, size_t*);
  nvrtcResult (*GetCUBIN)(nvrtcProgram, char*);
  nvrtcResult (*GetProgramLogSize)(nvrtcProgram, size_t*);
  nvrtcResult (*GetProgramLog)(nvrtcProgram, char*);
};

fs::path resolve_cuda_root(const ToolchainOptions& o) {
  if (!o.cuda_root.empty()) return o.cuda_root;
  for (const char* var : {"DECODEPACK_CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"})
    if (const char* v = std::getenv(var); v && *v) return v;
  if (fs::path built = built_cuda_root(); !built.empty()) return built;
  return "/usr/local/cuda";
}

// ptxas -v prints "Compile time = 12.3 ms" per kernel; dropping those lines keeps the log (which
// the cache stores and a bundle may carry) a function of the inputs only.
std::string strip_timing_lines(std::string_view log) {
  std::string out;
  size_t pos = 0;
  while (pos < log.size()) {
    size_t end = log.find('\n', pos);
    if (end == std::string_view::npos) end = log.size();
    std::string_view line = log.substr(pos, end - pos);
    if (line.find("Compile time =") == std::string_view::npos) {
      out.append(line);
      if (end < log.size()) out.push_back('\n');
    }
    pos = end + 1;
  }
  return out;
}

std::string ptx_arch(const TargetInfo& t) { return "compute_" + std::to_string(t.sm); }

std::string ptxas_flag_help() { return "--cuda-root DIR or DECODEPACK_CUDA_ROOT=DIR"; }

// ---------------------------------------------------------------------------------------------------
class NvrtcToolchain final : public DeviceToolchain {
 public:
  NvrtcToolchain(void* lib, const fs::path& lib_path) : lib_path_(lib_path) {
    auto sym = [&](const char* name) {
      void* p = ::dlsym(lib, name);
      if (!p)
        fail(Errc::toolchain, "{}: NVRTC library lacks {} (CUDA >= 11.2 needed; point {} at a newer toolkit)",
             lib_path.string(), name, ptxas_flag_help());
      return p;
    };
#define DP_NVRTC_SYM(field, name) api_.field = reinterpret_cast<decltype(api_.field)>(sym(name))
    DP_NVRTC_SYM(GetErrorString, "nvrtcGetErrorString");
    DP_NVRTC_SYM(Version, "nvrtcVersion");
    DP_NVRTC_SYM(GetNumSupportedArchs, "nvrtcGetNumSupportedArchs");
    DP_NVRTC_SYM(GetSupportedArchs, "nvrtcGetSupportedArchs");
    DP_NVRTC_SYM(CreateProgram, "nvrtcCreateProgram");
    DP_NVRTC_SYM(DestroyProgram, "nvrtcDestroyProgram");
    DP_NVRTC_SYM(CompileProgram, "nvrtcCompileProgram");
    DP_NVRTC_SYM(GetPTXSize, "nvrtcGetPTXSize");
    DP_NVRTC_SYM(GetPTX, "nvrtcGetPTX");
    DP_NVRTC_SYM(GetCUBINSize, "nvrtcGetCUBINSize");
    DP_NVRTC_SYM(GetCUBIN, "nvrtcGetCUBIN");
    DP_NVRTC_SYM(GetProgramLogSize, "nvrtcGetProgramLogSize");
    DP_NVRTC_SYM(GetProgramLog, "nvrtcGetProgramLog");
#undef DP_NVRTC_SYM
    int major = 0, minor = 0;
    check(api_.Version(&major, &minor), "nvrtcVersion", lib_path.string());
    // NVRTC reports major.minor only; the library's file name and size tell patch releases apart
    // (different code generators must not share compile-cache entries).
    fs::path real = lib_path;
    std::error_code ec;
    if (fs::path c = fs::canonical(lib_path, ec); !ec) real = c;
    const auto size = fs::file_size(real, ec);
    version_ = fmt::format("nvrtc {}.{} ({}, {} bytes)", major, minor, real.filename().string(), ec ? 0 : size);
    nvrtc_version_ = fmt::format("{}.{}", major, minor);
    int n = 0;
    check(api_.GetNumSupportedArchs(&n), "nvrtcGetNumSupportedArchs", lib_path.string());
    archs_.resize(static_cast<size_t>(n));
    if (n > 0) check(api_.GetSupportedArchs(archs_.data()), "nvrtcGetSupportedArchs", lib_path.string());
  }

  Vendor vendor() const override { return Vendor::nvidia; }
  const std::string& version() const override { return version_; }
  std::string location() const override { return lib_path_.string(); }

  void check_target(const TargetInfo& t) const override {
    for (int a : archs_)
      if (a == t.sm) return;
    std::string list;
    for (int a : archs_) list += fmt::format("{}sm_{}", list.empty() ? "" : ", ", a);
    fail(Errc::toolchain,
         "target {}: NVRTC {} cannot compile for sm_{} (it supports {}); install a CUDA toolkit that does and "
         "select it with {}",
         t.name, nvrtc_version_, t.sm, list, ptxas_flag_help());
  }

  std::vector<std::string> flags(const TargetInfo& t, bool want_ptx) const override {
    std::vector<std::string> f = {
        "--gpu-architecture=" + std::string(t.name),
        "-std=c++17",
        // Usage report per kernel (registers, shared memory, stack, spills) into the program log.
        "--ptxas-options=-v",
        // Never look next to the (non-existent) source file for headers: only the in-memory ones.
        "--no-source-include",
    };
    if (want_ptx) f.push_back("ptx:--gpu-architecture=" + ptx_arch(t));
    return f;
  }

  CompileOutput compile(const CompileJob& job) const override {
    CompileOutput out;
    std::vector<std::string> f = flags(*job.target, false);
    run(job, f, &out.code_object, nullptr, &out.log);
    if (job.want_ptx) {
      std::string ptx_log;
      run(job, {"--gpu-architecture=" + ptx_arch(*job.target), "-std=c++17", "--no-source-include"}, nullptr,
          &out.ptx, &ptx_log);
    }
    return out;
  }

 private:
  void check(nvrtcResult r, const char* call, const std::string& what) const {
    if (r != NVRTC_SUCCESS) fail(Errc::toolchain, "{}: {} failed: {}", what, call, api_.GetErrorString(r));
  }

  void run(const CompileJob& job, const std::vector<std::string>& opts, std::vector<uint8_t>* cubin,
           std::string* ptx, std::string* log) const {
    std::vector<const char*> hdr_text, hdr_name;
    for (const codegen::TemplateFile& h : job.headers) {
      hdr_text.push_back(h.text.c_str());
      hdr_name.push_back(h.name.c_str());
    }
    const std::string src_name = job.stem + ".cu";
    nvrtcProgram prog = nullptr;
    check(api_.CreateProgram(&prog, job.source.c_str(), src_name.c_str(), static_cast<int>(hdr_text.size()),
                             hdr_text.data(), hdr_name.data()),
          "nvrtcCreateProgram", job.stem);
    struct Guard {
      const NvrtcApi& api;
      nvrtcProgram& p;
      ~Guard() { api.DestroyProgram(&p); }
    } guard{api_, prog};

    std::vector<const char*> argv;
    for (const std::string& o : opts) argv.push_back(o.c_str());
    nvrtcResult rc;
    {
      // NVRTC runs in this process: if it crashes on this source (a compiler bug), say which kernel.
      const CrashNote note(fmt::format("NVRTC {} crashed compiling kernel {}: a compiler bug on this source; "
                                       "nothing was written to the output",
                                       nvrtc_version_, job.stem),
                           static_cast<int>(Errc::toolchain));
      // Fault injection for tests/cli/compiler_crash.py: the compile of the kernel named here crashes.
      if (const char* k = std::getenv("DECODEPACK_TEST_NVRTC_CRASH"); k && job.stem == k) std::raise(SIGSEGV);
      rc = api_.CompileProgram(prog, static_cast<int>(argv.size()), argv.data());
    }
    size_t n = 0;
    std::string raw_log;
    if (api_.GetProgramLogSize(prog, &n) == NVRTC_SUCCESS && n > 1) {
      raw_log.resize(n);
      api_.GetProgramLog(prog, raw_log.data());
      raw_log.resize(std::strlen(raw_log.c_str()));
    }
    *log = strip_timing_lines(raw_log);
    if (rc != NVRTC_SUCCESS)
      fail(Errc::toolchain, "{}: NVRTC ({}) failed to compile for {}: {}\n{}", job.stem, version_,
           job.target->name, api_.GetErrorString(rc), *log);
    if (cubin) {
      check(api_.GetCUBINSize(prog, &n), "nvrtcGetCUBINSize", job.stem);
      cubin->resize(n);
      check(api_.GetCUBIN(prog, reinterpret_cast<char*>(cubin->data())), "nvrtcGetCUBIN", job.stem);
    }
    if (ptx) {
      check(api_.GetPTXSize(prog, &n), "nvrtcGetPTXSize", job.stem);
      ptx->resize(n);
      check(api_.GetPTX(prog, ptx->data()), "nvrtcGetPTX", job.stem);
      ptx->resize(std::strlen(ptx->c_str()));
    }
  }

  fs::path lib_path_;
  NvrtcApi api_{};
  std::string version_;
  std::string nvrtc_version_;
  std::vector<int> archs_;
};

// ---------------------------------------------------------------------------------------------------
// nvcc needs files: the source and headers go into a private temporary directory and nvcc runs
// there with relative names only, so its path never reaches the output either.
class NvccToolchain final : public DeviceToolchain {
 public:
  explicit NvccToolchain(fs::path nvcc) : nvcc_(std::move(nvcc)) {
    ProcessResult r = run_process({nvcc_.string(), "--version"});
    if (!r.ok()) fail(Errc::toolchain, "{} --version: {}\n{}", nvcc_.string(), r.describe(), r.err);
    // "Cuda compilation tools, release 13.0, V13.0.88" and "Build cuda_13.0.r13.0/compiler.36424714_0"
    std::string release, build;
    std::istringstream in(r.out);
    for (std::string line; std::getline(in, line);) {
      if (line.rfind("Cuda compilation tools", 0) == 0) release = line;
      if (line.rfind("Build ", 0) == 0) build = line.substr(6);
    }
    if (release.empty()) fail(Errc::toolchain, "{} --version: unrecognised output:\n{}", nvcc_.string(), r.out);
    version_ = "nvcc " + release.substr(release.rfind(' ') + 1) + (build.empty() ? "" : " (" + build + ")");
    ProcessResult archs = run_process({nvcc_.string(), "--list-gpu-code"});
    if (archs.ok()) archs_ = archs.out;
  }

  Vendor vendor() const override { return Vendor::nvidia; }
  const std::string& version() const override { return version_; }
  std::string location() const override { return nvcc_.string(); }

  void check_target(const TargetInfo& t) const override {
    if (archs_.empty() || archs_.find("sm_" + std::to_string(t.sm) + "\n") != std::string::npos ||
        archs_.find(std::string(t.name) + "\n") != std::string::npos)
      return;
    fail(Errc::toolchain, "target {}: {} ({}) cannot compile for it; install a CUDA toolkit that does and select it "
         "with {}", t.name, nvcc_.string(), version_, ptxas_flag_help());
  }

  std::vector<std::string> flags(const TargetInfo& t, bool want_ptx) const override {
    std::string arch = ptx_arch(t) + (t.name.back() == 'a' ? "a" : "");
    std::vector<std::string> f = {"-cubin", "-gencode", "arch=" + arch + ",code=" + std::string(t.name),
                                  "-std=c++17", "-Xptxas", "-v", "-I."};
    if (want_ptx) f.push_back("ptx:-ptx -arch=" + ptx_arch(t));
    return f;
  }

  CompileOutput compile(const CompileJob& job) const override {
    TempDir dir("decodepack-nvcc");
    for (const codegen::TemplateFile& h : job.headers) write_file_atomic(dir.path() / h.name, h.text);
    const std::string src = job.stem + ".cu";
    write_file_atomic(dir.path() / src, job.source);
    CompileOutput out;
    std::vector<std::string> argv = {nvcc_.string()};
    for (const std::string& f : flags(*job.target, false)) argv.push_back(f);
    argv.insert(argv.end(), {"-o", "out.cubin", src});
    ProcessResult r = run_process(argv, dir.path());
    out.log = strip_timing_lines(r.out + r.err);
    if (!r.ok())
      fail(Errc::toolchain, "{}: {} failed to compile for {} ({}):\n{}", job.stem, version_, job.target->name,
           r.describe(), out.log);
    MappedFile cubin(dir.path() / "out.cubin");
    out.code_object.assign(cubin.data(), cubin.data() + cubin.size());
    if (job.want_ptx) {
      ProcessResult p = run_process({nvcc_.string(), "-ptx", "-arch=" + ptx_arch(*job.target), "-std=c++17", "-I.",
                                     "-o", "out.ptx", src},
                                    dir.path());
      if (!p.ok())
        fail(Errc::toolchain, "{}: {} failed to emit PTX ({}):\n{}", job.stem, version_, p.describe(), p.err);
      out.ptx = read_text_file(dir.path() / "out.ptx");
    }
    return out;
  }

 private:
  fs::path nvcc_;
  std::string version_;
  std::string archs_;
};

}  // namespace

// NVRTC loads its companion libnvrtc-builtins.so.<major>.<minor> by soname when it compiles, through
// the dynamic loader's search path. A toolkit outside that path (no ld.so.conf entry, no
// LD_LIBRARY_PATH: a fresh machine with CUDA in /usr/local/cuda) then fails with
// NVRTC_ERROR_BUILTIN_OPERATION_FAILURE. Loading the builtins from NVRTC's own directory first makes
// NVRTC's later dlopen of the soname find the library already loaded.
static void preload_nvrtc_builtins(const fs::path& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("libnvrtc-builtins.so.", 0) == 0 && name.find("alt") == std::string::npos)
      ::dlopen(e.path().c_str(), RTLD_NOW | RTLD_GLOBAL);  // never closed, like NVRTC itself
  }
}

std::unique_ptr<DeviceToolchain> make_cuda_toolchain(const ToolchainOptions& o) {
  const fs::path root = resolve_cuda_root(o);
  std::vector<std::string> tried;
  if (o.allow_nvrtc) {
    // The toolkit's own copy first (matches its nvcc and headers), then whatever the dynamic
    // loader finds (a pip/conda NVRTC on LD_LIBRARY_PATH). Versioned sonames cover runtime-only
    // installs that ship no unversioned development symlink.
    std::vector<std::string> candidates;
    for (const char* sub : {"lib64", "lib"})
      for (const char* so : {"libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"})
        candidates.push_back((root / sub / so).string());
    for (const char* so : {"libnvrtc.so", "libnvrtc.so.13", "libnvrtc.so.12"}) candidates.emplace_back(so);
    for (const std::string& c : candidates) {
      if (c.find('/') != std::string::npos && !fs::exists(c)) continue;
      // The handle is never closed: NVRTC keeps internal state for the life of the process.
      if (void* lib = ::dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL)) {
        fs::path where = c;
        if (c.find('/') == std::string::npos) {
          Dl_info info{};
          if (void* f = ::dlsym(lib, "nvrtcVersion"); f && ::dladdr(f, &info) && info.dli_fname)
            where = info.dli_fname;
        }
        preload_nvrtc_builtins(fs::path(where).parent_path());
        return std::make_unique<NvrtcToolchain>(lib, where);
      }
      tried.push_back(fmt::format("{} ({})", c, ::dlerror()));
    }
  }
  const fs::path nvcc = root / "bin" / "nvcc";
  if (fs::exists(nvcc)) return std::make_unique<NvccToolchain>(nvcc);
  tried.push_back(nvcc.string() + " (not found)");
  std::string list;
  for (const std::string& t : tried) list += "\n  " + t;
  fail(Errc::toolchain,
       "no CUDA compiler for sm_XX targets: neither NVRTC (libnvrtc.so) nor nvcc could be found. Tried:{}\n"
       "Install the CUDA toolkit (NVRTC is in cuda-nvrtc) and select it with {}",
       list, ptxas_flag_help());
}

std::map<std::string, PtxasUsage> parse_ptxas_log(std::string_view log) {
  // Lines of interest (NVRTC prefixes continuation lines with "ptxas         ."):
  //   ptxas info    : Compiling entry function 'K' for 'sm_90a'
  //   ptxas info    : Function properties for K
  //       0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
  //   ptxas info    : Used 34 registers, used 1 barriers, 24 bytes smem
  // "Function properties" also appears for non-entry device functions; their numbers are not
  // recorded (they are part of the calling kernel's).
  std::map<std::string, PtxasUsage> out;
  std::string entry, props;
  auto number_before = [](std::string_view line, std::string_view what, uint32_t* v) {
    size_t at = line.find(what);
    if (at == std::string_view::npos) return;
    size_t end = at;
    while (end > 0 && line[end - 1] == ' ') --end;
    size_t start = end;
    while (start > 0 && line[start - 1] >= '0' && line[start - 1] <= '9') --start;
    if (start < end) *v = static_cast<uint32_t>(std::strtoul(std::string(line.substr(start, end - start)).c_str(), nullptr, 10));
  };
  size_t pos = 0;
  while (pos < log.size()) {
    size_t end = log.find('\n', pos);
    if (end == std::string_view::npos) end = log.size();
    std::string_view line = log.substr(pos, end - pos);
    pos = end + 1;
    if (size_t at = line.find("Compiling entry function '"); at != std::string_view::npos) {
      size_t s = at + std::strlen("Compiling entry function '");
      entry = std::string(line.substr(s, line.find('\'', s) - s));
      out[entry];
      continue;
    }
    if (size_t at = line.find("Function properties for "); at != std::string_view::npos) {
      props = std::string(line.substr(at + std::strlen("Function properties for ")));
      while (!props.empty() && (props.back() == ' ' || props.back() == '\r')) props.pop_back();
      continue;
    }
    if (line.find("bytes stack frame") != std::string_view::npos) {
      auto it = out.find(props);
      if (it != out.end()) {
        number_before(line, "bytes stack frame", &it->second.stack_bytes);
        number_before(line, "bytes spill stores", &it->second.spill_store_bytes);
        number_before(line, "bytes spill loads", &it->second.spill_load_bytes);
      }
      continue;
    }
    if (line.find("Used ") != std::string_view::npos && line.find(" registers") != std::string_view::npos &&
        !entry.empty()) {
      PtxasUsage& u = out[entry];
      number_before(line, "registers", &u.registers);
      number_before(line, "bytes smem", &u.shared_bytes);
    }
  }
  return out;
}

}  // namespace dp::backend
