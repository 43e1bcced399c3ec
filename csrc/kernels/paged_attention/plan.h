// The plan of a paged attention call: which kernel form runs, with how many splits, on what grid.
// Torch-free and CUDA-free, so that it is unit-tested on any machine (tests/cpp/plan_test.cpp);
// the binding goes tensors -> params -> plan -> launch (csrc/backends/cuda_paged_attention.cu).
//
// Decode forms (DecodeForm): 4-warp blocks, one or more splits of each (sequence, kv head, row
// tile)'s kv tiles, merged by the merge kernel (kSplit) or, 2 splits, in a thread-block cluster
// (kCluster, sm_90) or in one block of two groups of warps (kBlockPairs); one split as one block of
// 8 warps per SM (kEightWarps); or one block per SM taking the items in turn (kPersistent).
//
// How many splits: shapes only, never seq_lens' values: one launch configuration (and one captured
// CUDA graph) serves every length up to the block table's width.
//
// A prefill-mode call of at most kVerifyMaxQueryLen new tokens per sequence (speculative
// decoding's verify) runs as a verify: the decode forms over rows that pack (new token, q head),
// so that the K/V tiles a block reads serve every draft of a row tile (prefill_runs_as_verify).
//
// Batch-invariant mode (BatchInvariance below) trades the batch-dependent choices for rules that
// read the sequence's own shape only.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace astr::kernels {

// ---- The plan's inputs ------------------------------------------------------------------------

// What a plan reads of the device and the build, once per device (launch.cu fills it).
struct DeviceFacts {
  int arch = 0;                 // compute capability, major * 10 + minor
  int num_sms = 0;              // multiprocessors
  int max_smem_per_block = 0;   // bytes a block may opt in to
  int max_smem_per_sm = 0;      // bytes
  int64_t l2_cache_bytes = 0;   // the L2 cache (0: unknown)
  bool has_sm90a_code = false;  // the library was built for sm_90a (wgmma)
};

enum class DecodeForm : int { kAuto, kSplit, kCluster, kBlockPairs, kEightWarps, kPersistent };
// kPersistent: the warp-specialised prefill as one block per SM looping over items
// (prefill_persistent_kernel.cuh); opt-in (prefill_kernel=persistent) until a GPU has measured it.
enum class PrefillKernel : int { kAuto, kWarpSpecialized, kWgmma, kMmaSync, kPersistent };
// How the persistent prefill's blocks take their items after their first
// (prefill_tile_scheduler.h).
enum class PrefillSchedule : int { kAuto, kClaimed, kRoundRobin };
// How a prefill over an FP8 cache reads it (PrefillPlan::dequantize_fp8_first).
enum class Fp8Prefill : int { kAuto, kInKernel, kDequantizeFirst };
// How the warp-specialised prefill copies K/V tiles (PrefillPlan::pool_boxes).
enum class PrefillLoads : int { kAuto, kTma, kCpAsync };
// Whether a prefill-mode call of few new tokens per sequence runs as a verify (the decode forms).
enum class VerifyForm : int { kAuto, kAlways, kNever };
// Which latent-attention kernel runs (kernels/mla/plan.h; a plan's is never kAuto).
enum class MlaKernel : int { kAuto, kTensorCore, kSimple };

// Tuning overrides for A/B runs and for the tests that run every form: parsed once, here, from
// ASTR_KERNEL_TUNING (read at library load) or torch.ops.astr.set_kernel_tuning(text), as
// comma-separated key=value pairs ("" = automatic):
//   decode_form=auto|split|cluster|block_pairs|eight_warps|persistent  a preference: where the form
//                                     cannot run (head dim, GPU), the automatic choice runs
//   decode_splits=N                  N splits (1..65535) instead of the rule's (plan below); with
//                                    the automatic form, 2 splits merge as the rule would merge 2;
//                                    a top-k call's splits too (TopkPlan)
//   persistent_blocks=N              the persistent decode's and the persistent prefill's grid (at
//                                    most the items), for tests that give each block several items
//   prefill_kernel=auto|warp_specialized|wgmma|mma_sync|persistent  a preference: that kernel
//                                    where it runs (else the automatic choice), or mma.sync always;
//                                    auto never picks persistent (not yet measured)
//   prefill_schedule=auto|claimed|round_robin  the persistent prefill's items after each block's
//                                    first: claimed from a counter (auto), or every grid-th
//   fp8_prefill=auto|in_kernel|dequantize_first  how a prefill reads an FP8 cache: in_kernel
//                                    where the kernel can (prefill_reads_fp8), else dequantized
//   prefill_loads=auto|tma|cp_async  the warp-specialised prefill's copies: TMA boxes where the
//                                    pool allows them (auto, tma), or the cp.async gather always
//   prefill_l2_panel=auto|all|N      the prefill's block order: (sequence, kv head) pairs in
//                                    panels of N (PrefillPlan::panel_pairs), or of all pairs
//   verify_form=auto|always|never    a prefill-mode call as a verify (the decode forms): up to
//                                    kVerifyMaxQueryLen new tokens per sequence (auto), at any
//                                    max_query_len (always), or never
//   invariant_split_tiles=N          batch-invariant mode's decode splits of N consecutive kv
//                                    tiles (1..65535) instead of kInvariantSplitTiles
//   mla_kernel=auto|tensor_core|simple  latent attention's kernel (kernels/mla/plan.h): a
//                                    preference for tensor_core (where it cannot run, the simple
//                                    one runs), the simple kernel always
//   mla_splits=N                     the tensor-core latent kernel's splits (1..64) instead of
//                                    the rule's
struct KernelTuning {
  DecodeForm decode_form = DecodeForm::kAuto;
  int decode_splits = 0;      // 0: the rule's
  int persistent_blocks = 0;  // 0: one per SM
  PrefillKernel prefill_kernel = PrefillKernel::kAuto;
  PrefillSchedule prefill_schedule = PrefillSchedule::kAuto;
  Fp8Prefill fp8_prefill = Fp8Prefill::kAuto;
  PrefillLoads prefill_loads = PrefillLoads::kAuto;
  int prefill_l2_panel = -1;  // -1: the rule's (prefill_panel_pairs); 0: all pairs; N: N pairs
  VerifyForm verify_form = VerifyForm::kAuto;
  int invariant_split_tiles = 0;  // 0: kInvariantSplitTiles
  MlaKernel mla_kernel = MlaKernel::kAuto;
  int mla_splits = 0;  // 0: the rule's
};
// "" on success; otherwise what is wrong (and *tuning is left unchanged).
std::string parse_kernel_tuning(std::string_view text, KernelTuning* tuning);

// The shape of a decode call (shapes and host ints only, never seq_lens' values: one plan and one
// captured CUDA graph serve every length up to the block table's width), or of a verify.
struct DecodeShape {
  int num_seqs = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;                   // of q and k
  int head_dim_v = 0;                 // of v and the output; 0: head_dim
  int64_t block_table_positions = 0;  // block table width * page size
  int window_left = -1;               // the call's window (-1: none): bounds the kv range read
  int kv_bytes = 2;                   // the cache's element size: 2, or 1 for FP8
  int query_len = 0;                  // a verify's max_query_len (rows: query_len x group); 0 for
                                      // a decode (one token per sequence, token b = sequence b)
  int64_t num_tokens = 0;             // the output's rows T (0: num_seqs, a decode's)
  bool batch_invariant = false;       // batch-invariant mode (BatchInvariance below)
};

struct DecodePlan {
  DecodeForm form = DecodeForm::kSplit;  // never kAuto
  int num_splits = 1;
  // 0: split s takes the kv tiles s, s + S, s + 2S, ...; > 0 (batch-invariant mode): split_tiles
  // consecutive tiles from tile s * split_tiles, the last split the rest.
  int split_tiles = 0;
  int persistent_blocks = 0;    // kPersistent: the grid
  size_t workspace_floats = 0;  // kSplit with num_splits > 1: partial outputs and their lse
  std::string error;            // set when no form can run the call here
};

struct PrefillPlan {
  PrefillKernel kernel = PrefillKernel::kMmaSync;  // never kAuto
  // An FP8 cache: the binding first dequantizes the pages the call reads into a scratch of q's
  // dtype (kernels/kv_cache/dequantize_pages.cu), which the kernel reads as a 16-bit cache;
  // otherwise the kernel reads the bytes itself (prefill_reads_fp8). See kFp8ScratchLimitBytes.
  bool dequantize_fp8_first = false;
  // The warp-specialised kernel copies K/V by TMA boxes where the pool allows it (page sizes of 8
  // slots or more, strides TMA can describe: kernels/paged_attention/pool_tensor_map.h), else by
  // the cp.async gather.
  bool pool_boxes = false;
  // The order in which the blocks start (query_rows.cuh, prefill_block_coordinates): the
  // (sequence, kv head) pairs in panels of this many, each panel's row tiles heaviest first over
  // its pairs before the next panel starts, so that the blocks running at once read the K/V of a
  // few pairs, which the L2 cache keeps between their row tiles (prefill_panel_pairs). 0: one
  // panel of every pair (each row tile over all pairs, the order before panels).
  int panel_pairs = 0;
  // kPersistent: the grid's blocks (one per SM, or the tuning's persistent_blocks; the launch
  // takes at most the items) and how they take items after their first (never kAuto). The
  // persistent kernel orders its items itself (longest first) and reads no panel_pairs.
  int persistent_blocks = 0;
  PrefillSchedule schedule = PrefillSchedule::kClaimed;
  std::string error;
};
// What a prefill's (sequence, kv head) pairs read, for its block order: pairs, and the bytes of
// K and V one pair may read (block table width x page size x D x 2 x the element's bytes).
struct PrefillKvFootprint {
  int64_t pairs = 0;
  int64_t bytes_per_pair = 0;
};
// Whether the kernel reads an FP8 cache's bytes itself at this head dim: the mma.sync prefill
// converts its fragments in registers, the wgmma prefill its tiles in shared memory (rows of whole
// 128-byte swizzle rows: D a multiple of 128); the warp-specialised one reads only 16-bit pages.
// config.h's kv kinds and generate_instantiations.py's FP8 families say the same.
constexpr bool prefill_reads_fp8(PrefillKernel kernel, int head_dim) {
  return kernel == PrefillKernel::kMmaSync ||
         (kernel == PrefillKernel::kWgmma && head_dim % 128 == 0);
}

// Decode items: (sequence, kv head, row tile of 16 query rows) triples; a verify's rows are
// query_len x group per (sequence, kv head).
int64_t decode_items(int num_seqs, int num_q_heads, int num_kv_heads, int query_len = 1);
// The kv positions a decode row may read: the block table's, or the window's (rounded out to
// whole tiles).
int64_t decode_kv_positions(const DecodeShape& shape);

DecodePlan plan_paged_decode(const DecodeShape& shape, const DeviceFacts& device,
                             const KernelTuning& tuning);
// The shape's v head dim (head_dim where head_dim_v is 0).
int decode_head_dim_v(const DecodeShape& shape);
// fp8_scratch_bytes: for an FP8 cache, the bytes the dequantized pages would take (K and V,
// num_seqs x block-table width pages of q's dtype; 0 for an empty table); none for a 16-bit cache.
// kv: for the block order (panel_pairs); none, one panel of every pair. batch_invariant: the mode
// (BatchInvariance below). head_dim_v: v's head dim, 0 for head_dim (config.h's rows are pairs);
// where it differs, an FP8 cache is read as bytes (the dequantizing pass takes one head dim).
PrefillPlan plan_paged_prefill(int head_dim, const DeviceFacts& device, const KernelTuning& tuning,
                               std::optional<int64_t> fp8_scratch_bytes = std::nullopt,
                               const PrefillKvFootprint& kv = {}, bool batch_invariant = false,
                               int head_dim_v = 0);

// Sparse top-k attention (a call with topk_indices, decode or prefill: the top-k kernels run it
// whatever its mode). Every query token is its own work item (its keys differ from its
// neighbours'): (token, kv head, row tile of 16 of the group's q heads) triples, as a decode's
// items with one token per sequence. A listing pass first resolves each token's entries (repeats,
// masked entries and bad ones: PagedTopkParams::listed_positions) in a hash table in shared memory
// of table_slots slots; the attention kernel then reads the listed keys in tiles of the decode's
// size, split over the topk list by the decode's one-wave rule and merged by its merge kernel.
struct TopkShape {
  int64_t num_tokens = 0;  // T: the query rows' tokens
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  int head_dim_v = 0;  // 0: head_dim
  int64_t topk = 0;    // entries per row
  int kv_bytes = 2;    // the cache's element size: 2, or 1 for FP8
  bool batch_invariant = false;
};
struct TopkPlan {
  int num_splits = 1;
  // 0: split s takes the entry tiles s, s + S, ...; > 0 (batch-invariant mode): split_tiles
  // consecutive tiles from tile s * split_tiles, the last split the rest (DecodePlan's meaning).
  int split_tiles = 0;
  size_t workspace_floats = 0;  // num_splits > 1: partial outputs and their lse
  int table_slots = 0;          // the listing pass' hash table: a power of two above topk
  std::string error;
};
// The most entries a row may list: the listing pass' table (kTopkMaxTableSlots slots of 8 bytes,
// 128 KiB of shared memory) holds more slots than entries.
inline constexpr int kTopkMaxTableSlots = 16384;
inline constexpr int64_t kTopkMaxEntries = kTopkMaxTableSlots - 1;
// Slots of the listing pass' table: twice the entries (short probes), rounded up to a power of
// two, at least 32, at most kTopkMaxTableSlots; 0 for more entries than kTopkMaxEntries.
constexpr int topk_table_slots(int64_t topk) {
  if (topk > kTopkMaxEntries) return 0;
  int slots = 32;
  while (slots < 2 * topk && slots < kTopkMaxTableSlots) slots *= 2;
  return slots;
}
// The split rule of a decode (decode_splits_filling_one_wave over the entry tiles; decode_splits=N
// forces N; batch-invariant mode: kInvariantSplitTiles consecutive tiles a split).
TopkPlan plan_paged_topk(const TopkShape& shape, const DeviceFacts& device,
                         const KernelTuning& tuning);

// Whether a prefill-mode call runs as a verify (plan_paged_decode then plans it, with the call's
// max_query_len as DecodeShape::query_len) rather than on a prefill kernel.
bool prefill_runs_as_verify(int64_t max_query_len, const KernelTuning& tuning,
                            bool batch_invariant);

const char* decode_form_name(DecodeForm form);
const char* prefill_kernel_name(PrefillKernel kernel);
const char* prefill_schedule_name(PrefillSchedule schedule);
// A plan as csrc/README.md's kernel table writes it: "split x13"; "warp_specialized" (the
// persistent prefill: "persistent x132", "persistent x132 round_robin"), and for an FP8 cache
// "... on dequantized pages" or "... reading FP8". Also what the "astrai" logger and the
// profiler ranges name (astr::cuda_paged_plan).
std::string describe_plan(const DecodePlan& plan);
std::string describe_plan(const PrefillPlan& plan, bool fp8_cache);
// "split x4" (and "... of 16 tiles" in batch-invariant mode).
std::string describe_plan(const TopkPlan& plan);
const char* fp8_prefill_name(Fp8Prefill mode);
const char* prefill_loads_name(PrefillLoads loads);
const char* verify_form_name(VerifyForm form);
const char* mla_kernel_name(MlaKernel kernel);

// ---- The rules (their measurements: benchmarks/results/decisions.md) ---------------------------

// As many splits as fit the whole grid into one wave of resident blocks, at least 1, at most one
// per kv tile and 256: a second wave's blocks start cold and every split adds a state to merge
// (decisions.md, "Decode: the split count fills one wave"). blocks_per_split: the decode blocks
// that one split of every (sequence, kv head, row tile) takes; resident_slots: decode blocks the
// GPU runs at once (SMs x blocks per SM); max_tiles: kv tiles of the longest sequence the block
// table can hold.
constexpr int decode_splits_filling_one_wave(int64_t blocks_per_split, int64_t resident_slots,
                                             int64_t max_tiles) {
  constexpr int64_t kMaxSplits = 256;
  if (blocks_per_split <= 0 || resident_slots <= 0 || max_tiles <= 1) return 1;
  const int64_t fitting = resident_slots / blocks_per_split;
  return static_cast<int>(std::clamp<int64_t>(std::min(fitting, max_tiles), 1, kMaxSplits));
}

// Whether block pairs (the 2 splits of a (sequence, kv head, row tile) as one block on one SM, see
// PagedAttentionTraits::kGroups) cover more than 2/3 of the SMs; where they do not, 2 single blocks
// per pair spread over twice as many SMs stream faster (decisions.md, "Decode: block pairs before
// clusters"). The one-wave rule gives 2 splits only to grids of more than a third of the slots,
// which with 2 slots per SM is more than 2/3 of the SMs: always covered; forced counts need not be.
constexpr bool decode_block_pairs_fill_gpu(int64_t pair_blocks, int64_t num_sms) {
  return pair_blocks > 0 && num_sms > 0 && 3 * pair_blocks > 2 * num_sms;
}

// Whether one split as eight-warp blocks (one block of 8 warps per (sequence, kv head, row tile),
// one per SM, page ids from a ring in shared memory; PagedAttentionTraits' kWarps) replaces the 2
// splits of block pairs, on the same grid: faster up to 16384 positions, level beyond, where the
// pairs stay (decisions.md, "Decode: eight-warp blocks"). max_kv_len: the block table's width in
// positions.
constexpr bool decode_eight_warp_blocks_pay(int64_t max_kv_len) {
  return max_kv_len > 0 && max_kv_len <= 16384;
}

// Whether the persistent eight-warp decode (one block per SM taking the (sequence, kv head, row
// tile) items in turn, claimed from a counter, decode_persistent_kernel.cuh) replaces one split of
// 4-warp blocks (two per SM, handed out by the hardware): with n = ceil(items / SMs) rounds of one
// item per SM, at 3 and from 5 rounds up. At odd n the 4-warp grid's last wave runs half empty; at
// 2 and 4 rounds the 4-warp blocks won (decisions.md, "Decode: the persistent decode").
constexpr bool decode_persistent_blocks_pay(int64_t num_items, int64_t num_sms) {
  if (num_sms <= 0 || num_items <= num_sms) return false;
  const int64_t rounds = (num_items + num_sms - 1) / num_sms;
  return rounds == 3 || rounds >= 5;
}

// Whether an FP8 prefill dequantizes the pages first: while the scratch that takes stays within
// kFp8ScratchLimitBytes; beyond it a kernel reads the bytes (the planned one if it can,
// prefill_reads_fp8, else the mma.sync prefill). The pass reads each page once and the kernel then
// runs at the 16-bit speed, where reading the bytes every block converts each tile it reads (about
// 10% slower); but the scratch is num_seqs x block-table width pages for K and V, gigabytes for a
// table padded to a long maximum length (decisions.md, "FP8 prefill: dequantize the pages first").
inline constexpr int64_t kFp8ScratchLimitBytes = int64_t{256} << 20;
constexpr bool prefill_dequantizes_fp8_first(int64_t fp8_scratch_bytes) {
  return fp8_scratch_bytes <= kFp8ScratchLimitBytes;
}

// How many (sequence, kv head) pairs a prefill's panel takes (PrefillPlan::panel_pairs; the plan
// makes a panel of all pairs or more one panel): as many as keep the K/V they read within half the
// L2 cache, at least 1; 0 (one panel) when either size is unknown. Without panels one wave of
// blocks reads every pair's K/V, more than the L2 holds on long or ragged batches, so a pair's
// tiles leave L2 before its next row tile reads them. Half: the L2 is two partitions, and Q and the
// output pass through it too (decisions.md, "Prefill: blocks start in L2 panels").
constexpr int64_t prefill_panel_pairs(int64_t kv_bytes_per_pair, int64_t l2_cache_bytes) {
  if (kv_bytes_per_pair <= 0 || l2_cache_bytes <= 0) return 0;
  return std::max<int64_t>(l2_cache_bytes / 2 / kv_bytes_per_pair, 1);
}

// Whether a prefill-mode call of at most max_query_len new tokens per sequence runs as a verify:
// the decode forms pack its (new token, q head) pairs into 16-row tiles (group x max_query_len
// rows per kv head: 4 to 16 tiles at GQA 32/8 and 2 to 16 drafts), where the prefill kernels'
// 64- or 128-row tiles would be mostly empty, and split its kv range over the GPU as a decode's.
// Up to kVerifyMaxQueryLen new tokens: not yet measured (the tuning's verify_form= compares).
inline constexpr int kVerifyMaxQueryLen = 16;
constexpr bool verify_fits(int64_t max_query_len) {
  return max_query_len >= 1 && max_query_len <= kVerifyMaxQueryLen;
}

// ---- Batch-invariant mode ----------------------------------------------------------------------
//
// In batch-invariant mode (astrai.set_batch_invariant) a sequence's rows must be the same bits
// whatever the batch around it. A row's result depends on the kernel form that computes it (each
// adds its partial results in its own order) and on how its kv range is cut into splits; the
// default rules pick both from the batch (the one-wave split count, pairs, clusters, eight-warp
// and persistent blocks; the verify form by the batch's max_query_len; an FP8 prefill's scratch
// by the batch's size). So, in this mode:
//   - a decode runs the 4-warp split form (it runs at every head dim on every GPU), its splits
//     kInvariantSplitTiles consecutive kv tiles each (invariant_decode_splits), merged by the merge
//     kernel in split order: a split past a sequence's length is empty and adds exact zeros, so
//     the block table's width (the batch's longest sequence) changes nothing;
//   - a prefill-mode call runs the prefill kernel whatever its max_query_len (never the verify
//     form); its blocks each take one (sequence, kv head, row tile) and its whole kv range, in
//     order, so its sums depend on the sequence alone;
//   - an FP8 prefill reads the bytes in the kernel (prefill_reads_fp8) unless the tuning says
//     otherwise, whatever the scratch would take.
// The tuning's decode_form, decode_splits and persistent_blocks are ignored in this mode.
// Cost: measured in benchmarks/results/decisions.md, "Batch-invariant mode", once a GPU has run it.

// 16 tiles: 1024 positions of a 16-bit cache (64-position tiles), 2048 of an FP8 one. At B = 1 and
// 32768 positions, 32 splits per kv head: about the one-wave rule's 33 on an H100.
inline constexpr int kInvariantSplitTiles = 16;

// Splits of split_tiles consecutive tiles covering max_tiles tiles: at least 2, so that every
// decode takes the merge kernel's arithmetic (a lone split normalises its rows itself, in another
// order once a sink logit joins), and at most 65535 (the grid's z).
constexpr int invariant_decode_splits(int64_t max_tiles, int split_tiles) {
  if (split_tiles <= 0) return 2;
  const int64_t needed = (std::max<int64_t>(max_tiles, 0) + split_tiles - 1) / split_tiles;
  return static_cast<int>(std::clamp<int64_t>(needed, 2, 65535));
}

}  // namespace astr::kernels
