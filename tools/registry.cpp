// decodepack push / pull: bundles to and from an OCI registry (distribution API).
#include <cstdio>
#include <filesystem>

#include "bundle/bundle.h"
#include "bundle/registry.h"
#include "commands.h"
#include "common/error.h"
#include "common/json.h"

namespace dp::tools {

namespace {

std::map<std::string, std::string> bundle_annotations(const bundle::Bundle& b) {
  const format::Manifest& m = b.manifest();
  auto join = [](const Json& a) {
    std::string s;
    for (const Json& x : a) s += (s.empty() ? "" : ",") + (x.is_string() ? x.get<std::string>() : x.dump());
    return s;
  };
  return {{"org.decodepack.model", m.model.model_type},
          {"org.decodepack.model.config-digest", m.model.config_digest},
          {"org.decodepack.targets", join(m.deploy["targets"])},
          {"org.decodepack.tensor-parallel", m.deploy["tensor_parallel"].dump()},
          {"org.decodepack.widths", join(m.deploy["widths"])},
          {"org.decodepack.bundle-digest", b.digest()},
          {"org.decodepack.format", fmt::format("{}.{}", m.format_version.major, m.format_version.minor)}};
}

// --timeout and --retries, shared by push and pull.
void add_transfer_options(CLI::App* cmd, bundle::TransferOptions& t) {
  cmd->add_option("--timeout", t.timeout_s, "Deadline of each registry request in seconds, plus 1 s per MiB of blob "
                                            "it carries; 0: none")
      ->capture_default_str()
      ->check(CLI::Range(0L, 86400L * 365));
  cmd->add_option("--retries", t.retries, "Times a request is repeated after HTTP 5xx or a broken connection "
                                          "(waiting 0.5 s, 1 s, 2 s, ...)")
      ->capture_default_str()
      ->check(CLI::Range(0, 20));
  t.log = [](const std::string& s) { std::fprintf(stderr, "%s\n", s.c_str()); };
}

}  // namespace

void add_push(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("push", "Upload a .dpk bundle to an OCI registry (blobs only when missing)");
  struct Opts {
    std::string bundle, ref;
    bool json = false;
    bundle::PushOptions push;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("bundle", o->bundle, "Bundle archive (.dpk)")->required();
  cmd->add_option("ref", o->ref, "host[:port]/repository:tag")->required();
  cmd->add_flag("--insecure", o->push.insecure, "Allow plain HTTP to a non-loopback registry");
  add_transfer_options(cmd, o->push);
  cmd->add_flag("--json", o->json, "Print the result as JSON");
  cmd->footer("Credentials: DECODEPACK_REGISTRY_USER/DECODEPACK_REGISTRY_PASSWORD, DECODEPACK_REGISTRY_TOKEN, or a "
              "docker-style config ($DOCKER_CONFIG/config.json or ~/.docker/config.json).");
  cmd->callback([o, &action] {
    action = [o] {
      bundle::Bundle b = bundle::Bundle::open(o->bundle);
      if (!b.is_archive())
        fail(Errc::usage, "{}: push takes a .dpk archive; build one with `decodepack build ... -o FILE.dpk`", o->bundle);
      bundle::Reference ref = bundle::parse_reference(o->ref);
      bundle::PushOptions po = o->push;
      po.title = std::filesystem::path(o->bundle).filename().string();
      bundle::PushResult r = bundle::push(o->bundle, b.manifest_bytes(), bundle_annotations(b), ref, po);
      if (o->json) {
        Json j{{"ref", ref.str()}, {"manifest_digest", r.manifest_digest}, {"bundle_digest", b.digest()},
               {"uploaded_blobs", r.uploaded_blobs}, {"skipped_blobs", r.skipped_blobs}};
        std::printf("%s\n", j.dump(2).c_str());
      } else {
        std::printf("pushed %s\n  as      %s@%s\n  bundle  %s\n  blobs   %d uploaded, %d already present\n",
                    o->bundle.c_str(), ref.str().c_str(), r.manifest_digest.c_str(), b.digest().c_str(),
                    r.uploaded_blobs, r.skipped_blobs);
      }
      return 0;
    };
  });
}

void add_pull(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("pull", "Download a bundle from an OCI registry (digests verified)");
  struct Opts {
    std::string ref, out;
    bool json = false;
    bundle::PullOptions pull;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("ref", o->ref, "host[:port]/repository:tag or ...@sha256:<digest>")->required();
  cmd->add_option("-o,--output", o->out, "Where to write the .dpk (replaced atomically, and only by a bundle that "
                                         "verifies)")->required();
  cmd->add_option("--digest", o->pull.expect_digest, "The bundle digest (sha256 of its manifest.json) to expect");
  cmd->add_flag("--force", o->pull.force, "Replace an output file that is not a bundle archive");
  cmd->add_flag("--insecure", o->pull.insecure, "Allow plain HTTP to a non-loopback registry");
  add_transfer_options(cmd, o->pull);
  cmd->add_flag("--json", o->json, "Print the result as JSON");
  cmd->callback([o, &action] {
    action = [o] {
      bundle::Reference ref = bundle::parse_reference(o->ref);
      // Checked in full before it replaces the output: layer digest, archive, manifest = config blob,
      // every file's digest, and --digest.
      bundle::PullResult r = bundle::pull(ref, o->out, o->pull);
      if (o->json) {
        Json j{{"ref", ref.str()}, {"output", o->out}, {"manifest_digest", r.manifest_digest},
               {"layer_digest", r.layer_digest}, {"bundle_digest", r.bundle_digest}, {"size", r.size}};
        std::printf("%s\n", j.dump(2).c_str());
      } else {
        std::printf("pulled %s\n  to      %s (%llu bytes)\n  bundle  %s\n", ref.str().c_str(), o->out.c_str(),
                    static_cast<unsigned long long>(r.size), r.bundle_digest.c_str());
      }
      return 0;
    };
  });
}

}  // namespace dp::tools
