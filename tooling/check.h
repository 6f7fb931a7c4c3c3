// The comparison policies of `run --check` and `bench`'s correctness gate (tooling/run.h lists them):
// the limits, the reference views of the harness's cache mirrors, the "nothing else changed" count,
// padded rows as don't-care, and MoE routing near-ties. Harness::check_step (check.cpp) applies them
// layer by layer.
#pragma once

#include <cstdint>
#include <set>
#include <span>
#include <vector>

#include "model/ir.h"
#include "reference/layer.h"
#include "tooling/weights.h"
#include "tooling/workload.h"

namespace dp::tools {

// Relative-error limits: bf16 outputs, caches and activations; fp32 KDA states (before the
// state-magnitude allowance check.cpp adds).
inline constexpr double kBf16Limit = 1e-2, kF32Limit = 1e-4;

// The reference's view of a KDA layer's cache mirrors (state, conv q/k/v) in the bound layouts, and of
// an MLA layer's latent cache.
ref::KdaState kda_from_raw(const model::Model& m, ref::Shard shard, LayerCaches& lc, const CacheLayouts& lay);
ref::MlaCache mla_from_raw(const model::Model& m, LayerCaches& lc);

// Elements of `now` that differ from `before` (bitwise) outside the units (slots, or cache rows) in
// `skip`; a unit is `unit_bytes` long, an element `elem`.
int64_t changed_outside(const std::vector<uint8_t>& before, const std::vector<uint8_t>& now, size_t unit_bytes,
                        size_t elem, const std::set<int64_t>& skip);

// A [rows, cols] bf16 buffer as a reference matrix.
ref::Mat bf16_mat(const std::vector<uint8_t>& raw, int64_t rows, int64_t cols);

// Padded requests' rows are don't-care: whatever the GPU left there (even NaN) must not reach the
// reference, whose routing and norms are per row anyway.
void zero_rows(ref::Mat& m, const std::vector<bool>& valid);

// MoE routing near-ties (check.cpp says how): rows of `want` whose alternative routing is closer to
// `gpu` take it; returns how many did.
// `ranks`: the layer's reference weights of every tensor-parallel rank, in rank order (one at TP 1).
int64_t match_near_ties(const model::Model& m, const WeightSource& src, int layer,
                        std::span<const ref::LayerWeights* const> ranks, const ref::Trace& trace, const ref::Mat& gpu,
                        const std::vector<bool>& valid, const ref::Options& opt, ref::Mat& want);

}  // namespace dp::tools
