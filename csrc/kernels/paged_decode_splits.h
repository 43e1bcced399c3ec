// How many splits of its kv range each (sequence, kv head, row tile) of a decode gets: the rule,
// apart from CUDA so that it is unit-tested on any machine (tests/cpp/decode_splits_test.cpp).
//
// Shapes only, never seq_lens' values: one launch configuration (and one captured CUDA graph)
// serves every length up to the block table's width. The rule: as many splits as fit the whole
// grid into one wave of resident blocks, at least 1, at most one per kv tile and 256. A second
// wave costs more than the unused slots of one (its blocks start cold, and every extra split adds
// a partial state to merge): measured on the H200 (132 SMs x 2 blocks, bf16, Hq=32, Hkv=8, D=128,
// page 16, benchmarks/sweep_decode_splits.py, us; the earlier rule, waves x (tiles per split + 1),
// chose more splits and a merge kernel wherever a few waves of short splits looked cheaper):
//
//   B, L      pairs  this rule           earlier rule  other counts
//   12, 2048     96  2 (cluster): 32.1   8: 39.0       1: 39.2
//   12, 4096     96  2 (cluster): 56.3   8: 61.4       4: 62.9
//   24, 2048    192  1: 54.8             4: 62.0       2 (cluster): 61.0
//   8, 4096      64  4: 41.1             4             3: 41.6, 2 (cluster): 43.1
//   10, 8192     80  3: 87.5             3             6: 89.6, 2 (cluster): 92.3
//   16, 2048    128  2 (cluster): 38.5   2             1: 41.4, 4: 44.6
//
// pairs = (sequence, kv head) pairs. From B = 33 up (Hkv = 8) one split, as before (B=64 L=4096,
// an earlier sweep: 1 split 243.6 us, 2 splits 249.1).
#pragma once

#include <algorithm>
#include <cstdint>

namespace astrai::kernels {

// blocks_per_split: the decode blocks that one split of every (sequence, kv head, row tile)
// takes; resident_slots: decode blocks the GPU runs at once (SMs x blocks per SM); max_tiles: kv
// tiles of the longest sequence the block table can hold.
constexpr int decode_splits_filling_one_wave(int64_t blocks_per_split, int64_t resident_slots,
                                             int64_t max_tiles) {
  constexpr int64_t kMaxSplits = 256;
  if (blocks_per_split <= 0 || resident_slots <= 0 || max_tiles <= 1) return 1;
  const int64_t fitting = resident_slots / blocks_per_split;
  return static_cast<int>(std::clamp<int64_t>(std::min(fitting, max_tiles), 1, kMaxSplits));
}

// Whether block pairs (the 2 splits of a (sequence, kv head, row tile) as one block on one SM, see
// PagedAttentionTraits::kGroups) cover more than 2/3 of the SMs. Where they do not, 2 single blocks
// per pair spread over twice as many SMs stream faster (H200, B=8 L=32768 with 2 splits forced, 64
// pair blocks: 350 us as pairs, 278 us as 2 blocks and the merge kernel; one SM reads at most ~48
// GB/s). The one-wave rule above gives 2 splits only to grids of more than a third of the slots,
// which with 2 slots per SM is more than 2/3 of the SMs: always covered; forced counts need not be.
constexpr bool decode_block_pairs_fill_gpu(int64_t pair_blocks, int64_t num_sms) {
  return pair_blocks > 0 && num_sms > 0 && 3 * pair_blocks > 2 * num_sms;
}

}  // namespace astrai::kernels
