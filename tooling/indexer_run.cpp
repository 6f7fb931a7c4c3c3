// decodepack indexer-run: the FP4 indexer prefill of a bundle on one GPU per DCP rank, through
// libdecodepack as a host calls it, checked against the CPU reference (compiler/indexer/reference.h).
//
// What a run does, per rank (one thread and one GPU each; ranks 0..W-1 of the bundle's dcp.size W):
//   1. a session on the rank's GPU; a key cache of the requested layout and block stride (zeroed), the
//      block tables (block ids shuffled), q, head weights and the output (poisoned);
//   2. dp_indexer_write_keys with vLLM's DCP slot mapping (-1 for the positions other ranks hold);
//   3. dp_indexer_prepare over the request sets, dp_indexer_prefill (under DCP the all-gathers go through
//      NCCL, opened with dlopen: the host's communicator, as vLLM's DCP group would be);
//   4. checks: every byte of the rank's cache equals the reference's (quantisation and placement exact);
//      every row of the output equals the reference top-k, or differs only among scores within the fp32
//      accumulation tolerance of the k-th best (near ties); rows with fewer keys than k end in -1.
// Inputs are random (keys with a spread of group magnitudes, some keys repeated so that exact score ties
// occur and must go to the lower position), or read from --inputs DIR (meta.json, keys.f32, q.f32,
// w.f32: e.g. written by tests/gpu/hf_indexer_check.py from HF transformers' DeepseekV32Indexer); the
// GPU's top-k and its cache read back and dequantised are written there (dp_topk.i32, dp_keys.f32).
#include "tooling/indexer_run.h"

#include <atomic>
#include <chrono>
#include <exception>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <thread>

#include "deploy/deploy.h"
#include "common/dtype.h"
#include "common/error.h"
#include "common/fs.h"
#include "common/json.h"
#include "indexer/geometry.h"
#include "indexer/key.h"
#include "indexer/reference.h"
#include "tooling/device.h"
#include "tooling/indexer_check.h"
#include "tooling/indexer_workload.h"
#include "tooling/json_output.h"
#include "tooling/nccl.h"

namespace dp::tools {
namespace {

namespace fs = std::filesystem;
namespace ix = dp::indexer;

using namespace ixrun;  // inputs and plan (indexer_workload.h), reference and comparison (indexer_check.h)

using Options = IndexerRunOptions;

// ---- one rank on its GPU ----------------------------------------------------------------------------

struct RankResult {
  int rank = 0;
  std::string device;
  double ms = 0;
  std::vector<uint8_t> cache;  // the cache read back
  std::vector<int32_t> out;    // [rows, k]
  std::vector<double> repeat_ms;  // --repeat: each further prefill
  bool repeat_identical = true;   // every further prefill wrote the same output as the first
  dp_indexer_plan_info info{};
  std::string error;
  int error_code = 0;
};

void run_rank(const Options& o, dp_bundle* bundle, const Inputs& in, const Layout& L, int rank, int device,
              const Nccl* nccl, const NcclUniqueId* id, RankResult& res) {
  const Driver& d = Driver::get();
  Context ctx(d, device);
  res.device = fmt::format("{} (device {})", ctx.name(), device);
  DeviceMemory mem(d);
  Stream stream(d);
  SessionHandle sh;  // the session only: the bundle is run_indexer's, shared by every rank (immutable once open)
  dp_session_options so;
  dp_session_options_init(&so);
  so.device = device;
  so.rank = rank;  // the DCP group is made of the first W tensor-parallel ranks
  rt(dp_session_create(bundle, &so, &sh.s), fmt::format("creating the session of rank {}", rank));

  Communicator comm;
  if (L.world > 1) {
    comm.nccl = nccl;
    nccl->check(nccl->CommInitRank(&comm.comm, static_cast<int>(L.world), *id, rank), "ncclCommInitRank");
  }
  struct CommGuard {
    Communicator& c;
    ~CommGuard() {
      if (c.comm) c.nccl->CommDestroy(c.comm);
    }
  } guard{comm};

  const int64_t T = in.total_keys(), rows = in.rows(), K = in.k;
  auto upload = [&](const void* src, size_t bytes, const char* what) {
    const CUdeviceptr p = mem.alloc(bytes, what);
    if (bytes) d.check(d.MemcpyHtoD(p, src, bytes), "cuMemcpyHtoD", what);
    return p;
  };
  const size_t cache_bytes = static_cast<size_t>(L.num_blocks * L.block_stride);
  const CUdeviceptr cache = mem.alloc(cache_bytes, "the key cache");
  d.check(d.MemsetD8Async(cache, 0, cache_bytes, stream.s), "cuMemsetD8Async");
  const CUdeviceptr keys = upload(in.keys.data(), in.keys.size() * 2, "the keys");
  const CUdeviceptr slots = upload(L.slots[rank].data(), L.slots[rank].size() * 8, "the slot mapping");
  const CUdeviceptr q = upload(in.q.data(), in.q.size() * 2, "q");
  const CUdeviceptr w = upload(in.w.data(), in.w.size() * 4, "the head weights");
  const CUdeviceptr out = mem.alloc(static_cast<size_t>(rows * K * 4), "the output");
  d.check(d.MemsetD8Async(out, 0x7f, static_cast<size_t>(rows * K * 4), stream.s), "cuMemsetD8Async");
  std::vector<CUdeviceptr> tables;
  for (const Set& s : L.sets) {
    std::vector<int32_t> t(static_cast<size_t>(s.chunk.seq_lens.size() * s.bt_stride), -1);
    for (size_t r = 0; r < s.chunk.block_table.size(); ++r)
      std::copy(s.chunk.block_table[r].begin(), s.chunk.block_table[r].end(), t.begin() + r * s.bt_stride);
    tables.push_back(upload(t.data(), t.size() * 4, "a block table"));
  }
  dp_bundle_info bi{};
  bi.size = sizeof(bi);
  rt(dp_bundle_get_info(bundle, &bi), "reading the bundle info");
  const CUdeviceptr workspace = mem.alloc(bi.indexer_prefill_workspace_bytes, "the prefill workspace");

  dp_indexer_cache c;
  dp_indexer_cache_init(&c);
  c.data = cache;
  c.num_blocks = L.num_blocks;
  c.block_stride = L.block_stride;
  c.layout = L.layout == ix::CacheLayout::packed ? DP_INDEXER_LAYOUT_PACKED : DP_INDEXER_LAYOUT_SPLIT;
  rt(dp_indexer_write_keys(sh.s, &c, keys, slots, T, stream.s), "dp_indexer_write_keys");

  std::vector<dp_indexer_requests> sets;
  for (size_t i = 0; i < L.sets.size(); ++i) {
    const Set& s = L.sets[i];
    sets.push_back({static_cast<int32_t>(s.chunk.seq_lens.size()), s.chunk.seq_lens.data(), s.chunk.query_lens.data(),
                    tables[i], s.bt_stride});
  }
  dp_indexer_batch_desc desc;
  dp_indexer_batch_desc_init(&desc);
  desc.num_sets = static_cast<int32_t>(sets.size());
  desc.sets = sets.data();
  desc.dcp_rank = rank;
  desc.max_tile_bytes = o.max_tile_bytes;
  dp_indexer_metadata* md = nullptr;
  res.info.size = sizeof(res.info);
  rt(dp_indexer_prepare(sh.s, &desc, &md, &res.info), "dp_indexer_prepare");
  std::unique_ptr<dp_indexer_metadata, void (*)(dp_indexer_metadata*)> md_guard(md, dp_indexer_metadata_free);

  dp_indexer_prefill_io io;
  dp_indexer_prefill_io_init(&io);
  io.q = q;
  io.weights = w;
  io.weight_scale = static_cast<float>(in.weight_scale);
  io.out = out;
  io.workspace = workspace;
  io.workspace_bytes = bi.indexer_prefill_workspace_bytes;
  if (L.world > 1) {
    io.all_gather = nccl_all_gather;
    io.all_gather_user = &comm;
  }
  Event e0(d), e1(d);
  d.check(d.EventRecord(e0.e, stream.s), "cuEventRecord");
  rt(dp_indexer_prefill(sh.s, md, &c, &io, stream.s), "dp_indexer_prefill");
  d.check(d.EventRecord(e1.e, stream.s), "cuEventRecord");
  d.check(d.StreamSynchronize(stream.s), "cuStreamSynchronize", "after the prefill");
  float ms = 0;
  d.check(d.EventElapsedTime(&ms, e0.e, e1.e), "cuEventElapsedTime");
  res.ms = ms;
  res.cache.resize(cache_bytes);
  res.out.resize(static_cast<size_t>(rows * K));
  d.check(d.MemcpyDtoHAsync(res.cache.data(), cache, cache_bytes, stream.s), "cuMemcpyDtoHAsync");
  d.check(d.MemcpyDtoHAsync(res.out.data(), out, res.out.size() * 4, stream.s), "cuMemcpyDtoHAsync");
  d.check(d.StreamSynchronize(stream.s), "cuStreamSynchronize");
  // Steady state: the same prefill again (NCCL's connections are set up by now), output poisoned first
  // and compared with the first run's: the kernels are deterministic.
  std::vector<int32_t> again(res.out.size());
  for (int i = 0; i < o.repeat; ++i) {
    d.check(d.MemsetD8Async(out, 0x7f, again.size() * 4, stream.s), "cuMemsetD8Async");
    d.check(d.EventRecord(e0.e, stream.s), "cuEventRecord");
    rt(dp_indexer_prefill(sh.s, md, &c, &io, stream.s), "dp_indexer_prefill");
    d.check(d.EventRecord(e1.e, stream.s), "cuEventRecord");
    d.check(d.MemcpyDtoHAsync(again.data(), out, again.size() * 4, stream.s), "cuMemcpyDtoHAsync");
    d.check(d.StreamSynchronize(stream.s), "cuStreamSynchronize", "after a repeated prefill");
    d.check(d.EventElapsedTime(&ms, e0.e, e1.e), "cuEventElapsedTime");
    res.repeat_ms.push_back(ms);
    res.repeat_identical = res.repeat_identical && again == res.out;
  }
}

}  // namespace

int run_indexer(const Options& o) {
  // Opened once, through libdecodepack as a host opens it; the deploy block comes with dp_bundle_info.
  SessionHandle opened;
  opened.b = open_bundle(o.bundle);
  dp_bundle_info info{};
  info.size = sizeof(info);
  rt(dp_bundle_get_info(opened.b, &info), "reading the bundle info");
  if (info.indexer_heads == 0) fail(Errc::input, "{}: the bundle's model has no sparse-attention indexer", o.bundle);
  const deploy::Deploy dep = deploy::parse_deploy(Json::parse(info.deploy_json), o.bundle + ": deploy");
  ix::PrefillConfig cfg{dep.indexer.max_keys_per_chunk, dep.indexer.max_requests, dep.dcp.size, dep.dcp.interleave,
                        dep.kv_cache.block_size};
  if (o.layout != "split" && o.layout != "packed") fail(Errc::usage, "--layout {}: expected split or packed", o.layout);
  if (o.set_size < 1) fail(Errc::usage, "--set-size {}: expected at least 1", o.set_size);
  const Inputs in = make_inputs(o, info.indexer_heads, info.indexer_top_k);
  Rng rng(o.seed + 17);
  const Layout L = plan_layout(o, in, cfg, rng);
  for (const Set& s : L.sets) ix::plan_chunk(s.chunk, cfg);  // the tool's own inputs within the limits
  std::vector<int> devices = o.devices;
  if (o.device >= 0) {
    if (L.world != 1)
      fail(Errc::usage, "--device {}: one device, but the bundle's dcp.size is {}; give one per rank with --devices",
           o.device, L.world);
    devices = {o.device};
  }
  if (devices.empty())
    for (int r = 0; r < L.world; ++r) devices.push_back(r);
  if (static_cast<int64_t>(devices.size()) != L.world)
    fail(Errc::usage, "--devices lists {} devices, the bundle's dcp.size is {}", devices.size(), L.world);

  std::fprintf(stderr, "decodepack: indexer-run: %zu requests in %zu sets, %lld keys, %lld rows; %lld heads, top-k %lld; "
               "DCP world %lld interleave %lld; cache %s, block %lld, stride %lld bytes\n",
               in.seq_lens.size(), L.sets.size(), static_cast<long long>(in.total_keys()),
               static_cast<long long>(in.rows()), static_cast<long long>(in.heads), static_cast<long long>(in.k),
               static_cast<long long>(L.world), static_cast<long long>(L.interleave), o.layout.c_str(),
               static_cast<long long>(L.block_size), static_cast<long long>(L.block_stride));
  const auto t0 = std::chrono::steady_clock::now();
  Reference ref;
  if (o.check) {
    ref = reference(in, L, cfg);
    std::fprintf(stderr, "decodepack: indexer-run: CPU reference in %.1f s\n",
                 std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }

  {  // every rank's GPU before any thread starts: a rank that cannot start would leave the others in NCCL
    const Driver& d = Driver::get();
    int count = 0;
    d.check(d.DeviceGetCount(&count), "cuDeviceGetCount");
    for (int dev : devices)
      if (dev < 0 || dev >= count)
        fail(Errc::device, "device {}: this host has {} CUDA device{}, the bundle's DCP world {} needs one per rank "
             "(--devices)", dev, count, count == 1 ? "" : "s", L.world);
  }
  std::optional<Nccl> nccl;
  NcclUniqueId id{};
  if (L.world > 1) {
    const char* env = std::getenv("DECODEPACK_NCCL");
    nccl = Nccl::open(!o.nccl.empty() ? o.nccl : env && *env ? env : "libnccl.so.2");
    nccl->check(nccl->GetUniqueId(&id), "ncclGetUniqueId");
  }
  std::vector<RankResult> results(L.world);
  std::vector<std::thread> threads;
  for (int rank = 0; rank < L.world; ++rank)
    threads.emplace_back([&, rank] {
      results[rank].rank = rank;
      try {
        run_rank(o, opened.b, in, L, rank, devices[rank], nccl ? &*nccl : nullptr, &id, results[rank]);
      } catch (const Error& e) {
        results[rank].error = e.what();
        results[rank].error_code = static_cast<int>(e.code());
      } catch (const std::exception& e) {
        results[rank].error = e.what();
        results[rank].error_code = static_cast<int>(Errc::internal);
      }
    });
  for (std::thread& t : threads) t.join();
  for (const RankResult& r : results)
    if (!r.error.empty()) fail(static_cast<Errc>(r.error_code), "rank {}: {}", r.rank, r.error);

  // Checks.
  Json ranks = Json::array();
  int64_t cache_diff_total = 0;
  std::vector<RowCheck> row_checks(L.world);
  for (const RankResult& r : results) {
    int64_t diff = 0, first = -1;
    RowCheck& rc = row_checks[r.rank];
    for (size_t i = 0; o.check && i < r.cache.size(); ++i)
      if (r.cache[i] != ref.caches[r.rank].bytes[i]) {
        ++diff;
        if (first < 0) first = static_cast<int64_t>(i);
      }
    cache_diff_total += diff;
    for (size_t si = 0; o.check && si < L.sets.size(); ++si) {
      const Set& s = L.sets[si];
      for (int64_t row = 0; row < s.rows; ++row)
        compare_row(std::span<const int32_t>(r.out).subspan((s.first_row + row) * in.k, in.k),
                    std::span<const int32_t>(ref.topk[si]).subspan(row * in.k, in.k), ref.logits[si][row],
                    s.first_row + row, rc);
    }
    ranks.push_back({{"rank", r.rank},
                     {"device", r.device},
                     {"prefill_ms", r.ms},
                     {"checked", o.check},
                     {"cache_bytes", r.cache.size()},
                     {"cache_bytes_differing", diff},
                     {"first_differing_byte", first},
                     {"rows", rc.rows},
                     {"rows_identical", rc.identical},
                     {"rows_near_ties", rc.near_ties},
                     {"rows_failed", rc.failed},
                     {"failures", rc.failures},
                     {"repeat_ms", r.repeat_ms},
                     {"repeat_median_ms", median(r.repeat_ms)},
                     {"repeat_identical", r.repeat_identical},
                     {"query_chunks", r.info.query_chunks},
                     {"metadata_device_bytes", r.info.device_bytes}});
  }
  bool ok = cache_diff_total == 0;
  for (const RowCheck& rc : row_checks) ok = ok && rc.failed == 0;
  for (const RankResult& r : results) ok = ok && r.repeat_identical;

  if (!o.inputs.empty()) {
    const fs::path dir = o.inputs;
    write_raw(dir / "dp_topk.i32", results[0].out);
    std::vector<float> deq(static_cast<size_t>(in.total_keys() * ix::kHeadDim));
    for (int64_t t = 0; t < in.total_keys(); ++t) {
      for (int64_t rank = 0; rank < L.world; ++rank) {
        const int64_t slot = L.slots[rank][t];
        if (slot < 0) continue;
        const int64_t block = slot / L.block_size, off = slot % L.block_size;
        const uint8_t* base = results[rank].cache.data() + block * L.block_stride;
        ix::KeyBytes kb{};
        if (L.layout == ix::CacheLayout::packed) {
          std::memcpy(kb.data(), base + off * ix::kKeyBytes, ix::kKeyBytes);
        } else {
          std::memcpy(kb.data(), base + off * ix::kPayloadBytes, ix::kPayloadBytes);
          std::memcpy(kb.data() + ix::kPayloadBytes, base + L.block_size * ix::kPayloadBytes + off * ix::kGroups,
                      ix::kGroups);
        }
        const auto v = ix::dequantise_key(kb);
        for (int64_t i = 0; i < ix::kHeadDim; ++i) deq[t * ix::kHeadDim + i] = static_cast<float>(v[i]);
      }
    }
    write_raw(dir / "dp_keys.f32", deq);
  }

  const Json result{{"bundle", o.bundle},
                    {"world", L.world},
                    {"interleave", L.interleave},
                    {"layout", o.layout},
                    {"block_size", L.block_size},
                    {"block_stride", L.block_stride},
                    {"heads", in.heads},
                    {"top_k", in.k},
                    {"requests", in.seq_lens.size()},
                    {"sets", L.sets.size()},
                    {"keys", in.total_keys()},
                    {"rows", in.rows()},
                    {"ranks", ranks},
                    {"ok", ok}};
  if (o.json) {
    Json j = result;
    if (!ok) j["error"] = json_error(Errc::verify, fmt::format("{}: the indexer prefill differs from the CPU reference "
                                                               "or between repeats", o.bundle));
    print_json(std::move(j));
  } else {
    if (!o.check) std::printf("not checked against the CPU reference (--no-check)\n");
    for (const Json& r : ranks) {
      std::printf("rank %lld on %s: prefill %.3f ms (%lld query chunks)\n", static_cast<long long>(r["rank"]),
                  r["device"].get<std::string>().c_str(), r["prefill_ms"].get<double>(),
                  static_cast<long long>(r["query_chunks"]));
      std::printf("  cache   %lld bytes, %lld differ from the reference\n", static_cast<long long>(r["cache_bytes"]),
                  static_cast<long long>(r["cache_bytes_differing"]));
      std::printf("  top-k   %lld rows: %lld identical, %lld differ only at near ties, %lld failed\n",
                  static_cast<long long>(r["rows"]), static_cast<long long>(r["rows_identical"]),
                  static_cast<long long>(r["rows_near_ties"]), static_cast<long long>(r["rows_failed"]));
      for (const Json& f : r["failures"]) std::printf("    %s\n", f.get<std::string>().c_str());
      if (!r["repeat_ms"].empty())
        std::printf("  repeat  %zu more prefills: median %.3f ms, min %.3f ms; output %s\n", r["repeat_ms"].size(),
                    r["repeat_median_ms"].get<double>(),
                    std::min_element(r["repeat_ms"].begin(), r["repeat_ms"].end())->get<double>(),
                    r["repeat_identical"].get<bool>() ? "identical every time" : "CHANGED between runs");
    }
    std::printf("%s\n", ok ? "OK" : "FAILED");
  }
  return ok ? 0 : static_cast<int>(Errc::verify);
}


}  // namespace dp::tools
