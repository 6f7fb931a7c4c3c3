// libFuzzer target: a HF config.json as arbitrary bytes, through dp::parse_json and
// dp::model::model_from_config.
//
// Contract under test: every input either yields a model or throws dp::Error(Errc::input) naming what
// is wrong. Any other exception (e.g. a nlohmann type_error from an unchecked .get<>()), a crash, a
// sanitizer report, or running out of memory on a small config (unbounded sizes taken from the file)
// is a bug. A fixed crash input belongs in corpus/json_config/ so that every run replays it.
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/error.h"
#include "common/json.h"
#include "model/ir.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    dp::Json config = dp::parse_json(text, "config.json");
    dp::model::Model m = dp::model::model_from_config(config, "config.json");
    // Touch the derived quantities the planner relies on; they must not trap either.
    (void)m.total_weight_bytes();
    for (const auto& w : m.weights) (void)w.bytes();
  } catch (const dp::Error& e) {
    if (e.code() != dp::Errc::input) std::abort();
  }
  return 0;
}
