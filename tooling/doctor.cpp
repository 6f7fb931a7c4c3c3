// `decodepack doctor`'s report: what this machine can build and run. The device toolchains (found
// exactly as `build` finds them), the GPU drivers and devices (asked through libdecodepack, which opens the
// drivers with dlopen as a serving host does), the targets each makes possible, and the compile
// cache. A report: whatever is missing is printed, and the exit status is 0.
#include "tooling/doctor.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "backend/cache.h"
#include "backend/target.h"
#include "backend/toolchain.h"
#include "common/error.h"
#include "common/json.h"
#include "decodepack/decodepack.h"
#include "format/targets.h"
#include "src/targets.h"

namespace fs = std::filesystem;

namespace dp::tools {
namespace {

struct ToolchainProbe {
  std::unique_ptr<backend::DeviceToolchain> tc;
  std::string error;  // why there is none
};

template <typename Make>
ToolchainProbe probe_toolchain(Make make, const backend::ToolchainOptions& o) {
  ToolchainProbe p;
  try {
    p.tc = make(o);
  } catch (const Error& e) {
    p.error = e.what();
  }
  return p;
}

Json toolchain_json(const ToolchainProbe& p, const char* targets) {
  if (!p.tc)
    return {{"found", false}, {"targets", targets}, {"version", nullptr}, {"location", nullptr},
            {"error", p.error}};
  Json j{{"found", true}, {"targets", targets}, {"version", p.tc->version()}, {"location", p.tc->location()},
         {"error", nullptr}};
  if (p.tc->vendor() == backend::Vendor::nvidia)
    // NVRTC assembles SASS in process; nvcc runs the toolkit's ptxas beside it.
    j["ptxas"] = p.tc->version().rfind("nvrtc", 0) == 0 ? "inside NVRTC" : "run by nvcc";
  return j;
}

struct Device {
  int ordinal = 0;
  dp_device_desc desc{};
};

struct DriverProbe {
  bool loaded = false;
  std::string error;  // no driver, or a driver that failed
  std::vector<Device> devices;
};

std::string take_message(dp_status* s) {
  std::string m = dp_status_message(s);
  dp_status_free(s);
  return m;
}

DriverProbe probe_driver(int32_t vendor) {
  DriverProbe p;
  int32_t n = 0;
  if (dp_status* s = dp_device_count(vendor, &n)) {
    p.loaded = dp_status_code(s) != DP_ERR_DRIVER_UNAVAILABLE;
    p.error = take_message(s);
    return p;
  }
  p.loaded = true;
  for (int32_t i = 0; i < n; ++i) {
    Device d;
    d.ordinal = i;
    dp_device_desc_init(&d.desc);
    if (dp_status* s = dp_device_query(vendor, i, &d.desc)) {
      p.error += (p.error.empty() ? "" : "; ") + fmt::format("device {}: {}", i, take_message(s));
      continue;
    }
    p.devices.push_back(d);
  }
  return p;
}

std::string driver_version_text(int32_t vendor, int32_t v) {
  if (v <= 0) return "unknown";
  return vendor == DP_VENDOR_CUDA ? rt::cuda_version_text(v) : std::to_string(v);
}

Json driver_json(const DriverProbe& p, int32_t vendor) {
  Json devices = Json::array();
  for (const Device& d : p.devices)
    devices.push_back({{"ordinal", d.ordinal}, {"name", d.desc.name}, {"arch", d.desc.arch},
                       {"driver_version", driver_version_text(vendor, d.desc.driver_version)}});
  return {{"loaded", p.loaded}, {"devices", devices},
          {"error", p.error.empty() ? Json(nullptr) : Json(p.error)}};
}

// Whether code objects for `t` run on one of the devices; `why` says why not (for the first device).
std::vector<int> runnable_on(const backend::TargetInfo& t, const DriverProbe& drv, const char* api,
                             const ToolchainProbe& tc, std::string* why) {
  std::vector<int> ordinals;
  if (drv.devices.empty()) {
    *why = drv.loaded ? fmt::format("no {} device", api) : fmt::format("no {} driver", api);
    return ordinals;
  }
  for (const Device& d : drv.devices) {
    std::string reason;
    if (!rt::target_runs_on(t.name, d.desc.arch, &reason)) {
      if (why->empty()) *why = fmt::format("device {} ({}, {}): {}", d.ordinal, d.desc.name, d.desc.arch, reason);
      continue;
    }
    if (t.vendor == backend::Vendor::nvidia) {
      // Both what the architecture needs and what code objects from this machine's toolkit need.
      int need = rt::min_driver_for_arch(t.name);
      if (tc.tc) need = std::max(need, rt::min_driver_for_toolchain(tc.tc->version()));
      if (need > 0 && d.desc.driver_version > 0 && d.desc.driver_version < need) {
        if (why->empty())
          *why = fmt::format("device {}: driver {} is older than {} (needs {})", d.ordinal,
                             rt::cuda_version_text(d.desc.driver_version), t.name, rt::cuda_version_text(need));
        continue;
      }
    }
    ordinals.push_back(d.ordinal);
  }
  return ordinals;
}

Json cache_json(const std::string& cache_dir) {
  Json j{{"dir", nullptr}, {"exists", false}, {"entries", 0}, {"bytes", 0}, {"error", nullptr}};
  fs::path dir;
  try {
    dir = cache_dir.empty() ? backend::CompileCache::default_dir() : fs::path(cache_dir);
  } catch (const Error& e) {
    j["error"] = e.what();
    return j;
  }
  j["dir"] = dir.string();
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return j;
  j["exists"] = true;
  uint64_t entries = 0, bytes = 0;
  // Entries live under v1/<2 hex>/<key>; a sibling tree of another cache version is counted too.
  fs::recursive_directory_iterator it(dir, fs::directory_options::skip_permission_denied, ec);
  for (; !ec && it != fs::recursive_directory_iterator(); it.increment(ec)) {
    std::error_code fe;
    if (!it->is_regular_file(fe)) continue;
    ++entries;
    bytes += it->file_size(fe);
  }
  if (ec) j["error"] = fmt::format("{}: {}", dir.string(), ec.message());
  j["entries"] = entries;
  j["bytes"] = bytes;
  return j;
}

std::string human_bytes(uint64_t b) {
  if (b < 1024) return fmt::format("{} bytes", b);
  if (b < (1ull << 20)) return fmt::format("{:.1f} KiB", b / 1024.0);
  if (b < (1ull << 30)) return fmt::format("{:.1f} MiB", b / 1048576.0);
  return fmt::format("{:.2f} GiB", b / 1073741824.0);
}

// Indents the continuation lines of a multi-line message under its first line.
std::string indent(const std::string& s, const char* pad) {
  std::string out;
  for (char c : s) {
    out.push_back(c);
    if (c == '\n') out += pad;
  }
  return out;
}

void print_text(const Json& r) {
  std::printf("decodepack %s\n\nToolchains\n", r["decodepack"].get<std::string>().c_str());
  for (const char* v : {"nvidia", "amd"}) {
    const Json& t = r["toolchains"][v];
    const std::string head = fmt::format("{} ({})", v, t["targets"].get<std::string>());
    if (t["found"].get<bool>()) {
      std::printf("  %-16s %s\n  %-16s %s\n", head.c_str(), t["version"].get<std::string>().c_str(), "",
                  t["location"].get<std::string>().c_str());
      if (t.contains("ptxas")) std::printf("  %-16s ptxas %s\n", "", t["ptxas"].get<std::string>().c_str());
    } else {
      std::printf("  %-16s not found: %s\n", head.c_str(), indent(t["error"].get<std::string>(), "    ").c_str());
    }
  }
  std::printf("\nDrivers and devices\n");
  for (const char* v : {"cuda", "hip"}) {
    const Json& d = r["drivers"][v];
    if (!d["loaded"].get<bool>()) {
      std::printf("  %-16s no driver: %s\n", v, d["error"].get<std::string>().c_str());
      continue;
    }
    std::printf("  %-16s driver loaded, %zu device%s\n", v, d["devices"].size(), d["devices"].size() == 1 ? "" : "s");
    for (const Json& dev : d["devices"])
      std::printf("  %-16s %d: %s, %s, driver %s\n", "", dev["ordinal"].get<int>(),
                  dev["name"].get<std::string>().c_str(), dev["arch"].get<std::string>().c_str(),
                  dev["driver_version"].get<std::string>().c_str());
    if (!d["error"].is_null()) std::printf("  %-16s %s\n", "", d["error"].get<std::string>().c_str());
  }
  std::printf("\nTargets          build  run\n");
  for (const Json& t : r["targets"]) {
    std::string run = "no";
    if (!t["run_devices"].empty()) {
      run = "yes (device";
      for (const Json& o : t["run_devices"]) run += fmt::format(" {}", o.get<int>());
      run += ")";
    } else if (!t["run_error"].is_null()) {
      run += ": " + t["run_error"].get<std::string>();
    }
    std::printf("  %-14s %-6s %s\n", t["name"].get<std::string>().c_str(), t["build"].get<bool>() ? "yes" : "no",
                run.c_str());
  }
  // Why a target cannot be built, once per distinct reason (one missing toolchain covers many targets).
  std::vector<std::string> reasons;
  for (const Json& t : r["targets"]) {
    if (t["build"].get<bool>() || t["build_error"].is_null()) continue;
    std::string why = t["build_error"].get<std::string>();
    if (std::find(reasons.begin(), reasons.end(), why) == reasons.end()) reasons.push_back(why);
  }
  for (const std::string& why : reasons) std::printf("  cannot build: %s\n", indent(why, "    ").c_str());
  const Json& c = r["cache"];
  std::printf("\nKernel cache\n");
  if (c["dir"].is_null())
    std::printf("  none: %s\n", c["error"].get<std::string>().c_str());
  else if (!c["exists"].get<bool>())
    std::printf("  %s (not created yet)\n", c["dir"].get<std::string>().c_str());
  else
    std::printf("  %s: %llu entr%s, %s\n", c["dir"].get<std::string>().c_str(),
                static_cast<unsigned long long>(c["entries"].get<uint64_t>()),
                c["entries"].get<uint64_t>() == 1 ? "y" : "ies", human_bytes(c["bytes"].get<uint64_t>()).c_str());
  if (!c["dir"].is_null() && !c["error"].is_null()) std::printf("  %s\n", c["error"].get<std::string>().c_str());
}

}  // namespace

Json doctor_report(const DoctorOptions& o) {
  backend::ToolchainOptions to;
  to.cuda_root = o.cuda_root;
  to.hip_clang = o.hip_clang;
  const ToolchainProbe nvidia = probe_toolchain(backend::make_cuda_toolchain, to);
  const ToolchainProbe amd = probe_toolchain(backend::make_hip_toolchain, to);
  const DriverProbe cuda = probe_driver(DP_VENDOR_CUDA);
  const DriverProbe hip = probe_driver(DP_VENDOR_HIP);

  Json targets = Json::array();
  for (const backend::TargetInfo& t : backend::known_targets()) {
    const bool nv = t.vendor == backend::Vendor::nvidia;
    const ToolchainProbe& tc = nv ? nvidia : amd;
    Json build_error = nullptr;
    if (!tc.tc) {
      build_error = fmt::format("no {} toolchain", nv ? "CUDA (NVRTC or nvcc)" : "HIP (clang++)");
    } else {
      try {
        tc.tc->check_target(t);
      } catch (const Error& e) {
        build_error = e.what();
      }
    }
    std::string run_why;
    const std::vector<int> run = runnable_on(t, nv ? cuda : hip, nv ? "CUDA" : "HIP", tc, &run_why);
    const format::GpuTarget* g = format::find_gpu_target(t.name);
    targets.push_back({{"name", t.name}, {"vendor", backend::to_string(t.vendor)},
                       {"gpus", g ? g->gpus : ""}, {"build", build_error.is_null()},
                       {"build_error", build_error}, {"run", !run.empty()}, {"run_devices", run},
                       {"run_error", run.empty() ? Json(run_why) : Json(nullptr)}});
  }
  return Json{
      {"decodepack", DP_VERSION_STRING},
      {"toolchains", {{"nvidia", toolchain_json(nvidia, "sm_XX")}, {"amd", toolchain_json(amd, "gfxNNN")}}},
      {"drivers", {{"cuda", driver_json(cuda, DP_VENDOR_CUDA)}, {"hip", driver_json(hip, DP_VENDOR_HIP)}}},
      {"targets", targets},
      {"cache", cache_json(o.cache_dir)}};
}

void print_doctor_text(const Json& report) { print_text(report); }

}  // namespace dp::tools
