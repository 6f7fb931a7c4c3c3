// The compile cache: code objects keyed by everything that determines their bytes.
//
// Key: sha256 over the generated source, every templates/ header (name and bytes), the compiler
// flags, the target and the toolchain's version string (compile_cache_key()). Nothing else reaches a
// code object, so a hit is exactly what a compile would produce.
//
// Layout: <dir>/v1/<first two hex digits>/<key>. Each entry is one file:
//   line 1  "decodepack-compile-cache 1"
//   line 2  "key <64 hex>"            the entry's own key (a file copied under another name is caught)
//   line 3  "sha256 <64 hex>"         digest of the payload
//   line 4  "sizes <code> <log> <ptx>" byte counts of the payload's three parts
//   payload code-object bytes, then the compiler log, then PTX (may be empty)
// Entries are written to a temporary file and renamed into place, so concurrent builds sharing a
// cache each see a whole entry or none. On read the header and digest are checked; an entry that
// fails is counted as corrupt, never used, and the caller recompiles and overwrites it. The caller
// also checks that a hit's code object holds the kernel of its key (compile_all() inspects it) and
// reports one that does not as corrupt (mark_unusable()).
#pragma once

#include <atomic>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "codegen/templates.h"

namespace dp::backend {

struct CacheEntry {
  std::vector<uint8_t> code_object;
  std::string log;
  std::string ptx;
};

struct CacheStats {
  uint64_t hits = 0;
  uint64_t misses = 0;   // includes corrupt entries (they are compiled again)
  uint64_t corrupt = 0;
};

class CompileCache {
 public:
  explicit CompileCache(std::filesystem::path dir);
  // $XDG_CACHE_HOME/decodepack, else $HOME/.cache/decodepack (XDG Base Directory defaults).
  static std::filesystem::path default_dir();

  // Thread-safe. nullopt on a miss or a corrupt entry (counted separately).
  std::optional<CacheEntry> get(const std::string& key);
  // Thread-safe; replaces any existing entry atomically. I/O errors are dp::Error(io) naming the path.
  void put(const std::string& key, const CacheEntry& e);

  // The entry get() returned for a key turned out not to hold that key's code object (its checksum is
  // valid, its contents are not what the key says): counted as corrupt instead of a hit.
  void mark_unusable();

  CacheStats stats() const;
  const std::filesystem::path& dir() const { return dir_; }
  std::filesystem::path entry_path(const std::string& key) const;

 private:
  std::filesystem::path dir_;
  std::atomic<uint64_t> hits_{0}, misses_{0}, corrupt_{0};
};

std::string compile_cache_key(const std::string& source, std::span<const codegen::TemplateFile> headers,
                              const std::vector<std::string>& flags, const std::string& target,
                              const std::string& toolchain_version, const std::string& stem);

}  // namespace dp::backend
