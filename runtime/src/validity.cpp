#include "src/validity.h"

#include <algorithm>

#include <fmt/ranges.h>

#include "src/params.h"
#include "src/targets.h"

namespace dp::rt {
namespace {

// Kernel parameter blocks larger than this are refused at validation; the launch path packs into a
// stack buffer of this size. CUDA's classic limit is 4 KiB.
constexpr uint32_t kMaxParamBytes = 4096;

int rank_of(const ArchId& t) { return t.suffix == 'a' ? 0 : t.suffix == 'f' ? 1 : 2; }

}  // namespace

std::string device_label(const dp_device_desc& d, int32_t ordinal) {
  const std::string who = ordinal >= 0 ? fmt::format("device {}", ordinal) : std::string("the described device");
  if (d.name[0]) return fmt::format("{} ({}, {})", who, d.name, d.arch);
  return fmt::format("{} ({})", who, d.arch);
}

Status check_rank(const dp_bundle& b, int32_t rank) {
  if (b.rank_weights(rank)) return ok();
  return error(DP_ERR_RANK, "{}: rank {} is not in the bundle: it holds rank{} {} of tensor_parallel {} (build the "
               "bundle with this rank in the deploy config's \"ranks\", or use the bundle built for rank {})",
               b.reader.label(), rank, b.deploy.ranks.size() == 1 ? "" : "s", fmt::join(b.deploy.ranks, ", "),
               b.deploy.tensor_parallel, rank);
}

Result<std::string> choose_target(const dp_bundle& b, const dp_device_desc& device, int32_t ordinal) {
  std::string best, reasons;
  for (const std::string& t : b.deploy.targets) {
    std::string why;
    if (target_runs_on(t, device.arch, &why)) {
      if (best.empty()) {
        best = t;
        continue;
      }
      const ArchId a = parse_arch(t), c = parse_arch(best);
      if (rank_of(a) < rank_of(c) || (rank_of(a) == rank_of(c) && a.minor > c.minor)) best = t;
    } else {
      reasons += fmt::format("{}{}", reasons.empty() ? "" : "; ", why);
    }
  }
  if (!best.empty()) return best;
  return error(DP_ERR_TARGET, "{}: no code object for {}: the bundle's targets are {} ({}): add {} to the deploy "
               "config's \"targets\" and rebuild the bundle", b.reader.label(), device_label(device, ordinal),
               fmt::join(b.deploy.targets, ", "), reasons, suggested_target(device.arch));
}

Status check_device(const dp_bundle& b, const dp_device_desc& d, int32_t ordinal, std::string* target_out,
                    const std::string& forced) {
  std::string target = forced;
  if (target.empty()) {
    auto chosen = choose_target(b, d, ordinal);
    if (!chosen.ok()) return chosen.status();
    target = *chosen;
  } else {
    if (std::find(b.deploy.targets.begin(), b.deploy.targets.end(), target) == b.deploy.targets.end())
      return error(DP_ERR_TARGET, "{}: session options: target {} is not one of the bundle's targets ({})",
                   b.reader.label(), target, fmt::join(b.deploy.targets, ", "));
    std::string why;
    if (!target_runs_on(target, d.arch, &why))
      return error(DP_ERR_TARGET, "{}: session options: target {} does not run on {}: {}", b.reader.label(), target,
                   device_label(d, ordinal), why);
  }
  if (target_out) *target_out = target;
  const std::string who = device_label(d, ordinal);
  const format::Manifest& m = b.manifest();

  if (d.vendor == DP_VENDOR_CUDA && d.driver_version > 0) {
    if (int need = min_driver_for_arch(target); need > d.driver_version)
      return error(DP_ERR_DRIVER_VERSION, "{}: the driver supports CUDA {} (cuDriverGetVersion {}), but {} code needs a "
                   "driver for CUDA {} or newer: upgrade the driver", who, cuda_version_text(d.driver_version),
                   d.driver_version, target, cuda_version_text(need));
    const std::string tc = m.toolchains.contains("nvidia") && m.toolchains["nvidia"].is_string()
                               ? m.toolchains["nvidia"].get<std::string>() : std::string();
    if (int need = min_driver_for_toolchain(tc); need > d.driver_version)
      return error(DP_ERR_DRIVER_VERSION, "{}: the driver supports CUDA {} (cuDriverGetVersion {}), but the bundle's {} "
                   "code objects were built by {}, which needs a driver for CUDA {} or newer (cubins run on drivers of "
                   "their toolkit's major version or later): upgrade the driver, or rebuild the bundle with a CUDA {}.x "
                   "toolkit", who, cuda_version_text(d.driver_version), d.driver_version, target, tc,
                   cuda_version_text(need), d.driver_version / 1000);
  }

  for (const format::KernelEntry& k : m.kernels) {
    if (k.target != target) continue;
    const uint64_t threads = uint64_t{k.block[0]} * k.block[1] * k.block[2];
    if (d.max_threads_per_block > 0 && threads > static_cast<uint64_t>(d.max_threads_per_block))
      return error(DP_ERR_DEVICE_LIMITS, "kernel {}: {} threads per block (block [{}, {}, {}]), {} allows {}", k.key,
                   threads, k.block[0], k.block[1], k.block[2], who, d.max_threads_per_block);
    for (int i = 0; i < 3; ++i) {
      if (d.max_block_dim[i] > 0 && k.block[i] > static_cast<uint32_t>(d.max_block_dim[i]))
        return error(DP_ERR_DEVICE_LIMITS, "kernel {}: block dimension {} is {}, {} allows {}", k.key, "xyz"[i],
                     k.block[i], who, d.max_block_dim[i]);
      if (d.max_grid_dim[i] > 0 && k.grid[i] > static_cast<uint32_t>(d.max_grid_dim[i]))
        return error(DP_ERR_DEVICE_LIMITS, "kernel {}: grid dimension {} is {}, {} allows {}", k.key, "xyz"[i],
                     k.grid[i], who, d.max_grid_dim[i]);
    }
    if (d.max_registers_per_block > 0 && uint64_t{k.registers} * threads > static_cast<uint64_t>(d.max_registers_per_block))
      return error(DP_ERR_DEVICE_LIMITS, "kernel {}: {} registers per thread x {} threads = {} registers per block, {} has "
                   "{}", k.key, k.registers, threads, uint64_t{k.registers} * threads, who, d.max_registers_per_block);
    if (d.max_shared_per_block > 0 && k.shared_bytes > static_cast<uint64_t>(d.max_shared_per_block))
      return error(DP_ERR_DEVICE_LIMITS, "kernel {}: {} bytes of static shared memory per block, {} allows {}", k.key,
                   k.shared_bytes, who, d.max_shared_per_block);
    // Dynamic shared memory comes on top of the static; beyond the default limit the function opts in.
    const uint64_t shared = uint64_t{k.shared_bytes} + k.dynamic_shared_bytes;
    const int64_t shared_limit = d.max_shared_per_block_optin > 0 ? d.max_shared_per_block_optin : d.max_shared_per_block;
    if (k.dynamic_shared_bytes > 0 && shared_limit > 0 && shared > static_cast<uint64_t>(shared_limit))
      return error(DP_ERR_DEVICE_LIMITS, "kernel {}: {} bytes of shared memory per block ({} static + {} dynamic), {} "
                   "allows {}{}", k.key, shared, k.shared_bytes, k.dynamic_shared_bytes, who, shared_limit,
                   d.max_shared_per_block_optin > 0 ? " with opt-in" : "");
  }
  for (const format::PrefetchEntry& p : m.prefetch)
    if (d.max_grid_dim[0] > 0 && p.grid > d.max_grid_dim[0])
      return error(DP_ERR_DEVICE_LIMITS, "prefetch table {} of layer {}: grid {}, {} allows {}", p.point, p.layer, p.grid,
                   who, d.max_grid_dim[0]);
  return ok();
}

Status check_kernels(const dp_bundle& b, const std::string& target) {
  const format::Manifest& m = b.manifest();
  bool prefetch_kernel = false;
  for (const format::KernelEntry& k : m.kernels) {
    if (k.target != target) continue;
    if (k.role != "final_norm" && k.role != "lm_head" && k.role != "prefetch" && k.role != "layer" &&
        k.role != "indexer")
      return error(DP_ERR_NOT_SUPPORTED, "{}: kernel {} has role \"{}\", which libdecodepack {} does not know (known: "
                   "final_norm, lm_head, prefetch, layer, indexer): use a libdecodepack as new as the decodepack that built it",
                   b.reader.label(), k.key, k.role, dp_version_string());
    if (k.role == "prefetch") prefetch_kernel = true;
    if (k.params.empty() || k.param_bytes > kMaxParamBytes)
      return error(DP_ERR_NOT_SUPPORTED, "{}: kernel {}: {} bytes of parameters in {} entries, expected 1..{} bytes",
                   b.reader.label(), k.key, k.param_bytes, k.params.size(), kMaxParamBytes);
    if (k.width != 0 && k.q != b.deploy.q)
      return error(DP_ERR_FORMAT, "{}: kernel {}: q {}, but the deploy's num_speculative_tokens gives q = {}",
                   b.reader.label(), k.key, k.q, b.deploy.q);
    for (const format::KernelParamEntry& p : k.params) {
      const unsigned size = param_kind_size(p.kind);
      if (size == 0 || p.size != size || p.offset % size != 0)
        return error(DP_ERR_FORMAT, "{}: kernel {}: parameter {} has kind \"{}\", size {}, offset {} (expected pointer/8, "
                     "u32/4 or f32/4 at an offset that is a multiple of its size)", b.reader.label(), k.key, p.name,
                     p.kind, p.size, p.offset);
      // Kernels of layer programs are bound by the programs' arguments (checked with the manifest); the
      // indexer's by src/indexer.cpp, which names every parameter it fills (checked at launch).
      if (k.role != "layer" && k.role != "indexer" && !param_source(k.role, p.name, p.kind))
        return error(DP_ERR_NOT_SUPPORTED, "{}: kernel {} (role {}): parameter {} ({}) is not one libdecodepack {} can "
                     "supply: use a libdecodepack as new as the decodepack that built the bundle", b.reader.label(), k.key,
                     k.role, p.name, p.kind, dp_version_string());
    }
  }
  if (!m.prefetch.empty() && !prefetch_kernel)
    return error(DP_ERR_FORMAT, "{}: the bundle has {} prefetch tables but no prefetch kernel for {}", b.reader.label(),
                 m.prefetch.size(), target);
  return ok();
}

}  // namespace dp::rt
