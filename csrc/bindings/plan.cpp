// Python classes of the step plan (cflow/plan.h), generated from its field tables: one class per
// op kind (cflow._core.Matmul, ...) with its named fields, a keyword constructor that rejects
// unknown names, `_fields` and a repr; TensorRef, BufferSpec and Plan. src/cflow/plan.py builds
// plans from them; the executor and the numpy reference engine run the same objects.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include <string>

#include "cflow/plan.h"

namespace nb = nanobind;
using namespace cflow;

namespace {

// "Kind(a=1, b=2)" from the class's _fields.
std::string describe(nb::handle self) {
  std::string out = nb::cast<std::string>(self.type().attr("__name__")) + "(";
  bool first = true;
  for (nb::handle f : nb::tuple(self.attr("_fields"))) {
    if (!first) out += ", ";
    first = false;
    out += nb::cast<std::string>(nb::str(f)) + "=" + nb::cast<std::string>(nb::repr(self.attr(f)));
  }
  return out + ")";
}

template <class T>
void reject_unknown(const nb::kwargs& kw, size_t used, const char* kind) {
  if (used == kw.size()) return;
  nb::tuple fields = nb::cast<nb::tuple>(nb::type<T>().attr("_fields"));
  for (auto [k, v] : kw) {
    bool known = false;
    for (nb::handle f : fields) known |= nb::cast<std::string>(nb::str(f)) == nb::cast<std::string>(nb::str(k));
    if (!known)
      throw nb::type_error((std::string(kind) + ": unknown field '" + nb::cast<std::string>(nb::str(k)) + "'").c_str());
  }
}

#define CFLOW_BIND_FIELD(type, name, def, doc) \
  c.def_rw(#name, &Cls::name, doc);            \
  names.append(nb::str(#name));
#define CFLOW_INIT_FIELD(type, name, def, doc) \
  if (kw.contains(#name)) {                    \
    o->name = nb::cast<type>(kw[#name]);       \
    ++used;                                    \
  }
#define CFLOW_BIND_CLASS(Kind, TABLE)                                       \
  {                                                                         \
    using Cls = Kind;                                                       \
    nb::class_<Kind> c(m, #Kind);                                           \
    nb::list names;                                                         \
    TABLE(CFLOW_BIND_FIELD)                                                 \
    c.attr("_fields") = nb::tuple(names);                                   \
    c.def("__init__", [](Kind* o, nb::kwargs kw) {                          \
      new (o) Kind();                                                       \
      size_t used = 0;                                                      \
      TABLE(CFLOW_INIT_FIELD)                                               \
      reject_unknown<Kind>(kw, used, #Kind);                                \
    });                                                                     \
    c.def("__repr__", [](nb::handle h) { return describe(h); });           \
  }

}  // namespace

void bind_plan(nb::module_& m) {
#define CFLOW_BIND_OP(Kind, TABLE) CFLOW_BIND_CLASS(Kind, TABLE)
  CFLOW_OPS(CFLOW_BIND_OP)
#undef CFLOW_BIND_OP
  CFLOW_BIND_CLASS(TensorRef, CFLOW_TENSOR_FIELDS)
  CFLOW_BIND_CLASS(BufferSpec, CFLOW_BUFFER_FIELDS)
  CFLOW_BIND_CLASS(ExpertRef, CFLOW_EXPERT_FIELDS)
  {
    nb::list kinds;
#define CFLOW_KIND_NAME(Kind, TABLE) kinds.append(m.attr(#Kind));
    CFLOW_OPS(CFLOW_KIND_NAME)
#undef CFLOW_KIND_NAME
    m.attr("OP_KINDS") = nb::tuple(kinds);  // in the order of their index in the executor's Op
  }
  nb::class_<Plan>(m, "Plan", "The step plan (cflow/plan.h): tensors, buffers, ops, logits buffer, RMSNorm constants")
      .def(nb::init<>())
      // The lists come out as copies (a list of references into the vector would dangle once
      // the vector is assigned); change one by assigning the whole list back.
      .def_prop_rw("tensors", [](const Plan& p) { return p.tensors; },
                   [](Plan& p, std::vector<TensorRef> v) { p.tensors = std::move(v); })
      .def_prop_rw("buffers", [](const Plan& p) { return p.buffers; },
                   [](Plan& p, std::vector<BufferSpec> v) { p.buffers = std::move(v); })
      .def_prop_rw("ops", [](const Plan& p) { return p.ops; }, [](Plan& p, std::vector<Op> v) { p.ops = std::move(v); })
      .def_prop_rw("experts", [](const Plan& p) { return p.experts; },
                   [](Plan& p, std::vector<ExpertRef> v) { p.experts = std::move(v); })
      .def_rw("logits", &Plan::logits)
      .def_rw("norm_eps", &Plan::norm_eps)
      .def_rw("norm_offset", &Plan::norm_offset);
}
