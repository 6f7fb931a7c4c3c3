// decodepack push / pull: bundles to and from an OCI registry (distribution API).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <random>

#include "bundle/bundle.h"
#include "bundle/pack.h"
#include "bundle/registry.h"
#include "commands.h"
#include "common/error.h"
#include "common/json.h"
#include "tooling/json_output.h"
#include "common/progress.h"

namespace fs = std::filesystem;

namespace dp::tools {

namespace {

// Progress of layer transfers on stderr (stdout keeps only the result, so --json stays one object),
// one reporter (common/progress.h) per blob: on a terminal one line redrawn in place; otherwise a
// plain line per 10% of the blob and one when it is done.
std::function<void(const bundle::TransferProgress&)> progress_printer() {
  const bool tty = stderr_is_tty();
  auto bar = std::make_shared<std::unique_ptr<Progress>>();
  auto what = std::make_shared<std::string>();
  auto moved = std::make_shared<uint64_t>(0);
  return [tty, bar, what, moved](const bundle::TransferProgress& p) {
    if (!*bar || *what != p.what || p.bytes < *moved) {  // a new blob, or a retry of one (its count starts over)
      *bar = std::make_unique<Progress>(stderr, tty, p.what, p.total, Progress::Unit::bytes);
      (*bar)->started(std::chrono::steady_clock::now() -
                      std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                          std::chrono::duration<double>(p.seconds)));
      *what = p.what;
    }
    *moved = p.bytes;
    (*bar)->update(p.bytes);
    if (p.finished) {
      (*bar)->finish();
      bar->reset();
    }
  };
}

// A directory of our own under the system's temporary directory, removed when the push ends.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = fs::temp_directory_path() / fmt::format("decodepack-push-{}-{:08x}", ::getpid(), rd());
    std::error_code ec;
    if (!fs::create_directory(path_, ec))
      fail(Errc::io, "{}: cannot create a temporary directory: {}", path_.string(), ec ? ec.message() : "it exists");
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

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
  cmd->add_flag_callback("--no-progress", [&t] { t.progress = nullptr; }, "Print no transfer progress on stderr");
  t.progress = progress_printer();
}

}  // namespace

void add_push(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("push", "Upload a bundle (.dpk, or a directory, packed first) to an OCI registry "
                                          "(blobs only when missing)");
  struct Opts {
    std::string bundle, ref;
    bool json = false;
    bundle::PushOptions push;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("bundle", o->bundle, "Bundle archive (.dpk) or bundle directory (packed into a .dpk first)")->required();
  cmd->add_option("ref", o->ref, "host[:port]/repository:tag")->required();
  cmd->add_flag("--insecure", o->push.insecure, "Allow plain HTTP to a non-loopback registry");
  cmd->add_option("--created", o->push.created, "org.opencontainers.image.created (RFC 3339); default: from "
                                                "SOURCE_DATE_EPOCH when set, else none (a bundle records no time)");
  cmd->add_option("--image-version", o->push.version, "org.opencontainers.image.version (default: none)");
  cmd->add_option("--source", o->push.source, "org.opencontainers.image.source: URL the bundle was built from "
                                              "(default: none)");
  add_transfer_options(cmd, o->push);
  cmd->add_flag("--json", o->json, "Print the result as JSON");
  cmd->footer("Credentials: DECODEPACK_REGISTRY_USER/DECODEPACK_REGISTRY_PASSWORD, DECODEPACK_REGISTRY_TOKEN, or a "
              "docker-style config ($DOCKER_CONFIG/config.json or ~/.docker/config.json).");
  cmd->callback([o, &action] {
    action = [o] {
      bundle::Bundle b = bundle::Bundle::open(o->bundle);
      bundle::Reference ref = bundle::parse_reference(o->ref);
      bundle::PushOptions po = o->push;
      fs::path dpk = o->bundle;
      std::string name = fs::path(o->bundle).filename().string();
      std::optional<TempDir> packed;
      if (!b.is_archive()) {
        // A directory is packed (verified, then archived exactly as `build -o X.dpk` would) into a
        // temporary .dpk named after it; the layer is then the same blob as that archive's.
        if (name.empty()) name = fs::path(o->bundle).parent_path().filename().string();  // "dir/"
        name += ".dpk";
        packed.emplace();
        dpk = packed->path() / name;
        bundle::pack_bundle(b, dpk, false);
      }
      po.title = name;
      if (po.created.empty())
        if (const char* epoch = std::getenv("SOURCE_DATE_EPOCH"); epoch && *epoch)
          po.created = bundle::created_from_epoch(epoch, "SOURCE_DATE_EPOCH");
      bundle::PushResult r = bundle::push(dpk, b.manifest_bytes(), bundle_annotations(b), ref, po);
      if (o->json) {
        print_json({{"bundle", o->bundle}, {"ref", ref.str()}, {"manifest_digest", r.manifest_digest},
                    {"digest", b.digest()}, {"uploaded_blobs", r.uploaded_blobs}, {"skipped_blobs", r.skipped_blobs}});
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
        print_json({{"ref", ref.str()}, {"bundle", o->out}, {"manifest_digest", r.manifest_digest},
                    {"archive_digest", r.layer_digest}, {"digest", r.bundle_digest}, {"archive_bytes", r.size}});
      } else {
        std::printf("pulled %s\n  to      %s (%llu bytes)\n  bundle  %s\n", ref.str().c_str(), o->out.c_str(),
                    static_cast<unsigned long long>(r.size), r.bundle_digest.c_str());
      }
      return 0;
    };
  });
}

}  // namespace dp::tools
