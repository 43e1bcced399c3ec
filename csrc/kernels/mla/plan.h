// How a latent-attention call runs on the cuda kernels: which kernel, its grid, block, shared
// memory and split count. Host code, torch- and CUDA-free (GoogleTest: tests/cpp/mla_test.cpp).
//
// Two kernels (csrc/README.md, "Latent attention"):
// - tensor_core (mla_tensor_core_kernel.cu; sm_90, where its shared memory fits): a block takes
//   kMlaTcRows rows that pack (new token, head) of one sequence, so each latent tile it reads
//   serves every head and every new token of the sequence, and one split of the positions; the
//   products run on the tensor cores (mma.sync m16n8k16). With several splits a merge kernel
//   combines the partial (out, lse).
// - simple (mla_attention_kernel.cu; the fallback: sm_80 to sm_89, and grids the tensor-core
//   form cannot launch): one block per (query row, group of kMlaHeadsPerBlock heads), float32
//   FMAs on the CUDA cores.
//
// The split count reads shapes only (never seq_lens' values): one launch configuration, and one
// captured CUDA graph, serves every length up to the block table's width; each split takes an
// equal share of its sequence's actual length on the device.
#pragma once

#include <cstdint>
#include <string>

#include "../paged_attention/plan.h"  // DeviceFacts, KernelTuning, MlaKernel
#include "config.h"

namespace astr::kernels {

// The simple kernel's tiles: one block per (query row, group of kMlaHeadsPerBlock heads); each of
// its 8 warps scores 2 heads against a tile of kMlaTileKeys positions (a lane per (head,
// position)) and accumulates their 512-wide outputs (a lane per 16 columns of each).
constexpr int kMlaHeadsPerBlock = 16;
constexpr int kMlaTileKeys = 16;
constexpr int kMlaThreads = 256;
// Shared-memory rows of Dc + Dr floats plus one: an odd stride puts the 16 positions that a warp
// scores at once in 16 different banks.
constexpr int kMlaRowFloats = kMlaLatentDim + kMlaRopeDim + 1;

// The tensor-core kernel's tiles: 8 warps = 4 groups of 16 rows x 2 halves of the 512 output
// columns; tiles of kMlaTcKeys positions (latent and rotary key side by side in one 16-bit row)
// double-buffered in shared memory. Rows padded by 8 elements (16 bytes) so that the 8 rows an
// ldmatrix reads fall in 8 different bank groups.
constexpr int kMlaTcRows = 64;
constexpr int kMlaTcKeys = 32;
constexpr int kMlaTcThreads = 256;
constexpr int kMlaTcRowElements = kMlaLatentDim + kMlaRopeDim + 8;
// The tile's probabilities P (16-bit, rows padded likewise), which the two warps of a row group
// share: each computes the scores of half the positions.
constexpr int kMlaTcProbElements = kMlaTcKeys + 8;
// A split takes at least this many positions of the block table's capacity, and a call at most
// kMlaTcMaxSplits splits (the merge reads them all for each row).
constexpr int kMlaTcMinSplitKeys = 256;
constexpr int kMlaTcMaxSplits = 64;       // also KernelTuning's bound on mla_splits
constexpr int kMlaTcMaxRowTiles = 65535;  // grid y

// What the plan reads of a call: shapes and host bounds, never tensor values.
struct MlaCallShape {
  int64_t num_seqs = 0;       // B
  int64_t max_query_len = 1;  // a prefill's bound on any sequence's new tokens; 1 for a decode
  int64_t num_heads = 0;      // H
  bool decode = true;
  bool fp8 = false;         // an e4m3 latent cache
  int64_t max_seq_len = 0;  // block-table width x page size: the most positions a sequence has
  int64_t num_tokens = 0;   // T, which sizes the splits' workspace (0: not known, not bounded)
};

struct MlaPlan {
  MlaKernel kernel = MlaKernel::kSimple;  // never kAuto
  int64_t grid_rows = 0;   // simple: grid x, B (decode) or B * max_query_len (row i of b)
  int64_t grid_heads = 0;  // simple: grid y, head groups of kMlaHeadsPerBlock
  int64_t row_tiles = 0;   // tensor_core: grid y, tiles of kMlaTcRows (new token, head) rows
  int num_splits = 1;      // tensor_core: grid z; more than one: the merge kernel runs after
  int threads = kMlaThreads;
  int smem_bytes = 0;
  bool poison_unplaced_rows = false;  // a prefill: the poisoning kernel's check (params.h)
  std::string error;                  // set when the call cannot be launched
};

// The tuning's mla_kernel and mla_splits (KernelTuning) override the rule, for tests and A/B runs.
MlaPlan plan_mla_attention(const MlaCallShape& shape, const DeviceFacts& device,
                           const KernelTuning& tuning = {});

// The plan in the kernel table's words: "tensor_core/split x4", "tensor_core", "simple".
std::string describe_plan(const MlaPlan& plan);

// The tensor-core kernel's shared memory: the query tile and two tiles of positions (16-bit), the
// tile's P and two float32s a row (the row groups' exchanged maxima and sums), and for an FP8
// latent two staging tiles of its raw bytes.
constexpr int mla_tensor_core_smem_bytes(bool fp8) {
  return (kMlaTcRows + 2 * kMlaTcKeys) * kMlaTcRowElements * 2 +
         kMlaTcRows * kMlaTcProbElements * 2 + 2 * kMlaTcRows * 4 +
         (fp8 ? 2 * kMlaTcKeys * kMlaLatentDim : 0);
}

}  // namespace astr::kernels
