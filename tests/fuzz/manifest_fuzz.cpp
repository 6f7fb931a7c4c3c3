// libFuzzer target: a bundle manifest.json as arbitrary bytes, through the runtime's format reader.
//
// Contract: every input yields a manifest or throws dp::format::FormatError; an accepted manifest
// re-serialises to a manifest the reader accepts with the same canonical bytes.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "format/manifest.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using dp::format::Json;
  Json j = Json::parse(data, data + size, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return 0;
  try {
    dp::format::Manifest m = dp::format::from_json(j, "manifest.json");
    const std::string bytes = dp::format::canonical_bytes(m);
    dp::format::Manifest again = dp::format::from_json(Json::parse(bytes), "again");
    if (dp::format::canonical_bytes(again) != bytes) std::abort();
  } catch (const dp::format::FormatError&) {
  }
  return 0;
}
