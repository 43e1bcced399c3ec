// The plan of a paged attention call (csrc/kernels/paged_attention/plan.h): the decode's rules
// on the shapes they were measured on (an H200: 132 SMs x 2 decode blocks at D = 128; Hq = 32,
// Hkv = 8, so one row tile per (sequence, kv head) pair; kv tiles of 64 positions), the forms the
// plan picks from them, the tuning overrides and the prefill's kernel.
#include "plan.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>

#include "config.h"
#include "device_facts.h"
#include "traits.h"

namespace {

using astr::kernels::decode_block_pairs_fill_gpu;
using astr::kernels::decode_eight_warp_blocks_pay;
using astr::kernels::decode_splits_filling_one_wave;
using astr::kernels::DecodeForm;
using astr::kernels::DecodePlan;
using astr::kernels::DecodeShape;
using astr::kernels::DeviceFacts;
using astr::kernels::KernelTuning;
using astr::kernels::kTopkMaxEntries;
using astr::kernels::PrefillKernel;
using astr::kernels::topk_table_slots;
using astr::kernels::TopkPlan;
using astr::kernels::TopkShape;
using astr::kernels::testing::sm80_facts;
using astr::kernels::testing::sm90_facts;

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
  using astr::kernels::decode_persistent_blocks_pay;
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
using astr::kernels::kBlockSharedMemoryLimitBytes;
TEST(DecodeResidency, OnePersistentBlockPerSmAtHeadDim128) {
  using Eight = astr::kernels::PagedAttentionTraits<128, true, 1, 8>;
  using Layout = astr::kernels::PersistentDecodeLayout<Eight>;
  EXPECT_LE(Layout::kSmemBytes, kBlockSharedMemoryLimitBytes);
  EXPECT_GT(Layout::kSmemBytes, 163 * 1024);  // not on an A100: the rule never asks there
  EXPECT_EQ(Layout::kSmemBytes, 209984);      // tests/kernels' persistent_decode_fits
}

constexpr int resident(int block_bytes) {
  return astr::kernels::kSmSharedMemoryBytes /
         (block_bytes + astr::kernels::kSharedMemoryReservedPerBlock);
}

TEST(DecodeResidency, TwoSingleBlocksOrOnePairPerSmAtHeadDim128) {
  using Single = astr::kernels::PagedAttentionTraits<128, true>;
  using Pair = astr::kernels::PagedAttentionTraits<128, true, 2>;
  EXPECT_EQ(Single::kStages, 2);
  EXPECT_EQ(Single::kBlocksPerSm, 2);
  EXPECT_EQ(resident(Single::kBlockSmemBytes), 2);  // a third does not fit beside 2
  EXPECT_EQ(resident(Pair::kBlockSmemBytes), 1);
  EXPECT_LE(Pair::kBlockSmemBytes, kBlockSharedMemoryLimitBytes);
}

TEST(DecodeResidency, OneEightWarpBlockPerSmAtHeadDim128) {
  using Eight = astr::kernels::PagedAttentionTraits<128, true, 1, 8>;
  EXPECT_EQ(Eight::kTileN, 128);  // 16 positions per warp, as in every decode group
  EXPECT_EQ(Eight::kStages, 2);
  EXPECT_TRUE(Eight::kPageIdRing);
  EXPECT_FALSE((astr::kernels::PagedAttentionTraits<128, true>::kPageIdRing));
  EXPECT_EQ(Eight::kBlocksPerSm, 1);
  EXPECT_EQ(resident(Eight::kBlockSmemBytes), 1);
  EXPECT_LE(Eight::kBlockSmemBytes, kBlockSharedMemoryLimitBytes);
  EXPECT_LE(Eight::kBlockSmemBytes, 163 * 1024);  // fits an A100's block too
  EXPECT_EQ(Eight::kMinBlocksPerSm, 0);           // 256 threads x 255 registers fit 64 K
}

TEST(DecodeResidency, FourBlocksPerSmAtHeadDim64) {
  using D64 = astr::kernels::PagedAttentionTraits<64, true>;
  EXPECT_EQ(D64::kStages, 2);
  EXPECT_EQ(D64::kBlocksPerSm, 4);
  EXPECT_EQ(resident(D64::kBlockSmemBytes), 4);  // a fifth does not fit beside 4
  EXPECT_GT(D64::kBlockSmemBytes, D64::kSmemBytes);
  EXPECT_EQ(D64::kMinBlocksPerSm, 4);  // registers: at most 128 per thread
}

TEST(DecodeResidency, OneBlockPerSmAtHeadDim256) {
  using D256 = astr::kernels::PagedAttentionTraits<256, true>;
  EXPECT_EQ(D256::kBlockSmemBytes, D256::kSmemBytes);
  EXPECT_EQ(D256::kBlocksPerSm, 1);
  EXPECT_EQ(resident(D256::kBlockSmemBytes), 1);
}

TEST(DecodeResidency, LaunchBoundsOnlyWhereRegistersWouldLimitResidency) {
  EXPECT_EQ((astr::kernels::PagedAttentionTraits<128, true>::kMinBlocksPerSm), 0);
  EXPECT_EQ((astr::kernels::PagedAttentionTraits<128, true, 2>::kMinBlocksPerSm), 0);
  EXPECT_EQ((astr::kernels::PagedAttentionTraits<256, true>::kMinBlocksPerSm), 0);
  EXPECT_EQ((astr::kernels::PagedAttentionTraits<128, false>::kMinBlocksPerSm), 0);
}

// ---- The plan ------------------------------------------------------------------------------

DecodeShape decode(int batch, int64_t length, int head_dim = 128, int kv_heads = 8,
                   int window_left = -1) {
  DecodeShape shape;
  shape.num_seqs = batch;
  shape.num_q_heads = 32;
  shape.num_kv_heads = kv_heads;
  shape.head_dim = head_dim;
  shape.block_table_positions = length;
  shape.window_left = window_left;
  return shape;
}

DecodePlan plan(const DecodeShape& shape, const DeviceFacts& device = sm90_facts(),
                const char* tuning = "") {
  KernelTuning parsed;
  EXPECT_EQ(astr::kernels::parse_kernel_tuning(tuning, &parsed), "");
  return astr::kernels::plan_paged_decode(shape, device, parsed);
}

TEST(DecodePlan, OneWaveOfTwoSplitsRunsEightWarpBlocksUpTo16384Positions) {
  const DecodePlan p = plan(decode(16, 2048));
  EXPECT_EQ(p.form, DecodeForm::kEightWarps);
  EXPECT_EQ(p.num_splits, 1);
  EXPECT_EQ(p.workspace_floats, 0u);
}

TEST(DecodePlan, LongerTwoSplitGridsRunBlockPairs) {
  const DecodePlan p = plan(decode(16, 32768));
  EXPECT_EQ(p.form, DecodeForm::kBlockPairs);
  EXPECT_EQ(p.num_splits, 2);
}

TEST(DecodePlan, ManySplitsMergeInTheMergeKernelWithAWorkspace) {
  const DecodePlan p = plan(decode(1, 32768));
  EXPECT_EQ(p.form, DecodeForm::kSplit);
  EXPECT_EQ(p.num_splits, 33);
  EXPECT_EQ(p.workspace_floats, 33u * 1 * 32 * (128 + 1));
}

TEST(DecodePlan, RoundsOfItemsPickThePersistentDecodeAtThreeAndFromFive) {
  EXPECT_EQ(plan(decode(48, 4096)).form, DecodeForm::kPersistent);  // 384 items: 3 rounds
  EXPECT_EQ(plan(decode(64, 4096)).form, DecodeForm::kSplit);       // 512: 4 rounds, 4-warp
  const DecodePlan p = plan(decode(128, 2048));                     // 1024: 8 rounds
  EXPECT_EQ(p.form, DecodeForm::kPersistent);
  EXPECT_EQ(p.persistent_blocks, 132);
}

TEST(DecodePlan, TwoSplitsAtOtherHeadDimsMergeInAClusterOnHopper) {
  // D = 256: 1 block per SM, so 2 splits fill one wave at B = 8 (64 pairs, 128 blocks).
  EXPECT_EQ(plan(decode(8, 4096, 256)).form, DecodeForm::kCluster);
  // Before sm_90 there are no clusters: the merge kernel (an A100 has 108 slots of 1 block).
  const DecodePlan p = plan(decode(4, 4096, 256), sm80_facts());
  EXPECT_EQ(p.form, DecodeForm::kSplit);
  EXPECT_EQ(p.num_splits, 3);
  EXPECT_GT(p.workspace_floats, 0u);
}

TEST(DecodePlan, EveryBuiltHeadDimHasAPlan) {
  for (const auto& row : astr::kernels::kPagedHeadDims) {
    if (!astr::kernels::paged_head_dim_built(row.head_dim)) continue;
    for (int batch : {1, 16, 64, 128}) {
      DecodeShape shape = decode(batch, 4096, row.head_dim);
      shape.head_dim_v = row.head_dim_v;
      const DecodePlan p = plan(shape);
      EXPECT_EQ(p.error, "") << row.head_dim << "/" << row.head_dim_v;
      EXPECT_GE(p.num_splits, 1);
    }
  }
}

// A row's pair, not each dim alone: (192, 128) has kernels, (192, 192) and (128, 192) none.
TEST(DecodePlan, HeadDimsArePairsOfTheList) {
  if (!astr::kernels::paged_head_dim_built(192)) GTEST_SKIP() << "a development build";
  DecodeShape shape = decode(16, 4096, 192);
  shape.head_dim_v = 128;
  EXPECT_EQ(plan(shape).error, "");
  shape.head_dim_v = 0;  // equal: 192 / 192
  EXPECT_EQ(plan(shape).error, astr::kernels::unsupported_head_dim_message(192));
  shape.head_dim = 128;
  shape.head_dim_v = 192;
  EXPECT_EQ(plan(shape).error, astr::kernels::unsupported_head_dim_message(128, 192));
  EXPECT_NE(plan(shape).error.find("with v head_dim 192 (supported: "), std::string::npos);
}

// The split workspace holds partial output rows of v's head dim (and their lse).
TEST(DecodePlan, SplitWorkspaceRowsAreVsHeadDim) {
  if (!astr::kernels::paged_head_dim_built(192)) GTEST_SKIP() << "a development build";
  DecodeShape shape = decode(1, 32768, 192);
  shape.head_dim_v = 128;
  const DecodePlan p = plan(shape);
  ASSERT_GT(p.num_splits, 1);
  EXPECT_EQ(p.workspace_floats, static_cast<size_t>(p.num_splits) * 32 * (128 + 1));
}

// D = 512 runs a block per chunk of 256 v columns, so a batch fills the GPU with half the splits
// of D = 256's rule; its blocks need sm_90's shared memory.
TEST(DecodePlan, HeadDim512CountsItsColumnChunksAndNeedsSm90) {
  if (!astr::kernels::paged_head_dim_built(512)) GTEST_SKIP() << "a development build";
  const DecodePlan p512 = plan(decode(1, 32768, 512));
  const DecodePlan p256 = plan(decode(1, 32768, 256));
  ASSERT_EQ(p512.error, "");
  EXPECT_EQ(p512.num_splits, (p256.num_splits + 1) / 2);
  EXPECT_NE(plan(decode(1, 32768, 512), sm80_facts()).error.find("needs sm_90"), std::string::npos);
  EXPECT_NE(astr::kernels::plan_paged_prefill(512, sm80_facts(), {}).error.find("needs sm_90"),
            std::string::npos);
}

// v's head dim other than q/k's: the mma.sync prefill (no wgmma form compiled), and an FP8 cache
// read as bytes (the dequantizing pass takes one head dim), whatever the scratch or the tuning.
TEST(PrefillPlan, DifferentVHeadDimRunsMmaSyncReadingFp8) {
  if (!astr::kernels::paged_head_dim_built(192)) GTEST_SKIP() << "a development build";
  KernelTuning dequantize_first;
  dequantize_first.fp8_prefill = astr::kernels::Fp8Prefill::kDequantizeFirst;
  for (const KernelTuning& tuning : {KernelTuning{}, dequantize_first}) {
    const astr::kernels::PrefillPlan p =
        astr::kernels::plan_paged_prefill(192, sm90_facts(), tuning, int64_t{1024}, {}, false, 128);
    EXPECT_EQ(p.error, "");
    EXPECT_EQ(p.kernel, astr::kernels::PrefillKernel::kMmaSync);
    EXPECT_FALSE(p.dequantize_fp8_first);
  }
  EXPECT_TRUE(astr::kernels::plan_paged_prefill(512, sm90_facts(), KernelTuning{}, int64_t{1024})
                  .dequantize_fp8_first);
}

TEST(DecodePlan, AnUnsupportedHeadDimNamesWhatIsSupported) {
  const DecodePlan p = plan(decode(16, 4096, 80));
  EXPECT_EQ(p.error, astr::kernels::unsupported_head_dim_message(80));
  EXPECT_NE(p.error.find("unsupported head_dim 80 (supported: "), std::string::npos);
}

TEST(DecodePlan, AWindowBoundsTheSplitsByTheWindowNotTheTable) {
  // B = 1 over a 32768-position table with a 1024-position window: the tiles of the window (and
  // one more) are split, as a table of that many positions would be.
  const DecodePlan windowed = plan(decode(1, 32768, 128, 8, 1023));
  const DecodePlan short_table = plan(decode(1, 1024 + 64));
  EXPECT_EQ(windowed.num_splits, short_table.num_splits);
  EXPECT_LT(windowed.num_splits, plan(decode(1, 32768)).num_splits);
}

TEST(DecodePlan, ForcedFormsRunWhereTheyCanAndFallBackWhereTheyCannot) {
  EXPECT_EQ(plan(decode(16, 2048), sm90_facts(), "decode_form=block_pairs").form,
            DecodeForm::kBlockPairs);
  EXPECT_EQ(plan(decode(16, 2048), sm90_facts(), "decode_form=cluster").form, DecodeForm::kCluster);
  const DecodePlan split =
      plan(decode(16, 2048), sm90_facts(), "decode_form=split,decode_splits=2");
  EXPECT_EQ(split.form, DecodeForm::kSplit);
  EXPECT_EQ(split.num_splits, 2);
  EXPECT_GT(split.workspace_floats, 0u);
  const DecodePlan persistent =
      plan(decode(4, 2048), sm90_facts(), "decode_form=persistent,persistent_blocks=3");
  EXPECT_EQ(persistent.form, DecodeForm::kPersistent);
  EXPECT_EQ(persistent.persistent_blocks, 3);
  // No persistent kernel at D = 64: the automatic choice runs.
  EXPECT_EQ(plan(decode(16, 2048, 64), sm90_facts(), "decode_form=persistent").form,
            plan(decode(16, 2048, 64)).form);
  // No cluster before sm_90.
  EXPECT_EQ(plan(decode(16, 2048), sm80_facts(), "decode_form=cluster").form, DecodeForm::kSplit);
}

TEST(DecodePlan, AForcedSplitCountKeepsItsCount) {
  for (int splits : {1, 3, 5, 32}) {
    const std::string tuning = "decode_splits=" + std::to_string(splits);
    EXPECT_EQ(plan(decode(4, 8192), sm90_facts(), tuning.c_str()).num_splits, splits);
  }
  // 2 forced splits merge as the rule's 2 would, but are not replaced by eight-warp blocks.
  EXPECT_EQ(plan(decode(16, 2048), sm90_facts(), "decode_splits=2").form, DecodeForm::kBlockPairs);
}

TEST(KernelTuning, ParsesEveryKeyAndRejectsWhatItCannotRead) {
  KernelTuning tuning;
  EXPECT_EQ(astr::kernels::parse_kernel_tuning(
                "decode_form=eight_warps,decode_splits=4,persistent_blocks=7,"
                "prefill_kernel=mma_sync",
                &tuning),
            "");
  EXPECT_EQ(tuning.decode_form, DecodeForm::kEightWarps);
  EXPECT_EQ(tuning.decode_splits, 4);
  EXPECT_EQ(tuning.persistent_blocks, 7);
  EXPECT_EQ(tuning.prefill_kernel, PrefillKernel::kMmaSync);
  for (const char* bad : {"decode_form=fast", "decode_splits=0", "decode_splits=x", "speed=1",
                          "decode_splits=70000"}) {
    KernelTuning unchanged = tuning;
    EXPECT_NE(astr::kernels::parse_kernel_tuning(bad, &unchanged), "") << bad;
    EXPECT_EQ(unchanged.decode_splits, 4) << bad;
  }
  EXPECT_EQ(astr::kernels::parse_kernel_tuning("", &tuning), "");
  EXPECT_EQ(tuning.decode_form, DecodeForm::kAuto);
}

TEST(PrefillPlan, TheWgmmaKernelTheHeadDimCompilesOnSm90aElseMmaSync) {
  KernelTuning automatic;
  // D = 128 compiles both wgmma prefills: the warp-specialised one runs, the first when asked.
  EXPECT_EQ(astr::kernels::plan_paged_prefill(128, sm90_facts(), automatic).kernel,
            PrefillKernel::kWarpSpecialized);
  EXPECT_EQ(astr::kernels::plan_paged_prefill(96, sm90_facts(), automatic).kernel,
            PrefillKernel::kWarpSpecialized);
  EXPECT_EQ(astr::kernels::plan_paged_prefill(64, sm90_facts(), automatic).kernel,
            PrefillKernel::kWarpSpecialized);
  EXPECT_EQ(astr::kernels::plan_paged_prefill(256, sm90_facts(), automatic).kernel,
            PrefillKernel::kWarpSpecialized);
  EXPECT_EQ(astr::kernels::plan_paged_prefill(128, sm80_facts(), automatic).kernel,
            PrefillKernel::kMmaSync);
  EXPECT_EQ(astr::kernels::plan_paged_prefill(64, sm80_facts(), automatic).kernel,
            PrefillKernel::kMmaSync);
  DeviceFacts no_sm90a = sm90_facts();
  no_sm90a.has_sm90a_code = false;
  EXPECT_EQ(astr::kernels::plan_paged_prefill(128, no_sm90a, automatic).kernel,
            PrefillKernel::kMmaSync);
  EXPECT_EQ(astr::kernels::plan_paged_prefill(64, no_sm90a, automatic).kernel,
            PrefillKernel::kMmaSync);
  KernelTuning mma_sync;
  mma_sync.prefill_kernel = PrefillKernel::kMmaSync;
  EXPECT_EQ(astr::kernels::plan_paged_prefill(128, sm90_facts(), mma_sync).kernel,
            PrefillKernel::kMmaSync);
  EXPECT_EQ(astr::kernels::plan_paged_prefill(64, sm90_facts(), mma_sync).kernel,
            PrefillKernel::kMmaSync);
  // A preference for a kernel the head dim does not compile gives the automatic choice.
  KernelTuning wgmma;
  wgmma.prefill_kernel = PrefillKernel::kWgmma;
  EXPECT_EQ(astr::kernels::plan_paged_prefill(64, sm90_facts(), wgmma).kernel,
            PrefillKernel::kWarpSpecialized);
  EXPECT_EQ(astr::kernels::plan_paged_prefill(128, sm90_facts(), wgmma).kernel,
            PrefillKernel::kWgmma);
  EXPECT_EQ(astr::kernels::plan_paged_prefill(96, sm90_facts(), wgmma).kernel,
            PrefillKernel::kWarpSpecialized);
  KernelTuning warp_specialized;
  warp_specialized.prefill_kernel = PrefillKernel::kWarpSpecialized;
  EXPECT_EQ(astr::kernels::plan_paged_prefill(96, sm90_facts(), warp_specialized).kernel,
            PrefillKernel::kWarpSpecialized);
  EXPECT_NE(astr::kernels::plan_paged_prefill(80, sm90_facts(), automatic).error, "");
}

TEST(PrefillPlan, AnFp8CacheIsDequantizedFirstWithinTheScratchLimitElseAKernelReadsTheBytes) {
  using astr::kernels::Fp8Prefill;
  using astr::kernels::kFp8ScratchLimitBytes;
  auto first = [](int head_dim, const DeviceFacts& device, const KernelTuning& tuning,
                  std::optional<int64_t> scratch) {
    return astr::kernels::plan_paged_prefill(head_dim, device, tuning, scratch)
        .dequantize_fp8_first;
  };
  KernelTuning automatic;
  // A 16-bit cache has nothing to dequantize.
  EXPECT_FALSE(first(128, sm90_facts(), automatic, std::nullopt));
  // The wgmma prefill (D = 128 on sm_90a): dequantized first up to the limit, bytes beyond.
  EXPECT_TRUE(first(128, sm90_facts(), automatic, 1));
  EXPECT_TRUE(first(128, sm90_facts(), automatic, kFp8ScratchLimitBytes));
  EXPECT_FALSE(first(128, sm90_facts(), automatic, kFp8ScratchLimitBytes + 1));
  // The mma.sync prefill (every head dim on the A100; D = 96 on the H200, where no wgmma kernel
  // reads FP8) reads the bytes too.
  EXPECT_FALSE(first(96, sm90_facts(), automatic, kFp8ScratchLimitBytes * 8));
  EXPECT_EQ(
      astr::kernels::plan_paged_prefill(96, sm90_facts(), automatic, kFp8ScratchLimitBytes * 8)
          .kernel,
      PrefillKernel::kMmaSync);
  EXPECT_FALSE(first(128, sm80_facts(), automatic, kFp8ScratchLimitBytes * 8));
  EXPECT_TRUE(first(128, sm80_facts(), automatic, kFp8ScratchLimitBytes));
  // The warp-specialised prefill (D = 64, 256 on the H200) reads 16-bit pages only: within the
  // limit it runs on dequantized pages, beyond it the mma.sync prefill reads the bytes.
  auto kernel = [](int head_dim, const KernelTuning& tuning, int64_t scratch) {
    return astr::kernels::plan_paged_prefill(head_dim, sm90_facts(), tuning, scratch).kernel;
  };
  EXPECT_TRUE(first(64, sm90_facts(), automatic, kFp8ScratchLimitBytes));
  EXPECT_EQ(kernel(64, automatic, kFp8ScratchLimitBytes), PrefillKernel::kWarpSpecialized);
  EXPECT_FALSE(first(256, sm90_facts(), automatic, kFp8ScratchLimitBytes + 1));
  EXPECT_EQ(kernel(256, automatic, kFp8ScratchLimitBytes + 1), PrefillKernel::kMmaSync);
  EXPECT_EQ(kernel(64, automatic, 0), PrefillKernel::kWarpSpecialized);
  // Forced either way.
  KernelTuning in_kernel;
  in_kernel.fp8_prefill = Fp8Prefill::kInKernel;
  EXPECT_FALSE(first(128, sm90_facts(), in_kernel, 1));
  EXPECT_EQ(kernel(128, in_kernel, 1), PrefillKernel::kWgmma);
  EXPECT_FALSE(first(64, sm90_facts(), in_kernel, 1));
  EXPECT_EQ(kernel(64, in_kernel, 1), PrefillKernel::kMmaSync);
  KernelTuning dequantize;
  dequantize.fp8_prefill = Fp8Prefill::kDequantizeFirst;
  EXPECT_TRUE(first(128, sm90_facts(), dequantize, kFp8ScratchLimitBytes * 8));
  EXPECT_EQ(kernel(64, dequantize, kFp8ScratchLimitBytes * 8), PrefillKernel::kWarpSpecialized);
  KernelTuning parsed;
  EXPECT_EQ(
      astr::kernels::parse_kernel_tuning("prefill_kernel=wgmma,fp8_prefill=in_kernel", &parsed),
      "");
  EXPECT_EQ(parsed.fp8_prefill, Fp8Prefill::kInKernel);
  EXPECT_NE(astr::kernels::parse_kernel_tuning("fp8_prefill=registers", &parsed), "");
}

TEST(PrefillPlan, TheWarpSpecializedKernelCopiesByTmaBoxesUnlessTunedToGather) {
  using astr::kernels::PrefillLoads;
  auto boxes = [](int head_dim, const DeviceFacts& device, const KernelTuning& tuning,
                  std::optional<int64_t> fp8_scratch = std::nullopt) {
    return astr::kernels::plan_paged_prefill(head_dim, device, tuning, fp8_scratch).pool_boxes;
  };
  KernelTuning automatic;
  EXPECT_TRUE(boxes(64, sm90_facts(), automatic));
  EXPECT_TRUE(boxes(64, sm90_facts(), automatic, 1));  // FP8 pages dequantized first: a 16-bit pool
  EXPECT_TRUE(boxes(96, sm90_facts(), automatic));     // rows of one and a half column blocks
  // Only the warp-specialised kernel copies by boxes.
  KernelTuning wgmma;
  wgmma.prefill_kernel = PrefillKernel::kWgmma;
  EXPECT_FALSE(boxes(128, sm90_facts(), wgmma));
  EXPECT_FALSE(boxes(64, sm80_facts(), automatic));
  EXPECT_FALSE(boxes(64, sm90_facts(), automatic, astr::kernels::kFp8ScratchLimitBytes + 1));
  KernelTuning gather;
  EXPECT_EQ(astr::kernels::parse_kernel_tuning("prefill_loads=cp_async", &gather), "");
  EXPECT_EQ(gather.prefill_loads, PrefillLoads::kCpAsync);
  EXPECT_FALSE(boxes(64, sm90_facts(), gather));
  KernelTuning tma;
  EXPECT_EQ(astr::kernels::parse_kernel_tuning("prefill_loads=tma", &tma), "");
  EXPECT_TRUE(boxes(256, sm90_facts(), tma));
  EXPECT_NE(astr::kernels::parse_kernel_tuning("prefill_loads=bulk", &tma), "");
}

TEST(PrefillPlan, BlocksGoInPanelsOfPairsWhoseKvFitsHalfTheL2) {
  using astr::kernels::PrefillKvFootprint;
  DeviceFacts device = sm90_facts();
  device.l2_cache_bytes = 50 << 20;
  auto panel = [&](int64_t pairs, int64_t positions, const KernelTuning& tuning = {}) {
    PrefillKvFootprint kv;
    kv.pairs = pairs;
    kv.bytes_per_pair = positions * 128 * 2 * 2;  // D = 128, K and V, bf16
    return astr::kernels::plan_paged_prefill(128, device, tuning, std::nullopt, kv).panel_pairs;
  };
  // 25 MB: 0.5 MB a pair at 1024 positions, 8 MB at 16384 (B=1, Hkv=8 reads 64 MB).
  EXPECT_EQ(panel(8, 16384), 3);
  EXPECT_EQ(panel(8, 8192), 6);
  EXPECT_EQ(panel(64, 5664), 9);  // the ragged benchmark batch: 8 sequences x 8 kv heads
  EXPECT_EQ(panel(16, 4096), 12);
  EXPECT_EQ(panel(8, 1024), 0);     // every pair fits: one panel (the order without panels)
  EXPECT_EQ(panel(4, 1 << 20), 1);  // one pair beyond the L2: panels of one
  EXPECT_EQ(panel(1, 1 << 20), 0);
  // No footprint, or no L2 known: one panel.
  EXPECT_EQ(astr::kernels::plan_paged_prefill(128, device, KernelTuning{}).panel_pairs, 0);
  device.l2_cache_bytes = 0;
  EXPECT_EQ(panel(8, 16384), 0);
  device.l2_cache_bytes = 50 << 20;
  // The tuning: a panel width, or all pairs.
  KernelTuning tuned;
  EXPECT_EQ(astr::kernels::parse_kernel_tuning("prefill_l2_panel=5", &tuned), "");
  EXPECT_EQ(panel(8, 1024, tuned), 5);
  EXPECT_EQ(panel(4, 1024, tuned), 0);  // 5 of 4 pairs: one panel
  EXPECT_EQ(astr::kernels::parse_kernel_tuning("prefill_l2_panel=all", &tuned), "");
  EXPECT_EQ(panel(8, 16384, tuned), 0);
  EXPECT_EQ(astr::kernels::parse_kernel_tuning("prefill_l2_panel=auto", &tuned), "");
  EXPECT_EQ(panel(8, 16384, tuned), 3);
  EXPECT_NE(astr::kernels::parse_kernel_tuning("prefill_l2_panel=0", &tuned), "");
  EXPECT_NE(astr::kernels::parse_kernel_tuning("prefill_l2_panel=wide", &tuned), "");
}

// ---- Verify: a prefill-mode call of few new tokens per sequence on the decode forms -----------

DecodeShape verify(int batch, int64_t length, int query_len, int head_dim = 128) {
  DecodeShape shape = decode(batch, length, head_dim);
  shape.query_len = query_len;
  shape.num_tokens = static_cast<int64_t>(batch) * query_len;
  return shape;
}

TEST(Verify, UpTo16NewTokensPerSequenceRunOnTheDecodeForms) {
  using astr::kernels::prefill_runs_as_verify;
  const KernelTuning automatic;
  for (int64_t max_query_len : {1, 2, 4, 8, 16})
    EXPECT_TRUE(prefill_runs_as_verify(max_query_len, automatic, false)) << max_query_len;
  EXPECT_FALSE(prefill_runs_as_verify(17, automatic, false));
  EXPECT_FALSE(prefill_runs_as_verify(4096, automatic, false));
  EXPECT_FALSE(prefill_runs_as_verify(0, automatic, false));
}

TEST(Verify, TheTuningForcesItAtAnyLengthOrNever) {
  using astr::kernels::prefill_runs_as_verify;
  KernelTuning always, never;
  EXPECT_EQ(astr::kernels::parse_kernel_tuning("verify_form=always", &always), "");
  EXPECT_EQ(astr::kernels::parse_kernel_tuning("verify_form=never", &never), "");
  EXPECT_TRUE(prefill_runs_as_verify(4096, always, false));
  EXPECT_FALSE(prefill_runs_as_verify(4, never, false));
  KernelTuning bad;
  EXPECT_NE(astr::kernels::parse_kernel_tuning("verify_form=sometimes", &bad), "");
}

TEST(Verify, RowsPackNewTokensTimesTheGroupIntoTilesOf16) {
  using astr::kernels::decode_items;
  // GQA 32/8: 4 rows per token; 8 drafts are 32 rows, 2 row tiles per (sequence, kv head).
  EXPECT_EQ(decode_items(16, 32, 8, 1), 16 * 8);
  EXPECT_EQ(decode_items(16, 32, 8, 4), 16 * 8);
  EXPECT_EQ(decode_items(16, 32, 8, 8), 16 * 8 * 2);
  EXPECT_EQ(decode_items(16, 32, 8, 16), 16 * 8 * 4);
  EXPECT_EQ(decode_items(2, 32, 32, 5), 2 * 32);  // MHA: 5 rows of one head in one tile
}

TEST(Verify, ThePlanSplitsItsItemsAsADecodeAndSizesTheWorkspaceByTokens) {
  // B = 16, 8 drafts: 256 items fill one wave alone: one split, no workspace.
  const DecodePlan wide = plan(verify(16, 8192, 8));
  EXPECT_EQ(wide.num_splits, 1);
  EXPECT_EQ(wide.workspace_floats, 0u);
  // B = 1, 4 drafts over 32768 positions: 8 items, the splits fill the wave, partial rows per
  // token.
  const DecodePlan narrow = plan(verify(1, 32768, 4));
  EXPECT_EQ(narrow.form, DecodeForm::kSplit);
  EXPECT_EQ(narrow.num_splits, 33);
  EXPECT_EQ(narrow.workspace_floats, 33u * 4 * 32 * (128 + 1));
}

TEST(Verify, NeverRunsThePersistentDecodeWhichTakesOneTokenPerSequence) {
  EXPECT_EQ(plan(decode(48, 4096)).form, DecodeForm::kPersistent);
  EXPECT_NE(plan(verify(48, 4096, 1)).form, DecodeForm::kPersistent);  // a prefill-mode call
  EXPECT_NE(plan(verify(12, 4096, 4)).form, DecodeForm::kPersistent);
  EXPECT_NE(plan(verify(12, 4096, 4), sm90_facts(), "decode_form=persistent").form,
            DecodeForm::kPersistent);
}

// ---- Sparse top-k attention: every query token an item, splits over its listed entries ---------

TopkShape topk_call(int64_t tokens, int64_t topk, int head_dim = 128, int kv_bytes = 2) {
  TopkShape shape;
  shape.num_tokens = tokens;
  shape.num_q_heads = 32;
  shape.num_kv_heads = 8;
  shape.head_dim = head_dim;
  shape.topk = topk;
  shape.kv_bytes = kv_bytes;
  return shape;
}

TopkPlan topk_plan(const TopkShape& shape, const char* tuning = "") {
  KernelTuning parsed;
  EXPECT_EQ(astr::kernels::parse_kernel_tuning(tuning, &parsed), "");
  return astr::kernels::plan_paged_topk(shape, sm90_facts(), parsed);
}

TEST(TopkPlan, FewTokensSplitTheirEntryTilesOverOneWaveAsADecodeSplitsItsKvTiles) {
  // 2048 entries: 32 tiles of 64 (16 of 128 over an FP8 cache). One token: 8 items.
  const TopkPlan one = topk_plan(topk_call(1, 2048));
  EXPECT_EQ(one.num_splits, 32);  // the one-wave rule allows 33, the tiles 32
  EXPECT_EQ(one.workspace_floats, 32u * 1 * 32 * (128 + 1));
  EXPECT_EQ(topk_plan(topk_call(1, 2048, 128, 1)).num_splits, 16);
  // 16 tokens: 128 items, two splits fill the wave.
  EXPECT_EQ(topk_plan(topk_call(16, 2048)).num_splits, 2);
  // A prefill's thousands of tokens fill it alone: one split, no workspace.
  const TopkPlan many = topk_plan(topk_call(4096, 2048));
  EXPECT_EQ(many.num_splits, 1);
  EXPECT_EQ(many.workspace_floats, 0u);
  EXPECT_EQ(describe_plan(one), "split x32");
}

TEST(TopkPlan, Qk192WithV128HasTopkKernelsWhoseWorkspaceHoldsRowsOfVsHeadDim) {
  TopkShape deepseek = topk_call(1, 2048, 192);
  deepseek.head_dim_v = 128;
  const TopkPlan plan = topk_plan(deepseek);
  EXPECT_EQ(plan.error, "");
  ASSERT_GT(plan.num_splits, 1);
  EXPECT_EQ(plan.workspace_floats, static_cast<size_t>(plan.num_splits) * 1 * 32 * (128 + 1));
}

// D = 512 runs a block per chunk of 256 v columns (as its decode does), so a token fills the GPU
// with fewer splits than D = 256 on the same entry tiles; its 216 KB block needs sm_90.
TEST(TopkPlan, HeadDim512CountsItsColumnChunksAndNeedsSm90) {
  if (!astr::kernels::paged_head_dim_built(512)) GTEST_SKIP() << "a development build";
  TopkShape gemma_global = topk_call(1, 2048, 512);
  const TopkPlan plan = topk_plan(gemma_global);
  ASSERT_EQ(plan.error, "");
  EXPECT_LT(plan.num_splits, topk_plan(topk_call(1, 2048, 256)).num_splits);
  EXPECT_EQ(plan.workspace_floats, static_cast<size_t>(plan.num_splits) * 1 * 32 * (512 + 1));
  KernelTuning none;
  EXPECT_EQ(astr::kernels::plan_paged_topk(gemma_global, sm80_facts(), none).error,
            "top-k: head_dim 512 needs sm_90 or newer");
}

TEST(TopkPlan, TheTuningForcesASplitCountAndBatchInvariantModeSplitsBy16Tiles) {
  EXPECT_EQ(topk_plan(topk_call(4096, 2048), "decode_splits=3").num_splits, 3);
  TopkShape invariant_call = topk_call(1, 2048);
  invariant_call.batch_invariant = true;
  const TopkPlan invariant = topk_plan(invariant_call);
  EXPECT_EQ(invariant.split_tiles, 16);
  EXPECT_EQ(invariant.num_splits, 2);
  EXPECT_EQ(describe_plan(invariant), "split x2 of 16 tiles");
  invariant_call.num_tokens = 4096;  // the batch changes nothing
  EXPECT_EQ(topk_plan(invariant_call).num_splits, 2);
}

TEST(TopkPlan, TheListingTableHoldsTwiceTheEntriesUpToItsLimit) {
  EXPECT_EQ(topk_table_slots(0), 32);
  EXPECT_EQ(topk_table_slots(16), 32);
  EXPECT_EQ(topk_table_slots(17), 64);
  EXPECT_EQ(topk_table_slots(2048), 4096);
  EXPECT_EQ(topk_table_slots(8192), 16384);
  EXPECT_EQ(topk_table_slots(kTopkMaxEntries), 16384);  // fewer slots than twice, more than once
  EXPECT_EQ(topk_table_slots(kTopkMaxEntries + 1), 0);
  EXPECT_EQ(topk_plan(topk_call(1, 2048)).table_slots, 4096);
  const TopkPlan wide = topk_plan(topk_call(1, kTopkMaxEntries + 1));
  EXPECT_NE(wide.error.find("at most 16383 entries"), std::string::npos) << wide.error;
  EXPECT_NE(topk_plan(topk_call(1, 64, 80)).error.find("unsupported head_dim 80"),
            std::string::npos);
}

// ---- Batch-invariant mode: what a sequence's rows go through depends on the sequence alone -----

DecodeShape invariant(DecodeShape shape) {
  shape.batch_invariant = true;
  return shape;
}

TEST(BatchInvariance, EveryDecodeRunsTheSplitFormWhateverTheBatch) {
  for (int batch : {1, 8, 16, 48, 64, 128}) {
    for (int head_dim : {64, 96, 128, 256}) {
      if (!astr::kernels::paged_head_dim_built(head_dim)) continue;
      for (const DeviceFacts& device : {sm90_facts(), sm80_facts()}) {
        const DecodePlan p = plan(invariant(decode(batch, 4096, head_dim)), device);
        EXPECT_EQ(p.error, "");
        EXPECT_EQ(p.form, DecodeForm::kSplit) << batch << " " << head_dim;
        EXPECT_EQ(p.split_tiles, astr::kernels::kInvariantSplitTiles);
        EXPECT_EQ(p.num_splits, 4) << batch << " " << head_dim;  // 64 tiles of 64 positions
      }
    }
  }
}

TEST(BatchInvariance, SplitsAreAFixedNumberOfConsecutiveTilesAsManyAsTheTableNeeds) {
  using astr::kernels::invariant_decode_splits;
  EXPECT_EQ(invariant_decode_splits(tiles(32768), 16), 32);
  EXPECT_EQ(invariant_decode_splits(tiles(32768 + 1), 16), 33);
  EXPECT_EQ(invariant_decode_splits(tiles(4096), 16), 4);
  const DecodePlan p = plan(invariant(decode(1, 32768)));
  EXPECT_EQ(p.num_splits, 32);
  EXPECT_EQ(p.workspace_floats, 32u * 1 * 32 * (128 + 1));
  // An FP8 cache's tiles are twice as long: half as many splits over the same positions.
  DecodeShape fp8 = invariant(decode(1, 32768));
  fp8.kv_bytes = 1;
  EXPECT_EQ(plan(fp8).num_splits, 16);
}

TEST(BatchInvariance, AtLeastTwoSplitsSoThatEveryDecodeMergesInTheMergeKernel) {
  using astr::kernels::invariant_decode_splits;
  EXPECT_EQ(invariant_decode_splits(1, 16), 2);
  EXPECT_EQ(invariant_decode_splits(16, 16), 2);
  EXPECT_EQ(invariant_decode_splits(0, 16), 2);
  EXPECT_EQ(plan(invariant(decode(64, 64))).num_splits, 2);
  EXPECT_GT(plan(invariant(decode(64, 64))).workspace_floats, 0u);
}

TEST(BatchInvariance, AWiderTableOnlyAddsSplitsPastTheNarrowerTablesOnes) {
  // A sequence alone (its own table width) and in a batch padded to a longer one: the same split
  // size, so split s covers the same tiles in both, and the extra splits lie past its length.
  const DecodePlan alone = plan(invariant(decode(1, 2048)));
  const DecodePlan batched = plan(invariant(decode(100, 30000)));
  EXPECT_EQ(alone.split_tiles, batched.split_tiles);
  EXPECT_EQ(alone.form, batched.form);
  EXPECT_LT(alone.num_splits, batched.num_splits);
}

TEST(BatchInvariance, TheTuningSetsTheSplitSizeAndNoForm) {
  const DecodePlan p =
      plan(invariant(decode(16, 4096)), sm90_facts(),
           "invariant_split_tiles=8,decode_form=eight_warps,decode_splits=1,persistent_blocks=3");
  EXPECT_EQ(p.form, DecodeForm::kSplit);
  EXPECT_EQ(p.split_tiles, 8);
  EXPECT_EQ(p.num_splits, 8);
  KernelTuning bad;
  EXPECT_NE(astr::kernels::parse_kernel_tuning("invariant_split_tiles=0", &bad), "");
}

TEST(BatchInvariance, APrefillModeCallNeverRunsAsAVerifyWhoseChoiceReadsTheBatch) {
  using astr::kernels::prefill_runs_as_verify;
  KernelTuning always;
  EXPECT_EQ(astr::kernels::parse_kernel_tuning("verify_form=always", &always), "");
  for (int64_t max_query_len : {1, 4, 16, 300}) {
    EXPECT_FALSE(prefill_runs_as_verify(max_query_len, KernelTuning{}, true));
    EXPECT_FALSE(prefill_runs_as_verify(max_query_len, always, true));
  }
}

TEST(BatchInvariance, AnFp8PrefillReadsTheBytesWhateverTheScratchWouldTake) {
  using astr::kernels::kFp8ScratchLimitBytes;
  auto prefill = [](int head_dim, const DeviceFacts& device, int64_t scratch,
                    const KernelTuning& tuning = {}) {
    return astr::kernels::plan_paged_prefill(head_dim, device, tuning, scratch, {}, true);
  };
  for (int64_t scratch : {int64_t{1}, kFp8ScratchLimitBytes, kFp8ScratchLimitBytes * 8}) {
    EXPECT_FALSE(prefill(128, sm90_facts(), scratch).dequantize_fp8_first);
    EXPECT_EQ(prefill(128, sm90_facts(), scratch).kernel, PrefillKernel::kWgmma);
    EXPECT_EQ(prefill(64, sm90_facts(), scratch).kernel, PrefillKernel::kMmaSync);
    EXPECT_EQ(prefill(128, sm80_facts(), scratch).kernel, PrefillKernel::kMmaSync);
  }
  // A forced choice is the same for every batch: kept.
  KernelTuning dequantize;
  EXPECT_EQ(astr::kernels::parse_kernel_tuning("fp8_prefill=dequantize_first", &dequantize), "");
  EXPECT_TRUE(
      prefill(128, sm90_facts(), kFp8ScratchLimitBytes * 8, dequantize).dequantize_fp8_first);
  // A 16-bit cache's prefill kernel is the default mode's (it reads no batch size).
  EXPECT_EQ(astr::kernels::plan_paged_prefill(128, sm90_facts(), {}, std::nullopt, {}, true).kernel,
            PrefillKernel::kWarpSpecialized);
}

}  // namespace

// The persistent prefill (prefill_persistent_kernel.cuh) has never run on a GPU: the automatic
// choice never takes it; prefill_kernel=persistent does where it is compiled (sm_90a, config.h's
// column), with one block per SM or the tuning's grid, and its items claimed or round robin.
KernelTuning tuned(const char* text) {
  KernelTuning tuning;
  EXPECT_EQ(astr::kernels::parse_kernel_tuning(text, &tuning), "") << text;
  return tuning;
}

TEST(PrefillPlan, ThePersistentKernelRunsOnlyWhenTheTuningAsks) {
  for (int head_dim : {64, 96, 128, 256}) {
    EXPECT_NE(astr::kernels::plan_paged_prefill(head_dim, sm90_facts(), KernelTuning{}).kernel,
              PrefillKernel::kPersistent)
        << head_dim;
    const astr::kernels::PrefillPlan p = astr::kernels::plan_paged_prefill(
        head_dim, sm90_facts(), tuned("prefill_kernel=persistent"));
    EXPECT_EQ(p.kernel, PrefillKernel::kPersistent) << head_dim;
    EXPECT_EQ(p.persistent_blocks, 132);
    EXPECT_EQ(p.schedule, astr::kernels::PrefillSchedule::kClaimed);
    EXPECT_TRUE(p.pool_boxes);
    EXPECT_EQ(astr::kernels::describe_plan(p, false), "persistent x132");
  }
  const astr::kernels::PrefillPlan grid = astr::kernels::plan_paged_prefill(
      128, sm90_facts(),
      tuned("prefill_kernel=persistent,persistent_blocks=7,prefill_schedule=round_robin,"
            "prefill_loads=cp_async"));
  EXPECT_EQ(grid.persistent_blocks, 7);
  EXPECT_EQ(grid.schedule, astr::kernels::PrefillSchedule::kRoundRobin);
  EXPECT_FALSE(grid.pool_boxes);
  EXPECT_EQ(astr::kernels::describe_plan(grid, false), "persistent x7 round_robin");
}

TEST(PrefillPlan, WhereThePersistentKernelCannotRunTheAutomaticChoiceDoes) {
  const KernelTuning persistent = tuned("prefill_kernel=persistent");
  EXPECT_EQ(astr::kernels::plan_paged_prefill(128, sm80_facts(), persistent).kernel,
            PrefillKernel::kMmaSync);
  DeviceFacts no_sm90a = sm90_facts();
  no_sm90a.has_sm90a_code = false;
  EXPECT_EQ(astr::kernels::plan_paged_prefill(128, no_sm90a, persistent).kernel,
            PrefillKernel::kMmaSync);
  // Not compiled for 192/128 nor 512 (config.h).
  EXPECT_EQ(
      astr::kernels::plan_paged_prefill(192, sm90_facts(), persistent, std::nullopt, {}, false, 128)
          .kernel,
      PrefillKernel::kMmaSync);
  EXPECT_EQ(astr::kernels::plan_paged_prefill(512, sm90_facts(), persistent).kernel,
            PrefillKernel::kMmaSync);
  EXPECT_EQ(astr::kernels::plan_paged_prefill(512, sm90_facts(), persistent).persistent_blocks, 0);
  // An FP8 cache: on dequantized pages it runs; reading the bytes, the wgmma kernel at D = 128
  // (it reads 16-bit pages only), the mma.sync one at D = 64.
  const astr::kernels::PrefillPlan dequantized =
      astr::kernels::plan_paged_prefill(128, sm90_facts(), persistent, int64_t{1024});
  EXPECT_EQ(dequantized.kernel, PrefillKernel::kPersistent);
  EXPECT_EQ(astr::kernels::describe_plan(dequantized, true),
            "persistent x132 on dequantized pages");
  const KernelTuning in_kernel = tuned("prefill_kernel=persistent,fp8_prefill=in_kernel");
  EXPECT_EQ(astr::kernels::plan_paged_prefill(128, sm90_facts(), in_kernel, int64_t{1024}).kernel,
            PrefillKernel::kWgmma);
  EXPECT_EQ(astr::kernels::plan_paged_prefill(64, sm90_facts(), in_kernel, int64_t{1024}).kernel,
            PrefillKernel::kMmaSync);
}

TEST(KernelTuning, ReadsThePersistentPrefillsKeys) {
  KernelTuning tuning = tuned("prefill_kernel=persistent,prefill_schedule=round_robin");
  EXPECT_EQ(tuning.prefill_kernel, PrefillKernel::kPersistent);
  EXPECT_EQ(tuning.prefill_schedule, astr::kernels::PrefillSchedule::kRoundRobin);
  EXPECT_EQ(tuned("prefill_schedule=claimed").prefill_schedule,
            astr::kernels::PrefillSchedule::kClaimed);
  for (const char* bad : {"prefill_schedule=sorted", "prefill_kernel=persistant"}) {
    KernelTuning unchanged = tuning;
    EXPECT_NE(astr::kernels::parse_kernel_tuning(bad, &unchanged), "") << bad;
    EXPECT_EQ(unchanged.prefill_schedule, astr::kernels::PrefillSchedule::kRoundRobin) << bad;
  }
}
