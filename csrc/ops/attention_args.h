// The attention op's argument list, and one call's arguments as the backends receive them.
#pragma once

#include <ATen/ATen.h>

#include <optional>

#include "dispatch/call_description.h"

// Every argument of astr::attention after q, in schema order: the one list from which the
// schemas of attention, attention.lse and explain (registration.cpp), their C++ entry points
// (ops.h, attention.cpp) and AttentionArgs are generated. Adding an argument is one row here
// (csrc/README.md, "Add an argument").
//   X(name, schema type, schema default, C++ parameter type)
// Shapes: dense q [B,Lq,Hq,D], k [B,Lk,Hkv,D], v [B,Lk,Hkv,Dv], mask broadcastable to
// [B,Hq,Lq,Lk], topk_indices [B,Lq,k]; paged q [T,Hq,D], pools [P,S,Hkv,D] / [P,S,Hkv,Dv],
// mask [T,K], topk_indices [T,k], tree_mask [T, max_query_len] (which new tokens of its own
// sequence each new token sees).
#define ASTR_ATTENTION_ARGS(X)                                                                   \
  X(k, "Tensor?", "=None", const std::optional<at::Tensor>&)         /* dense only */            \
  X(v, "Tensor?", "=None", const std::optional<at::Tensor>&)         /* dense only */            \
  X(attn_mask, "Tensor?", "=None", const std::optional<at::Tensor>&) /* bool or additive */      \
  X(is_causal, "bool", "=False", bool)                                                           \
  X(scale, "float?", "=None", std::optional<double>)               /* None: 1/sqrt(D) */         \
  X(k_cache, "Tensor?", "=None", const std::optional<at::Tensor>&) /* paged calls */             \
  X(v_cache, "Tensor?", "=None", const std::optional<at::Tensor>&)                               \
  X(block_table, "Tensor?", "=None", const std::optional<at::Tensor>&)     /* int32 [B,W] */     \
  X(seq_lens, "Tensor?", "=None", const std::optional<at::Tensor>&)        /* int32 [B] */       \
  X(query_start_loc, "Tensor?", "=None", const std::optional<at::Tensor>&) /* int32 [B+1] */     \
  X(max_query_len, "int", "=0", int64_t)                                   /* a host bound */    \
  X(mode, "str?", "=None", std::optional<c10::string_view>)                /* prefill, decode */ \
  X(backend, "str?", "=None", std::optional<c10::string_view>)          /* see backend_source */ \
  X(backend_source, "int", "=0", int64_t)                               /* SelectionSource */    \
  X(window_left, "int", "=-1", int64_t)                                 /* -1: no window */      \
  X(softcap, "float?", "=None", std::optional<double>)                  /* > 0 when set */       \
  X(sinks, "Tensor?", "=None", const std::optional<at::Tensor>&)        /* float32 [Hq] */       \
  X(k_scale, "Tensor?", "=None", const std::optional<at::Tensor>&)      /* FP8: float32 [Hkv] */ \
  X(v_scale, "Tensor?", "=None", const std::optional<at::Tensor>&)      /* FP8: float32 [Hkv] */ \
  X(topk_indices, "Tensor?", "=None", const std::optional<at::Tensor>&) /* int32 [T,k] */        \
  X(tree_mask, "Tensor?", "=None", const std::optional<at::Tensor>&)    /* bool [T, max_q] */

// ", Tensor? k=None, ...": the list as schema text, to follow "Tensor q".
#define ASTR_ATTENTION_SCHEMA_ARG(name, type, default_value, cpp_type) \
  ", " type " " #name default_value
#define ASTR_ATTENTION_SCHEMA_ARGS ASTR_ATTENTION_ARGS(ASTR_ATTENTION_SCHEMA_ARG)
// ", const std::optional<at::Tensor>& k, ...": the list as C++ parameters, to follow q.
#define ASTR_ATTENTION_PARAM(name, type, default_value, cpp_type) , cpp_type name
#define ASTR_ATTENTION_PARAMS ASTR_ATTENTION_ARGS(ASTR_ATTENTION_PARAM)
// ", const std::optional<at::Tensor>&, ...": the list as C++ types (a typed dispatcher call).
#define ASTR_ATTENTION_TYPE(name, type, default_value, cpp_type) , cpp_type
#define ASTR_ATTENTION_TYPES ASTR_ATTENTION_ARGS(ASTR_ATTENTION_TYPE)
// ", k, v, ...": the parameters passed on.
#define ASTR_ATTENTION_FORWARD(name, type, default_value, cpp_type) , name
#define ASTR_ATTENTION_FORWARDED ASTR_ATTENTION_ARGS(ASTR_ATTENTION_FORWARD)

namespace astr {

struct AttentionArgs {
  AttentionArgs(const at::Tensor& q ASTR_ATTENTION_PARAMS, bool return_lse);

  const at::Tensor& q;
#define ASTR_ATTENTION_MEMBER(name, type, default_value, cpp_type) cpp_type name;
  ASTR_ATTENTION_ARGS(ASTR_ATTENTION_MEMBER)
#undef ASTR_ATTENTION_MEMBER
  bool return_lse;           // attention.lse: also return each row's log-sum-exp
  dispatch::Mode call_mode;  // `mode` parsed

  bool paged() const { return k_cache.has_value(); }
  // The softcap as the kernels take it: 0 when off.
  double softcap_value() const { return softcap.value_or(0.0); }
  bool decode() const { return paged() && call_mode == dispatch::Mode::kDecode; }
  int64_t head_dim() const { return q.size(-1); }
  double resolved_scale() const;
};

// Parses `mode` ("prefill", "decode" or None) naming the argument on error.
dispatch::Mode parse_mode(std::optional<c10::string_view> mode);

// Checks shapes, dtypes and devices (and, for CPU tensors, the paged metadata's values) with
// errors that name the argument; then describes the call for the resolver.
dispatch::CallDescription validate_and_describe(const AttentionArgs& args);

// The variants' arguments and the FP8 cache's scales (validate_and_describe checks them too), and
// that `backend` implements every variant asked for (NotImplementedError naming the argument):
// for the backends' own ops, which direct calls reach without the resolver.
void validate_variant_args(const AttentionArgs& args, dispatch::Backend backend);

// The resolver's description from q alone (check_backend): kv heads assumed equal to q heads
// unless a cache says otherwise, v's head dim equal to q's unless v_cache says otherwise.
dispatch::CallDescription describe_form(const at::Tensor& q,
                                        const std::optional<at::Tensor>& k_cache,
                                        const std::optional<at::Tensor>& attn_mask, bool is_causal,
                                        dispatch::Mode mode,
                                        const std::optional<at::Tensor>& v_cache = std::nullopt);

}  // namespace astr
