// dp_ref_sensitivity: how far the float64 reference of ONE decoder layer moves when its input, or one of
// its bf16 rounding points, moves by one bf16 rounding. The answer says what relative error a correct
// GPU layer program can be expected to show against the reference (`run --check` compares at 1e-2):
// a GPU that keeps one intermediate in fp32, or rounds one element the other way, differs from the
// reference by about the reference's own change under the same perturbation.
//
//   dp_ref_sensitivity --model CONFIG --layer L [--seed S] [--context N] [--width W] [--samples K]
//                      [--res-proj-scale F]
//
// Weights: the synth fill of seed S (K3: with every attention-residual res_proj times F, to try other fills) (what `decodepack synth --seed S` writes and `run` binds). Inputs
// as `decodepack run --check` draws them (tooling/harness.cpp): hidden (and residual, for layer > 0)
// uniform in [-1, 1], MLA latent rows uniform in [-1.5, 1.5], KDA states around 1, stored attention-
// residual blocks uniform in [-1, 1], all bf16; one request per row with N cached tokens.
//
// Prints: (1) the magnitudes that decide the sensitivity (attention scores after the softmax scale,
// the attention-residual mix weights, the FFN activation inputs, rms of each stage); (2) the distance of
// the bf16-rounded reference from exact float64 math, per stage; (3) per rounding point, the change of
// the layer's outputs when that point alone is not rounded; (4) the change under one-ulp input
// perturbations; (5) the change of the FFN output for a one-ulp change of its input (the FFN's own
// amplification), the FFN's own rounding, and that of the layer's FFN half (post-attention norm, K3 mix,
// FFN) on the layer's residual output, which is what `run --check` compares a GPU layer's hidden with.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "common/error.h"
#include "common/rng.h"
#include "model/ir.h"
#include "reference/layer.h"
#include "reference/numeric.h"

namespace {

using namespace dp;
using namespace dp::ref;

Mat rand_bf16(int64_t rows, int64_t cols, double a, Rng& rng) {
  Mat m(rows, cols);
  for (double& v : m.v) v = round_bf16(rng.nonzero(-a, a));
  return m;
}

// The bf16 neighbour of a bf16 value x, one ulp up (dir > 0) or down in magnitude-independent order.
double bf16_step(double x, int dir) {
  uint16_t b = double_to_bf16_bits(x);
  const bool neg = b & 0x8000;
  if ((b & 0x7fff) == 0) return dir > 0 ? bf16_bits_to_double(0x0001) : bf16_bits_to_double(0x8001);
  // Moving away from zero increments the magnitude bits.
  const bool away = (dir > 0) != neg;
  b = static_cast<uint16_t>(away ? b + 1 : b - 1);
  return bf16_bits_to_double(b);
}

// Every element with probability `frac`: one ulp up or down at random.
Mat perturb_ulp(const Mat& m, double frac, Rng& rng) {
  Mat o = m;
  for (double& v : o.v)
    if (rng.uniform(0, 1) < frac) v = bf16_step(v, (rng.next() & 1) ? 1 : -1);
  return o;
}

double rms(std::span<const double> x) {
  double s = 0;
  for (double e : x) s += e * e;
  return x.empty() ? 0.0 : std::sqrt(s / static_cast<double>(x.size()));
}
double max_abs(std::span<const double> x) {
  double m = 0;
  for (double e : x) m = std::max(m, std::fabs(e));
  return m;
}

struct Setup {
  model::Model m;
  int layer = 0;
  int64_t width = 1, context = 100;
  uint64_t seed = 0;
  double res_proj_scale = 1.0;  // multiplies every *_res_proj.weight of the synth fill (K3)
};

// One step's state and inputs, fixed across the runs that are compared.
struct Inputs {
  StepMeta meta;
  Mat hidden, residual;  // residual empty for layer 0
  LayerState state;
  AttnResState attn_res;
};

Inputs make_inputs(const Setup& s, const LayerWeights& w) {
  const model::Model& m = s.m;
  Rng rng(s.seed ^ 0x1A9E7ull);
  Inputs in;
  const int64_t bs = 16, blocks = (s.context + 1 + bs - 1) / bs;
  std::vector<int64_t> lens;
  for (int64_t r = 0; r < s.width; ++r) lens.push_back(s.context + 1);
  in.meta = StepMeta::simple(s.width, 1, lens, bs, blocks);
  in.hidden = rand_bf16(s.width, m.hidden, 1.0, rng);
  if (s.layer > 0) in.residual = rand_bf16(s.width, m.hidden, 1.0, rng);
  if (w.spec().mixer == model::Mixer::kda) {
    in.state.kda = KdaState::zeros(m, w.shard(), 1 + s.width, KdaState::conv_width_for(m, ConvSpecLayout::per_slot, 1));
    for (double& v : in.state.kda.recurrent) v = round_fp32(rng.nonzero(-1, 1));
    for (auto* c : {&in.state.kda.conv_q, &in.state.kda.conv_k, &in.state.kda.conv_v})
      for (double& v : *c) v = round_bf16(rng.nonzero(-1, 1));
  } else {
    in.state.mla = MlaCache::zeros(m, 1 + s.width * blocks, bs);
    for (double& v : in.state.mla.data) v = round_bf16(rng.nonzero(-1.5, 1.5));
  }
  if (m.attn_res_block > 0)
    for (int64_t k = 0; k < attn_res_blocks(s.layer, m.attn_res_block); ++k)
      in.attn_res.blocks.push_back(rand_bf16(s.width, m.hidden, 1.0, rng));
  return in;
}

struct Run {
  LayerOutput out;
  Trace trace;
  AttnResState attn_res;  // the block state after the layer (K3)
};

Run run_layer(const Setup& s, const LayerWeights& w, const Inputs& in, const Options& opt, const Mat* hidden = nullptr) {
  Inputs st = in;  // the state is updated in place; every run starts from the same one
  Run r;
  r.out = decoder_layer(w, hidden ? *hidden : st.hidden, s.layer > 0 ? &st.residual : nullptr, st.meta, st.state, opt,
                        &r.trace, s.m.attn_res_block > 0 ? &st.attn_res : nullptr);
  r.attn_res = st.attn_res;
  return r;
}

// The FFN alone (TP 1) on x2.
Mat run_ffn(const LayerWeights& w, const Mat& x2, const Options& opt) {
  const LayerWeights* ranks[1] = {&w};
  return ffn(ranks, x2, opt);
}

void stats_line(const char* name, std::span<const double> x) {
  fmt::print("  {:<34} rms {:10.4g}  max|.| {:10.4g}\n", name, rms(x), max_abs(x));
}

void magnitudes(const Setup& s, const LayerWeights& w, const Inputs& in, const Run& base) {
  const model::Model& m = s.m;
  const Trace& tr = base.trace;
  fmt::print("\n(1) magnitudes (bf16-rounded reference, row 0 unless noted)\n");
  stats_line("layer input hidden", in.hidden.v);
  stats_line("x = RMSNorm_in(...)", tr.at("x").v);
  if (w.spec().mixer == model::Mixer::mla) {
    const model::MlaConfig& a = m.mla;
    const int64_t N = a.num_heads, Pn = a.qk_nope_head_dim, Rp = a.qk_rope_head_dim, L = a.kv_lora_rank,
                  Dq = Pn + Rp;
    stats_line("q (per head [nope | pe])", tr.at("q").v);
    stats_line("kv_a output [c | k_pe]", tr.at("kv").v);
    stats_line("c = kv_a_layernorm(c)", tr.at("c").v);
    stats_line("ql = q_nope . W_UK_T", tr.at("ql").v);
    // Scores over the cached context of request 0, every head.
    const Mat& q = tr.at("q");
    const Mat& ql = tr.at("ql");
    const double scale = 1.0 / std::sqrt(static_cast<double>(Dq));
    const int64_t len = in.meta.seq_lens[0];
    MlaCache cache = in.state.mla;  // the new token's row as the reference writes it
    {
      std::span<double> dst = cache.slot(in.meta.slot_mapping[0]);
      const Mat& c = tr.at("c");
      const Mat& kv = tr.at("kv");
      for (int64_t l = 0; l < L; ++l) dst[l] = round_bf16(c(0, l));
      for (int64_t e = 0; e < Rp; ++e) dst[L + e] = round_bf16(kv(0, L + e));
    }
    std::vector<double> all_s;
    double pmax_sum = 0, neff_sum = 0;
    for (int64_t n = 0; n < N; ++n) {
      std::vector<double> sc(static_cast<size_t>(len));
      double mx = -INFINITY;
      for (int64_t p = 0; p < len; ++p) {
        const int64_t slot = in.meta.block_table[0][p / cache.block_size] * cache.block_size + p % cache.block_size;
        std::span<double> row = cache.slot(slot);
        double d = 0;
        for (int64_t l = 0; l < L; ++l) d += ql(0, n * L + l) * row[l];
        for (int64_t e = 0; e < Rp; ++e) d += q(0, n * Dq + Pn + e) * row[L + e];
        sc[p] = scale * d;
        mx = std::max(mx, sc[p]);
        all_s.push_back(sc[p]);
      }
      double z = 0, p2 = 0, pm = 0;
      for (double& e : sc) z += (e = std::exp(e - mx));
      for (double e : sc) p2 += (e / z) * (e / z), pm = std::max(pm, e / z);
      pmax_sum += pm;
      neff_sum += 1.0 / p2;
    }
    double lo = INFINITY, hi = -INFINITY;
    for (double e : all_s) lo = std::min(lo, e), hi = std::max(hi, e);
    fmt::print("  {:<34} rms {:10.4g}  range [{:.3g}, {:.3g}] over {} positions x {} heads\n",
               "scores * (Pn+R)^-1/2", rms(all_s), lo, hi, len, N);
    fmt::print("  {:<34} mean max prob {:.3g}, mean effective positions 1/sum(p^2) {:.1f} of {}\n", "softmax",
               pmax_sum / static_cast<double>(N), neff_sum / static_cast<double>(N), len);
    stats_line("o_lat (attention output, latent)", tr.at("o_lat").v);
    stats_line("o_heads (after W_UV, gate)", tr.at("o_heads").v);
    if (tr.t.count("mla_gate")) {
      const Mat& g = tr.at("mla_gate");
      double sg = 0;
      for (double e : g.v) sg += sigmoid(e);
      stats_line("output-gate logits", g.v);
      fmt::print("  {:<34} mean sigmoid {:.3g}\n", "", sg / static_cast<double>(g.v.size()));
    }
  }
  stats_line("mixer output a", tr.at("mixer_out").v);
  stats_line("residual out (p, or residual)", base.out.residual.v);
  if (m.attn_res_block > 0) {
    // The post-attention mix of row 0: logits of every stored block and of p (mlp_res).
    const Tensor& rn = w.get("mlp_res_norm.weight");
    const Tensor& rp = w.get("mlp_res_proj.weight");
    std::vector<std::span<const double>> srcs;
    for (const Mat& b : base.attn_res.blocks) srcs.push_back(b.row(0));  // as they stand after the push
    srcs.push_back(base.out.residual.row(0));
    std::string ls = "  post-attention mix logits (blocks..., p):";
    std::vector<double> lg;
    for (auto x : srcs) {
      double d = 0;
      for (size_t i = 0; i < x.size(); ++i) d += x[i] * rn.data[i] * rp.data[i];
      lg.push_back(d / std::sqrt(rms(x) * rms(x) + m.rms_norm_eps));
    }
    double mx = -INFINITY, z = 0;
    for (double e : lg) mx = std::max(mx, e);
    for (double e : lg) z += std::exp(e - mx);
    for (double e : lg) ls += fmt::format(" {:.3g} (pi {:.3g})", e, std::exp(e - mx) / z);
    fmt::print("{}\n", ls);
  }
  stats_line("x2 = RMSNorm_post(...)", tr.at("x2").v);
  if (w.spec().ffn == model::Ffn::dense) {
    Mat g = linear(tr.at("x2"), w.get("mlp.gate_proj.weight"));
    Mat u = linear(tr.at("x2"), w.get("mlp.up_proj.weight"));
    stats_line("dense gate_proj output", g.v);
    stats_line("dense up_proj output", u.v);
    double act_ss = 0;
    for (size_t i = 0; i < g.v.size(); ++i) {
      const double a = m.activation == model::Activation::silu
                           ? silu(round_bf16(g.v[i])) * round_bf16(u.v[i])
                           : situ(round_bf16(g.v[i]), round_bf16(u.v[i]), m.situ_beta, m.situ_linear_beta);
      act_ss += a * a;
    }
    fmt::print("  {:<34} rms {:10.4g}\n", "activation output", std::sqrt(act_ss / static_cast<double>(g.v.size())));
  }
  stats_line("FFN output (hidden)", base.out.hidden.v);
}

struct Point {
  const char* name;
  bool Rounding::* flag;
};

constexpr Point kPoints[] = {
    {"residual", &Rounding::residual},         {"norm", &Rounding::norm},
    {"norm_before_weight", &Rounding::norm_before_weight}, {"linear", &Rounding::linear},
    {"conv", &Rounding::conv},                 {"kda_out", &Rounding::kda_out},
    {"gated_norm", &Rounding::gated_norm},     {"mla_q_absorbed", &Rounding::mla_q_absorbed},
    {"mla_attn_out", &Rounding::mla_attn_out}, {"mla_v_up", &Rounding::mla_v_up},
    {"mla_gate", &Rounding::mla_gate},         {"act", &Rounding::act},
    {"moe_weighted", &Rounding::moe_weighted}, {"moe_sum", &Rounding::moe_sum},
    {"ffn_out", &Rounding::ffn_out},           {"kda_state", &Rounding::kda_state},
    {"cache", &Rounding::cache},               {"attn_res", &Rounding::attn_res},
};

int run(const Setup& s, int samples) {
  const model::Model& m = s.m;
  fmt::print("model {} layer {} ({} + {}), width {}, context {}, synth seed {}, res_proj x {}\n", m.config_source,
             s.layer, model::to_string(m.layers.at(static_cast<size_t>(s.layer)).mixer),
             model::to_string(m.layers.at(static_cast<size_t>(s.layer)).ffn), s.width, s.context, s.seed,
             s.res_proj_scale);
  WeightLookup lookup = synth_lookup(m, s.layer, s.seed);
  if (s.res_proj_scale != 1.0)
    lookup = [base = lookup, k = s.res_proj_scale](const std::string& key) {
      std::vector<double> v = base(key);
      if (key.ends_with("_res_proj.weight"))
        for (double& e : v) e = round_bf16(e * k);
      return v;
    };
  LayerWeights w(m, s.layer, lookup);
  const Inputs in = make_inputs(s, w);
  const Options vllm;
  const Run base = run_layer(s, w, in, vllm);
  magnitudes(s, w, in, base);

  auto line = [&](const std::string& what, const Run& r) {
    fmt::print("  {:<40} mixer a {:9.3e}   residual {:9.3e}   x2 {:9.3e}   hidden {:9.3e}\n", what,
               rel_error(r.trace.at("mixer_out"), base.trace.at("mixer_out")),
               rel_error(r.out.residual, base.out.residual), rel_error(r.trace.at("x2"), base.trace.at("x2")),
               rel_error(r.out.hidden, base.out.hidden));
  };

  fmt::print("\n(2) exact float64 math (Rounding::none) against the bf16-rounded reference, per stage\n");
  Options exact;
  exact.rounding = Rounding::none();
  const Run ex = run_layer(s, w, in, exact);
  for (const auto& [k, v] : base.trace.t)
    if (ex.trace.t.count(k) && k != "topk_ids" && k != "topk_weights")
      fmt::print("  {:<14} {:9.3e}\n", k, rel_error(ex.trace.at(k), v));
  line("layer outputs", ex);

  fmt::print("\n(3) one rounding point left out (kept exact), all others as vLLM rounds\n");
  for (const Point& p : kPoints) {
    Options o;
    o.rounding.*(p.flag) = false;
    const Run r = run_layer(s, w, in, o);
    if (rel_error(r.out.hidden, base.out.hidden) == 0 && rel_error(r.out.residual, base.out.residual) == 0) continue;
    line(p.name, r);
  }

  {
    Options o;
    o.rounding.mla_attn_out = o.rounding.mla_v_up = false;
    line("mla_attn_out + mla_v_up (fused)", run_layer(s, w, in, o));
  }

  fmt::print("\n(4) layer input hidden: one bf16 ulp up or down at a random fraction of its elements\n");
  Rng rng(s.seed ^ 0xD1CEull);
  for (double frac : {0.01, 0.1, 1.0})
    for (int k = 0; k < samples; ++k) {
      const Mat h = perturb_ulp(in.hidden, frac, rng);
      line(fmt::format("fraction {:g}, sample {}", frac, k), run_layer(s, w, in, vllm, &h));
    }

  fmt::print("\n(5) stage sensitivities: one bf16 ulp at every element of a stage's bf16 input\n");
  const Mat& x2 = base.trace.at("x2");
  const Mat& ffn_base = base.out.hidden;
  for (int k = 0; k < samples; ++k) {
    const Mat xp = perturb_ulp(x2, 1.0, rng);
    const Mat y = run_ffn(w, xp, vllm);
    const Mat ye = run_ffn(w, xp, exact);
    const Mat y0e = run_ffn(w, x2, exact);
    fmt::print("  FFN: x2 moved {:9.3e} -> FFN output moved {:9.3e} (rounded), {:9.3e} (exact math)\n",
               rel_error(xp, x2), rel_error(y, ffn_base), rel_error(ye, y0e));
  }
  if (samples > 0) {
    const Mat y0e = run_ffn(w, x2, exact);
    fmt::print("  FFN's own rounding (rounded vs exact math on the same x2): {:9.3e}\n", rel_error(ffn_base, y0e));
  }
  // What `run --check` compares a layer's hidden output on: the FFN half (post-attention norm, K3 mix,
  // FFN) fed the layer's residual output. Its own rounding noise, without the mixer half's.
  {
    const LayerWeights* ranks[1] = {&w};
    const AttnResState* ar = m.attn_res_block > 0 ? &base.attn_res : nullptr;
    const Mat he = post_attention_ffn(ranks, base.out.residual, exact, nullptr, ar);
    fmt::print("  FFN half on the same residual (norm, mix, FFN): rounded vs exact math {:9.3e}\n",
               rel_error(base.out.hidden, he));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    Setup s;
    std::string model;
    int samples = 2;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      auto val = [&]() -> std::string {
        if (i + 1 >= argc) fail(Errc::usage, "{} needs a value", a);
        return argv[++i];
      };
      if (a == "--model") model = val();
      else if (a == "--layer") s.layer = std::stoi(val());
      else if (a == "--seed") s.seed = std::stoull(val());
      else if (a == "--context") s.context = std::stoll(val());
      else if (a == "--width") s.width = std::stoll(val());
      else if (a == "--samples") samples = std::stoi(val());
      else if (a == "--res-proj-scale") s.res_proj_scale = std::stod(val());
      else fail(Errc::usage, "unknown argument {} (see the comment at the top of ref_sensitivity.cpp)", a);
    }
    if (model.empty()) fail(Errc::usage, "--model CONFIG is required");
    s.m = model::load_model(model);
    if (s.layer < 0 || s.layer >= s.m.num_layers)
      fail(Errc::usage, "--layer {}: the model has {} layers", s.layer, s.m.num_layers);
    return run(s, samples);
  } catch (const std::exception& e) {
    fmt::print(stderr, "dp_ref_sensitivity: {}\n", e.what());
    return 1;
  }
}
