// libFuzzer target: a bundle manifest.json as arbitrary bytes, through the runtime's format reader:
// the bounded JSON parser the bundle reader uses (format/untrusted.h), then format::from_json.
//
// Contract: every input yields a manifest or throws dp::format::JsonTextError (not JSON, nested too
// deep, a repeated key) or dp::format::FormatError; an accepted manifest re-serialises to a manifest the
// reader accepts with the same canonical bytes.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "format/manifest.h"
#include "format/untrusted.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using dp::format::Json;
  const dp::format::JsonLimits limits{dp::format::kMaxManifestBytes};
  Json j;
  try {
    j = dp::format::parse_json_text(std::string_view(reinterpret_cast<const char*>(data), size), limits);
  } catch (const dp::format::JsonTextError&) {
    return 0;
  }
  try {
    dp::format::Manifest m = dp::format::from_json(j, "manifest.json");
    const std::string bytes = dp::format::canonical_bytes(m);
    dp::format::Manifest again = dp::format::from_json(dp::format::parse_json_text(bytes, limits), "again");
    if (dp::format::canonical_bytes(again) != bytes) std::abort();
  } catch (const dp::format::FormatError&) {
  }
  return 0;
}
