// Persistent eight-warp decode: one block per SM takes (sequence, kv head, row tile) items in turn
// and keeps one K/V pipeline running across item boundaries.
//
// The eight-warp decode block (PagedAttentionTraits<128, true, 1, 8>: 128-position tiles, 16 kv
// positions of each per warp, page ids two tiles ahead from a ring in shared memory) streams a
// sequence's K/V at the rate of the best bare read of a shuffled page pool, but a grid of more
// than one wave of such blocks loses ~4% to block starts and ends: each block waits for its page
// ids, query and first tile before its stream starts, and drains its pipeline before its epilogue.
// Here the block's tiles form one stream over all of its items: virtual tile g is tile t of item
// k, in stage g % kStages and page-id ring slot g % kPageIdSlots, and three cursors walk it:
//
//   consume  the tile the warps compute on (step g)
//   issue    the tile whose copy starts at step g (g + 1), with the query of its item when it is
//            the item's first tile (into the item's query buffer: two, by item parity)
//   ids      the tile whose page ids are fetched at step g (g + 3)
//
// so the next item's first tile is in flight while the warps finish this item and merge their
// softmax states (in a region of its own, not the K/V stages the next tile lands in). Every item
// has at least one tile (a sequence of length 0 runs one tile of masked scores and writes zeros),
// so a cursor moves to the next item exactly when its tile index reaches the item's count.
//
// Items: item i = (sequence, kv head) i / row tiles, row tile i % row tiles. Block b starts with
// item b and claims each further item from a counter (zero at launch) when its ids cursor is 3
// tiles from the end of its current item. The items then run in index order, as a grid of
// one-item blocks would start them, and a block on a slow SM or with long sequences takes fewer
// (a fixed share per block, or a claim a whole item ahead, ran ragged batches slower than the
// 4-warp blocks: benchmarks/results/decisions.md, "Decode: the persistent decode's claims").
// A claim is stored, and its length copied, a step after its atomic, and has landed two steps
// later, when the ids cursor needs it; where items are shorter than 3 tiles the cursor waits for
// it. One split; the grid is the SM count (at most the item count).
//
// The counter is zeroed by a one-thread kernel launched just before. On sm_90 the decode is that
// kernel's programmatic dependent launch (early_start): its blocks are scheduled as soon as the
// reset starts, read their first items' lengths, page ids, queries and tiles (all written before
// the reset was launched), and wait for the reset to complete only before their first claim.
// The decode then starts as if the reset were not there; a plain launch waits for the reset's end.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/dependent_launch.cuh"
#include "../common/device_primitives.cuh"
#include "../common/launch_status.h"
#include "instantiations.h"
#include "kv_tile_loader.cuh"
#include "params.h"
#include "query_rows.cuh"
#include "tile_math.cuh"
#include "traits.h"
#include "variant.cuh"

namespace astr::kernels {

// Zeroes the persistent decode's claim counter and lets the decode start at once (a no-op for a
// plain launch).
static __global__ void persistent_claim_counter_reset_kernel(int* counter) {
  allow_dependent_launch();
  *counter = 0;
}

// A position in the block's stream of tiles: tile t of the block's item k, which has `tiles`
// starting at the item's tile `base` of its sequence (the window's first: variant.cuh).
struct ItemTileCursor {
  int k, t, tiles, base;
};

// kSoftcap: the softcap it is compiled for (variant.cuh).
template <typename Traits, typename T, Softcap kSoftcap>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    paged_decode_persistent_kernel(const __grid_constant__ PagedKernelArgs args) {
  using Layout = PersistentDecodeLayout<Traits>;
  using Loader = KVTileLoader<Traits, T>;
  constexpr int D = Traits::kHeadDim;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kTileN = Traits::kTileN;
  constexpr int kStages = Traits::kStages;
  static_assert(kStages == 2, "the cursors are one tile (data) and three tiles (ids) ahead");

  const PagedAttentionParams& p = args.base;
  extern __shared__ __align__(128) unsigned char smem[];
  T* q_buffers = reinterpret_cast<T*>(smem + Layout::kQueryOffset);
  T* k_smem = reinterpret_cast<T*>(smem + Layout::kKOffset);
  T* v_smem = reinterpret_cast<T*>(smem + Layout::kVOffset);
  int32_t* page_ids = reinterpret_cast<int32_t*>(smem + Layout::kPageIdOffset);
  unsigned char* merge = smem + Layout::kMergeOffset;

  const int tid = threadIdx.x;
  const int warp = tid / 32, lane = tid % 32;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int row_tiles = (group + 15) / 16;
  const int seq_heads_tiles = p.num_kv_heads * row_tiles;
  const int num_items = p.num_seqs * seq_heads_tiles;

  // The block's items, in the order it takes them: item k of the block sits in slot
  // k % kItemSlots of the queue (its global index and its sequence's length). Item 0 is the
  // block's own (blockIdx.x; the grid is at most the item count); item k + 1 is claimed from the
  // launch's counter while the ids cursor is in item k (kClaimLead below; an index past the last
  // item ends the block's stream).
  constexpr int kSlots = Layout::kItemSlots;
  int* queue_item = reinterpret_cast<int*>(smem + Layout::kItemQueueOffset);
  int* queue_length = queue_item + kSlots;
  auto item_of = [&](int k) { return queue_item[k & (kSlots - 1)]; };
  auto seq_of = [&](int k) { return item_of(k) / seq_heads_tiles; };
  auto kv_head_of = [&](int k) { return item_of(k) / row_tiles % p.num_kv_heads; };
  auto row0_of = [&](int k) { return item_of(k) % row_tiles * 16; };
  // Item k's sequence and the kv range its token sees (variant.cuh): its tiles run from the
  // range's first tile (enter_item) to its end, at least one.
  auto sequence_of = [&](int k) {
    return decode_sequence(p, seq_of(k), queue_length[k & (kSlots - 1)]);
  };
  auto range_of = [&](int k) { return block_kv_range(p, sequence_of(k), row0_of(k), 16); };
  // Points cursor c at its item's tiles (none past the block's last item).
  auto enter_item = [&](ItemTileCursor& c) {
    c.t = 0;
    c.tiles = 0;
    c.base = 0;
    if (item_of(c.k) >= num_items) return;
    const KvRange range = range_of(c.k);
    c.base = range.begin / kTileN;
    c.tiles = max(1, (range.end - c.base * kTileN + kTileN - 1) / kTileN);
  };
  auto block_table_of = [&](int k) { return p.block_table + seq_of(k) * p.block_table_stride; };
  auto load_query = [&](int k) {
    load_query_rows<T, 16, Traits::kChunksPerRow, kThreads>(
        p, q_buffers + (k & 1) * Traits::kQSmemElements, tid, seq_of(k), row0_of(k), group, group,
        kv_head_of(k), [](int r, int ch) { return tile_offset<D, Traits::kSwizzle>(r, ch); });
  };

  // Pool addressing shared by every item; the loader is pointed at an item per call.
  // (kv_end is each item's: issue_at takes it.)
  const KVTileSource source = kv_tile_source<T>(p, 0, 0, 0, 0, kTileN, block_table_positions(p));
  Loader loader(source, k_smem, v_smem, tid, page_ids);
  const char* k_cache = static_cast<const char*>(p.k_cache);
  const char* v_cache = static_cast<const char*>(p.v_cache);
  const int64_t k_head_bytes = p.k_stride_head * (int64_t)sizeof(T);
  const int64_t v_head_bytes = p.v_stride_head * (int64_t)sizeof(T);

  // Claims. Thread 0 issues the atomic (its result is not waited for there); at the start of the
  // next step it writes the index into the queue and starts copying the length with that step's
  // copies, so the length has landed two steps after the store (store_step). A cursor entering
  // an item sooner (items of fewer tiles than the ids cursor is ahead) waits for everything in
  // flight instead.
  int claim_result = 0;         // thread 0: the counter's value returned by the atomic
  bool claim_pending = false;   // an atomic issued, its item not yet stored
  int store_step = -(1 << 30);  // step whose copies carry the last stored item's length
  bool counter_zeroed = false;  // thread 0: the reset kernel has completed (early_start)
  auto claim_next = [&] {
    if (tid == 0) {
      if (!counter_zeroed) {
        wait_for_prerequisite_grid();
        counter_zeroed = true;
      }
      claim_result = atomicAdd(args.claim_counter, 1);
    }
    claim_pending = true;
  };
  auto store_claim = [&](int k, int step) {
    if (tid == 0) {
      const int item = gridDim.x + claim_result;
      queue_item[k & (kSlots - 1)] = item;
      if (item < num_items)
        cp_async_4(shared_address(queue_length + (k & (kSlots - 1))),
                   p.seq_lens + item / seq_heads_tiles, true);
    }
    claim_pending = false;
    store_step = step;
  };
  // Before the ids cursor enters item k (k >= 1), at step `step`: its index and length visible.
  auto make_known = [&](int k, int step) {
    if (claim_pending) store_claim(k, step);
    if (step < store_step + 2) {
      loader.commit();
      cp_async_wait<0>();
      __syncthreads();
      store_step = -(1 << 30);
    }
  };

  // ---- prologue: the first item's length, query and first two tiles' page ids; a claim -------
  if (tid < kSlots) queue_item[tid] = tid == 0 ? static_cast<int>(blockIdx.x) : num_items;
  if (tid == 0)
    cp_async_4(shared_address(queue_length), p.seq_lens + blockIdx.x / seq_heads_tiles, true);
  __syncthreads();
  load_query(0);
  // Without a window an item's tiles start at tile 0, known before its length lands; with one,
  // the first item's length is waited for here.
  int first_base = 0;
  if (p.window_left >= 0) {
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    first_base = range_of(0).begin / kTileN;
  }
  loader.fetch_ids_at(block_table_of(0), first_base, 0);
  loader.fetch_ids_at(block_table_of(0), first_base + 1, 1);
  loader.commit();
  cp_async_wait<0>();
  __syncthreads();
  ItemTileCursor consume{0, 0, 0, 0};
  enter_item(consume);

  // A cursor past the block's last item stays there (tiles = 0).
  auto advance = [&](ItemTileCursor& c) {
    if (c.tiles == 0) return;
    if (++c.t >= c.tiles) {
      ++c.k;
      enter_item(c);
    }
  };
  auto valid = [](const ItemTileCursor& c) { return c.tiles > 0; };
  // The ids cursor leads: it claims the next item kClaimLead tiles before the end of its item (at
  // its first tile if it has fewer), late enough that a block does not hold an item it cannot
  // start soon (claims on entering an item ran ragged batches slower than the 4-warp blocks),
  // early enough that the claim has landed when the cursor gets there; and it makes the next item
  // known before it enters it.
  constexpr int kClaimLead = 3;
  auto claims_here = [](const ItemTileCursor& c) {
    return c.tiles > 0 && c.t == max(0, c.tiles - kClaimLead);
  };
  auto advance_ids = [&](ItemTileCursor& c, int step) {
    if (!valid(c)) return;
    if (c.t + 1 >= c.tiles) make_known(c.k + 1, step);
    advance(c);
    if (claims_here(c)) claim_next();
  };
  ItemTileCursor issue = consume, ids = consume;
  if (claims_here(ids)) claim_next();
  // The issue cursor's item: its threads' K/V columns and its kv end.
  const char *k_thread = nullptr, *v_thread = nullptr;
  int issue_kv_end = 0;
  auto aim_issue = [&](int k) {
    k_thread = loader.thread_column(k_cache + kv_head_of(k) * k_head_bytes);
    v_thread = loader.thread_column(v_cache + kv_head_of(k) * v_head_bytes);
    issue_kv_end = range_of(k).end;
  };
  auto issue_tile = [&](int stage, int slot_tile) {
    loader.issue_at(k_thread, v_thread, issue_kv_end, issue.base + issue.t, stage, slot_tile);
  };
  aim_issue(0);
  advance_ids(ids, -1);  // tile 0's ids are in slot 0
  if (ids.t == 0 && valid(ids)) {
    // The first item has one tile: virtual tile 1 is the second item's first (slot 1 holds the
    // first item's tile 1, which does not exist).
    loader.fetch_ids_at(block_table_of(ids.k), ids.base, 1);
    loader.commit();
    cp_async_wait<0>();
    __syncthreads();
  }
  advance_ids(ids, -1);
  // Step "-1": tile 0 into stage 0, the ids of virtual tile 2.
  issue_tile(0, 0);
  advance(issue);
  if (valid(ids)) {
    loader.fetch_ids_at(block_table_of(ids.k), ids.base + ids.t, 2);
    advance_ids(ids, -1);
  }
  loader.commit();

  const ScoreTransform transform = score_transform<kSoftcap>(p, args.scale_log2);
  const int warp_col0 = warp * Traits::kWarpTileN;
  T* out = static_cast<T*>(p.out);

  WarpSoftmaxState<Traits> state;
  uint32_t q_frag[D / 16][4];
  int kv_head = 0, row0 = 0;
  SequenceRows seq{};
  KvRange range{};
  UnmaskedTiles unmasked{};
  bool item_poisoned = false;  // this thread's share of the item's page ids left the pool

  for (int g = 0; valid(consume); ++g) {
    // ---- producer: the claim of the last step stored; the copy of tile g + 1 (and its item's
    // query); the ids of tile g + 3 ---------------------------------------------------------
    if (claim_pending) store_claim(ids.k + 1, g);
    if (valid(issue)) {
      if (issue.t == 0) {
        aim_issue(issue.k);
        load_query(issue.k);
      }
      issue_tile((g + 1) % kStages, g + 1);
      advance(issue);
    }
    if (valid(ids)) {
      loader.fetch_ids_at(block_table_of(ids.k), ids.base + ids.t, g + 3);
      advance_ids(ids, g);
    }
    loader.commit();
    loader.wait();  // tile g (and, at an item's first tile, its query) has landed

    // ---- consumer: tile g ----------------------------------------------------------------
    const int k = consume.k;
    if (consume.t == 0) {
      seq = sequence_of(k);
      kv_head = kv_head_of(k);
      row0 = row0_of(k);
      range = block_kv_range(p, seq, row0, 16);
      unmasked = unmasked_tiles(p, seq, range, row0, 16);
      // The item's page ids, checked once (the copies clamp theirs into the pool).
      item_poisoned =
          loader.page_ids_outside_pool(block_table_of(k), consume.base * kTileN, range.end);
      state.reset();
      const T* q_smem = q_buffers + (k & 1) * Traits::kQSmemElements;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        const int r = (lane % 8) + ((lane / 8) % 2) * 8;
        const int ch = ks * 2 + lane / 16;
        ldmatrix_x4(shared_address(q_smem + tile_offset<D, Traits::kSwizzle>(r, ch)), q_frag[ks]);
      }
    }
    const int stage = g % kStages;
    const int pos0 = (consume.base + consume.t) * kTileN;
    attend_kv_tile<Traits, T, T>(
        k_smem + stage * Traits::kTileElements, v_smem + stage * Traits::kTileElements, warp_col0,
        lane,
        [&](int, int ks, uint32_t (&a)[4]) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[e] = q_frag[ks][e];
        },
        [&] { return unmasked.need_mask(pos0, kTileN); },
        [&](auto& s_acc) {
          mask_invisible_scores<Traits>(s_acc, p, seq, range, lane, row0, pos0 + warp_col0);
        },
        transform, state);

    if (consume.t == consume.tiles - 1) {
      // ---- epilogue of item k: merge the warps' states, write the rows ---------------------
      finish_row_states(state, transform.exp_scale);
      const bool poisoned = __syncthreads_or(item_poisoned) || seq.poisoned;
      const MergedRows<Traits> merged = merge_warp_states<Traits>(
          merge, state, tid, seq.num_rows - row0, [] { __syncthreads(); });
#pragma unroll
      for (int i = 0; i < MergedRows<Traits>::kItems; ++i) {
        const int row = row0 + MergedRows<Traits>::row(tid, i);
        if (row >= seq.num_rows) continue;
        const int c = MergedRows<Traits>::column(tid, i) * 4;
        const int head = kv_head * group + row;
        const FinishedRow finished =
            finish_row(merged.m[i], poison_sum(merged.l[i], poisoned), sink_log2(p, head));
        const float inv = finished.inv;
        const float4 acc = merged.o[i];
        T* dst = out + seq.q_start * p.out_stride_token + head * p.out_stride_head + c;
        uint2 packed;
        packed.x = pack_pair<T>(acc.x * inv, acc.y * inv);
        packed.y = pack_pair<T>(acc.z * inv, acc.w * inv);
        *reinterpret_cast<uint2*>(dst) = packed;
        if (c == 0) store_lse(p, seq.q_start, head, finished.lse_log2);
      }
    }
    __syncthreads();  // the next step's copy overwrites this stage (and its ids' ring slot)
    advance(consume);
  }
  cp_async_wait<0>();
}

template <int D, typename T, typename KV>
LaunchStatus run_paged_decode_persistent(const PagedKernelArgs& args, cudaStream_t stream) {
  static_assert(std::is_same_v<T, KV>, "the persistent decode reads a cache of q's dtype");
  using Traits = DecodeEightWarpTraits<D>;
  constexpr int kSmemBytes = PersistentDecodeLayout<Traits>::kSmemBytes;
  auto kernel = args.base.softcap > 0.f
                    ? paged_decode_persistent_kernel<Traits, T, Softcap::kRunningMax>
                    : paged_decode_persistent_kernel<Traits, T, Softcap::kOff>;
  const cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes);
  if (error != cudaSuccess)
    return {std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(error)};
  persistent_claim_counter_reset_kernel<<<1, 1, 0, stream>>>(args.claim_counter);
  const LaunchStatus reset = status_after_launch("persistent_claim_counter_reset_kernel");
  if (!reset.ok()) return reset;
  const cudaError_t launched = launch_maybe_dependent(
      kernel, dim3(static_cast<unsigned>(args.persistent_blocks)), dim3(Traits::kThreads),
      kSmemBytes, stream, args.early_start && current_device_is_sm90_or_newer(), args);
  if (launched != cudaSuccess)
    return {std::string("paged_decode_persistent_kernel: ") + cudaGetErrorString(launched)};
  return status_after_launch("paged_decode_persistent_kernel");
}

}  // namespace astr::kernels
