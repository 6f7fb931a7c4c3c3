#include "codegen/kernel.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>

#include "common/error.h"

namespace dp::codegen {
namespace {

using Params = std::map<std::string, int64_t>;

struct ParamSpec {
  const char* key;     // "W": the name in KernelInstance::params
  const char* prefix;  // "w": its spelling in the kernel name
  int64_t min, max;    // inclusive
  const char* doc;
  // Left out of the kernel name when 0 (optional segments, flags that are usually off). Only for
  // parameters whose zero is unambiguous from the others (trailing GEMM segments, the f32 flag).
  bool omit_zero = false;
};

// A parameter of the entry point before layout (offsets are computed in kernel_signature()).
struct ArgSpec {
  const char* name;
  KernelParam::Kind kind;
  const char* c_type;
  std::string shape;
  std::string doc;
  bool nullable = false;
};

struct OpSpec {
  const char* name;
  const char* header;     // in templates/
  const char* device_fn;  // the device template the entry point calls
  std::vector<ParamSpec> params;  // fixed order: the order of the kernel name
  std::function<void(const Params&, const std::string& who)> check;  // op-specific constraints
  std::function<std::vector<int64_t>(const Params&)> template_args;   // device template arguments
  std::function<std::vector<ArgSpec>(const Params&)> args;
  std::function<LaunchShape(const Params&)> launch;
  std::function<uint32_t(const Params&)> block_threads;
  // The launch-bounds macro of the entry point (vendor.h, or the op header's own).
  const char* bounds = "DP_LAUNCH_BOUNDS";
};

// rmsnorm block size: enough threads that each holds at most a few 16-byte vectors of the row in
// registers (at most 256 threads, then more vectors per thread), rounded to whole wave64
// wavefronts so that one block shape serves both vendors. H = 2304 gives 192 threads x 2 vectors.
uint32_t rmsnorm_threads(int64_t h) {
  const int64_t vecs = h / 8;
  const int64_t per = (vecs + 255) / 256;
  const int64_t threads = (vecs + per - 1) / per;
  return static_cast<uint32_t>(std::max<int64_t>(64, (threads + 63) / 64 * 64));
}


// ---- GEMM-shaped kernels (templates/gemm.h, moe.h) -----------------------------------------------
// Every GEMM-shaped block is 256 threads = 8 groups of 32 lanes; a group owns a slot of 16*MT weight
// rows (MT tiles of 16 rows, the tensor-core tile height on NVIDIA) and one of S K-slices (split-K), so
// a block covers (8/S)*16*MT rows. These are functions of the named parameters (never of the target),
// so the kernel name stays a function of its parameters.
constexpr uint32_t kGemmThreads = 256;
constexpr int64_t kGemmGroups = 8;
constexpr int64_t kTileRows = 16;        // weight rows of one tensor-core tile
constexpr int64_t kChunkElems = 32;      // K elements a group consumes per step (four 16-byte vectors per row)
constexpr int64_t kMinSliceChunks = 8;   // chunks a K-slice should have (the loads one lane keeps in flight)
constexpr int64_t kMaxGemmRows = 32;     // activation rows (W*q) of one launch
constexpr int64_t kTargetBlocks = 264;   // about two blocks per SM of a 132-SM H200

struct GemmGeometry {
  int64_t mt = 1;  // 16-row tiles per slot
  int64_t s = 1;   // K-slices (split-K) per block
  int64_t rows() const { return kGemmGroups / s * kTileRows * mt; }
};

int64_t pow2_floor(int64_t x) {
  int64_t p = 1;
  while (p * 2 <= x) p *= 2;
  return p;
}

// Rows per block from the matrix height: about kTargetBlocks blocks where the matrix is tall enough,
// otherwise one tile of 16 rows per block with K split over the 8 groups, as far as K is long enough
// that every slice still keeps a lane's loads in flight.
GemmGeometry gemm_geometry(int64_t /*t*/, int64_t k, int64_t n_total) {
  const int64_t rb = std::clamp<int64_t>(pow2_floor(std::max<int64_t>(1, n_total / kTargetBlocks)), kTileRows,
                                         kGemmGroups * kTileRows);
  GemmGeometry g;
  g.s = kGemmGroups * kTileRows / rb;
  const int64_t chunks = (k + kChunkElems - 1) / kChunkElems;
  g.s = std::min(g.s, std::max<int64_t>(1, pow2_floor(chunks / kMinSliceChunks)));
  return g;
}

// MoE / MLP gate-up blocks: S = 4 K-slices, so a block holds 2 slots of 8 features (gate and up rows
// of a feature in one 16-row tile): 16 features per block.
constexpr int64_t kFfnSlices = 4;
constexpr int64_t kFfnFeatures = kGemmGroups / kFfnSlices * (kTileRows / 2);

constexpr const char* kGemmSegKeys[6] = {"NA", "NB", "NC", "ND", "NE", "NF"};

int64_t gemm_ntot(const Params& p) {
  int64_t n = 0;
  for (const char* k : kGemmSegKeys) n += p.at(k);
  return n;
}

uint32_t gemm_grid(const Params& p) {
  const int64_t rb = gemm_geometry(p.at("W"), p.at("K"), gemm_ntot(p)).rows();
  int64_t blocks = 0;
  for (const char* k : kGemmSegKeys) blocks += (p.at(k) + rb - 1) / rb;
  return static_cast<uint32_t>(blocks);
}


int64_t moe_max_used(const Params& p) { return std::min(p.at("E"), p.at("W") * p.at("K")); }

// moe_up from 2 activation rows: every warp computes whole 8-feature tiles (gate and up rows in one
// tensor-core tile, over all of D) and walks the step's tiles with a grid stride; one row keeps the
// block tiles of 16 features (4 K-slices, lane FMAs). Measured on the H200 (bench/NOTES.md).
bool moe_up_warp_tiles(const Params& p) { return p.at("W") >= 2; }

// moe_down: output features per block (M). One activation row: every group keeps 4 x 1 lane-FMA
// accumulators for its items and streams 4 rows of each. From 2 rows: a 16-row tensor-core tile per
// item (on AMD the lane-FMA loop walks the 16 rows 4 at a time).
int64_t moe_down_rows(int64_t t) { return t == 1 ? 4 : kTileRows; }

void check_multiple_of_8(const Params& p, const std::string& who, std::initializer_list<const char*> keys) {
  for (const char* k : keys)
    if (p.at(k) % 8 != 0)
      fail(Errc::input, "{}: parameter {} = {} is not a multiple of 8 (rows are read as 16-byte bf16 vectors)", who, k,
           p.at(k));
}

void check_topk(const Params& p, const std::string& who) {
  if (p.at("K") > p.at("E"))
    fail(Errc::input, "{}: parameter K = {} (top-k) exceeds E = {} experts", who, p.at("K"), p.at("E"));
}

std::string shape(std::initializer_list<int64_t> d, const char* dtype) {
  std::string s = "[";
  for (int64_t x : d) s += fmt::format("{}{}", s.size() > 1 ? ", " : "", x);
  return s + "] " + dtype;
}

// MLA split-KV attention: query rows (draft position, head) per block (DP_MLA_ROWS).
constexpr int64_t kMlaRows = 16;
int64_t mla_row_blocks(int64_t q, int64_t n) { return (q * n + kMlaRows - 1) / kMlaRows; }
// mla_combine: output columns per block (four per group).
int64_t mla_combine_cols(int64_t /*t*/) { return 32; }
constexpr int64_t kMlaAbsorbCols = 128;  // latent columns per mla_prep absorb block

std::string dims(const Params& p, std::initializer_list<const char*> keys, const char* dtype) {
  std::string s = "[";
  for (const char* k : keys) {
    if (s.size() > 1) s += ", ";
    s += std::to_string(p.at(k));
  }
  return s + "] " + dtype;
}

// Indexer ops: fixed blocks, grids from the chunk at run time (the manifest's grid is a default).
constexpr int64_t kIdxThreads = 256;
LaunchShape idx_launch(uint32_t threads) {
  LaunchShape s;
  s.block[0] = threads;
  s.grid_is_default = true;
  return s;
}

// An indexer op without compile-time parameters: blocks of kIdxThreads, the same arguments always.
OpSpec indexer_op(const char* name, const char* device_fn, std::vector<ArgSpec> args) {
  return {name,
          "indexer.h",
          device_fn,
          {},
          [](const Params&, const std::string&) {},
          [](const Params&) { return std::vector<int64_t>{kIdxThreads}; },
          [args](const Params&) { return args; },
          [](const Params&) { return idx_launch(kIdxThreads); },
          [](const Params&) { return static_cast<uint32_t>(kIdxThreads); }};
}

const std::vector<OpSpec>& ops() {
  static const std::vector<OpSpec> table = {
      {
          // Skinny GEMM over up to six weights that read the same input, stacked in one launch.
          "gemm",
          "gemm.h",
          "dp_gemm",
          {{"W", "w", 1, kMaxGemmRows, "activation rows (requests x q)"},
           {"K", "k", 8, 1 << 20, "input width, a multiple of 8"},
           {"NA", "na", 1, 1 << 20, "rows of weight 0"},
           {"NB", "nb", 0, 1 << 20, "rows of weight 1 (0: absent)", true},
           {"NC", "nc", 0, 1 << 20, "rows of weight 2 (0: absent)", true},
           {"ND", "nd", 0, 1 << 20, "rows of weight 3 (0: absent)", true},
           {"NE", "ne", 0, 1 << 20, "rows of weight 4 (0: absent)", true},
           {"NF", "nf", 0, 1 << 20, "rows of weight 5 (0: absent)", true},
           {"F", "f", 0, 1, "1: fp32 output (router logits), 0: bf16", true}},
          [](const Params& p, const std::string& who) {
            check_multiple_of_8(p, who, {"K"});
            for (int i = 1; i < 6; ++i)
              if (p.at(kGemmSegKeys[i]) > 0 && p.at(kGemmSegKeys[i - 1]) == 0)
                fail(Errc::input, "{}: parameter {} = {} follows {} = 0 (absent weights must be the last ones)", who,
                     kGemmSegKeys[i], p.at(kGemmSegKeys[i]), kGemmSegKeys[i - 1]);
          },
          [](const Params& p) {
            const GemmGeometry g = gemm_geometry(p.at("W"), p.at("K"), gemm_ntot(p));
            return std::vector<int64_t>{p.at("W"), p.at("K"), p.at("NA"), p.at("NB"), p.at("NC"), p.at("ND"),
                                        p.at("NE"), p.at("NF"), p.at("F"), g.mt, g.s};
          },
          [](const Params& p) {
            const char* out_t = p.at("F") ? "fp32" : "bf16";
            std::vector<ArgSpec> a{
                {"x", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"W", "K"}, "bf16"), "input rows"},
                {"out", KernelParam::Kind::pointer, "void*", shape({p.at("W"), gemm_ntot(p)}, out_t),
                 "outputs of the weights side by side, in weight order"},
            };
            static const char* names[6] = {"w0", "w1", "w2", "w3", "w4", "w5"};
            for (int i = 0; i < 6; ++i)
              if (p.at(kGemmSegKeys[i]) > 0)
                a.push_back({names[i], KernelParam::Kind::pointer, "const dp_bf16*",
                             shape({p.at(kGemmSegKeys[i]), p.at("K")}, "bf16"), "weight [out, in]"});
            return a;
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = gemm_grid(p);
            s.block[0] = kGemmThreads;
            return s;
          },
          [](const Params&) { return kGemmThreads; },
          "DP_KERNEL_BOUNDS",
      },
      {
          // KDA recurrent step: conv + gates + L2 norm + gated delta rule + gated RMSNorm, all heads.
          "kda_step",
          "kda.h",
          "dp_kda_step",
          {{"W", "w", 1, 4096, "requests"},
           {"Q", "q", 1, 16, "rows per request (1 + speculative tokens)"},
           {"NH", "nh", 1, 1024, "KDA heads on this rank"},
           {"D", "d", 64, 256, "head dim (64, 128, 192 or 256)"},
           {"CV", "cv", 2, 8, "short conv kernel size"},
           {"FR", "fr", 8, 1024, "forget gate rank (f_a rows), a multiple of 8"},
           {"GR", "gr", 0, 1024, "output gate rank (g_a rows); 0: full-rank g_proj (K3)"},
           {"SG", "sg", 0, 1, "1: K3 safe gate (lower_bound * sigmoid), 0: softplus gate"},
           {"ON", "on", 0, 1, "1: o_norm weight is fp32, 0: bf16"}},
          [](const Params& p, const std::string& who) {
            if (p.at("D") % 64 != 0)
              fail(Errc::input, "{}: parameter D = {} is not a multiple of 64 (valid: 64, 128, 192, 256)", who,
                   p.at("D"));
            check_multiple_of_8(p, who, {"FR", "GR"});
          },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W"), p.at("Q"), p.at("NH"), p.at("D"), p.at("CV"),
                                        p.at("FR"), p.at("GR"), p.at("SG"), p.at("ON")};
          },
          [](const Params& p) {
            const int64_t W = p.at("W"), Q = p.at("Q"), NH = p.at("NH"), D = p.at("D"), P = NH * D;
            const int64_t NP = 3 * P + p.at("FR") + (p.at("GR") > 0 ? p.at("GR") : P) + NH;
            const std::string conv_slot = fmt::format("[{}, {}]", p.at("CV") - 1, P);
            return std::vector<ArgSpec>{
                {"proj", KernelParam::Kind::pointer, "const dp_bf16*", shape({W * Q, NP}, "bf16"),
                 "projections, columns q | k | v | f_a | g_a (g when GR = 0) | b"},
                {"w_fb", KernelParam::Kind::pointer, "const dp_bf16*", shape({P, p.at("FR")}, "bf16"), "f_b_proj"},
                {"w_gb", KernelParam::Kind::pointer, "const dp_bf16*", shape({P, p.at("GR")}, "bf16"),
                 "g_b_proj (null when GR = 0)", true},
                {"conv_wq", KernelParam::Kind::pointer, "const float*", shape({P, p.at("CV")}, "fp32"), "q_conv1d"},
                {"conv_wk", KernelParam::Kind::pointer, "const float*", shape({P, p.at("CV")}, "fp32"), "k_conv1d"},
                {"conv_wv", KernelParam::Kind::pointer, "const float*", shape({P, p.at("CV")}, "fp32"), "v_conv1d"},
                {"dt_bias", KernelParam::Kind::pointer, "const float*", shape({P}, "fp32"), "dt_bias"},
                {"a_log", KernelParam::Kind::pointer, "const float*", shape({NH}, "fp32"),
                 "A_log of this rank's heads (K3: replicated tensor + rank*NH)"},
                {"o_norm", KernelParam::Kind::pointer, "const void*", shape({D}, p.at("ON") ? "fp32" : "bf16"),
                 "o_norm.weight"},
                {"state", KernelParam::Kind::pointer, "float*", "[slots, state_stride] fp32",
                 fmt::format("recurrent state pool: slot s holds S[k][v] [{}, {}, {}] at s*state_stride, updated "
                             "in place", NH, D, D)},
                {"conv_q", KernelParam::Kind::pointer, "dp_bf16*", "[slots, conv_stride] bf16",
                 fmt::format("q conv state pool: slot s holds {} at s*conv_stride, updated in place", conv_slot)},
                {"conv_k", KernelParam::Kind::pointer, "dp_bf16*", "[slots, conv_stride] bf16",
                 fmt::format("k conv state pool, {} per slot", conv_slot)},
                {"conv_v", KernelParam::Kind::pointer, "dp_bf16*", "[slots, conv_stride] bf16",
                 fmt::format("v conv state pool, {} per slot", conv_slot)},
                {"slots", KernelParam::Kind::pointer, "const dp_i32*", shape({W, Q}, "i32"),
                 "state slot per draft position; slots[r][0] = 0 marks a padded request"},
                {"num_accepted", KernelParam::Kind::pointer, "const dp_i32*", shape({W}, "i32"),
                 "accepted tokens of the previous step, 1..Q (null when Q = 1)", true},
                {"out", KernelParam::Kind::pointer, "dp_bf16*", shape({W * Q, P}, "bf16"), "gated RMSNorm output"},
                {"lower_bound", KernelParam::Kind::f32, "float", "", "safe gate lower bound (SG = 1)"},
                {"onorm_eps", KernelParam::Kind::f32, "float", "", "gated RMSNorm epsilon"},
                {"state_stride", KernelParam::Kind::u32, "dp_u32", "",
                 fmt::format("fp32 elements between state slots, at least {} (dense)", NH * D * D)},
                {"conv_stride", KernelParam::Kind::u32, "dp_u32", "",
                 fmt::format("elements between conv-state slots, at least {} (dense)", (p.at("CV") - 1) * P)},
            };
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = static_cast<uint32_t>(p.at("NH"));
            s.grid[1] = static_cast<uint32_t>(p.at("W"));
            s.block[0] = static_cast<uint32_t>(4 * p.at("D"));
            return s;
          },
          [](const Params& p) { return static_cast<uint32_t>(4 * p.at("D")); },
          "DP_KERNEL_BOUNDS",
      },
      {
          // MoE routing: sigmoid, correction bias, top-k, renormalise; the step's used-expert list.
          "moe_route",
          "moe.h",
          "dp_moe_route",
          {{"W", "w", 1, 64, "activation rows (requests x q)"},
           {"E", "e", 1, 1024, "routed experts"},
           {"K", "k", 1, 32, "experts per token (top-k)"},
           {"RN", "rn", 0, 1, "1: renormalise the top-k weights"}},
          [](const Params& p, const std::string& who) { check_topk(p, who); },
          [](const Params& p) { return std::vector<int64_t>{p.at("W"), p.at("E"), p.at("K"), p.at("RN")}; },
          [](const Params& p) {
            const int64_t W = p.at("W"), E = p.at("E"), K = p.at("K"), U = moe_max_used(p);
            return std::vector<ArgSpec>{
                {"logits", KernelParam::Kind::pointer, "const float*", shape({W, E}, "fp32"), "router logits"},
                {"bias", KernelParam::Kind::pointer, "const float*", shape({E}, "fp32"),
                 "e_score_correction_bias (selection only)"},
                {"topk_ids", KernelParam::Kind::pointer, "dp_i32*", shape({W, K}, "i32"), "chosen experts"},
                {"topk_weights", KernelParam::Kind::pointer, "float*", shape({W, K}, "fp32"),
                 "their weights (renormalised, unscaled)"},
                {"experts", KernelParam::Kind::pointer, "dp_i32*", shape({1 + U}, "i32"),
                 "count, then the used experts ascending"},
                {"expert_slots", KernelParam::Kind::pointer, "dp_i32*", shape({U, W}, "i32"),
                 "top-k position of each used expert per row, or -1"},
            };
          },
          [](const Params&) {
            LaunchShape s;
            s.block[0] = 256;
            return s;
          },
          [](const Params&) { return uint32_t{256}; },
          "DP_KERNEL_BOUNDS",
      },
      {
          // Gate/up + activation of every used routed expert and of the shared expert, one launch.
          "moe_up",
          "moe.h",
          "dp_moe_up",
          {{"W", "w", 1, kMaxGemmRows, "activation rows (requests x q)"},
           {"D", "d", 8, 1 << 20, "expert input width (hidden, or K3 latent)"},
           {"I", "i", 8, 1 << 20, "expert intermediate width (this rank's shard)"},
           {"E", "e", 1, 1024, "routed experts"},
           {"K", "k", 1, 32, "experts per token (top-k)"},
           {"S", "s", 0, 1 << 20, "shared expert width (this rank's shard); 0: none"},
           {"ACT", "act", 0, 1, "0: silu(gate)*up, 1: K3 SiTU"}},
          [](const Params& p, const std::string& who) {
            check_multiple_of_8(p, who, {"D", "I", "S"});
            check_topk(p, who);
          },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W"), p.at("D"), p.at("I"), p.at("E"), p.at("K"), p.at("S"),
                                        p.at("ACT"), 1, kFfnSlices, moe_up_warp_tiles(p) ? 1 : 0};
          },
          [](const Params& p) {
            const int64_t W = p.at("W"), D = p.at("D"), I = p.at("I"), E = p.at("E"), K = p.at("K"), S = p.at("S");
            const int64_t U = moe_max_used(p);
            std::vector<ArgSpec> a{
                {"x", KernelParam::Kind::pointer, "const dp_bf16*", shape({W, D}, "bf16"), "post-attention-norm rows"},
                {"w1", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[{}, stride_w1] bf16", E),
                 fmt::format("expert gate weights: expert e's [{}, {}] at e*stride_w1", I, D)},
                {"w3", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[{}, stride_w3] bf16", E),
                 fmt::format("expert up weights: expert e's [{}, {}] at e*stride_w3 (fused w13: w1 + {})", I, D,
                             I * D)},
                {"shared_gate", KernelParam::Kind::pointer, "const dp_bf16*", shape({S, D}, "bf16"),
                 "shared expert gate_proj (null when S = 0)", true},
                {"shared_up", KernelParam::Kind::pointer, "const dp_bf16*", shape({S, D}, "bf16"),
                 "shared expert up_proj (null when S = 0)", true},
                {"experts", KernelParam::Kind::pointer, "const dp_i32*", shape({1 + U}, "i32"), "from moe_route"},
                {"expert_slots", KernelParam::Kind::pointer, "const dp_i32*", shape({U, W}, "i32"), "from moe_route"},
                {"h", KernelParam::Kind::pointer, "dp_bf16*", shape({W, K, I}, "bf16"), "routed activations"},
                {"hs", KernelParam::Kind::pointer, "dp_bf16*", shape({W, S}, "bf16"),
                 "shared expert activations (null when S = 0)", true},
                {"stride_w1", KernelParam::Kind::u32, "dp_u32", "",
                 fmt::format("elements between experts of w1, a multiple of 8, at least {} (dense; fused w13: {})",
                             I * D, 2 * I * D)},
                {"stride_w3", KernelParam::Kind::u32, "dp_u32", "",
                 fmt::format("elements between experts of w3, a multiple of 8, at least {} (dense; fused w13: {})",
                             I * D, 2 * I * D)},
            };
            if (p.at("ACT")) {
              a.push_back({"act_beta", KernelParam::Kind::f32, "float", "", "SiTU beta"});
              a.push_back({"act_linear_beta", KernelParam::Kind::f32, "float", "", "SiTU linear beta"});
            }
            return a;
          },
          [](const Params& p) {
            LaunchShape s;
            if (moe_up_warp_tiles(p)) {
              // Warp tiles of 8 features: enough blocks of 8 warps for the most tiles a step can have,
              // at most kTargetBlocks (the warps walk the tiles with a stride).
              const int64_t tiles = (p.at("S") + 7) / 8 + moe_max_used(p) * ((p.at("I") + 7) / 8);
              s.grid[0] = static_cast<uint32_t>(std::min(kTargetBlocks, (tiles + kGemmGroups - 1) / kGemmGroups));
              s.block[0] = kGemmThreads;
              return s;
            }
            const int64_t n_i = (p.at("I") + kFfnFeatures - 1) / kFfnFeatures;
            const int64_t n_s = (p.at("S") + kFfnFeatures - 1) / kFfnFeatures;
            s.grid[0] = static_cast<uint32_t>(n_s + moe_max_used(p) * n_i);
            s.block[0] = kGemmThreads;
            return s;
          },
          [](const Params&) { return kGemmThreads; },
          "DP_KERNEL_BOUNDS",
      },
      {
          // Down projection of every used expert, weighted sum, routed scaling, plus the shared expert.
          "moe_down",
          "moe.h",
          "dp_moe_down",
          {{"W", "w", 1, kMaxGemmRows, "activation rows (requests x q)"},
           {"D", "d", 8, 1 << 20, "expert output width (hidden, or K3 latent)"},
           {"I", "i", 8, 1 << 20, "expert intermediate width (this rank's shard)"},
           {"E", "e", 1, 1024, "routed experts"},
           {"K", "k", 1, 32, "experts per token (top-k)"},
           {"S", "s", 0, 1 << 20, "shared expert width (this rank's shard); 0: none"}},
          [](const Params& p, const std::string& who) {
            check_multiple_of_8(p, who, {"D", "I", "S"});
            check_topk(p, who);
          },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W"), p.at("D"), p.at("I"), p.at("E"), p.at("K"), p.at("S"),
                                        moe_down_rows(p.at("W"))};
          },
          [](const Params& p) {
            const int64_t W = p.at("W"), D = p.at("D"), I = p.at("I"), E = p.at("E"), K = p.at("K"), S = p.at("S");
            const int64_t U = moe_max_used(p);
            return std::vector<ArgSpec>{
                {"h", KernelParam::Kind::pointer, "const dp_bf16*", shape({W, K, I}, "bf16"), "from moe_up"},
                {"hs", KernelParam::Kind::pointer, "const dp_bf16*", shape({W, S}, "bf16"),
                 "from moe_up (null when S = 0)", true},
                {"w2", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[{}, stride_w2] bf16", E),
                 fmt::format("expert down weights: expert e's [{}, {}] at e*stride_w2", D, I)},
                {"shared_down", KernelParam::Kind::pointer, "const dp_bf16*", shape({D, S}, "bf16"),
                 "shared expert down_proj (null when S = 0)", true},
                {"experts", KernelParam::Kind::pointer, "const dp_i32*", shape({1 + U}, "i32"), "from moe_route"},
                {"expert_slots", KernelParam::Kind::pointer, "const dp_i32*", shape({U, W}, "i32"), "from moe_route"},
                {"topk_weights", KernelParam::Kind::pointer, "const float*", shape({W, K}, "fp32"), "from moe_route"},
                {"out", KernelParam::Kind::pointer, "dp_bf16*", shape({W, D}, "bf16"), "FFN output"},
                {"routed_scaling", KernelParam::Kind::f32, "float", "", "routed_scaling_factor"},
                {"stride_w2", KernelParam::Kind::u32, "dp_u32", "",
                 fmt::format("elements between experts of w2, a multiple of 8, at least {} (dense)", D * I)},
            };
          },
          [](const Params& p) {
            LaunchShape s;
            const int64_t m = moe_down_rows(p.at("W"));
            s.grid[0] = static_cast<uint32_t>((p.at("D") + m - 1) / m);
            s.block[0] = kGemmThreads;
            return s;
          },
          [](const Params&) { return kGemmThreads; },
          "DP_KERNEL_BOUNDS",
      },
      {
          // Dense MLP gate/up + activation (its down projection is a gemm).
          "mlp_up",
          "moe.h",
          "dp_mlp_up",
          {{"W", "w", 1, kMaxGemmRows, "activation rows (requests x q)"},
           {"D", "d", 8, 1 << 20, "input width (hidden)"},
           {"I", "i", 8, 1 << 20, "intermediate width (this rank's shard)"},
           {"ACT", "act", 0, 1, "0: silu(gate)*up, 1: K3 SiTU"}},
          [](const Params& p, const std::string& who) { check_multiple_of_8(p, who, {"D", "I"}); },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W"), p.at("D"), p.at("I"), p.at("ACT"), 1, kFfnSlices};
          },
          [](const Params& p) {
            std::vector<ArgSpec> a{
                {"x", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"W", "D"}, "bf16"),
                 "post-attention-norm rows"},
                {"w_gate", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"I", "D"}, "bf16"), "gate_proj"},
                {"w_up", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"I", "D"}, "bf16"), "up_proj"},
                {"h", KernelParam::Kind::pointer, "dp_bf16*", dims(p, {"W", "I"}, "bf16"),
                 "activations (down_proj input)"},
            };
            if (p.at("ACT")) {
              a.push_back({"act_beta", KernelParam::Kind::f32, "float", "", "SiTU beta"});
              a.push_back({"act_linear_beta", KernelParam::Kind::f32, "float", "", "SiTU linear beta"});
            }
            return a;
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = static_cast<uint32_t>((p.at("I") + kFfnFeatures - 1) / kFfnFeatures);
            s.block[0] = kGemmThreads;
            return s;
          },
          [](const Params&) { return kGemmThreads; },
          "DP_KERNEL_BOUNDS",
      },
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
           {"BS", "bs", 1, 1 << 16, "cache block size (tokens)"}},
          [](const Params& p, const std::string& who) {
            if (p.at("W") * p.at("Q") > kMaxGemmRows)
              fail(Errc::input, "{}: W x Q = {} rows exceed {} (the absorbed query keeps every row in registers)",
                   who, p.at("W") * p.at("Q"), kMaxGemmRows);
            if (p.at("L") % 64 != 0 || p.at("R") % 2 != 0 || p.at("PN") % 8 != 0 || (p.at("L") + p.at("R")) % 8 != 0)
              fail(Errc::input, "{}: L = {} (multiple of 64), R = {} (even, L + R a multiple of 8), PN = {} "
                   "(multiple of 8) do not fit the templates", who, p.at("L"), p.at("R"), p.at("PN"));
          },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W") * p.at("Q"), p.at("Q"),  p.at("N"), p.at("L"),
                                        p.at("R"),             p.at("PN"), p.at("V"), p.at("BS")};
          },
          [](const Params& p) {
            const int64_t T = p.at("W") * p.at("Q"), N = p.at("N"), L = p.at("L"), R = p.at("R");
            return std::vector<ArgSpec>{
                {"q", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[{}, stride_q] bf16", T),
                 "q rows, head n at n*(PN+R): [nope | pe]"},
                {"stride_q", KernelParam::Kind::u32, "dp_u32", "", "elements between q rows"},
                {"kv", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[{}, stride_kv] bf16", T),
                 "kv_a_proj_with_mqa rows [c | k_pe]"},
                {"stride_kv", KernelParam::Kind::u32, "dp_u32", "", "elements between kv rows"},
                {"kv_norm_w", KernelParam::Kind::pointer, "const dp_bf16*", shape({L}, "bf16"), "kv_a_layernorm"},
                {"kv_b", KernelParam::Kind::pointer, "const dp_bf16*",
                 shape({N * (p.at("PN") + p.at("V")), L}, "bf16"), "kv_b_proj"},
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
           {"NS", "ns", 1, 256, "KV splits per request"}},
          [](const Params& p, const std::string& who) {
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
            return std::vector<int64_t>{p.at("W"), p.at("Q"), p.at("N"), p.at("L"), p.at("R"), p.at("BS"), p.at("NS")};
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
           {"OG", "og", 0, 1, "1: K3 output gate sigmoid(g_proj x)"}},
          [](const Params& p, const std::string& who) { check_multiple_of_8(p, who, {"L"}); },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W"),  p.at("Q"), p.at("N"),  p.at("L"),
                                        p.at("PN"), p.at("V"), p.at("NS"), p.at("OG")};
          },
          [](const Params& p) {
            const int64_t W = p.at("W"), Q = p.at("Q"), N = p.at("N"), L = p.at("L"), NS = p.at("NS");
            return std::vector<ArgSpec>{
                {"part_o", KernelParam::Kind::pointer, "const float*", shape({W, NS, Q, N, L}, "fp32"),
                 "from mla_attn"},
                {"part_ml", KernelParam::Kind::pointer, "const float*", shape({W, NS, Q, N, 2}, "fp32"),
                 "from mla_attn"},
                {"seq_lens", KernelParam::Kind::pointer, "const dp_i32*", shape({W}, "i32"), "0 = padded request"},
                {"kv_b", KernelParam::Kind::pointer, "const dp_bf16*",
                 shape({N * (p.at("PN") + p.at("V")), L}, "bf16"), "kv_b_proj (W_UV rows)"},
                {"gate", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[{}, stride_g] bf16", W * Q),
                 "K3 g_proj output, head n at n*V (null when OG = 0)", true},
                {"stride_g", KernelParam::Kind::u32, "dp_u32", "", "elements between gate rows"},
                {"out", KernelParam::Kind::pointer, "dp_bf16*", shape({W * Q, N * p.at("V")}, "bf16"),
                 "o_proj input"},
            };
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
      // ---- FP4 indexer prefill (templates/indexer.h). Grids are chosen at run time from the chunk.
      indexer_op("idx_quant", "dp_idx_quant",
                 {
                   {"keys", KernelParam::Kind::pointer, "const dp_bf16*", "[count, 128] bf16", "index keys (normed, roped)"},
                   {"slots", KernelParam::Kind::pointer, "const dp_i64*", "[count] i64", "cache slot per key, -1 = skip"},
                   {"cache", KernelParam::Kind::pointer, "dp_u8*", "[num_blocks, block_stride] u8", "MXFP4 key cache"},
                   {"count", KernelParam::Kind::u32, "dp_u32", "", "keys"},
                   {"num_blocks", KernelParam::Kind::u32, "dp_u32", "", "cache blocks"},
                   {"block_size", KernelParam::Kind::u32, "dp_u32", "", "keys per cache block"},
                   {"block_stride", KernelParam::Kind::u32, "dp_u32", "", "bytes between cache blocks"},
                   {"layout", KernelParam::Kind::u32, "dp_u32", "", "0: split, 1: packed"},
                 }),
      indexer_op("idx_pack", "dp_idx_pack",
                 {
                   {"cache", KernelParam::Kind::pointer, "const dp_u8*", "[num_blocks, block_stride] u8", "this rank's key cache"},
                   {"block_table", KernelParam::Kind::pointer, "const dp_i32*", "[R, bt_stride] i32", "request set's blocks"},
                   {"local_cu", KernelParam::Kind::pointer, "const dp_i32*", "[R + 1] i32", "this rank's packed row offsets"},
                   {"packed", KernelParam::Kind::pointer, "dp_u8*", "[max_local, 68] u8", "compact keys"},
                   {"num_requests", KernelParam::Kind::u32, "dp_u32", "", "R"},
                   {"bt_stride", KernelParam::Kind::u32, "dp_u32", "", "entries per block-table row"},
                   {"max_local", KernelParam::Kind::u32, "dp_u32", "", "packed rows (zero past the rank's keys)"},
                   {"num_blocks", KernelParam::Kind::u32, "dp_u32", "", "cache blocks"},
                   {"block_size", KernelParam::Kind::u32, "dp_u32", "", "keys per cache block"},
                   {"block_stride", KernelParam::Kind::u32, "dp_u32", "", "bytes between cache blocks"},
                   {"layout", KernelParam::Kind::u32, "dp_u32", "", "0: split, 1: packed"},
                 }),
      indexer_op("idx_stage", "dp_idx_stage",
                 {
                   {"gathered", KernelParam::Kind::pointer, "const dp_u8*", "[W * max_local, 68] u8", "every rank's packed rows"},
                   {"cu", KernelParam::Kind::pointer, "const dp_i32*", "[R + 1] i32", "key offsets"},
                   {"local_cu", KernelParam::Kind::pointer, "const dp_i32*", "[W, R + 1] i32", "every rank's row offsets"},
                   {"payload", KernelParam::Kind::pointer, "dp_u8*", "[pages, 1, 4, 64, 16] u8", "staged payload"},
                   {"scales", KernelParam::Kind::pointer, "dp_u8*", "[pages, 1, 4, 64] u8", "staged scales"},
                   {"num_requests", KernelParam::Kind::u32, "dp_u32", "", "R"},
                   {"world", KernelParam::Kind::u32, "dp_u32", "", "DCP world size"},
                   {"interleave", KernelParam::Kind::u32, "dp_u32", "", "DCP interleave"},
                   {"max_local", KernelParam::Kind::u32, "dp_u32", "", "packed rows per rank"},
                   {"pages", KernelParam::Kind::u32, "dp_u32", "", "64-key pages"},
                 }),
      {
          "idx_score",
          "indexer.h",
          "dp_idx_score",
          {{"NH", "nh", 8, 64, "index heads, a multiple of 8"}},
          [](const Params& p, const std::string& who) {
            if (p.at("NH") % 8 != 0)
              fail(Errc::input, "{}: parameter NH = {} is not a multiple of 8 (8 head groups per block)", who, p.at("NH"));
          },
          [](const Params& p) { return std::vector<int64_t>{p.at("NH")}; },
          [](const Params& p) {
            const int64_t NH = p.at("NH");
            return std::vector<ArgSpec>{
                {"q", KernelParam::Kind::pointer, "const dp_bf16*", fmt::format("[rows, {}, 128] bf16", NH), "index queries"},
                {"w", KernelParam::Kind::pointer, "const float*", fmt::format("[rows, {}] fp32", NH), "head weights"},
                {"payload", KernelParam::Kind::pointer, "const dp_u8*", "[pages, 1, 4, 64, 16] u8", "staged payload"},
                {"scales", KernelParam::Kind::pointer, "const dp_u8*", "[pages, 1, 4, 64] u8", "staged scales"},
                {"cu", KernelParam::Kind::pointer, "const dp_i32*", "[R + 1] i32", "key offsets"},
                {"row_request", KernelParam::Kind::pointer, "const dp_i32*", "[rows] i32", "request of each row"},
                {"row_position", KernelParam::Kind::pointer, "const dp_i32*", "[rows] i32", "position of each row"},
                {"logits", KernelParam::Kind::pointer, "float*", "[tile_rows, L] fp32", "scores"},
                {"row_begin", KernelParam::Kind::u32, "dp_u32", "", "first row of the tile"},
                {"tile_rows", KernelParam::Kind::u32, "dp_u32", "", "rows scored"},
                {"L", KernelParam::Kind::u32, "dp_u32", "", "logits row stride (longest request)"},
                {"weight_scale", KernelParam::Kind::f32, "float", "", "factor on every score"},
            };
          },
          [](const Params&) { return idx_launch(256); },
          [](const Params&) { return uint32_t{256}; },
      },
      {
          "idx_topk",
          "indexer.h",
          "dp_idx_topk",
          {{"K", "k", 1, 4096, "positions selected per row"}},
          [](const Params&, const std::string&) {},
          [](const Params& p) { return std::vector<int64_t>{p.at("K")}; },
          [](const Params& p) {
            return std::vector<ArgSpec>{
                {"logits", KernelParam::Kind::pointer, "const float*", "[tile_rows, L] fp32", "scores"},
                {"row_position", KernelParam::Kind::pointer, "const dp_i32*", "[rows] i32", "position of each row"},
                {"out", KernelParam::Kind::pointer, "dp_i32*", fmt::format("[tile_rows, {}] i32", p.at("K")),
                 "positions, best first, -1 padded"},
                {"row_begin", KernelParam::Kind::u32, "dp_u32", "", "first row of the tile"},
                {"tile_rows", KernelParam::Kind::u32, "dp_u32", "", "rows written"},
                {"valid_rows", KernelParam::Kind::u32, "dp_u32", "", "rows with a query (the rest: -1)"},
                {"L", KernelParam::Kind::u32, "dp_u32", "", "logits row stride"},
            };
          },
          [](const Params&) { return idx_launch(512); },
          [](const Params&) { return uint32_t{512}; },
      },
      indexer_op("idx_rows", "dp_idx_rows",
                 {
                   {"src", KernelParam::Kind::pointer, "const dp_i32*", "[src_rows, k] i32", "gathered selections"},
                   {"map", KernelParam::Kind::pointer, "const dp_i32*", "[rows] i32", "source row per row, -1: none"},
                   {"out", KernelParam::Kind::pointer, "dp_i32*", "[rows, k] i32", "selections in row order"},
                   {"rows", KernelParam::Kind::u32, "dp_u32", "", "rows"},
                   {"k", KernelParam::Kind::u32, "dp_u32", "", "entries per row"},
                 }),
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
      {
          "rmsnorm",
          "norm.h",
          "dp_add_rmsnorm",
          {{"W", "w", 1, 4096, "rows (batch width x rows per request)"},
           {"H", "h", 8, 1 << 20, "row length (hidden size), a multiple of 8"}},
          [](const Params& p, const std::string& who) {
            if (p.at("H") % 8 != 0)
              fail(Errc::input, "{}: parameter H = {} is not a multiple of 8 (rows are read as 16-byte bf16 vectors)",
                   who, p.at("H"));
          },
          [](const Params& p) {
            return std::vector<int64_t>{p.at("W"), p.at("H"), rmsnorm_threads(p.at("H"))};
          },
          [](const Params& p) {
            return std::vector<ArgSpec>{
                {"hidden", KernelParam::Kind::pointer, "const dp_bf16*", dims(p, {"W", "H"}, "bf16"),
                 "this layer's mixer/FFN output"},
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
  return table;
}

std::string describe(const KernelInstance& k) {
  std::string s = k.op.empty() ? std::string("kernel instance") : "kernel instance " + k.op;
  std::string ps;
  for (const auto& [key, v] : k.params) ps += fmt::format("{}{}={}", ps.empty() ? "" : ", ", key, v);
  s += "(" + ps + ")";
  if (!k.target.empty()) s += " for " + k.target;
  return s;
}

const OpSpec& spec_of(const KernelInstance& k, std::string_view where) {
  const std::string who = where.empty() ? describe(k) : fmt::format("{}: {}", where, describe(k));
  for (const OpSpec& op : ops()) {
    if (k.op != op.name) continue;
    for (const ParamSpec& ps : op.params) {
      auto it = k.params.find(ps.key);
      if (it == k.params.end())
        fail(Errc::input, "{}: missing parameter {} ({}; valid range {}..{})", who, ps.key, ps.doc, ps.min, ps.max);
      if (it->second < ps.min || it->second > ps.max)
        fail(Errc::input, "{}: parameter {} = {} is out of range (valid: {}..{}, {})", who, ps.key, it->second,
             ps.min, ps.max, ps.doc);
    }
    for (const auto& [key, v] : k.params) {
      bool known = std::any_of(op.params.begin(), op.params.end(), [&](const ParamSpec& ps) { return key == ps.key; });
      if (!known) {
        std::string valid;
        for (const ParamSpec& ps : op.params) valid += fmt::format("{}{}", valid.empty() ? "" : ", ", ps.key);
        fail(Errc::input, "{}: unknown parameter {} for op {} ({})", who, key, op.name,
             valid.empty() ? std::string("it takes none") : "valid: " + valid);
      }
    }
    op.check(k.params, who);
    return op;
  }
  std::string valid;
  for (const std::string& n : known_ops()) valid += fmt::format("{}{}", valid.empty() ? "" : ", ", n);
  fail(Errc::input, "{}: unknown op \"{}\" (valid: {})", who, k.op, valid);
}

}  // namespace

std::vector<std::string> known_ops() {
  std::vector<std::string> names;
  for (const OpSpec& op : ops()) names.emplace_back(op.name);
  std::sort(names.begin(), names.end());
  return names;
}

void validate_instance(const KernelInstance& k, std::string_view where) { (void)spec_of(k, where); }

std::string kernel_name(const KernelInstance& k) {
  const OpSpec& op = spec_of(k, {});
  std::string name = op.name;
  for (const ParamSpec& ps : op.params) {
    if (ps.omit_zero && k.params.at(ps.key) == 0) continue;
    name += fmt::format("_{}{}", ps.prefix, k.params.at(ps.key));
  }
  return name;
}

std::string instance_key(const KernelInstance& k) {
  if (k.target.empty()) fail(Errc::input, "{}: no target given", describe(k));
  for (char c : k.target)
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_'))
      fail(Errc::input, "{}: target \"{}\" is not a target name (lower-case letters, digits, '_')", describe(k),
           k.target);
  return kernel_name(k) + "." + k.target;
}

KernelSignature kernel_signature(const KernelInstance& k) {
  const OpSpec& op = spec_of(k, {});
  KernelSignature sig;
  uint32_t offset = 0;
  for (ArgSpec& a : op.args(k.params)) {
    KernelParam p;
    p.name = a.name;
    p.kind = a.kind;
    p.c_type = a.c_type;
    p.shape = std::move(a.shape);
    p.doc = std::move(a.doc);
    p.nullable = a.nullable;
    p.size = p.align = a.kind == KernelParam::Kind::pointer ? 8u : 4u;
    offset = (offset + p.align - 1) / p.align * p.align;
    p.offset = offset;
    offset += p.size;
    sig.params.push_back(std::move(p));
  }
  sig.bytes = offset;
  return sig;
}

LaunchShape launch_shape(const KernelInstance& k) { return spec_of(k, {}).launch(k.params); }

std::string op_header(const KernelInstance& k) { return spec_of(k, {}).header; }

std::string generate_source(const KernelInstance& k) {
  const OpSpec& op = spec_of(k, {});
  const std::string name = kernel_name(k);
  const KernelSignature sig = kernel_signature(k);
  const LaunchShape launch = launch_shape(k);

  std::string params_line;
  for (const ParamSpec& ps : op.params)
    params_line += fmt::format("{}{}={}", params_line.empty() ? "" : ", ", ps.key, k.params.at(ps.key));
  std::string targs;
  for (int64_t v : op.template_args(k.params)) targs += fmt::format("{}{}", targs.empty() ? "" : ", ", v);

  std::string s;
  s += "// generated by decodepack, do not edit.\n";
  s += "// Reproduce with `decodepack build --emit-source DIR`; change templates/ or compiler/codegen instead.\n";
  s += fmt::format("// kernel {}: op {} ({})\n", name, op.name, params_line);
  std::string grid = std::to_string(launch.grid[0]);
  if (launch.grid[1] > 1 || launch.grid[2] > 1) grid += fmt::format(" x {} x {}", launch.grid[1], launch.grid[2]);
  s += fmt::format("// launch: block {} threads, grid {} blocks{}; parameter block {} bytes\n", launch.block[0], grid,
                   launch.grid_is_default ? " by default" : "", sig.bytes);
  s += "#include \"vendor.h\"\n";
  s += fmt::format("#include \"{}\"\n\n", op.header);
  s += fmt::format("extern \"C\" __global__ {}({}) void {}(\n", op.bounds, op.block_threads(k.params), name);
  for (size_t i = 0; i < sig.params.size(); ++i) {
    const KernelParam& p = sig.params[i];
    std::string decl = fmt::format("    {} {}{}", p.c_type, p.name, i + 1 < sig.params.size() ? "," : ") {");
    std::string comment = p.shape;
    if (p.nullable) comment += comment.empty() ? "may be null" : ", may be null";
    if (!p.doc.empty()) comment += (comment.empty() ? "" : "; ") + p.doc;
    s += fmt::format("{:<44}  // +{}: {}\n", decl, p.offset, comment);
  }
  std::string call_args;
  for (const KernelParam& p : sig.params) call_args += fmt::format("{}{}", call_args.empty() ? "" : ", ", p.name);
  s += "  DP_GRID_DEPENDENCY_ENTRY();  // programmatic dependent launch (vendor.h)\n";
  s += fmt::format("  {}<{}>({});\n}}\n", op.device_fn, targs, call_args);
  return s;
}

}  // namespace dp::codegen
