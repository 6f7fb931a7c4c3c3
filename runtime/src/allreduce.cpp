#include "src/allreduce.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <vector>

#include "decodepack/decodepack.h"

namespace dp::rt {

uint64_t allreduce_exchange_bytes(int64_t ranks, int64_t rows, int64_t hidden) {
  return kAllreduceDataOffset + 2ull * static_cast<uint64_t>(ranks) * static_cast<uint64_t>(rows) *
                                    static_cast<uint64_t>(hidden) * 2;
}

std::string describe_error_flag(uint32_t v) {
  const uint32_t op = DP_FLAG_OP(v), peer = DP_FLAG_PEER(v), layer = DP_FLAG_LAYER(v);
  std::string where;
  if (layer) where += fmt::format("layer {}", layer - 1);
  if (op) where += fmt::format("{}{}", where.empty() ? "" : ", ", op == 1 ? "after the o-projection" : "after the FFN");
  std::vector<std::string> causes;
  if (v & DP_FLAG_WAIT_TIMEOUT)
    causes.push_back(peer ? fmt::format("a bounded wait of this rank gave up waiting for rank {}", peer - 1)
                          : std::string("a kernel of this rank gave up a bounded wait"));
  if (v & DP_FLAG_PEER_ABORT)
    causes.push_back(peer && !(v & DP_FLAG_WAIT_TIMEOUT) ? fmt::format("rank {} announced that it gave up a wait", peer - 1)
                                                         : std::string("a peer rank announced that it gave up"));
  if (causes.empty()) causes.push_back("unknown cause");
  return fmt::format("error flag {:#010x}: {}{}", v, fmt::join(causes, "; "),
                     where.empty() ? std::string() : " (first in " + where + ")");
}

}  // namespace dp::rt
