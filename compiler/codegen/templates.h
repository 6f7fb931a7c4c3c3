// The device-code headers of templates/ as the compiler hands them to NVRTC and clang.
//
// Every compile sees the whole set (vendor.h and every op header) as in-memory files with bare names,
// so no path of the build machine reaches a code object, and the compile cache keys on the exact
// bytes of every header, not on a directory that could change underneath it.
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace dp::codegen {

struct TemplateFile {
  std::string name;  // bare file name, e.g. "vendor.h"
  std::string text;
};

class TemplateSet {
 public:
  // Reads every *.h directly in `dir`, sorted by name. Throws dp::Error(toolchain) naming the
  // directory (and how to point at another) when it is missing or holds no vendor.h.
  static TemplateSet load(const std::filesystem::path& dir);

  // Where templates/ is, first match wins:
  //   1. the environment variable DECODEPACK_TEMPLATES_DIR;
  //   2. the install layout, <dir of the executable>/../share/decodepack/templates;
  //   3. the source tree this binary was built from (developer builds and tests).
  // Returns the first candidate that exists, or candidate 3 (so the error names it).
  static std::filesystem::path default_dir();

  const std::vector<TemplateFile>& files() const { return files_; }
  const TemplateFile* find(std::string_view name) const;
  const std::filesystem::path& dir() const { return dir_; }
  // sha256 over every (name, text) pair in order: one value that identifies the device code.
  std::string digest() const;

 private:
  std::filesystem::path dir_;
  std::vector<TemplateFile> files_;
};

}  // namespace dp::codegen
