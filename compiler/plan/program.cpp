#include "plan/program.h"

#include <cmath>
#include <map>

#include "common/error.h"
#include "model/quant.h"
#include "plan/plan.h"

namespace dp::plan {

using model::Ffn;
using model::Mixer;
using model::Model;
using model::WeightSpec;
using From = ProgramArg::From;

const char* to_string(From f) {
  switch (f) {
    case From::io: return "io";
    case From::weight: return "weight";
    case From::expert_stride: return "expert_stride";
    case From::workspace: return "workspace";
    case From::kv: return "kv";
    case From::kv_stride: return "kv_stride";
    case From::f32: return "f32";
    case From::u32: return "u32";
    case From::null: return "null";
    case From::tp: return "tp";
    case From::layer: return "layer";
  }
  return "?";
}

namespace {

constexpr uint64_t align256(uint64_t x) { return (x + 255) / 256 * 256; }

// Thrown inside the builder when this version cannot build the class: the message becomes the reason.
struct Unavailable {
  std::string why;
};

// The weights of the first layer of a class, by layer-relative key, with the rank-0 shard shapes.
class LayerWeightsView {
 public:
  LayerWeightsView(const Model& m, const model::LayerSpec& l, int64_t tp) : m_(m), l_(l), tp_(tp) {}

  const WeightSpec* find(const std::string& key) const {
    const std::string k = group_key(key);
    for (size_t i : l_.weights)
      if (m_.weights[i].key == k) return &m_.weights[i];
    return nullptr;
  }
  const WeightSpec& get(const std::string& key) const {
    if (const WeightSpec* w = find(key)) return *w;
    fail(Errc::internal, "layer program: layer {} has no weight {}", l_.index, key);
  }
  // Rank 0's shard shape (equal shards on every rank).
  std::vector<int64_t> shape(const std::string& key) const {
    const WeightSpec& w = get(key);
    std::vector<int64_t> s = w.shape;
    if (w.split.kind == model::Split::Kind::dim) s[static_cast<size_t>(w.split.dim)] /= tp_;
    return s;
  }
  int64_t rows(const std::string& key) const { return shape(key).at(0); }

  // "experts.{e}.w1.weight" is stored per expert; expert 0 stands for the group.
  static std::string group_key(const std::string& key) {
    std::string k = key;
    if (auto p = k.find("{e}"); p != std::string::npos) k.replace(p, 3, "0");
    return k;
  }

 private:
  const Model& m_;
  const model::LayerSpec& l_;
  int64_t tp_;
};

// Not a scratch offset: "write the dp_layer_io field instead" (StepBuilder::ws_or_io).
constexpr uint64_t kNoScratch = ~uint64_t{0};

// Sequential scratch: every buffer of a program gets its own 256-byte aligned range (no reuse: at the
// decode widths the whole program's scratch is a few MB at most), from `top`, which starts above the
// counter words (layer_program's counter_reserve). Counter words are taken from offset 0 by every op
// (program.h): `counters` is the most one op takes.
struct Scratch {
  uint64_t top = 0;
  uint64_t counters = 0;
  uint64_t take(uint64_t bytes) {
    const uint64_t at = top;
    top = align256(top + bytes);
    return at;
  }
  uint64_t counter(uint64_t bytes) {
    counters = std::max(counters, align256(bytes));
    return 0;
  }
};

// The tp sources that are u32 words (the others, "peers" and "flag", are pointers).
bool tp_is_u32(const ProgramArg& a) {
  return a.from == From::tp && (a.name == "rank" || a.name == "layer" || a.name == "timeout_us");
}

class StepBuilder {
 public:
  StepBuilder(std::string op, std::map<std::string, int64_t> params) { kernel_ = {std::move(op), std::move(params), ""}; }

  StepBuilder& io(const char* p, const char* field) { return put(p, From::io, field); }
  StepBuilder& weight(const char* p, const std::string& key) { return put(p, From::weight, key); }
  StepBuilder& expert_stride(const char* p, const std::string& key) { return put(p, From::expert_stride, key); }
  StepBuilder& ws(const char* p, uint64_t offset) { return put(p, From::workspace, "", offset); }
  // Workspace at `offset`, or the dp_layer_io field when `offset` is kNoScratch (tensor_parallel 1).
  StepBuilder& ws_or_io(const char* p, uint64_t offset, const char* field) {
    return offset == kNoScratch ? io(p, field) : ws(p, offset);
  }
  StepBuilder& kv(const char* p, const char* kind) { return put(p, From::kv, kind); }
  StepBuilder& kv_stride(const char* p, const char* kind) { return put(p, From::kv_stride, kind); }
  StepBuilder& f32(const char* p, double v) { return put(p, From::f32, "", 0, v); }
  // A kernel parameter set after construction (a fused form's switch).
  StepBuilder& param(const char* key, int64_t v) {
    kernel_.params[key] = v;
    return *this;
  }
  StepBuilder& u32(const char* p, int64_t v) { return put(p, From::u32, "", 0, static_cast<double>(v)); }
  StepBuilder& null(const char* p) { return put(p, From::null, ""); }
  StepBuilder& tp(const char* p, const char* what) { return put(p, From::tp, what); }
  StepBuilder& layer(const char* p) { return put(p, From::layer, ""); }

  // Orders the bindings by the kernel's signature and checks that they cover it exactly, with kinds
  // that fit and weights whose dtype is the parameter's; a mismatch is a bug in this file.
  ProgramStep finish(const LayerWeightsView& lw) {
    try {
      codegen::validate_instance(kernel_);
    } catch (const Error& e) {
      throw Unavailable{e.what()};
    }
    ProgramStep s;
    s.kernel = kernel_;
    s.name = codegen::kernel_name(kernel_);
    for (const codegen::KernelParam& p : codegen::kernel_signature(kernel_).params) {
      auto it = args_.find(p.name);
      if (it == args_.end()) fail(Errc::internal, "layer program: {}: parameter {} is not bound", s.name, p.name);
      const ProgramArg& a = it->second;
      const bool is_u32 = a.from == From::expert_stride || a.from == From::kv_stride || a.from == From::u32 ||
                          a.from == From::layer || (a.from == From::io && a.name == "block_table_stride") ||
                          tp_is_u32(a);
      const codegen::KernelParam::Kind want = a.from == From::f32 ? codegen::KernelParam::Kind::f32
                                              : is_u32            ? codegen::KernelParam::Kind::u32
                                                                  : codegen::KernelParam::Kind::pointer;
      if (want != p.kind || (a.from == From::null && !p.nullable))
        fail(Errc::internal, "layer program: {}: parameter {} bound from {} does not fit its kind", s.name, p.name,
             to_string(a.from));
      if (a.from == From::weight) {
        const WeightSpec& w = lw.get(a.name);
        const std::string dt = w.dtype == DType::F32       ? "fp32"
                               : w.dtype == DType::BF16    ? "bf16"
                               : w.dtype == DType::F8_E4M3 ? "e4m3"
                               : w.dtype == DType::U8      ? "u8"
                                                           : "?";
        if (!p.shape.ends_with(" " + dt)) {
          // An e4m3 weight where the op reads bf16 (a projection this version dequantises nowhere): no
          // program, with the reason; any other mismatch is a bug in this file.
          if (w.dtype == DType::F8_E4M3)
            throw Unavailable{fmt::format("FP8 weight {} is stored e4m3, but op {} reads its parameter {} as {} "
                                          "(no e4m3 form of that op in this version)",
                                          a.name, kernel_.op, p.name, p.shape)};
          fail(Errc::internal, "layer program: {}: parameter {} ({}) bound to {} of dtype {}", s.name, p.name, p.shape,
               a.name, dtype_name(w.dtype));
        }
      }
      s.args.push_back(a);
      args_.erase(it);
    }
    if (!args_.empty())
      fail(Errc::internal, "layer program: {}: binding {} names no parameter", s.name, args_.begin()->first);
    return s;
  }

  // The NCCL form of an allreduce step (format 1.8): ncclAllReduce of the kernel's [W, H] bf16 `partial`
  // into `out`, between kernels; the tp bindings (exchange buffers, wait bound) have no use there.
  ProgramStep nccl_allreduce() const {
    if (kernel_.op != "allreduce") fail(Errc::internal, "layer program: nccl_allreduce from a {} step", kernel_.op);
    ProgramStep s;
    s.collective = "nccl_allreduce";
    s.name = s.collective;
    s.kernel = {s.collective, {}, ""};
    s.elements = static_cast<uint64_t>(kernel_.params.at("W") * kernel_.params.at("H"));
    ProgramArg send = args_.at("partial"), recv = args_.at("out");
    send.param = "send";
    recv.param = "recv";
    s.args = {send, recv};
    return s;
  }

 private:
  StepBuilder& put(const char* p, From f, std::string name, uint64_t offset = 0, double value = 0) {
    args_[p] = ProgramArg{p, f, std::move(name), offset, value};
    return *this;
  }
  codegen::KernelInstance kernel_;
  std::map<std::string, ProgramArg> args_;
};

// moe_down's split grid (SK): its blocks (two per SM of a 132-SM H200), and the rows (W x q) from which
// the bf16 and e4m3 forms take it. The MXFP4 latent sum never does (slower at K3's 224 tiles).
constexpr int64_t kSplitBlocks = 264;
constexpr int64_t kSplitFromRows = 8;

// Split-KV partitions per request: about 256 blocks (two per SM of a 132-SM H200) at this width, at
// most 64 splits (every split's partials are merged again by each mla_combine block of the head).
// mla_attn's blocks take 16 query rows (draft position, head) of one request each.
int64_t mla_splits(int64_t width, int64_t q, int64_t heads) {
  const int64_t blocks = width * ((q * heads + 15) / 16);
  int64_t ns = 1;
  while (ns < 64 && blocks * ns < 256) ns *= 2;
  return ns;
}

class Builder {
 public:
  Builder(const Model& m, const deploy::Deploy& d, LayerClass cls, int64_t width, const model::LayerSpec& l,
          uint64_t counter_reserve)
      : m_(m), d_(d), cls_(cls), w_(width), q_(d.q()), t_(width * d.q()), lw_(m, l, d.tensor_parallel),
        reserve_(counter_reserve) {
    ws_.top = counter_reserve;
  }

  LayerProgram build() {
    LayerProgram p;
    p.cls = cls_;
    p.width = w_;
    try {
      check_supported();
      const int64_t H = m_.hidden;
      x_ = ws_.take(t_ * H * 2);
      push(add_norm(0, "input_layernorm.weight")
               .io("hidden", "hidden").io("residual", "residual")
               .ws("out", x_).io("residual_out", "residual_out").f32("eps", m_.rms_norm_eps));
      a_ = ws_.take(t_ * H * 2);
      if (mixer() == Mixer::kda) kda(); else mla();
      x2_ = ws_.take(t_ * H * 2);
      push(add_norm(1, "post_attention_layernorm.weight")
               .ws("hidden", a_).io("residual", "residual_out")
               .ws("out", x2_).io("residual_out", "residual_out").f32("eps", m_.rms_norm_eps));
      if (ffn() == Ffn::dense)
        dense();
      else if (ffn() == Ffn::latent_moe)
        latent_moe();
      else if (m_.moe.expert_format == model::ExpertFormat::mxfp4)
        moe_mxfp4();
      else
        moe();
      p.steps = std::move(steps_);
      p.workspace = ws_.top;
      p.counter_bytes = ws_.counters;
      if (reserve_ > 0 && ws_.counters > reserve_)
        fail(Errc::internal, "layer program {} at width {}: {} bytes of counter words, {} reserved", to_string(cls_), w_,
             ws_.counters, reserve_);
    } catch (const Unavailable& u) {
      p.steps.clear();
      p.workspace = 0;
      p.unavailable = u.why;
    }
    return p;
  }

 private:
  Mixer mixer() const {
    return cls_ == LayerClass::kda_dense || cls_ == LayerClass::kda_moe || cls_ == LayerClass::kda_latent_moe
               ? Mixer::kda : Mixer::mla;
  }
  Ffn ffn() const {
    if (cls_ == LayerClass::kda_dense || cls_ == LayerClass::mla_dense) return Ffn::dense;
    if (cls_ == LayerClass::kda_latent_moe || cls_ == LayerClass::mla_latent_moe) return Ffn::latent_moe;
    return Ffn::moe;
  }

  void check_supported() const {
    // FP8 weights are read by the ops' e4m3 forms (Q8); a weight bound to an op without one makes the
    // step Unavailable (StepBuilder::finish), and so do matrices of one op stored differently (fp8()).
    if (m_.quant.method == model::QuantMethod::fp8_block &&
        (m_.quant.block.size() != 2 || m_.quant.block[0] != 128 || m_.quant.block[1] != 128))
      throw Unavailable{fmt::format("FP8 blocks of {}: the kernels read 128x128 blocks", model::describe(m_.quant))};
    // Kimi-K3: the mixers (full-rank safe-gate KDA, q-LoRA MLA with the output gate), the dense SiTU FFN,
    // the latent MoE and the block attention residuals (attnres, add_norm) have programs.
    // MXFP4 experts are read by the Q4 forms of moe_up / moe_down, which have no shared expert: the
    // latent MoE (latent_moe) and the plain MoE over MXFP4 experts (moe_mxfp4) run it apart.
    if (t_ > 32)
      throw Unavailable{fmt::format("width {} x q {} = {} rows: the skinny GEMMs hold at most 32 rows", w_, q_, t_)};
    if (mixer() == Mixer::kda) {
      if (d_.kda_state.layout != deploy::KdaStateLayout::kv)
        throw Unavailable{"kda_state.layout \"vk\": the KDA kernel reads the k-major \"kv\" layout"};
      if (d_.conv_state.layout != deploy::ConvStateLayout::sd || d_.conv_state.dtype != deploy::ConvStateDtype::bf16)
        throw Unavailable{fmt::format("conv_state {} {}: the KDA kernel reads bf16 \"sd\" conv states",
                                      deploy::to_string(d_.conv_state.dtype), deploy::to_string(d_.conv_state.layout))};
    } else {
      if (d_.kv_cache.dtype != deploy::KvCacheDtype::bf16)
        throw Unavailable{"kv_cache.dtype fp8: the MLA kernels read bf16 latent caches"};
      if (d_.dcp.size > 1)
        throw Unavailable{fmt::format("dcp.size {}: decode context parallelism has no layer program yet", d_.dcp.size)};
      if (m_.indexer.present())
        throw Unavailable{"MLA with a sparse-attention indexer: the decode kernels attend densely, which differs from "
                          "top-k sparse attention once a context exceeds index_topk; no program until sparse MLA exists"};
    }
  }

  // The fused residual add + RMSNorm that opens each half of the layer (stage 0: input_layernorm, 1:
  // post_attention_layernorm), with its norm weight bound; the caller binds hidden, residual, out,
  // residual_out and eps. Plain residual: rmsnorm. K3 block attention residuals (attn_res_block B > 0):
  // attnres, which mixes the stored blocks of the step's attn_res buffer with the partial sum p (the
  // residual), with the half's *_res_norm / *_res_proj weights, pushes p as a new block when the
  // layer's index is a multiple of B (stage 0 only; the index comes from the layer source, since one
  // program serves every layer of its class) and norms the mix. The layer's output pair stays vLLM's:
  // hidden = the FFN output, residual = p, which the next layer's attnres adds.
  StepBuilder add_norm(int64_t stage, const char* norm) const {
    const int64_t B = m_.attn_res_block;
    if (B == 0) {
      StepBuilder b("rmsnorm", {{"W", t_}, {"H", m_.hidden}});
      b.weight("weight", norm);
      return b;
    }
    const std::string res = stage == 0 ? "self_attention" : "mlp";
    StepBuilder b("attnres", {{"W", t_}, {"H", m_.hidden}, {"B", B}, {"NB", (m_.num_layers + B - 1) / B},
                              {"S", stage}});
    b.kv("blocks", "attn_res").kv_stride("stride_blocks", "attn_res").layer("layer")
        .weight("res_norm", res + "_res_norm.weight").weight("res_proj", res + "_res_proj.weight")
        .weight("weight", norm);
    return b;
  }

  void push(StepBuilder& b) { steps_.push_back(b.finish(lw_)); }
  void push(StepBuilder&& b) { push(b); }

  // FP8: whether the weight `key` is stored e4m3 (its scales are the weight "<module>.weight_scale_inv").
  bool fp8(const std::string& key) const {
    return lw_.get(key).quant.method == model::QuantMethod::fp8_block && !lw_.get(key).quant.excluded;
  }
  static std::string scale_key(const std::string& key) { return key.substr(0, key.size() - 7) + ".weight_scale_inv"; }
  // Whether the matrices of one op are all e4m3 (1) or all not (0); mixed ones have no kernel.
  int64_t fp8_all(const char* what, std::initializer_list<std::string> keys) const {
    int64_t n = 0;
    for (const std::string& k : keys) n += fp8(k) ? 1 : 0;
    if (n != 0 && n != static_cast<int64_t>(keys.size()))
      throw Unavailable{fmt::format("{}: {} of its {} matrices are FP8 (e4m3) and the rest not; the kernel reads all "
                                    "of one op's matrices in one format", what, n, keys.size())};
    return n ? 1 : 0;
  }
  // Binds weight `key` to parameter `param` and, e4m3, its scales to `param`_scale.
  void bind_weight(StepBuilder& b, const char* param, const std::string& key) {
    b.weight(param, key);
    if (fp8(key)) b.weight((std::string(param) + "_scale").c_str(), scale_key(key));
  }
  // The gemm of up to six weights over one input: NA..NF from their rows, Q8 from their storage.
  // add: the output plus a bf16 addend (AD = 1, parameter "add").
  StepBuilder gemm(int64_t k, const std::vector<std::string>& keys, bool f32 = false, bool add = false) {
    static const char* seg[6] = {"NA", "NB", "NC", "ND", "NE", "NF"};
    static const char* par[6] = {"w0", "w1", "w2", "w3", "w4", "w5"};
    std::map<std::string, int64_t> params{{"W", t_}, {"K", k}, {"F", f32 ? 1 : 0}};
    if (add) params["AD"] = 1;
    int64_t q8 = 0;
    for (size_t i = 0; i < 6; ++i) {
      params[seg[i]] = i < keys.size() ? lw_.rows(keys[i]) : 0;
      if (i < keys.size() && fp8(keys[i])) q8 |= int64_t{1} << i;
    }
    if (q8) params["Q8"] = q8;
    StepBuilder b("gemm", std::move(params));
    for (size_t i = 0; i < keys.size(); ++i) bind_weight(b, par[i], keys[i]);
    return b;
  }

  void kda() {
    const model::KdaConfig& k = m_.kda;
    const int64_t H = m_.hidden, NH = k.num_heads / d_.tensor_parallel, D = k.head_dim, P = NH * D;
    // The output gate: low-rank g_a (f_a's width, expanded by g_b inside kda_step), or K3's full-rank g_proj,
    // whose P columns the gemm writes directly (GR = 0).
    const std::string g_key = k.full_rank_gate ? "self_attn.g_proj.weight" : "self_attn.g_a_proj.weight";
    const int64_t FR = lw_.rows("self_attn.f_a_proj.weight"), GW = lw_.rows(g_key), GR = k.full_rank_gate ? 0 : GW;
    const int64_t NP = 3 * P + FR + GW + NH;
    const uint64_t proj = ws_.take(t_ * NP * 2), o = ws_.take(t_ * P * 2);
    push(gemm(H, {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                  "self_attn.f_a_proj.weight", g_key, "self_attn.b_proj.weight"})
             .ws("x", x_).ws("out", proj));
    const bool onorm_f32 = lw_.get("self_attn.o_norm.weight").dtype == DType::F32;
    // K3 keeps A_log whole on every rank (more entries than heads): at tensor_parallel > 1 the kernel finds
    // the rank's heads at rank*NH (AR); Kimi-Linear's A_log is sharded by heads like the other tensors.
    const bool a_log_whole = lw_.get("self_attn.A_log").split.kind == model::Split::Kind::replicated;
    std::map<std::string, int64_t> kp{{"W", w_}, {"Q", q_}, {"NH", NH}, {"D", D}, {"CV", k.conv_kernel}, {"FR", FR},
                                      {"GR", GR}, {"SG", k.gate_lower_bound ? 1 : 0}, {"ON", onorm_f32 ? 1 : 0}};
    if (a_log_whole && sharded()) kp["AR"] = 1;
    StepBuilder step("kda_step", kp);
    step.ws("proj", proj).weight("w_fb", "self_attn.f_b_proj.weight")
        .weight("conv_wq", "self_attn.q_conv1d.weight").weight("conv_wk", "self_attn.k_conv1d.weight")
        .weight("conv_wv", "self_attn.v_conv1d.weight").weight("dt_bias", "self_attn.dt_bias")
        .weight("a_log", "self_attn.A_log").weight("o_norm", "self_attn.o_norm.weight")
        .kv("state", "kda_state").kv("conv_q", "conv_q").kv("conv_k", "conv_k").kv("conv_v", "conv_v")
        .kv_stride("state_stride", "kda_state").kv_stride("conv_stride", "conv_q")
        .io("slots", "state_indices").ws("out", o).f32("lower_bound", k.gate_lower_bound.value_or(0))
        .f32("onorm_eps", 1e-5);
    if (GR > 0) step.weight("w_gb", "self_attn.g_b_proj.weight"); else step.null("w_gb");
    if (q_ > 1) step.io("num_accepted", "num_accepted"); else step.null("num_accepted");
    if (kp.count("AR")) step.tp("rank", "rank");
    push(step);
    o_proj(P, o);
  }

  // The o-projection of the mixer output `o` ([t, k] bf16) into a_, summed over the ranks at
  // tensor_parallel > 1. The post-attention norm stays a separate launch: fused into this gemm as its
  // last block's tail (gemm NM 1) it measured slower on the H200 (bench/NOTES.md, 2026-12-05).
  void o_proj(int64_t k, uint64_t o) {
    push(gemm(k, {"self_attn.o_proj.weight"}).ws("x", o).ws("out", partial_of(a_)));
    reduce_into_ws(a_, 0);
  }

  void mla() {
    const model::MlaConfig& a = m_.mla;
    const int64_t H = m_.hidden, N = a.num_heads / d_.tensor_parallel, L = a.kv_lora_rank, R = a.qk_rope_head_dim;
    const int64_t PN = a.qk_nope_head_dim, V = a.v_head_dim, BS = d_.kv_cache.block_size;
    // One gemm over x: [q (QW) | kv (L+R) | g (N*V, K3 output gate)], or with q-LoRA (K3)
    // [q_a (QL) | kv | g], whose q_a columns are normalised (q_a_layernorm) and expanded by q_b_proj.
    const int64_t QW = N * (PN + R), QL = a.q_lora_rank, G = a.output_gate ? N * V : 0;
    const int64_t lead = QL > 0 ? QL : QW, row = lead + L + R + G;
    if ((lead * 2) % 16 != 0)
      throw Unavailable{fmt::format("MLA q width {} x 2 bytes is not a multiple of 16: the kv half of the fused "
                                    "projection output would be misaligned", lead)};
    const int64_t NS = mla_splits(w_, q_, N);
    const uint64_t qkv = ws_.take(t_ * row * 2), qabs = ws_.take(t_ * N * (L + R) * 2);
    const uint64_t part_o = ws_.take(w_ * NS * q_ * N * L * 4), part_ml = ws_.take(w_ * NS * q_ * N * 2 * 4);
    const uint64_t o = ws_.take(t_ * N * V * 2);
    const std::string q_key = QL > 0 ? "self_attn.q_a_proj.weight" : "self_attn.q_proj.weight";
    if (lw_.rows(q_key) != lead || lw_.rows("self_attn.kv_a_proj_with_mqa.weight") != L + R ||
        (QL > 0 && lw_.rows("self_attn.q_b_proj.weight") != QW) || (G > 0 && lw_.rows("self_attn.g_proj.weight") != G))
      fail(Errc::internal, "layer program: MLA projection rows differ from the config's head geometry");
    std::vector<std::string> keys{q_key, "self_attn.kv_a_proj_with_mqa.weight"};
    if (G > 0) keys.push_back("self_attn.g_proj.weight");
    push(gemm(H, keys).ws("x", x_).ws("out", qkv));
    uint64_t q = qkv;  // the q rows mla_prep reads, stride_q elements apart
    int64_t stride_q = row;
    if (QL > 0) {
      // q = W_qb RMSNorm(q_a): the norm reads the q_a columns of the fused rows (S = row) and writes
      // dense rows; its residual_out (a copy of q_a, there is no residual) goes to scratch nobody reads.
      const uint64_t qn = ws_.take(t_ * QL * 2), q_copy = ws_.take(t_ * QL * 2);
      q = ws_.take(t_ * QW * 2);
      stride_q = QW;
      push(StepBuilder("rmsnorm", {{"W", t_}, {"H", QL}, {"S", row}})
               .ws("hidden", qkv).null("residual").weight("weight", "self_attn.q_a_layernorm.weight")
               .ws("out", qn).ws("residual_out", q_copy).f32("eps", m_.rms_norm_eps));
      push(gemm(QL, {"self_attn.q_b_proj.weight"}).ws("x", qn).ws("out", q));
    }
    const std::string kv_b = "self_attn.kv_b_proj.weight";
    std::map<std::string, int64_t> prep{{"W", w_}, {"Q", q_}, {"N", N}, {"L", L}, {"R", R}, {"PN", PN}, {"V", V},
                                        {"BS", BS}};
    if (fp8(kv_b)) prep["Q8"] = 1;
    StepBuilder ps("mla_prep", prep);
    ps.ws("q", q).u32("stride_q", stride_q).ws("kv", qkv + static_cast<uint64_t>(lead) * 2).u32("stride_kv", row)
        .weight("kv_norm_w", "self_attn.kv_a_layernorm.weight")
        .io("seq_lens", "seq_lens").io("slot_mapping", "slot_mapping").kv("cache", "mla_latent")
        .kv_stride("cache_stride", "mla_latent").ws("q_abs", qabs).f32("eps", m_.rms_norm_eps);
    bind_weight(ps, "kv_b", kv_b);
    push(ps);
    push(StepBuilder("mla_attn", {{"W", w_}, {"Q", q_}, {"N", N}, {"L", L}, {"R", R}, {"BS", BS}, {"NS", NS}})
             .ws("q_abs", qabs).kv("cache", "mla_latent").kv_stride("cache_stride", "mla_latent")
             .io("block_table", "block_table").io("stride_bt", "block_table_stride").io("seq_lens", "seq_lens")
             .ws("part_o", part_o).ws("part_ml", part_ml).f32("scale", 1.0 / std::sqrt(static_cast<double>(PN + R))));
    std::map<std::string, int64_t> comb{{"W", w_}, {"Q", q_}, {"N", N}, {"L", L}, {"PN", PN}, {"V", V}, {"NS", NS},
                                        {"OG", G > 0 ? 1 : 0}};
    if (fp8(kv_b)) comb["Q8"] = 1;
    StepBuilder cs("mla_combine", comb);
    cs.ws("part_o", part_o).ws("part_ml", part_ml).io("seq_lens", "seq_lens").ws("out", o);
    if (G > 0)
      cs.ws("gate", qkv + static_cast<uint64_t>(lead + L + R) * 2).u32("stride_g", row);
    else
      cs.null("gate").u32("stride_g", 0);
    bind_weight(cs, "kv_b", kv_b);
    push(cs);
    o_proj(N * V, o);
  }

  void dense() {
    const int64_t H = m_.hidden, I = lw_.rows("mlp.gate_proj.weight");
    const uint64_t h = ws_.take(t_ * I * 2);
    const int64_t act = m_.activation == model::Activation::situ ? 1 : 0;
    std::map<std::string, int64_t> upp{{"W", t_}, {"D", H}, {"I", I}, {"ACT", act}};
    if (fp8_all("the dense MLP's gate/up", {"mlp.gate_proj.weight", "mlp.up_proj.weight"})) upp["Q8"] = 1;
    StepBuilder up("mlp_up", upp);
    up.ws("x", x2_).ws("h", h);
    bind_weight(up, "w_gate", "mlp.gate_proj.weight");
    bind_weight(up, "w_up", "mlp.up_proj.weight");
    if (act) up.f32("act_beta", m_.situ_beta).f32("act_linear_beta", m_.situ_linear_beta);
    push(up);
    push(gemm(I, {"mlp.down_proj.weight"}).ws("x", h).ws_or_io("out", partial_of_out(), "out"));
    reduce_into_out();
  }

  // The router logits ([t, E] fp32 at `logits`) and the routing: top-k ids and weights, the used experts
  // and each one's slot per row. One launch: the router gemm with the routing fused (TK, TR; its last
  // block runs moe_route over the logits), with its own block counter in the workspace.
  void router(int64_t h, uint64_t logits, uint64_t ids, uint64_t tw, uint64_t experts, uint64_t slots) {
    const model::MoeConfig& e = m_.moe;
    StepBuilder g = gemm(h, {"block_sparse_moe.gate.weight"}, /*f32=*/true);
    g.param("TK", e.top_k).param("TR", e.renormalize ? 1 : 0);
    g.ws("x", x2_).ws("out", logits).weight("bias", "block_sparse_moe.gate.e_score_correction_bias")
        .ws("topk_ids", ids).ws("topk_weights", tw).ws("experts", experts).ws("expert_slots", slots)
        .ws("done", ws_.counter(4));
    push(g);
  }

  void moe() {
    const model::MoeConfig& e = m_.moe;
    const int64_t H = m_.hidden, E = e.num_experts, K = e.top_k;
    const std::string ex = "block_sparse_moe.experts.{e}.";
    const int64_t I = lw_.rows(ex + "w1.weight");
    const bool shared = lw_.find("block_sparse_moe.shared_experts.gate_proj.weight") != nullptr;
    const int64_t S = shared ? lw_.rows("block_sparse_moe.shared_experts.gate_proj.weight") : 0;
    const int64_t U = std::min(E, t_ * K), act = m_.activation == model::Activation::situ ? 1 : 0;
    const uint64_t logits = ws_.take(t_ * E * 4), ids = ws_.take(t_ * K * 4), tw = ws_.take(t_ * K * 4);
    const uint64_t experts = ws_.take((1 + U) * 4), slots = ws_.take(U * t_ * 4);
    const uint64_t h = ws_.take(t_ * K * I * 2), hs = ws_.take(t_ * std::max<int64_t>(S, 1) * 2);
    router(H, logits, ids, tw, experts, slots);
    const std::string sh = "block_sparse_moe.shared_experts.";
    const int64_t q8 = shared ? fp8_all("the MoE experts", {ex + "w1.weight", ex + "w3.weight", ex + "w2.weight",
                                                             sh + "gate_proj.weight", sh + "up_proj.weight",
                                                             sh + "down_proj.weight"})
                              : fp8_all("the MoE experts", {ex + "w1.weight", ex + "w3.weight", ex + "w2.weight"});
    std::map<std::string, int64_t> upp{{"W", t_}, {"D", H}, {"I", I}, {"E", E}, {"K", K}, {"S", S}, {"ACT", act}};
    if (q8) upp["Q8"] = 1;
    StepBuilder up("moe_up", upp);
    up.ws("x", x2_).expert_stride("stride_w1", ex + "w1.weight").expert_stride("stride_w3", ex + "w3.weight")
        .ws("experts", experts).ws("expert_slots", slots).ws("h", h).ws("hs", hs);
    bind_weight(up, "w1", ex + "w1.weight");
    bind_weight(up, "w3", ex + "w3.weight");
    if (q8)
      up.expert_stride("stride_w1_scale", scale_key(ex + "w1.weight"))
          .expert_stride("stride_w3_scale", scale_key(ex + "w3.weight"));
    if (shared) {
      bind_weight(up, "shared_gate", sh + "gate_proj.weight");
      bind_weight(up, "shared_up", sh + "up_proj.weight");
    } else {
      up.null("shared_gate").null("shared_up");
      if (q8) up.null("shared_gate_scale").null("shared_up_scale");
    }
    if (act) up.f32("act_beta", m_.situ_beta).f32("act_linear_beta", m_.situ_linear_beta);
    push(up);
    std::map<std::string, int64_t> downp{{"W", t_}, {"D", H}, {"I", I}, {"E", E}, {"K", K}, {"S", S}};
    if (q8) downp["Q8"] = 1;
    StepBuilder down("moe_down", downp);
    down.ws("h", h).ws("hs", hs).expert_stride("stride_w2", ex + "w2.weight")
        .ws("experts", experts).ws("expert_slots", slots).ws("topk_weights", tw).ws_or_io("out", partial_of_out(), "out")
        .f32("routed_scaling", e.routed_scaling);
    bind_weight(down, "w2", ex + "w2.weight");
    if (q8) down.expert_stride("stride_w2_scale", scale_key(ex + "w2.weight"));
    if (shared) {
      bind_weight(down, "shared_down", sh + "down_proj.weight");
    } else {
      down.null("shared_down");
      if (q8) down.null("shared_down_scale");
    }
    // The split grid from 8 rows: measured a win there and a loss at one row (H200, 2026-12-05).
    if (t_ >= kSplitFromRows) split_grid(down, H);
    push(down);
    reduce_into_out();
  }

  // A plain MoE layer over MXFP4 experts (experts at the hidden width): the Q4 forms of moe_up /
  // moe_down (no shared expert) write the scaled routed sum to scratch; the shared expert runs apart
  // (mlp_up, then its down gemm with the routed sum as addend, AD = 1) into the layer output. Under
  // tensor parallelism both are this rank's partials, summed by the one allreduce (op 1) as in moe().
  void moe_mxfp4() {
    const model::MoeConfig& e = m_.moe;
    const int64_t H = m_.hidden, E = e.num_experts, K = e.top_k;
    const std::string ex = "block_sparse_moe.experts.{e}.", sh = "block_sparse_moe.shared_experts.";
    const int64_t I = lw_.rows(ex + "w1.weight_packed");
    if (I % e.mxfp4_group != 0)
      throw Unavailable{fmt::format("MXFP4 experts: this rank's intermediate width {} is not a multiple of {} (one "
                                    "scale per {} values of w2's rows)", I, e.mxfp4_group, e.mxfp4_group)};
    const bool shared = lw_.find(sh + "gate_proj.weight") != nullptr;
    const int64_t S = shared ? lw_.rows(sh + "gate_proj.weight") : 0;
    const int64_t U = std::min(E, t_ * K), act = m_.activation == model::Activation::situ ? 1 : 0;
    const uint64_t logits = ws_.take(t_ * E * 4), ids = ws_.take(t_ * K * 4), tw = ws_.take(t_ * K * 4);
    const uint64_t experts = ws_.take((1 + U) * 4), slots = ws_.take(U * t_ * 4);
    const uint64_t h = ws_.take(t_ * K * I * 2);
    router(H, logits, ids, tw, experts, slots);
    push(mxfp4_up(x2_, H, I, act, experts, slots, h));
    const uint64_t out = shared ? ws_.take(t_ * H * 2) : partial_of_out();  // the routed sum, or the output
    StepBuilder down = mxfp4_down(H, I, h, experts, slots, tw);
    down.ws_or_io("out", out, "out");
    push(down);
    if (shared) {
      const uint64_t hs = ws_.take(t_ * S * 2);
      push(shared_up(S, act, hs));
      push(gemm(S, {sh + "down_proj.weight"}, false, /*add=*/true)
               .ws("x", hs).ws("add", out).ws_or_io("out", partial_of_out(), "out"));
    }
    reduce_into_out();
  }

  // moe_up over MXFP4 routed experts (Q4, no shared expert) reading x [T, D].
  StepBuilder mxfp4_up(uint64_t x, int64_t D, int64_t I, int64_t act, uint64_t experts, uint64_t slots, uint64_t h) {
    const model::MoeConfig& e = m_.moe;
    const std::string ex = "block_sparse_moe.experts.{e}.";
    StepBuilder up("moe_up", {{"W", t_}, {"D", D}, {"I", I}, {"E", e.num_experts}, {"K", e.top_k}, {"S", 0},
                              {"ACT", act}, {"Q4", 1}});
    for (const char* w : {"w1", "w3"}) {
      const std::string packed = ex + w + ".weight_packed", scale = ex + w + ".weight_scale";
      const std::string p(w);
      up.weight(w, packed).weight((p + "_scale").c_str(), scale).expert_stride(("stride_" + p).c_str(), packed)
          .expert_stride(("stride_" + p + "_scale").c_str(), scale);
    }
    up.ws("x", x).ws("experts", experts).ws("expert_slots", slots).ws("h", h);
    if (act) up.f32("act_beta", m_.situ_beta).f32("act_linear_beta", m_.situ_linear_beta);
    return up;
  }
  // moe_down over MXFP4 routed experts (Q4) writing the scaled routed sum [T, D]; "out" left to the caller.
  StepBuilder mxfp4_down(int64_t D, int64_t I, uint64_t h, uint64_t experts, uint64_t slots, uint64_t tw) {
    const model::MoeConfig& e = m_.moe;
    const std::string ex = "block_sparse_moe.experts.{e}.";
    StepBuilder down("moe_down",
                     {{"W", t_}, {"D", D}, {"I", I}, {"E", e.num_experts}, {"K", e.top_k}, {"S", 0}, {"Q4", 1}});
    down.ws("h", h).weight("w2", ex + "w2.weight_packed").weight("w2_scale", ex + "w2.weight_scale")
        .expert_stride("stride_w2", ex + "w2.weight_packed").expert_stride("stride_w2_scale", ex + "w2.weight_scale")
        .ws("experts", experts).ws("expert_slots", slots).ws("topk_weights", tw)
        .f32("routed_scaling", e.routed_scaling);
    return down;
  }
  // moe_down's split grid (SK): kSplitBlocks blocks share every tile's work evenly; each tile's sums meet
  // in the workspace (up to ceil(G / tiles) + 1 slots of [16, t] fp32) with a counter per tile.
  void split_grid(StepBuilder& down, int64_t D) {
    const int64_t tiles = (D + 15) / 16, tile_slots = (kSplitBlocks + tiles - 1) / tiles + 1;
    down.param("SK", kSplitBlocks).ws("partials", ws_.take(tiles * tile_slots * 16 * t_ * 4)).ws("done", ws_.counter(tiles * 4));
  }
  // The shared expert's gate/up (mlp_up over ws.x2) into hs [T, S].
  StepBuilder shared_up(int64_t S, int64_t act, uint64_t hs) {
    const std::string sh = "block_sparse_moe.shared_experts.";
    std::map<std::string, int64_t> sp{{"W", t_}, {"D", m_.hidden}, {"I", S}, {"ACT", act}};
    if (fp8_all("the shared expert's gate/up", {sh + "gate_proj.weight", sh + "up_proj.weight"})) sp["Q8"] = 1;
    StepBuilder su("mlp_up", sp);
    su.ws("x", x2_).ws("h", hs);
    bind_weight(su, "w_gate", sh + "gate_proj.weight");
    bind_weight(su, "w_up", sh + "up_proj.weight");
    if (act) su.f32("act_beta", m_.situ_beta).f32("act_linear_beta", m_.situ_linear_beta);
    return su;
  }

  // K3 latent MoE (model-family.md 3c): the routed experts run in the latent width D; the shared expert
  // at full width on x2; out = up_lat(norm(latent sum)) + shared(x2). MXFP4 experts (the K3 checkpoints'
  // packed U8 codes + U8 E8M0 scales) go to the Q4 forms of moe_up / moe_down, bf16 ones to the plain
  // forms, both without a shared expert (S = 0). The latent sum [T, D] and the shared expert's output
  // [T, H] sit side by side in one buffer, so that at tensor_parallel > 1 a single allreduce (op 1,
  // row length D + H over the flat [T, D] + [T, H] pair) sums both: the all-reduces of a layer stay one
  // after the o-projection and one after the FFN, alternating the exchange buffer's halves as
  // allreduce.h requires. The latent up-projection is replicated: it reads the summed, normalised
  // latent and adds the summed shared output in its epilogue (gemm AD = 1), writing the layer output on
  // every rank.
  void latent_moe() {
    const model::MoeConfig& e = m_.moe;
    const int64_t H = m_.hidden, E = e.num_experts, K = e.top_k, D = e.latent_dim;
    const bool q4 = e.expert_format == model::ExpertFormat::mxfp4;
    const std::string ex = "block_sparse_moe.experts.{e}.", sh = "block_sparse_moe.shared_experts.";
    const std::string w1 = ex + (q4 ? "w1.weight_packed" : "w1.weight");
    const std::string w3 = ex + (q4 ? "w3.weight_packed" : "w3.weight");
    const std::string w2 = ex + (q4 ? "w2.weight_packed" : "w2.weight");
    const int64_t I = lw_.rows(w1);  // this rank's shard of the expert intermediate width
    if (q4 && I % e.mxfp4_group != 0)
      throw Unavailable{fmt::format("MXFP4 experts: this rank's intermediate width {} is not a multiple of {} (one "
                                    "scale per {} values of w2's rows)", I, e.mxfp4_group, e.mxfp4_group)};
    const bool shared = lw_.find(sh + "gate_proj.weight") != nullptr;
    const int64_t S = shared ? lw_.rows(sh + "gate_proj.weight") : 0;
    const int64_t U = std::min(E, t_ * K), act = m_.activation == model::Activation::situ ? 1 : 0;
    const uint64_t logits = ws_.take(t_ * E * 4), ids = ws_.take(t_ * K * 4), tw = ws_.take(t_ * K * 4);
    const uint64_t experts = ws_.take((1 + U) * 4), slots = ws_.take(U * t_ * 4);
    const uint64_t lat = ws_.take(t_ * D * 2), h = ws_.take(t_ * K * I * 2);
    // [T, D] latent sum, then [T, H] shared expert output (the all-reduced pair at tensor_parallel > 1).
    const uint64_t sums = ws_.take(t_ * (D + (shared ? H : 0)) * 2);
    const uint64_t shared_out = sums + static_cast<uint64_t>(t_ * D * 2);
    router(H, logits, ids, tw, experts, slots);
    push(gemm(H, {"block_sparse_moe.routed_expert_down_proj.weight"}).ws("x", x2_).ws("out", lat));

    if (q4) {
      push(mxfp4_up(lat, D, I, act, experts, slots, h));
      StepBuilder down = mxfp4_down(D, I, h, experts, slots, tw);
      down.ws("out", sums);
      push(down);
    } else {
      StepBuilder up("moe_up", {{"W", t_}, {"D", D}, {"I", I}, {"E", E}, {"K", K}, {"S", 0}, {"ACT", act}});
      up.ws("x", lat).weight("w1", w1).weight("w3", w3).expert_stride("stride_w1", w1).expert_stride("stride_w3", w3)
          .ws("experts", experts).ws("expert_slots", slots).ws("h", h).null("shared_gate").null("shared_up").null("hs");
      if (act) up.f32("act_beta", m_.situ_beta).f32("act_linear_beta", m_.situ_linear_beta);
      push(up);
      push(StepBuilder("moe_down", {{"W", t_}, {"D", D}, {"I", I}, {"E", E}, {"K", K}, {"S", 0}})
               .ws("h", h).weight("w2", w2).expert_stride("stride_w2", w2).ws("experts", experts)
               .ws("expert_slots", slots).ws("topk_weights", tw).ws("out", sums)
               .f32("routed_scaling", e.routed_scaling).null("hs").null("shared_down"));
    }
    if (shared) {
      const uint64_t hs = ws_.take(t_ * S * 2);
      push(shared_up(S, act, hs));
      push(gemm(S, {sh + "down_proj.weight"}).ws("x", hs).ws("out", shared_out));
    }
    if (sharded()) {
      StepBuilder b("allreduce", {{"W", t_}, {"H", D + (shared ? H : 0)}, {"R", d_.tensor_parallel}});
      b.ws("partial", sums).ws("out", sums).tp("peers", "peers").tp("flag", "flag").tp("rank", "rank")
          .tp("layer", "layer").u32("op", 1).tp("timeout_us", "timeout_us");
      push_allreduce(b);
    }
    uint64_t normed = sums;
    if (e.latent_norm) {
      normed = ws_.take(t_ * D * 2);
      const uint64_t copy = ws_.take(t_ * D * 2);  // residual_out of a norm without a residual: unused copy
      push(StepBuilder("rmsnorm", {{"W", t_}, {"H", D}})
               .ws("hidden", sums).null("residual").weight("weight", "block_sparse_moe.routed_expert_norm.weight")
               .ws("out", normed).ws("residual_out", copy).f32("eps", m_.rms_norm_eps));
    }
    StepBuilder upl = gemm(D, {"block_sparse_moe.routed_expert_up_proj.weight"});
    upl.ws("x", normed).io("out", "out");
    if (shared) {
      upl = gemm(D, {"block_sparse_moe.routed_expert_up_proj.weight"}, false, /*add=*/true);
      upl.ws("x", normed).io("out", "out").ws("add", shared_out);
    }
    push(upl);
  }

  // ---- Tensor parallelism ----------------------------------------------------------------------------
  // At tensor_parallel > 1 the o-projection and the FFN's down projection read the rank's shard of
  // their input dimension, so they yield this rank's partial sum of the layer's output. It goes to
  // scratch, and an allreduce step sums every rank's partial into the output, before the next fused
  // residual add + RMSNorm adds the residual: the residual stream is added once (vLLM's order), and
  // every rank then holds the same full hidden and residual rows. At tensor_parallel 1 the projection
  // writes the output directly and no step is added.
  bool sharded() const { return d_.tensor_parallel > 1; }
  // Where the projection writes: `dst` at TP 1, else a fresh [t, H] bf16 partial buffer.
  uint64_t partial_of(uint64_t dst) {
    partial_ = sharded() ? ws_.take(t_ * m_.hidden * 2) : dst;
    return partial_;
  }
  // The same for the layer output (dp_layer_io "out"): kNoScratch at TP 1.
  uint64_t partial_of_out() {
    partial_ = sharded() ? ws_.take(t_ * m_.hidden * 2) : kNoScratch;
    return partial_;
  }
  // The all-reduce path of this width (the deploy's `allreduce`): the in-kernel allreduce step, or the
  // same sum as an NCCL collective step between kernels.
  void push_allreduce(StepBuilder& b) {
    if (d_.allreduce(w_) == format::Allreduce::nccl) steps_.push_back(b.nccl_allreduce());
    else push(b);
  }
  void push_allreduce(StepBuilder&& b) { push_allreduce(b); }
  StepBuilder allreduce(int64_t op) const {
    StepBuilder b("allreduce", {{"W", t_}, {"H", m_.hidden}, {"R", d_.tensor_parallel}});
    b.ws("partial", partial_).tp("peers", "peers").tp("flag", "flag").tp("rank", "rank").tp("layer", "layer")
        .u32("op", op).tp("timeout_us", "timeout_us");
    return b;
  }
  void reduce_into_ws(uint64_t dst, int64_t op) {
    if (sharded()) push_allreduce(allreduce(op).ws("out", dst));
  }
  void reduce_into_out() {
    if (sharded()) push_allreduce(allreduce(1).io("out", "out"));
  }

  const Model& m_;
  const deploy::Deploy& d_;
  LayerClass cls_;
  int64_t w_, q_, t_;
  LayerWeightsView lw_;
  Scratch ws_;
  uint64_t reserve_ = 0;  // bytes of counter words below every program's scratch
  uint64_t x_ = 0, a_ = 0, x2_ = 0, partial_ = 0;
  std::vector<ProgramStep> steps_;
};

}  // namespace

LayerProgram layer_program(const Model& m, const deploy::Deploy& d, LayerClass cls, int64_t width,
                           uint64_t counter_reserve) {
  const model::LayerSpec* first = nullptr;
  for (const model::LayerSpec& l : m.layers)
    if (layer_class(l) == cls) {
      first = &l;
      break;
    }
  if (!first) fail(Errc::internal, "layer program for class {}: the model has no layer of it", to_string(cls));
  LayerProgram p = Builder(m, d, cls, width, *first, counter_reserve).build();
  // Every layer of the class must hold the same weights (by key, dtype and shape) as the first.
  for (const model::LayerSpec& l : m.layers) {
    if (layer_class(l) != cls || &l == first) continue;
    const LayerWeightsView a(m, *first, d.tensor_parallel), b(m, l, d.tensor_parallel);
    for (const ProgramStep& s : p.steps)
      for (const ProgramArg& arg : s.args) {
        if (arg.from != From::weight) continue;
        const WeightSpec* wb = b.find(arg.name);
        if (!wb || wb->dtype != a.get(arg.name).dtype || b.shape(arg.name) != a.shape(arg.name))
          fail(Errc::input, "{}: layer {} ({}) {} weight {} differs from layer {}'s: layers of one class must hold equal "
               "weights", m.config_source, l.index, to_string(cls), wb ? "has a" : "lacks the",
               LayerWeightsView::group_key(arg.name), first->index);
      }
  }
  return p;
}

}  // namespace dp::plan
