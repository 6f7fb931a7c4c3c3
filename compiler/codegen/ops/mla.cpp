// mla_prep, mla_attn, mla_combine (templates/mla.h): NoPE MLA decode over the paged latent cache.
#include "codegen/ops/spec.h"

#include <fmt/format.h>

#include "common/error.h"

namespace dp::codegen::ops {
namespace {

// MLA split-KV attention: query rows (draft position, head) per block (DP_MLA_ROWS).
constexpr int64_t kMlaRows = 16;
int64_t mla_row_blocks(int64_t q, int64_t n) { return (q * n + kMlaRows - 1) / kMlaRows; }
// mla_combine: output columns per block (four per group).
int64_t mla_combine_cols(int64_t /*t*/) { return 32; }
constexpr int64_t kMlaAbsorbCols = 128;  // latent columns per mla_prep absorb block

// mla_attn's shared memory on NVIDIA (templates/mla.h, tensor-core path): each staged tile is 16 cache
// rows of L+R+8 bf16; the static rest is the score partials [4, 16, 16] fp32, the probabilities
// [16, 24] bf16 and the row rescales [16] fp32 (plus the two tiles when TS = 0).
int64_t mla_attn_tile_bytes(const Params& p) { return 16 * (p.at("L") + p.at("R") + 8) * 2; }
int64_t mla_attn_static_bytes(const Params& p) {
  return 4 * 16 * 16 * 4 + 16 * 24 * 2 + 16 * 4 + (p.at("TS") ? 0 : 2 * mla_attn_tile_bytes(p));
}
int64_t mla_attn_dynamic_bytes(const Params& p) { return p.at("TS") * mla_attn_tile_bytes(p); }
constexpr int64_t kMaxSharedOptIn = 227 * 1024;  // sm_90's per-block limit with opt-in

}  // namespace

std::vector<OpSpec> mla_ops() {
  std::vector<OpSpec> ops{
      {
          // MLA: kv_a_layernorm + latent-cache write, absorbed query q_nope . W_UK_T (+ q_pe).
          "mla_prep",
          "mla.h",
          "dp_mla_prep",
          {{"W", "w", 1, kMaxGemmRows, "requests"},
           {"Q", "q", 1, 8, "rows per request"},
           {"N", "n", 1, 1024, "MLA heads on this rank"},
           {"L", "l", 64, 4096, "kv_lora_rank, a multiple of 64"},
           {"R", "r", 0, 1024, "qk_rope_head_dim (unrotated: NoPE), even"},
           {"PN", "pn", 8, 1024, "qk_nope_head_dim, a multiple of 8"},
           {"V", "v", 8, 1024, "v_head_dim"},
           {"BS", "bs", 1, 1 << 16, "cache block size (tokens)"},
           q8_param("1: kv_b_proj e4m3 with 128 x 128 block scales")},
          [](const Params& p, const std::string& who) {
            if (p.at("W") * p.at("Q") > kMaxGemmRows)
              fail(Errc::input, "{}: W x Q = {} rows exceed {} (the absorbed query keeps every row in registers)",
                   who, p.at("W") * p.at("Q"), kMaxGemmRows);
            if (p.at("L") % 64 != 0 || p.at("R") % 2 != 0 || p.at("PN") % 8 != 0 || (p.at("L") + p.at("R")) % 8 != 0)
              fail(Errc::input, "{}: L = {} (multiple of 64), R = {} (even, L + R a multiple of 8), PN = {} "
                   "(multiple of 8) do not fit the templates", who, p.at("L"), p.at("R"), p.at("PN"));
          },
          [](const Params& p) {
            std::vector<int64_t> a{p.at("W") * p.at("Q"), p.at("Q"),  p.at("N"), p.at("L"),
                                   p.at("R"),             p.at("PN"), p.at("V"), p.at("BS")};
            if (p.at("Q8")) a.push_back(1);
            return a;
          },
          [](const Params& p) {
            const int64_t T = p.at("W") * p.at("Q"), N = p.at("N"), L = p.at("L"), R = p.at("R");
            std::vector<ArgSpec> a{
                {"q", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[{}, stride_q] bf16", T),
                 "q rows, head n at n*(PN+R): [nope | pe]"},
                {"stride_q", KernelParam::Kind::u32, "dp_u32", "", "elements between q rows"},
                {"kv", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[{}, stride_kv] bf16", T),
                 "kv_a_proj_with_mqa rows [c | k_pe]"},
                {"stride_kv", KernelParam::Kind::u32, "dp_u32", "", "elements between kv rows"},
                {"kv_norm_w", KernelParam::Kind::pointer, "const dp_bf16*", shape({L}, "bf16"), "kv_a_layernorm"},
                {"kv_b", KernelParam::Kind::pointer, p.at("Q8") ? "const dp_u8*" : "const dp_bf16*",
                 shape({N * (p.at("PN") + p.at("V")), L}, p.at("Q8") ? "e4m3" : "bf16"), "kv_b_proj"},
                {"seq_lens", KernelParam::Kind::pointer, "const dp_i32*", shape({p.at("W")}, "i32"),
                 "tokens per request incl. the new ones; 0 = padded"},
                {"slot_mapping", KernelParam::Kind::pointer, "const dp_i64*", shape({T}, "i64"),
                 "cache slot of each new token, -1 = none"},
                {"cache", KernelParam::Kind::pointer, "dp_bf16*", "[blocks, cache_stride] bf16",
                 fmt::format("latent cache: block b holds [{}, {}] at b*cache_stride; row of slot s at "
                             "(s / {})*cache_stride + (s % {})*{}, written", p.at("BS"), L + R, p.at("BS"),
                             p.at("BS"), L + R)},
                {"q_abs", KernelParam::Kind::pointer, "dp_bf16*", shape({T, N, L + R}, "bf16"),
                 "absorbed query [q_lat | q_pe]"},
                {"eps", KernelParam::Kind::f32, "float", "", "kv_a_layernorm epsilon"},
                {"cache_stride", KernelParam::Kind::u32, "dp_u32", "",
                 fmt::format("elements between cache blocks, a multiple of 8, at least {} (dense)",
                             p.at("BS") * (L + R))},
            };
            if (p.at("Q8"))
              a.push_back({"kv_b_scale", KernelParam::Kind::pointer, "const float*",
                           scale_shape(N * (p.at("PN") + p.at("V")), L), "block scales of kv_b"});
            return a;
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = static_cast<uint32_t>(p.at("W") * p.at("Q") +
                                              p.at("N") * ((p.at("L") + kMlaAbsorbCols - 1) / kMlaAbsorbCols));
            s.block[0] = 256;
            return s;
          },
          [](const Params&) { return uint32_t{256}; },
          "DP_KERNEL_BOUNDS",
      },
      {
          // MLA split-KV attention over the paged latent cache: per-split (max, sum, o_lat) partials.
          "mla_attn",
          "mla.h",
          "dp_mla_attn",
          {{"W", "w", 1, 4096, "requests"},
           {"Q", "q", 1, 8, "rows per request"},
           {"N", "n", 1, 1024, "MLA heads on this rank"},
           {"L", "l", 64, 1024, "kv_lora_rank, a multiple of 64"},
           {"R", "r", 0, 1024, "qk_rope_head_dim"},
           {"BS", "bs", 1, 1 << 16, "cache block size (tokens)"},
           {"NS", "ns", 1, 256, "KV splits per request"},
           {"TS", "ts", 0, 16, "NVIDIA: cache tiles staged per block in dynamic shared memory (TS - 1 in flight); "
            "0: two in static shared memory", true}},
          [](const Params& p, const std::string& who) {
            if (p.at("TS") == 1)
              fail(Errc::input, "{}: TS = 1 stages no tile ahead: 0 (two static buffers) or 2 to 16", who);
            if (p.at("TS") > 0 && mla_attn_dynamic_bytes(p) + mla_attn_static_bytes(p) > kMaxSharedOptIn)
              fail(Errc::input, "{}: TS = {} tiles of {} bytes and {} bytes of static shared memory exceed the {} "
                   "bytes an sm_90 block may opt in to", who, p.at("TS"), mla_attn_dynamic_bytes(p) / p.at("TS"),
                   mla_attn_static_bytes(p), kMaxSharedOptIn);
            if (p.at("L") % 64 != 0 || (p.at("L") + p.at("R")) % 8 != 0)
              fail(Errc::input, "{}: L = {} must be a multiple of 64 and L + R = {} a multiple of 8", who, p.at("L"),
                   p.at("L") + p.at("R"));
            // The staged tile and the block's queries share 48 KiB of static shared memory: 32 rows
            // of (L+R)/2 + 1 words and 8 query rows (lane-FMA path), 16 rows of L+R+8 bf16 and 4 KiB
            // of scores (tensor-core path).
            const int64_t kr = p.at("L") + p.at("R");
            const int64_t fma_bytes = (32 * (kr / 2 + 1) + 8 * (kr / 2)) * 4;
            const int64_t mma_bytes = 16 * (kr + 8) * 2 + 4 * 16 * 16 * 4 + 16 * 24 * 2 + 16 * 4;
            if (std::max(fma_bytes, mma_bytes) > 48 * 1024 || kr % 16 != 0)
              fail(Errc::input, "{}: a cache row of L + R = {} values is too wide for the attention tile (or not a "
                   "multiple of 16; at most {})", who, kr, 2 * (48 * 1024 / 4 - 32) / 40 / 16 * 16);
          },
          [](const Params& p) {
            std::vector<int64_t> a{p.at("W"), p.at("Q"), p.at("N"), p.at("L"), p.at("R"), p.at("BS"), p.at("NS")};
            if (p.at("TS")) a.push_back(p.at("TS"));
            return a;
          },
          [](const Params& p) {
            const int64_t W = p.at("W"), Q = p.at("Q"), N = p.at("N"), L = p.at("L"), NS = p.at("NS");
            return std::vector<ArgSpec>{
                {"q_abs", KernelParam::Kind::pointer, "const dp_bf16*", shape({W * Q, N, L + p.at("R")}, "bf16"),
                 "from mla_prep"},
                {"cache", KernelParam::Kind::pointer, "const dp_bf16*", "[blocks, cache_stride] bf16",
                 fmt::format("latent cache: block b holds [{}, {}] at b*cache_stride", p.at("BS"), L + p.at("R"))},
                {"block_table", KernelParam::Kind::pointer, "const dp_i32*", fmt::format("[{}, stride_bt] i32", W),
                 "physical block of each logical block"},
                {"stride_bt", KernelParam::Kind::u32, "dp_u32", "", "elements between block-table rows"},
                {"seq_lens", KernelParam::Kind::pointer, "const dp_i32*", shape({W}, "i32"), "0 = padded request"},
                {"part_o", KernelParam::Kind::pointer, "float*", shape({W, NS, Q, N, L}, "fp32"),
                 "unnormalised o_lat per split"},
                {"part_ml", KernelParam::Kind::pointer, "float*", shape({W, NS, Q, N, 2}, "fp32"),
                 "running max and sum per split"},
                {"scale", KernelParam::Kind::f32, "float", "", "softmax scale (qk_nope + qk_rope)^-1/2"},
                {"cache_stride", KernelParam::Kind::u32, "dp_u32", "",
                 fmt::format("elements between cache blocks, a multiple of 8, at least {} (dense)",
                             p.at("BS") * (L + p.at("R")))},
            };
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = static_cast<uint32_t>(mla_row_blocks(p.at("Q"), p.at("N")));
            s.grid[1] = static_cast<uint32_t>(p.at("NS"));
            s.grid[2] = static_cast<uint32_t>(p.at("W"));
            s.block[0] = 256;
            return s;
          },
          [](const Params&) { return uint32_t{256}; },
          "DP_KERNEL_BOUNDS_2",  // two blocks per SM hide one block's tile load behind the other's arithmetic
      },
      {
          // MLA: merge the splits, o_lat . W_UV per head, K3 output gate.
          "mla_combine",
          "mla.h",
          "dp_mla_combine",
          {{"W", "w", 1, 4096, "requests"},
           {"Q", "q", 1, 8, "rows per request"},
           {"N", "n", 1, 1024, "MLA heads on this rank"},
           {"L", "l", 8, 4096, "kv_lora_rank"},
           {"PN", "pn", 8, 1024, "qk_nope_head_dim"},
           {"V", "v", 8, 1024, "v_head_dim"},
           {"NS", "ns", 1, 256, "KV splits per request"},
           {"OG", "og", 0, 1, "1: K3 output gate sigmoid(g_proj x)"},
           q8_param("1: kv_b_proj e4m3 with 128 x 128 block scales")},
          [](const Params& p, const std::string& who) {
            check_multiple_of_8(p, who, {"L"});
            if (p.at("Q8")) check_multiple_of_16(p, who, {"L"});
          },
          [](const Params& p) {
            std::vector<int64_t> a{p.at("W"),  p.at("Q"), p.at("N"),  p.at("L"),
                                   p.at("PN"), p.at("V"), p.at("NS"), p.at("OG")};
            if (p.at("Q8")) a.push_back(1);
            return a;
          },
          [](const Params& p) {
            const int64_t W = p.at("W"), Q = p.at("Q"), N = p.at("N"), L = p.at("L"), NS = p.at("NS");
            std::vector<ArgSpec> a{
                {"part_o", KernelParam::Kind::pointer, "const float*", shape({W, NS, Q, N, L}, "fp32"),
                 "from mla_attn"},
                {"part_ml", KernelParam::Kind::pointer, "const float*", shape({W, NS, Q, N, 2}, "fp32"),
                 "from mla_attn"},
                {"seq_lens", KernelParam::Kind::pointer, "const dp_i32*", shape({W}, "i32"), "0 = padded request"},
                {"kv_b", KernelParam::Kind::pointer, p.at("Q8") ? "const dp_u8*" : "const dp_bf16*",
                 shape({N * (p.at("PN") + p.at("V")), L}, p.at("Q8") ? "e4m3" : "bf16"), "kv_b_proj (W_UV rows)"},
                {"gate", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[{}, stride_g] bf16", W * Q),
                 "K3 g_proj output, head n at n*V (null when OG = 0)", true},
                {"stride_g", KernelParam::Kind::u32, "dp_u32", "", "elements between gate rows"},
                {"out", KernelParam::Kind::pointer, "dp_bf16*", shape({W * Q, N * p.at("V")}, "bf16"),
                 "o_proj input"},
            };
            if (p.at("Q8"))
              a.push_back({"kv_b_scale", KernelParam::Kind::pointer, "const float*",
                           scale_shape(N * (p.at("PN") + p.at("V")), L), "block scales of kv_b"});
            return a;
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = static_cast<uint32_t>(p.at("N"));
            const int64_t cols = mla_combine_cols(p.at("W") * p.at("Q"));
            s.grid[1] = static_cast<uint32_t>((p.at("V") + cols - 1) / cols);
            s.block[0] = 256;
            return s;
          },
          [](const Params&) { return uint32_t{256}; },
          "DP_KERNEL_BOUNDS",
      },
  };
  for (OpSpec& op : ops)
    if (std::string_view(op.name) == "mla_attn")
      op.dynamic_shared = [](const Params& p, const std::string& target) {
        return target.rfind("sm_", 0) == 0 ? static_cast<uint32_t>(mla_attn_dynamic_bytes(p)) : uint32_t{0};
      };
  return ops;
}

}  // namespace dp::codegen::ops
