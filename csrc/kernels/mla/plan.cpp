#include "plan.h"

#include <algorithm>
#include <climits>

namespace astr::kernels {

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Enough (row tile, split) blocks to fill the SMs once (the kernel runs one block an SM), each
// split at least kMlaTcMinSplitKeys of the longest possible sequence.
int tensor_core_splits(int64_t blocks, int64_t max_seq_len, int num_sms) {
  if (blocks >= num_sms) return 1;
  const int64_t wanted = ceil_div(std::max(num_sms, 1), std::max<int64_t>(blocks, 1));
  const int64_t longest = std::max<int64_t>(ceil_div(max_seq_len, kMlaTcMinSplitKeys), 1);
  return static_cast<int>(std::min({wanted, longest, int64_t{kMlaTcMaxSplits}}));
}

}  // namespace

MlaPlan plan_mla_attention(const MlaCallShape& shape, const DeviceFacts& device,
                           const KernelTuning& tuning) {
  MlaPlan plan;
  const int64_t rows_per_seq = shape.decode ? 1 : shape.max_query_len;
  plan.poison_unplaced_rows = !shape.decode;
  if (rows_per_seq < 1) {
    plan.error = "max_query_len must be at least 1 for a prefill";
    return plan;
  }
  // The tensor-core form: sm_90 (its shared memory), a row-tile count grid y can hold.
  const int64_t row_tiles = ceil_div(rows_per_seq * shape.num_heads, kMlaTcRows);
  const int tc_smem = mla_tensor_core_smem_bytes(shape.fp8);
  // The tuning's mla_kernel=simple forgoes it; its mla_splits replaces the rule's count.
  if (tuning.mla_kernel != MlaKernel::kSimple && device.arch >= 90 &&
      tc_smem <= device.max_smem_per_block && row_tiles <= kMlaTcMaxRowTiles &&
      shape.num_seqs <= INT32_MAX) {
    plan.kernel = MlaKernel::kTensorCore;
    plan.row_tiles = row_tiles;
    plan.num_splits = tuning.mla_splits > 0 ? std::min(tuning.mla_splits, kMlaTcMaxSplits)
                                            : tensor_core_splits(shape.num_seqs * row_tiles,
                                                                 shape.max_seq_len, device.num_sms);
    // The workspace holds splits x T x H rows, bounded by the grid's rows only while T <= B x
    // max_query_len; more tokens than that is bad metadata (poisoned rows), which must not cost
    // an allocation the size of T times the splits: one split, no workspace.
    if (shape.num_tokens > shape.num_seqs * rows_per_seq) plan.num_splits = 1;
    plan.threads = kMlaTcThreads;
    plan.smem_bytes = tc_smem;
    return plan;
  }
  plan.kernel = MlaKernel::kSimple;
  plan.grid_rows = shape.num_seqs * rows_per_seq;
  plan.grid_heads = ceil_div(shape.num_heads, kMlaHeadsPerBlock);
  plan.threads = kMlaThreads;
  plan.smem_bytes =
      static_cast<int>((kMlaHeadsPerBlock + kMlaTileKeys) * kMlaRowFloats * sizeof(float));
  if (plan.grid_rows > INT32_MAX) {
    plan.error = "too many query rows for one launch: sequences x max_query_len = " +
                 std::to_string(plan.grid_rows) + " (at most 2^31 - 1)";
  } else if (plan.grid_heads > 65535) {
    plan.error = "too many heads for one launch: " + std::to_string(shape.num_heads);
  }
  return plan;
}

std::string describe_plan(const MlaPlan& plan) {
  if (plan.kernel == MlaKernel::kSimple) return "simple";
  if (plan.num_splits == 1) return "tensor_core";
  return "tensor_core/split x" + std::to_string(plan.num_splits);
}

}  // namespace astr::kernels
