// dp_tp_allreduce_build OUT_DIR [TARGET]: compiles the allreduce instances the multi-process check runs
// (templates/allreduce.h through codegen + backend, NVRTC for sm_90a) on a machine without a GPU and
// writes OUT_DIR/<instance key>.cubin. dp_tp_allreduce_check loads them on the GPU machine.
#include <cstdio>
#include <filesystem>

#include "backend/compile.h"
#include "common/error.h"
#include "common/fs.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: dp_tp_allreduce_build OUT_DIR [TARGET (default sm_90a)]\n");
    return 2;
  }
  try {
    const std::filesystem::path out = argv[1];
    const std::string target = argc > 2 ? argv[2] : "sm_90a";
    std::filesystem::create_directories(out);
    std::vector<dp::codegen::KernelInstance> instances;
    // The 48B model's hidden size, 1 and 8 rows (one block / several blocks), 2 and 4 ranks; a short
    // row (H 256, the tiny preset) too.
    for (int64_t r : {2, 4})
      for (int64_t w : {1, 8})
        for (int64_t h : {256, 2304}) instances.push_back({"allreduce", {{"W", w}, {"H", h}, {"R", r}}, target});
    dp::backend::CompileOptions o;
    o.jobs = 2;
    const dp::backend::CompileReport report = dp::backend::compile_all(instances, o);
    for (const dp::backend::CompiledKernel& k : report.kernels)
      dp::write_file_atomic(out / k.file_name, std::string_view(reinterpret_cast<const char*>(k.code_object.data()),
                                                                k.code_object.size()));
    std::fprintf(stderr, "%zu kernels written to %s\n", report.kernels.size(), out.string().c_str());
    return 0;
  } catch (const dp::Error& e) {
    std::fprintf(stderr, "dp_tp_allreduce_build: %s\n", e.what());
    return static_cast<int>(e.code());
  }
}
