// decodepack generate: greedy decoding of a batch of prompts, the whole model on the GPU through
// libdecodepack (generator.h says what a generate does).
#include <cstdio>
#include <numeric>

#include <fmt/ranges.h>

#include "commands.h"
#include "common/error.h"
#include "common/json.h"
#include "tooling/generator.h"
#include "tooling/json_output.h"

namespace dp::tools {
namespace {

double device_ms(const GenerateResult& r) {
  double t = 0;
  for (const GenerateStep& s : r.steps) t += s.ms;
  return t;
}

int64_t tokens_fed(const GenerateResult& r) {
  int64_t n = 0;
  for (const GenerateStep& s : r.steps) n += s.requests;
  return n;
}

void print_text(const GenerateResult& r) {
  std::printf("bundle   %s (%s)\n", r.bundle.c_str(), r.digest.c_str());
  std::printf("device   %s, target %s\n", r.device.c_str(), r.target.c_str());
  std::printf("model    %s; weights %s; %d layers, hidden %lld, vocab %lld\n", r.model.c_str(), r.weights.c_str(),
              r.num_layers, static_cast<long long>(r.hidden), static_cast<long long>(r.vocab));
  std::printf("batch    %zu requests, %d new tokens each, %s\n\n", r.requests.size(), r.max_tokens,
              r.graph ? "CUDA graphs per width" : "eager launches");
  std::printf("%-6s %-6s %-9s %-8s %10s  %s\n", "step", "width", "requests", "mode", "ms", "finished");
  for (const GenerateStep& s : r.steps)
    std::printf("%-6d %-6d %-9d %-8s %10.3f  %s\n", s.index, s.width, s.requests, s.mode.c_str(), s.ms,
                fmt::format("{}", fmt::join(s.left, " ")).c_str());
  std::printf("\n");
  for (size_t i = 0; i < r.requests.size(); ++i) {
    const GenerateRequest& q = r.requests[i];
    std::printf("request %zu: %zu prompt tokens (steps %d..%d) -> %s\n", i, q.prompt.size(), q.first_step, q.last_step,
                fmt::format("{}", fmt::join(q.tokens, " ")).c_str());
  }
  const double ms = device_ms(r);
  int64_t generated = 0;
  for (const GenerateRequest& q : r.requests) generated += static_cast<int64_t>(q.tokens.size());
  std::printf("\n%zu steps, %lld tokens fed, %lld generated; device time %.3f ms (%.1f steps/s, %.1f tokens/s); "
              "wall %.3f s\n", r.steps.size(), static_cast<long long>(tokens_fed(r)), static_cast<long long>(generated),
              ms, ms > 0 ? 1e3 * static_cast<double>(r.steps.size()) / ms : 0.0,
              ms > 0 ? 1e3 * static_cast<double>(tokens_fed(r)) / ms : 0.0, r.wall_s);
  if (!r.logits.empty()) std::printf("logits   %s (float32 [rows, %lld])\n", r.logits.c_str(), static_cast<long long>(r.vocab));
}

Json to_json(const GenerateResult& r) {
  Json steps = Json::array(), requests = Json::array();
  for (const GenerateStep& s : r.steps)
    steps.push_back({{"step", s.index}, {"width", s.width}, {"requests", s.requests}, {"mode", s.mode}, {"ms", s.ms},
                     {"finished", s.left}});
  for (const GenerateRequest& q : r.requests)
    requests.push_back({{"prompt", q.prompt},
                        {"tokens", q.tokens},
                        {"argmax", q.argmax},
                        {"gap", q.gap},
                        {"logits_row", q.logits_row},
                        {"first_step", q.first_step},
                        {"last_step", q.last_step}});
  return Json{{"bundle", r.bundle},     {"digest", r.digest},         {"device", r.device},
              {"target", r.target},     {"model", r.model},           {"weights", r.weights},
              {"vocab_size", r.vocab},  {"hidden_size", r.hidden},    {"num_layers", r.num_layers},
              {"max_tokens", r.max_tokens}, {"graph", r.graph},       {"steps", steps},
              {"requests", requests},   {"device_ms", device_ms(r)},  {"tokens_fed", tokens_fed(r)},
              {"wall_s", r.wall_s},     {"logits_file", r.logits}};
}

}  // namespace

void add_generate(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand(
      "generate", "Greedy generation on a GPU through libdecodepack, the whole model on the bundle's kernels: embedding "
                  "rows, every layer program, the final norm, the LM head, argmax; prompts are fed one token per step, "
                  "requests leave when done and the step runs at the next width the bundle holds, as a "
                  "continuous-batching host does. Exit 0: generated; 3: bad prompts file or a bundle without what the "
                  "batch needs; 8: no GPU or the GPU/driver refused");
  auto o = std::make_shared<GenerateOptions>();
  auto json = std::make_shared<bool>(false), no_prefetch = std::make_shared<bool>(false);
  auto no_pdl = std::make_shared<bool>(false);
  cmd->add_option("bundle", o->bundle, "Bundle directory or .dpk file (format 1.5 or later: it carries the LM head)")
      ->required();
  cmd->add_option("--model", o->model,
                  "The checkpoint directory (config.json + safetensors) the bundle was built from: its weights, "
                  "embedding and LM head are loaded. A directory with only config.json, a config file or a preset "
                  "gives random weights (the synth fill of --seed)")
      ->required();
  cmd->add_option("--prompts", o->prompts,
                  "Prompts file: one request per line, token ids separated by whitespace. Refused before any GPU work "
                  "(exit 3, naming the line and value): a non-numeric id, an id outside the vocabulary, an empty line, "
                  "more requests than the widest width (or --width)")
      ->required();
  cmd->add_option("--max-tokens", o->max_tokens, "Tokens generated per request")->capture_default_str();
  cmd->add_option("--width", o->width,
                  "Run every step at this width (one of the bundle's), padding the rows of requests that finished. "
                  "Default: each step at the smallest width the bundle holds for the requests left");
  cmd->add_flag("--graph", o->graph,
                "CUDA graphs: the first step at each width runs eagerly and is captured (FULL), later steps at that "
                "width replay it with fresh contents in the captured buffers");
  cmd->add_option("--logits", o->logits,
                  "Write every fed position's fp32 logits to this file: float32 [rows, vocab], request by request, "
                  "position by position (--json gives each request's first row)");
  cmd->add_option("--seed", o->seed, "Seed of the random weights when --model holds no safetensors")
      ->capture_default_str();
  cmd->add_option("--device", o->device, "CUDA device ordinal")->capture_default_str();
  cmd->add_flag("--no-prefetch", *no_prefetch, "Launch no L2 weight prefetch (DP_SESSION_NO_PREFETCH)");
  cmd->add_flag("--no-pdl", *no_pdl, "Launch without programmatic dependent launch (DP_SESSION_NO_PDL)");
  cmd->add_flag("--json", *json, "Print the result as JSON (progress stays on stderr)");
  cmd->footer(
      "Needs an NVIDIA GPU: the driver (libcuda.so.1, or $DECODEPACK_CUDA_LIBRARY) is loaded at run time.\n"
      "A request's prompt is fed one token per decode step (prefill through decode steps, for KDA and MLA alike);\n"
      "--json also gives, per fed position, the argmax and the gap between the two largest logits (along the\n"
      "prompt: teacher-forced predictions).\n"
      "Exit codes: 0 ok, 1 internal error, 2 usage (e.g. a width the bundle lacks), 3 bad input (prompts file,\n"
      "model/bundle mismatch, a bundle without programs or LM head for a width), 4 I/O, 8 device.");
  cmd->callback([o, json, no_prefetch, no_pdl, &action] {
    action = [o, json, no_prefetch, no_pdl] {
      o->prefetch = !*no_prefetch;
      o->pdl = !*no_pdl;
      o->log = [](const std::string& s) { std::fprintf(stderr, "decodepack: generate: %s\n", s.c_str()); };
      const GenerateResult r = generate(*o);
      if (*json) print_json(to_json(r));
      else print_text(r);
      return 0;
    };
  });
}

}  // namespace dp::tools
