// Latent attention on the tensor cores (sm_90; compiles for sm_80): the plan's tensor_core form
// (plan.h). Definitions: params.h.
//
// Block (sequence b, row tile m, split s), 8 warps. Its kMlaTcRows = 64 rows pack (new token i,
// head h) of sequence b as row i * H + h, so one tile of positions read from the pool serves all
// heads and all new tokens of the sequence. Its positions: split s's share of [0, extent), where
// extent is what its last row sees, in whole tiles of kMlaTcKeys = 32.
//   - The query tile (64 x 576, 16-bit) is copied into shared memory once; tiles of positions
//     (latent 512 and rotary key 64 side by side in one row) stream through two buffers by
//     cp.async, the next one in flight while the current one is multiplied. An FP8 latent lands
//     as raw bytes in a staging buffer and is converted to q's dtype in shared memory (exactly:
//     every e4m3 value is a bf16 and an fp16); its scale multiplies the latent part of the scores
//     and the output instead, in float32.
//   - Warp w takes rows 16 (w % 4) .. + 15 and output columns 256 (w / 4) .. + 255; the two warps
//     of a row group (w and w + 4) are a pair that meets at its own named barrier. Each computes
//     the scores of its 16 rows against its half of the tile's 32 positions (S = Qn Ckv^T +
//     Qr Kr^T, mma.sync m16n8k16, float32 accumulators), the pair exchanges the rows' maxima
//     through shared memory, each writes its half of P (16-bit) there, and each then computes
//     O += P Ckv over its 256 columns and all 32 positions (128 float32 accumulators a thread).
//     Each keeps the softmax sum of its own positions; the pair adds them at the end.
//   - One split: out and lse written directly. Several: each split writes its normalised output
//     and log2-sum-exp to the workspace and mla_merge_splits_kernel combines them.
//
// Fragment layouts of mma.sync m16n8k16 (g = lane / 4, t = lane % 4): A (16 x 16, row-major)
// a0 = A[g][2t, 2t+1], a1 = A[g+8][2t, 2t+1], a2 = A[g][2t+8, 2t+9], a3 = A[g+8][2t+8, 2t+9];
// B (16 x 8, "col") b0 = B[2t, 2t+1][g], b1 = B[2t+8, 2t+9][g]; C (16 x 8) c0, c1 = C[g][2t, 2t+1],
// c2, c3 = C[g+8][2t, 2t+1]. ldmatrix x4 gives lane l, from matrix j (rows addressed by lanes
// 8j .. 8j+7), the pair at row l / 4, columns 2 (l % 4) and + 1 (.trans: of the transpose).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../common/device_primitives.cuh"
#include "config.h"
#include "launch.h"
#include "sequence_rows.cuh"

namespace astr::kernels {

namespace {

constexpr int kLatent = kMlaLatentDim;      // Dc
constexpr int kRope = kMlaRopeDim;          // Dr
constexpr int kWidth = kLatent + kRope;     // q/k width
constexpr int kStride = kMlaTcRowElements;  // shared-memory row stride, 16-bit elements
constexpr int kRows = kMlaTcRows;
constexpr int kKeys = kMlaTcKeys;
constexpr int kThreads = kMlaTcThreads;
constexpr int kRowGroups = kRows / 16;                     // 4 warps' rows
constexpr int kColumnHalves = kThreads / 32 / kRowGroups;  // 2 warps' columns
constexpr int kWarpColumns = kLatent / kColumnHalves;      // 256
constexpr int kOutTiles = kWarpColumns / 8;                // n8 tiles of a warp's output: 32
constexpr int kWarpKeys = kKeys / kColumnHalves;           // positions a warp scores: 16
constexpr int kScoreTiles = kWarpKeys / 8;                 // n8 tiles of a warp's scores: 2
constexpr int kProbStride = kMlaTcProbElements;            // P's row stride, elements
constexpr int kWidthSteps = kWidth / 16;                   // k16 steps of a score: 36
constexpr int kLatentSteps = kLatent / 16;                 // of which the latent's: 32
constexpr int kChunks16 = kWidth / 8;                      // 16-byte pieces of a 16-bit row
static_assert(kRowGroups * kColumnHalves * 32 == kThreads, "8 warps: 4 row groups x 2 halves");
static_assert(kStride % 8 == 0 && (kStride / 8) % 2 == 1, "16-byte rows, odd in 16-byte units");
static_assert(kKeys % 16 == 0 && kWarpKeys == 16, "P's k16 steps; a warp scores one x4 load");
static_assert(kProbStride % 8 == 0 && (kProbStride / 8) % 2 == 1, "P's rows padded as the tiles'");
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr unsigned kFullMask = 0xffffffffu;

// The two warps of row group `group` (warps group and group + 4) wait for each other.
__device__ __forceinline__ void pair_barrier(int group) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(1 + group));
}

// 16 e4m3 bytes as 16 T values (exact: every e4m3 value is a bf16 and an fp16), two uint4s.
template <typename T>
__device__ __forceinline__ void fp8x16_to(const uint4& raw, uint4 (&out)[2]) {
  const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&raw);
  uint32_t* words = reinterpret_cast<uint32_t*>(out);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const __half2 h(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3));
    if constexpr (std::is_same_v<T, __half>) {
      words[i] = *reinterpret_cast<const uint32_t*>(&h);
    } else {
      words[i] = pack_pair<__nv_bfloat16>(__low2float(h), __high2float(h));
    }
  }
}

// Where packed row r = i * H + h of sequence `rows` lives: q, out and lse's token, and the head.
struct RowPlace {
  int token;
  int head;
};
__device__ __forceinline__ RowPlace row_place(const SequenceRows& rows, int row, int heads) {
  return {rows.first_token + row / heads, row % heads};
}

template <typename T, bool kFp8>
__global__ void __launch_bounds__(kThreads, 1)
    mla_tensor_core_kernel(const __grid_constant__ MlaAttentionParams p,
                           const __grid_constant__ MlaSplitWorkspace workspace) {
  extern __shared__ __align__(16) unsigned char smem_bytes[];
  T* q_tile = reinterpret_cast<T*>(smem_bytes);   // [kRows][kStride]
  T* kv_tiles = q_tile + kRows * kStride;         // [2][kKeys][kStride]: latent, then rope
  T* prob_tile = kv_tiles + 2 * kKeys * kStride;  // [kRows][kProbStride]: the tile's P
  float* row_exchange = reinterpret_cast<float*>(prob_tile + kRows * kProbStride);  // [2][kRows]
  uint8_t* fp8_tiles = reinterpret_cast<uint8_t*>(row_exchange + 2 * kRows);  // [2][kKeys][Dc]

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = lane / 4, t = lane % 4;
  const int row_group = warp % kRowGroups, column_half = warp / kRowGroups;
  const int seq = blockIdx.x, split = blockIdx.z, num_splits = gridDim.z;
  const int heads = p.num_heads;
  const SequenceRows rows = sequence_rows(p, seq);
  const int row0 = blockIdx.y * kRows;  // the block's first packed row
  const int64_t rows_total = static_cast<int64_t>(rows.num_rows) * heads;
  if (row0 >= rows_total) return;  // uniform: a row tile past the sequence's new tokens
  const int rows_here = static_cast<int>(min(static_cast<int64_t>(kRows), rows_total - row0));
  const bool split_output = num_splits > 1;
  const int64_t packed_rows = static_cast<int64_t>(p.num_tokens) * heads;  // workspace rows

  // The positions: what the block's last row sees, split s's share in whole tiles.
  const int extent = rows.kv_end((row0 + rows_here - 1) / heads);
  const int share = (extent + num_splits - 1) / num_splits;
  const int chunk = (share + kKeys - 1) / kKeys * kKeys;
  const int begin = static_cast<int>(min(static_cast<int64_t>(split) * chunk, int64_t{extent}));
  const int end = static_cast<int>(min(static_cast<int64_t>(begin) + chunk, int64_t{extent}));
  const int32_t* table = p.block_table + static_cast<int64_t>(seq) * p.block_table_stride;

  // Bad pages poison the sequence: the splits of a row tile check one share each of the pages
  // its length uses (any NaN split makes the merged row NaN). Reads below skip such pages.
  const int pages_used = (rows.seq_len + p.page_size - 1) / p.page_size;
  const int page_share = (pages_used + num_splits - 1) / num_splits;
  const int64_t page_begin = static_cast<int64_t>(split) * page_share;
  const int64_t page_end = min(int64_t{pages_used}, page_begin + page_share);
  bool bad_page = false;
  for (int64_t i = page_begin + tid; i < page_end; i += kThreads) {
    const int page = table[i];
    bad_page |= page < 0 || page >= p.num_pages;
  }
  const bool poisoned = __syncthreads_or(rows.poisoned || bad_page);

  // A row's lse (log2 units) to lse (natural log), or to the workspace (split output).
  auto write_lse = [&](int row, float lse2) {
    const RowPlace place = row_place(rows, row, heads);
    if (split_output) {
      workspace.lse[split * packed_rows + static_cast<int64_t>(place.token) * heads + place.head] =
          lse2;
    } else if (p.lse != nullptr) {
      p.lse[static_cast<int64_t>(place.token) * p.lse_stride_token + place.head] =
          lse2 * kLn2;  // -inf and NaN stay
    }
  };

  if (poisoned || begin >= end) {
    // Poisoned: NaN rows and lse, or (splits) NaN lse, from which the merge writes NaN rows.
    // Nothing to see: zeros and lse -inf, or (splits) lse -inf alone, a split the merge skips.
    const float nan = __int_as_float(0x7fc00000);
    const float value = poisoned ? nan : 0.f;
    for (int e = tid; !split_output && e < rows_here * kLatent; e += kThreads) {
      const RowPlace place = row_place(rows, row0 + e / kLatent, heads);
      T* out = static_cast<T*>(p.out) + static_cast<int64_t>(place.token) * p.out_stride_token +
               static_cast<int64_t>(place.head) * p.out_stride_head;
      out[e % kLatent] = from_float<T>(value);
    }
    for (int r = tid; r < rows_here; r += kThreads) write_lse(row0 + r, poisoned ? nan : -INFINITY);
    return;
  }

  // ---- Copies ----
  // The query tile: row r of the block is packed row row0 + r; rows past the sequence's are
  // zeros (scored, never written).
  for (int c = tid; c < kRows * kChunks16; c += kThreads) {
    const int r = c / kChunks16, piece = c % kChunks16;
    T* dst = q_tile + r * kStride + piece * 8;
    const T* src = static_cast<const T*>(p.q_nope);
    int bytes = 0;
    if (r < rows_here) {
      const RowPlace place = row_place(rows, row0 + r, heads);
      src = piece < kLatent / 8
                ? static_cast<const T*>(p.q_nope) + place.token * p.q_nope_stride_token +
                      place.head * p.q_nope_stride_head + piece * 8
                : static_cast<const T*>(p.q_rope) + place.token * p.q_rope_stride_token +
                      place.head * p.q_rope_stride_head + (piece - kLatent / 8) * 8;
      bytes = 16;
    }
    cp_async_16(shared_address(dst), src, bytes != 0);
  }

  // A tile of positions [tile, tile + kKeys) into buffer `buf`; positions past `end` (and any on
  // a page outside the pool) are zeros, never read: P is 0 there, and 0 times a NaN would not be.
  auto load_tile = [&](int buf, int tile) {
    T* kv = kv_tiles + buf * kKeys * kStride;
    constexpr int kLatentPieces = kFp8 ? kLatent / 16 : kLatent / 8;
    constexpr int kPieces = kLatentPieces + kRope / 8;
    for (int c = tid; c < kKeys * kPieces; c += kThreads) {
      const int k = c / kPieces, piece = c % kPieces;
      const int pos = tile + k;
      int64_t page = -1;
      if (pos < end) {
        page = table[pos / p.page_size];
        if (page >= p.num_pages) page = -1;
      }
      const int64_t slot = pos % p.page_size;
      const bool read = page >= 0;
      if (piece < kLatentPieces) {
        if constexpr (kFp8) {
          const uint8_t* src = static_cast<const uint8_t*>(p.ckv_cache);
          if (read) src += page * p.ckv_stride_page + slot * p.ckv_stride_slot + piece * 16;
          cp_async_16(shared_address(fp8_tiles + (buf * kKeys + k) * kLatent + piece * 16), src,
                      read);
        } else {
          const T* src = static_cast<const T*>(p.ckv_cache);
          if (read) src += page * p.ckv_stride_page + slot * p.ckv_stride_slot + piece * 8;
          cp_async_16(shared_address(kv + k * kStride + piece * 8), src, read);
        }
      } else {
        const int rope_piece = piece - kLatentPieces;
        const T* src = static_cast<const T*>(p.krope_cache);
        if (read) src += page * p.krope_stride_page + slot * p.krope_stride_slot + rope_piece * 8;
        cp_async_16(shared_address(kv + k * kStride + kLatent + rope_piece * 8), src, read);
      }
    }
  };

  load_tile(0, begin);
  cp_async_commit();  // the query tile and the first tile of positions

  // ---- Per-thread state ----
  // This thread's two rows: g and g + 8 of its warp's 16. What each sees, clipped to the split.
  int row_end[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row_group * 16 + g + 8 * i;
    row_end[i] = r < rows_here ? min(rows.kv_end((row0 + r) / heads), end) : 0;
  }
  const float scale_log2 = p.scale * kLog2e;
  const float ckv_scale = kFp8 ? *p.ckv_scale : 1.f;
  float row_max[2] = {-INFINITY, -INFINITY};  // log2 units
  float row_sum[2] = {0.f, 0.f};              // this thread's share (its columns)
  float acc[kOutTiles][4];
#pragma unroll
  for (int j = 0; j < kOutTiles; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;

  const T* q_warp = q_tile + (row_group * 16) * kStride;
  // A row group past the block's rows (16 heads of one token fill one of four) only copies.
  const bool warp_has_rows = row_group * 16 < rows_here;
  int buf = 0;
  for (int tile = begin; tile < end; tile += kKeys, buf ^= 1) {
    if (tile + kKeys < end) load_tile(buf ^ 1, tile + kKeys);
    cp_async_commit();  // (empty on the last tile: the wait below stays uniform)
    cp_async_wait<1>();
    __syncthreads();
    T* kv = kv_tiles + buf * kKeys * kStride;
    if constexpr (kFp8) {
      const uint8_t* raw = fp8_tiles + buf * kKeys * kLatent;
      for (int c = tid; c < kKeys * kLatent / 16; c += kThreads) {
        const int k = c / (kLatent / 16), piece = c % (kLatent / 16);
        const uint4 bytes = *reinterpret_cast<const uint4*>(raw + k * kLatent + piece * 16);
        uint4 converted[2];
        fp8x16_to<T>(bytes, converted);
        uint4* dst = reinterpret_cast<uint4*>(kv + k * kStride + piece * 16);
        dst[0] = converted[0];
        dst[1] = converted[1];
      }
      __syncthreads();
    }
    if (warp_has_rows) {
      // S = Q K^T: the warp's 16 rows x its 16 positions (column_half's), 2 n8 tiles.
      const int key0 = column_half * kWarpKeys;  // the warp's first position in the tile
      float s[kScoreTiles][4];
#pragma unroll
      for (int j = 0; j < kScoreTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll 4
      for (int kk = 0; kk < kWidthSteps; ++kk) {
        uint32_t a[4], b[4];
        ldmatrix_x4(shared_address(q_warp + (lane % 16) * kStride + kk * 16 + (lane / 16) * 8), a);
        ldmatrix_x4(shared_address(kv + (key0 + (lane / 16) * 8 + lane % 8) * kStride + kk * 16 +
                                   ((lane / 8) % 2) * 8),
                    b);
        mma_m16n8k16<T>(s[0], a, b[0], b[1]);
        mma_m16n8k16<T>(s[1], a, b[2], b[3]);
        if (kFp8 && kk == kLatentSteps - 1) {  // the latent part read stored values: scale it
#pragma unroll
          for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[j][e] *= ckv_scale;
        }
      }

      // Online softmax of the thread's two rows (elements e / 2 == i): the maximum over its
      // quad's columns, then over the pair's (both warps then hold the same maxima).
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int j = 0; j < kScoreTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int pos = tile + key0 + j * 8 + 2 * t + (e % 2);
          const float logit = pos < row_end[e / 2] ? s[j][e] * scale_log2 : -INFINITY;
          s[j][e] = logit;
          tile_max[e / 2] = fmaxf(tile_max[e / 2], logit);
        }
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(kFullMask, tile_max[i], 1));
        tile_max[i] = fmaxf(tile_max[i], __shfl_xor_sync(kFullMask, tile_max[i], 2));
        if (t == 0) row_exchange[column_half * kRows + row_group * 16 + g + 8 * i] = tile_max[i];
      }
      pair_barrier(row_group);
      float rescale[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        const float other = row_exchange[(1 - column_half) * kRows + row_group * 16 + g + 8 * i];
        const float new_max = fmaxf(row_max[i], fmaxf(tile_max[i], other));
        const float base = new_max == -INFINITY ? 0.f : new_max;  // nothing seen yet: no inf - inf
        rescale[i] = exp2f(row_max[i] - base);
        row_max[i] = new_max;
        tile_max[i] = base;
        row_sum[i] *= rescale[i];
      }
      // P of the warp's positions into the shared tile: rows g and g + 8, columns 2t and 2t + 1.
      T* prob_warp = prob_tile + (row_group * 16) * kProbStride + key0;
#pragma unroll
      for (int j = 0; j < kScoreTiles; ++j) {
        float weight[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          weight[e] = exp2f(s[j][e] - tile_max[e / 2]);
          row_sum[e / 2] += weight[e];
        }
        *reinterpret_cast<uint32_t*>(prob_warp + g * kProbStride + j * 8 + 2 * t) =
            pack_pair<T>(weight[0], weight[1]);
        *reinterpret_cast<uint32_t*>(prob_warp + (g + 8) * kProbStride + j * 8 + 2 * t) =
            pack_pair<T>(weight[2], weight[3]);
      }
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) {
        acc[j][0] *= rescale[0];
        acc[j][1] *= rescale[0];
        acc[j][2] *= rescale[1];
        acc[j][3] *= rescale[1];
      }
      pair_barrier(row_group);  // the pair's P is written

      // O += P V over the warp's 256 columns and the tile's 32 positions.
      const T* v_warp = kv + column_half * kWarpColumns;
      const T* prob_rows = prob_tile + (row_group * 16) * kProbStride;
#pragma unroll
      for (int ks = 0; ks < kKeys / 16; ++ks) {
        uint32_t a[4];
        ldmatrix_x4(
            shared_address(prob_rows + (lane % 16) * kProbStride + ks * 16 + (lane / 16) * 8), a);
#pragma unroll
        for (int pair = 0; pair < kOutTiles / 2; ++pair) {
          uint32_t b[4];
          ldmatrix_x4_trans(
              shared_address(v_warp + (ks * 16 + ((lane / 8) % 2) * 8 + lane % 8) * kStride +
                             pair * 16 + (lane / 16) * 8),
              b);
          mma_m16n8k16<T>(acc[2 * pair], a, b[0], b[1]);
          mma_m16n8k16<T>(acc[2 * pair + 1], a, b[2], b[3]);
        }
      }
    }  // warp_has_rows
    __syncthreads();  // the buffer is consumed before the next iteration refills it
  }
  cp_async_wait<0>();

  // ---- Epilogue: each row's sum over its quad and the pair's two halves of the positions (the
  // exchange's last reads were before the loop's closing barrier); out = acc / sum (times the FP8
  // scale) ----
  float sums[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    sums[i] = row_sum[i];
    sums[i] += __shfl_xor_sync(kFullMask, sums[i], 1);
    sums[i] += __shfl_xor_sync(kFullMask, sums[i], 2);
    if (warp_has_rows && t == 0)
      row_exchange[column_half * kRows + row_group * 16 + g + 8 * i] = sums[i];
  }
  if (warp_has_rows) pair_barrier(row_group);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int r = row_group * 16 + g + 8 * i;
    const float sum = sums[i] + (warp_has_rows ? row_exchange[(1 - column_half) * kRows + r] : 0.f);
    if (r >= rows_here) continue;
    const int row = row0 + r;
    const RowPlace place = row_place(rows, row, heads);
    // sum is 0 for a row that saw nothing, NaN where a score was NaN or inf (a NaN or inf in q
    // or the cache): that NaN stays in out and lse, so that the merge makes the row NaN too.
    const bool saw_nothing = sum == 0.f;
    const float inverse = saw_nothing ? 0.f : ckv_scale / sum;
    const int column0 = column_half * kWarpColumns + 2 * t;
    if (split_output) {
      float* out =
          workspace.out +
          (split * packed_rows + static_cast<int64_t>(place.token) * heads + place.head) * kLatent;
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) {
        *reinterpret_cast<float2*>(out + column0 + j * 8) =
            make_float2(acc[j][2 * i] * inverse, acc[j][2 * i + 1] * inverse);
      }
    } else {
      T* out = static_cast<T*>(p.out) + static_cast<int64_t>(place.token) * p.out_stride_token +
               static_cast<int64_t>(place.head) * p.out_stride_head;
#pragma unroll
      for (int j = 0; j < kOutTiles; ++j) {
        *reinterpret_cast<uint32_t*>(out + column0 + j * 8) =
            pack_pair<T>(acc[j][2 * i] * inverse, acc[j][2 * i + 1] * inverse);
      }
    }
    if (column_half == 0 && t == 0)
      write_lse(row, saw_nothing ? -INFINITY : row_max[i] + log2f(sum));
  }
}

// out and lse of packed row r from the splits' partial results: weights 2^(lse_s - max), skipping
// the splits that saw nothing (their weight is 0); any NaN split (poisoned, or a NaN score) makes
// the row NaN, none that saw anything makes it zeros with lse -inf. A warp per row, 16 columns a
// lane.
template <typename T>
__global__ void __launch_bounds__(256)
    mla_merge_splits_kernel(const __grid_constant__ MlaAttentionParams p,
                            const __grid_constant__ MlaSplitWorkspace workspace, int num_splits) {
  const int64_t packed_rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= packed_rows) return;
  const int token = static_cast<int>(row / p.num_heads), head = static_cast<int>(row % p.num_heads);
  float max_lse = -INFINITY;
  bool poisoned = false;
  for (int s = 0; s < num_splits; ++s) {
    const float lse = workspace.lse[s * packed_rows + row];
    poisoned |= isnan(lse);
    max_lse = fmaxf(max_lse, lse);
  }
  T* out = static_cast<T*>(p.out) + static_cast<int64_t>(token) * p.out_stride_token +
           static_cast<int64_t>(head) * p.out_stride_head;
  const float nan = __int_as_float(0x7fc00000);
  float column_sums[kLatent / 128][4] = {};
  float total = 0.f;
  if (!poisoned && max_lse != -INFINITY) {
    for (int s = 0; s < num_splits; ++s) {
      const float weight = exp2f(workspace.lse[s * packed_rows + row] - max_lse);
      if (weight == 0.f) continue;
      total += weight;
      const float* partial = workspace.out + (s * packed_rows + row) * kLatent;
#pragma unroll
      for (int i = 0; i < kLatent / 128; ++i) {
        const float4 v = *reinterpret_cast<const float4*>(partial + i * 128 + lane * 4);
        column_sums[i][0] += weight * v.x;
        column_sums[i][1] += weight * v.y;
        column_sums[i][2] += weight * v.z;
        column_sums[i][3] += weight * v.w;
      }
    }
  }
  const float inverse = total > 0.f ? 1.f / total : 0.f;
#pragma unroll
  for (int i = 0; i < kLatent / 128; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      out[i * 128 + lane * 4 + e] = from_float<T>(poisoned ? nan : column_sums[i][e] * inverse);
  if (p.lse != nullptr && lane == 0) {
    p.lse[static_cast<int64_t>(token) * p.lse_stride_token + head] =
        poisoned ? nan : (total > 0.f ? (max_lse + log2f(total)) * kLn2 : -INFINITY);
  }
}

template <typename T, bool kFp8>
LaunchStatus launch_typed(const MlaAttentionParams& p, const MlaPlan& plan,
                          const MlaSplitWorkspace& workspace, cudaStream_t stream) {
  auto kernel = mla_tensor_core_kernel<T, kFp8>;
  const cudaError_t error =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, plan.smem_bytes);
  if (error != cudaSuccess)
    return {std::string("cudaFuncSetAttribute: ") + cudaGetErrorString(error)};
  const dim3 grid(static_cast<unsigned>(p.num_seqs), static_cast<unsigned>(plan.row_tiles),
                  static_cast<unsigned>(plan.num_splits));
  kernel<<<grid, kThreads, plan.smem_bytes, stream>>>(p, workspace);
  const LaunchStatus launched = status_after_launch("mla_tensor_core_kernel");
  if (!launched.ok() || plan.num_splits == 1) return launched;
  const int64_t packed_rows = static_cast<int64_t>(p.num_tokens) * p.num_heads;
  constexpr int kRowsPerBlock = 256 / 32;
  mla_merge_splits_kernel<T>
      <<<static_cast<unsigned>((packed_rows + kRowsPerBlock - 1) / kRowsPerBlock), 256, 0,
         stream>>>(p, workspace, plan.num_splits);
  return status_after_launch("mla_merge_splits_kernel");
}

template <typename T>
LaunchStatus launch_for_cache(const MlaAttentionParams& p, const MlaPlan& plan,
                              const MlaSplitWorkspace& workspace, cudaStream_t stream) {
  return p.ckv_dtype == ScalarType::kFloat8E4M3
             ? launch_typed<T, true>(p, plan, workspace, stream)
             : launch_typed<T, false>(p, plan, workspace, stream);
}

}  // namespace

LaunchStatus launch_mla_tensor_core(const MlaAttentionParams& params, const MlaPlan& plan,
                                    const MlaSplitWorkspace& workspace, cudaStream_t stream) {
  switch (params.q_dtype) {
    case ScalarType::kBFloat16:
      return launch_for_cache<__nv_bfloat16>(params, plan, workspace, stream);
    case ScalarType::kFloat16:
      return launch_for_cache<__half>(params, plan, workspace, stream);
    default:
      return {"mla_attention: q must be bfloat16 or float16"};
  }
}

}  // namespace astr::kernels
