// Bindings of the kernel library: tile GEMVs (every type, activation path and ISA), the fused
// GLU GEMV, the bandwidth probe and the thread count. Arrays in, pointers out; the GIL is
// released around every kernel call.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "cflow/kernels.h"
#include "cflow/probe.h"
#include "cflow/threadpool.h"

namespace nb = nanobind;
using namespace cflow;

namespace {

using Bytes = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using VecF = nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using OutF = nb::ndarray<nb::numpy, float, nb::ndim<1>>;

BlockType parse_type(const std::string& s) {
  BlockType bt;
  if (!block_from_name(s.c_str(), &bt)) throw nb::value_error(("unsupported weight type: " + s).c_str());
  return bt;
}

AType parse_act(const std::string& s) {
  if (s == "f32") return AType::F32;
  if (s == "q8") return AType::Q8;
  if (s == "q8x2") return AType::Q8x2;
  throw nb::value_error(("activation type must be 'f32', 'q8' or 'q8x2', got " + s).c_str());
}

Isa parse_isa(const std::optional<std::string>& s) {
  if (!s) return best_isa();
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512})
    if (*s == isa_name(isa)) {
      if (!isa_supported(isa)) throw nb::value_error(("ISA not supported by this CPU: " + *s).c_str());
      return isa;
    }
  throw nb::value_error(("unknown ISA: " + *s).c_str());
}

OutF new_out(size_t n) {
  float* p = new float[n ? n : 1];
  nb::capsule owner(p, [](void* q) noexcept { delete[] (float*)q; });
  return OutF(p, {n}, owner);
}

Pack parse_pack(const std::string& s) {
  Pack p;
  if (!pack_from_name(s.c_str(), &p)) throw nb::value_error(("pack must be 'blocks' or 'planes', got " + s).c_str());
  return p;
}

// Checks shapes and returns the validated layout; x must have cols values.
TileLayout check(BlockType bt, AType at, const Bytes& tiles, const VecF& x, int rows, int cols,
                 std::tuple<int, int> tile, int interleave, const std::string& pack) {
  const char* err = nullptr;
  const TileLayout L =
      tile_layout(bt, rows, cols, std::get<0>(tile), std::get<1>(tile), interleave, parse_pack(pack), &err);
  if (err) throw nb::value_error(err);
  if (at != AType::F32 && !has_int8_path(bt, false)) throw nb::value_error("this weight type has no int8 activation path");
  if (!gemv_fn(bt, L.packing(), at, Isa::Scalar)) throw nb::value_error("no kernel for this weight type, activation and pack");
  if (tiles.shape(0) != layout_nbytes(L))
    throw nb::value_error(("tiles: expected " + std::to_string(layout_nbytes(L)) + " bytes, got " +
                           std::to_string(tiles.shape(0))).c_str());
  if (x.shape(0) != (size_t)cols) throw nb::value_error("x: expected cols values");
  return L;
}

// A pool of exactly n threads (the global one, resized when needed).
ThreadPool* pool_of(int threads) {
  if (threads < 1) throw nb::value_error("threads must be >= 1");
  if (threads == 1) return nullptr;
  set_num_threads(threads);
  return &global_pool();
}

}  // namespace

void bind_kernels(nb::module_& m) {
  m.def(
      "quantize_fit",
      [](const std::string& type, nb::ndarray<const float, nb::ndim<2>, nb::c_contig, nb::device::cpu> x,
         int threads, std::optional<nb::ndarray<const float, nb::ndim<1>, nb::c_contig, nb::device::cpu>> importance) {
        const bool q4_0 = type == "q4_0";
        if (!q4_0 && type != "q4_1") throw nb::value_error("quantize_fit: type must be 'q4_0' or 'q4_1'");
        const size_t rows = x.shape(0), cols = x.shape(1), bb = q4_0 ? 18 : 20;
        if (cols % 32) throw nb::value_error("quantize_fit: columns must be a multiple of 32");
        if (threads < 1) throw nb::value_error("threads must be >= 1");
        const float* imp = nullptr;
        if (importance) {
          if (importance->shape(0) != cols)
            throw nb::value_error(("quantize_fit: importance has " + std::to_string(importance->shape(0)) +
                                   " values for " + std::to_string(cols) + " columns").c_str());
          imp = importance->data();
          for (size_t j = 0; j < cols; ++j)
            if (!(imp[j] > 0.f) || !std::isfinite(imp[j]))
              throw nb::value_error("quantize_fit: importance values must be positive and finite");
        }
        const size_t nb_ = rows * (cols / 32);
        uint8_t* p = new uint8_t[nb_ * bb ? nb_ * bb : 1];
        nb::capsule owner(p, [](void* q) noexcept { delete[] (uint8_t*)q; });
        int64_t refused;
        {
          nb::gil_scoped_release nogil;
          refused = (q4_0 ? quantize_q4_0_fit : quantize_q4_1_fit)(x.data(), (int64_t)nb_, p, threads, imp,
                                                                   (int64_t)(cols / 32));
        }
        if (refused)  // (the capsule frees p)
          throw nb::value_error((std::to_string(refused) + " block(s) of 32 hold values too large for " + type +
                                 "'s fp16 scale").c_str());
        return nb::ndarray<nb::numpy, uint8_t, nb::ndim<2>>(p, {rows, cols / 32 * bb}, owner);
      },
      nb::arg("type"), nb::arg("x"), nb::arg("threads") = 1, nb::arg("importance") = nb::none(),
      "float32 (R, C), C % 32 == 0 -> uint8 (R, C / 32 * block bytes): Q4_0 or Q4_1 blocks with fitted "
      "scales (kernels.h quantize_q4_0_fit, quantize_q4_1_fit); importance: float32 (C,) > 0, the "
      "weight of each column's squared error.");
  m.def(
      "gemv",
      [](const std::string& wtype, Bytes tiles, VecF x, int rows, int cols, std::tuple<int, int> tile,
         int interleave, const std::string& act, std::optional<std::string> isa, int threads, const std::string& pack) {
        const BlockType bt = parse_type(wtype);
        const AType at = parse_act(act);
        const TileLayout L = check(bt, at, tiles, x, rows, cols, tile, interleave, pack);
        const Isa i = parse_isa(isa);
        ThreadPool* pool = pool_of(threads);
        OutF y = new_out(rows);
        {
          nb::gil_scoped_release nogil;
          std::vector<uint8_t> xa(act_bytes(bt, at, cols));
          prepare_act(bt, at, xa.data(), x.data(), cols);
          cflow::gemv(at, i, y.data(), xa.data(), tiles.data(), L, pool);
        }
        return y;
      },
      nb::arg("wtype"), nb::arg("tiles"), nb::arg("x"), nb::arg("rows"), nb::arg("cols"),
      nb::arg("tile") = std::make_tuple(128, 256), nb::arg("interleave") = 1, nb::arg("act") = "q8",
      nb::arg("isa") = nb::none(), nb::arg("threads") = 1, nb::arg("pack") = "blocks",
      "y = W x over a tiled payload (uint8), x float32 (cols); act 'q8' quantizes x to int8 blocks.");

  m.def(
      "gemv_glu",
      [](const std::string& wtype, Bytes tiles, VecF x, int ff, int cols, std::tuple<int, int> tile,
         int interleave, const std::string& glu, const std::string& act, std::optional<std::string> isa,
         int threads, const std::string& pack) {
        const BlockType bt = parse_type(wtype);
        const AType at = parse_act(act);
        const TileLayout L = check(bt, at, tiles, x, 2 * ff, cols, tile, interleave, pack);
        if (L.tr % 2) throw nb::value_error("gemv_glu: tile rows must be even");
        Glu g;
        if (glu == "silu") g = Glu::Silu;
        else if (glu == "gelu_tanh") g = Glu::GeluTanh;
        else throw nb::value_error("glu must be 'silu' or 'gelu_tanh'");
        const Isa i = parse_isa(isa);
        ThreadPool* pool = pool_of(threads);
        OutF h = new_out(ff);
        {
          nb::gil_scoped_release nogil;
          std::vector<uint8_t> xa(act_bytes(bt, at, cols));
          prepare_act(bt, at, xa.data(), x.data(), cols);
          cflow::gemv_glu(at, i, g, h.data(), xa.data(), tiles.data(), L, pool);
        }
        return h;
      },
      nb::arg("wtype"), nb::arg("tiles"), nb::arg("x"), nb::arg("ff"), nb::arg("cols"),
      nb::arg("tile") = std::make_tuple(128, 256), nb::arg("interleave") = 1, nb::arg("glu") = "silu",
      nb::arg("act") = "q8", nb::arg("isa") = nb::none(), nb::arg("threads") = 1, nb::arg("pack") = "blocks",
      "h = glu(gate x) * (up x) in one pass over a gate+up matrix fused by half-stripes.");

  m.def(
      "gemv_time",
      [](const std::string& wtype, Bytes tiles, VecF x, int rows, int cols, std::tuple<int, int> tile,
         int interleave, const std::string& act, std::optional<std::string> isa, int threads, int repeats,
         int warmup, const std::string& pack) {
        const BlockType bt = parse_type(wtype);
        const AType at = parse_act(act);
        const TileLayout L = check(bt, at, tiles, x, rows, cols, tile, interleave, pack);
        const Isa i = parse_isa(isa);
        ThreadPool* pool = pool_of(threads);
        std::vector<double> secs;
        {
          nb::gil_scoped_release nogil;
          std::vector<uint8_t> xa(act_bytes(bt, at, cols));
          std::vector<float> y(rows);
          for (int r = 0; r < warmup + repeats; ++r) {  // the first `warmup` passes are not timed
            const auto t0 = std::chrono::steady_clock::now();
            prepare_act(bt, at, xa.data(), x.data(), cols);
            cflow::gemv(at, i, y.data(), xa.data(), tiles.data(), L, pool);
            const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            if (r >= warmup) secs.push_back(s);
          }
        }
        return secs;
      },
      nb::arg("wtype"), nb::arg("tiles"), nb::arg("x"), nb::arg("rows"), nb::arg("cols"),
      nb::arg("tile") = std::make_tuple(128, 256), nb::arg("interleave") = 1, nb::arg("act") = "q8",
      nb::arg("isa") = nb::none(), nb::arg("threads") = 1, nb::arg("repeats") = 5, nb::arg("warmup") = 1,
      nb::arg("pack") = "blocks",
      "Seconds of each of `repeats` GEMVs (activation quantization included), after `warmup` untimed ones.");

  m.def(
      "gemv_isa",
      [](const std::string& wtype, const std::string& act, std::optional<std::string> isa, const std::string& pack) {
        Isa used = Isa::Scalar;
        if (!gemv_fn(parse_type(wtype), parse_pack(pack), parse_act(act), parse_isa(isa), &used))
          throw nb::value_error("no kernel for this weight/activation pair");
        return std::string(isa_name(used));
      },
      nb::arg("wtype"), nb::arg("act") = "q8", nb::arg("isa") = nb::none(), nb::arg("pack") = "blocks",
      "ISA of the kernel that runs for (wtype, act) when `isa` (default: best) is allowed.");

  m.def(
      "probe_read",
      [](double mib, int threads, int repeats, std::optional<std::string> isa) {
        if (mib <= 0 || threads < 1 || repeats < 1) throw nb::value_error("probe_read: bad arguments");
        const Isa i = parse_isa(isa);
        nb::gil_scoped_release nogil;
        return probe_read((size_t)(mib * (1 << 20)), threads, repeats, i);
      },
      nb::arg("mib") = 1024.0, nb::arg("threads") = 1, nb::arg("repeats") = 5, nb::arg("isa") = nb::none(),
      "STREAM-like read bandwidth (GB/s) of each of `repeats` passes over a buffer of `mib` MiB.");

  m.def("set_num_threads", [](int n) {
    if (n < 1) throw nb::value_error("threads must be >= 1");
    set_num_threads(n);
  });
  m.def("num_threads", [] { return num_threads(); });
}
