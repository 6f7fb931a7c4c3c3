// NCCL for the all-reduce path of tensor parallelism (format 1.8): libnccl.so.2 opened with dlopen on
// first use, as the GPU drivers are (src/driver.*), so that nothing links it and a bundle that never
// all-reduces with NCCL never needs it. The declarations are nccl.h's documented ABI: the 128-byte
// unique id, the communicator handle, the data type and reduction codes, and the entry points used.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "src/status.h"

namespace dp::rt {

struct NcclUniqueId {
  char internal[128];
};
using NcclComm = struct ncclComm*;
inline constexpr int kNcclBfloat16 = 9;  // ncclBfloat16 (NCCL 2.10 and later)
inline constexpr int kNcclSum = 0;       // ncclSum
// 2.10.0 (NCCL_VERSION_CODE 21000): the first release with ncclBfloat16; collectives were already
// capturable into CUDA graphs (2.9).
inline constexpr int kNcclMinVersion = 21000;
inline constexpr const char* kNcclDefaultLibrary = "libnccl.so.2";

struct NcclApi {
  std::string library;  // the name or path opened
  int version = 0;      // ncclGetVersion's code: major * 10000 + minor * 100 + patch
  int (*GetVersion)(int*) = nullptr;
  int (*GetUniqueId)(NcclUniqueId*) = nullptr;
  int (*CommInitRank)(NcclComm*, int, NcclUniqueId, int) = nullptr;
  int (*AllReduce)(const void*, void*, size_t, int, int, NcclComm, void*) = nullptr;
  int (*CommDestroy)(NcclComm) = nullptr;
  const char* (*GetErrorString)(int) = nullptr;
};

// "2.21.5" from a version code (also the pre-2.9 encoding major * 1000 + minor * 100 + patch).
std::string nccl_version_text(int code);

// The library to open: `library` when non-empty, else $DECODEPACK_NCCL_LIBRARY when set, else
// libnccl.so.2.
std::string nccl_library_name(const char* library);

// The process's table for library `name` (nccl_library_name's), opened once and never closed.
// DP_ERR_NCCL_UNAVAILABLE naming the library and why: it cannot be opened, it lacks an entry point
// (named), or it is older than 2.10.0 (both versions named). A failure is not cached.
Result<const NcclApi*> nccl_api(const std::string& name);

// DP_OK for ncclSuccess (0); else DP_ERR_COMMUNICATOR "<call> failed: <NCCL's text> (r)[: what]".
Status nccl_check(const NcclApi& api, int r, const char* call, const std::string& what = {});

}  // namespace dp::rt
