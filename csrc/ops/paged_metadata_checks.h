// The value checks of a paged call's metadata, shared by astr::attention's validation and
// astr::mla_attention's (validate_attention.cpp).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace astr {

// One paged call's metadata, its shapes already checked (csrc/README.md, "The ops").
struct PagedMetadata {
  const at::Tensor& block_table;      // int32 [B, W]
  const at::Tensor& seq_lens;         // int32 [B], cached + new tokens
  const at::Tensor* query_start_loc;  // int32 [B + 1], or null (a decode may leave it out)
  int64_t num_tokens;                 // T, the query tokens
  int64_t max_query_len;              // the host bound on any sequence's new tokens
  bool decode;                        // one new token per sequence; a length of 0 is padding
  int64_t num_pages;                  // P of the pools
  int64_t page_size;                  // S
  const char* q_name;                 // the query argument's name, for messages
};

// Reads the metadata's values where that costs no synchronisation (CPU tensors) or where the
// checked mode asks for it (set_metadata_checks), and raises naming the bad argument: a
// query_start_loc that does not run from 0 to T without decreasing, a sequence with more new
// tokens than max_query_len or than its length, a length past its block-table row, a page id
// outside the pool. Fake and meta tensors are not read. Under CUDA graph capture a read raises a
// message that says to turn the checked mode off.
void check_paged_metadata_values(const PagedMetadata& metadata);

// False for tensors whose values cannot be read here (fake or functional tensors while
// torch.compile traces, meta tensors).
bool has_readable_values(const at::Tensor& t);

}  // namespace astr
