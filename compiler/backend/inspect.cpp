// Code-object inspection with LLVM's Object and BinaryFormat libraries.
//
// NVIDIA cubin (ELF64, EM_CUDA = 190). NVIDIA does not document the format; what is read here was
// checked against ptxas -v for the kernels of this project (tests/unit/backend):
//   * kernels: global STT_FUNC symbols with the CUDA entry bit (st_other & 0x10) or a
//     ".nv.info.<name>" section;
//   * the target: e_flags bits 8..15 hold the SM number (90) in ELF ABI version 8 (CUDA 12.x/13.x
//     cubins), bits 0..7 in older ones; the 'a' suffix is not encoded there;
//   * ".nv.info" sections are a sequence of attribute records, each starting with
//       u8 format, u8 attribute id, u16 value-or-length (little-endian)
//     format 0x01 (NVAL), 0x02 (BVAL) and 0x03 (HVAL) records are those 4 bytes (the u16 is the value
//     for HVAL); format 0x04 (SVAL) is followed by `length` payload bytes. Attributes used:
//       0x19 EIATTR_CBANK_PARAM_SIZE (HVAL, in .nv.info.<kernel>): parameter block bytes;
//       0x0a EIATTR_PARAM_CBANK (SVAL u32 constant-bank symbol, u16 offset, u16 size): fallback size;
//       0x17 EIATTR_KPARAM_INFO (SVAL u32 index, u16 ordinal, u16 offset, u32 flags with the
//            parameter size in bits 18..31): last resort, size = max(offset + size);
//       0x2f EIATTR_REGCOUNT, 0x11 EIATTR_FRAME_SIZE, 0x12 EIATTR_MIN_STACK_SIZE,
//       0x23 EIATTR_MAX_STACK_SIZE (SVAL u32 symbol index, u32 value, in the global ".nv.info");
//   * static shared memory: the size of ".nv.shared.<kernel>". When the cubin references the
//     reserved shared window (symbol ".nv.reservedSmem.offset0", sm_80 and newer), that section
//     starts with the 1 KiB the driver reserves per block, which is subtracted to match ptxas -v.
//
// AMD code object (ELF64, EM_AMDGPU = 224), as specified in LLVM's AMDGPUUsage ("Code Object V4/V5
// Metadata"): the NT_AMDGPU_METADATA note (owner "AMDGPU", type 32) holds a msgpack map whose
// "amdhsa.kernels" array describes each kernel (.name, .symbol = "<name>.kd", .args, .kernarg_segment_size,
// .vgpr_count, .sgpr_count, .group_segment_fixed_size, .private_segment_fixed_size, .vgpr_spill_count),
// and "amdhsa.target" names the processor ("amdgcn-amd-amdhsa--gfx942"). The kernel descriptor
// symbol "<name>.kd" must exist: it is what the loader looks up.
#include "backend/inspect.h"

#include <llvm/BinaryFormat/ELF.h>
#include <llvm/BinaryFormat/MsgPackDocument.h>
#include <llvm/Object/ELFObjectFile.h>
#include <llvm/Object/ObjectFile.h>
#include <llvm/Support/Error.h>
#include <llvm/Support/MemoryBuffer.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>

#include "backend/target.h"
#include "common/error.h"

namespace dp::backend {
namespace {

using ELFT = llvm::object::ELF64LE;
using ElfFile = llvm::object::ELFFile<ELFT>;
using Shdr = ELFT::Shdr;

std::string llvm_message(llvm::Error e) { return llvm::toString(std::move(e)); }

template <typename T>
T unwrap(llvm::Expected<T> v, const std::string& where, const char* what) {
  if (!v) fail(Errc::input, "{}: {}: {}", where, what, llvm_message(v.takeError()));
  return std::move(*v);
}

uint16_t rd16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }
uint32_t rd32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) | (static_cast<uint32_t>(p[2]) << 16) |
         (static_cast<uint32_t>(p[3]) << 24);
}

// One .nv.info record.
struct NvInfoAttr {
  uint8_t format;
  uint8_t id;
  uint16_t value;                  // HVAL value (or SVAL payload length)
  llvm::ArrayRef<uint8_t> payload;  // SVAL only
};

constexpr uint8_t kEifmtSval = 0x04;
constexpr uint8_t kEiattrParamCbank = 0x0a;
constexpr uint8_t kEiattrFrameSize = 0x11;
constexpr uint8_t kEiattrMinStackSize = 0x12;
constexpr uint8_t kEiattrKparamInfo = 0x17;
constexpr uint8_t kEiattrCbankParamSize = 0x19;
constexpr uint8_t kEiattrMaxStackSize = 0x23;
constexpr uint8_t kEiattrRegcount = 0x2f;
constexpr uint8_t kStoCudaEntry = 0x10;
constexpr uint32_t kNvReservedSharedBytes = 1024;

std::vector<NvInfoAttr> parse_nv_info(llvm::ArrayRef<uint8_t> b, const std::string& where, llvm::StringRef section) {
  std::vector<NvInfoAttr> out;
  size_t p = 0;
  while (p < b.size()) {
    if (b.size() - p < 4)
      fail(Errc::input, "{}: section {}: truncated attribute record at byte {} ({} bytes left, need 4)", where,
           section.str(), p, b.size() - p);
    NvInfoAttr a{b[p], b[p + 1], rd16(&b[p + 2]), {}};
    p += 4;
    if (a.format == kEifmtSval) {
      if (b.size() - p < a.value)
        fail(Errc::input, "{}: section {}: attribute 0x{:02x} at byte {} declares {} payload bytes, {} left", where,
             section.str(), a.id, p - 4, a.value, b.size() - p);
      a.payload = b.slice(p, a.value);
      p += a.value;
    }
    out.push_back(a);
  }
  return out;
}

std::vector<CodeObjectKernel> inspect_cubin(const ElfFile& elf, const TargetInfo& target, const std::string& where) {
  const auto& hdr = elf.getHeader();
  if (hdr.e_machine != llvm::ELF::EM_CUDA)
    fail(Errc::input, "{}: ELF machine {} is not EM_CUDA ({}), so this is no cubin for {}", where,
         static_cast<unsigned>(hdr.e_machine), static_cast<unsigned>(llvm::ELF::EM_CUDA), target.name);
  const unsigned abi = hdr.e_ident[llvm::ELF::EI_ABIVERSION];
  const unsigned sm = abi >= 8 ? (hdr.e_flags >> 8) & 0xff : hdr.e_flags & 0xff;
  if (static_cast<int>(sm) != target.sm)
    fail(Errc::input, "{}: cubin is for sm_{} (e_flags 0x{:x}), expected {}", where, sm, hdr.e_flags, target.name);

  auto sections = unwrap(elf.sections(), where, "reading section headers");
  const Shdr* symtab = nullptr;
  std::map<std::string, const Shdr*> by_name;
  for (const Shdr& s : sections) {
    if (s.sh_type == llvm::ELF::SHT_SYMTAB) symtab = &s;
    by_name[unwrap(elf.getSectionName(s), where, "reading a section name").str()] = &s;
  }
  if (!symtab) fail(Errc::input, "{}: cubin has no symbol table", where);
  auto syms = unwrap(elf.symbols(symtab), where, "reading the symbol table");
  llvm::StringRef strtab = unwrap(elf.getStringTableForSymtab(*symtab), where, "reading symbol names");

  // Per-symbol attributes of the global .nv.info, keyed by symbol index.
  std::map<uint32_t, std::map<uint8_t, uint32_t>> per_symbol;
  if (auto it = by_name.find(".nv.info"); it != by_name.end()) {
    auto data = unwrap(elf.getSectionContents(*it->second), where, "reading .nv.info");
    for (const NvInfoAttr& a : parse_nv_info(data, where, ".nv.info"))
      if (a.format == kEifmtSval && a.payload.size() >= 8) per_symbol[rd32(&a.payload[0])][a.id] = rd32(&a.payload[4]);
  }

  bool reserved_shared = false;
  for (const auto& s : syms) {
    llvm::StringRef n = unwrap(s.getName(strtab), where, "reading a symbol name");
    if (n == ".nv.reservedSmem.offset0") reserved_shared = true;
  }

  std::vector<CodeObjectKernel> out;
  for (size_t i = 0; i < syms.size(); ++i) {
    const auto& s = syms[i];
    if (s.getType() != llvm::ELF::STT_FUNC || s.getBinding() != llvm::ELF::STB_GLOBAL) continue;
    const std::string name = unwrap(s.getName(strtab), where, "reading a symbol name").str();
    auto info_it = by_name.find(".nv.info." + name);
    if (!(s.st_other & kStoCudaEntry) && info_it == by_name.end()) continue;  // device function, not a kernel

    CodeObjectKernel k;
    k.symbol = name;
    if (info_it != by_name.end()) {
      auto data = unwrap(elf.getSectionContents(*info_it->second), where, "reading .nv.info.<kernel>");
      std::optional<uint32_t> cbank_size, param_cbank, kparam_end;
      for (const NvInfoAttr& a : parse_nv_info(data, where, ".nv.info." + name)) {
        if (a.id == kEiattrCbankParamSize && a.format != kEifmtSval) cbank_size = a.value;
        if (a.id == kEiattrParamCbank && a.payload.size() >= 8) param_cbank = rd16(&a.payload[6]);
        if (a.id == kEiattrKparamInfo && a.payload.size() >= 12) {
          const uint32_t end = rd16(&a.payload[6]) + ((rd32(&a.payload[8]) >> 18) & 0x3fff);
          kparam_end = std::max(kparam_end.value_or(0), end);
        }
      }
      k.param_bytes = cbank_size ? *cbank_size : param_cbank ? *param_cbank : kparam_end.value_or(0);
    }
    if (auto it = per_symbol.find(static_cast<uint32_t>(i)); it != per_symbol.end()) {
      const auto& attrs = it->second;
      auto get = [&](uint8_t id) { auto a = attrs.find(id); return a == attrs.end() ? 0u : a->second; };
      k.registers = get(kEiattrRegcount);
      k.stack_bytes = std::max({get(kEiattrFrameSize), get(kEiattrMinStackSize), get(kEiattrMaxStackSize)});
    }
    if (k.registers == 0) {
      // Older cubins keep the register count in the top byte of the text section's sh_info.
      if (auto t = by_name.find(".text." + name); t != by_name.end()) k.registers = t->second->sh_info >> 24;
    }
    if (auto sh = by_name.find(".nv.shared." + name); sh != by_name.end()) {
      uint64_t size = sh->second->sh_size;
      if (reserved_shared && size >= kNvReservedSharedBytes) size -= kNvReservedSharedBytes;
      k.shared_bytes = static_cast<uint32_t>(size);
    }
    out.push_back(std::move(k));
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------
std::optional<uint64_t> msgpack_uint(llvm::msgpack::MapDocNode& m, llvm::StringRef key) {
  auto it = m.find(key);
  if (it == m.end()) return std::nullopt;
  llvm::msgpack::DocNode& n = it->second;
  if (n.getKind() == llvm::msgpack::Type::UInt) return n.getUInt();
  if (n.getKind() == llvm::msgpack::Type::Int && n.getInt() >= 0) return static_cast<uint64_t>(n.getInt());
  return std::nullopt;
}

std::optional<std::string> msgpack_string(llvm::msgpack::MapDocNode& m, llvm::StringRef key) {
  auto it = m.find(key);
  if (it == m.end() || !it->second.isString()) return std::nullopt;
  return it->second.getString().str();
}

std::vector<CodeObjectKernel> inspect_amdgpu(const ElfFile& elf, const TargetInfo& target, const std::string& where) {
  const auto& hdr = elf.getHeader();
  if (hdr.e_machine != llvm::ELF::EM_AMDGPU)
    fail(Errc::input, "{}: ELF machine {} is not EM_AMDGPU ({}), so this is no code object for {}", where,
         static_cast<unsigned>(hdr.e_machine), static_cast<unsigned>(llvm::ELF::EM_AMDGPU), target.name);
  auto sections = unwrap(elf.sections(), where, "reading section headers");

  std::string blob;
  std::vector<std::string> symbols;
  for (const Shdr& s : sections) {
    if (s.sh_type == llvm::ELF::SHT_NOTE) {
      llvm::Error err = llvm::Error::success();
      for (const auto& note : elf.notes(s, err))
        if (note.getName() == "AMDGPU" && note.getType() == llvm::ELF::NT_AMDGPU_METADATA)
          blob = note.getDescAsStringRef(4).str();
      if (err) fail(Errc::input, "{}: reading notes: {}", where, llvm_message(std::move(err)));
    }
    if (s.sh_type == llvm::ELF::SHT_SYMTAB || s.sh_type == llvm::ELF::SHT_DYNSYM) {
      auto syms = unwrap(elf.symbols(&s), where, "reading a symbol table");
      llvm::StringRef strtab = unwrap(elf.getStringTableForSymtab(s), where, "reading symbol names");
      for (const auto& sym : syms) symbols.push_back(unwrap(sym.getName(strtab), where, "reading a symbol name").str());
    }
  }
  if (blob.empty()) fail(Errc::input, "{}: no NT_AMDGPU_METADATA note (not an AMDGPU HSA code object v3+)", where);

  llvm::msgpack::Document doc;
  if (!doc.readFromBlob(blob, /*Multi=*/false))
    fail(Errc::input, "{}: NT_AMDGPU_METADATA is not valid msgpack", where);
  if (!doc.getRoot().isMap()) fail(Errc::input, "{}: NT_AMDGPU_METADATA root is not a map", where);
  llvm::msgpack::MapDocNode root = doc.getRoot().getMap();

  // "amdgcn-amd-amdhsa--gfx942:sramecc+:xnack-" -> "gfx942"
  std::string processor = msgpack_string(root, "amdhsa.target").value_or("");
  if (size_t dash = processor.rfind("--"); dash != std::string::npos) processor = processor.substr(dash + 2);
  processor = processor.substr(0, processor.find(':'));
  if (processor != target.name)
    fail(Errc::input, "{}: code object is for \"{}\" (amdhsa.target), expected {}", where, processor, target.name);

  auto kernels_it = root.find("amdhsa.kernels");
  if (kernels_it == root.end() || !kernels_it->second.isArray())
    fail(Errc::input, "{}: NT_AMDGPU_METADATA has no amdhsa.kernels array", where);
  std::vector<CodeObjectKernel> out;
  size_t index = 0;
  for (llvm::msgpack::DocNode& node : kernels_it->second.getArray()) {
    const std::string here = fmt::format("{}: amdhsa.kernels[{}]", where, index++);
    if (!node.isMap()) fail(Errc::input, "{} is not a map", here);
    llvm::msgpack::MapDocNode m = node.getMap();
    auto need_uint = [&](llvm::StringRef key) {
      auto v = msgpack_uint(m, key);
      if (!v) fail(Errc::input, "{}: missing or non-integer {}", here, key.str());
      if (*v > UINT32_MAX) fail(Errc::input, "{}: {} = {} does not fit 32 bits", here, key.str(), *v);
      return static_cast<uint32_t>(*v);
    };
    CodeObjectKernel k;
    auto name = msgpack_string(m, ".name");
    if (!name) fail(Errc::input, "{}: missing .name", here);
    k.symbol = *name;
    const std::string kd = msgpack_string(m, ".symbol").value_or("");
    if (kd != k.symbol + ".kd")
      fail(Errc::input, "{} ({}): .symbol is \"{}\", expected \"{}.kd\"", here, k.symbol, kd, k.symbol);
    if (std::find(symbols.begin(), symbols.end(), kd) == symbols.end())
      fail(Errc::input, "{} ({}): kernel descriptor symbol {} is missing from the symbol tables", here, k.symbol, kd);
    k.kernarg_bytes = need_uint(".kernarg_segment_size");
    k.registers = need_uint(".vgpr_count");
    k.scalar_registers = need_uint(".sgpr_count");
    k.shared_bytes = need_uint(".group_segment_fixed_size");
    k.stack_bytes = need_uint(".private_segment_fixed_size");
    k.spill_bytes = 4 * msgpack_uint(m, ".vgpr_spill_count").value_or(0);
    // Explicit arguments are those the host passes; hidden_* ones (grid sizes, implicit pointers)
    // are appended by the runtime and are not part of the signature.
    if (auto args = m.find(".args"); args != m.end() && args->second.isArray()) {
      for (llvm::msgpack::DocNode& a : args->second.getArray()) {
        if (!a.isMap()) continue;
        llvm::msgpack::MapDocNode am = a.getMap();
        const std::string kind = msgpack_string(am, ".value_kind").value_or("");
        if (kind.rfind("hidden_", 0) == 0) continue;
        const uint64_t end = msgpack_uint(am, ".offset").value_or(0) + msgpack_uint(am, ".size").value_or(0);
        k.param_bytes = std::max<uint32_t>(k.param_bytes, static_cast<uint32_t>(end));
      }
    }
    out.push_back(std::move(k));
  }
  return out;
}

}  // namespace

std::vector<CodeObjectKernel> inspect_code_object(std::span<const uint8_t> bytes, const std::string& target,
                                                  const std::string& where) {
  const TargetInfo& t = target_info(target, where);
  // ELF structures are read in place and need 8-byte alignment; a bundle member inside a tar can
  // sit at any offset, so copy when needed.
  std::vector<uint64_t> aligned;
  const char* data = reinterpret_cast<const char*>(bytes.data());
  if (reinterpret_cast<uintptr_t>(data) % 8 != 0) {
    aligned.resize((bytes.size() + 7) / 8);
    std::memcpy(aligned.data(), bytes.data(), bytes.size());
    data = reinterpret_cast<const char*>(aligned.data());
  }
  llvm::StringRef buf(data, bytes.size());
  if (bytes.size() < 4 || std::memcmp(data, "\x7f" "ELF", 4) != 0)
    fail(Errc::input, "{}: not an ELF file (code objects for {} are ELF)", where, target);
  auto obj = llvm::object::ObjectFile::createELFObjectFile(llvm::MemoryBufferRef(buf, where));
  if (!obj) fail(Errc::input, "{}: not a valid ELF file: {}", where, llvm_message(obj.takeError()));
  auto* elf64 = llvm::dyn_cast<llvm::object::ELF64LEObjectFile>(obj->get());
  if (!elf64) fail(Errc::input, "{}: not a 64-bit little-endian ELF file", where);
  const ElfFile& elf = elf64->getELFFile();

  std::vector<CodeObjectKernel> out =
      t.vendor == Vendor::nvidia ? inspect_cubin(elf, t, where) : inspect_amdgpu(elf, t, where);
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) { return a.symbol < b.symbol; });
  return out;
}

const CodeObjectKernel& require_kernel(const std::vector<CodeObjectKernel>& kernels, const std::string& symbol,
                                       const std::string& where, int64_t param_bytes) {
  for (const CodeObjectKernel& k : kernels) {
    if (k.symbol != symbol) continue;
    if (param_bytes >= 0 && k.param_bytes != static_cast<uint64_t>(param_bytes))
      fail(Errc::verify, "{}: kernel {} takes {} parameter bytes, expected {}", where, symbol, k.param_bytes,
           param_bytes);
    return k;
  }
  std::string present;
  for (const CodeObjectKernel& k : kernels) present += fmt::format("{}{}", present.empty() ? "" : ", ", k.symbol);
  fail(Errc::verify, "{}: kernel {} is missing (present: {})", where, symbol, present.empty() ? "none" : present);
}

}  // namespace dp::backend
