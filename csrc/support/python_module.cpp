// An empty Python module so that `import astrai._C` works where a loader insists; the ops are
// registered by loading the library (torch.ops.load_library), not through Python bindings.
#include <Python.h>

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
}
