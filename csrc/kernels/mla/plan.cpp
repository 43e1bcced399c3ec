#include "plan.h"

#include <climits>

namespace astr::kernels {

MlaPlan plan_mla_attention(int64_t num_seqs, int64_t max_query_len, int64_t num_heads,
                           bool decode) {
  MlaPlan plan;
  const int64_t rows_per_seq = decode ? 1 : max_query_len;
  plan.grid_rows = num_seqs * rows_per_seq;
  plan.grid_heads = (num_heads + kMlaHeadsPerBlock - 1) / kMlaHeadsPerBlock;
  plan.smem_bytes =
      static_cast<int>((kMlaHeadsPerBlock + kMlaTileKeys) * kMlaRowFloats * sizeof(float));
  plan.poison_unplaced_rows = !decode;
  if (rows_per_seq < 1) {
    plan.error = "max_query_len must be at least 1 for a prefill";
  } else if (plan.grid_rows > INT32_MAX) {
    plan.error = "too many query rows for one launch: sequences x max_query_len = " +
                 std::to_string(plan.grid_rows) + " (at most 2^31 - 1)";
  } else if (plan.grid_heads > 65535) {
    plan.error = "too many heads for one launch: " + std::to_string(num_heads);
  }
  return plan;
}

}  // namespace astr::kernels
