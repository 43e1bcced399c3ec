// Warnings that reach Python's `warnings` module, so that warnings.catch_warnings and -W filters
// see them: c10's warnings (TORCH_WARN) raised inside a torch.ops call never reach it (they are
// printed to stderr).
#pragma once

#include <string>

namespace astr {

// An astrai.extension.AstraiWarning (a UserWarning), attributed to the caller's line: the nearest
// Python frame outside astrai and torch (astrai/extension/warning.py). Without a Python
// interpreter, a c10 warning. Where a filter turns the warning into an error, throws c10::Error
// with the same text (a Python exception cannot cross the dispatcher): a caller that warns once
// marks the warning as given only after this returns. Call it with no lock held: it may wait for
// the GIL.
void warn_in_python(const std::string& message);

}  // namespace astr
