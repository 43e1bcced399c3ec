// Latent attention over a paged latent cache, decode and prefill: the simple kernel, correctness
// first (float32 FMAs on the CUDA cores, no tensor cores), which the plan keeps for sm_80 to sm_89
// (plan.h); the launch entry point of both kernels. Definitions: params.h; tiles: plan.h.
//
// One block per (query row, group of 16 heads). The block copies its 16 query rows (576 values
// each: latent and rope parts) into shared memory as float32, then walks the positions its row
// sees in tiles of 16: the tile's latents and rotary keys are read from the pool (an FP8 latent
// converted and scaled in registers on the way) into shared memory as float32; each warp scores
// its 2 heads against the 16 positions (one lane per pair), updates their online softmax, and
// accumulates p * latent into its heads' 512-wide outputs (16 columns per lane).
//
// What the tensor-core kernel (mla_tensor_core_kernel.cu) does instead: all heads of a token (and
// its s_q tokens) in one block as the M side of tensor-core products, positions split across
// blocks with a merge, tiles copied asynchronously while the previous one is multiplied.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <climits>
#include <cstdint>

#include "../common/device_primitives.cuh"
#include "config.h"
#include "launch.h"
#include "sequence_rows.cuh"

namespace astr::kernels {

namespace {

constexpr int kLatent = kMlaLatentDim;     // Dc
constexpr int kRope = kMlaRopeDim;         // Dr
constexpr int kWidth = kLatent + kRope;    // q/k width
constexpr int kRow = kMlaRowFloats;        // shared-memory row stride, floats
constexpr int kHeads = kMlaHeadsPerBlock;  // heads per block
constexpr int kKeys = kMlaTileKeys;        // positions per tile
constexpr int kThreads = kMlaThreads;
constexpr int kHeadsPerWarp = 2;
constexpr int kColumnsPerLane = kLatent / 32;  // output columns lane, lane + 32, ...
static_assert(kHeads == kThreads / 32 * kHeadsPerWarp, "each warp takes two heads");
static_assert(kKeys * kHeadsPerWarp == 32, "a lane per (head, position) of a tile");
static_assert(kLatent % 32 == 0 && kLatent % 16 == 0 && kRope % 8 == 0, "16-byte pieces");
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// 16 bytes of 16-bit values (8 of them) as floats into shared memory.
template <typename T>
__device__ __forceinline__ void copy_chunk_as_floats(const T* src, float* dst) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const T* x = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) dst[i] = to_float(x[i]);
}

// 16 bytes of e4m3 latents (16 of them) as stored.float() * scale into shared memory: every e4m3
// value is exactly an f16, and the product is the reference's float32 product.
__device__ __forceinline__ void copy_fp8_chunk_as_floats(const uint8_t* src, float scale,
                                                         float* dst) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const __nv_fp8_storage_t* x = reinterpret_cast<const __nv_fp8_storage_t*>(&raw);
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    const __half value(__nv_cvt_fp8_to_halfraw(x[i], __NV_E4M3));
    dst[i] = __half2float(value) * scale;
  }
}

// The query row of a block and what it sees (sequence_rows.cuh: the rule both kernels apply).
struct QueryRow {
  bool exists;    // false: a prefill grid slot past its sequence's new tokens (nothing to write)
  bool poisoned;  // the sequence's metadata is invalid: NaN out, NaN lse
  int token;      // the row of q and out
  int seq_len;    // clamped to [0, block table width * S]
  int kv_end;     // the row sees positions [0, kv_end)
};

__device__ __forceinline__ QueryRow query_row(const MlaAttentionParams& p, int seq, int index) {
  const SequenceRows rows = sequence_rows(p, seq);
  QueryRow row{};
  row.exists = index < rows.num_rows;
  row.poisoned = rows.poisoned;
  row.token = rows.first_token + index;
  row.seq_len = rows.seq_len;
  row.kv_end = rows.kv_end(index);
  return row;
}

template <typename T>
__device__ __forceinline__ void write_nan_rows(const MlaAttentionParams& p, int token, int head0,
                                               int tid, int threads) {
  const float nan = __int_as_float(0x7fc00000);
  for (int e = tid; e < kHeads * kLatent; e += threads) {
    const int head = head0 + e / kLatent;
    if (head >= p.num_heads) continue;
    T* out = static_cast<T*>(p.out) + token * p.out_stride_token + head * p.out_stride_head;
    out[e % kLatent] = from_float<T>(nan);
  }
  if (p.lse != nullptr && tid < kHeads && head0 + tid < p.num_heads)
    p.lse[token * p.lse_stride_token + head0 + tid] = nan;
}

// Two blocks an SM: their shared memory (2 x 74 KB) fits every sm_80+ GPU, and ptxas may give a
// thread 128 registers (it takes 96; without the hint it kept 64, and the FP8 form spilled).
template <typename T, bool kFp8>
__global__ void __launch_bounds__(kThreads, 2)
    mla_attention_kernel(const __grid_constant__ MlaAttentionParams p) {
  extern __shared__ float smem[];
  float* q_rows = smem;                   // [kHeads][kRow]: latent part, then rope part
  float* kv_rows = smem + kHeads * kRow;  // [kKeys][kRow]: a tile's latents, then rotary keys
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int head0 = blockIdx.y * kHeads;
  const int seq = p.decode ? blockIdx.x : blockIdx.x / p.max_query_len;
  const int index = p.decode ? 0 : blockIdx.x % p.max_query_len;
  const QueryRow row = query_row(p, seq, index);
  if (!row.exists) return;  // uniform over the block
  const int32_t* table = p.block_table + seq * p.block_table_stride;

  // Every page the sequence's length uses is in the pool, or its rows are poisoned (none read).
  const int pages_used = (row.seq_len + p.page_size - 1) / p.page_size;
  bool bad_page = false;
  for (int i = tid; i < pages_used; i += kThreads) {
    const int page = table[i];
    bad_page |= page < 0 || page >= p.num_pages;
  }
  if (__syncthreads_or(row.poisoned || bad_page)) {
    write_nan_rows<T>(p, row.token, head0, tid, kThreads);
    return;
  }

  // The block's query rows as float32; heads past H are zeros (scored, never written).
  constexpr int kQueryChunks = kWidth / 8;  // 16-byte pieces of one head's row
  for (int c = tid; c < kHeads * kQueryChunks; c += kThreads) {
    const int h = c / kQueryChunks, chunk = c % kQueryChunks;
    const int head = head0 + h;
    float* dst = q_rows + h * kRow + chunk * 8;
    if (head >= p.num_heads) {
#pragma unroll
      for (int i = 0; i < 8; ++i) dst[i] = 0.f;
      continue;
    }
    const T* src = chunk < kLatent / 8
                       ? static_cast<const T*>(p.q_nope) + row.token * p.q_nope_stride_token +
                             head * p.q_nope_stride_head + chunk * 8
                       : static_cast<const T*>(p.q_rope) + row.token * p.q_rope_stride_token +
                             head * p.q_rope_stride_head + (chunk - kLatent / 8) * 8;
    copy_chunk_as_floats(src, dst);
  }

  const float scale_log2 = p.scale * kLog2e;
  const float ckv_scale = kFp8 ? *p.ckv_scale : 1.f;
  const int my_key = lane % kKeys;                          // the position this lane scores
  const int my_head = warp * kHeadsPerWarp + lane / kKeys;  // the head it scores, in the block
  float running_max = -INFINITY;  // of my_head's scores so far (log2 units), as each of its lanes
  float running_sum = 0.f;        // sum of exp2(score - running_max)
  float acc[kHeadsPerWarp][kColumnsPerLane] = {};  // the warp's heads, columns lane + 32 i

  constexpr int kLatentChunks = kFp8 ? kLatent / 16 : kLatent / 8;  // 16-byte pieces of a latent
  constexpr int kKeyChunks = kLatentChunks + kRope / 8;
  for (int tile = 0; tile < row.kv_end; tile += kKeys) {
    __syncthreads();  // the query rows are written; the previous tile is consumed
    for (int c = tid; c < kKeys * kKeyChunks; c += kThreads) {
      const int k = c / kKeyChunks, chunk = c % kKeyChunks;
      const int pos = tile + k;
      float* dst = kv_rows + k * kRow;
      const bool latent = chunk < kLatentChunks;
      const int width = latent && kFp8 ? 16 : 8;
      dst += latent ? chunk * width : kLatent + (chunk - kLatentChunks) * 8;
      if (pos >= row.kv_end) {  // past what the row sees: never read from the pool
        for (int i = 0; i < width; ++i) dst[i] = 0.f;
        continue;
      }
      const int64_t page = table[pos / p.page_size];
      const int64_t slot = pos % p.page_size;
      if (!latent) {
        const T* src = static_cast<const T*>(p.krope_cache) + page * p.krope_stride_page +
                       slot * p.krope_stride_slot + (chunk - kLatentChunks) * 8;
        copy_chunk_as_floats(src, dst);
      } else if constexpr (kFp8) {
        const uint8_t* src = static_cast<const uint8_t*>(p.ckv_cache) + page * p.ckv_stride_page +
                             slot * p.ckv_stride_slot + chunk * 16;
        copy_fp8_chunk_as_floats(src, ckv_scale, dst);
      } else {
        const T* src = static_cast<const T*>(p.ckv_cache) + page * p.ckv_stride_page +
                       slot * p.ckv_stride_slot + chunk * 8;
        copy_chunk_as_floats(src, dst);
      }
    }
    __syncthreads();

    // Scores: this lane's (head, position) over the 576 columns.
    const float* q = q_rows + my_head * kRow;
    const float* k = kv_rows + my_key * kRow;
    float score = 0.f;
#pragma unroll 8
    for (int d = 0; d < kWidth; ++d) score = fmaf(q[d], k[d], score);
    const bool visible = tile + my_key < row.kv_end;
    const float logit = visible ? score * scale_log2 : -INFINITY;

    // Online softmax over the 16 lanes of my_head (xor offsets below 16 stay in the half warp).
    float tile_max = logit;
#pragma unroll
    for (int offset = kKeys / 2; offset > 0; offset /= 2)
      tile_max = fmaxf(tile_max, __shfl_xor_sync(kFullMask, tile_max, offset));
    const float new_max = fmaxf(running_max, tile_max);
    const float weight = visible ? exp2f(logit - new_max) : 0.f;
    const float rescale = running_max == -INFINITY ? 0.f : exp2f(running_max - new_max);
    float tile_sum = weight;
#pragma unroll
    for (int offset = kKeys / 2; offset > 0; offset /= 2)
      tile_sum += __shfl_xor_sync(kFullMask, tile_sum, offset);
    running_sum = running_sum * rescale + tile_sum;
    running_max = new_max;

    // Outputs: each of the warp's two heads, columns lane + 32 i, += weight(position) * latent.
#pragma unroll
    for (int h = 0; h < kHeadsPerWarp; ++h) {
      const float head_rescale = __shfl_sync(kFullMask, rescale, h * kKeys);
#pragma unroll
      for (int i = 0; i < kColumnsPerLane; ++i) acc[h][i] *= head_rescale;
#pragma unroll 4
      for (int j = 0; j < kKeys; ++j) {
        const float w = __shfl_sync(kFullMask, weight, h * kKeys + j);
        const float* latent = kv_rows + j * kRow;
#pragma unroll
        for (int i = 0; i < kColumnsPerLane; ++i)
          acc[h][i] = fmaf(w, latent[lane + 32 * i], acc[h][i]);
      }
    }
  }

  // out = acc / sum (0 for a row that saw nothing); lse = ln(sum) + max, -inf for none.
#pragma unroll
  for (int h = 0; h < kHeadsPerWarp; ++h) {
    const float sum = __shfl_sync(kFullMask, running_sum, h * kKeys);
    const float row_max = __shfl_sync(kFullMask, running_max, h * kKeys);
    const int head = head0 + warp * kHeadsPerWarp + h;
    if (head >= p.num_heads) continue;
    // sum is 0 for a row that saw nothing, NaN where a score was NaN or inf: NaN out and lse.
    const bool saw_nothing = sum == 0.f;
    const float inverse = saw_nothing ? 0.f : 1.f / sum;
    T* out = static_cast<T*>(p.out) + row.token * p.out_stride_token + head * p.out_stride_head;
#pragma unroll
    for (int i = 0; i < kColumnsPerLane; ++i)
      out[lane + 32 * i] = from_float<T>(acc[h][i] * inverse);
    if (p.lse != nullptr && lane == 0)
      p.lse[row.token * p.lse_stride_token + head] =
          saw_nothing ? -INFINITY : (row_max + log2f(sum)) * kLn2;
  }
}

// What the prefill grid cannot see from one sequence's metadata: a query_start_loc that does not
// run from 0 to T without decreasing places no token for sure, so every row is written as NaN;
// otherwise the rows of a sequence past max_query_len, which no block of the grid reaches, are.
// One block, after the attention (stream order).
template <typename T>
__global__ void __launch_bounds__(128)
    mla_poison_unplaced_rows_kernel(const __grid_constant__ MlaAttentionParams p) {
  const int32_t* starts = p.query_start_loc;
  const float nan = __int_as_float(0x7fc00000);
  auto poison_rows = [&](int begin, int end) {
    const int64_t elements = static_cast<int64_t>(end - begin) * p.num_heads * kLatent;
    for (int64_t e = threadIdx.x; e < elements; e += blockDim.x) {
      const int token = begin + static_cast<int>(e / (p.num_heads * kLatent));
      const int head = static_cast<int>(e / kLatent % p.num_heads);
      T* out = static_cast<T*>(p.out) + token * p.out_stride_token + head * p.out_stride_head;
      out[e % kLatent] = from_float<T>(nan);
      if (p.lse != nullptr && e % kLatent == 0) p.lse[token * p.lse_stride_token + head] = nan;
    }
  };
  bool misplaced = false;
  for (int b = threadIdx.x; b <= p.num_seqs; b += blockDim.x) {
    const int32_t start = starts[b];
    misplaced |= (b == 0 && start != 0) || (b == p.num_seqs && start != p.num_tokens) ||
                 (b < p.num_seqs && starts[b + 1] < start);
  }
  if (__syncthreads_or(misplaced)) {
    poison_rows(0, p.num_tokens);
    return;
  }
  // Placed: 0 <= starts[b] <= starts[b + 1] <= T.
  for (int b = 0; b < p.num_seqs; ++b) {
    const int64_t begin = static_cast<int64_t>(starts[b]) + p.max_query_len;
    if (begin < starts[b + 1]) poison_rows(static_cast<int>(begin), starts[b + 1]);
  }
}

template <typename T>
LaunchStatus launch_simple(const MlaAttentionParams& p, const MlaPlan& plan, cudaStream_t stream) {
  auto kernel = p.ckv_dtype == ScalarType::kFloat8E4M3 ? mla_attention_kernel<T, true>
                                                       : mla_attention_kernel<T, false>;
  const cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.smem_bytes);
  if (error != cudaSuccess)
    return {std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(error)};
  const dim3 grid(static_cast<unsigned>(plan.grid_rows), static_cast<unsigned>(plan.grid_heads));
  kernel<<<grid, plan.threads, plan.smem_bytes, stream>>>(p);
  return status_after_launch("mla_attention_kernel");
}

template <typename T>
LaunchStatus launch_typed(const MlaAttentionParams& p, const MlaPlan& plan,
                          const MlaSplitWorkspace& workspace, cudaStream_t stream) {
  const LaunchStatus launched = plan.kernel == MlaKernel::kTensorCore
                                    ? launch_mla_tensor_core(p, plan, workspace, stream)
                                    : launch_simple<T>(p, plan, stream);
  if (!launched.ok() || !plan.poison_unplaced_rows) return launched;
  mla_poison_unplaced_rows_kernel<T><<<1, 128, 0, stream>>>(p);
  return status_after_launch("mla_poison_unplaced_rows_kernel");
}

}  // namespace

LaunchStatus launch_mla_attention(const MlaAttentionParams& params, const MlaPlan& plan,
                                  const MlaSplitWorkspace& workspace, cudaStream_t stream) {
  if (!plan.error.empty()) return {plan.error};
  if (params.num_tokens == 0 || params.num_seqs == 0) return {};
  if (plan.kernel == MlaKernel::kTensorCore && plan.num_splits > 1 &&
      (workspace.out == nullptr || workspace.lse == nullptr))
    return {"mla_attention: the tensor-core plan's splits need a workspace"};
  if (params.ckv_dtype != params.q_dtype && params.ckv_dtype != ScalarType::kFloat8E4M3)
    return {"mla_attention: the latent cache holds q's dtype or float8_e4m3fn"};
  if (params.ckv_dtype == ScalarType::kFloat8E4M3 && params.ckv_scale == nullptr)
    return {"mla_attention: an FP8 latent cache needs ckv_scale"};
  if (params.page_size < 1 || params.page_size > kMlaMaxPageSize)
    return {"mla_attention: page size must be 1 to 256"};
  switch (params.q_dtype) {
    case ScalarType::kBFloat16:
      return launch_typed<__nv_bfloat16>(params, plan, workspace, stream);
    case ScalarType::kFloat16:
      return launch_typed<__half>(params, plan, workspace, stream);
    default:
      return {"mla_attention: q must be bfloat16 or float16"};
  }
}

}  // namespace astr::kernels
