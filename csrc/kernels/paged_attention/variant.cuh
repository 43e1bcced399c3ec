// The variant layer: what each query row sees, how its scores are shaped and how its final state
// becomes an output row. Every paged kernel (decode_kernel.cuh, decode_persistent_kernel.cuh,
// prefill_mma_sync_kernel.cuh, prefill_wgmma_kernel.cuh, prefill_warp_specialized_kernel.cuh, and
// the merge kernel for split decodes) asks here, so a mask or score variant is written once
// (csrc/README.md has the recipe).
//
// Rows pack (new token, q head of the GQA group): row r of kv head h is new token r / G of the
// sequence, q head h * G + r % G (G = num_q_heads / num_kv_heads). New token i of a sequence sits
// at kv position first_pos + i, first_pos = seq_len - q_len (params.h has the visibility rule).
//
// Softmax state is kept in the log2 domain (exp2 on the SFU): scores are multiplied by
// scale * log2(e), or folded into the exponent when that factor is positive (online_softmax.cuh).
//
// Poison: metadata that would make a kernel read outside its tensors is never followed (page ids
// outside the pool are not read, lengths are clamped to the block table); the rows it concerns are
// written as NaN, which a finished state carries as l = NaN through every merge (finish_row).
#pragma once

#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>

#include "../common/device_primitives.cuh"
#include "params.h"

namespace astr::kernels {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// One sequence as the block sees it, its metadata clamped to what can be read.
struct SequenceRows {
  int seq_len;    // kv length, clamped to [0, block table width * page size]
  int q_start;    // first new token in q
  int q_len;      // new tokens (clamped so that they lie in q)
  int first_pos;  // kv position of new token 0: seq_len - q_len
  int num_rows;   // q_len * group
  int group;      // q heads per kv head
  bool poisoned;  // the metadata is invalid: the sequence's rows are written as NaN
};

__device__ __forceinline__ int block_table_positions(const PagedAttentionParams& p) {
  return static_cast<int>(
      min((int64_t)p.block_table_width << p.log2_page_size, (int64_t)INT32_MAX));
}

// Decode: token b is sequence b's one new token, at position seq_len - 1. A length of 0 is a
// padding slot (a batch padded for a captured graph): it sees nothing and is written as zeros.
__device__ __forceinline__ SequenceRows decode_sequence(const PagedAttentionParams& p, int seq,
                                                        int seq_len) {
  SequenceRows s;
  const int capacity = block_table_positions(p);
  s.poisoned = seq_len < 0 || seq_len > capacity;
  s.seq_len = min(max(seq_len, 0), capacity);
  s.q_start = seq;
  s.q_len = 1;
  s.first_pos = s.seq_len - 1;
  s.group = p.num_q_heads / p.num_kv_heads;
  s.num_rows = s.group;
  return s;
}

// Prefill: sequence b's new tokens are q[query_start_loc[b] .. query_start_loc[b + 1]).
__device__ __forceinline__ SequenceRows prefill_sequence(const PagedAttentionParams& p,
                                                         const int32_t* query_start_loc, int seq,
                                                         int max_query_len) {
  SequenceRows s;
  const int capacity = block_table_positions(p);
  const int seq_len = p.seq_lens[seq];
  const int start = query_start_loc[seq];
  const int end = query_start_loc[seq + 1];
  // Tokens outside q, a decreasing range or more tokens than the grid covers: nothing of this
  // sequence can be placed for sure; its rows that lie in q are written as NaN.
  s.q_start = min(max(start, 0), p.num_tokens);
  const int q_end = min(max(end, s.q_start), p.num_tokens);
  s.q_len = q_end - s.q_start;
  s.poisoned = start < 0 || end < start || end > p.num_tokens || end - start > max_query_len ||
               seq_len < end - start || seq_len > capacity;
  s.seq_len = min(max(seq_len, 0), capacity);
  s.first_pos = s.seq_len - s.q_len;
  s.group = p.num_q_heads / p.num_kv_heads;
  s.num_rows = s.q_len * s.group;
  return s;
}

// The kv positions [begin, end) that rows [row0, row0 + block_rows) can see, together: from the
// window's start of the first row's token to the causal edge of the last one (under a tree mask,
// the sequence's end: a new token may see any new token its row names), within the sequence and
// the mask's width.
struct KvRange {
  int begin, end;
};
__device__ __forceinline__ KvRange block_kv_range(const PagedAttentionParams& p,
                                                  const SequenceRows& s, int row0, int block_rows) {
  KvRange range{0, s.seq_len};
  const int first_token = row0 / s.group;
  const int last_token = (min(row0 + block_rows, s.num_rows) - 1) / s.group;
  if (p.is_causal && p.tree_mask == nullptr)
    range.end = min(range.end, s.first_pos + last_token + 1);
  if (p.attn_mask != nullptr) range.end = min(range.end, p.mask_kv_len);
  if (p.window_left >= 0) range.begin = max(0, s.first_pos + first_token - p.window_left);
  return range;
}

// Which tiles need per-score masking for rows [row0, row0 + block_rows): a tile of kv positions
// [pos0, pos0 + tile_n) needs none when it lies in [unmasked_begin, unmasked_end), i.e. within the
// range's end, below the causal edge of the block's first row and from the window's start of its
// last row on; with a user mask every tile needs it, with a tree mask every tile holding a new
// token of the sequence. Worked out once per block (two registers in the loop: the prefill runs at
// the register cap).
struct UnmaskedTiles {
  int begin, end;
  __device__ __forceinline__ bool need_mask(int pos0, int tile_n) const {
    return pos0 < begin || pos0 + tile_n > end;
  }
};
__device__ __forceinline__ UnmaskedTiles unmasked_tiles(const PagedAttentionParams& p,
                                                        const SequenceRows& s, const KvRange& range,
                                                        int row0, int block_rows) {
  UnmaskedTiles tiles{0, range.end};
  if (p.is_causal) tiles.end = min(tiles.end, s.first_pos + row0 / s.group + 1);
  if (p.window_left >= 0) {
    const int last_token = (min(row0 + block_rows, s.num_rows) - 1) / s.group;
    tiles.begin = s.first_pos + last_token - p.window_left;
  }
  if (p.tree_mask != nullptr) tiles.end = min(tiles.end, s.first_pos);
  if (p.attn_mask != nullptr) tiles.end = INT_MIN;  // every tile
  return tiles;
}

// What one query row sees of a tile: positions in [begin, limit) where its mask row, if any, is
// true from mask_from on (mask_row[pos], pos >= mask_from). The user's mask row covers every
// position (mask_from 0); a tree mask's row covers the sequence's new tokens (mask_from =
// first_pos, mask_row offset back by it, and limit stops at its last column), the cached prefix
// before them staying visible. (Offset, so that the loop over a tile's scores subtracts nothing:
// the warp-specialised prefill spilled with the subtraction. Only positions >= mask_from are read
// through it, all inside the row.)
struct RowVisibility {
  int begin, limit;
  const bool* mask_row;  // null without a mask
  int mask_from;
};
__device__ __forceinline__ RowVisibility row_visibility(const PagedAttentionParams& p,
                                                        const SequenceRows& s, const KvRange& range,
                                                        int row) {
  const int token = min(row, max(s.num_rows - 1, 0)) / s.group;  // padding rows: clamp, never read
  const int position = s.first_pos + token;
  RowVisibility v;
  v.limit = p.is_causal && p.tree_mask == nullptr ? min(range.end, position + 1) : range.end;
  v.begin = p.window_left >= 0 ? max(0, position - p.window_left) : 0;
  v.mask_row = nullptr;
  v.mask_from = 0;
  if (p.attn_mask != nullptr) {
    v.mask_row = p.attn_mask + (int64_t)(s.q_start + token) * p.mask_stride_token;
  } else if (p.tree_mask != nullptr) {
    v.mask_row =
        p.tree_mask + ((int64_t)(s.q_start + token) * p.tree_mask_stride_token - s.first_pos);
    v.mask_from = s.first_pos;
    // Columns past the mask's width are never read (a sequence with more new tokens than
    // max_query_len is poisoned, and its rows still run).
    if (v.limit - s.first_pos > p.tree_mask_width) v.limit = s.first_pos + p.tree_mask_width;
  }
  return v;
}
// Whether rows read mask rows (row_visibility's mask_row): a kernel that keeps its rows' ranges
// across tiles looks a row up again only then.
__device__ __forceinline__ bool rows_read_masks(const PagedAttentionParams& p) {
  return p.attn_mask != nullptr || p.tree_mask != nullptr;
}
__device__ __forceinline__ bool visible(const RowVisibility& v, int pos) {
  bool keep = pos >= v.begin && pos < v.limit;
  if (v.mask_row != nullptr && keep && pos >= v.mask_from) keep = v.mask_row[pos];
  return keep;
}

// How raw scores q . k (fp32 accumulators) enter the online softmax. A positive scale is folded
// into the exponent (exp2(s * c - max * c): one FFMA per score, online_softmax.cuh); otherwise the
// scores are multiplied first. With a softcap the scores become tanh(s * scale / softcap) and
// softcap * log2(e) is what folds into the exponent.
//
// A softcap bounds the scores, so the softmax needs no running max (Softcap::kFixedMax below,
// online_softmax_row's kFixedMax): with the max held at 0 the weights 2^(softcap * log2(e) * tanh)
// lie in [2^-c, 2^c] for c = softcap * log2(e), all normal floats (and bf16s: P is bf16 for the
// P V multiply) while c <= kFixedMaxLimit, and a sum of up to 2^40 of them stays far below float's
// 2^128. That saves the max, its shuffles and the rescale of O per tile, which pays for the tanh
// in the issue-bound prefill softmax (benchmarks/results/decisions.md, "Softcap"). Not with fp16 P
// (largest 65504), nor with a larger softcap (softcap_kernel below).
constexpr float kFixedMaxLimit = 80.f;  // log2 of the largest weight: softcap <= 55.4
struct ScoreTransform {
  float scale_log2;  // scale * log2(e) (times the kv head's k scale)
  float exp_scale;   // what online_softmax_row multiplies scores and the max by
  bool fold;         // scale_log2 folded into exp_scale
  bool softcap;      // softcap on
  float cap_in;      // scale / softcap
};
// What a kernel is compiled for (a template argument, so that no softcap or fixed-max branch
// sits in the tile loop of a call that does not need it: such branches cost the prefill 3-8%): no
// softcap, a softcap with the running max, or with the max fixed at 0. The launchers pick it from
// the call (softcap_kernel).
enum class Softcap : int { kOff, kRunningMax, kFixedMax };
// fixed_max_allowed: the kernel family has a kFixedMax instantiation (the prefills; a decode
// reads memory, and keeps the running max). bf16_weights: P is bf16 for the P V multiply.
__host__ __device__ inline Softcap softcap_kernel(float softcap, bool bf16_weights,
                                                  bool fixed_max_allowed) {
  if (!(softcap > 0.f)) return Softcap::kOff;
  const bool bounded = bf16_weights && softcap * kLog2e <= kFixedMaxLimit;
  return fixed_max_allowed && bounded ? Softcap::kFixedMax : Softcap::kRunningMax;
}

// An FP8 cache's scales for one kv head (1 for a 16-bit cache): the k scale folds into the score
// scale (score_transform's scale_log2), the v scale multiplies each output row.
struct KvScales {
  float k = 1.f;
  float v = 1.f;
};
template <bool kFp8>
__device__ __forceinline__ KvScales kv_head_scales(const PagedAttentionParams& p, int kv_head) {
  KvScales scales;
  if constexpr (kFp8) {
    scales.k = p.k_scale[kv_head];
    scales.v = p.v_scale[kv_head];
  }
  return scales;
}

template <Softcap kSoftcap>
__device__ __forceinline__ ScoreTransform score_transform(const PagedAttentionParams& p,
                                                          float scale_log2) {
  ScoreTransform t;
  t.scale_log2 = scale_log2;
  t.softcap = kSoftcap != Softcap::kOff;
  t.fold = !t.softcap && scale_log2 > 0.f;
  t.exp_scale = t.softcap ? p.softcap * kLog2e : (t.fold ? scale_log2 : 1.f);
  t.cap_in = t.softcap ? scale_log2 / (kLog2e * p.softcap) : 0.f;
  return t;
}

// tanh on the SFU (tanh.approx: max relative error 2^-11, well under bf16's rounding).
__device__ __forceinline__ float fast_tanh(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Applies the transform to a tile of scores before masking; score(i) is a reference to score i.
template <int kCount, typename Score>
__device__ __forceinline__ void transform_scores(const ScoreTransform& t, Score&& score) {
  if (t.softcap) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) score(i) = fast_tanh(score(i) * t.cap_in);
  } else if (!t.fold) {
#pragma unroll
    for (int i = 0; i < kCount; ++i) score(i) *= t.scale_log2;
  }
}

// A row's sink logit in the log2 domain, or -inf without sinks.
__device__ __forceinline__ float sink_log2(const PagedAttentionParams& p, int q_head) {
  return p.sinks != nullptr ? p.sinks[q_head] * kLog2e : -INFINITY;
}

// A finished row: multiply its unnormalized output by `inv`; `lse_log2` is the log2 of its softmax
// denominator (-inf when it saw nothing). A row state (max m in the log2 domain, sum l) with a sink
// adds exp2(sink - m) to the sum; a poisoned state (l = NaN) gives NaN for both.
struct FinishedRow {
  float inv;
  float lse_log2;
};
__device__ __forceinline__ FinishedRow finish_row(float m, float l, float sink) {
  FinishedRow row;
  if (l != l) {  // poisoned
    row.inv = l;
    row.lse_log2 = l;
    return row;
  }
  if (sink != -INFINITY) {
    // Rescale to max(m, sink), so that neither term overflows; a row that saw nothing has m = -inf
    // and l = 0, and only the sink remains.
    const float top = fmaxf(m, sink);
    const float own = m == -INFINITY ? 0.f : exp2f(m - top);
    const float total = l * own + exp2f(sink - top);
    row.inv = own / total;  // out = o / l_total = o * own / total
    row.lse_log2 = top + log2f(total);
    return row;
  }
  row.inv = l > 0.f ? 1.f / l : 0.f;
  row.lse_log2 = l > 0.f ? m + log2f(l) : -INFINITY;
  return row;
}

// The log-sum-exp output, natural log, of row (token, q head) when the call asked for it.
__device__ __forceinline__ void store_lse(const PagedAttentionParams& p, int token, int q_head,
                                          float lse_log2) {
  if (p.lse != nullptr) p.lse[(int64_t)token * p.lse_stride_token + q_head] = lse_log2 * kLn2;
}

// The poison mark of a row state: l = NaN (finish_row turns it into NaN outputs).
__device__ __forceinline__ float poison_sum(float l, bool poisoned) {
  return poisoned ? __int_as_float(0x7fffffff) : l;
}

}  // namespace astr::kernels
