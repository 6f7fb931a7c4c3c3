// `decodepack doctor`'s report (tools/doctor.cpp prints it): the device toolchains as `build` finds
// them, the GPU drivers and devices as libdecodepack sees them, per target whether this machine builds
// it and on which devices it runs, and the compile cache.
#pragma once

#include <string>

#include "common/json.h"

namespace dp::tools {

struct DoctorOptions {
  std::string cuda_root, hip_clang, cache_dir;  // as for build; cache_dir "" = the default cache
};

// The report as one JSON object (the shape README.md documents); never throws for what is missing.
Json doctor_report(const DoctorOptions& o);

// The report as text on stdout.
void print_doctor_text(const Json& report);

}  // namespace dp::tools
