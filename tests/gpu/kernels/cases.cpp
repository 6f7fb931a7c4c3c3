#include "cases.h"

#include <cstdlib>

#include <fmt/format.h>

namespace dp::gpucheck {

const std::vector<ModelShape>& model_shapes() {
  static const std::vector<ModelShape> shapes = [] {
    std::vector<ModelShape> v;
    // manifests/presets/kimi-linear-tiny.json
    ModelShape tiny;
    tiny.name = "kimi-linear-tiny";
    tiny.hidden = 256;
    tiny.heads = 2;
    tiny.experts = 16;
    tiny.top_k = 4;
    tiny.inter = 128;
    tiny.shared = 128;
    tiny.routed_scaling = 2.446;
    tiny.dense_inter = 512;
    tiny.mla_heads = 2;
    tiny.block_size = 16;
    tiny.splits = 4;
    tiny.max_context = 200;
    v.push_back(tiny);
    // manifests/presets/kimi-k3-tiny.json (its experts run in the 128-wide latent; here the expert
    // kernels are checked at the hidden width, the same code with D = 256).
    ModelShape k3 = tiny;
    k3.name = "kimi-k3-tiny";
    k3.g_rank = 0;
    k3.safe_gate = true;
    k3.onorm_f32 = true;
    k3.shared = 256;
    k3.routed_scaling = 1.0;
    k3.situ = true;
    k3.mla_gate = true;
    k3.q_lora = 128;
    k3.latent = 128;  // its latent MoE (the mxfp4 cases)
    k3.attn_res_block = 2;  // layers 0, 2, 4 push: 3 blocks
    k3.layers = 5;
    v.push_back(k3);
    // Kimi-Linear-48B-A3B (model-family.md 1), TP 1.
    ModelShape big;
    big.name = "kimi-linear-48b";
    big.hidden = 2304;
    big.heads = 32;
    big.experts = 256;
    big.top_k = 8;
    big.inter = 1024;
    big.shared = 1024;
    big.routed_scaling = 2.446;
    big.dense_inter = 9216;
    big.mla_heads = 32;
    big.block_size = 64;
    big.splits = 16;
    big.max_context = 3000;
    v.push_back(big);
    // FP8 partial blocks: widths that are multiples of 16 (e4m3 rows are read as 16-byte vectors) but not
    // of 128, so that the last 128 x 128 block of a row and of a column is partial in every FP8 weight
    // of the GEMMs, the dense MLP and the experts: hidden 336 (2 blocks + 80), expert and shared width
    // 208 (1 + 80), dense width 400 (3 + 16). KDA and MLA as in the tiny model.
    ModelShape part = tiny;
    part.name = "fp8-partial-blocks";
    part.hidden = 336;
    part.inter = 208;
    part.shared = 208;
    part.dense_inter = 400;
    v.push_back(part);
    // Rank 1 of the tiny K3 at tensor_parallel 2: one KDA and one MLA head, the whole 128-entry A_log.
    ModelShape k3r = k3;
    k3r.name = "kimi-k3-tiny-tp2-rank1";
    k3r.heads = 1;
    k3r.mla_heads = 1;
    k3r.a_log_size = 128;
    k3r.a_log_rank = 1;
    v.push_back(k3r);
    // Rank 3 of Kimi-K3 at tensor_parallel 8 (model-family.md 1b, 2b): hidden 7168, 12 of 96 KDA and MLA
    // heads, q_lora_rank 1536, the dense FFN's 33792 / 8 features. Its MoE is a small stand-in (16 experts
    // of 384) so that the expert stacks fit; the K3 experts are MXFP4 in a latent width, checked elsewhere.
    ModelShape k3big = k3;
    k3big.name = "kimi-k3-tp8-rank3";
    k3big.hidden = 7168;
    k3big.heads = 12;
    k3big.a_log_size = 128;
    k3big.a_log_rank = 3;
    k3big.experts = 16;
    k3big.top_k = 4;
    k3big.inter = 384;
    k3big.shared = 768;
    k3big.dense_inter = 33792 / 8;
    k3big.mla_heads = 12;
    k3big.q_lora = 1536;
    k3big.block_size = 64;
    k3big.splits = 16;
    k3big.max_context = 2000;
    v.push_back(k3big);
    // Kimi-K3 (model-family.md 1b, 2b), TP 1: the latent MoE only (hidden 7168, latent 3584, 896 MXFP4
    // experts of intermediate 3072, top-16, shared width 2 x 3072 = 6144, SiTU, routed scaling 1).
    ModelShape k3lat;
    k3lat.name = "kimi-k3";
    k3lat.hidden = 7168;
    k3lat.latent = 3584;
    k3lat.experts = 896;
    k3lat.top_k = 16;
    k3lat.inter = 3072;
    k3lat.shared = 6144;
    k3lat.routed_scaling = 1.0;
    k3lat.situ = true;
    v.push_back(k3lat);
    return v;
  }();
  return shapes;
}

const char* to_string(Layout l) {
  switch (l) {
    case Layout::dense: return "dense";
    case Layout::padded: return "padded";
    case Layout::wide: return "wide";
  }
  return "?";
}

std::string Case::name() const {
  std::string name = fmt::format("{} w{} q{}", model->name, width, q);
  if (layout != Layout::dense) name += std::string(" ") + to_string(layout);
  if (mxfp4) name += " mxfp4";
  if (fp8) name += " fp8";
  return ring ? name + " ring" : name;
}

// Indices are stable where run_on_device.sh and RESULTS.md refer to them: the dense cases first (0..21,
// as before the layouts existed), then the padded and wide ones, the dense 48B-shaped case (the timed
// one, the last bf16 case), then the FP8 cases (31 on), then the MXFP4 latent-MoE cases (42 on).
std::vector<Case> all_cases() {
  const auto& m = model_shapes();
  std::vector<Case> v;
  for (int64_t q : {1, 2})
    for (int64_t w = 1; w <= 8; ++w) v.push_back({&m[0], w, q});  // every width, tiny Kimi-Linear
  for (int64_t q : {1, 2})
    for (int64_t w : {1, 3, 8}) v.push_back({&m[1], w, q});  // K3 variants of every op
  // Padded host pools and fused w13: a padded request (w >= 3), a zero draft slot (w >= 4, q 2).
  v.push_back({&m[0], 3, 2, Layout::padded});
  v.push_back({&m[0], 5, 1, Layout::padded});
  v.push_back({&m[0], 8, 2, Layout::padded});
  v.push_back({&m[1], 3, 2, Layout::padded});
  v.push_back({&m[1], 8, 1, Layout::padded});
  // Offsets past 2^32 elements (about 45 GB of device memory at most, one check at a time).
  v.push_back({&m[0], 4, 2, Layout::wide});
  v.push_back({&m[1], 3, 1, Layout::wide});
  v.push_back({&m[2], 8, 2, Layout::padded});  // 48B shapes with vLLM's layouts
  v.push_back({&m[2], 8, 2});                  // one dense 48B-shaped case, the most rows (timed)
  // FP8 weights: every row count 1, 2, 4, 8 and 16 of the tiny model, its padded (fused w13 and its
  // scales) and wide layouts, the partial-block shapes, and the 48B shapes (timed).
  for (int64_t w : {1, 2, 4, 8}) v.push_back({&m[0], w, 1, Layout::dense, true});
  v.push_back({&m[0], 8, 2, Layout::dense, true});
  v.push_back({&m[0], 3, 2, Layout::padded, true});
  v.push_back({&m[0], 4, 2, Layout::wide, true});
  v.push_back({&m[3], 1, 1, Layout::dense, true});
  v.push_back({&m[3], 8, 2, Layout::dense, true});
  v.push_back({&m[3], 3, 2, Layout::padded, true});
  v.push_back({&m[2], 8, 2, Layout::dense, true});
  // Kimi-K3 tensor-parallel ranks (A_log offset by rank, q-LoRA MLA of the rank's heads).
  v.push_back({&m[4], 1, 1});
  v.push_back({&m[4], 4, 2});
  v.push_back({&m[5], 1, 1});
  v.push_back({&m[5], 8, 2});
  // MXFP4 latent MoE: the K3-tiny shapes (latent 128) at 1, 3 x 2 and 8 rows, padded stacks (fused w13
  // and its scales, padding after every w2 expert and its scales); the K3 shapes at every width 1..8
  // (timed) and padded at width 8.
  auto lat = [&](const ModelShape* s, int64_t w, int64_t q, Layout l) {
    Case c{s, w, q, l};
    c.mxfp4 = true;
    v.push_back(c);
  };
  lat(&m[1], 1, 1, Layout::dense);
  lat(&m[1], 3, 2, Layout::dense);
  lat(&m[1], 8, 1, Layout::dense);
  lat(&m[1], 3, 2, Layout::padded);
  lat(&m[1], 8, 2, Layout::padded);
  for (int64_t w = 1; w <= 8; ++w) lat(&m[6], w, 1, Layout::dense);
  lat(&m[6], 8, 1, Layout::padded);
  // The 48B shapes at one row (timed, appended so that the indices above stay): the width-1 kernels,
  // e.g. the MLA attention over 64 splits.
  v.push_back({&m[2], 1, 1});
  // The weight-ring forms (RG 6; the gate/ups 2) of the FP8 kernels: one row and 8 rows of the tiny
  // model, its padded layout, the partial-block shapes, and the 48B shapes at one row without and with the
  // ring (timed).
  auto ring = [&](const ModelShape* s, int64_t w, int64_t q, Layout l) {
    Case c{s, w, q, l, true};
    c.ring = true;
    v.push_back(c);
  };
  ring(&m[0], 1, 1, Layout::dense);
  ring(&m[0], 4, 2, Layout::dense);
  ring(&m[0], 3, 2, Layout::padded);
  ring(&m[3], 1, 1, Layout::dense);
  v.push_back({&m[2], 1, 1, Layout::dense, true});
  ring(&m[2], 1, 1, Layout::dense);
  return v;
}

std::vector<codegen::KernelInstance> CaseKernels::all() const {
  std::vector<codegen::KernelInstance> v{
      rmsnorm,    in_proj,    kda,        kda_split,  o_proj,        o_proj_norm, router,          route,
      router_route, moe_up,   moe_down,   mlp_up,     mlp_down,      mla_prep,    mla_attn,        mla_combine,
      mla_attn_staged, mixed, mla_in,     q_norm,     q_b,           lat_down,    lat_norm,        lat_up,
      moe_down_split, moe_down_split_ring, attnres[0], attnres[1], attnres[2], attnres_k3};
  v.insert(v.end(), moe_down_rings.begin(), moe_down_rings.end());
  v.insert(v.end(), moe_up_rings.begin(), moe_up_rings.end());
  std::erase_if(v, [](const codegen::KernelInstance& k) { return k.op.empty(); });
  return v;
}

CaseKernels kernels_of(const Case& c, const std::string& target) {
  const ModelShape& m = *c.model;
  const int64_t T = c.rows(), H = m.hidden, P = m.proj_size();
  auto gemm = [&](int64_t k, std::vector<int64_t> n, bool f32) {
    codegen::KernelInstance i{"gemm", {{"W", T}, {"K", k}, {"F", f32 ? 1 : 0}}, target};
    const char* keys[6] = {"NA", "NB", "NC", "ND", "NE", "NF"};
    for (size_t s = 0; s < 6; ++s) i.params[keys[s]] = s < n.size() ? n[s] : 0;
    return i;
  };
  CaseKernels k;
  k.rmsnorm = {"rmsnorm", {{"W", T}, {"H", H}}, target};
  k.in_proj = gemm(H, {P, P, P, m.f_rank, m.g_rank > 0 ? m.g_rank : P, m.heads}, false);
  k.kda = {"kda_step",
           {{"W", c.width},
            {"Q", c.q},
            {"NH", m.heads},
            {"D", m.head_dim},
            {"CV", m.conv},
            {"FR", m.f_rank},
            {"GR", m.g_rank},
            {"SG", m.safe_gate ? 1 : 0},
            {"ON", m.onorm_f32 ? 1 : 0}},
           target};
  if (m.a_log_rank >= 0) k.kda.params["AR"] = 1;
  // The value-split form (4 blocks per head, one row per request), checked beside the one-block form.
  if (c.q == 1 && m.head_dim % 128 == 0) {
    k.kda_split = k.kda;
    k.kda_split.params["VS"] = 4;
  }
  k.o_proj = gemm(P, {H}, false);
  k.o_proj_norm = k.o_proj;
  k.o_proj_norm.params["NM"] = 1;
  k.router = gemm(H, {m.experts}, true);
  k.route = {"moe_route", {{"W", T}, {"E", m.experts}, {"K", m.top_k}, {"RN", 1}}, target};
  k.router_route = k.router;
  k.router_route.params["TK"] = m.top_k;
  k.router_route.params["TR"] = 1;
  const int64_t act = m.situ ? 1 : 0;
  k.moe_up = {"moe_up",
              {{"W", T}, {"D", H}, {"I", m.inter}, {"E", m.experts}, {"K", m.top_k}, {"S", m.shared}, {"ACT", act}},
              target};
  k.moe_down = {
      "moe_down", {{"W", T}, {"D", H}, {"I", m.inter}, {"E", m.experts}, {"K", m.top_k}, {"S", m.shared}}, target};
  k.mlp_up = {"mlp_up", {{"W", T}, {"D", H}, {"I", m.dense_inter}, {"ACT", act}}, target};
  k.mlp_down = gemm(m.dense_inter, {H}, false);
  k.mla_prep = {"mla_prep",
                {{"W", c.width},
                 {"Q", c.q},
                 {"N", m.mla_heads},
                 {"L", m.lora},
                 {"R", m.rope},
                 {"PN", m.nope},
                 {"V", m.v_dim},
                 {"BS", m.block_size}},
                target};
  k.mla_attn = {"mla_attn",
                {{"W", c.width},
                 {"Q", c.q},
                 {"N", m.mla_heads},
                 {"L", m.lora},
                 {"R", m.rope},
                 {"BS", m.block_size},
                 {"NS", m.splits}},
                target};
  k.mla_attn_staged = k.mla_attn;
  // DP_CHECK_MLA_TS picks another depth (dp_kernel_build and dp_kernel_check must see the same value).
  const char* ts = std::getenv("DP_CHECK_MLA_TS");
  k.mla_attn_staged.params["TS"] = ts && *ts ? std::atoi(ts) : 4;
  k.mla_combine = {"mla_combine",
                   {{"W", c.width},
                    {"Q", c.q},
                    {"N", m.mla_heads},
                    {"L", m.lora},
                    {"PN", m.nope},
                    {"V", m.v_dim},
                    {"NS", m.splits},
                    {"OG", m.mla_gate ? 1 : 0}},
                   target};
  if (m.q_lora > 0) {
    const int64_t row = m.q_lora + m.lora + m.rope + (m.mla_gate ? m.mla_heads * m.v_dim : 0);
    k.mla_in = gemm(H, {m.q_lora, m.lora + m.rope, m.mla_gate ? m.mla_heads * m.v_dim : 0}, false);
    k.q_norm = {"rmsnorm", {{"W", T}, {"H", m.q_lora}, {"S", row}}, target};
    k.q_b = gemm(m.q_lora, {m.mla_heads * (m.nope + m.rope)}, false);
  }
  if (m.attn_res_block > 0 && !c.fp8) {
    for (int64_t s = 0; s < 3; ++s)
      k.attnres[s] = {"attnres",
                      {{"W", T}, {"H", H}, {"B", m.attn_res_block}, {"NB", m.attn_res_blocks()}, {"S", s}},
                      target};
    k.attnres_k3 = {"attnres", {{"W", T}, {"H", 7168}, {"B", 12}, {"NB", 8}, {"S", 0}}, target};
  }
  if (c.fp8) {
    // Q8 (left out for bf16): 1 for an op whose weights are all e4m3; for gemm a bitmask over its weights.
    k.in_proj.params["Q8"] = 0b111;  // q, k, v; f_a, g_a (g), b stay bf16
    for (codegen::KernelInstance* i :
         {&k.o_proj, &k.o_proj_norm, &k.mlp_down, &k.moe_up, &k.moe_down, &k.mlp_up, &k.mla_prep, &k.mla_combine})
      i->params["Q8"] = 1;
    k.mixed = gemm(H, {P, 80, 208}, false);
    k.mixed.params["Q8"] = 0b101;
  }
  if (c.fp8 && c.ring) {
    for (codegen::KernelInstance* i : {&k.in_proj, &k.o_proj, &k.mlp_down, &k.mixed}) i->params["RG"] = 6;
    for (codegen::KernelInstance* i : {&k.moe_up, &k.mlp_up}) i->params["RG"] = 2;  // a ring per warp
    if (T == 1) k.moe_down.params["RG"] = 6;
  }
  // moe_down over the split grid (SK 264) beside the one-block-per-tile form: e4m3 at every row count,
  // bf16 from two rows (one bf16 row is the lane-FMA loop).
  if ((c.fp8 || T >= 2) && !c.ring) {  // (the ring cases check the ring forms only)
    k.moe_down_split = k.moe_down;
    k.moe_down_split.params["SK"] = 264;
  }
  if (c.fp8) {  // the split grid through the weight ring, every FP8 case (its shared expert is as wide as I)
    k.moe_down_split_ring = k.moe_down;
    k.moe_down_split_ring.params["SK"] = 264;
    k.moe_down_split_ring.params["RG"] = 6;
  }
  if (c.mxfp4) {
    const int64_t D = m.latent;
    CaseKernels l;
    l.router = k.router;
    l.route = k.route;
    l.router_route = k.router_route;
    l.lat_down = gemm(H, {D}, false);
    l.moe_up = {"moe_up",
                {{"W", T}, {"D", D}, {"I", m.inter}, {"E", m.experts}, {"K", m.top_k}, {"S", 0}, {"ACT", act},
                 {"Q4", 1}},
                target};
    l.moe_down = {"moe_down",
                  {{"W", T}, {"D", D}, {"I", m.inter}, {"E", m.experts}, {"K", m.top_k}, {"S", 0}, {"Q4", 1}},
                  target};
    l.lat_norm = {"rmsnorm", {{"W", T}, {"H", D}}, target};
    l.mlp_up = {"mlp_up", {{"W", T}, {"D", H}, {"I", m.shared}, {"ACT", act}}, target};
    l.mlp_down = gemm(m.shared, {H}, false);
    l.lat_up = gemm(D, {H}, false);
    l.lat_up.params["AD"] = 1;
    l.moe_down_split = l.moe_down;
    l.moe_down_split.params["SK"] = 264;
    l.moe_down_split_ring = l.moe_down_split;
    l.moe_down_split_ring.params["RG"] = 8;
    // DP_CHECK_RING names one depth instead (dp_kernel_build and dp_kernel_check must see the same value).
    const char* rg = std::getenv("DP_CHECK_RING");
    for (int64_t stages : rg && *rg ? std::vector<int64_t>{std::atoi(rg)} : std::vector<int64_t>{4, 6, 8}) {
      l.moe_down_rings.push_back(l.moe_down);
      l.moe_down_rings.back().params["RG"] = stages;
    }
    for (int64_t stages : {2, 3}) {
      l.moe_up_rings.push_back(l.moe_up);
      l.moe_up_rings.back().params["RG"] = stages;
    }
    return l;
  }
  return k;
}

}  // namespace dp::gpucheck
