// AMD backend: clang (HIP mode, device only) as a subprocess, with no ROCm installation.
//
// -nogpuinc/-nogpulib: no HIP headers and no device bitcode libraries, so the only inputs are the
// generated source and templates/ (vendor.h supplies what the HIP headers would). The result is a
// linked AMDGPU code object (ELF shared object, what hipModuleLoadData takes), not an offload bundle.
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>

#include "backend/subprocess.h"
#include "backend/toolchain.h"
#include "common/error.h"
#include "common/fs.h"

namespace fs = std::filesystem;

namespace dp::backend {
namespace {

constexpr const char* kSelectHelp = "--hip-clang PATH or DECODEPACK_HIP_CLANG=PATH";

fs::path resolve_clang(const ToolchainOptions& o, std::vector<std::string>* tried) {
  auto usable = [&](const fs::path& p, const char* from) {
    std::error_code ec;
    if (fs::is_regular_file(p, ec) && ::access(p.c_str(), X_OK) == 0) return true;
    tried->push_back(fmt::format("{} ({}: not an executable file)", p.string(), from));
    return false;
  };
  if (!o.hip_clang.empty()) {
    // An explicit choice that does not work is an error, never silently replaced by another clang.
    if (usable(o.hip_clang, "--hip-clang")) return o.hip_clang;
    return {};
  }
  if (const char* env = std::getenv("DECODEPACK_HIP_CLANG"); env && *env) {
    if (usable(env, "DECODEPACK_HIP_CLANG")) return env;
    return {};
  }
  if (fs::path built = built_hip_clang(); !built.empty() && usable(built, "found at build time")) return built;
  if (const char* path = std::getenv("PATH")) {
    for (const char* name : {"clang++-19", "clang++"}) {
      std::istringstream dirs(path);
      for (std::string dir; std::getline(dirs, dir, ':');) {
        fs::path p = fs::path(dir.empty() ? "." : dir) / name;
        std::error_code ec;
        if (fs::is_regular_file(p, ec) && ::access(p.c_str(), X_OK) == 0) return p;
      }
      tried->push_back(fmt::format("{} (not in PATH)", name));
    }
  }
  return {};
}

class ClangHipToolchain final : public DeviceToolchain {
 public:
  explicit ClangHipToolchain(fs::path clang) : clang_(std::move(clang)) {
    ProcessResult r = run_process({clang_.string(), "--version"});
    if (!r.ok()) fail(Errc::toolchain, "{} --version: {}\n{}", clang_.string(), r.describe(), r.err);
    version_ = r.out.substr(0, r.out.find('\n'));
    // "Debian clang version 19.1.7 (3~deb12u1)", "clang version 20.0.0git (...)", "AMD clang version 18.0.0..."
    size_t at = version_.find("clang version ");
    if (at != std::string::npos) llvm_major_ = std::atoi(version_.c_str() + at + std::strlen("clang version "));
    if (llvm_major_ <= 0)
      fail(Errc::toolchain, "{}: not a clang (its --version says \"{}\"); select clang with {}", clang_.string(),
           version_, kSelectHelp);
  }

  Vendor vendor() const override { return Vendor::amd; }
  const std::string& version() const override { return version_; }
  std::string location() const override { return clang_.string(); }

  void check_target(const TargetInfo& t) const override {
    if (t.min_llvm_major > llvm_major_)
      fail(Errc::toolchain,
           "target {} needs LLVM >= {} (its AMDGPU backend first knows {} in LLVM {}), but the HIP compiler {} is "
           "LLVM {} (\"{}\"); install clang-{} or newer and select it with {}",
           t.name, t.min_llvm_major, t.name, t.min_llvm_major, clang_.string(), llvm_major_, version_,
           t.min_llvm_major, kSelectHelp);
    // The table says the version is new enough; ask the compiler itself too (a vendor clang can lack
    // a processor, or the AMDGPU backend altogether). Cached: one probe per target per toolchain.
    std::lock_guard<std::mutex> lock(mu_);
    if (probed_ok_.count(std::string(t.name))) return;
    ProcessResult r = run_process({clang_.string(), "-x", "hip", "--offload-arch=" + std::string(t.name),
                                   "--cuda-device-only", "-nogpulib", "-nogpuinc", "-fsyntax-only", "/dev/null"});
    if (!r.ok())
      fail(Errc::toolchain, "target {}: the HIP compiler {} (\"{}\") does not accept --offload-arch={}: {}; "
           "select a clang with AMDGPU support for it with {}",
           t.name, clang_.string(), version_, t.name, first_line(r.err), kSelectHelp);
    probed_ok_.insert(std::string(t.name));
  }

  std::vector<std::string> flags(const TargetInfo& t, bool) const override {
    return {
        "-x", "hip", "--offload-arch=" + std::string(t.name),
        // Device code only, as one linked code object rather than a clang offload bundle.
        "--cuda-device-only", "--no-gpu-bundle-output",
        // No ROCm: neither its headers nor its device libraries (vendor.h needs neither).
        "-nogpulib", "-nogpuinc",
        "-O3", "-std=c++17",
        "-I.",
    };
  }

  CompileOutput compile(const CompileJob& job) const override {
    TempDir dir("decodepack-hip");
    for (const codegen::TemplateFile& h : job.headers) write_file_atomic(dir.path() / h.name, h.text);
    const std::string src = job.stem + ".hip";
    write_file_atomic(dir.path() / src, job.source);
    std::vector<std::string> argv = {clang_.string()};
    for (const std::string& f : flags(*job.target, false)) argv.push_back(f);
    // The compilation-unit id names a 1-byte __hip_cuid_* symbol in the code object. clang derives
    // it from the input's path by default (a temporary directory here, different every run), so
    // fix it to the instance's stem: the same instance then always gives the same bytes.
    argv.push_back("-cuid=" + job.stem);
    argv.insert(argv.end(), {"-o", "out.hsaco", src});
    // Relative names in a private directory: no path of this machine reaches the code object.
    ProcessResult r = run_process(argv, dir.path());
    CompileOutput out;
    out.log = r.out + r.err;
    if (!r.ok())
      fail(Errc::toolchain, "{}: {} failed to compile for {} ({}):\n{}", job.stem, clang_.string(), job.target->name,
           r.describe(), out.log);
    MappedFile co(dir.path() / "out.hsaco");
    out.code_object.assign(co.data(), co.data() + co.size());
    return out;
  }

 private:
  static std::string first_line(const std::string& s) {
    std::string l = s.substr(0, s.find('\n'));
    return l.empty() ? "no message" : l;
  }

  fs::path clang_;
  std::string version_;
  int llvm_major_ = 0;
  mutable std::mutex mu_;
  mutable std::set<std::string> probed_ok_;
};

}  // namespace

std::unique_ptr<DeviceToolchain> make_hip_toolchain(const ToolchainOptions& o) {
  std::vector<std::string> tried;
  fs::path clang = resolve_clang(o, &tried);
  if (clang.empty()) {
    std::string list;
    for (const std::string& t : tried) list += "\n  " + t;
    fail(Errc::toolchain,
         "no HIP device compiler for gfx targets (clang++ >= 17 with the AMDGPU backend). Tried:{}\n"
         "Install clang-19 and lld-19, or select a clang with {}",
         list, kSelectHelp);
  }
  return std::make_unique<ClangHipToolchain>(clang);
}

}  // namespace dp::backend
