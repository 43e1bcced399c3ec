// Sparse top-k attention over the paged cache (DeepSeek sparse attention): each query token sees
// only the kv positions its topk_indices row lists (params.h), so every token is its own work item
// and only the listed keys are read. Two kernels, then the decode's merge:
//
//   topk_listing_kernel    one block per token: resolves its row once for every kv head and split,
//                          into listed_positions (PagedTopkParams): an entry the row's
//                          causal/window/mask rules hide, or that repeats an earlier entry (a hash
//                          table in shared memory keeps each position's first entry), becomes -1;
//                          a bad entry (below -1, past the sequence, on a page outside the pool) or
//                          bad metadata of the sequence makes every entry -2 (the row is NaN);
//   paged_topk_kernel      the decode kernel's block (4 warps, 16 rows: the q heads of one kv head
//                          of the token, packed as the decode packs its group) over tiles of
//                          listed entries: each copy looks its entry's position, then its page,
//                          up a tile ahead, gathers the key and value rows (an entry of -1 copies
//                          nothing and scores -inf), and the tile runs through the decode's tile
//                          math (attend_kv_tile: FP8 dequantized in registers, variant.cuh's score
//                          and denominator rules). Split s takes the entry tiles s, s + S, ... (or
//                          consecutive ones in batch-invariant mode), and more than one split merge
//                          in the decode's merge kernel.
//
// The grid comes from shapes only (tokens, heads, topk): no host synchronisation, and a captured
// CUDA graph replays with new indices and lengths. plan.h (TopkPlan) has the split rule.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

#include "../common/device_primitives.cuh"
#include "../common/launch_status.h"
#include "../common/online_softmax.cuh"
#include "decode_merge_kernel.cuh"
#include "instantiations.h"
#include "kv_tile_loader.cuh"
#include "params.h"
#include "query_rows.cuh"
#include "tile_math.cuh"
#include "traits.h"
#include "variant.cuh"

namespace astr::kernels {

// A query token of a top-k call: its sequence (decode: token b is sequence b's; prefill: the
// sequence whose query_start_loc range holds it) and the sequence's rows. A token outside the
// range it was placed in (query_start_loc that does not increase) is poisoned.
struct TopkToken {
  int seq_index;
  SequenceRows seq;
  int row;  // the row of the token's first q head of a kv head (variant.cuh: row_visibility)
};
__device__ __forceinline__ TopkToken topk_token(const PagedKernelArgs& args, int token) {
  const PagedAttentionParams& p = args.base;
  TopkToken t;
  if (args.query_start_loc == nullptr) {
    t.seq_index = token;
    t.seq = decode_sequence(p, token, p.seq_lens[token]);
    t.row = 0;
    return t;
  }
  // The last sequence that starts at or before the token (empty sequences before it start there
  // too); any answer is in [0, B) whatever query_start_loc holds.
  int low = 0, high = p.num_seqs - 1;
  while (low < high) {
    const int mid = (low + high + 1) / 2;
    if (args.query_start_loc[mid] <= token)
      low = mid;
    else
      high = mid - 1;
  }
  t.seq_index = low;
  t.seq = prefill_sequence(p, args.query_start_loc, low, args.max_query_len);
  const int within = token - t.seq.q_start;
  if (within < 0 || within >= t.seq.q_len) t.seq.poisoned = true;
  t.row = min(max(within, 0), max(t.seq.q_len - 1, 0)) * t.seq.group;
  return t;
}

// Positions hashed into a table of 2^log2_slots slots (Fibonacci hashing: consecutive positions
// spread over the table).
__device__ __forceinline__ uint32_t topk_slot(int32_t position, int log2_slots) {
  return (static_cast<uint32_t>(position) * 2654435761u) >> (32 - log2_slots);
}

// The listing pass (see the top of the file), kThreads threads taking kBatch entries each at a
// time. Shared memory: the table, [slots] positions (-1: free) then [slots] the first entry that
// lists each.
template <int kThreads, int kBatch>
__global__ void __launch_bounds__(kThreads)
    topk_listing_kernel(const __grid_constant__ PagedKernelArgs args) {
  const PagedAttentionParams& p = args.base;
  extern __shared__ int32_t topk_table[];
  const int slots = args.topk_table_slots;
  const int log2_slots = 31 - __clz(slots);
  int32_t* table_position = topk_table;
  int32_t* table_first = topk_table + slots;
  const int token = blockIdx.x;
  const int topk = p.topk;
  const int32_t* indices = p.topk_indices + token * p.topk_stride_token;
  int32_t* listed = args.listed_positions + static_cast<int64_t>(token) * topk;

  for (int i = threadIdx.x; i < slots; i += kThreads) {
    table_position[i] = -1;
    table_first[i] = INT_MAX;
  }
  const TopkToken at = topk_token(args, token);
  const SequenceRows& seq = at.seq;
  // A decode padding slot (length 0) is zeros whatever it lists.
  const bool padding = args.query_start_loc == nullptr && !seq.poisoned && seq.seq_len == 0;
  KvRange range{0, seq.seq_len};
  if (p.attn_mask != nullptr) range.end = min(range.end, p.mask_kv_len);
  const RowVisibility seen = row_visibility(p, seq, range, at.row);
  const int32_t* block_table = p.block_table + at.seq_index * p.block_table_stride;
  __syncthreads();  // the table is clear

  // Each entry the row sees goes into the table (its first entry kept by atomicMin); what it
  // keeps is written now and thinned to first entries below. kBatch entries a thread at a time,
  // their loads issued together: the index, then its page id, are dependent loads.
  bool bad = false;
  for (int base = threadIdx.x; base < topk; base += kThreads * kBatch) {
    int32_t position[kBatch], page[kBatch];
    bool seen_key[kBatch];  // the entry lists a position its row sees: page[b] is its page id
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int j = base + b * kThreads;
      position[b] = j < topk && !padding ? indices[j] : -1;
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      seen_key[b] = false;
      page[b] = 0;
      if (position[b] == -1) continue;
      if (position[b] < 0 || position[b] >= seq.seq_len) {
        bad = true;
      } else if (visible(seen, position[b])) {
        seen_key[b] = true;
        page[b] = block_table[position[b] >> p.log2_page_size];
      }
    }
#pragma unroll
    for (int b = 0; b < kBatch; ++b) {
      const int j = base + b * kThreads;
      if (j >= topk) break;
      int32_t kept = -1;
      if (seen_key[b]) {
        if (static_cast<unsigned>(page[b]) >= static_cast<unsigned>(p.num_pages)) {
          bad = true;
        } else {
          // Terminates: a row lists at most topk < slots positions.
          for (uint32_t slot = topk_slot(position[b], log2_slots);;
               slot = (slot + 1) & (slots - 1)) {
            const int32_t held = atomicCAS(&table_position[slot], -1, position[b]);
            if (held == -1 || held == position[b]) {
              atomicMin(&table_first[slot], j);
              break;
            }
          }
          kept = position[b];
        }
      }
      listed[j] = kept;
    }
  }
  const bool poisoned = __syncthreads_or(bad) != 0 || seq.poisoned;  // the table is complete
  for (int j = threadIdx.x; j < topk; j += kThreads) {
    if (poisoned) {
      listed[j] = -2;
      continue;
    }
    const int32_t position = listed[j];  // this thread's own write
    if (position < 0) continue;
    uint32_t slot = topk_slot(position, log2_slots);
    while (table_position[slot] != position) slot = (slot + 1) & (slots - 1);
    if (table_first[slot] != j) listed[j] = -1;  // a repeat: its first entry reads the key
  }
}

// The K/V tiles of a token's listed entries (KVTileLoader's copies and layout, rows gathered by
// entry): tile t of the block holds entries entry_begin + t * entry_step + row. lookup(tile) reads
// the tile's positions and their page ids into registers a tile ahead; issue(tile, stage) starts
// the copies (an entry of -1, or past the row, copies zeros) and marks in `seen` which rows of
// the stage hold a key (one thread per row). Where V's rows have fewer chunks than K's (192, 128;
// 512's chunks of 256 columns), V's copies take rows of their own (KVTileLoader: kSameRows), each
// with its own entry. Where the traits keep page ids in a ring (D = 512: a position and a page id
// for each of 48 copies a thread would spill), lookup has one thread per row write the row's
// position and page id into the stage's slot of the ring instead, and the copies read them there.
template <typename Traits, typename KV>
struct ListedKeyTiles {
  using Copies = KVTileLoader<Traits, KV>;
  using VShape = typename Copies::VShape;
  static constexpr int D = Traits::kHeadDim;
  static constexpr int kTileN = Traits::kTileN;
  static constexpr bool kRing = Traits::kPageIdRing;
  static constexpr int kCopies = kRing ? 1 : Copies::kCopies;
  static constexpr bool kSameRows = Copies::kSameRows;
  static constexpr int kVCopies = kSameRows || kRing ? 1 : Copies::kVCopies;
  // The ring: [kStages][2][kTileN] int32 (positions, then page ids), tile t in slot t % kStages,
  // in the traits' page-id region (kPageIdSlots = 2 x kStages slots of kTileN ids).
  static_assert(!kRing ||
                    (Traits::kPageIdSlots >= 2 * Traits::kStages && kTileN <= Traits::kThreads),
                "top-k ring: a position and a page id per row of each stage, a thread per row");

  Copies copies;  // its source's kv range is unused: the rows come from the entries
  const int32_t* listed;
  const int32_t* block_table;
  int entry_begin, entry_end, entry_step;
  int32_t* seen;  // [kStages][kTileN] in shared memory: 1 where the row holds a key
  int32_t* ring;  // kRing: see above
  int positions[kCopies];
  int pages[kCopies];
  int v_positions[kVCopies];  // V's own rows (kSameRows false)
  int v_pages[kVCopies];
  bool poisoned = false;  // an entry of -2: the row's metadata is bad (topk_listing_kernel)

  __device__ __forceinline__ ListedKeyTiles(const KVTileSource& source, KV* k_stages, KV* v_stages,
                                            int tid, const int32_t* listed_row, int begin, int end,
                                            int step, int32_t* seen_rows, int32_t* id_ring)
      : copies(source, k_stages, v_stages, tid),
        listed(listed_row),
        block_table(source.block_table),
        entry_begin(begin),
        entry_end(end),
        entry_step(step),
        seen(seen_rows),
        ring(id_ring) {}

  // The tile's positions and page ids: into registers, or (kRing) into its slot of the ring, read
  // by every thread's copies after the next barrier of the block.
  __device__ __forceinline__ void lookup(int tile) {
    const int entry0 = entry_begin + tile * entry_step;
    if constexpr (kRing) {
      const int row = copies.thread;
      if (row < kTileN) {
        int32_t* slot = ring + (tile % Traits::kStages) * 2 * kTileN;
        look_up_entry(entry0 + row, slot[row], slot[kTileN + row]);
      }
    } else {
#pragma unroll
      for (int i = 0; i < kCopies; ++i)
        look_up_entry(entry0 + copies.copy_row(i), positions[i], pages[i]);
      if constexpr (!kSameRows) {
#pragma unroll
        for (int i = 0; i < kVCopies; ++i)
          look_up_entry(entry0 + copies.v_copy_row(i), v_positions[i], v_pages[i]);
      }
    }
  }
  __device__ __forceinline__ void look_up_entry(int entry, int32_t& position, int32_t& page) {
    const int32_t listed_position = entry < entry_end ? listed[entry] : -1;
    poisoned |= listed_position == -2;
    // The listing pass checked the page ids of the positions it kept.
    page = listed_position >= 0 ? block_table[listed_position >> copies.src.log2_page_size] : 0;
    position = listed_position;
  }
  // Copy i's row's position and page id (V's rows: kV), from registers or the stage's ring slot.
  template <bool kV>
  __device__ __forceinline__ void row_entry(int i, int row, int stage, int& position,
                                            int& page) const {
    if constexpr (kRing) {
      const int32_t* slot = ring + stage * 2 * kTileN;
      position = slot[row];
      page = slot[kTileN + row];
    } else if constexpr (kV) {
      position = v_positions[i];
      page = v_pages[i];
    } else {
      position = positions[i];
      page = pages[i];
    }
  }

  __device__ __forceinline__ void issue(int stage) {
    const KVTileSource& src = copies.src;
    const int page_mask = (1 << src.log2_page_size) - 1;
    KV* k_dst = copies.k_smem + stage * Traits::kTileElements;
    KV* v_dst = copies.v_smem + stage * VShape::kTileElements;
    if constexpr (!kSameRows) {  // V's own rows, then K's below
#pragma unroll
      for (int i = 0; i < Copies::kVCopies; ++i) {
        const int row = copies.v_copy_row(i);
        const int column = copies.v_copy_chunk(i, copies.thread);
        int position, row_page;
        row_entry<true>(i, row, stage, position, row_page);
        const bool valid = position >= 0;
        const int page = valid ? static_cast<int>(min(static_cast<unsigned>(row_page),
                                                      static_cast<unsigned>(src.num_pages) - 1u))
                               : 0;
        const int slot = valid ? position & page_mask : 0;
        const char* v_base = Copies::kVOneColumn ? copies.v_thread : copies.v_thread + column * 16;
        const char* v_src =
            v_base + ((int64_t)page * src.v_page_bytes + (int64_t)(slot * src.v_slot_bytes));
        const int offset =
            tile_offset<VShape::kColumns, VShape::kSwizzle, Traits::kKVChunkElements>(row, column);
        cp_async_16(shared_address(v_dst + offset), v_src, valid);
      }
    }
#pragma unroll
    for (int i = 0; i < Copies::kCopies; ++i) {
      const int row = copies.copy_row(i);
      const int column = copies.copy_chunk(i);
      int position, row_page;
      row_entry<false>(i, row, stage, position, row_page);
      const bool valid = position >= 0;
      // Clamped into the pool all the same: no value of the scratch makes a copy leave it.
      const int page = valid ? static_cast<int>(min(static_cast<unsigned>(row_page),
                                                    static_cast<unsigned>(src.num_pages) - 1u))
                             : 0;
      const int slot = valid ? position & page_mask : 0;
      const char* k_base = Copies::kOneColumn ? copies.k_thread : copies.k_thread + column * 16;
      const char* k_src =
          k_base + ((int64_t)page * src.k_page_bytes + (int64_t)(slot * src.k_slot_bytes));
      const int offset = tile_offset<D, Traits::kKVSwizzle, Traits::kKVChunkElements>(row, column);
      cp_async_16(shared_address(k_dst + offset), k_src, valid);
      if constexpr (kSameRows) {
        const char* v_base = Copies::kOneColumn ? copies.v_thread : copies.v_thread + column * 16;
        const char* v_src =
            v_base + ((int64_t)page * src.v_page_bytes + (int64_t)(slot * src.v_slot_bytes));
        cp_async_16(shared_address(v_dst + offset), v_src, valid);
      }
      if (column == 0) seen[stage * kTileN + row] = valid ? 1 : 0;
    }
  }
};

// The attention kernel (see the top of the file). Grid: x = (token, kv head, v column chunk), the
// chunks of a pair side by side as in the decode, y = row tiles of the group, z = splits.
// kSoftcap, kE5M2: as the decode kernel's.
template <typename Traits, typename T, typename KV, Softcap kSoftcap, bool kE5M2>
__global__ void __launch_bounds__(Traits::kBlockThreads, Traits::kMinBlocksPerSm)
    paged_topk_kernel(const __grid_constant__ PagedKernelArgs args) {
  static_assert(Traits::kDecode && Traits::kGroups == 1 && Traits::kWarps == 4,
                "the decode's 4-warp block");
  static_assert(sizeof(KV) == Traits::kKVBytes, "traits of this cache");
  constexpr int D = Traits::kHeadDim;    // q and k
  constexpr int DV = Traits::kVColumns;  // the block's chunk of v's (and the output's) columns
  constexpr int kVChunks = Traits::kVChunks;
  constexpr int kChunks = Traits::kChunksPerRow;
  constexpr int kThreads = Traits::kThreads;
  constexpr int kTileN = Traits::kTileN;
  constexpr int kWarpTileN = Traits::kWarpTileN;
  constexpr int kStages = Traits::kStages;
  constexpr int kBlockRows = Traits::kBlockRows;
  // The rows' `seen` marks take the place of the cluster merge's incoming region.
  static_assert(kStages * kTileN * 4 <= Traits::kIncomingBytes, "room for the seen marks");

  const PagedAttentionParams& p = args.base;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  T* q_smem = reinterpret_cast<T*>(smem_raw);
  KV* k_smem = reinterpret_cast<KV*>(q_smem + Traits::kQSmemElements);
  KV* v_smem = k_smem + Traits::kKVSmemElements;
  int32_t* seen =
      reinterpret_cast<int32_t*>(smem_raw + Traits::kSmemBytes - Traits::kIncomingBytes);

  const int tid = threadIdx.x;
  auto sync_group = [] { __syncthreads(); };
  // Split: the merge kernel, a programmatic dependent, may be scheduled now.
  if (args.num_splits > 1) allow_dependent_launch();
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int pair_index = static_cast<int>(blockIdx.x) / kVChunks;
  const int v_column0 = (static_cast<int>(blockIdx.x) % kVChunks) * DV;
  const int token = pair_index / p.num_kv_heads;
  const int kv_head = pair_index % p.num_kv_heads;
  const int row0 = blockIdx.y * kBlockRows;
  const int split = blockIdx.z;
  const int group = p.num_q_heads / p.num_kv_heads;
  const int num_rows = group;  // this token's q heads of the kv head
  const TopkToken at = topk_token(args, token);

  // The split's entry tiles, as a decode splits its kv tiles.
  int entry_begin, entry_step, entry_end = p.topk;
  if (args.split_tiles > 0) {
    const int64_t begin = (int64_t)split * args.split_tiles * kTileN;
    entry_begin = static_cast<int>(min(begin, (int64_t)INT_MAX));
    entry_step = kTileN;
    if (split + 1 < args.num_splits)
      entry_end =
          static_cast<int>(min((int64_t)entry_end, begin + (int64_t)args.split_tiles * kTileN));
  } else {
    entry_begin = split * kTileN;
    entry_step = args.num_splits * kTileN;
  }
  const int num_tiles =
      entry_end > entry_begin ? (entry_end - entry_begin + entry_step - 1) / entry_step : 0;

  const KVTileSource source =
      kv_tile_source<KV>(p, at.seq_index, kv_head, 0, 0, entry_step, 0, v_column0);
  ListedKeyTiles<Traits, KV> tiles(source, k_smem, v_smem, tid,
                                   args.listed_positions + static_cast<int64_t>(token) * p.topk,
                                   entry_begin, entry_end, entry_step, seen,
                                   reinterpret_cast<int32_t*>(v_smem + Traits::kVSmemElements));

  auto q_offset = [](int r, int ch) { return tile_offset<D, Traits::kSwizzle>(r, ch); };
  WarpSoftmaxState<Traits> state;
  state.reset();
  uint32_t q_frag[Traits::kQInRegisters ? D / 16 : 1][4];
  auto load_q_fragment = [&](int ks, uint32_t (&a)[4]) {
    if constexpr (Traits::kFp8) {  // f16 by then (query_tile_to_f16)
      load_fp8_query_fragment(reinterpret_cast<const __half*>(q_smem), 0, lane, ks, q_offset, a);
    } else {
      const int r = (lane % 8) + ((lane / 8) % 2) * 8;
      const int ch = ks * 2 + lane / 16;
      ldmatrix_x4(shared_address(q_smem + q_offset(r, ch)), a);
    }
  };

  // The token's rows of the kv head: row r is q head kv_head * group + r (load_query_rows with
  // the token as the first new token of a one-token sequence).
  load_query_rows<T, kBlockRows, kChunks, kThreads>(p, q_smem, tid, token, row0, num_rows, group,
                                                    kv_head, q_offset);
  // The decode's pipeline: every stage issued, empty or not, positions and pages a tile ahead
  // (from the ring: every stage's looked up before a barrier, then issued).
  if constexpr (ListedKeyTiles<Traits, KV>::kRing) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) tiles.lookup(s);
    __syncthreads();
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if constexpr (!ListedKeyTiles<Traits, KV>::kRing) tiles.lookup(s);
    if (s < num_tiles) tiles.issue(s);
    tiles.copies.commit();
  }
  if constexpr (ListedKeyTiles<Traits, KV>::kRing) {
    __syncthreads();  // tile 0's slot is looked up again (tile kStages) in the first iteration
  } else {
    tiles.lookup(kStages - 1);
  }

  const KvScales scales = kv_head_scales<Traits::kFp8>(p, kv_head);
  ScoreTransform transform = score_transform<kSoftcap>(p, args.scale_log2 * scales.k);
  const int warp_col0 = warp * kWarpTileN;
  const int lane_col = (lane % 4) * 2;

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int next = tile + kStages - 1;
    if (next < num_tiles) tiles.issue(next % kStages);
    tiles.copies.commit();
    tiles.lookup(next + 1);
    tiles.copies.wait();

    if constexpr (Traits::kFp8 && !std::is_same_v<T, __half>) {
      if (tile == 0) {
        const float restore =
            query_tile_to_f16<kBlockRows, kChunks, kThreads>(q_smem, tid, q_offset, sync_group);
        transform = score_transform<kSoftcap>(p, args.scale_log2 * scales.k * restore);
      }
    }
    if constexpr (Traits::kQInRegisters) {
      if (tile == 0) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) load_q_fragment(ks, q_frag[ks]);
      }
    }

    const int stage = tile % kStages;
    const int32_t* stage_seen = seen + stage * kTileN + warp_col0;
    attend_kv_tile<Traits, T, KV, kE5M2>(
        k_smem + stage * Traits::kTileElements, v_smem + stage * Traits::kVTileElements, warp_col0,
        lane,
        [&](int, int ks, uint32_t (&a)[4]) {
          if constexpr (Traits::kQInRegisters) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[e] = q_frag[ks][e];
          } else {
            load_q_fragment(ks, a);
          }
        },
        [] { return true; },
        [&](auto& s_acc) {
    // Every row is the same token: one mark per column.
#pragma unroll
          for (int nt = 0; nt < kWarpTileN / 8; ++nt) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              if (stage_seen[nt * 8 + lane_col + e] == 0) {
                s_acc[0][nt][e] = -INFINITY;
                s_acc[0][nt][2 + e] = -INFINITY;
              }
            }
          }
        },
        transform, state);
    sync_group();  // the next iteration's copy overwrites this stage
  }
  cp_async_wait<0>();
  finish_row_states(state, transform.exp_scale);

  // The warps' states merged through shared memory; one split writes its rows, more write their
  // normalized partial rows and log2-sum-exp for the merge kernel (the decode's epilogue).
  const bool poisoned = __syncthreads_or(tiles.poisoned) != 0 || at.seq.poisoned;
  MergedRows<Traits> merged = merge_warp_states<Traits>(reinterpret_cast<unsigned char*>(k_smem),
                                                        state, tid, num_rows - row0, sync_group);
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < MergedRows<Traits>::kItems; ++i) {
    const int row = row0 + MergedRows<Traits>::row(tid, i);
    if (row >= num_rows) continue;
    const int c = v_column0 + MergedRows<Traits>::column(tid, i) * 4;  // of the output row
    const float4 acc = merged.o[i];
    const float l = poison_sum(merged.l[i], poisoned);
    const int head = kv_head * group + row;
    if (args.num_splits == 1) {
      const FinishedRow finished = finish_row(merged.m[i], l, sink_log2(p, head));
      const float inv = finished.inv * scales.v;
      T* dst = out + (int64_t)token * p.out_stride_token + head * p.out_stride_head + c;
      uint2 packed;
      packed.x = pack_pair<T>(acc.x * inv, acc.y * inv);
      packed.y = pack_pair<T>(acc.z * inv, acc.w * inv);
      *reinterpret_cast<uint2*>(dst) = packed;
      if (c == 0) store_lse(p, token, head, finished.lse_log2);
    } else {
      // The sink joins once, in the merge kernel.
      const FinishedRow finished = finish_row(merged.m[i], l, -INFINITY);
      const float inv = finished.inv * scales.v;
      const int64_t index = ((int64_t)split * p.num_tokens + token) * p.num_q_heads + head;
      *reinterpret_cast<float4*>(args.partial_out + index * Traits::kHeadDimV + c) =
          make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
      if (c == 0) args.partial_lse[index] = finished.lse_log2;
    }
  }
}

// The listing pass, the attention kernel on the plan's splits, the merge kernel after more than
// one, and for a prefill the rows no sequence places for sure (query_rows.cuh) as NaN. D: q and
// k's head dim, DV: v's (the decode's 4-warp block, traits.h; a block per chunk of v's columns).
template <int D, int DV, typename T, typename KV>
LaunchStatus run_paged_topk(const PagedKernelArgs& args, cudaStream_t stream) {
  using Traits = DecodeTraits<D, sizeof(KV), DV>;
  const PagedAttentionParams& p = args.base;
  if (args.listed_positions == nullptr || args.topk_table_slots < 32 ||
      (args.topk_table_slots & (args.topk_table_slots - 1)) != 0 || args.topk_table_slots <= p.topk)
    return {"top-k: the listing pass needs its scratch and a table of more slots than entries"};
  if (p.topk > 0) {
    // 2048 entries in one step of 512 threads x 4 (the pass is latency-bound: one block a token).
    constexpr int kListingThreads = 512;
    constexpr int kListingBatch = 4;
    const int table_bytes = 2 * args.topk_table_slots * static_cast<int>(sizeof(int32_t));
    const cudaError_t error =
        cudaFuncSetAttribute(topk_listing_kernel<kListingThreads, kListingBatch>,
                             cudaFuncAttributeMaxDynamicSharedMemorySize, table_bytes);
    if (error != cudaSuccess)
      return {std::string("topk_listing_kernel: cudaFuncSetAttribute: ") +
              cudaGetErrorString(error)};
    topk_listing_kernel<kListingThreads, kListingBatch>
        <<<dim3(static_cast<unsigned>(p.num_tokens)), kListingThreads, table_bytes, stream>>>(args);
    const LaunchStatus listed = status_after_launch("topk_listing_kernel");
    if (!listed.ok()) return listed;
  }

  auto pick = [&](auto e5m2) {
    constexpr bool kE5M2 = decltype(e5m2)::value;
    return p.softcap > 0.f ? paged_topk_kernel<Traits, T, KV, Softcap::kRunningMax, kE5M2>
                           : paged_topk_kernel<Traits, T, KV, Softcap::kOff, kE5M2>;
  };
  auto kernel = pick(std::false_type{});
  if constexpr (Traits::kFp8) {
    if (p.kv_dtype == ScalarType::kFloat8E5M2) kernel = pick(std::true_type{});
  }
  const int group = p.num_q_heads / p.num_kv_heads;
  const int64_t items = (int64_t)p.num_tokens * p.num_kv_heads * Traits::kVChunks;
  if (items > INT32_MAX) return {"top-k: too many tokens x kv heads for one launch"};
  const cudaError_t error = cudaFuncSetAttribute(
      kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Traits::kBlockSmemBytes);
  if (error != cudaSuccess)
    return {std::string("paged_topk_kernel: cudaFuncSetAttribute: ") + cudaGetErrorString(error)};
  const dim3 grid(static_cast<unsigned>(items),
                  static_cast<unsigned>((group + Traits::kBlockRows - 1) / Traits::kBlockRows),
                  static_cast<unsigned>(args.num_splits));
  kernel<<<grid, Traits::kBlockThreads, Traits::kBlockSmemBytes, stream>>>(args);
  LaunchStatus status = status_after_launch("paged_topk_kernel");
  if (status.ok() && args.num_splits > 1) status = launch_paged_decode_merge<T, DV>(args, stream);
  if (status.ok() && args.query_start_loc != nullptr)
    status = launch_unplaced_rows_poison(args, stream, /*dependent=*/false);
  return status;
}

}  // namespace astr::kernels
