// The one file that calls the Python C API (limited API, as python_module.cpp): the library is
// only ever loaded into a Python process (torch.ops.load_library).
#include "support/python_warnings.h"

#include <Python.h>
#include <c10/util/Exception.h>

#include "support/check.h"

namespace astr {

void warn_in_python(const std::string& message) {
  if (!Py_IsInitialized()) {
    TORCH_WARN(message);
    return;
  }
  const PyGILState_STATE gil = PyGILState_Ensure();
  const bool raised = PyErr_WarnEx(PyExc_UserWarning, message.c_str(), 1) != 0;
  if (raised) PyErr_Clear();
  PyGILState_Release(gil);
  ASTR_CHECK(!raised, "UserWarning (an error under the active warnings filter): ", message);
}

}  // namespace astr
