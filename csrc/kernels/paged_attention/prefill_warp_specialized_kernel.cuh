// Paged prefill on Hopper (sm_90a): a warp-specialised kernel on the warpgroup multiply (wgmma),
// and its launcher. The plan runs it on sm_90 when the library was built for sm_90a and the head
// dim compiles it (config.h: every head dim; at D = 96 and 128 prefill_wgmma_kernel.cuh is
// compiled as well, plan.cpp).
//
// Same work split and semantics as the mma.sync prefill (traits.h, variant.cuh): a block owns
// kBlockRows packed query rows (new token, q head of the GQA group) of one (sequence, kv head) and
// walks its kv tiles (causal tiles past the block's last token skipped) with the online softmax of
// FlashAttention-2. The block is three warpgroups with roles (warp_specialization.cuh):
//   - the producer (warpgroup 0) copies the K and V tiles from the pages into kStages
//     shared-memory stages, and hands each K and each V tile over on its own mbarrier once its
//     copies have landed: with pages of 8 slots or more, TMA boxes of whole page rows issued by
//     one warp (pool_tensor_map.h; a last tile that reaches past the block's kv range is gathered
//     as below, its rows past the end zero-filled); otherwise the whole warpgroup gathers with
//     cp.async (kv_tile_loader.cuh: any page size, any page order). It keeps few registers
//     (setmaxnreg) so that the consumers can have more;
//   - two consumers (warpgroups 1 and 2) own 64 query rows each. S = Q K^T takes Q and K from
//     shared memory, O += P V takes P from the S accumulators (registers) and V from shared
//     memory, both asynchronous. Inside a consumer, the scores of tile t are multiplied while
//     P V of tile t - 1 is, and the softmax of tile t runs while P V of tile t - 1 is still in
//     flight; between the two consumers, named barriers make them take turns issuing their
//     multiplies, so that one's softmax overlaps the other's multiplies ("ping-pong").
// Q, K and V tiles are in the 128-byte swizzled layout the descriptors describe
// (common/wgmma_primitives.cuh).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "../common/device_primitives.cuh"
#include "../common/launch_status.h"
#include "../common/warp_specialization.cuh"
#include "../common/wgmma_primitives.cuh"
#include "instantiations.h"
#include "kv_tile_loader.cuh"
#include "params.h"
#include "pool_tensor_map.h"
#include "query_rows.cuh"
#include "variant.cuh"
#include "wgmma_row_tile.cuh"

namespace astr::kernels {

// kBoxes_: the producer copies by TMA boxes (pool_tensor_map.h), gathering only a last tile that
// reaches past the kv range; otherwise it gathers every tile with cp.async (kv_tile_loader.cuh).
template <int kHeadDim_, bool kBoxes_>
struct PrefillWarpSpecializedTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr bool kBoxes = kBoxes_;
  static constexpr bool kDecode = false;
  static constexpr int kConsumers = 2;  // consumer warpgroups, 64 rows each (wgmma's M)
  static constexpr int kBlockThreads = (1 + kConsumers) * 128;
  static constexpr int kThreads = 128;  // the K/V loader's threads: the producer warpgroup
  static constexpr int kGroups = 1;
  static constexpr int kBlockRows = kConsumers * 64;
  // kv positions per tile (S's N): the O accumulators (D / 2 registers), one tile's scores
  // (kTileN / 2) and the previous tile's P (kTileN / 4) live at once under the consumers' cap.
  // Gathering, the producer's address arithmetic needs registers, and D = 128 fits 80-wide tiles;
  // with TMA boxes the producer needs few, so the consumers get 240 and D = 128 takes 128-wide
  // tiles (the widths measured: benchmarks/results/decisions.md, "Prefill: the warp-specialised").
  // D = 96 (rows of 12 chunks) gathers tiles of a multiple of 32 rows (128 threads, whole copies
  // each), and has registers for 128-wide tiles either way.
  static constexpr int kTileN = kHeadDim == 64 || kHeadDim == 96 ? 128
                                : kHeadDim == 256                ? 64
                                : kBoxes                         ? 128
                                                                 : 80;
  static constexpr int kStages = kHeadDim == 64 ? 4 : kHeadDim == 128 && !kBoxes ? 3 : 2;
  // Rows of whole 64-element column blocks (128 bytes, the swizzle's): D = 96 leaves half of its
  // second block unused, and the multiplies never read it (k steps of 16, N = D); TMA boxes fill
  // it with zeros (columns past D are outside the map).
  static constexpr int kPaddedHeadDim = (kHeadDim + 63) / 64 * 64;
  static constexpr int kColumnBlocks = kPaddedHeadDim / 64;
  // Registers per thread: the block starts with the cap of __launch_bounds__ (65536 / 384, in
  // steps of 8: 168), and setmaxnreg only moves them between warpgroups: a consumer's request
  // beyond what the producer gave back waits forever.
  static constexpr int kLaunchRegisters = (65536 / kBlockThreads) / 8 * 8;
  // By boxes: the producer at 24 leaves the consumers 240 (D = 128's 128-wide tiles need them); at
  // D = 64 the consumers fit in 232, and 40 keep the producer's per-tile box loop out of local
  // memory (at 24 it reloaded the map's coordinate order from it every tile).
  static constexpr int kProducerRegisters = kBoxes ? (kHeadDim == 64 ? 40 : 24) : 56;
  static constexpr int kConsumerRegisters = kBoxes ? (kHeadDim == 64 ? 232 : 240) : 224;
  static constexpr int kElementBytes = 2;
  static constexpr int kChunksPerRow = kHeadDim * kElementBytes / 16;
  static constexpr int kKVBytes =
      kElementBytes;  // FP8 pages reach it dequantized (dequantize_pages.cu)
  static constexpr int kKVChunksPerRow = kChunksPerRow;
  static constexpr bool kWgmmaTiles = true;
  // The producer reads its rows' addresses from a ring of row offsets (kRowRingBytes below), not
  // the loader's page-id ring or page ids in registers (16 a tile per thread made it spill).
  static constexpr bool kPageIdRing = false;
  static constexpr int kPageIdSlots = 0;
  static constexpr int kTileElements = kTileN * kPaddedHeadDim;
  static constexpr int kQElements = kBlockRows * kPaddedHeadDim;
  static constexpr int kTileBytes = (kQElements + 2 * kStages * kTileElements) * kElementBytes;
  // The barriers after the tiles: full and empty, for K and V, per stage.
  static constexpr int kBarrierBytes = 4 * kStages * 8;
  // The producer's row ring (kv_tile_loader.cuh: put_row_offsets): K and V byte offsets of each
  // row of a tile, 2 tiles.
  static constexpr int kRowRingSlots = 2;
  static constexpr int kRowRingBytes = kRowRingSlots * 2 * kTileN * 8;
  // + 1024: the tiles start on the first 1024-byte boundary of the dynamic shared memory.
  static constexpr int kSmemBytes = kTileBytes + kBarrierBytes + kRowRingBytes + 1024;
  static_assert(kHeadDim % 32 == 0, "k steps of 16 in whole halves of column blocks");
  static_assert(kSmemBytes <= 227 * 1024, "shared memory");
  static_assert(kProducerRegisters + kConsumers * kConsumerRegisters <=
                    (1 + kConsumers) * kLaunchRegisters,
                "setmaxnreg: the consumers claim only what the producer releases");
};

// The stage hand-off barriers of one block (warp_specialization.cuh).
template <int kStages>
struct StageBarriers {
  // The producer's 128 threads arrive (cp.async gather), or its box-issuing thread with the
  // tile's bytes (TMA).
  uint64_t k_full[kStages], v_full[kStages];
  uint64_t k_empty[kStages], v_empty[kStages];  // the consumers' 8 warps arrive
};

#if defined(ASTR_HAS_WGMMA)
// The producer's gather (every page size): the warpgroup's 128 threads copy each tile with
// cp.async, each thread's arrival counted once its copies have landed (the full barriers expect
// 128). Before its copies, one thread per row puts the row's K and V offsets into the row ring
// (kv_tile_loader.cuh), the next tile's page ids already read. first_tile: the first tile's index
// in the block's stream of tiles (the stages' order; the persistent prefill's blocks take several
// items in turn), 0 here.
template <typename Traits, typename T>
__device__ __forceinline__ void produce_tiles_by_gather(StageBarriers<Traits::kStages>& bars,
                                                        const KVTileLoader<Traits, T>& loader,
                                                        int64_t* row_ring, int num_tiles,
                                                        int producer_barrier, int first_tile = 0) {
  constexpr int kStages = Traits::kStages;
  constexpr int kSlots = Traits::kRowRingSlots;
  int32_t next_page = loader.read_row_page(0);
  for (int tile = 0; tile < num_tiles; ++tile) {
    const int stage = (first_tile + tile) % kStages;
    const int free_parity = (((first_tile + tile) / kStages) & 1) ^ 1;
    // The tile's row offsets into the ring, the next tile's page ids read (used an iteration
    // later); the barrier publishes the ring slot, and every thread is past its reads of the
    // slot's last use (two tiles back).
    loader.template put_row_offsets<kSlots>(row_ring, tile, next_page);
    if (tile + 1 < num_tiles) next_page = loader.read_row_page(tile + 1);
    named_barrier_sync<128>(producer_barrier);
    // Each copy hands its tile over on its own: the barrier counts this thread's arrival once
    // its copies have landed, and the thread goes on issuing.
    mbarrier_wait(&bars.k_empty[stage], free_parity);
    loader.template issue_rows<kSlots, false>(row_ring, tile, stage);
    cp_async_arrive_on(&bars.k_full[stage]);
    mbarrier_wait(&bars.v_empty[stage], free_parity);
    loader.template issue_rows<kSlots, true>(row_ring, tile, stage);
    cp_async_arrive_on(&bars.v_full[stage]);
  }
}

// The producer by TMA boxes (pool_tensor_map.h; the full barriers expect one arrival). Every tile
// that ends within the range (kv_end) goes as boxes of `box rows` slots x 64 columns, one per
// lane of warp 0: the lane reads its box's page id, lane 0 arrives with the tile's bytes, and the
// boxes complete them. A last tile that reaches past kv_end is gathered instead by the whole
// warpgroup with cp.async, so that its rows past the end are zeros, not stale slots of the last
// page (their weights are 0, but 0 * NaN is NaN): warps 1-3 wait at the producer's barrier until
// warp 0, which has followed the stages' phases in order, finds that tile's stage free; then each
// thread's copies are counted on the barrier (cp_async_arrive_on_counted) and, once every thread
// has counted them, thread 0 arrives. first_tile: as for the gather.
template <typename Traits, typename T>
__device__ __forceinline__ void produce_tiles_by_boxes(
    const PagedAttentionParams& p, const PoolTensorMaps& maps, StageBarriers<Traits::kStages>& bars,
    const KVTileLoader<Traits, T>& loader, int64_t* row_ring, int kv_head, int kv_begin, int kv_end,
    int num_tiles, int producer_barrier, int first_tile = 0) {
  constexpr int kTileN = Traits::kTileN;
  constexpr int kStages = Traits::kStages;
  constexpr int kSlots = Traits::kRowRingSlots;
  constexpr uint32_t kTileBytes = Traits::kTileElements * sizeof(T);
  constexpr int kColumnBlocks = Traits::kColumnBlocks;
  static_assert(kTileN / kMinPoolBoxRows * kColumnBlocks <= 32, "one box per lane of a warp");
  static_assert(kTileN % kMinPoolBoxRows == 0, "tiles of whole boxes");
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const bool partial_last = num_tiles > 0 && kv_begin + num_tiles * kTileN > kv_end;
  const int whole_tiles = num_tiles - (partial_last ? 1 : 0);
  if (warp == 0) {
    if (lane == 0) {
      prefetch_tensor_map(maps.k);
      prefetch_tensor_map(maps.v);
    }
    // This lane's box: column block lane / row_boxes, rows from (lane % row_boxes) x box rows;
    // lanes past the tile's boxes issue none.
    const int log2_box = maps.log2_box_rows;
    const int row_boxes = kTileN >> log2_box;
    const bool has_box = lane < row_boxes * kColumnBlocks;
    const int column_block = lane / row_boxes;
    const int box_row = (lane % row_boxes) << log2_box;
    const uint32_t box_offset = (column_block * kTileN + box_row) * 128;  // bytes into a tile
    const int page_mask = (1 << p.log2_page_size) - 1;
    for (int tile = 0; tile < whole_tiles; ++tile) {
      const int stage = (first_tile + tile) % kStages;
      const int free_parity = (((first_tile + tile) / kStages) & 1) ^ 1;
      const int pos = kv_begin + tile * kTileN + box_row;
      // Positions below kv_end <= the block table's width: the id is in the sequence's row. An id
      // outside the pool reads zeros (and prescan_page_ids has poisoned the rows).
      const int page = has_box ? loader.src.block_table[pos >> p.log2_page_size] : 0;
      const int slot = pos & page_mask;
      mbarrier_wait(&bars.k_empty[stage], free_parity);
      if (lane == 0) mbarrier_arrive_expect_bytes(&bars.k_full[stage], kTileBytes);
      __syncwarp();  // the bytes are expected before any box can complete them
      if (has_box)
        copy_pool_box(shared_address(loader.k_smem + stage * Traits::kTileElements) + box_offset,
                      maps, maps.k, shared_address(&bars.k_full[stage]), column_block * 64, slot,
                      kv_head, page);
      mbarrier_wait(&bars.v_empty[stage], free_parity);
      if (lane == 0) mbarrier_arrive_expect_bytes(&bars.v_full[stage], kTileBytes);
      __syncwarp();
      if (has_box)
        copy_pool_box(shared_address(loader.v_smem + stage * Traits::kTileElements) + box_offset,
                      maps, maps.v, shared_address(&bars.v_full[stage]), column_block * 64, slot,
                      kv_head, page);
    }
  }
  if (partial_last) {
    const int tile = num_tiles - 1;
    const int stage = (first_tile + tile) % kStages;
    const int free_parity = (((first_tile + tile) / kStages) & 1) ^ 1;
    loader.template put_row_offsets<kSlots>(row_ring, tile, loader.read_row_page(tile));
    if (warp == 0) {
      mbarrier_wait(&bars.k_empty[stage], free_parity);
      mbarrier_wait(&bars.v_empty[stage], free_parity);
    }
    named_barrier_sync<128>(producer_barrier);  // the ring is written and the stage free
    // One copy per step: this tile is one of many, and the producer runs at 24 registers.
    loader.template issue_rows<kSlots, false, 1>(row_ring, tile, stage);
    cp_async_arrive_on_counted(&bars.k_full[stage]);
    loader.template issue_rows<kSlots, true, 1>(row_ring, tile, stage);
    cp_async_arrive_on_counted(&bars.v_full[stage]);
    named_barrier_sync<128>(producer_barrier);  // every thread's copies are counted
    if (threadIdx.x == 0) {
      mbarrier_arrive(&bars.k_full[stage]);
      mbarrier_arrive(&bars.v_full[stage]);
    }
  }
}
#endif

// kSoftcap: the softcap it is compiled for (variant.cuh).
template <typename Traits, typename T, Softcap kSoftcap>
__global__ void __launch_bounds__(Traits::kBlockThreads, 1)
    paged_prefill_warp_specialized_kernel(const __grid_constant__ PagedKernelArgs args,
                                          const __grid_constant__ PoolTensorMaps maps) {
#if defined(ASTR_HAS_WGMMA)
  constexpr int D = Traits::kHeadDim;
  constexpr int kChunks = Traits::kChunksPerRow;
  constexpr int kTileN = Traits::kTileN;
  constexpr int kStages = Traits::kStages;
  constexpr int kBlockRows = Traits::kBlockRows;
  allow_dependent_launch();  // the unplaced-rows check (query_rows.cuh) runs beside it
  constexpr int kConsumerWarps = Traits::kConsumers * 4;
  constexpr float kNegInf = -INFINITY;
  // Named barriers (0 is __syncthreads'): the producer warpgroup's; each consumer warpgroup's
  // own (kConsumerBarrier + consumer); each consumer's turn to issue its multiplies (kTurnBarrier
  // + consumer: it syncs, the other consumer arrives to hand the turn over).
  constexpr int kProducerBarrier = 1;
  constexpr int kConsumerBarrier = 2;
  constexpr int kTurnBarrier = 4;

  const PagedAttentionParams& p = args.base;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (shared_address(smem_raw) & 1023)) & 1023);
  T* q_smem = reinterpret_cast<T*>(smem);
  T* k_smem = q_smem + Traits::kQElements;
  T* v_smem = k_smem + kStages * Traits::kTileElements;
  auto& bars = *reinterpret_cast<StageBarriers<kStages>*>(smem + Traits::kTileBytes);
  int64_t* row_ring = reinterpret_cast<int64_t*>(smem + Traits::kTileBytes + Traits::kBarrierBytes);

  const int tid = threadIdx.x;
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int warpgroup = warp / 4;
  const PrefillBlock block = prefill_block_coordinates(p.num_kv_heads, args.panel_pairs);
  const int seq_index = block.seq_index;
  const int kv_head = block.kv_head;
  const int row_tile = block.row_tile;

  const SequenceRows seq = prefill_sequence(p, args.query_start_loc, seq_index, args.max_query_len);
  const int group = seq.group;
  const int num_rows = seq.num_rows;
  const int q_start = seq.q_start;
  const int row0 = row_tile * kBlockRows;
  if (row0 >= num_rows) return;

  // Tiles from the one holding the first visible position to the range's end.
  const KvRange range = block_kv_range(p, seq, row0, kBlockRows);
  const int kv_begin = range.begin / kTileN * kTileN;
  const int num_tiles = range.end > kv_begin ? (range.end - kv_begin + kTileN - 1) / kTileN : 0;

  const KVTileSource source =
      kv_tile_source<T>(p, seq_index, kv_head, kv_begin, range.end, kTileN, range.end);
  if (tid == 0) {
    // By boxes a tile's full barrier waits for one thread's arrival and the tile's bytes.
    const int full_arrivals = Traits::kBoxes ? 1 : Traits::kThreads;
#pragma unroll
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(&bars.k_full[s], full_arrivals);
      mbarrier_init(&bars.v_full[s], full_arrivals);
      mbarrier_init(&bars.k_empty[s], kConsumerWarps);
      mbarrier_init(&bars.v_empty[s], kConsumerWarps);
    }
    mbarrier_init_fence();
  }
  // The producer's threads check the block's page ids once (the copies then only clamp them);
  // the barrier ORs the result over the block and publishes the barriers' initialisation. The
  // roles part after it: no block-wide barrier follows.
  bool outside_pool = false;
  if (warpgroup == 0) {
    KVTileLoader<Traits, T> scan(source, k_smem, v_smem, tid);
    scan.prescan_page_ids();
    outside_pool = scan.poisoned;
  }
  const bool poisoned = __syncthreads_or(outside_pool) || seq.poisoned;

  if (warpgroup == 0) {
    // ---- producer: K(t) and V(t) of every tile, each handed over on its own barrier ------------
    release_registers<Traits::kProducerRegisters>();
    KVTileLoader<Traits, T> loader(source, k_smem, v_smem, tid);
    if constexpr (Traits::kBoxes) {
      produce_tiles_by_boxes<Traits, T>(p, maps, bars, loader, row_ring, kv_head, kv_begin,
                                        range.end, num_tiles, kProducerBarrier);
    } else {
      produce_tiles_by_gather<Traits, T>(bars, loader, row_ring, num_tiles, kProducerBarrier);
    }
    cp_async_commit();
    cp_async_wait<0>();  // no copy outlives its thread
  } else {
    // ---- consumers: 64 rows each --------------------------------------------------------------
    claim_registers<Traits::kConsumerRegisters>();
    const int consumer = warpgroup - 1;
    const int ctid = tid - 128 * (1 + consumer);  // thread in the consumer warpgroup
    const int cwarp = warp - 4 * (1 + consumer);  // warp in the consumer warpgroup
    const int rows0 = consumer * 64;              // the consumer's first row in the block
    const int own_barrier = kConsumerBarrier + consumer;
    const int turn_barrier = kTurnBarrier + consumer;
    const int other_turn_barrier = kTurnBarrier + (1 - consumer);

    // Q: this consumer's 64 rows of the block's Q tile (column blocks of kBlockRows rows).
    load_query_rows<T, 64, kChunks, 128>(
        p, q_smem, ctid, q_start, row0 + rows0, num_rows, group, kv_head,
        [&](int r, int ch) { return swizzled_128b_tile_offset<kBlockRows>(rows0 + r, ch); });
    cp_async_commit();

    const UnmaskedTiles unmasked = unmasked_tiles(p, seq, range, row0, kBlockRows);
    const ScoreTransform transform = score_transform<kSoftcap>(p, args.scale_log2);
    const uint32_t q_rows = shared_address(q_smem) + rows0 * 128;

    // ---- per-thread state: rows rows0 + 16 * cwarp + lane / 4 (+ 8) of the block ----------------
    const int lane_row = lane / 4;
    const int lane_col = (lane % 4) * 2;
    const int thread_row = row0 + rows0 + cwarp * 16 + lane_row;
    float o_acc[D / 2];  // register 4 dt + e: column 8 dt + lane_col + e % 2 of row half e / 2
#pragma unroll
    for (int i = 0; i < D / 2; ++i) o_acc[i] = 0.f;
    float row_max[2] = {kNegInf, kNegInf};
    float row_sum[2] = {0.f, 0.f};
    float s_acc[kTileN / 2];
    uint32_t p_frag[kTileN / 16][4];  // P of the previous tile, the A operand of O += P V

    cp_async_wait<0>();
    fence_shared_for_async_proxy();
    named_barrier_sync<128>(own_barrier);  // the consumer's Q rows are in shared memory

    // S = Q K^T and O += P V of a stage's tiles (wgmma_row_tile.cuh), issued, not waited for.
    auto issue_scores = [&](int stage) {
      // The Q descriptors derived again every tile (opaque_copy), not kept through the loop.
      astr::kernels::issue_scores<T, D, kTileN, kBlockRows>(
          s_acc, opaque_copy(q_rows), shared_address(k_smem + stage * Traits::kTileElements));
    };
    auto issue_pv = [&](int stage) {
      issue_output_update<T, D, kTileN>(o_acc, p_frag,
                                        shared_address(v_smem + stage * Traits::kTileElements));
    };
    // A stage's copies have landed; cp.async writes through the generic proxy and wgmma reads
    // through the async one, and the writing threads cannot fence copies that complete on their
    // own, so each reading thread fences after it has acquired them.
    auto wait_for_copies = [&](uint64_t* barrier, int parity) {
      mbarrier_wait(barrier, parity);
      fence_shared_for_async_proxy();
    };
    // One warp's share of releasing a stage to the producer (the barrier counts warps).
    auto release = [&](uint64_t* barrier) {
      if (lane == 0) mbarrier_arrive(barrier);
    };
    // The scores of tile `tile` (landed in s_acc) -> its weights; alpha: the output's rescale.
    // The two rows' visible ranges, worked out once: in the tile loop the division by the group
    // and the mask rows' 64-bit addresses made the consumers spill (D = 128, 128-wide tiles:
    // 100 bytes; none with this). With mask rows (a user or tree mask) the row is looked up
    // again per tile.
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
      // The first consumer takes the first turn.
      if (consumer == 1) named_barrier_arrive<256>(other_turn_barrier);
      // Tile 0: its scores alone.
      wait_for_copies(&bars.k_full[0], 0);
      named_barrier_sync<256>(turn_barrier);
      issue_scores(0);
      if (num_tiles > 1 || consumer == 0) named_barrier_arrive<256>(other_turn_barrier);
      wgmma_wait<0>();
      pin_registers(s_acc);
      release(&bars.k_empty[0]);
      float alpha[2];
      softmax(0, alpha);
      scores_to_a_fragments<T, kTileN>(s_acc, p_frag);

      // Tile t: its scores and P V of tile t - 1 are issued together; the softmax of tile t runs
      // while P V is in flight, the rescale of O waits for it.
      for (int tile = 1; tile < num_tiles; ++tile) {
        const int stage = tile % kStages;
        const int prev = (tile - 1) % kStages;
        wait_for_copies(&bars.k_full[stage], (tile / kStages) & 1);
        named_barrier_sync<256>(turn_barrier);
        issue_scores(stage);
        wait_for_copies(&bars.v_full[prev], ((tile - 1) / kStages) & 1);
        issue_pv(prev);
        // The other consumer's turn; the second one's last turn is handed to nobody.
        if (tile + 1 < num_tiles || consumer == 0) named_barrier_arrive<256>(other_turn_barrier);
        wgmma_wait<1>();  // the scores (P V may still run)
        pin_registers(s_acc);
        release(&bars.k_empty[stage]);
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
      const int last = (num_tiles - 1) % kStages;
      wait_for_copies(&bars.v_full[last], ((num_tiles - 1) / kStages) & 1);
      issue_pv(last);
      wgmma_wait<0>();
      pin_registers(o_acc);
#pragma unroll
      for (int kk = 0; kk < kTileN / 16; ++kk) pin_registers(p_frag[kk]);
      release(&bars.v_empty[last]);
    }

    sum_rows_over_quad(row_sum);
    store_finished_rows<T, D>(p, seq, kv_head, thread_row, lane_col, o_acc, row_max, row_sum,
                              transform, poisoned);
  }  // consumers
#else
  __trap();  // built without sm_90a: the plan never chooses this (plan_paged_prefill)
#endif
}

// TMA boxes where the plan allows them and the pool can be described (pool_tensor_map.h), the
// gather otherwise: two instantiations, whose kernel names tell them apart.
template <int D, typename T, typename KV>
LaunchStatus run_paged_prefill_warp_specialized(const PagedKernelArgs& args, cudaStream_t stream) {
  auto launch = [&](auto boxes, const PoolTensorMaps& maps) {
    using Traits = PrefillWarpSpecializedTraits<D, decltype(boxes)::value>;
    return launch_prefill<T, /*kFp8=*/false>(
        args,
        [](auto softcap, auto) {
          return paged_prefill_warp_specialized_kernel<Traits, T, decltype(softcap)::value>;
        },
        Traits::kSmemBytes, Traits::kBlockThreads, Traits::kBlockRows, stream,
        "paged_prefill_warp_specialized_kernel", maps);
  };
  PoolTensorMaps maps{};
  if (args.pool_boxes &&
      encode_pool_tensor_maps(args.base, PrefillWarpSpecializedTraits<D, true>::kTileN, &maps))
    return launch(std::true_type{}, maps);
  return launch(std::false_type{}, maps);
}

}  // namespace astr::kernels
