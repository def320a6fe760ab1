// Bindings of the small ops (norms, rope, softmax, activations, top-k, attention), as the
// submodule cflow._core.ops. Each function checks every shape and index, then releases the GIL
// and writes into caller-given output arrays (src/cflow/ops.py allocates them); those must
// already be contiguous arrays of the right dtype (noconvert: never a silent temporary copy). The optional
// `isa` argument (scalar|avx2|avx512) picks a path explicitly, for tests; None = best_isa().
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cmath>
#include <optional>
#include <string>

#include "cflow/ops.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

template <class T>
using Arr = nb::ndarray<T, nb::c_contig, nb::device::cpu>;
using F32 = Arr<float>;
using CF32 = Arr<const float>;
using U16 = Arr<uint16_t>;
using CU16 = Arr<const uint16_t>;
using CI32 = Arr<const int32_t>;
using Isa = std::optional<std::string>;

void require(bool ok, const std::string& msg) {
  if (!ok) throw nb::value_error(msg.c_str());
}

const cflow::OpsTable& pick(const Isa& isa) {
  if (!isa) return cflow::ops();
  for (auto i : {cflow::Isa::Scalar, cflow::Isa::Avx2, cflow::Isa::Avx512})
    if (*isa == cflow::isa_name(i)) {
      require(cflow::isa_supported(i), "ISA " + *isa + " is not supported by this CPU");
      return cflow::ops_table(i);
    }
  throw nb::value_error(("unknown ISA '" + *isa + "' (scalar|avx2|avx512)").c_str());
}

template <class A>
std::string shape_str(const A& a) {
  std::string s = "(";
  for (size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + (a.ndim() == 1 ? ",)" : ")");
}

template <class A, class B>
void same_shape(const A& a, const B& b, const char* what) {
  bool ok = a.ndim() == b.ndim();
  for (size_t i = 0; ok && i < a.ndim(); ++i) ok = a.shape(i) == b.shape(i);
  require(ok, std::string(what) + ": shapes differ, " + shape_str(a) + " vs " + shape_str(b));
}

// (rows, n) view of an array of ndim >= 1 with a non-empty last axis.
template <class A>
std::pair<int, int> rows_n(const A& a, const char* what) {
  require(a.ndim() >= 1, std::string(what) + ": needs at least 1 dimension");
  const size_t n = a.shape(a.ndim() - 1);
  require(n > 0, std::string(what) + ": the last axis is empty");
  require(a.size() < (size_t(1) << 31), std::string(what) + ": array too large");
  return {(int)(a.size() / n), (int)n};
}

// Attention shape from q (.., n_head, hd) and the cache (n_kv_head, max_ctx, hd); checks all.
template <class C>
cflow::AttnShape attn_shape(const CF32& q, const C& k, const C& v, const F32& out, float scale,
                            int window, float softcap, int head_begin, int head_end) {
  require(k.ndim() == 3, "attention: the K cache must be (n_kv_head, max_ctx, head_dim), got " +
                             shape_str(k));
  same_shape(k, v, "attention: K and V caches");
  same_shape(q, out, "attention: q and out");
  cflow::AttnShape s;
  s.n_kv_head = (int)k.shape(0), s.max_ctx = (int)k.shape(1), s.head_dim = (int)k.shape(2);
  s.n_head = (int)q.shape(q.ndim() - 2);
  require(q.shape(q.ndim() - 1) == (size_t)s.head_dim,
          "attention: q head_dim " + std::to_string(q.shape(q.ndim() - 1)) +
              " differs from the cache's " + std::to_string(s.head_dim));
  require(s.n_kv_head > 0 && s.head_dim > 0 && s.max_ctx > 0, "attention: empty cache");
  require(s.n_head > 0 && s.n_head % s.n_kv_head == 0,
          "attention: n_head " + std::to_string(s.n_head) + " is not a multiple of n_kv_head " +
              std::to_string(s.n_kv_head));
  require(std::isfinite(scale), "attention: scale must be finite");
  require(window >= 0, "attention: window must be >= 0 (0 = no window)");
  require(softcap >= 0 && std::isfinite(softcap), "attention: softcap must be >= 0 (0 = none)");
  require(0 <= head_begin && head_begin <= head_end && head_end <= s.n_head,
          "attention: head range [" + std::to_string(head_begin) + ", " +
              std::to_string(head_end) + ") outside [0, " + std::to_string(s.n_head) + ")");
  s.scale = scale, s.window = window, s.softcap = softcap;
  return s;
}

template <class C>
void attn_decode(F32 out, CF32 q, C k, C v, int pos, float scale, int window, float softcap,
                 int head_begin, int head_end, const Isa& isa) {
  require(q.ndim() == 2, "attn_decode: q must be (n_head, head_dim), got " + shape_str(q));
  const cflow::AttnShape s =
      attn_shape(q, k, v, out, scale, window, softcap, head_begin, head_end);
  require(0 <= pos && pos < s.max_ctx, "attn_decode: pos " + std::to_string(pos) +
                                           " outside the cache [0, " +
                                           std::to_string(s.max_ctx) + ")");
  const cflow::OpsTable& t = pick(isa);
  nb::gil_scoped_release nogil;
  if constexpr (std::is_same<C, CF32>::value)
    t.attn_decode(out.data(), q.data(), k.data(), v.data(), pos, s, head_begin, head_end);
  else
    t.attn_decode_f16(out.data(), q.data(), k.data(), v.data(), pos, s, head_begin, head_end);
}

template <class C>
void attn_prefill(F32 out, CF32 q, C k, C v, int p0, float scale, int window, float softcap,
                  int head_begin, int head_end, const Isa& isa) {
  require(q.ndim() == 3, "attn_prefill: q must be (T, n_head, head_dim), got " + shape_str(q));
  const cflow::AttnShape s =
      attn_shape(q, k, v, out, scale, window, softcap, head_begin, head_end);
  const int T = (int)q.shape(0);
  require(p0 >= 0 && (size_t)p0 + T <= (size_t)s.max_ctx,
          "attn_prefill: positions [" + std::to_string(p0) + ", " + std::to_string(p0 + T) +
              ") outside the cache [0, " + std::to_string(s.max_ctx) + ")");
  const cflow::OpsTable& t = pick(isa);
  nb::gil_scoped_release nogil;
  if constexpr (std::is_same<C, CF32>::value)
    t.attn_prefill(out.data(), q.data(), k.data(), v.data(), p0, T, s, head_begin, head_end);
  else
    t.attn_prefill_f16(out.data(), q.data(), k.data(), v.data(), p0, T, s, head_begin, head_end);
}

}  // namespace

void bind_ops(nb::module_& root) {
  nb::module_ m = root.def_submodule(
      "ops", "Small fp32 ops; every function writes into its first argument (see cflow.ops)");

  nb::class_<cflow::RopeTable>(m, "RopeTable",
                               "cos/sin of pos * inv_freq, (max_pos, rot_dim/2), built once")
      .def("__init__",
           [](cflow::RopeTable* self, int rot_dim, int max_pos, double theta) {
             require(rot_dim > 0 && rot_dim % 2 == 0, "RopeTable: rot_dim must be even and > 0");
             require(max_pos > 0, "RopeTable: max_pos must be > 0");
             require((size_t)max_pos * rot_dim <= (size_t(1) << 31), "RopeTable: too large");
             require(theta > 0 && std::isfinite(theta), "RopeTable: theta must be > 0");
             new (self) cflow::RopeTable(cflow::rope_table(rot_dim, max_pos, theta));
           },
           "rot_dim"_a, "max_pos"_a, "theta"_a)
      .def_static("from_freqs",
           [](CF32 inv_freq, int max_pos) {
             require(inv_freq.ndim() == 1 && inv_freq.shape(0) > 0,
                     "RopeTable.from_freqs: inv_freq must be a non-empty 1-D array");
             require(max_pos > 0, "RopeTable: max_pos must be > 0");
             require((size_t)max_pos * inv_freq.shape(0) <= (size_t(1) << 30),
                     "RopeTable: too large");
             return cflow::rope_table_freqs(2 * (int)inv_freq.shape(0), max_pos, inv_freq.data());
           },
           "inv_freq"_a, "max_pos"_a)
      .def_ro("rot_dim", &cflow::RopeTable::rot_dim)
      .def_ro("max_pos", &cflow::RopeTable::max_pos);

  m.def("rmsnorm",
        [](F32 y, CF32 x, CF32 w, float eps, float w_offset, const Isa& isa) {
          same_shape(y, x, "rmsnorm: y and x");
          auto [rows, n] = rows_n(x, "rmsnorm: x");
          require(w.ndim() == 1 && w.shape(0) == (size_t)n,
                  "rmsnorm: w must be (" + std::to_string(n) + ",), got " + shape_str(w));
          require(eps >= 0, "rmsnorm: eps must be >= 0");
          const cflow::OpsTable& t = pick(isa);
          nb::gil_scoped_release nogil;
          t.rmsnorm(y.data(), x.data(), w.data(), rows, n, eps, w_offset);
        },
        "y"_a.noconvert(), "x"_a, "w"_a, "eps"_a, "w_offset"_a, "isa"_a = nb::none());

  m.def("rope",
        [](F32 x, CI32 pos, const cflow::RopeTable& table, const std::string& style,
           const Isa& isa) {
          require(x.ndim() == 3, "rope: x must be (T, n_head, head_dim), got " + shape_str(x));
          const int T = (int)x.shape(0), nh = (int)x.shape(1), hd = (int)x.shape(2);
          require(pos.ndim() == 1 && pos.shape(0) == (size_t)T,
                  "rope: pos must be (" + std::to_string(T) + ",), got " + shape_str(pos));
          require(table.rot_dim <= hd, "rope: the table's rot_dim " +
                                           std::to_string(table.rot_dim) + " exceeds head_dim " +
                                           std::to_string(hd));
          for (int t = 0; t < T; ++t)
            require(0 <= pos.data()[t] && pos.data()[t] < table.max_pos,
                    "rope: position " + std::to_string(pos.data()[t]) + " outside the table [0, " +
                        std::to_string(table.max_pos) + ")");
          require(style == "neox" || style == "interleaved",
                  "rope: style must be 'neox' or 'interleaved', got '" + style + "'");
          const auto st = style == "neox" ? cflow::RopeStyle::Neox : cflow::RopeStyle::Interleaved;
          const cflow::OpsTable& t = pick(isa);
          nb::gil_scoped_release nogil;
          t.rope(x.data(), T, nh, hd, pos.data(), table, st);
        },
        "x"_a.noconvert(), "pos"_a, "table"_a, "style"_a, "isa"_a = nb::none());

  // In-place row-wise ops: x (..., n).
  for (auto [name, fn] : {std::pair{"softmax", &cflow::OpsTable::softmax},
                          std::pair{"log_softmax", &cflow::OpsTable::log_softmax}})
    m.def(name,
          [fn = fn, name = std::string(name)](F32 x, const Isa& isa) {
            auto [rows, n] = rows_n(x, name.c_str());
            const cflow::OpsTable& t = pick(isa);
            nb::gil_scoped_release nogil;
            (t.*fn)(x.data(), rows, n);
          },
          "x"_a.noconvert(), "isa"_a = nb::none());

  // y = f(x), element-wise.
  for (auto [name, fn] : {std::pair{"silu", &cflow::OpsTable::silu},
                          std::pair{"gelu_tanh", &cflow::OpsTable::gelu_tanh}})
    m.def(name,
          [fn = fn, name = std::string(name)](F32 y, CF32 x, const Isa& isa) {
            same_shape(y, x, name.c_str());
            auto [rows, n] = rows_n(x, name.c_str());
            const cflow::OpsTable& t = pick(isa);
            nb::gil_scoped_release nogil;
            (t.*fn)(y.data(), x.data(), rows * n);
          },
          "y"_a.noconvert(), "x"_a, "isa"_a = nb::none());

  // h = f(g, u), element-wise.
  for (auto [name, fn] : {std::pair{"swiglu", &cflow::OpsTable::swiglu},
                          std::pair{"geglu", &cflow::OpsTable::geglu},
                          std::pair{"add", &cflow::OpsTable::add}})
    m.def(name,
          [fn = fn, name = std::string(name)](F32 h, CF32 g, CF32 u, const Isa& isa) {
            same_shape(h, g, name.c_str());
            same_shape(g, u, name.c_str());
            auto [rows, n] = rows_n(g, name.c_str());
            const cflow::OpsTable& t = pick(isa);
            nb::gil_scoped_release nogil;
            (t.*fn)(h.data(), g.data(), u.data(), rows * n);
          },
          "h"_a.noconvert(), "g"_a, "u"_a, "isa"_a = nb::none());

  m.def("scale",
        [](F32 y, CF32 x, float s, const Isa& isa) {
          same_shape(y, x, "scale");
          auto [rows, n] = rows_n(x, "scale");
          const cflow::OpsTable& t = pick(isa);
          nb::gil_scoped_release nogil;
          t.scale(y.data(), x.data(), s, rows * n);
        },
        "y"_a.noconvert(), "x"_a, "s"_a, "isa"_a = nb::none());

  m.def("f32_to_f16",
        [](U16 y, CF32 x, const Isa& isa) {
          same_shape(y, x, "f32_to_f16");
          auto [rows, n] = rows_n(x, "f32_to_f16");
          const cflow::OpsTable& t = pick(isa);
          nb::gil_scoped_release nogil;
          t.f32_to_f16(y.data(), x.data(), rows * n);
        },
        "y"_a.noconvert(), "x"_a, "isa"_a = nb::none());

  m.def("f16_to_f32",
        [](F32 y, CU16 x, const Isa& isa) {
          same_shape(y, x, "f16_to_f32");
          auto [rows, n] = rows_n(x, "f16_to_f32");
          const cflow::OpsTable& t = pick(isa);
          nb::gil_scoped_release nogil;
          t.f16_to_f32(y.data(), x.data(), rows * n);
        },
        "y"_a.noconvert(), "x"_a, "isa"_a = nb::none());

  m.def("topk",
        [](Arr<int32_t> idx, F32 val, CF32 x, const Isa& isa) {
          require(x.ndim() == 1 && x.shape(0) > 0, "topk: x must be a non-empty 1-D array");
          require(x.shape(0) < (size_t(1) << 31), "topk: x too large");
          require(idx.ndim() == 1 && val.ndim() == 1 && idx.shape(0) == val.shape(0),
                  "topk: idx and val must be 1-D of the same length k");
          const int n = (int)x.shape(0), k = (int)idx.shape(0);
          require(1 <= k && k <= n, "topk: k=" + std::to_string(k) + " outside [1, n=" +
                                        std::to_string(n) + "]");
          const cflow::OpsTable& t = pick(isa);
          nb::gil_scoped_release nogil;
          t.topk(idx.data(), val.data(), x.data(), n, k);
        },
        "idx"_a.noconvert(), "val"_a.noconvert(), "x"_a, "isa"_a = nb::none());

  m.def("attn_decode", &attn_decode<CF32>, "out"_a.noconvert(), "q"_a, "k"_a.noconvert(), "v"_a.noconvert(), "pos"_a, "scale"_a,
        "window"_a, "softcap"_a, "head_begin"_a, "head_end"_a, "isa"_a = nb::none());
  m.def("attn_decode", &attn_decode<CU16>, "out"_a.noconvert(), "q"_a, "k"_a.noconvert(), "v"_a.noconvert(), "pos"_a, "scale"_a,
        "window"_a, "softcap"_a, "head_begin"_a, "head_end"_a, "isa"_a = nb::none());
  m.def("attn_prefill", &attn_prefill<CF32>, "out"_a.noconvert(), "q"_a, "k"_a.noconvert(), "v"_a.noconvert(), "p0"_a, "scale"_a,
        "window"_a, "softcap"_a, "head_begin"_a, "head_end"_a, "isa"_a = nb::none());
  m.def("attn_prefill", &attn_prefill<CU16>, "out"_a.noconvert(), "q"_a, "k"_a.noconvert(), "v"_a.noconvert(), "p0"_a, "scale"_a,
        "window"_a, "softcap"_a, "head_begin"_a, "head_end"_a, "isa"_a = nb::none());
}
