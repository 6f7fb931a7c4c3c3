// Subcommand registration. Each tools/<name>.cpp defines one add_<name>() that declares its options
// and sets `action` (run after parsing). Mains stay thin: the work lives in libdp_compiler.
#pragma once

#include <CLI/CLI.hpp>

#include <functional>

namespace dp::tools {

using Action = std::function<int()>;

void add_synth(CLI::App& app, Action& action);
void add_plan(CLI::App& app, Action& action);
void add_build(CLI::App& app, Action& action);
void add_inspect(CLI::App& app, Action& action);
void add_verify(CLI::App& app, Action& action);
void add_pack(CLI::App& app, Action& action);
void add_push(CLI::App& app, Action& action);
void add_pull(CLI::App& app, Action& action);
void add_run(CLI::App& app, Action& action);
void add_generate(CLI::App& app, Action& action);
void add_indexer_run(CLI::App& app, Action& action);
void add_bench(CLI::App& app, Action& action);
void add_doctor(CLI::App& app, Action& action);

// Progress and diagnostics go to stderr; results (tables, --json) go to stdout.
bool stderr_is_tty();

}  // namespace dp::tools
