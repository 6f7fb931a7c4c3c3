// decodepack bench: per layer class, per width and per whole step, how fast a bundle's layer programs run
// and what share of the HBM read ceiling (measured in the same run) they reach (tooling/bench.h).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "tooling/bench.h"
#include "commands.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"

namespace dp::tools {
namespace {

namespace fs = std::filesystem;

// bench/chart.py: $DECODEPACK_CHART_SCRIPT, the installed copy beside the binary, or the source tree's.
fs::path chart_script() {
  if (const char* env = std::getenv("DECODEPACK_CHART_SCRIPT"); env && *env) return env;
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    const fs::path installed = exe.parent_path().parent_path() / "share" / "decodepack" / "bench" / "chart.py";
    if (fs::is_regular_file(installed, ec)) return installed;
  }
#ifdef DP_BENCH_SOURCE_DIR
  return fs::path(DP_BENCH_SOURCE_DIR) / "chart.py";
#else
  return "bench/chart.py";
#endif
}

// python3 chart.py OUT.png JSON [BASELINE_JSON]; dp::Error(toolchain) when it cannot draw.
void draw_chart(const std::string& out, const std::string& json, const std::string& baseline) {
  const fs::path script = chart_script();
  std::error_code ec;
  if (!fs::is_regular_file(script, ec))
    fail(Errc::toolchain, "--chart: the chart script {} is missing (set DECODEPACK_CHART_SCRIPT to bench/chart.py)",
         script.string());
  std::vector<std::string> args = {"python3", script.string(), out, json};
  if (!baseline.empty()) {
    args.push_back("--baseline");
    args.push_back(baseline);
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) fail(Errc::toolchain, "--chart: cannot start python3");
  if (pid == 0) {
    ::execvp("python3", argv.data());
    std::fprintf(stderr, "decodepack: bench: cannot run python3\n");
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0) {
  }
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
    fail(Errc::toolchain, "--chart: {} {} failed (exit {}); the measurements are in {} (it needs python3 with "
         "matplotlib)", script.string(), out, WIFEXITED(status) ? WEXITSTATUS(status) : -1, json);
}

}  // namespace

void add_bench(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand(
      "bench",
      "Time a bundle's layer programs on a GPU through libdecodepack, as a host launches them: the HBM read ceiling "
      "of this GPU, then per width a correctness gate (the run --check comparisons on one CUDA-graph replay), every "
      "layer class L2-cold (all its layers in one graph), the whole step, and each class's kernels one by one. "
      "Exit 0: measured, every check passed; 5: a check failed (those classes are not timed); 8: no GPU");
  auto o = std::make_shared<BenchOptions>();
  auto json_out = std::make_shared<std::string>(), chart_out = std::make_shared<std::string>(),
       baseline = std::make_shared<std::string>();
  auto no_prefetch = std::make_shared<bool>(false), no_kernels = std::make_shared<bool>(false);
  o->run.context = 4096;
  cmd->add_option("bundle", o->run.bundle, "Bundle directory or .dpk file")->required();
  cmd->add_option("--model", o->run.model,
                  "The checkpoint or config the bundle was built from (as for run); a config or preset gives random "
                  "weights. Default: the built-in preset whose config the bundle records");
  cmd->add_option("--widths", o->widths, "Batch widths to measure, e.g. 1,2,4,8 (default: every width of the bundle)")
      ->delimiter(',');
  cmd->add_option("--context", o->run.context, "Cached tokens of every request before the step")->capture_default_str();
  cmd->add_option("--replays", o->replays, "Timed CUDA-graph replays per figure (median, p10, p90 of them)")
      ->capture_default_str();
  cmd->add_option("--kernel-reps", o->kernel_reps, "Repetitions of each per-kernel measurement")->capture_default_str();
  cmd->add_option("--ceiling-gib", o->ceiling_gib, "GiB the HBM read-ceiling stream reads")->capture_default_str();
  cmd->add_option("--json", *json_out, "Write the results as JSON (manifests/bench-result.schema.json) to this file");
  cmd->add_option("--chart", *chart_out,
                  "Draw the share of the ceiling and the µs per layer class and width into this PNG (bench/chart.py, "
                  "python3 with matplotlib)");
  cmd->add_option("--baseline", *baseline,
                  "A baseline's JSON (bench/baseline.py --json) to draw beside decodepack's in --chart");
  cmd->add_flag("--no-kernels", *no_kernels, "Skip the per-kernel breakdown");
  cmd->add_option("--prefetch", o->prefetch,
                  "L2 weight prefetch: on (the bundle's tables), off (DP_SESSION_NO_PREFETCH), or sweep (on, and per "
                  "width the whole step with prefetch off, each point alone and the next_attention tables capped, "
                  "timed side by side)")
      ->check(CLI::IsMember({"on", "off", "sweep"}))
      ->capture_default_str();
  cmd->add_flag("--no-prefetch", *no_prefetch, "Same as --prefetch off");
  cmd->add_option("--seed", o->run.seed, "Seed of the inputs, caches and random weights")->capture_default_str();
  cmd->add_flag("--random-weights", o->run.random_weights, "Random weights even when --model holds safetensors");
  cmd->add_option("--device", o->run.device, "CUDA device ordinal")->capture_default_str();
  cmd->footer(
      "Needs an NVIDIA GPU: the driver (libcuda.so.1, or $DECODEPACK_CUDA_LIBRARY) is loaded at run time. q = 1 and\n"
      "tensor_parallel 1 bundles. Bytes: compiler/bench/bytes.h; output: bench/README.md.\n"
      "Exit codes: 0 ok, 1 internal error, 2 usage, 3 bad input, 4 I/O, 5 a check failed, 7 --chart could not draw,\n"
      "8 device (no driver or GPU, driver errors).");
  cmd->callback([o, json_out, chart_out, baseline, no_prefetch, no_kernels, &action] {
    action = [o, json_out, chart_out, baseline, no_prefetch, no_kernels] {
      if (!baseline->empty() && chart_out->empty()) fail(Errc::usage, "--baseline {}: only used with --chart", *baseline);
      if (*no_prefetch) {
        if (o->prefetch == "sweep") fail(Errc::usage, "--no-prefetch with --prefetch sweep: choose one");
        o->prefetch = "off";
      }
      o->kernels = !*no_kernels;
      o->run.log = [](const std::string& s) { std::fprintf(stderr, "decodepack: bench: %s\n", s.c_str()); };
      std::string json_path = *json_out;
      if (json_path.empty() && !chart_out->empty()) json_path = *chart_out + ".json";
      if (!json_path.empty())
        o->progress = [json_path](const bench::BenchResult& partial) {
          write_file_atomic(json_path, bench::to_json(partial).dump(2) + "\n");
        };
      const bench::BenchResult r = run_bench(*o);
      const std::string text = bench::to_text(r);
      std::fwrite(text.data(), 1, text.size(), stdout);
      std::fflush(stdout);
      if (!json_path.empty()) write_file_atomic(json_path, bench::to_json(r).dump(2) + "\n");
      if (!chart_out->empty()) draw_chart(*chart_out, json_path, *baseline);
      int failed = 0;
      for (const bench::GateResult& g : r.gate) failed += g.failed;
      return failed ? static_cast<int>(Errc::verify) : 0;
    };
  });
}

}  // namespace dp::tools
