// dp_kernel_check CUBIN_DIR [--out FILE] [--only SUBSTRING] [--case INDEX] [--count] [--list] [--time]
//
// Runs every decode-layer kernel of every case in cases.cpp on the GPU (CUDA driver API, the cubins
// dp_kernel_build made) and compares it with the float64 CPU reference:
//   * dp::ref (compiler/reference/ops.h) supplies the math of each op: linear, fused add + RMSNorm,
//     the KDA conv step, gate, L2 norm, delta rule and gated RMSNorm, the router, silu/SiTU, and the
//     bf16/fp32 rounding at vLLM's storage points. This file only lays out the inputs the way each
//     kernel takes them and walks requests, draft positions and experts as kda.h / moe.h document.
//   * Expert matrices are not converted to double (a 48B layer holds 3.6 GB of them): their dot
//     products are taken in double straight from the bf16 words (dot_bf16 below), the same sums.
//   * FP8 cases (Case::fp8): the weights an FP8 checkpoint stores in e4m3 (cases.h) are drawn as bf16
//     values, quantized by model::quantize_fp8_blocks (128 x 128 blocks, the last ones partial in the
//     fp8-partial-blocks shapes), uploaded as e4m3 bytes plus fp32 scales, and bound to the kernels' FP8
//     variants (Q8); the references multiply e4m3 * scale_inv in double and round only where the bf16
//     path rounds. Tolerances are the bf16 ones.
// Every check draws fresh random non-zero inputs, poisons the outputs (all bytes 0xFF: NaN for bf16
// and fp32, -1 for i32) and fails on NaN. Tolerances: ||gpu - ref|| / ||ref|| < 1e-2 for bf16 outputs,
// < 1e-4 for the fp32 KDA state and fp32 router logits; state slots the step must not write, and the
// conv states, are compared bit for bit.
//
// The routed experts' weights are uploaded only for the experts the step routes to; every other
// expert's weights are NaN on the device, so a kernel that reads an expert it should not use fails.
//
// Host layouts (cases.h Layout): the KDA state / conv pools, the MLA cache and the expert stacks are
// laid out dense, padded (spare elements after every slot / block, vLLM's fused w13) or wide (slots,
// blocks and experts past 2^32 elements). Padding is poisoned like the outputs: a kernel that reads it
// gets NaN, and every padding element of the slots in play must keep its bits (checked).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../cuda_test_driver.h"
#include "cases.h"
#include "codegen/kernel.h"
#include "common/dtype.h"
#include "common/error.h"
#include "model/quant.h"
#include "reference/numeric.h"
#include "reference/ops.h"

namespace dp::gpucheck {
namespace {

namespace fs = std::filesystem;
using codegen::KernelInstance;
using ref::Mat;

// ---- CUDA driver -----------------------------------------------------------------------------------

// The driver through the project's table (runtime/driver/cuda.h, opened with dlopen): the checker starts,
// lists and counts its cases on a host without a driver, and says why it cannot run them there.
using dp::gputest::cu;

void cu_check(int r, const char* what) {
  if (r == CUDA_SUCCESS) return;
  const char* name = nullptr;
  const char* msg = nullptr;
  cu().GetErrorName(r, &name);
  cu().GetErrorString(r, &msg);
  fail(Errc::device, "{} failed: {} ({})", what, name ? name : "?", msg ? msg : "");
}
#define CU(call) cu_check((call), #call)

struct DevBuf {
  CUdeviceptr ptr = 0;
  size_t bytes = 0;
  DevBuf() = default;
  explicit DevBuf(size_t n) : bytes(n) { CU(cu().MemAlloc(&ptr, std::max<size_t>(n, 16))); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : ptr(o.ptr), bytes(o.bytes) { o.ptr = 0; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    std::swap(ptr, o.ptr);
    std::swap(bytes, o.bytes);
    return *this;
  }
  ~DevBuf() {
    if (ptr) cu().MemFree(ptr);
  }
  void poison() {
    if (bytes) CU(cu().MemsetD8(ptr, 0xFF, bytes));
  }
  template <class T>
  void upload(const std::vector<T>& v, size_t offset_bytes = 0) {
    CU(cu().MemcpyHtoD(ptr + offset_bytes, v.data(), v.size() * sizeof(T)));
  }
  template <class T>
  std::vector<T> download() const {
    std::vector<T> v(bytes / sizeof(T));
    CU(cu().MemcpyDtoH(v.data(), ptr, bytes));
    return v;
  }
  template <class T>
  std::vector<T> download(size_t offset_bytes, size_t count) const {
    std::vector<T> v(count);
    CU(cu().MemcpyDtoH(v.data(), ptr + offset_bytes, count * sizeof(T)));
    return v;
  }
};
template <class T>
DevBuf device_copy(const std::vector<T>& v) {
  DevBuf b(v.size() * sizeof(T));
  b.upload(v);
  return b;
}

// One kernel argument: a device pointer (0 = null), an fp32 or a u32 scalar.
struct Arg {
  CUdeviceptr ptr = 0;
  float f = 0.0f;
  uint32_t u = 0;
  bool is_f32 = false, is_u32 = false;
  Arg(const DevBuf& b) : ptr(b.ptr) {}  // NOLINT: buffers convert implicitly
  Arg(CUdeviceptr p) : ptr(p) {}        // NOLINT
  Arg(float v) : f(v), is_f32(true) {}  // NOLINT
  explicit Arg(uint32_t v) : u(v), is_u32(true) {}
};

class Kernels {
 public:
  explicit Kernels(fs::path dir) : dir_(std::move(dir)) {}
  ~Kernels() {
    for (auto& [k, m] : modules_) cu().ModuleUnload(m.first);
  }

  // Launches k with arguments by parameter name (every non-nullable parameter must be given), then
  // synchronises so that a fault is attributed to this launch. Returns the kernel time in ms.
  float launch(const KernelInstance& k, const std::map<std::string, Arg>& args, int repeat = 1) {
    CUfunction f = function(k);
    const codegen::KernelSignature sig = codegen::kernel_signature(k);
    std::vector<CUdeviceptr> ptrs(sig.params.size());
    std::vector<float> floats(sig.params.size());
    std::vector<uint32_t> u32s(sig.params.size());
    std::vector<void*> pack;
    for (size_t i = 0; i < sig.params.size(); ++i) {
      const codegen::KernelParam& p = sig.params[i];
      auto it = args.find(p.name);
      if (it == args.end()) {
        if (p.kind == codegen::KernelParam::Kind::pointer && p.nullable) {
          ptrs[i] = 0;
          pack.push_back(&ptrs[i]);
          continue;
        }
        fail(Errc::internal, "{}: no value for parameter {}", codegen::kernel_name(k), p.name);
      }
      if (p.kind == codegen::KernelParam::Kind::u32) {
        if (!it->second.is_u32) fail(Errc::internal, "{}: parameter {} wants a u32", codegen::kernel_name(k), p.name);
        u32s[i] = it->second.u;
        pack.push_back(&u32s[i]);
      } else if (p.kind == codegen::KernelParam::Kind::f32) {
        if (!it->second.is_f32) fail(Errc::internal, "{}: parameter {} wants an f32", codegen::kernel_name(k), p.name);
        floats[i] = it->second.f;
        pack.push_back(&floats[i]);
      } else {
        if (it->second.is_f32 || it->second.is_u32)
          fail(Errc::internal, "{}: parameter {} wants a pointer", codegen::kernel_name(k), p.name);
        ptrs[i] = it->second.ptr;
        pack.push_back(&ptrs[i]);
      }
    }
    for (const auto& [name, v] : args) {
      bool known = false;
      for (const auto& p : sig.params) known |= p.name == name;
      if (!known) fail(Errc::internal, "{}: no parameter named {}", codegen::kernel_name(k), name);
    }
    const codegen::LaunchShape s = codegen::launch_shape(k);
    if (s.dynamic_shared_bytes > 0)  // beyond 48 KiB the function opts in first, as the runtime does at load
      CU(cu().FuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                               static_cast<int>(s.dynamic_shared_bytes)));
    CUevent start, stop;
    CU(cu().EventCreate(&start, CU_EVENT_DEFAULT));
    CU(cu().EventCreate(&stop, CU_EVENT_DEFAULT));
    CU(cu().EventRecord(start, nullptr));
    for (int r = 0; r < repeat; ++r)
      CU(cu().LaunchKernel(f, s.grid[0], s.grid[1], s.grid[2], s.block[0], s.block[1], s.block[2],
                           s.dynamic_shared_bytes, nullptr, pack.data(), nullptr));
    CU(cu().EventRecord(stop, nullptr));
    const int r = cu().CtxSynchronize();
    if (r != CUDA_SUCCESS) cu_check(r, ("running " + codegen::kernel_name(k)).c_str());
    float ms = 0;
    CU(cu().EventElapsedTime(&ms, start, stop));
    cu().EventDestroy(start);
    cu().EventDestroy(stop);
    return ms / static_cast<float>(repeat);
  }

 private:
  CUfunction function(const KernelInstance& k) {
    const std::string key = codegen::instance_key(k);
    auto it = modules_.find(key);
    if (it == modules_.end()) {
      const fs::path file = dir_ / (key + ".cubin");
      std::ifstream in(file, std::ios::binary);
      if (!in) fail(Errc::io, "{}: missing (run dp_kernel_build first)", file.string());
      std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
      CUmodule m;
      CU(cu().ModuleLoadData(&m, bytes.data()));
      CUfunction f;
      CU(cu().ModuleGetFunction(&f, m, codegen::kernel_name(k).c_str()));
      it = modules_.emplace(key, std::make_pair(m, f)).first;
    }
    return it->second.second;
  }
  fs::path dir_;
  std::map<std::string, std::pair<CUmodule, CUfunction>> modules_;
};

// ---- random data and conversions -------------------------------------------------------------------

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 0x1234567ull) {}
  uint64_t next() {  // splitmix64
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform(double lo, double hi) { return lo + (hi - lo) * static_cast<double>(next() >> 11) * 0x1.0p-53; }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
};

inline float bf16_to_f32(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint16_t to_bf16(double x) { return ref::double_to_bf16_bits(x); }

// Uniform in [lo, hi], never exactly zero, rounded to bf16.
std::vector<uint16_t> rand_bf16(size_t n, Rng& rng, double lo, double hi) {
  std::vector<uint16_t> v(n);
  for (auto& e : v) {
    double x = rng.uniform(lo, hi);
    if (x == 0) x = hi;
    e = to_bf16(x);
  }
  return v;
}
std::vector<float> rand_f32(size_t n, Rng& rng, double lo, double hi) {
  std::vector<float> v(n);
  for (auto& e : v) e = static_cast<float>(rng.uniform(lo, hi));
  return v;
}
std::vector<double> to_double(const std::vector<uint16_t>& v) {
  std::vector<double> d(v.size());
  for (size_t i = 0; i < v.size(); ++i) d[i] = bf16_to_f32(v[i]);
  return d;
}
std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }
Mat to_mat(const std::vector<uint16_t>& v, int64_t rows, int64_t cols) {
  Mat m(rows, cols);
  m.v = to_double(v);
  return m;
}
// Exact double dot product of a bf16 row with a double vector (the expert matrices stay bf16).
double dot_bf16(const uint16_t* w, const double* x, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(bf16_to_f32(w[i])) * x[i];
  return s;
}

// ---- weights: bf16, or FP8 block-quantized -----------------------------------------------------------

constexpr int64_t kFp8Block = 128;  // FP8 checkpoints: one fp32 scale_inv per 128 x 128 block

// A weight matrix [rows, cols] as a checkpoint stores it and the kernels read it: bf16 words, or (FP8)
// e4m3 bytes with an fp32 scale_inv per 128 x 128 block, [ceil(rows/128), ceil(cols/128)] row-major,
// made by model::quantize_fp8_blocks from the same bf16 values (the DeepSeek-style checkpoints `synth
// --quantize fp8` writes). Its real values, which the references multiply by, are e4m3 * scale_inv,
// exact in double; nothing else is rounded.
struct HostWeight {
  int64_t rows = 0, cols = 0;
  bool fp8 = false;
  std::vector<uint16_t> bf16;  // rows * cols, when !fp8
  std::vector<uint8_t> e4m3;   // rows * cols, when fp8
  std::vector<float> scale;    // the block scales, when fp8

  int64_t block_cols() const { return (cols + kFp8Block - 1) / kFp8Block; }
  // Row r dotted with x[0..cols) in double (every product exact).
  double dot(int64_t r, const double* x) const {
    if (!fp8) return dot_bf16(bf16.data() + r * cols, x, cols);
    static const std::vector<double> e4m3_value = [] {
      std::vector<double> v(256);
      for (int b = 0; b < 256; ++b) v[static_cast<size_t>(b)] = e4m3_bits_to_f32(static_cast<uint8_t>(b));
      return v;
    }();
    const uint8_t* w = e4m3.data() + r * cols;
    const float* s = scale.data() + (r / kFp8Block) * block_cols();
    double sum = 0;
    for (int64_t i = 0; i < cols; ++i) sum += e4m3_value[w[i]] * static_cast<double>(s[i / kFp8Block]) * x[i];
    return sum;
  }
  // Every real value, row-major (for matrices small enough to hold in double).
  std::vector<double> real() const {
    if (!fp8) return to_double(bf16);
    std::vector<double> v(e4m3.size()), s(scale.begin(), scale.end());
    for (size_t i = 0; i < v.size(); ++i) v[i] = e4m3_bits_to_f32(e4m3[i]);
    return ref::dequant_fp8_blocks(v, s, rows, cols, kFp8Block, kFp8Block, "weight");
  }
};

// Random weights: bf16 values uniform in [lo, hi] (the draws of rand_bf16, so a bf16 weight is what
// rand_bf16 gives), quantized to FP8 blocks when `fp8`.
HostWeight rand_weight(int64_t rows, int64_t cols, Rng& rng, double lo, double hi, bool fp8) {
  HostWeight w;
  w.rows = rows;
  w.cols = cols;
  w.fp8 = fp8;
  w.bf16 = rand_bf16(static_cast<size_t>(rows * cols), rng, lo, hi);
  if (!fp8) return w;
  std::vector<float> v(w.bf16.size());
  for (size_t i = 0; i < v.size(); ++i) v[i] = bf16_to_f32(w.bf16[i]);
  model::Fp8Blocks q = model::quantize_fp8_blocks(v, rows, cols, kFp8Block);
  w.e4m3 = std::move(q.values);
  w.scale = std::move(q.scale_inv);
  w.bf16.clear();
  return w;
}

// A weight on the device: its stored values and, for an FP8 one, its scales.
struct DevWeight {
  DevBuf values, scale;
};
DevWeight device_weight(const HostWeight& w) {
  DevWeight d;
  d.values = w.fp8 ? device_copy(w.e4m3) : device_copy(w.bf16);
  if (w.fp8) d.scale = device_copy(w.scale);
  return d;
}
// Binds weight parameter `name` and, for an e4m3 weight, its scales "<name>_scale".
void bind_weight(std::map<std::string, Arg>& args, const std::string& name, const DevWeight& w) {
  args.emplace(name, Arg(w.values));
  if (w.scale.ptr) args.emplace(name + "_scale", Arg(w.scale));
}

// The instance's Q8 parameter (0: bf16 weights, the parameter left out).
int64_t q8_of(const KernelInstance& k) {
  auto it = k.params.find("Q8");
  return it == k.params.end() ? 0 : it->second;
}

// ---- results ------------------------------------------------------------------------------------------

struct Result {
  std::string case_name, check;
  double value = 0, limit = 0;
  bool pass = false;
  std::string note;
};

class Report {
 public:
  void add(const std::string& c, const std::string& check, double value, double limit, std::string note = {}) {
    Result r{c, check, value, limit, value < limit && !std::isnan(value), std::move(note)};
    std::printf("  %-8s %-28s %.3e (limit %.0e)%s%s\n", r.pass ? "ok" : "FAIL", check.c_str(), value, limit,
                r.note.empty() ? "" : "  ", r.note.c_str());
    std::fflush(stdout);
    results_.push_back(std::move(r));
  }
  // A count that must be zero (unwritten outputs, touched state, wrong ids).
  void zero(const std::string& c, const std::string& check, int64_t count, std::string note = {}) {
    add(c, check, static_cast<double>(count), 0.5, std::move(note));
  }
  const std::vector<Result>& results() const { return results_; }
  int failures() const {
    int n = 0;
    for (const Result& r : results_) n += !r.pass;
    return n;
  }

 private:
  std::vector<Result> results_;
};

// ||a - b|| / ||b||; NaN anywhere (an unwritten, poisoned output) or a size mismatch gives +inf. The same
// measure as dp::ref::rel_error (layer.h), which lives with the layer reference this tool does not link.
double rel_error(const std::vector<double>& a, const std::vector<double>& b) {
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
double rel(const std::vector<double>& gpu, const std::vector<double>& expect) { return rel_error(gpu, expect); }

std::vector<double> bf16_out(const DevBuf& b) { return to_double(b.download<uint16_t>()); }
std::vector<double> f32_out(const DevBuf& b) { return to_double(b.download<float>()); }

constexpr double kBf16Tol = 1e-2, kF32Tol = 1e-4;

// Reference of a bf16 GEMM output: x W^T in double, rounded to bf16 (Rounding::linear).
std::vector<double> linear_bf16(const Mat& x, const std::vector<double>& w, int64_t out, int64_t in,
                                bool round = true) {
  Mat y = ref::linear(x, w, out, in);
  ref::round_bf16_if(round, y);
  return y.v;
}

double act(const ModelShape& m, double g, double u) {
  return m.situ ? ref::situ(g, u, m.situ_beta, m.situ_linear_beta) : ref::silu(g) * u;
}

// ---- host-owned pools (Layout in cases.h) ---------------------------------------------------------------

constexpr int64_t kFar = int64_t{1} << 32;  // element offsets from here on need 64-bit address math

// A host-owned pool (KDA state or conv slots, MLA cache blocks) as the host lays it out: slot s holds
// `dense` elements at s*stride; the rest of every stride (padding) and every slot that is not live hold
// poison (all bytes 0xFF: NaN in bf16 and fp32, so a kernel that reads them fails). Only the live slots
// are uploaded and read back, so that a wide pool may span tens of GB on the device.
template <class T>
struct Pool {
  int64_t dense = 0, stride = 0;
  std::map<int64_t, std::vector<T>> before;  // live slot -> its [stride] elements as uploaded
  DevBuf dev;

  template <class Random>
  Pool(int64_t count, int64_t dense_elems, int64_t stride_elems, const std::vector<int64_t>& live, Random random)
      : dense(dense_elems), stride(stride_elems), dev(static_cast<size_t>(count * stride_elems) * sizeof(T)) {
    dev.poison();
    for (int64_t s : live) {
      std::vector<T> v = random(static_cast<size_t>(dense));
      v.resize(static_cast<size_t>(stride));
      std::memset(v.data() + dense, 0xFF, static_cast<size_t>(stride - dense) * sizeof(T));
      dev.upload(v, static_cast<size_t>(s * stride) * sizeof(T));
      before.emplace(s, std::move(v));
    }
  }
  std::vector<T> after(int64_t s) const {
    return dev.download<T>(static_cast<size_t>(s * stride) * sizeof(T), static_cast<size_t>(stride));
  }
  // The dense parts of the live slots as the reference's starting point.
  std::map<int64_t, std::vector<double>> dense_double() const {
    std::map<int64_t, std::vector<double>> m;
    for (const auto& [s, v] : before) m.emplace(s, to_double(std::vector<T>(v.begin(), v.begin() + dense)));
    return m;
  }
  // Padding elements of the live slots whose bits changed.
  int64_t padding_touched() const {
    int64_t n = 0;
    for (const auto& [s, v0] : before) {
      const std::vector<T> g = after(s);
      for (int64_t e = dense; e < stride; ++e) n += std::memcmp(&g[e], &v0[e], sizeof(T)) != 0;
    }
    return n;
  }
};

// Slot ids of a pool: the null slot 0, then first .. first + n - 1.
std::vector<int64_t> live_slots(int64_t first, int64_t n) {
  std::vector<int64_t> v{0};
  for (int64_t i = 0; i < n; ++i) v.push_back(first + i);
  return v;
}

int64_t round_up8(int64_t x) { return (x + 7) / 8 * 8; }

// ---- checks ---------------------------------------------------------------------------------------------

struct Ctx {
  Kernels& kernels;
  Report& report;
  bool time = false;
};

void check_rmsnorm(Ctx& ctx, const Case& c, const CaseKernels& k, uint64_t seed) {
  const int64_t T = c.rows(), H = c.model->hidden;
  for (bool with_residual : {true, false}) {
    Rng rng(seed + with_residual);
    auto hidden = rand_bf16(T * H, rng, -2, 2), residual = rand_bf16(T * H, rng, -2, 2);
    auto weight = rand_bf16(H, rng, 0.5, 1.5);
    DevBuf dh = device_copy(hidden), dr = device_copy(residual), dw = device_copy(weight);
    DevBuf out(T * H * 2), rout(T * H * 2);
    out.poison();
    rout.poison();
    ctx.kernels.launch(k.rmsnorm, {{"hidden", dh},
                                   {"residual", with_residual ? dr.ptr : CUdeviceptr(0)},
                                   {"weight", dw},
                                   {"out", out},
                                   {"residual_out", rout},
                                   {"eps", 1e-5f}});
    Mat mh = to_mat(hidden, T, H), mr = to_mat(residual, T, H);
    ref::AddNorm e =
        ref::fused_add_rms_norm(mh, with_residual ? &mr : nullptr, to_double(weight), 1e-5, ref::Rounding::vllm());
    const std::string tag = with_residual ? "rmsnorm" : "rmsnorm (layer 0)";
    ctx.report.add(c.name(), tag + " out", rel(bf16_out(out), e.x.v), kBf16Tol);
    ctx.report.add(c.name(), tag + " residual", rel(bf16_out(rout), e.residual.v), 1e-6);
  }
}

// attnres (K3 block attention residuals) at one stage over a buffer of `layers` / `block` layers, for
// each layer value that makes a different block count or push, with and without a residual, against
// ref::attn_res_add_norm: out and residual_out, the pushed block exactly, and every other element of
// the buffer untouched (unused blocks and the padding between rows are poisoned).
void check_attnres_instance(Ctx& ctx, const Case& c, const KernelInstance& k, int64_t layers, uint64_t seed) {
  if (k.op.empty()) return;
  const int64_t T = c.rows(), H = k.params.at("H"), B = k.params.at("B"), NB = k.params.at("NB");
  const int64_t S = k.params.at("S");
  const int64_t stride = NB * H + (c.layout == Layout::dense ? 0 : 24);  // padded rows: 48 spare bytes
  std::vector<int64_t> layer_values;
  if (S == 2) layer_values = {layers};
  else
    for (int64_t l : {int64_t{0}, int64_t{1}, B - 1, B, B + 1, 2 * B, (layers - 1) / B * B, layers - 2, layers - 1})
      if (l >= 0 && l < layers && std::find(layer_values.begin(), layer_values.end(), l) == layer_values.end())
        layer_values.push_back(l);
  for (int64_t layer : layer_values) {
    const int64_t n = S == 1 ? layer / B + 1 : (layer + B - 1) / B;
    const bool push = S == 0 && layer % B == 0;
    const bool with_residual = !(S == 0 && layer == 0);
    Rng rng(seed + static_cast<uint64_t>(layer));
    auto hidden = rand_bf16(T * H, rng, -2, 2), residual = rand_bf16(T * H, rng, -2, 2);
    auto res_norm = rand_bf16(H, rng, 0.5, 1.5), res_proj = rand_bf16(H, rng, -0.1, 0.1);
    auto weight = rand_bf16(H, rng, 0.5, 1.5);
    std::vector<uint16_t> buf(static_cast<size_t>(T * stride), 0xFFFF);  // NaN: must stay untouched
    std::vector<Mat> blocks;
    for (int64_t b = 0; b < n; ++b) {
      Mat mb(T, H);
      for (int64_t t = 0; t < T; ++t)
        for (int64_t i = 0; i < H; ++i) {
          const uint16_t v = to_bf16(rng.uniform(-3, 3));
          buf[static_cast<size_t>(t * stride + b * H + i)] = v;
          mb(t, i) = bf16_to_f32(v);
        }
      blocks.push_back(std::move(mb));
    }
    DevBuf dh = device_copy(hidden), dr = device_copy(residual), dn = device_copy(res_norm);
    DevBuf dp = device_copy(res_proj), dw = device_copy(weight), dbuf = device_copy(buf);
    DevBuf out(T * H * 2), rout(T * H * 2);
    out.poison();
    rout.poison();
    ctx.kernels.launch(k, {{"hidden", dh},
                           {"residual", with_residual ? dr.ptr : CUdeviceptr(0)},
                           {"blocks", dbuf},
                           {"stride_blocks", Arg(static_cast<uint32_t>(stride))},
                           {"layer", Arg(static_cast<uint32_t>(layer))},
                           {"res_norm", dn},
                           {"res_proj", dp},
                           {"weight", dw},
                           {"out", out},
                           {"residual_out", rout},
                           {"eps", 1e-5f}});
    Mat mh = to_mat(hidden, T, H), mr = to_mat(residual, T, H);
    ref::AddNorm e = ref::attn_res_add_norm(mh, with_residual ? &mr : nullptr, blocks, push, to_double(res_norm),
                                            to_double(res_proj), to_double(weight), 1e-5, ref::Rounding::vllm());
    const std::string tag = fmt::format("attnres h{} s{} layer {}{}", H, S, layer, push ? " push" : "");
    ctx.report.add(c.name(), tag + " out", rel(bf16_out(out), e.x.v), kBf16Tol);
    ctx.report.add(c.name(), tag + " residual", rel(bf16_out(rout), e.residual.v), 1e-6);
    // The buffer: block n of every row is p after a push; everything else as uploaded.
    const std::vector<uint16_t> got = dbuf.download<uint16_t>();
    int64_t changed = 0;
    double pushed_err = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < stride; ++j) {
        const size_t at = static_cast<size_t>(t * stride + j);
        if (push && j >= n * H && j < (n + 1) * H) {
          pushed_err = std::max(pushed_err, std::fabs(bf16_to_f32(got[at]) - blocks[n](t, j - n * H)));
          if (std::isnan(bf16_to_f32(got[at]))) pushed_err = std::numeric_limits<double>::infinity();
        } else {
          changed += got[at] != buf[at];
        }
      }
    if (push) ctx.report.add(c.name(), tag + " pushed block", pushed_err, 1e-30);
    ctx.report.zero(c.name(), tag + " other blocks untouched", changed);
  }
}

void check_attnres(Ctx& ctx, const Case& c, const CaseKernels& k, uint64_t seed) {
  for (int s = 0; s < 3; ++s) check_attnres_instance(ctx, c, k.attnres[s], c.model->layers, seed + 100 * s);
  check_attnres_instance(ctx, c, k.attnres_k3, 93, seed + 400);  // Kimi-K3: 93 layers, block 12
}

// A gemm launch over the given segments with random inputs, against linear() per segment.
void check_gemm(Ctx& ctx, const Case& c, const KernelInstance& k, const std::string& tag, uint64_t seed) {
  const int64_t T = c.rows(), K = k.params.at("K");
  const bool f32 = k.params.at("F") != 0;
  Rng rng(seed);
  auto x = rand_bf16(T * K, rng, -1, 1);
  const Mat mx = to_mat(x, T, K);
  const double a = std::sqrt(3.0 / static_cast<double>(K)) * 1.5;
  // Weight s is e4m3 with block scales where bit s of Q8 is set.
  const int64_t q8 = q8_of(k);
  std::vector<DevWeight> ws;
  std::vector<std::vector<double>> expect_seg;
  int64_t ntot = 0;
  for (const char* key : {"NA", "NB", "NC", "ND", "NE", "NF"}) {
    const int64_t n = k.params.at(key);
    if (!n) break;
    const HostWeight w = rand_weight(n, K, rng, -a, a, (q8 >> ws.size()) & 1);
    ws.push_back(device_weight(w));
    expect_seg.push_back(linear_bf16(mx, w.real(), n, K, !f32));
    ntot += n;
  }
  DevBuf out(T * ntot * (f32 ? 4 : 2));
  out.poison();
  DevBuf dx = device_copy(x);
  std::map<std::string, Arg> args{{"x", dx}, {"out", out}};
  const char* names[6] = {"w0", "w1", "w2", "w3", "w4", "w5"};
  for (size_t i = 0; i < ws.size(); ++i) bind_weight(args, names[i], ws[i]);
  ctx.kernels.launch(k, args);
  // Reassemble the expected [T, ntot] row layout: segment outputs side by side.
  std::vector<double> expect(static_cast<size_t>(T * ntot));
  int64_t col = 0;
  for (const auto& seg : expect_seg) {
    const int64_t n = static_cast<int64_t>(seg.size()) / T;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < n; ++j) expect[t * ntot + col + j] = seg[t * n + j];
    col += n;
  }
  ctx.report.add(c.name(), "gemm " + tag, rel(f32 ? f32_out(out) : bf16_out(out), expect), f32 ? kF32Tol : kBf16Tol,
                 q8 ? fmt::format("Q8 {}, K {}", q8, K) : std::string());
}

// The o-projection with the post-attention norm fused (gemm NM 1): the projection, then the residual
// add + RMSNorm of its rows against ref::fused_add_rms_norm over the bf16 projection. Launched twice over
// the same block counter (zeroed once, as the runtime's workspace): the second launch must find it back
// at zero and give the same bits, and the counter must read zero after each.
void check_gemm_norm(Ctx& ctx, const Case& c, const KernelInstance& k, uint64_t seed) {
  const int64_t T = c.rows(), K = k.params.at("K"), N = k.params.at("NA");
  Rng rng(seed);
  auto x = rand_bf16(T * K, rng, -1, 1), residual = rand_bf16(T * N, rng, -2, 2);
  auto weight = rand_bf16(N, rng, 0.5, 1.5);
  const double a = std::sqrt(3.0 / static_cast<double>(K)) * 1.5;
  const HostWeight w = rand_weight(N, K, rng, -a, a, q8_of(k) & 1);
  const DevWeight dw = device_weight(w);
  DevBuf dx = device_copy(x), dres = device_copy(residual), dnw = device_copy(weight);
  DevBuf h(T * N * 2), normed(T * N * 2), rout(T * N * 2);
  DevBuf done = device_copy(std::vector<uint32_t>(64, 0u));
  const std::vector<double> proj = linear_bf16(to_mat(x, T, K), w.real(), N, K, true);
  Mat mh(T, N);
  mh.v = proj;
  const Mat mr = to_mat(residual, T, N);
  const ref::AddNorm e = ref::fused_add_rms_norm(mh, &mr, to_double(weight), 1e-5, ref::Rounding::vllm());
  std::vector<uint16_t> first;
  for (int launch = 0; launch < 2; ++launch) {
    h.poison();
    normed.poison();
    rout.poison();
    std::map<std::string, Arg> args{{"x", dx},         {"out", h},          {"residual", dres},
                                    {"norm_weight", dnw}, {"normed", normed}, {"residual_out", rout},
                                    {"eps", 1e-5f},     {"done", done}};
    bind_weight(args, "w0", dw);
    ctx.kernels.launch(k, args);
    const std::string tag = fmt::format("o_proj + norm (launch {})", launch + 1);
    ctx.report.add(c.name(), tag + " projection", rel(bf16_out(h), proj), kBf16Tol);
    ctx.report.add(c.name(), tag + " out", rel(bf16_out(normed), e.x.v), kBf16Tol);
    ctx.report.add(c.name(), tag + " residual", rel(bf16_out(rout), e.residual.v), 1e-6);
    // Exact checks: 0 passes, 1 fails (limit 0.5).
    const uint32_t counter = done.download<uint32_t>(0, 1)[0];
    ctx.report.add(c.name(), tag + " block counter left at zero", counter == 0 ? 0.0 : 1.0, 0.5,
                   fmt::format("counter {}", counter));
    const std::vector<uint16_t> bits = normed.download<uint16_t>();
    if (launch == 0) first = bits;
    else ctx.report.add(c.name(), "o_proj + norm: both launches give the same bits", first == bits ? 0.0 : 1.0, 0.5);
  }
}

// KDA step: fresh projections, weights and states; the reference walks requests and draft positions
// exactly as compiler/reference/layer.cpp kda_mixer does (ConvSpecLayout::per_slot).
// One kda_step form (`kernel`: k.kda, or k.kda_split with its workspace) on inputs drawn from `seed`, so
// that both forms see the same ones; `tag` names its checks.
void check_kda_form(Ctx& ctx, const Case& c, const codegen::KernelInstance& kernel, const std::string& tag,
                    uint64_t seed) {
  const ModelShape& m = *c.model;
  const int64_t W = c.width, Q = c.q, T = c.rows(), NH = m.heads, D = m.head_dim, P = m.proj_size();
  const int64_t CK = m.conv, CH = CK - 1, FR = m.f_rank, GR = m.g_rank, NP = m.proj_cols();
  const int64_t GW = GR > 0 ? GR : P, fa_col = 3 * P, g_col = 3 * P + FR, b_col = 3 * P + FR + GW;
  Rng rng(seed);

  // Projections: q | k | v | f_a | g_a (g) | b.
  std::vector<uint16_t> proj(T * NP);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < NP; ++j) {
      const double span = j < 3 * P ? 2.0 : j < g_col ? 1.0 : 3.0;
      double v = rng.uniform(-span, span);
      proj[t * NP + j] = to_bf16(v == 0 ? span : v);
    }
  const double afr = std::sqrt(3.0 / FR);
  auto w_fb = rand_bf16(P * FR, rng, -afr, afr);
  auto w_gb = rand_bf16(GR > 0 ? P * GR : 8, rng, -afr, afr);
  auto cq = rand_f32(P * CK, rng, -0.6, 0.6), ck = rand_f32(P * CK, rng, -0.6, 0.6),
       cv = rand_f32(P * CK, rng, -0.6, 0.6);
  auto dt_bias = rand_f32(P, rng, -3, -1);
  // K3 ranks (AR): the whole A_log, of which this rank's heads start at rank*NH.
  const int64_t a_log_at = m.a_log_rank >= 0 ? m.a_log_rank * NH : 0;
  auto a_log = rand_f32(m.a_log_rank >= 0 ? m.a_log_size : NH, rng, -1, 1.5);
  auto onorm_bf = rand_bf16(D, rng, 0.5, 1.5);
  auto onorm_f = rand_f32(D, rng, 0.5, 1.5);

  // Pools as the host lays them out (cases.h Layout): dense, or with padding after every slot (strides
  // that are not multiples of 8: the states need only element alignment), or with the slots in use
  // past 2^32 elements from the base.
  const int64_t state_dense = NH * D * D, conv_dense = CH * P;
  int64_t state_stride = state_dense, conv_stride = conv_dense, base = 0;
  if (c.layout != Layout::dense) {
    state_stride += 13;
    conv_stride += 5;
  }
  if (c.layout == Layout::wide) {
    base = kFar / state_stride + 1;                             // slot base: past 2^32 fp32 elements
    conv_stride = std::max(conv_stride, kFar / base + 1 + 5);  // and past 2^32 conv elements
  }

  // Slots: base + a random permutation of 1..W*Q; one padded request (all slots 0) when W >= 3; for
  // Q > 1 the last request's draft slot 1 is 0 when W >= 4 (not written); two spare slots that nobody
  // uses; the null slot 0.
  const int64_t num_slots = base + 1 + W * Q + 2;
  const std::vector<int64_t> live = live_slots(base + 1, W * Q + 2);
  std::vector<int32_t> perm(W * Q);
  for (int64_t i = 0; i < W * Q; ++i) perm[i] = static_cast<int32_t>(base + 1 + i);
  for (int64_t i = W * Q - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  std::vector<int32_t> slots = perm;
  if (W >= 3)
    for (int64_t i = 0; i < Q; ++i) slots[1 * Q + i] = 0;
  if (Q > 1 && W >= 4) slots[(W - 1) * Q + 1] = 0;
  std::vector<int32_t> accepted(W, 1);
  if (Q > 1)
    for (int64_t r = 0; r < W; ++r) accepted[r] = static_cast<int32_t>(1 + rng.below(Q));
  if (Q > 1 && W >= 4) accepted[W - 1] = 1;  // it must read from its first slot, the only non-zero one

  auto rand_state = [&](size_t n) { return rand_f32(n, rng, -1, 1); };
  auto rand_conv = [&](size_t n) { return rand_bf16(n, rng, -2, 2); };
  const Pool<float> pstate(num_slots, state_dense, state_stride, live, rand_state);
  const Pool<uint16_t> pconv[3] = {{num_slots, conv_dense, conv_stride, live, rand_conv},
                                   {num_slots, conv_dense, conv_stride, live, rand_conv},
                                   {num_slots, conv_dense, conv_stride, live, rand_conv}};

  DevBuf d_proj = device_copy(proj), d_fb = device_copy(w_fb), d_gb = device_copy(w_gb);
  DevBuf d_cq = device_copy(cq), d_ck = device_copy(ck), d_cv = device_copy(cv), d_dt = device_copy(dt_bias);
  DevBuf d_alog = device_copy(a_log), d_on = m.onorm_f32 ? device_copy(onorm_f) : device_copy(onorm_bf);
  DevBuf d_slots = device_copy(slots), d_acc = device_copy(accepted);
  DevBuf out(T * P * 2);
  out.poison();
  std::map<std::string, Arg> args{{"proj", d_proj},
                                  {"w_fb", d_fb},
                                  {"conv_wq", d_cq},
                                  {"conv_wk", d_ck},
                                  {"conv_wv", d_cv},
                                  {"dt_bias", d_dt},
                                  {"a_log", d_alog},
                                  {"o_norm", d_on},
                                  {"state", pstate.dev},
                                  {"conv_q", pconv[0].dev},
                                  {"conv_k", pconv[1].dev},
                                  {"conv_v", pconv[2].dev},
                                  {"slots", d_slots},
                                  {"out", out},
                                  {"lower_bound", -5.0f},
                                  {"onorm_eps", 1e-5f},
                                  {"state_stride", Arg(static_cast<uint32_t>(state_stride))},
                                  {"conv_stride", Arg(static_cast<uint32_t>(conv_stride))}};
  if (GR > 0) args.emplace("w_gb", Arg(d_gb));
  if (m.a_log_rank >= 0) args.emplace("rank", Arg(static_cast<uint32_t>(m.a_log_rank)));
  if (Q > 1) args.emplace("num_accepted", Arg(d_acc));
  // VS: the splits' o columns, gate columns and sums of o^2, and a counter per (request, head) that every
  // launch leaves at zero.
  const int64_t VS = kernel.params.count("VS") ? kernel.params.at("VS") : 0;
  DevBuf o_part(std::max<int64_t>(W * NH * D * 4, 4)), g_part(std::max<int64_t>(W * NH * D * 4, 4)),
      ss_part(std::max<int64_t>(W * NH * VS * 4, 4));
  DevBuf done = device_copy(std::vector<uint32_t>(W * NH, 0u));
  if (VS) {
    o_part.poison();
    g_part.poison();
    ss_part.poison();
    args.emplace("o_part", o_part);
    args.emplace("g_part", g_part);
    args.emplace("ss_part", ss_part);
    args.emplace("done", done);
  }
  const float ms = ctx.kernels.launch(kernel, args);
  if (VS) {
    int64_t left = 0;
    for (uint32_t v : done.download<uint32_t>()) left += v != 0;
    ctx.report.zero(c.name(), tag + ": counters left nonzero", left);
  }

  // ---- reference (per live slot: [NH, D, D] state, [CH, P] conv histories) ----
  std::map<int64_t, std::vector<double>> state = pstate.dense_double();
  std::map<int64_t, std::vector<double>> conv[3] = {pconv[0].dense_double(), pconv[1].dense_double(),
                                                    pconv[2].dense_double()};
  const std::vector<float>* taps[3] = {&cq, &ck, &cv};
  std::vector<double> expect(T * P, 0.0);
  std::set<int64_t> written;
  const std::vector<double> onorm = m.onorm_f32 ? to_double(onorm_f) : to_double(onorm_bf);
  const double qscale = 1.0 / std::sqrt(static_cast<double>(D));
  std::optional<double> lb;
  if (m.safe_gate) lb = m.lower_bound;
  for (int64_t r = 0; r < W; ++r) {
    if (slots[r * Q] == 0) continue;  // padded: zero rows, no state traffic
    const int64_t read_slot = slots[r * Q + accepted[r] - 1];
    std::vector<std::vector<double>> hist[3];
    for (int w3 = 0; w3 < 3; ++w3) {
      hist[w3].resize(P);
      for (int64_t ch = 0; ch < P; ++ch)
        for (int64_t i = 0; i < CH; ++i) hist[w3][ch].push_back(conv[w3].at(read_slot)[i * P + ch]);
    }
    std::vector<std::vector<double>> S(NH);
    const std::vector<double>& rs = state.at(read_slot);
    for (int64_t j = 0; j < NH; ++j) S[j].assign(rs.begin() + j * D * D, rs.begin() + (j + 1) * D * D);
    for (int64_t i = 0; i < Q; ++i) {
      const int64_t t = r * Q + i, ws = slots[r * Q + i];
      std::vector<double> y[3];
      for (int w3 = 0; w3 < 3; ++w3) {
        y[w3].resize(P);
        for (int64_t ch = 0; ch < P; ++ch) {
          const double xn = bf16_to_f32(proj[t * NP + w3 * P + ch]);
          std::vector<double> tp(taps[w3]->begin() + ch * CK, taps[w3]->begin() + (ch + 1) * CK);
          y[w3][ch] = ref::round_bf16(ref::kda_conv_step(hist[w3][ch], xn, tp));
          hist[w3][ch].erase(hist[w3][ch].begin());
          hist[w3][ch].push_back(xn);
          if (ws != 0)
            for (int64_t h = 0; h < CH; ++h) conv[w3].at(ws)[h * P + ch] = hist[w3][ch][h];
        }
      }
      for (int64_t j = 0; j < NH; ++j) {
        std::vector<double> qv(y[0].begin() + j * D, y[0].begin() + (j + 1) * D);
        std::vector<double> kv(y[1].begin() + j * D, y[1].begin() + (j + 1) * D);
        std::vector<double> vv(y[2].begin() + j * D, y[2].begin() + (j + 1) * D);
        ref::l2_normalize(qv, 1e-6, qscale);
        ref::l2_normalize(kv, 1e-6, 1.0);
        std::vector<double> alpha(D), g(D), o(D), og(D);
        for (int64_t cc = 0; cc < D; ++cc) {
          const int64_t ch = j * D + cc;
          double f = 0;
          for (int64_t rr = 0; rr < FR; ++rr)
            f += bf16_to_f32(w_fb[ch * FR + rr]) * bf16_to_f32(proj[t * NP + fa_col + rr]);
          alpha[cc] = ref::kda_alpha(ref::round_bf16(f), dt_bias[ch], a_log[a_log_at + j], lb);
          if (GR > 0) {
            double gg = 0;
            for (int64_t rr = 0; rr < GR; ++rr)
              gg += bf16_to_f32(w_gb[ch * GR + rr]) * bf16_to_f32(proj[t * NP + g_col + rr]);
            g[cc] = ref::round_bf16(gg);
          } else {
            g[cc] = bf16_to_f32(proj[t * NP + g_col + ch]);
          }
        }
        const double beta = ref::sigmoid(bf16_to_f32(proj[t * NP + b_col + j]));
        ref::kda_delta_step(S[j], qv, kv, vv, alpha, beta, o);
        for (double& e : S[j]) e = ref::round_fp32(e);
        if (ws != 0) {
          std::copy(S[j].begin(), S[j].end(), state.at(ws).begin() + j * D * D);
          written.insert(ws);
        }
        ref::round_bf16_if(true, o);
        ref::gated_rms_norm(o, g, onorm, 1e-5, og);
        for (int64_t cc = 0; cc < D; ++cc) expect[t * P + j * D + cc] = ref::round_bf16(og[cc]);
      }
    }
  }

  ctx.report.add(c.name(), tag + " out", rel(bf16_out(out), expect), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us", ms * 1e3) : std::string());
  // State: written slots within 1e-4; every other live slot untouched, bit for bit.
  std::vector<double> got, want;
  int64_t touched = 0;
  for (const auto& [s, v0] : pstate.before) {
    const std::vector<float> g = pstate.after(s);
    for (int64_t e = 0; e < state_dense; ++e) {
      if (written.count(s)) {
        got.push_back(g[e]);
        want.push_back(state.at(s)[e]);
      } else if (std::memcmp(&g[e], &v0[e], 4) != 0) {
        ++touched;
      }
    }
  }
  ctx.report.add(c.name(), tag + " state (written)", rel_error(got, want), kF32Tol);
  ctx.report.zero(c.name(), tag + " state (others)", touched, "values changed in slots the step must not write");
  int64_t conv_bad = 0;
  for (int w3 = 0; w3 < 3; ++w3)
    for (const auto& [s, v0] : pconv[w3].before) {
      const std::vector<uint16_t> g = pconv[w3].after(s);
      for (int64_t e = 0; e < conv_dense; ++e) conv_bad += to_bf16(conv[w3].at(s)[e]) != g[e];
    }
  ctx.report.zero(c.name(), tag + " conv states", conv_bad, "elements differing from the reference");
  const int64_t pad_touched =
      pstate.padding_touched() + pconv[0].padding_touched() + pconv[1].padding_touched() + pconv[2].padding_touched();
  ctx.report.zero(c.name(), tag + " pool padding", pad_touched,
                  fmt::format("state_stride {} (dense {}), conv_stride {} (dense {}), slots {}..{}", state_stride,
                              state_dense, conv_stride, conv_dense, base + 1, num_slots - 1));
}

void check_kda(Ctx& ctx, const Case& c, const CaseKernels& k, uint64_t seed) {
  check_kda_form(ctx, c, k.kda, "kda_step", seed);
  if (!k.kda_split.op.empty())
    check_kda_form(ctx, c, k.kda_split, fmt::format("kda_step vs{}", k.kda_split.params.at("VS")), seed);

}

// The router and moe_route of a MoE step over x [T, H] (fresh router weights and bias), each checked:
// the router's fp32 logits against linear(), the top-k ids against ref::route (near-ties accepted and
// noted), the weights against the reference over the GPU's choice, the used-expert table exactly.
// `ok` is false when the ids or the table are wrong (the expert kernels would index garbage).
struct Routed {
  DevBuf ids, tw, experts, eslots;
  std::vector<int32_t> gid;      // [T, KT] the GPU's top-k ids
  std::vector<float> gw;         // [T, KT] its weights
  std::vector<double> w_want;    // [T, KT] the reference weights over the GPU's choice
  std::vector<int32_t> used_v;   // the used experts, ascending
  bool ok = false;
};
Routed check_routing(Ctx& ctx, const Case& c, const CaseKernels& k, Rng& rng, const DevBuf& dx, const Mat& mx) {
  const ModelShape& m = *c.model;
  const int64_t T = c.rows(), H = m.hidden, E = m.experts, KT = m.top_k;
  const int64_t U = std::min(E, T * KT);
  const double ah = std::sqrt(3.0 / H);
  auto wr = rand_bf16(E * H, rng, -2 * ah, 2 * ah);
  auto bias = rand_f32(E, rng, -0.1, 0.1);
  // Wide layout: every row picks the last expert (its biased score beats any other), the one whose
  // weights lie past 2^32 elements.
  if (c.layout == Layout::wide && E > 1) bias[E - 1] += 2.0f;
  DevBuf dwr = device_copy(wr), dbias = device_copy(bias);
  DevBuf logits(T * E * 4);
  logits.poison();
  ctx.kernels.launch(k.router, {{"x", dx}, {"out", logits}, {"w0", dwr}});
  const std::vector<double> gl = f32_out(logits);
  ctx.report.add(c.name(), "gemm router (fp32)", rel(gl, linear_bf16(mx, to_double(wr), E, H, false)), kF32Tol);

  // ---- route ----
  Routed R;
  R.ids = DevBuf(T * KT * 4);
  R.tw = DevBuf(T * KT * 4);
  R.experts = DevBuf((1 + U) * 4);
  R.eslots = DevBuf(U * T * 4);
  for (DevBuf* b : {&R.ids, &R.tw, &R.experts, &R.eslots}) b->poison();
  const float route_ms = ctx.kernels.launch(k.route, {{"logits", logits},
                                                      {"bias", dbias},
                                                      {"topk_ids", R.ids},
                                                      {"topk_weights", R.tw},
                                                      {"experts", R.experts},
                                                      {"expert_slots", R.eslots}});
  R.gid = R.ids.download<int32_t>();
  R.gw = R.tw.download<float>();
  const std::vector<int32_t>& gid = R.gid;
  const std::vector<float>& gw = R.gw;
  const std::vector<int32_t> gex = R.experts.download<int32_t>();
  const std::vector<int32_t> gsl = R.eslots.download<int32_t>();
  model::MoeConfig cfg;
  cfg.num_experts = E;
  cfg.top_k = KT;
  cfg.renormalize = true;
  const std::vector<double> bias_d = to_double(bias);
  int64_t bad_ids = 0, near_ties = 0;
  std::vector<double> w_got, w_want;  // weights: GPU vs reference over the GPU's choice
  std::set<int32_t> used;
  for (int64_t t = 0; t < T; ++t) {
    std::span<const double> lt(gl.data() + t * E, E);
    const ref::Routing rt = ref::route(lt, bias_d, cfg);
    std::vector<int32_t> mine(gid.begin() + t * KT, gid.begin() + (t + 1) * KT);
    bool valid = true;
    for (int32_t e : mine) valid &= e >= 0 && e < E;
    if (!valid || std::set<int32_t>(mine.begin(), mine.end()).size() != static_cast<size_t>(KT)) {
      bad_ids += KT;
      continue;
    }
    std::vector<int64_t> want_ids(rt.experts.begin(), rt.experts.end());
    std::vector<int64_t> got_ids(mine.begin(), mine.end());
    if (got_ids != want_ids) {
      // Accept only a choice whose every expert scores within 1e-6 of the reference's k-th score
      // (fp32 vs float64 sigmoid on a near-tie), and say so.
      const double kth = ref::sigmoid(lt[want_ids.back()]) + bias_d[want_ids.back()];
      bool tie = true;
      for (int32_t e : mine) tie &= ref::sigmoid(lt[e]) + bias_d[e] >= kth - 1e-6;
      if (tie)
        ++near_ties;
      else
        bad_ids += KT;
    }
    double sum = 0;
    for (int32_t e : mine) sum += ref::sigmoid(lt[e]);
    for (int64_t j = 0; j < KT; ++j) {
      w_got.push_back(gw[t * KT + j]);
      w_want.push_back(ref::sigmoid(lt[mine[j]]) / sum);
      used.insert(mine[j]);
    }
  }
  ctx.report.zero(c.name(), "moe_route top-k ids", bad_ids,
                  near_ties ? fmt::format("{} rows differ only on a near-tie", near_ties) : std::string());
  ctx.report.add(c.name(), "moe_route weights", rel_error(w_got, w_want), 1e-5,
                 ctx.time ? fmt::format("{:.1f} us", route_ms * 1e3) : std::string());
  int64_t table_bad = gex[0] != static_cast<int32_t>(used.size());
  const std::vector<int32_t> used_v(used.begin(), used.end());
  for (size_t u = 0; u < used_v.size() && !table_bad; ++u) {
    table_bad += gex[1 + u] != used_v[u];
    for (int64_t t = 0; t < T; ++t) {
      int32_t want = -1;
      for (int64_t j = 0; j < KT; ++j)
        if (gid[t * KT + j] == used_v[u]) want = static_cast<int32_t>(j);
      table_bad += gsl[u * T + t] != want;
    }
  }
  ctx.report.zero(c.name(), "moe_route expert table", table_bad);

  // The router with the routing fused (gemm TK): the same logits and routing bit for bit, twice over
  // one block counter (zeroed once, as the runtime's workspace), which each launch leaves at zero.
  if (!k.router_route.op.empty()) {
    DevBuf done = device_copy(std::vector<uint32_t>(64, 0u));
    for (int launch = 0; launch < 2; ++launch) {
      DevBuf fl(T * E * 4), ids(T * KT * 4), tw(T * KT * 4), ex((1 + U) * 4), sl(U * T * 4);
      for (DevBuf* b : {&fl, &ids, &tw, &ex, &sl}) b->poison();
      ctx.kernels.launch(k.router_route, {{"x", dx},
                                          {"out", fl},
                                          {"w0", dwr},
                                          {"bias", dbias},
                                          {"topk_ids", ids},
                                          {"topk_weights", tw},
                                          {"experts", ex},
                                          {"expert_slots", sl},
                                          {"done", done}});
      int64_t differ = 0;
      auto count = [&](const DevBuf& a, const DevBuf& b) {
        const std::vector<uint8_t> x = a.download<uint8_t>(), y = b.download<uint8_t>();
        for (size_t i = 0; i < x.size(); ++i) differ += x[i] != y[i];
      };
      count(fl, logits);
      count(ids, R.ids);
      count(tw, R.tw);
      count(ex, R.experts);
      count(sl, R.eslots);
      const std::string tag = fmt::format("router + routing fused (launch {})", launch + 1);
      ctx.report.zero(c.name(), tag + ": bytes unlike the separate kernels'", differ);
      ctx.report.zero(c.name(), tag + ": block counter left nonzero", done.download<uint32_t>(0, 1)[0] != 0);
    }
  }
  R.w_want = std::move(w_want);
  R.used_v = used_v;
  R.ok = !bad_ids && !table_bad;
  return R;
}

// Router logits -> moe_route -> moe_up -> moe_down, each checked on its own (inputs: the previous
// GPU outputs) and the whole chain against the reference from x.
void check_moe(Ctx& ctx, const Case& c, const CaseKernels& k, uint64_t seed) {
  const ModelShape& m = *c.model;
  const int64_t T = c.rows(), H = m.hidden, E = m.experts, KT = m.top_k, I = m.inter, S = m.shared;
  Rng rng(seed);
  auto x = rand_bf16(T * H, rng, -1, 1);
  const Mat mx = to_mat(x, T, H);
  const double ah = std::sqrt(3.0 / H);
  DevBuf dx = device_copy(x);
  Routed R = check_routing(ctx, c, k, rng, dx, mx);
  if (!R.ok) return;  // the expert kernels would index garbage
  const std::vector<int32_t>& gid = R.gid;
  const std::vector<float>& gw = R.gw;
  const std::vector<double>& w_want = R.w_want;
  const std::vector<int32_t>& used_v = R.used_v;
  DevBuf &experts = R.experts, &eslots = R.eslots, &tw = R.tw;

  // ---- weights: only routed experts get values; the rest (and any padding) stay NaN on the device ----
  // Layouts (cases.h): dense stacks w1, w3 [E, I, H] and w2 [E, H, I]; padded: vLLM's fused w13
  // [E, 2I, H] (w1 = w13, w3 = w13 + I*H, both strides 2*I*H) and a w2 stack with padding per expert;
  // wide: the same with strides that put the last expert past 2^32 elements.
  // FP8 (Q8 = 1): the stacks hold e4m3 bytes (element strides are byte strides, multiples of 16), and
  // beside them the experts' fp32 block scales, nb = ceil(I/128) * ceil(H/128) per matrix: dense
  // [E, nb] stacks, or (padded, wide) fused w13 scales [E, 2 nb] (w3_scale = w13_scale + nb) and 3
  // poisoned floats after every expert's w2 scales. Poison is NaN in e4m3 (0xFF) as in bf16 and fp32.
  const bool fp8 = q8_of(k.moe_up) != 0;
  if (fp8 != (q8_of(k.moe_down) != 0)) fail(Errc::internal, "{}: moe_up and moe_down differ in Q8", c.name());
  const int64_t elem = fp8 ? 1 : 2;
  const double ai = std::sqrt(3.0 / I), as = std::sqrt(3.0 / std::max<int64_t>(S, 8));
  const int64_t IH = I * H;
  const bool fused = c.layout != Layout::dense;
  int64_t stride_w13 = fused ? 2 * IH : IH, stride_w2 = fused ? IH + 64 : IH;
  if (c.layout == Layout::wide && E > 1) {
    const int64_t past = kFar / (E - 1) + 1, far = fp8 ? (past + 15) / 16 * 16 : round_up8(past);
    stride_w13 = std::max(stride_w13, far);
    stride_w2 = std::max(stride_w2, far);
  }
  const int64_t nb = (I + kFp8Block - 1) / kFp8Block * ((H + kFp8Block - 1) / kFp8Block);
  const int64_t stride_s13 = fused ? 2 * nb : nb, stride_s2 = fused ? nb + 3 : nb;
  DevBuf w1(E * stride_w13 * elem), w3(fused ? 0 : E * IH * elem), w2(E * stride_w2 * elem);
  DevBuf s1(fp8 ? E * stride_s13 * 4 : 0), s3(fp8 && !fused ? E * nb * 4 : 0), s2(fp8 ? E * stride_s2 * 4 : 0);
  for (DevBuf* b : {&w1, &w3, &w2, &s1, &s3, &s2}) b->poison();
  const CUdeviceptr w1_ptr = w1.ptr, w3_ptr = fused ? w1.ptr + IH * elem : w3.ptr;
  const CUdeviceptr s1_ptr = s1.ptr, s3_ptr = fused ? s1.ptr + nb * 4 : s3.ptr;
  // Weight `w` of an expert at element `at` of `values`, its scales at float `scale_at` of `scales`.
  auto upload = [&](const HostWeight& w, DevBuf& values, int64_t at, DevBuf& scales, int64_t scale_at) {
    if (!w.fp8) return values.upload(w.bf16, static_cast<size_t>(at) * 2);
    values.upload(w.e4m3, static_cast<size_t>(at));
    scales.upload(w.scale, static_cast<size_t>(scale_at) * 4);
  };
  std::map<int32_t, HostWeight> h1, h3, h2;  // host copies of the routed experts
  int64_t far_experts = 0;  // routed experts whose weights start past 2^32 elements
  for (int32_t e : used_v) {
    Rng er(seed * 1000 + static_cast<uint64_t>(e));
    h1[e] = rand_weight(I, H, er, -ah, ah, fp8);
    h3[e] = rand_weight(I, H, er, -ah, ah, fp8);
    h2[e] = rand_weight(H, I, er, -ai, ai, fp8);
    upload(h1[e], w1, e * stride_w13, s1, e * stride_s13);
    if (fused)
      upload(h3[e], w1, e * stride_w13 + IH, s1, e * stride_s13 + nb);
    else
      upload(h3[e], w3, e * IH, s3, e * nb);
    upload(h2[e], w2, e * stride_w2, s2, e * stride_s2);
    far_experts += e * std::min(stride_w13, stride_w2) >= kFar;
  }
  std::string layout_note =
      fmt::format("{}: stride_w1/w3 {}, stride_w2 {} (dense {}); {} routed experts past 2^32 elements",
                  fused ? "fused w13" : "separate w1, w3", stride_w13, stride_w2, IH, far_experts);
  if (fp8)
    layout_note += fmt::format("; e4m3, stride_w1_scale/w3_scale {}, stride_w2_scale {} (dense {})", stride_s13,
                               stride_s2, nb);
  if (c.layout == Layout::wide)
    ctx.report.zero(c.name(), "moe wide layout reached", far_experts == 0, layout_note);
  const HostWeight sg = rand_weight(S, H, rng, -ah, ah, fp8), su = rand_weight(S, H, rng, -ah, ah, fp8),
                   sd = rand_weight(H, S, rng, -as, as, fp8);
  const DevWeight dsg = device_weight(sg), dsu = device_weight(su), dsd = device_weight(sd);

  // ---- moe_up ----
  DevBuf h(T * KT * I * 2), hs(T * S * 2);
  h.poison();
  hs.poison();
  std::map<std::string, Arg> up_args{{"x", dx},
                                     {"w1", w1_ptr},
                                     {"w3", w3_ptr},
                                     {"experts", experts},
                                     {"expert_slots", eslots},
                                     {"h", h},
                                     {"hs", hs},
                                     {"stride_w1", Arg(static_cast<uint32_t>(stride_w13))},
                                     {"stride_w3", Arg(static_cast<uint32_t>(stride_w13))}};
  bind_weight(up_args, "shared_gate", dsg);
  bind_weight(up_args, "shared_up", dsu);
  if (fp8) {
    up_args.emplace("w1_scale", Arg(s1_ptr));
    up_args.emplace("w3_scale", Arg(s3_ptr));
    up_args.emplace("stride_w1_scale", Arg(static_cast<uint32_t>(stride_s13)));
    up_args.emplace("stride_w3_scale", Arg(static_cast<uint32_t>(stride_s13)));
  }
  if (m.situ) {
    up_args.emplace("act_beta", Arg(static_cast<float>(m.situ_beta)));
    up_args.emplace("act_linear_beta", Arg(static_cast<float>(m.situ_linear_beta)));
  }
  const float up_ms = ctx.kernels.launch(k.moe_up, up_args);
  std::vector<double> h_ref(T * KT * I), hs_ref(T * S);
  for (int64_t t = 0; t < T; ++t) {
    const double* xt = mx.v.data() + t * H;
    for (int64_t j = 0; j < KT; ++j) {
      const int32_t e = gid[t * KT + j];
      for (int64_t i = 0; i < I; ++i) {
        const double g = ref::round_bf16(h1.at(e).dot(i, xt));
        const double u = ref::round_bf16(h3.at(e).dot(i, xt));
        h_ref[(t * KT + j) * I + i] = ref::round_bf16(act(m, g, u));
      }
    }
    for (int64_t i = 0; i < S; ++i) {
      const double g = ref::round_bf16(sg.dot(i, xt));
      const double u = ref::round_bf16(su.dot(i, xt));
      hs_ref[t * S + i] = ref::round_bf16(act(m, g, u));
    }
  }
  const std::vector<double> h_gpu = bf16_out(h), hs_gpu = bf16_out(hs);
  ctx.report.add(c.name(), "moe_up routed", rel(h_gpu, h_ref), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us", up_ms * 1e3) : layout_note);
  ctx.report.add(c.name(), "moe_up shared", rel(hs_gpu, hs_ref), kBf16Tol);

  // ---- moe_down (inputs: the GPU's h, hs and weights) ----
  DevBuf out(T * H * 2);
  out.poison();
  std::map<std::string, Arg> down_args{{"h", h},
                                       {"hs", hs},
                                       {"w2", w2},
                                       {"experts", experts},
                                       {"expert_slots", eslots},
                                       {"topk_weights", tw},
                                       {"out", out},
                                       {"routed_scaling", static_cast<float>(m.routed_scaling)},
                                       {"stride_w2", Arg(static_cast<uint32_t>(stride_w2))}};
  bind_weight(down_args, "shared_down", dsd);
  if (fp8) {
    down_args.emplace("w2_scale", Arg(s2));
    down_args.emplace("stride_w2_scale", Arg(static_cast<uint32_t>(stride_s2)));
  }
  const float down_ms = ctx.kernels.launch(k.moe_down, down_args);
  // vLLM's rounding points: each weighted expert output, their sum, the scaled sum, the shared
  // output and the final sum are bf16 tensors (Rounding::moe_weighted, moe_sum, linear, ffn_out).
  auto down_ref = [&](const std::vector<double>& hh, const std::vector<double>& hhs, const std::vector<double>& wts) {
    std::vector<double> o(T * H);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < H; ++n) {
        double acc = 0;
        for (int64_t j = 0; j < KT; ++j) {
          const int32_t e = gid[t * KT + j];
          acc += ref::round_bf16(wts[t * KT + j] * h2.at(e).dot(n, hh.data() + (t * KT + j) * I));
        }
        acc = ref::round_bf16(ref::round_bf16(acc) * m.routed_scaling);
        const double sh = ref::round_bf16(sd.dot(n, hhs.data() + t * S));
        o[t * H + n] = ref::round_bf16(acc + sh);
      }
    return o;
  };
  const std::vector<double> gw_d(gw.begin(), gw.end());
  const std::vector<double> out_gpu = bf16_out(out);
  ctx.report.add(c.name(), "moe_down", rel(out_gpu, down_ref(h_gpu, hs_gpu, gw_d)), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us", down_ms * 1e3) : std::string());
  ctx.report.add(c.name(), "moe chain (from x)", rel(out_gpu, down_ref(h_ref, hs_ref, w_want)), kBf16Tol,
                 fmt::format("{} experts used", used_v.size()));
  // The split grid (SK): the same sums from blocks that share the tiles, against the same reference,
  // twice over one set of tile counters (zeroed once), which each launch must leave at zero; the two
  // launches give the same bits (the slots are added in a fixed order). Also through the weight ring (RG;
  // e4m3), the blocks sharing the (tile, item) pairs.
  for (const codegen::KernelInstance* split : {&k.moe_down_split, &k.moe_down_split_ring}) {
    if (split->op.empty()) continue;
    const int64_t G = split->params.at("SK"), tiles = (H + 15) / 16, slots = (G + tiles - 1) / tiles + 1;
    const std::string form =
        split->params.count("RG") ? fmt::format(", ring of {} stages", split->params.at("RG")) : std::string();
    DevBuf parts(tiles * slots * 16 * T * 4), cnt = device_copy(std::vector<uint32_t>(tiles, 0u));
    parts.poison();
    std::vector<std::vector<double>> outs;
    float split_ms = 0;
    for (int rep = 0; rep < 2; ++rep) {
      DevBuf out2(T * H * 2);
      out2.poison();
      std::map<std::string, Arg> split_args = down_args;
      split_args.insert_or_assign("out", Arg(out2));
      split_args.emplace("partials", parts);
      split_args.emplace("done", cnt);
      split_ms = ctx.kernels.launch(*split, split_args);
      outs.push_back(bf16_out(out2));
    }
    ctx.report.add(c.name(), fmt::format("moe_down split over {} blocks{}", G, form),
                   rel(outs[0], down_ref(h_gpu, hs_gpu, gw_d)), kBf16Tol, ctx.time ? fmt::format("{:.1f} us (one block per tile: {:.1f} us)", split_ms * 1e3,
                                                    down_ms * 1e3)
                                      : std::string());
    int64_t left = 0, differ = 0;
    for (uint32_t v : cnt.download<uint32_t>()) left += v != 0;
    for (size_t i = 0; i < outs[0].size(); ++i) differ += outs[0][i] != outs[1][i];
    ctx.report.zero(c.name(), fmt::format("moe_down split{}: tile counters left nonzero", form), left);
    ctx.report.zero(c.name(), fmt::format("moe_down split{}: launches that differ", form), differ,
                    "output values, second launch vs first");
  }
}

// ---- MXFP4 latent MoE (Case::mxfp4) ---------------------------------------------------------------------

constexpr int64_t kMxfp4Group = 32;  // values per E8M0 scale

// An MXFP4 matrix [rows, cols] as the K3 checkpoints store it (compressed-tensors mxfp4-pack-quantized):
// random E2M1 codes, two per byte (the even column in the low nibble), and one E8M0 scale byte per 32
// values of a row, around 2^-(log2(sqrt(cols) * 3)) so that a row's dot product with unit-sized
// activations is of order one. Its real values come from the reference's own decoder
// (ref::dequant_mxfp4).
struct Fp4Weight {
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> packed;  // [rows, cols / 2]
  std::vector<uint8_t> scale;   // [rows, cols / 32]
  std::vector<double> real() const {
    return ref::dequant_mxfp4(std::vector<double>(packed.begin(), packed.end()),
                              std::vector<double>(scale.begin(), scale.end()), rows, cols, kMxfp4Group, "mxfp4 weight");
  }
};
Fp4Weight rand_fp4(int64_t rows, int64_t cols, Rng& rng) {
  Fp4Weight w;
  w.rows = rows;
  w.cols = cols;
  w.packed.resize(static_cast<size_t>(rows * cols / 2));
  w.scale.resize(static_cast<size_t>(rows * cols / kMxfp4Group));
  for (uint8_t& b : w.packed) b = static_cast<uint8_t>(rng.next() & 0xff);
  const int centre = 127 - static_cast<int>(std::lround(std::log2(std::sqrt(static_cast<double>(cols)) * 3.0)));
  for (uint8_t& s : w.scale) s = static_cast<uint8_t>(centre - 1 + rng.below(3));
  return w;
}

// moe_up / moe_down over MXFP4 experts in the latent width, checked on their own (inputs: the previous GPU
// outputs) and the whole latent MoE from x against the reference (the rounding points of
// compiler/reference/layer.cpp ffn(), latent_moe at TP 1).
void check_latent_moe(Ctx& ctx, const Case& c, const CaseKernels& k, uint64_t seed) {
  const ModelShape& m = *c.model;
  const int64_t T = c.rows(), H = m.hidden, D = m.latent, E = m.experts, KT = m.top_k, I = m.inter, S = m.shared;
  Rng rng(seed);
  auto x = rand_bf16(T * H, rng, -1, 1);
  const Mat mx = to_mat(x, T, H);
  DevBuf dx = device_copy(x);
  Routed R = check_routing(ctx, c, k, rng, dx, mx);
  if (!R.ok) return;  // the expert kernels would index garbage
  const double ah = std::sqrt(3.0 / H), ad = std::sqrt(3.0 / D), as = std::sqrt(3.0 / S);

  // ---- latent down ----
  const HostWeight wdl = rand_weight(D, H, rng, -ah, ah, false);
  const DevWeight dwdl = device_weight(wdl);
  DevBuf lat(T * D * 2);
  lat.poison();
  const float lat_ms = ctx.kernels.launch(k.lat_down, {{"x", dx}, {"out", lat}, {"w0", dwdl.values}});
  const std::vector<double> lat_ref = linear_bf16(mx, wdl.real(), D, H), lat_gpu = bf16_out(lat);
  ctx.report.add(c.name(), "gemm latent down", rel(lat_gpu, lat_ref), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us", lat_ms * 1e3) : std::string());

  // ---- MXFP4 expert stacks: dense [E, I*D/2] bytes (w1, w3) and [E, D*I/2] (w2), scales [E, I*D/32] and
  // [E, D*I/32]; padded: the fused w13 (w3 = w13 + I*D/2, strides I*D) with its fused scales (w3_scale =
  // w13_scale + I*D/32, strides I*D/16), 64 spare bytes after every w2 expert and 3 after its scales.
  // Only the routed experts are uploaded; the rest is poison (0xFF: code -6 with scale byte 255). ----
  const bool fused = c.layout != Layout::dense;
  const int64_t pk = I * D / 2, sk = I * D / kMxfp4Group;  // bytes of one matrix, of its scales
  const int64_t stride_w13 = fused ? 2 * pk : pk, stride_s13 = fused ? 2 * sk : sk;
  const int64_t stride_w2 = fused ? pk + 64 : pk, stride_s2 = fused ? sk + 3 : sk;
  DevBuf w1(E * stride_w13), w3(fused ? 0 : E * pk), w2(E * stride_w2);
  DevBuf s1(E * stride_s13), s3(fused ? 0 : E * sk), s2(E * stride_s2);
  for (DevBuf* b : {&w1, &w3, &w2, &s1, &s3, &s2}) b->poison();
  const CUdeviceptr w1_ptr = w1.ptr, w3_ptr = fused ? w1.ptr + pk : w3.ptr;
  const CUdeviceptr s1_ptr = s1.ptr, s3_ptr = fused ? s1.ptr + sk : s3.ptr;
  std::map<int32_t, Fp4Weight> h1, h3, h2;
  for (int32_t e : R.used_v) {
    Rng er(seed * 1000 + static_cast<uint64_t>(e));
    h1[e] = rand_fp4(I, D, er);
    h3[e] = rand_fp4(I, D, er);
    h2[e] = rand_fp4(D, I, er);
    w1.upload(h1[e].packed, static_cast<size_t>(e * stride_w13));
    s1.upload(h1[e].scale, static_cast<size_t>(e * stride_s13));
    if (fused) {
      w1.upload(h3[e].packed, static_cast<size_t>(e * stride_w13 + pk));
      s1.upload(h3[e].scale, static_cast<size_t>(e * stride_s13 + sk));
    } else {
      w3.upload(h3[e].packed, static_cast<size_t>(e * pk));
      s3.upload(h3[e].scale, static_cast<size_t>(e * sk));
    }
    w2.upload(h2[e].packed, static_cast<size_t>(e * stride_w2));
    s2.upload(h2[e].scale, static_cast<size_t>(e * stride_s2));
  }
  const std::string layout_note =
      fmt::format("{}: stride_w1/w3 {}, _scale {}; stride_w2 {}, _scale {} (dense {}, {})",
                  fused ? "fused w13" : "separate w1, w3", stride_w13, stride_s13, stride_w2, stride_s2, pk, sk);

  // ---- moe_up (Q4) ----
  DevBuf h(T * KT * I * 2);
  h.poison();
  std::map<std::string, Arg> up_args{{"x", lat},
                                     {"w1", w1_ptr},
                                     {"w1_scale", s1_ptr},
                                     {"w3", w3_ptr},
                                     {"w3_scale", s3_ptr},
                                     {"experts", R.experts},
                                     {"expert_slots", R.eslots},
                                     {"h", h},
                                     {"stride_w1", Arg(static_cast<uint32_t>(stride_w13))},
                                     {"stride_w1_scale", Arg(static_cast<uint32_t>(stride_s13))},
                                     {"stride_w3", Arg(static_cast<uint32_t>(stride_w13))},
                                     {"stride_w3_scale", Arg(static_cast<uint32_t>(stride_s13))}};
  if (m.situ) {
    up_args.emplace("act_beta", Arg(static_cast<float>(m.situ_beta)));
    up_args.emplace("act_linear_beta", Arg(static_cast<float>(m.situ_linear_beta)));
  }
  const int repeat = ctx.time ? 20 : 1;
  const float up_ms = ctx.kernels.launch(k.moe_up, up_args, repeat);
  // h for the rows of each expert, from latent rows [T, D]: for each of `ins` (the GPU's latent and the
  // reference's), each expert dequantised once.
  auto up_ref = [&](const std::vector<const std::vector<double>*>& ins) {
    std::vector<std::vector<double>> outs(ins.size(), std::vector<double>(T * KT * I));
    for (int32_t e : R.used_v) {
      const std::vector<double> g = h1.at(e).real(), u = h3.at(e).real();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < KT; ++j) {
          if (R.gid[t * KT + j] != e) continue;
          for (size_t n = 0; n < ins.size(); ++n) {
            const double* xt = ins[n]->data() + t * D;
            for (int64_t i = 0; i < I; ++i) {
              double gs = 0, us = 0;
              for (int64_t d = 0; d < D; ++d) {
                gs += g[i * D + d] * xt[d];
                us += u[i * D + d] * xt[d];
              }
              outs[n][(t * KT + j) * I + i] = ref::round_bf16(act(m, ref::round_bf16(gs), ref::round_bf16(us)));
            }
          }
        }
    }
    return outs;
  };
  const std::vector<double> h_gpu = bf16_out(h);
  const std::vector<std::vector<double>> hs_both = up_ref({&lat_gpu, &lat_ref});
  const std::vector<double>&h_ref = hs_both[0], &h_chain = hs_both[1];
  // Bandwidth on the bytes the launch must read: the used experts' packed codes and scales.
  const double up_bytes = static_cast<double>(R.used_v.size()) * 2 * (pk + sk);
  ctx.report.add(c.name(), "moe_up mxfp4 routed", rel(h_gpu, h_ref), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us, {:.0f} GB/s on {} experts' packed bytes", up_ms * 1e3,
                                        up_bytes / (up_ms * 1e-3) * 1e-9, R.used_v.size())
                          : layout_note);
  // The weight rings (RG, a ring per warp): the same h bit for bit (the chunks are summed in the register
  // loop's order), and its time beside the register form's.
  for (const codegen::KernelInstance& ring : k.moe_up_rings) {
    DevBuf h2(T * KT * I * 2);
    h2.poison();
    std::map<std::string, Arg> ring_args = up_args;
    ring_args.insert_or_assign("h", Arg(h2));
    const float ring_ms = ctx.kernels.launch(ring, ring_args, repeat);
    const std::vector<uint16_t> a = h.download<uint16_t>(), b = h2.download<uint16_t>();
    int64_t unlike = 0;
    for (size_t i = 0; i < a.size(); ++i) unlike += a[i] != b[i];
    const int64_t stages = ring.params.at("RG");
    ctx.report.zero(c.name(), fmt::format("moe_up mxfp4 ring of {} stages: values unlike the register form's", stages),
                    unlike);
    ctx.report.add(c.name(), fmt::format("moe_up mxfp4 ring of {} stages", stages), rel(bf16_out(h2), h_ref),
                   kBf16Tol,
                   ctx.time ? fmt::format("{:.1f} us, {:.0f} GB/s on {} experts' packed bytes", ring_ms * 1e3,
                                          up_bytes / (ring_ms * 1e-3) * 1e-9, R.used_v.size())
                            : std::string());
  }

  // ---- moe_down (Q4): the scaled latent sum ----
  DevBuf sum(T * D * 2);
  sum.poison();
  // moe_down's arguments writing the sum to `out` (the split form adds its workspace).
  auto down_args = [&](const DevBuf& out) {
    return std::map<std::string, Arg>{{"h", h},
                                      {"w2", w2},
                                      {"w2_scale", s2},
                                      {"experts", R.experts},
                                      {"expert_slots", R.eslots},
                                      {"topk_weights", R.tw},
                                      {"out", out},
                                      {"routed_scaling", static_cast<float>(m.routed_scaling)},
                                      {"stride_w2", Arg(static_cast<uint32_t>(stride_w2))},
                                      {"stride_w2_scale", Arg(static_cast<uint32_t>(stride_s2))}};
  };
  const float down_ms = ctx.kernels.launch(k.moe_down, down_args(sum), repeat);
  // The scaled latent sum from (h, weights) pairs: the GPU's h with its weights, and the reference
  // chain's; each expert dequantised once.
  using HW = std::pair<const std::vector<double>*, const std::vector<double>*>;
  auto down_ref = [&](const std::vector<HW>& ins) {
    std::vector<std::vector<double>> ye(ins.size(), std::vector<double>(T * KT * D));  // round(w * W2 h)
    for (int32_t e : R.used_v) {
      const std::vector<double> w = h2.at(e).real();
      for (int64_t t = 0; t < T; ++t)
        for (int64_t j = 0; j < KT; ++j) {
          if (R.gid[t * KT + j] != e) continue;
          for (size_t k2 = 0; k2 < ins.size(); ++k2) {
            const double* ht = ins[k2].first->data() + (t * KT + j) * I;
            for (int64_t n = 0; n < D; ++n) {
              double acc = 0;
              for (int64_t i = 0; i < I; ++i) acc += w[n * I + i] * ht[i];
              ye[k2][(t * KT + j) * D + n] = ref::round_bf16((*ins[k2].second)[t * KT + j] * acc);
            }
          }
        }
    }
    std::vector<std::vector<double>> o(ins.size(), std::vector<double>(T * D));
    for (size_t k2 = 0; k2 < ins.size(); ++k2)
      for (int64_t t = 0; t < T; ++t)
        for (int64_t n = 0; n < D; ++n) {
          double acc = 0;
          for (int64_t j = 0; j < KT; ++j) acc += ye[k2][(t * KT + j) * D + n];
          o[k2][t * D + n] = ref::round_bf16(ref::round_bf16(acc) * m.routed_scaling);
        }
    return o;
  };
  const std::vector<double> gw_d(R.gw.begin(), R.gw.end());
  const std::vector<double> sum_gpu = bf16_out(sum);
  const std::vector<std::vector<double>> sums_both = down_ref({{&h_gpu, &gw_d}, {&h_chain, &R.w_want}});
  const double down_bytes = static_cast<double>(R.used_v.size()) * (pk + sk);
  ctx.report.add(c.name(), "moe_down mxfp4 (latent sum)", rel(sum_gpu, sums_both[0]), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us, {:.0f} GB/s on {} experts' packed bytes", down_ms * 1e3,
                                        down_bytes / (down_ms * 1e-3) * 1e-9, R.used_v.size())
                          : std::string());
  // The split grid (SK): the same sum from blocks that share the tiles, against the same reference;
  // repeated over one set of tile counters (zeroed once), which every launch must leave at zero. Also
  // through the weight ring (RG), the blocks sharing the (tile, expert) pairs.
  for (const codegen::KernelInstance* split : {&k.moe_down_split, &k.moe_down_split_ring}) {
    if (split->op.empty()) continue;
    const int64_t G = split->params.at("SK"), tiles = (D + 15) / 16, slots = (G + tiles - 1) / tiles + 1;
    DevBuf parts(tiles * slots * 16 * T * 4), cnt = device_copy(std::vector<uint32_t>(tiles, 0u));
    parts.poison();
    DevBuf sum2(T * D * 2);
    sum2.poison();
    std::map<std::string, Arg> split_args = down_args(sum2);
    split_args.emplace("partials", parts);
    split_args.emplace("done", cnt);
    const float split_ms = ctx.kernels.launch(*split, split_args, repeat);
    const std::string form =
        split->params.count("RG") ? fmt::format(", ring of {} stages", split->params.at("RG")) : std::string();
    ctx.report.add(c.name(), fmt::format("moe_down mxfp4 split over {} blocks{}", G, form),
                   rel(bf16_out(sum2), sums_both[0]), kBf16Tol,
                   ctx.time ? fmt::format("{:.1f} us, {:.0f} GB/s on {} experts' packed bytes", split_ms * 1e3,
                                          down_bytes / (split_ms * 1e-3) * 1e-9, R.used_v.size())
                            : std::string());
    int64_t left = 0;
    for (uint32_t v : cnt.download<uint32_t>()) left += v != 0;
    ctx.report.zero(c.name(), fmt::format("moe_down split{}: tile counters left nonzero", form), left);
  }

  // The weight ring (RG): the same sum, the weights streamed through shared memory by bulk copies.
  for (const codegen::KernelInstance& ring : k.moe_down_rings) {
    DevBuf sum3(T * D * 2);
    sum3.poison();
    const float ring_ms = ctx.kernels.launch(ring, down_args(sum3), repeat);
    ctx.report.add(c.name(), fmt::format("moe_down mxfp4 ring of {} stages", ring.params.at("RG")),
                   rel(bf16_out(sum3), sums_both[0]), kBf16Tol,
                   ctx.time ? fmt::format("{:.1f} us, {:.0f} GB/s on {} experts' packed bytes", ring_ms * 1e3,
                                          down_bytes / (ring_ms * 1e-3) * 1e-9, R.used_v.size())
                            : std::string());
  }

  // ---- RMSNorm of the latent sum (no residual: residual_out is a copy of the input) ----
  auto nw = rand_bf16(D, rng, 0.5, 1.5);
  DevBuf dnw = device_copy(nw), ln(T * D * 2), copy(T * D * 2);
  ln.poison();
  copy.poison();
  ctx.kernels.launch(k.lat_norm, {{"hidden", sum},
                                  {"residual", CUdeviceptr(0)},
                                  {"weight", dnw},
                                  {"out", ln},
                                  {"residual_out", copy},
                                  {"eps", static_cast<float>(1e-5)}});
  auto norm_ref = [&](const std::vector<double>& in) {
    Mat mi(T, D);
    mi.v = in;
    return ref::fused_add_rms_norm(mi, nullptr, to_double(nw), 1e-5, ref::Rounding::vllm()).x.v;
  };
  const std::vector<double> ln_gpu = bf16_out(ln);
  ctx.report.add(c.name(), "rmsnorm latent", rel(ln_gpu, norm_ref(sum_gpu)), kBf16Tol);
  ctx.report.add(c.name(), "rmsnorm latent residual_out", rel(bf16_out(copy), sum_gpu), 1e-6);

  // ---- shared expert at full width (bf16) ----
  const HostWeight sg = rand_weight(S, H, rng, -ah, ah, false), su = rand_weight(S, H, rng, -ah, ah, false),
                   sd = rand_weight(H, S, rng, -as, as, false);
  const DevWeight dsg = device_weight(sg), dsu = device_weight(su), dsd = device_weight(sd);
  DevBuf hs(T * S * 2), sh(T * H * 2);
  hs.poison();
  sh.poison();
  std::map<std::string, Arg> su_args{{"x", dx}, {"w_gate", dsg.values}, {"w_up", dsu.values}, {"h", hs}};
  if (m.situ) {
    su_args.emplace("act_beta", Arg(static_cast<float>(m.situ_beta)));
    su_args.emplace("act_linear_beta", Arg(static_cast<float>(m.situ_linear_beta)));
  }
  ctx.kernels.launch(k.mlp_up, su_args);
  ctx.kernels.launch(k.mlp_down, {{"x", hs}, {"out", sh}, {"w0", dsd.values}});
  const std::vector<double> sgr = linear_bf16(mx, sg.real(), S, H), sur = linear_bf16(mx, su.real(), S, H);
  std::vector<double> hs_ref(T * S);
  for (size_t i = 0; i < hs_ref.size(); ++i) hs_ref[i] = ref::round_bf16(act(m, sgr[i], sur[i]));
  Mat mhs(T, S);
  mhs.v = hs_ref;
  const std::vector<double> sdd = sd.real(), sh_ref = linear_bf16(mhs, sdd, H, S), sh_gpu = bf16_out(sh);
  ctx.report.add(c.name(), "shared expert (mlp_up + down)", rel(sh_gpu, sh_ref), kBf16Tol);

  // ---- latent up + shared (gemm AD) ----
  const HostWeight wul = rand_weight(H, D, rng, -ad, ad, false);
  const DevWeight dwul = device_weight(wul);
  DevBuf out(T * H * 2);
  out.poison();
  const float lup_ms = ctx.kernels.launch(k.lat_up, {{"x", ln}, {"out", out}, {"w0", dwul.values}, {"add", sh}});
  const std::vector<double> wuld = wul.real();
  auto out_ref = [&](const std::vector<double>& normed, const std::vector<double>& shared) {
    Mat mn(T, D);
    mn.v = normed;
    std::vector<double> o = linear_bf16(mn, wuld, H, D);
    for (size_t i = 0; i < o.size(); ++i) o[i] = ref::round_bf16(o[i] + shared[i]);
    return o;
  };
  const std::vector<double> out_gpu = bf16_out(out);
  ctx.report.add(c.name(), "gemm latent up + shared (AD)", rel(out_gpu, out_ref(ln_gpu, sh_gpu)), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us", lup_ms * 1e3) : std::string());
  // The whole latent MoE from x: every stage from the reference's own previous stage.
  const std::vector<double> chain = out_ref(norm_ref(sums_both[1]), sh_ref);
  ctx.report.add(c.name(), "latent moe chain (from x)", rel(out_gpu, chain), kBf16Tol,
                 fmt::format("{} experts used", R.used_v.size()));
}

void check_mlp(Ctx& ctx, const Case& c, const CaseKernels& k, uint64_t seed) {
  const ModelShape& m = *c.model;
  const int64_t T = c.rows(), H = m.hidden, I = m.dense_inter;
  Rng rng(seed);
  auto x = rand_bf16(T * H, rng, -1, 1);
  const double ah = std::sqrt(3.0 / H), ai = std::sqrt(3.0 / I);
  const bool up8 = q8_of(k.mlp_up) != 0, down8 = q8_of(k.mlp_down) != 0;
  const HostWeight wg = rand_weight(I, H, rng, -ah, ah, up8), wu = rand_weight(I, H, rng, -ah, ah, up8),
                   wd = rand_weight(H, I, rng, -ai, ai, down8);
  DevBuf dx = device_copy(x);
  const DevWeight dwg = device_weight(wg), dwu = device_weight(wu), dwd = device_weight(wd);
  DevBuf h(T * I * 2), out(T * H * 2);
  h.poison();
  out.poison();
  std::map<std::string, Arg> args{{"x", dx}, {"h", h}};
  bind_weight(args, "w_gate", dwg);
  bind_weight(args, "w_up", dwu);
  if (m.situ) {
    args.emplace("act_beta", Arg(static_cast<float>(m.situ_beta)));
    args.emplace("act_linear_beta", Arg(static_cast<float>(m.situ_linear_beta)));
  }
  const float up_ms = ctx.kernels.launch(k.mlp_up, args);
  const Mat mx = to_mat(x, T, H);
  const std::vector<double> g = linear_bf16(mx, wg.real(), I, H), u = linear_bf16(mx, wu.real(), I, H);
  std::vector<double> h_ref(T * I);
  for (size_t i = 0; i < h_ref.size(); ++i) h_ref[i] = ref::round_bf16(act(m, g[i], u[i]));
  const std::vector<double> h_gpu = bf16_out(h);
  ctx.report.add(c.name(), "mlp_up", rel(h_gpu, h_ref), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us", up_ms * 1e3) : std::string());
  std::map<std::string, Arg> down_args{{"x", h}, {"out", out}};
  bind_weight(down_args, "w0", dwd);
  const float down_ms = ctx.kernels.launch(k.mlp_down, down_args);
  Mat mh(T, I), mhr(T, I);
  mh.v = h_gpu;
  mhr.v = h_ref;
  const std::vector<double> out_gpu = bf16_out(out), wdd = wd.real();
  ctx.report.add(c.name(), "gemm mlp down", rel(out_gpu, linear_bf16(mh, wdd, H, I)), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us", down_ms * 1e3) : std::string());
  ctx.report.add(c.name(), "mlp chain (from x)", rel(out_gpu, linear_bf16(mhr, wdd, H, I)), kBf16Tol);
}

// MLA: mla_prep -> mla_attn -> mla_combine on a paged cache with random history, against the
// absorbed-attention math of compiler/reference/layer.cpp mla_mixer (cache write before attention,
// causal within the request's new rows, bf16 q_lat / o_lat / o at vLLM's storage points).
// The q-LoRA front of a K3 MLA layer, the layer program's first three mixer steps: gemm [q_a | kv_a | g]
// over random x, rmsnorm (q_a_layernorm) of the q_a columns of those rows (S = the row width, residual
// null), gemm q_b_proj. Each step is checked against the reference of its own GPU input.
struct MlaFront {
  DevBuf fused, q;             // [T, row] bf16 [q_a | kv | g], [T, NQ] bf16 q rows
  int64_t row = 0;
  std::vector<double> gpu;     // [T, NQ + L+R + G]: q from the q_b gemm, kv and gate from the fused rows
  std::vector<double> from_x;  // the same rows computed from x by the reference alone
};

MlaFront mla_q_lora_front(Ctx& ctx, const Case& c, const CaseKernels& k, Rng& rng) {
  const ModelShape& m = *c.model;
  const int64_t T = c.rows(), H = m.hidden, N = m.mla_heads, QL = m.q_lora, LR = m.lora + m.rope;
  const int64_t NQ = N * (m.nope + m.rope), G = m.mla_gate ? N * m.v_dim : 0, row = QL + LR + G, ld = NQ + LR + G;
  auto x = rand_bf16(T * H, rng, -1, 1);
  const Mat mx = to_mat(x, T, H);
  const double ah = std::sqrt(3.0 / H), aq = std::sqrt(3.0 / QL);
  const HostWeight wqa = rand_weight(QL, H, rng, -ah, ah, false), wkv = rand_weight(LR, H, rng, -2 * ah, 2 * ah, false);
  const HostWeight wg = rand_weight(std::max<int64_t>(G, 1), H, rng, -3 * ah, 3 * ah, false);
  const HostWeight wqb = rand_weight(NQ, QL, rng, -aq, aq, false);
  auto qa_norm_w = rand_bf16(QL, rng, 0.5, 1.5);

  MlaFront f;
  f.row = row;
  f.fused = DevBuf(T * row * 2);
  f.fused.poison();
  DevBuf dx = device_copy(x), dnw = device_copy(qa_norm_w);
  const DevWeight dqa = device_weight(wqa), dkv = device_weight(wkv), dg = device_weight(wg), dqb = device_weight(wqb);
  std::map<std::string, Arg> in_args{{"x", dx}, {"out", f.fused}};
  bind_weight(in_args, "w0", dqa);
  bind_weight(in_args, "w1", dkv);
  if (G > 0) bind_weight(in_args, "w2", dg);
  const float t_in = ctx.kernels.launch(k.mla_in, in_args);
  const std::vector<double> e_qa = linear_bf16(mx, wqa.real(), QL, H), e_kv = linear_bf16(mx, wkv.real(), LR, H);
  const std::vector<double> e_g = G > 0 ? linear_bf16(mx, wg.real(), G, H) : std::vector<double>{};
  std::vector<double> expect(T * row);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < row; ++j)
      expect[t * row + j] = j < QL ? e_qa[t * QL + j] : j < QL + LR ? e_kv[t * LR + j - QL] : e_g[t * G + j - QL - LR];
  const std::vector<double> fused = bf16_out(f.fused);
  ctx.report.add(c.name(), "gemm mla in_proj (q_a, kv_a, g)", rel(fused, expect), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us", t_in * 1e3) : fmt::format("row {}", row));

  DevBuf qn(T * QL * 2), q_copy(T * QL * 2);
  qn.poison();
  q_copy.poison();
  const float t_norm = ctx.kernels.launch(
      k.q_norm, {{"hidden", f.fused}, {"weight", dnw}, {"out", qn}, {"residual_out", q_copy}, {"eps", 1e-5f}});
  Mat gqa(T, QL);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < QL; ++j) gqa(t, j) = fused[t * row + j];
  const ref::AddNorm en = ref::fused_add_rms_norm(gqa, nullptr, to_double(qa_norm_w), 1e-5, ref::Rounding::vllm());
  ctx.report.add(c.name(), "rmsnorm q_a (strided rows)", rel(bf16_out(qn), en.x.v), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us", t_norm * 1e3) : fmt::format("S {}", row));
  ctx.report.add(c.name(), "rmsnorm q_a residual_out", rel(bf16_out(q_copy), en.residual.v), 1e-6);

  f.q = DevBuf(T * NQ * 2);
  f.q.poison();
  std::map<std::string, Arg> qb_args{{"x", qn}, {"out", f.q}};
  bind_weight(qb_args, "w0", dqb);
  const float t_qb = ctx.kernels.launch(k.q_b, qb_args);
  Mat mqn(T, QL);
  mqn.v = bf16_out(qn);
  const std::vector<double> q = bf16_out(f.q), wqb_real = wqb.real();
  ctx.report.add(c.name(), "gemm q_b", rel(q, linear_bf16(mqn, wqb_real, NQ, QL)), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us", t_qb * 1e3) : std::string());

  // From x alone: q_a -> q_a_layernorm -> q_b, kv and g, rounded where the GPU path stores bf16.
  Mat mqa(T, QL);
  mqa.v = e_qa;
  const ref::AddNorm enx = ref::fused_add_rms_norm(mqa, nullptr, to_double(qa_norm_w), 1e-5, ref::Rounding::vllm());
  const std::vector<double> q_x = linear_bf16(enx.x, wqb_real, NQ, QL);
  f.gpu.resize(T * ld);
  f.from_x.resize(T * ld);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < ld; ++j) {
      f.gpu[t * ld + j] = j < NQ ? q[t * NQ + j] : fused[t * row + QL + j - NQ];
      f.from_x[t * ld + j] = j < NQ ? q_x[t * NQ + j] : expect[t * row + QL + j - NQ];
    }
  return f;
}

// MLA prep + attention + combine. Plain q_proj models: one random stacked buffer [q | kv | gate] (row
// stride ld) so that the kernels' row strides are exercised. q-LoRA models (K3): the front above, and the
// kernels read q from the q_b output and kv and the gate from the fused rows, as the layer program binds
// them; the output is also checked against the reference from x.
void check_mla(Ctx& ctx, const Case& c, const CaseKernels& k, uint64_t seed) {
  const ModelShape& m = *c.model;
  const int64_t W = c.width, Q = c.q, T = c.rows(), N = m.mla_heads, L = m.lora, R = m.rope, PN = m.nope, V = m.v_dim,
                BS = m.block_size, NS = m.splits, LR = L + R;
  const int64_t NQ = N * (PN + R), G = m.mla_gate ? N * V : 0, ld = NQ + LR + G;
  Rng rng(seed);
  std::vector<double> pj;  // [T, ld] the q | kv | gate values the kernels read
  std::optional<MlaFront> front;
  DevBuf d_proj;
  CUdeviceptr q_ptr = 0, kv_ptr = 0;
  uint32_t stride_q = 0, stride_kv = 0;
  if (m.q_lora > 0) {
    front.emplace(mla_q_lora_front(ctx, c, k, rng));
    pj = front->gpu;
    q_ptr = front->q.ptr;
    stride_q = static_cast<uint32_t>(NQ);
    kv_ptr = front->fused.ptr + m.q_lora * 2;
    stride_kv = static_cast<uint32_t>(front->row);
  } else {
    std::vector<uint16_t> proj(T * ld);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < ld; ++j) {
        const double span = j < NQ ? 1.0 : j < NQ + LR ? 2.0 : 3.0;
        const double v = rng.uniform(-span, span);
        proj[t * ld + j] = to_bf16(v == 0 ? span : v);
      }
    pj = to_double(proj);
    d_proj = device_copy(proj);
    q_ptr = d_proj.ptr;
    stride_q = static_cast<uint32_t>(ld);
    kv_ptr = d_proj.ptr + NQ * 2;
    stride_kv = static_cast<uint32_t>(ld);
  }
  const double akb = std::sqrt(3.0 / PN);
  // kv_b [N*(PN+V), L]: e4m3 with block scales when the MLA kernels are the FP8 ones (both must agree).
  const bool fp8 = q8_of(k.mla_prep) != 0;
  if (fp8 != (q8_of(k.mla_combine) != 0)) fail(Errc::internal, "{}: mla_prep and mla_combine differ in Q8", c.name());
  const HostWeight kv_b = rand_weight(N * (PN + V), L, rng, -akb, akb, fp8);
  const std::vector<double> kvb = kv_b.real();
  auto norm_w = rand_bf16(L, rng, 0.5, 1.5);

  // The cache as the host lays it out (cases.h Layout): dense blocks, blocks with padding after their BS
  // rows (a multiple of 8: the attention reads rows with 16-byte loads), or blocks past 2^32 elements.
  const int64_t cache_dense = BS * LR;
  int64_t cache_stride = cache_dense, base = 0;
  if (c.layout != Layout::dense) cache_stride += 64;
  if (c.layout == Layout::wide) base = kFar / cache_stride + 1;

  // Requests: random lengths; request 0 as short as possible (splits with no token), request 1
  // padded when W >= 3. Blocks are base + a random permutation of 1..W*MB; the null block 0 and two
  // spare blocks are never used.
  std::vector<int32_t> lens(W);
  for (int64_t r = 0; r < W; ++r) lens[r] = static_cast<int32_t>(Q + rng.below(m.max_context - Q + 1));
  if (W >= 2) lens[0] = static_cast<int32_t>(Q);
  if (W >= 3) lens[1] = 0;
  const int64_t MB = (m.max_context + BS - 1) / BS;  // block-table row length
  const int64_t num_blocks = base + 1 + W * MB + 2;
  std::vector<int32_t> perm(W * MB);
  for (int64_t i = 0; i < W * MB; ++i) perm[i] = static_cast<int32_t>(base + 1 + i);
  for (int64_t i = W * MB - 1; i > 0; --i) std::swap(perm[i], perm[rng.below(i + 1)]);
  const std::vector<int32_t>& bt = perm;  // [W, MB]
  std::vector<int64_t> slot_map(T, -1);
  for (int64_t r = 0; r < W; ++r)
    for (int64_t i = 0; i < Q && lens[r] > 0; ++i) {
      const int64_t pos = lens[r] - Q + i;
      slot_map[r * Q + i] = static_cast<int64_t>(bt[r * MB + pos / BS]) * BS + pos % BS;
    }
  const Pool<uint16_t> pcache(num_blocks, cache_dense, cache_stride, live_slots(base + 1, W * MB + 2),
                              [&](size_t n) { return rand_bf16(n, rng, -2, 2); });

  DevBuf d_norm = device_copy(norm_w);
  const DevWeight d_kvb = device_weight(kv_b);
  DevBuf d_lens = device_copy(lens), d_bt = device_copy(perm), d_slots = device_copy(slot_map);
  const DevBuf& d_cache = pcache.dev;
  const Arg cache_stride_arg(static_cast<uint32_t>(cache_stride));
  DevBuf q_abs(T * N * LR * 2), part_o(W * NS * Q * N * L * 4), part_ml(W * NS * Q * N * 2 * 4), out(T * N * V * 2);
  for (DevBuf* b : {&q_abs, &part_o, &part_ml, &out}) b->poison();
  const float eps = 1e-5f, scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(PN + R)));
  std::map<std::string, Arg> pargs{{"q", q_ptr},
                                   {"stride_q", Arg(stride_q)},
                                   {"kv", kv_ptr},
                                   {"stride_kv", Arg(stride_kv)},
                                   {"kv_norm_w", d_norm},
                                   {"seq_lens", d_lens},
                                   {"slot_mapping", d_slots},
                                   {"cache", d_cache},
                                   {"q_abs", q_abs},
                                   {"eps", eps},
                                   {"cache_stride", cache_stride_arg}};
  bind_weight(pargs, "kv_b", d_kvb);
  const float t_prep = ctx.kernels.launch(k.mla_prep, pargs);
  std::map<std::string, Arg> aargs{{"q_abs", q_abs},
                                   {"cache", d_cache},
                                   {"block_table", d_bt},
                                   {"stride_bt", Arg(static_cast<uint32_t>(MB))},
                                   {"seq_lens", d_lens},
                                   {"part_o", part_o},
                                   {"part_ml", part_ml},
                                   {"scale", scale},
                                   {"cache_stride", cache_stride_arg}};
  const float t_attn = ctx.kernels.launch(k.mla_attn, aargs);
  std::map<std::string, Arg> cargs{{"part_o", part_o},
                                   {"part_ml", part_ml},
                                   {"seq_lens", d_lens},
                                   {"stride_g", Arg(stride_kv)},
                                   {"out", out}};
  bind_weight(cargs, "kv_b", d_kvb);
  if (m.mla_gate) cargs.emplace("gate", Arg(kv_ptr + LR * 2));  // the gate columns follow kv
  const float t_comb = ctx.kernels.launch(k.mla_combine, cargs);

  // ---- reference over [q | kv | gate] rows pj (per live block: [BS, L+R]) ----
  struct Expect {
    std::map<int64_t, std::vector<double>> cache;
    std::set<int64_t> written;  // slots (block*BS + offset) the step writes
    std::vector<double> qabs, out;
  };
  const std::vector<double> nw = to_double(norm_w);
  auto reference = [&](const std::vector<double>& rows) {
    Expect x;
    std::map<int64_t, std::vector<double>>& cache = x.cache;
    cache = pcache.dense_double();
    auto cache_row = [&](int64_t slot) { return cache.at(slot / BS).data() + (slot % BS) * LR; };
    std::set<int64_t>& written = x.written;
    for (int64_t t = 0; t < T; ++t) {
      if (lens[t / Q] == 0 || slot_map[t] < 0) continue;
      std::vector<double> cv(L), cn(L);
      for (int64_t l = 0; l < L; ++l) cv[l] = rows[t * ld + NQ + l];
      ref::rms_norm(cv, nw, eps, cn);
      double* dst = cache_row(slot_map[t]);
      for (int64_t l = 0; l < L; ++l) dst[l] = ref::round_bf16(cn[l]);
      for (int64_t e = 0; e < R; ++e) dst[L + e] = rows[t * ld + NQ + L + e];
      written.insert(slot_map[t]);
    }
    std::vector<double>& qabs_ref = x.qabs;
    std::vector<double>& out_ref = x.out;
    qabs_ref.assign(T * N * LR, 0.0);
    out_ref.assign(T * N * V, 0.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t n = 0; n < N; ++n) {
        double* qa = qabs_ref.data() + (t * N + n) * LR;
        const double* qn = rows.data() + t * ld + n * (PN + R);
        for (int64_t l = 0; l < L; ++l) {
          double s = 0;
          for (int64_t j = 0; j < PN; ++j) s += qn[j] * kvb[(n * (PN + V) + j) * L + l];
          qa[l] = ref::round_bf16(s);
        }
        for (int64_t e = 0; e < R; ++e) qa[L + e] = qn[PN + e];
      }
    for (int64_t r = 0; r < W; ++r) {
      if (lens[r] == 0) continue;
      for (int64_t i = 0; i < Q; ++i) {
        const int64_t t = r * Q + i, last = lens[r] - Q + i;
        for (int64_t n = 0; n < N; ++n) {
          const double* qa = qabs_ref.data() + (t * N + n) * LR;
          std::vector<double> sc(last + 1);
          double mx = -std::numeric_limits<double>::infinity();
          for (int64_t p = 0; p <= last; ++p) {
            const double* row = cache_row(static_cast<int64_t>(bt[r * MB + p / BS]) * BS + p % BS);
            double d = 0;
            for (int64_t e = 0; e < LR; ++e) d += qa[e] * row[e];
            sc[p] = d * scale;
            mx = std::max(mx, sc[p]);
          }
          double z = 0;
          for (double& e : sc) z += (e = std::exp(e - mx));
          std::vector<double> ol(L, 0.0);
          for (int64_t p = 0; p <= last; ++p) {
            const double* row = cache_row(static_cast<int64_t>(bt[r * MB + p / BS]) * BS + p % BS);
            for (int64_t l = 0; l < L; ++l) ol[l] += sc[p] / z * row[l];
          }
          ref::round_bf16_if(true, ol);
          for (int64_t v = 0; v < V; ++v) {
            double o = 0;
            for (int64_t l = 0; l < L; ++l) o += ol[l] * kvb[(n * (PN + V) + PN + v) * L + l];
            o = ref::round_bf16(o);
            if (m.mla_gate) o = ref::round_bf16(o * ref::sigmoid(rows[t * ld + NQ + LR + n * V + v]));
            out_ref[t * N * V + n * V + v] = o;
          }
        }
      }
    }
    return x;
  };
  const Expect e = reference(pj);
  const std::vector<double>& qabs_ref = e.qabs;
  const std::vector<double>& out_ref = e.out;

  std::vector<double> got, want;
  int64_t touched = 0;
  for (const auto& [b, v0] : pcache.before) {
    const std::vector<uint16_t> g = pcache.after(b);
    for (int64_t i = 0; i < cache_dense; ++i) {
      if (e.written.count(b * BS + i / LR)) {
        got.push_back(bf16_to_f32(g[i]));
        want.push_back(e.cache.at(b)[i]);
      } else if (g[i] != v0[i]) {
        ++touched;
      }
    }
  }
  ctx.report.add(c.name(), "mla_prep cache rows", rel_error(got, want), kBf16Tol);
  ctx.report.zero(c.name(), "mla_prep cache (others)", touched, "values changed in slots the step must not write");
  ctx.report.zero(c.name(), "mla cache padding", pcache.padding_touched(),
                  fmt::format("cache_stride {} (dense {}), blocks {}..{}", cache_stride, cache_dense, base + 1,
                              num_blocks - 1));
  ctx.report.add(c.name(), "mla_prep q_abs", rel(bf16_out(q_abs), qabs_ref), kBf16Tol,
                 ctx.time ? fmt::format("{:.1f} us", t_prep * 1e3) : fp8 ? "kv_b e4m3" : std::string());
  const std::vector<double> out_gpu = bf16_out(out);
  ctx.report.add(c.name(), "mla attn+combine out", rel(out_gpu, out_ref), kBf16Tol,
                 ctx.time ? fmt::format("attn {:.1f} us, combine {:.1f} us", t_attn * 1e3, t_comb * 1e3)
                          : fmt::format("contexts up to {}", *std::max_element(lens.begin(), lens.end())));
  if (front)
    ctx.report.add(c.name(), "mla q-LoRA chain (from x)", rel(out_gpu, reference(front->from_x).out), kBf16Tol,
                   "gemm, rmsnorm, gemm q_b, prep, attn, combine + gate");
  if (!k.mla_attn_staged.op.empty()) {
    // The staged attention (TS tiles in dynamic shared memory, 4 unless DP_CHECK_MLA_TS says otherwise) does the same arithmetic in the same order:
    // the same partials, bit for bit, and so the same output.
    DevBuf part_o2(W * NS * Q * N * L * 4), part_ml2(W * NS * Q * N * 2 * 4), out2(T * N * V * 2);
    for (DevBuf* b : {&part_o2, &part_ml2, &out2}) b->poison();
    aargs.insert_or_assign("part_o", Arg(part_o2));
    aargs.insert_or_assign("part_ml", Arg(part_ml2));
    const float t_staged = ctx.kernels.launch(k.mla_attn_staged, aargs);
    cargs.insert_or_assign("part_o", Arg(part_o2));
    cargs.insert_or_assign("part_ml", Arg(part_ml2));
    cargs.insert_or_assign("out", Arg(out2));
    ctx.kernels.launch(k.mla_combine, cargs);
    const std::vector<double> out_staged = bf16_out(out2);
    ctx.report.add(c.name(), fmt::format("mla attn staged (TS {}) + combine out", k.mla_attn_staged.params.at("TS")), rel(out_staged, out_ref), kBf16Tol,
                   ctx.time ? fmt::format("attn {:.1f} us (two static buffers: {:.1f} us)", t_staged * 1e3, t_attn * 1e3)
                            : std::string("dynamic shared memory"));
    int64_t differ = 0;
    for (size_t i = 0; i < out_staged.size(); ++i) differ += out_staged[i] != out_gpu[i];
    ctx.report.zero(c.name(), "mla attn staged = two buffers", differ, "output values that differ");
  }
}

}  // namespace
}  // namespace dp::gpucheck

int main(int argc, char** argv) {
  using namespace dp::gpucheck;
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: dp_kernel_check CUBIN_DIR [--out FILE (appended)] [--only SUBSTRING] [--case INDEX] "
                 "[--count] [--list] [--time]\n");
    return 2;
  }
  std::string out_file, only;
  bool time = false;
  int64_t case_index = -1;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--out" && i + 1 < argc)
      out_file = argv[++i];
    else if (a == "--only" && i + 1 < argc)
      only = argv[++i];
    else if (a == "--case" && i + 1 < argc)
      case_index = std::stoll(argv[++i]);
    else if (a == "--count") {
      std::printf("%zu\n", all_cases().size());  // cases, for running each in its own process
      return 0;
    } else if (a == "--list") {  // "INDEX<tab>NAME" per case
      const std::vector<Case> cases = all_cases();
      for (size_t ci = 0; ci < cases.size(); ++ci) std::printf("%zu\t%s\n", ci, cases[ci].name().c_str());
      return 0;
    } else if (a == "--time")
      time = true;
    else {
      std::fprintf(stderr, "dp_kernel_check: unknown argument %s\n", a.c_str());
      return 2;
    }
  }
  try {
    // Opens the driver and makes device 0's primary context current (cuda_test_driver.h).
    if (!cu().why_not.empty()) dp::fail(dp::Errc::device, "cannot run the checks: {}", cu().why_not);
    CUdevice dev;
    CU(cu().DeviceGet(&dev, 0));
    char name[256] = {};
    CU(cu().DeviceGetName(name, sizeof name, dev));
    std::printf("device: %s\n", name);
    Kernels kernels(argv[1]);
    Report report;
    Ctx c{kernels, report, time};
    uint64_t seed = 1;
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<Case> cases = all_cases();
    for (size_t ci = 0; ci < cases.size(); ++ci) {
      const Case& cs = cases[ci];
      if (!only.empty() && cs.name().find(only) == std::string::npos) continue;
      if (case_index >= 0 && static_cast<int64_t>(ci) != case_index) continue;
      std::printf("%s\n", cs.name().c_str());
      const CaseKernels k = kernels_of(cs, "sm_90a");
      const bool timing = time && (cs.model->name == "kimi-linear-48b" || cs.model->name == "kimi-k3");
      c.time = timing;
      if (cs.mxfp4) {  // the latent MoE with MXFP4 experts: only its ops
        check_latent_moe(c, cs, k, seed += 10);
        continue;
      }
      if (!cs.fp8) check_rmsnorm(c, cs, k, seed += 10);  // FP8 cases: only the ops that read FP8 weights
      check_gemm(c, cs, k.in_proj, cs.fp8 ? "kda in_proj (q, k, v e4m3)" : "kda in_proj (6 weights)", seed += 10);
      check_gemm(c, cs, k.o_proj, "o_proj", seed += 10);
      check_gemm_norm(c, cs, k.o_proj_norm, seed += 10);
      if (cs.fp8) check_gemm(c, cs, k.mixed, "mixed (w0, w2 e4m3; w1 bf16)", seed += 10);
      if (!cs.fp8) check_kda(c, cs, k, seed += 10);
      check_moe(c, cs, k, seed += 10);
      check_mlp(c, cs, k, seed += 10);
      check_mla(c, cs, k, seed += 10);
      check_attnres(c, cs, k, seed += 10);
    }
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("\n%zu checks, %d failed, %.1f s\n", report.results().size(), report.failures(), secs);
    if (!out_file.empty()) {
      std::ofstream f(out_file, std::ios::app);
      for (const Result& r : report.results())
        f << name << "\t" << r.case_name << "\t" << r.check << "\t" << r.value << "\t" << r.limit << "\t"
          << (r.pass ? "ok" : "FAIL") << "\t" << r.note << "\n";
    }
    return report.failures() ? 1 : 0;
  } catch (const dp::Error& e) {
    std::fprintf(stderr, "dp_kernel_check: %s\n", e.what());
    return static_cast<int>(e.code());
  }
}
