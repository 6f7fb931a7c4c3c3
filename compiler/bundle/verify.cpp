#include "bundle/verify.h"

#include <set>
#include <thread>

#include "backend/inspect.h"
#include "bundle/fingerprint.h"
#include "common/error.h"
#include "common/hash.h"
#include "model/ir.h"
#include "model/safetensors.h"

#include <map>

#include <fmt/ranges.h>

namespace dp::bundle {

VerifyReport verify_bundle(const Bundle& b, const VerifyOptions& o) {
  VerifyReport r;
  r.digest = b.digest();
  const format::Manifest& m = b.manifest();
  const std::string where = b.path().string();
  auto problem = [&](std::string what, std::string object, std::string msg) {
    r.problems.push_back({std::move(what), std::move(object), std::move(msg)});
  };

  if (format::canonical_bytes(m) != b.manifest_bytes())
    problem("manifest", format::kManifestFile,
            fmt::format("{}: {} is not in canonical form (it was edited after the build): its digest {} is not the "
                        "digest of the manifest it describes, sha256:{}",
                        where, format::kManifestFile, r.digest, sha256_hex(format::canonical_bytes(m))));
  if (!o.expect_digest.empty() && o.expect_digest != r.digest)
    problem("manifest", format::kManifestFile,
            fmt::format("{}: bundle digest {}, expected {}", where, r.digest, o.expect_digest));

  std::set<std::string> listed, bad;  // bad: files with a problem, not inspected again as code objects
  for (const format::FileEntry& f : m.files) {
    listed.insert(f.path);
    ++r.files_checked;
    if (!b.has(f.path)) {
      problem("file", f.path, fmt::format("{}: missing file {} (expected {} bytes, sha256 {})", where, f.path, f.size, f.sha256));
      continue;
    }
    if (const uint64_t size = b.size(f.path); size != f.size) {
      problem("file", f.path, fmt::format("{}: file {} has {} bytes, expected {}", where, f.path, size, f.size));
      bad.insert(f.path);
      continue;
    }
    std::string h = b.sha256(f.path);  // streamed: the file is not held in memory
    if (h != f.sha256) {
      problem("file", f.path, fmt::format("{}: file {} has sha256 {}, expected {}", where, f.path, h, f.sha256));
      bad.insert(f.path);
    }
  }
  for (const std::string& f : b.files())
    if (!listed.count(f)) problem("file", f, fmt::format("{}: file {} is not listed in the manifest", where, excerpt(f)));

  for (const format::KernelEntry& k : m.kernels) {
    ++r.kernels_checked;
    if (!b.has(k.file) || bad.count(k.file)) continue;  // reported above
    try {
      auto kernels = backend::inspect_code_object(b.file(k.file), k.target, where + ":" + k.file);
      const backend::CodeObjectKernel* found = nullptr;
      for (const auto& ck : kernels)
        if (ck.symbol == k.name) found = &ck;
      if (!found)
        problem("kernel", k.key, fmt::format("{}: {} does not define kernel {}", where, k.file, k.name));
      else if (found->param_bytes != k.param_bytes)
        problem("kernel", k.key,
                fmt::format("{}: kernel {} in {} takes {} parameter bytes, manifest says {}", where, k.name, k.file,
                            found->param_bytes, k.param_bytes));
    } catch (const Error& e) {
      problem("kernel", k.key, e.what());
    }
  }

  if (!o.model.empty()) {
    if (!m.weights_fingerprinted) {
      problem("weight", "*", fmt::format("{}: the bundle was built without weights and has no fingerprints to check "
                                         "against {}", where, o.model));
      return r;
    }
    st::Checkpoint ck = st::Checkpoint::open(o.model);
    // Other names a checkpoint may use for a tensor (HF transformers' layout), from the model IR.
    std::map<std::string, std::vector<std::string>> aliases;
    for (const model::WeightSpec& w : model::load_model(o.model).weights)
      if (!w.aliases.empty()) aliases[w.name] = w.aliases;
    std::vector<ShardRef> refs;
    std::vector<std::pair<std::string, std::string>> expect;  // (tensor name, digest)
    for (const format::RankEntry& re : m.ranks)
      for (const format::WeightEntry& w : re.weights) {
        const size_t n = w.experts > 0 ? static_cast<size_t>(w.experts) : 1;
        for (size_t e = 0; e < n; ++e) {
          std::string name = w.name;
          if (w.experts > 0) name.replace(name.find("{e}"), 3, std::to_string(e));
          const st::TensorInfo* t = ck.find(name);
          if (auto a = aliases.find(name); !t && a != aliases.end())
            for (const std::string& alt : a->second) t = t ? t : ck.find(alt);
          if (!t) {
            problem("weight", name, fmt::format("{}: tensor {} (rank {}) is not in the checkpoint", o.model, name, re.rank));
            continue;
          }
          // The shard is cut from the checkpoint tensor along split_dim; every other dimension must be the
          // bundle's, and the tensor must reach the shard's end. Checked before fingerprint() walks it.
          bool fits = t->shape.size() == w.shape.size();
          for (size_t d = 0; fits && d < w.shape.size(); ++d)
            fits = static_cast<int>(d) == w.split_dim ? t->shape[d] >= w.end : t->shape[d] == w.shape[d];
          if (!fits) {
            std::vector<std::string> want;
            for (size_t d = 0; d < w.shape.size(); ++d)
              want.push_back(static_cast<int>(d) == w.split_dim ? fmt::format(">={}", w.end) : std::to_string(w.shape[d]));
            problem("weight", name,
                    fmt::format("{}: tensor {} (rank {}): shape {} ({} dimensions), the bundle expects [{}] ({} "
                                "dimensions{})", o.model, name, re.rank, st::shape_string(t->shape), t->shape.size(),
                                fmt::join(want, ", "), w.shape.size(),
                                w.split_dim >= 0 ? fmt::format("; the rank's shard is [{}, {}) of dimension {}", w.begin,
                                                               w.end, w.split_dim)
                                                 : std::string()));
            continue;
          }
          auto dt = dtype_from_name(w.dtype);  // validate() accepted only known dtypes
          refs.push_back({t, w.split_dim, w.begin, w.end, *dt});
          expect.push_back({fmt::format("{} (rank {}{})", name, re.rank,
                                        w.split_dim >= 0 ? fmt::format(", dim {} [{}, {})", w.split_dim, w.begin, w.end) : ""),
                            w.sha256[e]});
        }
      }
    const unsigned jobs = o.jobs ? o.jobs : std::max(1u, std::thread::hardware_concurrency());
    Progress bar(o.progress, o.progress_tty, fmt::format("fingerprinting weight shards ({} threads)", jobs), refs.size());
    std::vector<std::string> got = fingerprint_all(ck, refs, jobs, &bar);
    bar.finish();
    r.weights_checked = got.size();
    for (size_t i = 0; i < got.size(); ++i)
      if (got[i] != expect[i].second)
        problem("weight", expect[i].first,
                fmt::format("{}: weight {}: fingerprint {}, bundle expects {}", o.model, expect[i].first, got[i],
                            expect[i].second));
  }
  return r;
}

}  // namespace dp::bundle
