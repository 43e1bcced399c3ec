// Every host entry point of the astr library. Schemas: registration.cpp (the only place that
// defines them). Shapes: T new query tokens, B sequences, Hq/Hkv heads, D head dim,
// P pages, S page size, W block-table width.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <string>
#include <tuple>

#include "ops/attention_args.h"
#include "ops/mla_attention_args.h"

namespace astr {

// The one entry point: resolves a backend (csrc/dispatch) and runs it. CompositeImplicitAutograd.
// Its arguments after q are the one list ASTR_ATTENTION_ARGS (attention_args.h).
at::Tensor attention(
    const at::Tensor& q ASTR_ATTENTION_PARAMS);  // dense [B,Lq,Hq,D] | paged [T,Hq,D]

// attention, also returning lse (float32, out's shape without its last dim: the natural log of
// each row's softmax denominator, sink included). return_lse must be true.
std::tuple<at::Tensor, at::Tensor> attention_with_lse(const at::Tensor& q ASTR_ATTENTION_PARAMS,
                                                      bool return_lse);

// The resolver's decision for the same arguments, as JSON text, without running anything.
std::string explain(const at::Tensor& q ASTR_ATTENTION_PARAMS, bool return_lse);

// Merges two partial attentions over disjoint key sets: out [..., D] and lse [...] (float32,
// natural log) each; lse -inf marks a row that saw nothing. Returns (out, lse) of the union.
std::tuple<at::Tensor, at::Tensor> merge_states(const at::Tensor& out_a, const at::Tensor& lse_a,
                                                const at::Tensor& out_b, const at::Tensor& lse_b);

// Inserted by `attention` into graphs that torch.compile traces when the choice was implicit:
// at run time, raises if the thread's context or ASTR_BACKEND (`selected_backend`) differs from
// (backend, backend_source), what the graph was traced under. Direct torch.ops.astr.attention
// calls are not guarded by torch.compile (the Python API's are: it recompiles), so a stale graph
// must not run.
void check_trace_state(const at::Tensor& q, c10::string_view backend, int64_t backend_source);

// Reasons `backend` cannot run a call of this form ("" when it can), one per line.
// `placement` adds the built/installed, device and arch rules.
std::string check_backend(c10::string_view backend, const at::Tensor& q,
                          const std::optional<at::Tensor>& k_cache,  // [P,S,Hkv,D]
                          const std::optional<at::Tensor>& attn_mask, bool is_causal,
                          std::optional<c10::string_view> mode, bool placement,
                          const std::optional<at::Tensor>& v_cache);  // [P,S,Hkv,Dv]

// Writes k/v [T,Hkv,D] into the pools [P,S,Hkv,D] at slot_mapping [T] (int32, page*S+offset;
// negative: skip). CPU kernel here; CUDA kernel in csrc/backends/append_kv_cuda.cu.
void append_kv_cpu(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                   at::Tensor& v_cache, const at::Tensor& slot_mapping,
                   const std::optional<at::Tensor>& k_scale,  // FP8 pools: float32 [Hkv]
                   const std::optional<at::Tensor>& v_scale);
// The Meta kernel: the same checks (csrc/backends/append_kv_checks.h), nothing written. Fake
// tensors run it while torch.compile traces.
void append_kv_meta(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                    at::Tensor& v_cache, const at::Tensor& slot_mapping,
                    const std::optional<at::Tensor>& k_scale,
                    const std::optional<at::Tensor>& v_scale);

// The Autograd kernel (ops/append_kv_autograd.cpp): runs the device kernel below autograd, so k/v
// that require grad are written as values and the pools never record history.
void append_kv_autograd(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache,
                        at::Tensor& v_cache, const at::Tensor& slot_mapping,
                        const std::optional<at::Tensor>& k_scale,
                        const std::optional<at::Tensor>& v_scale);

// Override stack, environment and status: the Python API's handles on csrc/dispatch.
int64_t push_backend(c10::string_view name);  // -> the entry's id, for pop_backend
void pop_backend(std::optional<int64_t> id);  // that entry, wherever it is; None: the top
// What a call without backend= would select now: (name, SelectionSource) with the source
// context, environment or default (name "").
std::tuple<std::string, int64_t> selected_backend();
void set_backend_status(c10::string_view backend, bool available, c10::string_view reason,
                        int64_t version);
std::string backend_status(c10::string_view backend);  // JSON {available, reason, version}
std::string build_info();  // JSON: torch version, CUDA, archs, what the kernels were built for

// The cuda backend's kernel tuning (csrc/kernels/paged_attention/plan.h: KernelTuning) and the
// checked mode for paged metadata (csrc/backends/cuda_paged_attention.cu).
void set_kernel_tuning(c10::string_view tuning);
std::string kernel_tuning();
void set_metadata_checks(bool enabled);
bool metadata_checks();
// Batch-invariant mode (csrc/support/kernel_settings.h): a sequence's rows of a paged call do not
// depend on the batch around it.
void set_batch_invariant(bool enabled);
bool batch_invariant();

// Latent attention (DeepSeek-family MLA) over a paged latent cache: the query already multiplied
// by the absorbed key up-projection, q_nope [T,H,Dc] and q_rope [T,H,Dr], attends over one latent
// ckv [Dc] and one rotary key krope [Dr] per cached token, shared by every head; returns
// out [T,H,Dc] (the caller applies the value up-projection). Arguments after q_nope: the one list
// ASTR_MLA_ATTENTION_ARGS (mla_attention_args.h). Resolves a backend like attention.
at::Tensor mla_attention(const at::Tensor& q_nope ASTR_MLA_ATTENTION_PARAMS);
// mla_attention, also returning lse [T,H] (float32, natural log). return_lse must be true.
std::tuple<at::Tensor, at::Tensor> mla_attention_with_lse(
    const at::Tensor& q_nope ASTR_MLA_ATTENTION_PARAMS, bool return_lse);
// The resolver's decision for the same arguments, as JSON text, without running anything.
std::string explain_mla(const at::Tensor& q_nope ASTR_MLA_ATTENTION_PARAMS, bool return_lse);

// Writes ckv [T,Dc] and krope [T,Dr] into the pools ckv_cache [P,S,Dc] and krope_cache [P,S,Dr]
// at slot_mapping [T] (int32, page*S+offset; negative: skip); an FP8 (e4m3) ckv_cache stores
// fp8(clamp(ckv / ckv_scale)) with ckv_scale float32 [1]. CPU kernel here (append_mla.cpp), CUDA
// kernel in ops/append_mla_cuda.cu; the Meta kernel checks only; the Autograd kernel writes
// below autograd.
void append_mla_cpu(const at::Tensor& ckv, const at::Tensor& krope, at::Tensor& ckv_cache,
                    at::Tensor& krope_cache, const at::Tensor& slot_mapping,
                    const std::optional<at::Tensor>& ckv_scale);
void append_mla_meta(const at::Tensor& ckv, const at::Tensor& krope, at::Tensor& ckv_cache,
                     at::Tensor& krope_cache, const at::Tensor& slot_mapping,
                     const std::optional<at::Tensor>& ckv_scale);
void append_mla_autograd(const at::Tensor& ckv, const at::Tensor& krope, at::Tensor& ckv_cache,
                         at::Tensor& krope_cache, const at::Tensor& slot_mapping,
                         const std::optional<at::Tensor>& ckv_scale);

}  // namespace astr
