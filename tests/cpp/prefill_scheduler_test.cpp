// The persistent prefill's tile scheduler (csrc/kernels/paged_attention/prefill_tile_scheduler.h):
// every item handed out exactly once, longest first, over ragged batches with cached prefixes and
// with the GQA row packing of the prefill kernels.
#include <gtest/gtest.h>

#include <map>
#include <set>
#include <tuple>
#include <vector>

#include "prefill_tile_scheduler.h"

namespace astr::kernels {
namespace {

// The persistent kernel's blocks: 128 packed rows; kv tiles of 128 positions (D = 128 by boxes).
PrefillScheduleShape causal_shape(int num_seqs, int num_kv_heads, int group, int max_query_len) {
  PrefillScheduleShape shape;
  shape.num_seqs = num_seqs;
  shape.num_kv_heads = num_kv_heads;
  shape.group = group;
  shape.block_rows = 128;
  shape.tile_n = 128;
  shape.grid_row_tiles = static_cast<int>(prefill_grid_row_tiles(max_query_len, group, 128));
  shape.causal = true;
  return shape;
}

using Item = std::tuple<int, int, int>;  // sequence, kv head, row tile

// Every item of the order, in order.
std::vector<PrefillItem> items_in_order(const PrefillScheduleShape& shape,
                                        const std::vector<int32_t>& order) {
  std::vector<PrefillItem> items;
  const int count = static_cast<int>(order.size()) * shape.num_kv_heads;
  for (int i = 0; i < count; ++i) items.push_back(prefill_item(order.data(), i, shape));
  return items;
}

// The items a batch has: each sequence's row tiles that hold rows, for every kv head.
std::set<Item> expected_items(const PrefillScheduleShape& shape, const std::vector<int>& q_lens) {
  std::set<Item> items;
  for (int seq = 0; seq < shape.num_seqs; ++seq)
    for (int r = 0; r < prefill_sequence_row_tiles(shape, q_lens[seq]); ++r)
      for (int h = 0; h < shape.num_kv_heads; ++h) items.insert({seq, h, r});
  return items;
}

void expect_every_item_once(const PrefillScheduleShape& shape, const std::vector<int>& q_lens,
                            const std::vector<PrefillItem>& items) {
  std::multiset<Item> seen;
  for (const PrefillItem& item : items) seen.insert({item.seq, item.kv_head, item.row_tile});
  const std::set<Item> expected = expected_items(shape, q_lens);
  EXPECT_EQ(seen.size(), expected.size());
  for (const Item& item : expected) EXPECT_EQ(seen.count(item), 1u);
}

void expect_longest_first(const PrefillScheduleShape& shape, const std::vector<int>& q_lens,
                          const std::vector<int>& seq_lens, const std::vector<PrefillItem>& items) {
  for (size_t i = 1; i < items.size(); ++i) {
    const PrefillItem& a = items[i - 1];
    const PrefillItem& b = items[i];
    EXPECT_GE(prefill_row_tile_kv_tiles(shape, q_lens[a.seq], seq_lens[a.seq], a.row_tile),
              prefill_row_tile_kv_tiles(shape, q_lens[b.seq], seq_lens[b.seq], b.row_tile))
        << "item " << i;
  }
}

TEST(PrefillScheduler, OneCausalSequenceRunsItsLateRowTilesFirst) {
  // 2048 new tokens at GQA 4: 8192 rows, 64 row tiles of 32 tokens, tile r sees 32 (r + 1) keys.
  const PrefillScheduleShape shape = causal_shape(1, 8, 4, 2048);
  const std::vector<int> q_lens = {2048}, seq_lens = {2048};
  const std::vector<int32_t> order = prefill_schedule_order(shape, q_lens.data(), seq_lens.data());
  ASSERT_EQ(order.size(), 64u);
  // Row tiles 60-63 see 1952-2048 keys, 16 tiles each; row tiles 0-3 one tile.
  EXPECT_GE(order.front(), 60);
  EXPECT_LE(order.back(), 3);
  const std::vector<PrefillItem> items = items_in_order(shape, order);
  expect_every_item_once(shape, q_lens, items);
  expect_longest_first(shape, q_lens, seq_lens, items);
  // The kv heads of a row tile run side by side.
  for (int h = 0; h < 8; ++h) {
    EXPECT_EQ(items[h].row_tile, order.front());
    EXPECT_EQ(items[h].kv_head, h);
  }
}

TEST(PrefillScheduler, RaggedBatchWithCachedPrefixesRunsLongestFirst) {
  // New tokens and keys: a long cached prefix, a fresh prompt, one token, an empty sequence, a
  // short prompt after a short prefix.
  const std::vector<int> q_lens = {300, 1000, 1, 0, 77};
  const std::vector<int> seq_lens = {4396, 1000, 9000, 50, 277};
  const PrefillScheduleShape shape = causal_shape(5, 2, 4, 1000);
  const std::vector<int32_t> order = prefill_schedule_order(shape, q_lens.data(), seq_lens.data());
  const std::vector<PrefillItem> items = items_in_order(shape, order);
  expect_every_item_once(shape, q_lens, items);
  expect_longest_first(shape, q_lens, seq_lens, items);
  // The one-token sequence with 9000 cached keys (71 tiles) goes first, then the prefixed
  // prompt's tiles (4096 + 32 (r + 1) keys, up to 4396: 33 to 35 tiles), ahead of every tile of the
  // fresh prompt (at most 1000 keys).
  EXPECT_EQ(items.front().seq, 2);
  EXPECT_EQ(prefill_row_tile_kv_tiles(shape, 1, 9000, 0), 71);
  EXPECT_EQ(items[2].seq, 0);
  EXPECT_EQ(prefill_row_tile_kv_tiles(shape, 300, 4396, items[2].row_tile), 35);
  int last_prefixed = 0, first_fresh = static_cast<int>(items.size());
  for (int i = 0; i < static_cast<int>(items.size()); ++i) {
    if (items[i].seq == 0) last_prefixed = i;
    if (items[i].seq == 1) first_fresh = std::min(first_fresh, i);
  }
  EXPECT_LT(last_prefixed, first_fresh);
  // The empty sequence has no item.
  for (const PrefillItem& item : items) EXPECT_NE(item.seq, 3);
}

TEST(PrefillScheduler, RowTilesPackTokensTimesTheGroup) {
  // GQA 4: a 128-row tile holds 32 tokens x 4 q heads; 100 tokens are 400 rows, 4 tiles, the last
  // holding rows 384-399 (tokens 96-99). GQA 8: 16 tokens a tile, 7 tiles.
  PrefillScheduleShape shape = causal_shape(1, 1, 4, 100);
  EXPECT_EQ(prefill_sequence_row_tiles(shape, 100), 4);
  // Causal over 100 fresh tokens with 64-key tiles: tile 2 sees tokens up to 95 (96 keys, 2 tiles),
  // tile 3 up to 99 (100 keys, 2 tiles), tile 0 up to 31 (1 tile).
  shape.tile_n = 64;
  EXPECT_EQ(prefill_row_tile_kv_tiles(shape, 100, 100, 0), 1);
  EXPECT_EQ(prefill_row_tile_kv_tiles(shape, 100, 100, 2), 2);
  EXPECT_EQ(prefill_row_tile_kv_tiles(shape, 100, 100, 3), 2);
  EXPECT_EQ(prefill_row_tile_kv_tiles(shape, 100, 100, 4), 0);  // no rows
  shape = causal_shape(1, 1, 8, 100);
  EXPECT_EQ(prefill_sequence_row_tiles(shape, 100), 7);
  shape.tile_n = 16;
  // Tile 1: rows 128-255, tokens 16-31: keys up to 32 with 68 cached (100 keys).
  EXPECT_EQ(prefill_row_tile_kv_tiles(shape, 100, 168, 1), 100 / 16 + 1);
}

TEST(PrefillScheduler, NonCausalWindowAndMaskBoundTheWork) {
  PrefillScheduleShape shape = causal_shape(1, 1, 1, 1024);
  shape.causal = false;
  // Every row tile of a non-causal sequence sees all 1024 keys.
  for (int r = 0; r < 8; ++r) EXPECT_EQ(prefill_row_tile_kv_tiles(shape, 1024, 1024, r), 8);
  // A window of 100 behind each row: tile 4 (tokens 512-639) from 412 (tile 3) to the end.
  shape.causal = true;
  shape.window_left = 100;
  EXPECT_EQ(prefill_row_tile_kv_tiles(shape, 1024, 1024, 4), 2);
  // A mask of 200 columns ends every range there.
  shape.window_left = -1;
  shape.mask_kv_len = 200;
  EXPECT_EQ(prefill_row_tile_kv_tiles(shape, 1024, 1024, 7), 2);
}

TEST(PrefillScheduler, RowTilesStopAtTheGrid) {
  // A sequence of more new tokens than max_query_len (poisoned metadata) has the grid's row tiles
  // only: its rows past them are the unplaced-rows kernel's.
  const PrefillScheduleShape shape = causal_shape(2, 1, 1, 256);
  const std::vector<int> q_lens = {1000, 256}, seq_lens = {1000, 256};
  EXPECT_EQ(prefill_sequence_row_tiles(shape, 1000), 2);
  const std::vector<int32_t> order = prefill_schedule_order(shape, q_lens.data(), seq_lens.data());
  EXPECT_EQ(order.size(), 4u);
  EXPECT_LE(static_cast<int64_t>(order.size()) + kPrefillScheduleOrder,
            prefill_schedule_ints(shape.num_seqs, shape.grid_row_tiles));
  expect_every_item_once(shape, q_lens, items_in_order(shape, order));
}

TEST(PrefillScheduler, WorkPastTheLastBucketSharesIt) {
  EXPECT_EQ(prefill_work_bucket(0), 0);
  EXPECT_EQ(prefill_work_bucket(kPrefillWorkBuckets - 1), kPrefillWorkBuckets - 1);
  EXPECT_EQ(prefill_work_bucket(100000), kPrefillWorkBuckets - 1);
}

// Blocks of a grid take their items as the kernel's producers do: first their own, then claimed
// or round robin; every item goes to one block, and the claims hand them out in order.
TEST(PrefillScheduler, ClaimedAndRoundRobinHandOutEveryItemOnce) {
  constexpr int kItems = 1000;
  for (int grid : {1, 7, 132, 999, 1000}) {
    std::map<int64_t, int> owner;
    // Claimed: the blocks' atomics, in whatever order they come (here round the blocks).
    int counter = 0;
    std::vector<bool> done(grid, false);
    for (int b = 0; b < grid; ++b) owner[b] = b;
    for (bool any = true; any;) {
      any = false;
      for (int b = 0; b < grid; ++b) {
        if (done[b]) continue;
        const int64_t item = prefill_claimed_item(grid, counter++);
        if (item >= kItems) {
          done[b] = true;
          continue;
        }
        EXPECT_EQ(owner.count(item), 0u);
        owner[item] = b;
        any = true;
      }
    }
    EXPECT_EQ(owner.size(), static_cast<size_t>(kItems));
    std::map<int64_t, int> round_robin;
    for (int b = 0; b < grid; ++b)
      for (int k = 0; prefill_round_robin_item(b, grid, k) < kItems; ++k)
        EXPECT_TRUE(round_robin.emplace(prefill_round_robin_item(b, grid, k), b).second);
    EXPECT_EQ(round_robin.size(), static_cast<size_t>(kItems));
  }
}

}  // namespace
}  // namespace astr::kernels
