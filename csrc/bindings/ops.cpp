// Bindings of the element-wise and small ops (norms, rope, softmax, activations, top-k, attention).
#include <nanobind/nanobind.h>
namespace nb = nanobind;

void bind_ops(nb::module_& m) {}
