// Host side of pool_tensor_map.h: the driver's tensor-map encoder, reached through the runtime's
// entry-point query (so the library does not link libcuda), and the maps of a call's pools.
#include <algorithm>
#include <cstdint>

#include "pool_tensor_map.h"

namespace astr::kernels {

namespace {

using EncodeTiled = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*,
                                 const cuuint64_t*, const cuuint64_t*, const cuuint32_t*,
                                 const cuuint32_t*, CUtensorMapInterleave, CUtensorMapSwizzle,
                                 CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver's cuTensorMapEncodeTiled, or null (a toolkit or driver without it); asked once.
EncodeTiled encode_tiled() {
  static const EncodeTiled entry = []() -> EncodeTiled {
#if CUDART_VERSION >= 12000
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found{};
    // An error already pending belongs to the caller's earlier work: it is left for them to see.
    const bool error_was_pending = cudaPeekAtLastError() != cudaSuccess;
#if CUDART_VERSION >= 12050
    const cudaError_t error = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function,
                                                               12000, cudaEnableDefault, &found);
#else
    const cudaError_t error =
        cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &function, cudaEnableDefault, &found);
#endif
    if (error != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      if (!error_was_pending) cudaGetLastError();  // the query's own error is not the caller's
      return nullptr;
    }
    return reinterpret_cast<EncodeTiled>(function);
#else
    return nullptr;
#endif
  }();
  return entry;
}

// One pool's map: dims (D, then slot, head and page ordered by stride), boxes of 64 x box_rows.
bool encode_pool(EncodeTiled encode, const void* pool, int64_t stride_slot, int64_t stride_head,
                 int64_t stride_page, const PagedAttentionParams& p, int box_rows, CUtensorMap* map,
                 int* slot_dim, int* head_dim, int* page_dim) {
  constexpr int64_t kElement = 2;
  struct Dim {
    int64_t stride_bytes;
    int64_t size;
    int box;
    int which;  // 0 slot, 1 head, 2 page
  };
  Dim dims[3] = {
      {stride_slot * kElement, int64_t{1} << p.log2_page_size, box_rows, 0},
      {stride_head * kElement, p.num_kv_heads, 1, 1},
      {stride_page * kElement, p.num_pages, 1, 2},
  };
  // Increasing strides, each dim nested in the next as a map describes them; a dim of one element
  // (one kv head, one page) goes last, its stride (never stepped) made to nest.
  std::stable_sort(dims, dims + 3, [](const Dim& a, const Dim& b) {
    if ((a.size == 1) != (b.size == 1)) return b.size == 1;
    return a.stride_bytes < b.stride_bytes;
  });
  for (int i = 1; i < 3; ++i)
    if (dims[i].size == 1) dims[i].stride_bytes = dims[i - 1].stride_bytes * dims[i - 1].size;
  cuuint64_t sizes[4] = {static_cast<cuuint64_t>(p.head_dim), 0, 0, 0};
  cuuint64_t strides[3] = {0, 0, 0};
  cuuint32_t box[4] = {64, 0, 0, 0};
  const cuuint32_t element_strides[4] = {1, 1, 1, 1};
  for (int i = 0; i < 3; ++i) {
    const Dim& d = dims[i];
    if (d.size <= 0 || d.size > (int64_t{1} << 32)) return false;
    if (d.stride_bytes <= 0 || d.stride_bytes % 16 != 0 || d.stride_bytes >= (int64_t{1} << 40))
      return false;
    sizes[i + 1] = static_cast<cuuint64_t>(d.size);
    strides[i] = static_cast<cuuint64_t>(d.stride_bytes);
    box[i + 1] = static_cast<cuuint32_t>(d.box);
    (d.which == 0 ? *slot_dim : d.which == 1 ? *head_dim : *page_dim) = i + 1;
  }
  const CUresult result =
      encode(map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 4, const_cast<void*>(pool), sizes, strides, box,
             element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  return result == CUDA_SUCCESS;
}

}  // namespace

bool encode_pool_tensor_maps(const PagedAttentionParams& p, int tile_rows, PoolTensorMaps* maps) {
  maps->log2_box_rows = 0;
  // D = 96: the second column block's box reaches past D, and TMA fills those columns with zeros.
  if (p.kv_dtype != p.q_dtype || p.head_dim % 32 != 0 || tile_rows <= 0) return false;
  // Box rows: a power of two dividing the tile's rows and the page, at most 256 (TMA's limit).
  const int tile_pow2 = tile_rows & -tile_rows;
  const int box_rows = std::min({tile_pow2, 1 << std::min(p.log2_page_size, 8), 256});
  if (box_rows < kMinPoolBoxRows) return false;
  if (reinterpret_cast<uintptr_t>(p.k_cache) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.v_cache) % 16 != 0)
    return false;
  const EncodeTiled encode = encode_tiled();
  if (encode == nullptr) return false;
  int k_slot = 0, k_head = 0, k_page = 0, v_slot = 0, v_head = 0, v_page = 0;
  if (!encode_pool(encode, p.k_cache, p.k_stride_slot, p.k_stride_head, p.k_stride_page, p,
                   box_rows, &maps->k, &k_slot, &k_head, &k_page) ||
      !encode_pool(encode, p.v_cache, p.v_stride_slot, p.v_stride_head, p.v_stride_page, p,
                   box_rows, &maps->v, &v_slot, &v_head, &v_page))
    return false;
  // One coordinate order serves both maps' boxes.
  if (k_slot != v_slot || k_head != v_head || k_page != v_page) return false;
  maps->slot_dim = k_slot;
  maps->head_dim = k_head;
  maps->page_dim = k_page;
  int log2 = 0;
  while ((1 << log2) < box_rows) ++log2;
  maps->log2_box_rows = log2;
  return true;
}

}  // namespace astr::kernels
