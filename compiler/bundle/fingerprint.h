// Weight fingerprints: sha256 of each tensor-parallel shard exactly as a rank holds it on the device
// (the shard's elements in row-major order, in the dtype the manifest lists). Streamed with pread in
// bounded chunks, so hashing a checkpoint of any size keeps memory small and never maps it whole.
#pragma once

#include <string>
#include <vector>

#include "common/progress.h"
#include "model/ir.h"
#include "model/safetensors.h"
#include "plan/plan.h"

namespace dp::bundle {

// One shard to hash: tensor `t` of the checkpoint, cut as `shard` describes, converted to `dtype`.
struct ShardRef {
  const st::TensorInfo* tensor = nullptr;
  int split_dim = -1;
  int64_t begin = 0, end = 0;
  DType dtype = DType::BF16;  // the device dtype (the checkpoint's may differ: bf16 -> f32 is converted)
};

std::string fingerprint(const st::Checkpoint& ckpt, const ShardRef& s);

// Hashes many shards on `jobs` threads; results in input order. `progress` (when given) advances by one
// per shard hashed.
std::vector<std::string> fingerprint_all(const st::Checkpoint& ckpt, const std::vector<ShardRef>& shards,
                                         unsigned jobs, Progress* progress = nullptr);

}  // namespace dp::bundle
