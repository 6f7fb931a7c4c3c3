#include "backend/cache.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "common/error.h"
#include "common/fs.h"
#include "common/hash.h"
#include "common/output.h"

namespace fs = std::filesystem;

namespace dp::backend {
namespace {

constexpr std::string_view kMagic = "decodepack-compile-cache 1";

// Every field length-prefixed, so no two different inputs hash the same byte stream.
void field(Sha256& h, std::string_view tag, std::string_view value) {
  h.update(fmt::format("{}:{}:", tag, value.size()));
  h.update(value);
}

bool is_hex64(std::string_view s) {
  return s.size() == 64 && s.find_first_not_of("0123456789abcdef") == std::string_view::npos;
}

}  // namespace

std::string compile_cache_key(const std::string& source, std::span<const codegen::TemplateFile> headers,
                              const std::vector<std::string>& flags, const std::string& target,
                              const std::string& toolchain_version, const std::string& stem) {
  Sha256 h;
  field(h, "format", kMagic);
  field(h, "stem", stem);
  field(h, "target", target);
  field(h, "toolchain", toolchain_version);
  for (const std::string& f : flags) field(h, "flag", f);
  field(h, "source", source);
  for (const codegen::TemplateFile& t : headers) {
    field(h, "header", t.name);
    field(h, "text", t.text);
  }
  return h.hex();
}

CompileCache::CompileCache(fs::path dir) : dir_(std::move(dir)) {}

fs::path CompileCache::default_dir() {
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x == '/') return fs::path(x) / "decodepack";
  if (const char* home = std::getenv("HOME"); home && *home) return fs::path(home) / ".cache" / "decodepack";
  fail(Errc::usage, "no cache directory: neither XDG_CACHE_HOME nor HOME is set; pass --cache-dir DIR");
}

fs::path CompileCache::entry_path(const std::string& key) const {
  if (!is_hex64(key)) fail(Errc::internal, "compile cache: malformed key \"{}\"", key);
  return dir_ / "v1" / key.substr(0, 2) / key;
}

std::optional<CacheEntry> CompileCache::get(const std::string& key) {
  const fs::path path = entry_path(key);
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    ++misses_;
    return std::nullopt;
  }
  auto corrupt = [&]() -> std::optional<CacheEntry> {
    ++corrupt_;
    ++misses_;
    return std::nullopt;
  };
  std::string data;
  try {
    data = read_text_file(path);
  } catch (const Error&) {
    return corrupt();
  }
  // Four header lines, then the payload.
  std::string_view rest(data);
  std::string_view lines[4];
  for (std::string_view& line : lines) {
    size_t nl = rest.find('\n');
    if (nl == std::string_view::npos) return corrupt();
    line = rest.substr(0, nl);
    rest.remove_prefix(nl + 1);
  }
  if (lines[0] != kMagic || lines[1] != "key " + key || lines[2].substr(0, 7) != "sha256 " ||
      !is_hex64(lines[2].substr(7)) || lines[3].substr(0, 6) != "sizes ")
    return corrupt();
  unsigned long long sizes[3];
  char tail = 0;
  if (std::sscanf(std::string(lines[3].substr(6)).c_str(), "%llu %llu %llu%c", &sizes[0], &sizes[1], &sizes[2],
                  &tail) != 3)
    return corrupt();
  if (sizes[0] > rest.size() || sizes[1] > rest.size() || sizes[2] > rest.size() ||
      sizes[0] + sizes[1] + sizes[2] != rest.size())
    return corrupt();
  if (sha256_hex(rest) != lines[2].substr(7)) return corrupt();
  if (sizes[0] == 0) return corrupt();  // an empty code object is never a compile result
  CacheEntry e;
  const auto* p = reinterpret_cast<const uint8_t*>(rest.data());
  e.code_object.assign(p, p + sizes[0]);
  e.log = std::string(rest.substr(sizes[0], sizes[1]));
  e.ptx = std::string(rest.substr(sizes[0] + sizes[1], sizes[2]));
  ++hits_;
  return e;
}

void CompileCache::put(const std::string& key, const CacheEntry& e) {
  const fs::path path = entry_path(key);
  std::error_code ec;
  fs::create_directories(path.parent_path(), ec);
  if (ec) fail(Errc::io, "{}: cannot create cache directory: {}", path.parent_path().string(), ec.message());
  std::string payload(reinterpret_cast<const char*>(e.code_object.data()), e.code_object.size());
  payload += e.log;
  payload += e.ptx;
  std::string file = fmt::format("{}\nkey {}\nsha256 {}\nsizes {} {} {}\n", kMagic, key, sha256_hex(payload),
                                 e.code_object.size(), e.log.size(), e.ptx.size());
  file += payload;
  remove_stale_staging(path);  // a build killed while writing this entry
  write_file_atomic(path, file);
}

void CompileCache::mark_unusable() {
  --hits_;
  ++corrupt_;
  ++misses_;
}

CacheStats CompileCache::stats() const { return {hits_.load(), misses_.load(), corrupt_.load()}; }

}  // namespace dp::backend
