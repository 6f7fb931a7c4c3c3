// Closed-form and consistency checks of the float64 CPU reference (compiler/reference/).
//
// Each test states a property the reference must have whatever its implementation: norms of known
// vectors, a KDA layer that neither decays nor writes keeps its state and reads it, a one-hot conv
// kernel delays its input, attention over one token returns that token, absorbed MLA equals the
// naive per-head attention, a MoE forced onto one expert is that expert, a spec-verify step equals
// the sequential steps it verifies, padded requests touch nothing, and TP partials sum to TP=1.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <set>

#include "../test_util.h"
#include "model/safetensors.h"
#include "model/synth.h"
#include "reference/layer.h"
#include "reference/numeric.h"

namespace dp::ref {
namespace {

using model::Model;

const Model& tiny() {
  static const Model m = model::load_model("kimi-linear-tiny");
  return m;
}
const Model& k3tiny() {
  static const Model m = model::load_model("kimi-k3-tiny");
  return m;
}

// Random values in (-scale, scale), rounded to bf16 (or fp32) like the buffers they stand for.
std::vector<double> rand_vec(size_t n, uint64_t seed, double scale, bool bf16 = true) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-scale, scale);
  std::vector<double> v(n);
  for (double& e : v) e = bf16 ? round_bf16(u(rng)) : round_fp32(u(rng));
  return v;
}
Mat rand_mat(int64_t rows, int64_t cols, uint64_t seed, double scale = 1.0) {
  Mat m(rows, cols);
  m.v = rand_vec(m.v.size(), seed, scale);
  return m;
}
KdaState rand_kda(const Model& m, Shard sh, int64_t slots, int64_t width, uint64_t seed) {
  KdaState s = KdaState::zeros(m, sh, slots, width);
  s.recurrent = rand_vec(s.recurrent.size(), seed, 0.5, false);
  s.conv_q = rand_vec(s.conv_q.size(), seed + 1, 1.0);
  s.conv_k = rand_vec(s.conv_k.size(), seed + 2, 1.0);
  s.conv_v = rand_vec(s.conv_v.size(), seed + 3, 1.0);
  return s;
}
MlaCache rand_mla(const Model& m, int64_t blocks, int64_t bs, uint64_t seed) {
  MlaCache c = MlaCache::zeros(m, blocks, bs);
  c.data = rand_vec(c.data.size(), seed, 1.0);
  return c;
}

// Rank `rank`'s slice (heads / channels) of a full-width KDA state.
KdaState slice_kda(const Model& m, KdaState& full, int tp, int rank) {
  KdaState part = KdaState::zeros(m, {tp, rank}, full.num_slots, full.conv_width);
  for (int64_t s = 0; s < full.num_slots; ++s) {
    for (int64_t j = 0; j < part.heads; ++j) {
      std::span<double> src = full.slot_state(s, rank * part.heads + j);
      std::copy(src.begin(), src.end(), part.slot_state(s, j).begin());
    }
    for (int c3 = 0; c3 < 3; ++c3)
      for (int64_t c = 0; c < part.conv_dim; ++c) {
        std::span<double> src = full.conv(c3, s, rank * part.conv_dim + c);
        std::copy(src.begin(), src.end(), part.conv(c3, s, c).begin());
      }
  }
  return part;
}

// Rows `rows` of m.
Mat pick(const Mat& m, const std::vector<int64_t>& rows) {
  Mat o(static_cast<int64_t>(rows.size()), m.cols);
  for (size_t i = 0; i < rows.size(); ++i)
    std::copy(m.row(rows[i]).begin(), m.row(rows[i]).end(), o.row(static_cast<int64_t>(i)).begin());
  return o;
}

AttnResState pick_attn_res(const AttnResState& st, const std::vector<int64_t>& rows) {
  AttnResState o;
  for (const Mat& b : st.blocks) o.blocks.push_back(pick(b, rows));
  return o;
}
double max_diff(std::span<const double> a, std::span<const double> b) {
  if (a.size() != b.size()) return INFINITY;
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d = std::max(d, std::fabs(a[i] - b[i]));
  return d;
}
double max_abs(std::span<const double> a) {
  double d = 0;
  for (double e : a) d = std::max(d, std::fabs(e));
  return d;
}

// A lookup that edits some tensors of another.
WeightLookup edit(WeightLookup base, std::map<std::string, std::function<void(std::vector<double>&)>> edits) {
  return [base = std::move(base), edits = std::move(edits)](const std::string& key) {
    std::vector<double> v = base(key);
    if (auto it = edits.find(key); it != edits.end()) it->second(v);
    return v;
  };
}

// The block state a K3 layer expects on entry (attn_res_blocks(layer, B) random bf16 blocks of `rows`
// rows); empty for models without block attention residuals (then pass ar_ptr() = nullptr).
AttnResState rand_attn_res(const Model& m, int layer, int64_t rows, uint64_t seed) {
  AttnResState st;
  if (m.attn_res_block > 0)
    for (int64_t k = 0; k < attn_res_blocks(layer, m.attn_res_block); ++k)
      st.blocks.push_back(rand_mat(rows, m.hidden, seed + static_cast<uint64_t>(k)));
  return st;
}
AttnResState* ar_ptr(const Model& m, AttnResState& st) { return m.attn_res_block > 0 ? &st : nullptr; }
// Rows `rows` of every block.
AttnResState pick_attn_res(const AttnResState& st, const std::vector<int64_t>& rows);

Options none() {
  Options o;
  o.rounding = Rounding::none();
  return o;
}

// ---- norms --------------------------------------------------------------------------------------

TEST(Reference, RmsNormKnownVector) {
  const std::vector<double> x = {3, 4}, w = {1, 2};
  std::vector<double> out(2);
  rms_norm(x, w, 0.0, out);  // mean(x^2) = 12.5
  EXPECT_DOUBLE_EQ(out[0], 3 / std::sqrt(12.5));
  EXPECT_DOUBLE_EQ(out[1], 8 / std::sqrt(12.5));
  rms_norm(x, w, 3.5, out);  // mean + eps = 16
  EXPECT_DOUBLE_EQ(out[0], 0.75);
  EXPECT_DOUBLE_EQ(out[1], 2.0);
}

TEST(Reference, FusedAddNormCarriesTheResidual) {
  Mat h(1, 4), r(1, 4);
  h.v = {1, 2, 3, 4};
  r.v = {1, 0, -1, 1.0 / 3};
  const std::vector<double> w = {1, 1, 1, 1};
  AddNorm first = fused_add_rms_norm(h, nullptr, w, 0.0, Rounding::vllm());  // layer 0: residual = h
  EXPECT_EQ(first.residual.v, h.v);
  AddNorm a = fused_add_rms_norm(h, &r, w, 0.0, Rounding::none());
  EXPECT_EQ(a.residual.v, (std::vector<double>{2, 2, 2, 4 + 1.0 / 3}));
  AddNorm b = fused_add_rms_norm(h, &r, w, 0.0, Rounding::vllm());
  EXPECT_EQ(b.residual(0, 3), round_bf16(4 + 1.0 / 3));  // the residual is stored in bf16
  EXPECT_NE(b.residual(0, 3), a.residual(0, 3));
  double ss = 0;
  for (double e : b.residual.v) ss += e * e;
  for (int i = 0; i < 4; ++i) EXPECT_EQ(b.x(0, i), round_bf16(b.residual(0, i) / std::sqrt(ss / 4)));
}

TEST(Reference, FinalNormIsNormOfTheSum) {
  const Model& m = tiny();
  Mat h = rand_mat(3, m.hidden, 1), r = rand_mat(3, m.hidden, 2);
  const std::vector<double> w = rand_vec(static_cast<size_t>(m.hidden), 3, 1.0);
  Mat out = final_norm(m, h, r, w, none());
  for (int64_t t = 0; t < 3; ++t) {
    std::vector<double> s(static_cast<size_t>(m.hidden)), e(static_cast<size_t>(m.hidden));
    for (int64_t i = 0; i < m.hidden; ++i) s[i] = h(t, i) + r(t, i);
    rms_norm(s, w, m.rms_norm_eps, e);
    EXPECT_LT(max_diff(out.row(t), e), 1e-14);
  }
}

// ---- KDA ops --------------------------------------------------------------------------------------

TEST(Reference, KdaGates) {
  EXPECT_DOUBLE_EQ(kda_alpha(0, 0, 0, std::nullopt), -std::log(2.0));  // -exp(0) softplus(0)
  EXPECT_DOUBLE_EQ(kda_alpha(1, 2, std::log(3.0), std::nullopt), -3 * std::log1p(std::exp(3.0)));
  EXPECT_EQ(kda_alpha(30, 0, 0, std::nullopt), -30.0);    // softplus threshold
  EXPECT_EQ(kda_alpha(-1000, 0, 5, std::nullopt), -0.0);  // no decay at all
  EXPECT_DOUBLE_EQ(kda_alpha(1, -1, 2, -5.0), -2.5);      // K3: lb * sigmoid(0)
  for (double f : {-50.0, -1.0, 0.3, 7.0, 50.0}) {
    const double a = kda_alpha(f, 0.1, 1.0, -5.0);
    EXPECT_GE(a, -5.0);
    EXPECT_LE(a, 0.0);
  }
}

TEST(Reference, DeltaRuleClosedForms) {
  const size_t d = 8;
  std::vector<double> S = rand_vec(d * d, 5, 1.0, false), S0 = S;
  std::vector<double> q = rand_vec(d, 6, 1.0), k = rand_vec(d, 7, 1.0), v = rand_vec(d, 8, 1.0);
  std::vector<double> zero(d, 0.0), o(d);
  // No decay (alpha = 0) and beta = 0: S unchanged, o = S^T q.
  kda_delta_step(S, q, k, v, zero, 0.0, o);
  EXPECT_EQ(S, S0);
  for (size_t b = 0; b < d; ++b) {
    double e = 0;
    for (size_t a = 0; a < d; ++a) e += S0[a * d + b] * q[a];
    EXPECT_DOUBLE_EQ(o[b], e);
  }
  // Decay log(1/2), beta = 0: S halves.
  std::vector<double> half(d, std::log(0.5));
  kda_delta_step(S, q, k, v, half, 0.0, o);
  for (size_t i = 0; i < d * d; ++i) EXPECT_DOUBLE_EQ(S[i], S0[i] / 2);
  // Per-key-channel decay: alpha[k] = -k ln 2 scales ROW k of S (the k-major [k][v] layout) by 2^-k.
  std::vector<double> Sd = S0, ramp(d);
  for (size_t a = 0; a < d; ++a) ramp[a] = -static_cast<double>(a) * std::log(2.0);
  kda_delta_step(Sd, q, k, v, ramp, 0.0, o);
  for (size_t a = 0; a < d; ++a)
    for (size_t b = 0; b < d; ++b) EXPECT_DOUBLE_EQ(Sd[a * d + b], std::ldexp(S0[a * d + b], -static_cast<int>(a)));
  // beta = 1 with a unit key e_3: the state then maps e_3 to v exactly (S^T e_3 = row 3 = v).
  std::vector<double> e3(d, 0.0);
  e3[3] = 1;
  kda_delta_step(S, e3, e3, v, zero, 1.0, o);
  for (size_t b = 0; b < d; ++b) EXPECT_DOUBLE_EQ(S[3 * d + b], v[b]);
  EXPECT_EQ(o, v);  // o = S^T q with q = e_3
  for (size_t a = 0; a < d; ++a)
    if (a != 3) {
      for (size_t b = 0; b < d; ++b) EXPECT_DOUBLE_EQ(S[a * d + b], S0[a * d + b] / 2);  // other rows untouched
    }
}

TEST(Reference, ConvStepAndL2Norm) {
  const std::vector<double> hist = {1, 2, 3}, w = {0.5, -1, 2, 4};
  EXPECT_DOUBLE_EQ(kda_conv_step(hist, -1.5, w), silu(0.5 - 2 + 6 - 6));
  std::vector<double> x = {3, 4};
  l2_normalize(x, 0.0, 2.0);
  EXPECT_DOUBLE_EQ(x[0], 1.2);
  EXPECT_DOUBLE_EQ(x[1], 1.6);
  std::vector<double> g = {0, 0}, out(2), ow = {1, 1};
  gated_rms_norm(std::vector<double>{3, 4}, g, ow, 0.0, out);  // rms 3.5355..., sigmoid(0) = 1/2
  EXPECT_DOUBLE_EQ(out[0], 0.5 * 3 / std::sqrt(12.5));
}

// ---- KDA layer ------------------------------------------------------------------------------------

// KDA layer 1 of the tiny model with no decay (dt_bias -> -1000: softplus = 0) and beta = 0 (b_proj
// logits -1000 on an all-ones input): the recurrent state is unchanged and o = S^T q_hat.
TEST(Reference, KdaNoDecayNoWriteKeepsStateAndReadsIt) {
  const Model& m = tiny();
  const int64_t H = m.hidden, d = m.kda.head_dim, h = m.kda.num_heads;
  LayerWeights w(m, 1,
                 edit(synth_lookup(m, 1, 21),
                      {{"self_attn.dt_bias", [](auto& v) { std::fill(v.begin(), v.end(), -1000.0); }},
                       {"self_attn.b_proj.weight", [H](auto& v) { std::fill(v.begin(), v.end(), -1000.0 / H); }}}));
  StepMeta meta = StepMeta::simple(2, 1, {10, 20}, 16, 2);
  KdaState st = rand_kda(m, {}, 3, m.kda.conv_kernel - 1, 33);
  const KdaState before = st;
  Mat x(2, H, 1.0);
  Trace tr;
  Mat out = kda_mixer(w, x, meta, st, none(), &tr);
  EXPECT_EQ(st.recurrent, before.recurrent);
  EXPECT_NE(st.conv_q, before.conv_q);  // the conv history did move
  EXPECT_EQ(max_abs(tr.at("beta").v), 0.0);
  EXPECT_EQ(max_abs(tr.at("alpha").v), 0.0);
  for (int64_t r = 0; r < 2; ++r) {
    const int64_t slot = meta.kda_slots[r][0];
    for (int64_t j = 0; j < h; ++j) {
      std::vector<double> qh(tr.at("q_conv").row(r).begin() + j * d, tr.at("q_conv").row(r).begin() + (j + 1) * d);
      l2_normalize(qh, 1e-6, 1 / std::sqrt(static_cast<double>(d)));
      std::span<double> S = st.slot_state(slot, j);
      for (int64_t b = 0; b < d; ++b) {
        double e = 0;
        for (int64_t a = 0; a < d; ++a) e += S[a * d + b] * qh[a];
        ASSERT_NEAR(tr.at("o")(r, j * d + b), e, 1e-13) << r << " " << j << " " << b;
      }
    }
  }
  EXPECT_GT(max_abs(out.v), 0.0);
}

// One-hot conv kernels: tap 0 delays the input by K-1 steps, tap K-1 passes the current input.
TEST(Reference, KdaConvOneHotKernelDelaysInput) {
  const Model& m = tiny();
  const int64_t K = m.kda.conv_kernel;
  auto onehot = [K](int64_t tap) {
    return [K, tap](std::vector<double>& v) {
      for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<int64_t>(i % K) == tap ? 1.0 : 0.0;
    };
  };
  LayerWeights w(m, 1,
                 edit(synth_lookup(m, 1, 5),
                      {{"self_attn.q_conv1d.weight", onehot(0)}, {"self_attn.k_conv1d.weight", onehot(K - 1)}}));
  StepMeta meta = StepMeta::simple(1, 1, {1}, 16, 1);
  KdaState st = KdaState::zeros(m, {}, 2, K - 1);
  std::vector<Mat> qs;
  for (int step = 0; step < 7; ++step) {
    Trace tr;
    kda_mixer(w, rand_mat(1, m.hidden, 100 + step), meta, st, none(), &tr);
    qs.push_back(tr.at("q"));
    for (int64_t c = 0; c < m.kda.projection_size(); ++c) {
      const double delayed = step >= K - 1 ? qs[step - (K - 1)](0, c) : 0.0;
      ASSERT_EQ(tr.at("q_conv")(0, c), silu(delayed)) << step << " " << c;
      ASSERT_EQ(tr.at("k_conv")(0, c), silu(tr.at("k")(0, c))) << step << " " << c;
    }
  }
}

// ---- MLA ------------------------------------------------------------------------------------------

// seq_len 1: softmax over one position is 1, so o_lat = that token's (normed) latent c and
// o_heads[n] = W_UV[n]^T c.
TEST(Reference, MlaAttentionOverOneTokenReturnsItsLatent) {
  const Model& m = tiny();
  const model::MlaConfig& a = m.mla;
  LayerWeights w = LayerWeights::from_synth(m, 3, 9);
  StepMeta meta = StepMeta::simple(2, 1, {1, 1}, 16, 1);
  MlaCache cache = rand_mla(m, 3, 16, 4);
  Trace tr;
  Mat x = rand_mat(2, m.hidden, 77);
  mla_mixer(w, x, meta, cache, none(), &tr);
  const int64_t L = a.kv_lora_rank, N = a.num_heads, Pn = a.qk_nope_head_dim, V = a.v_head_dim;
  const Tensor& kvb = w.get("self_attn.kv_b_proj.weight");
  for (int64_t t = 0; t < 2; ++t) {
    for (int64_t n = 0; n < N; ++n) {
      for (int64_t l = 0; l < L; ++l) ASSERT_NEAR(tr.at("o_lat")(t, n * L + l), tr.at("c")(t, l), 1e-15);
      for (int64_t v = 0; v < V; ++v) {
        double e = 0;
        for (int64_t l = 0; l < L; ++l) e += kvb.at(n * (Pn + V) + Pn + v, l) * tr.at("c")(t, l);
        ASSERT_NEAR(tr.at("o_heads")(t, n * V + v), e, 1e-12);
      }
    }
    // The cache row holds [c | k_pe] at the token's slot.
    std::span<double> row = cache.slot(meta.slot_mapping[t]);
    EXPECT_EQ(max_diff(row.subspan(0, static_cast<size_t>(L)), tr.at("c").row(t)), 0.0);
    EXPECT_EQ(max_diff(row.subspan(static_cast<size_t>(L)), tr.at("kv").row(t).subspan(static_cast<size_t>(L))), 0.0);
  }
}

// The absorbed computation (q_nope W_UK_T against latents, o_lat W_UV) equals plain per-head
// attention with k_nope = W_UK c and v = W_UV c, causal within a q = 2 step.
TEST(Reference, MlaAbsorbedEqualsNaiveAttention) {
  const Model& m = tiny();
  const model::MlaConfig& a = m.mla;
  const int64_t L = a.kv_lora_rank, N = a.num_heads, Pn = a.qk_nope_head_dim, R = a.qk_rope_head_dim, V = a.v_head_dim,
                bs = 4;
  LayerWeights w = LayerWeights::from_synth(m, 3, 10);
  StepMeta meta = StepMeta::simple(2, 2, {5, 9}, bs, 3);
  MlaCache cache = rand_mla(m, 7, bs, 12);
  Trace tr;
  mla_mixer(w, rand_mat(4, m.hidden, 13), meta, cache, none(), &tr);
  const Tensor& kvb = w.get("self_attn.kv_b_proj.weight");
  const Mat& qf = tr.at("q");
  for (int64_t r = 0; r < 2; ++r) {
    for (int64_t i = 0; i < 2; ++i) {
      const int64_t t = r * 2 + i, pos = meta.seq_lens[r] - 2 + i;
      for (int64_t n = 0; n < N; ++n) {
        std::vector<double> s;
        std::vector<std::vector<double>> vals;
        for (int64_t p = 0; p <= pos; ++p) {
          std::span<double> row = cache.slot(meta.block_table[r][p / bs] * bs + p % bs);
          double dot = 0;
          for (int64_t j = 0; j < Pn; ++j) {
            double kn = 0;
            for (int64_t l = 0; l < L; ++l) kn += kvb.at(n * (Pn + V) + j, l) * row[l];
            dot += qf(t, n * (Pn + R) + j) * kn;
          }
          for (int64_t e = 0; e < R; ++e) dot += qf(t, n * (Pn + R) + Pn + e) * row[L + e];
          s.push_back(dot / std::sqrt(static_cast<double>(Pn + R)));
          std::vector<double> vv(static_cast<size_t>(V));
          for (int64_t j = 0; j < V; ++j)
            for (int64_t l = 0; l < L; ++l) vv[j] += kvb.at(n * (Pn + V) + Pn + j, l) * row[l];
          vals.push_back(vv);
        }
        const double mx = *std::max_element(s.begin(), s.end());
        double z = 0;
        for (double& e : s) z += (e = std::exp(e - mx));
        for (int64_t j = 0; j < V; ++j) {
          double o = 0;
          for (size_t p = 0; p < s.size(); ++p) o += s[p] / z * vals[p][j];
          ASSERT_NEAR(tr.at("o_heads")(t, n * V + j), o, 1e-11 * (1 + std::fabs(o))) << t << " " << n << " " << j;
        }
      }
    }
  }
}

// ---- MoE ------------------------------------------------------------------------------------------

TEST(Reference, RouterSelectsByBiasWeighsWithoutIt) {
  model::MoeConfig cfg;
  cfg.num_experts = 6;
  cfg.top_k = 2;
  const std::vector<double> logits = {0.0, 1.0, -1.0, 2.0, 0.5, 0.0};
  // Without bias: experts 3 (2.0) and 1 (1.0), weights sigmoid / sum.
  Routing r = route(logits, {}, cfg);
  EXPECT_EQ(r.experts, (std::vector<int64_t>{3, 1}));
  const double s3 = sigmoid(2.0), s1 = sigmoid(1.0);
  EXPECT_DOUBLE_EQ(r.weights[0], s3 / (s3 + s1));
  // Bias lifts expert 2 first: the weight is its UNbiased sigmoid score.
  Routing b = route(logits, std::vector<double>{0, 0, 10, 0, 0, 0}, cfg);
  EXPECT_EQ(b.experts, (std::vector<int64_t>{2, 3}));
  const double s2 = sigmoid(-1.0);
  EXPECT_DOUBLE_EQ(b.weights[0], s2 / (s2 + s3));
  EXPECT_DOUBLE_EQ(b.weights[0] + b.weights[1], 1.0);
  cfg.renormalize = false;
  EXPECT_DOUBLE_EQ(route(logits, std::vector<double>{0, 0, 10, 0, 0, 0}, cfg).weights[0], s2);
  // Ties: the lower index first.
  cfg.top_k = 3;
  EXPECT_EQ(route(std::vector<double>(6, 0.25), {}, cfg).experts, (std::vector<int64_t>{0, 1, 2}));
  // Grouped stage: 3 groups of 2, keep the best group by top-2 sum; expert 3 (best alone) is masked.
  cfg.top_k = 2;
  cfg.num_expert_group = 3;
  cfg.topk_group = 1;
  EXPECT_EQ(route(std::vector<double>{1.5, 1.4, -3, 3, 0, 0}, {}, cfg).experts, (std::vector<int64_t>{0, 1}));
}

// top_k = 1 and a huge correction bias on expert 11: the routed weight renormalises to 1, so the
// MoE output is routed_scaling * E_11(x) + Shared(x) (computed here with independent loops).
TEST(Reference, MoeForcedOntoOneExpertIsThatExpert) {
  Model m = tiny();
  m.moe.top_k = 1;
  const int64_t forced = 11, H = m.hidden;
  LayerWeights w(m, 2,
                 edit(synth_lookup(m, 2, 3),
                      {{"block_sparse_moe.gate.e_score_correction_bias", [](auto& v) { v[forced] = 1000.0; }}}));
  Mat x = rand_mat(3, H, 8);
  Trace tr;
  Mat out = moe(w, x, none(), &tr);
  auto mlp = [&](const Tensor& g, const Tensor& u, const Tensor& dn, std::span<const double> xr) {
    std::vector<double> a(static_cast<size_t>(g.rows())), y(static_cast<size_t>(H));
    for (int64_t i = 0; i < g.rows(); ++i) {
      double gs = 0, us = 0;
      for (int64_t j = 0; j < H; ++j) gs += g.at(i, j) * xr[j], us += u.at(i, j) * xr[j];
      a[i] = gs / (1 + std::exp(-gs)) * us;
    }
    for (int64_t o = 0; o < H; ++o)
      for (int64_t i = 0; i < g.rows(); ++i) y[o] += dn.at(o, i) * a[i];
    return y;
  };
  const std::string s = "block_sparse_moe.shared_experts.";
  const Tensor e1 = w.expert(forced, "w1"), e3 = w.expert(forced, "w3"), e2 = w.expert(forced, "w2");
  for (int64_t t = 0; t < 3; ++t) {
    EXPECT_EQ(tr.at("topk_ids")(t, 0), forced);
    EXPECT_EQ(tr.at("topk_weights")(t, 0), 1.0);
    std::vector<double> ye = mlp(e1, e3, e2, x.row(t));
    std::vector<double> ys =
        mlp(w.get(s + "gate_proj.weight"), w.get(s + "up_proj.weight"), w.get(s + "down_proj.weight"), x.row(t));
    for (int64_t o = 0; o < H; ++o)
      ASSERT_NEAR(out(t, o), m.moe.routed_scaling * ye[o] + ys[o], 1e-12) << t << " " << o;
  }
  // Only the forced expert's weights were read (plus router, bias and the shared MLP), once each
  // by moe() and once more by this test.
  for (const std::string& key : w.lookups())
    EXPECT_TRUE(key.rfind("block_sparse_moe.experts.", 0) != 0 || key.rfind("block_sparse_moe.experts.11.", 0) == 0)
        << key;
  EXPECT_EQ(w.lookups().size(), 2u + 3u + 3u + 3u);
}

// The routed experts run on threads of their own: with many experts chosen, the MoE output equals the
// sum the test forms one expert at a time from the trace's routing, the lookups come in expert order
// (each expert's w1, w3, w2), and of two failing experts the lower one's error is the one thrown.
TEST(Reference, MoeExpertsOnThreadsMatchOneAtATime) {
  const Model& m = tiny();
  const int64_t H = m.hidden, T = 6, k = m.moe.top_k;
  LayerWeights w = LayerWeights::from_synth(m, 2, 3);
  const Mat x = rand_mat(T, H, 21);
  Trace tr;
  moe(w, x, none(), &tr);
  const Mat& routed = tr.at("routed");
  std::set<int64_t> chosen;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < k; ++i) chosen.insert(static_cast<int64_t>(tr.at("topk_ids")(t, i)));
  ASSERT_GE(chosen.size(), 4u) << "the test wants several experts at once";
  std::vector<std::string> got, want;  // the routed experts' keys: each chosen expert's, ascending
  for (const std::string& key : w.lookups())
    if (key.rfind("block_sparse_moe.experts.", 0) == 0) got.push_back(key);
  for (int64_t e : chosen)
    for (const char* mat : {"w1", "w3", "w2"})
      want.push_back(fmt::format("block_sparse_moe.experts.{}.{}.weight", e, mat));
  EXPECT_EQ(got, want);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> acc(static_cast<size_t>(H), 0.0);
    for (int64_t i = 0; i < k; ++i) {
      const int64_t e = static_cast<int64_t>(tr.at("topk_ids")(t, i));
      const Tensor g = w.expert(e, "w1"), u = w.expert(e, "w3"), dn = w.expert(e, "w2");
      std::vector<double> a(static_cast<size_t>(g.rows()));
      for (int64_t r = 0; r < g.rows(); ++r) {
        double gs = 0, us = 0;
        for (int64_t j = 0; j < H; ++j) gs += g.at(r, j) * x(t, j), us += u.at(r, j) * x(t, j);
        a[static_cast<size_t>(r)] = gs / (1 + std::exp(-gs)) * us;
      }
      for (int64_t o = 0; o < H; ++o) {
        double y = 0;
        for (int64_t r = 0; r < g.rows(); ++r) y += dn.at(o, r) * a[static_cast<size_t>(r)];
        acc[static_cast<size_t>(o)] += tr.at("topk_weights")(t, i) * y;
      }
    }
    for (int64_t o = 0; o < H; ++o)
      ASSERT_NEAR(routed(t, o), m.moe.routed_scaling * acc[static_cast<size_t>(o)], 1e-12) << t << " " << o;
  }
  // Two chosen experts whose lookups fail: the lower one's message.
  const int64_t lo = *chosen.begin(), hi = *chosen.rbegin();
  WeightLookup base = synth_lookup(m, 2, 3);
  LayerWeights bad(m, 2, [&](const std::string& key) {
    for (int64_t e : {lo, hi})
      if (key == fmt::format("block_sparse_moe.experts.{}.w2.weight", e)) fail(Errc::input, "no tensor {}", key);
    return base(key);
  });
  test::expect_error([&] { moe(bad, x, none()); }, Errc::input,
                     {fmt::format("experts.{}.w2", lo)});
}

TEST(Reference, DenseMlpIsDownOfSiluGateTimesUp) {
  const Model& m = tiny();
  LayerWeights w = LayerWeights::from_synth(m, 0, 4);
  Mat x = rand_mat(2, m.hidden, 9);
  Mat y = dense_mlp(w, x, none());
  const Tensor &g = w.get("mlp.gate_proj.weight"), &u = w.get("mlp.up_proj.weight"),
               &dn = w.get("mlp.down_proj.weight");
  for (int64_t t = 0; t < 2; ++t) {
    std::vector<double> a(static_cast<size_t>(g.rows()));
    for (int64_t i = 0; i < g.rows(); ++i) {
      double gs = 0, us = 0;
      for (int64_t j = 0; j < m.hidden; ++j) gs += g.at(i, j) * x(t, j), us += u.at(i, j) * x(t, j);
      a[i] = silu(gs) * us;
    }
    for (int64_t o = 0; o < m.hidden; o += 17) {
      double e = 0;
      for (int64_t i = 0; i < g.rows(); ++i) e += dn.at(o, i) * a[i];
      EXPECT_NEAR(y(t, o), e, 1e-12);
    }
  }
}

// ---- spec-verify == sequential ------------------------------------------------------------------

// A q = 2 step of a KDA decoder layer equals two q = 1 steps, token by token: outputs, and the state
// written for each draft position. Request 0 resumes from its 2nd slot (2 tokens accepted last step),
// request 1 from its 1st. Full vLLM rounding: the equality is exact.
void kda_spec_vs_sequential(const Model& m, int layer, ConvSpecLayout layout) {
  SCOPED_TRACE(
      fmt::format("{} layer {} {}", m.model_type, layer, layout == ConvSpecLayout::window ? "window" : "per_slot"));
  const int64_t H = m.hidden, K = m.kda.conv_kernel, W = 2, q = 2;
  LayerWeights w = LayerWeights::from_synth(m, layer, 17);
  Options opt;
  opt.conv_spec = layout;
  const bool window = layout == ConvSpecLayout::window;
  StepMeta spec = StepMeta::simple(W, q, {30, 40}, 16, 3);
  spec.num_accepted = {2, 1};
  LayerState s_spec;
  s_spec.kda = rand_kda(m, {}, 1 + W * q, window ? K - 2 + q : K - 1, 50);
  const KdaState initial = s_spec.kda;
  Mat hid = rand_mat(W * q, H, 60), res = rand_mat(W * q, H, 61);
  const AttnResState ar = rand_attn_res(m, layer, W * q, 62);
  AttnResState ar_spec = ar;
  LayerOutput o_spec = decoder_layer(w, hid, &res, spec, s_spec, opt, nullptr, ar_ptr(m, ar_spec));

  // Sequential: one slot per request (slot 1 + r), initialised from what the spec step read.
  LayerState s_seq;
  s_seq.kda = KdaState::zeros(m, {}, 1 + W, K - 1);
  for (int64_t r = 0; r < W; ++r) {
    const int64_t acc = spec.num_accepted[r], from = spec.kda_slots[r][acc - 1];
    const int64_t n = initial.head_dim * initial.head_dim;
    for (int64_t j = 0; j < s_seq.kda.heads; ++j) {
      const double* init = initial.recurrent.data() + (from * initial.heads + j) * n;
      std::copy(init, init + n, s_seq.kda.slot_state(1 + r, j).begin());
    }
    for (int c3 = 0; c3 < 3; ++c3)
      for (int64_t c = 0; c < s_seq.kda.conv_dim; ++c) {
        const std::vector<double>& iv = c3 == 0 ? initial.conv_q : c3 == 1 ? initial.conv_k : initial.conv_v;
        const int64_t src_slot = window ? spec.kda_slots[r][0] : from;
        const double* src = iv.data() + (src_slot * initial.conv_dim + c) * initial.conv_width + (window ? acc - 1 : 0);
        std::copy(src, src + (K - 1), s_seq.kda.conv(c3, 1 + r, c).begin());
      }
  }
  for (int64_t i = 0; i < q; ++i) {
    StepMeta one = StepMeta::simple(W, 1, {30 - q + 1 + i, 40 - q + 1 + i}, 16, 3);
    for (int64_t r = 0; r < W; ++r) one.kda_slots[r] = {1 + r};
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < W; ++r) rows.push_back(r * q + i);
    Mat ph = pick(hid, rows), pr = pick(res, rows);
    AttnResState ar_one = pick_attn_res(ar, rows);
    LayerOutput o = decoder_layer(w, ph, &pr, one, s_seq, opt, nullptr, ar_ptr(m, ar_one));
    EXPECT_EQ(ar_one.blocks.size(), ar_spec.blocks.size());
    for (size_t k = 0; k < ar_one.blocks.size(); ++k)
      EXPECT_EQ(max_diff(ar_one.blocks[k].v, pick(ar_spec.blocks[k], rows).v), 0.0) << "block " << k;
    EXPECT_GT(max_abs(o.hidden.v), 0.0);
    EXPECT_EQ(max_diff(o.hidden.v, pick(o_spec.hidden, rows).v), 0.0) << "token " << i;
    EXPECT_EQ(max_diff(o.residual.v, pick(o_spec.residual, rows).v), 0.0) << "token " << i;
    for (int64_t r = 0; r < W; ++r) {
      const int64_t slot = spec.kda_slots[r][i];  // where the spec step left token i's state
      for (int64_t j = 0; j < s_seq.kda.heads; ++j) {
        EXPECT_EQ(max_diff(s_seq.kda.slot_state(1 + r, j), s_spec.kda.slot_state(slot, j)), 0.0) << r << " " << i;
      }
      for (int c3 = 0; c3 < 3; ++c3)
        for (int64_t c = 0; c < s_seq.kda.conv_dim; c += 37) {
          std::span<double> seqc = s_seq.kda.conv(c3, 1 + r, c);
          if (!window) {
            EXPECT_EQ(max_diff(seqc, s_spec.kda.conv(c3, slot, c)), 0.0) << r << " " << i << " " << c;
          } else if (i == q - 1) {
            // The window ends with the last K-1 inputs (the history after the last draft token).
            std::span<double> win = s_spec.kda.conv(c3, spec.kda_slots[r][0], c);
            EXPECT_EQ(max_diff(seqc, win.subspan(win.size() - static_cast<size_t>(K - 1))), 0.0) << r << " " << c;
          }
        }
    }
  }
}

TEST(Reference, KdaSpecVerifyEqualsSequentialSteps) {
  kda_spec_vs_sequential(tiny(), 1, ConvSpecLayout::per_slot);
  kda_spec_vs_sequential(tiny(), 0, ConvSpecLayout::per_slot);  // layer 0: dense FFN
  kda_spec_vs_sequential(tiny(), 1, ConvSpecLayout::window);
}

TEST(Reference, KdaWindowLayoutRewritesTheWindow) {
  // q = 2, accepted 2: history = old[1..K-1]; new window = [old[2..K-2], x0, x1] (K = 4: [old[2], x0, x1] + 1).
  const Model& m = tiny();
  const int64_t K = m.kda.conv_kernel;
  LayerWeights w = LayerWeights::from_synth(m, 1, 2);
  Options opt;
  opt.conv_spec = ConvSpecLayout::window;
  StepMeta meta = StepMeta::simple(1, 2, {8}, 16, 1);
  meta.num_accepted = {2};
  KdaState st = rand_kda(m, {}, 3, K, 70);
  const KdaState before = st;
  Trace tr;
  kda_mixer(w, rand_mat(2, m.hidden, 71), meta, st, opt, &tr);
  for (int64_t c = 0; c < st.conv_dim; ++c) {
    std::span<double> nw = st.conv(0, 1, c);
    const double* old = before.conv_q.data() + (1 * before.conv_dim + c) * K;
    ASSERT_EQ(nw[0], old[2]);
    ASSERT_EQ(nw[1], old[3]);
    ASSERT_EQ(nw[2], tr.at("q")(0, c));
    ASSERT_EQ(nw[3], tr.at("q")(1, c));
    // Token 0 convolved old[1..3] with x0.
    std::span<const double> taps(w.get("self_attn.q_conv1d.weight").data.data() + c * K, static_cast<size_t>(K));
    ASSERT_EQ(tr.at("q_conv")(0, c),
              round_bf16(kda_conv_step(std::vector<double>{old[1], old[2], old[3]}, tr.at("q")(0, c), taps)));
  }
  EXPECT_EQ(st.conv_q.size(), before.conv_q.size());
  // Slot 2 (the second draft position) holds no conv state in this layout: untouched.
  for (int64_t c = 0; c < st.conv_dim; ++c)
    EXPECT_EQ(max_diff(st.conv(0, 2, c), std::span<const double>(before.conv_q.data() + (2 * before.conv_dim + c) * K,
                                                                 static_cast<size_t>(K))),
              0.0);
}

// A q = 2 step of an MLA decoder layer equals two q = 1 steps: outputs and the latent cache.
void mla_spec_vs_sequential(const Model& m, int layer) {
  SCOPED_TRACE(fmt::format("{} layer {}", m.model_type, layer));
  const int64_t H = m.hidden, W = 2, q = 2, bs = 4;
  LayerWeights w = LayerWeights::from_synth(m, layer, 23);
  StepMeta spec = StepMeta::simple(W, q, {6, 9}, bs, 3);
  LayerState s_spec, s_seq;
  s_spec.mla = rand_mla(m, 1 + 3 * W, bs, 80);
  s_seq.mla = s_spec.mla;
  Mat hid = rand_mat(W * q, H, 81), res = rand_mat(W * q, H, 82);
  const AttnResState ar = rand_attn_res(m, layer, W * q, 83);
  AttnResState ar_spec = ar;
  LayerOutput o_spec = decoder_layer(w, hid, &res, spec, s_spec, {}, nullptr, ar_ptr(m, ar_spec));
  for (int64_t i = 0; i < q; ++i) {
    StepMeta one = StepMeta::simple(W, 1, {6 - q + 1 + i, 9 - q + 1 + i}, bs, 3);
    std::vector<int64_t> rows = {0 * q + i, 1 * q + i};
    Mat ph = pick(hid, rows), pr = pick(res, rows);
    AttnResState ar_one = pick_attn_res(ar, rows);
    LayerOutput o = decoder_layer(w, ph, &pr, one, s_seq, {}, nullptr, ar_ptr(m, ar_one));
    EXPECT_GT(max_abs(o.hidden.v), 0.0);
    EXPECT_EQ(max_diff(o.hidden.v, pick(o_spec.hidden, rows).v), 0.0) << "token " << i;
    EXPECT_EQ(max_diff(o.residual.v, pick(o_spec.residual, rows).v), 0.0) << "token " << i;
  }
  EXPECT_EQ(s_seq.mla.data, s_spec.mla.data);
}

TEST(Reference, MlaSpecVerifyEqualsSequentialSteps) { mla_spec_vs_sequential(tiny(), 3); }

// ---- padded requests ----------------------------------------------------------------------------

TEST(Reference, PaddedKdaRequestReadsAndWritesNothing) {
  const Model& m = tiny();
  LayerWeights w = LayerWeights::from_synth(m, 2, 31);
  for (int64_t q : {1, 2}) {
    StepMeta meta = StepMeta::simple(3, q, {5, 0, 7}, 16, 1);
    meta.kda_slots[1].assign(static_cast<size_t>(q), kNullBlockId);
    if (q == 2) meta.num_accepted = {2, 1, 1};
    KdaState st = rand_kda(m, {}, 1 + 3 * q, m.kda.conv_kernel - 1, 90);
    const KdaState before = st;
    Trace tr;
    Mat out = kda_mixer(w, rand_mat(3 * q, m.hidden, 91), meta, st, {}, &tr);
    // Only the real requests' slots changed; slot 0 and the padded request's slots did not.
    std::vector<bool> touched(static_cast<size_t>(st.num_slots), false);
    for (int64_t r : {0, 2})
      for (int64_t s : meta.kda_slots[r]) touched[s] = true;
    for (int64_t s = 0; s < st.num_slots; ++s) {
      for (int64_t j = 0; j < st.heads; ++j) {
        std::span<const double> b(before.recurrent.data() + (s * st.heads + j) * st.head_dim * st.head_dim,
                                  static_cast<size_t>(st.head_dim * st.head_dim));
        if (touched[s])
          EXPECT_GT(max_diff(st.slot_state(s, j), b), 0.0) << q << " " << s;
        else
          EXPECT_EQ(max_diff(st.slot_state(s, j), b), 0.0) << q << " " << s;
      }
      for (int64_t c = 0; c < st.conv_dim; ++c) {
        std::span<const double> b(before.conv_v.data() + (s * st.conv_dim + c) * st.conv_width,
                                  static_cast<size_t>(st.conv_width));
        if (!touched[s]) {
          ASSERT_EQ(max_diff(st.conv(2, s, c), b), 0.0) << q << " " << s;
        }
      }
    }
    const std::vector<bool> valid = valid_rows(meta, model::Mixer::kda);
    for (int64_t t = 0; t < 3 * q; ++t) {
      EXPECT_EQ(valid[t], t / q != 1);
      if (t / q == 1)
        EXPECT_EQ(max_abs(out.row(t)), 0.0);
      else
        EXPECT_GT(max_abs(out.row(t)), 0.0);
    }
  }
}

TEST(Reference, PaddedMlaRequestReadsAndWritesNothing) {
  const Model& m = tiny();
  LayerWeights w = LayerWeights::from_synth(m, 3, 32);
  const int64_t bs = 4;
  StepMeta meta = StepMeta::simple(3, 2, {5, 0, 7}, bs, 2);
  meta.block_table[1] = {0, 0};  // vLLM pads block-table rows with the null block
  MlaCache cache = rand_mla(m, 7, bs, 93);
  const MlaCache before = cache;
  Mat out = mla_mixer(w, rand_mat(6, m.hidden, 94), meta, cache, {});
  for (int64_t s = 0; s < cache.num_blocks * bs; ++s) {
    const bool written = s == meta.slot_mapping[0] || s == meta.slot_mapping[1] || s == meta.slot_mapping[4] ||
                         s == meta.slot_mapping[5];
    std::span<const double> b(before.data.data() + s * cache.row, static_cast<size_t>(cache.row));
    if (written)
      EXPECT_GT(max_diff(cache.slot(s), b), 0.0) << s;
    else
      EXPECT_EQ(max_diff(cache.slot(s), b), 0.0) << s;
  }
  for (int64_t t = 0; t < 6; ++t) {
    if (t / 2 == 1)
      EXPECT_EQ(max_abs(out.row(t)), 0.0);
    else
      EXPECT_GT(max_abs(out.row(t)), 0.0);
  }
  // PAD_SLOT_ID: that token is not written, the rest of the step goes on.
  meta.slot_mapping[5] = kPadSlotId;
  MlaCache c2 = before;
  mla_mixer(w, rand_mat(6, m.hidden, 94), meta, c2, {});
  const int64_t s5 = StepMeta::simple(3, 2, {5, 0, 7}, bs, 2).slot_mapping[5];
  std::span<const double> b5(before.data.data() + s5 * c2.row, static_cast<size_t>(c2.row));
  EXPECT_EQ(max_diff(c2.slot(s5), b5), 0.0);
  EXPECT_EQ(max_diff(c2.slot(meta.slot_mapping[4]), cache.slot(meta.slot_mapping[4])), 0.0);  // same write as before
}

// ---- tensor parallelism ---------------------------------------------------------------------------

// For every layer of the tiny model: the two ranks' partial mixer and FFN outputs sum to the TP=1
// outputs, the TP=2 decoder layer equals the TP=1 one, and each rank's KDA state is its heads' slice.
TEST(Reference, TensorParallelPartialsSumToTp1) {
  const Model& m = tiny();
  const int64_t W = 2, q = 2, H = m.hidden, bs = 4;
  for (int layer = 0; layer < 4; ++layer) {
    SCOPED_TRACE(fmt::format("layer {}", layer));
    LayerWeights full = LayerWeights::from_synth(m, layer, 41);
    LayerWeights r0 = LayerWeights::from_synth(m, layer, 41, {2, 0}),
                 r1 = LayerWeights::from_synth(m, layer, 41, {2, 1});
    StepMeta meta = StepMeta::simple(W, q, {6, 9}, bs, 3);
    meta.num_accepted = {2, 1};
    const int64_t slots = 1 + W * q, width = m.kda.conv_kernel - 1;
    // Full-width states, and each rank's slice of them.
    LayerState s_full, s0, s1;
    s_full.kda = rand_kda(m, {}, slots, width, 100);
    s0.kda = slice_kda(m, s_full.kda, 2, 0);
    s1.kda = slice_kda(m, s_full.kda, 2, 1);
    s_full.mla = rand_mla(m, 7, bs, 101);
    s0.mla = s1.mla = s_full.mla;
    Mat hid = rand_mat(W * q, H, 102), res = rand_mat(W * q, H, 103);
    const Options opt = none();

    // Mixer partials, from copies of the states.
    LayerState a_full = s_full, a0 = s0, a1 = s1;
    Mat x = rand_mat(W * q, H, 104);
    Mat mf, m0, m1;
    if (m.layers[layer].mixer == model::Mixer::kda) {
      mf = kda_mixer(full, x, meta, a_full.kda, opt);
      m0 = kda_mixer(r0, x, meta, a0.kda, opt);
      m1 = kda_mixer(r1, x, meta, a1.kda, opt);
    } else {
      mf = mla_mixer(full, x, meta, a_full.mla, opt);
      m0 = mla_mixer(r0, x, meta, a0.mla, opt);
      m1 = mla_mixer(r1, x, meta, a1.mla, opt);
    }
    Mat sum = m0;
    for (size_t i = 0; i < sum.v.size(); ++i) sum.v[i] += m1.v[i];
    EXPECT_LT(rel_error(sum, mf), 1e-13);
    EXPECT_GT(rel_error(m0, mf), 0.1);  // a partial alone is not the whole
    // FFN partials (non-latent FFNs have a per-rank partial).
    Mat f0 = m.layers[layer].ffn == model::Ffn::dense ? dense_mlp(r0, x, opt) : moe(r0, x, opt);
    Mat f1 = m.layers[layer].ffn == model::Ffn::dense ? dense_mlp(r1, x, opt) : moe(r1, x, opt);
    const LayerWeights* one[1] = {&full};
    Mat ff = ffn(one, x, opt);
    for (size_t i = 0; i < f0.v.size(); ++i) f0.v[i] += f1.v[i];
    EXPECT_LT(rel_error(f0, ff), 1e-13);

    // Whole layers.
    LayerState b_full = s_full, b0 = s0, b1 = s1;
    LayerOutput of = decoder_layer(full, hid, &res, meta, b_full, opt);
    const LayerWeights* ranks[2] = {&r0, &r1};
    LayerState* states[2] = {&b0, &b1};
    LayerOutput ot = decoder_layer_tp(ranks, hid, &res, meta, states, opt);
    EXPECT_LT(rel_error(ot.hidden, of.hidden), 1e-13);
    EXPECT_LT(rel_error(ot.residual, of.residual), 1e-13);
    if (m.layers[layer].mixer == model::Mixer::kda) {
      KdaState expect0 = slice_kda(m, b_full.kda, 2, 0);
      EXPECT_LT(rel_error(b0.kda.recurrent, expect0.recurrent), 1e-13);
      EXPECT_EQ(b0.kda.conv_k, expect0.conv_k);
    } else {
      EXPECT_EQ(b0.mla.data, b_full.mla.data);
      EXPECT_EQ(b1.mla.data, b_full.mla.data);
    }
  }
}

// ---- weights --------------------------------------------------------------------------------------

TEST(Reference, CheckpointLookupMatchesSynth) {
  test::TempDir dir;
  model::SynthOptions so;
  so.preset = "kimi-linear-tiny";
  so.out = dir / "ckpt";
  so.seed = 5;
  model::synthesize(so);
  const Model& m = tiny();
  st::Checkpoint ck = st::Checkpoint::open(so.out);
  for (int layer = 0; layer < 4; ++layer) {
    LayerWeights a = LayerWeights::from_checkpoint(m, ck, layer, {2, 1});
    LayerWeights b = LayerWeights::from_synth(m, layer, 5, {2, 1});
    for (size_t i : m.layers[layer].weights) {
      const std::string& key = m.weights[i].key;
      ASSERT_EQ(a.get(key).data, b.get(key).data) << key;
      ASSERT_EQ(a.get(key).shape, b.get(key).shape) << key;
    }
  }
  // A different seed gives different values (the comparison above can fail).
  EXPECT_NE(LayerWeights::from_synth(m, 0, 6).get("mlp.up_proj.weight").data,
            LayerWeights::from_checkpoint(m, ck, 0).get("mlp.up_proj.weight").data);
  // The final norm weight is a model-level tensor.
  EXPECT_EQ(model_tensor(m, checkpoint_lookup(m, ck, -1), "norm.weight").data,
            model_tensor(m, synth_lookup(m, -1, 5), "norm.weight").data);

  // HF transformers layout: layer 0's MLP under block_sparse_moe.* (an alias), fp32 params as bf16.
  so.out = dir / "hf";
  so.layout = model::CheckpointLayout::transformers;
  model::synthesize(so);
  st::Checkpoint hf = st::Checkpoint::open(so.out);
  LayerWeights h0 = LayerWeights::from_checkpoint(m, hf, 0);
  EXPECT_EQ(h0.get("mlp.down_proj.weight").data, LayerWeights::from_synth(m, 0, 5).get("mlp.down_proj.weight").data);
  const std::vector<double>& dt = h0.get("self_attn.dt_bias").data;
  for (double v : dt) ASSERT_EQ(v, round_bf16(v));
}

TEST(Reference, ShardsFollowTheSplitRules) {
  const Model& m = tiny();
  LayerWeights full = LayerWeights::from_synth(m, 1, 3), r1 = LayerWeights::from_synth(m, 1, 3, {2, 1});
  const Tensor& q = r1.get("self_attn.q_proj.weight");  // column-parallel: rows [P/2, P)
  const int64_t P = m.kda.projection_size(), H = m.hidden;
  ASSERT_EQ(q.shape, (std::vector<int64_t>{P / 2, H}));
  EXPECT_EQ(q.at(0, 5), full.get("self_attn.q_proj.weight").at(P / 2, 5));
  const Tensor& o = r1.get("self_attn.o_proj.weight");  // row-parallel: columns [P/2, P)
  ASSERT_EQ(o.shape, (std::vector<int64_t>{H, P / 2}));
  EXPECT_EQ(o.at(7, 0), full.get("self_attn.o_proj.weight").at(7, P / 2));
  EXPECT_EQ(r1.get("self_attn.A_log").shape, (std::vector<int64_t>{1, 1, 1, 1}));  // dim 2
  EXPECT_EQ(r1.get("self_attn.A_log").data[0], full.get("self_attn.A_log").data[1]);
  EXPECT_EQ(r1.get("self_attn.f_a_proj.weight").data, full.get("self_attn.f_a_proj.weight").data);  // replicated
  test::expect_error(
      [&] {
        LayerWeights::from_synth(m, 1, 3, {3, 0}).get("self_attn.q_proj.weight");
      },
      Errc::input, {"self_attn.q_proj.weight", "tensor_parallel 3"});
  test::expect_error([&] { full.get("self_attn.nonexistent"); }, Errc::input, {"nonexistent", "layer 1"});
}

// ---- Kimi-K3 paths --------------------------------------------------------------------------------

TEST(Reference, K3MxFp4ExpertsDequantise) {
  const Model& m = k3tiny();
  ASSERT_EQ(m.moe.expert_format, model::ExpertFormat::mxfp4);
  LayerWeights w = LayerWeights::from_synth(m, 1, 3);
  const Tensor d = w.expert(5, "w1");
  const Tensor& p = w.get("block_sparse_moe.experts.5.w1.weight_packed");
  const Tensor& s = w.get("block_sparse_moe.experts.5.w1.weight_scale");
  ASSERT_EQ(d.shape, (std::vector<int64_t>{m.moe.intermediate, m.moe.latent_dim}));
  const auto byte = static_cast<uint8_t>(p.at(3, 4));
  const double sc = e8m0_value(static_cast<uint8_t>(s.at(3, 0)));
  EXPECT_EQ(d.at(3, 8), e2m1_value(byte & 0xf) * sc);
  EXPECT_EQ(d.at(3, 9), e2m1_value(byte >> 4) * sc);
  double nz = 0;
  for (double v : d.data) nz += v != 0;
  EXPECT_GT(nz, static_cast<double>(d.data.size()) / 2);
}

TEST(Reference, K3SpecVerifyAndTensorParallel) {
  const Model& m = k3tiny();
  ASSERT_TRUE(m.kda.full_rank_gate);
  ASSERT_TRUE(m.kda.gate_lower_bound.has_value());
  ASSERT_TRUE(m.mla.output_gate);
  ASSERT_GT(m.mla.q_lora_rank, 0);
  kda_spec_vs_sequential(m, 1, ConvSpecLayout::per_slot);  // full-rank gate, safe gate, latent MoE, SiTU
  mla_spec_vs_sequential(m, 3);                            // q-LoRA, output gate

  // Safe gate: alpha in (lower_bound, 0).
  LayerWeights w1 = LayerWeights::from_synth(m, 1, 7);
  StepMeta meta = StepMeta::simple(2, 1, {3, 4}, 16, 1);
  KdaState st = rand_kda(m, {}, 3, m.kda.conv_kernel - 1, 8);
  Trace tr;
  kda_mixer(w1, rand_mat(2, m.hidden, 9), meta, st, {}, &tr);
  for (double a : tr.at("alpha").v) {
    ASSERT_GT(a, *m.kda.gate_lower_bound);
    ASSERT_LT(a, 0.0);
  }

  // TP = 2 equals TP = 1 on a KDA layer (A_log replicated [a_log_size]: rank r uses heads r*h/2..)
  // and on the latent-MoE MLA layer (the latent sum is all-reduced before its norm).
  {
    LayerWeights f1 = LayerWeights::from_synth(m, 2, 16);
    LayerWeights q0 = LayerWeights::from_synth(m, 2, 16, {2, 0}), q1 = LayerWeights::from_synth(m, 2, 16, {2, 1});
    LayerState sf, s0, s1;
    sf.kda = rand_kda(m, {}, 3, m.kda.conv_kernel - 1, 19);
    s0.kda = slice_kda(m, sf.kda, 2, 0);
    s1.kda = slice_kda(m, sf.kda, 2, 1);
    Mat hid = rand_mat(2, m.hidden, 17), res = rand_mat(2, m.hidden, 18);
    AttnResState af = rand_attn_res(m, 2, 2, 20), at = af;
    LayerOutput of = decoder_layer(f1, hid, &res, meta, sf, none(), nullptr, &af);
    const LayerWeights* ranks[2] = {&q0, &q1};
    LayerState* states[2] = {&s0, &s1};
    LayerOutput ot = decoder_layer_tp(ranks, hid, &res, meta, states, none(), nullptr, &at);
    EXPECT_LT(rel_error(ot.hidden, of.hidden), 1e-13);
    EXPECT_LT(rel_error(ot.residual, of.residual), 1e-13);
  }
  const int layer = 4;
  LayerWeights full = LayerWeights::from_synth(m, layer, 12);
  LayerWeights r0 = LayerWeights::from_synth(m, layer, 12, {2, 0}), r1 = LayerWeights::from_synth(m, layer, 12, {2, 1});
  StepMeta mm = StepMeta::simple(2, 1, {3, 5}, 4, 2);
  LayerState sf, s0, s1;
  sf.mla = rand_mla(m, 5, 4, 13);
  s0.mla = s1.mla = sf.mla;
  Mat hid = rand_mat(2, m.hidden, 14), res = rand_mat(2, m.hidden, 15);
  AttnResState af = rand_attn_res(m, layer, 2, 16), at = af;
  LayerOutput of = decoder_layer(full, hid, &res, mm, sf, none(), nullptr, &af);
  const LayerWeights* ranks[2] = {&r0, &r1};
  LayerState* states[2] = {&s0, &s1};
  LayerOutput ot = decoder_layer_tp(ranks, hid, &res, mm, states, none(), nullptr, &at);
  EXPECT_LT(rel_error(ot.hidden, of.hidden), 1e-13);
  EXPECT_GT(max_abs(of.hidden.v), 0.0);
}

// The FFN half on the layer's own residual output is the layer's hidden output, bit for bit (vLLM
// rounding), for plain and K3 (attention-residual) layers, at TP 1 and TP 2: `run --check` relies on
// this to compare a GPU layer's FFN half on the GPU's residual.
TEST(Reference, PostAttentionFfnOnTheResidualIsTheLayersHidden) {
  for (const Model* mp : {&tiny(), &k3tiny()}) {
    const Model& m = *mp;
    for (int layer = 0; layer < m.num_layers; ++layer) {
      SCOPED_TRACE(fmt::format("{} layer {}", m.config_source, layer));
      const bool kda = m.layers[static_cast<size_t>(layer)].mixer == model::Mixer::kda;
      StepMeta meta = StepMeta::simple(2, 1, {3, 5}, 4, 2);
      for (int tp : {1, 2}) {
        std::vector<std::unique_ptr<LayerWeights>> w;
        std::vector<const LayerWeights*> ranks;
        std::vector<LayerState> st(static_cast<size_t>(tp));
        std::vector<LayerState*> sp;
        LayerState whole = [&] {
          LayerState s;
          if (kda) s.kda = rand_kda(m, {}, 3, m.kda.conv_kernel - 1, 31);
          else s.mla = rand_mla(m, 5, 4, 31);
          return s;
        }();
        for (int r = 0; r < tp; ++r) {
          w.push_back(std::make_unique<LayerWeights>(LayerWeights::from_synth(m, layer, 30, {tp, r})));
          ranks.push_back(w.back().get());
          if (kda) st[static_cast<size_t>(r)].kda = tp == 1 ? whole.kda : slice_kda(m, whole.kda, tp, r);
          else st[static_cast<size_t>(r)].mla = whole.mla;
          sp.push_back(&st[static_cast<size_t>(r)]);
        }
        const Mat hid = rand_mat(2, m.hidden, 32), res = rand_mat(2, m.hidden, 33);
        AttnResState ar = rand_attn_res(m, layer, 2, 34);
        const LayerOutput out =
            decoder_layer_tp(ranks, hid, layer > 0 ? &res : nullptr, meta, sp, {}, nullptr, ar_ptr(m, ar));
        Trace tr;
        const Mat h = post_attention_ffn(ranks, out.residual, {}, &tr, ar_ptr(m, ar));
        EXPECT_EQ(h.v, out.hidden.v) << "tp " << tp;
        EXPECT_GT(max_abs(h.v), 0.0);
        EXPECT_EQ(tr.at("residual2").v, out.residual.v);
        // A changed residual changes the FFN half's output (it is really the input).
        Mat moved = out.residual;
        for (double& v : moved.row(0)) v = -v;
        EXPECT_NE(post_attention_ffn(ranks, moved, {}, nullptr, ar_ptr(m, ar)).v, out.hidden.v);
      }
    }
  }
  // The block state must be the one after the layer (layer 0 of K3 pushes the embedding first).
  const Model& m = k3tiny();
  LayerWeights w = LayerWeights::from_synth(m, 0, 30);
  const LayerWeights* ranks[1] = {&w};
  AttnResState empty;
  EXPECT_THROW(post_attention_ffn(ranks, rand_mat(2, m.hidden, 35), {}, nullptr, &empty), dp::Error);
  EXPECT_THROW(post_attention_ffn(ranks, rand_mat(2, m.hidden, 35), {}, nullptr, nullptr), dp::Error);
}

TEST(Reference, AttnResMixClosedForms) {
  const std::vector<double> p = {1, -2, 3, 0.5}, w = {0.3, 1, -2, 4};
  std::vector<double> out(4);
  attn_res_mix({}, p, w, 1e-5, out);  // no blocks: h = p
  EXPECT_EQ(out, p);
  // A block 2p has the same logit as p (the logit is RMS-normalised): h = (2p + p) / 2.
  std::vector<double> b(4);
  for (int i = 0; i < 4; ++i) b[i] = 2 * p[i];
  std::span<const double> one[1] = {b};
  attn_res_mix(one, p, w, 0.0, out);
  for (int i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(out[i], 1.5 * p[i]);
  // w_eff = 0: every logit is 0, a plain average of the raw vectors.
  const std::vector<double> c = {4, 4, 4, 4}, zero(4, 0.0);
  std::span<const double> two[2] = {b, c};
  attn_res_mix(two, p, zero, 1e-5, out);
  for (int i = 0; i < 4; ++i) EXPECT_DOUBLE_EQ(out[i], (b[i] + c[i] + p[i]) / 3);
  // Logits (x . w) * rsqrt(mean(x^2)): a block aligned with w dominates a block against it.
  std::vector<double> big(4), neg(4);
  for (int i = 0; i < 4; ++i) big[i] = 100 * w[i], neg[i] = -w[i];
  std::span<const double> bn[2] = {big, neg};
  attn_res_mix(bn, neg, w, 0.0, out);
  double l_big = 0, ss = 0;
  for (int i = 0; i < 4; ++i) l_big += w[i] * w[i], ss += w[i] * w[i];
  l_big /= std::sqrt(ss / 4);  // logit of big = -(logit of neg)
  const double pb = 1 / (1 + 2 * std::exp(-2 * l_big));
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(out[i], pb * big[i] + (1 - pb) * neg[i], 1e-12);
}

TEST(Reference, AttnResAddNormClosedForms) {
  // Rows of 4; res_norm * res_proj = 0 makes every logit 0: h is the plain mean of the blocks and p.
  const std::vector<double> zero(4, 0.0), ones(4, 1.0), w = {1, 2, 0.5, -1};
  Mat hid(2, 4), res(2, 4), b(2, 4);
  hid.v = {1, 2, 3, 4, -1, 0, 1, 2};
  res.v = {0.5, 0.5, 0.5, 0.5, 1, 1, 1, 1};
  b.v = {4, 3, 2, 1, 2, 2, 2, 2};
  std::vector<Mat> blocks = {b};
  const Rounding exact = Rounding::none();
  AddNorm r = attn_res_add_norm(hid, &res, blocks, false, zero, ones, w, 0.0, exact);
  ASSERT_EQ(blocks.size(), 1u);                        // no push
  EXPECT_EQ(r.residual.v, (std::vector<double>{1.5, 2.5, 3.5, 4.5, 0, 1, 2, 3}));  // p = hidden + residual
  // Row 0: h = ((4,3,2,1) + (1.5,2.5,3.5,4.5)) / 2 = 2.75 each: RMSNorm(h) = 1, out = w.
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(r.x(0, i), w[i], 1e-15);
  // Row 1: h = ((2,2,2,2) + (0,1,2,3)) / 2 = (1, 1.5, 2, 2.5); rms = sqrt(3.375).
  const double h1[4] = {1, 1.5, 2, 2.5};
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(r.x(1, i), h1[i] / std::sqrt(3.375) * w[i], 1e-15);

  // A push stores p as the newest block and restarts the partial sum; the mix still read the old blocks.
  AddNorm q = attn_res_add_norm(hid, &res, blocks, true, zero, ones, w, 0.0, exact);
  ASSERT_EQ(blocks.size(), 2u);
  EXPECT_EQ(blocks[1].v, r.residual.v);
  EXPECT_EQ(q.residual.v, std::vector<double>(8, 0.0));
  EXPECT_EQ(q.x.v, r.x.v);

  // No blocks (layer 0, no residual): h = p = the embedding; it becomes block 0.
  std::vector<Mat> none_yet;
  AddNorm e = attn_res_add_norm(hid, nullptr, none_yet, true, w, w, ones, 0.0, exact);
  ASSERT_EQ(none_yet.size(), 1u);
  EXPECT_EQ(none_yet[0].v, hid.v);
  EXPECT_NEAR(e.x(0, 0), 1 / std::sqrt(7.5), 1e-15);  // RMSNorm of (1, 2, 3, 4)

  // The logit uses w_eff = res_norm * res_proj: only the product matters.
  std::vector<Mat> b1 = {b}, b2 = {b};
  const std::vector<double> n1 = {1, 2, 3, 4}, p1 = {2, 1, 0.5, -1}, n2 = {2, 2, 1.5, -4}, p2 = {1, 1, 1, 1};
  AddNorm x1 = attn_res_add_norm(hid, &res, b1, false, n1, p1, w, 1e-5, exact);
  AddNorm x2 = attn_res_add_norm(hid, &res, b2, false, n2, p2, w, 1e-5, exact);
  EXPECT_LT(max_diff(x1.x.v, x2.x.v), 1e-14);
  EXPECT_GT(max_diff(x1.x.v, r.x.v), 1e-3);  // and it does matter

  // Rounding: p and h are bf16 values, x as the fused add + norm rounds it.
  AddNorm rb = attn_res_add_norm(hid, &res, blocks, false, n1, p1, w, 1e-5, Rounding::vllm());
  for (double v : rb.x.v) EXPECT_EQ(v, round_bf16(v));
}

// A chain of K3 layers carries the block list as model-family.md 3d says: layer 0 stores the
// embedding, layer i pushes when i % B == 0 (B = 2 in kimi-k3-tiny: layers 0, 2, 4), each push
// stores the partial sum p of the previous block and restarts it, and the final norm mixes them.
TEST(Reference, K3LayersCarryTheBlocks) {
  const Model& m = k3tiny();
  ASSERT_EQ(m.attn_res_block, 2);
  const int64_t W = 2, H = m.hidden;
  StepMeta meta = StepMeta::simple(W, 1, {3, 5}, 4, 2);
  const Mat emb = rand_mat(W, H, 1);
  AttnResState ar;
  Mat hidden = emb, residual;
  std::vector<Mat> p_before_push;  // p at each push (the block it stores)
  for (int l = 0; l < m.num_layers; ++l) {
    SCOPED_TRACE(l);
    ASSERT_EQ(static_cast<int64_t>(ar.blocks.size()), attn_res_blocks(l, 2));
    LayerWeights w = LayerWeights::from_synth(m, l, 30 + l);
    LayerState st;
    if (m.layers[l].mixer == model::Mixer::kda) st.kda = rand_kda(m, {}, 4, m.kda.conv_kernel - 1, 40 + l);
    else st.mla = rand_mla(m, 6, 4, 40 + l);
    // p entering the layer: hidden + residual (bf16); at a push it becomes the newest block.
    Mat p = hidden;
    if (l > 0)
      for (size_t i = 0; i < p.v.size(); ++i) p.v[i] = round_bf16(p.v[i] + residual.v[i]);
    Trace tr;
    LayerOutput o = decoder_layer(w, hidden, l > 0 ? &residual : nullptr, meta, st, {}, &tr, &ar);
    ASSERT_EQ(static_cast<int64_t>(ar.blocks.size()), attn_res_blocks(l + 1, 2));
    if (l % 2 == 0) {
      EXPECT_EQ(ar.blocks.back().v, p.v);                               // the pushed block is p
      EXPECT_EQ(tr.at("residual").v, std::vector<double>(p.v.size()));  // and p restarts at 0
      EXPECT_EQ(o.residual.v, tr.at("mixer_out").v);                    // p = 0 + a
    } else {
      EXPECT_EQ(tr.at("residual").v, p.v);
    }
    if (l == 0) {
      EXPECT_EQ(ar.blocks[0].v, emb.v);
    }
    EXPECT_GT(max_abs(o.hidden.v), 0.0);
    hidden = o.hidden;
    residual = o.residual;
  }
  // Missing or miscounted state is an error that says so.
  {
    LayerWeights w = LayerWeights::from_synth(m, 1, 3);
    LayerState st;
    st.kda = rand_kda(m, {}, 4, m.kda.conv_kernel - 1, 4);
    test::expect_error([&] { decoder_layer(w, emb, &emb, meta, st); }, Errc::input, {"AttnResState"});
    AttnResState three = rand_attn_res(m, 5, W, 9);
    test::expect_error([&] { decoder_layer(w, emb, &emb, meta, st, {}, nullptr, &three); }, Errc::input,
                       {"layer 1 expects 1", "holds 3"});
  }
  // Final: the mix of the stored blocks and p with output_attn_res, then the final norm; with
  // output_attn_res_proj = 0 the mix is the mean of the blocks and p.
  const std::vector<double> zero(static_cast<size_t>(H), 0.0), ones(static_cast<size_t>(H), 1.0);
  const Mat out = final_norm_attn_res(m, hidden, residual, ar, ones, zero, ones, none());
  Mat mean(W, H);
  for (int64_t i = 0; i < W * H; ++i) {
    double s = hidden.v[i] + residual.v[i];
    for (const Mat& b : ar.blocks) s += b.v[i];
    mean.v[i] = s / static_cast<double>(ar.blocks.size() + 1);
  }
  const Mat want = final_norm(m, mean, Mat(W, H), ones, none());
  EXPECT_LT(rel_error(out, want), 1e-14);
  AttnResState short_state = ar;
  short_state.blocks.pop_back();
  test::expect_error([&] { final_norm_attn_res(m, hidden, residual, short_state, ones, zero, ones); }, Errc::input,
                     {"store 3 blocks", "holds 2"});
}

// ---- rounding and errors --------------------------------------------------------------------------

TEST(Reference, VllmRoundingStaysNearExactMath) {
  const Model& m = tiny();
  for (int layer : {1, 3}) {
    LayerWeights w = LayerWeights::from_synth(m, layer, 51);
    StepMeta meta = StepMeta::simple(3, 1, {4, 9, 2}, 4, 3);
    LayerState a, b;
    a.kda = rand_kda(m, {}, 4, m.kda.conv_kernel - 1, 52);
    a.mla = rand_mla(m, 10, 4, 53);
    b = a;
    Mat hid = rand_mat(3, m.hidden, 54), res = rand_mat(3, m.hidden, 55);
    LayerOutput exact = decoder_layer(w, hid, &res, meta, a, none());
    LayerOutput bf = decoder_layer(w, hid, &res, meta, b, {});
    const double e = rel_error(bf.hidden, exact.hidden);
    EXPECT_GT(e, 0.0) << layer;   // rounding is applied...
    EXPECT_LT(e, 2e-2) << layer;  // ...and stays within the kernels' tolerance
    for (double v : bf.hidden.v) ASSERT_EQ(v, round_bf16(v));
    if (layer == 1) {
      EXPECT_LT(rel_error(b.kda.recurrent, a.kda.recurrent), 1e-2);
      for (double v : b.kda.recurrent) ASSERT_EQ(v, round_fp32(v));
    }
  }
}

TEST(Reference, BadStepsAreErrors) {
  const Model& m = tiny();
  LayerWeights w = LayerWeights::from_synth(m, 1, 1);
  KdaState st = rand_kda(m, {}, 5, m.kda.conv_kernel - 1, 1);
  StepMeta meta = StepMeta::simple(2, 2, {5, 6}, 16, 1);
  meta.num_accepted = {3, 1};
  test::expect_error([&] { kda_mixer(w, rand_mat(4, m.hidden, 1), meta, st, {}); }, Errc::input, {"num_accepted 3"});
  meta.num_accepted = {1, 1};
  KdaState wrong = rand_kda(m, {}, 5, m.kda.conv_kernel, 1);
  test::expect_error([&] { kda_mixer(w, rand_mat(4, m.hidden, 1), meta, wrong, {}); }, Errc::input, {"conv_width 4"});
  test::expect_error([&] { kda_mixer(w, rand_mat(3, m.hidden, 1), meta, st, {}); }, Errc::input, {"[W*q = 4"});
  LayerWeights mw = LayerWeights::from_synth(m, 3, 1);
  MlaCache c = rand_mla(m, 3, 16, 1);
  meta.slot_mapping[1] += 1;
  test::expect_error([&] { mla_mixer(mw, rand_mat(4, m.hidden, 1), meta, c, {}); }, Errc::input, {"slot_mapping[1]"});
  test::expect_error([&] { kda_mixer(mw, rand_mat(4, m.hidden, 1), meta, st, {}); }, Errc::input, {"not a KDA layer"});
  LayerWeights r1 = LayerWeights::from_synth(m, 1, 1, {2, 1});
  LayerState ls;
  test::expect_error([&] { decoder_layer(r1, rand_mat(4, m.hidden, 1), nullptr, meta, ls); }, Errc::input,
                     {"decoder_layer_tp"});
}

TEST(Reference, RelErrorFlagsNanAndMasksRows) {
  Mat a(2, 2), b(2, 2);
  a.v = {1, 2, 3, 4};
  b.v = {1, 2, 30, 40};
  EXPECT_EQ(rel_error(a, a), 0.0);
  EXPECT_GT(rel_error(a, b), 0.5);
  std::vector<bool> mask = {true, false};
  EXPECT_EQ(rel_error(a, b, &mask), 0.0);
  a.v[0] = std::nan("");
  EXPECT_TRUE(std::isinf(rel_error(a, b)));
}

}  // namespace
}  // namespace dp::ref
