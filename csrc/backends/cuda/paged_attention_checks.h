// What the cuda kernels need of a paged call, checked before anything is allocated or launched.
// The op's validation (ops/validate_attention.cpp) runs before the resolver picks cuda; these
// checks hold for direct calls of astr::cuda_paged_attention too, and add the kernels' own rules.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

#include "ops/attention_args.h"

namespace astr::backends {

// The sizes of a checked paged call.
struct PagedCallShape {
  int64_t num_tokens = 0;    // T
  int64_t num_q_heads = 0;   // Hq
  int64_t head_dim = 0;      // D of q and k
  int64_t head_dim_v = 0;    // of v and the output (config.h's rows are (D, Dv) pairs)
  int64_t num_kv_heads = 0;  // Hkv
  int64_t page_size = 0;     // S, a power of two
  int64_t num_pages = 0;     // P
  int64_t num_seqs = 0;      // B
  int64_t width = 0;         // W, the block table's pages per sequence
  bool fp8 = false;          // an FP8 cache, read with k_scale / v_scale
};

// Raises naming the argument when a kernel cannot read it: CUDA tensors on q's device, 16-bit q,
// a head dim the kernels were built for, 16-byte rows, int32 metadata of the batch's shape.
PagedCallShape check_cuda_paged_call(const AttentionArgs& args);

}  // namespace astr::backends
