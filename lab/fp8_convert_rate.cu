// Probe: how fast an SM turns e4m3 byte pairs into 16-bit pairs, by the conversion unit
// (cvt.rn.f16x2.e4m3x2) and by the integer path of device_primitives.cuh's fp8_pair_to_16bit
// (prmt, shift, lop3, fma.bf16x2). Each thread converts a register array over and over; the grid
// fills every SM with W warps. Prints pairs per clock per SM.
//   nvcc -O3 -arch=sm_90a -o /tmp/fp8_rate lab/fp8_convert_rate.cu && /tmp/fp8_rate
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdint>

constexpr int kRegs = 16;
constexpr int kIters = 4096;

__device__ __forceinline__ uint32_t by_cvt(uint32_t bytes) {
  uint32_t out;
  asm volatile("{ .reg .b16 lo; mov.b32 {lo, _}, %1; cvt.rn.f16x2.e4m3x2 %0, lo; }"
               : "=r"(out)
               : "r"(bytes));
  return out;
}

__device__ __forceinline__ uint32_t by_integers(uint32_t bytes) {
  uint32_t top;
  asm volatile("prmt.b32 %0, %1, %2, 0x1404;" : "=r"(top) : "r"(bytes), "r"(0u));
  const uint32_t bits = (top & 0x80008000u) | ((top >> 4) & 0x07F007F0u);
  uint32_t out;
  asm volatile("fma.rn.bf16x2 %0, %1, %2, %3;"
               : "=r"(out)
               : "r"(bits), "r"(0x7B807B80u), "r"(0x80008000u));
  return out;
}

template <int kPath>
__global__ void convert(uint32_t* sink, uint32_t seed) {
  uint32_t r[kRegs];
#pragma unroll
  for (int i = 0; i < kRegs; ++i) r[i] = seed * (threadIdx.x + i + 1);
  uint32_t acc = 0;
  for (int it = 0; it < kIters; ++it) {
#pragma unroll
    for (int i = 0; i < kRegs; ++i) {
      const uint32_t v = kPath == 0 ? by_cvt(r[i]) : by_integers(r[i]);
      acc ^= v;
      r[i] += v;  // a dependency per register, as a decode's fragments have
    }
  }
  if (acc == 0x12345678u) sink[threadIdx.x] = acc;
}

int main() {
  int sms = 0, clock_khz = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0);
  uint32_t* sink;
  cudaMalloc(&sink, 4096);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int path = 0; path < 2; ++path) {
    for (int warps : {4, 8, 16, 32}) {
      auto kernel = path == 0 ? convert<0> : convert<1>;
      kernel<<<sms, warps * 32>>>(sink, 3);
      cudaEventRecord(a);
      kernel<<<sms, warps * 32>>>(sink, 3);
      cudaEventRecord(b);
      cudaEventSynchronize(b);
      float ms = 0;
      cudaEventElapsedTime(&ms, a, b);
      const double pairs_per_sm = double(warps) * 32 * kRegs * kIters;
      const double clocks = ms * 1e-3 * clock_khz * 1e3;
      printf("%-9s warps/SM %2d: %.1f pairs/clk/SM (%.3f ms)\n", path == 0 ? "cvt" : "integer",
             warps, pairs_per_sm / clocks, ms);
    }
  }
  return 0;
}
