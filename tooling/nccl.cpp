#include "tooling/nccl.h"

#include <dlfcn.h>

#include <type_traits>

#include "common/error.h"

namespace dp::tools {

Nccl Nccl::open(const std::string& name) {
  void* h = ::dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!h)
    fail(Errc::device, "DCP needs NCCL for the all-gathers: cannot open {} ({}); pass --nccl PATH or set "
         "DECODEPACK_NCCL (e.g. the libnccl.so.2 that PyTorch ships)", name, ::dlerror());
  Nccl n;
  n.library = name;
  auto sym = [&](auto& fn, const char* s) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(::dlsym(h, s));
    if (!fn) fail(Errc::device, "{} lacks {}", name, s);
  };
  sym(n.GetUniqueId, "ncclGetUniqueId");
  sym(n.CommInitRank, "ncclCommInitRank");
  sym(n.AllGather, "ncclAllGather");
  sym(n.CommDestroy, "ncclCommDestroy");
  sym(n.GetErrorString, "ncclGetErrorString");
  return n;
}

void Nccl::check(int r, const char* call) const {
  if (r != 0) fail(Errc::device, "{} failed: {} ({})", call, GetErrorString(r), r);
}

int32_t nccl_all_gather(void* user, uint64_t send, uint64_t recv, uint64_t bytes, dp_stream stream) {
  auto* c = static_cast<Communicator*>(user);
  c->last_error = c->nccl->AllGather(reinterpret_cast<const void*>(send), reinterpret_cast<void*>(recv), bytes,
                                     kNcclUint8, c->comm, stream);
  return c->last_error;
}

}  // namespace dp::tools
