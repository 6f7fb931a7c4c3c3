// dp_kernel_build OUT_DIR [TARGET]: compiles every kernel instance the GPU checks need through the
// product's own path (codegen + backend::compile_all, i.e. NVRTC for sm_90a), on a machine without a
// GPU, and writes OUT_DIR/<instance key>.cubin plus OUT_DIR/usage.txt (registers, shared memory,
// spills per kernel). dp_kernel_check then loads them on the GPU machine.
#include <fmt/format.h>

#include <cstdio>
#include <filesystem>
#include <set>

#include "backend/compile.h"
#include "cases.h"
#include "common/error.h"
#include "common/fs.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: dp_kernel_build OUT_DIR [TARGET (default sm_90a)]\n");
    return 2;
  }
  try {
    const std::filesystem::path out = argv[1];
    const std::string target = argc > 2 ? argv[2] : "sm_90a";
    std::filesystem::create_directories(out);
    std::vector<dp::codegen::KernelInstance> instances;
    std::set<std::string> seen;
    for (const dp::gpucheck::Case& c : dp::gpucheck::all_cases())
      for (const dp::codegen::KernelInstance& k : dp::gpucheck::kernels_of(c, target).all())
        if (seen.insert(dp::codegen::instance_key(k)).second) instances.push_back(k);
    dp::backend::CompileOptions o;
    o.jobs = 2;
    o.progress = dp::backend::progress_printer(stderr, false);
    const dp::backend::CompileReport report = dp::backend::compile_all(instances, o);
    std::string usage = fmt::format("# {} kernels for {}, {}\n# key registers shared_bytes stack_bytes spill_bytes\n",
                                    report.kernels.size(), target, report.toolchains.begin()->second);
    int bad = 0;
    for (const dp::backend::CompiledKernel& k : report.kernels) {
      dp::write_file_atomic(out / k.file_name, std::string_view(reinterpret_cast<const char*>(k.code_object.data()),
                                                                k.code_object.size()));
      usage += fmt::format("{} {} {} {} {}\n", k.key, k.usage.registers, k.usage.shared_bytes, k.usage.stack_bytes,
                           k.usage.spill_bytes);
      if (k.usage.spill_bytes || k.usage.stack_bytes || !k.warnings.empty()) {
        std::fprintf(stderr, "%s: spills %u, stack %u, %zu warnings\n", k.key.c_str(), k.usage.spill_bytes,
                     k.usage.stack_bytes, k.warnings.size());
        ++bad;
      }
    }
    dp::write_file_atomic(out / "usage.txt", usage);
    std::fprintf(stderr, "%zu kernels written to %s (%d with spills/stack/warnings)\n", report.kernels.size(),
                 out.string().c_str(), bad);
    return bad ? 1 : 0;
  } catch (const dp::Error& e) {
    std::fprintf(stderr, "dp_kernel_build: %s\n", e.what());
    return static_cast<int>(e.code());
  }
}
