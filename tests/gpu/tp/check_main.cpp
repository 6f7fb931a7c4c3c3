// dp_tp_allreduce_check KERNEL_DIR [options]: the in-kernel all-reduce (templates/allreduce.h) with its
// ranks as separate processes on one GPU, exchanging CUDA IPC handles through files, as a serving host's
// TP workers would (IPC works within one device). Not a gtest: the parent forks the ranks before any
// CUDA call and only waits for them (killing them past a deadline, which is the "no hang" check).
//
//   --ranks R (2)  --rows W (8)  --hidden H (2304)  --layers L (4)  --steps S (3)
//   --graph        capture one step's launches into a CUDA graph once, replay it every step
//   --skip R:L     rank R does not launch layer L's two all-reduces in step 0 (the fault test)
//   --timeout-us U (2000000): the bound of every wait (ranks on one device are time-sliced: keep it >= 1 s)
//
// Checks. Without --skip: every rank's output of every (step, layer, op) equals, bit for bit, the fp32
// sum in rank order of every rank's bf16 partial rounded once to bf16, and no error flag is set. With
// --skip: no rank hangs (each step ends within about one bound), every rank's error flag is non-zero
// after step 0, some rank recorded DP_FLAG_WAIT_TIMEOUT naming the skipped layer and the skipping rank
// (or the skipping rank its own timeout, waiting in its next layer: which rank gives up first is a race),
// and the later steps still run to the end. Exit 0 when every check passed, 1 otherwise. It links
// libcuda (the toolkit's stub at link time), so ctest skips it (77) where no driver is installed.
#include <cuda.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace fs = std::filesystem;

namespace {

struct Options {
  fs::path dir;
  int ranks = 2, rows = 8, hidden = 2304, layers = 4, steps = 3;
  bool graph = false;
  int skip_rank = -1, skip_layer = -1;
  uint32_t timeout_us = 2000000;
};

// Exchange buffer bytes (templates/allreduce.h, runtime/src/allreduce.h).
uint64_t exchange_bytes(const Options& o) {
  return 512 + 2ull * 8 * 64 * 128 + 2ull * o.ranks * o.rows * o.hidden * 2;
}

float bf16_to_f32(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint16_t f32_to_bf16(float f) {  // round to nearest even, as the kernel
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

// Rank r's partial element i of (step, layer, op): a value in [-2, 2) from a hash, exactly a bf16.
uint16_t partial_value(int rank, int step, int layer, int op, uint64_t i) {
  uint64_t x = (static_cast<uint64_t>(rank) << 56) ^ (static_cast<uint64_t>(step) << 40) ^
               (static_cast<uint64_t>(layer) << 24) ^ (static_cast<uint64_t>(op) << 20) ^ i;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ull;
  x ^= x >> 33;
  return f32_to_bf16(static_cast<float>(x % 4096) / 1024.0f - 2.0f);
}

bool wait_for_files(const fs::path& dir, const std::string& stem, int n, int seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (std::chrono::steady_clock::now() < end) {
    int have = 0;
    for (int r = 0; r < n; ++r) have += fs::exists(dir / (stem + std::to_string(r)));
    if (have == n) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

void write_file(const fs::path& p, const void* data, size_t n) {
  const fs::path tmp = p.string() + ".tmp";
  std::ofstream(tmp, std::ios::binary).write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
  fs::rename(tmp, p);
}

#define CK(call)                                                                                   \
  do {                                                                                             \
    const CUresult r_ = (call);                                                                    \
    if (r_ != CUDA_SUCCESS) {                                                                      \
      const char* s_ = nullptr;                                                                    \
      cuGetErrorName(r_, &s_);                                                                     \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", rank, #call, s_ ? s_ : "?");                \
      return 1;                                                                                    \
    }                                                                                              \
  } while (0)

int run_rank(const Options& o, int rank, const fs::path& rdv) {
  CK(cuInit(0));
  CUdevice dev;
  CUcontext ctx;
  CK(cuDeviceGet(&dev, 0));
  CK(cuDevicePrimaryCtxRetain(&ctx, dev));
  CK(cuCtxSetCurrent(ctx));
  const std::string name = "allreduce_w" + std::to_string(o.rows) + "_h" + std::to_string(o.hidden) + "_r" +
                           std::to_string(o.ranks);
  std::ifstream in(o.dir / (name + ".sm_90a.cubin"), std::ios::binary);
  if (!in) {
    std::fprintf(stderr, "rank %d: no %s.sm_90a.cubin in %s (run dp_tp_allreduce_build first)\n", rank, name.c_str(),
                 o.dir.c_str());
    return 1;
  }
  std::stringstream image;
  image << in.rdbuf();
  CUmodule mod;
  CUfunction fn;
  CK(cuModuleLoadData(&mod, image.str().data()));
  CK(cuModuleGetFunction(&fn, mod, name.c_str()));
  int blocks = 0;
  {
    const uint64_t vecs = static_cast<uint64_t>(o.rows) * o.hidden / 8;
    blocks = static_cast<int>(std::min<uint64_t>(64, std::max<uint64_t>(1, (vecs + 255) / 256)));
  }

  // This rank's exchange buffer, zeroed, exported; the others' opened.
  const uint64_t bytes = exchange_bytes(o);
  CUdeviceptr mine;
  CK(cuMemAlloc(&mine, bytes));
  CK(cuMemsetD8(mine, 0, bytes));
  CUipcMemHandle handle;
  CK(cuIpcGetMemHandle(&handle, mine));
  write_file(rdv / ("handle." + std::to_string(rank)), &handle, sizeof(handle));
  if (!wait_for_files(rdv, "handle.", o.ranks, 60)) {
    std::fprintf(stderr, "rank %d: the other ranks' IPC handles did not arrive within 60 s\n", rank);
    return 1;
  }
  std::vector<uint64_t> peers(o.ranks);
  for (int p = 0; p < o.ranks; ++p) {
    if (p == rank) {
      peers[p] = mine;
      continue;
    }
    CUipcMemHandle h;
    std::ifstream(rdv / ("handle." + std::to_string(p)), std::ios::binary).read(reinterpret_cast<char*>(&h), sizeof(h));
    CUdeviceptr ptr;
    CK(cuIpcOpenMemHandle(&ptr, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS));
    peers[p] = ptr;
  }
  CUdeviceptr table, flag;
  CK(cuMemAlloc(&table, peers.size() * 8));
  CK(cuMemcpyHtoD(table, peers.data(), peers.size() * 8));
  CK(cuMemAlloc(&flag, 4));
  CK(cuMemsetD8(flag, 0, 4));
  const size_t n = static_cast<size_t>(o.rows) * o.hidden;
  std::vector<CUdeviceptr> partial(o.layers * 2), out(o.layers * 2);
  for (int i = 0; i < o.layers * 2; ++i) {
    CK(cuMemAlloc(&partial[i], n * 2));
    CK(cuMemAlloc(&out[i], n * 2));
  }
  CUstream stream;
  CK(cuStreamCreate(&stream, CU_STREAM_NON_BLOCKING));
  // Every rank zeroed its buffer before any rank launches.
  const char one = 1;
  write_file(rdv / ("ready." + std::to_string(rank)), &one, 1);
  if (!wait_for_files(rdv, "ready.", o.ranks, 60)) {
    std::fprintf(stderr, "rank %d: the other ranks were not ready within 60 s\n", rank);
    return 1;
  }

  auto launch_step = [&](int step) -> CUresult {
    for (int l = 0; l < o.layers; ++l)
      for (uint32_t op = 0; op < 2; ++op) {
        if (step == 0 && rank == o.skip_rank && l == o.skip_layer) continue;
        CUdeviceptr pa = partial[l * 2 + op], po = out[l * 2 + op];
        uint32_t r32 = static_cast<uint32_t>(rank), layer = static_cast<uint32_t>(l), timeout = o.timeout_us;
        void* args[] = {&pa, &po, &table, &flag, &r32, &layer, &op, &timeout};
        if (CUresult r = cuLaunchKernel(fn, blocks, 1, 1, 256, 1, 1, 0, stream, args, nullptr); r != CUDA_SUCCESS)
          return r;
      }
    return CUDA_SUCCESS;
  };
  CUgraphExec exec = nullptr;
  if (o.graph) {
    // Captured once, replayed every step: the tags come from the device's sequence counts, so a replay
    // needs nothing re-armed. (Not with --skip: a graph bakes one step's launches.)
    CUgraph g;
    CK(cuStreamBeginCapture(stream, CU_STREAM_CAPTURE_MODE_THREAD_LOCAL));
    CK(launch_step(1));
    CK(cuStreamEndCapture(stream, &g));
    CK(cuGraphInstantiate(&exec, g, 0));
  }

  int failures = 0;
  std::vector<uint16_t> host(n), got(n);
  for (int s = 0; s < o.steps; ++s) {
    for (int l = 0; l < o.layers; ++l)
      for (int op = 0; op < 2; ++op) {
        for (size_t i = 0; i < n; ++i) host[i] = partial_value(rank, s, l, op, i);
        CK(cuMemcpyHtoD(partial[l * 2 + op], host.data(), n * 2));
      }
    const auto t0 = std::chrono::steady_clock::now();
    if (exec && !(s == 0 && o.skip_rank >= 0)) CK(cuGraphLaunch(exec, stream));
    else CK(launch_step(s));
    CK(cuStreamSynchronize(stream));
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    uint32_t fv = 0;
    CK(cuMemcpyDtoH(&fv, flag, 4));
    std::printf("rank %d step %d: %.3f ms, error flag %#010x\n", rank, s, ms, fv);
    if (o.skip_rank < 0) {
      if (fv) ++failures;
      for (int l = 0; l < o.layers; ++l)
        for (int op = 0; op < 2; ++op) {
          CK(cuMemcpyDtoH(got.data(), out[l * 2 + op], n * 2));
          size_t bad = 0;
          for (size_t i = 0; i < n; ++i) {
            float acc = 0;
            for (int p = 0; p < o.ranks; ++p) acc += bf16_to_f32(partial_value(p, s, l, op, i));
            bad += got[i] != f32_to_bf16(acc);
          }
          if (bad) {
            std::printf("rank %d step %d layer %d op %d: %zu of %zu elements differ from the rank-order fp32 sum\n",
                        rank, s, l, op, bad, n);
            ++failures;
          }
        }
    } else if (ms > 3.0 * o.timeout_us / 1000.0 + 2000.0) {
      std::printf("rank %d step %d took %.0f ms, more than 3 bounds\n", rank, s, ms);
      ++failures;
    }
    if (s == 0) write_file(rdv / ("flag." + std::to_string(rank)), &fv, 4);
  }
  return failures ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (argc < 2) {
    std::fprintf(stderr, "usage: dp_tp_allreduce_check KERNEL_DIR [--ranks R] [--rows W] [--hidden H] [--layers L] "
                         "[--steps S] [--graph] [--skip RANK:LAYER] [--timeout-us U]\n");
    return 2;
  }
  o.dir = argv[1];
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string { return i + 1 < argc ? argv[++i] : ""; };
    if (a == "--ranks") o.ranks = std::atoi(next().c_str());
    else if (a == "--rows") o.rows = std::atoi(next().c_str());
    else if (a == "--hidden") o.hidden = std::atoi(next().c_str());
    else if (a == "--layers") o.layers = std::atoi(next().c_str());
    else if (a == "--steps") o.steps = std::atoi(next().c_str());
    else if (a == "--graph") o.graph = true;
    else if (a == "--timeout-us") o.timeout_us = static_cast<uint32_t>(std::strtoul(next().c_str(), nullptr, 10));
    else if (a == "--skip") {
      const std::string v = next();
      o.skip_rank = std::atoi(v.c_str());
      o.skip_layer = std::atoi(v.substr(v.find(':') + 1).c_str());
    } else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  // The rendezvous directory (IPC handles, readiness, flags) beside the kernels.
  std::string tmpl = (o.dir / "rendezvous-XXXXXX").string();
  if (!mkdtemp(tmpl.data())) {
    std::perror("mkdtemp");
    return 1;
  }
  const fs::path rdv = tmpl;
  std::vector<pid_t> kids;
  std::fflush(stdout);  // nothing buffered is duplicated into the children
  for (int r = 0; r < o.ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      const int rc = run_rank(o, r, rdv);
      std::fflush(stdout);  // _exit does not flush stdio
      _exit(rc);
    }
    kids.push_back(pid);
  }
  // Every rank must finish: a hang is a failure, reported and ended here.
  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::milliseconds(120000 + 4ll * o.steps * o.timeout_us / 1000);
  int failed = 0, left = o.ranks;
  std::vector<bool> done(o.ranks, false);
  while (left > 0) {
    for (int r = 0; r < o.ranks; ++r) {
      int status = 0;
      if (done[r] || waitpid(kids[r], &status, WNOHANG) != kids[r]) continue;
      done[r] = true;
      --left;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code) std::printf("rank %d exited %d\n", r, code);
      failed += code != 0;
    }
    if (left > 0 && std::chrono::steady_clock::now() > deadline) {
      for (int r = 0; r < o.ranks; ++r)
        if (!done[r]) {
          std::printf("rank %d hangs past the deadline: killed\n", r);
          kill(kids[r], SIGKILL);
          waitpid(kids[r], nullptr, 0);
        }
      return 1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  if (o.skip_rank >= 0) {
    bool named = false;
    for (int r = 0; r < o.ranks; ++r) {
      uint32_t v = 0;
      std::ifstream(rdv / ("flag." + std::to_string(r)), std::ios::binary).read(reinterpret_cast<char*>(&v), 4);
      const uint32_t op = (v >> 2) & 3, peer = (v >> 8) & 0xff, layer = v >> 16;
      std::printf("rank %d after step 0: flag %#010x (timeout %u, peer abort %u, op %u, peer %d, layer %d)\n", r, v,
                  v & 1, (v >> 1) & 1, op, static_cast<int>(peer) - 1, static_cast<int>(layer) - 1);
      if (v == 0) {
        std::printf("rank %d did not report the gave-up wait\n", r);
        ++failed;
      }
      // Which rank gives up first is a race: a peer waiting in the skipped layer for the skipping rank,
      // or the skipping rank waiting in its next layer for a peer still in the skipped one.
      named |= (v & 1) && ((peer == static_cast<uint32_t>(o.skip_rank) + 1 &&
                            layer == static_cast<uint32_t>(o.skip_layer) + 1) ||
                           r == o.skip_rank);
    }
    if (!named) {
      std::printf("no rank recorded a timeout waiting for rank %d in layer %d, nor rank %d for a peer\n", o.skip_rank,
                  o.skip_layer, o.skip_rank);
      ++failed;
    }
  }
  fs::remove_all(rdv);
  std::printf("%s\n", failed ? "FAILED" : "passed");
  return failed ? 1 : 0;
}
