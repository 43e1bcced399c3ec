// What the ops that ask the resolver for a backend share (attention.cpp, mla_attention.cpp).
#pragma once

#include <ATen/ATen.h>

#include "dispatch/resolver.h"

namespace astr {

// An implicit choice that skipped a backend which is present: warns once per distinct reason,
// through Python's warnings, naming `op` ("astr.attention").
void report_fallback(const char* op, const dispatch::Decision& decision,
                     const dispatch::CallDescription& call);

// True while torch.compile traces: `t` is a fake or functional tensor.
bool is_traced(const at::Tensor& t);

// Records astr::check_trace_state(q, <the selection seen now>) in the graph being traced: a
// choice the caller did not pass is read at trace time, and the graph checks it at run time.
void record_trace_state(const at::Tensor& q);

}  // namespace astr
