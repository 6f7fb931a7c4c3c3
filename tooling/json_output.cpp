#include "tooling/json_output.h"

#include <cstdio>

namespace dp::tools {

Json json_error(Errc code, const std::string& message) {
  return {{"code", errc_name(code)}, {"exit", static_cast<int>(code)}, {"message", message}};
}

void print_json(Json result) {
  result["schema_version"] = kJsonSchemaVersion;
  // Messages may quote bytes of hostile input that are not UTF-8: replaced, never a throw here.
  std::printf("%s\n", result.dump(2, ' ', false, Json::error_handler_t::replace).c_str());
  std::fflush(stdout);
}

void print_json_error(Errc code, const std::string& message) { print_json({{"error", json_error(code, message)}}); }

}  // namespace dp::tools
