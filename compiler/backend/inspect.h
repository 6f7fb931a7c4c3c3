// Reading device code objects without a GPU: which kernels a cubin or an AMDGPU code object holds,
// the size of each kernel's parameter block and its resource usage.
//
// Used after every compile (the kernel must be there with the parameter size its signature says),
// by `verify` and by the runtime's loader (a bundle's kernel table is checked against the bytes).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace dp::backend {

struct CodeObjectKernel {
  std::string symbol;         // entry-point name, e.g. "rmsnorm_w4_h2304"
  uint32_t param_bytes = 0;   // explicit parameter block (NVIDIA: EIATTR_CBANK_PARAM_SIZE; AMD: end of
                              // the last non-hidden kernarg), comparable to KernelSignature::bytes
  uint32_t registers = 0;     // per thread: NVIDIA registers; AMD vector registers (.vgpr_count)
  uint32_t shared_bytes = 0;  // static shared memory / LDS per block, without NVIDIA's reserved 1 KiB
  uint32_t stack_bytes = 0;   // per-thread stack / private segment
  uint32_t spill_bytes = 0;   // per-thread spill stores; AMD: 4 x .vgpr_spill_count. The cubin does
                              // not record spills: inspection leaves 0, the compile log fills it in
  // AMD only (0 on NVIDIA):
  uint32_t scalar_registers = 0;  // .sgpr_count
  uint32_t kernarg_bytes = 0;     // .kernarg_segment_size, hidden arguments included
};

// Lists the kernels of a code object for `target` ("sm_90a", "gfx942", ...), sorted by symbol.
// Checks the ELF machine and that the code object was built for that target. Malformed input is
// dp::Error(input) beginning with `where` (a file name or a bundle member).
std::vector<CodeObjectKernel> inspect_code_object(std::span<const uint8_t> bytes, const std::string& target,
                                                  const std::string& where);

// The kernel named `symbol` in `kernels`, or dp::Error(verify) naming `where`, the symbol and the
// kernels that are present. When `param_bytes` is given, the kernel's must equal it.
const CodeObjectKernel& require_kernel(const std::vector<CodeObjectKernel>& kernels, const std::string& symbol,
                                       const std::string& where, int64_t param_bytes = -1);

}  // namespace dp::backend
