/* A stand-in for libnccl.so.2 with nccl.h's entry points, none of which communicates: the runtime's
 * NCCL loader must refuse it for its version (FAKE_NCCL_VERSION) or for the entry point left out. */
#include <stddef.h>
#include <string.h>

typedef struct { char internal[128]; } ncclUniqueId;
typedef struct ncclComm* ncclComm_t;

int ncclGetVersion(int* v) { *v = FAKE_NCCL_VERSION; return 0; }
int ncclGetUniqueId(ncclUniqueId* id) { memset(id, 0, sizeof *id); return 0; }
int ncclCommInitRank(ncclComm_t* c, int n, ncclUniqueId id, int r) { (void)c, (void)n, (void)id, (void)r; return 5; }
#ifndef FAKE_NCCL_NO_ALLREDUCE
int ncclAllReduce(const void* s, void* r, size_t n, int t, int op, ncclComm_t c, void* st) {
  (void)s, (void)r, (void)n, (void)t, (void)op, (void)c, (void)st;
  return 5;
}
#endif
int ncclCommDestroy(ncclComm_t c) { (void)c; return 0; }
const char* ncclGetErrorString(int r) { return r ? "internal error" : "no error"; }
