// The one Python extension module, cflow._core. Each binding file registers its part;
// every call that runs longer than a few microseconds releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>

#include <nanobind/ndarray.h>

#include "cflow/cpu.h"
#include "cflow/crc32c.h"
#include "cflow/planes.h"
#include "cflow/threadpool.h"

namespace nb = nanobind;

void bind_kernels(nb::module_& m);  // csrc/bindings/kernels.cpp
void bind_ops(nb::module_& m);      // csrc/bindings/ops.cpp
void bind_plan(nb::module_& m);     // csrc/bindings/plan.cpp
void bind_engine(nb::module_& m);   // csrc/bindings/engine.cpp
void bind_mapping(nb::module_& m);  // csrc/bindings/mapping.cpp

NB_MODULE(_core, m) {
  m.doc() = "cflow native core: tile kernels, thread pool and decode engine";
  m.def("best_isa", [] { return std::string(cflow::isa_name(cflow::best_isa())); },
        "Name of the ISA path the kernels dispatch to on this CPU (scalar|avx2|avx512).");
  m.def("amx_usable", [] { return cflow::amx_usable() && cflow::best_isa() == cflow::Isa::Avx512; },
        "Whether batched decode steps run on the AMX tile unit (CPU, OS and CFLOW_AMX allowing).");
  m.def("isa_supported", [](const std::string& name) {
    for (auto isa : {cflow::Isa::Scalar, cflow::Isa::Avx2, cflow::Isa::Avx512})
      if (name == cflow::isa_name(isa)) return cflow::isa_supported(isa);
    throw nb::value_error(("unknown ISA: " + name).c_str());
  });
  m.def("crc32c", [](nb::ndarray<const uint8_t, nb::c_contig, nb::device::cpu> data, uint32_t value) {
    nb::gil_scoped_release nogil;
    return cflow::crc32c(data.data(), data.size(), value);
  }, nb::arg("data"), nb::arg("value") = 0,
     "CRC-32C of a uint8 array, continuing from value (crc32c(b, crc32c(a)) == crc32c(a + b)).");
  m.def("set_prefetch", &cflow::set_prefetch, nb::arg("on"),
        "Turn the kernels' software prefetches on or off (CFLOW_PREFETCH=0 starts with them off).");
  m.def("prefetch", &cflow::prefetch_on, "Whether the kernels issue their software prefetches.");
  m.def("set_thread_name", [](const std::string& name) { cflow::set_thread_name(name.c_str()); }, nb::arg("name"),
        "Name the calling thread as the OS shows it (top -H, /proc/<pid>/task/<tid>/comm; Linux cuts it "
        "at 15 characters).");
  bind_kernels(m);
  bind_ops(m);
  bind_plan(m);
  bind_engine(m);
  bind_mapping(m);
}
