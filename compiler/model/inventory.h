// Inventory check: does a checkpoint hold exactly the tensors the model IR expects?
#pragma once

#include <string>
#include <vector>

#include "model/ir.h"
#include "model/safetensors.h"

namespace dp::model {

struct InventoryIssue {
  enum class Kind { missing, unexpected, shape, dtype };
  Kind kind;
  std::string name;      // tensor name as in the checkpoint (or as expected, for missing)
  std::string expected;  // "[4096, 2304]", "BF16", ...
  std::string found;
  std::string file;      // shard holding it, when known
  std::string note;      // why the expectation is what it is (FP8 weights and their scales), or empty
  std::string message() const;
};

struct Inventory {
  // For each Model::weights entry, the checkpoint tensor that provides it (nullptr when missing).
  std::vector<const st::TensorInfo*> resolved;
  std::vector<InventoryIssue> issues;
  bool ok() const { return issues.empty(); }
};

// Matches every IR weight by name or alias, then checks shape and dtype (the canonical dtype or one
// of the accepted alternatives). Tensors the IR does not know are "unexpected". Issues about an FP8
// block-quantized weight or its weight_scale_inv say what the quantization expects, and a scale the
// model has no FP8 weight for says so.
Inventory check_inventory(const Model& model, const st::Checkpoint& ckpt);

// Throws dp::Error(verify) listing every issue (at most `max_listed`, then a count) when not ok().
void require_inventory(const Inventory& inv, const std::string& where, size_t max_listed = 20);

std::string shape_string(const std::vector<int64_t>& shape);

}  // namespace dp::model
