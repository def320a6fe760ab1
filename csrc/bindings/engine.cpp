// Bindings of the decode engine (plan executor, KV cache). The plan arrives as flat arrays built
// once by src/cflow/engine.py; forward() releases the GIL for the whole step.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include "cflow/engine.h"

namespace nb = nanobind;
using namespace cflow;
using namespace nb::literals;

namespace {

template <class T>
using Arr = nb::ndarray<T, nb::c_contig, nb::device::cpu>;

// Keeps the Python object owning the mapped bytes alive as long as the engine.
struct PyEngine {
  nb::object owner;
  std::unique_ptr<Engine> eng;
};

PyEngine* make_engine(nb::object owner, Arr<const uint8_t> buf, Arr<const int32_t> idims, Arr<const float> fdims,
                      Arr<const int64_t> tensors, Arr<const int32_t> ops_i, Arr<const float> ops_f,
                      Arr<const int32_t> buf_width, int logits_buf, int threads, bool fast) {
  if (buf.ndim() != 1) throw nb::value_error("weights must be a 1-D uint8 buffer");
  if (idims.size() != 9 || fdims.size() != 4) throw nb::value_error("dims: expected 9 ints and 4 floats");
  ModelDims D;
  const int32_t* di = idims.data();
  D.n_layer = di[0]; D.d_model = di[1]; D.n_head = di[2]; D.n_kv_head = di[3]; D.head_dim = di[4];
  D.vocab = di[5]; D.n_ctx = di[6]; D.rope_style = di[7]; D.act = di[8];
  const float* df = fdims.data();
  D.eps = df[0]; D.norm_offset = df[1]; D.attn_scale = df[2]; D.embed_scale = df[3];
  if (tensors.ndim() != 2 || tensors.shape(1) != 9) throw nb::value_error("tensors: expected (n, 9) int64");
  std::vector<TensorRef> T(tensors.shape(0));
  for (size_t i = 0; i < T.size(); ++i) {
    const int64_t* r = tensors.data() + i * 9;
    T[i].off = r[0]; T[i].nbytes = r[1];
    T[i].L.type = (int)r[2]; T[i].L.rows = (int)r[3]; T[i].L.cols = (int)r[4];
    T[i].L.tr = (int)r[5]; T[i].L.tc = (int)r[6]; T[i].L.g = (int)r[7]; T[i].L.pack = (int)r[8];
  }
  if (ops_i.ndim() != 2 || ops_i.shape(1) != kOpInts || ops_f.ndim() != 2 || ops_f.shape(1) != kOpFloats ||
      ops_f.shape(0) != ops_i.shape(0))
    throw nb::value_error("ops: expected (n, 10) int32 and (n, 2) float32");
  Plan P;
  P.ops.resize(ops_i.shape(0));
  for (size_t i = 0; i < P.ops.size(); ++i) {
    const int32_t* r = ops_i.data() + i * kOpInts;
    Op& o = P.ops[i];
    o.kind = r[0]; o.w = r[1]; o.bias = r[2]; o.norm = r[3]; o.src = r[4]; o.dst = r[5];
    o.flags = r[6]; o.layer = r[7]; o.aux0 = r[8]; o.aux1 = r[9];
    o.f0 = ops_f.data()[i * 2]; o.f1 = ops_f.data()[i * 2 + 1];
  }
  P.buf_width.assign(buf_width.data(), buf_width.data() + buf_width.size());
  P.logits_buf = logits_buf;
  auto* pe = new PyEngine;
  pe->owner = owner;
  pe->eng = std::make_unique<Engine>(buf.data(), buf.size(), D, std::move(T), std::move(P), threads, fast);
  return pe;
}

}  // namespace

void bind_engine(nb::module_& m) {
  nb::class_<State>(m, "EngineState", "KV cache of one sequence")
      .def_rw("pos", &State::pos)
      .def_ro("n_ctx", &State::n_ctx);
  nb::class_<PyEngine>(m, "EngineCore", "Native plan executor (src/cflow/engine.py builds the plan)")
      .def("__init__",
           [](PyEngine* self, nb::object owner, Arr<const uint8_t> buf, Arr<const int32_t> idims, Arr<const float> fdims,
              Arr<const int64_t> tensors, Arr<const int32_t> ops_i, Arr<const float> ops_f, Arr<const int32_t> bw,
              int logits_buf, int threads, bool fast) {
             PyEngine* e = make_engine(owner, buf, idims, fdims, tensors, ops_i, ops_f, bw, logits_buf, threads, fast);
             new (self) PyEngine(std::move(*e));
             delete e;
           })
      .def("new_state", [](PyEngine& e) { return e.eng->new_state(); })
      .def("threads", [](PyEngine& e) { return e.eng->threads(); })
      .def("profile", [](PyEngine& e) { return e.eng->profile(); })
      .def(
          "forward",
          [](PyEngine& e, State& st, Arr<const int32_t> tokens, bool all_logits, Arr<float> out) {
            const int n = (int)tokens.size();
            const size_t need = (size_t)e.eng->dims().vocab * (all_logits ? n : 1);
            if (out.size() < need) throw nb::value_error("forward: output array too small");
            nb::gil_scoped_release nogil;
            e.eng->forward(st, tokens.data(), n, all_logits, out.data());
          },
          "state"_a, "tokens"_a, "all_logits"_a, "out"_a);
}
