// Tile shapes of the paged attention kernels, one place for every choice. Plain C++: the plan
// (plan.cpp) counts residency and shared memory from these on any machine.
//
// Both kernels (decode_kernel.cuh, prefill_mma_sync_kernel.cuh) run the same warp routine
// (FlashAttention-2: S = Q K^T and O += P V on mma.sync.m16n8k16 with fp32 accumulators, online
// softmax in registers) over query "rows" that pack (new token, q head of the GQA group) pairs: row
// r of kv head h is token r / G, q head h * G + r % G. Packing the group into rows makes every K/V
// tile loaded into shared memory serve all G q heads that read it.
//
// Decode (one token per sequence): a block owns 16 rows (one GQA group, padded to 16; groups larger
// than 16 take several row tiles) and its 4 warps split each K/V tile by kv position, merging their
// softmax states through shared memory at the end. The kernel is memory-bound, so the rows padding
// a group to 16 cost nothing; what matters is how the K/V stream is requested: two groups of warps
// per SM (two blocks, or one block pair: kGroups), up to kStages tiles in flight per group, and
// rows that land aligned (swizzled, not padded: tile_offset in common/device_primitives.cuh). One
// group of 8 warps over 128-position tiles (kWarps), one block per SM with the page ids two tiles
// ahead in shared memory, runs at one wave in place of the block pairs up to 16384 positions
// (plan.h).
//
// Prefill: warps split the rows (kRowBlocksPerWarp blocks of 16 rows each) and every warp reads
// the whole K/V tile. Two 16-row blocks per warp halve the shared-memory traffic per mma (each K/V
// fragment loaded by ldmatrix feeds two mma), which is the limit at one block of 16. D <= 128 takes
// 128x64 tiles, faster than 128x32 despite 68 bytes of spills at the 255-register cap. These are
// the mma.sync prefill's traits (sm_80, and wherever no wgmma prefill runs: plan.cpp). The shapes
// measured, and the designs that lost: benchmarks/results/decisions.md ("Decode: tiles" and
// "Prefill: mma.sync tiles").
//
// Head dims whose rows are not a power of two of 16-byte chunks (D = 96: 12) keep padded rows in
// decode too (the swizzle permutes 8 chunks), and their copies and merges index (row, chunk)
// pairs flatly (kv_tile_loader.cuh, tile_math.cuh).
#pragma once

namespace astr::kernels {

constexpr bool is_power_of_two(int value) { return value > 0 && (value & (value - 1)) == 0; }
constexpr int ilog2(int value) { return value > 1 ? 1 + ilog2(value / 2) : 0; }

// Shared memory of an H100/H200 SM, the most one block may take, and what the driver keeps per
// resident block: the figures the residency below is computed from.
constexpr int kSmSharedMemoryBytes = 228 * 1024;
constexpr int kBlockSharedMemoryLimitBytes = 227 * 1024;
constexpr int kSharedMemoryReservedPerBlock = 1024;

// kWarps_: warps of a group. 4, except the decode's eight-warp blocks (D = 128): one group of 8
// warps, 16 kv positions of every tile each, as every decode group splits its tiles, so its tiles
// are 128 positions; one block per SM, page ids from a ring in shared memory (kPageIdRing).
// kKVBytes_: the cache's element size, 2 (q's 16-bit type) or 1 (FP8, dequantized in registers:
// tile_math.cuh).
// kHeadDimV_: v's head dim (and the output's), kHeadDim_ q and k's (config.h's rows). A block
// accumulates kVColumns of v's columns, chunk blockIdx.x % kVChunks (query_rows.cuh: the grid):
// above 256 columns O would not fit in registers next to S, so 512 takes 2 chunks of 256, each
// block computing the full q . k scores (the same softmax statistics in every chunk).
template <int kHeadDim_, bool kDecode_, int kGroups_ = 1, int kWarps_ = 4, int kKVBytes_ = 2,
          int kHeadDimV_ = kHeadDim_>
struct PagedAttentionTraits {
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kHeadDimV = kHeadDimV_;
  static constexpr int kVChunks = kHeadDimV > 256 ? kHeadDimV / 256 : 1;
  static constexpr int kVColumns = kHeadDimV / kVChunks;  // of one block
  static_assert(kVColumns * kVChunks == kHeadDimV && kVColumns % 32 == 0,
                "v columns: chunks of whole 32-column pairs of k16 steps");
  // The row layout and register budget follow the larger of q/k's rows and the block's v
  // columns (equal for every row but (192, 128), which is sized as 128 where O decides).
  static constexpr bool kEqualDims = kHeadDim == kHeadDimV;
  static constexpr bool kDecode = kDecode_;
  static constexpr int kWarps = kWarps_;
  static_assert(kWarps == 4 || (kWarps == 8 && kDecode && kGroups_ == 1),
                "4 warps, or 8 in decode");
  static constexpr int kThreads = kWarps * 32;  // one group's (see kGroups)
  static constexpr int kElementBytes = 2;       // q and output: 16-bit floats
  static constexpr int kChunksPerRow = kHeadDim * kElementBytes / 16;  // 16-byte chunks of a q row
  static constexpr int kKVBytes = kKVBytes_;
  static constexpr bool kFp8 = kKVBytes == 1;
  static_assert(kKVBytes == 2 || kKVBytes == 1, "16-bit or FP8 K/V tiles");
  static constexpr int kKVChunksPerRow = kHeadDim * kKVBytes / 16;  // of a K row (V: equal dims)
  static constexpr int kVChunksPerRow = kVColumns * kKVBytes / 16;  // of a block's V columns
  static constexpr int kKVChunkElements = 16 / kKVBytes;

  // Decode: 16 rows per block. Prefill: 2 row blocks of 16 per warp up to 128 v columns
  // (registers: O 2x16x128 fp32 + S 2x16x64 fp32 fit in 255; q's fragments are read per k step),
  // 1 above.
  static constexpr int kRowBlocksPerWarp = kDecode ? 1 : (kVColumns <= 128 ? 2 : 1);
  static constexpr int kBlockRows = kDecode ? 16 : kWarps * 16 * kRowBlocksPerWarp;

  // K/V tile: kv positions per pipeline stage. Decode splits it across the warps (16 each; 32
  // with an FP8 cache, so that a stage holds as many bytes in flight as a 16-bit one).
  // Prefill: 64 positions where O and S both fit (v columns and q/k rows up to 128), else 32.
  static constexpr int kTileN =
      kDecode ? (kFp8 ? 32 : 16) * kWarps : (kVColumns <= 128 && kHeadDim <= 128 ? 64 : 32);
  static constexpr int kWarpTileN = kDecode ? kTileN / kWarps : kTileN;

  // Pipeline depth: 2 stages (the tile being waited for and the next one). Decode has room for 3
  // or 4, which measured slower at D = 64 and 128 (decisions.md, "Decode: tiles"). Prefill is
  // compute-bound: double buffering.
  static constexpr int kStages = 2;

  // Q fragments kept in registers for the whole kv loop when they fit next to O and S.
  static constexpr bool kQInRegisters = kDecode && kHeadDim <= 128;

  // Shared-memory row layout (see tile_offset in common/device_primitives.cuh): decode streams K/V
  // and reads faster into swizzled, unpadded rows; prefill keeps padded rows (fewer registers), as
  // do rows the swizzle cannot permute (not a power of two of at least 8 chunks).
  static constexpr bool kSwizzle = kDecode && is_power_of_two(kChunksPerRow) && kChunksPerRow >= 8;
  static constexpr int kRowStride = kSwizzle ? kHeadDim : kHeadDim + 8;  // q rows, elements
  static constexpr int kQSmemElements = kBlockRows * kRowStride;
  // K/V rows, in cache elements (the same layouts, by the cache's chunks).
  static constexpr bool kKVSwizzle =
      kDecode && is_power_of_two(kKVChunksPerRow) && kKVChunksPerRow >= 8;
  static constexpr int kKVRowStride = kKVSwizzle ? kHeadDim : kHeadDim + kKVChunkElements;
  static constexpr bool kWgmmaTiles = false;  // K/V tile layout (kv_tile_loader.cuh)
  static constexpr int kTileElements = kTileN * kKVRowStride;      // of K (and V: equal dims)
  static constexpr int kKVSmemElements = kStages * kTileElements;  // K's stages
  // V rows of the block's kVColumns (the same as K's where the dims are equal).
  static constexpr bool kVSwizzle =
      kDecode && is_power_of_two(kVChunksPerRow) && kVChunksPerRow >= 8;
  static constexpr int kVRowStride = kVSwizzle ? kVColumns : kVColumns + kKVChunkElements;
  static constexpr int kVTileElements = kTileN * kVRowStride;
  static constexpr int kVSmemElements = kStages * kVTileElements;  // V's stages
  // Decode splits merged in a thread-block cluster: 2 (plan.h says why). The
  // epilogue's incoming region (at the end of shared memory, outside the K/V stages, which the
  // peer may still be reading) receives the peer's states of this block's half of the columns:
  // 16 rows x D / 2 floats of output, then 16 maxima and 16 sums.
  static constexpr int kClusterSplits = 2;
  static constexpr int kIncomingBytes = kDecode ? (16 * kVColumns / kClusterSplits + 32) * 4 : 0;
  // Page ids from a ring in shared memory instead of registers (kv_tile_loader.cuh): the eight-warp
  // decode block. A single group per SM waits for its page ids where two groups hide that wait
  // behind each other. The ring holds kPageIdSlots tiles of kTileN ids (one per row, at page size
  // 1), after the V stages.
  // D = 512's 4-warp decode block takes the ring too: page ids in registers for its K and V
  // copies (32 and 16 rows a thread) spilled.
  static constexpr bool kPageIdRing = kDecode && (kWarps == 8 || kHeadDim > 256);
  static constexpr int kPageIdSlots = kPageIdRing ? 2 * kStages : 0;
  static constexpr int kPageIdBytes = kPageIdSlots * kTileN * 4;

  // Decode merge across warps reuses the K/V region: kWarps x 16 rows x (D + 4) floats (+4 pads
  // rows so the float2 stores of a warp hit distinct banks) plus m and l per row. The region is
  // the larger of the two (the 16-bit stages always are; FP8 stages of D = 128 are not).
  static constexpr int kMergeRowStride = kVColumns + 4;
  static constexpr int kMergeBytes = kWarps * 16 * (kMergeRowStride + 2) * 4;
  static constexpr int kKVStagesBytes = (kKVSmemElements + kVSmemElements) * kKVBytes;
  static constexpr int kKVRegionBytes =
      kDecode && kMergeBytes > kKVStagesBytes ? kMergeBytes : kKVStagesBytes;
  static constexpr int kSmemBytes =
      ((kQSmemElements * kElementBytes + kKVRegionBytes + kPageIdBytes + kIncomingBytes + 127) /
       128) *
      128;

  // Resident decode blocks per SM (single blocks), which the split rule and the block pairs count
  // on: 4 at D = 64, 2 at D = 96 and 128, 1 at D = 256; 1 eight-warp block. A block reserves just
  // over 1 / (n + 1) of an H100/H200 SM's 228 KB of shared memory (rounded up to 128 bytes), so
  // that no more than n fit (decisions.md, "Decode residency per head dim").
  // (192, 128): 2, its K and V rows averaging 160 elements.
  static constexpr int kDecodeBlocksPerSm =
      kWarps == 8 ? 1 : (kHeadDim + kVColumns <= 128 ? 4 : (kHeadDim + kVColumns <= 320 ? 2 : 1));
  static constexpr int kShareOfOneBlockMoreBytes =
      kSmSharedMemoryBytes / (kDecodeBlocksPerSm + 1) - kSharedMemoryReservedPerBlock;
  static constexpr int kMinSmemBytes = kDecode ? (kShareOfOneBlockMoreBytes / 128 + 1) * 128 : 0;
  static constexpr int kSingleBlockSmemBytes =
      kSmemBytes > kMinSmemBytes ? kSmemBytes : kMinSmemBytes;

  // Used by the split heuristic (resident blocks per SM, from shared memory).
  static constexpr int kBlocksPerSm =
      kBlockSharedMemoryLimitBytes / (kSingleBlockSmemBytes + kSharedMemoryReservedPerBlock);
  static_assert(!kDecode || kBlocksPerSm == kDecodeBlocksPerSm, "decode residency");

  // The kernel's launch bounds: where n decode blocks of kThreads could not all have 255 registers
  // per thread in the 64 K of an SM (D = 64: 4 blocks, at most 128 each), the compiler is told to
  // keep that many resident. 0 leaves the bound out (D = 128 and 256, prefill, block pairs): even
  // a bound the kernel already meets changed ptxas' register allocation at D = 128.
  static constexpr int kMinBlocksPerSm =
      kDecode && kGroups_ == 1 && kDecodeBlocksPerSm * kThreads * 255 > 64 * 1024
          ? kDecodeBlocksPerSm
          : 0;

  // Decode block pairs: kGroups = 2 puts the two splits of a (sequence, kv head, row tile) in one
  // block as two independent groups of kWarps warps, each with its own shared-memory region
  // (kSmemBytes: query, K/V stages, incoming states), its own pipeline and its own named barrier;
  // they merge in shared memory at the end like a cluster pair, with no cluster. Everything above
  // is per group.
  static constexpr int kGroups = kGroups_;
  static constexpr int kBlockThreads = kThreads * kGroups;
  static constexpr int kBlockSmemBytes =
      kGroups == 1 ? kSingleBlockSmemBytes : kSmemBytes * kGroups;
  static_assert(kGroups == 1 || (kDecode && kGroups == kClusterSplits), "pairs of decode splits");
  static_assert(kSmemBytes % 128 == 0, "each group's region starts 128-byte aligned");

  static_assert(kHeadDim % 16 == 0, "mma k-steps of 16");
  static_assert(kWarpTileN % 16 == 0, "P V consumes kv positions 16 at a time");
  static_assert((kTileN * kKVChunksPerRow) % kThreads == 0, "tile copy must divide evenly");
  static_assert((kTileN * kVChunksPerRow) % kThreads == 0, "tile copy must divide evenly");
  static_assert(kEqualDims || (kWarps == 4 && kGroups_ == 1),
                "different q/k and v head dims: the 4-warp decode and the mma.sync prefill");
};

// Traits of the decode forms (plan.h's DecodeForm): 4-warp blocks (also the split and cluster
// forms), block pairs, eight-warp blocks (also the persistent decode's block).
template <int kHeadDim, int kKVBytes = 2, int kHeadDimV = kHeadDim>
using DecodeTraits = PagedAttentionTraits<kHeadDim, true, 1, 4, kKVBytes, kHeadDimV>;
template <int kHeadDim, int kKVBytes = 2>
using DecodePairTraits = PagedAttentionTraits<kHeadDim, true, 2, 4, kKVBytes>;
template <int kHeadDim, int kKVBytes = 2>
using DecodeEightWarpTraits = PagedAttentionTraits<kHeadDim, true, 1, 8, kKVBytes>;
template <int kHeadDim, int kKVBytes = 2, int kHeadDimV = kHeadDim>
using PrefillTraits = PagedAttentionTraits<kHeadDim, false, 1, 4, kKVBytes, kHeadDimV>;

// Shared memory of the persistent decode block (decode_persistent_kernel.cuh): two query
// buffers, the K and V stages and the page-id ring as the eight-warp block has them, then the
// merge region (the K/V stages hold the next item's tiles while the warps merge) and the queue of
// the block's items (index and length, kItemSlots of each).
template <typename Traits>
struct PersistentDecodeLayout {
  static_assert(Traits::kDecode && Traits::kPageIdRing && Traits::kGroups == 1,
                "the eight-warp decode block's tiles");
  static constexpr int kItemSlots = 8;  // a power of two above the items in flight (at most 5)
  static constexpr int kQueryBytes = Traits::kQSmemElements * Traits::kElementBytes;
  static constexpr int kStageBytes =
      Traits::kKVSmemElements * Traits::kKVBytes;  // all stages of K (or V)
  static constexpr int kQueryOffset = 0;           // [2] query buffers
  static constexpr int kKOffset = kQueryOffset + 2 * kQueryBytes;
  static constexpr int kVOffset = kKOffset + kStageBytes;
  static constexpr int kPageIdOffset = kVOffset + kStageBytes;
  static constexpr int kMergeOffset = kPageIdOffset + Traits::kPageIdBytes;
  static constexpr int kItemQueueOffset = kMergeOffset + Traits::kMergeBytes;
  static constexpr int kSmemBytes = kItemQueueOffset + 2 * kItemSlots * 4;
  static_assert(kMergeOffset % 16 == 0 && kItemQueueOffset % 16 == 0, "16-byte aligned regions");
  static_assert(kSmemBytes <= kBlockSharedMemoryLimitBytes, "one block per SM");
};

}  // namespace astr::kernels
