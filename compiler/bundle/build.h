// `decodepack build`: plan, fingerprint the weights, generate and compile the kernels, write the
// manifest, and publish the bundle (a directory or a .dpk archive) with one atomic rename.
//
// Nothing but decodepack's own files is ever removed (common/output.h): an existing output is
// replaced only when it is a bundle (bundle_own_files()), and the staging entries of killed builds of
// the same output are removed first.
//
// The output is a function of the inputs only: the same model, deploy config, tool version and
// toolchains give the same bytes whatever the thread count, the clock, the locale or the output path.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "backend/cache.h"
#include "backend/toolchain.h"
#include "format/sections.h"

namespace dp::model {
struct Model;
}

namespace dp::bundle {

struct BuildOptions {
  std::string model;                 // checkpoint dir, config file or preset
  std::string deploy = "default";    // deploy file or "default"
  std::filesystem::path out;         // "x.dpk": archive; anything else: directory
  // Write over an output that is not a bundle decodepack wrote: a file is replaced, a directory is
  // written into (its other entries kept). Without it such an output is refused (Errc::usage). An
  // output that is, lies in or contains the input model or deploy file is refused regardless.
  bool force = false;
  unsigned jobs = 0;                 // 0: hardware concurrency
  std::filesystem::path cache_dir;   // empty: the default compile cache
  bool use_cache = true;
  std::filesystem::path emit_source; // when set: write every generated translation unit there
  backend::ToolchainOptions toolchains;
  bool weights = true;               // fingerprint the checkpoint's weights when it has any
  int64_t context = 4096;            // plan's KV estimate (recorded in the plan, not the manifest)
  std::function<void(const std::string&)> log;         // progress lines (stderr)
  bool progress_tty = false;
};

struct BuildResult {
  std::filesystem::path out;
  std::string digest;                // "sha256:..." of manifest.json
  size_t kernels = 0;                // compiled code objects
  size_t planned_only = 0;           // planned layer programs not built by this version
  bool fingerprinted = false;
  size_t fingerprints = 0;
  backend::CacheStats cache;
  double seconds = 0;
  // The compiler's warnings about the kernels (e.g. register spills), each "<kernel key>: <warning>";
  // also logged ("warning: ...") as the build runs.
  std::vector<std::string> warnings;
};

BuildResult build_bundle(const BuildOptions& o);

// The manifest's model.details for `m`: the IR's hyper-parameters the runtime and tools read back
// (format::details_from_json).
format::ModelDetails manifest_details(const model::Model& m);

}  // namespace dp::bundle
