// Warnings that reach Python's `warnings` module, so that warnings.catch_warnings and -W filters
// see them: c10's warnings (TORCH_WARN) raised inside a torch.ops call never reach it (they are
// printed to stderr).
#pragma once

#include <string>

namespace astr {

// A UserWarning, attributed to the Python code that made the call. Without a Python interpreter,
// a c10 warning. Where a filter turns the warning into an error, throws c10::Error with the same
// text (a Python exception cannot cross the dispatcher). Call it with no lock held: it may wait
// for the GIL.
void warn_in_python(const std::string& message);

}  // namespace astr
