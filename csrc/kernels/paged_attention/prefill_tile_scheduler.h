// The persistent prefill's tile scheduler (prefill_persistent_kernel.cuh): which (sequence, kv
// head, row tile) item each block of a grid of one block per SM takes, and in what order.
// Torch-free and CUDA-free but for the qualifiers, so that GoogleTest checks the order on the host
// (tests/cpp/prefill_scheduler_test.cpp) with the very functions the kernels call.
//
// Items. A prefill block owns block_rows packed query rows (row r of a sequence is new token
// r / group with q head kv_head * group + r % group: the GQA packing of variant.cuh) of one
// (sequence, kv head). A sequence of q_len new tokens has ceil(q_len * group / block_rows) row
// tiles, at most the grid's (max_query_len covers; rows past it are the unplaced-rows kernel's).
// A (sequence, row tile) pair is the same work for every kv head, so the order lists pairs and
// item i is pair order[i / num_kv_heads] with kv head i % num_kv_heads: the kv heads of a pair run
// side by side, and the kv range they read is the same positions of the same pages.
//
// Longest first. The work of a pair is the kv tiles its rows see (prefill_row_tile_kv_tiles: the
// kernel's range, block_kv_range of variant.cuh, in tiles of tile_n): the late row tiles of a
// causal sequence and the sequences with long cached prefixes see the most. The order sorts pairs
// by it, most first, so that the last items of the launch are the short ones and the blocks finish
// together (a grid that starts them in index order leaves a long item to the last wave). The sort
// is a counting sort over kPrefillWorkBuckets buckets of whole tiles (items of more tiles share
// the last bucket: past 2047 tiles, 131072 keys at 64 a tile, the order among them matters little).
// It runs on the device (a one-block kernel before the prefill reads seq_lens and query_start_loc,
// no host sync); on the device, pairs of one bucket land in the order their atomics come, which
// changes no result: every item is computed whole by one block, from its own rows and keys.
//
// Handing out. Block b takes item b first; then either the next item off a global counter
// (claimed: a block on a slow SM or with long items takes fewer), or items b + grid, b + 2 grid,
// ... (round robin: no atomic, for A/B runs). An index past the items ends the block's stream.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define ASTR_SCHEDULER_FN __host__ __device__ inline
#else
#define ASTR_SCHEDULER_FN inline
#endif

namespace astr::kernels {

// The persistent kernel's packed rows per item: two consumer warpgroups of 64 (wgmma's M).
inline constexpr int kPersistentPrefillRows = 128;

// What the order reads of a launch (shapes and host values only; the lengths come per sequence).
struct PrefillScheduleShape {
  int num_seqs = 0;
  int num_kv_heads = 0;
  int group = 1;           // q heads per kv head
  int block_rows = 0;      // packed rows per item
  int tile_n = 0;          // kv positions per tile of the kernel
  int grid_row_tiles = 0;  // row tiles per sequence the launch covers (prefill_grid_row_tiles)
  bool causal = false;     // is_causal without a tree mask (a tree mask sees to the sequence's end)
  int window_left = -1;    // -1: no window
  int mask_kv_len = -1;    // attn_mask's width; -1: no mask
};

// Row tiles that cover max_query_len tokens of group rows each (0 for an empty launch).
ASTR_SCHEDULER_FN int64_t prefill_grid_row_tiles(int64_t max_query_len, int group, int block_rows) {
  if (max_query_len <= 0 || group <= 0 || block_rows <= 0) return 0;
  return (max_query_len * group + block_rows - 1) / block_rows;
}

// Row tiles of a sequence of q_len new tokens (as the kernel clamps it: prefill_sequence), within
// the grid's.
ASTR_SCHEDULER_FN int prefill_sequence_row_tiles(const PrefillScheduleShape& shape, int q_len) {
  if (q_len <= 0) return 0;
  const int64_t rows = static_cast<int64_t>(q_len) * shape.group;
  const int64_t tiles = (rows + shape.block_rows - 1) / shape.block_rows;
  return static_cast<int>(tiles < shape.grid_row_tiles ? tiles : shape.grid_row_tiles);
}

// The kv tiles row tile `row_tile` of a sequence (q_len new tokens, seq_len keys) walks: from the
// tile holding its first visible position to its range's end (block_kv_range, variant.cuh; the
// kernel's count). Only the order reads it: an estimate that missed would cost time, not results.
ASTR_SCHEDULER_FN int prefill_row_tile_kv_tiles(const PrefillScheduleShape& shape, int q_len,
                                                int seq_len, int row_tile) {
  const int64_t num_rows = static_cast<int64_t>(q_len) * shape.group;
  const int64_t row0 = static_cast<int64_t>(row_tile) * shape.block_rows;
  if (row0 >= num_rows) return 0;
  const int64_t last_row =
      (row0 + shape.block_rows < num_rows ? row0 + shape.block_rows : num_rows);
  const int64_t first_token = row0 / shape.group;
  const int64_t last_token = (last_row - 1) / shape.group;
  const int64_t first_pos = static_cast<int64_t>(seq_len) - q_len;
  int64_t begin = 0, end = seq_len;
  if (shape.causal && first_pos + last_token + 1 < end) end = first_pos + last_token + 1;
  if (shape.mask_kv_len >= 0 && shape.mask_kv_len < end) end = shape.mask_kv_len;
  if (shape.window_left >= 0) {
    begin = first_pos + first_token - shape.window_left;
    if (begin < 0) begin = 0;
  }
  const int64_t kv_begin = begin / shape.tile_n * shape.tile_n;
  return end > kv_begin ? static_cast<int>((end - kv_begin + shape.tile_n - 1) / shape.tile_n) : 0;
}

// The counting sort's buckets: bucket w holds the pairs of w kv tiles (the last one, more too).
// 2048 ints of shared memory in the device's sort.
inline constexpr int kPrefillWorkBuckets = 2048;
ASTR_SCHEDULER_FN int prefill_work_bucket(int kv_tiles) {
  return kv_tiles < 0 ? 0 : kv_tiles < kPrefillWorkBuckets ? kv_tiles : kPrefillWorkBuckets - 1;
}

// The scheduler's workspace, int32: the claim counter, the number of items, then the order (one
// pair index, seq * grid_row_tiles + row tile, per pair with rows). Sized from shapes only.
inline constexpr int kPrefillScheduleCounter = 0;
inline constexpr int kPrefillScheduleItems = 1;
inline constexpr int kPrefillScheduleOrder = 2;
ASTR_SCHEDULER_FN int64_t prefill_schedule_ints(int64_t num_seqs, int64_t grid_row_tiles) {
  return kPrefillScheduleOrder + num_seqs * grid_row_tiles;
}

struct PrefillItem {
  int seq, kv_head, row_tile;
};
// Item `item` of the order (item < the workspace's item count).
ASTR_SCHEDULER_FN PrefillItem prefill_item(const int32_t* order, int item,
                                           const PrefillScheduleShape& shape) {
  const int pair = order[item / shape.num_kv_heads];
  return {pair / shape.grid_row_tiles, item % shape.num_kv_heads, pair % shape.grid_row_tiles};
}

// The k-th item block `block` of `grid` takes (k >= 1; its first is item `block`): round robin,
// or the claim'th item claimed from the counter (claim: the counter's value its atomic returned).
ASTR_SCHEDULER_FN int64_t prefill_round_robin_item(int block, int grid, int k) {
  return block + static_cast<int64_t>(k) * grid;
}
ASTR_SCHEDULER_FN int64_t prefill_claimed_item(int grid, int claim) {
  return static_cast<int64_t>(grid) + claim;
}

// Host: the order the device's sort builds, pairs of one bucket in pair order (the device's may
// differ there). q_lens and seq_lens: each sequence's new tokens and keys, as the kernel clamps
// them (prefill_sequence).
inline std::vector<int32_t> prefill_schedule_order(const PrefillScheduleShape& shape,
                                                   const int* q_lens, const int* seq_lens) {
  std::vector<int> starts(kPrefillWorkBuckets + 1, 0);  // counts, then each bucket's first slot
  auto for_each_pair = [&](auto&& f) {
    for (int seq = 0; seq < shape.num_seqs; ++seq) {
      const int row_tiles = prefill_sequence_row_tiles(shape, q_lens[seq]);
      for (int r = 0; r < row_tiles; ++r)
        f(seq * shape.grid_row_tiles + r,
          prefill_work_bucket(prefill_row_tile_kv_tiles(shape, q_lens[seq], seq_lens[seq], r)));
    }
  };
  for_each_pair([&](int, int bucket) { ++starts[bucket]; });
  // Most work first: bucket w starts after every pair of more tiles.
  int slot = 0;
  for (int w = kPrefillWorkBuckets - 1; w >= 0; --w) {
    const int count = starts[w];
    starts[w] = slot;
    slot += count;
  }
  std::vector<int32_t> order(slot);
  for_each_pair([&](int pair, int bucket) { order[starts[bucket]++] = pair; });
  return order;
}

}  // namespace astr::kernels
