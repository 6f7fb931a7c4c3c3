// Load-time validation of a bundle against a device description and a rank (dp_bundle_query_validity,
// and the first thing dp_session_create does). No driver needed: the device is described by numbers.
#pragma once

#include <string>

#include "src/bundle.h"
#include "src/status.h"

namespace dp::rt {

// The bundle holds `rank` (DP_ERR_RANK otherwise, naming the ranks it holds and how to get the rank).
Status check_rank(const dp_bundle& b, int32_t rank);

// Picks the bundle target that runs on `device` (arch-specific exact match first, then family, then
// generic of the highest minor); DP_ERR_TARGET when none does, saying which target to add.
Result<std::string> choose_target(const dp_bundle& b, const dp_device_desc& device, int32_t ordinal);

// Target, driver version and every kernel of that target against the device limits. The target is
// `forced` when not empty (the host asked for it: it must be one of the bundle's and run on the
// device), else choose_target's; it is returned in *target.
Status check_device(const dp_bundle& b, const dp_device_desc& device, int32_t ordinal, std::string* target,
                    const std::string& forced = {});

// Checks the parts of the manifest a session relies on for `target` that the format library leaves
// open: kernel parameter kinds and sizes, parameter names the runtime can supply per role.
Status check_kernels(const dp_bundle& b, const std::string& target);

// "device 0 (NVIDIA H200, sm_90)" / "the described device (sm_100)".
std::string device_label(const dp_device_desc& d, int32_t ordinal);

}  // namespace dp::rt
