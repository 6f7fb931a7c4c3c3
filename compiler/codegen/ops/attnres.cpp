// attnres (templates/attnres.h): K3 block attention residuals, the fused add + mix (+ push) + RMSNorm,
// one block per row.
#include "codegen/ops/spec.h"

#include "common/error.h"

namespace dp::codegen::ops {
namespace {

// The rmsnorm block shape (norm.cpp): at most a few 16-byte vectors of the row per thread.
uint32_t attnres_threads(int64_t h) {
  const int64_t vecs = h / 8;
  const int64_t per = (vecs + 255) / 256;
  const int64_t threads = (vecs + per - 1) / per;
  return static_cast<uint32_t>(std::max<int64_t>(64, (threads + 63) / 64 * 64));
}

}  // namespace

std::vector<OpSpec> attnres_ops() {
  return {
      {
          "attnres",
          "attnres.h",
          "dp_attn_res_norm",
          {{"W", "w", 1, 4096, "rows (batch width x rows per request)"},
           {"H", "h", 8, 1 << 20, "row length (hidden size), a multiple of 8"},
           {"B", "b", 1, 4096, "attention-residual block size (attn_res_block_size): layer i pushes when i % B == 0"},
           {"NB", "n", 1, 64, "blocks the attn_res buffer holds per row: ceil(num_hidden_layers / B)"},
           {"S", "s", 0, 2, "stage: 0 before the input norm (may push), 1 before the post-attention norm, 2 the "
                            "final norm"}},
          [](const Params& p, const std::string& who) {
            check_multiple_of_8(p, who, {"H"});
          },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W"), p.at("H"), p.at("B"), p.at("NB"), p.at("S"),
                                        attnres_threads(p.at("H"))};
          },
          [](const Params& p) {
            return std::vector<ArgSpec>{
                {"hidden", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "the mixer / FFN output (layer 0: the embedding)"},
                {"residual", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "the block's partial sum p in (layer 0 has none)", true},
                {"blocks", KernelParam::Kind::pointer, "dp_bf16*", shape({p.at("W"), p.at("NB"), p.at("H")}, "bf16"),
                 "the attn_res buffer: the stored blocks of each row (rows stride_blocks apart); a push writes one"},
                {"stride_blocks", KernelParam::Kind::u32, "dp_u32", "", "elements between rows of blocks"},
                {"layer", KernelParam::Kind::u32, "dp_u32", "", "the decoder layer (S 2: num_hidden_layers)"},
                {"res_norm", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"H"}, "bf16"),
                 "the mix's *_res_norm weight"},
                {"res_proj", KernelParam::Kind::pointer, "const dp_bf16*", shape({1, p.at("H")}, "bf16"),
                 "the mix's *_res_proj weight"},
                {"weight", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"H"}, "bf16"),
                 "the norm weight after the mix"},
                {"out", KernelParam::Kind::pointer, "dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "normalised rows (may alias hidden)"},
                {"residual_out", KernelParam::Kind::pointer, "dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "p out, 0 after a push (may alias residual)"},
                {"eps", KernelParam::Kind::f32, "float", "", "epsilon of the mix's inv_rms and of the norm"},
            };
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = static_cast<uint32_t>(p.at("W"));
            s.block[0] = attnres_threads(p.at("H"));
            return s;
          },
          [](const Params& p) { return attnres_threads(p.at("H")); },
      },
  };
}

}  // namespace dp::codegen::ops
