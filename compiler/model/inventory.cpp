#include "model/inventory.h"

#include <unordered_map>
#include <unordered_set>

#include "common/error.h"

namespace dp::model {

std::string shape_string(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::string InventoryIssue::message() const {
  // Names and shapes come from the checkpoint's headers: quoted through excerpt().
  std::string at = file.empty() ? std::string() : fmt::format(" (in {})", file);
  switch (kind) {
    case Kind::missing: return fmt::format("missing tensor {}: expected {}", name, expected);
    case Kind::unexpected:
      return fmt::format("unexpected tensor {}{}: found {}, not part of the model", excerpt(name), at, excerpt(found));
    case Kind::shape: return fmt::format("tensor {}{}: shape {}, expected {}", name, at, excerpt(found), expected);
    case Kind::dtype: return fmt::format("tensor {}{}: dtype {}, expected {}", name, at, found, expected);
  }
  return name;
}

Inventory check_inventory(const Model& model, const st::Checkpoint& ckpt) {
  Inventory inv;
  inv.resolved.assign(model.weights.size(), nullptr);
  std::unordered_set<std::string> used;
  for (size_t i = 0; i < model.weights.size(); ++i) {
    const WeightSpec& w = model.weights[i];
    const st::TensorInfo* t = ckpt.find(w.name);
    for (size_t a = 0; !t && a < w.aliases.size(); ++a) t = ckpt.find(w.aliases[a]);
    if (!t) {
      std::string names = w.name;
      for (const std::string& a : w.aliases) names += " (or " + a + ")";
      inv.issues.push_back({InventoryIssue::Kind::missing, names,
                            fmt::format("{} {}", shape_string(w.shape), dtype_name(w.dtype)), "", ""});
      continue;
    }
    used.insert(t->name);
    inv.resolved[i] = t;
    const std::string file = ckpt.file_path(t->file).filename().string();
    if (t->shape != w.shape)
      inv.issues.push_back({InventoryIssue::Kind::shape, t->name, shape_string(w.shape), shape_string(t->shape), file});
    bool dtype_ok = t->dtype == w.dtype;
    for (DType d : w.alt_dtypes) dtype_ok = dtype_ok || t->dtype == d;
    if (!dtype_ok) {
      std::string expected(dtype_name(w.dtype));
      for (DType d : w.alt_dtypes) expected += fmt::format(" or {}", dtype_name(d));
      inv.issues.push_back({InventoryIssue::Kind::dtype, t->name, expected, std::string(dtype_name(t->dtype)), file});
    }
  }
  for (const st::TensorInfo& t : ckpt.tensors())
    if (!used.count(t.name))
      inv.issues.push_back({InventoryIssue::Kind::unexpected, t.name, "",
                            fmt::format("{} {}", shape_string(t.shape), dtype_name(t.dtype)),
                            ckpt.file_path(t.file).filename().string()});
  return inv;
}

void require_inventory(const Inventory& inv, const std::string& where, size_t max_listed) {
  if (inv.ok()) return;
  std::string msg = fmt::format("{}: checkpoint does not match the model config ({} problem{}):", where,
                                inv.issues.size(), inv.issues.size() == 1 ? "" : "s");
  for (size_t i = 0; i < inv.issues.size() && i < max_listed; ++i) msg += "\n  " + inv.issues[i].message();
  if (inv.issues.size() > max_listed) msg += fmt::format("\n  ... and {} more", inv.issues.size() - max_listed);
  fail(Errc::verify, "{}", msg);
}

}  // namespace dp::model
