// prefetch (templates/prefetch.h): L2 prefetch of weight ranges, any grid.
#include "codegen/ops/spec.h"

#include "common/error.h"

namespace dp::codegen::ops {

std::vector<OpSpec> prefetch_ops() {
  return {
      {
          "prefetch",
          "prefetch.h",
          "dp_prefetch_ranges",
          {{"B", "b", 32, 1024, "threads per block (multiple of 32)"}},
          [](const Params& p, const std::string& who) {
            if (p.at("B") % 32 != 0)
              fail(Errc::input, "{}: parameter B = {} is not a multiple of 32 (valid: 32, 64, ..., 1024)", who,
                   p.at("B"));
          },
          [](const Params& p) { return std::vector<int64_t>{p.at("B")}; },
          [](const Params&) {
            return std::vector<ArgSpec>{
                {"table", KernelParam::Kind::pointer, "const dp_prefetch_range*", "[count] {u64 addr, u64 bytes}",
                 "ranges to prefetch, 16-byte aligned"},
                {"count", KernelParam::Kind::u32, "dp_u32", "", "entries in table"},
            };
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = 32;  // default; the kernel adapts to any grid (DESIGN.md: 32 x 32 by default)
            s.block[0] = static_cast<uint32_t>(p.at("B"));
            s.grid_is_default = true;
            return s;
          },
          [](const Params& p) { return static_cast<uint32_t>(p.at("B")); },
      },
  };
}

}  // namespace dp::codegen::ops
