// decodepack: ahead-of-time decode-kernel compiler and bundle packager. See README.md.
#include <unistd.h>

#include <cstdio>

#include "commands.h"
#include "common/error.h"

namespace dp::tools {
bool stderr_is_tty() { return ::isatty(STDERR_FILENO) == 1; }
}  // namespace dp::tools

int main(int argc, char** argv) {
  CLI::App app{"decodepack: ahead-of-time decode-kernel compiler and bundle packager for Kimi-Linear / Kimi-K3"};
  app.set_version_flag("--version", std::string("decodepack ") + DP_VERSION_STRING);
  app.require_subcommand(1);
  app.footer(
      "Exit codes: 0 ok, 1 internal error, 2 usage, 3 bad input (model, checkpoint, deploy config, bundle),\n"
      "4 I/O, 5 verification failed, 6 registry, 7 toolchain, 8 device.");

  dp::tools::Action action;
  dp::tools::add_synth(app, action);
  dp::tools::add_plan(app, action);
  dp::tools::add_build(app, action);
  dp::tools::add_inspect(app, action);
  dp::tools::add_verify(app, action);
  dp::tools::add_push(app, action);
  dp::tools::add_pull(app, action);
  dp::tools::add_run(app, action);
  dp::tools::add_indexer_run(app, action);
  dp::tools::add_bench(app, action);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    int rc = app.exit(e);
    return rc == 0 ? 0 : static_cast<int>(dp::Errc::usage);
  }
  try {
    return action ? action() : 0;
  } catch (const dp::Error& e) {
    std::fprintf(stderr, "decodepack: error: %s\n", e.what());
    return static_cast<int>(e.code());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "decodepack: internal error: %s\n", e.what());
    return static_cast<int>(dp::Errc::internal);
  }
}
