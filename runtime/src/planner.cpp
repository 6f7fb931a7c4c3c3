#include "src/planner.h"

#include <algorithm>

#include <fmt/format.h>

namespace dp::rt {
namespace {

PlanOutcome refuse(int32_t reason, std::string message) { return {reason, 0, std::move(message)}; }

bool is_padding(int32_t state) { return state == DP_NULL_BLOCK_ID || state == DP_PAD_SLOT_ID; }

}  // namespace

PlanOutcome plan_step(const PlanInputs& in, const dp_step_desc& d) {
  const std::vector<int32_t>& widths = *in.widths;
  if (d.pp_stage_input)
    return refuse(DP_REASON_PP_STAGE_INPUT, "the step's input comes from a previous pipeline-parallel stage");
  if (!in.kv_missing.empty())
    return refuse(DP_REASON_NO_KV, fmt::format("no KV cache bound yet: {} (profiling or a dummy run)", in.kv_missing));
  if (d.graph_mode == DP_GRAPH_PIECEWISE)
    return refuse(DP_REASON_PIECEWISE, "PIECEWISE graph mode: attention metadata is not part of the captured graph");
  if (d.num_requests > widths.back())
    return refuse(DP_REASON_TOO_MANY_REQUESTS, fmt::format("{} requests, the largest width built is {}",
                                                           d.num_requests, widths.back()));
  if (d.num_requests <= 0)
    return refuse(DP_REASON_NOT_UNIFORM, fmt::format("{} requests: not a decode step", d.num_requests));
  if (d.query_lens)
    for (int32_t r = 0; r < d.num_requests; ++r)
      if (d.query_lens[r] != in.q)
        return refuse(DP_REASON_NOT_UNIFORM,
                      fmt::format("request {} has {} query rows, expected q = {} for every request (a prefill, chunked "
                                  "prefill or mixed step)", r, d.query_lens[r], in.q));

  // The metadata must stay inside the bound caches: the kernels index them without further checks.
  const int32_t stride = d.state_indices_stride > 0 ? d.state_indices_stride : in.q;
  for (int32_t r = 0; r < d.num_requests; ++r) {
    bool padded = false;
    if (d.state_indices && in.slots >= 0) {
      const int32_t* row = d.state_indices + static_cast<int64_t>(r) * stride;
      padded = is_padding(row[0]);
      for (int32_t j = 0; j < in.q; ++j) {
        if (padded ? !is_padding(row[j]) : (row[j] < 1 || row[j] >= in.slots))
          return refuse(DP_REASON_BAD_METADATA,
                        padded ? fmt::format("request {}: state index {} at draft position {} in a padded request "
                                             "(position 0 is {}), expected {} or {} throughout", r, row[j], j, row[0],
                                             DP_NULL_BLOCK_ID, DP_PAD_SLOT_ID)
                               : fmt::format("request {}: state index {} at draft position {}, expected 1..{} (the "
                                             "bound KDA state has {} slots; 0 is the null block)", r, row[j], j,
                                             in.slots - 1, in.slots));
      }
    }
    if (d.num_accepted) {
      const int32_t a = d.num_accepted[r];
      if (padded && a != 1)
        return refuse(DP_REASON_BAD_METADATA,
                      fmt::format("request {}: padded (state index {}) with num_accepted {}, expected 1", r,
                                  DP_NULL_BLOCK_ID, a));
      if (a < 1 || a > in.q)
        return refuse(DP_REASON_BAD_METADATA,
                      fmt::format("request {}: num_accepted {}, expected 1..{}", r, a, in.q));
    }
    if (d.block_table && in.blocks >= 0 && !padded) {
      const int32_t* row = d.block_table + static_cast<int64_t>(r) * d.block_table_stride;
      for (int32_t c = 0; c < d.block_table_cols; ++c)
        if (row[c] < 0 || row[c] >= in.blocks)
          return refuse(DP_REASON_BAD_METADATA,
                        fmt::format("request {}: block table entry {} is {}, expected 0..{} (the bound MLA cache has "
                                    "{} blocks)", r, c, row[c], in.blocks - 1, in.blocks));
    }
  }
  const auto it = std::lower_bound(widths.begin(), widths.end(), d.num_requests);
  if (in.nccl_widths && !in.communicator && std::binary_search(in.nccl_widths->begin(), in.nccl_widths->end(), *it))
    return refuse(DP_REASON_NO_COMMUNICATOR,
                  fmt::format("width {} all-reduces with NCCL (deploy allreduce) and the session has no communicator "
                              "yet (dp_session_init_nccl)", *it));
  return {DP_REASON_NONE, *it, {}};
}

}  // namespace dp::rt
