// decodepack doctor: what this machine can build and run. The device toolchains (found exactly as
// `build` finds them), the GPU drivers and devices (asked through libdecodepack, which opens the
// drivers with dlopen as a serving host does), the targets each makes possible, and the compile
// cache. A report: whatever is missing is printed, and the exit status is 0.
#include <cstdio>
#include <memory>
#include <string>

#include "commands.h"
#include "tooling/doctor.h"
#include "tooling/json_output.h"

namespace dp::tools {

void add_doctor(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("doctor", "Report the toolchains, GPU drivers and devices, the targets this machine "
                                           "can build and run, and the kernel cache (exit 0 whatever is missing)");
  struct Opts {
    std::string cuda_root, hip_clang, cache_dir;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--cuda-root", o->cuda_root, "CUDA toolkit root to check (as for build)");
  cmd->add_option("--hip-clang", o->hip_clang, "clang++ for gfx targets to check (as for build)");
  cmd->add_option("--cache-dir", o->cache_dir, "Compile cache to measure (default: $XDG_CACHE_HOME/decodepack)");
  cmd->add_flag("--json", o->json, "Print the report as one JSON object");
  cmd->callback([o, &action] {
    action = [o] {
      DoctorOptions d;
      d.cuda_root = o->cuda_root;
      d.hip_clang = o->hip_clang;
      d.cache_dir = o->cache_dir;
      const Json report = doctor_report(d);
      if (o->json)
        print_json(report);
      else
        print_doctor_text(report);
      return 0;
    };
  });
}

}  // namespace dp::tools
