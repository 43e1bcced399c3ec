// Host side of the paged attention kernels: head-dim/dtype dispatch, the split-KV heuristic and the
// checks that need no data. The instantiations live in paged_{decode,prefill}_hdim*.cu.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cmath>

#include "launch.h"
#include "paged_attention_instantiations.h"
#include "paged_attention_traits.h"
#include "paged_decode_splits.h"

namespace astrai::kernels {

bool is_supported_head_dim(int head_dim) {
  return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

std::string unsupported_head_dim_message(int head_dim) {
  return "unsupported head_dim " + std::to_string(head_dim) + " (supported: 64, 128, 256)";
}

namespace {

template <int D, bool kDecode>
LaunchStatus run_for_dtype(const PagedKernelArgs& args, int grid_rows, cudaStream_t stream) {
  switch (args.base.dtype) {
    case ScalarType::kBFloat16:
      return run_paged_attention<D, __nv_bfloat16, kDecode>(args, grid_rows, stream);
    case ScalarType::kFloat16:
      return run_paged_attention<D, __half, kDecode>(args, grid_rows, stream);
    default:
      return {"unsupported dtype for paged attention (supported: bfloat16, float16)"};
  }
}

template <bool kDecode>
LaunchStatus run_for_head_dim(const PagedKernelArgs& args, int grid_rows, cudaStream_t stream) {
  switch (args.base.head_dim) {
    case 64:
      return run_for_dtype<64, kDecode>(args, grid_rows, stream);
    case 128:
      return run_for_dtype<128, kDecode>(args, grid_rows, stream);
    case 256:
      return run_for_dtype<256, kDecode>(args, grid_rows, stream);
    default:
      return {unsupported_head_dim_message(args.base.head_dim)};
  }
}

int blocks_per_sm_for_decode(int head_dim) {
  switch (head_dim) {
    case 64:
      return PagedAttentionTraits<64, true>::kBlocksPerSm;
    case 128:
      return PagedAttentionTraits<128, true>::kBlocksPerSm;
    default:
      return PagedAttentionTraits<256, true>::kBlocksPerSm;
  }
}

LaunchStatus check_common(const PagedAttentionParams& p) {
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0)
    return {"num_q_heads must be a positive multiple of num_kv_heads"};
  if (p.log2_page_size < 0 || p.log2_page_size > 30) return {"page size must be a power of two"};
  // The kernels form cache addresses as page * page stride + slot * slot stride in 32-bit byte
  // multiplies (the head offset is 64-bit): a page, and the slots of one page, must span < 2 GiB.
  constexpr int64_t kMaxBytes = INT32_MAX;
  const int64_t page_size = int64_t{1} << p.log2_page_size;
  const int64_t element = 2;
  for (int64_t stride : {p.k_stride_page, p.v_stride_page})
    if (stride < 0 || stride * element > kMaxBytes)
      return {"k_cache/v_cache page stride must be under 2 GiB (got " + std::to_string(stride) +
              " elements)"};
  for (int64_t stride : {p.k_stride_slot, p.v_stride_slot})
    if (stride < 0 || stride * element * page_size > kMaxBytes)
      return {"k_cache/v_cache slots of one page must span under 2 GiB (slot stride " +
              std::to_string(stride) + " elements, page size " + std::to_string(page_size) + ")"};
  return {};
}

}  // namespace

// (sequence, kv head, row tile of 16 rows) triples: decode blocks per split, persistent items.
int64_t paged_decode_items(int num_seqs, int num_q_heads, int num_kv_heads) {
  if (num_seqs <= 0 || num_kv_heads <= 0) return 0;
  const int group = std::max(1, num_q_heads / num_kv_heads);
  return (int64_t)num_seqs * num_kv_heads * ((group + 15) / 16);
}

int paged_decode_num_splits(int num_seqs, int num_q_heads, int num_kv_heads, int max_kv_len,
                            int head_dim, int num_sms) {
  // The rule and its measurements: paged_decode_splits.h. E.g. B=1,Hkv=8,L=32768 -> 33 splits
  // (264 blocks, one wave on 132 SMs x 2); B=16,Hkv=8 -> 2; B=64 -> 1.
  constexpr int kTileN = PagedAttentionTraits<128, true>::kTileN;  // the same at every head dim
  if (num_seqs <= 0 || num_kv_heads <= 0) return 1;
  const int64_t blocks_per_split = paged_decode_items(num_seqs, num_q_heads, num_kv_heads);
  const int64_t slots =
      (int64_t)std::max(1, num_sms) * std::max(1, blocks_per_sm_for_decode(head_dim));
  const int64_t tiles = ((int64_t)std::max(0, max_kv_len) + kTileN - 1) / kTileN;
  return decode_splits_filling_one_wave(blocks_per_split, slots, tiles);
}

// An answer about the current device that every launch may ask for, kept per device: `compute`
// (device -> answer, 0 = could not tell) runs once per device; a 0 is not kept. `known` is a
// function-local static array (zero-initialised: not yet asked).
constexpr int kMaxCachedDevices = 64;
template <typename Compute>
int current_device_answer(std::atomic<int> (&known)[kMaxCachedDevices], Compute compute) {
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  const bool cached = device >= 0 && device < kMaxCachedDevices;
  if (cached) {
    const int answer = known[device].load(std::memory_order_relaxed);
    if (answer != 0) return answer;
  }
  const int answer = compute(device);
  if (cached && answer != 0) known[device].store(answer, std::memory_order_relaxed);
  return answer;
}

// Clusters, programmatic dependent launch and the wgmma prefill depend on the arch, and every
// split decode and prefill launch asks.
int current_device_arch() {
  static std::atomic<int> known[kMaxCachedDevices];
  return current_device_answer(known, [](int device) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess)
      return 0;
    return major * 10 + minor;
  });
}

// A device attribute of the current device (0 if it cannot be read), kept per device: the decode
// rules ask for shared-memory sizes on every call.
template <cudaDeviceAttr kAttribute>
static int current_device_attribute() {
  static std::atomic<int> known[kMaxCachedDevices];
  return current_device_answer(known, [](int device) {
    int value = 0;
    return cudaDeviceGetAttribute(&value, kAttribute, device) == cudaSuccess ? value : 0;
  });
}

// Where the wgmma prefill beats the mma.sync one (H200, causal bf16, bench_attention.py --quick,
// TFLOP/s wgmma vs mma.sync): at D = 128 on every row, 1.06-1.52x (B=2 S=4096 GQA 343 vs 300,
// ragged batch 349 vs 288, B=1 S=1024 207 vs 136); at D = 64 not, even with 128-wide tiles
// (B=4 S=4096: 235 vs 252 and 238 vs 260; 96-wide: 224 and 233): the softmax, the same per row,
// weighs twice as much against half the multiply.
constexpr bool wgmma_pays_for_head_dim(int head_dim) { return head_dim == 128; }

bool paged_prefill_wgmma_runs_here() {
#if defined(ASTR_WITH_SM90A)
  return current_device_arch() == 90;  // sm_90a code runs on sm_90 only
#else
  return false;
#endif
}

// Only pairs of splits merge in a cluster; larger clusters were measured slower (H200, bf16,
// Hq=32 Hkv=8 D=128 page 16, benchmarks/sweep_decode_splits.py, us in cluster vs with the merge
// kernel): 2 splits 39.0 vs 40.4 at B=16 L=2048, 67.6 vs 69.6 at L=4096, 249 vs 251 at B=64
// L=4096; 3, 4 or 8 splits were slower (B=16 L=2048: 47.6/51.9/63.0 vs 45.2/43.9/47.3; B=4 L=8192
// with 8 splits: 56.6 vs 40.9), as larger clusters leave slots idle waiting for a whole cluster to
// fit. So the kernel's epilogue is written for pairs (PagedAttentionTraits::kClusterSplits).
bool paged_decode_can_merge_in_cluster(int num_splits) {
  return num_splits == PagedAttentionTraits<128, true>::kClusterSplits &&
         current_device_is_sm90_or_newer();
}

// Whether an SM of the current device holds the D = 128 block pair as well as 2 single blocks:
// the pair fits one block's shared memory, and the SM holds half as many pairs as single blocks
// (else pairs would leave slots of the one-wave split rule empty).
static bool current_device_fits_decode_block_pairs() {
  using Pair = PagedAttentionTraits<128, true, 2>;
  const int optin = current_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
  const int per_sm = current_device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>();
  const int pairs_per_sm = per_sm / (Pair::kBlockSmemBytes + kSharedMemoryReservedPerBlock);
  return optin >= Pair::kBlockSmemBytes &&
         2 * pairs_per_sm >= PagedAttentionTraits<128, true>::kBlocksPerSm;
}

// Block pairs against clusters of 2 on the H200 (bf16, Hq=32, D=128, page 16, us per call, two
// runs of benchmarks/decode_pairs_ab.py, results/decode_block_pairs_NVIDIA-H200_2026-12-03.md):
// B=16 L=2048 37.7 / 36.9 vs 38.0 / 37.8, B=12 L=2048 31.2 / 30.9 vs 32.1 / 31.7, B=12 L=4096
// 55.0 / 54.3 vs 55.6 / 55.2; from L=4096 at B=16 within 0.8% either way. The cluster's launch
// and its barrier cost more than sharing one SM's issue slots.
bool paged_decode_can_merge_in_block_pairs(int num_splits, int head_dim) {
  return num_splits == PagedAttentionTraits<128, true, 2>::kGroups &&
         paged_decode_block_pairs_compiled(head_dim) && current_device_fits_decode_block_pairs();
}

bool paged_decode_can_run_eight_warp_blocks(int num_splits, int head_dim) {
  using EightWarps = PagedAttentionTraits<128, true, 1, 8>;
  return num_splits == 1 && paged_decode_eight_warp_blocks_compiled(head_dim) &&
         current_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>() >=
             EightWarps::kBlockSmemBytes;
}

bool paged_decode_can_run_persistent(int num_splits, int head_dim, int64_t num_items, int blocks) {
  using Layout = PersistentDecodeLayout<PagedAttentionTraits<128, true, 1, 8>>;
  return num_splits == 1 && paged_decode_persistent_compiled(head_dim) && blocks > 0 &&
         blocks <= num_items && num_items <= INT32_MAX / 2 &&
         current_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>() >= Layout::kSmemBytes;
}

bool paged_decode_block_pairs_fill_gpu(int num_seqs, int num_q_heads, int num_kv_heads,
                                       int num_sms) {
  return decode_block_pairs_fill_gpu(paged_decode_items(num_seqs, num_q_heads, num_kv_heads),
                                     num_sms);
}

size_t paged_decode_workspace_floats(int num_splits, bool merged_in_place, int num_tokens,
                                     int num_q_heads, int head_dim) {
  if (num_splits <= 1 || merged_in_place) return 0;
  return (size_t)num_splits * num_tokens * num_q_heads * (head_dim + 1);
}

LaunchStatus launch_paged_decode(const PagedDecodeParams& params, cudaStream_t stream) {
  if (!is_supported_head_dim(params.head_dim))
    return {unsupported_head_dim_message(params.head_dim)};
  LaunchStatus status = check_common(params);
  if (!status.ok()) return status;
  if (params.num_tokens != params.num_seqs) return {"decode needs one query token per sequence"};
  if (params.num_splits < 1 || params.num_splits > 65535) return {"num_splits out of range"};
  if (params.merge_in_cluster && !paged_decode_can_merge_in_cluster(params.num_splits))
    return {"decode: merge_in_cluster needs sm_90 and 2 splits (got " +
            std::to_string(params.num_splits) + ")"};
  if (params.merge_in_block_pairs &&
      !paged_decode_can_merge_in_block_pairs(params.num_splits, params.head_dim))
    return {
        "decode: merge_in_block_pairs needs 2 splits, head_dim 128 and a GPU whose SMs hold a "
        "pair (" +
        std::to_string(PagedAttentionTraits<128, true, 2>::kBlockSmemBytes / 1024) +
        " KB of shared memory; got " + std::to_string(params.num_splits) + " splits, head_dim " +
        std::to_string(params.head_dim) + ")"};
  if (params.merge_in_cluster && params.merge_in_block_pairs)
    return {"decode: merge_in_cluster and merge_in_block_pairs exclude each other"};
  if (params.eight_warp_blocks &&
      !paged_decode_can_run_eight_warp_blocks(params.num_splits, params.head_dim))
    return {"decode: eight_warp_blocks needs 1 split, head_dim 128 and " +
            std::to_string(PagedAttentionTraits<128, true, 1, 8>::kBlockSmemBytes / 1024) +
            " KB of shared memory per block (got " + std::to_string(params.num_splits) +
            " splits, head_dim " + std::to_string(params.head_dim) + ")"};
  if (params.persistent_blocks < 0 ||
      (params.persistent_blocks > 0 &&
       (params.eight_warp_blocks || params.merge_in_cluster || params.merge_in_block_pairs ||
        params.persistent_claim_counter == nullptr ||
        !paged_decode_can_run_persistent(
            params.num_splits, params.head_dim,
            paged_decode_items(params.num_seqs, params.num_q_heads, params.num_kv_heads),
            params.persistent_blocks))))
    return {
        "decode: persistent_blocks needs 1 split, head_dim 128, a grid of 1 to the item count, a "
        "claim counter, " +
        std::to_string(PersistentDecodeLayout<PagedAttentionTraits<128, true, 1, 8>>::kSmemBytes /
                       1024) +
        " KB of shared memory per block, and no other decode form (got " +
        std::to_string(params.num_splits) + " splits, head_dim " + std::to_string(params.head_dim) +
        ", " + std::to_string(params.persistent_blocks) + " blocks)"};
  if (params.num_splits > 1 && !params.merge_in_cluster && !params.merge_in_block_pairs &&
      params.workspace == nullptr)
    return {"decode with num_splits > 1 needs a workspace"};
  if (params.num_tokens == 0) return {};
  PagedKernelArgs args{};
  args.base = params;
  args.query_start_loc = nullptr;
  args.num_splits = params.num_splits;
  args.merge_in_cluster = params.merge_in_cluster;
  args.merge_in_block_pairs = params.merge_in_block_pairs;
  args.eight_warp_blocks = params.eight_warp_blocks;
  args.persistent_blocks = params.persistent_blocks;
  args.claim_counter = params.persistent_claim_counter;
  args.early_start = params.persistent_early_start;
  args.scale_log2 = params.scale * 1.4426950408889634f;
  if (params.persistent_blocks > 0) {
    if (params.dtype == ScalarType::kBFloat16)
      return run_paged_decode_persistent<__nv_bfloat16>(args, stream);
    if (params.dtype == ScalarType::kFloat16)
      return run_paged_decode_persistent<__half>(args, stream);
    return {"unsupported dtype for paged attention (supported: bfloat16, float16)"};
  }
  const size_t rows = (size_t)params.num_splits * params.num_tokens * params.num_q_heads;
  args.partial_out = params.workspace;
  args.partial_lse =
      params.workspace == nullptr ? nullptr : params.workspace + rows * params.head_dim;
  const int group = params.num_q_heads / params.num_kv_heads;
  return run_for_head_dim<true>(args, group, stream);
}

LaunchStatus launch_paged_prefill(const PagedPrefillParams& params, cudaStream_t stream) {
  if (!is_supported_head_dim(params.head_dim))
    return {unsupported_head_dim_message(params.head_dim)};
  LaunchStatus status = check_common(params);
  if (!status.ok()) return status;
  if (params.query_start_loc == nullptr) return {"prefill needs query_start_loc"};
  if (params.num_tokens == 0 || params.num_seqs == 0 || params.max_query_len <= 0) return {};
  PagedKernelArgs args{};
  args.base = params;
  args.query_start_loc = params.query_start_loc;
  args.num_splits = 1;
  args.merge_in_cluster = false;
  args.merge_in_block_pairs = false;
  args.eight_warp_blocks = false;
  args.persistent_blocks = 0;
  args.scale_log2 = params.scale * 1.4426950408889634f;
  const int group = params.num_q_heads / params.num_kv_heads;
  const int64_t rows = (int64_t)params.max_query_len * group;
  if (rows > INT32_MAX) return {"max_query_len * group size too large"};
  const int grid_rows = static_cast<int>(rows);
  const int D = params.head_dim;
  const bool bf16 = params.dtype == ScalarType::kBFloat16;
  const bool fp16 = params.dtype == ScalarType::kFloat16;
  const bool wgmma_fits = (D == 64 || D == 128) && (bf16 || fp16);
  const bool wgmma_chosen = params.kernel == PrefillKernel::kWgmma ||
                            (params.kernel == PrefillKernel::kAuto && wgmma_pays_for_head_dim(D));
  if (wgmma_fits && wgmma_chosen && paged_prefill_wgmma_runs_here()) {
    if (D == 64)
      return bf16 ? run_paged_prefill_wgmma<64, __nv_bfloat16>(args, grid_rows, stream)
                  : run_paged_prefill_wgmma<64, __half>(args, grid_rows, stream);
    return bf16 ? run_paged_prefill_wgmma<128, __nv_bfloat16>(args, grid_rows, stream)
                : run_paged_prefill_wgmma<128, __half>(args, grid_rows, stream);
  }
  return run_for_head_dim<false>(args, grid_rows, stream);
}

}  // namespace astrai::kernels
