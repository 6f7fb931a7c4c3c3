// Kernel instances of the decode-layer ops at the shapes the family tests use (target sm_90a unless
// given).
#pragma once

#include <string>
#include <vector>

#include "codegen/kernel.h"

namespace dp::codegen::test_ops {

inline KernelInstance gemm(int64_t w, int64_t k, std::vector<int64_t> n, bool f32 = false,
                           std::string target = "sm_90a") {
  KernelInstance i{"gemm", {{"W", w}, {"K", k}, {"F", f32 ? 1 : 0}}, std::move(target)};
  const char* keys[6] = {"NA", "NB", "NC", "ND", "NE", "NF"};
  for (size_t s = 0; s < 6; ++s) i.params[keys[s]] = s < n.size() ? n[s] : 0;
  return i;
}
// The gemm with the post-attention norm fused (NM 1).
inline KernelInstance gemm_norm(int64_t w, int64_t k, int64_t n, std::string target = "sm_90a") {
  KernelInstance i = gemm(w, k, {n}, false, std::move(target));
  i.params["NM"] = 1;
  return i;
}
// The router gemm (fp32 logits) with the MoE routing fused (TK top-k, TR renormalise).
inline KernelInstance gemm_route(int64_t w, int64_t k, int64_t e, int64_t topk, std::string target = "sm_90a") {
  KernelInstance i = gemm(w, k, {e}, true, std::move(target));
  i.params["TK"] = topk;
  i.params["TR"] = 1;
  return i;
}
inline KernelInstance kda(int64_t w, int64_t q, int64_t nh, int64_t gr = 128, bool k3 = false,
                          std::string target = "sm_90a") {
  return {"kda_step",
          {{"W", w}, {"Q", q}, {"NH", nh}, {"D", 128}, {"CV", 4}, {"FR", 128}, {"GR", gr}, {"SG", k3}, {"ON", k3}},
          std::move(target)};
}
inline KernelInstance route(int64_t w, int64_t e, int64_t k, std::string target = "sm_90a") {
  return {"moe_route", {{"W", w}, {"E", e}, {"K", k}, {"RN", 1}}, std::move(target)};
}
inline KernelInstance moe_up(int64_t w, int64_t d, int64_t i, int64_t e, int64_t k, int64_t s, int64_t act = 0,
                      std::string target = "sm_90a") {
  return {"moe_up", {{"W", w}, {"D", d}, {"I", i}, {"E", e}, {"K", k}, {"S", s}, {"ACT", act}}, std::move(target)};
}
inline KernelInstance moe_down(int64_t w, int64_t d, int64_t i, int64_t e, int64_t k, int64_t s,
                        std::string target = "sm_90a") {
  return {"moe_down", {{"W", w}, {"D", d}, {"I", i}, {"E", e}, {"K", k}, {"S", s}}, std::move(target)};
}
inline KernelInstance mlp_up(int64_t w, int64_t d, int64_t i, int64_t act = 0, std::string target = "sm_90a") {
  return {"mlp_up", {{"W", w}, {"D", d}, {"I", i}, {"ACT", act}}, std::move(target)};
}
// MLA at Kimi shapes: L 512, R 64, PN 128, V 128, cache blocks of 64 tokens.
inline KernelInstance mla_prep(int64_t w, int64_t q, int64_t n, std::string target = "sm_90a") {
  return {"mla_prep",
          {{"W", w}, {"Q", q}, {"N", n}, {"L", 512}, {"R", 64}, {"PN", 128}, {"V", 128}, {"BS", 64}},
          std::move(target)};
}
inline KernelInstance mla_attn(int64_t w, int64_t q, int64_t n, int64_t ns = 16,
                               std::string target = "sm_90a") {
  return {"mla_attn", {{"W", w}, {"Q", q}, {"N", n}, {"L", 512}, {"R", 64}, {"BS", 64}, {"NS", ns}}, std::move(target)};
}
inline KernelInstance mla_combine(int64_t w, int64_t q, int64_t n, int64_t og = 0,
                                  std::string target = "sm_90a") {
  return {"mla_combine",
          {{"W", w}, {"Q", q}, {"N", n}, {"L", 512}, {"PN", 128}, {"V", 128}, {"NS", 16}, {"OG", og}},
          std::move(target)};
}
inline KernelInstance rmsnorm(int64_t w, int64_t h, std::string target = "sm_90a") {
  return {"rmsnorm", {{"W", w}, {"H", h}}, std::move(target)};
}
inline KernelInstance allreduce(int64_t w, int64_t h, int64_t r, std::string target = "sm_90a") {
  return {"allreduce", {{"W", w}, {"H", h}, {"R", r}}, std::move(target)};
}
inline KernelInstance prefetch(int64_t b, std::string target = "sm_90a") {
  return {"prefetch", {{"B", b}}, std::move(target)};
}

// The e4m3 form of an op that reads weights: Q8 = mask (bit s: weight s is e4m3; 1 for single-weight ops).
inline KernelInstance q8(KernelInstance k, int64_t mask = 1) {
  k.params["Q8"] = mask;
  return k;
}
// The MXFP4 form (Q4 = v) of moe_up / moe_down.
inline KernelInstance q4(KernelInstance k, int64_t v = 1) {
  k.params["Q4"] = v;
  return k;
}
// moe_down over the split grid (SK = blocks).
inline KernelInstance split(KernelInstance k, int64_t blocks = 264) {
  k.params["SK"] = blocks;
  return k;
}
// The weight-ring form (RG stages) of an e4m3 or MXFP4 op.
inline KernelInstance ring(KernelInstance k, int64_t stages = 6) {
  k.params["RG"] = stages;
  return k;
}

}  // namespace dp::codegen::test_ops
