// The device compilers behind one interface: NVIDIA (NVRTC in process, or nvcc) and AMD (clang).
//
// A toolchain is located and versioned once (construction), asked whether it can build a target
// (check_target, before any compile starts, so a missing or too-old toolchain costs nothing), then
// compiles many translation units, possibly from several threads at once.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/target.h"
#include "codegen/templates.h"

namespace dp::backend {

struct CompileJob {
  std::string stem;    // file name stem and display name, e.g. "rmsnorm_w4_h2304.sm_90a"; no '/'
  std::string source;  // the generated translation unit
  std::span<const codegen::TemplateFile> headers;  // every templates/ header, by bare name
  const TargetInfo* target = nullptr;
  bool want_ptx = false;  // NVIDIA only: also return portable PTX (compute_XX, without the 'a')
};

struct CompileOutput {
  std::vector<uint8_t> code_object;  // cubin (ELF, EM_CUDA) or AMDGPU code object (ELF, EM_AMDGPU)
  std::string log;                   // the compiler's diagnostics; NVIDIA: includes ptxas -v usage
  std::string ptx;                   // when want_ptx
};

class DeviceToolchain {
 public:
  virtual ~DeviceToolchain() = default;
  virtual Vendor vendor() const = 0;
  // Identifies the compiler exactly enough for the compile cache and the manifest, e.g.
  // "nvrtc 13.0" or "Debian clang version 19.1.7 (3~deb12u1)".
  virtual const std::string& version() const = 0;
  // Where it was found: the NVRTC library, nvcc or clang++ (for `decodepack doctor` and messages).
  virtual std::string location() const = 0;
  // Refuses a target this toolchain cannot build: dp::Error(toolchain) with what to install and the
  // flag / environment variable that selects another toolchain.
  virtual void check_target(const TargetInfo& t) const = 0;
  // The options compile() uses for `t` (part of the compile-cache key).
  virtual std::vector<std::string> flags(const TargetInfo& t, bool want_ptx) const = 0;
  // Thread-safe. A compile error is dp::Error(toolchain) naming the job and quoting the log.
  virtual CompileOutput compile(const CompileJob& job) const = 0;
};

struct ToolchainOptions {
  // NVIDIA: the CUDA toolkit root (NVRTC in lib64/, nvcc in bin/). Empty: $DECODEPACK_CUDA_ROOT,
  // then $CUDA_HOME / $CUDA_PATH, then the root found when decodepack was built, then /usr/local/cuda.
  std::filesystem::path cuda_root;
  bool allow_nvrtc = true;  // false: always use nvcc (tests, or an NVRTC that misbehaves)
  // AMD: the clang++ to run. Empty: $DECODEPACK_HIP_CLANG, then the clang found when decodepack was
  // built, then clang++-19 / clang++ from PATH. Set with --hip-clang.
  std::filesystem::path hip_clang;
};

// Locate a toolchain; dp::Error(toolchain) naming everything that was tried and how to point at one.
std::unique_ptr<DeviceToolchain> make_cuda_toolchain(const ToolchainOptions& o);
std::unique_ptr<DeviceToolchain> make_hip_toolchain(const ToolchainOptions& o);

// Build-time defaults (compile definitions from cmake/DecodepackToolchains.cmake); empty if none.
std::filesystem::path built_cuda_root();
std::filesystem::path built_hip_clang();

// What ptxas -v reports per kernel (NVRTC --ptxas-options=-v, nvcc -Xptxas -v).
struct PtxasUsage {
  uint32_t registers = 0;
  uint32_t shared_bytes = 0;  // static shared memory ("N bytes smem")
  uint32_t stack_bytes = 0;   // "N bytes stack frame"
  uint32_t spill_store_bytes = 0;
  uint32_t spill_load_bytes = 0;
};
// Parses every "Compiling entry function 'X'" block of a ptxas -v log; kernels keyed by name.
std::map<std::string, PtxasUsage> parse_ptxas_log(std::string_view log);

}  // namespace dp::backend
