// The plan of a paged attention call (plan.h): plain C++, unit-tested in tests/cpp/plan_test.cpp.
#include "plan.h"

#include <cstdlib>

#include "config.h"
#include "traits.h"

namespace astr::kernels {

namespace {

// What the decode forms of one head dim need of an SM (from traits.h): the rule's resident blocks
// and each optional form's shared memory (0: the form is not compiled for this head dim).
struct DecodeFootprint {
  int blocks_per_sm = 0;
  int tile_positions = 64;  // kv positions of a 4-warp block's tile
  int v_chunks = 1;         // blocks per item, each accumulating a chunk of v's columns
  int pair_block_smem = 0;
  int eight_warp_block_smem = 0;
  int persistent_block_smem = 0;
};

// kv_bytes 1: an FP8 cache, whose decode tiles are twice as many positions and which the
// persistent decode does not read (config.h).
template <int D, int DV, int kKVBytes>
DecodeFootprint decode_footprint_of() {
  constexpr const HeadDimForms& forms = *paged_head_dim_forms(D, DV);
  DecodeFootprint footprint;
  footprint.blocks_per_sm = DecodeTraits<D, kKVBytes, DV>::kBlocksPerSm;
  footprint.tile_positions = DecodeTraits<D, kKVBytes, DV>::kTileN;
  footprint.v_chunks = DecodeTraits<D, kKVBytes, DV>::kVChunks;
  if constexpr (forms.decode_block_pairs)
    footprint.pair_block_smem = DecodePairTraits<D, kKVBytes>::kBlockSmemBytes;
  if constexpr (forms.decode_eight_warps)
    footprint.eight_warp_block_smem = DecodeEightWarpTraits<D, kKVBytes>::kBlockSmemBytes;
  if constexpr (forms.decode_persistent && kKVBytes == 2)
    footprint.persistent_block_smem = PersistentDecodeLayout<DecodeEightWarpTraits<D>>::kSmemBytes;
  return footprint;
}

DecodeFootprint decode_footprint(int head_dim, int head_dim_v, int kv_bytes) {
  DecodeFootprint footprint;
  for_head_dim(head_dim, head_dim_v, [&](auto d, auto dv) {
    constexpr int D = decltype(d)::value;
    constexpr int DV = decltype(dv)::value;
    footprint = kv_bytes == 1 ? decode_footprint_of<D, DV, 1>() : decode_footprint_of<D, DV, 2>();
  });
  return footprint;
}

bool fits_block(int smem_bytes, const DeviceFacts& device) {
  return smem_bytes > 0 && device.max_smem_per_block >= smem_bytes;
}

// Block pairs take an SM as well as 2 single blocks do: the pair fits one block's shared memory,
// and the SM holds half as many pairs as single blocks (else pairs would leave slots of the
// one-wave split rule empty).
bool pairs_fit(const DecodeFootprint& footprint, const DeviceFacts& device) {
  if (!fits_block(footprint.pair_block_smem, device)) return false;
  const int pairs_per_sm =
      device.max_smem_per_sm / (footprint.pair_block_smem + kSharedMemoryReservedPerBlock);
  return 2 * pairs_per_sm >= footprint.blocks_per_sm;
}

// Only pairs of splits merge in a cluster (PagedAttentionTraits::kClusterSplits): larger clusters
// leave slots idle waiting for a whole cluster to fit. Block pairs go first where they run: a
// cluster's launch and barrier cost more than sharing one SM's issue slots (measurements:
// benchmarks/results/decisions.md, "Decode: two splits merge as a pair" and "block pairs").
bool cluster_runs(const DeviceFacts& device) { return device.arch >= 90; }

size_t split_workspace_floats(const DecodeShape& shape, int num_splits) {
  if (num_splits <= 1) return 0;
  const int64_t rows = shape.num_tokens > 0 ? shape.num_tokens : shape.num_seqs;
  // Partial output rows of v's head dim, and their lse.
  return static_cast<size_t>(num_splits) * rows * shape.num_q_heads *
         (decode_head_dim_v(shape) + 1);
}

}  // namespace

int decode_head_dim_v(const DecodeShape& shape) {
  return shape.head_dim_v > 0 ? shape.head_dim_v : shape.head_dim;
}

namespace {

bool parse_int(std::string_view text, int low, int high, int* value) {
  if (text.empty() || text.size() > 9) return false;
  int result = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    result = result * 10 + (c - '0');
  }
  if (result < low || result > high) return false;
  *value = result;
  return true;
}

}  // namespace

std::string describe_plan(const DecodePlan& plan) {
  std::string form =
      std::string(decode_form_name(plan.form)) + " x" + std::to_string(plan.num_splits);
  if (plan.split_tiles > 0) form += " of " + std::to_string(plan.split_tiles) + " tiles";
  return form;
}

std::string describe_plan(const TopkPlan& plan) {
  std::string form = "split x" + std::to_string(plan.num_splits);
  if (plan.split_tiles > 0) form += " of " + std::to_string(plan.split_tiles) + " tiles";
  return form;
}

std::string describe_plan(const PrefillPlan& plan, bool fp8_cache) {
  std::string form = prefill_kernel_name(plan.kernel);
  if (plan.kernel == PrefillKernel::kPersistent) {
    form += " x" + std::to_string(plan.persistent_blocks);
    if (plan.schedule == PrefillSchedule::kRoundRobin) form += " round_robin";
  }
  if (fp8_cache) form += plan.dequantize_fp8_first ? " on dequantized pages" : " reading FP8";
  return form;
}

const char* decode_form_name(DecodeForm form) {
  switch (form) {
    case DecodeForm::kAuto:
      return "auto";
    case DecodeForm::kSplit:
      return "split";
    case DecodeForm::kCluster:
      return "cluster";
    case DecodeForm::kBlockPairs:
      return "block_pairs";
    case DecodeForm::kEightWarps:
      return "eight_warps";
    case DecodeForm::kPersistent:
      return "persistent";
  }
  return "?";
}

const char* prefill_kernel_name(PrefillKernel kernel) {
  switch (kernel) {
    case PrefillKernel::kAuto:
      return "auto";
    case PrefillKernel::kWarpSpecialized:
      return "warp_specialized";
    case PrefillKernel::kWgmma:
      return "wgmma";
    case PrefillKernel::kMmaSync:
      return "mma_sync";
    case PrefillKernel::kPersistent:
      return "persistent";
  }
  return "?";
}

const char* prefill_schedule_name(PrefillSchedule schedule) {
  switch (schedule) {
    case PrefillSchedule::kAuto:
      return "auto";
    case PrefillSchedule::kClaimed:
      return "claimed";
    case PrefillSchedule::kRoundRobin:
      return "round_robin";
  }
  return "?";
}

const char* fp8_prefill_name(Fp8Prefill mode) {
  switch (mode) {
    case Fp8Prefill::kAuto:
      return "auto";
    case Fp8Prefill::kInKernel:
      return "in_kernel";
    case Fp8Prefill::kDequantizeFirst:
      return "dequantize_first";
  }
  return "?";
}

const char* verify_form_name(VerifyForm form) {
  switch (form) {
    case VerifyForm::kAuto:
      return "auto";
    case VerifyForm::kAlways:
      return "always";
    case VerifyForm::kNever:
      return "never";
  }
  return "?";
}

const char* mla_kernel_name(MlaKernel kernel) {
  switch (kernel) {
    case MlaKernel::kAuto:
      return "auto";
    case MlaKernel::kTensorCore:
      return "tensor_core";
    case MlaKernel::kSimple:
      return "simple";
  }
  return "?";
}

const char* prefill_loads_name(PrefillLoads loads) {
  switch (loads) {
    case PrefillLoads::kAuto:
      return "auto";
    case PrefillLoads::kTma:
      return "tma";
    case PrefillLoads::kCpAsync:
      return "cp_async";
  }
  return "?";
}

std::string parse_kernel_tuning(std::string_view text, KernelTuning* tuning) {
  KernelTuning parsed;
  size_t start = 0;
  while (start < text.size()) {
    size_t end = text.find(',', start);
    if (end == std::string_view::npos) end = text.size();
    const std::string_view item = text.substr(start, end - start);
    start = end + 1;
    if (item.empty()) continue;
    const size_t equals = item.find('=');
    const std::string_view key = item.substr(0, equals);
    const std::string_view value =
        equals == std::string_view::npos ? std::string_view() : item.substr(equals + 1);
    bool known = true;
    bool ok = true;
    if (key == "decode_form") {
      ok = false;
      for (DecodeForm form :
           {DecodeForm::kAuto, DecodeForm::kSplit, DecodeForm::kCluster, DecodeForm::kBlockPairs,
            DecodeForm::kEightWarps, DecodeForm::kPersistent}) {
        if (value == decode_form_name(form)) {
          parsed.decode_form = form;
          ok = true;
        }
      }
    } else if (key == "decode_splits") {
      ok = parse_int(value, 1, 65535, &parsed.decode_splits);
    } else if (key == "persistent_blocks") {
      ok = parse_int(value, 1, 1 << 20, &parsed.persistent_blocks);
    } else if (key == "prefill_kernel") {
      ok = false;
      for (PrefillKernel kernel :
           {PrefillKernel::kAuto, PrefillKernel::kWarpSpecialized, PrefillKernel::kWgmma,
            PrefillKernel::kMmaSync, PrefillKernel::kPersistent}) {
        if (value == prefill_kernel_name(kernel)) {
          parsed.prefill_kernel = kernel;
          ok = true;
        }
      }
    } else if (key == "prefill_schedule") {
      ok = false;
      for (PrefillSchedule schedule :
           {PrefillSchedule::kAuto, PrefillSchedule::kClaimed, PrefillSchedule::kRoundRobin}) {
        if (value == prefill_schedule_name(schedule)) {
          parsed.prefill_schedule = schedule;
          ok = true;
        }
      }
    } else if (key == "fp8_prefill") {
      ok = false;
      for (Fp8Prefill mode :
           {Fp8Prefill::kAuto, Fp8Prefill::kInKernel, Fp8Prefill::kDequantizeFirst}) {
        if (value == fp8_prefill_name(mode)) {
          parsed.fp8_prefill = mode;
          ok = true;
        }
      }
    } else if (key == "prefill_loads") {
      ok = false;
      for (PrefillLoads loads : {PrefillLoads::kAuto, PrefillLoads::kTma, PrefillLoads::kCpAsync}) {
        if (value == prefill_loads_name(loads)) {
          parsed.prefill_loads = loads;
          ok = true;
        }
      }
    } else if (key == "verify_form") {
      ok = false;
      for (VerifyForm form : {VerifyForm::kAuto, VerifyForm::kAlways, VerifyForm::kNever}) {
        if (value == verify_form_name(form)) {
          parsed.verify_form = form;
          ok = true;
        }
      }
    } else if (key == "invariant_split_tiles") {
      ok = parse_int(value, 1, 65535, &parsed.invariant_split_tiles);
    } else if (key == "mla_kernel") {
      ok = false;
      for (MlaKernel kernel : {MlaKernel::kAuto, MlaKernel::kTensorCore, MlaKernel::kSimple}) {
        if (value == mla_kernel_name(kernel)) {
          parsed.mla_kernel = kernel;
          ok = true;
        }
      }
    } else if (key == "mla_splits") {
      ok = parse_int(value, 1, 64, &parsed.mla_splits);
    } else if (key == "prefill_l2_panel") {
      if (value == "auto") {
        parsed.prefill_l2_panel = -1;
      } else if (value == "all") {
        parsed.prefill_l2_panel = 0;
      } else {
        ok = parse_int(value, 1, 1 << 30, &parsed.prefill_l2_panel);
      }
    } else {
      known = false;
    }
    if (!known || !ok) {
      return "kernel tuning: cannot read '" + std::string(item) +
             "' (expected comma-separated decode_form=auto|split|cluster|block_pairs|"
             "eight_warps|persistent, decode_splits=1..65535, persistent_blocks=N, "
             "prefill_kernel=auto|warp_specialized|wgmma|mma_sync|persistent, "
             "prefill_schedule=auto|claimed|round_robin, "
             "fp8_prefill=auto|in_kernel|dequantize_first, prefill_loads=auto|tma|cp_async, "
             "prefill_l2_panel=auto|all|N, verify_form=auto|always|never, "
             "invariant_split_tiles=1..65535, mla_kernel=auto|tensor_core|simple, "
             "mla_splits=1..64)";
    }
  }
  *tuning = parsed;
  return "";
}

int64_t decode_items(int num_seqs, int num_q_heads, int num_kv_heads, int query_len) {
  if (num_seqs <= 0 || num_kv_heads <= 0) return 0;
  const int64_t rows =
      static_cast<int64_t>(std::max(1, num_q_heads / num_kv_heads)) * std::max(1, query_len);
  return static_cast<int64_t>(num_seqs) * num_kv_heads * ((rows + 15) / 16);
}

int64_t decode_kv_positions(const DecodeShape& shape) {
  int64_t positions = std::max<int64_t>(0, shape.block_table_positions);
  if (shape.window_left >= 0) {
    // A window of W + 1 positions starts anywhere in a tile: it touches at most one tile more.
    const int tile_n =
        shape.kv_bytes == 1 ? DecodeTraits<128, 1>::kTileN : DecodeTraits<128>::kTileN;
    positions = std::min<int64_t>(positions, static_cast<int64_t>(shape.window_left) + tile_n);
  }
  return positions;
}

DecodePlan plan_paged_decode(const DecodeShape& shape, const DeviceFacts& device,
                             const KernelTuning& tuning) {
  DecodePlan plan;
  const int head_dim_v = decode_head_dim_v(shape);
  if (paged_head_dim_forms(shape.head_dim, head_dim_v) == nullptr) {
    plan.error = unsupported_head_dim_message(shape.head_dim, head_dim_v);
    return plan;
  }
  const HeadDimForms& forms = *paged_head_dim_forms(shape.head_dim, head_dim_v);
  if (device.arch < paged_head_dim_min_arch(forms)) {
    plan.error = "decode: head_dim " + std::to_string(shape.head_dim) + " needs sm_" +
                 std::to_string(paged_head_dim_min_arch(forms)) + " or newer";
    return plan;
  }
  if (shape.kv_bytes != 1 && shape.kv_bytes != 2) {
    plan.error = "decode: a cache of 1- or 2-byte elements";
    return plan;
  }
  const DecodeFootprint footprint = decode_footprint(shape.head_dim, head_dim_v, shape.kv_bytes);
  // A head dim of several v column chunks (512) runs a block per chunk of every item.
  const int64_t items = decode_items(shape.num_seqs, shape.num_q_heads, shape.num_kv_heads,
                                     std::max(1, shape.query_len)) *
                        footprint.v_chunks;
  const int64_t kv_positions = decode_kv_positions(shape);
  const int num_sms = std::max(1, device.num_sms);
  const int tile_n = footprint.tile_positions;
  const int64_t tiles = (kv_positions + tile_n - 1) / tile_n;

  // Batch-invariant mode: the split form, splits of a fixed number of consecutive tiles.
  if (shape.batch_invariant) {
    plan.form = DecodeForm::kSplit;
    plan.split_tiles =
        tuning.invariant_split_tiles > 0 ? tuning.invariant_split_tiles : kInvariantSplitTiles;
    plan.num_splits = invariant_decode_splits(tiles, plan.split_tiles);
    plan.workspace_floats = split_workspace_floats(shape, plan.num_splits);
    return plan;
  }

  // The split rule (one wave of resident 4-warp blocks); a forced count replaces it. The tile
  // size is the same at every head dim (twice as long with an FP8 cache).
  const int64_t slots = static_cast<int64_t>(num_sms) * std::max(1, footprint.blocks_per_sm);
  const bool forced_splits = tuning.decode_splits > 0;
  const int splits =
      forced_splits ? tuning.decode_splits : decode_splits_filling_one_wave(items, slots, tiles);

  const bool pairs_run = forms.decode_block_pairs && pairs_fit(footprint, device);
  const bool eight_warps_run =
      forms.decode_eight_warps && fits_block(footprint.eight_warp_block_smem, device);
  const int persistent_grid = static_cast<int>(
      std::min<int64_t>(items, tuning.persistent_blocks > 0 ? tuning.persistent_blocks : num_sms));
  // The persistent decode takes one token per sequence, token b of sequence b (not a verify).
  const bool persistent_runs = forms.decode_persistent && shape.query_len == 0 &&
                               fits_block(footprint.persistent_block_smem, device) &&
                               persistent_grid > 0 && items <= INT32_MAX / 2;

  auto choose = [&](DecodeForm form, int num_splits) {
    plan.form = form;
    plan.num_splits = num_splits;
    plan.persistent_blocks = form == DecodeForm::kPersistent ? persistent_grid : 0;
    plan.workspace_floats =
        form == DecodeForm::kSplit ? split_workspace_floats(shape, num_splits) : 0;
  };

  // A forced form, where it runs.
  switch (tuning.decode_form) {
    case DecodeForm::kSplit:
      choose(DecodeForm::kSplit, splits);
      return plan;
    case DecodeForm::kCluster:
      if (cluster_runs(device)) {
        choose(DecodeForm::kCluster, 2);
        return plan;
      }
      break;
    case DecodeForm::kBlockPairs:
      if (pairs_run) {
        choose(DecodeForm::kBlockPairs, 2);
        return plan;
      }
      break;
    case DecodeForm::kEightWarps:
      if (eight_warps_run) {
        choose(DecodeForm::kEightWarps, 1);
        return plan;
      }
      break;
    case DecodeForm::kPersistent:
      if (persistent_runs) {
        choose(DecodeForm::kPersistent, 1);
        return plan;
      }
      break;
    case DecodeForm::kAuto:
      break;
  }

  // The automatic choice. 2 splits: block pairs where they fill the GPU, replaced by eight-warp
  // blocks where those pay (unless the count was forced), else a cluster on sm_90, else the merge
  // kernel. 1 split: the persistent decode where its rounds pay, else 4-warp blocks.
  if (splits == 2 && pairs_run && decode_block_pairs_fill_gpu(items, num_sms)) {
    if (!forced_splits && eight_warps_run && decode_eight_warp_blocks_pay(kv_positions))
      choose(DecodeForm::kEightWarps, 1);
    else
      choose(DecodeForm::kBlockPairs, 2);
  } else if (splits == 2 && cluster_runs(device)) {
    choose(DecodeForm::kCluster, 2);
  } else if (splits == 1 && persistent_runs && decode_persistent_blocks_pay(items, num_sms)) {
    choose(DecodeForm::kPersistent, 1);
  } else {
    choose(DecodeForm::kSplit, splits);
  }
  return plan;
}

TopkPlan plan_paged_topk(const TopkShape& shape, const DeviceFacts& device,
                         const KernelTuning& tuning) {
  TopkPlan plan;
  const HeadDimForms* forms = paged_head_dim_forms(shape.head_dim, shape.head_dim_v);
  if (forms == nullptr) {
    plan.error = unsupported_head_dim_message(shape.head_dim, shape.head_dim_v);
    return plan;
  }
  if (!forms->topk) {
    plan.error = topk_head_dim_message(*forms);
    return plan;
  }
  if (device.arch < paged_head_dim_min_arch(*forms)) {
    plan.error = "top-k: head_dim " + std::to_string(shape.head_dim) + " needs sm_" +
                 std::to_string(paged_head_dim_min_arch(*forms)) + " or newer";
    return plan;
  }
  if (shape.kv_bytes != 1 && shape.kv_bytes != 2) {
    plan.error = "top-k: a cache of 1- or 2-byte elements";
    return plan;
  }
  plan.table_slots = topk_table_slots(shape.topk);
  if (shape.topk < 0 || plan.table_slots == 0) {
    plan.error = "topk_indices: at most " + std::to_string(kTopkMaxEntries) +
                 " entries per query row in the cuda kernels, got " + std::to_string(shape.topk);
    return plan;
  }
  if (shape.num_kv_heads <= 0 || shape.num_tokens * shape.num_kv_heads > INT32_MAX) {
    plan.error = "top-k: tokens x kv heads must be 1 to 2^31 - 1";
    return plan;
  }
  const DecodeFootprint footprint =
      decode_footprint(forms->head_dim, forms->head_dim_v, shape.kv_bytes);
  // A head dim of several v column chunks (512) runs a block per chunk of every item.
  const int64_t items =
      decode_items(static_cast<int>(std::min<int64_t>(shape.num_tokens, INT32_MAX)),
                   shape.num_q_heads, shape.num_kv_heads) *
      footprint.v_chunks;
  const int64_t tiles = (shape.topk + footprint.tile_positions - 1) / footprint.tile_positions;
  if (shape.batch_invariant) {
    plan.split_tiles =
        tuning.invariant_split_tiles > 0 ? tuning.invariant_split_tiles : kInvariantSplitTiles;
    plan.num_splits = invariant_decode_splits(tiles, plan.split_tiles);
  } else if (tuning.decode_splits > 0) {
    plan.num_splits = tuning.decode_splits;
  } else {
    const int64_t slots =
        static_cast<int64_t>(std::max(1, device.num_sms)) * std::max(1, footprint.blocks_per_sm);
    plan.num_splits = decode_splits_filling_one_wave(items, slots, tiles);
  }
  if (plan.num_splits > 1) {
    // Partial output rows of v's head dim, and their lse.
    plan.workspace_floats = static_cast<size_t>(plan.num_splits) * shape.num_tokens *
                            shape.num_q_heads * (forms->head_dim_v + 1);
  }
  return plan;
}

// The prefill kernel: on sm_90 (sm_90a code) the warp-specialised one wherever config.h compiles
// it, else the first wgmma kernel, else mma.sync. With TMA boxes (pool_tensor_map.h) the
// warp-specialised kernel is the fastest at every head dim it compiles; at D = 128 the first wgmma
// kernel is compiled too, for FP8 pages read in the kernel, and runs with prefill_kernel=wgmma
// (decisions.md, "Prefill: which kernel runs at each head dim"). The persistent form of the
// warp-specialised kernel runs only when the tuning asks for it: no GPU has measured it yet.
PrefillPlan plan_paged_prefill(int head_dim, const DeviceFacts& device, const KernelTuning& tuning,
                               std::optional<int64_t> fp8_scratch_bytes,
                               const PrefillKvFootprint& kv, bool batch_invariant, int head_dim_v) {
  PrefillPlan plan;
  if (head_dim_v == 0) head_dim_v = head_dim;
  const HeadDimForms* forms = paged_head_dim_forms(head_dim, head_dim_v);
  if (forms == nullptr) {
    plan.error = unsupported_head_dim_message(head_dim, head_dim_v);
    return plan;
  }
  if (device.arch < paged_head_dim_min_arch(*forms)) {
    plan.error = "prefill: head_dim " + std::to_string(head_dim) + " needs sm_" +
                 std::to_string(paged_head_dim_min_arch(*forms)) + " or newer";
    return plan;
  }
  // sm_90a code runs on sm_90 only.
  const bool sm90a = device.has_sm90a_code && device.arch == 90;
  const bool warp_specialized_runs = forms->prefill_warp_specialized && sm90a;
  const bool wgmma_runs = forms->prefill_wgmma && sm90a;
  const bool persistent_runs = forms->prefill_persistent && sm90a;
  const PrefillKernel wanted = tuning.prefill_kernel;
  if (wanted == PrefillKernel::kMmaSync) {
    plan.kernel = PrefillKernel::kMmaSync;
  } else if (wanted == PrefillKernel::kPersistent && persistent_runs) {
    plan.kernel = PrefillKernel::kPersistent;
  } else if (wanted == PrefillKernel::kWgmma && wgmma_runs) {
    plan.kernel = PrefillKernel::kWgmma;
  } else if (warp_specialized_runs) {
    plan.kernel = PrefillKernel::kWarpSpecialized;
  } else if (wgmma_runs) {
    plan.kernel = PrefillKernel::kWgmma;
  } else {
    plan.kernel = PrefillKernel::kMmaSync;
  }
  if (fp8_scratch_bytes.has_value()) {
    // Batch-invariant mode: the bytes in the kernel, whatever the batch's scratch would take.
    bool first = !batch_invariant && prefill_dequantizes_fp8_first(*fp8_scratch_bytes);
    if (tuning.fp8_prefill != Fp8Prefill::kAuto)
      first = tuning.fp8_prefill == Fp8Prefill::kDequantizeFirst;
    // The dequantizing pass writes K and V pages of one head dim: other v head dims read the bytes.
    if (head_dim_v != head_dim) first = false;
    // Reading the bytes: the kernel planned, or where it cannot (the warp-specialised ones), the
    // wgmma one where it runs and can, else the mma.sync prefill, which
    // can at every head dim on every GPU.
    if (!first && !prefill_reads_fp8(plan.kernel, head_dim)) {
      plan.kernel = wgmma_runs && prefill_reads_fp8(PrefillKernel::kWgmma, head_dim)
                        ? PrefillKernel::kWgmma
                        : PrefillKernel::kMmaSync;
    }
    plan.dequantize_fp8_first = first;
  }
  const bool warp_specialized =
      plan.kernel == PrefillKernel::kWarpSpecialized || plan.kernel == PrefillKernel::kPersistent;
  plan.pool_boxes = warp_specialized && tuning.prefill_loads != PrefillLoads::kCpAsync;
  if (plan.kernel == PrefillKernel::kPersistent) {
    plan.persistent_blocks =
        tuning.persistent_blocks > 0 ? tuning.persistent_blocks : std::max(device.num_sms, 1);
    plan.schedule = tuning.prefill_schedule == PrefillSchedule::kRoundRobin
                        ? PrefillSchedule::kRoundRobin
                        : PrefillSchedule::kClaimed;
  }
  const int64_t panel = tuning.prefill_l2_panel >= 0
                            ? tuning.prefill_l2_panel
                            : prefill_panel_pairs(kv.bytes_per_pair, device.l2_cache_bytes);
  // A panel of all pairs or more is the order without panels (the kernel reads it so too).
  plan.panel_pairs = kv.pairs > 0 && panel >= kv.pairs ? 0 : static_cast<int>(panel);
  return plan;
}

bool prefill_runs_as_verify(int64_t max_query_len, const KernelTuning& tuning,
                            bool batch_invariant) {
  // Batch-invariant mode: max_query_len is the batch's, so it may not choose the form.
  if (batch_invariant) return false;
  switch (tuning.verify_form) {
    case VerifyForm::kNever:
      return false;
    case VerifyForm::kAlways:
      return max_query_len >= 1;
    case VerifyForm::kAuto:
      break;
  }
  return verify_fits(max_query_len);
}

}  // namespace astr::kernels
