// The sparse-attention indexer's prefill on a session (decodepack.h "Sparse-attention indexer prefill";
// behaviour of reference/seeds/004, kernels in templates/indexer.h, CPU reference in compiler/indexer/).
//
// dp_indexer_prepare checks every request set and plans it once per attention group: the DCP geometry
// (each rank's keys per request, their packed row offsets), the query chunks (row ranges whose logits
// tile stays under 1 GiB; under DCP each rank scores ceil(n / W) rows of a range) and, under DCP, where
// each rank's selected rows land after the one all-gather. The metadata's device arrays are uploaded
// there. dp_indexer_prefill then runs, per request set: pack this rank's keys, all-gather them (DCP),
// stage them into 64-key pages; per query chunk: score, top-k; and at the end (DCP) the all-gather of
// every chunk's selected rows and their copy into row order. The staged keys live in the workspace and
// are overwritten by the next set, so a set's keys are released before the next is staged.
//
// Workspace layout (exactly dp_bundle_info.indexer_prefill_workspace_bytes, compiler/indexer/workspace.h):
//   [0, 2^30)               logits tile, fp32 [tile rows, longest request]
//   packed                  this rank's packed keys, local_bound x 68 bytes
//   gathered                every rank's packed keys, W x local_bound x 68 (world 1: packed itself)
//   payload, scales         staged pages, ceil(max_keys / 64) x (4096 + 256) bytes
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "format/dcp.h"
#include "src/indexer.h"
#include "src/session.h"

namespace {
constexpr uint64_t kTileBytes = uint64_t{1} << 30;
constexpr int64_t kKeyBytes = 68;
constexpr int64_t kPageKeys = 64;
constexpr uint64_t kAlign = 16;
constexpr int64_t kScoreKeys = 32;        // keys per idx_score block (templates/indexer.h)
constexpr int64_t kMaxGridY = 65535;     // idx_score loops over key blocks beyond it

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
}  // namespace

dp_indexer_metadata::~dp_indexer_metadata() {
  if (device && session && session->device) {
    dp::rt::DeviceScope scope(session->device.get());
    if (scope.status().ok()) session->device->free(device);
  }
}

namespace dp::rt {
namespace {

// Host-side int32 arrays of one set, in upload order.
struct SetArrays {
  std::vector<int32_t> cu, local_cu, row_request, row_position;
};

}  // namespace
}  // namespace dp::rt

using dp::rt::DeploySettings;
using dp::rt::IndexerRange;
using dp::rt::IndexerSet;
using dp::rt::error;
using dp::rt::ok;
using dp::rt::Status;

Status dp_session::load_indexer() {
  const dp::format::Manifest& m = bundle->manifest();
  if (m.indexer.heads == 0)
    return error(DP_ERR_NOT_SUPPORTED, "{}: the bundle's model has no sparse-attention indexer", label());
  if (!indexer_kernels.empty()) return ok();
  if (!device)
    return error(DP_ERR_NO_DEVICE, "{}: the indexer prefill needs a device; this session is host-only", label());
  dp::rt::DeviceScope scope(device.get());
  DP_RETURN_IF_ERROR(scope.status());
  std::map<std::string, dp::rt::LoadedKernel> loaded_now;
  for (const char* op : {"idx_quant", "idx_pack", "idx_stage", "idx_score", "idx_topk", "idx_rows"}) {
    const dp::format::KernelEntry* k = nullptr;
    for (const dp::format::KernelEntry& e : m.kernels)
      if (e.target == target && e.role == "indexer" && e.op == op) k = &e;
    if (!k)
      return error(DP_ERR_NO_KERNEL, "{}: the bundle has no {} kernel for {} (index heads {}, head dim {}, top-k {}: the "
                   "kernels take head dim 128, heads a multiple of 8 up to 64, top-k up to 4096; bundles before format "
                   "1.2 have none)", label(), op, target, m.indexer.heads, m.indexer.head_dim, m.indexer.top_k);
    // The parameters this library fills, in order (templates/indexer.h via compiler/codegen/kernel.cpp).
    static const std::map<std::string, std::vector<std::string>> kParams = {
        {"idx_quant", {"keys", "slots", "cache", "count", "num_blocks", "block_size", "block_stride", "layout"}},
        {"idx_pack", {"cache", "block_table", "local_cu", "packed", "num_requests", "bt_stride", "max_local",
                      "num_blocks", "block_size", "block_stride", "layout"}},
        {"idx_stage", {"gathered", "cu", "local_cu", "payload", "scales", "num_requests", "world", "interleave",
                       "max_local", "pages"}},
        {"idx_score", {"q", "w", "payload", "scales", "cu", "row_request", "row_position", "logits", "row_begin",
                       "tile_rows", "L", "weight_scale"}},
        {"idx_topk", {"logits", "row_position", "out", "row_begin", "tile_rows", "valid_rows", "L"}},
        {"idx_rows", {"src", "map", "out", "rows", "k"}}};
    std::vector<std::string> names;
    for (const dp::format::KernelParamEntry& p : k->params) names.push_back(p.name);
    if (names != kParams.at(op))
      return error(DP_ERR_FORMAT, "{}: kernel {} takes ({}), libdecodepack {} passes ({}): the bundle and the library "
                   "disagree", label(), k->key, fmt::join(names, ", "), dp_version_string(), fmt::join(kParams.at(op), ", "));
    dp::rt::LoadedKernel lk;
    DP_RETURN_IF_ERROR(load_kernel(*k, -1, &lk, /*role_params=*/false));
    loaded_now[op] = std::move(lk);
  }
  indexer_kernels = std::move(loaded_now);
  return ok();
}

// Packs `args` (every parameter of the kernel by name; f32 values as their bit pattern) and launches.
Status dp_session::indexer_launch(const char* op, uint32_t grid_x, uint32_t grid_y,
                                  std::initializer_list<std::pair<const char*, uint64_t>> args, dp_stream stream) {
  if (grid_x == 0 || grid_y == 0) return ok();
  const dp::rt::LoadedKernel& k = indexer_kernels.at(op);
  alignas(16) uint8_t block[512];
  if (k.block.size() > sizeof(block))
    return error(DP_ERR_INTERNAL, "{}: {} has a {}-byte parameter block", label(), k.entry->key, k.block.size());
  std::memset(block, 0, sizeof(block));
  size_t set = 0;
  for (const dp::format::KernelParamEntry& p : k.entry->params) {
    auto it = std::find_if(args.begin(), args.end(), [&](const auto& a) { return p.name == a.first; });
    if (it == args.end())
      return error(DP_ERR_FORMAT, "{}: kernel {} has a parameter {} that libdecodepack {} does not fill", label(),
                   k.entry->key, p.name, dp_version_string());
    if (p.size == 8) std::memcpy(block + p.offset, &it->second, 8);
    else {
      const uint32_t v = static_cast<uint32_t>(it->second);
      std::memcpy(block + p.offset, &v, 4);
    }
    ++set;
  }
  if (set != args.size())
    return error(DP_ERR_FORMAT, "{}: kernel {} has {} parameters, libdecodepack {} passes {}: the bundle does not match "
                 "this library", label(), k.entry->key, set, dp_version_string(), args.size());
  dp::rt::LaunchSpec l;
  l.function = k.function;
  l.grid[0] = grid_x;
  l.grid[1] = grid_y;
  std::copy(k.entry->block, k.entry->block + 3, l.block);
  l.dynamic_shared = k.entry->dynamic_shared_bytes;
  l.stream = stream;
  l.params = block;
  l.param_bytes = k.block.size();
  return device->launch(l, k.entry->key.c_str());
}

Status dp_session::check_indexer_cache(const char* fn, const dp_indexer_cache& c) const {
  const int64_t bs = bundle->deploy.block_size;
  DP_RETURN_IF_ERROR(dp::rt::check_io_address(fn, "cache.data", c.data, false));
  if (c.num_blocks < 1 || c.num_blocks > INT32_MAX)
    return error(DP_ERR_SHAPE, "{}: cache.num_blocks {}, expected 1..{}", fn, c.num_blocks, INT32_MAX);
  if (c.layout != DP_INDEXER_LAYOUT_SPLIT && c.layout != DP_INDEXER_LAYOUT_PACKED)
    return error(DP_ERR_INVALID_ARGUMENT, "{}: cache.layout {}, expected DP_INDEXER_LAYOUT_SPLIT (0) or "
                 "DP_INDEXER_LAYOUT_PACKED (1)", fn, c.layout);
  if (c.block_stride < bs * kKeyBytes || c.block_stride > UINT32_MAX)
    return error(DP_ERR_LAYOUT, "{}: cache.block_stride {} bytes, expected at least block_size {} x 68 = {} (and below "
                 "2^32)", fn, c.block_stride, bs, bs * kKeyBytes);
  if (c.block_stride % static_cast<int64_t>(kAlign))
    return error(DP_ERR_ALIGNMENT, "{}: cache.block_stride {} bytes is not a multiple of {}", fn, c.block_stride, kAlign);
  return ok();
}

Status dp_session::indexer_write_keys(const dp_indexer_cache& cache, uint64_t keys, uint64_t slot_mapping, int64_t count,
                                      dp_stream stream) {
  const char* fn = "dp_indexer_write_keys";
  if (bundle->manifest().indexer.heads == 0)
    return error(DP_ERR_NOT_SUPPORTED, "{}: {}: the bundle's model has no sparse-attention indexer", fn, label());
  DP_RETURN_IF_ERROR(check_indexer_cache(fn, cache));
  if (count < 0 || count > INT32_MAX) return error(DP_ERR_SHAPE, "{}: count {}, expected 0..{}", fn, count, INT32_MAX);
  if (count == 0) return ok();
  DP_RETURN_IF_ERROR(dp::rt::check_io_address(fn, "keys", keys, false));
  DP_RETURN_IF_ERROR(dp::rt::check_io_address(fn, "slot_mapping", slot_mapping, false));
  DP_RETURN_IF_ERROR(load_indexer());
  dp::rt::DeviceScope scope(device.get());
  DP_RETURN_IF_ERROR(scope.status());
  return indexer_launch("idx_quant", static_cast<uint32_t>(ceil_div(count, 8)), 1,
                        {{"keys", keys}, {"slots", slot_mapping}, {"cache", cache.data},
                         {"count", static_cast<uint64_t>(count)}, {"num_blocks", static_cast<uint64_t>(cache.num_blocks)},
                         {"block_size", static_cast<uint64_t>(bundle->deploy.block_size)},
                         {"block_stride", static_cast<uint64_t>(cache.block_stride)},
                         {"layout", static_cast<uint64_t>(cache.layout)}},
                        stream);
}

Status dp_session::indexer_prepare(const dp_indexer_batch_desc& desc, dp_indexer_metadata** out,
                                   dp_indexer_plan_info* info) {
  const char* fn = "dp_indexer_prepare";
  const dp::format::Manifest& m = bundle->manifest();
  const DeploySettings& d = bundle->deploy;
  if (m.indexer.heads == 0)
    return error(DP_ERR_NOT_SUPPORTED, "{}: {}: the bundle's model has no sparse-attention indexer", fn, label());
  const int64_t W = d.dcp_size, I = d.dcp_interleave, B = d.block_size, K = m.indexer.top_k;
  if (desc.dcp_rank < 0 || desc.dcp_rank >= W)
    return error(DP_ERR_RANK, "{}: dcp_rank {}, expected 0..{} (the deploy's dcp.size is {})", fn, desc.dcp_rank, W - 1, W);
  if (desc.num_sets < 1 || !desc.sets)
    return error(DP_ERR_INVALID_ARGUMENT, "{}: num_sets {} with sets {}: expected at least one request set", fn,
                 desc.num_sets, desc.sets ? "given" : "NULL");

  auto md = std::make_unique<dp_indexer_metadata>();
  md->session = this;
  md->rank = desc.dcp_rank;
  md->world = W;
  md->interleave = I;
  std::vector<dp::rt::SetArrays> arrays;
  for (int32_t si = 0; si < desc.num_sets; ++si) {
    const dp_indexer_requests& rs = desc.sets[si];
    const std::string where = fmt::format("{}: sets[{}]", fn, si);
    if (rs.num_requests < 1 || rs.num_requests > d.indexer_max_requests)
      return error(DP_ERR_SHAPE, "{}: num_requests {}, expected 1..{} (deploy indexer.max_requests: the workspace holds "
                   "no more)", where, rs.num_requests, d.indexer_max_requests);
    if (!rs.seq_lens || !rs.query_lens)
      return error(DP_ERR_INVALID_ARGUMENT, "{}: seq_lens or query_lens is NULL", where);
    DP_RETURN_IF_ERROR(dp::rt::check_io_address(where.c_str(), "block_table", rs.block_table, false));
    IndexerSet set;
    dp::rt::SetArrays a;
    set.requests = rs.num_requests;
    set.block_table = rs.block_table;
    set.bt_stride = rs.block_table_stride;
    set.row_offset = md->rows;
    a.cu.push_back(0);
    for (int32_t r = 0; r < rs.num_requests; ++r) {
      const int64_t len = rs.seq_lens[r], q = rs.query_lens[r];
      if (len < 1) return error(DP_ERR_SHAPE, "{}: request {} has seq_len {}, expected at least 1", where, r, len);
      if (q < 0 || q > len)
        return error(DP_ERR_SHAPE, "{}: request {} has query_len {}, expected 0..seq_len {}", where, r, q, len);
      if (len > d.indexer_max_keys || set.keys + len > d.indexer_max_keys)
        return error(DP_ERR_SHAPE, "{}: requests 0..{} hold {} keys, beyond the workspace's {} (deploy "
                     "indexer.max_keys_per_chunk): split the set", where, r, set.keys + len, d.indexer_max_keys);
      set.keys += len;
      set.rows += q;
      set.max_len = std::max(set.max_len, len);
      a.cu.push_back(static_cast<int32_t>(set.keys));
      for (int64_t j = 0; j < q; ++j) {
        a.row_request.push_back(r);
        a.row_position.push_back(static_cast<int32_t>(len - q + j));
      }
    }
    int64_t most_blocks = 0;
    for (int64_t rank = 0; rank < W; ++rank) {
      int64_t total = 0;
      a.local_cu.push_back(0);
      for (int32_t r = 0; r < rs.num_requests; ++r) {
        const int64_t local = dp::dcp::local_len(rs.seq_lens[r], W, rank, I);
        most_blocks = std::max(most_blocks, ceil_div(local, B));
        total += local;
        a.local_cu.push_back(static_cast<int32_t>(total));
      }
      set.max_local = std::max(set.max_local, total);
    }
    if (rs.block_table_stride < most_blocks)
      return error(DP_ERR_SHAPE, "{}: block_table_stride {}, expected at least {} (the longest request's keys on one "
                   "rank need that many blocks of {} at dcp.size {})", where, rs.block_table_stride, most_blocks, B, W);
    if (rs.block_table_stride > UINT32_MAX)
      return error(DP_ERR_SHAPE, "{}: block_table_stride {} is above 2^32 - 1", where, rs.block_table_stride);
    set.pages = ceil_div(set.keys, kPageKeys);
    // Query chunks: a rank's tile of share rows x max_len fp32 logits stays within the tile (1 GiB).
    const uint64_t tile_bytes = desc.max_tile_bytes ? desc.max_tile_bytes : kTileBytes;
    if (tile_bytes > kTileBytes || tile_bytes < 4 * static_cast<uint64_t>(set.max_len))
      return error(DP_ERR_SHAPE, "{}: max_tile_bytes {}, expected 0 or {}..{} (one row of {} fp32 logits up to the "
                   "workspace's tile)", where, desc.max_tile_bytes, 4 * set.max_len, kTileBytes, set.max_len);
    const int64_t tile_rows = static_cast<int64_t>(tile_bytes / (4 * static_cast<uint64_t>(set.max_len)));
    for (int64_t begin = 0; begin < set.rows; begin += tile_rows * W) {
      IndexerRange range;
      range.begin = begin;
      range.end = std::min(set.rows, begin + tile_rows * W);
      range.share = ceil_div(range.end - range.begin, W);
      range.pending = md->pending_rows;
      if (W > 1) md->pending_rows += range.share;
      set.ranges.push_back(range);
      ++md->chunks;
    }
    md->rows += set.rows;
    md->keys += set.keys;
    md->sets.push_back(std::move(set));
    arrays.push_back(std::move(a));
  }

  // Device arrays: every set's int32 tables, then (DCP) the selected-rows buffers and the row map.
  std::vector<int32_t> host;
  auto place = [&](const std::vector<int32_t>& v) {
    const uint64_t at = host.size() * 4;
    host.insert(host.end(), v.begin(), v.end());
    host.resize((host.size() + 3) / 4 * 4, 0);  // keep every table 16-byte aligned
    return at;
  };
  for (size_t i = 0; i < md->sets.size(); ++i) {
    IndexerSet& set = md->sets[i];
    set.cu = place(arrays[i].cu);
    set.local_cu = place(arrays[i].local_cu);
    set.row_request = place(arrays[i].row_request);
    set.row_position = place(arrays[i].row_position);
  }
  if (W > 1) {
    std::vector<int32_t> map(md->rows, -1);
    for (const IndexerSet& set : md->sets)
      for (const IndexerRange& range : set.ranges)
        for (int64_t q = 0; q < W; ++q)
          for (int64_t i = 0; i < range.share; ++i) {
            const int64_t row = range.begin + q * range.share + i;
            if (row < range.end) map[set.row_offset + row] = static_cast<int32_t>(q * md->pending_rows + range.pending + i);
          }
    md->map = place(map);
  }
  const uint64_t table_bytes = host.size() * 4;
  uint64_t bytes = table_bytes;
  if (W > 1) {
    md->pending = bytes;
    bytes += static_cast<uint64_t>(md->pending_rows * K) * 4;
    bytes = (bytes + kAlign - 1) / kAlign * kAlign;
    md->gathered = bytes;
    bytes += static_cast<uint64_t>(W * md->pending_rows * K) * 4;
  }
  md->bytes = bytes;
  if (device) {
    dp::rt::DeviceScope scope(device.get());
    DP_RETURN_IF_ERROR(scope.status());
    DP_RETURN_IF_ERROR(device->alloc(std::max<uint64_t>(bytes, 16), "the indexer prefill metadata", &md->device));
    DP_RETURN_IF_ERROR(device->upload(md->device, host.data(), table_bytes, "the indexer prefill metadata"));
  }
  // Offsets become addresses (or stay offsets on a host-only session, which cannot run the prefill).
  for (IndexerSet& set : md->sets) {
    set.cu += md->device;
    set.local_cu += md->device;
    set.row_request += md->device;
    set.row_position += md->device;
  }
  if (W > 1) {
    md->map += md->device;
    md->pending += md->device;
    md->gathered += md->device;
  }
  if (info) {
    dp_indexer_plan_info v;
    dp_indexer_plan_info_init(&v);
    v.rows = md->rows;
    v.sets = static_cast<int32_t>(md->sets.size());
    v.query_chunks = md->chunks;
    v.keys = md->keys;
    v.device_bytes = md->bytes;
    const size_t n = info->size < sizeof(v) ? info->size : sizeof(v);
    v.size = info->size;
    std::memcpy(info, &v, n);
  }
  *out = md.release();
  return ok();
}

Status dp_session::indexer_prefill(const dp_indexer_metadata& md, const dp_indexer_cache& cache,
                                   const dp_indexer_prefill_io& io, dp_stream stream) {
  const char* fn = "dp_indexer_prefill";
  const dp::format::Manifest& m = bundle->manifest();
  const DeploySettings& d = bundle->deploy;
  if (md.session != this)
    return error(DP_ERR_INVALID_ARGUMENT, "{}: {}: the metadata was prepared on another session", fn, label());
  DP_RETURN_IF_ERROR(check_indexer_cache(fn, cache));
  for (const auto& [field, v] : {std::pair{"io.q", io.q}, {"io.weights", io.weights}, {"io.out", io.out},
                                 {"io.workspace", io.workspace}})
    DP_RETURN_IF_ERROR(dp::rt::check_io_address(fn, field, v, false));
  if (io.workspace_bytes < m.indexer.prefill_workspace_bytes)
    return error(DP_ERR_SHAPE, "{}: io.workspace_bytes {}, expected at least {} (dp_bundle_info."
                 "indexer_prefill_workspace_bytes: the logits tile and the staged keys of one chunk)", fn,
                 io.workspace_bytes, m.indexer.prefill_workspace_bytes);
  if (md.world > 1 && !io.all_gather)
    return error(DP_ERR_INVALID_ARGUMENT, "{}: io.all_gather is NULL, but the deploy's dcp.size is {}: the host's "
                 "communicator must exchange the ranks' keys and selections", fn, md.world);
  if (!device || !md.device)
    return error(DP_ERR_NO_DEVICE, "{}: {}: the indexer prefill needs a device; this session is host-only", fn, label());
  DP_RETURN_IF_ERROR(load_indexer());
  dp::rt::DeviceScope scope(device.get());
  DP_RETURN_IF_ERROR(scope.status());

  const int64_t W = md.world, NH = m.indexer.heads, K = m.indexer.top_k;
  int64_t local_bound = 0;
  dp::dcp::local_rows_bound(d.indexer_max_keys, d.indexer_max_requests, W, md.interleave, &local_bound);
  const uint64_t logits = io.workspace;
  const uint64_t packed = io.workspace + kTileBytes;
  const uint64_t rows_bytes = static_cast<uint64_t>(local_bound * kKeyBytes);
  const uint64_t gathered = W > 1 ? packed + rows_bytes : packed;
  const uint64_t payload = W > 1 ? gathered + static_cast<uint64_t>(W) * rows_bytes : packed + rows_bytes;
  const uint64_t scales = payload + static_cast<uint64_t>(ceil_div(d.indexer_max_keys, kPageKeys) * kPageKeys * 64);
  const uint64_t weight_scale = std::bit_cast<uint32_t>(io.weight_scale);
  auto u = [](int64_t v) { return static_cast<uint64_t>(v); };

  for (const IndexerSet& set : md.sets) {
    // Stage this set's keys (the previous set's pages are overwritten: released).
    DP_RETURN_IF_ERROR(indexer_launch(
        "idx_pack", static_cast<uint32_t>(ceil_div(set.max_local * 17, 256)), 1,
        {{"cache", cache.data}, {"block_table", set.block_table},
         {"local_cu", set.local_cu + u(md.rank * (set.requests + 1) * 4)}, {"packed", packed},
         {"num_requests", u(set.requests)}, {"bt_stride", u(set.bt_stride)}, {"max_local", u(set.max_local)},
         {"num_blocks", u(cache.num_blocks)}, {"block_size", u(d.block_size)}, {"block_stride", u(cache.block_stride)},
         {"layout", u(cache.layout)}},
        stream));
    if (W > 1) {
      const int32_t rc = io.all_gather(io.all_gather_user, packed, gathered, u(set.max_local * kKeyBytes), stream);
      if (rc != 0)
        return error(DP_ERR_COMMUNICATOR, "{}: the host's all_gather of the packed keys ({} bytes per rank) returned {}",
                     fn, set.max_local * kKeyBytes, rc);
    }
    DP_RETURN_IF_ERROR(indexer_launch(
        "idx_stage", static_cast<uint32_t>(ceil_div(set.pages * kPageKeys * 17, 256)), 1,
        {{"gathered", gathered}, {"cu", set.cu}, {"local_cu", set.local_cu}, {"payload", payload}, {"scales", scales},
         {"num_requests", u(set.requests)}, {"world", u(W)}, {"interleave", u(md.interleave)},
         {"max_local", u(set.max_local)}, {"pages", u(set.pages)}},
        stream));
    for (const IndexerRange& range : set.ranges) {
      const int64_t first = range.begin + (W > 1 ? md.rank * range.share : 0);
      const int64_t tile = W > 1 ? range.share : range.end - range.begin;
      const int64_t valid = std::clamp<int64_t>(range.end - first, 0, tile);
      DP_RETURN_IF_ERROR(indexer_launch(
          "idx_score", static_cast<uint32_t>(valid),
          static_cast<uint32_t>(std::min(ceil_div(set.max_len, kScoreKeys), kMaxGridY)),
          {{"q", io.q + u(set.row_offset * NH * 128 * 2)}, {"w", io.weights + u(set.row_offset * NH * 4)},
           {"payload", payload}, {"scales", scales}, {"cu", set.cu}, {"row_request", set.row_request},
           {"row_position", set.row_position}, {"logits", logits}, {"row_begin", u(first)}, {"tile_rows", u(valid)},
           {"L", u(set.max_len)}, {"weight_scale", weight_scale}},
          stream));
      const uint64_t dst = W > 1 ? md.pending + u(range.pending * K * 4) : io.out + u((set.row_offset + first) * K * 4);
      DP_RETURN_IF_ERROR(indexer_launch(
          "idx_topk", static_cast<uint32_t>(tile), 1,
          {{"logits", logits}, {"row_position", set.row_position}, {"out", dst}, {"row_begin", u(first)},
           {"tile_rows", u(tile)}, {"valid_rows", u(valid)}, {"L", u(set.max_len)}},
          stream));
    }
  }
  if (W > 1 && md.pending_rows > 0) {
    const int32_t rc = io.all_gather(io.all_gather_user, md.pending, md.gathered, u(md.pending_rows * K * 4), stream);
    if (rc != 0)
      return error(DP_ERR_COMMUNICATOR, "{}: the host's all_gather of the selected rows ({} bytes per rank) returned {}",
                   fn, md.pending_rows * K * 4, rc);
    DP_RETURN_IF_ERROR(indexer_launch("idx_rows", static_cast<uint32_t>(ceil_div(md.rows * K, 256)), 1,
                                      {{"src", md.gathered}, {"map", md.map}, {"out", io.out}, {"rows", u(md.rows)},
                                       {"k", u(K)}},
                                      stream));
  }
  return ok();
}
