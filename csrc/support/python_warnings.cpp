// The one file that calls the Python C API (limited API, as python_module.cpp): the library is
// only ever loaded into a Python process (torch.ops.load_library).
#include "support/python_warnings.h"

#include <Python.h>
#include <c10/util/Exception.h>

#include "support/check.h"

namespace astr {

namespace {

// astrai.extension.warning.warn (a new reference, kept), or null where that module cannot be
// imported (the library loaded without its package): then a plain UserWarning. The GIL is held.
PyObject* astrai_warn_function() {
  static PyObject* function = nullptr;
  if (function != nullptr) return function;
  PyObject* module = PyImport_ImportModule("astrai.extension.warning");
  if (module != nullptr) {
    function = PyObject_GetAttrString(module, "warn");
    Py_DECREF(module);
  }
  if (function == nullptr) PyErr_Clear();  // tried again at the next warning
  return function;
}

// Issues the warning; false when it raised (a filter made it an error). The GIL is held.
bool issue_warning(const std::string& message) {
  PyObject* warn = astrai_warn_function();
  if (warn == nullptr) return PyErr_WarnEx(PyExc_UserWarning, message.c_str(), 1) == 0;
  PyObject* text =
      PyUnicode_DecodeUTF8(message.data(), static_cast<Py_ssize_t>(message.size()), "replace");
  if (text == nullptr) return false;
  PyObject* result = PyObject_CallFunctionObjArgs(warn, text, nullptr);
  Py_DECREF(text);
  Py_XDECREF(result);
  return result != nullptr;
}

}  // namespace

void warn_in_python(const std::string& message) {
  if (!Py_IsInitialized()) {
    TORCH_WARN(message);
    return;
  }
  const PyGILState_STATE gil = PyGILState_Ensure();
  const bool raised = !issue_warning(message);
  if (raised) PyErr_Clear();
  PyGILState_Release(gil);
  ASTR_CHECK(!raised, "AstraiWarning (an error under the active warnings filter): ", message);
}

}  // namespace astr
