// decodepack indexer-run: the sparse-attention indexer prefill of a bundle on the GPU, checked against
// the CPU reference (tooling/indexer_run.h, .cpp say what a run does).
#include <memory>

#include "commands.h"
#include "tooling/indexer_run.h"

namespace dp::tools {

void add_indexer_run(CLI::App& app, Action& action) {
  auto* cmd = app.add_subcommand(
      "indexer-run",
      "Run the sparse-attention indexer prefill of a bundle on the GPU (one GPU per DCP rank, all-gathers through "
      "NCCL) through libdecodepack, and compare the key cache bytes and every row's top-k with the CPU reference. "
      "Exit 0: every check passed; 5: a check failed; 8: no GPU, driver or NCCL");
  auto o = std::make_shared<IndexerRunOptions>();
  cmd->add_option("bundle", o->bundle, "Bundle directory or .dpk file of a model with an indexer")->required();
  cmd->add_option("--seq-lens", o->seq_lens, "Keys of each request (context + new tokens)")->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--query-lens", o->query_lens, "Query rows of each request, its newest positions (default: all)")
      ->delimiter(',');
  cmd->add_option("--set-size", o->set_size, "Requests per request set (each set's keys are staged once)")
      ->capture_default_str();
  cmd->add_option("--layout", o->layout, "Key-cache block layout: split (payload rows, then scale rows) or packed")
      ->capture_default_str();
  cmd->add_option("--stride-pad", o->stride_pad, "Bytes between cache blocks beyond block_size x 68 (a multiple of 16)")
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "Seed of the random inputs and block ids")->capture_default_str();
  cmd->add_option("--inputs", o->inputs,
                  "Read the inputs from DIR (meta.json, keys.f32, q.f32, w.f32) instead of drawing them, and write "
                  "the GPU's top-k (dp_topk.i32) and its dequantised cache (dp_keys.f32) there");
  cmd->add_option("--max-tile-bytes", o->max_tile_bytes,
                  "Cap each query chunk's logits tile (dp_indexer_batch_desc.max_tile_bytes; 0: 1 GiB): smaller values "
                  "split the rows into more chunks that share the staged keys");
  cmd->add_option("--repeat", o->repeat,
                  "Run the prefill this many more times after the checked one and report the median time (the "
                  "first run includes one-time setup such as NCCL's connections); each output must equal the first")
      ->capture_default_str();
  cmd->add_flag("!--no-check", o->check,
                "Only time the prefill (with --repeat): no CPU reference, no comparison (the output's determinism "
                "across repeats is still checked)");
  auto* devices = cmd->add_option("--devices", o->devices, "CUDA device of each DCP rank (default 0..W-1)")
                      ->delimiter(',');
  cmd->add_option("--device", o->device, "CUDA device ordinal of a one-rank bundle (as for run and bench; default 0)")
      ->check(CLI::NonNegativeNumber)
      ->excludes(devices);
  cmd->add_option("--nccl", o->nccl, "NCCL library for DCP (default: $DECODEPACK_NCCL or libnccl.so.2)");
  cmd->add_flag("--json", o->json, "Print the result as JSON");
  cmd->footer(
      "Needs an NVIDIA GPU per DCP rank (the bundle's dcp.size), the driver (libcuda.so.1) and, above one rank,\n"
      "NCCL. Exit codes: 0 ok, 1 internal error, 2 usage, 3 bad input, 4 I/O, 5 a check failed, 8 device.");
  cmd->callback([o, &action] { action = [o] { return run_indexer(*o); }; });
}

}  // namespace dp::tools
