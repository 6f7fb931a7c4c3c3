// layer_probe: the FFN half of the 48B-shaped FP8 KDA + MoE layer at width 1 (rmsnorm, router + routing,
// moe_up, moe_down: the product's device functions with the template arguments its plan gives them), run
// two ways over the same inputs: as four kernels chained by programmatic dependent launch (the product
// today), and as one resident grid that calls the four device functions in turn with a grid barrier
// between them. The outputs must agree bit for bit; the times say what the three boundaries cost.
#pragma once
#include <cstdint>

constexpr int kH = 2304, kE = 256, kTopK = 8, kI = 1024, kS = 1024;

// Device pointers of one layer's FFN half.
struct FfnArgs {
  const void* hidden;       // [1, H] bf16 (the attention output)
  void* residual;           // [1, H] bf16, in place
  const void* norm_w;       // [H] bf16
  void* x2;                 // [1, H] bf16
  void* logits;             // [1, E] fp32
  const void* router_w;     // [E, H] bf16
  const float* bias;        // [E] fp32
  int* topk_ids;            // [1, K]
  float* topk_w;            // [1, K]
  int* experts;             // [1 + K]
  int* slots;               // [K, 1]
  unsigned* done;           // [1] (zero)
  const uint8_t* w1;        // [E, I, H] e4m3
  const float* w1s;         // [E, 8 * 18]
  const uint8_t* w3;
  const float* w3s;
  const uint8_t* sg;        // [S, H] e4m3
  const float* sgs;         // [8, 18]
  const uint8_t* su;
  const float* sus;
  void* h;                  // [1, K, I] bf16
  void* hs;                 // [1, S] bf16
  const uint8_t* w2;        // [E, H, I] e4m3
  const float* w2s;         // [E, 18 * 8]
  const uint8_t* sd;        // [H, S] e4m3
  const float* sds;         // [18, 8]
  void* out;                // [1, H] bf16
};

// mega.cu: one launch of the fused FFN half (programmatic dependent launch on), `bar` two zeroed words;
// prefetch: the blocks idle during the norm and the router pull the router's and the shared expert's
// weights into L2.
void launch_mega(const FfnArgs& a, unsigned* bar, int blocks, void* stream, bool prefetch);
int mega_blocks_per_sm();
// The same built with every template load through ld.global.cg (mega.cu, PROBE_CG).
void launch_mega_cg(const FfnArgs& a, unsigned* bar, int blocks, void* stream, bool prefetch);
int mega_blocks_per_sm_cg();
