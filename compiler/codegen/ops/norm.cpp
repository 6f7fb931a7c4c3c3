// rmsnorm (templates/norm.h): fused residual add + RMSNorm, one block per row.
#include "codegen/ops/spec.h"

#include "common/error.h"

namespace dp::codegen::ops {
namespace {

// rmsnorm block size: enough threads that each holds at most a few 16-byte vectors of the row in
// registers (at most 256 threads, then more vectors per thread), rounded to whole wave64
// wavefronts so that one block shape serves both vendors. H = 2304 gives 192 threads x 2 vectors.
uint32_t rmsnorm_threads(int64_t h) {
  const int64_t vecs = h / 8;
  const int64_t per = (vecs + 255) / 256;
  const int64_t threads = (vecs + per - 1) / per;
  return static_cast<uint32_t>(std::max<int64_t>(64, (threads + 63) / 64 * 64));
}

}  // namespace

std::vector<OpSpec> norm_ops() {
  return {
      {
          "rmsnorm",
          "norm.h",
          "dp_add_rmsnorm",
          {{"W", "w", 1, 4096, "rows (batch width x rows per request)"},
           {"H", "h", 8, 1 << 20, "row length (hidden size), a multiple of 8"},
           {"S", "s", 0, 1 << 20, "elements between hidden rows, a multiple of 8, at least H (0: H, dense rows)",
            true}},
          [](const Params& p, const std::string& who) {
            if (p.at("H") % 8 != 0)
              fail(Errc::input, "{}: parameter H = {} is not a multiple of 8 (rows are read as 16-byte bf16 vectors)",
                   who, p.at("H"));
            if (p.at("S") != 0 && (p.at("S") % 8 != 0 || p.at("S") < p.at("H")))
              fail(Errc::input, "{}: parameter S = {} must be 0 or a multiple of 8 of at least H = {} (hidden rows are "
                   "read as 16-byte bf16 vectors)", who, p.at("S"), p.at("H"));
          },
          [](const Params& p) {
            std::vector<int64_t> a{p.at("W"), p.at("H"), rmsnorm_threads(p.at("H"))};
            if (p.at("S")) a.push_back(p.at("S"));  // the device template's default is H
            return a;
          },
          [](const Params& p) {
            return std::vector<ArgSpec>{
                {"hidden", KernelParam::Kind::pointer, "const dp_bf16*",
                 p.at("S") ? shape({p.at("W"), p.at("S")}, "bf16") : dims(p, {"W", "H"}, "bf16"),
                 p.at("S") ? "rows to normalise: the first H of every S elements" : "this layer's mixer/FFN output"},
                {"residual", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "residual stream in (layer 0 has none)", true},
                {"weight", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"H"}, "bf16"), "norm weight"},
                {"out", KernelParam::Kind::pointer, "dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "normalised rows (may alias hidden)"},
                {"residual_out", KernelParam::Kind::pointer, "dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "residual stream out (may alias residual)"},
                {"eps", KernelParam::Kind::f32, "float", "", "variance epsilon"},
            };
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = static_cast<uint32_t>(p.at("W"));
            s.block[0] = rmsnorm_threads(p.at("H"));
            return s;
          },
          [](const Params& p) { return rmsnorm_threads(p.at("H")); },
      },
  };
}

}  // namespace dp::codegen::ops
