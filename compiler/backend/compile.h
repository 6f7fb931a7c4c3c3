// Compiling a list of kernel instances to code objects: the build's device-code step.
//
//   auto report = dp::backend::compile_all(instances, {.jobs = 8, .progress = printer});
//
// Before anything compiles, every instance is validated and every target is checked against its
// toolchain (a gfx950 build with clang-19 fails here, naming the LLVM it needs). Then each distinct
// instance is looked up in the compile cache or compiled on a pool of `jobs` threads, its code object
// inspected (the entry point must be there with the signature's parameter size) and returned in
// the order of the input, whatever the thread count: the output is a function of the input only.
#pragma once

#include <cstdio>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "backend/cache.h"
#include "backend/inspect.h"
#include "backend/toolchain.h"
#include "codegen/kernel.h"

namespace dp::backend {

struct CompileProgress {
  size_t done = 0;   // finished so far, this one included
  size_t total = 0;  // distinct instances
  std::string key;   // "rmsnorm_w4_h2304.sm_90a"
  bool cache_hit = false;
  double seconds = 0;  // this instance's wall time (compile, or cache read)
};

struct CompileOptions {
  unsigned jobs = 0;                     // 0: std::thread::hardware_concurrency()
  std::filesystem::path cache_dir;       // empty: CompileCache::default_dir()
  bool use_cache = true;                 // false: compile everything, read and write no cache
  std::filesystem::path templates_dir;   // empty: TemplateSet::default_dir()
  ToolchainOptions toolchains;           // --cuda-root, --hip-clang
  bool emit_ptx = false;                 // NVIDIA: also keep portable PTX per kernel
  // Called once per distinct instance as it finishes, from worker threads but never concurrently.
  std::function<void(const CompileProgress&)> progress;
};

struct CompiledKernel {
  codegen::KernelInstance instance;
  std::string name;        // entry-point symbol, "rmsnorm_w4_h2304"
  std::string key;         // "rmsnorm_w4_h2304.sm_90a"
  std::string file_name;   // key + ".cubin" | ".hsaco"
  std::string source;      // the generated translation unit
  codegen::KernelSignature signature;
  codegen::LaunchShape launch;
  std::vector<uint8_t> code_object;
  std::string sha256;      // of code_object
  std::string ptx;         // with emit_ptx on NVIDIA targets
  CodeObjectKernel usage;  // from the code object; NVIDIA spills from ptxas -v (the cubin lacks them)
  std::string toolchain;   // the version string of the compiler that built it
  std::string log;         // compiler diagnostics (ptxas -v for NVIDIA), timing lines removed
  std::vector<std::string> warnings;  // spills, compiler warnings
  std::vector<std::string> notes;     // e.g. a cache entry that did not hold this kernel and was replaced
  bool cache_hit = false;
  double seconds = 0;
};

struct CompileReport {
  std::vector<CompiledKernel> kernels;          // in input order (duplicates repeated)
  CacheStats cache;                             // this run's hits / misses / corrupt entries
  std::map<std::string, std::string> toolchains;  // vendor ("nvidia", "amd") -> version string
  std::string templates_digest;                 // TemplateSet::digest() of the headers used
  double seconds = 0;
};

CompileReport compile_all(const std::vector<codegen::KernelInstance>& instances, const CompileOptions& options);

// A progress callback for a terminal or a log (common/progress.h): on a TTY one line redrawn in place
// with the percentage, elapsed time, ETA and the kernel that finished last; otherwise a plain line per
// 10% of the kernels and one at the end ("compiling kernels: 100% (48/48) in 6.1 s; 40 from the cache").
std::function<void(const CompileProgress&)> progress_printer(std::FILE* out, bool tty);

}  // namespace dp::backend
