#include "tooling/check.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <span>

#include <fmt/format.h>

#include "common/error.h"
#include "reference/numeric.h"
#include "tooling/harness.h"
#include "common/parallel.h"

namespace dp::tools {

ref::KdaState kda_from_raw(const model::Model& m, ref::Shard shard, LayerCaches& lc, const CacheLayouts& lay) {
  const Cache& st = *lc.find(DP_KV_KDA_STATE);
  const Cache& cq = *lc.find(DP_KV_CONV_Q);
  const int64_t S = st.count, h = st.desc.shape[1], d = st.desc.shape[2];
  const bool sd = lay.conv == "sd";
  const int64_t width = sd ? cq.desc.shape[1] : cq.desc.shape[2], P = sd ? cq.desc.shape[2] : cq.desc.shape[1];
  ref::KdaState k = ref::KdaState::zeros(m, shard, S, width);
  if (k.heads != h || k.head_dim != d || k.conv_dim != P)
    fail(Errc::internal, "KDA cache [{} heads, dim {}, {} conv channels], the reference expects [{}, {}, {}]", h, d, P,
         k.heads, k.head_dim, k.conv_dim);
  const bool vk = lay.kda_state == "vk";
  for (int64_t s = 0; s < S; ++s)
    for (int64_t j = 0; j < h; ++j) {
      std::span<double> dst = k.slot_state(s, j);
      const uint8_t* src = st.host.data() + static_cast<size_t>(s) * st.slot_bytes + static_cast<size_t>(j * d * d) * 4;
      for (int64_t a = 0; a < d; ++a)
        for (int64_t b = 0; b < d; ++b)
          dst[static_cast<size_t>(a * d + b)] = get_f32(src + static_cast<size_t>(vk ? b * d + a : a * d + b) * 4);
    }
  for (int which = 0; which < 3; ++which) {
    const Cache& c = *lc.find(DP_KV_CONV_Q + which);
    for (int64_t s = 0; s < S; ++s)
      for (int64_t ch = 0; ch < P; ++ch) {
        std::span<double> dst = k.conv(which, s, ch);
        const uint8_t* base = c.host.data() + static_cast<size_t>(s) * c.slot_bytes;
        for (int64_t w = 0; w < width; ++w)
          dst[static_cast<size_t>(w)] = get_value(base + static_cast<size_t>(sd ? w * P + ch : ch * width + w) * c.elem, c.dtype);
      }
  }
  return k;
}

ref::MlaCache mla_from_raw(const model::Model& m, LayerCaches& lc) {
  const Cache& c = *lc.find(DP_KV_MLA_LATENT);
  ref::MlaCache out = ref::MlaCache::zeros(m, c.count, c.desc.shape[1]);
  if (out.row != c.desc.shape[2])
    fail(Errc::internal, "MLA cache rows of {} values, the reference expects {}", c.desc.shape[2], out.row);
  for (size_t i = 0; i < out.data.size(); ++i) out.data[i] = get_bf16(c.host.data() + i * 2);
  return out;
}

int64_t changed_outside(const std::vector<uint8_t>& before, const std::vector<uint8_t>& now, size_t unit_bytes,
                        size_t elem, const std::set<int64_t>& skip) {
  int64_t n = 0;
  const int64_t units = static_cast<int64_t>(before.size() / unit_bytes);
  for (int64_t s = 0; s < units; ++s) {
    if (skip.count(s)) continue;
    const size_t off = static_cast<size_t>(s) * unit_bytes;
    if (std::memcmp(before.data() + off, now.data() + off, unit_bytes) == 0) continue;
    for (size_t e = 0; e < unit_bytes; e += elem) n += std::memcmp(before.data() + off + e, now.data() + off + e, elem) != 0;
  }
  return n;
}

ref::Mat bf16_mat(const std::vector<uint8_t>& raw, int64_t rows, int64_t cols) {
  ref::Mat m(rows, cols);
  for (size_t i = 0; i < m.v.size(); ++i) m.v[i] = get_bf16(raw.data() + 2 * i);
  return m;
}

void zero_rows(ref::Mat& m, const std::vector<bool>& valid) {
  for (int64_t t = 0; t < m.rows; ++t)
    if (!valid[static_cast<size_t>(t)])
      for (double& v : m.row(t)) v = 0;
}

// MoE routing near-ties. The GPU layer computes the router from its own bf16 activations, which may
// differ from the reference's by an ulp here and there; where the k-th and (k+1)-th biased scores of a
// row are closer than kNearTie, the two sides may legitimately pick different experts, and that row's
// FFN output then differs entirely. For such rows the reference FFN is also computed with the
// alternative choice (the weakest chosen expert swapped for the near-tied one, done by moving the
// selection-only correction bias, so the weights stay the router's), and the row takes whichever
// candidate is closer to the GPU's. Returns the rows that took an alternative.
namespace {
constexpr double kNearTie = 1e-2;
}  // namespace

int64_t match_near_ties(const model::Model& m, const WeightSource& src, int layer,
                        std::span<const ref::LayerWeights* const> ranks, const ref::Trace& trace, const ref::Mat& gpu,
                        const std::vector<bool>& valid, const ref::Options& opt, ref::Mat& want) {
  const ref::LayerWeights& w = *ranks[0];
  if (w.spec().ffn == model::Ffn::dense || !trace.t.count("router_logits")) return 0;
  const int64_t E = m.moe.num_experts, k = m.moe.top_k;
  if (k < 1 || k >= E) return 0;
  const std::string bias_key = "block_sparse_moe.gate.e_score_correction_bias";
  const std::vector<double> bias = w.get(bias_key).data;
  const ref::Mat& logits = trace.at("router_logits");
  const ref::Mat& x2 = trace.at("x2");
  auto sqdist = [&](int64_t t, std::span<const double> ref_row) {
    double d = 0;
    for (int64_t c = 0; c < gpu.cols; ++c) {
      const double e = gpu(t, c) - ref_row[static_cast<size_t>(c)];
      d += e * e;
    }
    return std::isnan(d) ? std::numeric_limits<double>::infinity() : d;
  };
  int64_t taken = 0;
  for (int64_t t = 0; t < logits.rows; ++t) {
    if (!valid[static_cast<size_t>(t)]) continue;
    std::vector<double> sel(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e)
      sel[static_cast<size_t>(e)] = ref::sigmoid(logits(t, e)) + (bias.empty() ? 0.0 : bias[static_cast<size_t>(e)]);
    std::vector<int64_t> order(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) order[static_cast<size_t>(e)] = e;
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t b) { return sel[static_cast<size_t>(a)] > sel[static_cast<size_t>(b)]; });
    const int64_t a = order[static_cast<size_t>(k - 1)];
    double best = sqdist(t, want.row(t));
    std::vector<double> best_row;
    for (int64_t j = k; j < E; ++j) {
      const int64_t b = order[static_cast<size_t>(j)];
      const double gap = sel[static_cast<size_t>(a)] - sel[static_cast<size_t>(b)];
      if (gap > kNearTie || bias.empty()) break;
      std::vector<double> nb = bias;
      nb[static_cast<size_t>(b)] += gap + 1e-9;
      nb[static_cast<size_t>(a)] -= 1e-9;
      // Every rank's shard with the moved bias (it is replicated), for the FFN over all ranks.
      std::vector<std::unique_ptr<ref::LayerWeights>> alt;
      std::vector<const ref::LayerWeights*> alt_ranks;
      for (const ref::LayerWeights* r : ranks) {
        alt.push_back(std::make_unique<ref::LayerWeights>(
            m, layer, [base = src.lookup(layer), nb, bias_key](const std::string& key) {
              return key == bias_key ? nb : base(key);
            },
            r->shard()));
        alt_ranks.push_back(alt.back().get());
      }
      ref::Mat xr(1, x2.cols);
      std::copy(x2.row(t).begin(), x2.row(t).end(), xr.row(0).begin());
      const ref::Mat y = ref::ffn(alt_ranks, xr, opt);
      const double d = sqdist(t, y.row(0));
      if (d < best) {
        best = d;
        best_row = y.v;
      }
    }
    if (!best_row.empty()) {
      std::copy(best_row.begin(), best_row.end(), want.row(t).begin());
      ++taken;
    }
  }
  return taken;
}

// ---- the check of one step ---------------------------------------------------------------------------

void Harness::check_step(int index, const std::string& mode) {
  const model::Model& m = model_->m;
  const ref::StepMeta sm = meta_.step_meta();
  const int64_t T = res_.rows, H = hidden_;
  auto make_check = [&](int layer, const std::string& cls, const std::string& quantity, double value,
                        double limit) {
    RunCheck c;
    c.step = index;
    c.mode = mode;
    c.layer = layer;
    c.cls = cls;
    c.quantity = quantity;
    c.value = value;
    c.limit = limit;
    c.ok = std::isfinite(value) && value < limit;
    return c;
  };
  const std::vector<bool> valid = ref::valid_rows(sm, model::Mixer::kda);  // padding is the same for both mixers
  const ref::Options opt;

  // What the comparisons read comes off the device first (one stream); then the layers are compared
  // in parallel, each with its own reference weights, caches and results.
  struct PeerLayer {  // what rank p > 0 sent (send_check_data): its mirrors, caches and outputs
    std::vector<std::vector<uint8_t>> before, now;
    std::vector<uint8_t> hout, rout;
  };
  struct LayerData {
    int32_t layer = 0;
    std::vector<uint8_t> hin, rin, hout, rout;
    std::vector<std::vector<uint8_t>> now;  // the caches as the GPU left them
    std::vector<PeerLayer> peers;           // ranks 1 .. tp-1
    std::vector<RunCheck> checks;
    int64_t routed = -1;
  };
  // K3: the step's attention-residual blocks as the GPU left them. Layers only append, so the blocks a
  // layer found on entry are the first attn_res_blocks(l, B) of them (each comparison stands alone, on
  // the GPU's state, like the caches'); block k, row t at t * stride + k * H.
  const int64_t B = m.attn_res_block;
  std::vector<ref::Mat> blocks;
  if (B > 0) {
    const std::vector<uint8_t> raw = download(attn_res_, static_cast<size_t>(T * attn_res_stride_) * 2);
    for (int64_t k = 0; k < attn_res_blocks_; ++k) {
      ref::Mat b(T, H);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < H; ++i) b(t, i) = get_bf16(raw.data() + static_cast<size_t>(t * attn_res_stride_ + k * H + i) * 2);
      zero_rows(b, valid);
      blocks.push_back(std::move(b));
    }
  }
  std::vector<LayerData> data;
  for (int32_t l = 0; l < num_layers_; ++l) {
    if (!run_layer_[static_cast<size_t>(l)]) continue;
    const size_t li = static_cast<size_t>(l);
    LayerData d;
    d.layer = l;
    d.hin = download(hidden_bufs_[li], act_bytes_);
    if (l > 0) d.rin = download(residual_bufs_[li], act_bytes_);
    d.hout = download(hidden_bufs_[li + 1], act_bytes_);
    d.rout = download(residual_bufs_[li + 1], act_bytes_);
    for (const Cache& c : caches_[li].c) d.now.push_back(download(c.ptr, c.bytes()));
    data.push_back(std::move(d));
  }
  // Tensor parallelism: the other ranks' caches (as the step read them and as it left them) and outputs.
  for (int p = 1; p < tp_; ++p) {
    const std::vector<uint8_t> blob = group_->receive(fmt::format("check.{}", index), p);
    size_t at = 0;
    auto take = [&](size_t n) {
      if (at + n > blob.size())
        fail(Errc::internal, "rank {}'s check data of step {}: {} bytes, more expected", p, index, blob.size());
      std::vector<uint8_t> v(blob.begin() + static_cast<std::ptrdiff_t>(at), blob.begin() + static_cast<std::ptrdiff_t>(at + n));
      at += n;
      return v;
    };
    for (LayerData& d : data) {
      PeerLayer pl;
      for (const Cache& c : caches_[static_cast<size_t>(d.layer)].c) {
        pl.before.push_back(take(c.bytes()));
        pl.now.push_back(take(c.bytes()));
      }
      pl.hout = take(act_bytes_);
      pl.rout = take(act_bytes_);
      d.peers.push_back(std::move(pl));
    }
    if (at != blob.size())
      fail(Errc::internal, "rank {}'s check data of step {}: {} bytes, {} expected", p, index, blob.size(), at);
  }
  parallel_for(data.size(), check_threads, [&](size_t i) {
    LayerData& d = data[i];
    const int32_t l = d.layer;
    const size_t li = static_cast<size_t>(l);
    auto add = [&](int layer, const std::string& cls, const std::string& quantity, double value,
                   double limit) -> RunCheck& {
      d.checks.push_back(make_check(layer, cls, quantity, value, limit));
      return d.checks.back();
    };
    // A count that must be 0 (cache rows changed where the step must not write).
    auto add_count = [&](int layer, const std::string& cls, const std::string& quantity, int64_t n) {
      RunCheck& c = add(layer, cls, quantity, static_cast<double>(n), 0);
      c.kind = "count";
      c.ok = n == 0;
    };
      const std::string& cls = res_.layer_classes[li];
      ref::Mat hin = bf16_mat(d.hin, T, H);
      zero_rows(hin, valid);
      ref::Mat rin;
      if (l > 0) {
        rin = bf16_mat(d.rin, T, H);
        zero_rows(rin, valid);
      }
      const ref::Mat hout = bf16_mat(d.hout, T, H);
      const ref::Mat rout = bf16_mat(d.rout, T, H);

      // Every rank's weights and caches: rank 0's own, the others' as they sent them (copies that
      // take the same mirror updates below, so the checks read alike for every rank).
      const size_t R = static_cast<size_t>(tp_);
      std::vector<std::unique_ptr<ref::LayerWeights>>& rw = ref_weights_[li];
      rw.resize(R);
      std::vector<const ref::LayerWeights*> ranks;
      for (size_t p = 0; p < R; ++p) {
        if (!rw[p]) rw[p] = std::make_unique<ref::LayerWeights>(m, l, source_->lookup(l), ref::Shard{tp_, static_cast<int>(p)});
        ranks.push_back(rw[p].get());
      }
      std::vector<LayerCaches> peer_caches(R - 1);
      std::vector<LayerCaches*> lcs{&caches_[li]};
      std::vector<std::vector<std::vector<uint8_t>>*> nows{&d.now};
      for (size_t p = 1; p < R; ++p) {
        LayerCaches& pc = peer_caches[p - 1];
        pc.kda = caches_[li].kda;
        for (size_t k = 0; k < caches_[li].c.size(); ++k) {
          const Cache& c = caches_[li].c[k];
          Cache x;
          x.kind = c.kind;
          x.desc = c.desc;
          x.dtype = c.dtype;
          x.elem = c.elem;
          x.slot_bytes = c.slot_bytes;
          x.count = c.count;
          x.host = std::move(d.peers[p - 1].before[k]);
          pc.c.push_back(std::move(x));
        }
        lcs.push_back(&pc);
        nows.push_back(&d.peers[p - 1].now);
      }
      std::vector<ref::LayerState> states(R);
      std::vector<ref::LayerState*> state_ptrs;
      for (size_t p = 0; p < R; ++p) {
        if (lcs[p]->kda) states[p].kda = kda_from_raw(m, ref::Shard{tp_, static_cast<int>(p)}, *lcs[p], layouts_);
        else states[p].mla = mla_from_raw(m, *lcs[p]);
        state_ptrs.push_back(&states[p]);
      }
      ref::Trace trace;
      ref::AttnResState attn_res;
      if (B > 0) attn_res.blocks.assign(blocks.begin(), blocks.begin() + ref::attn_res_blocks(l, B));
      ref::AttnResState* ar = B > 0 ? &attn_res : nullptr;
      ref::LayerOutput want =
          R == 1 ? ref::decoder_layer(*ranks[0], hin, l > 0 ? &rin : nullptr, sm, states[0], opt, &trace, ar)
                 : ref::decoder_layer_tp(ranks, hin, l > 0 ? &rin : nullptr, sm, state_ptrs, opt, &trace, ar);
      if (B > 0 && l % B == 0)  // the block this layer pushed: p, exactly
        add(l, cls, "attn_res pushed block",
            ref::rel_error(blocks[static_cast<size_t>(l / B)], attn_res.blocks.back(), &valid), 1e-6);
      // The FFN half is compared on the GPU's own residual output (K3: its partial sum p), the way each
      // layer is compared on the GPU's own layer input: the mixer half is checked by the residual row,
      // and its bf16 rounding differences do not compound into the FFN half's error. Against the
      // reference's own residual ("end to end", shown in the row's name) a correct layer whose FFN input
      // is the renormalised mixer output alone (K3 layer 0 mixes the MLA output with the embedding, and
      // the mix may weight the MLA output ~1) lands near 1e-2 from rounding alone:
      // tests/results/gpu-2026-12-03/README.md "Why K3-shaped layer 0's hidden was at 1e-2".
      const double end_to_end = ref::rel_error(hout, want.hidden, &valid);
      ref::Mat rout_valid = rout;
      zero_rows(rout_valid, valid);
      ref::Trace ffn_trace;
      const ref::Mat ffn_want = ref::post_attention_ffn(ranks, rout_valid, opt, &ffn_trace, ar);
      want.hidden = ffn_want;
      const int64_t alternatives = match_near_ties(m, *source_, l, ranks, ffn_trace, hout, valid, opt, want.hidden);
      if (drop_reference_cache_)
        for (auto& w : rw) w->drop_cache();
      if (const auto it = ffn_trace.t.find("topk_ids"); it != ffn_trace.t.end()) {
        std::set<int64_t> experts;
        for (int64_t t = 0; t < it->second.rows; ++t)
          if (valid[static_cast<size_t>(t)])
            for (double e : it->second.row(t)) experts.insert(static_cast<int64_t>(e));
        d.routed = static_cast<int64_t>(experts.size());
      }
      add(l, cls,
          alternatives ? fmt::format("hidden ({} near-tie row{} rerouted; end to end {:.2e})", alternatives,
                                     alternatives == 1 ? "" : "s", end_to_end)
                       : fmt::format("hidden (end to end {:.2e})", end_to_end),
          ref::rel_error(hout, want.hidden, &valid), kBf16Limit);
      add(l, cls, "residual", ref::rel_error(rout, want.residual, &valid), kBf16Limit);
      if (R > 1) {
        // The all-reduce sums in rank order on every rank: every rank's output rows are rank 0's, bit for bit.
        int64_t differ = 0;
        for (const PeerLayer& pl : d.peers)
          for (int64_t t = 0; t < T; ++t) {
            if (!valid[static_cast<size_t>(t)]) continue;
            const size_t off = static_cast<size_t>(t * H) * 2;
            for (int64_t c = 0; c < H; ++c) {
              differ += std::memcmp(pl.hout.data() + off + c * 2, d.hout.data() + off + c * 2, 2) != 0;
              differ += std::memcmp(pl.rout.data() + off + c * 2, d.rout.data() + off + c * 2, 2) != 0;
            }
          }
        add_count(l, cls, fmt::format("hidden/residual of ranks 1-{} equal rank 0's", R - 1), differ);
      }

    for (size_t p = 0; p < R; ++p) {
      LayerCaches& lc = *lcs[p];
      const std::vector<std::vector<uint8_t>>& now = *nows[p];
      ref::LayerState& state = states[p];
      const ref::Shard shard{tp_, static_cast<int>(p)};
      const std::string of = R > 1 ? fmt::format(", rank {}", p) : "";
      // The caches as the GPU left them; the mirror becomes them, so the next step starts from the
      // GPU's state (the comparison of each step stands alone).
      if (lc.kda) {
        std::set<int64_t> touched;
        for (int r = 0; r < width_; ++r)
          if (meta_.real[r])
            for (int i = 0; i < q_; ++i) touched.insert(meta_.state_indices[static_cast<size_t>(r * q_ + i)]);
        int64_t changed = 0;
        for (size_t k = 0; k < lc.c.size(); ++k)
          changed += changed_outside(lc.c[k].host, now[k], lc.c[k].slot_bytes, lc.c[k].elem, touched);
        const ref::KdaState before = kda_from_raw(m, shard, lc, layouts_);
        for (size_t k = 0; k < lc.c.size(); ++k) lc.c[k].host = now[k];
        const ref::KdaState got = kda_from_raw(m, shard, lc, layouts_);
        std::vector<double> gs, ws, gc, wc;
        ref::KdaState& ref_state = state.kda;
        for (int64_t s : touched) {
          for (int64_t j = 0; j < got.heads; ++j) {
            const size_t n = static_cast<size_t>(got.head_dim * got.head_dim);
            const size_t off = static_cast<size_t>((s * got.heads + j)) * n;
            gs.insert(gs.end(), got.recurrent.begin() + static_cast<std::ptrdiff_t>(off),
                      got.recurrent.begin() + static_cast<std::ptrdiff_t>(off + n));
            std::span<double> w = ref_state.slot_state(s, j);
            ws.insert(ws.end(), w.begin(), w.end());
          }
          for (int which = 0; which < 3; ++which) {
            const std::vector<double>& gv = which == 0 ? got.conv_q : which == 1 ? got.conv_k : got.conv_v;
            const std::vector<double>& wv = which == 0 ? ref_state.conv_q : which == 1 ? ref_state.conv_k : ref_state.conv_v;
            const size_t n = static_cast<size_t>(got.conv_dim * got.conv_width), off = static_cast<size_t>(s) * n;
            gc.insert(gc.end(), gv.begin() + static_cast<std::ptrdiff_t>(off), gv.begin() + static_cast<std::ptrdiff_t>(off + n));
            wc.insert(wc.end(), wv.begin() + static_cast<std::ptrdiff_t>(off), wv.begin() + static_cast<std::ptrdiff_t>(off + n));
          }
        }
        // The state limit. The state read is exact on both sides, so only this step's update S_new - S_read
        // can differ, and it is computed from bf16-rounded inputs (projections, conv outputs, gates): where
        // a GPU GEMM and the float64 reference round one such input to neighbouring bf16 values, the
        // update moves by up to one bf16 unit (2^-8) of its size. The limit is that, or 1e-4 when larger.
        double upd2 = 0, new2 = 0;
        for (int r = 0; r < width_; ++r) {
          if (!meta_.real[r]) continue;
          const int64_t src = meta_.state_indices[static_cast<size_t>(r * q_ + meta_.num_accepted[static_cast<size_t>(r)] - 1)];
          for (int i = 0; i < q_; ++i) {
            const int64_t dst = meta_.state_indices[static_cast<size_t>(r * q_ + i)];
            for (int64_t j = 0; j < got.heads; ++j) {
              const size_t n = static_cast<size_t>(got.head_dim * got.head_dim);
              const size_t off = static_cast<size_t>((src * got.heads + j)) * n;
              std::span<double> w = ref_state.slot_state(dst, j);
              for (size_t e = 0; e < n; ++e) {
                const double d = w[e] - before.recurrent[off + e];
                upd2 += d * d;
                new2 += w[e] * w[e];
              }
            }
          }
        }
        const double state_limit = std::max(kF32Limit, new2 > 0 ? std::ldexp(std::sqrt(upd2 / new2), -8) : 0.0);
        add(l, cls, fmt::format("kda state ({} slots{})", touched.size(), of), ref::rel_error(gs, ws), state_limit);
        add(l, cls, "conv state q/k/v" + of, ref::rel_error(gc, wc), kBf16Limit);
        add_count(l, cls, "other slots unchanged" + of, changed);
      } else {
        Cache& c = lc.c[0];
        const int64_t bs = c.desc.shape[1];
        const size_t row_values = static_cast<size_t>(c.desc.shape[2]);
        std::set<int64_t> written;  // cache slots (block * block_size + offset) the step writes
        for (size_t t = 0; t < meta_.slot_mapping.size(); ++t)
          if (valid[t] && meta_.slot_mapping[t] >= 0) written.insert(meta_.slot_mapping[t]);
        // Every other row, bitwise.
        const int64_t changed = changed_outside(c.host, now[0], c.slot_bytes / static_cast<size_t>(bs), c.elem, written);
        c.host = now[0];
        const ref::MlaCache got = mla_from_raw(m, lc);
        std::vector<double> g, w;
        for (int64_t s : written) {
          const size_t off = static_cast<size_t>(s) * row_values;
          g.insert(g.end(), got.data.begin() + static_cast<std::ptrdiff_t>(off),
                   got.data.begin() + static_cast<std::ptrdiff_t>(off + row_values));
          w.insert(w.end(), state.mla.data.begin() + static_cast<std::ptrdiff_t>(off),
                   state.mla.data.begin() + static_cast<std::ptrdiff_t>(off + row_values));
        }
        add(l, cls, fmt::format("latent rows ({} written{})", written.size(), of), ref::rel_error(g, w), kBf16Limit);
        add_count(l, cls, "other rows unchanged" + of, changed);
      }
    }
  });
  for (LayerData& d : data) {
    res_.checks.insert(res_.checks.end(), d.checks.begin(), d.checks.end());
    routed_[static_cast<size_t>(d.layer)] = d.routed;
  }

  // The final norm, from the rows the GPU fed it.
  ref::Mat h = bf16_mat(download(hidden_bufs_.back(), act_bytes_), T, H);
  ref::Mat r = bf16_mat(download(residual_bufs_.back(), act_bytes_), T, H);
  zero_rows(h, valid);
  zero_rows(r, valid);
  if (norm_weight_.empty()) norm_weight_ = ref::model_tensor(m, source_->lookup(-1), "norm.weight").data;
  ref::AddNorm want;
  if (B > 0) {
    // K3: the final mix of every stored block and p (output_attn_res), then the final norm.
    if (out_res_norm_.empty()) {
      out_res_norm_ = ref::model_tensor(m, source_->lookup(-1), "output_attn_res_norm.weight").data;
      out_res_proj_ = ref::model_tensor(m, source_->lookup(-1), "output_attn_res_proj.weight").data;
    }
    want = ref::attn_res_add_norm(h, &r, blocks, false, out_res_norm_, out_res_proj_, norm_weight_, m.rms_norm_eps,
                                  opt.rounding);
  } else {
    want = ref::fused_add_rms_norm(h, &r, norm_weight_, m.rms_norm_eps, opt.rounding);
  }
  res_.checks.push_back(make_check(
      -1, "final_norm", "out", ref::rel_error(bf16_mat(download(final_out_, act_bytes_), T, H), want.x, &valid),
      kBf16Limit));
  res_.checks.push_back(make_check(
      -1, "final_norm", "residual",
      ref::rel_error(bf16_mat(download(final_residual_, act_bytes_), T, H), want.residual, &valid), kBf16Limit));
}

}  // namespace dp::tools
