// `decodepack generate`: the whole model on the GPU through libdecodepack, greedy decoding of a batch of
// prompts as a continuous-batching serving host runs it.
//
// What one generate does:
//   1. opens the bundle and the model it was built from (the same phases as `run`: tooling/harness.h), reads
//      the prompts file and checks it against the bundle (token ids inside the vocabulary, at most as many
//      requests as the widest width), and checks that every layer class has its program and the bundle
//      its LM head at every width the batch will use: all before any GPU work;
//   2. creates the session, binds every decode weight (`run`'s binding: the checkpoint's tensors, or the
//      synth fill without safetensors) and loads the kernels; uploads the LM head weight (the checkpoint's
//      lm_head.weight, or embed_tokens.weight when tied) and binds it (dp_session_bind_lm_head); keeps
//      the embedding on the host;
//   3. binds zeroed caches sized for the batch (Batcher: one KDA state slot per request, MLA blocks for
//      every token a request feeds) and, for a model with block attention residuals (Kimi-K3), the
//      attention-residual buffer (bind_attn_res: rows for the largest width; the layer programs fill it
//      within each step, since every layer runs on them);
//   4. per step (Batcher::next): gathers the input tokens' embedding rows on the host and uploads them and
//      the metadata, zeroes the state slots of requests that start, dp_plan at the step's width, every
//      layer through dp_launch_layer (ping-pong hidden/residual buffers, prefetch forks and one join),
//      dp_launch_final_norm, dp_launch_lm_head (fp32 logits), then the host takes the argmax of each real
//      row's logits; with --graph, the first step at a width runs eagerly and is then captured (planned at
//      capture, DP_GRAPH_FULL), and later steps at that width replay it with fresh buffer contents.
// Prompts are fed one token per step (prefill by decode steps); a request's step after its last prompt
// token yields its first generated token. Requests leave when done; the next step runs at the smallest
// width the bundle holds for the requests left (or --width, with padded rows).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dp::tools {

struct GenerateOptions {
  std::string bundle;
  std::string model;        // checkpoint dir (config.json + safetensors), config or preset (random weights)
  std::string prompts;      // one request per line: token ids separated by whitespace
  int max_tokens = 16;      // tokens generated per request
  int width = 0;            // > 0: every step at this width (padded rows); 0: the smallest built width
  bool graph = false;       // CUDA graphs per width (FULL), replayed
  bool prefetch = true;
  bool pdl = true;
  int device = 0;
  uint64_t seed = 0;        // the synth fill when --model has no safetensors
  std::string logits;       // "": none; else a file for every fed position's fp32 logits (see GenerateResult)
  std::function<void(const std::string&)> log;
};

struct GenerateRequest {
  std::vector<int32_t> prompt;
  std::vector<int32_t> tokens;       // generated
  std::vector<int32_t> argmax;       // per fed position (prompt positions: teacher-forced predictions)
  std::vector<float> gap;            // per fed position: logit(top 1) - logit(top 2)
  int64_t logits_row = -1;           // first row of this request in the logits file (-1: none written)
  int first_step = 0, last_step = 0; // 1-based steps it ran in
};

struct GenerateStep {
  int index = 0;        // 1-based
  int width = 0;
  int requests = 0;     // real rows
  std::string mode;     // "eager" | "capture" (eager, then captured) | "graph" (replayed)
  double ms = 0;        // device time of the step's launches (cuEvent pair)
  std::vector<int> left;  // requests that finished in this step
};

struct GenerateResult {
  std::string bundle, digest, device, target, model, weights;
  int64_t vocab = 0, hidden = 0;
  int num_layers = 0, max_tokens = 0;
  bool graph = false;
  std::vector<GenerateRequest> requests;
  std::vector<GenerateStep> steps;
  double wall_s = 0;    // host wall time of the step loop (uploads, launches, argmax)
  std::string logits;   // the logits file: float32 little-endian [rows, vocab], rows request by request,
                        // fed position by position
};

// Throws dp::Error: usage (bad options, a --width the bundle lacks), input (bad prompts file, model/bundle
// mismatch, a bundle without the programs or LM head the batch needs), io, device.
GenerateResult generate(const GenerateOptions& o);

}  // namespace dp::tools
