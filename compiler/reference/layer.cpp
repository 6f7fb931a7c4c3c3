#include "reference/layer.h"

#include <algorithm>
#include <cmath>
#include <exception>
#include <limits>
#include <thread>

#include "common/error.h"
#include "common/parallel.h"
#include "reference/numeric.h"

namespace dp::ref {

using model::Model;

// ---- metadata and state containers ----------------------------------------------------------------

StepMeta StepMeta::simple(int64_t num_requests, int64_t q, const std::vector<int64_t>& seq_lens, int64_t block_size,
                          int64_t blocks_per_request, int64_t first_block, int64_t kda_slot_base) {
  if (static_cast<int64_t>(seq_lens.size()) != num_requests)
    fail(Errc::internal, "StepMeta::simple: {} sequence lengths for {} requests", seq_lens.size(), num_requests);
  StepMeta m;
  m.num_requests = num_requests;
  m.q = q;
  m.seq_lens = seq_lens;
  for (int64_t r = 0; r < num_requests; ++r) {
    std::vector<int64_t> slots, blocks;
    for (int64_t i = 0; i < q; ++i) slots.push_back(kda_slot_base + r * q + i);
    for (int64_t b = 0; b < blocks_per_request; ++b) blocks.push_back(first_block + r * blocks_per_request + b);
    m.kda_slots.push_back(slots);
    m.block_table.push_back(blocks);
    m.num_accepted.push_back(1);
    for (int64_t i = 0; i < q; ++i) {
      const int64_t pos = seq_lens[r] - q + i;
      if (pos < 0 || pos / block_size >= blocks_per_request) {
        m.slot_mapping.push_back(kPadSlotId);
        continue;
      }
      m.slot_mapping.push_back(blocks[pos / block_size] * block_size + pos % block_size);
    }
  }
  return m;
}

KdaState KdaState::zeros(const Model& m, Shard shard, int64_t num_slots, int64_t conv_width) {
  if (m.kda.num_heads % shard.tp)
    fail(Errc::input, "reference: KDA heads {} do not divide by tensor_parallel {}", m.kda.num_heads, shard.tp);
  KdaState s;
  s.num_slots = num_slots;
  s.heads = m.kda.num_heads / shard.tp;
  s.head_dim = m.kda.head_dim;
  s.conv_dim = s.heads * s.head_dim;
  s.conv_width = conv_width;
  s.recurrent.assign(static_cast<size_t>(num_slots * s.heads * s.head_dim * s.head_dim), 0.0);
  for (auto* c : {&s.conv_q, &s.conv_k, &s.conv_v})
    c->assign(static_cast<size_t>(num_slots * s.conv_dim * conv_width), 0.0);
  return s;
}

int64_t KdaState::conv_width_for(const Model& m, ConvSpecLayout layout, int64_t q) {
  return layout == ConvSpecLayout::window ? m.kda.conv_kernel - 2 + q : m.kda.conv_kernel - 1;
}

std::span<double> KdaState::slot_state(int64_t slot, int64_t head) {
  if (slot < 0 || slot >= num_slots || head < 0 || head >= heads)
    fail(Errc::input, "reference: KDA state slot {} head {} out of range ({} slots, {} heads)", slot, head, num_slots,
         heads);
  const int64_t n = head_dim * head_dim;
  return {recurrent.data() + (slot * heads + head) * n, static_cast<size_t>(n)};
}

std::span<double> KdaState::conv(int which, int64_t slot, int64_t channel) {
  if (slot < 0 || slot >= num_slots || channel < 0 || channel >= conv_dim || which < 0 || which > 2)
    fail(Errc::input, "reference: KDA conv state slot {} channel {} out of range ({} slots, {} channels)", slot,
         channel, num_slots, conv_dim);
  std::vector<double>& v = which == 0 ? conv_q : which == 1 ? conv_k : conv_v;
  return {v.data() + (slot * conv_dim + channel) * conv_width, static_cast<size_t>(conv_width)};
}

MlaCache MlaCache::zeros(const Model& m, int64_t num_blocks, int64_t block_size) {
  MlaCache c;
  c.num_blocks = num_blocks;
  c.block_size = block_size;
  c.row = m.mla.cache_row();
  c.data.assign(static_cast<size_t>(num_blocks * block_size * c.row), 0.0);
  return c;
}

std::span<double> MlaCache::slot(int64_t s) {
  if (s < 0 || s >= num_blocks * block_size)
    fail(Errc::input, "reference: MLA cache slot {} out of range ({} blocks x {})", s, num_blocks, block_size);
  return {data.data() + s * row, static_cast<size_t>(row)};
}

const Mat& Trace::at(const std::string& name) const {
  auto it = t.find(name);
  if (it == t.end()) fail(Errc::internal, "reference trace has no entry \"{}\"", name);
  return it->second;
}

// ---- helpers ---------------------------------------------------------------------------------------

namespace {

// y = W x for one row: W [out, in].
std::vector<double> gemv(const Tensor& w, std::span<const double> x) {
  if (w.cols() != static_cast<int64_t>(x.size()))
    fail(Errc::internal, "reference gemv: weight [{}, {}] for an input of {}", w.rows(), w.cols(), x.size());
  std::vector<double> y(static_cast<size_t>(w.rows()));
  for (int64_t o = 0; o < w.rows(); ++o) {
    const double* wr = w.data.data() + o * w.cols();
    double s = 0;
    for (size_t i = 0; i < x.size(); ++i) s += wr[i] * x[i];
    y[o] = s;
  }
  return y;
}

Mat linear_r(const Mat& x, const Tensor& w, const Rounding& r) {
  Mat y = linear(x, w);
  round_bf16_if(r.linear, y);
  return y;
}

double act(const Model& m, double gate, double up) {
  return m.activation == model::Activation::silu ? silu(gate) * up : situ(gate, up, m.situ_beta, m.situ_linear_beta);
}

double mla_eps(const Model& m, const Options& opt) { return opt.mla_norm_eps.value_or(m.rms_norm_eps); }

// Gate/up/down MLP under `prefix` ("mlp." or "block_sparse_moe.shared_experts."): [T, H] partial.
Mat gated_mlp(const LayerWeights& w, const std::string& prefix, const Mat& x, const Options& opt) {
  const Rounding& R = opt.rounding;
  Mat g = linear_r(x, w.get(prefix + "gate_proj.weight"), R);
  Mat u = linear_r(x, w.get(prefix + "up_proj.weight"), R);
  for (size_t i = 0; i < g.v.size(); ++i) g.v[i] = act(w.model(), g.v[i], u.v[i]);
  round_bf16_if(R.act, g);
  return linear_r(g, w.get(prefix + "down_proj.weight"), R);
}

// Routed experts of a MoE layer: router on `x`, experts applied to `xe` (x itself, or the K3 latent).
// Returns [T, D] = routed_scaling * sum_i w_i E_i(xe), the rank's partial (experts' intermediates are
// sharded).
Mat routed_experts(const LayerWeights& w, const Mat& x, const Mat& xe, const Options& opt, Trace* trace) {
  const Model& m = w.model();
  const Rounding& R = opt.rounding;
  Mat logits = linear(x, w.get("block_sparse_moe.gate.weight"));  // [T, E], fp32 in vLLM
  round_bf16_if(R.router_logits, logits);
  const Tensor& bias = w.get("block_sparse_moe.gate.e_score_correction_bias");
  const int64_t k = m.moe.top_k, T = x.rows, D = xe.cols;
  Mat ids(T, k), wts(T, k);
  // Route every row, then stream each chosen expert once over the rows that chose it.
  std::map<int64_t, std::vector<std::pair<int64_t, int64_t>>> users;  // expert -> (row, top-k position)
  for (int64_t t = 0; t < T; ++t) {
    const Routing rt = route(logits.row(t), bias.data, m.moe);
    for (int64_t i = 0; i < k; ++i) {
      ids(t, i) = static_cast<double>(rt.experts[i]);
      wts(t, i) = rt.weights[i];
      users[rt.experts[i]].push_back({t, i});
    }
  }
  std::vector<std::vector<double>> y(static_cast<size_t>(T * k));  // w_i * E_i(xe_t), per (row, position)
  // The chosen experts on threads of their own: loading one (its three matrices decoded or generated,
  // and dequantised, into doubles) is most of the reference's time at the 48B shape, and every (row,
  // position) has its own slot of y, so the result does not depend on the threads. The keys looked up
  // are recorded in expert order, and the first failing expert's error (in that order) is thrown.
  const std::vector<std::pair<int64_t, std::vector<std::pair<int64_t, int64_t>>>> work(users.begin(), users.end());
  std::vector<std::vector<std::string>> keys(work.size());
  std::vector<std::exception_ptr> errors(work.size());
  auto apply = [&](size_t n) {
    const auto& [e, rows] = work[n];
    std::vector<std::string>* kn = &keys[n];
    const Tensor w1 = w.expert(e, "w1", kn), w3 = w.expert(e, "w3", kn), w2 = w.expert(e, "w2", kn);
    for (const auto& [t, i] : rows) {
      std::vector<double> g = gemv(w1, xe.row(t));  // [I/tp]
      std::vector<double> u = gemv(w3, xe.row(t));
      round_bf16_if(R.linear, g);
      round_bf16_if(R.linear, u);
      for (size_t j = 0; j < g.size(); ++j) g[j] = act(m, g[j], u[j]);
      round_bf16_if(R.act, g);
      std::vector<double> ye = gemv(w2, g);  // [D]
      for (double& v : ye) v *= wts(t, i);
      round_bf16_if(R.moe_weighted, ye);
      y[static_cast<size_t>(t * k + i)] = std::move(ye);
    }
  };
  parallel_for(work.size(), std::clamp(std::thread::hardware_concurrency(), 1u, 32u), [&](size_t n) {
    try {
      apply(n);
    } catch (...) {
      errors[n] = std::current_exception();
    }
  });
  for (size_t n = 0; n < work.size(); ++n) {
    if (errors[n]) std::rethrow_exception(errors[n]);
    w.note_lookups(keys[n]);
  }
  // Sum over the top-k in routing order, then the routed scaling factor.
  Mat out(T, D);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> acc(static_cast<size_t>(D), 0.0);
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < D; ++j) acc[j] += y[static_cast<size_t>(t * k + i)][j];
    round_bf16_if(R.moe_sum, acc);
    for (double& v : acc) v *= m.moe.routed_scaling;
    round_bf16_if(R.moe_sum, acc);
    std::copy(acc.begin(), acc.end(), out.row(t).begin());
  }
  if (trace) {
    trace->put("router_logits", logits);
    trace->put("topk_ids", ids);
    trace->put("topk_weights", wts);
    trace->put("routed", out);
  }
  return out;
}

// The all-reduce: sum of the ranks' partials, rounded once (Rounding::ffn_out).
Mat all_reduce(const std::vector<Mat>& parts, const Rounding& R) {
  Mat s = parts.at(0);
  for (size_t i = 1; i < parts.size(); ++i)
    for (size_t j = 0; j < s.v.size(); ++j) s.v[j] += parts[i].v[j];
  round_bf16_if(R.ffn_out, s);
  return s;
}

Mat add_r(const Mat& a, const Mat& b, bool round) {
  Mat s = a;
  for (size_t j = 0; j < s.v.size(); ++j) s.v[j] += b.v[j];
  round_bf16_if(round, s);
  return s;
}

void check_rows(const Mat& x, const StepMeta& meta, int64_t H, const char* what) {
  if (meta.num_requests < 0 || meta.q < 1)
    fail(Errc::input, "reference step: {} requests x q {} is not a decode step", meta.num_requests, meta.q);
  if (x.rows != meta.rows() || x.cols != H)
    fail(Errc::input, "reference {}: input is [{}, {}], expected [W*q = {}, {}]", what, x.rows, x.cols, meta.rows(), H);
}

}  // namespace

// ---- KDA ------------------------------------------------------------------------------------------

Mat kda_mixer(const LayerWeights& w, const Mat& x, const StepMeta& meta, KdaState& st, const Options& opt,
              Trace* trace) {
  const Model& m = w.model();
  const model::KdaConfig& kc = m.kda;
  const Rounding& R = opt.rounding;
  if (w.spec().mixer != model::Mixer::kda) fail(Errc::input, "reference: layer {} is not a KDA layer", w.layer());
  check_rows(x, meta, m.hidden, "KDA mixer");
  const Shard sh = w.shard();
  const int64_t h = kc.num_heads / sh.tp, d = kc.head_dim, P = h * d, K = kc.conv_kernel, T = x.rows, q = meta.q;
  const bool window = opt.conv_spec == ConvSpecLayout::window;
  const int64_t width = KdaState::conv_width_for(m, opt.conv_spec, q);
  if (st.heads != h || st.head_dim != d || st.conv_dim != P || st.conv_width != width)
    fail(Errc::input,
         "reference KDA state: heads {} head_dim {} conv_dim {} conv_width {}, expected {} {} {} {} (layout {})",
         st.heads, st.head_dim, st.conv_dim, st.conv_width, h, d, P, width, window ? "window" : "per_slot");
  if (static_cast<int64_t>(meta.kda_slots.size()) != meta.num_requests ||
      static_cast<int64_t>(meta.num_accepted.size()) != meta.num_requests)
    fail(Errc::input, "reference KDA step: {} slot rows and {} accepted counts for {} requests", meta.kda_slots.size(),
         meta.num_accepted.size(), meta.num_requests);

  // 1. Projections (bf16 GEMMs) and gates.
  Mat q0 = linear_r(x, w.get("self_attn.q_proj.weight"), R);  // [T, P]
  Mat k0 = linear_r(x, w.get("self_attn.k_proj.weight"), R);  // [T, P]
  Mat v0 = linear_r(x, w.get("self_attn.v_proj.weight"), R);  // [T, P]
  Mat f = linear_r(linear_r(x, w.get("self_attn.f_a_proj.weight"), R), w.get("self_attn.f_b_proj.weight"), R);
  Mat b = linear_r(x, w.get("self_attn.b_proj.weight"), R);  // [T, h] beta logits
  Mat g = kc.full_rank_gate
              ? linear_r(x, w.get("self_attn.g_proj.weight"), R)
              : linear_r(linear_r(x, w.get("self_attn.g_a_proj.weight"), R), w.get("self_attn.g_b_proj.weight"), R);
  const Tensor* convw[3] = {&w.get("self_attn.q_conv1d.weight"), &w.get("self_attn.k_conv1d.weight"),
                            &w.get("self_attn.v_conv1d.weight")};  // [P, 1, K] each
  const Tensor& dt_bias = w.get("self_attn.dt_bias");              // [P]
  const Tensor& a_log = w.get("self_attn.A_log");                  // [1,1,h,1] sharded, or K3 [a_log_size]
  const bool a_log_sharded = find_weight(m, w.layer(), "self_attn.A_log").split.kind != model::Split::Kind::replicated;
  auto a_log_of = [&](int64_t j) { return a_log.data.at(static_cast<size_t>(a_log_sharded ? j : sh.rank * h + j)); };
  const Tensor& onorm = w.get("self_attn.o_norm.weight");  // [d]
  const Mat* pre[3] = {&q0, &k0, &v0};

  Mat conv_out[3] = {Mat(T, P), Mat(T, P), Mat(T, P)};
  Mat alpha(T, P), beta(T, h), o_all(T, P), o_gated(T, P);
  const double qscale = 1.0 / std::sqrt(static_cast<double>(d));

  for (int64_t r = 0; r < meta.num_requests; ++r) {
    const std::vector<int64_t>& slots = meta.kda_slots[r];
    const int64_t acc = meta.num_accepted[r];
    if (slots.empty()) fail(Errc::input, "reference KDA step: request {} has no state slot", r);
    if (slots[0] == kNullBlockId) continue;  // padded: read and write nothing, zero output rows
    if (acc < 1 || acc > q) fail(Errc::input, "reference KDA step: request {} num_accepted {} not in 1..{}", r, acc, q);
    if (static_cast<int64_t>(slots.size()) < q && (q > 1))
      fail(Errc::input, "reference KDA step: request {} has {} state slots, spec decode needs q = {}", r, slots.size(),
           q);
    const int64_t read_slot = slots[acc - 1];
    if (read_slot == kNullBlockId)
      fail(Errc::input, "reference KDA step: request {} reads its state from slot 0 (NULL_BLOCK_ID) at position {}", r,
           acc - 1);

    // Histories of the three convs, per channel, as read at the start of the step.
    std::vector<std::vector<double>> hist[3];
    std::vector<std::vector<double>> old_window[3];
    for (int c3 = 0; c3 < 3; ++c3) {
      hist[c3].resize(static_cast<size_t>(P));
      if (window) old_window[c3].resize(static_cast<size_t>(P));
      for (int64_t c = 0; c < P; ++c) {
        if (window) {
          std::span<double> s = st.conv(c3, slots[0], c);
          old_window[c3][c].assign(s.begin(), s.end());
          hist[c3][c].assign(s.begin() + (acc - 1), s.begin() + (acc - 1) + (K - 1));
        } else {
          std::span<double> s = st.conv(c3, read_slot, c);
          hist[c3][c].assign(s.begin(), s.end());
        }
      }
    }
    // Running recurrent state per head, from slot num_accepted-1.
    std::vector<std::vector<double>> S(static_cast<size_t>(h));
    for (int64_t j = 0; j < h; ++j) {
      std::span<double> s = st.slot_state(read_slot, j);
      S[j].assign(s.begin(), s.end());
    }

    for (int64_t i = 0; i < q; ++i) {
      const int64_t t = r * q + i;
      const int64_t write_slot = static_cast<int64_t>(slots.size()) > i ? slots[i] : kNullBlockId;
      // 3. Short causal conv + SiLU, then shift the history.
      for (int c3 = 0; c3 < 3; ++c3) {
        for (int64_t c = 0; c < P; ++c) {
          std::vector<double>& hc = hist[c3][c];
          const double xn = (*pre[c3])(t, c);
          std::span<const double> taps(convw[c3]->data.data() + c * K, static_cast<size_t>(K));
          double y = kda_conv_step(hc, xn, taps);
          conv_out[c3](t, c) = R.conv ? round_bf16(y) : y;
          hc.erase(hc.begin());
          hc.push_back(R.cache ? round_bf16(xn) : xn);
          if (!window && write_slot != kNullBlockId) {
            std::span<double> dst = st.conv(c3, write_slot, c);
            std::copy(hc.begin(), hc.end(), dst.begin());
          }
        }
      }
      // 2, 4, 5, 6. Gates, L2 norm, delta rule, gated RMSNorm, per head.
      for (int64_t j = 0; j < h; ++j) {
        std::vector<double> qv(conv_out[0].row(t).begin() + j * d, conv_out[0].row(t).begin() + (j + 1) * d);
        std::vector<double> kv(conv_out[1].row(t).begin() + j * d, conv_out[1].row(t).begin() + (j + 1) * d);
        std::vector<double> vv(conv_out[2].row(t).begin() + j * d, conv_out[2].row(t).begin() + (j + 1) * d);
        l2_normalize(qv, opt.l2norm_eps, qscale);
        l2_normalize(kv, opt.l2norm_eps, 1.0);
        std::vector<double> al(static_cast<size_t>(d));
        for (int64_t c = 0; c < d; ++c) {
          const int64_t ch = j * d + c;
          al[c] = kda_alpha(f(t, ch), dt_bias.data[ch], a_log_of(j), kc.gate_lower_bound);
          alpha(t, ch) = al[c];
        }
        const double bt = sigmoid(b(t, j));
        beta(t, j) = bt;
        std::vector<double> o(static_cast<size_t>(d));
        kda_delta_step(S[j], qv, kv, vv, al, bt, o);
        if (R.kda_state)
          for (double& e : S[j]) e = round_fp32(e);
        if (write_slot != kNullBlockId) {
          std::span<double> dst = st.slot_state(write_slot, j);
          std::copy(S[j].begin(), S[j].end(), dst.begin());
        }
        round_bf16_if(R.kda_out, o);
        std::copy(o.begin(), o.end(), o_all.row(t).begin() + j * d);
        std::span<const double> gh(g.row(t).data() + j * d, static_cast<size_t>(d));
        std::span<double> og(o_gated.row(t).data() + j * d, static_cast<size_t>(d));
        gated_rms_norm(o, gh, onorm.data, opt.kda_onorm_eps, og);
        round_bf16_if(R.gated_norm, og);
      }
    }
    // GDN-style window: [old[off+1 .. off+K-2], x_0 .. x_{q-1}] back into slot 0 of the request.
    if (window) {
      const int64_t off = acc - 1;
      for (int c3 = 0; c3 < 3; ++c3) {
        for (int64_t c = 0; c < P; ++c) {
          std::span<double> dst = st.conv(c3, slots[0], c);
          int64_t n = 0;
          for (int64_t s = off + 1; s < off + K - 1; ++s) dst[n++] = old_window[c3][c][s];
          for (int64_t i = 0; i < q; ++i) {
            const double xn = (*pre[c3])(r * q + i, c);
            dst[n++] = R.cache ? round_bf16(xn) : xn;
          }
        }
      }
    }
  }
  // 7. o_proj (row-parallel: the rank's partial sum).
  Mat out = linear_r(o_gated, w.get("self_attn.o_proj.weight"), R);
  if (trace) {
    trace->put("q", q0);
    trace->put("k", k0);
    trace->put("v", v0);
    trace->put("f", f);
    trace->put("g", g);
    trace->put("q_conv", conv_out[0]);
    trace->put("k_conv", conv_out[1]);
    trace->put("v_conv", conv_out[2]);
    trace->put("alpha", alpha);
    trace->put("beta", beta);
    trace->put("o", o_all);
    trace->put("o_gated", o_gated);
  }
  return out;
}

// ---- MLA ------------------------------------------------------------------------------------------

Mat mla_mixer(const LayerWeights& w, const Mat& x, const StepMeta& meta, MlaCache& cache, const Options& opt,
              Trace* trace) {
  const Model& m = w.model();
  const model::MlaConfig& a = m.mla;
  const Rounding& R = opt.rounding;
  if (w.spec().mixer != model::Mixer::mla) fail(Errc::input, "reference: layer {} is not an MLA layer", w.layer());
  check_rows(x, meta, m.hidden, "MLA mixer");
  const Shard sh = w.shard();
  if (a.num_heads % sh.tp)
    fail(Errc::input, "reference: MLA heads {} do not divide by tensor_parallel {}", a.num_heads, sh.tp);
  const int64_t N = a.num_heads / sh.tp, Pn = a.qk_nope_head_dim, Rp = a.qk_rope_head_dim, V = a.v_head_dim,
                L = a.kv_lora_rank, Dq = Pn + Rp, T = x.rows, q = meta.q;
  if (cache.row != L + Rp)
    fail(Errc::input, "reference MLA cache rows hold {} values, expected L + R = {}", cache.row, L + Rp);
  if (static_cast<int64_t>(meta.seq_lens.size()) != meta.num_requests ||
      static_cast<int64_t>(meta.block_table.size()) != meta.num_requests ||
      static_cast<int64_t>(meta.slot_mapping.size()) != T)
    fail(Errc::input, "reference MLA step: {} seq_lens, {} block-table rows, {} slot_mapping entries for {} x {} rows",
         meta.seq_lens.size(), meta.block_table.size(), meta.slot_mapping.size(), meta.num_requests, q);
  const double eps = mla_eps(m, opt);

  // 1. q: [T, N*(Pn+R)], per head [nope | "rope"] (no rotation: NoPE).
  Mat qf;
  if (a.q_lora_rank > 0) {
    Mat qa = linear_r(x, w.get("self_attn.q_a_proj.weight"), R);
    Mat qn(T, qa.cols);
    const Tensor& lnw = w.get("self_attn.q_a_layernorm.weight");
    for (int64_t t = 0; t < T; ++t) rms_norm(qa.row(t), lnw.data, eps, qn.row(t));
    round_bf16_if(R.norm, qn);
    qf = linear_r(qn, w.get("self_attn.q_b_proj.weight"), R);
  } else {
    qf = linear_r(x, w.get("self_attn.q_proj.weight"), R);
  }
  // 2. kv = [c | k_pe]; c <- RMSNorm(c) * w.
  Mat kv = linear_r(x, w.get("self_attn.kv_a_proj_with_mqa.weight"), R);  // [T, L+R]
  Mat c(T, L);
  const Tensor& kvln = w.get("self_attn.kv_a_layernorm.weight");
  for (int64_t t = 0; t < T; ++t) rms_norm(kv.row(t).subspan(0, static_cast<size_t>(L)), kvln.data, eps, c.row(t));
  round_bf16_if(R.norm, c);

  // 4. Cache write, for every row before any attention.
  auto slot_of = [&](int64_t r, int64_t pos) {
    const std::vector<int64_t>& bt = meta.block_table[r];
    const int64_t blk = pos / cache.block_size;
    if (blk >= static_cast<int64_t>(bt.size()))
      fail(Errc::input, "reference MLA step: request {} position {} needs block-table entry {}, the row has {}", r, pos,
           blk, bt.size());
    if (bt[blk] < 0 || bt[blk] >= cache.num_blocks)
      fail(Errc::input, "reference MLA step: request {} block {} is {}, the cache has {} blocks", r, blk, bt[blk],
           cache.num_blocks);
    return bt[blk] * cache.block_size + pos % cache.block_size;
  };
  for (int64_t r = 0; r < meta.num_requests; ++r) {
    const int64_t len = meta.seq_lens[r];
    if (len == 0) continue;  // padded request
    if (len < q) fail(Errc::input, "reference MLA step: request {} has seq_len {} < q = {}", r, len, q);
    for (int64_t i = 0; i < q; ++i) {
      const int64_t t = r * q + i, s = meta.slot_mapping[t];
      if (s == kPadSlotId) continue;
      const int64_t expect = slot_of(r, len - q + i);
      if (s != expect)
        fail(Errc::input, "reference MLA step: slot_mapping[{}] is {}, but the block table puts position {} at slot {}",
             t, s, len - q + i, expect);
      std::span<double> dst = cache.slot(s);
      for (int64_t l = 0; l < L; ++l) dst[l] = c(t, l);
      for (int64_t e = 0; e < Rp; ++e) dst[L + e] = kv(t, L + e);
      round_bf16_if(R.cache, dst);
    }
  }

  // Absorbed attention. kv_b_proj [N*(Pn+V), L]: row n*(Pn+V)+j is W_UK_T[n][j][:] for j < Pn and
  // W_UV[n][:][j-Pn] for j >= Pn (kv_b_proj^T reshaped to (L, N, Pn+V)).
  const Tensor& kvb = w.get("self_attn.kv_b_proj.weight");
  auto kvb_row = [&](int64_t n, int64_t j) { return kvb.data.data() + (n * (Pn + V) + j) * L; };
  Mat gate;
  if (a.output_gate) gate = linear_r(x, w.get("self_attn.g_proj.weight"), R);  // [T, N*V]
  const double scale = 1.0 / std::sqrt(static_cast<double>(Dq));
  Mat ql_all(T, N * L), olat_all(T, N * L), o_heads(T, N * V);
  for (int64_t r = 0; r < meta.num_requests; ++r) {
    const int64_t len = meta.seq_lens[r];
    if (len == 0) continue;
    // Cached latent rows of positions 0..len-1 (the request's context, including the new tokens).
    std::vector<std::span<double>> ctx;
    for (int64_t p = 0; p < len; ++p) ctx.push_back(cache.slot(slot_of(r, p)));
    for (int64_t i = 0; i < q; ++i) {
      const int64_t t = r * q + i, pos = len - q + i;
      for (int64_t n = 0; n < N; ++n) {
        const double* qn = &qf(t, n * Dq);
        // ql = q_nope . W_UK_T[n]: [Pn] -> [L].
        std::vector<double> ql(static_cast<size_t>(L), 0.0);
        for (int64_t j = 0; j < Pn; ++j) {
          const double* wr = kvb_row(n, j);
          for (int64_t l = 0; l < L; ++l) ql[l] += qn[j] * wr[l];
        }
        round_bf16_if(R.mla_q_absorbed, ql);
        // Scores over positions 0..pos, softmax, o_lat = sum p_t c_t.
        std::vector<double> s(static_cast<size_t>(pos + 1));
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t p = 0; p <= pos; ++p) {
          double dot = 0;
          for (int64_t l = 0; l < L; ++l) dot += ql[l] * ctx[p][l];
          for (int64_t e = 0; e < Rp; ++e) dot += qn[Pn + e] * ctx[p][L + e];
          s[p] = scale * dot;
          mx = std::max(mx, s[p]);
        }
        double z = 0;
        for (double& e : s) z += (e = std::exp(e - mx));
        std::vector<double> ol(static_cast<size_t>(L), 0.0);
        for (int64_t p = 0; p <= pos; ++p)
          for (int64_t l = 0; l < L; ++l) ol[l] += s[p] / z * ctx[p][l];
        round_bf16_if(R.mla_attn_out, ol);
        // o = o_lat . W_UV[n]: [L] -> [V].
        std::vector<double> o(static_cast<size_t>(V));
        for (int64_t v = 0; v < V; ++v) {
          const double* wr = kvb_row(n, Pn + v);
          double acc = 0;
          for (int64_t l = 0; l < L; ++l) acc += ol[l] * wr[l];
          o[v] = acc;
        }
        round_bf16_if(R.mla_v_up, o);
        std::copy(ql.begin(), ql.end(), ql_all.row(t).begin() + n * L);
        std::copy(ol.begin(), ol.end(), olat_all.row(t).begin() + n * L);
        std::copy(o.begin(), o.end(), o_heads.row(t).begin() + n * V);
      }
      if (a.output_gate) {
        for (int64_t e = 0; e < N * V; ++e) o_heads(t, e) *= sigmoid(gate(t, e));
        round_bf16_if(R.mla_gate, o_heads.row(t));
      }
    }
  }
  Mat out = linear_r(o_heads, w.get("self_attn.o_proj.weight"), R);
  if (trace) {
    trace->put("q", qf);
    trace->put("kv", kv);
    trace->put("c", c);
    trace->put("ql", ql_all);
    trace->put("o_lat", olat_all);
    trace->put("o_heads", o_heads);
    if (a.output_gate) trace->put("mla_gate", gate);
  }
  return out;
}

// ---- FFN ------------------------------------------------------------------------------------------

Mat dense_mlp(const LayerWeights& w, const Mat& x, const Options& opt, Trace* trace) {
  if (w.spec().ffn != model::Ffn::dense) fail(Errc::input, "reference: layer {} has no dense MLP", w.layer());
  return gated_mlp(w, "mlp.", x, opt);
}

Mat moe(const LayerWeights& w, const Mat& x, const Options& opt, Trace* trace) {
  if (w.spec().ffn != model::Ffn::moe)
    fail(Errc::input, "reference: layer {} is not a (non-latent) MoE layer: use ffn()", w.layer());
  Mat routed = routed_experts(w, x, x, opt, trace);
  if (w.model().moe.num_shared == 0) return routed;
  Mat shared = gated_mlp(w, "block_sparse_moe.shared_experts.", x, opt);
  if (trace) trace->put("shared", shared);
  return add_r(routed, shared, opt.rounding.ffn_out);
}

Mat ffn(std::span<const LayerWeights* const> ranks, const Mat& x, const Options& opt, Trace* trace) {
  if (ranks.empty()) fail(Errc::internal, "reference ffn: no ranks");
  const LayerWeights& w0 = *ranks[0];
  const Model& m = w0.model();
  const Rounding& R = opt.rounding;
  std::vector<Mat> parts;
  switch (w0.spec().ffn) {
    case model::Ffn::dense:
      for (const LayerWeights* w : ranks) parts.push_back(dense_mlp(*w, x, opt, trace));
      return all_reduce(parts, R);
    case model::Ffn::moe:
      for (const LayerWeights* w : ranks) parts.push_back(moe(*w, x, opt, trace));
      return all_reduce(parts, R);
    case model::Ffn::latent_moe: {
      Mat lat = linear_r(x, w0.get("block_sparse_moe.routed_expert_down_proj.weight"), R);  // [T, D] replicated
      for (const LayerWeights* w : ranks) parts.push_back(routed_experts(*w, x, lat, opt, trace));
      Mat routed = all_reduce(parts, R);  // [T, D]
      if (m.moe.latent_norm) {
        const Tensor& nw = w0.get("block_sparse_moe.routed_expert_norm.weight");
        Mat n(routed.rows, routed.cols);
        for (int64_t t = 0; t < routed.rows; ++t) rms_norm(routed.row(t), nw.data, m.rms_norm_eps, n.row(t));
        round_bf16_if(R.norm, n);
        routed = n;
      }
      Mat up = linear_r(routed, w0.get("block_sparse_moe.routed_expert_up_proj.weight"), R);  // [T, H]
      if (m.moe.num_shared == 0) return up;
      std::vector<Mat> sparts;
      for (const LayerWeights* w : ranks) sparts.push_back(gated_mlp(*w, "block_sparse_moe.shared_experts.", x, opt));
      Mat shared = all_reduce(sparts, R);
      if (trace) {
        trace->put("latent", lat);
        trace->put("latent_up", up);
        trace->put("shared", shared);
      }
      return add_r(up, shared, R.ffn_out);
    }
  }
  fail(Errc::internal, "reference ffn: unknown FFN kind");
}

Mat post_attention_ffn(std::span<const LayerWeights* const> ranks, const Mat& residual, const Options& opt,
                       Trace* trace, const AttnResState* attn_res) {
  if (ranks.empty()) fail(Errc::internal, "reference post_attention_ffn: no ranks");
  const LayerWeights& w0 = *ranks[0];
  const Model& m = w0.model();
  if (residual.cols != m.hidden)
    fail(Errc::input, "reference post_attention_ffn: residual is [{}, {}], expected [T, {}]", residual.rows,
         residual.cols, m.hidden);
  const int64_t B = m.attn_res_block;
  if ((B > 0) != (attn_res != nullptr))
    fail(Errc::input, "reference post_attention_ffn: layer {}: {}", w0.layer(),
         B > 0 ? "the model has block attention residuals: pass the step's AttnResState after the layer"
               : "an AttnResState for a model without block attention residuals");
  if (B > 0 && static_cast<int64_t>(attn_res->blocks.size()) != attn_res_blocks(w0.layer() + 1, B))
    fail(Errc::input, "reference post_attention_ffn: layer {}'s second mix sees {} stored blocks, the state holds {}",
         w0.layer(), attn_res_blocks(w0.layer() + 1, B), attn_res->blocks.size());
  // The residual is already the bf16 sum, so the add of the fused add + norm is left out (no residual
  // argument): the norm (K3: the mix and the norm) is the one decoder_layer_tp applies to it.
  AddNorm post;
  if (B == 0) {
    post = fused_add_rms_norm(residual, nullptr, w0.get("post_attention_layernorm.weight").data, m.rms_norm_eps,
                              opt.rounding);
  } else {
    std::vector<Mat> blocks = attn_res->blocks;
    post = attn_res_add_norm(residual, nullptr, blocks, false, w0.get("mlp_res_norm.weight").data,
                             w0.get("mlp_res_proj.weight").data, w0.get("post_attention_layernorm.weight").data,
                             m.rms_norm_eps, opt.rounding);
  }
  Mat hidden = ffn(ranks, post.x, opt, trace);
  if (trace) {
    trace->put("x2", post.x);
    trace->put("residual2", post.residual);
    trace->put("ffn_out", hidden);
  }
  return hidden;
}

// ---- whole layers -------------------------------------------------------------------------------

LayerOutput decoder_layer(const LayerWeights& w, const Mat& hidden, const Mat* residual, const StepMeta& meta,
                          LayerState& state, const Options& opt, Trace* trace, AttnResState* attn_res) {
  if (w.shard().tp != 1)
    fail(Errc::input, "reference decoder_layer: weights are rank {} of tp {}; use decoder_layer_tp for TP > 1",
         w.shard().rank, w.shard().tp);
  const LayerWeights* ranks[1] = {&w};
  LayerState* states[1] = {&state};
  return decoder_layer_tp(ranks, hidden, residual, meta, states, opt, trace, attn_res);
}

LayerOutput decoder_layer_tp(std::span<const LayerWeights* const> ranks, const Mat& hidden, const Mat* residual,
                             const StepMeta& meta, std::span<LayerState* const> states, const Options& opt,
                             Trace* trace, AttnResState* attn_res) {
  if (ranks.empty() || ranks.size() != states.size())
    fail(Errc::input, "reference decoder_layer_tp: {} ranks of weights, {} states", ranks.size(), states.size());
  const LayerWeights& w0 = *ranks[0];
  for (size_t i = 0; i < ranks.size(); ++i) {
    const Shard s = ranks[i]->shard();
    if (s.tp != static_cast<int>(ranks.size()) || s.rank != static_cast<int>(i) || ranks[i]->layer() != w0.layer() ||
        &ranks[i]->model() != &w0.model())
      fail(
          Errc::input,
          "reference decoder_layer_tp: entry {} holds rank {} of tp {} of layer {}, expected rank {} of {} of layer {}",
          i, s.rank, s.tp, ranks[i]->layer(), i, ranks.size(), w0.layer());
  }
  const Model& m = w0.model();
  const Rounding& R = opt.rounding;
  check_rows(hidden, meta, m.hidden, "decoder layer");

  const int64_t B = m.attn_res_block;
  if ((B > 0) != (attn_res != nullptr))
    fail(Errc::input, "reference decoder_layer: layer {}: {}", w0.layer(),
         B > 0 ? "the model has block attention residuals (attn_res_block > 0): pass the step's AttnResState"
               : "an AttnResState for a model without block attention residuals");
  if (B > 0 && static_cast<int64_t>(attn_res->blocks.size()) != attn_res_blocks(w0.layer(), B))
    fail(Errc::input, "reference decoder_layer: layer {} expects {} stored attention-residual blocks (block {}), the "
         "state holds {}", w0.layer(), attn_res_blocks(w0.layer(), B), B, attn_res->blocks.size());
  auto add_norm = [&](const Mat& h, const Mat* r, const char* res, const char* norm, bool push) {
    const std::string rs = res;
    if (B == 0) return fused_add_rms_norm(h, r, w0.get(norm).data, m.rms_norm_eps, R);
    return attn_res_add_norm(h, r, attn_res->blocks, push, w0.get(rs + "_res_norm.weight").data,
                             w0.get(rs + "_res_proj.weight").data, w0.get(norm).data, m.rms_norm_eps, R);
  };
  AddNorm in = add_norm(hidden, residual, "self_attention", "input_layernorm.weight", w0.spec().attn_res_push);
  std::vector<Mat> parts;
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (w0.spec().mixer == model::Mixer::kda)
      parts.push_back(kda_mixer(*ranks[i], in.x, meta, states[i]->kda, opt, trace));
    else
      parts.push_back(mla_mixer(*ranks[i], in.x, meta, states[i]->mla, opt, trace));
  }
  Mat mixer_out = all_reduce(parts, R);
  AddNorm post = add_norm(mixer_out, &in.residual, "mlp", "post_attention_layernorm.weight", false);
  LayerOutput out;
  out.hidden = ffn(ranks, post.x, opt, trace);
  out.residual = post.residual;
  if (trace) {
    trace->put("x", in.x);
    trace->put("residual", in.residual);
    trace->put("mixer_out", mixer_out);
    trace->put("x2", post.x);
    trace->put("residual2", post.residual);
    trace->put("ffn_out", out.hidden);
  }
  return out;
}

Mat final_norm(const Model& m, const Mat& hidden, const Mat& residual, std::span<const double> norm_weight,
               const Options& opt) {
  return fused_add_rms_norm(hidden, &residual, norm_weight, m.rms_norm_eps, opt.rounding).x;
}

Mat final_norm_attn_res(const Model& m, const Mat& hidden, const Mat& residual, const AttnResState& st,
                        std::span<const double> res_norm, std::span<const double> res_proj,
                        std::span<const double> norm_weight, const Options& opt) {
  const int64_t B = m.attn_res_block;
  if (B <= 0) fail(Errc::input, "reference final_norm_attn_res: the model has no block attention residuals");
  if (static_cast<int64_t>(st.blocks.size()) != attn_res_blocks(m.num_layers, B))
    fail(Errc::input, "reference final_norm_attn_res: {} layers with block {} store {} blocks, the state holds {}",
         m.num_layers, B, attn_res_blocks(m.num_layers, B), st.blocks.size());
  std::vector<Mat> blocks = st.blocks;
  return attn_res_add_norm(hidden, &residual, blocks, false, res_norm, res_proj, norm_weight, m.rms_norm_eps,
                           opt.rounding).x;
}

// ---- comparisons ----------------------------------------------------------------------------------

double rel_error(std::span<const double> a, std::span<const double> b) {
  if (a.size() != b.size()) return std::numeric_limits<double>::infinity();
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) return std::numeric_limits<double>::infinity();
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  if (den == 0) return num == 0 ? 0.0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

double rel_error(const Mat& a, const Mat& b, const std::vector<bool>* row_mask) {
  if (a.rows != b.rows || a.cols != b.cols) return std::numeric_limits<double>::infinity();
  if (!row_mask) return rel_error(a.v, b.v);
  std::vector<double> x, y;
  for (int64_t t = 0; t < a.rows; ++t) {
    if (!(*row_mask)[t]) continue;
    x.insert(x.end(), a.row(t).begin(), a.row(t).end());
    y.insert(y.end(), b.row(t).begin(), b.row(t).end());
  }
  return rel_error(x, y);
}

std::vector<bool> valid_rows(const StepMeta& meta, model::Mixer mixer) {
  std::vector<bool> v(static_cast<size_t>(meta.rows()), true);
  for (int64_t r = 0; r < meta.num_requests; ++r) {
    const bool pad = mixer == model::Mixer::kda
                         ? (r < static_cast<int64_t>(meta.kda_slots.size()) &&
                            (meta.kda_slots[r].empty() || meta.kda_slots[r][0] == kNullBlockId))
                         : (r < static_cast<int64_t>(meta.seq_lens.size()) && meta.seq_lens[r] == 0);
    for (int64_t i = 0; i < meta.q; ++i) v[static_cast<size_t>(r * meta.q + i)] = !pad;
  }
  return v;
}

}  // namespace dp::ref
