// decodepack pack: a bundle directory into a .dpk archive (verified first; the same bytes as
// `build -o X.dpk` writes for that bundle).
#include <cstdio>

#include "bundle/bundle.h"
#include "bundle/pack.h"
#include "commands.h"
#include "common/hash.h"
#include "common/json.h"
#include "tooling/json_output.h"

namespace dp::tools {

void add_pack(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("pack", "Pack a bundle directory into a .dpk archive (verified first)");
  struct Opts {
    std::string dir, out;
    bool force = false, json = false;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("bundle", o->dir, "Bundle directory")->required();
  cmd->add_option("-o,--output", o->out, "The .dpk to write (replaced atomically)")->required();
  cmd->add_flag("--force", o->force, "Replace an output file that is not a bundle archive");
  cmd->add_flag("--json", o->json, "Print the result as JSON");
  cmd->callback([o, &action] {
    action = [o] {
      bundle::Bundle b = bundle::Bundle::open(o->dir);
      bundle::pack_bundle(b, o->out, o->force);
      const std::string layer = "sha256:" + sha256_file(o->out);
      if (o->json) {
        print_json({{"directory", o->dir}, {"bundle", o->out}, {"digest", b.digest()}, {"archive_digest", layer}});
      } else {
        std::printf("packed %s\n  to      %s\n  bundle  %s\n  archive %s\n", o->dir.c_str(), o->out.c_str(),
                    b.digest().c_str(), layer.c_str());
      }
      return 0;
    };
  });
}

}  // namespace dp::tools
