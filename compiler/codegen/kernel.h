// Kernel instances: which specialisation of which op template, its name, its parameter block and the
// small translation unit that instantiates it.
//
// An instance is (op, integer template parameters, target). Everything else is a function of it:
//   kernel_name()      "rmsnorm_w4_h2304": the op, then every parameter in the op's fixed order (what
//                      each letter means per op: templates/README.md, "Kernel names"). It
//                      is the entry-point symbol in the code object and the manifest's kernel name;
//                      the target is left out of it because the same source compiles for every target.
//   instance_key()     "rmsnorm_w4_h2304.sm_90a": the file name stem and the key of the manifest's
//                      kernel table and of the compile results (unique per code object).
//   kernel_signature() the entry point's parameters with their byte offsets, as the host must pack
//                      them; the code-object inspection checks the compiled size against it.
//   launch_shape()     grid and block the kernel is compiled for.
//   generate_source()  the translation unit: banner, includes, one extern "C" __global__ entry point
//                      that calls the op's device template with the constants.
//
// Each op family is described in ops/<family>.cpp beside its device header templates/<family>.h
// (params, checks, signature, launch shape, device call; ops/spec.h); kernel.cpp joins the families
// into one table. Adding a family means that file, its line in kernel.cpp, its header and its row of
// name letters in templates/README.md.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace dp::codegen {

struct KernelInstance {
  std::string op;                         // "prefetch" | "rmsnorm" (see known_ops())
  std::map<std::string, int64_t> params;  // template parameters by upper-case name, e.g. {W: 4, H: 2304}
  std::string target;                     // "sm_90a" | "gfx942" | "gfx90a" | ...

  bool operator==(const KernelInstance&) const = default;
};

// One parameter of a kernel's entry point, in declaration order.
struct KernelParam {
  enum class Kind { pointer, u32, f32 };
  std::string name;     // C identifier, e.g. "hidden"
  Kind kind;
  std::string c_type;   // device-side type in the generated source, e.g. "const dp_bf16*"
  std::string shape;    // for pointers: shape and dtype with the instance's numbers, "[4, 2304] bf16"
  std::string doc;      // one line for the manifest / generated comment ("" if none)
  bool nullable = false;
  uint32_t size = 0;    // bytes
  uint32_t align = 0;   // bytes
  uint32_t offset = 0;  // byte offset in the parameter block
};

// The entry point's parameter block as CUDA's cuLaunchKernel / HIP's hipModuleLaunchKernel lay it
// out: each parameter at the next multiple of its alignment, in declaration order. `bytes` is the
// end of the last parameter, unpadded: it is what the NVIDIA code object records
// (EIATTR_CBANK_PARAM_SIZE) and the end of the explicit arguments in AMD's kernarg segment.
struct KernelSignature {
  std::vector<KernelParam> params;
  uint32_t bytes = 0;
};

struct LaunchShape {
  uint32_t grid[3] = {1, 1, 1};   // blocks; for ops whose grid is a run-time choice, the default
  uint32_t block[3] = {1, 1, 1};  // threads per block: fixed, the kernel is compiled for it
  uint32_t dynamic_shared_bytes = 0;
  bool grid_is_default = false;   // true where the runtime may pick another grid (prefetch)
};

// Ops this build knows, in name order.
std::vector<std::string> known_ops();

// Checks op, parameter names and values (throws dp::Error(input) naming the instance, the parameter,
// the value and what would be valid). `where` prefixes the message (e.g. the plan entry).
void validate_instance(const KernelInstance& k, std::string_view where = {});

std::string kernel_name(const KernelInstance& k);   // validates
std::string instance_key(const KernelInstance& k);  // kernel_name + "." + target
KernelSignature kernel_signature(const KernelInstance& k);
LaunchShape launch_shape(const KernelInstance& k);

// The generated translation unit. Depends only on op and params (never on the target), so one
// source serves every vendor; it includes "vendor.h" and the op's header from templates/.
std::string generate_source(const KernelInstance& k);
// The templates/ header the op's device code lives in, e.g. "norm.h".
std::string op_header(const KernelInstance& k);

}  // namespace dp::codegen
