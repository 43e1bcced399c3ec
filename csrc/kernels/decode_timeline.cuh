// Diagnostic: per-block timeline of the paged decode kernel. Off unless the library is built with
// ASTR_DECODE_TIMELINE=1 (setup.py defines the macro); then thread 0 of every decode block prints
// one line per launch,
//
//   TL grid_x splits block_x split seq_len sm num_tiles start prologue first_tile loop_end end
//
// with %globaltimer nanoseconds at: entry, the prologue's copies issued, the first K/V tile in
// shared memory, the last tile consumed, the epilogue done. benchmarks/decode_timeline.py runs and
// reads it. In the normal build every mark is a constant 0 and nothing is printed.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

namespace astrai::kernels {

#if defined(ASTR_DECODE_TIMELINE)
inline constexpr bool kDecodeTimeline = true;
#else
inline constexpr bool kDecodeTimeline = false;
#endif

struct DecodeTimeline {
  unsigned long long start = 0, prologue = 0, first_tile = 0, loop_end = 0;

  __device__ __forceinline__ static unsigned long long now() {
    unsigned long long t = 0;
    if constexpr (kDecodeTimeline) asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }

  __device__ __forceinline__ void report(int seq_len, int num_tiles) const {
    if constexpr (kDecodeTimeline) {
      const unsigned long long end = now();
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      if (threadIdx.x == 0)
        printf("TL %u %u %u %u %d %u %d %llu %llu %llu %llu %llu\n", gridDim.x, gridDim.z,
               blockIdx.x, blockIdx.z, seq_len, sm, num_tiles, start, prologue, first_tile,
               loop_end, end);
    }
  }
};

}  // namespace astrai::kernels
