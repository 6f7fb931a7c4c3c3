// `indexer-run`'s checks: the CPU reference of every rank's key cache and every set's top-k
// (compiler/indexer/reference.h), and the comparison of a GPU row with it.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "indexer/reference.h"
#include "tooling/indexer_workload.h"

namespace dp::tools::ixrun {

struct Reference {
  std::vector<ix::KeyCache> caches;             // per rank
  std::vector<std::vector<int32_t>> topk;       // per set: [rows, k]
  std::vector<std::vector<std::vector<double>>> logits;  // per set, per row
};

Reference reference(const Inputs& in, const Layout& L, const ix::PrefillConfig& cfg);

// The median (0 for none).
double median(std::vector<double> v);

struct RowCheck {
  int64_t rows = 0, identical = 0, near_ties = 0, failed = 0;
  std::vector<std::string> failures;  // first few
};

// A GPU row against the reference: equal, or different only where scores are within `tol` of the k-th
// best (fp32 accumulation vs float64); in both cases -1 exactly after the visible keys and the list in
// best-first order (by the reference's scores, within tol).
void compare_row(std::span<const int32_t> gpu, std::span<const int32_t> ref, std::span<const double> logits,
                 int64_t row, RowCheck& rc);

}  // namespace dp::tools::ixrun
