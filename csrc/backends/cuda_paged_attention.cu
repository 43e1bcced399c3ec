// Binding of the cuda backend's paged attention kernels (csrc/kernels/) to the op
// astr::cuda_paged_attention. Checks every argument, fills the parameter struct, launches on the
// current stream. No host synchronisation and no allocation that depends on tensor values: the
// decode path can be captured in a CUDA graph and replayed with new seq_lens.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <optional>
#include <string>

#include "../check.h"
#include "../kernels/launch.h"
#include "../kernels/paged_decode_splits.h"

namespace astrai::backends {
namespace {

// Tuning hooks for benchmarks/sweep_decode_splits.py, the A/B runs and the kernel tests: with
// ASTR_TUNE_KERNELS set before the first call, ASTR_DECODE_SPLITS forces the decode split count,
// ASTR_DECODE_CLUSTER_MERGE=0 turns the in-cluster and in-block merges off (the merge kernel),
// ASTR_DECODE_BLOCK_PAIRS=0 the block pairs only (clusters where they run) and =1 runs block pairs
// wherever they can, also on grids they do not fill, ASTR_DECODE_EIGHT_WARPS=0 keeps the block
// pairs where eight-warp blocks would replace them and =1 runs eight-warp blocks where the split
// rule's block pairs would run (at any length) or where 1 split is forced (other forced counts are
// kept), ASTR_DECODE_PERSISTENT=0 keeps one split on single blocks where the persistent decode
// would run and =1 runs it wherever one split runs (also in place of eight-warp blocks),
// ASTR_DECODE_PERSISTENT_BLOCKS=n gives it a grid of n blocks (at most the item count) instead of
// one per SM (tests: several items per block on small batches), ASTR_DECODE_EARLY_START=0 launches
// the persistent decode after its counter's reset instead of as its dependent launch,
// ASTR_PREFILL_WGMMA=0 keeps prefill on the mma.sync kernel and =1 puts it on wgmma wherever that
// runs, whatever the head dim pays (all read on every call). Otherwise one branch on a static.
bool kernel_tuning() {
  static const bool tuning = std::getenv("ASTR_TUNE_KERNELS") != nullptr;
  return tuning;
}
bool tuning_switch_is_off(const char* name) {
  if (!kernel_tuning()) return false;
  const char* value = std::getenv(name);
  return value != nullptr && std::string(value) == "0";
}
bool tuning_switch_is_on(const char* name) {
  if (!kernel_tuning()) return false;
  const char* value = std::getenv(name);
  return value != nullptr && std::string(value) == "1";
}
kernels::PrefillKernel prefill_kernel_override() {
  if (!kernel_tuning()) return kernels::PrefillKernel::kAuto;
  const char* value = std::getenv("ASTR_PREFILL_WGMMA");
  if (value == nullptr) return kernels::PrefillKernel::kAuto;
  return std::string(value) == "0" ? kernels::PrefillKernel::kMmaSync
                                   : kernels::PrefillKernel::kWgmma;
}
int decode_persistent_grid_override() {
  if (!kernel_tuning()) return 0;
  const char* value = std::getenv("ASTR_DECODE_PERSISTENT_BLOCKS");
  return value == nullptr ? 0 : std::max(0, std::atoi(value));
}
int decode_split_count_override() {
  if (!kernel_tuning()) return 0;
  const char* value = std::getenv("ASTR_DECODE_SPLITS");
  return value == nullptr ? 0 : std::max(0, std::min(std::atoi(value), 65535));
}

using kernels::ScalarType;

ScalarType to_kernel_dtype(at::ScalarType dtype) {
  return dtype == at::kBFloat16 ? ScalarType::kBFloat16 : ScalarType::kFloat16;
}

void check_cuda_tensor(const at::Tensor& t, const char* name, const at::Device& device) {
  ASTR_CHECK(t.is_cuda(), "cuda_paged_attention: ", name, " must be a CUDA tensor, got device ",
             t.device());
  ASTR_CHECK(t.device() == device, "cuda_paged_attention: ", name, " must be on ", device,
             " (the device of q), got ", t.device());
}

void check_int32_vector(const at::Tensor& t, const char* name, int64_t expected_len,
                        const at::Device& device) {
  check_cuda_tensor(t, name, device);
  ASTR_CHECK(t.scalar_type() == at::kInt, "cuda_paged_attention: ", name, " must be int32, got ",
             t.scalar_type());
  ASTR_CHECK(t.dim() == 1 && t.size(0) == expected_len, "cuda_paged_attention: ", name,
             " must have shape [", expected_len, "], got ", t.sizes());
  ASTR_CHECK(t.stride(0) == 1 || t.size(0) <= 1, "cuda_paged_attention: ", name,
             " must be contiguous");
}

// cp.async moves 16 bytes: base pointer and every stride of a 16-bit tensor must be multiples of 8
// elements.
void check_16_byte_rows(const at::Tensor& t, const char* name) {
  ASTR_CHECK(t.stride(-1) == 1, "cuda_paged_attention: ", name,
             " must have a contiguous last dim (stride 1), got strides ", t.strides());
  ASTR_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, "cuda_paged_attention: ", name,
             " must be 16-byte aligned");
  for (int64_t d = 0; d + 1 < t.dim(); ++d)
    ASTR_CHECK(t.stride(d) % 8 == 0 || t.size(d) == 1, "cuda_paged_attention: ", name,
               " strides must be multiples of 8 elements (16 bytes), got ", t.strides());
}

int log2_of_power_of_two(int64_t value) {
  int log2 = 0;
  while ((int64_t{1} << log2) < value) ++log2;
  return log2;
}

at::Tensor cuda_paged_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                const at::Tensor& v_cache, const at::Tensor& block_table,
                                const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                int64_t max_query_len, bool decode,
                                const std::optional<at::Tensor>& attn_mask, bool is_causal,
                                double scale) {
  ASTR_CHECK(q.is_cuda(), "cuda_paged_attention: q must be a CUDA tensor, got device ", q.device());
  const at::Device device = q.device();
  ASTR_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
             "cuda_paged_attention: q must be bfloat16 or float16, got ", q.scalar_type());
  ASTR_CHECK(q.dim() == 3, "cuda_paged_attention: q must have shape [T, Hq, D] (rank 3), got ",
             q.sizes());
  const int64_t num_tokens = q.size(0), num_q_heads = q.size(1), head_dim = q.size(2);
  ASTR_CHECK(kernels::is_supported_head_dim(static_cast<int>(head_dim)),
             "cuda_paged_attention: q: ", kernels::unsupported_head_dim_message(head_dim));
  check_16_byte_rows(q, "q");

  for (const auto& [cache, name] : {std::pair{&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
    check_cuda_tensor(*cache, name, device);
    ASTR_CHECK(cache->scalar_type() == q.scalar_type(), "cuda_paged_attention: ", name,
               " must have the dtype of q (", q.scalar_type(), "), got ", cache->scalar_type());
    ASTR_CHECK(cache->dim() == 4, "cuda_paged_attention: ", name,
               " must have shape [P, S, Hkv, D] (rank 4), got ", cache->sizes());
    ASTR_CHECK(cache->size(3) == head_dim, "cuda_paged_attention: ", name, " head dim ",
               cache->size(3), " must equal q's head dim ", head_dim);
    check_16_byte_rows(*cache, name);
  }
  ASTR_CHECK(v_cache.sizes() == k_cache.sizes(), "cuda_paged_attention: v_cache shape ",
             v_cache.sizes(), " must equal k_cache shape ", k_cache.sizes());
  const int64_t page_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  ASTR_CHECK(page_size >= 1 && (page_size & (page_size - 1)) == 0,
             "cuda_paged_attention: k_cache page size (dim 1) must be a power of two, got ",
             page_size);
  ASTR_CHECK(num_kv_heads >= 1 && num_q_heads % num_kv_heads == 0,
             "cuda_paged_attention: q heads (", num_q_heads,
             ") must be a multiple of k_cache kv heads (", num_kv_heads, ")");

  check_cuda_tensor(block_table, "block_table", device);
  ASTR_CHECK(block_table.scalar_type() == at::kInt,
             "cuda_paged_attention: block_table must be int32, got ", block_table.scalar_type());
  ASTR_CHECK(block_table.dim() == 2,
             "cuda_paged_attention: block_table must have shape [B, W], got ", block_table.sizes());
  ASTR_CHECK(block_table.stride(1) == 1 || block_table.size(1) <= 1,
             "cuda_paged_attention: block_table must have a contiguous last dim");
  const int64_t num_seqs = block_table.size(0);
  check_int32_vector(seq_lens, "seq_lens", num_seqs, device);
  if (decode) {
    ASTR_CHECK(num_tokens == num_seqs,
               "cuda_paged_attention: decode needs one token per sequence: q has ", num_tokens,
               " tokens, block_table has ", num_seqs, " sequences");
  } else {
    check_int32_vector(query_start_loc, "query_start_loc", num_seqs + 1, device);
    ASTR_CHECK(max_query_len >= 0, "cuda_paged_attention: max_query_len must be >= 0, got ",
               max_query_len);
    ASTR_CHECK(num_tokens == 0 || max_query_len > 0,
               "cuda_paged_attention: max_query_len must be >= 1 when q has tokens");
  }
  const bool* mask_ptr = nullptr;
  int64_t mask_stride = 0, mask_kv_len = 0;
  if (attn_mask.has_value()) {
    const at::Tensor& mask = *attn_mask;
    check_cuda_tensor(mask, "attn_mask", device);
    ASTR_CHECK(mask.scalar_type() == at::kBool,
               "cuda_paged_attention: attn_mask must be bool (True = attend), got ",
               mask.scalar_type());
    ASTR_CHECK(mask.dim() == 2 && mask.size(0) == num_tokens,
               "cuda_paged_attention: attn_mask must have shape [T, K] with T = ", num_tokens,
               ", got ", mask.sizes());
    ASTR_CHECK(mask.stride(1) == 1 || mask.size(1) <= 1,
               "cuda_paged_attention: attn_mask must have a contiguous last dim");
    mask_ptr = mask.data_ptr<bool>();
    mask_stride = mask.stride(0);
    mask_kv_len = mask.size(1);
  }
  ASTR_CHECK(num_tokens <= INT32_MAX && num_seqs <= INT32_MAX,
             "cuda_paged_attention: too many tokens");

  const c10::cuda::CUDAGuard guard(device);
  at::Tensor out = at::empty({num_tokens, num_q_heads, head_dim}, q.options());
  if (num_tokens == 0) return out;

  kernels::PagedAttentionParams base{};
  base.q = q.data_ptr();
  base.q_stride_token = q.stride(0);
  base.q_stride_head = q.stride(1);
  base.k_cache = k_cache.data_ptr();
  base.v_cache = v_cache.data_ptr();
  base.k_stride_page = k_cache.stride(0);
  base.k_stride_slot = k_cache.stride(1);
  base.k_stride_head = k_cache.stride(2);
  base.v_stride_page = v_cache.stride(0);
  base.v_stride_slot = v_cache.stride(1);
  base.v_stride_head = v_cache.stride(2);
  base.block_table = block_table.data_ptr<int32_t>();
  base.block_table_stride = block_table.stride(0);
  base.block_table_width = static_cast<int>(block_table.size(1));
  base.seq_lens = seq_lens.data_ptr<int32_t>();
  base.attn_mask = mask_ptr;
  base.mask_stride_token = mask_stride;
  base.mask_kv_len = static_cast<int>(std::min<int64_t>(mask_kv_len, INT32_MAX));
  base.out = out.data_ptr();
  base.out_stride_token = out.stride(0);
  base.out_stride_head = out.stride(1);
  base.num_seqs = static_cast<int>(num_seqs);
  base.num_tokens = static_cast<int>(num_tokens);
  base.num_q_heads = static_cast<int>(num_q_heads);
  base.num_kv_heads = static_cast<int>(num_kv_heads);
  base.head_dim = static_cast<int>(head_dim);
  base.log2_page_size = log2_of_power_of_two(page_size);
  base.is_causal = is_causal;
  base.scale = static_cast<float>(scale);
  base.dtype = to_kernel_dtype(q.scalar_type());

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  kernels::LaunchStatus status;
  if (decode) {
    kernels::PagedDecodeParams params{};
    static_cast<kernels::PagedAttentionParams&>(params) = base;
    const int64_t max_kv_len = std::min<int64_t>(block_table.size(1) * page_size, INT32_MAX);
    int num_sms = 0;
    C10_CUDA_CHECK(
        cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device.index()));
    params.num_splits =
        kernels::paged_decode_num_splits(base.num_seqs, base.num_q_heads, base.num_kv_heads,
                                         static_cast<int>(max_kv_len), base.head_dim, num_sms);
    const int forced_split_count = decode_split_count_override();
    if (forced_split_count > 0) params.num_splits = forced_split_count;
    const bool pairs_fill_gpu = kernels::paged_decode_block_pairs_fill_gpu(
        base.num_seqs, base.num_q_heads, base.num_kv_heads, num_sms);
    params.merge_in_block_pairs =
        kernels::paged_decode_can_merge_in_block_pairs(params.num_splits, base.head_dim) &&
        (pairs_fill_gpu || tuning_switch_is_on("ASTR_DECODE_BLOCK_PAIRS")) &&
        !tuning_switch_is_off("ASTR_DECODE_BLOCK_PAIRS") &&
        !tuning_switch_is_off("ASTR_DECODE_CLUSTER_MERGE");
    // Eight-warp blocks: one split on the block pairs' grid, where that pays (shapes only). A
    // forced split count is kept, except for one split with the switch on.
    const bool forced_splits = forced_split_count > 0;
    const bool eight_warps_on = tuning_switch_is_on("ASTR_DECODE_EIGHT_WARPS");
    const bool eight_warps_replace_pairs =
        params.merge_in_block_pairs && !forced_splits &&
        (eight_warps_on || kernels::decode_eight_warp_blocks_pay(max_kv_len));
    const bool eight_warps_forced = forced_splits && params.num_splits == 1 && eight_warps_on;
    if ((eight_warps_replace_pairs || eight_warps_forced) &&
        kernels::paged_decode_can_run_eight_warp_blocks(1, base.head_dim) &&
        !tuning_switch_is_off("ASTR_DECODE_EIGHT_WARPS")) {
      params.num_splits = 1;
      params.merge_in_block_pairs = false;
      params.eight_warp_blocks = true;
    }
    params.merge_in_cluster = !params.merge_in_block_pairs &&
                              kernels::paged_decode_can_merge_in_cluster(params.num_splits) &&
                              !tuning_switch_is_off("ASTR_DECODE_CLUSTER_MERGE");
    // The persistent decode: one split, where its rounds of one item per SM pay
    // (decode_persistent_blocks_pay, shapes only), on a grid of one block per SM.
    const int64_t items =
        kernels::paged_decode_items(base.num_seqs, base.num_q_heads, base.num_kv_heads);
    const bool persistent_on = tuning_switch_is_on("ASTR_DECODE_PERSISTENT");
    const int forced_grid = decode_persistent_grid_override();
    const int persistent_grid =
        static_cast<int>(std::min<int64_t>(items, forced_grid > 0 ? forced_grid : num_sms));
    if (params.num_splits == 1 && !params.merge_in_cluster &&
        (persistent_on ||
         (!params.eight_warp_blocks && kernels::decode_persistent_blocks_pay(items, num_sms))) &&
        !tuning_switch_is_off("ASTR_DECODE_PERSISTENT") &&
        kernels::paged_decode_can_run_persistent(1, base.head_dim, items, persistent_grid)) {
      params.eight_warp_blocks = false;
      params.persistent_blocks = persistent_grid;
    }
    // Size from shapes only (split count, T, Hq, D), never from seq_lens' values.
    const size_t workspace_floats = kernels::paged_decode_workspace_floats(
        params.num_splits, params.merge_in_cluster || params.merge_in_block_pairs, base.num_tokens,
        base.num_q_heads, base.head_dim);
    at::Tensor workspace;
    if (workspace_floats > 0) {
      workspace =
          at::empty({static_cast<int64_t>(workspace_floats)}, q.options().dtype(at::kFloat));
      params.workspace = workspace.data_ptr<float>();
    }
    // The persistent decode's claim counter, which the launch zeroes in the stream (also inside
    // a captured graph).
    at::Tensor claim_counter;
    if (params.persistent_blocks > 0) {
      claim_counter = at::empty({1}, q.options().dtype(at::kInt));
      params.persistent_claim_counter = claim_counter.data_ptr<int32_t>();
      params.persistent_early_start = !tuning_switch_is_off("ASTR_DECODE_EARLY_START");
    }
    status = kernels::launch_paged_decode(params, stream);
  } else {
    kernels::PagedPrefillParams params{};
    static_cast<kernels::PagedAttentionParams&>(params) = base;
    params.query_start_loc = query_start_loc.data_ptr<int32_t>();
    params.max_query_len = static_cast<int>(std::min<int64_t>(max_query_len, INT32_MAX));
    params.kernel = prefill_kernel_override();
    status = kernels::launch_paged_prefill(params, stream);
  }
  ASTR_CHECK(status.ok(), "cuda_paged_attention: ", status.error);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(astr, CUDA, m) { m.impl("cuda_paged_attention", &cuda_paged_attention); }

}  // namespace astrai::backends
