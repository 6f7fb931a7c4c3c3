// `decodepack indexer-run` (tools/indexer_run.cpp declares its options): the FP4 indexer prefill of a
// bundle on one GPU per DCP rank, through libdecodepack as a host calls it, checked against the CPU
// reference (compiler/indexer/reference.h). indexer_run.cpp says what a run does.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dp::tools {

struct IndexerRunOptions {
  std::string bundle;
  std::vector<int64_t> seq_lens{1, 37, 64, 129, 300};
  std::vector<int64_t> query_lens;  // default: seq_lens (a prefill from empty)
  int64_t set_size = 3;             // requests per request set
  std::string layout = "split";
  int64_t stride_pad = 32;          // bytes added to block_size * 68 (merged pages)
  uint64_t seed = 0;  // as in synth, run and bench
  std::string inputs;
  std::string nccl;
  std::vector<int> devices;
  int device = -1;  // --device: one rank's device, as in run and bench
  uint64_t max_tile_bytes = 0;
  int repeat = 0;
  bool check = true;
  bool json = false;
};

// Runs, checks and prints the result (text or --json on stdout, progress on stderr). Returns the exit
// status: 0 every check passed, 5 a check failed; throws dp::Error otherwise (usage, input, device).
int run_indexer(const IndexerRunOptions& o);

}  // namespace dp::tools
