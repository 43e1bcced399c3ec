// Paged attention kernel template (decode and prefill) and its launcher.
// Included only by the per-head-dim instantiation files; see paged_attention_traits.h for the
// design.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "decode_timeline.cuh"
#include "dependent_launch.cuh"
#include "device_primitives.cuh"
#include "launch.h"
#include "online_softmax.cuh"
#include "paged_attention_instantiations.h"
#include "paged_attention_params.h"
#include "paged_attention_rows.cuh"
#include "paged_attention_tile_math.cuh"
#include "paged_attention_traits.h"
#include "paged_decode_merge.cuh"
#include "paged_kv_tile_loader.cuh"

namespace astrai::kernels {

template <typename Traits, typename T>
__global__ void __launch_bounds__(Traits::kBlockThreads, Traits::kMinBlocksPerSm)
    paged_attention_kernel(const __grid_constant__ PagedKernelArgs args) {
  constexpr int D = Traits::kHeadDim;
  constexpr int kChunks = Traits::kChunksPerRow;
  constexpr int kThreads = Traits::kThreads;  // of this thread's group
  constexpr int kGroups = Traits::kGroups;    // 2: a decode block pair (paged_attention_traits.h)
  constexpr int kTileN = Traits::kTileN;
  constexpr int kWarpTileN = Traits::kWarpTileN;
  constexpr int kStages = Traits::kStages;
  constexpr int kMRep = Traits::kRowBlocksPerWarp;
  constexpr int kBlockRows = Traits::kBlockRows;
  constexpr bool kDecode = Traits::kDecode;
  constexpr float kNegInf = -INFINITY;

  const PagedAttentionParams& p = args.base;
  extern __shared__ __align__(128) unsigned char smem_block[];
  // A block pair's group g works in its own region, kSmemBytes from g * kSmemBytes.
  const int pair_group = kGroups > 1 ? static_cast<int>(threadIdx.x) / kThreads : 0;
  unsigned char* smem_raw = smem_block + pair_group * Traits::kSmemBytes;
  T* q_smem = reinterpret_cast<T*>(smem_raw);
  T* k_smem = q_smem + Traits::kQSmemElements;
  T* v_smem = k_smem + Traits::kKVSmemElements;

  const int tid = kGroups > 1 ? static_cast<int>(threadIdx.x) % kThreads : threadIdx.x;
  auto sync_group = [] { group_barrier<kGroups, kThreads>(); };
  DecodeTimeline timeline;  // diagnostic build only (decode_timeline.cuh)
  if constexpr (kDecode) timeline.start = DecodeTimeline::now();
  // Split decode: let the merge kernel (launched as a programmatic dependent, see below) be
  // scheduled now; it waits for this grid's results before reading them.
  if (kDecode && kGroups == 1 && args.num_splits > 1 && !args.merge_in_cluster)
    allow_dependent_launch();
  // In-cluster merge: the first phase of the cluster barrier says "started" (waited for before a
  // block writes into a peer's shared memory, in the epilogue).
  if (kDecode && kGroups == 1 && args.merge_in_cluster) cluster_arrive_relaxed();
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int seq = blockIdx.x / p.num_kv_heads;
  const int kv_head = blockIdx.x % p.num_kv_heads;
  const int group = p.num_q_heads / p.num_kv_heads;
  // Prefill: heavy (late, causal) row tiles first.
  const int row_tile = kDecode ? blockIdx.y : gridDim.y - 1 - blockIdx.y;
  const int split = kDecode ? static_cast<int>(blockIdx.z) * kGroups + pair_group : 0;

  const int seq_len = p.seq_lens[seq];
  int q_start, q_len;
  if constexpr (kDecode) {
    q_start = seq;
    q_len = 1;
  } else {
    q_start = args.query_start_loc[seq];
    q_len = args.query_start_loc[seq + 1] - q_start;
  }
  const int num_rows = q_len * group;
  const int row0 = row_tile * kBlockRows;
  // (Never taken in decode, whose grid has ceil(group / 16) row tiles: a cluster's blocks, and a
  // block pair's groups, must all reach their barriers.)
  if (row0 >= num_rows) return;
  const int first_pos = seq_len - q_len;  // kv position of new token 0

  // kv range of this block: [kv_begin, kv_end).
  const int kv_end = block_kv_end(p, seq_len, first_pos, row0, kBlockRows, num_rows, group);
  // Decode: split s takes tiles s, s + S, s + 2S, ... of the sequence (S = num_splits), so the
  // splits stay balanced within a tile at every length (the grid comes from shapes alone) and a
  // block's first tile is known before its seq_len arrives.
  const int kv_begin = kDecode ? split * kTileN : 0;
  const int tile_step = kDecode ? args.num_splits * kTileN : kTileN;
  const int num_tiles = kv_end > kv_begin ? (kv_end - kv_begin + tile_step - 1) / tile_step : 0;

  // ---- global -> shared copies -------------------------------------------------------------
  auto load_q = [&]() {
    load_query_rows<T, kBlockRows, kChunks, kThreads>(
        p, q_smem, tid, q_start, row0, num_rows, group, kv_head,
        [](int r, int ch) { return tile_offset<D, Traits::kSwizzle>(r, ch); });
  };
  // K/V tiles (see paged_kv_tile_loader.cuh).
  KVTileSource source = kv_tile_source<T>(p, seq, kv_head);
  source.kv_begin = kv_begin;
  source.kv_end = kv_end;
  source.tile_step = tile_step;
  source.lookup_end = kDecode
                          ? static_cast<int>(min((int64_t)p.block_table_width << p.log2_page_size,
                                                 (int64_t)INT32_MAX))
                          : kv_end;
  // The eight-warp decode block's page-id ring follows the V stages (Traits::kPageIdRing).
  KVTileLoader<Traits, T> loader(source, k_smem, v_smem, tid,
                                 reinterpret_cast<int32_t*>(v_smem + Traits::kKVSmemElements));

  // ---- per-warp state ----------------------------------------------------------------------
  // Rows of this warp: decode, the block's 16 rows (warps split kv); prefill, kMRep x 16 rows.
  const int warp_row0 = kDecode ? 0 : warp * 16 * kMRep;
  const int warp_col0 = kDecode ? warp * kWarpTileN : 0;  // kv offset inside the tile
  const int lane_row = lane / 4;                          // fragment row (and +8)
  const int lane_col = (lane % 4) * 2;                    // fragment column pair

  WarpSoftmaxState<Traits> state;  // O, running max and sum of the warp's rows
  state.reset();
  uint32_t q_frag[Traits::kQInRegisters ? kMRep : 1][Traits::kQInRegisters ? D / 16 : 1][4];

  auto load_q_fragment = [&](int mi, int ks, uint32_t (&a)[4]) {
    const int r = warp_row0 + mi * 16 + (lane % 8) + ((lane / 8) % 2) * 8;
    const int ch = ks * 2 + lane / 16;
    ldmatrix_x4(shared_address(q_smem + tile_offset<D, Traits::kSwizzle>(r, ch)), a);
  };

  // ---- pipeline prologue ---------------------------------------------------------------------
  // Decode looks page ids up one tile ahead (into registers, consumed by the next issue), so the
  // block-table read latency hides behind a tile's compute: at page size 1 every row has its own
  // lookup. Its prologue issues every stage, empty or not: the first lookups then do not depend
  // on seq_len (see KVTileSource::lookup_end) and both reads are in flight together. Prefill
  // (compute-bound, no registers to spare) looks up just before the copy. With the page-id ring
  // (eight-warp decode blocks) the ids of the first kStages tiles are waited for here, with the
  // query, before the first copy; each step then carries the ids of the tile kStages after its
  // own, which land before they are used.
  load_q();  // committed with the first K/V step (with the ring: with the first ids)
  if constexpr (Traits::kPageIdRing) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) loader.fetch_ids(s);
    loader.commit();
    cp_async_wait<0>();
    sync_group();
  }
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (kDecode || s < num_tiles) {
      if constexpr (!Traits::kPageIdRing) loader.lookup(s);
      loader.issue(s, s);
      if constexpr (Traits::kPageIdRing) loader.fetch_ids(s + kStages);
    }
    loader.commit();  // one step per stage, empty or not, keeps the wait counts uniform
  }
  if constexpr (kDecode && !Traits::kPageIdRing) loader.lookup(kStages - 1);

  if constexpr (kDecode) timeline.prologue = DecodeTimeline::now();

  const float scale_log2 = args.scale_log2;
  // Scores enter the exponent as exp2(s * exp_scale - max * exp_scale): with a positive scale,
  // s and row_max stay unscaled and one FFMA per score replaces a multiply and a subtract.
  const bool fold_scale = scale_log2 > 0.f;
  const float exp_scale = fold_scale ? scale_log2 : 1.f;
  const bool* mask = p.attn_mask;

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int next = tile + kStages - 1;
    if (next < num_tiles) {
      if constexpr (!kDecode) loader.lookup(next);
      loader.issue(next, next % kStages);
    }
    if constexpr (Traits::kPageIdRing) {
      if (next + kStages < num_tiles) loader.fetch_ids(next + kStages);
    }
    loader.commit();
    if constexpr (kDecode && !Traits::kPageIdRing) loader.lookup(next + 1);
    loader.wait();
    if (kDecode && tile == 0) timeline.first_tile = DecodeTimeline::now();

    if constexpr (Traits::kQInRegisters) {
      if (tile == 0) {
#pragma unroll
        for (int mi = 0; mi < kMRep; ++mi)
#pragma unroll
          for (int ks = 0; ks < D / 16; ++ks) load_q_fragment(mi, ks, q_frag[mi][ks]);
      }
    }

    const int stage = tile % kStages;
    const T* k_tile = k_smem + stage * kTileN * Traits::kRowStride;
    const T* v_tile = v_smem + stage * kTileN * Traits::kRowStride;
    const int pos0 = kv_begin + tile * tile_step;

    attend_kv_tile<Traits, T>(
        k_tile, v_tile, warp_col0, lane,
        [&](int mi, int ks, uint32_t (&a)[4]) {
          if constexpr (Traits::kQInRegisters) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[e] = q_frag[mi][ks][e];
          } else {
            load_q_fragment(mi, ks, a);
          }
        },
        // Masks: only tiles that cross kv_end, the causal edge of this block, or a user mask.
        [&] {
          return mask != nullptr || pos0 + kTileN > kv_end ||
                 (p.is_causal && pos0 + kTileN - 1 > first_pos + row0 / group);
        },
        [&](auto& s_acc) {
          mask_invisible_scores<Traits>(s_acc, p, lane, row0 + warp_row0, num_rows, group, q_start,
                                        first_pos, kv_end, pos0 + warp_col0);
        },
        fold_scale, scale_log2, exp_scale, state);
    sync_group();  // the next iteration's copy overwrites this stage
  }
  cp_async_wait<0>();
  if constexpr (kDecode) timeline.loop_end = DecodeTimeline::now();
  // From here on row_max is in the log2 domain, row_sum the full row's.
  finish_row_states(state, exp_scale);

  T* out = static_cast<T*>(p.out);
  if constexpr (!kDecode) {
#pragma unroll
    for (int mi = 0; mi < kMRep; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int row = row0 + warp_row0 + mi * 16 + lane_row + half * 8;
        if (row >= num_rows) continue;
        const int token = q_start + row / group;
        const int head = kv_head * group + row % group;
        const float sum = state.row_sum[mi][half];
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        T* dst = out + token * p.out_stride_token + head * p.out_stride_head + lane_col;
#pragma unroll
        for (int dt = 0; dt < D / 8; ++dt) {
          *reinterpret_cast<uint32_t*>(dst + dt * 8) =
              pack_pair<T>(state.o[mi][dt][half * 2] * inv, state.o[mi][dt][half * 2 + 1] * inv);
        }
      }
    }
  } else {
    // Merge the softmax states of the 4 warps (each saw a quarter of every tile) through shared
    // memory; thread t takes float4 column t % (D / 4) of rows t / (D / 4) + i * kRowsPerPass.
    // Then, with merge_in_cluster, the 2 splits of this (sequence, kv head, row tile) are one
    // thread-block cluster (sm_90): each block owns half of the columns and pushes its state of
    // the other half into its peer's shared memory (stores, which need no round trip), one cluster
    // barrier, and each block writes its half of the rows to `out`: no workspace, no merge kernel.
    // A block pair (kGroups = 2) merges the same way, its groups' shared memory in place of the
    // peers', a block barrier in place of the cluster's. Otherwise a split block writes its
    // normalized result and log2-sum-exp to the workspace for paged_decode_merge_kernel, and a
    // lone block its output.
    sync_group();  // the merge region is the K/V stages' (paged_attention_tile_math.cuh)
    MergedRows<Traits> merged = merge_warp_states<Traits>(reinterpret_cast<unsigned char*>(k_smem),
                                                          state, tid, num_rows - row0, sync_group);
    constexpr int kColumns = MergedRows<Traits>::kColumns;
    constexpr int kItems = MergedRows<Traits>::kItems;
    const int column = tid % kColumns;
    const int c = column * 4;
    auto item_row = [&](int i) { return MergedRows<Traits>::row(tid, i); };
    float (&item_m)[kItems] = merged.m;
    float (&item_l)[kItems] = merged.l;
    float4(&item_o)[kItems] = merged.o;

    const bool pair_merge = kGroups > 1 || args.merge_in_cluster;
    bool owned = true;  // this block (group) writes this thread's column
    if (pair_merge) {
      constexpr int kOwnColumns = kColumns / Traits::kClusterSplits;
      constexpr int kOwnFloats = D / Traits::kClusterSplits;
      // [16][D / 2] floats of output, then [16] maxima and [16] sums (PagedAttentionTraits).
      float* incoming =
          reinterpret_cast<float*>(smem_raw + Traits::kSmemBytes - Traits::kIncomingBytes);
      const int rank = kGroups > 1 ? pair_group : cluster_block_rank();
      const int owner = column / kOwnColumns;
      owned = owner == rank;
      // The arrive at the top: every block of the cluster has started.
      if constexpr (kGroups == 1) cluster_wait();
      if (!owned) {
        float* peer = kGroups > 1 ? incoming + (owner - rank) * (Traits::kSmemBytes / 4)
                                  : cluster_peer_address(incoming, owner);
        const int peer_c = c - owner * kOwnFloats;
#pragma unroll
        for (int i = 0; i < kItems; ++i) {
          const int r = item_row(i);
          if (row0 + r >= num_rows) continue;
          *reinterpret_cast<float4*>(peer + r * kOwnFloats + peer_c) = item_o[i];
          if (peer_c == 0) {
            peer[16 * kOwnFloats + r] = item_m[i];
            peer[16 * kOwnFloats + 16 + r] = item_l[i];
          }
        }
      }
      // The pushes have landed (release / acquire).
      if constexpr (kGroups > 1)
        __syncthreads();
      else
        cluster_barrier();
      if (owned) {
        const int own_c = c - rank * kOwnFloats;
#pragma unroll
        for (int i = 0; i < kItems; ++i) {
          const int r = item_row(i);
          if (row0 + r >= num_rows) continue;
          const float peer_m = incoming[16 * kOwnFloats + r];
          const float m = fmaxf(item_m[i], peer_m);
          if (m == kNegInf) continue;  // both empty: l stays 0, the output 0
          const float w_own = exp2f(item_m[i] - m), w_peer = exp2f(peer_m - m);
          const float4 o = *reinterpret_cast<const float4*>(incoming + r * kOwnFloats + own_c);
          item_l[i] = item_l[i] * w_own + incoming[16 * kOwnFloats + 16 + r] * w_peer;
          item_o[i].x = item_o[i].x * w_own + o.x * w_peer;
          item_o[i].y = item_o[i].y * w_own + o.y * w_peer;
          item_o[i].z = item_o[i].z * w_own + o.z * w_peer;
          item_o[i].w = item_o[i].w * w_own + o.w * w_peer;
          item_m[i] = m;
        }
      }
    }
    if (owned) {
      const int num_tokens = p.num_tokens;
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        const int row = row0 + item_row(i);
        if (row >= num_rows) continue;
        const float l = item_l[i];
        const float inv = l > 0.f ? 1.f / l : 0.f;
        const float4 acc = item_o[i];
        const int head = kv_head * group + row;
        if (args.num_splits == 1 || pair_merge) {
          T* dst = out + seq * p.out_stride_token + head * p.out_stride_head + c;
          uint2 packed;
          packed.x = pack_pair<T>(acc.x * inv, acc.y * inv);
          packed.y = pack_pair<T>(acc.z * inv, acc.w * inv);
          *reinterpret_cast<uint2*>(dst) = packed;
        } else {
          const int64_t index = ((int64_t)split * num_tokens + seq) * p.num_q_heads + head;
          *reinterpret_cast<float4*>(args.partial_out + index * D + c) =
              make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
          if (c == 0) args.partial_lse[index] = l > 0.f ? item_m[i] + log2f(l) : kNegInf;
        }
      }
    }
    timeline.report(seq_len, num_tiles);
  }
}

// Launches one instantiation (grid from shapes only): in decode, the splits of a (sequence, kv
// head, row tile) are grid z, as a cluster (merge_in_cluster), as block pairs (Traits::kGroups = 2:
// both splits in one block, grid z halved) or followed by the merge kernel.
template <typename Traits, typename T>
LaunchStatus launch_paged_attention(const PagedKernelArgs& args, int grid_rows,
                                    cudaStream_t stream) {
  constexpr bool kDecode = Traits::kDecode;
  constexpr bool kPairs = Traits::kGroups > 1;
  auto kernel = paged_attention_kernel<Traits, T>;
  dim3 grid;
  const LaunchStatus prepared = prepare_row_tile_launch(
      kernel, Traits::kBlockSmemBytes, args.base, grid_rows, Traits::kBlockRows,
      kDecode ? args.num_splits / Traits::kGroups : 1, &grid);
  if (!prepared.ok()) return prepared;
  if (kDecode && !kPairs && args.merge_in_cluster) {
    // The num_splits blocks of a (sequence, kv head, row tile) are one cluster (grid z = splits).
    cudaLaunchConfig_t config = {};
    config.gridDim = grid;
    config.blockDim = dim3(Traits::kBlockThreads);
    config.dynamicSmemBytes = Traits::kBlockSmemBytes;
    config.stream = stream;
    cudaLaunchAttribute attribute[1];
    attribute[0].id = cudaLaunchAttributeClusterDimension;
    attribute[0].val.clusterDim.x = 1;
    attribute[0].val.clusterDim.y = 1;
    attribute[0].val.clusterDim.z = static_cast<unsigned>(args.num_splits);
    config.attrs = attribute;
    config.numAttrs = 1;
    const cudaError_t launched = cudaLaunchKernelEx(&config, kernel, args);
    if (launched != cudaSuccess)
      return {std::string("paged_decode_kernel (cluster of ") + std::to_string(args.num_splits) +
              " splits): " + cudaGetErrorString(launched)};
    return status_after_launch("paged_decode_kernel");
  }
  kernel<<<grid, Traits::kBlockThreads, Traits::kBlockSmemBytes, stream>>>(args);
  LaunchStatus status = status_after_launch(
      !kDecode ? "paged_prefill_kernel"
               : (kPairs ? "paged_decode_kernel (block pairs)" : "paged_decode_kernel"));
  if (!status.ok() || !kDecode || kPairs || args.num_splits == 1) return status;
  const int64_t rows = (int64_t)args.base.num_tokens * args.base.num_q_heads;
  // On sm_90 the merge is a programmatic dependent launch: its blocks are scheduled while the
  // attention kernel's last blocks run and wait in griddepcontrol.wait, which removes the launch
  // gap between the two kernels (also inside a captured CUDA graph). Elsewhere a plain launch.
  const cudaError_t launched = launch_maybe_dependent(
      paged_decode_merge_kernel<T, Traits::kHeadDim>, dim3(static_cast<unsigned>(rows)),
      dim3(kMergeThreads), 0, stream, current_device_is_sm90_or_newer(), args);
  if (launched != cudaSuccess)
    return {std::string("paged_decode_merge_kernel: ") + cudaGetErrorString(launched)};
  return status_after_launch("paged_decode_merge_kernel");
}

// Launches the instantiation the arguments ask for: the eight-warp decode block or the block pair
// kernel where the decode asks for them, else the kernel of single groups of 4 warps.
template <int D, typename T, bool kDecode>
LaunchStatus run_paged_attention(const PagedKernelArgs& args, int grid_rows, cudaStream_t stream) {
  if constexpr (kDecode && paged_decode_eight_warp_blocks_compiled(D)) {
    if (args.eight_warp_blocks)
      return launch_paged_attention<PagedAttentionTraits<D, true, 1, 8>, T>(args, grid_rows,
                                                                            stream);
  }
  if constexpr (kDecode && paged_decode_block_pairs_compiled(D)) {
    if (args.merge_in_block_pairs)
      return launch_paged_attention<PagedAttentionTraits<D, true, 2>, T>(args, grid_rows, stream);
  }
  return launch_paged_attention<PagedAttentionTraits<D, kDecode>, T>(args, grid_rows, stream);
}

#define ASTRAI_INSTANTIATE_PAGED_ATTENTION(D, DECODE)                                              \
  template LaunchStatus run_paged_attention<D, __nv_bfloat16, DECODE>(const PagedKernelArgs&, int, \
                                                                      cudaStream_t);               \
  template LaunchStatus run_paged_attention<D, __half, DECODE>(const PagedKernelArgs&, int,        \
                                                               cudaStream_t);

}  // namespace astrai::kernels
