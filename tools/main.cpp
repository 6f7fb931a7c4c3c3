// decodepack: ahead-of-time decode-kernel compiler and bundle packager. See README.md.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "commands.h"
#include "common/error.h"
#include "common/suggest.h"
#include "tooling/json_output.h"

namespace dp::tools {
bool stderr_is_tty() { return ::isatty(STDERR_FILENO) == 1; }
}  // namespace dp::tools

namespace {

// Whether the command line asks for --json on stdout: the word --json (before any "--") given to a
// subcommand whose --json is a flag (bench's --json takes a file name and writes there instead), or to a
// word that is no subcommand at all (or to none: `decodepack --json`). Read from argv, so that a command line CLI11 refused still counts.
bool json_requested(const CLI::App& app, int argc, char** argv) {
  if (argc < 2) return false;
  bool word = false;
  for (int i = 1; i < argc && std::string(argv[i]) != "--"; ++i) word = word || std::string(argv[i]) == "--json";
  if (!word) return false;
  for (const CLI::App* sub : app.get_subcommands({}))
    if (sub->get_name() == argv[1]) {
      const CLI::Option* o = sub->get_option_no_throw("--json");
      return o && o->get_expected_max() == 0;
    }
  return true;
}

// An option the chosen subcommand does not have ("build --modle x"), with the nearest of its options;
// "" when every option word is known. Checked before CLI11's own message, which would otherwise
// complain first about a required option (--model) that the typo was meant to be.
std::string unknown_option(const CLI::App& app, int argc, char** argv) {
  if (argc < 2) return {};
  const CLI::App* sub = nullptr;
  for (const CLI::App* s : app.get_subcommands({}))
    if (s->get_name() == argv[1]) sub = s;
  if (!sub) return {};
  for (int i = 2; i < argc; ++i) {
    const std::string word = argv[i];
    if (word == "--") break;  // the rest are positionals
    if (word.size() < 3 || word.compare(0, 2, "--") != 0) continue;
    const std::string name = word.substr(0, word.find('='));
    if (sub->get_option_no_throw(name) || app.get_option_no_throw(name)) continue;
    std::vector<std::string> names;
    for (const CLI::Option* o : sub->get_options())
      for (const std::string& l : o->get_lnames()) names.push_back("--" + l);
    const std::string near = dp::closest_name(name, names);
    return fmt::format("unknown option '{}' of {}{} (see decodepack {} --help)",
                       name.size() > 64 ? name.substr(0, 64) + "..." : name, sub->get_name(),
                       near.empty() ? "" : "; did you mean '" + near + "'?", sub->get_name());
  }
  return {};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"decodepack: ahead-of-time decode-kernel compiler and bundle packager for Kimi-Linear / Kimi-K3"};
  app.set_version_flag("--version", std::string("decodepack ") + DP_VERSION_STRING);
  app.require_subcommand(1);
  app.footer(
      "Exit codes: 0 ok, 1 internal error, 2 usage, 3 bad input (model, checkpoint, deploy config, bundle),\n"
      "4 I/O, 5 verification failed, 6 registry, 7 toolchain, 8 device. `doctor` always exits 0 (a report).\n"
      "--json: one JSON object on stdout, also on failure ({\"schema_version\": 1, \"error\": {\"code\", \"exit\",\n"
      "\"message\"}}); shapes in manifests/cli/ (README.md \"JSON output\"). bench --json FILE writes FILE instead.");

  dp::tools::Action action;
  dp::tools::add_synth(app, action);
  dp::tools::add_plan(app, action);
  dp::tools::add_build(app, action);
  dp::tools::add_inspect(app, action);
  dp::tools::add_verify(app, action);
  dp::tools::add_pack(app, action);
  dp::tools::add_push(app, action);
  dp::tools::add_pull(app, action);
  dp::tools::add_run(app, action);
  dp::tools::add_generate(app, action);
  dp::tools::add_indexer_run(app, action);
  dp::tools::add_bench(app, action);
  dp::tools::add_doctor(app, action);

  // A first word that is no subcommand is a typo of one (CLI11 would only say one is required).
  if (argc >= 2 && argv[1][0] != '-') {
    std::vector<std::string> names;
    for (const CLI::App* sub : app.get_subcommands({})) names.push_back(sub->get_name());
    const std::string word = argv[1];
    if (std::find(names.begin(), names.end(), word) == names.end()) {
      std::string list;
      for (const std::string& n : names) list += (list.empty() ? "" : ", ") + n;
      const std::string near = dp::closest_name(word, names);
      std::fprintf(stderr, "decodepack: error: unknown subcommand '%s'%s (subcommands: %s; see decodepack --help)\n",
                   word.size() > 64 ? (word.substr(0, 64) + "...").c_str() : word.c_str(),
                   near.empty() ? "" : ("; did you mean '" + near + "'?").c_str(), list.c_str());
      if (json_requested(app, argc, argv))
        dp::tools::print_json_error(dp::Errc::usage,
                                    fmt::format("unknown subcommand '{}'{}", word.size() > 64 ? word.substr(0, 64) + "..." : word,
                                                near.empty() ? "" : "; did you mean '" + near + "'?"));
      return static_cast<int>(dp::Errc::usage);
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const bool json = json_requested(app, argc, argv);
    if (const std::string typo = unknown_option(app, argc, argv); !typo.empty()) {
      std::fprintf(stderr, "decodepack: error: %s\n", typo.c_str());
      if (json) dp::tools::print_json_error(dp::Errc::usage, typo);
      return static_cast<int>(dp::Errc::usage);
    }
    int rc = app.exit(e);
    if (rc != 0 && json) dp::tools::print_json_error(dp::Errc::usage, e.what());
    return rc == 0 ? 0 : static_cast<int>(dp::Errc::usage);
  }
  const bool json = json_requested(app, argc, argv);
  try {
    return action ? action() : 0;
  } catch (const dp::Error& e) {
    std::fprintf(stderr, "decodepack: error: %s\n", e.what());
    if (json) dp::tools::print_json_error(e.code(), e.what());
    return static_cast<int>(e.code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decodepack: internal error: %s\n", e.what());
    if (json) dp::tools::print_json_error(dp::Errc::internal, e.what());
    return static_cast<int>(dp::Errc::internal);
  }
}
