// The --json contract (README.md "JSON output"): a command given --json prints exactly one JSON object
// on stdout, on success and on failure alike, and nothing else there (progress and messages go to
// stderr). Every object carries "schema_version"; a failure carries "error" with a stable code, the exit
// status and the message that stderr also shows. Each command's shape is a JSON Schema under
// manifests/cli/. `bench --json FILE` is the one exception: it writes its result file there.
#pragma once

#include <string>

#include "common/error.h"
#include "common/json.h"

namespace dp::tools {

// The version of the --json shapes (manifests/cli/*.schema.json). Raised when a key is removed or
// changes meaning; keys may be added without a raise.
inline constexpr int kJsonSchemaVersion = 1;

// The error member: {"code": "input", "exit": 3, "message": "..."}; `code` is errc_name(code).
Json json_error(Errc code, const std::string& message);

// Prints `result` (an object) as the command's one JSON document, with schema_version added.
void print_json(Json result);

// A failure as the command's one JSON document: {"schema_version": 1, "error": {...}}.
void print_json_error(Errc code, const std::string& message);

}  // namespace dp::tools
