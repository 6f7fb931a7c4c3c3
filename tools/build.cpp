// decodepack build: plan + fingerprint + compile + package one bundle (directory or .dpk).
#include <cstdio>

#include "bundle/build.h"
#include "commands.h"
#include "common/error.h"
#include "common/json.h"
#include "tooling/json_output.h"

namespace dp::tools {

void add_build(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("build", "Compile the kernels and package a bundle (directory, or a .dpk archive "
                                          "when the output ends in .dpk)");
  struct Opts {
    std::string model, deploy = "default", out, cache_dir, emit_source, cuda_root, hip_clang;
    unsigned jobs = 0;
    bool no_cache = false, no_weights = false, force = false, json = false;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--model", o->model, "Checkpoint directory, config file, or preset")->required();
  cmd->add_option("--deploy", o->deploy, "Deploy config JSON, or `default`")->capture_default_str();
  cmd->add_option("-o,--output", o->out, "Bundle to write: DIR or FILE.dpk (replaced atomically; an existing output "
                                        "that is not a bundle is refused)")->required();
  cmd->add_flag("--force", o->force, "Write over an output that is not a bundle: a file is replaced, a directory is "
                                     "written into and keeps its other files");
  cmd->add_option("-j,--jobs", o->jobs, "Parallel compile and hashing jobs (default: all cores)");
  cmd->add_option("--cache-dir", o->cache_dir, "Compile cache (default: $XDG_CACHE_HOME/decodepack)");
  cmd->add_flag("--no-cache", o->no_cache, "Compile everything; read and write no cache");
  cmd->add_option("--emit-source", o->emit_source, "Also write every generated kernel source into DIR");
  cmd->add_option("--cuda-root", o->cuda_root, "CUDA toolkit root (default: $DECODEPACK_CUDA_ROOT or the one found "
                                               "at configure time)");
  cmd->add_option("--hip-clang", o->hip_clang, "clang++ for gfx targets (default: $DECODEPACK_HIP_CLANG or "
                                               "clang++-19)");
  cmd->add_flag("--no-weights", o->no_weights, "Do not read or fingerprint the checkpoint's weights");
  cmd->add_flag("--json", o->json, "Print the result as JSON");
  cmd->callback([o, &action] {
    action = [o] {
      bundle::BuildOptions bo;
      bo.model = o->model;
      bo.deploy = o->deploy;
      bo.out = o->out;
      bo.force = o->force;
      bo.jobs = o->jobs;
      bo.cache_dir = o->cache_dir;
      bo.use_cache = !o->no_cache;
      bo.emit_source = o->emit_source;
      bo.toolchains.cuda_root = o->cuda_root;
      bo.toolchains.hip_clang = o->hip_clang;
      bo.weights = !o->no_weights;
      bo.progress_tty = stderr_is_tty();
      bo.log = [](const std::string& s) { std::fprintf(stderr, "%s\n", s.c_str()); };
      bundle::BuildResult r = bundle::build_bundle(bo);
      if (o->json) {
        print_json({{"bundle", r.out.string()}, {"digest", r.digest}, {"kernels", r.kernels},
                    {"planned_only", r.planned_only}, {"weights_fingerprinted", r.fingerprinted},
                    {"fingerprints", r.fingerprints},
                    {"cache", {{"hits", r.cache.hits}, {"misses", r.cache.misses}, {"corrupt", r.cache.corrupt}}},
                    {"seconds", r.seconds}, {"warnings", r.warnings}});
      } else {
        std::printf("built %s\n  digest   %s\n  kernels  %zu compiled (cache: %llu hits, %llu misses, %llu corrupt)\n"
                    "  weights  %s\n  time     %.2f s\n",
                    r.out.c_str(), r.digest.c_str(), r.kernels, static_cast<unsigned long long>(r.cache.hits),
                    static_cast<unsigned long long>(r.cache.misses), static_cast<unsigned long long>(r.cache.corrupt),
                    r.fingerprinted ? fmt::format("{} shard fingerprints", r.fingerprints).c_str()
                                    : "not fingerprinted (config-only build)",
                    r.seconds);
      }
      return 0;
    };
  });
}

}  // namespace dp::tools
