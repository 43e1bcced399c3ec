// Warp-level building blocks shared by the attention kernels: cp.async, ldmatrix, mma.sync.
// Requires sm_80 or newer.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace astr::kernels {

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// `value`, copied where the compiler cannot see through (a volatile move): what derives from it
// is computed again at each use instead of being hoisted out of a loop and kept in registers. The
// warp-specialised prefill passes its Q tile's address through it every tile: ptxas had hoisted
// the Q descriptors of every k step out of the tile loop (16 at D = 256) and spilled them.
__device__ __forceinline__ uint32_t opaque_copy(uint32_t value) {
  uint32_t copy;
  asm volatile("mov.b32 %0, %1;\n" : "=r"(copy) : "r"(value));
  return copy;
}

// 16-byte global -> shared copy; when !valid nothing is read and the 16 bytes are zero-filled
// (padding rows must hold finite values: their probabilities are 0 but 0 * NaN is NaN).
__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
// 4-byte global -> shared copy (cp.async.ca: the only form below 16 bytes), zero-filled when
// !valid.
__device__ __forceinline__ void cp_async_4(uint32_t dst, const void* src, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(dst), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t address, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t address, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// c[16x8] += a[16x16] * b[16x8], fp32 accumulate (fragment layouts of the PTX ISA, m16n8k16).
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1);
template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                            uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float (&c)[4], const uint32_t (&a)[4],
                                                     uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// A 16-bit float to and from float32 (torch's extension flags turn off their implicit
// conversions).
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half(x);
}

// Two floats -> one 32-bit register of two 16-bit values (low half = first).
template <typename T>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
template <>
__device__ __forceinline__ uint32_t pack_pair<__half>(float lo, float hi) {
  __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Programmatic dependent launch (sm_90; no-ops elsewhere and when the launch did not ask for it).
// The primary grid allows its dependent to be scheduled; the dependent waits until the primary has
// completed and its memory is visible.
__device__ __forceinline__ void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// Barrier over this thread's group of a block made of kGroups equal groups of kGroupThreads
// threads (named barrier 1 + group; barrier 0 is __syncthreads'), with __syncthreads' ordering of
// shared memory among the group. One group: __syncthreads.
template <int kGroups, int kGroupThreads>
__device__ __forceinline__ void group_barrier() {
  if constexpr (kGroups == 1) {
    __syncthreads();
  } else {
    static_assert(kGroupThreads % 32 == 0 && kGroups < 16, "named barriers of whole warps");
    const int id = 1 + static_cast<int>(threadIdx.x) / kGroupThreads;
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "n"(kGroupThreads) : "memory");
  }
}

// group_barrier that also ORs `predicate` over the group: true in every thread when any thread of
// the group passed true (bar.red.or; __syncthreads_or for one group).
template <int kGroups, int kGroupThreads>
__device__ __forceinline__ bool group_barrier_or(bool predicate) {
  if constexpr (kGroups == 1) {
    return __syncthreads_or(predicate) != 0;
  } else {
    static_assert(kGroupThreads % 32 == 0 && kGroups < 16, "named barriers of whole warps");
    const int id = 1 + static_cast<int>(threadIdx.x) / kGroupThreads;
    uint32_t result;
    asm volatile(
        "{\n.reg .pred in, out;\nsetp.ne.u32 in, %1, 0;\n"
        "bar.red.or.pred out, %2, %3, in;\nselp.u32 %0, 1, 0, out;\n}\n"
        : "=r"(result)
        : "r"(static_cast<uint32_t>(predicate)), "r"(id), "n"(kGroupThreads)
        : "memory");
    return result != 0;
  }
}

// Thread-block clusters (sm_90): the block's rank in its cluster, a barrier over every thread of
// the cluster (release / acquire: shared-memory writes before it are visible to the cluster's
// blocks after it), and the address of the same shared-memory object in the block of another rank
// (distributed shared memory, read and written with ordinary loads and stores). Before sm_90 no
// launch asks for a cluster; calling these there traps.
__device__ __forceinline__ int cluster_block_rank() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t rank;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return static_cast<int>(rank);
#else
  __trap();
  return 0;
#endif
}
__device__ __forceinline__ void cluster_barrier() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "barrier.cluster.arrive.release.aligned;\n"
      "barrier.cluster.wait.acquire.aligned;\n" ::
          : "memory");
#else
  __trap();
#endif
}
// The two halves of a cluster barrier, for a phase that only says "every block has started"
// (no memory ordering): arrive early, wait later.
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}
template <typename T>
__device__ __forceinline__ T* cluster_peer_address(T* pointer, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t peer;
  asm("mapa.u64 %0, %1, %2;\n" : "=l"(peer) : "l"(reinterpret_cast<uint64_t>(pointer)), "r"(rank));
  return reinterpret_cast<T*>(peer);
#else
  __trap();
  return pointer;
#endif
}

// 2^x on the SFU (ex2.approx: 2 ulp, exp2(-inf) = +0).
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// Shared-memory tiles of rows of kRowElements elements (16-byte chunks of kChunkElements: 8 for
// 16-bit elements, 16 for FP8), in one of two layouts:
//
// Padded (kSwizzle = false): each row padded by one chunk. The 8 rows an ldmatrix reads at one
// column then start 4 banks apart (conflict-free), and every fragment address is a per-lane base
// plus a compile-time offset, which keeps registers free (prefill runs at the 255 cap).
//
// Swizzled (kSwizzle = true): rows of exactly D elements, chunk c of row r stored at c ^ (r % 8);
// the 8 rows of an ldmatrix again hit 8 distinct chunk positions of a 128-byte line. Costs an
// address register per fragment column, but every row (and every 32-byte sector a cp.async
// brings in) lands aligned, which a streaming kernel needs: decode uses this (rows at a 272-byte
// pitch read 7-8% slower: benchmarks/results/decisions.md, "Decode: tiles").
template <int kRowElements, bool kSwizzle, int kChunkElements = 8>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  static_assert(!kSwizzle || kRowElements >= 8 * kChunkElements,
                "the swizzle permutes 8 chunks of a row");
  if constexpr (kSwizzle) return row * kRowElements + ((chunk ^ (row & 7)) * kChunkElements);
  return row * (kRowElements + kChunkElements) + chunk * kChunkElements;
}

// FP8 (e4m3 or e5m2) bytes to f16 pairs in registers, for the KV-cache reads; exact, as every
// e4m3 and e5m2 value is an f16 (a NaN byte stays NaN): e4m3 by the conversion unit
// (cvt.rn.f16x2.e4m3x2), e5m2 by moving each byte to the top byte of its half (e5m2 is f16's top
// byte). The conversion unit turns about three times as many e4m3 pairs per clock into f16 as an
// integer path makes bf16, so FP8 tiles are multiplied in f16 whatever q's type (tile_math.cuh;
// benchmarks/results/decisions.md, "FP8 bytes become f16").
// Bytes 0, 1 (kHigh false) or 2, 3 (kHigh true) of `bytes`, the lower byte in the low half.
template <bool kE5M2, bool kHigh>
__device__ __forceinline__ uint32_t fp8_pair_to_f16x2(uint32_t bytes) {
  uint32_t out;
  if constexpr (kE5M2) {
    asm("prmt.b32 %0, %1, %2, %3;\n"
        : "=r"(out)
        : "r"(bytes), "r"(0u), "n"(kHigh ? 0x3424 : 0x1404));
  } else {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 890
    // No FP8 conversion unit before sm_89: each byte to the top of its half, its exponent and
    // mantissa shifted into f16's fields (the sign stays), then times 2^8 for the exponents'
    // bias difference (exact, subnormals included).
    uint32_t top;
    asm("prmt.b32 %0, %1, %2, %3;\n"
        : "=r"(top)
        : "r"(bytes), "r"(0u), "n"(kHigh ? 0x3424 : 0x1404));
    const uint32_t bits = (top & 0x80008000u) | ((top >> 1) & 0x3F803F80u);
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n"
        : "=r"(out)
        : "r"(bits), "r"(0x5C005C00u), "r"(0x80008000u));
#else
    if constexpr (kHigh) {
      asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, hi;\n}\n"
          : "=r"(out)
          : "r"(bytes));
    } else {
      asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %1;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n}\n"
          : "=r"(out)
          : "r"(bytes));
    }
#endif
  }
  return out;
}
// Bytes 0 and 2 (`even`) and 1 and 3 (`odd`) of `bytes` as f16 pairs: one element of two rows
// each (a transposed ldmatrix of FP8 rows read as 16-bit pairs).
template <bool kE5M2>
__device__ __forceinline__ void fp8_strided_pairs_to_f16x2(uint32_t bytes, uint32_t& even,
                                                           uint32_t& odd) {
  if constexpr (kE5M2) {
    asm("prmt.b32 %0, %1, %2, 0x2404;\n" : "=r"(even) : "r"(bytes), "r"(0u));
    asm("prmt.b32 %0, %1, %2, 0x3414;\n" : "=r"(odd) : "r"(bytes), "r"(0u));
  } else {
    const uint32_t low = fp8_pair_to_f16x2<false, false>(bytes);  // elements 0, 1
    const uint32_t high = fp8_pair_to_f16x2<false, true>(bytes);  // elements 2, 3
    asm("prmt.b32 %0, %1, %2, 0x5410;\n" : "=r"(even) : "r"(low), "r"(high));
    asm("prmt.b32 %0, %1, %2, 0x7632;\n" : "=r"(odd) : "r"(low), "r"(high));
  }
}

// Hopper's 128-byte swizzle (the layout wgmma reads, wgmma_primitives.cuh): a tile of kRows rows
// x D 16-bit elements stored as D / 64 column blocks, each kRows rows of exactly 128 bytes, with
// 16-byte chunk c of a row at position c ^ (row % 8) inside it (address bits 4-6 XOR bits 7-9:
// each column block must start on a 1024-byte boundary). Eight rows make a 1024-byte atom, and
// the 8 rows an ldmatrix or a wgmma reads at one column land in 8 distinct bank groups.
template <int kRows>
__device__ __forceinline__ int swizzled_128b_tile_offset(int row, int chunk) {
  return (chunk / 8) * kRows * 64 + row * 64 + (((chunk % 8) ^ (row % 8)) * 8);
}

}  // namespace astr::kernels
