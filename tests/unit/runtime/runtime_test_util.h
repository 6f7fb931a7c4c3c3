// Helpers for the runtime tests (CPU and GPU): real bundles built by the decodepack CLI, and small
// wrappers over the C ABI that turn a dp_status into a checkable value.
//
// The bundles are built once per build tree into DP_RT_TEST_WORK (a lock serialises concurrent test
// processes; a stamp holding the CLI's size and time rebuilds them when the CLI changes), so the many
// processes ctest starts share one set. The tests link libdecodepack only; the compiler is reached
// through its command line, as a user would.
#pragma once

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "decodepack/decodepack.h"

namespace dp::rttest {

namespace fs = std::filesystem;

// The outcome of a C call: its code and message (the status is freed).
struct Outcome {
  dp_code code = DP_OK;
  std::string message;
  bool ok() const { return code == DP_OK; }
};

inline Outcome outcome(dp_status* s) {
  Outcome o{dp_status_code(s), dp_status_message(s)};
  dp_status_free(s);
  return o;
}

inline std::string quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

// Runs the CLI; returns its exit status and leaves its output in `log`.
inline int run_cli(const std::vector<std::string>& args, const fs::path& log) {
  std::string cmd = quote(DP_CLI_PATH);
  for (const std::string& a : args) cmd += " " + quote(a);
  cmd += " > " + quote(log.string()) + " 2>&1";
  const int rc = std::system(cmd.c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

inline std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_text(const fs::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary);
  out << s;
}

// The test bundles (see ensure_bundles): paths under the work directory.
struct Bundles {
  fs::path dir;      // the work directory
  fs::path model;    // synth --preset kimi-linear-tiny --seed 0
  fs::path tiny;     // .dpk: sm_90a + gfx942, widths 1-8, TP 1, every prefetch point, with fingerprints
  fs::path tiny_dir; // the same bundle as a directory (the archive extracted)
  fs::path spec;     // .dpk: sm_90a, widths 1,2,4, one speculative token, conv ds/float32, kv fp8/16
  fs::path tp2;      // .dpk: sm_90a, TP 2 (ranks 0 and 1), widths 1-4
  fs::path tp2_mixed;  // tp2 with "allreduce": widths 3 and 4 by NCCL, 1 and 2 in-kernel (format 1.8)
  fs::path tp2_nccl;   // tp2 with "allreduce": "nccl" at every width (format 1.8, no exchange buffers)
  fs::path multi;    // .dpk: sm_80, sm_90, sm_90a, width 1
  fs::path fp8;      // .dpk: synth --quantize fp8 of kimi-linear-tiny, sm_90a, widths 1-2, with fingerprints
  fs::path k3;       // .dpk: kimi-k3-tiny without weights, sm_90a, widths 1-2 (format 1.7: attention residuals)
  std::string error; // non-empty when building failed (the CLI's output)
};

inline Bundles ensure_bundles() {
  Bundles b;
  // DECODEPACK_TEST_WORK: bundles built elsewhere (e.g. copied to a GPU machine without the compiler's
  // dependencies); used as they are, never rebuilt.
  const char* prebuilt = std::getenv("DECODEPACK_TEST_WORK");
  b.dir = prebuilt && *prebuilt ? fs::path(prebuilt) : fs::path(DP_RT_TEST_WORK);
  b.model = b.dir / "model";
  b.tiny = b.dir / "tiny.dpk";
  b.tiny_dir = b.dir / "tiny-dir";
  b.spec = b.dir / "spec.dpk";
  b.tp2 = b.dir / "tp2.dpk";
  b.tp2_mixed = b.dir / "tp2-mixed.dpk";
  b.tp2_nccl = b.dir / "tp2-nccl.dpk";
  b.multi = b.dir / "multi.dpk";
  b.fp8 = b.dir / "fp8.dpk";
  b.k3 = b.dir / "k3.dpk";
  if (prebuilt && *prebuilt) {
    for (const fs::path& p : {b.tiny, b.tiny_dir, b.spec, b.tp2, b.tp2_mixed, b.tp2_nccl, b.multi, b.k3})
      if (!fs::exists(p)) b.error = "DECODEPACK_TEST_WORK=" + b.dir.string() + " lacks " + p.filename().string();
    return b;
  }
  fs::create_directories(b.dir);

  const int lock = ::open((b.dir / ".lock").c_str(), O_CREAT | O_RDWR | O_CLOEXEC, 0644);
  if (lock >= 0) ::flock(lock, LOCK_EX);
  struct stat st {};
  ::stat(DP_CLI_PATH, &st);
  const std::string stamp = std::string(DP_CLI_PATH) + " " + std::to_string(st.st_size) + " " +
                            std::to_string(st.st_mtim.tv_sec) + "." + std::to_string(st.st_mtim.tv_nsec) + " v6\n";
  const fs::path stamp_file = b.dir / "stamp";
  if (!fs::exists(stamp_file) || read_text(stamp_file) != stamp) {
    fs::remove(stamp_file);
    const fs::path cache = b.dir / "cache", log = b.dir / "build.log";
    auto deploy = [&](const char* name, const char* json) {
      write_text(b.dir / name, json);
      return (b.dir / name).string();
    };
    std::vector<std::vector<std::string>> steps = {
        {"synth", "--preset", "kimi-linear-tiny", "--seed", "0", "-o", b.model.string()},
        // The default deploy but with tables for every prefetch point (TP 1 defaults to none), so that
        // the prefetch paths have something to launch.
        {"build", "--model", b.model.string(), "-o", b.tiny.string(), "--cache-dir", cache.string(), "-j", "2",
         "--deploy", deploy("tiny.json", R"({"targets": ["sm_90a", "gfx942"], "widths": [1, 2, 3, 4, 5, 6, 7, 8],
                "prefetch": {"points": ["oproj_down", "attention_moe", "next_attention", "attention_oproj"]}})")},
        {"build", "--model", b.model.string(), "--no-weights", "-o", b.spec.string(), "--cache-dir", cache.string(),
         "-j", "2", "--deploy",
         deploy("spec.json", R"({"targets": ["sm_90a"], "widths": [1, 2, 4], "num_speculative_tokens": 1,
                "conv_state": {"dtype": "float32", "layout": "ds"}, "kda_state": {"layout": "vk"},
                "kv_cache": {"dtype": "fp8", "block_size": 16}})")},
        {"build", "--model", b.model.string(), "--no-weights", "-o", b.tp2.string(), "--cache-dir", cache.string(),
         "-j", "2", "--deploy", deploy("tp2.json", R"({"targets": ["sm_90a"], "tensor_parallel": 2, "max_num_seqs": 4})")},
        {"build", "--model", b.model.string(), "--no-weights", "-o", b.tp2_mixed.string(), "--cache-dir", cache.string(),
         "-j", "2", "--deploy", deploy("tp2-mixed.json", R"({"targets": ["sm_90a"], "tensor_parallel": 2, "max_num_seqs": 4,
                "allreduce": {"1": "in_kernel", "3": "nccl", "4": "nccl"}})")},
        {"build", "--model", b.model.string(), "--no-weights", "-o", b.tp2_nccl.string(), "--cache-dir", cache.string(),
         "-j", "2", "--deploy", deploy("tp2-nccl.json", R"({"targets": ["sm_90a"], "tensor_parallel": 2, "max_num_seqs": 4,
                "allreduce": "nccl"})")},
        {"build", "--model", b.model.string(), "--no-weights", "-o", b.multi.string(), "--cache-dir", cache.string(),
         "-j", "2", "--deploy", deploy("multi.json", R"({"targets": ["sm_80", "sm_90", "sm_90a"], "widths": [1]})")},
        {"synth", "--preset", "kimi-linear-tiny", "--quantize", "fp8", "--seed", "0", "-o", (b.dir / "model-fp8").string()},
        {"build", "--model", (b.dir / "model-fp8").string(), "-o", b.fp8.string(), "--cache-dir", cache.string(), "-j",
         "2", "--deploy", deploy("fp8.json", R"({"targets": ["sm_90a"], "widths": [1, 2]})")},
        {"build", "--model", "kimi-k3-tiny", "--no-weights", "-o", b.k3.string(), "--cache-dir", cache.string(), "-j",
         "2", "--deploy", deploy("k3.json", R"({"targets": ["sm_90a"], "widths": [1, 2]})")},
    };
    for (auto& args : steps) {
      // A killed earlier run may have left an output behind; the CLI replaces files but wants a
      // fresh directory for `synth`.
      if (args[0] == "synth") fs::remove_all(args.back());
      if (int rc = run_cli(args, log); rc != 0) {
        b.error = "decodepack " + args[0] + " failed (exit " + std::to_string(rc) + "):\n" + read_text(log);
        break;
      }
    }
    // The directory form of the same bundle: the archive's members, extracted (the CLI's directory
    // output is tested with the compiler; here both forms must hold identical bytes).
    if (b.error.empty()) {
      fs::remove_all(b.tiny_dir);
      fs::create_directories(b.tiny_dir);
      const std::string cmd = "tar -xf " + quote(b.tiny.string()) + " -C " + quote(b.tiny_dir.string()) + " > " +
                              quote(log.string()) + " 2>&1";
      if (std::system(cmd.c_str()) != 0) b.error = "tar -xf failed:\n" + read_text(log);
    }
    if (b.error.empty()) write_text(stamp_file, stamp);
  }
  if (lock >= 0) ::close(lock);  // releases the lock
  return b;
}

// A host-only session's options for `rank` (target: the bundle's first unless given).
inline dp_session_options host_options(int32_t rank = 0, const char* target = nullptr) {
  dp_session_options o;
  dp_session_options_init(&o);
  o.device = DP_DEVICE_NONE;
  o.rank = rank;
  o.target = target;
  return o;
}

// Binds every weight of `rank` at fake, 16-byte-aligned, distinct addresses (host-only sessions never
// dereference them); expert groups through the grouped call. A weight named `skip` is left alone.
inline Outcome bind_all_weights(const dp_bundle* b, dp_session* s, int32_t rank, uint64_t base = 0x7f0000000000ull,
                                const std::string& skip = {}) {
  const int32_t n = dp_bundle_weight_count(b, rank);
  uint64_t next = base;
  for (int32_t i = 0; i < n; ++i) {
    dp_weight_info w;
    w.size = sizeof(w);
    Outcome o = outcome(dp_bundle_get_weight(b, rank, i, &w));
    if (!o.ok()) return o;
    if (w.name == skip) continue;
    dp_tensor t;
    dp_tensor_init(&t, 0, w.dtype, w.ndim, w.shape);
    uint64_t bytes = dp_dtype_size(w.dtype);
    for (int32_t d = 0; d < w.ndim; ++d) bytes *= static_cast<uint64_t>(w.shape[d]);
    bytes = (bytes + 255) / 256 * 256;
    if (w.experts == 0) {
      t.data = next;
      next += bytes;
      o = outcome(dp_session_bind_weight(s, w.name, &t));
    } else {
      std::vector<uint64_t> ptrs;
      for (int32_t e = 0; e < w.experts; ++e, next += bytes) ptrs.push_back(next);
      o = outcome(dp_session_bind_expert_weights(s, w.name, ptrs.data(), w.experts, &t));
    }
    if (!o.ok()) return o;
  }
  return {};
}

// Binds every cache of every layer with `slots` KDA slots and `blocks` MLA blocks at fake addresses.
inline Outcome bind_all_kv(const dp_bundle* b, dp_session* s, int64_t slots, int64_t blocks,
                           uint64_t base = 0x7e0000000000ull) {
  dp_bundle_info info;
  info.size = sizeof(info);
  Outcome o = outcome(dp_bundle_get_info(b, &info));
  if (!o.ok()) return o;
  uint64_t next = base;
  for (int32_t l = 0; l < info.num_layers; ++l) {
    dp_layer_info li;
    li.size = sizeof(li);
    o = outcome(dp_bundle_get_layer(b, l, &li));
    if (!o.ok()) return o;
    std::vector<int32_t> kinds = li.mixer == DP_MIXER_KDA
                                     ? std::vector<int32_t>{DP_KV_KDA_STATE, DP_KV_CONV_Q, DP_KV_CONV_K, DP_KV_CONV_V}
                                     : std::vector<int32_t>{DP_KV_MLA_LATENT};
    for (int32_t kind : kinds) {
      dp_tensor t;
      o = outcome(dp_session_kv_layout(s, l, kind, kind == DP_KV_MLA_LATENT ? blocks : slots, &t));
      if (!o.ok()) return o;
      t.data = next;
      next += 1ull << 32;
      o = outcome(dp_session_bind_kv(s, l, kind, &t));
      if (!o.ok()) return o;
    }
  }
  return {};
}

}  // namespace dp::rttest

// gtest: expect code and every fragment in the message.
#define DP_EXPECT_STATUS(expr, code_, ...)                                                                   \
  do {                                                                                                         \
    const ::dp::rttest::Outcome dp_o_ = ::dp::rttest::outcome(expr);                                          \
    EXPECT_EQ(dp_code_name(dp_o_.code), std::string(dp_code_name(code_))) << dp_o_.message;                    \
    for (const char* dp_f_ : std::initializer_list<const char*>{__VA_ARGS__})                                  \
      EXPECT_NE(dp_o_.message.find(dp_f_), std::string::npos) << "message lacks \"" << dp_f_ << "\": " << dp_o_.message; \
  } while (0)

#define DP_EXPECT_OK(expr)                                                  \
  do {                                                                      \
    const ::dp::rttest::Outcome dp_o_ = ::dp::rttest::outcome(expr);       \
    EXPECT_TRUE(dp_o_.ok()) << dp_code_name(dp_o_.code) << ": " << dp_o_.message; \
  } while (0)
