// Bindings of cflow/mapping.h: MappedFile, a guarded read-only mapping of a file (the reader's
// CflowFile maps .cflow files with it; docs/ENGINE.md, "Model file changed on disk").
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include "cflow/mapping.h"

namespace nb = nanobind;
using namespace cflow;
using namespace nb::literals;

namespace {

nb::tuple stat_tuple(const FileStat& s) { return nb::make_tuple(s.dev, s.ino, s.size, s.mtime_ns); }

}  // namespace

void bind_mapping(nb::module_& m) {
  m.def("map_guard_supported", &map_guard_supported,
        "Whether reads of a MappedFile whose file shrank read zeros (and set `lost`) instead of raising SIGBUS.");
  nb::class_<MappedFile>(m, "MappedFile",
                         "A file mapped read-only, whole, guarded against SIGBUS where supported (cflow/mapping.h)")
      .def(nb::init<const std::string&>(), "path"_a)
      .def_prop_ro("size", &MappedFile::size)
      .def_prop_ro("guarded", &MappedFile::guarded, "faults in the mapping are caught (Linux)")
      .def_prop_ro("lost", &MappedFile::lost,
                   "a read faulted (the file shrank under the mapping, or an I/O error): the pages from there on "
                   "now read as zeros")
      .def_prop_ro("opened", [](const MappedFile& f) { return stat_tuple(f.opened()); },
                   "(dev, ino, size, mtime_ns) of the file when it was mapped")
      .def("stat", [](const MappedFile& f) { return stat_tuple(f.stat()); },
           "(dev, ino, size, mtime_ns) of the mapped file now (fstat of the mapped inode)")
      .def(
          "array",
          [](nb::handle self) {
            MappedFile& f = nb::cast<MappedFile&>(self);
            const size_t shape[1] = {f.size()};
            return nb::ndarray<nb::numpy, const uint8_t, nb::ndim<1>>(f.data(), 1, shape, self);
          },
          "A read-only uint8 numpy view of the whole mapping; it keeps the MappedFile alive.");
}
