// Packing a bundle directory into a .dpk archive (`decodepack pack`, and `push` of a directory).
//
// The directory is verified first (exactly the files its manifest lists, each with its size and sha256;
// verify_bundle()), then archived by write_archive(), so the archive has the same bytes as the one
// `decodepack build -o X.dpk` writes for the same bundle, and pushing a directory or its packed archive
// gives the same layer digest.
//
// Errors (dp::Error): what Bundle::open and verify_bundle report for a damaged directory (Errc::verify
// lists the problems), Errc::usage for an input that is already an archive or an output that overlaps
// the directory or is not a bundle archive (without `force`), Errc::io for files.
#pragma once

#include <filesystem>

#include "bundle/bundle.h"

namespace dp::bundle {

// Packs the directory bundle `b` into `out_dpk` (replaced atomically; only a bundle archive is replaced
// unless `force`).
void pack_bundle(const Bundle& b, const std::filesystem::path& out_dpk, bool force);

}  // namespace dp::bundle
