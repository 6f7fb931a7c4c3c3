// Shared by the GPU tests and the overhead program: a device session on the tiny bundle with every
// weight in its own device allocation (random final-norm weight), real KV caches, bf16 helpers and the
// CPU reference of the final norm (templates/norm.h's arithmetic).
#pragma once

#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cuda_test_driver.h"
#include "runtime_test_util.h"

namespace dp::gputest {

using rttest::outcome;
using rttest::Outcome;

inline uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// residual_out = bf16(hidden + residual); out = bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w), per row.
inline void final_norm_reference(const std::vector<uint16_t>& hidden, const std::vector<uint16_t>* residual,
                                 const std::vector<uint16_t>& weight, int rows, int h, float eps,
                                 std::vector<uint16_t>& out, std::vector<uint16_t>& residual_out) {
  out.assign(static_cast<size_t>(rows) * h, 0);
  residual_out.assign(static_cast<size_t>(rows) * h, 0);
  std::vector<float> x(h);
  for (int r = 0; r < rows; ++r) {
    double sumsq = 0;
    for (int k = 0; k < h; ++k) {
      const size_t i = static_cast<size_t>(r) * h + k;
      float v = from_bf16(hidden[i]);
      if (residual) v = from_bf16(to_bf16(v + from_bf16((*residual)[i])));
      x[k] = v;
      residual_out[i] = to_bf16(v);
      sumsq += static_cast<double>(v) * v;
    }
    const float scale = static_cast<float>(1.0 / std::sqrt(sumsq / h + eps));
    for (int k = 0; k < h; ++k)
      out[static_cast<size_t>(r) * h + k] = to_bf16(from_bf16(to_bf16(x[k] * scale)) * from_bf16(weight[k]));
  }
}

inline std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = to_bf16(d(rng));
  return v;
}

// The tensors of a safetensors checkpoint directory (every *.safetensors file): name -> raw bytes.
inline std::map<std::string, std::string> read_checkpoint(const std::filesystem::path& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    if (e.path().extension() != ".safetensors") continue;
    const std::string bytes = rttest::read_text(e.path());
    uint64_t n = 0;
    std::memcpy(&n, bytes.data(), 8);
    const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
    for (const auto& [name, t] : header.items()) {
      if (name == "__metadata__") continue;
      const uint64_t begin = t["data_offsets"][0], end = t["data_offsets"][1];
      out[name] = bytes.substr(8 + n + begin, end - begin);
    }
  }
  return out;
}

// A device session with everything bound and loaded; frees its allocations.
class DeviceSession {
 public:
  ~DeviceSession() {
    dp_session_destroy(s);
    dp_bundle_close(b);
    for (CUdeviceptr p : allocations) cu().MemFree(p);
  }

  // Returns "" or what failed.
  // `checkpoint`: when given, every weight gets its checkpoint bytes (TP 1: the whole tensor).
  std::string open(const std::string& bundle, uint32_t flags = 0, const std::map<std::string, std::string>* checkpoint = nullptr,
                   int64_t slots = 16, int64_t blocks = 16) {
    std::mt19937 rng(1234);
    if (Outcome o = outcome(dp_bundle_open(bundle.c_str(), nullptr, &b)); !o.ok()) return o.message;
    dp_session_options opt;
    dp_session_options_init(&opt);
    opt.device = 0;
    opt.flags = flags;
    if (Outcome o = outcome(dp_session_create(b, &opt, &s)); !o.ok()) return o.message;
    dp_bundle_info info;
    info.size = sizeof(info);
    if (Outcome o = outcome(dp_bundle_get_info(b, &info)); !o.ok()) return o.message;
    hidden = static_cast<int>(info.hidden_size);
    eps = static_cast<float>(info.rms_norm_eps);
    for (int32_t i = 0; i < info.num_widths; ++i) widths.push_back(info.widths[i]);
    num_layers = info.num_layers;

    for (int32_t i = 0; i < dp_bundle_weight_count(b, 0); ++i) {
      dp_weight_info w;
      w.size = sizeof(w);
      if (Outcome o = outcome(dp_bundle_get_weight(b, 0, i, &w)); !o.ok()) return o.message;
      size_t bytes = dp_dtype_size(w.dtype);
      for (int32_t d = 0; d < w.ndim; ++d) bytes *= static_cast<size_t>(w.shape[d]);
      dp_tensor t;
      dp_tensor_init(&t, 0, w.dtype, w.ndim, w.shape);
      auto upload = [&](CUdeviceptr dst, std::string name) {
        if (!checkpoint) return std::string();
        auto it = checkpoint->find(name);
        if (it == checkpoint->end() || it->second.size() != bytes) return "checkpoint lacks " + name + " of " + std::to_string(bytes) + " bytes";
        cu().MemcpyHtoD(dst, it->second.data(), bytes);
        return std::string();
      };
      if (w.experts == 0) {
        t.data = alloc(bytes);
        if (std::string(w.name) == "model.norm.weight") {
          norm_weight = random_bf16(static_cast<size_t>(w.shape[0]), rng, 0.5f, 1.5f);
          cu().MemcpyHtoD(t.data, norm_weight.data(), bytes);
        }
        if (std::string e = upload(t.data, w.name); !e.empty()) return e;
        bound[w.name] = t.data;
        if (checkpoint && std::string(w.name) == "model.norm.weight") {
          norm_weight.resize(static_cast<size_t>(w.shape[0]));
          std::memcpy(norm_weight.data(), checkpoint->at(w.name).data(), bytes);
        }
        if (Outcome o = outcome(dp_session_bind_weight(s, w.name, &t)); !o.ok()) return o.message;
      } else {
        // One stacked allocation per group, as vLLM's FusedMoE holds experts.
        const size_t stride = (bytes + 255) / 256 * 256;
        const CUdeviceptr base = alloc(stride * w.experts);
        std::vector<uint64_t> ptrs;
        for (int32_t e = 0; e < w.experts; ++e) {
          ptrs.push_back(base + e * stride);
          std::string name = w.name;
          name.replace(name.find("{e}"), 3, std::to_string(e));
          if (std::string err = upload(ptrs.back(), name); !err.empty()) return err;
          bound[name] = ptrs.back();
        }
        if (Outcome o = outcome(dp_session_bind_expert_weights(s, w.name, ptrs.data(), w.experts, &t)); !o.ok())
          return o.message;
      }
    }
    if (Outcome o = outcome(dp_session_finalize_weights(s)); !o.ok()) return o.message;
    if (Outcome o = outcome(dp_session_load_kernels(s)); !o.ok()) return o.message;
    for (int32_t l = 0; l < num_layers; ++l) {
      dp_layer_info li;
      li.size = sizeof(li);
      if (Outcome o = outcome(dp_bundle_get_layer(b, l, &li)); !o.ok()) return o.message;
      const std::vector<int32_t> kinds = li.mixer == DP_MIXER_KDA
          ? std::vector<int32_t>{DP_KV_KDA_STATE, DP_KV_CONV_Q, DP_KV_CONV_K, DP_KV_CONV_V}
          : std::vector<int32_t>{DP_KV_MLA_LATENT};
      for (int32_t kind : kinds) {
        dp_tensor t;
        if (Outcome o = outcome(dp_session_kv_layout(s, l, kind, kind == DP_KV_MLA_LATENT ? blocks : slots, &t)); !o.ok())
          return o.message;
        size_t bytes = dp_dtype_size(t.dtype);
        for (int32_t d = 0; d < t.ndim; ++d) bytes *= static_cast<size_t>(t.shape[d]);
        t.data = alloc(bytes);
        if (Outcome o = outcome(dp_session_bind_kv(s, l, kind, &t)); !o.ok()) return o.message;
      }
    }
    return {};
  }

  CUdeviceptr alloc(size_t bytes) {
    CUdeviceptr p = 0;
    if (cu().MemAlloc(&p, bytes ? bytes : 16) != CUDA_SUCCESS) return 0;
    allocations.push_back(p);
    return p;
  }

  // A step of `requests` uniform decode requests.
  // `rows`: rows per request (the bundle's q).
  dp_plan_result plan(int32_t requests, int32_t graph_mode = DP_GRAPH_NONE, int32_t rows = 1) {
    std::vector<int32_t> q(requests, rows), acc(requests, 1), st(static_cast<size_t>(requests * rows));
    for (int32_t i = 0; i < requests * rows; ++i) st[i] = 1 + i;
    dp_step_desc d;
    dp_step_desc_init(&d);
    d.num_requests = requests;
    d.query_lens = q.data();
    d.num_accepted = acc.data();
    d.state_indices = st.data();
    d.graph_mode = graph_mode;
    dp_plan_result r;
    dp_plan_result_init(&r);
    last_plan = outcome(dp_plan(s, &d, &r));
    return r;
  }

  dp_bundle* b = nullptr;
  dp_session* s = nullptr;
  int hidden = 0, num_layers = 0;
  float eps = 0;
  std::vector<int32_t> widths;
  std::vector<uint16_t> norm_weight;
  std::vector<CUdeviceptr> allocations;
  std::map<std::string, CUdeviceptr> bound;  // weight (expert) name -> device address
  Outcome last_plan;
};

}  // namespace dp::gputest
