// The latent attention op's argument list (astr::mla_attention), and one call's arguments as its
// backends receive them.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "dispatch/call_description.h"

// Every argument of astr::mla_attention after q_nope, in schema order: the one list from which
// the schemas of mla_attention, mla_attention.lse, explain_mla and cuda_mla_attention
// (registration.cpp), their C++ entry points (ops.h, mla_attention.cpp), MlaAttentionArgs and the
// resolver's call into the cuda op are generated. The names and their order up to `backend` are a
// contract with clients outside this repository (issue 50): new arguments go at the end, with a
// default.
//   X(name, schema type, schema default, C++ parameter type)
// Shapes: q_nope [T,H,Dc] (the query times the absorbed key up-projection), q_rope [T,H,Dr];
// ckv_cache [P,S,Dc] (one latent per token, shared by every head), krope_cache [P,S,Dr];
// metadata as astr::attention's paged calls. DeepSeek-family models: Dc = 512, Dr = 64.
#define ASTR_MLA_ATTENTION_ARGS(X)                                                            \
  X(q_rope, "Tensor", "", const at::Tensor&)          /* [T,H,Dr], q_nope's dtype */          \
  X(ckv_cache, "Tensor", "", const at::Tensor&)       /* [P,S,Dc]: q's dtype or e4m3 */       \
  X(krope_cache, "Tensor", "", const at::Tensor&)     /* [P,S,Dr]: q's dtype */               \
  X(block_table, "Tensor", "", const at::Tensor&)     /* int32 [B,W] */                       \
  X(seq_lens, "Tensor", "", const at::Tensor&)        /* int32 [B], cached + new */           \
  X(query_start_loc, "Tensor", "", const at::Tensor&) /* int32 [B+1] */                       \
  X(max_query_len, "int", "", int64_t)                /* a host bound */                      \
  X(mode, "str", "", c10::string_view)                /* "prefill" or "decode" */             \
  X(scale, "float", "", double)                       /* the softmax scale (yarn mscale) */   \
  X(is_causal, "bool", "=True", bool)                                                         \
  X(backend, "str?", "=None", std::optional<c10::string_view>)       /* see backend_source */ \
  X(backend_source, "int", "=0", int64_t)                            /* SelectionSource */    \
  X(ckv_scale, "Tensor?", "=None", const std::optional<at::Tensor>&) /* FP8: float32 [1] */

// The list as schema text, C++ parameters, C++ types and forwarded names (attention_args.h has
// the per-row macros: ASTR_ATTENTION_SCHEMA_ARG, ...).
#define ASTR_MLA_SCHEMA_ARG(name, type, default_value, cpp_type) ", " type " " #name default_value
#define ASTR_MLA_ATTENTION_SCHEMA_ARGS ASTR_MLA_ATTENTION_ARGS(ASTR_MLA_SCHEMA_ARG)
#define ASTR_MLA_PARAM(name, type, default_value, cpp_type) , cpp_type name
#define ASTR_MLA_ATTENTION_PARAMS ASTR_MLA_ATTENTION_ARGS(ASTR_MLA_PARAM)
#define ASTR_MLA_TYPE(name, type, default_value, cpp_type) , cpp_type
#define ASTR_MLA_ATTENTION_TYPES ASTR_MLA_ATTENTION_ARGS(ASTR_MLA_TYPE)
#define ASTR_MLA_FORWARD(name, type, default_value, cpp_type) , name
#define ASTR_MLA_ATTENTION_FORWARDED ASTR_MLA_ATTENTION_ARGS(ASTR_MLA_FORWARD)

namespace astr {

struct MlaAttentionArgs {
  MlaAttentionArgs(const at::Tensor& q_nope ASTR_MLA_ATTENTION_PARAMS, bool return_lse);

  const at::Tensor& q_nope;
#define ASTR_MLA_MEMBER(name, type, default_value, cpp_type) cpp_type name;
  ASTR_MLA_ATTENTION_ARGS(ASTR_MLA_MEMBER)
#undef ASTR_MLA_MEMBER
  bool return_lse;           // mla_attention.lse: also return each row's log-sum-exp
  dispatch::Mode call_mode;  // `mode` parsed: kPrefill or kDecode

  bool decode() const { return call_mode == dispatch::Mode::kDecode; }
  bool fp8() const { return ckv_scale.has_value(); }
  int64_t latent_dim() const { return q_nope.size(-1); }  // Dc
  int64_t rope_dim() const { return q_rope.size(-1); }    // Dr
};

// Checks shapes, dtypes and devices (and, on the CPU or in the checked mode, the metadata's
// values and the scale's) with errors that name the argument; then describes the call for the
// resolver: q/k head dim Dc + Dr, v head dim Dc, one kv head, `latent` set.
dispatch::CallDescription validate_and_describe_mla(const MlaAttentionArgs& args);

}  // namespace astr
