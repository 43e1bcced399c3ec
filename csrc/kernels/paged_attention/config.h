// The one list of what the paged-attention kernels are built for. Everything else derives from it:
//   - the resolver's capability rules (csrc/dispatch/capability.cpp: head dims, dtypes, kv dtypes);
//   - the template dispatch (launch.cu: dispatch_head_dim, dispatch_types);
//   - the build's instantiation files (scripts/generate_instantiations.py reads the table rows and
//     the type lists below, one .cu per family, head dim, q dtype and kv dtype);
//   - the `info` capability table (build_info.cpp reports what was built).
// Plain C++ (no CUDA): the resolver and GoogleTest include it. Adding a head dim or a KV-cache
// dtype: csrc/README.md.
#pragma once

#include <cstddef>
#include <string>
#include <type_traits>
#include <utility>

namespace astr::kernels {

// Head dims with kernels, and which optional forms each one compiles. A row is a pair: q and k's
// head dim, and v's (and the output's), equal but for DeepSeek's MHA form (192, 128). A v head
// dim above 256 (Gemma 4's global layers, 512) is split into column chunks of 256 that separate
// blocks accumulate: each computes the full q . k scores and the same softmax statistics, and
// writes its own output columns (traits.h, kVChunks). Every head dim has the
// decode (blocks of 4 warps, splits merged by the merge kernel or in a thread-block cluster) and
// the mma.sync prefill; the forms measured to pay at D = 128 are compiled there only, and the
// top-k kernels where the row says so:
//   decode_block_pairs   2 splits as one block of two groups of warps (traits.h, kGroups)
//   decode_eight_warps   1 split as one block of 8 warps per SM (traits.h, kWarps)
//   decode_persistent    one block per SM taking items in turn (decode_persistent_kernel.cuh)
//   prefill_wgmma        prefill on Hopper's warpgroup multiply, every warp loading and
//                        multiplying (prefill_wgmma_kernel.cuh; sm_90a builds; head dims of
//                        whole 32-element halves of column blocks)
//   prefill_warp_specialized  the warp-specialised prefill on wgmma: a producer warpgroup, two
//                        consumers taking turns (prefill_warp_specialized_kernel.cuh; sm_90a
//                        builds; head dims of whole 32-element halves of column blocks)
//   prefill_persistent   the warp-specialised prefill as one block per SM looping over items
//                        handed out longest first (prefill_persistent_kernel.cuh,
//                        prefill_tile_scheduler.h; sm_90a builds): opt-in (prefill_kernel=
//                        persistent) until a GPU has measured it
//   topk                 the sparse top-k kernels (topk_attention_kernel.cuh: the decode's
//                        4-warp block, a block per chunk of v's columns as in the decode)
// Where both prefills on wgmma could run, each head dim compiles the one measured faster
// (benchmarks/results/decisions.md, "Prefill: which kernel runs"): the plan runs the compiled one.
struct HeadDimForms {
  int head_dim;    // q and k
  int head_dim_v;  // v and the output
  bool decode_block_pairs;
  bool decode_eight_warps;
  bool decode_persistent;
  bool prefill_wgmma;
  bool prefill_warp_specialized;
  bool prefill_persistent;
  bool topk;
};

// clang-format off
// generate_instantiations.py parses the rows between the two markers: keep one row per line.
inline constexpr HeadDimForms kPagedHeadDims[] = {
    // BEGIN HEAD DIMS
    {64,  64,  false, false, false, false, true,  true,  true},
    {96,  96,  false, false, false, false, true,  true,  true},
    {128, 128, true,  true,  true,  true,  true,  true,  true},
    {192, 128, false, false, false, false, false, false, true},
    {256, 256, false, false, false, false, true,  true,  true},
    {512, 512, false, false, false, false, false, false, true},
    // END HEAD DIMS
};
// clang-format on
inline constexpr size_t kNumPagedHeadDims = sizeof(kPagedHeadDims) / sizeof(kPagedHeadDims[0]);

// q and output element types (16-bit floats; the mma.sync / wgmma operand types).
//   X(ScalarType enumerator, CUDA type, torch name)
#define ASTR_PAGED_Q_TYPES(X)             \
  X(kBFloat16, __nv_bfloat16, "bfloat16") \
  X(kFloat16, __half, "float16")

// KV-cache element kinds: X(enumerator, storage type or Q for q's own, file-name part). An FP8
// cache (e4m3 or e5m2, told apart at run time) is one byte per element; the decode forms read it
// and dequantize in registers (tile_math.cuh), and so can the mma.sync prefill; the wgmma prefill
// converts its tiles in shared memory (prefill_wgmma_kernel.cuh). plan.h says when a prefill
// reads the bytes rather than pages the binding has dequantized first
// (csrc/backends/cuda/paged_attention.cu). The other families (the persistent decode, the
// warp-specialised prefills) are built for q's own type only: the plan keeps FP8 decodes off the
// persistent form, and FP8 prefills reading the bytes off the warp-specialised ones.
#define ASTR_PAGED_KV_KINDS(X) X(kSameAsQ, Q, same) X(kFp8, uint8_t, fp8)

// The development build (ASTR_HEAD_DIM=128 at build time: setup.py defines ASTR_ONLY_HEAD_DIM)
// compiles the rows of one q/k head dim; everything that reads the list asks through
// paged_head_dim_built.
constexpr bool paged_head_dim_built(int head_dim) {
#if defined(ASTR_ONLY_HEAD_DIM)
  return head_dim == ASTR_ONLY_HEAD_DIM;
#else
  (void)head_dim;
  return true;
#endif
}

// The row of a built (q/k, v) head-dim pair, or null. head_dim_v 0: equal to head_dim.
constexpr const HeadDimForms* paged_head_dim_forms(int head_dim, int head_dim_v = 0) {
  if (head_dim_v == 0) head_dim_v = head_dim;
  for (const HeadDimForms& forms : kPagedHeadDims)
    if (forms.head_dim == head_dim && forms.head_dim_v == head_dim_v &&
        paged_head_dim_built(head_dim))
      return &forms;
  return nullptr;
}

// Calls f(std::integral_constant<int, D>{}, std::integral_constant<int, DV>{}) for the built row
// (D, DV) == (head_dim, head_dim_v), both compile-time constants (the template dispatch over the
// list); false when none matches.
template <size_t I = 0, typename F>
bool for_head_dim(int head_dim, int head_dim_v, F&& f) {
  if constexpr (I == kNumPagedHeadDims) {
    (void)head_dim;
    (void)head_dim_v;
    (void)f;
    return false;
  } else {
    constexpr int D = kPagedHeadDims[I].head_dim;
    constexpr int DV = kPagedHeadDims[I].head_dim_v;
    if constexpr (paged_head_dim_built(D)) {
      if (head_dim == D && head_dim_v == DV) {
        f(std::integral_constant<int, D>{}, std::integral_constant<int, DV>{});
        return true;
      }
    }
    return for_head_dim<I + 1>(head_dim, head_dim_v, std::forward<F>(f));
  }
}

// The least compute capability (major * 10 + minor) a row's kernels run on: q/k rows above 256
// elements (512) take a decode block of 216 KB of shared memory (traits.h), which sm_90's 227 KB
// per block holds and sm_80's 163 KB does not.
constexpr int paged_head_dim_min_arch(const HeadDimForms& forms) {
  return forms.head_dim > 256 ? 90 : 80;
}

// A row as text: "128", or "192/128" where v's head dim differs. (Appends only: GCC 12 at -O3
// warns, falsely, of overlapping copies in `"/" + std::to_string(...)`.)
inline std::string paged_head_dim_text(const HeadDimForms& forms) {
  std::string text = std::to_string(forms.head_dim);
  if (forms.head_dim_v != forms.head_dim) {
    text += '/';
    text += std::to_string(forms.head_dim_v);
  }
  return text;
}

// "64, 96, 128, 192/128, 256, 512": the built rows (q/k head dim, "/v" where v's differs), for
// messages and build_info.
inline std::string paged_head_dims_text() {
  std::string text;
  for (const HeadDimForms& forms : kPagedHeadDims) {
    if (!paged_head_dim_built(forms.head_dim)) continue;
    if (!text.empty()) text += ", ";
    text += paged_head_dim_text(forms);
  }
  return text;
}

// "unsupported head_dim 80 (supported: ...)"; with a v head dim of its own, "unsupported head_dim
// 192 with v head_dim 96 (supported: ...)".
inline std::string unsupported_head_dim_message(int head_dim, int head_dim_v = 0) {
  std::string text = "unsupported head_dim " + std::to_string(head_dim);
  if (head_dim_v != 0 && head_dim_v != head_dim)
    text += " with v head_dim " + std::to_string(head_dim_v);
  return text + " (supported: " + paged_head_dims_text() + ")";
}

// Why a row without the top-k kernels refuses topk_indices: "topk_indices: the cuda top-k kernels
// take head dims 64, 96, 128, 192/128, 256 (got 512)".
inline std::string topk_head_dim_message(const HeadDimForms& forms) {
  std::string text = "topk_indices: the cuda top-k kernels take head dims ";
  bool first = true;
  for (const HeadDimForms& row : kPagedHeadDims) {
    if (!row.topk || !paged_head_dim_built(row.head_dim)) continue;
    if (!first) text += ", ";
    text += paged_head_dim_text(row);
    first = false;
  }
  text += " (got ";
  text += paged_head_dim_text(forms);
  text += ')';
  return text;
}

}  // namespace astr::kernels
