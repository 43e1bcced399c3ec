// How a latent-attention call runs on the cuda kernel (mla_attention_kernel.cu): its grid, block
// and shared memory. Host code, torch- and CUDA-free (GoogleTest: tests/cpp/mla_test.cpp).
#pragma once

#include <cstdint>
#include <string>

#include "config.h"

namespace astr::kernels {

// The kernel's tiles: one block per (query row, group of kMlaHeadsPerBlock heads); each of its 8
// warps scores 2 heads against a tile of kMlaTileKeys positions (a lane per (head, position)) and
// accumulates their 512-wide outputs (a lane per 16 columns of each).
constexpr int kMlaHeadsPerBlock = 16;
constexpr int kMlaTileKeys = 16;
constexpr int kMlaThreads = 256;
// Shared-memory rows of Dc + Dr floats plus one: an odd stride puts the 16 positions that a warp
// scores at once in 16 different banks.
constexpr int kMlaRowFloats = kMlaLatentDim + kMlaRopeDim + 1;

struct MlaPlan {
  int64_t grid_rows = 0;   // grid x: B (decode) or B * max_query_len (prefill: row i of b)
  int64_t grid_heads = 0;  // grid y: head groups of kMlaHeadsPerBlock
  int threads = kMlaThreads;
  int smem_bytes = 0;                 // the query rows and one tile of positions, as float32
  bool poison_unplaced_rows = false;  // a prefill: the second kernel's check (params.h)
  std::string error;                  // set when the call cannot be launched
};

MlaPlan plan_mla_attention(int64_t num_seqs, int64_t max_query_len, int64_t num_heads, bool decode);

}  // namespace astr::kernels
