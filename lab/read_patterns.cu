// Read-rate microbenchmark: how fast can a decode-style K/V stream be read on this GPU, and which
// detail of the copy pattern costs what? No attention math: every block copies 64-row K and V
// tiles (256-byte rows, D = 128 bf16) into shared memory with 16-byte cp.async, three stages,
// a block barrier per tile, and reads each tile back once from shared memory. Variants change one
// thing at a time: 108.8 KB of shared memory per block (the attention kernel's size before the
// swizzle), rows at a 272-byte pitch (the padded layout), the zero-fill form of cp.async, the
// attention kernel's start (seq_len, then a page id, then copies), and a persistent grid
// ("details", the default). "strategies" compares ways of loading instead: an L2 prefetch hint,
// smaller tiles with more stages, one block per SM, 256 threads, a persistent grid, and warps
// that each stream their own part with their own stages (no block barrier), on NHD and HND.
// "kvsplit" compares SDPA cuDNN's decode pipeline (K and V in separate steps, one buffer each, read
// from its disassembly) with ours, at one block per (sequence, kv head) and at two. "layouts" reads
// the same bytes NHD and HND with the current decode's forms (8 warps with 128-row tiles, 4 warps
// with 64-row tiles, 2 stages each) and cuDNN's, one block per (sequence, kv head), and on NHD
// pages of 16 slots scattered through the pool ("P16", a shuffled paged pool without lookups).
// "streamk" asks
// whether a stream-K decode would read faster: the items' tiles dealt to every SM in equal
// contiguous runs that cross (sequence, kv head) items (the partial results a merge would then
// combine; the merge is not timed), against a block per item, on NHD rows.
// Each line is the median of 15 launches, L2 emptied before each by a 256 MB write followed by a
// 256 MB read of another buffer ("clean"), or by the write alone ("dirty", whose write-back then
// lands inside the timed launch).
//
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90,code=sm_90 lab/read_patterns.cu \
//       -o /tmp/read_patterns && /tmp/read_patterns [details | strategies | kvsplit | layouts |
//       streamk]
//
// Readings (H200): results/read_patterns_NVIDIA-H200_2026-12-02.md, kvsplit in
// results/decode_cudnn_pipeline_NVIDIA-H200_2026-12-03.md, layouts in
// results/read_patterns_layouts_NVIDIA-H200_2026-12-03.md (P16 in
// results/read_patterns_scattered_pages_NVIDIA-H200_2026-12-03.md), streamk in
// results/read_stream_k_NVIDIA-H200_2026-12-03.md; what they changed: NOTES.md.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <string>
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

struct Layout {
  const char* k;
  const char* v;
  int64_t seq_stride, head_stride, token_stride;  // bytes
  int heads, length, splits;
  int items;  // seqs * heads * splits
  float* out;
  const int* lens;   // [items], all = a large length
  const int* table;  // zeros
  // kScatter kernels: NHD pages of 16 slots (32 KB, every head), placed in 2^log2_pages page
  // frames by a fixed bijection (an odd multiplier), as a shuffled paged pool, with no lookup.
  int log2_pages;
};

// The byte offset of row pos of item (one split) in a scattered NHD pool of 16-slot pages.
__device__ __forceinline__ int64_t scattered_row(const Layout& L, int item, int pos) {
  const int head = item % L.heads, seq = item / L.heads;
  const uint32_t logical = (uint32_t)seq * (uint32_t)(L.length >> 4) + (uint32_t)(pos >> 4);
  const uint32_t frame = (logical * 2654435761u) & ((1u << L.log2_pages) - 1);
  return (int64_t)frame * (16 * L.heads * kRowBytes) + (pos & 15) * (L.heads * kRowBytes) +
         head * kRowBytes;
}

__device__ __forceinline__ uint32_t saddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
template <int kHint>
__device__ __forceinline__ void cp16(uint32_t dst, const void* src) {
  if constexpr (kHint == 0)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  else if constexpr (kHint == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
  else
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void wait_group() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void item_range(const Layout& L, int item, const char*& kb,
                                           const char*& vb, int& begin, int& end) {
  const int split = item % L.splits;
  const int sh = item / L.splits;
  const int head = sh % L.heads, seq = sh / L.heads;
  const int chunk = L.length / L.splits;
  begin = split * chunk;
  end = begin + chunk;
  kb = L.k + seq * L.seq_stride + head * L.head_stride;
  vb = L.v + seq * L.seq_stride + head * L.head_stride;
}

// A pipeline over n tiles, shared by kThreads threads (a block, or one warp with sync =
// __syncwarp): issue(t) starts tile t's K and V copies into stage t % kStages; once a tile has
// landed, each thread (index me) reads back its share of both stages (bytes that other threads
// copied, as the mma loop would) into acc, then after_tile(t) runs.
template <int kThreads, int kStages, int kStageBytes, typename Issue, typename Sync,
          typename AfterTile>
__device__ __forceinline__ void run_pipeline(int n, const unsigned char* ks,
                                             const unsigned char* vs, int me, uint32_t& acc,
                                             Issue issue, Sync sync, AfterTile after_tile) {
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < n) issue(s);
    commit();
  }
  for (int t = 0; t < n; ++t) {
    if (t + kStages - 1 < n) issue(t + kStages - 1);
    commit();
    wait_group<kStages - 1>();
    sync();
    const int st = t % kStages;
    constexpr int kReads = 2 * kStageBytes / kThreads / 16;
#pragma unroll
    for (int i = 0; i < kReads; ++i) {
      const int idx = ((me * 7 + i * kThreads) % (2 * kStageBytes / 16));
      const uint4 x = *reinterpret_cast<const uint4*>(
          (idx < kStageBytes / 16 ? ks : vs - kStageBytes) + st * kStageBytes + idx * 16);
      acc ^= x.x + x.y * 3 + x.z * 5 + x.w * 7;
    }
    sync();
    after_tile(t);
  }
  wait_group<0>();
}

// Block pipeline, as the attention kernel: all threads copy each tile, barrier per tile, then a
// "consume" that reads the tile from shared memory (the bytes the mma loop would read).
template <int kThreads, int kTile, int kStages, int kHint, bool kPersistent, int kRowPitch = 256,
          bool kZfill = false, bool kChain = false, bool kScatter = false>
__global__ void __launch_bounds__(kThreads) block_pipeline(const Layout L) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kStageBytes = kTile * kRowPitch;
  unsigned char* ks = smem;
  unsigned char* vs = smem + kStages * kStageBytes;
  const int tid = threadIdx.x;
  const int row0 = tid / kChunks, ch = tid % kChunks;
  constexpr int kRowsPerPass = kThreads / kChunks;
  constexpr int kCopies = kTile / kRowsPerPass;
  uint32_t acc = 0;
  for (int item = blockIdx.x; item < L.items; item += kPersistent ? gridDim.x : L.items) {
    const char *kb, *vb;
    int begin, end;
    item_range(L, item, kb, vb, begin, end);
    if constexpr (kChain) {  // the attention kernel's start: seq_len, then a page id, then copies
      const int len = L.lens[item];
      const int page = L.table[len & 1023];
      begin += page;  // page is 0: only the dependency matters
      end = min(end, begin + len);
    }
    const int tiles = (end - begin) / kTile;
    auto issue = [&](int t) {
      const int st = t % kStages;
#pragma unroll
      for (int i = 0; i < kCopies; ++i) {
        const int r = row0 + i * kRowsPerPass;
        const int64_t off = (int64_t)(begin + t * kTile + r) * L.token_stride + ch * 16;
        if constexpr (kZfill) {
          const int n = begin + t * kTile + r < end ? 16 : 0;
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                           saddr(ks + st * kStageBytes + r * kRowPitch + ch * 16)),
                       "l"(kb + off), "r"(n));
          asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(
                           saddr(vs + st * kStageBytes + r * kRowPitch + ch * 16)),
                       "l"(vb + off), "r"(n));
        } else if constexpr (kScatter) {
          const int64_t row = scattered_row(L, item, begin + t * kTile + r) + ch * 16;
          cp16<kHint>(saddr(ks + st * kStageBytes + r * kRowPitch + ch * 16), L.k + row);
          cp16<kHint>(saddr(vs + st * kStageBytes + r * kRowPitch + ch * 16), L.v + row);
        } else {
          cp16<kHint>(saddr(ks + st * kStageBytes + r * kRowPitch + ch * 16), kb + off);
          cp16<kHint>(saddr(vs + st * kStageBytes + r * kRowPitch + ch * 16), vb + off);
        }
      }
    };
    run_pipeline<kThreads, kStages, kStageBytes>(
        tiles, ks, vs, tid, acc, issue, [] { __syncthreads(); }, [](int) {});
  }
  if (acc == 0x12345678u) L.out[blockIdx.x] = 1.f;
}

// SDPA cuDNN's decode pipeline (its sm80 kernel, read from a profiler's disassembly): K and V of a
// tile in separate commit groups, each in its own buffer of kStages tiles; wait for K, consume it,
// refill it with the next K; wait for V, consume it, refill it. kStages = 1 is cuDNN's (at most
// the next K and this V in flight).
template <int kThreads, int kTile, int kStages, bool kScatter = false>
__global__ void __launch_bounds__(kThreads) kv_split_pipeline(const Layout L) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kStageBytes = kTile * kRowBytes;
  unsigned char* ks = smem;
  unsigned char* vs = smem + kStages * kStageBytes;
  const int tid = threadIdx.x;
  const int row0 = tid / kChunks, ch = tid % kChunks;
  constexpr int kRowsPerPass = kThreads / kChunks;
  constexpr int kCopies = kTile / kRowsPerPass;
  uint32_t acc = 0;
  const char *kb, *vb;
  int begin, end;
  item_range(L, blockIdx.x, kb, vb, begin, end);
  const int tiles = (end - begin) / kTile;
  // base: this item's rows (contiguous layouts); pool: the K or V pool (kScatter).
  auto issue = [&](const char* base, const char* pool, unsigned char* dst, int t) {
    const int st = t % kStages;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int r = row0 + i * kRowsPerPass;
      const int pos = begin + t * kTile + r;
      const char* src = kScatter ? pool + scattered_row(L, blockIdx.x, pos) + ch * 16
                                 : base + (int64_t)pos * L.token_stride + ch * 16;
      cp16<0>(saddr(dst + st * kStageBytes + r * kRowBytes + ch * 16), src);
    }
  };
  auto consume = [&](const unsigned char* buf) {
    constexpr int kReads = kStageBytes / kThreads / 16;
#pragma unroll
    for (int i = 0; i < kReads; ++i) {
      const int idx = (tid * 7 + i * kThreads) % (kStageBytes / 16);
      const uint4 x = *reinterpret_cast<const uint4*>(buf + idx * 16);
      acc ^= x.x + x.y * 3 + x.z * 5 + x.w * 7;
    }
  };
  // Prologue: K and V of the first kStages tiles, K before V in each.
  for (int s = 0; s < kStages; ++s) {
    if (s < tiles) issue(kb, L.k, ks, s);
    commit();
    if (s < tiles) issue(vb, L.v, vs, s);
    commit();
  }
  for (int t = 0; t < tiles; ++t) {
    const int st = t % kStages;
    wait_group<2 * kStages - 1>();  // K of tile t
    __syncthreads();
    consume(ks + st * kStageBytes);
    __syncthreads();
    if (t + kStages < tiles) issue(kb, L.k, ks, t + kStages);
    commit();
    wait_group<2 * kStages - 1>();  // V of tile t
    __syncthreads();
    consume(vs + st * kStageBytes);
    __syncthreads();
    if (t + kStages < tiles) issue(vb, L.v, vs, t + kStages);
    commit();
  }
  wait_group<0>();
  if (acc == 0x12345678u) L.out[blockIdx.x] = 1.f;
}

// Stream-K reads: kStreamK false, block b reads item b whole (one split); true, the items' tiles
// in order are cut into gridDim.x equal runs and the pipeline runs on across item boundaries,
// writing 2 KB (a partial result: 4 heads x 128 fp32) wherever a run ends an item.
template <int kThreads, int kTile, int kStages, bool kStreamK>
__global__ void __launch_bounds__(kThreads) stream_k_pipeline(const Layout L, float* partials) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kStageBytes = kTile * kRowBytes;
  unsigned char* ks = smem;
  unsigned char* vs = smem + kStages * kStageBytes;
  const int tid = threadIdx.x;
  const int row0 = tid / kChunks, ch = tid % kChunks;
  constexpr int kRowsPerPass = kThreads / kChunks;
  constexpr int kCopies = kTile / kRowsPerPass;
  const int tiles_per_item = L.length / kTile;
  const int64_t total = (int64_t)L.items * tiles_per_item;
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
    const int head = item % L.heads, seq = item / L.heads;
    const int64_t base = seq * L.seq_stride + head * L.head_stride;
    const int st = t % kStages;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int r = row0 + i * kRowsPerPass;
      const int64_t off = base + (int64_t)(tile * kTile + r) * L.token_stride + ch * 16;
      cp16<0>(saddr(ks + st * kStageBytes + r * kRowBytes + ch * 16), L.k + off);
      cp16<0>(saddr(vs + st * kStageBytes + r * kRowBytes + ch * 16), L.v + off);
    }
  };
  uint32_t acc = 0;
  const auto sync = [] { __syncthreads(); };
  run_pipeline<kThreads, kStages, kStageBytes>(n, ks, vs, tid, acc, issue, sync, [&](int t) {
    if constexpr (kStreamK) {
      const int64_t g = first + t;
      const bool item_ends = (g + 1) % tiles_per_item == 0;
      if (item_ends || t == n - 1) {
        const int64_t slot = (int64_t)blockIdx.x * 4 + (item_ends ? 0 : 1);
        for (int i = tid; i < 512; i += kThreads) partials[slot * 512 + i] = (float)(acc & 7);
      }
    }
  });
  if (acc == 0x12345678u) L.out[blockIdx.x] = 1.f;
}

// Warp-independent pipelines: each warp streams its own quarter of the item's range with its own
// stages; __syncwarp only.
template <int kWarps, int kWarpTile, int kStages>
__global__ void __launch_bounds__(kWarps * 32) warp_pipeline(const Layout L) {
  extern __shared__ __align__(128) unsigned char smem[];
  constexpr int kStageBytes = kWarpTile * kRowBytes;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  unsigned char* ks = smem + warp * 2 * kStages * kStageBytes;
  unsigned char* vs = ks + kStages * kStageBytes;
  const int row0 = lane / kChunks, ch = lane % kChunks;
  constexpr int kCopies = kWarpTile / 2;
  uint32_t acc = 0;
  const char *kb, *vb;
  int begin, end;
  item_range(L, blockIdx.x, kb, vb, begin, end);
  const int span = (end - begin) / kWarps;
  begin += warp * span;
  const int tiles = span / kWarpTile;
  auto issue = [&](int t) {
    const int st = t % kStages;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int r = row0 + i * 2;
      const int64_t off = (int64_t)(begin + t * kWarpTile + r) * L.token_stride + ch * 16;
      cp16<0>(saddr(ks + st * kStageBytes + r * kRowBytes + ch * 16), kb + off);
      cp16<0>(saddr(vs + st * kStageBytes + r * kRowBytes + ch * 16), vb + off);
    }
  };
  run_pipeline<32, kStages, kStageBytes>(
      tiles, ks, vs, lane, acc, issue, [] { __syncwarp(); }, [](int) {});
  if (acc == 0x12345678u) L.out[blockIdx.x] = 1.f;
}

// Plain stream: 16-byte non-coherent loads into registers, grid-stride, 4 in flight per thread.
__global__ void __launch_bounds__(256) stream_read(const uint4* a, int64_t n, float* out) {
  uint32_t acc = 0;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 x[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) x[j] = __ldcs(a + i + j * stride);
#pragma unroll
    for (int j = 0; j < 4; ++j) acc ^= x[j].x + x[j].y + x[j].z + x[j].w;
  }
  for (; i < n; i += stride) {
    uint4 x = __ldcs(a + i);
    acc ^= x.x + x.y + x.z + x.w;
  }
  if (acc == 0x12345678u) out[0] = 1.f;
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
static int g_mode = 1;  // 0 none, 1 write (dirty L2), 2 write then read (clean L2)

static void flush(int i) {
  if (g_mode == 0) return;
  CK(cudaMemsetAsync(g_flush_w, i & 0xff, kFlushBytes));
  if (g_mode == 2) touch_read<<<132 * 8, 256>>>((const uint4*)g_flush_r, kFlushBytes / 16, g_out);
}

template <typename F>
static float time_us(F launch, int reps = 15) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  for (int i = 0; i < 2; ++i) launch();
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    flush(i);
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

template <typename K>
static void set_smem(K kernel, int bytes) {
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes));
}

// "streamk": two rounds over decode shapes, NHD rows, clean L2; the grid of each line in brackets.
static void stream_k_runs(const char* k, const char* v, int sms) {
  g_mode = 2;
  float* partials;
  CK(cudaMalloc(&partials, 4 * 1024 * 2048));
  printf("SMs %d; clean L2 (write + read flush), median of 15\n", sms);
  struct Shape {
    int b, l;
  };
  const Shape shapes[] = {{16, 2048}, {16, 4096}, {16, 8192}, {16, 32768},
                          {12, 4096}, {64, 4096}, {128, 2048}};
  for (int round = 0; round < 2; ++round) {
    for (const Shape& s : shapes) {
      Layout L{};
      L.k = k;
      L.v = v;
      L.heads = 8;
      L.length = s.l;
      L.splits = 1;
      L.items = s.b * 8;
      L.token_stride = 8 * kRowBytes;  // NHD: [B, L, H, D]
      L.head_stride = kRowBytes;
      L.seq_stride = (int64_t)s.l * 8 * kRowBytes;
      L.out = g_out;
      const double bytes = 2.0 * s.b * s.l * 8 * kRowBytes;
      char label[64];
      snprintf(label, sizeof label, "r%d B=%3d L=%5d %5.0f MB", round, s.b, s.l, bytes / 1e6);
      auto run = [&](auto kern, int threads, int smem, int grid, const char* name) {
        set_smem(kern, smem);
        const float us = time_us([&] { kern<<<grid, threads, smem>>>(L, partials); });
        printf("%s %-36s grid %4d %8.1f us %.3f TB/s\n", label, name, grid, us, bytes / us / 1e6);
      };
      constexpr int kW8 = 2 * 2 * 128 * kRowBytes;  // 8 warps: 2 stages of 128-row K + V
      constexpr int kW4 = 2 * 2 * 64 * kRowBytes;   // 4 warps: 2 stages of 64-row K + V
      run(stream_k_pipeline<256, 128, 2, false>, 256, kW8, L.items, "8 warps, a block per item");
      run(stream_k_pipeline<256, 128, 2, true>, 256, kW8, sms, "8 warps, stream-K over every SM");
      run(stream_k_pipeline<256, 128, 2, true>, 256, kW8, std::min(L.items, 128),
          "8 warps, stream-K over 128 blocks");
      run(stream_k_pipeline<128, 64, 2, false>, 128, kW4, L.items, "4 warps, a block per item");
      run(stream_k_pipeline<128, 64, 2, true>, 128, kW4, 2 * sms, "4 warps, stream-K, 2 per SM");
    }
  }
  CK(cudaFree(partials));
}

int main(int argc, char** argv) {
  // "details" (default): run 2 of the readings, one detail of the attention kernel's copy per
  // line, NHD layout. "strategies": run 1, loading strategies, NHD and HND, three flushes.
  const bool kvsplit = argc >= 2 && std::string(argv[1]) == "kvsplit";
  const bool layouts = argc >= 2 && std::string(argv[1]) == "layouts";
  const bool details = !kvsplit && !layouts && (argc < 2 || std::string(argv[1]) != "strategies");
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  const int64_t kMax = 1ll << 30;  // per K and V
  char *k, *v;
  CK(cudaMalloc(&k, kMax));
  CK(cudaMalloc(&v, kMax));
  CK(cudaMemset(k, 1, kMax));
  CK(cudaMemset(v, 2, kMax));
  CK(cudaMalloc(&g_flush_w, kFlushBytes));
  CK(cudaMalloc(&g_flush_r, kFlushBytes));
  CK(cudaMemset(g_flush_r, 3, kFlushBytes));
  CK(cudaMalloc(&g_out, 1 << 20));
  int *lens, *table;
  CK(cudaMalloc(&lens, 1 << 20));
  CK(cudaMalloc(&table, 1 << 20));
  {
    std::vector<int> h(1 << 18, 1 << 30);
    CK(cudaMemcpy(lens, h.data(), 1 << 20, cudaMemcpyHostToDevice));
    CK(cudaMemset(table, 0, 1 << 20));
  }
  if (argc >= 2 && std::string(argv[1]) == "streamk") {
    stream_k_runs(k, v, sms);
    return 0;
  }
  const char* mode_names[] = {"no flush", "write flush (dirty L2)", "write+read flush (clean L2)"};

  struct Shape {
    int b, l, splits;
  };
  const std::vector<Shape> shapes =
      kvsplit || layouts
          ? std::vector<Shape>{{16, 2048, 1}, {16, 8192, 1}, {16, 32768, 1}, {64, 4096, 1}}
      : details ? std::vector<Shape>{{16, 2048, 2}, {16, 4096, 2}, {64, 4096, 1}}
                : std::vector<Shape>{{16, 2048, 2}, {16, 4096, 2}, {64, 4096, 1}, {16, 16384, 1}};
  const std::vector<int> modes = kvsplit || layouts ? std::vector<int>{2}
                                 : details          ? std::vector<int>{2, 1}
                                                    : std::vector<int>{1, 2, 0};
  for (int mode : modes) {
    g_mode = mode;
    printf("== %s ==\n", mode_names[mode]);
    for (int64_t mb : {134, 268, 1073}) {
      const int64_t bytes = mb << 20;
      float us =
          time_us([&] { stream_read<<<sms * 8, 256>>>((const uint4*)k, bytes / 16, g_out); });
      printf("stream ld.v4 %5lld MB: %7.1f us %.2f TB/s\n", (long long)mb, us, bytes / us / 1e6);
    }
    {
      const int64_t bytes = 1ll << 30;
      float us = time_us([&] { CK(cudaMemcpyAsync(v, k, bytes / 2, cudaMemcpyDeviceToDevice)); });
      printf("copy 512 MB (r+w): %.1f us %.2f TB/s\n", us, bytes / us / 1e6);
    }
    for (const Shape& s : shapes) {
      for (int layout = 0; layout < (details ? 1 : layouts ? 3 : 2); ++layout) {
        Layout L;
        L.k = k;
        L.v = v;
        L.heads = 8;
        L.length = s.l;
        L.splits = s.splits;
        L.items = s.b * 8 * s.splits;
        L.out = g_out;
        L.lens = lens;
        L.table = table;
        L.log2_pages = 0;
        while ((1ll << L.log2_pages) < (int64_t)s.b * s.l / 16) ++L.log2_pages;
        if (layout == 0 || layout == 2) {  // NHD: [B, L, H, D]; 2: its 16-slot pages scattered
          L.token_stride = 8 * kRowBytes;
          L.head_stride = kRowBytes;
          L.seq_stride = (int64_t)s.l * 8 * kRowBytes;
        } else {  // HND contiguous: [B, H, L, D]
          L.token_stride = kRowBytes;
          L.head_stride = (int64_t)s.l * kRowBytes;
          L.seq_stride = (int64_t)8 * s.l * kRowBytes;
        }
        const double bytes = 2.0 * s.b * s.l * 8 * kRowBytes;
        char label[96];
        const char* layout_names[] = {"NHD", "HND", "P16"};
        snprintf(label, sizeof label, "B=%d L=%d %s %4.0f MB", s.b, s.l, layout_names[layout],
                 bytes / 1e6);
        auto run = [&](auto kern, const char* name, int smem, int grid = 0, int threads = 128) {
          set_smem(kern, smem);
          const int g = grid ? grid : L.items;
          const float us = time_us([&] { kern<<<g, threads, smem>>>(L); });
          printf("%s %-34s %7.1f us %.2f TB/s\n", label, name, us, bytes / us / 1e6);
        };
        const int tile64 = 64 * kRowBytes * 2;  // K + V of one 64-row stage
        if (layouts && layout == 2) {
          run(block_pipeline<256, 128, 2, 0, false, 256, false, false, true>,
              "8 warps tile128 st2 1/SM", 4 * 128 * 256, 0, 256);
          run(block_pipeline<128, 64, 2, 0, false, 256, false, false, true>,
              "4 warps tile64 st2, 2/SM", 2 * tile64);
          run(block_pipeline<128, 64, 2, 0, false, 256, false, false, true>,
              "4 warps tile64 st2, 1/SM", 120000);
          run(kv_split_pipeline<128, 128, 1, true>, "cudnn: kv split 128 st1, 86 KB", 88064);
          // More bytes in flight per SM on scattered pages.
          run(block_pipeline<256, 128, 3, 0, false, 256, false, false, true>,
              "8 warps tile128 st3 1/SM (192 KB)", 6 * 128 * 256, 0, 256);
          run(block_pipeline<256, 64, 4, 0, false, 256, false, false, true>,
              "8 warps tile64 st4 1/SM (128 KB)", 8 * 64 * 256, 0, 256);
          run(block_pipeline<128, 64, 4, 0, false, 256, false, false, true>,
              "4 warps tile64 st4 1/SM (128 KB)", 8 * 64 * 256);
        } else if (layouts) {
          run(block_pipeline<256, 128, 2, 0, false>, "8 warps tile128 st2 1/SM", 4 * 128 * 256, 0,
              256);
          run(block_pipeline<128, 64, 2, 0, false>, "4 warps tile64 st2, 2/SM", 2 * tile64);
          run(block_pipeline<128, 64, 2, 0, false>, "4 warps tile64 st2, 1/SM", 120000);
          run(kv_split_pipeline<128, 128, 1>, "cudnn: kv split 128 st1, 86 KB", 88064);
          run(block_pipeline<256, 128, 3, 0, false>, "8 warps tile128 st3 1/SM (192 KB)",
              6 * 128 * 256, 0, 256);
          run(block_pipeline<256, 64, 4, 0, false>, "8 warps tile64 st4 1/SM (128 KB)",
              8 * 64 * 256, 0, 256);
          run(block_pipeline<128, 64, 4, 0, false>, "4 warps tile64 st4 1/SM (128 KB)",
              8 * 64 * 256);
        } else if (kvsplit) {
          // Splits of 1 here; "x2" lines run 2 blocks per item's range (2 splits, the pairs' grid).
          Layout L2 = L;
          L2.splits = 2;
          L2.items = L.items * 2;
          run(kv_split_pipeline<128, 128, 1>, "cudnn: kv split 128 st1 1/SM", 2 * 128 * kRowBytes);
          run(kv_split_pipeline<128, 128, 1>, "kv split 128 st1, 86 KB", 88064);
          run(kv_split_pipeline<128, 64, 2>, "kv split 64 st2 1/SM", 151552);
          run(block_pipeline<128, 128, 2, 0, false>, "block tile128 st2 1/SM", 2 * 2 * 128 * 256);
          set_smem(block_pipeline<128, 64, 2, 0, false>, 2 * tile64);
          const float us2 = time_us([&] {
            auto kern = block_pipeline<128, 64, 2, 0, false>;
            kern<<<L2.items, 128, 2 * tile64>>>(L2);
          });
          printf("%s %-34s %7.1f us %.2f TB/s\n", label, "ours: block st2 x2 splits 2/SM", us2,
                 bytes / us2 / 1e6);
          const float us3 = time_us([&] {
            auto kern = kv_split_pipeline<128, 64, 2>;
            kern<<<L2.items, 128, 2 * tile64>>>(L2);
          });
          printf("%s %-34s %7.1f us %.2f TB/s\n", label, "kv split 64 st2 x2 splits 2/SM", us3,
                 bytes / us3 / 1e6);
        } else if (details) {
          run(block_pipeline<128, 64, 3, 0, false>, "block st3 (96 KB)", 3 * tile64);
          run(block_pipeline<128, 64, 3, 0, false>, "block st3 + 108.8 KB smem", 108800);
          run(block_pipeline<128, 64, 3, 0, false, 272>, "block st3 272-B rows", 3 * 64 * 272 * 2);
          run(block_pipeline<128, 64, 3, 0, false, 256, true>, "block st3 zfill form", 3 * tile64);
          run(block_pipeline<128, 64, 3, 0, false, 256, false, true>, "block st3 start chain",
              3 * tile64);
          run(block_pipeline<128, 64, 3, 0, false, 272, true, true>, "all four", 108800);
          run(block_pipeline<128, 64, 3, 0, true, 272, true, true>, "all four, persistent", 108800,
              2 * sms);
        } else {
          run(block_pipeline<128, 64, 3, 0, false>, "block 128t tile64 st3", 3 * tile64);
          run(block_pipeline<128, 64, 3, 256, false>, "block 128t tile64 st3 L2::256B", 3 * tile64);
          run(block_pipeline<128, 32, 6, 0, false>, "block 128t tile32 st6", 3 * tile64);
          run(block_pipeline<128, 64, 6, 0, false>, "block 128t tile64 st6 (1/SM)", 6 * tile64);
          // 256 threads: the launch helper uses 128, so this one is launched here.
          {
            auto kern = block_pipeline<256, 64, 3, 0, false>;
            set_smem(kern, 3 * tile64);
            const float us = time_us([&] { kern<<<L.items, 256, 3 * tile64>>>(L); });
            printf("%s %-34s %7.1f us %.2f TB/s\n", label, "block 256t tile64 st3", us,
                   bytes / us / 1e6);
          }
          run(block_pipeline<128, 64, 3, 0, true>, "block 128t st3 persistent 2/SM", 3 * tile64,
              std::min(L.items, 2 * sms));
          run(warp_pipeline<4, 16, 3>, "warp 4w tile16 st3", 4 * 3 * 16 * kRowBytes * 2);
          run(warp_pipeline<4, 16, 6>, "warp 4w tile16 st6 (1/SM)", 4 * 6 * 16 * kRowBytes * 2);
          run(warp_pipeline<4, 8, 6>, "warp 4w tile8 st6", 4 * 6 * 8 * kRowBytes * 2);
        }
      }
    }
  }
  return 0;
}
