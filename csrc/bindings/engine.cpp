// Bindings of the decode engine (plan executor, KV cache).
#include <nanobind/nanobind.h>
namespace nb = nanobind;

void bind_engine(nb::module_& m) {}
