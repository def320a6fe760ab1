// Tile GEMMs: every ISA's kernels (GemmTable) against the scalar references, ragged shapes included.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "cflow/gemm.h"
#include "cflow/planes.h"
#include "test_util.h"

using namespace cflow;

// Random blocks with sane fp16 scales (0.01 .. 0.05), so sums stay finite.
static std::vector<uint8_t> random_matrix(const TileLayout& L, std::mt19937& rng) {
  std::vector<uint8_t> w(layout_nbytes(L));
  for (auto& b : w) b = (uint8_t)rng();
  if (L.type == T_F32) {
    std::uniform_real_distribution<float> u(-1, 1);
    for (size_t i = 0; i < w.size() / 4; ++i) {
      float f = u(rng);
      std::memcpy(&w[i * 4], &f, 4);
    }
    return w;
  }
  const uint16_t scales[] = {0x211f, 0x2666, 0x28cd, 0x2a66};  // ~0.01 .. 0.05
  for (size_t o = 0; o < w.size(); o += L.bb) {
    std::memcpy(&w[o], &scales[rng() % 4], 2);
    if (L.type == T_Q4_1) std::memcpy(&w[o + 2], &scales[rng() % 4], 2);
  }
  return w;
}

// A whole-block matrix regrouped into the planes pack (the inverse of unpack_planes): chunk by
// chunk in payload order (tile, group, column block), block i of a g-row chunk put by planes_put.
static std::vector<uint8_t> to_planes(const TileLayout& L, const std::vector<uint8_t>& w) {
  std::vector<uint8_t> p(w.size());
  const int hdr = planes_header(static_cast<WType>(L.type)), nbr = L.cols / L.qk, bpt = L.tc / L.qk;
  size_t off = 0;
  for (int s0 = 0; s0 < L.rows; s0 += L.tr) {
    const int nr = std::min(L.tr, L.rows - s0);
    for (int cb0 = 0; cb0 < nbr; cb0 += bpt)
      for (int g0 = 0; g0 < nr; g0 += L.g) {
        const int gg = std::min(L.g, nr - g0);
        for (int b = 0; b < std::min(bpt, nbr - cb0); ++b, off += (size_t)gg * L.bb)
          for (int i = 0; i < gg; ++i) planes_put(&p[off], gg, i, hdr, L.bb, &w[off + (size_t)i * L.bb]);
      }
  }
  return p;
}

static float max_rel(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) { num += (a[i] - b[i]) * (a[i] - b[i]); den += b[i] * b[i]; }
  return (float)std::sqrt(num / (den + 1e-30));
}

// The tables of every ISA this CPU runs, scalar included.
static std::vector<const GemmTable*> gemm_tables() {
  std::vector<const GemmTable*> t;
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512})
    if (isa_supported(isa)) t.push_back(&gemm_table(isa));
  return t;
}

TEST(gemm_dispatch_table_matches_isa) {
  CHECK(gemm_table(Isa::Scalar).isa == Isa::Scalar);
  CHECK(gemm_table(best_isa()).isa == best_isa());
}

TEST(gemm_matches_reference) {
  const auto tables = gemm_tables();
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-2, 2);
  struct Case { int type, rows, cols, tr, tc, g; bool planes = false; };
  const Case cases[] = {
      {T_Q4_1, 200, 96, 40, 64, 4}, {T_Q4_0, 77, 160, 32, 96, 8}, {T_Q8_0, 130, 64, 128, 256, 1},
      {T_Q5_0, 64, 288, 64, 128, 2}, {T_F32, 33, 40, 16, 24, 4}, {T_Q4_1, 576, 576, 128, 256, 4},
      // planes: full 16-row groups, ragged groups at stripe ends, interleave below 16
      {T_Q4_0, 77, 160, 32, 96, 16, true}, {T_Q4_1, 200, 96, 48, 64, 16, true},
      {T_Q8_0, 130, 64, 128, 256, 16, true}, {T_Q4_1, 100, 288, 64, 128, 8, true},
  };
  for (const Case& c : cases) {
    TileLayout L;
    L.type = c.type; L.rows = c.rows; L.cols = c.cols; L.tr = c.tr; L.tc = c.tc; L.g = c.g;
    const char* err = nullptr;
    CHECK(make_layout(L, &err));
    auto w = random_matrix(L, rng);
    if (c.planes) {  // same weights, planes pack: every result below must not change
      w = to_planes(L, w);
      L.pack = 1;
      CHECK(make_layout(L, &err));
    }
    for (int n : {1, 3, 9, 20}) {
      std::vector<float> x((size_t)n * L.cols);
      for (auto& v : x) v = u(rng);
      // whole matrix and a share starting at an interior group
      for (int part = 0; part < 2; ++part) {
        const int units = layout_units(L);
        const int r0 = part ? unit_row(L, units / 3) : 0, r1 = part ? unit_row(L, 2 * units / 3 + 1) : L.rows;
        const int nr = r1 - r0;
        std::vector<float> a((size_t)n * nr), b((size_t)n * nr);
        gemm_f32_ref(L, w.data(), r0, r1, x.data(), L.cols, n, b.data(), nr);
        std::vector<int8_t> qr((size_t)n * L.cols);
        std::vector<float> dr((size_t)n * L.cols / 32), sr(dr.size());
        QActs ref_q{n, L.cols, dr.data(), sr.data(), qr.data()};
        if (q8_supported(L.type)) quantize_acts_ref(x.data(), L.cols, n, L.cols, ref_q);
        // the second level: a small residual-like input
        std::vector<float> x2(x.size());
        for (size_t i = 0; i < x.size(); ++i) x2[i] = 0.01f * x[(i * 7) % x.size()];
        for (const GemmTable* T : tables) {
          T->f32(L, w.data(), r0, r1, x.data(), L.cols, n, a.data(), nr);
          CHECK(max_rel(a, b) < 1e-5f);
          if (!q8_supported(L.type)) continue;
          std::vector<int8_t> q((size_t)n * L.cols), q2(q.size());
          std::vector<float> d((size_t)n * L.cols / 32), s(d.size()), d2(d.size()), s2(d.size());
          QActs qa{n, L.cols, d.data(), s.data(), q.data()}, qb{n, L.cols, d2.data(), s2.data(), q2.data()};
          T->quantize(x.data(), L.cols, n, L.cols, qa);
          CHECK(q == qr && d == dr && max_rel(s, sr) < 1e-6f);
          T->q8(L, w.data(), r0, r1, qa, a.data(), nr);
          std::vector<float> c2(a.size());
          gemm_q8_ref(L, w.data(), r0, r1, qa, c2.data(), nr);
          CHECK(max_rel(a, c2) < 1e-5f);
          CHECK(max_rel(a, b) < 2e-2f);  // int8 activations stay close to the exact product
          // two levels: one pass where the ISA has it, else (and always through the
          // dispatcher) the sum of two passes; both equal the sum of two reference passes
          T->quantize(x2.data(), L.cols, n, L.cols, qb);
          std::vector<float> e2(a.size()), r2(a.size());
          gemm_q8_ref(L, w.data(), r0, r1, qb, r2.data(), nr);
          for (size_t i = 0; i < r2.size(); ++i) r2[i] += c2[i];
          if (T->q8x2(L, w.data(), r0, r1, qa, qb, e2.data(), nr)) CHECK(max_rel(e2, r2) < 1e-5f);
          if (T->isa != best_isa()) continue;
          gemm_q8x2(L, w.data(), r0, r1, qa, qb, e2.data(), nr);
          CHECK(max_rel(e2, r2) < 1e-5f);
        }
      }
    }
    // rows dequantized one at a time agree with a GEMM against unit vectors
    std::vector<float> row(L.cols), e((size_t)L.cols), y(L.rows);
    const int c0 = L.cols / 2;
    e[c0] = 1.f;
    gemm_f32_ref(L, w.data(), 0, L.rows, e.data(), L.cols, 1, y.data(), L.rows);
    for (int r = 0; r < L.rows; r += 7) {
      dequant_row(L, w.data(), r, row.data());
      CHECK(row[c0] == y[r]);
    }
  }
}
