// Hopper warpgroup matrix multiply (wgmma, sm_90a) for the prefill kernel: shared-memory matrix
// descriptors, the 128-byte swizzled tile layout they describe, and the fences and waits around
// the asynchronous multiplies. The calls themselves (one inline-PTX statement naming every
// accumulator register) are generated into wgmma_calls.inc by scripts/gen_wgmma_calls.py.
//
// Layout: tiles in shared memory as swizzled_128b_tile_offset (device_primitives.cuh) lays them
// out: D / 64 column blocks of R rows x 128 bytes, each starting on a 1024-byte boundary.
//
// Fragments: a warpgroup (4 consecutive warps, the first one's index a multiple of 4) multiplies a
// 64-row A by B. Warp w of the group holds accumulator rows 16w + lane / 4 and 16w + lane / 4 + 8;
// register 4j + e holds column 8j + 2 (lane % 4) + (e % 2) of the first row (e < 2) or the second
// (e >= 2): per warp the mma.sync m16n8 accumulator layout, repeated along N. An A operand in
// registers (16 rows x 16 k per warp) has the mma.sync m16n8k16 A layout, so the accumulators of
// S = Q K^T, converted to 16 bits, are the A operand of O += P V as they stand.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "device_primitives.cuh"

namespace astr::kernels {

// Shared-memory matrix descriptor (PTX ISA, "matrix descriptor format"): start address, leading
// and stride byte offsets (all in 16-byte units), 128-byte swizzle (mode 1 in bits 62-63). The
// base-offset field stays 0: every column block starts on a 1024-byte boundary.
//
// K-major operand (rows of the matrix along M or N, k contiguous), as Q and K are: the k16 slice
// of one instruction lies inside a 128-byte row, so the leading offset is unused (1 by
// convention); the stride offset is 1024 bytes, from one 8-row atom to the next. The slice at k
// starts (k % 64) * 2 bytes into its column block.
//
// MN-major operand (n contiguous), as V is for O += P V (B = V[kv][d], n = d): the leading offset
// steps from one 64-wide column block to the next (R * 128 bytes), the stride offset from one
// 8-row atom of k to the next (1024 bytes).
__device__ __forceinline__ uint64_t swizzled_descriptor(uint32_t shared_byte_address,
                                                        uint32_t leading_bytes,
                                                        uint32_t stride_bytes) {
  uint64_t d = 0;
  d |= static_cast<uint64_t>((shared_byte_address & 0x3FFFF) >> 4);
  d |= static_cast<uint64_t>((leading_bytes >> 4) & 0x3FFF) << 16;
  d |= static_cast<uint64_t>((stride_bytes >> 4) & 0x3FFF) << 32;
  d |= static_cast<uint64_t>(1) << 62;
  return d;
}

// The descriptor of a matrix `bytes` (a multiple of 16) further on in shared memory: the start
// address field (bits 0-13, 16-byte units) of a shared address below 256 KB never carries out of
// the low word, so a 32-bit add there replaces the mask, shift and or of swizzled_descriptor for
// every k step (one integer add instead of five).
__device__ __forceinline__ uint64_t advance_descriptor(uint64_t descriptor, uint32_t bytes) {
  const uint32_t low = static_cast<uint32_t>(descriptor) + (bytes >> 4);
  return (descriptor & 0xFFFFFFFF00000000ull) | low;
}

// m64nNk16, fp32 accumulators d[N / 2] per thread. both_from_shared: A and B K-major in shared
// memory (S = Q K^T). a_from_registers: A in registers, B MN-major in shared memory (O += P V).
// accumulate = 0 overwrites d, 1 adds to it. Issued asynchronously: see the fences below.
template <typename T, int N>
struct WgmmaM64 {
  static __device__ __forceinline__ void both_from_shared(float (&d)[N / 2], uint64_t desc_a,
                                                          uint64_t desc_b, int accumulate);
  static __device__ __forceinline__ void a_from_registers(float (&d)[N / 2], const uint32_t (&a)[4],
                                                          uint64_t desc_b, int accumulate);
};

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define ASTR_HAS_WGMMA 1
#include "wgmma_calls.inc"

// Before the first wgmma that reads registers (accumulators, A) written by ordinary instructions.
__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
// Wait until at most kPending committed groups are in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}
// Shared memory written by the generic proxy (cp.async, ordinary stores) is read by wgmma through
// the async proxy: each writing thread fences before the barrier that publishes the writes.
__device__ __forceinline__ void fence_shared_for_async_proxy() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}
#endif

// Keeps the compiler from moving reads or writes of an accumulator across a wgmma or its wait: the
// hardware writes the registers asynchronously, which the compiler cannot see.
template <int kCount>
__device__ __forceinline__ void pin_registers(float (&d)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The same for A operands in registers: they must keep their values until the wgmma reading them
// has completed.
template <int kCount>
__device__ __forceinline__ void pin_registers(uint32_t (&a)[kCount]) {
#pragma unroll
  for (int i = 0; i < kCount; ++i) asm volatile("" : "+r"(a[i])::"memory");
}

}  // namespace astr::kernels
