// Host side of the paged attention kernels: the device facts the plans read, the checks that need
// no data, and the dispatch over config.h's list (head dim, q type, kv type) to the instantiations
// the build generates (instantiations.h). No kernel is compiled here.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <climits>
#include <cmath>
#include <string>
#include <type_traits>

#include "config.h"
#include "instantiations.h"
#include "launch.h"
#include "variant.cuh"

namespace astr::kernels {

namespace {

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

// A device attribute of the current device (0 if it cannot be read), kept per device: the plans
// ask for the SM count and shared-memory sizes on every call.
template <cudaDeviceAttr kAttribute>
int current_device_attribute() {
  static std::atomic<int> known[kMaxCachedDevices];
  return current_device_answer(known, [](int device) {
    int value = 0;
    return cudaDeviceGetAttribute(&value, kAttribute, device) == cudaSuccess ? value : 0;
  });
}

// Calls f(T{}, KV{}) with the CUDA types of the params' q and kv dtypes (config.h's lists): KV
// is T for a cache of q's dtype, a byte for an FP8 cache.
template <typename F>
LaunchStatus dispatch_types(const PagedAttentionParams& p, F&& f) {
#define ASTR_DISPATCH_Q_TYPE(enumerator, type, name)       \
  if (p.q_dtype == ScalarType::enumerator) {               \
    if (p.kv_dtype == p.q_dtype) return f(type{}, type{}); \
    if (is_fp8(p.kv_dtype)) return f(type{}, uint8_t{});   \
  }
  ASTR_PAGED_Q_TYPES(ASTR_DISPATCH_Q_TYPE)
#undef ASTR_DISPATCH_Q_TYPE
  return {
      "unsupported dtypes for paged attention (q: bfloat16 or float16; the cache: q's dtype, "
      "float8_e4m3fn or float8_e5m2)"};
}

LaunchStatus check_common(const PagedAttentionParams& p) {
  if (paged_head_dim_forms(p.head_dim, p.head_dim_v) == nullptr)
    return {unsupported_head_dim_message(p.head_dim, p.head_dim_v)};
  if (p.num_kv_heads <= 0 || p.num_q_heads % p.num_kv_heads != 0)
    return {"num_q_heads must be a positive multiple of num_kv_heads"};
  if (p.log2_page_size < 0 || p.log2_page_size > 30) return {"page size must be a power of two"};
  if (p.num_pages < 0) return {"num_pages must be >= 0"};
  if (p.window_left < -1) return {"window_left must be -1 (no window) or >= 0"};
  if (!(p.softcap >= 0.f) || std::isinf(p.softcap)) return {"softcap must be 0 (off) or > 0"};
  if (is_fp8(p.kv_dtype) != (p.k_scale != nullptr && p.v_scale != nullptr))
    return {"an FP8 cache needs k_scale and v_scale, and only an FP8 cache takes them"};
  // The kernels form cache addresses as page * page stride + slot * slot stride in 32-bit byte
  // multiplies (the head offset is 64-bit): a page, and the slots of one page, must span < 2 GiB.
  constexpr int64_t kMaxBytes = INT32_MAX;
  const int64_t page_size = int64_t{1} << p.log2_page_size;
  const int64_t element = element_bytes(p.kv_dtype);
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

PagedKernelArgs kernel_args(const PagedAttentionParams& p) {
  PagedKernelArgs args{};
  args.base = p;
  if (args.base.head_dim_v == 0) args.base.head_dim_v = p.head_dim;  // params of equal dims
  args.num_splits = 1;
  args.scale_log2 = p.scale * kLog2e;
  return args;
}

}  // namespace

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

DeviceFacts current_device_facts() {
  DeviceFacts facts;
  facts.arch = current_device_arch();
  facts.num_sms = current_device_attribute<cudaDevAttrMultiProcessorCount>();
  facts.max_smem_per_block = current_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>();
  facts.max_smem_per_sm = current_device_attribute<cudaDevAttrMaxSharedMemoryPerMultiprocessor>();
  facts.l2_cache_bytes = current_device_attribute<cudaDevAttrL2CacheSize>();
#if defined(ASTR_WITH_SM90A)
  facts.has_sm90a_code = true;
#endif
  return facts;
}

namespace {

// A decode's or a verify's launch (verify: query_start_loc set, params.num_tokens rows).
LaunchStatus launch_decode_forms(const PagedDecodeParams& params, const DecodePlan& plan,
                                 const int32_t* query_start_loc, int max_query_len,
                                 cudaStream_t stream) {
  LaunchStatus status = check_common(params);
  if (!status.ok()) return status;
  if (!plan.error.empty()) return {plan.error};
  if (plan.num_splits < 1 || plan.num_splits > 65535) return {"num_splits out of range"};
  if (plan.split_tiles < 0) return {"split_tiles must be >= 0"};
  const bool persistent = plan.form == DecodeForm::kPersistent;
  if (persistent && (plan.persistent_blocks < 1 || params.persistent_claim_counter == nullptr))
    return {"decode: the persistent form needs a grid and a claim counter"};
  if (plan.workspace_floats > 0 && params.workspace == nullptr)
    return {"decode with num_splits > 1 needs a workspace"};
  if (params.num_tokens == 0) return {};
  PagedKernelArgs args = kernel_args(params);
  args.query_start_loc = query_start_loc;
  args.max_query_len = max_query_len;
  args.num_splits = plan.num_splits;
  args.split_tiles = plan.split_tiles;
  args.merge_in_cluster = plan.form == DecodeForm::kCluster;
  args.persistent_blocks = plan.persistent_blocks;
  args.claim_counter = params.persistent_claim_counter;
  args.early_start = true;
  const size_t rows = (size_t)plan.num_splits * params.num_tokens * params.num_q_heads;
  args.partial_out = params.workspace;
  // The partial outputs are rows of the output's (v's) head dim.
  args.partial_lse =
      params.workspace == nullptr ? nullptr : params.workspace + rows * args.base.head_dim_v;
  status = {"paged decode: " + unsupported_head_dim_message(params.head_dim, params.head_dim_v)};
  for_head_dim(params.head_dim, params.head_dim_v, [&](auto d, auto dv) {
    constexpr int D = decltype(d)::value;
    constexpr int DV = decltype(dv)::value;
    status = dispatch_types(params, [&](auto t, auto kv) -> LaunchStatus {
      using T = decltype(t);
      using KV = decltype(kv);
      if constexpr (paged_head_dim_forms(D, DV)->decode_persistent && std::is_same_v<T, KV>) {
        if (persistent) return run_paged_decode_persistent<D, T, KV>(args, stream);
      }
      if (persistent) return {"decode: the persistent form is not compiled for this head dim"};
      return run_paged_decode<D, DV, T, KV>(args, plan.form, stream);
    });
  });
  return status;
}

}  // namespace

LaunchStatus launch_paged_decode(const PagedDecodeParams& params, const DecodePlan& plan,
                                 cudaStream_t stream) {
  if (params.num_tokens != params.num_seqs) return {"decode needs one query token per sequence"};
  return launch_decode_forms(params, plan, nullptr, 0, stream);
}

LaunchStatus launch_paged_verify(const PagedVerifyParams& params, const DecodePlan& plan,
                                 cudaStream_t stream) {
  if (params.query_start_loc == nullptr) return {"verify needs query_start_loc"};
  if (plan.form == DecodeForm::kPersistent)
    return {"verify: the persistent decode takes one token per sequence"};
  if (params.num_tokens == 0 || params.num_seqs == 0 || params.max_query_len <= 0) return {};
  return launch_decode_forms(params, plan, params.query_start_loc, params.max_query_len, stream);
}

LaunchStatus launch_paged_topk(const PagedTopkParams& params, const TopkPlan& plan,
                               cudaStream_t stream) {
  LaunchStatus status = check_common(params);
  if (!status.ok()) return status;
  if (!plan.error.empty()) return {plan.error};
  if (plan.num_splits < 1 || plan.num_splits > 65535) return {"num_splits out of range"};
  if (plan.split_tiles < 0) return {"split_tiles must be >= 0"};
  if (params.topk_indices == nullptr || params.topk < 0) return {"top-k: needs topk_indices"};
  if (params.query_start_loc == nullptr && params.num_tokens != params.num_seqs)
    return {"decode needs one query token per sequence"};
  if (plan.workspace_floats > 0 && params.workspace == nullptr)
    return {"top-k with num_splits > 1 needs a workspace"};
  if (params.num_tokens == 0 || params.num_seqs == 0) return {};
  if (params.query_start_loc != nullptr && params.max_query_len <= 0) return {};
  PagedKernelArgs args = kernel_args(params);
  args.query_start_loc = params.query_start_loc;
  args.max_query_len = params.max_query_len;
  args.num_splits = plan.num_splits;
  args.split_tiles = plan.split_tiles;
  args.listed_positions = params.listed_positions;
  args.topk_table_slots = plan.table_slots;
  const size_t rows = (size_t)plan.num_splits * params.num_tokens * params.num_q_heads;
  args.partial_out = params.workspace;
  // The partial outputs are rows of the output's (v's) head dim.
  args.partial_lse =
      params.workspace == nullptr ? nullptr : params.workspace + rows * args.base.head_dim_v;
  status = {"paged top-k: " + unsupported_head_dim_message(params.head_dim, params.head_dim_v)};
  for_head_dim(params.head_dim, params.head_dim_v, [&](auto d, auto dv) {
    constexpr int D = decltype(d)::value;
    constexpr int DV = decltype(dv)::value;
    if constexpr (paged_head_dim_forms(D, DV)->topk) {
      status = dispatch_types(params, [&](auto t, auto kv) -> LaunchStatus {
        return run_paged_topk<D, DV, decltype(t), decltype(kv)>(args, stream);
      });
    } else {
      status = {"paged top-k: the top-k kernels are not built for head dims " + std::to_string(D) +
                "/" + std::to_string(DV)};
    }
  });
  return status;
}

LaunchStatus launch_paged_prefill(const PagedPrefillParams& params, const PrefillPlan& plan,
                                  cudaStream_t stream) {
  LaunchStatus status = check_common(params);
  if (!status.ok()) return status;
  if (!plan.error.empty()) return {plan.error};
  if (params.query_start_loc == nullptr) return {"prefill needs query_start_loc"};
  if (params.num_tokens == 0 || params.num_seqs == 0 || params.max_query_len <= 0) return {};
  PagedKernelArgs args = kernel_args(params);
  args.query_start_loc = params.query_start_loc;
  args.max_query_len = params.max_query_len;
  args.pool_boxes = plan.pool_boxes;
  args.panel_pairs = plan.panel_pairs;
  const bool persistent = plan.kernel == PrefillKernel::kPersistent;
  if (persistent) {
    if (plan.persistent_blocks < 1 || params.schedule_workspace == nullptr)
      return {"prefill: the persistent kernel needs a grid and a scheduler workspace"};
    args.persistent_blocks = plan.persistent_blocks;
    args.prefill_schedule = params.schedule_workspace;
    args.round_robin = plan.schedule == PrefillSchedule::kRoundRobin;
  }
  const bool wgmma = plan.kernel == PrefillKernel::kWgmma;
  const bool warp_specialized = plan.kernel == PrefillKernel::kWarpSpecialized;
  status = {"paged prefill: " + unsupported_head_dim_message(params.head_dim, params.head_dim_v)};
  for_head_dim(params.head_dim, params.head_dim_v, [&](auto d, auto dv) {
    constexpr int D = decltype(d)::value;
    constexpr int DV = decltype(dv)::value;
    status = dispatch_types(params, [&](auto t, auto kv) -> LaunchStatus {
      using T = decltype(t);
      using KV = decltype(kv);
      if constexpr (paged_head_dim_forms(D, DV)->prefill_wgmma) {
        if (wgmma) return run_paged_prefill_wgmma<D, T, KV>(args, stream);
      }
      if (wgmma) return {"prefill: the wgmma kernel is not compiled for this head dim"};
      if (persistent) {
        if constexpr (!std::is_same_v<T, KV>) {
          return {
              "prefill: the persistent kernel reads a cache of q's dtype (an FP8 cache is "
              "dequantized first)"};
        } else if constexpr (paged_head_dim_forms(D, DV)->prefill_persistent) {
          return run_paged_prefill_persistent<D, T, KV>(args, stream);
        } else {
          return {"prefill: the persistent kernel is not compiled for this head dim"};
        }
      }
      if (warp_specialized) {
        if constexpr (!std::is_same_v<T, KV>) {
          return {
              "prefill: the warp-specialised kernel reads a cache of q's dtype (an FP8 cache "
              "is dequantized first)"};
        } else if constexpr (paged_head_dim_forms(D, DV)->prefill_warp_specialized) {
          return run_paged_prefill_warp_specialized<D, T, KV>(args, stream);
        } else {
          return {"prefill: the warp-specialised kernel is not compiled for this head dim"};
        }
      }
      return run_paged_prefill<D, DV, T, KV>(args, stream);
    });
  });
  return status;
}

}  // namespace astr::kernels
