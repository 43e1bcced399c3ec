// Read-rate probe for a stream-K decode: does a K/V stream read faster when the same bytes are
// dealt to every SM in equal contiguous runs of tiles (runs cross (sequence, kv head) items, as a
// stream-K split would, whose partial results a merge would then combine) than when each block
// reads one whole item? At B = 16, Hkv = 8 there are 128 items for 132 SMs: one block per item
// leaves 4 SMs idle, and at B = 64 each block's pipeline starts cold once per item. No attention
// math: each block copies K and V tiles (256-byte rows, D = 128 bf16) into shared memory with
// 16-byte cp.async, a block barrier per tile, reads each tile back once, and in stream-K form
// writes 2 KB (a partial result's size) wherever its run ends an item. NHD rows ([B, L, H, D],
// rows of one item 2 KB apart). Each line is the median of 15 launches, L2 emptied before each by
// a 256 MB write followed by a 256 MB read of another buffer. The merge kernel a stream-K decode
// needs is not in these times.
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 benchmarks/read_stream_k.cu \
//       -o /tmp/read_stream_k && /tmp/read_stream_k
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#define CK(x)                                                                   \
  do {                                                                          \
    cudaError_t e = (x);                                                        \
    if (e != cudaSuccess) {                                                     \
      printf("CUDA error %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

constexpr int kRowBytes = 256;  // D = 128 bf16
constexpr int kChunks = 16;     // 16-byte pieces per row
constexpr int kHeads = 8;

struct Stream {
  const char* k;
  const char* v;
  int64_t seq_stride, token_stride;  // bytes; a head is kRowBytes further
  int length;                        // positions per item
  int items;                         // sequences * heads
  float* partials;                   // 2 KB per written partial
  float* out;
};

__device__ __forceinline__ uint32_t saddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// kStreamK false: block b reads item b whole. true: the items' tiles in order, cut into gridDim.x
// equal runs; the pipeline runs on across item boundaries.
template <int kThreads, int kTile, int kStages, bool kStreamK>
__global__ void __launch_bounds__(kThreads) tile_pipeline(const Stream S) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kStageBytes = kTile * kRowBytes;
  unsigned char* ks = smem;
  unsigned char* vs = smem + kStages * kStageBytes;
  const int tid = threadIdx.x;
  const int row0 = tid / kChunks, ch = tid % kChunks;
  constexpr int kRowsPerPass = kThreads / kChunks;
  constexpr int kCopies = kTile / kRowsPerPass;
  const int tiles_per_item = S.length / kTile;
  const int64_t total = (int64_t)S.items * tiles_per_item;
  int64_t first, last;  // [first, last) in the flattened (item, tile) order
  if constexpr (kStreamK) {
    first = total * blockIdx.x / gridDim.x;
    last = total * (blockIdx.x + 1) / gridDim.x;
  } else {
    first = (int64_t)blockIdx.x * tiles_per_item;
    last = first + tiles_per_item;
  }
  const int n = static_cast<int>(last - first);
  auto issue = [&](int t) {
    const int64_t g = first + t;
    const int item = static_cast<int>(g / tiles_per_item);
    const int tile = static_cast<int>(g - (int64_t)item * tiles_per_item);
    const int head = item % kHeads, seq = item / kHeads;
    const int64_t base = seq * S.seq_stride + (int64_t)head * kRowBytes;
    const int st = t % kStages;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int r = row0 + i * kRowsPerPass;
      const int64_t off = base + (int64_t)(tile * kTile + r) * S.token_stride + ch * 16;
      cp16(saddr(ks + st * kStageBytes + r * kRowBytes + ch * 16), S.k + off);
      cp16(saddr(vs + st * kStageBytes + r * kRowBytes + ch * 16), S.v + off);
    }
  };
  uint32_t acc = 0;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n) issue(s);
    commit();
  }
  for (int t = 0; t < n; ++t) {
    if (t + kStages - 1 < n) issue(t + kStages - 1);
    commit();
    wait_group<kStages - 1>();
    __syncthreads();
    const int st = t % kStages;
    constexpr int kReads = 2 * kStageBytes / kThreads / 16;
#pragma unroll
    for (int i = 0; i < kReads; ++i) {
      const int idx = (tid * 7 + i * kThreads) % (2 * kStageBytes / 16);
      const uint4 x = *reinterpret_cast<const uint4*>(
          (idx < kStageBytes / 16 ? ks : vs - kStageBytes) + st * kStageBytes + idx * 16);
      acc ^= x.x + x.y * 3 + x.z * 5 + x.w * 7;
    }
    __syncthreads();
    if constexpr (kStreamK) {
      const int64_t g = first + t;
      const bool item_ends = (g + 1) % tiles_per_item == 0;
      if (item_ends || t == n - 1) {  // a partial result: 2 KB (4 heads x 128 fp32)
        const int64_t slot = (int64_t)blockIdx.x * 4 + (item_ends ? 0 : 1);
        for (int i = tid; i < 512; i += kThreads) S.partials[slot * 512 + i] = (float)(acc & 7);
      }
    }
  }
  wait_group<0>();
  if (acc == 0x12345678u) S.out[blockIdx.x] = 1.f;
}

__global__ void touch_read(const uint4* a, int64_t n, float* out) {
  uint32_t acc = 0;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
       i += (int64_t)gridDim.x * blockDim.x)
    acc ^= a[i].x;
  if (acc == 0x12345678u) out[0] = 1.f;
}

static char* g_flush_w;
static char* g_flush_r;
static float* g_out;
constexpr int64_t kFlushBytes = 256ll << 20;

template <typename F>
static float time_us(F launch, int reps = 15) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) launch();
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    CK(cudaMemsetAsync(g_flush_w, i & 0xff, kFlushBytes));
    touch_read<<<132 * 8, 256>>>((const uint4*)g_flush_r, kFlushBytes / 16, g_out);
    CK(cudaEventRecord(a));
    launch();
    CK(cudaEventRecord(b));
    CK(cudaEventSynchronize(b));
    float ms;
    CK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1e3f);
  }
  CK(cudaGetLastError());
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t kMax = 1ll << 31;  // per K and V: B=16 L=32768 holds 1 GB each
  char *k, *v;
  CK(cudaMalloc(&k, kMax));
  CK(cudaMalloc(&v, kMax));
  CK(cudaMemset(k, 1, kMax));
  CK(cudaMemset(v, 2, kMax));
  CK(cudaMalloc(&g_flush_w, kFlushBytes));
  CK(cudaMalloc(&g_flush_r, kFlushBytes));
  CK(cudaMemset(g_flush_r, 3, kFlushBytes));
  CK(cudaMalloc(&g_out, 1 << 20));
  float* partials;
  CK(cudaMalloc(&partials, 4 * 1024 * 2048));
  printf("SMs %d; clean L2 (write + read flush), median of 15\n", sms);

  struct Shape {
    int b, l;
  };
  const std::vector<Shape> shapes = {{16, 2048}, {16, 4096}, {16, 8192}, {16, 32768},
                                     {12, 4096}, {64, 4096}, {128, 2048}};
  for (int round = 0; round < 2; ++round) {
    for (const Shape& s : shapes) {
      Stream S;
      S.k = k;
      S.v = v;
      S.token_stride = kHeads * kRowBytes;
      S.seq_stride = (int64_t)s.l * kHeads * kRowBytes;
      S.length = s.l;
      S.items = s.b * kHeads;
      S.partials = partials;
      S.out = g_out;
      const double bytes = 2.0 * s.b * s.l * kHeads * kRowBytes;
      char label[64];
      snprintf(label, sizeof label, "r%d B=%3d L=%5d %5.0f MB", round, s.b, s.l, bytes / 1e6);
      auto run = [&](auto kern, int threads, int smem, int grid, const char* name) {
        CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        const float us = time_us([&] { kern<<<grid, threads, smem>>>(S); });
        printf("%s %-36s grid %4d %8.1f us %.3f TB/s\n", label, name, grid, us, bytes / us / 1e6);
      };
      constexpr int kW8 = 2 * 2 * 128 * kRowBytes;  // 8 warps: 2 stages of 128-row K + V
      constexpr int kW4 = 2 * 2 * 64 * kRowBytes;   // 4 warps: 2 stages of 64-row K + V
      run(tile_pipeline<256, 128, 2, false>, 256, kW8, S.items, "8 warps, a block per item");
      run(tile_pipeline<256, 128, 2, true>, 256, kW8, sms, "8 warps, stream-K over every SM");
      run(tile_pipeline<256, 128, 2, true>, 256, kW8, std::min(S.items, 128),
          "8 warps, stream-K over 128 blocks");
      run(tile_pipeline<128, 64, 2, false>, 128, kW4, S.items, "4 warps, a block per item");
      run(tile_pipeline<128, 64, 2, true>, 128, kW4, 2 * sms, "4 warps, stream-K, 2 per SM");
    }
  }
  return 0;
}
