// `decodepack verify`: is a bundle exactly what its manifest says, and (with --model) were its weight
// fingerprints taken from this checkpoint?
#pragma once

#include <cstdio>
#include <optional>
#include <string>
#include <vector>

#include "bundle/bundle.h"

namespace dp::bundle {

struct VerifyProblem {
  std::string what;      // "file", "kernel", "weight", "manifest"
  std::string object;    // path, kernel key or tensor name
  std::string message;   // names expected and actual values
};

struct VerifyOptions {
  std::string model;                   // checkpoint directory to re-hash (empty: skip)
  std::string expect_digest;           // "sha256:..." the bundle must have (empty: skip)
  unsigned jobs = 0;
  std::FILE* progress = nullptr;       // fingerprinting progress (common/progress.h) goes here when set
  bool progress_tty = false;
};

struct VerifyReport {
  std::string digest;
  size_t files_checked = 0;
  size_t kernels_checked = 0;
  size_t weights_checked = 0;
  std::vector<VerifyProblem> problems;
  bool ok() const { return problems.empty(); }
};

// Checks: manifest.json is in canonical form and, when given, has the expected digest; every listed
// file exists with its size and sha256; no file is unlisted; every kernel's code object holds its
// symbol with the manifest's parameter size; with a model, every weight fingerprint. Format errors
// (schema, version, truncated archive) throw as Bundle::open does; content problems are collected.
VerifyReport verify_bundle(const Bundle& b, const VerifyOptions& o);

}  // namespace dp::bundle
