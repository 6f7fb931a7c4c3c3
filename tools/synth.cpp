// decodepack synth: write a random checkpoint with a preset's real tensor names, shapes and dtypes.
#include <cstdio>

#include "commands.h"
#include "common/error.h"
#include "common/json.h"
#include "tooling/json_output.h"
#include "model/synth.h"

namespace dp::tools {

void add_synth(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand("synth", "Write a deterministic random checkpoint (safetensors shards, index, "
                                          "config.json) for a preset");
  struct Opts {
    std::string preset, out, layout = "vllm", quantize = "none";
    uint64_t seed = 0, shard_mb = 0;
    bool force = false, json = false;
  };
  auto o = std::make_shared<Opts>();
  cmd->add_option("--preset", o->preset, "Preset name (see `decodepack plan --help`) or config.json path")
      ->required();
  cmd->add_option("-o,--output", o->out, "Output directory (replaced atomically; an existing directory that synth "
                                        "did not write is refused)")->required();
  cmd->add_flag("--force", o->force, "Write into an existing directory that synth did not write (its other files are "
                                     "kept), or over a file");
  cmd->add_option("--seed", o->seed, "Seed; the same seed gives the same bytes")->capture_default_str();
  cmd->add_option("--shard-mb", o->shard_mb, "Target shard size in MiB (default: a third of the model)");
  cmd->add_option("--layout", o->layout, "Tensor names/dtypes: vllm (as the Hub ships them) or transformers "
                                         "(as HF transformers 5 save_pretrained writes them)")
      ->check(CLI::IsMember({"vllm", "transformers"}))
      ->capture_default_str();
  cmd->add_option("--quantize", o->quantize, "none (the preset's dtypes) or fp8 (e4m3 weights with an fp32 "
                                             "weight_scale_inv per 128x128 block, as DeepSeek-style FP8 checkpoints; the "
                                             "config gains the quantization_config)")
      ->check(CLI::IsMember({"none", "fp8"}))
      ->capture_default_str();
  cmd->add_flag("--json", o->json, "Print the result as JSON");
  cmd->callback([o, &action] {
    action = [o] {
      model::SynthOptions so;
      so.preset = o->preset;
      so.out = o->out;
      so.force = o->force;
      so.seed = o->seed;
      so.shard_bytes = o->shard_mb << 20;
      so.layout = o->layout == "vllm" ? model::CheckpointLayout::vllm : model::CheckpointLayout::transformers;
      so.quantize = o->quantize == "fp8" ? model::SynthQuantize::fp8 : model::SynthQuantize::none;
      so.progress = stderr;
      so.progress_tty = stderr_is_tty();
      model::SynthResult r = model::synthesize(so);
      if (o->json) {
        print_json({{"checkpoint", o->out}, {"checkpoint_tensors", r.tensors}, {"files", r.shards},
                    {"bytes", r.bytes}, {"preset", o->preset}, {"quantize", o->quantize}, {"seed", o->seed}});
      } else {
        std::printf("wrote %s: %zu tensors in %zu shards, %llu bytes\n", o->out.c_str(), r.tensors, r.shards,
                    static_cast<unsigned long long>(r.bytes));
      }
      return 0;
    };
  });
}

}  // namespace dp::tools
