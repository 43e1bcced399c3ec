// Copies K/V tiles of one (sequence, kv head) from the paged pool into the shared-memory stages of
// the attention kernel, and waits for them (KV: the cache's element type, q's 16-bit type or an
// FP8 byte):
//
//   lookup(tile)        read the page ids of the tile's rows into registers (tile t of a block
//                       starts at kv position kv_begin + t * tile_step)
//   fetch_ids(tile)     Traits::kPageIdRing instead: start copying the tile's page ids into its
//                       slot of a ring in shared memory, landed with the next commit's step
//   read_row_page(tile), put_row_offsets(ring, tile, page), issue_rows(ring, tile, stage)
//                       a warp-specialised producer's ring of row offsets instead: one thread
//                       per row computes the row's K and V addresses, each copy reads its own
//   *_at(...)           fetch_ids and issue for another (sequence, kv head) and ring slot (the
//                       persistent decode, paged_decode_persistent_kernel.cuh)
//   issue(tile, stage)  start the copies of the tile into the stage (pages from the last lookup)
//   commit()            close the copies issued so far as one pipeline step
//   wait()              block until the oldest pending tile is in shared memory, visible to
//                       every thread
//
// A page id outside [0, num_pages) is never followed: every kernel checks the ids of its kv range
// once (prescan_page_ids, each id read by one thread) and sets the loader's `poisoned` flag (the
// kernel writes the rows of that sequence as NaN, variant.cuh); a copy only clamps its id into
// the pool. So no block-table value makes a copy read outside the pools; checked per copy, the
// compare cost the prefill 5-7% (benchmarks/results/decisions.md, "Page ids checked once").
//
// 16-byte cp.async per thread, kChunksPerRow threads per row; per row a thread computes only
// page * page stride + slot * slot stride (32-bit multiplies, byte strides checked by the
// launcher), the head and column part once. Where the threads do not divide into whole rows
// (D = 96: 12 chunks a row), each copy takes its own (row, chunk) of the tile instead. Rows past
// kv_end are zero-filled (their scores are masked, but P V multiplies them by 0 and 0 * NaN would
// be NaN). Shared rows follow the traits' layout: Traits::kWgmmaTiles (swizzled_128b_tile_offset,
// for wgmma), else Traits::kSwizzle and Traits::kRowStride (tile_offset); both in
// device_primitives.cuh. Bulk copies and TMA boxes measured no faster here (decisions.md, "K/V
// copies"); the warp-specialised prefill copies by TMA boxes instead (pool_tensor_map.h).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../common/device_primitives.cuh"
#include "params.h"
#include "traits.h"

namespace astr::kernels {

// What the loader needs to address one (sequence, kv head)'s rows of the pool.
struct KVTileSource {
  const char* k_head;  // k_cache + kv_head * k_stride_head, in bytes
  const char* v_head;
  int k_page_bytes, k_slot_bytes;  // byte strides; the launcher checks that they fit in int32
  int v_page_bytes, v_slot_bytes;
  const int32_t* block_table;  // this sequence's row of the block table
  int log2_page_size;
  int num_pages;         // page ids outside [0, num_pages) are not read
  int kv_begin, kv_end;  // this block's kv range
  int tile_step;         // kv positions from one of the block's tiles to the next
  // lookup() reads page ids of positions below lookup_end only: kv_end, or for decode the block
  // table's width in positions, so that the first lookups need not wait for seq_lens (page ids
  // of positions past kv_end are read but never used).
  int lookup_end;
};

// The pool addressing of one (sequence, kv head) and the block's tiles: kv_begin, kv_begin +
// tile_step, ... below kv_end, page ids looked up below lookup_end (KVTileSource); V's rows from
// column v_column0 (a block's chunk of v's columns, traits.h).
template <typename KV>
__device__ __forceinline__ KVTileSource kv_tile_source(const PagedAttentionParams& p, int seq,
                                                       int kv_head, int kv_begin, int kv_end,
                                                       int tile_step, int lookup_end,
                                                       int v_column0 = 0) {
  KVTileSource source;
  source.kv_begin = kv_begin;
  source.kv_end = kv_end;
  source.tile_step = tile_step;
  source.lookup_end = lookup_end;
  source.k_head =
      static_cast<const char*>(p.k_cache) + kv_head * p.k_stride_head * (int64_t)sizeof(KV);
  source.v_head = static_cast<const char*>(p.v_cache) +
                  (kv_head * p.v_stride_head + v_column0) * (int64_t)sizeof(KV);
  source.k_page_bytes = static_cast<int>(p.k_stride_page * sizeof(KV));
  source.k_slot_bytes = static_cast<int>(p.k_stride_slot * sizeof(KV));
  source.v_page_bytes = static_cast<int>(p.v_stride_page * sizeof(KV));
  source.v_slot_bytes = static_cast<int>(p.v_stride_slot * sizeof(KV));
  source.block_table = p.block_table + seq * p.block_table_stride;
  source.log2_page_size = p.log2_page_size;
  source.num_pages = p.num_pages;
  return source;
}

// The V tiles' shape: the traits' own where they tell v's head dim (PagedAttentionTraits:
// kVColumns, a block's chunk of v's columns), else K's (the wgmma prefills' traits, equal dims).
template <typename Traits, typename = void>
struct VTileShape {
  static constexpr int kChunksPerRow = Traits::kKVChunksPerRow;
  static constexpr int kTileElements = Traits::kTileElements;
  static constexpr int kColumns = Traits::kHeadDim;
  static constexpr bool kSwizzle = Traits::kKVSwizzle;
};
template <typename Traits>
struct VTileShape<Traits, std::void_t<decltype(Traits::kVColumns)>> {
  static constexpr int kChunksPerRow = Traits::kVChunksPerRow;
  static constexpr int kTileElements = Traits::kVTileElements;
  static constexpr int kColumns = Traits::kVColumns;
  static constexpr bool kSwizzle = Traits::kVSwizzle;
};

template <typename Traits, typename KV>
struct KVTileLoader {
  static constexpr int D = Traits::kHeadDim;
  static constexpr int kChunks = Traits::kKVChunksPerRow;
  static constexpr int kThreads = Traits::kThreads;
  static constexpr int kTileN = Traits::kTileN;
  static constexpr int kStages = Traits::kStages;
  // Each thread copies kCopies 16-byte chunks of the tile: where the threads divide into whole
  // rows, the same column of rows row0 + i * kRowsPerPass; otherwise chunk tid + i * kThreads of
  // the tile's rows read one after another.
  static constexpr int kCopies = kTileN * kChunks / kThreads;
  static constexpr bool kOneColumn = kThreads % kChunks == 0;
  static constexpr int kRowsPerPass = kOneColumn ? kThreads / kChunks : 0;
  static_assert((kTileN * kChunks) % kThreads == 0, "tile copy must divide evenly");
  static_assert(kOneColumn || !Traits::kPageIdRing, "page-id ring: one column per thread");
  // V's copies: the same rows and chunks as K's where a V row of the block has as many chunks
  // (every head dim but (192, 128) and 512's chunks of 256 columns), else their own, with their
  // own page ids (lookup reads both).
  using VShape = VTileShape<Traits>;
  static constexpr int kVChunks = VShape::kChunksPerRow;
  static constexpr bool kSameRows = kVChunks == kChunks;
  static constexpr int kVCopies = kTileN * kVChunks / kThreads;
  static constexpr bool kVOneColumn = kThreads % kVChunks == 0;
  static constexpr int kVRowsPerPass = kVOneColumn ? kThreads / kVChunks : 0;
  static_assert((kTileN * kVChunks) % kThreads == 0, "V tile copy must divide evenly");
  static_assert(kSameRows || !Traits::kWgmmaTiles, "V rows of their own: mma.sync tiles");

  // Page ids: one tile ahead in registers (lookup), or from the ring (fetch_ids): kIdSlots tiles
  // of kTileN ids, tile t in slot t % kIdSlots.
  static constexpr bool kIdRing = Traits::kPageIdRing;
  static constexpr int kIdSlots = Traits::kPageIdSlots;
  static_assert(!kIdRing || (kIdSlots >= 2 * kStages && (kIdSlots & (kIdSlots - 1)) == 0),
                "page-id ring: a power of two of at least 2 x kStages slots");
  static_assert(!kIdRing || kTileN <= kThreads, "page-id ring: one thread per id");

  KVTileSource src;
  KV* k_smem;
  KV* v_smem;
  const char* k_thread;  // k_head + this thread's column (kOneColumn)
  const char* v_thread;
  int row0, chunk, thread;
  int pages[kIdRing ? 1 : kCopies];
  int v_pages[kSameRows || kIdRing ? 1 : kVCopies];  // V's own rows' ids, without the ring
  int32_t* id_ring;                                  // kIdRing: [kIdSlots][kTileN]
  bool poisoned = false;  // prescan_page_ids met a page id outside the pool

  __device__ __forceinline__ KVTileLoader(const KVTileSource& source, KV* k_stages, KV* v_stages,
                                          int tid, int32_t* page_id_ring = nullptr)
      : src(source), k_smem(k_stages), v_smem(v_stages), id_ring(page_id_ring) {
    row0 = kOneColumn ? tid / kChunks : 0;
    chunk = kOneColumn ? tid % kChunks : 0;
    thread = tid;
    k_thread = thread_column(src.k_head);
    v_thread = kSameRows ? thread_column(src.v_head)
                         : src.v_head + (kVOneColumn ? tid % kVChunks : 0) * 16;
  }

  // Row and chunk of the V tile that V copy i of this thread takes, where V's rows are their own.
  __device__ __forceinline__ int v_copy_row(int i, int copier) const {
    if constexpr (kVOneColumn) return copier / kVChunks + i * kVRowsPerPass;
    return (copier + i * kThreads) / kVChunks;
  }
  __device__ __forceinline__ int v_copy_row(int i) const { return v_copy_row(i, thread); }
  __device__ __forceinline__ int v_copy_chunk(int i, int copier) const {
    if constexpr (kVOneColumn) return copier % kVChunks;
    return (copier + i * kThreads) % kVChunks;
  }

  // Row and chunk of the tile that copy i of this thread takes (copier: the thread's index, or a
  // copy of it the compiler cannot see through, issue_rows).
  __device__ __forceinline__ int copy_row(int i) const { return copy_row(i, thread); }
  __device__ __forceinline__ int copy_row(int i, int copier) const {
    if constexpr (kOneColumn) return copier / kChunks + i * kRowsPerPass;
    return (copier + i * kThreads) / kChunks;
  }
  __device__ __forceinline__ int copy_chunk(int i) const { return copy_chunk(i, thread); }
  __device__ __forceinline__ int copy_chunk(int i, int copier) const {
    if constexpr (kOneColumn) return copier % kChunks;
    return (copier + i * kThreads) % kChunks;
  }

  // Sets `poisoned` where a page id of the block's tiles lies outside the pool: positions
  // [kv_begin, kv_end) when the tiles follow each other (tile_step = kTileN), else each tile's
  // own kTileN positions (a split decode block's tiles kv_begin + t * tile_step, which start at
  // multiples of kTileN: a tile holds whole pages or lies in one). The kernel ORs the flag over
  // the block before it writes.
  __device__ __forceinline__ void prescan_page_ids() {
    if constexpr (Traits::kDecode) {  // split tiles: the decode's (powers of two)
      static_assert(is_power_of_two(kTileN), "decode tiles of whole pages");
      if (src.tile_step != kTileN) {
        const int log2_page = src.log2_page_size;
        const int log2_ids = max(0, ilog2(kTileN) - log2_page);  // page ids per tile, log2
        const int tiles = (src.kv_end - src.kv_begin + src.tile_step - 1) / src.tile_step;
        for (int i = thread; i < (tiles << log2_ids); i += kThreads) {
          const int pos = src.kv_begin + (i >> log2_ids) * src.tile_step +
                          ((i & ((1 << log2_ids) - 1)) << log2_page);
          if (pos < src.kv_end) poisoned |= outside_pool(src.block_table[pos >> log2_page]);
        }
        return;
      }
    }
    poisoned |= page_ids_outside_pool(src.block_table, src.kv_begin, src.kv_end);
  }
  // Whether a page id of positions [begin, end) of a block-table row lies outside the pool, each
  // id read by one thread of the group (this thread's share; OR the result over the group).
  __device__ __forceinline__ bool page_ids_outside_pool(const int32_t* block_table, int begin,
                                                        int end) const {
    bool outside = false;
    if (end <= begin) return outside;
    const int first = begin >> src.log2_page_size;
    const int last = ((end - 1) >> src.log2_page_size) + 1;
    for (int i = first + thread; i < last; i += kThreads) outside |= outside_pool(block_table[i]);
    return outside;
  }
  // Unsigned: negative ids too.
  __device__ __forceinline__ bool outside_pool(int32_t page) const {
    return static_cast<unsigned>(page) >= static_cast<unsigned>(src.num_pages);
  }

  __device__ __forceinline__ void lookup(int tile) {
    static_assert(!kIdRing, "lookup: page ids in registers");
    const int pos0 = src.kv_begin + tile * src.tile_step;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int pos = pos0 + copy_row(i);
      pages[i] = pos < src.lookup_end ? src.block_table[pos >> src.log2_page_size] : 0;
    }
    if constexpr (!kSameRows && !kIdRing) {
#pragma unroll
      for (int i = 0; i < kVCopies; ++i) {
        const int pos = pos0 + v_copy_row(i);
        v_pages[i] = pos < src.lookup_end ? src.block_table[pos >> src.log2_page_size] : 0;
      }
    }
  }

  // kIdRing: one thread per page id of the tile (tiles start at multiples of kTileN, so a tile
  // spans kTileN / page size pages, or one); ids past the block table's width read as 0.
  __device__ __forceinline__ void fetch_ids(int tile) { fetch_ids_at(src.block_table, tile, tile); }
  // The same for another sequence's row of the block table, into the ring slot of tile slot_tile
  // (the persistent decode's stream of tiles over several items).
  __device__ __forceinline__ void fetch_ids_at(const int32_t* block_table, int tile,
                                               int slot_tile) {
    static_assert(kIdRing, "fetch_ids: the page-id ring");
    const int log2_page = src.log2_page_size;
    const int count = max(1, kTileN >> log2_page);
    if (thread < count) {
      const int index = ((src.kv_begin + tile * src.tile_step) >> log2_page) + thread;
      const bool valid = index < (src.lookup_end >> log2_page);
      cp_async_4(shared_address(id_ring + (slot_tile & (kIdSlots - 1)) * kTileN + thread),
                 block_table + (valid ? index : 0), valid);
    }
  }

  // The row ring (a warp-specialised producer): instead of page ids, each row of a tile has its
  // K and V byte offsets from the head in shared memory (-1 past kv_end), computed once per row by
  // one thread, so that a copy costs a shared load and an add, not a page-id load, a clamp and
  // two wide multiplies (per copy they made the producer too slow: the consumers stalled on its
  // tiles). Ring: [slots][2][kTileN] int64, tile t in slot t % slots; a slot is rewritten two
  // tiles later at the earliest, after the producer's barrier.
  //
  // This thread's row's page id, read a tile ahead (0 past lookup_end or for threads past kTileN).
  __device__ __forceinline__ int32_t read_row_page(int tile) const {
    const int pos = src.kv_begin + tile * src.tile_step + thread;
    return thread < kTileN && pos < src.lookup_end ? src.block_table[pos >> src.log2_page_size] : 0;
  }
  template <int kSlots>
  __device__ __forceinline__ void put_row_offsets(int64_t* ring, int tile, int32_t page) const {
    if (thread >= kTileN) return;
    const int pos = src.kv_begin + tile * src.tile_step + thread;
    int64_t* slot_rows = ring + (tile % kSlots) * 2 * kTileN;
    int64_t k_offset = -1, v_offset = -1;
    if (pos < src.kv_end) {
      // An id outside the pool is clamped into it (prescan_page_ids has poisoned the rows).
      const int64_t clamped =
          min(static_cast<unsigned>(page), static_cast<unsigned>(src.num_pages) - 1u);
      const int slot = pos & ((1 << src.log2_page_size) - 1);
      k_offset = clamped * src.k_page_bytes + static_cast<int64_t>(slot) * src.k_slot_bytes;
      v_offset = clamped * src.v_page_bytes + static_cast<int64_t>(slot) * src.v_slot_bytes;
    }
    slot_rows[thread] = k_offset;
    slot_rows[kTileN + thread] = v_offset;
  }
  // The copies of a tile's K (kV false) or V rows into the stage (a warp-specialised kernel hands
  // each to its consumers on its own barrier). kUnroll: copies issued per loop step (all of them
  // unrolled, ptxas computes every address first: a producer short of registers spills). Where
  // the threads do not divide into whole rows (D = 96), each copy adds its own chunk's column.
  template <int kSlots, bool kV, int kUnroll = kCopies>
  __device__ __forceinline__ void issue_rows(const int64_t* ring, int tile, int stage) const {
    static_assert(Traits::kWgmmaTiles, "row ring: wgmma tiles");
    const int64_t* rows = ring + (tile % kSlots) * 2 * kTileN + (kV ? kTileN : 0);
    KV* dst = (kV ? v_smem : k_smem) + stage * Traits::kTileElements;
    const char* column = kV ? v_thread : k_thread;
    // Copies with their own chunk derive each copy's row and chunk from the thread index again
    // every tile (opaque_copy): hoisted out of the tile loop, 12 of each spilled the producer.
    const int copier = kOneColumn ? thread : static_cast<int>(opaque_copy(thread));
#pragma unroll kUnroll
    for (int i = 0; i < kCopies; ++i) {
      const int row = copy_row(i, copier);
      const int copy_column = copy_chunk(i, copier);
      const int64_t offset = rows[row];
      const char* src = kOneColumn ? column : column + copy_column * 16;
      cp_async_16(shared_address(dst + swizzled_128b_tile_offset<kTileN>(row, copy_column)),
                  src + (offset < 0 ? 0 : offset), offset >= 0);
    }
  }

  // This thread's column of a (sequence, kv head)'s rows: head + its 16-byte chunk (the row
  // start where copies take their own chunks).
  __device__ __forceinline__ const char* thread_column(const char* head) const {
    return head + chunk * 16;
  }

  __device__ __forceinline__ void issue(int tile, int stage) {
    issue_at(k_thread, v_thread, src.kv_end, tile, stage, tile);
  }
  // The same for another (sequence, kv head): its columns (thread_column) and kv end, page ids
  // from the ring slot of tile slot_tile.
  __device__ __forceinline__ void issue_at(const char* k_column, const char* v_column, int kv_end,
                                           int tile, int stage, int slot_tile) {
    const int pos0 = src.kv_begin + tile * src.tile_step;
    const int page_mask = (1 << src.log2_page_size) - 1;
    KV* k_dst = k_smem + stage * Traits::kTileElements;
    KV* v_dst = v_smem + stage * VShape::kTileElements;
    // D = 512 (V's rows their own, page ids from the ring) derives each copy's row and chunk from
    // the thread index again every tile (opaque_copy): hoisted out of the tile loop, the offsets
    // of its 48 copies spilled the decode.
    constexpr bool kOpaque = !kSameRows && kIdRing;
    const int copier = kOpaque ? static_cast<int>(opaque_copy(thread)) : thread;
    if constexpr (!kSameRows) {
      // V's own rows, then K's below.
      const int clamp = src.num_pages - 1;
#pragma unroll
      for (int i = 0; i < kVCopies; ++i) {
        const int row = v_copy_row(i, copier);
        const int pos = pos0 + row;
        const bool valid = pos < kv_end;
        int page = 0;
        if (valid) {
          if constexpr (kIdRing)
            page = id_ring[(slot_tile & (kIdSlots - 1)) * kTileN + (row >> src.log2_page_size)];
          else
            page = v_pages[i];
          page = static_cast<int>(min(static_cast<unsigned>(page), unsigned(clamp)));
        }
        const int slot = pos & page_mask;
        const int column = v_copy_chunk(i, copier);
        const char* v_base = kVOneColumn ? v_column : v_column + column * 16;
        const char* v_src =
            v_base + ((int64_t)page * src.v_page_bytes + (int64_t)(slot * src.v_slot_bytes));
        const int offset =
            tile_offset<VShape::kColumns, VShape::kSwizzle, Traits::kKVChunkElements>(row, column);
        cp_async_16(shared_address(v_dst + offset), v_src, valid);
      }
    }
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int row = copy_row(i, copier);
      const int pos = pos0 + row;
      // Rows past kv_end read nothing (zero fill); page 0 keeps their address a plain pool
      // address (their looked-up id may be anything). An id outside the pool is clamped into it
      // (prescan_page_ids has poisoned the rows).
      const bool valid = pos < kv_end;
      int page = 0;
      if (valid) {
        if constexpr (kIdRing)
          page = id_ring[(slot_tile & (kIdSlots - 1)) * kTileN + (row >> src.log2_page_size)];
        else
          page = pages[i];
        page = static_cast<int>(
            min(static_cast<unsigned>(page), static_cast<unsigned>(src.num_pages) - 1u));
      }
      const int slot = pos & page_mask;
      const int column = copy_chunk(i, copier);
      const char* k_base = kOneColumn ? k_column : k_column + column * 16;
      const char* v_base = kOneColumn ? v_column : v_column + column * 16;
      const char* k_src =
          k_base + ((int64_t)page * src.k_page_bytes + (int64_t)(slot * src.k_slot_bytes));
      const char* v_src =
          v_base + ((int64_t)page * src.v_page_bytes + (int64_t)(slot * src.v_slot_bytes));
      int offset;
      if constexpr (Traits::kWgmmaTiles)
        offset = swizzled_128b_tile_offset<kTileN>(row, column);
      else
        offset = tile_offset<D, Traits::kKVSwizzle, Traits::kKVChunkElements>(row, column);
      cp_async_16(shared_address(k_dst + offset), k_src, valid);
      if constexpr (kSameRows) cp_async_16(shared_address(v_dst + offset), v_src, valid);
    }
  }

  __device__ __forceinline__ void commit() { cp_async_commit(); }

  // Every step commits one group (empty or not), so "all but the newest kStages - 1 groups done"
  // means this tile (and the query tile, committed with the first step) has landed. The barrier
  // spans the loader's group of threads (Traits::kGroups).
  __device__ __forceinline__ void wait() {
    cp_async_wait<kStages - 1>();
    group_barrier<Traits::kGroups, kThreads>();
  }
};

}  // namespace astr::kernels
