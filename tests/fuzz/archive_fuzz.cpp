// libFuzzer target: a .dpk archive as arbitrary bytes, through both archive readers: the compiler's
// (dp::bundle::list_archive / read_archive_member, which push and pull use) and the runtime's
// (dp::format::BundleReader: open, verify, then every file), which inspect, verify and libdecodepack use.
// Both walk the archive with dp::format::walk_archive (runtime/format/ustar.h).
//
// Contract under test: every input is either accepted or refused with the reader's own error type
// (dp::Error for the compiler's reader, dp::format::FormatError for the runtime's); anything else (another
// exception, a crash, a sanitizer report, a hang, memory beyond the input's size) is a bug. What is
// accepted must be consistent: every member lies inside the file, and both readers agree on which
// regular files the archive holds.
//
// The readers take a path (they open the file themselves, as they must to refuse FIFOs), so each input
// is written to one memfd and opened through /proc/self/fd.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "bundle/archive.h"
#include "common/error.h"
#include "format/bundle_reader.h"

namespace {

void check(bool ok) {
  if (!ok) std::abort();  // libFuzzer saves the input as a crash
}

const std::string& input_path() {
  static const std::string path = [] {
    const int fd = ::memfd_create("dpk", MFD_CLOEXEC);
    check(fd >= 0);
    return "/proc/self/fd/" + std::to_string(fd);
  }();
  return path;
}

void write_input(const uint8_t* data, size_t size) {
  const int fd = std::stoi(input_path().substr(input_path().rfind('/') + 1));
  check(::ftruncate(fd, 0) == 0);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pwrite(fd, data + done, size - done, static_cast<off_t>(done));
    check(n > 0);
    done += static_cast<size_t>(n);
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  write_input(data, size);
  const std::string& path = input_path();

  // The compiler's reader.
  std::vector<std::string> compiler_files;
  bool compiler_ok = false;
  try {
    for (const dp::bundle::ArchiveEntry& e : dp::bundle::list_archive(path)) {
      check(e.offset <= size && e.size <= size - e.offset);
      compiler_files.push_back(e.path);
    }
    compiler_ok = true;
    try {
      const std::string m = dp::bundle::read_archive_member(path, "manifest.json");
      check(m.size() <= size);
    } catch (const dp::Error& e) {
      check(e.code() == dp::Errc::verify || e.code() == dp::Errc::input);
    }
  } catch (const dp::Error& e) {
    check(e.code() == dp::Errc::verify || e.code() == dp::Errc::input);
  }

  // The runtime's reader.
  try {
    dp::format::BundleReader b = dp::format::BundleReader::open(path);
    check(b.is_archive());
    check(b.manifest_bytes().size() <= size);
    // Both readers walk the same structure: what one accepts, the other accepts with the same files.
    check(compiler_ok);
    std::vector<std::string> runtime_files = b.files();
    runtime_files.push_back("manifest.json");
    std::sort(runtime_files.begin(), runtime_files.end());
    std::sort(compiler_files.begin(), compiler_files.end());
    check(runtime_files == compiler_files);
    try {
      b.verify();
    } catch (const dp::format::FormatError&) {
    }
    for (const std::string& f : b.files()) {
      try {
        check(b.file(f).size() == b.size(f) && b.size(f) <= size);
      } catch (const dp::format::FormatError&) {
      }
    }
  } catch (const dp::format::FormatError&) {
  }
  return 0;
}
