#include "codegen/templates.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "common/error.h"
#include "common/fs.h"
#include "common/hash.h"

namespace fs = std::filesystem;

namespace dp::codegen {

TemplateSet TemplateSet::load(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    fail(Errc::toolchain,
         "{}: templates directory not found (set DECODEPACK_TEMPLATES_DIR or --templates-dir to the "
         "decodepack templates/ directory)",
         dir.string());
  TemplateSet set;
  set.dir_ = dir;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    if (!e.is_regular_file() || e.path().extension() != ".h") continue;
    set.files_.push_back({e.path().filename().string(), read_text_file(e.path())});
  }
  if (ec) fail(Errc::io, "{}: cannot list directory: {}", dir.string(), ec.message());
  std::sort(set.files_.begin(), set.files_.end(),
            [](const TemplateFile& a, const TemplateFile& b) { return a.name < b.name; });
  if (!set.find("vendor.h"))
    fail(Errc::toolchain, "{}: no vendor.h, so this is not the decodepack templates/ directory", dir.string());
  return set;
}

fs::path TemplateSet::default_dir() {
  if (const char* env = std::getenv("DECODEPACK_TEMPLATES_DIR"); env && *env) return env;
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    fs::path installed = exe.parent_path().parent_path() / "share" / "decodepack" / "templates";
    if (fs::is_regular_file(installed / "vendor.h", ec)) return installed;
  }
#ifdef DP_TEMPLATES_SOURCE_DIR
  return DP_TEMPLATES_SOURCE_DIR;
#else
  return "templates";
#endif
}

const TemplateFile* TemplateSet::find(std::string_view name) const {
  for (const TemplateFile& f : files_)
    if (f.name == name) return &f;
  return nullptr;
}

std::string TemplateSet::digest() const {
  Sha256 h;
  for (const TemplateFile& f : files_) {
    // Length-prefixed so that moving bytes between a name and a text changes the digest.
    const std::string head = std::to_string(f.name.size()) + ":" + f.name + ":" + std::to_string(f.text.size()) + ":";
    h.update(head);
    h.update(f.text);
  }
  return h.hex();
}

}  // namespace dp::codegen
