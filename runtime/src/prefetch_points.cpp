#include "src/prefetch_points.h"

#include <algorithm>

#include "decodepack/decodepack.h"

namespace dp::rt {

static_assert(format::kPrefetchPoints[DP_PREFETCH_OPROJ_DOWN] == "oproj_down" &&
              format::kPrefetchPoints[DP_PREFETCH_ATTENTION_MOE] == "attention_moe" &&
              format::kPrefetchPoints[DP_PREFETCH_NEXT_ATTENTION] == "next_attention" &&
              format::kPrefetchPoints[DP_PREFETCH_ATTENTION_OPROJ] == "attention_oproj" &&
              format::kPrefetchPoints.size() == DP_PREFETCH_ATTENTION_OPROJ + 1,
              "format::kPrefetchPoints must list the points in dp_prefetch_point order");

int32_t prefetch_point_id(std::string_view name) {
  for (size_t i = 0; i < format::kPrefetchPoints.size(); ++i)
    if (format::kPrefetchPoints[i] == name) return static_cast<int32_t>(i);
  return -1;
}

int32_t prefetch_start_after(int32_t point, const format::ProgramEntry& program, const std::vector<std::string>& ops) {
  const auto n = static_cast<int32_t>(std::min(program.steps.size(), ops.size()));
  auto reads = [&](int32_t i, std::string_view weight) {
    for (const format::ProgramArgEntry& a : program.steps[static_cast<size_t>(i)].args)
      if (a.from == "weight" && a.name == weight) return true;
    return false;
  };
  auto is_core = [&](int32_t i) {
    const std::string& op = ops[static_cast<size_t>(i)];
    return op == "kda_step" || op.starts_with("mla_");
  };
  int32_t first_core = -1, last_core = -1;
  for (int32_t i = 0; i < n; ++i)
    if (is_core(i)) {
      if (first_core < 0) first_core = i;
      last_core = i;
    }
  const bool mla = first_core >= 0 && ops[static_cast<size_t>(first_core)] != "kda_step";
  for (int32_t i = 0; i < n; ++i) {
    switch (point) {
      case DP_PREFETCH_ATTENTION_OPROJ:
        return first_core >= 0 ? first_core - 1 : -1;
      case DP_PREFETCH_OPROJ_DOWN:
        if (reads(i, "self_attn.o_proj.weight")) return i;
        break;
      case DP_PREFETCH_ATTENTION_MOE:
        if (mla) return last_core;
        if (reads(i, "self_attn.q_proj.weight")) return i;  // KDA: the fused input projection
        break;
      case DP_PREFETCH_NEXT_ATTENTION:
        if (ops[static_cast<size_t>(i)] == "moe_up") return i;
        break;
      default:
        return -1;
    }
  }
  return -1;
}

}  // namespace dp::rt
