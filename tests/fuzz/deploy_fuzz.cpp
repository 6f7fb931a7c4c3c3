// libFuzzer target: a deploy config as arbitrary bytes, through dp::parse_json, dp::deploy::parse_deploy
// and the model-dependent checks against the tiny preset.
//
// Contract: every input yields a deploy config or throws dp::Error(Errc::input). A parsed config must
// survive its canonical round trip unchanged (parse_deploy(to_json(d)) == d).
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "common/error.h"
#include "common/json.h"
#include "deploy/deploy.h"
#include "model/ir.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const dp::model::Model tiny = dp::model::load_model("kimi-linear-tiny");
  std::string_view text(reinterpret_cast<const char*>(data), size);
  try {
    dp::deploy::Deploy d = dp::deploy::parse_deploy(dp::parse_json(text, "deploy.json"), "deploy.json");
    if (!(dp::deploy::parse_deploy(dp::deploy::to_json(d), "canonical") == d)) std::abort();
    dp::deploy::check_against_model(d, tiny, "deploy.json");
  } catch (const dp::Error& e) {
    if (e.code() != dp::Errc::input) std::abort();
  }
  return 0;
}
