// The L2 prefetch points (decodepack.h dp_prefetch_point): their names in the bundle, and the kernel of
// a layer program after which the runtime starts each. Pure functions of the manifest, tested on any host.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "format/manifest.h"

namespace dp::rt {

// dp_prefetch_point of a manifest point name; -1 for a name this library does not know.
int32_t prefetch_point_id(std::string_view name);

// The program step after whose launch the prefetch of `point` starts, -1 for before the layer's first
// kernel (also where the program lacks the kernel the point names). `ops` are the template ops of the
// program's kernels, in program order. The side stream waits for that kernel to finish, so the
// prefetch overlaps the kernels after it:
//   attention_oproj  after the kernel before the attention core (kda_step, mla_*): the core reads the
//                    caches far below the HBM limit at small widths, and the o-projection follows it;
//   oproj_down       after the o-projection: the MoE front is read two kernels later;
//   attention_moe    after the attention input projection (KDA) or the attention core (MLA);
//   next_attention   after the routed experts' first kernel (moe_up), so that the next layer's
//                    attention weights land while the experts finish.
int32_t prefetch_start_after(int32_t point, const format::ProgramEntry& program, const std::vector<std::string>& ops);

}  // namespace dp::rt
