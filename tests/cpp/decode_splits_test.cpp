// The decode's split-KV rule (csrc/kernels/paged_decode_splits.h), on the shapes it was measured
// on: an H200 (132 SMs x 2 decode blocks at D = 128), Hq = 32, Hkv = 8, so one row tile per
// (sequence, kv head) pair, kv tiles of 64 positions.
#include <gtest/gtest.h>

#include <cstdint>

#include "paged_attention_traits.h"
#include "paged_decode_splits.h"

namespace {

using astrai::kernels::decode_block_pairs_fill_gpu;
using astrai::kernels::decode_eight_warp_blocks_pay;
using astrai::kernels::decode_splits_filling_one_wave;

constexpr int64_t kH200Slots = 132 * 2;
constexpr int64_t pairs(int64_t batch, int64_t kv_heads = 8) { return batch * kv_heads; }
constexpr int64_t tiles(int64_t length) { return (length + 63) / 64; }

TEST(DecodeSplits, AsManyAsFitTheGridIntoOneWave) {
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(16), kH200Slots, tiles(2048)), 2);
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(12), kH200Slots, tiles(4096)), 2);
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(10), kH200Slots, tiles(8192)), 3);
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(8), kH200Slots, tiles(4096)), 4);
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(1), kH200Slots, tiles(32768)), 33);
}

TEST(DecodeSplits, OneSplitOnceTheBatchAloneFillsMostOfAWave) {
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(24), kH200Slots, tiles(2048)), 1);
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(64), kH200Slots, tiles(4096)), 1);
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(32, 32), kH200Slots, tiles(4096)), 1);
}

TEST(DecodeSplits, NeverMoreSplitsThanTilesNorMoreThan256) {
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(1), kH200Slots, tiles(512)), 8);
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(1), kH200Slots, tiles(64)), 1);
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(1), kH200Slots, tiles(1)), 1);
  EXPECT_EQ(decode_splits_filling_one_wave(1, 100000, 100000), 256);
}

TEST(DecodeSplits, DegenerateShapesTakeOneSplit) {
  EXPECT_EQ(decode_splits_filling_one_wave(0, kH200Slots, tiles(4096)), 1);
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(16), 0, tiles(4096)), 1);
  EXPECT_EQ(decode_splits_filling_one_wave(pairs(16), kH200Slots, 0), 1);
}

TEST(DecodeBlockPairs, TakeMoreThanTwoThirdsOfTheSms) {
  EXPECT_TRUE(decode_block_pairs_fill_gpu(pairs(16), 132));   // 128 pair blocks
  EXPECT_TRUE(decode_block_pairs_fill_gpu(pairs(12), 132));   // 96, measured faster than 2 blocks
  EXPECT_FALSE(decode_block_pairs_fill_gpu(pairs(11), 132));  // 88 = 2/3 of 132
  EXPECT_FALSE(decode_block_pairs_fill_gpu(pairs(8), 132));   // 64, measured 1.26x slower
  EXPECT_FALSE(decode_block_pairs_fill_gpu(0, 132));
  EXPECT_FALSE(decode_block_pairs_fill_gpu(pairs(16), 0));
}

TEST(DecodeBlockPairs, EveryTwoSplitGridOfTheRuleIsFilled) {
  // Wherever the one-wave rule gives 2 splits, the pairs cover more than 2/3 of the SMs.
  int two_split_grids = 0;
  for (int64_t blocks = 1; blocks <= 400; ++blocks) {
    if (decode_splits_filling_one_wave(blocks, kH200Slots, tiles(32768)) != 2) continue;
    ++two_split_grids;
    EXPECT_TRUE(decode_block_pairs_fill_gpu(blocks, 132)) << blocks;
  }
  EXPECT_EQ(two_split_grids, 132 - 88);  // 89 to 132 pair blocks
}

TEST(DecodeEightWarpBlocks, ReplaceThePairsUpTo16384Positions) {
  EXPECT_TRUE(decode_eight_warp_blocks_pay(2048));
  EXPECT_TRUE(decode_eight_warp_blocks_pay(16384));  // measured 0.5% faster
  EXPECT_FALSE(decode_eight_warp_blocks_pay(16385));
  EXPECT_FALSE(decode_eight_warp_blocks_pay(32768));  // level on average: the pairs stay
  EXPECT_FALSE(decode_eight_warp_blocks_pay(0));
}

TEST(DecodePersistentBlocks, RunAtThreeRoundsOfOneItemPerSmAndFromFive) {
  using astrai::kernels::decode_persistent_blocks_pay;
  // 132 SMs: the measured batch sizes at Hkv = 8 (items = 8 B), rounds = ceil(items / 132).
  EXPECT_FALSE(decode_persistent_blocks_pay(192, 132));  // B=24: 2 rounds
  EXPECT_FALSE(decode_persistent_blocks_pay(256, 132));  // B=32: 2
  EXPECT_TRUE(decode_persistent_blocks_pay(320, 132));   // B=40: 3
  EXPECT_TRUE(decode_persistent_blocks_pay(384, 132));   // B=48: 3
  EXPECT_FALSE(decode_persistent_blocks_pay(448, 132));  // B=56: 4
  EXPECT_FALSE(decode_persistent_blocks_pay(512, 132));  // B=64: 4
  EXPECT_TRUE(decode_persistent_blocks_pay(640, 132));   // B=80: 5
  EXPECT_TRUE(decode_persistent_blocks_pay(768, 132));   // B=96: 6
  EXPECT_TRUE(decode_persistent_blocks_pay(896, 132));   // B=112: 7
  EXPECT_TRUE(decode_persistent_blocks_pay(1024, 132));  // B=128: 8
  // One round or less is the split rule's (block pairs, eight-warp blocks); edges of a round.
  EXPECT_FALSE(decode_persistent_blocks_pay(132, 132));
  EXPECT_FALSE(decode_persistent_blocks_pay(100, 132));
  EXPECT_TRUE(decode_persistent_blocks_pay(265, 132));
  EXPECT_TRUE(decode_persistent_blocks_pay(396, 132));
  EXPECT_FALSE(decode_persistent_blocks_pay(397, 132));  // 4 rounds
  EXPECT_TRUE(decode_persistent_blocks_pay(529, 132));   // 5
  EXPECT_FALSE(decode_persistent_blocks_pay(1000, 0));
}

// The rule's slots assume 2 single decode blocks per SM at D = 128 (4 at D = 64) and a block pair
// in place of both (paged_attention_traits.h, with an H200 SM's shared-memory figures).
using astrai::kernels::kBlockSharedMemoryLimitBytes;
TEST(DecodeResidency, OnePersistentBlockPerSmAtHeadDim128) {
  using Eight = astrai::kernels::PagedAttentionTraits<128, true, 1, 8>;
  using Layout = astrai::kernels::PersistentDecodeLayout<Eight>;
  EXPECT_LE(Layout::kSmemBytes, kBlockSharedMemoryLimitBytes);
  EXPECT_GT(Layout::kSmemBytes, 163 * 1024);  // not on an A100: the rule never asks there
  EXPECT_EQ(Layout::kSmemBytes, 209984);      // tests/kernels' persistent_decode_fits
}

constexpr int resident(int block_bytes) {
  return astrai::kernels::kSmSharedMemoryBytes /
         (block_bytes + astrai::kernels::kSharedMemoryReservedPerBlock);
}

TEST(DecodeResidency, TwoSingleBlocksOrOnePairPerSmAtHeadDim128) {
  using Single = astrai::kernels::PagedAttentionTraits<128, true>;
  using Pair = astrai::kernels::PagedAttentionTraits<128, true, 2>;
  EXPECT_EQ(Single::kStages, 2);
  EXPECT_EQ(Single::kBlocksPerSm, 2);
  EXPECT_EQ(resident(Single::kBlockSmemBytes), 2);  // a third does not fit beside 2
  EXPECT_EQ(resident(Pair::kBlockSmemBytes), 1);
  EXPECT_LE(Pair::kBlockSmemBytes, kBlockSharedMemoryLimitBytes);
}

TEST(DecodeResidency, OneEightWarpBlockPerSmAtHeadDim128) {
  using Eight = astrai::kernels::PagedAttentionTraits<128, true, 1, 8>;
  EXPECT_EQ(Eight::kTileN, 128);  // 16 positions per warp, as in every decode group
  EXPECT_EQ(Eight::kStages, 2);
  EXPECT_TRUE(Eight::kPageIdRing);
  EXPECT_FALSE((astrai::kernels::PagedAttentionTraits<128, true>::kPageIdRing));
  EXPECT_EQ(Eight::kBlocksPerSm, 1);
  EXPECT_EQ(resident(Eight::kBlockSmemBytes), 1);
  EXPECT_LE(Eight::kBlockSmemBytes, kBlockSharedMemoryLimitBytes);
  EXPECT_LE(Eight::kBlockSmemBytes, 163 * 1024);  // fits an A100's block too
  EXPECT_EQ(Eight::kMinBlocksPerSm, 0);           // 256 threads x 255 registers fit 64 K
}

TEST(DecodeResidency, FourBlocksPerSmAtHeadDim64) {
  using D64 = astrai::kernels::PagedAttentionTraits<64, true>;
  EXPECT_EQ(D64::kStages, 2);
  EXPECT_EQ(D64::kBlocksPerSm, 4);
  EXPECT_EQ(resident(D64::kBlockSmemBytes), 4);  // a fifth does not fit beside 4
  EXPECT_GT(D64::kBlockSmemBytes, D64::kSmemBytes);
  EXPECT_EQ(D64::kMinBlocksPerSm, 4);  // registers: at most 128 per thread
}

TEST(DecodeResidency, OneBlockPerSmAtHeadDim256) {
  using D256 = astrai::kernels::PagedAttentionTraits<256, true>;
  EXPECT_EQ(D256::kBlockSmemBytes, D256::kSmemBytes);
  EXPECT_EQ(D256::kBlocksPerSm, 1);
  EXPECT_EQ(resident(D256::kBlockSmemBytes), 1);
}

TEST(DecodeResidency, LaunchBoundsOnlyWhereRegistersWouldLimitResidency) {
  EXPECT_EQ((astrai::kernels::PagedAttentionTraits<128, true>::kMinBlocksPerSm), 0);
  EXPECT_EQ((astrai::kernels::PagedAttentionTraits<128, true, 2>::kMinBlocksPerSm), 0);
  EXPECT_EQ((astrai::kernels::PagedAttentionTraits<256, true>::kMinBlocksPerSm), 0);
  EXPECT_EQ((astrai::kernels::PagedAttentionTraits<128, false>::kMinBlocksPerSm), 0);
}

}  // namespace
