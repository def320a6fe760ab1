// Bindings of the kernel library (GEMV, norms, rope, activations, thread pool).
#include <nanobind/nanobind.h>
namespace nb = nanobind;

void bind_kernels(nb::module_& m) {}
