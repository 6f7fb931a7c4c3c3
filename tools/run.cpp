// decodepack run: decode steps of a bundle on the GPU through libdecodepack, optionally checked layer by
// layer against the CPU reference (tooling/run.h says what a run does).
#include <cmath>
#include <cstdio>

#include "commands.h"
#include "common/error.h"
#include "common/json.h"
#include "tooling/json_output.h"
#include "tooling/run.h"

namespace dp::tools {
namespace {

std::string layer_name(int layer) { return layer < 0 ? std::string("final") : std::to_string(layer); }

std::string value_text(const RunCheck& c) {
  if (c.kind == "count") return fmt::format("{} changed", static_cast<int64_t>(c.value));
  if (c.kind == "fault") return fmt::format("{:.0f} ms", c.value);
  if (!std::isfinite(c.value)) return "inf (NaN)";
  return fmt::format("{:.3e}", c.value);
}

void print_text(const RunResult& r) {
  std::printf("bundle   %s (%s)\n", r.bundle.c_str(), r.digest.c_str());
  std::printf("device   %s, target %s\n", r.device.c_str(), r.target.c_str());
  std::printf("model    %s\nweights  %s, %.1f MiB on the device\n", r.model.c_str(), r.weights.c_str(),
              static_cast<double>(r.weight_bytes) / double(1 << 20));
  std::printf("step     width %d (%d real request%s), q %d, %d rows; rank %d of tensor_parallel %d\n", r.width,
              r.requests, r.requests == 1 ? "" : "s", r.q, r.rows, r.rank, r.tensor_parallel);
  std::string skipped;
  for (int l : r.layers_skipped) skipped += fmt::format("{}{} ({})", skipped.empty() ? "" : ", ", l, r.layer_classes[l]);
  std::printf("layers   %zu run through their programs%s%s\n", r.layers_run.size(),
              skipped.empty() ? "" : "; skipped (no program): ", skipped.c_str());
  for (const RunStep& s : r.steps) {
    std::printf("\nstep %d (%s): %.3f ms\n", s.index, s.mode.c_str(), s.ms);
    bool header = false;
    for (const RunCheck& c : r.checks) {
      if (c.step != s.index) continue;
      if (!header) {
        std::printf("  %-6s %-12s %-26s %-14s %-8s %s\n", "layer", "class", "quantity", "error", "limit", "ok");
        header = true;
      }
      std::printf("  %-6s %-12s %-26s %-14s %-8s %s\n", layer_name(c.layer).c_str(), c.cls.c_str(),
                  c.quantity.c_str(), value_text(c).c_str(),
                  c.kind == "count"   ? "0"
                  : c.kind == "fault" ? fmt::format("{:.0f} ms", c.limit).c_str()
                                      : fmt::format("{:.0e}", c.limit).c_str(),
                  c.ok ? "ok" : "FAIL");
    }
  }
  if (r.checked) {
    const int bad = r.failures();
    std::printf("\n%s: %zu checks, %d failed\n", bad ? "FAILED" : "OK", r.checks.size(), bad);
  } else {
    std::printf("\n%zu step%s run (not checked: add --check to compare with the CPU reference)\n", r.steps.size(),
                r.steps.size() == 1 ? "" : "s");
  }
}

Json to_json(const RunResult& r) {
  Json steps = Json::array(), checks = Json::array(), classes = Json::array();
  for (const RunStep& s : r.steps) steps.push_back({{"step", s.index}, {"mode", s.mode}, {"ms", s.ms}});
  for (const RunCheck& c : r.checks) {
    Json j{{"step", c.step},   {"mode", c.mode},   {"layer", c.layer}, {"class", c.cls},
           {"quantity", c.quantity}, {"kind", c.kind}, {"limit", c.limit}, {"ok", c.ok}};
    // JSON has no inf/NaN: an unwritten (NaN) output is reported as null.
    j["value"] = std::isfinite(c.value) ? Json(c.value) : Json(nullptr);
    checks.push_back(j);
  }
  Json j{{"bundle", r.bundle},
              {"digest", r.digest},
              {"device", r.device},
              {"target", r.target},
              {"model", r.model},
              {"weight_source", r.weights},
              {"weight_entries", r.weight_entries},
              {"bound_bytes", r.weight_bytes},
              {"width", r.width},
              {"requests", r.requests},
              {"q", r.q},
              {"rows", r.rows},
              {"tensor_parallel", r.tensor_parallel},
              {"rank", r.rank},
              {"layer_classes", r.layer_classes},
              {"layers_run", r.layers_run},
              {"layers_skipped", r.layers_skipped},
              {"steps", steps},
              {"checked", r.checked},
              {"checks", checks},
              {"failures", r.failures()},
              {"ok", r.failures() == 0}};
  if (r.failures())
    j["error"] = json_error(Errc::verify, fmt::format("{}: {} of {} checks failed", r.bundle, r.failures(),
                                                      r.checks.size()));
  return j;
}

}  // namespace

void add_run(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand(
      "run", "Run decode steps of a bundle on a GPU through libdecodepack, as a serving host does, and with --check "
             "compare every layer's output, the KDA states and the written MLA cache rows with the CPU reference. "
             "Exit 0: ran (and every check passed); 5: a check failed; 8: no GPU or the GPU/driver refused");
  auto o = std::make_shared<RunOptions>();
  auto json = std::make_shared<bool>(false), no_prefetch = std::make_shared<bool>(false);
  auto no_pdl = std::make_shared<bool>(false);
  cmd->add_option("bundle", o->bundle, "Bundle directory or .dpk file")->required();
  cmd->add_option("--model", o->model,
                  "The checkpoint directory (config.json + safetensors) the bundle was built from: its weights are "
                  "loaded (the rank's shards, converted to the bound dtypes). A directory with only config.json, a "
                  "config file or a preset gives random weights. Default: the built-in preset whose config the bundle "
                  "records, with random weights");
  cmd->add_option("--width", o->width, "Batch width (requests per step) to run; one of the bundle's widths")->required();
  cmd->add_option("--requests", o->requests, "Real requests (1..width); the remaining rows are padding "
                                             "(NULL_BLOCK_ID state, no cache writes). Default: width");
  cmd->add_option("--steps", o->steps, "Decode steps to run (the metadata advances between steps)")
      ->capture_default_str();
  cmd->add_flag("--check", o->check,
                "Compare each step with the float64 CPU reference: per layer hidden and residual (bf16, rel. error "
                "< 1e-2), KDA recurrent state (fp32, < max(1e-4, 2^-8 x the step's relative update)) and conv states, MLA latent rows written (< 1e-2), "
                "nothing else in any cache changed, and the final norm. Outputs are poisoned (NaN) before every "
                "step; NaN fails");
  cmd->add_flag("--graph", o->graph,
                "After one eager warm-up step, capture a step in a CUDA graph (stream capture) and replay it --steps "
                "times, with fresh inputs and metadata copied into the captured buffers (every step is checked)");
  cmd->add_flag("--skip-missing", o->skip_missing,
                "Run only the layers the bundle has programs for at this width; a skipped layer's outputs (the next "
                "layer's inputs) are fresh random rows, as the host's own layer would have produced. Without it, a "
                "layer without a program is an error (exit 3) naming it");
  cmd->add_option("--seed", o->seed, "Seed of the inputs, caches, metadata and random weights (the same fill as "
                                     "`decodepack synth --seed`)")
      ->capture_default_str();
  cmd->add_flag("--random-weights", o->random_weights, "Random weights even when --model holds safetensors");
  cmd->add_flag("--verify-weights", o->verify_weights,
                "After binding, check every weight shard on the device against the bundle's fingerprints "
                "(dp_session_verify_weights)");
  cmd->add_option("--rank", o->rank, "Rank of a tensor_parallel 1 bundle to run (must be built). A bundle built for "
                                     "tensor_parallel N runs all N ranks, each a process of its own on --device or --devices "
                                     "(CUDA IPC between them); rank 0 reports its step times and, with --check, "
                                     "compares every rank's caches and outputs with the reference over all ranks")
      ->capture_default_str();
  cmd->add_option("--tp-fault", o->tp_fault,
                  "tensor_parallel > 1, a fault test: skip:R:L (rank R does not launch layer L) or die:R:L (rank R's "
                  "process exits before launching layer L) in one eager step; passes when every other rank finishes "
                  "the step within 3 wait bounds + 2 s and dp_after_step reports the gave-up wait on each");
  auto tp_wait_ms = std::make_shared<uint32_t>(10000);
  cmd->add_option("--tp-wait-ms", *tp_wait_ms,
                  "tensor_parallel > 1: the bound of every all-reduce wait, after which a rank records the wait it "
                  "gave up and the step fails on every rank (dp_after_step)")
      ->check(CLI::Range(1u, 3600000u))
      ->capture_default_str();
  auto* device = cmd->add_option("--device", o->device, "CUDA device ordinal (of every rank without --devices)")
                     ->capture_default_str();
  cmd->add_option("--devices", o->devices,
                  "tensor_parallel N: the CUDA device of each rank, N ordinals (default: every rank on --device). A "
                  "width the bundle all-reduces with NCCL (deploy \"allreduce\") needs one GPU per rank: NCCL refuses "
                  "two ranks on one GPU")
      ->delimiter(',')
      ->excludes(device);
  cmd->add_option("--nccl", o->nccl, "NCCL library for widths that all-reduce with NCCL (default: $DECODEPACK_NCCL, "
                                     "else $DECODEPACK_NCCL_LIBRARY or libnccl.so.2)");
  cmd->add_option("--context", o->context, "Cached tokens per request before the first step (each request gets a "
                                           "different length in [context/2, context])")
      ->capture_default_str();
  cmd->add_flag("--no-prefetch", *no_prefetch, "Launch no L2 weight prefetch (DP_SESSION_NO_PREFETCH)");
  cmd->add_flag("--no-pdl", *no_pdl,
                "Launch without programmatic dependent launch (DP_SESSION_NO_PDL; for comparisons)");
  cmd->add_flag("--json", *json, "Print the result as JSON (progress stays on stderr)");
  cmd->footer(
      "Needs an NVIDIA GPU: the driver (libcuda.so.1, or $DECODEPACK_CUDA_LIBRARY) is loaded at run time.\n"
      "Every layer with a program at --width runs through dp_launch_layer; each layer has its own input and output\n"
      "buffers, and --check computes each layer's reference from the very rows the GPU layer read.\n"
      "Exit codes: 0 ok, 1 internal error, 2 usage (e.g. a width the bundle lacks), 3 bad input (model/bundle\n"
      "mismatch, layers without programs), 4 I/O, 5 a check failed, 8 device (no driver or GPU, driver errors).");
  cmd->callback([o, json, no_prefetch, no_pdl, tp_wait_ms, &action] {
    action = [o, json, no_prefetch, no_pdl, tp_wait_ms] {
      o->allreduce_timeout_us = *tp_wait_ms * 1000;
      o->prefetch = !*no_prefetch;
      o->pdl = !*no_pdl;
      o->log = [](const std::string& s) { std::fprintf(stderr, "decodepack: run: %s\n", s.c_str()); };
      const RunResult r = run_bundle(*o);
      if (*json) print_json(to_json(r));
      else print_text(r);
      return r.failures() ? static_cast<int>(Errc::verify) : 0;
    };
  });
}

}  // namespace dp::tools
