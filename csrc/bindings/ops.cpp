// Bindings of the small ops the engine calls (RMSNorm, softmax, gated activations), as the
// submodule cflow._core.ops. Each function checks every shape and index, then releases the GIL
// and writes into caller-given output arrays (src/cflow/ops.py allocates them); those must
// already be contiguous arrays of the right dtype (noconvert: never a silent temporary copy). The optional
// `isa` argument (scalar|avx2|avx512) picks a path explicitly, for tests; None = best_isa().
#include <algorithm>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "cflow/ops.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

template <class T>
using Arr = nb::ndarray<T, nb::c_contig, nb::device::cpu>;
using F32 = Arr<float>;
using CF32 = Arr<const float>;
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

}  // namespace

void bind_ops(nb::module_& root) {
  nb::module_ m = root.def_submodule(
      "ops", "Small fp32 ops; every function writes into its first argument (see cflow.ops)");

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

  // The KV cache's q8_0 blocks (ops.h): x (n,) floats, n a multiple of 32 -> y (n / 32 * 34,) bytes.
  m.def("to_q8_0",
        [](Arr<uint8_t> y, CF32 x) {
          require(x.ndim() == 1 && x.shape(0) % 32 == 0, "to_q8_0: x must be (n,) with n a multiple of 32");
          require(y.ndim() == 1 && y.shape(0) == x.shape(0) / 32 * cflow::kQ8Block,
                  "to_q8_0: y must be (" + std::to_string(x.shape(0) / 32 * cflow::kQ8Block) + ",)");
          require(x.size() < (size_t(1) << 31), "to_q8_0: array too large");
          nb::gil_scoped_release nogil;
          cflow::to_q8_0(x.data(), y.data(), (int)x.shape(0));
        },
        "y"_a.noconvert(), "x"_a);
  // y (n,) floats <- x (n / 32 * 34,) bytes of q8_0 blocks, as one row of n values.
  m.def("from_q8",
        [](F32 y, Arr<const uint8_t> x, const Isa& isa) {
          require(y.ndim() == 1 && y.shape(0) % 32 == 0, "from_q8: y must be (n,) with n a multiple of 32");
          require(x.ndim() == 1 && x.shape(0) == y.shape(0) / 32 * cflow::kQ8Block,
                  "from_q8: x must be (" + std::to_string(y.shape(0) / 32 * cflow::kQ8Block) + ",)");
          require(y.size() < (size_t(1) << 31), "from_q8: array too large");
          const cflow::OpsTable& t = pick(isa);
          nb::gil_scoped_release nogil;
          t.from_q8(x.data(), 1, (int)y.shape(0), y.data());
        },
        "y"_a.noconvert(), "x"_a, "isa"_a = nb::none());

  // In place, row-wise: x (..., n).
  m.def("softmax",
        [](F32 x, const Isa& isa) {
          auto [rows, n] = rows_n(x, "softmax");
          const cflow::OpsTable& t = pick(isa);
          nb::gil_scoped_release nogil;
          t.softmax(x.data(), rows, n);
        },
        "x"_a.noconvert(), "isa"_a = nb::none());

  // The sampler's candidates (cflow.sampling): the indices of the k largest of x and of every
  // value equal to the k-th, ascending (int32), or None where x holds a value that is not
  // finite. It keeps the GIL: a few microseconds, between a server step's forwards.
  m.def("top_k_ids",
        [](CF32 x, int k, const Isa& isa) -> nb::object {
          require(x.ndim() == 1, "top_k_ids: x must be 1-D, got " + shape_str(x));
          const size_t n = x.shape(0);
          require(n < (size_t(1) << 31), "top_k_ids: array too large");
          require(k >= 1 && (size_t)k <= n, "top_k_ids: k must be in 1.." + std::to_string(n));
          auto* ids = new std::vector<int32_t>();
          if (!cflow::top_k_ids(pick(isa), x.data(), (int)n, k, *ids)) {
            delete ids;
            return nb::none();
          }
          nb::capsule owner(ids, [](void* p) noexcept { delete static_cast<std::vector<int32_t>*>(p); });
          return nb::cast(nb::ndarray<nb::numpy, int32_t, nb::ndim<1>>(ids->data(), {ids->size()}, owner));
        },
        "x"_a, "k"_a, "isa"_a = nb::none());

  // One draw of the sampler with top-k on (cflow.sampling, `sample_top_k` in ops.h): the token,
  // or None where x holds a value that is not finite.
  m.def("sample_top_k",
        [](CF32 x, int k, double temperature, double top_p, double min_p, double u, const Isa& isa) -> nb::object {
          require(x.ndim() == 1, "sample_top_k: x must be 1-D, got " + shape_str(x));
          const size_t n = x.shape(0);
          require(n < (size_t(1) << 31), "sample_top_k: array too large");
          require(k >= 1 && (size_t)k <= n, "sample_top_k: k must be in 1.." + std::to_string(n));
          require(temperature > 0 && std::isfinite(temperature), "sample_top_k: temperature must be > 0");
          require(top_p > 0 && top_p <= 1 && min_p >= 0 && min_p <= 1,
                  "sample_top_k: top_p must be in (0, 1], min_p in [0, 1]");
          require(u >= 0 && u < 1, "sample_top_k: u must be in [0, 1)");
          const int id = cflow::sample_top_k(pick(isa), x.data(), (int)n, k, temperature, top_p, min_p, u);
          if (id < 0) return nb::none();
          return nb::int_(id);
        },
        "x"_a, "k"_a, "temperature"_a, "top_p"_a, "min_p"_a, "u"_a, "isa"_a = nb::none());

  // The same draw after a repetition penalty on the tokens of `history` (int32 ids, each < x's
  // size, in any order): `sample_top_k_penalised` in ops.h (temperature 0: greedy). None where x
  // holds a value that is not finite or k plus the history's distinct tokens reach x's size (the
  // caller penalises the whole vocabulary).
  m.def("sample_top_k_penalised",
        [](CF32 x, int k, nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> history,
           double penalty, double temperature, double top_p, double min_p, double u, const Isa& isa) -> nb::object {
          require(x.ndim() == 1, "sample_top_k_penalised: x must be 1-D, got " + shape_str(x));
          const size_t n = x.shape(0), len = history.shape(0);
          require(n < (size_t(1) << 31) && len < (size_t(1) << 31), "sample_top_k_penalised: array too large");
          require(k >= 1 && (size_t)k < n, "sample_top_k_penalised: k must be in 1.." + std::to_string(n - 1));
          const int32_t* hs = history.data();
          bool in_range = true;
          for (size_t i = 0; i < len; ++i) in_range &= hs[i] >= 0 && (size_t)hs[i] < n;
          require(in_range, "sample_top_k_penalised: history ids must be in 0.." + std::to_string(n - 1));
          require(penalty > 0 && std::isfinite(penalty), "sample_top_k_penalised: penalty must be > 0");
          require(temperature >= 0 && std::isfinite(temperature), "sample_top_k_penalised: temperature must be >= 0");
          require(top_p > 0 && top_p <= 1 && min_p >= 0 && min_p <= 1,
                  "sample_top_k_penalised: top_p must be in (0, 1], min_p in [0, 1]");
          require(u >= 0 && u < 1, "sample_top_k_penalised: u must be in [0, 1)");
          const int id = cflow::sample_top_k_penalised(pick(isa), x.data(), (int)n, k, hs, (int)len, penalty,
                                                       temperature, top_p, min_p, u);
          if (id < 0) return nb::none();
          return nb::int_(id);
        },
        "x"_a, "k"_a, "history"_a, "penalty"_a, "temperature"_a, "top_p"_a, "min_p"_a, "u"_a, "isa"_a = nb::none());

  // The same draw with the distinct tokens `moved` (int32, each < x's size) at `values` (float64,
  // finite) instead of their logits: `sample_top_k_moved` in ops.h (the frequency and presence
  // penalties, cflow.sampling). None where x holds a value that is not finite or k plus the
  // moved tokens reach x's size (the caller moves a copy of the whole vocabulary).
  m.def("sample_top_k_moved",
        [](CF32 x, int k, nb::ndarray<const int32_t, nb::ndim<1>, nb::c_contig, nb::device::cpu> moved,
           nb::ndarray<const double, nb::ndim<1>, nb::c_contig, nb::device::cpu> values, double temperature,
           double top_p, double min_p, double u, const Isa& isa) -> nb::object {
          require(x.ndim() == 1, "sample_top_k_moved: x must be 1-D, got " + shape_str(x));
          const size_t n = x.shape(0), h = moved.shape(0);
          require(n < (size_t(1) << 31), "sample_top_k_moved: array too large");
          require(values.shape(0) == h, "sample_top_k_moved: one value per moved token");
          require(k >= 1 && (size_t)k < n, "sample_top_k_moved: k must be in 1.." + std::to_string(n - 1));
          const int32_t* ms = moved.data();
          std::vector<int32_t> sorted(ms, ms + h);  // a few dozen ids: sorted, not marked in a vocabulary
          std::sort(sorted.begin(), sorted.end());
          bool ok = std::adjacent_find(sorted.begin(), sorted.end()) == sorted.end() &&
                    (h == 0 || (sorted.front() >= 0 && (size_t)sorted.back() < n));
          for (size_t i = 0; i < h; ++i) ok &= std::isfinite(values.data()[i]);
          require(ok, "sample_top_k_moved: moved ids must be distinct, in 0.." + std::to_string(n - 1) +
                          ", their values finite");
          require(temperature >= 0 && std::isfinite(temperature), "sample_top_k_moved: temperature must be >= 0");
          require(top_p > 0 && top_p <= 1 && min_p >= 0 && min_p <= 1,
                  "sample_top_k_moved: top_p must be in (0, 1], min_p in [0, 1]");
          require(u >= 0 && u < 1, "sample_top_k_moved: u must be in [0, 1)");
          const int id = cflow::sample_top_k_moved(pick(isa), x.data(), (int)n, k, ms, values.data(), (int)h,
                                                   temperature, top_p, min_p, u);
          if (id < 0) return nb::none();
          return nb::int_(id);
        },
        "x"_a, "k"_a, "moved"_a, "values"_a, "temperature"_a, "top_p"_a, "min_p"_a, "u"_a, "isa"_a = nb::none());

  // h = f(g, u), element-wise.
  for (auto [name, fn] : {std::pair{"swiglu", &cflow::OpsTable::swiglu},
                          std::pair{"geglu", &cflow::OpsTable::geglu}})
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
}

