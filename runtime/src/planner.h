// Step planning: does a step run on the bundle's kernels, and at which width? A pure function of the
// step's host metadata and what the session has bound, so the rules (reference: the specialized
// decode's plan() and step_reason()) are tested without a GPU.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "decodepack/decodepack.h"

namespace dp::rt {

struct PlanInputs {
  const std::vector<int32_t>* widths = nullptr;  // built widths, sorted
  int q = 1;
  std::string kv_missing;      // "" when every cache is bound; else which one is not (for the message)
  int64_t slots = -1;          // KDA state slots bound (smallest over layers); -1: no KDA layers
  int64_t blocks = -1;         // MLA cache blocks bound (smallest over layers); -1: no MLA layers
  const std::vector<int32_t>* nccl_widths = nullptr;  // widths whose programs call NCCL (format 1.8); null: none
  bool communicator = false;   // the session has its NCCL communicator
};

struct PlanOutcome {
  int32_t reason = DP_REASON_NONE;
  int32_t width = 0;
  std::string message;
};

// Checks in the order of dp_plan's documentation and returns the first reason, or the width.
PlanOutcome plan_step(const PlanInputs& in, const dp_step_desc& d);

}  // namespace dp::rt
