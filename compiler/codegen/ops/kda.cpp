// kda_step (templates/kda.h): the KDA recurrent step of every head and request in one launch.
#include "codegen/ops/spec.h"

#include <algorithm>

#include <fmt/format.h>

#include "common/error.h"

namespace dp::codegen::ops {
namespace {

// The one-block-per-head form reads its state, conv history and weights before the dependency wait
// (templates/kda.h, kEarly): none of them is written by the kernels before it in a step.
bool kda_early(const Params& p) { return !p.at("VS"); }

}  // namespace

std::vector<OpSpec> kda_ops() {
  std::vector<OpSpec> ops{
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
           {"ON", "on", 0, 1, "1: o_norm weight is fp32, 0: bf16"},
           {"AR", "ar", 0, 1, "1: a_log is the whole replicated A_log, head j of rank `rank` at rank*NH + j (K3 "
            "at tensor_parallel > 1)", true},
           {"VS", "vs", 0, 4, "value splits: 2 or 4 blocks per head and request, each owning D/VS state columns, "
            "the head's last one normalising (Q = 1); 0: one block", true}},
          [](const Params& p, const std::string& who) {
            if (p.at("D") % 64 != 0)
              fail(Errc::input, "{}: parameter D = {} is not a multiple of 64 (valid: 64, 128, 192, 256)", who,
                   p.at("D"));
            check_multiple_of_8(p, who, {"FR", "GR"});
            if (p.at("VS") == 1 || p.at("VS") == 3)
              fail(Errc::input, "{}: parameter VS = {}: 0 (one block per head), 2 or 4", who, p.at("VS"));
            if (p.at("VS") && p.at("Q") != 1)
              fail(Errc::input, "{}: parameter VS = {} needs one row per request (Q = {}: the draft positions' conv "
                   "states would be written before every split read them)", who, p.at("VS"), p.at("Q"));
            if (p.at("VS") && (p.at("D") / p.at("VS")) % 32 != 0)
              fail(Errc::input, "{}: parameter VS = {} splits D = {} into {} columns, not whole groups of 32", who,
                   p.at("VS"), p.at("D"), p.at("D") / p.at("VS"));
          },
          [](const Params& p) {
            std::vector<int64_t> a{p.at("W"),  p.at("Q"),  p.at("NH"), p.at("D"), p.at("CV"),
                                   p.at("FR"), p.at("GR"), p.at("SG"), p.at("ON")};
            a.push_back(p.at("AR"));
            a.push_back(std::max<int64_t>(p.at("VS"), 1));
            if (kda_early(p)) a.push_back(1);  // dp_kda_step's kEarly
            return a;
          },
          [](const Params& p) {
            const int64_t W = p.at("W"), Q = p.at("Q"), NH = p.at("NH"), D = p.at("D"), P = NH * D;
            const int64_t NP = 3 * P + p.at("FR") + (p.at("GR") > 0 ? p.at("GR") : P) + NH;
            const std::string conv_slot = fmt::format("[{}, {}]", p.at("CV") - 1, P);
            std::vector<ArgSpec> a{
                {"proj", KernelParam::Kind::pointer, "const dp_bf16*", shape({W * Q, NP}, "bf16"),
                 "projections, columns q | k | v | f_a | g_a (g when GR = 0) | b"},
                {"w_fb", KernelParam::Kind::pointer, "const dp_bf16*", shape({P, p.at("FR")}, "bf16"), "f_b_proj"},
                {"w_gb", KernelParam::Kind::pointer, "const dp_bf16*", shape({P, p.at("GR")}, "bf16"),
                 "g_b_proj (null when GR = 0)", true},
                {"conv_wq", KernelParam::Kind::pointer, "const float*", shape({P, p.at("CV")}, "fp32"), "q_conv1d"},
                {"conv_wk", KernelParam::Kind::pointer, "const float*", shape({P, p.at("CV")}, "fp32"), "k_conv1d"},
                {"conv_wv", KernelParam::Kind::pointer, "const float*", shape({P, p.at("CV")}, "fp32"), "v_conv1d"},
                {"dt_bias", KernelParam::Kind::pointer, "const float*", shape({P}, "fp32"), "dt_bias"},
                {"a_log", KernelParam::Kind::pointer, "const float*",
                 p.at("AR") ? "[A_log size] fp32" : shape({NH}, "fp32"),
                 p.at("AR") ? "the whole A_log; this rank's heads at rank*NH" : "A_log of this rank's heads"},
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
            if (p.at("AR"))
              a.push_back({"rank", KernelParam::Kind::u32, "dp_u32", "", "tensor-parallel rank: its heads' A_log entries "
                           "start at rank*NH"});
            if (p.at("VS")) {
              a.push_back({"o_part", KernelParam::Kind::pointer, "float*", shape({W, NH, D}, "fp32"),
                           "every block's o columns (scratch)"});
              a.push_back({"g_part", KernelParam::Kind::pointer, "float*", shape({W, NH, D}, "fp32"),
                           "every block's sigmoid(g) columns (scratch)"});
              a.push_back({"ss_part", KernelParam::Kind::pointer, "float*", shape({W, NH, p.at("VS")}, "fp32"),
                           "every block's sum of o^2 (scratch)"});
              a.push_back({"done", KernelParam::Kind::pointer, "dp_u32*", shape({W, NH}, "u32"),
                           "per head and request: blocks done (zero before the launch; left zero)"});
            }
            return a;
          },
          [](const Params& p) {
            LaunchShape s;
            s.grid[0] = static_cast<uint32_t>(p.at("NH") * std::max<int64_t>(p.at("VS"), 1));
            s.grid[1] = static_cast<uint32_t>(p.at("W"));
            s.block[0] = static_cast<uint32_t>(4 * p.at("D"));
            return s;
          },
          [](const Params& p) { return static_cast<uint32_t>(4 * p.at("D")); },
          "DP_KERNEL_BOUNDS",
          [](const Params& p) {
            // The split form's workspace follows `rank`, which is 0 when AR is not given.
            if (!p.at("VS")) return DeviceCall{};
            DeviceCall c;
            c.args = {"proj",   "w_fb",   "w_gb",         "conv_wq",   "conv_wk",     "conv_wv",    "dt_bias",
                      "a_log",  "o_norm", "state",        "conv_q",    "conv_k",      "conv_v",     "slots",
                      "num_accepted", "out", "lower_bound", "onorm_eps", "state_stride", "conv_stride",
                      p.at("AR") ? "rank" : "0u", "o_part", "g_part", "ss_part", "done"};
            return c;
          },
      },
  };
  ops[0].early_weights = kda_early;
  return ops;
}

}  // namespace dp::codegen::ops
