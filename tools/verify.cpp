// decodepack verify: schema, format version, every digest, missing or extra files, code-object symbols,
// and with --model the weight fingerprints.
#include <cstdio>

#include "bundle/verify.h"
#include "commands.h"
#include "common/error.h"
#include "common/json.h"
#include "tooling/json_output.h"

namespace dp::tools {

void add_verify(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("verify", "Check a bundle's integrity (and, with --model, its weight fingerprints). "
                                           "Exit 0: intact; 3: malformed or unsupported; 5: content differs");
  struct Opts {
    std::string bundle, model, digest;
    unsigned jobs = 0;
    bool json = false;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("bundle", o->bundle, "Bundle directory or .dpk file")->required();
  cmd->add_option("--model", o->model, "Checkpoint directory whose weights the bundle must match");
  cmd->add_option("--digest", o->digest, "Expected bundle digest (sha256:...)");
  cmd->add_option("-j,--jobs", o->jobs, "Hashing threads (default: all cores)");
  cmd->add_flag("--json", o->json, "Print the report as JSON");
  cmd->callback([o, &action] {
    action = [o] {
      bundle::Bundle b = bundle::Bundle::open(o->bundle);
      bundle::VerifyReport r = bundle::verify_bundle(b, {o->model, o->digest, o->jobs, stderr, stderr_is_tty()});
      const std::string summary =
          fmt::format("{} problem{}", r.problems.size(), r.problems.size() == 1 ? "" : "s");
      for (const auto& p : r.problems) std::fprintf(stderr, "decodepack: verify: %s\n", p.message.c_str());
      if (o->json) {
        Json problems = Json::array();
        for (const auto& p : r.problems) problems.push_back({{"what", p.what}, {"object", p.object}, {"message", p.message}});
        Json j{{"bundle", o->bundle}, {"digest", r.digest}, {"ok", r.ok()}, {"files_checked", r.files_checked},
               {"kernels_checked", r.kernels_checked}, {"fingerprints_checked", r.weights_checked},
               {"problems", problems}};
        if (!r.ok())
          j["error"] = json_error(Errc::verify, fmt::format("{}: {} (first: {})", o->bundle, summary,
                                                            r.problems.front().message));
        print_json(std::move(j));
      } else {
        std::printf("%s: %s (%s; %zu files, %zu kernels, %zu weight fingerprints checked)\n", o->bundle.c_str(),
                    r.ok() ? "OK" : summary.c_str(),
                    r.digest.c_str(), r.files_checked, r.kernels_checked, r.weights_checked);
      }
      return r.ok() ? 0 : static_cast<int>(Errc::verify);
    };
  });
}

}  // namespace dp::tools
