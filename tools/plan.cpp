// decodepack plan: what `build` would produce for a model and a deploy config. No GPU, no compile.
#include <cstdio>
#include <filesystem>

#include "commands.h"
#include "common/error.h"
#include "deploy/deploy.h"
#include "tooling/json_output.h"
#include "model/inventory.h"
#include "model/ir.h"
#include "model/safetensors.h"
#include "plan/plan.h"

namespace dp::tools {

void add_plan(CLI::App& app, Action& action) {
  std::string presets;
  for (const std::string& p : model::preset_names()) presets += (presets.empty() ? "" : ", ") + p;
  auto* cmd = app.add_subcommand("plan", "Show the kernels, weight shards, step bytes, prefetch tables and "
                                         "workspaces a build would produce (no GPU, no compile)");
  struct Opts {
    std::string model, deploy = "default";
    int64_t context = 4096;
    bool json = false, no_weights = false;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--model", o->model,
                  "Checkpoint directory (config.json [+ safetensors]), config file, or preset (" + presets + ")")
      ->required();
  cmd->add_option("--deploy", o->deploy, "Deploy config JSON, or `default` for the built-in one")
      ->capture_default_str();
  cmd->add_option("--context", o->context, "Tokens of context per request for the KV bytes estimate")
      ->capture_default_str();
  cmd->add_flag("--no-weights", o->no_weights, "Do not check the checkpoint's tensors even if present");
  cmd->add_flag("--json", o->json, "Print the plan as JSON");
  cmd->callback([o, &action] {
    action = [o] {
      model::Model m = model::load_model(o->model);
      deploy::Deploy d = deploy::load_deploy(o->deploy);
      // A directory with weights is checked against the IR before anything is planned from it.
      std::error_code ec;
      namespace fs = std::filesystem;
      if (!o->no_weights && fs::is_directory(o->model, ec) && st::Checkpoint::present(o->model)) {
        st::Checkpoint ck = st::Checkpoint::open(o->model);
        model::require_inventory(model::check_inventory(m, ck), o->model);
      }
      plan::PlanOptions po;
      po.context = o->context;
      plan::Plan p = plan::make_plan(m, d, o->deploy, po);
      if (o->json) print_json(plan::to_json(p, m, d));
      else std::fputs(plan::to_text(p, m, d).c_str(), stdout);
      return 0;
    };
  });
}

}  // namespace dp::tools
