#include "model/inventory.h"

#include <unordered_map>
#include <unordered_set>

#include "common/error.h"
#include "model/quant.h"

namespace dp::model {

std::string shape_string(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

std::string InventoryIssue::message() const {
  // Names and shapes come from the checkpoint's headers: quoted through excerpt().
  std::string at = file.empty() ? std::string() : fmt::format(" (in {})", file);
  const std::string why = note.empty() ? std::string() : fmt::format(" ({})", note);
  switch (kind) {
    case Kind::missing: return fmt::format("missing tensor {}: expected {}{}", name, expected, why);
    case Kind::unexpected:
      return fmt::format("unexpected tensor {}{}: found {}, not part of the model{}", excerpt(name), at, excerpt(found),
                         why);
    case Kind::shape: return fmt::format("tensor {}{}: shape {}, expected {}{}", name, at, excerpt(found), expected, why);
    case Kind::dtype: return fmt::format("tensor {}{}: dtype {}, expected {}{}", name, at, found, expected, why);
  }
  return name;
}

namespace {

std::string module_of(const std::string& weight) {
  return weight.ends_with(".weight") ? weight.substr(0, weight.size() - 7) : weight;
}

// Why an FP8 weight, its scale or an unquantized linear weight of an FP8 model is expected as it is.
// `q`: the weight that `w` scales, when `w` is a scale tensor.
std::string quant_note(const Model& model, const WeightSpec& w, const WeightSpec* q, InventoryIssue::Kind kind) {
  if (model.quant.method != QuantMethod::fp8_block) return {};
  const std::string config = fmt::format("quantization_config: {}", describe(model.quant));
  if (!w.scale_of.empty()) {
    if (!q || q->shape.size() != 2 || q->quant.block.size() != 2) return {};
    const std::string of = fmt::format("the fp32 weight_scale_inv of FP8 weight {} {}: one scale per {}x{} block",
                                       w.scale_of, shape_string(q->shape), q->quant.block[0], q->quant.block[1]);
    if (kind == InventoryIssue::Kind::shape)
      return fmt::format("{}, ceil({}/{}) x ceil({}/{})", of, q->shape[0], q->quant.block[0], q->shape[1],
                         q->quant.block[1]);
    return of;
  }
  if (w.quant.method == QuantMethod::fp8_block)
    return fmt::format("{} stores {} as e4m3 with a weight_scale_inv; the ignore list (modules_to_not_convert / "
                       "ignored_layers) does not name it", config, module_of(w.name));
  if (w.quant.excluded)
    return fmt::format("{}, but the ignore list (modules_to_not_convert / ignored_layers) keeps {} unquantized", config,
                       module_of(w.name));
  return {};
}

}  // namespace

Inventory check_inventory(const Model& model, const st::Checkpoint& ckpt) {
  Inventory inv;
  inv.resolved.assign(model.weights.size(), nullptr);
  std::unordered_set<std::string> used;
  // Names to IR entries, for the scales' weights and the scales a checkpoint has too many of (a model
  // holds 10^5 weights: no linear search per issue).
  std::unordered_map<std::string_view, size_t> index;
  for (size_t i = 0; i < model.weights.size(); ++i) index.emplace(model.weights[i].name, i);
  auto find = [&](std::string_view name) -> const WeightSpec* {
    auto it = index.find(name);
    return it == index.end() ? nullptr : &model.weights[it->second];
  };
  for (size_t i = 0; i < model.weights.size(); ++i) {
    const WeightSpec& w = model.weights[i];
    const WeightSpec* scaled = w.scale_of.empty() ? nullptr : find(w.scale_of);
    const st::TensorInfo* t = ckpt.find(w.name);
    for (size_t a = 0; !t && a < w.aliases.size(); ++a) t = ckpt.find(w.aliases[a]);
    if (!t) {
      std::string names = w.name;
      for (const std::string& a : w.aliases) names += " (or " + a + ")";
      InventoryIssue issue{InventoryIssue::Kind::missing, names,
                           fmt::format("{} {}", shape_string(w.shape), dtype_name(w.dtype)), "", "",
                           quant_note(model, w, scaled, InventoryIssue::Kind::missing)};
      // A missing scale: name the file holding its weight (IR order puts the weight first).
      if (scaled && !issue.note.empty())
        if (const st::TensorInfo* qt = inv.resolved[static_cast<size_t>(scaled - model.weights.data())])
          issue.note += fmt::format("; the weight is in {}", ckpt.file_path(qt->file).filename().string());
      inv.issues.push_back(std::move(issue));
      continue;
    }
    used.insert(t->name);
    inv.resolved[i] = t;
    const std::string file = ckpt.file_path(t->file).filename().string();
    if (t->shape != w.shape)
      inv.issues.push_back({InventoryIssue::Kind::shape, t->name, shape_string(w.shape), shape_string(t->shape), file,
                            quant_note(model, w, scaled, InventoryIssue::Kind::shape)});
    bool dtype_ok = t->dtype == w.dtype;
    for (DType d : w.alt_dtypes) dtype_ok = dtype_ok || t->dtype == d;
    if (!dtype_ok) {
      std::string expected(dtype_name(w.dtype));
      for (DType d : w.alt_dtypes) expected += fmt::format(" or {}", dtype_name(d));
      inv.issues.push_back({InventoryIssue::Kind::dtype, t->name, expected, std::string(dtype_name(t->dtype)), file,
                            quant_note(model, w, scaled, InventoryIssue::Kind::dtype)});
    }
  }
  for (const st::TensorInfo& t : ckpt.tensors()) {
    if (used.count(t.name)) continue;
    // A scale whose weight the model holds unquantized: say why it has none.
    std::string note;
    if (t.name.ends_with(".weight_scale_inv"))
      if (const WeightSpec* w = find(t.name.substr(0, t.name.size() - 17) + ".weight"))
        note = model.quant.method != QuantMethod::fp8_block
                   ? fmt::format("the config has no FP8 quantization_config, so {} has no scale", excerpt(w->name))
               : w->quant.excluded
                   ? fmt::format("{} is in the ignore list (modules_to_not_convert / ignored_layers) and stays {}",
                                 excerpt(w->name), dtype_name(w->dtype))
                   : fmt::format("{} is not a linear layer that FP8 quantizes; it stays {}", excerpt(w->name),
                                 dtype_name(w->dtype));
    inv.issues.push_back({InventoryIssue::Kind::unexpected, t.name, "",
                          fmt::format("{} {}", shape_string(t.shape), dtype_name(t.dtype)),
                          ckpt.file_path(t.file).filename().string(), std::move(note)});
  }
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
