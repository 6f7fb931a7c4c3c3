#include "src/nccl.h"

#include <dlfcn.h>

#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

namespace dp::rt {
namespace {

Status unavailable(const std::string& name, const std::string& why) {
  return error(DP_ERR_NCCL_UNAVAILABLE,
               "NCCL: {} {}; the bundle all-reduces with NCCL at some width (deploy \"allreduce\"), which needs "
               "libnccl.so.2 {} or later (PyTorch's wheels ship one): put it on the loader path, set "
               "DECODEPACK_NCCL_LIBRARY to its path, or build the bundle with \"allreduce\": \"in_kernel\"",
               name, why, nccl_version_text(kNcclMinVersion));
}

}  // namespace

std::string nccl_version_text(int code) {
  if (code >= 20900) return fmt::format("{}.{}.{}", code / 10000, code % 10000 / 100, code % 100);
  return fmt::format("{}.{}.{}", code / 1000, code % 1000 / 100, code % 100);
}

std::string nccl_library_name(const char* library) {
  if (library && *library) return library;
  const char* env = std::getenv("DECODEPACK_NCCL_LIBRARY");
  return env && *env ? env : kNcclDefaultLibrary;
}

Result<const NcclApi*> nccl_api(const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, std::unique_ptr<NcclApi>> opened;
  std::lock_guard<std::mutex> lock(mu);
  if (auto it = opened.find(name); it != opened.end()) return static_cast<const NcclApi*>(it->second.get());
  void* h = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    const char* why = ::dlerror();
    return unavailable(name, fmt::format("cannot be loaded: {}", why ? why : "unknown error"));
  }
  auto a = std::make_unique<NcclApi>();
  a->library = name;
  const char* missing = nullptr;
  auto sym = [&](auto& fn, const char* s) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(h, s));
    if (!fn && !missing) missing = s;
  };
  sym(a->GetVersion, "ncclGetVersion");
  sym(a->GetUniqueId, "ncclGetUniqueId");
  sym(a->CommInitRank, "ncclCommInitRank");
  sym(a->AllReduce, "ncclAllReduce");
  sym(a->CommDestroy, "ncclCommDestroy");
  sym(a->GetErrorString, "ncclGetErrorString");
  if (missing) {
    ::dlclose(h);
    return unavailable(name, fmt::format("has no entry point {} (not NCCL, or too old)", missing));
  }
  if (int r = a->GetVersion(&a->version); r != 0) {
    ::dlclose(h);
    return unavailable(name, fmt::format("ncclGetVersion failed ({})", r));
  }
  if (a->version < kNcclMinVersion) {
    const std::string v = nccl_version_text(a->version);
    ::dlclose(h);
    return unavailable(name, fmt::format("is NCCL {} (code {}), older than {} (the first with bf16 all-reduce)", v,
                                         a->version, nccl_version_text(kNcclMinVersion)));
  }
  const NcclApi* p = a.get();
  opened.emplace(name, std::move(a));  // never closed: function pointers into it stay in use until exit
  return p;
}

Status nccl_check(const NcclApi& api, int r, const char* call, const std::string& what) {
  if (r == 0) return ok();
  const char* text = api.GetErrorString ? api.GetErrorString(r) : nullptr;
  return error(DP_ERR_COMMUNICATOR, "{} failed: {} ({}){}{}", call, text ? text : "unknown NCCL error", r,
               what.empty() ? "" : ": ", what);
}

}  // namespace dp::rt
