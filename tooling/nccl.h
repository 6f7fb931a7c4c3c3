// NCCL, the host's communicator under DCP (`indexer-run`'s all-gathers), opened with dlopen like the
// CUDA driver, so that nothing links it and a one-rank run never needs it. The declarations are nccl.h's
// documented ABI: the unique id (128 bytes), the communicator handle, ncclUint8, and the five entry
// points used. The one NCCL table of the project.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "decodepack/decodepack.h"

namespace dp::tools {

struct NcclUniqueId {
  char internal[128];
};
using NcclComm = struct ncclComm*;
inline constexpr int kNcclUint8 = 1;

struct Nccl {
  std::string library;
  int (*GetUniqueId)(NcclUniqueId*) = nullptr;
  int (*CommInitRank)(NcclComm*, int, NcclUniqueId, int) = nullptr;
  int (*AllGather)(const void*, void*, size_t, int, NcclComm, void*) = nullptr;
  int (*CommDestroy)(NcclComm) = nullptr;
  const char* (*GetErrorString)(int) = nullptr;

  // Opens `name` (a library name or path). Throws dp::Error(device) naming the library that cannot be
  // opened or the missing entry point.
  static Nccl open(const std::string& name);
  // Throws dp::Error(device) "<call> failed: <NCCL's text> (r)" unless r is ncclSuccess (0).
  void check(int r, const char* call) const;
};

// One rank's communicator, as the user pointer of nccl_all_gather.
struct Communicator {
  const Nccl* nccl = nullptr;
  NcclComm comm = nullptr;
  int last_error = 0;
};

// dp_indexer_io's all_gather callback: ncclAllGather of `bytes` bytes on `stream` (user: a Communicator).
int32_t nccl_all_gather(void* user, uint64_t send, uint64_t recv, uint64_t bytes, dp_stream stream);

}  // namespace dp::tools
