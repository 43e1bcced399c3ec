// Paged decode on mma.sync: the kernel of 4-warp blocks (also as block pairs and as eight-warp
// blocks, by its traits) and its launcher. traits.h has the design, plan.h which form runs.
//
// A block owns one (sequence, kv head, row tile of 16 rows) and the kv tiles of its split: split s
// of S takes tiles s, s + S, s + 2S, ... of the row's visible range, so the splits stay balanced
// within a tile at every length (the grid comes from shapes alone) and a block's first tile is
// known before its seq_len arrives; in batch-invariant mode (args.split_tiles > 0) it takes
// split_tiles consecutive tiles from tile s * split_tiles instead, so that which tiles a split sums
// depends on the sequence alone (plan.h). A verify (args.query_start_loc set: several new tokens
// per sequence, a prefill-mode call) packs (new token, q head) into the rows, as the prefill does,
// over max_query_len x group rows per sequence. Its warps each take 16 kv positions of every tile
// and merge their softmax states through shared memory at the end. Then: one split writes its rows;
// 2 splits as a cluster or a block pair merge in shared memory (each block or group owns half of
// the columns); more splits write normalized partial results and their log2-sum-exp to the
// workspace for decode_merge_kernel.cuh.
#pragma once

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "../common/dependent_launch.cuh"
#include "../common/device_primitives.cuh"
#include "../common/launch_status.h"
#include "../common/online_softmax.cuh"
#include "config.h"
#include "decode_merge_kernel.cuh"
#include "instantiations.h"
#include "kv_tile_loader.cuh"
#include "params.h"
#include "query_rows.cuh"
#include "tile_math.cuh"
#include "traits.h"
#include "variant.cuh"

namespace astr::kernels {

// kSoftcap: the softcap it is compiled for (variant.cuh); kE5M2: an FP8 cache holds e5m2 (else
// e4m3).
template <typename Traits, typename T, typename KV, Softcap kSoftcap, bool kE5M2>
__global__ void __launch_bounds__(Traits::kBlockThreads, Traits::kMinBlocksPerSm)
    paged_decode_kernel(const __grid_constant__ PagedKernelArgs args) {
  static_assert(Traits::kDecode && sizeof(KV) == Traits::kKVBytes, "decode traits of this cache");
  constexpr int D = Traits::kHeadDim;    // q and k
  constexpr int DV = Traits::kVColumns;  // the block's chunk of v's (and the output's) columns
  constexpr int kVChunks = Traits::kVChunks;
  constexpr int kChunks = Traits::kChunksPerRow;
  constexpr int kThreads = Traits::kThreads;  // of this thread's group
  constexpr int kGroups = Traits::kGroups;    // 2: a decode block pair (traits.h)
  constexpr int kTileN = Traits::kTileN;
  constexpr int kWarpTileN = Traits::kWarpTileN;
  constexpr int kStages = Traits::kStages;
  constexpr int kBlockRows = Traits::kBlockRows;

  const PagedAttentionParams& p = args.base;
  extern __shared__ __align__(128) unsigned char smem_block[];
  // A block pair's group g works in its own region, kSmemBytes from g * kSmemBytes.
  const int pair_group = kGroups > 1 ? static_cast<int>(threadIdx.x) / kThreads : 0;
  unsigned char* smem_raw = smem_block + pair_group * Traits::kSmemBytes;
  T* q_smem = reinterpret_cast<T*>(smem_raw);
  KV* k_smem = reinterpret_cast<KV*>(q_smem + Traits::kQSmemElements);
  KV* v_smem = k_smem + Traits::kKVSmemElements;

  const int tid = kGroups > 1 ? static_cast<int>(threadIdx.x) % kThreads : threadIdx.x;
  auto sync_group = [] { group_barrier<kGroups, kThreads>(); };
  // Split decode: let the merge kernel (launched as a programmatic dependent, see below) be
  // scheduled now; it waits for this grid's results before reading them.
  if (kGroups == 1 && args.num_splits > 1 && !args.merge_in_cluster) allow_dependent_launch();
  // In-cluster merge: the first phase of the cluster barrier says "started" (waited for before a
  // block writes into a peer's shared memory, in the epilogue).
  if (kGroups == 1 && args.merge_in_cluster) cluster_arrive_relaxed();
  const int warp = tid / 32;
  const int lane = tid % 32;
  // x: (sequence, kv head, v column chunk), the chunks of a pair side by side (their K reads
  // meet in L2).
  const int pair_index = static_cast<int>(blockIdx.x) / kVChunks;
  const int v_column0 = (static_cast<int>(blockIdx.x) % kVChunks) * DV;
  const int seq_index = pair_index / p.num_kv_heads;
  const int kv_head = pair_index % p.num_kv_heads;
  const int row_tile = blockIdx.y;
  const int split = static_cast<int>(blockIdx.z) * kGroups + pair_group;

  const bool verify = args.query_start_loc != nullptr;
  const SequenceRows seq =
      verify ? prefill_sequence(p, args.query_start_loc, seq_index, args.max_query_len)
             : decode_sequence(p, seq_index, p.seq_lens[seq_index]);
  const int group = seq.group;
  const int num_rows = seq.num_rows;
  const int row0 = row_tile * kBlockRows;
  // A decode's grid has ceil(group / 16) row tiles: never taken. A verify's covers max_query_len
  // tokens: the sequence's row tiles past its own tokens have nothing to do. (A cluster's blocks
  // and a block pair's groups share their row tile: all of them return, or none.)
  if (row0 >= num_rows) return;

  // The row's visible range; split s takes its tiles s, s + S, ... from the window's first tile,
  // or split_tiles consecutive ones from tile s * split_tiles (the last split: the rest).
  const KvRange range = block_kv_range(p, seq, row0, kBlockRows);
  const UnmaskedTiles unmasked = unmasked_tiles(p, seq, range, row0, kBlockRows);
  const int first_tile = range.begin / kTileN;
  int kv_begin, tile_step, kv_end = range.end;
  if (args.split_tiles > 0) {
    const int64_t begin = ((int64_t)first_tile + (int64_t)split * args.split_tiles) * kTileN;
    kv_begin = static_cast<int>(min(begin, (int64_t)INT_MAX));
    tile_step = kTileN;
    if (split + 1 < args.num_splits)
      kv_end = static_cast<int>(min((int64_t)kv_end, begin + (int64_t)args.split_tiles * kTileN));
  } else {
    kv_begin = (first_tile + split) * kTileN;
    tile_step = args.num_splits * kTileN;
  }
  const int num_tiles = kv_end > kv_begin ? (kv_end - kv_begin + tile_step - 1) / tile_step : 0;

  // ---- global -> shared copies -------------------------------------------------------------
  auto load_q = [&]() {
    load_query_rows<T, kBlockRows, kChunks, kThreads>(
        p, q_smem, tid, seq.q_start, row0, num_rows, group, kv_head,
        [](int r, int ch) { return tile_offset<D, Traits::kSwizzle>(r, ch); });
  };
  // K/V tiles (see kv_tile_loader.cuh). Page ids are looked up as far as the block table reaches,
  // so that the first lookups need not wait for seq_lens.
  const KVTileSource source = kv_tile_source<KV>(p, seq_index, kv_head, kv_begin, kv_end, tile_step,
                                                 block_table_positions(p), v_column0);
  // The eight-warp decode block's page-id ring follows the V stages (Traits::kPageIdRing).
  KVTileLoader<Traits, KV> loader(source, k_smem, v_smem, tid,
                                  reinterpret_cast<int32_t*>(v_smem + Traits::kVSmemElements));

  // ---- per-warp state: the block's 16 rows, the warp's 16 kv positions of every tile ----------
  const int warp_col0 = warp * kWarpTileN;  // kv offset inside the tile

  WarpSoftmaxState<Traits> state;  // O, running max and sum of the warp's rows
  state.reset();
  uint32_t q_frag[Traits::kQInRegisters ? D / 16 : 1][4];

  auto q_offset = [](int r, int ch) { return tile_offset<D, Traits::kSwizzle>(r, ch); };
  auto load_q_fragment = [&](int ks, uint32_t (&a)[4]) {
    if constexpr (Traits::kFp8) {  // f16 by then (query_tile_to_f16)
      load_fp8_query_fragment(reinterpret_cast<const __half*>(q_smem), 0, lane, ks, q_offset, a);
    } else {
      const int r = (lane % 8) + ((lane / 8) % 2) * 8;
      const int ch = ks * 2 + lane / 16;
      ldmatrix_x4(shared_address(q_smem + q_offset(r, ch)), a);
    }
  };

  // ---- pipeline prologue ---------------------------------------------------------------------
  // Page ids are looked up one tile ahead (into registers, consumed by the next issue), so the
  // block-table read latency hides behind a tile's compute: at page size 1 every row has its own
  // lookup. The prologue issues every stage, empty or not: the first lookups then do not depend
  // on seq_len (see KVTileSource::lookup_end) and both reads are in flight together. With the
  // page-id ring (eight-warp decode blocks) the ids of the first kStages tiles are waited for
  // here, with the query, before the first copy; each step then carries the ids of the tile
  // kStages after its own, which land before they are used.
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
    if constexpr (!Traits::kPageIdRing) loader.lookup(s);
    loader.issue(s, s);
    if constexpr (Traits::kPageIdRing) loader.fetch_ids(s + kStages);
    loader.commit();  // one step per stage, empty or not, keeps the wait counts uniform
  }
  if constexpr (!Traits::kPageIdRing) loader.lookup(kStages - 1);
  // The page ids of the block's tiles, checked once while the first copies are in flight (read
  // again by the lookups: the same lines, from L2).
  loader.prescan_page_ids();

  // FP8: the kv head's k scale folds into the score scale, its v scale into each output row.
  const KvScales scales = kv_head_scales<Traits::kFp8>(p, kv_head);
  ScoreTransform transform = score_transform<kSoftcap>(p, args.scale_log2 * scales.k);

  for (int tile = 0; tile < num_tiles; ++tile) {
    const int next = tile + kStages - 1;
    if (next < num_tiles) loader.issue(next, next % kStages);
    if constexpr (Traits::kPageIdRing) {
      if (next + kStages < num_tiles) loader.fetch_ids(next + kStages);
    }
    loader.commit();
    if constexpr (!Traits::kPageIdRing) loader.lookup(next + 1);
    loader.wait();

    // FP8 tiles are multiplied in f16 (tile_math.cuh): a bf16 query becomes f16 once it has
    // landed, scaled into f16's range, and the scale's inverse joins the score scale.
    if constexpr (Traits::kFp8 && !std::is_same_v<T, __half>) {
      if (tile == 0) {
        const float restore = query_tile_to_f16<kBlockRows, kChunks, kThreads>(
            q_smem, tid, [](int r, int ch) { return tile_offset<D, Traits::kSwizzle>(r, ch); },
            sync_group);
        transform = score_transform<kSoftcap>(p, args.scale_log2 * scales.k * restore);
      }
    }
    if constexpr (Traits::kQInRegisters) {
      if (tile == 0) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) load_q_fragment(ks, q_frag[ks]);
      }
    }

    const int stage = tile % kStages;
    const KV* k_tile = k_smem + stage * Traits::kTileElements;
    const KV* v_tile = v_smem + stage * Traits::kVTileElements;
    const int pos0 = kv_begin + tile * tile_step;

    attend_kv_tile<Traits, T, KV, kE5M2>(
        k_tile, v_tile, warp_col0, lane,
        [&](int, int ks, uint32_t (&a)[4]) {
          if constexpr (Traits::kQInRegisters) {
#pragma unroll
            for (int e = 0; e < 4; ++e) a[e] = q_frag[ks][e];
          } else {
            load_q_fragment(ks, a);
          }
        },
        [&] { return unmasked.need_mask(pos0, kTileN); },
        [&](auto& s_acc) {
          mask_invisible_scores<Traits>(s_acc, p, seq, range, lane, row0, pos0 + warp_col0);
        },
        transform, state);
    sync_group();  // the next iteration's copy overwrites this stage
  }
  cp_async_wait<0>();
  // From here on row_max is in the log2 domain, row_sum the full row's.
  finish_row_states(state, transform.exp_scale);

  // ---- epilogue ------------------------------------------------------------------------------
  // Merge the softmax states of the warps (each saw its part of every tile) through shared
  // memory. Then, with merge_in_cluster, the 2 splits of this (sequence, kv head, row tile) are one
  // thread-block cluster (sm_90): each block owns half of the columns and pushes its state of the
  // other half into its peer's shared memory (stores, which need no round trip), one cluster
  // barrier, and each block writes its half of the rows to `out`: no workspace, no merge kernel.
  // A block pair (kGroups = 2) merges the same way, its groups' shared memory in place of the
  // peers', a block barrier in place of the cluster's. Otherwise a split block writes its
  // normalized result and log2-sum-exp to the workspace for the merge kernel, and a lone block
  // its output. The group's barrier before the merge also tells every thread whether the block's
  // page ids left the pool (poison, variant.cuh).
  const bool poisoned =
      group_barrier_or<kGroups, kThreads>(loader.poisoned) || seq.poisoned;  // K/V stages free
  MergedRows<Traits> merged = merge_warp_states<Traits>(reinterpret_cast<unsigned char*>(k_smem),
                                                        state, tid, num_rows - row0, sync_group);
  constexpr int kColumns = MergedRows<Traits>::kColumns;
  constexpr int kItems = MergedRows<Traits>::kItems;
  auto item_row = [&](int i) { return MergedRows<Traits>::row(tid, i); };
  auto item_column = [&](int i) { return MergedRows<Traits>::column(tid, i); };
  float (&item_m)[kItems] = merged.m;
  float (&item_l)[kItems] = merged.l;
  float4(&item_o)[kItems] = merged.o;
#pragma unroll
  for (int i = 0; i < kItems; ++i) item_l[i] = poison_sum(item_l[i], poisoned);

  const bool pair_merge = kGroups > 1 || args.merge_in_cluster;
  constexpr int kOwnColumns = kColumns / Traits::kClusterSplits;
  constexpr int kOwnFloats = DV / Traits::kClusterSplits;
  // Which block (group) of a pair writes item i's column: rank column / kOwnColumns.
  const int rank = !pair_merge ? 0 : (kGroups > 1 ? pair_group : cluster_block_rank());
  auto owner = [&](int i) { return pair_merge ? item_column(i) / kOwnColumns : rank; };
  if (pair_merge) {
    // [16][D / 2] floats of output, then [16] maxima and [16] sums (PagedAttentionTraits).
    float* incoming =
        reinterpret_cast<float*>(smem_raw + Traits::kSmemBytes - Traits::kIncomingBytes);
    // The arrive at the top: every block of the cluster has started.
    if constexpr (kGroups == 1) cluster_wait();
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int r = item_row(i);
      const int to = owner(i);
      if (to == rank || row0 + r >= num_rows) continue;
      float* peer = kGroups > 1 ? incoming + (to - rank) * (Traits::kSmemBytes / 4)
                                : cluster_peer_address(incoming, to);
      const int peer_c = item_column(i) * 4 - to * kOwnFloats;
      *reinterpret_cast<float4*>(peer + r * kOwnFloats + peer_c) = item_o[i];
      if (peer_c == 0) {
        peer[16 * kOwnFloats + r] = item_m[i];
        peer[16 * kOwnFloats + 16 + r] = item_l[i];
      }
    }
    // The pushes have landed (release / acquire).
    if constexpr (kGroups > 1)
      __syncthreads();
    else
      cluster_barrier();
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const int r = item_row(i);
      if (owner(i) != rank || row0 + r >= num_rows) continue;
      const int own_c = item_column(i) * 4 - rank * kOwnFloats;
      const float peer_m = incoming[16 * kOwnFloats + r];
      const float m = fmaxf(item_m[i], peer_m);
      // An empty state (max -inf) weighs 0; a poisoned one (sum NaN) makes the sum NaN.
      const float w_own = item_m[i] == -INFINITY ? 0.f : exp2f(item_m[i] - m);
      const float w_peer = peer_m == -INFINITY ? 0.f : exp2f(peer_m - m);
      const float4 o = *reinterpret_cast<const float4*>(incoming + r * kOwnFloats + own_c);
      item_l[i] = item_l[i] * w_own + incoming[16 * kOwnFloats + 16 + r] * w_peer;
      item_o[i].x = item_o[i].x * w_own + o.x * w_peer;
      item_o[i].y = item_o[i].y * w_own + o.y * w_peer;
      item_o[i].z = item_o[i].z * w_own + o.z * w_peer;
      item_o[i].w = item_o[i].w * w_own + o.w * w_peer;
      item_m[i] = m;
    }
  }
  T* out = static_cast<T*>(p.out);
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int row = row0 + item_row(i);
    if (owner(i) != rank || row >= num_rows) continue;
    const int c = v_column0 + item_column(i) * 4;  // of the output row
    // Every chunk's statistics are the same: chunk 0 writes the lse.
    const bool lse_writer = c == 0;
    const float4 acc = item_o[i];
    // Row (new token, q head of the group); a decode's one token is q_start = its sequence's.
    const int token = seq.q_start + row / group;
    const int head = kv_head * group + row % group;
    if (args.num_splits == 1 || pair_merge) {
      const FinishedRow finished = finish_row(item_m[i], item_l[i], sink_log2(p, head));
      const float inv = finished.inv * scales.v;
      T* dst = out + (int64_t)token * p.out_stride_token + head * p.out_stride_head + c;
      uint2 packed;
      packed.x = pack_pair<T>(acc.x * inv, acc.y * inv);
      packed.y = pack_pair<T>(acc.z * inv, acc.w * inv);
      *reinterpret_cast<uint2*>(dst) = packed;
      if (lse_writer) store_lse(p, token, head, finished.lse_log2);
    } else {
      // The sink joins once, in the merge kernel.
      const FinishedRow finished = finish_row(item_m[i], item_l[i], -INFINITY);
      const float inv = finished.inv * scales.v;
      const int64_t index = ((int64_t)split * p.num_tokens + token) * p.num_q_heads + head;
      *reinterpret_cast<float4*>(args.partial_out + index * Traits::kHeadDimV + c) =
          make_float4(acc.x * inv, acc.y * inv, acc.z * inv, acc.w * inv);
      if (lse_writer) args.partial_lse[index] = finished.lse_log2;
    }
  }
}

// Launches one decode form (grid from shapes only): the splits of a (sequence, kv head, row tile)
// are grid z, as a cluster (merge_in_cluster), as block pairs (Traits::kGroups = 2: both splits in
// one block, grid z halved) or followed by the merge kernel.
template <typename Traits, typename T, typename KV>
LaunchStatus launch_paged_decode(const PagedKernelArgs& args, cudaStream_t stream) {
  constexpr bool kPairs = Traits::kGroups > 1;
  // The instantiation for the call's softcap and, with an FP8 cache, its format.
  auto pick = [&](auto e5m2) {
    constexpr bool kE5M2 = decltype(e5m2)::value;
    return args.base.softcap > 0.f ? paged_decode_kernel<Traits, T, KV, Softcap::kRunningMax, kE5M2>
                                   : paged_decode_kernel<Traits, T, KV, Softcap::kOff, kE5M2>;
  };
  auto kernel = pick(std::false_type{});
  if constexpr (Traits::kFp8) {
    if (args.base.kv_dtype == ScalarType::kFloat8E5M2) kernel = pick(std::true_type{});
  }
  // Rows per sequence: the group, or a verify's max_query_len new tokens of it.
  const int group = args.base.num_q_heads / args.base.num_kv_heads;
  const int64_t rows = (int64_t)group * (args.query_start_loc != nullptr ? args.max_query_len : 1);
  if (rows > INT32_MAX) return {"max_query_len * group size too large"};
  dim3 grid;
  const LaunchStatus prepared = prepare_row_tile_launch(
      kernel, Traits::kBlockSmemBytes, args.base, static_cast<int>(rows), Traits::kBlockRows,
      args.num_splits / Traits::kGroups, &grid, Traits::kVChunks);
  if (!prepared.ok()) return prepared;
  if (!kPairs && args.merge_in_cluster) {
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
  LaunchStatus status =
      status_after_launch(kPairs ? "paged_decode_kernel (block pairs)" : "paged_decode_kernel");
  if (!status.ok() || kPairs || args.num_splits == 1) return status;
  return launch_paged_decode_merge<T, Traits::kHeadDimV>(args, stream);
}

template <int D, int DV, typename T, typename KV>
LaunchStatus launch_paged_decode_form(const PagedKernelArgs& args, DecodeForm form,
                                      cudaStream_t stream) {
  constexpr const HeadDimForms& forms = *paged_head_dim_forms(D, DV);
  constexpr int kKVBytes = sizeof(KV);
  static_assert(D == DV || !(forms.decode_eight_warps || forms.decode_block_pairs),
                "different q/k and v head dims: the 4-warp decode forms");
  if constexpr (forms.decode_eight_warps) {
    if (form == DecodeForm::kEightWarps)
      return launch_paged_decode<DecodeEightWarpTraits<D, kKVBytes>, T, KV>(args, stream);
  }
  if constexpr (forms.decode_block_pairs) {
    if (form == DecodeForm::kBlockPairs)
      return launch_paged_decode<DecodePairTraits<D, kKVBytes>, T, KV>(args, stream);
  }
  if (form != DecodeForm::kSplit && form != DecodeForm::kCluster)
    return {std::string("decode form ") + decode_form_name(form) +
            " is not compiled for head_dim " + std::to_string(D)};
  return launch_paged_decode<DecodeTraits<D, kKVBytes, DV>, T, KV>(args, stream);
}

template <int D, int DV, typename T, typename KV>
LaunchStatus run_paged_decode(const PagedKernelArgs& args, DecodeForm form, cudaStream_t stream) {
  const LaunchStatus status = launch_paged_decode_form<D, DV, T, KV>(args, form, stream);
  if (!status.ok() || args.query_start_loc == nullptr) return status;
  // A verify's rows past max_query_len, or of a query_start_loc that places no token for sure,
  // are NaN, as a prefill's (query_rows.cuh). After the merge kernel, which writes every row: a
  // plain launch, not a dependent one.
  return launch_unplaced_rows_poison(args, stream, /*dependent=*/false);
}

}  // namespace astr::kernels
