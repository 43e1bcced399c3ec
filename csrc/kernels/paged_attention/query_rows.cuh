// The query rows of one block (variant.cuh says how rows pack (token, q head) pairs): their copy
// into shared memory, and the grid every row-tiled launch uses.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <type_traits>

#include "../common/dependent_launch.cuh"
#include "../common/device_primitives.cuh"
#include "../common/launch_status.h"
#include "instantiations.h"
#include "params.h"
#include "variant.cuh"

namespace astr::kernels {

// The (sequence, kv head) pair and row tile of a prefill block (grid: prepare_row_tile_launch).
// Blocks start in the order of their linear index (x fastest); that order goes panel by panel of
// panel_pairs pairs (PrefillPlan::panel_pairs; 0, or all pairs or more: one panel), and inside a
// panel row tile by row tile, the heaviest (late, causal) first, over the panel's pairs: the
// blocks running at once read the K/V of the panel's pairs only, which the L2 cache keeps for
// their later row tiles. Every (pair, row tile) once: a panel's blocks are width x row tiles.
struct PrefillBlock {
  int seq_index, kv_head, row_tile;
};
__device__ __forceinline__ PrefillBlock prefill_block_coordinates(int num_kv_heads,
                                                                  int panel_pairs) {
  const int pairs = gridDim.x;
  const int row_tiles = gridDim.y;
  const int panel = panel_pairs > 0 && panel_pairs < pairs ? panel_pairs : pairs;
  const int64_t linear = blockIdx.x + static_cast<int64_t>(blockIdx.y) * pairs;
  const int first_pair =
      static_cast<int>(linear / (static_cast<int64_t>(panel) * row_tiles)) * panel;
  const int width = min(panel, pairs - first_pair);
  const int within = static_cast<int>(linear - static_cast<int64_t>(first_pair) * row_tiles);
  const int pair = first_pair + within % width;
  return {pair / num_kv_heads, pair % num_kv_heads, row_tiles - 1 - within / width};
}

// Starts the cp.async copies of the block's kRows query rows into shared memory; element
// offset(r, chunk) places 16-byte chunk `chunk` of row r. Rows past num_rows are zero-filled.
template <typename T, int kRows, int kChunks, int kThreads, typename Offset>
__device__ __forceinline__ void load_query_rows(const PagedAttentionParams& p, T* q_smem, int tid,
                                                int q_start, int row0, int num_rows, int group,
                                                int kv_head, Offset offset) {
  const T* q_base = static_cast<const T*>(p.q);
  constexpr int kCopies = kRows * kChunks;
#pragma unroll
  for (int i = 0; i < (kCopies + kThreads - 1) / kThreads; ++i) {
    const int c = tid + i * kThreads;
    if (kCopies % kThreads != 0 && c >= kCopies) break;
    const int r = c / kChunks, ch = c % kChunks;
    const int row = row0 + r;
    const bool valid = row < num_rows;
    const T* src = q_base;
    if (valid) {
      const int token = q_start + row / group;
      const int head = kv_head * group + row % group;
      src = q_base + token * p.q_stride_token + head * p.q_stride_head + ch * 8;
    }
    cp_async_16(shared_address(q_smem + offset(r, ch)), src, valid);
  }
}

// A bf16 query tile of kRows rows (16-byte chunk `chunk` of row r at offset(r, chunk)) becomes
// f16 in place, for the f16 products over an FP8 cache (tile_math.cuh, prefill_wgmma_kernel.cuh):
// each value times 2^-e, e chosen so that the tile's largest magnitude lands in [2^14, 2^15) (f16's
// largest is 65504). f16 has bf16's 8 significant bits and 3 more, so every value within 2^28 of
// the largest stays exact; smaller ones, whose products weigh under 2^-28 of the largest's, become
// subnormals or 0. Returns 2^e, for the caller to fold into the score scale. sync() is the group's
// barrier, called twice. The maximum: with warp_largest (kThreads / 32 floats of shared memory)
// each thread reads its share of the tile and the warps exchange theirs there; without, every warp
// of the group reads the whole tile (no exchange: the decode's few rows).
template <int kRows, int kChunks, int kThreads, typename Offset, typename Sync>
__device__ __forceinline__ float query_tile_to_f16(void* q_smem, int tid, Offset offset,
                                                   Sync&& sync, float* warp_largest = nullptr) {
  auto chunk_at = [&](int c) -> uint4& {
    return *reinterpret_cast<uint4*>(static_cast<uint16_t*>(q_smem) +
                                     offset(c / kChunks, c % kChunks));
  };
  const bool exchange = warp_largest != nullptr;
  float largest = 0.f;
  for (int c = exchange ? tid : tid % 32; c < kRows * kChunks; c += exchange ? kThreads : 32) {
    const uint4 v = chunk_at(c);
    const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      largest = fmaxf(largest, fabsf(__uint_as_float(words[i] << 16)));
      largest = fmaxf(largest, fabsf(__uint_as_float(words[i] & 0xffff0000u)));
    }
  }
#pragma unroll
  for (int lane_mask = 16; lane_mask > 0; lane_mask /= 2)
    largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, lane_mask));
  if (exchange && tid % 32 == 0) warp_largest[tid / 32] = largest;
  sync();  // every warp has read the bf16 values (and posted its maximum)
  if (exchange) {
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) largest = fmaxf(largest, warp_largest[w]);
  }
  const int exponent = static_cast<int>((__float_as_uint(largest) >> 23) & 0xff) - 127;
  // A zero tile (exponent -127) keeps 2^100; NaN and inf (128) stay NaN and inf.
  const int e = min(max(exponent - 14, -100), 100);
  const float down = exp2f(static_cast<float>(-e));
  for (int c = tid; c < kRows * kChunks; c += kThreads) {
    uint4& chunk = chunk_at(c);
    uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const __half2 h = __floats2half2_rn(__uint_as_float(words[i] << 16) * down,
                                          __uint_as_float(words[i] & 0xffff0000u) * down);
      words[i] = *reinterpret_cast<const uint32_t*>(&h);
    }
    chunk = make_uint4(words[0], words[1], words[2], words[3]);
  }
  sync();  // the f16 tile is visible to every warp
  return exp2f(static_cast<float>(e));
}

// Host: lets `kernel` use `smem_bytes` of dynamic shared memory and sets the grid every paged
// attention launch uses: x = (sequence, kv head) pairs of `p` times v_chunks (the blocks of a
// pair's chunks of v's columns side by side: traits.h, kVChunks), y = the row tiles of
// `block_rows` rows that cover grid_rows rows (at most 65535), z = grid_z.
template <typename Kernel>
LaunchStatus prepare_row_tile_launch(Kernel kernel, int smem_bytes, const PagedAttentionParams& p,
                                     int grid_rows, int block_rows, int grid_z, dim3* grid,
                                     int v_chunks = 1) {
  const cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
  if (error != cudaSuccess)
    return {std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(error)};
  const int64_t row_tiles = (grid_rows + block_rows - 1) / block_rows;
  if (row_tiles > 65535) return {"paged attention: too many query rows for one launch"};
  const int64_t seq_heads = (int64_t)p.num_seqs * p.num_kv_heads * v_chunks;
  if (seq_heads > INT32_MAX) return {"paged attention: too many (sequence, kv head) pairs"};
  *grid = dim3(static_cast<unsigned>(seq_heads), static_cast<unsigned>(row_tiles),
               static_cast<unsigned>(grid_z));
  return {};
}

// What the prefill kernels cannot see from one sequence's metadata (no host check runs in
// unchecked mode, nor under torch.compile): a query_start_loc that does not run from 0 to T
// without decreasing places no token for sure (tokens belong to no sequence, or to two), and the
// tokens of a sequence past max_query_len lie outside the grid (it covers max_query_len rows of
// each), so no block writes them. One block after every prefill: for such a query_start_loc it
// waits for the prefill and writes every row of out (and lse) as NaN; otherwise it writes the rows
// past max_query_len as NaN (prefill_sequence poisons the rest of those sequences), and nothing
// for valid metadata (B + 1 loads). A kernel of its own, not a step of the prefills: code there
// took registers from their main loops (ptxas: spills in the warp-specialised and mma.sync ones).
template <int kThreads>
__global__ void __launch_bounds__(kThreads) poison_unplaced_rows_kernel(PagedKernelArgs args) {
  const PagedAttentionParams& p = args.base;
  const int32_t* starts = args.query_start_loc;
  constexpr uint16_t kNan16 = 0x7fff;  // a NaN in both float16 and bfloat16
  auto poison_rows = [&](int begin, int end, int first, int step) {
    const int dv = p.head_dim_v;  // the output's rows
    const int64_t elements = static_cast<int64_t>(end - begin) * p.num_q_heads * dv;
    for (int64_t i = first; i < elements; i += step) {
      const int token = begin + static_cast<int>(i / (p.num_q_heads * dv));
      const int head = static_cast<int>(i / dv % p.num_q_heads);
      const int64_t at = token * p.out_stride_token + head * p.out_stride_head + i % dv;
      static_cast<uint16_t*>(p.out)[at] = kNan16;
      if (p.lse != nullptr && i % dv == 0)
        p.lse[token * p.lse_stride_token + head] = __int_as_float(0x7fc00000);
    }
  };
  bool misplaced = false;
  for (int b = threadIdx.x; b <= p.num_seqs; b += kThreads) {
    const int32_t start = starts[b];
    misplaced |= (b == 0 && start != 0) || (b == p.num_seqs && start != p.num_tokens) ||
                 (b < p.num_seqs && starts[b + 1] < start);
  }
  if (__syncthreads_or(misplaced)) {
    wait_for_prerequisite_grid();  // the prefill's rows are written: overwrite them
    poison_rows(0, p.num_tokens, threadIdx.x, kThreads);
    return;
  }
  // Placed: 0 <= starts[b] <= starts[b + 1] <= T. Rows the grid never reaches: written while the
  // prefill runs (it allows this launch from its start); then ending only after the prefill, so
  // that what follows in the stream still follows the prefill.
  for (int b = 0; b < p.num_seqs; ++b) {
    const int64_t begin = static_cast<int64_t>(starts[b]) + args.max_query_len;
    if (begin < starts[b + 1])
      poison_rows(static_cast<int>(begin), starts[b + 1], threadIdx.x, kThreads);
  }
  wait_for_prerequisite_grid();
}

// Host: launches poison_unplaced_rows_kernel after a prefill (or a verify): on sm_90 as the
// prefill's programmatic dependent (it starts as the prefill's blocks end: no launch gap), unless
// `dependent` is false (the kernel before it writes rows past max_query_len too: the verify's merge
// kernel).
inline LaunchStatus launch_unplaced_rows_poison(const PagedKernelArgs& args, cudaStream_t stream,
                                                bool dependent = true) {
  constexpr int kThreads = 128;
  const cudaError_t error =
      launch_maybe_dependent(poison_unplaced_rows_kernel<kThreads>, dim3(1), dim3(kThreads), 0,
                             stream, dependent && current_device_is_sm90_or_newer(), args);
  if (error != cudaSuccess)
    return {std::string("poison_unplaced_rows_kernel: ") + cudaGetErrorString(error)};
  return {};
}

// Host: every prefill's launcher. kernel_for(softcap, e5m2) names an instantiation (both
// std::integral_constant); it launches the one the call needs, by its softcap kind (variant.cuh,
// softcap_kernel) and, over an FP8 cache (kFp8), its format, over row tiles of block_rows packed
// rows (max_query_len x group rows per sequence). P is f16 over an FP8 cache (its fragments are
// f16), so that cache has no fixed-max instantiation: the running max takes its place. `extra`:
// the kernel's parameters after args (the warp-specialised prefill's tensor maps).
// v_chunks: the blocks of a (sequence, kv head) pair's chunks of v's columns (traits.h).
template <typename T, bool kFp8, int kVChunks = 1, typename KernelFor, typename... Extra>
LaunchStatus launch_prefill(const PagedKernelArgs& args, KernelFor&& kernel_for, int smem_bytes,
                            int threads, int block_rows, cudaStream_t stream, const char* name,
                            const Extra&... extra) {
  const Softcap softcap =
      softcap_kernel(args.base.softcap, !kFp8 && std::is_same_v<T, __nv_bfloat16>,
                     /*fixed_max_allowed=*/true);
  auto pick = [&](auto e5m2) {
    if constexpr (!kFp8) {
      if (softcap == Softcap::kFixedMax)
        return kernel_for(std::integral_constant<Softcap, Softcap::kFixedMax>{}, e5m2);
    }
    if (softcap == Softcap::kRunningMax)
      return kernel_for(std::integral_constant<Softcap, Softcap::kRunningMax>{}, e5m2);
    return kernel_for(std::integral_constant<Softcap, Softcap::kOff>{}, e5m2);
  };
  auto kernel = pick(std::false_type{});
  if constexpr (kFp8) {
    if (args.base.kv_dtype == ScalarType::kFloat8E5M2) kernel = pick(std::true_type{});
  }
  const int group = args.base.num_q_heads / args.base.num_kv_heads;
  const int64_t rows = (int64_t)args.max_query_len * group;
  if (rows > INT32_MAX) return {"max_query_len * group size too large"};
  dim3 grid;
  const LaunchStatus prepared = prepare_row_tile_launch(
      kernel, smem_bytes, args.base, static_cast<int>(rows), block_rows, 1, &grid, kVChunks);
  if (!prepared.ok()) return prepared;
  kernel<<<grid, threads, smem_bytes, stream>>>(args, extra...);
  const LaunchStatus launched = status_after_launch(name);
  if (!launched.ok()) return launched;
  return launch_unplaced_rows_poison(args, stream);
}

}  // namespace astr::kernels
