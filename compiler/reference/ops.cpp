#include "reference/ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "common/error.h"
#include "reference/numeric.h"

namespace dp::ref {

Rounding Rounding::none() {
  Rounding r;
  r.residual = r.norm = r.linear = r.conv = r.kda_out = r.gated_norm = false;
  r.mla_q_absorbed = r.mla_attn_out = r.mla_v_up = r.mla_gate = false;
  r.act = r.moe_weighted = r.moe_sum = r.ffn_out = r.kda_state = r.cache = r.router_logits = false;
  r.attn_res = false;
  return r;
}

void round_bf16_if(bool on, std::span<double> x) {
  if (!on) return;
  for (double& e : x) e = round_bf16(e);
}
void round_bf16_if(bool on, Mat& m) { round_bf16_if(on, std::span<double>(m.v)); }

Mat linear(const Mat& x, std::span<const double> w, int64_t out, int64_t in) {
  if (x.cols != in) fail(Errc::internal, "reference linear: input has {} columns, weight expects {}", x.cols, in);
  if (static_cast<int64_t>(w.size()) != out * in)
    fail(Errc::internal, "reference linear: weight has {} values, expected [{}, {}]", w.size(), out, in);
  Mat y(x.rows, out);
  for (int64_t t = 0; t < x.rows; ++t) {
    const double* xr = x.v.data() + t * in;
    for (int64_t o = 0; o < out; ++o) {
      const double* wr = w.data() + o * in;
      double s = 0;
      for (int64_t i = 0; i < in; ++i) s += wr[i] * xr[i];
      y(t, o) = s;
    }
  }
  return y;
}

Mat linear(const Mat& x, const Tensor& w) { return linear(x, w.data, w.rows(), w.cols()); }

void rms_norm(std::span<const double> x, std::span<const double> w, double eps, std::span<double> out) {
  if (w.size() != x.size() || out.size() != x.size())
    fail(Errc::internal, "reference rms_norm: sizes {} / weight {} / out {}", x.size(), w.size(), out.size());
  double ss = 0;
  for (double e : x) ss += e * e;
  const double inv = 1.0 / std::sqrt(ss / static_cast<double>(x.size()) + eps);
  for (size_t i = 0; i < x.size(); ++i) out[i] = x[i] * inv * w[i];
}

AddNorm fused_add_rms_norm(const Mat& hidden, const Mat* residual, std::span<const double> w, double eps,
                           const Rounding& rnd) {
  AddNorm r;
  r.residual = hidden;
  if (residual) {
    if (residual->rows != hidden.rows || residual->cols != hidden.cols)
      fail(Errc::input, "reference: residual is [{}, {}], hidden_states [{}, {}]", residual->rows, residual->cols,
           hidden.rows, hidden.cols);
    for (size_t i = 0; i < r.residual.v.size(); ++i) r.residual.v[i] += residual->v[i];
    round_bf16_if(rnd.residual, r.residual);
  }
  r.x = Mat(hidden.rows, hidden.cols);
  if (rnd.norm && rnd.norm_before_weight) {
    const std::vector<double> ones(w.size(), 1.0);
    for (int64_t t = 0; t < hidden.rows; ++t) {
      std::span<double> x = r.x.row(t);
      rms_norm(r.residual.row(t), ones, eps, x);
      for (size_t i = 0; i < x.size(); ++i) x[i] = round_bf16(round_bf16(x[i]) * w[i]);
    }
    return r;
  }
  for (int64_t t = 0; t < hidden.rows; ++t) rms_norm(r.residual.row(t), w, eps, r.x.row(t));
  round_bf16_if(rnd.norm, r.x);
  return r;
}

// ---- KDA ----------------------------------------------------------------------------------------

double kda_alpha(double f, double dt_bias, double a_log, std::optional<double> lower_bound) {
  const double a = std::exp(a_log);
  if (lower_bound) return *lower_bound * sigmoid(a * (f + dt_bias));
  return -a * softplus(f + dt_bias, 1.0, 20.0);
}

double kda_conv_step(std::span<const double> history, double x_new, std::span<const double> w) {
  if (w.size() != history.size() + 1)
    fail(Errc::internal, "reference conv: {} taps for a history of {}", w.size(), history.size());
  double s = w.back() * x_new;
  for (size_t t = 0; t < history.size(); ++t) s += w[t] * history[t];
  return silu(s);
}

void l2_normalize(std::span<double> x, double eps, double scale) {
  double ss = 0;
  for (double e : x) ss += e * e;
  const double f = scale / std::sqrt(ss + eps);
  for (double& e : x) e *= f;
}

void kda_delta_step(std::span<double> S, std::span<const double> q, std::span<const double> k,
                    std::span<const double> v, std::span<const double> alpha, double beta, std::span<double> o) {
  const size_t dk = k.size(), dv = v.size();
  if (S.size() != dk * dv || q.size() != dk || alpha.size() != dk || o.size() != dv)
    fail(Errc::internal, "reference delta rule: inconsistent sizes");
  // Decay: row k of S (one key channel) scales by exp(alpha[k]).
  for (size_t a = 0; a < dk; ++a) {
    const double g = std::exp(alpha[a]);
    for (size_t b = 0; b < dv; ++b) S[a * dv + b] *= g;
  }
  // u = beta * (v - S^T k)
  std::vector<double> u(dv);
  for (size_t b = 0; b < dv; ++b) {
    double kv = 0;
    for (size_t a = 0; a < dk; ++a) kv += S[a * dv + b] * k[a];
    u[b] = beta * (v[b] - kv);
  }
  // S += k u^T
  for (size_t a = 0; a < dk; ++a)
    for (size_t b = 0; b < dv; ++b) S[a * dv + b] += k[a] * u[b];
  // o = S^T q
  for (size_t b = 0; b < dv; ++b) {
    double s = 0;
    for (size_t a = 0; a < dk; ++a) s += S[a * dv + b] * q[a];
    o[b] = s;
  }
}

void gated_rms_norm(std::span<const double> o, std::span<const double> g, std::span<const double> w, double eps,
                    std::span<double> out) {
  rms_norm(o, w, eps, out);
  for (size_t i = 0; i < out.size(); ++i) out[i] *= sigmoid(g[i]);
}

// ---- MoE ----------------------------------------------------------------------------------------

Routing route(std::span<const double> logits, std::span<const double> correction_bias, const model::MoeConfig& cfg) {
  const auto E = static_cast<int64_t>(logits.size());
  if (E != cfg.num_experts || (!correction_bias.empty() && static_cast<int64_t>(correction_bias.size()) != E))
    fail(Errc::internal, "reference router: {} logits, {} biases for {} experts", logits.size(), correction_bias.size(),
         cfg.num_experts);
  std::vector<double> s(static_cast<size_t>(E)), sel(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) {
    s[e] = sigmoid(logits[e]);
    sel[e] = s[e] + (correction_bias.empty() ? 0.0 : correction_bias[e]);
  }
  // Orders expert ids by decreasing score, the lower id first among equal scores.
  auto by_score = [](const std::vector<double>* score) {
    return [score](int64_t a, int64_t b) {
      const std::vector<double>& x = *score;
      return x[a] > x[b] || (x[a] == x[b] && a < b);
    };
  };
  std::vector<bool> allowed(static_cast<size_t>(E), true);
  const int64_t G = cfg.num_expert_group;
  if (G > 1) {
    if (E % G || cfg.topk_group < 1 || cfg.topk_group > G)
      fail(Errc::input, "reference router: {} experts in {} groups, topk_group {}", E, G, cfg.topk_group);
    const int64_t per = E / G;
    std::vector<double> gscore(static_cast<size_t>(G));
    for (int64_t g = 0; g < G; ++g) {
      std::vector<double> in(sel.begin() + g * per, sel.begin() + (g + 1) * per);
      std::sort(in.begin(), in.end(), std::greater<>());
      gscore[g] = in[0] + (per > 1 ? in[1] : 0.0);
    }
    std::vector<int64_t> gid(static_cast<size_t>(G));
    std::iota(gid.begin(), gid.end(), 0);
    std::stable_sort(gid.begin(), gid.end(), by_score(&gscore));
    std::fill(allowed.begin(), allowed.end(), false);
    for (int64_t i = 0; i < cfg.topk_group; ++i)
      for (int64_t e = gid[i] * per; e < (gid[i] + 1) * per; ++e) allowed[e] = true;
  }
  std::vector<int64_t> ids;
  for (int64_t e = 0; e < E; ++e)
    if (allowed[e]) ids.push_back(e);
  if (static_cast<int64_t>(ids.size()) < cfg.top_k)
    fail(Errc::input, "reference router: top_k {} exceeds the {} experts left after the group stage", cfg.top_k,
         ids.size());
  std::stable_sort(ids.begin(), ids.end(), by_score(&sel));
  Routing r;
  r.experts.assign(ids.begin(), ids.begin() + cfg.top_k);
  double sum = 0;
  for (int64_t e : r.experts) {
    r.weights.push_back(s[e]);
    sum += s[e];
  }
  if (cfg.renormalize)
    for (double& w : r.weights) w /= sum;
  return r;
}

// ---- K3 block attention residuals ----------------------------------------------------------------

void attn_res_mix(std::span<const std::span<const double>> blocks, std::span<const double> p,
                  std::span<const double> w_eff, double eps, std::span<double> out) {
  const size_t H = p.size();
  if (w_eff.size() != H || out.size() != H) fail(Errc::internal, "reference attn_res_mix: inconsistent sizes");
  if (blocks.empty()) {
    std::copy(p.begin(), p.end(), out.begin());
    return;
  }
  auto logit = [&](std::span<const double> x) {
    double ss = 0, dot = 0;
    for (size_t i = 0; i < H; ++i) ss += x[i] * x[i], dot += x[i] * w_eff[i];
    return dot / std::sqrt(ss / static_cast<double>(H) + eps);
  };
  std::vector<double> l;
  for (std::span<const double> b : blocks) l.push_back(logit(b));
  l.push_back(logit(p));
  const double mx = *std::max_element(l.begin(), l.end());
  double z = 0;
  for (double& e : l) z += (e = std::exp(e - mx));
  std::fill(out.begin(), out.end(), 0.0);
  for (size_t k = 0; k <= blocks.size(); ++k) {
    std::span<const double> x = k < blocks.size() ? blocks[k] : p;
    const double pi = l[k] / z;
    for (size_t i = 0; i < H; ++i) out[i] += pi * x[i];
  }
}

AddNorm attn_res_add_norm(const Mat& hidden, const Mat* residual, std::vector<Mat>& blocks, bool push,
                          std::span<const double> res_norm, std::span<const double> res_proj,
                          std::span<const double> weight, double eps, const Rounding& rnd) {
  const int64_t T = hidden.rows, H = hidden.cols;
  if (res_norm.size() != static_cast<size_t>(H) || res_proj.size() != static_cast<size_t>(H) ||
      weight.size() != static_cast<size_t>(H))
    fail(Errc::input, "reference attn_res_add_norm: weights of {}, {} and {} elements for rows of {}", res_norm.size(),
         res_proj.size(), weight.size(), H);
  for (size_t k = 0; k < blocks.size(); ++k)
    if (blocks[k].rows != T || blocks[k].cols != H)
      fail(Errc::input, "reference attn_res_add_norm: block {} is [{}, {}], hidden_states [{}, {}]", k, blocks[k].rows,
           blocks[k].cols, T, H);
  // p: the fused add without a norm (fused_add_rms_norm's residual half).
  Mat p = hidden;
  if (residual) {
    if (residual->rows != T || residual->cols != H)
      fail(Errc::input, "reference: residual is [{}, {}], hidden_states [{}, {}]", residual->rows, residual->cols, T, H);
    for (size_t i = 0; i < p.v.size(); ++i) p.v[i] += residual->v[i];
    round_bf16_if(rnd.residual, p);
  }
  std::vector<double> w_eff(static_cast<size_t>(H));
  for (int64_t i = 0; i < H; ++i) w_eff[i] = res_norm[i] * res_proj[i];
  Mat h(T, H);
  std::vector<std::span<const double>> rows(blocks.size());
  for (int64_t t = 0; t < T; ++t) {
    for (size_t k = 0; k < blocks.size(); ++k) rows[k] = std::as_const(blocks[k]).row(t);
    attn_res_mix(rows, std::as_const(p).row(t), w_eff, eps, h.row(t));
  }
  round_bf16_if(rnd.attn_res, h);
  AddNorm r = fused_add_rms_norm(h, nullptr, weight, eps, rnd);  // no residual: the norm of h alone
  if (push) {
    blocks.push_back(std::move(p));
    r.residual = Mat(T, H);
  } else {
    r.residual = std::move(p);
  }
  return r;
}

}  // namespace dp::ref
