// The persistent warp-specialised prefill on Hopper (sm_90a), and its launcher: the block of the
// warp-specialised prefill (prefill_warp_specialized_kernel.cuh: a producer warpgroup, two
// consumer warpgroups of 64 rows taking turns, the same traits and tiles, so the same sums in the
// same order), one per SM, looping over (sequence, kv head, row tile) items that a scheduler
// orders longest first (prefill_tile_scheduler.h). Opt-in (prefill_kernel=persistent) until a GPU
// has measured it; NOT YET RUN ON A GPU when written.
//
// Why: a grid of one-item blocks starts each block with a cold pipeline (its Q, then its first K
// tile, before the first multiply) and ends it with a store that nothing overlaps (issue 52's
// profile: 8.9% of stall samples at the first K wait). Here the pipeline runs across items:
//   - the block's kv tiles form one stream over its items (tile g of the stream in stage
//     g % kStages, with the phases of g / kStages), so the producer copies the next item's first
//     tiles as soon as stages free up, while the consumers finish the current item;
//   - Q has its own buffers (two where shared memory allows, else one), filled by the producer on a
//     full/empty mbarrier pair: the next item's Q lands while the consumers finish this one (with
//     one buffer, from the consumers' last Q K^T of the item on);
//   - the producer resolves each item (claim, sequence metadata, kv range, page-id check) and
//     publishes it in a ring of two item slots on mbarriers, an item ahead of the consumers;
//   - the turn taking between the consumers (named barriers, as in the grid kernel: the softmax and
//     the epilogue of one under the other's multiplies) runs on across items without a restart,
//     and a consumer's output stores (plain st.global, nothing waits for them) are in flight while
//     it issues the next item's first multiply, whose Q and K the producer has already copied.
//     Issuing that multiply before the stores, with the last P V, made ptxas serialise every
//     wgmma of the kernel (C7518 with the scores in flight over the store's branches; C7515 when
//     waited before it): so the item's first S is issued after its predecessor's epilogue;
//   - inside a warpgroup, FA3's intra-warpgroup overlap as in the grid kernel: the scores of tile
//     t are issued with P V of tile t - 1, and the softmax of tile t runs while P V is in flight.
// Items are handed out by a claim counter, or round robin (PrefillPlan::schedule); the order and
// the counter live in a workspace that a one-block kernel (prefill_schedule_kernel) writes first,
// from seq_lens and query_start_loc on the device: no host sync. The prefill is launched as its
// programmatic dependent and waits for it only before its first claim.
//
// Contracts as params.h and the grid kernel: poisoned rows (bad page ids of the item's kv range,
// bad metadata) are NaN, rows that see nothing are zeros, rows past max_query_len are the
// unplaced-rows kernel's (query_rows.cuh), launched after this one as in every prefill.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../common/dependent_launch.cuh"
#include "../common/device_primitives.cuh"
#include "../common/launch_status.h"
#include "../common/warp_specialization.cuh"
#include "../common/wgmma_primitives.cuh"
#include "instantiations.h"
#include "kv_tile_loader.cuh"
#include "params.h"
#include "pool_tensor_map.h"
#include "prefill_tile_scheduler.h"
#include "prefill_warp_specialized_kernel.cuh"
#include "query_rows.cuh"
#include "variant.cuh"
#include "wgmma_row_tile.cuh"

namespace astr::kernels {

// ---- The scheduler's sort on the device (prefill_tile_scheduler.h) ----------------------------

inline constexpr int kScheduleThreads = 1024;

// The scheduler's view of a launch: the persistent kernel's rows per item and kv tiles.
__host__ __device__ inline PrefillScheduleShape prefill_schedule_shape(const PagedKernelArgs& args,
                                                                       int tile_n) {
  const PagedAttentionParams& p = args.base;
  PrefillScheduleShape shape;
  shape.num_seqs = p.num_seqs;
  shape.num_kv_heads = p.num_kv_heads;
  shape.group = p.num_q_heads / p.num_kv_heads;
  shape.block_rows = kPersistentPrefillRows;
  shape.tile_n = tile_n;
  shape.grid_row_tiles = static_cast<int>(
      prefill_grid_row_tiles(args.max_query_len, shape.group, kPersistentPrefillRows));
  shape.causal = p.is_causal && p.tree_mask == nullptr;
  shape.window_left = p.window_left;
  shape.mask_kv_len = p.attn_mask != nullptr ? p.mask_kv_len : -1;
  return shape;
}

// One block: the counting sort of prefill_schedule_order, pairs of a bucket in the order their
// atomics come; then the item count and a zero claim counter. The prefill that follows may start
// at once (it waits for this grid before its first claim).
template <int kTileN>
__global__ void __launch_bounds__(kScheduleThreads)
    prefill_schedule_kernel(const __grid_constant__ PagedKernelArgs args) {
  allow_dependent_launch();
  __shared__ int bucket_start[kPrefillWorkBuckets];
  __shared__ int warp_sums[kScheduleThreads / 32];
  const PagedAttentionParams& p = args.base;
  const PrefillScheduleShape shape = prefill_schedule_shape(args, kTileN);
  int32_t* schedule = args.prefill_schedule;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  for (int w = tid; w < kPrefillWorkBuckets; w += kScheduleThreads) bucket_start[w] = 0;
  __syncthreads();
  const int pairs = shape.num_seqs * shape.grid_row_tiles;  // the launcher checked the product
  // The bucket of pair `pair`, or -1 where its row tile holds no row (as the kernel clamps it).
  auto bucket_of = [&](int pair) {
    const int seq = pair / shape.grid_row_tiles, row_tile = pair % shape.grid_row_tiles;
    const SequenceRows s = prefill_sequence(p, args.query_start_loc, seq, args.max_query_len);
    if (row_tile >= prefill_sequence_row_tiles(shape, s.q_len)) return -1;
    return prefill_work_bucket(prefill_row_tile_kv_tiles(shape, s.q_len, s.seq_len, row_tile));
  };
  for (int pair = tid; pair < pairs; pair += kScheduleThreads) {
    const int bucket = bucket_of(pair);
    if (bucket >= 0) atomicAdd(&bucket_start[bucket], 1);
  }
  __syncthreads();
  // Most work first: thread t owns the buckets kPer t .. kPer t + kPer - 1 counted from the top;
  // an exclusive scan of the threads' totals gives each bucket its first slot.
  constexpr int kPer = kPrefillWorkBuckets / kScheduleThreads;
  static_assert(kPrefillWorkBuckets % kScheduleThreads == 0, "whole buckets per thread");
  int counts[kPer];
  int total = 0;
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    counts[i] = bucket_start[kPrefillWorkBuckets - 1 - (tid * kPer + i)];
    total += counts[i];
  }
  int inclusive = total;
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const int below = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += below;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  __syncthreads();  // every count read, every warp's sum posted
  int start = inclusive - total;
  for (int w = 0; w < warp; ++w) start += warp_sums[w];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    bucket_start[kPrefillWorkBuckets - 1 - (tid * kPer + i)] = start;
    start += counts[i];
  }
  if (tid == kScheduleThreads - 1) {
    schedule[kPrefillScheduleItems] = start * shape.num_kv_heads;  // start: every pair
    schedule[kPrefillScheduleCounter] = 0;
  }
  __syncthreads();
  for (int pair = tid; pair < pairs; pair += kScheduleThreads) {
    const int bucket = bucket_of(pair);
    if (bucket >= 0) schedule[kPrefillScheduleOrder + atomicAdd(&bucket_start[bucket], 1)] = pair;
  }
}

// ---- The persistent kernel ---------------------------------------------------------------------

// The grid kernel's traits (tiles, stages: the same sums in the same order), but for the registers
// by boxes: the producer here also claims and resolves items and copies Q, which spilled it at the
// grid kernel's 24. ptxas at 40 / 232 against 24 / 240 (sm_90a, bf16, spill stores in bytes, no
// softcap / running max / fixed max): D = 64: 40/28/28 against 120/116/116; D = 128: 204/48/48
// against 260/120/120; D = 256: 136/56/36 against 172/128/120. In the SASS (D = 128, no softcap)
// most of it is in the user-mask path (a tile's mask bytes); the unmasked tile loop reloads five
// values a tile from local memory. Not yet measured on a GPU.
template <int kHeadDim_, bool kBoxes_>
struct PrefillPersistentTraits : PrefillWarpSpecializedTraits<kHeadDim_, kBoxes_> {
  using Grid = PrefillWarpSpecializedTraits<kHeadDim_, kBoxes_>;
  static constexpr int kProducerRegisters = kBoxes_ ? 40 : Grid::kProducerRegisters;
  static constexpr int kConsumerRegisters = kBoxes_ ? 232 : Grid::kConsumerRegisters;
  static_assert(kProducerRegisters + Grid::kConsumers * kConsumerRegisters <=
                    (1 + Grid::kConsumers) * Grid::kLaunchRegisters,
                "setmaxnreg: the consumers claim only what the producer releases");
};

// An item as the producer publishes it to the consumers: the sequence's rows, the kv range of the
// item's rows and its tiles, and whether its rows are poisoned (metadata or page ids). row0 < 0:
// the block's stream has ended.
struct PersistentItem {
  SequenceRows seq;
  int seq_index, kv_head, row0;
  KvRange range;
  int num_tiles;
  int poisoned;  // 0 or 1: an int, so that the producer's warps can OR their page checks into it
};

// The barriers beyond the stages' (StageBarriers): per Q buffer, full (the producer's 128 threads'
// copies landed) and empty (the consumers' 8 warps have issued their last Q K^T of its item); per
// item slot, full (the producer's thread 0 has published it) and empty (the 8 warps have read it).
struct PersistentBarriers {
  uint64_t q_full[2], q_empty[2];
  uint64_t item_full[2], item_empty[2];
  PersistentItem items[2];
};

// Shared memory: Q buffers, the K and V stages, the barriers, the producer's row ring.
template <typename Traits>
struct PrefillPersistentLayout {
  static constexpr int kQBytes = Traits::kQElements * Traits::kElementBytes;
  static constexpr int kStageBytes = 2 * Traits::kStages * Traits::kTileElements * 2;
  static constexpr int kBarrierBytes =
      (Traits::kBarrierBytes + static_cast<int>(sizeof(PersistentBarriers)) + 127) / 128 * 128;
  static constexpr int kOneQBytes = kQBytes + kStageBytes + kBarrierBytes + Traits::kRowRingBytes;
  // Two Q buffers where they fit (D = 256: Q is 64 KB, the stages 128 KB: one).
  static constexpr int kQBuffers = kOneQBytes + kQBytes + 1024 <= 227 * 1024 ? 2 : 1;
  static constexpr int kKOffset = kQBuffers * kQBytes;
  static constexpr int kVOffset = kKOffset + kStageBytes / 2;
  static constexpr int kStageBarrierOffset = kKOffset + kStageBytes;
  static constexpr int kPersistentBarrierOffset = kStageBarrierOffset + Traits::kBarrierBytes;
  static constexpr int kRowRingOffset = kStageBarrierOffset + kBarrierBytes;
  // + 1024: the tiles start on the first 1024-byte boundary of the dynamic shared memory.
  static constexpr int kSmemBytes = kRowRingOffset + Traits::kRowRingBytes + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
  static_assert(kQBytes % 1024 == 0 && kStageBytes % 2048 == 0, "tiles on 1024-byte boundaries");
  static_assert(Traits::kBlockRows == kPersistentPrefillRows, "the scheduler's rows per item");
};

// kSoftcap: the softcap it is compiled for (variant.cuh).
template <typename Traits, typename T, Softcap kSoftcap>
__global__ void __launch_bounds__(Traits::kBlockThreads, 1)
    paged_prefill_persistent_kernel(const __grid_constant__ PagedKernelArgs args,
                                    const __grid_constant__ PoolTensorMaps maps) {
#if defined(ASTR_HAS_WGMMA)
  using Layout = PrefillPersistentLayout<Traits>;
  constexpr int D = Traits::kHeadDim;
  constexpr int kChunks = Traits::kChunksPerRow;
  constexpr int kTileN = Traits::kTileN;
  constexpr int kStages = Traits::kStages;
  constexpr int kBlockRows = Traits::kBlockRows;
  constexpr int kQBuffers = Layout::kQBuffers;
  constexpr int kConsumerWarps = Traits::kConsumers * 4;
  constexpr float kNegInf = -INFINITY;
  // Named barriers (0 is __syncthreads'): the producer warpgroup's; each consumer's turn to issue
  // its multiplies (kTurnBarrier + consumer), as in the grid kernel.
  constexpr int kProducerBarrier = 1;
  constexpr int kTurnBarrier = 4;
  allow_dependent_launch();  // the unplaced-rows check (query_rows.cuh) runs beside it

  const PagedAttentionParams& p = args.base;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
  T* q_buffers = reinterpret_cast<T*>(smem);
  T* k_smem = reinterpret_cast<T*>(smem + Layout::kKOffset);
  T* v_smem = reinterpret_cast<T*>(smem + Layout::kVOffset);
  auto& bars = *reinterpret_cast<StageBarriers<kStages>*>(smem + Layout::kStageBarrierOffset);
  auto& sync = *reinterpret_cast<PersistentBarriers*>(smem + Layout::kPersistentBarrierOffset);
  int64_t* row_ring = reinterpret_cast<int64_t*>(smem + Layout::kRowRingOffset);

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int warpgroup = warp / 4;
  if (tid == 0) {
    const int full_arrivals = Traits::kBoxes ? 1 : Traits::kThreads;
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&bars.k_full[s], full_arrivals);
      mbarrier_init(&bars.v_full[s], full_arrivals);
      mbarrier_init(&bars.k_empty[s], kConsumerWarps);
      mbarrier_init(&bars.v_empty[s], kConsumerWarps);
    }
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      mbarrier_init(&sync.q_full[b], Traits::kThreads);  // the producer's cp.async arrivals
      mbarrier_init(&sync.q_empty[b], kConsumerWarps);
      mbarrier_init(&sync.item_full[b], 1);
      mbarrier_init(&sync.item_empty[b], kConsumerWarps);
    }
    mbarrier_init_fence();
  }
  __syncthreads();  // the barriers are initialised; the roles part, no block-wide barrier after

  if (warpgroup == 0) {
    // ---- producer: each item's publication, its Q, its K and V tiles -------------------------
    release_registers<Traits::kProducerRegisters>();
    int32_t* schedule = args.prefill_schedule;
    int num_items = 0;  // thread 0's
    if (tid == 0) {
      wait_for_prerequisite_grid();  // the scheduler's sort has written the order
      num_items = schedule[kPrefillScheduleItems];
    }
    int first_tile = 0;  // the item's first tile in the block's stream
    for (int n = 0;; ++n) {
      const int slot = n & 1;
      PersistentItem& item = sync.items[slot];
      if (tid == 0) {
        mbarrier_wait(&sync.item_empty[slot], ((n >> 1) & 1) ^ 1);
        const int64_t index = n == 0 ? static_cast<int64_t>(blockIdx.x)
                              : args.round_robin
                                  ? prefill_round_robin_item(blockIdx.x, gridDim.x, n)
                                  : prefill_claimed_item(gridDim.x, atomicAdd(schedule, 1));
        item.row0 = -1;
        item.poisoned = 0;
        if (index < num_items) {
          const PrefillItem claimed =
              prefill_item(schedule + kPrefillScheduleOrder, static_cast<int>(index),
                           prefill_schedule_shape(args, kTileN));
          item.seq_index = claimed.seq;
          item.kv_head = claimed.kv_head;
          item.row0 = claimed.row_tile * kBlockRows;
        }
      }
      named_barrier_sync<128>(kProducerBarrier);  // the claim is visible to the warpgroup
      if (item.row0 < 0) {
        if (tid == 0) mbarrier_arrive(&sync.item_full[slot]);  // the consumers' end
        break;
      }
      const int seq_index = item.seq_index;
      const int kv_head = item.kv_head;
      const int row0 = item.row0;
      const SequenceRows seq =
          prefill_sequence(p, args.query_start_loc, seq_index, args.max_query_len);
      const KvRange range = block_kv_range(p, seq, row0, kBlockRows);
      const int kv_begin = range.begin / kTileN * kTileN;
      const int num_tiles = range.end > kv_begin ? (range.end - kv_begin + kTileN - 1) / kTileN : 0;
      const KVTileSource source =
          kv_tile_source<T>(p, seq_index, kv_head, kv_begin, range.end, kTileN, range.end);
      KVTileLoader<Traits, T> loader(source, k_smem, v_smem, tid);
      // The item's page ids checked once (the copies then only clamp them), ORed over the warps.
      loader.prescan_page_ids();
      const bool outside_pool = __any_sync(0xffffffffu, loader.poisoned) || seq.poisoned;
      if (lane == 0 && outside_pool) atomicOr(&item.poisoned, 1);
      if (tid == 0) {
        item.seq = seq;
        item.range = range;
        item.num_tiles = num_tiles;
      }
      named_barrier_sync<128>(kProducerBarrier);             // the item is complete
      if (tid == 0) mbarrier_arrive(&sync.item_full[slot]);  // release: the consumers read it

      // Q: the item's rows into its buffer once the consumers have issued their last Q K^T of the
      // buffer's last item. One copy in flight per step (the producer runs on few registers).
      const int buffer = n % kQBuffers;
      mbarrier_wait(&sync.q_empty[buffer], ((n / kQBuffers) & 1) ^ 1);
      T* q_smem = q_buffers + buffer * Traits::kQElements;
      const T* q_base = static_cast<const T*>(p.q);
#pragma unroll 1
      for (int c = tid; c < kBlockRows * kChunks; c += Traits::kThreads) {
        const int r = c / kChunks, ch = c % kChunks;
        const int row = row0 + r;
        const bool valid = row < seq.num_rows;
        const T* src = q_base;
        if (valid) {
          const int token = seq.q_start + row / seq.group;
          const int head = kv_head * seq.group + row % seq.group;
          src = q_base + token * p.q_stride_token + head * p.q_stride_head + ch * 8;
        }
        cp_async_16(shared_address(q_smem + swizzled_128b_tile_offset<kBlockRows>(r, ch)), src,
                    valid);
      }
      cp_async_arrive_on(&sync.q_full[buffer]);

      // K and V: the grid kernel's producers, on the block's stream of stages.
      if constexpr (Traits::kBoxes) {
        produce_tiles_by_boxes<Traits, T>(p, maps, bars, loader, row_ring, kv_head, kv_begin,
                                          range.end, num_tiles, kProducerBarrier, first_tile);
      } else {
        produce_tiles_by_gather<Traits, T>(bars, loader, row_ring, num_tiles, kProducerBarrier,
                                           first_tile);
      }
      first_tile += num_tiles;
    }
    cp_async_commit();
    cp_async_wait<0>();  // no copy outlives its thread
  } else {
    // ---- consumers: 64 rows of each item each ------------------------------------------------
    claim_registers<Traits::kConsumerRegisters>();
    const int consumer = warpgroup - 1;
    const int cwarp = warp - 4 * (1 + consumer);  // warp in the consumer warpgroup
    const int rows0 = consumer * 64;              // the consumer's first row in the item
    const int turn_barrier = kTurnBarrier + consumer;
    const int other_turn_barrier = kTurnBarrier + (1 - consumer);
    const ScoreTransform transform = score_transform<kSoftcap>(p, args.scale_log2);
    const int lane_row = lane / 4;
    const int lane_col = (lane % 4) * 2;

    // One warp's share of an arrival that counts warps (stages, Q buffers, item slots).
    auto release = [&](uint64_t* barrier) {
      if (lane == 0) mbarrier_arrive(barrier);
    };
    // Copies that landed through the generic proxy (cp.async), read by wgmma through the async
    // one: each reading thread fences after it has acquired them (as in the grid kernel).
    auto wait_for_copies = [&](uint64_t* barrier, int parity) {
      mbarrier_wait(barrier, parity);
      fence_shared_for_async_proxy();
    };
    // Item n of the block, read from its slot where needed (registers are short), the slot held
    // until the item's rows are stored: the producer is one item ahead, not two.
    auto wait_for_item = [&](int n) -> const PersistentItem& {
      mbarrier_wait(&sync.item_full[n & 1], (n >> 1) & 1);
      return sync.items[n & 1];
    };
    auto q_rows_of = [&](int n) {
      return shared_address(q_buffers + (n % kQBuffers) * Traits::kQElements) + rows0 * 128;
    };
    float o_acc[D / 2];  // register 4 dt + e: column 8 dt + lane_col + e % 2 of row half e / 2
    float s_acc[kTileN / 2];
    uint32_t p_frag[kTileN / 16][4];  // P of the previous tile, the A operand of O += P V
    auto issue_scores = [&](uint32_t q_rows, int stage) {
      // The Q descriptors derived again every tile (opaque_copy), not kept through the loop.
      astr::kernels::issue_scores<T, D, kTileN, kBlockRows>(
          s_acc, opaque_copy(q_rows), shared_address(k_smem + stage * Traits::kTileElements));
    };
    auto issue_pv = [&](int stage) {
      issue_output_update<T, D, kTileN>(o_acc, p_frag,
                                        shared_address(v_smem + stage * Traits::kTileElements));
    };

    // The turns run on across items: the first consumer takes the first; every turn ends handing
    // over to the other; the first consumer takes the second's last hand-over after the loop.
    if (consumer == 1) named_barrier_arrive<256>(other_turn_barrier);
    int n = 0;
    int first_tile = 0;  // the item's first tile in the block's stream
    for (;; ++n) {
      const PersistentItem& item = wait_for_item(n);
      if (item.row0 < 0) break;
      const SequenceRows& seq = item.seq;
      const KvRange& range = item.range;
      const int num_tiles = item.num_tiles;
      const int kv_begin = range.begin / kTileN * kTileN;
      const int row0 = item.row0;
      const int q_buffer = n % kQBuffers;
      const int q_parity = (n / kQBuffers) & 1;
      const uint32_t q_rows = q_rows_of(n);
      const int thread_row = row0 + rows0 + cwarp * 16 + lane_row;
#pragma unroll
      for (int i = 0; i < D / 2; ++i) o_acc[i] = 0.f;
      float row_max[2] = {kNegInf, kNegInf};
      float row_sum[2] = {0.f, 0.f};
      const UnmaskedTiles unmasked = unmasked_tiles(p, seq, range, row0, kBlockRows);
      // The two rows' visible ranges, worked out once per item (the grid kernel's reasons).
      const RowVisibility first_row = row_visibility(p, seq, range, thread_row);
      const RowVisibility second_row = row_visibility(p, seq, range, thread_row + 8);
      const int begins[2] = {first_row.begin, second_row.begin};
      const int limits[2] = {first_row.limit, second_row.limit};
      auto seen = [&](int half) {
        RowVisibility row{begins[half], limits[half], nullptr, 0};
        if (rows_read_masks(p)) {
          const RowVisibility masked = row_visibility(p, seq, range, thread_row + half * 8);
          row.mask_row = masked.mask_row;
          row.mask_from = masked.mask_from;
        }
        return row;
      };
      auto softmax = [&](int tile, float (&alpha)[2]) {
        softmax_tile_seen<kTileN, kSoftcap>(s_acc, unmasked, transform, seen, lane_col,
                                            kv_begin + tile * kTileN, row_max, row_sum, alpha);
      };

      if (num_tiles > 0) {
        // Tile 0: its scores alone. Its Q and K have mostly landed during the last item.
        wait_for_copies(&sync.q_full[q_buffer], q_parity);
        wait_for_copies(&bars.k_full[first_tile % kStages], (first_tile / kStages) & 1);
        named_barrier_sync<256>(turn_barrier);
        issue_scores(q_rows, first_tile % kStages);
        named_barrier_arrive<256>(other_turn_barrier);
        wgmma_wait<0>();
        pin_registers(s_acc);
        release(&bars.k_empty[first_tile % kStages]);
        if (num_tiles == 1) release(&sync.q_empty[q_buffer]);  // Q's last read has landed
        float alpha[2];
        softmax(0, alpha);
        scores_to_a_fragments<T, kTileN>(s_acc, p_frag);

        // Tile t: its scores and P V of tile t - 1 issued together; the softmax of tile t runs
        // while P V is in flight, the rescale of O waits for it.
        for (int tile = 1; tile < num_tiles; ++tile) {
          const int g = first_tile + tile;
          const int stage = g % kStages;
          const int prev = (g - 1) % kStages;
          wait_for_copies(&bars.k_full[stage], (g / kStages) & 1);
          named_barrier_sync<256>(turn_barrier);
          issue_scores(q_rows, stage);
          wait_for_copies(&bars.v_full[prev], ((g - 1) / kStages) & 1);
          issue_pv(prev);
          named_barrier_arrive<256>(other_turn_barrier);
          wgmma_wait<1>();  // the scores (P V may still run)
          pin_registers(s_acc);
          release(&bars.k_empty[stage]);
          if (tile == num_tiles - 1) release(&sync.q_empty[q_buffer]);
          softmax(tile, alpha);
          wgmma_wait<0>();  // P V of tile - 1: O and P are free
          pin_registers(o_acc);
#pragma unroll
          for (int kk = 0; kk < kTileN / 16; ++kk) pin_registers(p_frag[kk]);
          release(&bars.v_empty[prev]);
          if constexpr (kSoftcap != Softcap::kFixedMax) {
#pragma unroll
            for (int i = 0; i < D / 2; ++i) o_acc[i] *= alpha[(i % 4) / 2];
          }
          scores_to_a_fragments<T, kTileN>(s_acc, p_frag);
        }

        // P V of the last tile.
        const int last = (first_tile + num_tiles - 1) % kStages;
        wait_for_copies(&bars.v_full[last], ((first_tile + num_tiles - 1) / kStages) & 1);
        named_barrier_sync<256>(turn_barrier);
        issue_pv(last);
        named_barrier_arrive<256>(other_turn_barrier);
        wgmma_wait<0>();
        pin_registers(o_acc);
#pragma unroll
        for (int kk = 0; kk < kTileN / 16; ++kk) pin_registers(p_frag[kk]);
        release(&bars.v_empty[last]);
      } else {
        // No tile: the Q buffer's phases are still taken and given back in order.
        wait_for_copies(&sync.q_full[q_buffer], q_parity);
        release(&sync.q_empty[q_buffer]);
      }

      sum_rows_over_quad(row_sum);
      store_finished_rows<T, D>(p, seq, item.kv_head, thread_row, lane_col, o_acc, row_max, row_sum,
                                transform, item.poisoned != 0);
      first_tile += num_tiles;
      __syncwarp();  // every lane is done with the slot before the warp frees it
      release(&sync.item_empty[n & 1]);
    }
    if (consumer == 0) named_barrier_sync<256>(turn_barrier);  // the second's last hand-over
  }  // consumers
#else
  __trap();  // built without sm_90a: the plan never chooses this (plan_paged_prefill)
#endif
}

// The sort, then the persistent kernel (TMA boxes where the plan allows them and the pool can be
// described, the gather otherwise: two instantiations, as the grid kernel's), on at most
// args.persistent_blocks blocks and no more than the items the shapes allow, then the unplaced
// rows' check.
template <int D, typename T, typename KV>
LaunchStatus run_paged_prefill_persistent(const PagedKernelArgs& args, cudaStream_t stream) {
  static_assert(std::is_same_v<T, KV>, "the persistent prefill reads a cache of q's dtype");
  const PagedAttentionParams& p = args.base;
  if (args.prefill_schedule == nullptr || args.persistent_blocks < 1)
    return {"prefill: the persistent kernel needs a grid and a scheduler workspace"};
  auto launch = [&](auto boxes, const PoolTensorMaps& maps) -> LaunchStatus {
    using Traits = PrefillPersistentTraits<D, decltype(boxes)::value>;
    using Layout = PrefillPersistentLayout<Traits>;
    const PrefillScheduleShape shape = prefill_schedule_shape(args, Traits::kTileN);
    const int64_t items =
        static_cast<int64_t>(shape.num_seqs) * shape.grid_row_tiles * shape.num_kv_heads;
    if (items > INT32_MAX) return {"prefill: too many items for the persistent kernel"};
    if (items == 0) return launch_unplaced_rows_poison(args, stream);
    prefill_schedule_kernel<Traits::kTileN><<<1, kScheduleThreads, 0, stream>>>(args);
    const LaunchStatus sorted = status_after_launch("prefill_schedule_kernel");
    if (!sorted.ok()) return sorted;
    const Softcap softcap =
        softcap_kernel(p.softcap, std::is_same_v<T, __nv_bfloat16>, /*fixed_max_allowed=*/true);
    auto kernel = paged_prefill_persistent_kernel<Traits, T, Softcap::kOff>;
    if (softcap == Softcap::kFixedMax)
      kernel = paged_prefill_persistent_kernel<Traits, T, Softcap::kFixedMax>;
    if (softcap == Softcap::kRunningMax)
      kernel = paged_prefill_persistent_kernel<Traits, T, Softcap::kRunningMax>;
    const cudaError_t error = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Layout::kSmemBytes);
    if (error != cudaSuccess)
      return {std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(error)};
    const int grid = static_cast<int>(std::min<int64_t>(args.persistent_blocks, items));
    const cudaError_t launched = launch_maybe_dependent(
        kernel, dim3(static_cast<unsigned>(grid)), dim3(Traits::kBlockThreads), Layout::kSmemBytes,
        stream, current_device_is_sm90_or_newer(), args, maps);
    if (launched != cudaSuccess)
      return {std::string("paged_prefill_persistent_kernel: ") + cudaGetErrorString(launched)};
    const LaunchStatus status = status_after_launch("paged_prefill_persistent_kernel");
    if (!status.ok()) return status;
    return launch_unplaced_rows_poison(args, stream);
  };
  PoolTensorMaps maps{};
  if (args.pool_boxes &&
      encode_pool_tensor_maps(args.base, PrefillWarpSpecializedTraits<D, true>::kTileN, &maps))
    return launch(std::true_type{}, maps);
  return launch(std::false_type{}, maps);
}

}  // namespace astr::kernels
