// All astr schemas, in one place. Each def is followed by its implementation registrations;
// the CUDA kernels register under the CUDA key in csrc/backends/*.cu, fakes live in
// astrai/extension/ops.py.
#include <torch/library.h>

#include "ops/ops.h"

TORCH_LIBRARY(astr, m) {
  // Attention over dense q/k/v or a paged KV cache; picks the backend (see csrc/dispatch). Its
  // arguments after q are one list, ASTR_ATTENTION_ARGS (attention_args.h).
  m.def("attention(Tensor q" ASTR_ATTENTION_SCHEMA_ARGS ") -> Tensor");
  m.impl("attention", c10::DispatchKey::CompositeImplicitAutograd, TORCH_FN(astr::attention));
  // The same, also returning each row's log-sum-exp: attention(..., return_lse=...) resolves to
  // this overload; with return_lse=False no LSE is computed and the second tensor is empty.
  m.def("attention.lse(Tensor q" ASTR_ATTENTION_SCHEMA_ARGS
        ", *, bool return_lse) -> (Tensor, Tensor)");
  m.impl("attention.lse", c10::DispatchKey::CompositeImplicitAutograd,
         TORCH_FN(astr::attention_with_lse));

  // Combines two partial attentions over disjoint key sets exactly, through their log-sum-exps.
  m.def("merge_states(Tensor out_a, Tensor lse_a, Tensor out_b, Tensor lse_b) -> (Tensor, Tensor)");
  m.impl("merge_states", c10::DispatchKey::CompositeImplicitAutograd, TORCH_FN(astr::merge_states));

  // Writes new tokens' k/v into the paged pools through the slot mapping (mutates both pools);
  // into FP8 pools as fp8(clamp(x / scale)) with the per-kv-head scales.
  m.def(
      "append_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
      "Tensor slot_mapping, Tensor? k_scale=None, Tensor? v_scale=None) -> ()");
  m.impl("append_kv", c10::DispatchKey::CPU, TORCH_FN(astr::append_kv_cpu));
  // Meta (and fake tensors): checks only. A real tensor mixed with meta ones dispatches here too,
  // and is refused instead of returning with nothing written.
  m.impl("append_kv", c10::DispatchKey::Meta, TORCH_FN(astr::append_kv_meta));
  // Autograd (every device): the write runs below autograd, so a cache never holds a graph.
  m.impl("append_kv", c10::DispatchKey::Autograd, TORCH_FN(astr::append_kv_autograd));

  // The cuda backend: our paged prefill/decode kernels (CUDA key only; csrc/backends/cuda), over
  // attention's arguments (paged calls; backend and backend_source are ignored). Returns
  // (out, lse): lse [T, Hq] float32 when return_lse, else an empty tensor.
  m.def("cuda_paged_attention(Tensor q" ASTR_ATTENTION_SCHEMA_ARGS
        ", *, bool return_lse=False) -> (Tensor, Tensor)");
  // Which kernel form the cuda backend's plan picks for such a call ("decode/split x13",
  // "prefill/warp_specialized"), computing the plan only (CUDA key): what the "astrai" logger
  // and the profiler ranges name (astrai/extension/visibility.py).
  m.def("cuda_paged_plan(Tensor q" ASTR_ATTENTION_SCHEMA_ARGS ") -> str");
  // The kernel tuning string (csrc/kernels/paged_attention/plan.h: KernelTuning), "" = automatic.
  m.def("set_kernel_tuning(str tuning) -> ()", &astr::set_kernel_tuning);
  m.def("kernel_tuning() -> str", &astr::kernel_tuning);
  // Checked mode: validate paged metadata on every call (a host synchronisation; off by default,
  // on with ASTR_CHECK_METADATA=1).
  m.def("set_metadata_checks(bool enabled) -> ()", &astr::set_metadata_checks);
  m.def("metadata_checks() -> bool", &astr::metadata_checks);
  // Batch-invariant mode: a sequence's rows of a paged call are the same bits whatever the batch
  // around it (on with ASTR_BATCH_INVARIANT=1).
  m.def("set_batch_invariant(bool enabled) -> ()", &astr::set_batch_invariant);
  m.def("batch_invariant() -> bool", &astr::batch_invariant);

  // The flash backend's entry points. Their kernels are registered from Python by the flash
  // probe (astrai/extension/backend/flash_ops.py), wrapping the flash-attn package's own API,
  // so the resolver reaches the package through the dispatcher.
  // Both return (out, lse); lse is empty unless return_lse. window_left -1 and softcap 0: off.
  m.def(
      "flash_dense(Tensor q, Tensor k, Tensor v, bool is_causal, float scale, "
      "int window_left=-1, float softcap=0.0, bool return_lse=False) -> (Tensor, Tensor)");
  m.def(
      "flash_paged(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
      "Tensor query_start_loc, int max_query_len, bool decode, bool is_causal, float scale, "
      "int window_left=-1, float softcap=0.0, bool return_lse=False) -> (Tensor, Tensor)");
  // Gradients of flash_dense, for packages whose Python functions are not torch ops
  // (FlashAttention-4): flash_dense's autograd formula calls it.
  m.def(
      "flash_dense_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, bool is_causal, "
      "float scale, int window_left=-1, float softcap=0.0) -> (Tensor, Tensor, Tensor)");

  // Recorded in compiled graphs by attention (implicit choices): raises at run time if the
  // context or ASTR_BACKEND differs from the one the graph was traced under. Side-effectful
  // (astrai/extension/ops.py tells torch.fx so), never decomposed.
  m.def("check_trace_state(Tensor q, str backend, int backend_source) -> ()");
  m.impl("check_trace_state", c10::DispatchKey::CompositeExplicitAutograd,
         TORCH_FN(astr::check_trace_state));

  // The resolver's decision for a call, as JSON, without running it.
  m.def("explain(Tensor q" ASTR_ATTENTION_SCHEMA_ARGS ", *, bool return_lse=False) -> str",
        &astr::explain);

  // Why a backend cannot run a call of this form ("" when it can).
  m.def(
      "check_backend(str backend, Tensor q, Tensor? k_cache, Tensor? attn_mask, bool is_causal, "
      "str? mode, bool placement, Tensor? v_cache=None) -> str",
      &astr::check_backend);

  // Latent attention (DeepSeek-family MLA) over a paged latent cache; picks the backend like
  // attention. Its arguments after q_nope are one list, ASTR_MLA_ATTENTION_ARGS
  // (mla_attention_args.h); mla_attention(..., return_lse=True) resolves to the .lse overload.
  m.def("mla_attention(Tensor q_nope" ASTR_MLA_ATTENTION_SCHEMA_ARGS ") -> Tensor");
  m.impl("mla_attention", c10::DispatchKey::CompositeImplicitAutograd,
         TORCH_FN(astr::mla_attention));
  m.def("mla_attention.lse(Tensor q_nope" ASTR_MLA_ATTENTION_SCHEMA_ARGS
        ", *, bool return_lse) -> (Tensor, Tensor)");
  m.impl("mla_attention.lse", c10::DispatchKey::CompositeImplicitAutograd,
         TORCH_FN(astr::mla_attention_with_lse));
  // The resolver's decision for a latent attention call, as JSON, without running it.
  m.def("explain_mla(Tensor q_nope" ASTR_MLA_ATTENTION_SCHEMA_ARGS
        ", *, bool return_lse=False) -> str",
        &astr::explain_mla);
  // Writes new tokens' latents and rotary keys into the latent pools through the slot mapping
  // (mutates both pools); an FP8 latent pool stores fp8(clamp(ckv / ckv_scale)).
  m.def(
      "append_mla(Tensor ckv, Tensor krope, Tensor(a!) ckv_cache, Tensor(b!) krope_cache, "
      "Tensor slot_mapping, Tensor? ckv_scale=None) -> ()");
  m.impl("append_mla", c10::DispatchKey::CPU, TORCH_FN(astr::append_mla_cpu));
  m.impl("append_mla", c10::DispatchKey::Meta, TORCH_FN(astr::append_mla_meta));
  m.impl("append_mla", c10::DispatchKey::Autograd, TORCH_FN(astr::append_mla_autograd));
  // The cuda backend's latent attention kernels (CUDA key only; backends/cuda/mla_attention.cu),
  // over mla_attention's arguments (backend and backend_source are ignored). Returns (out, lse):
  // lse [T, H] float32 when return_lse, else an empty tensor.
  m.def("cuda_mla_attention(Tensor q_nope" ASTR_MLA_ATTENTION_SCHEMA_ARGS
        ", *, bool return_lse=False) -> (Tensor, Tensor)");
  // Which kernel the cuda backend's plan picks for such a call ("tensor_core/split x4",
  // "tensor_core", "simple"), computing the plan only (CUDA key).
  m.def("cuda_mla_plan(Tensor q_nope" ASTR_MLA_ATTENTION_SCHEMA_ARGS ") -> str");

  // Thread-local override stack, pushed/popped by attn_backend(...) in Python. A push returns its
  // entry's id; a pop with that id removes that entry wherever it is (None: the top).
  m.def("push_backend(str name) -> int", &astr::push_backend);
  m.def("pop_backend(int? id=None) -> ()", &astr::pop_backend);
  // What a call without backend= selects now (context, then ASTR_BACKEND, else default), as
  // (name, SelectionSource: 2 context, 3 environment, 4 default).
  m.def("selected_backend() -> (str, int)", &astr::selected_backend);
  // Process-wide availability of a backend (the flash probe writes it) and its reading.
  m.def("set_backend_status(str backend, bool available, str reason, int version) -> ()",
        &astr::set_backend_status);
  m.def("backend_status(str backend) -> str", &astr::backend_status);
  // How this library was built (torch version, CUDA, archs), as JSON.
  m.def("build_info() -> str", &astr::build_info);
}
