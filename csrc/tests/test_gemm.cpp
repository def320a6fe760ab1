// Tile GEMMs: every ISA's kernels (KernelTable) against the scalar references, ragged shapes included.
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
  if (L.bt() == BlockType::F32) {
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
    if (L.bt() == BlockType::Q4_1 || L.bt() == BlockType::Q5_1 || L.bt() == BlockType::Q4_K || L.bt() == BlockType::Q5_K)
      std::memcpy(&w[o + 2], &scales[rng() % 4], 2);
  }
  return w;
}

// A whole-block matrix regrouped into the planes pack (the inverse of unpack_planes): chunk by
// chunk in payload order (tile, group, column block), block i of a g-row chunk put by planes_put.
static std::vector<uint8_t> to_planes(const TileLayout& L, const std::vector<uint8_t>& w) {
  std::vector<uint8_t> p(w.size());
  const int nbr = L.cols / L.qk, bpt = L.tc / L.qk;
  size_t off = 0;
  for (int s0 = 0; s0 < L.rows; s0 += L.tr) {
    const int nr = std::min(L.tr, L.rows - s0);
    for (int cb0 = 0; cb0 < nbr; cb0 += bpt)
      for (int g0 = 0; g0 < nr; g0 += L.g) {
        const int gg = std::min(L.g, nr - g0);
        for (int b = 0; b < std::min(bpt, nbr - cb0); ++b, off += (size_t)gg * L.bb)
          for (int i = 0; i < gg; ++i) planes_put(&p[off], gg, i, L.bt(), &w[off + (size_t)i * L.bb]);
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
static std::vector<const KernelTable*> kernel_tables() {
  std::vector<const KernelTable*> t;
  for (Isa isa : {Isa::Scalar, Isa::Avx2, Isa::Avx512})
    if (isa_supported(isa)) t.push_back(&kernel_table(isa));
  return t;
}

TEST(kernel_table_matches_isa) {
  CHECK(kernel_table(Isa::Scalar).isa == Isa::Scalar);
  CHECK(kernel_table(best_isa()).isa == best_isa());
}

// The one int8 predicate reads the table: every quantized type has the GEMV path, the K-quants
// no GEMM path; the scalar table has an int8 GEMM exactly where the predicate says so.
TEST(int8_paths_follow_the_block_table) {
  for (const BlockTraits& t : kBlockTypes) {
    CHECK(has_int8_path(t.type, false) == (t.elems > 1));
    CHECK(has_int8_path(t.type, true) == (t.elems == QK));
    CHECK((kernel_table(Isa::Scalar).gemm_q8[block_index(t.type)][0] != nullptr) == has_int8_path(t.type, true));
    CHECK((gemv_fn(t.type, Pack::Blocks, AType::Q8, Isa::Scalar) != nullptr) == has_int8_path(t.type, false));
    CHECK(block_traits(t.type) == &t && !std::strcmp(block_name(t.type), t.name));
  }
}

TEST(gemm_matches_reference) {
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> u(-2, 2);
  struct Case { BlockType type; int rows, cols, tr, tc, g; bool planes = false; };
  using B = BlockType;
  const Case cases[] = {
      {B::Q4_1, 200, 96, 40, 64, 4}, {B::Q4_0, 77, 160, 32, 96, 8}, {B::Q8_0, 130, 64, 128, 256, 1},
      {B::Q5_0, 64, 288, 64, 128, 2}, {B::F32, 33, 40, 16, 24, 4}, {B::Q4_1, 576, 576, 128, 256, 4},
      {B::Q4_K, 40, 512, 16, 256, 4}, {B::Q5_1, 77, 160, 32, 96, 8}, {B::Q5_K, 40, 512, 16, 256, 4},
      // planes: full 16-row groups, ragged groups at stripe ends, interleave below 16
      {B::Q4_0, 77, 160, 32, 96, 16, true}, {B::Q4_1, 200, 96, 48, 64, 16, true},
      {B::Q8_0, 130, 64, 128, 256, 16, true}, {B::Q4_1, 100, 288, 64, 128, 8, true},
      {B::Q5_0, 77, 160, 32, 96, 16, true}, {B::Q5_0, 100, 288, 64, 128, 8, true},
      {B::Q5_1, 77, 160, 32, 96, 16, true}, {B::Q5_1, 100, 288, 64, 128, 8, true},
      {B::Q5_K, 40, 512, 16, 256, 16, true},
  };
  for (const Case& c : cases) {
    TileLayout L;
    L.type = (int)c.type; L.rows = c.rows; L.cols = c.cols; L.tr = c.tr; L.tc = c.tc; L.g = c.g;
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
        ref::gemm_f32(L, w.data(), r0, r1, x.data(), L.cols, n, b.data(), nr);
        const bool int8 = has_int8_path(L.bt(), true);
        // int8 activations of one and two levels, quantized by the scalar reference
        QActs one{n, L.cols, 1, nullptr}, two{n, L.cols, 2, nullptr};
        std::vector<uint8_t> b1(one.bytes()), b2(two.bytes()), q(b1.size());
        one.data = b1.data();
        two.data = b2.data();
        std::vector<float> c1(a.size()), c2(a.size());
        if (int8) {
          for (int k = 0; k < n; ++k) ref::quantize_q8a(one.row(k), x.data() + (size_t)k * L.cols, L.cols);
          quantize_acts(x.data(), L.cols, n, L.cols, two);
          CHECK(!std::memcmp(two.row(n - 1), one.row(n - 1), q8a_row_bytes(L.cols)));  // level 1
          ref::gemm_q8(L, w.data(), r0, r1, one, c1.data(), nr);
          ref::gemm_q8(L, w.data(), r0, r1, two, c2.data(), nr);
          CHECK(max_rel(c1, b) < 2e-2f);  // int8 activations stay close to the exact product
          CHECK(max_rel(c2, b) < max_rel(c1, b) / 20 + 1e-5f);  // the second level closes most of the gap
        }
        for (const KernelTable* T : kernel_tables()) {
          T->gemm_f32(L, w.data(), r0, r1, x.data(), L.cols, n, a.data(), nr);
          CHECK(max_rel(a, b) < 1e-5f);
          if (!int8) continue;
          for (int k = 0; k < n; ++k)
            T->quantize_q8a((block_q8a*)(q.data() + k * q8a_row_bytes(L.cols)), x.data() + (size_t)k * L.cols, L.cols);
          CHECK(q == b1);
          const GemmQ8Fn q8 = T->gemm_q8[block_index(L.bt())][L.pack];
          CHECK(q8 != nullptr);
          if (!q8) continue;
          q8(L, w.data(), r0, r1, one, a.data(), nr);
          CHECK(max_rel(a, c1) < 1e-5f);
          q8(L, w.data(), r0, r1, two, a.data(), nr);
          CHECK(max_rel(a, c2) < 1e-5f);
          if (T->isa != best_isa()) continue;
          gemm_q8(L, w.data(), r0, r1, two, a.data(), nr);
          CHECK(max_rel(a, c2) < 1e-5f);
        }
      }
    }
    // rows dequantized one at a time agree with a GEMM against unit vectors
    std::vector<float> row(L.cols), e((size_t)L.cols), y(L.rows);
    const int c0 = L.cols / 2;
    e[c0] = 1.f;
    ref::gemm_f32(L, w.data(), 0, L.rows, e.data(), L.cols, 1, y.data(), L.rows);
    for (int r = 0; r < L.rows; r += 7) {
      dequant_row(L, w.data(), r, row.data());
      CHECK(row[c0] == y[r]);
    }
  }
}

// The largest weights against the largest activations: int16 partial sums (AVX2's maddubs runs)
// must not saturate or wrap. Every quant byte of the planes types at its extreme (nibbles and
// fifth bits all ones, Q8_0 -128), x all equal (every activation byte 127); every ISA's planes
// GEMM against the scalar one. (The K-quants' GEMM is fp32 only: has_int8_path.)
TEST(planes_gemm_holds_extreme_weights) {
  std::mt19937 rng(3);
  for (const BlockTraits& t : kBlockTypes) {
    if (!t.planes_header || !t.gemm_int8) continue;
    TileLayout L;
    L.type = (int)t.type; L.rows = 48; L.cols = 256; L.tr = 48; L.tc = 256; L.g = 16;
    const char* err = nullptr;
    CHECK(make_layout(L, &err));
    auto w = random_matrix(L, rng);
    for (size_t o = 0; o < w.size(); o += L.bb)
      std::memset(&w[o + t.planes_header], t.type == BlockType::Q8_0 ? 0x80 : 0xFF, L.bb - t.planes_header);
    w = to_planes(L, w);
    L.pack = (int)Pack::Planes;
    const int n = 9;
    std::vector<float> x((size_t)n * L.cols, 1.f), a((size_t)n * L.rows), b(a.size());
    for (int levels : {1, 2}) {
      QActs q{n, L.cols, levels, nullptr};
      std::vector<uint8_t> qb(q.bytes());
      q.data = qb.data();
      quantize_acts(x.data(), L.cols, n, L.cols, q);
      ref::gemm_q8(L, w.data(), 0, L.rows, q, b.data(), L.rows);
      for (const KernelTable* T : kernel_tables()) {
        const GemmQ8Fn q8 = T->gemm_q8[block_index(t.type)][L.pack];
        CHECK(q8 != nullptr);
        if (!q8) continue;
        q8(L, w.data(), 0, L.rows, q, a.data(), L.rows);
        const bool ok = max_rel(a, b) < 1e-6f;
        if (!ok) std::fprintf(stderr, "extreme weights: %s %s, %d level(s)\n", t.name, isa_name(T->isa), levels);
        CHECK(ok);
      }
    }
  }
}

// With AVX2, Q8_0's planes GEMM with two levels takes the GEMV's integers and float finish
// (x86/avx2/planes_x16.h): within a column tile each prompt row is, bit for bit, what the GEMV
// computes for that token (across tiles the GEMV adds each tile's sum into y, the GEMM runs one
// sum on, so the rounding differs there). Tokens in runs of 16, 2 and 1 (n = 19), a ragged last
// group, one column tile.
TEST(avx2_q8_0_planes_gemm_is_the_gemv_bit_for_bit) {
  if (!isa_supported(Isa::Avx2)) return;
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> u(-2, 2);
  TileLayout L;
  L.type = (int)BlockType::Q8_0; L.rows = 130; L.cols = 256; L.tr = 128; L.tc = 256; L.g = 16;
  const char* err = nullptr;
  CHECK(make_layout(L, &err));
  auto w = to_planes(L, random_matrix(L, rng));
  L.pack = (int)Pack::Planes;
  CHECK(make_layout(L, &err));
  const int n = 19;
  std::vector<float> x((size_t)n * L.cols), a((size_t)n * L.rows), y(L.rows);
  for (auto& v : x) v = u(rng);
  QActs q{n, L.cols, 2, nullptr};
  std::vector<uint8_t> qb(q.bytes());
  q.data = qb.data();
  quantize_acts(x.data(), L.cols, n, L.cols, q);
  kernel_table(Isa::Avx2).gemm_q8[block_index(BlockType::Q8_0)][L.pack](L, w.data(), 0, L.rows, q, a.data(), L.rows);
  for (int k = 0; k < n; ++k) {  // the two levels of token k lie together, as the GEMV reads them
    gemv(AType::Q8x2, Isa::Avx2, y.data(), q.row(k, 0), w.data(), L, nullptr);
    CHECK(!std::memcmp(y.data(), a.data() + (size_t)k * L.rows, sizeof(float) * L.rows));
  }
}

// Every ISA quantizes activations to exactly the reference's bytes (block_q8a rows with their
// sums, and the K-quants' block_q8_K with bsums), large and tiny values, zero blocks included.
TEST(activation_quantization_is_the_reference_on_every_isa) {
  for (int cols : {256, 512, 544, 768, 4864 / 256 * 256}) {  // 8 to 152 blocks: runs of 16 and their tails
    std::mt19937 rng(cols);
    std::normal_distribution<float> nd(0.f, 2.f);
    std::vector<float> x(cols);
    for (float& v : x) v = nd(rng);
    for (int j = 0; j < 32; ++j) x[j] = 0.f;  // an all-zero block
    for (int j = 256; j < std::min(cols, 512); ++j) x[j] *= 1e-30f;
    std::vector<uint8_t> ra(q8a_row_bytes(cols)), rk(cols / QK_K * sizeof(block_q8_K));
    ref::quantize_q8a((block_q8a*)ra.data(), x.data(), cols);
    ref::quantize_q8_K((block_q8_K*)rk.data(), x.data(), cols);
    for (const KernelTable* T : kernel_tables()) {
      std::vector<uint8_t> a(ra.size()), k(rk.size());
      T->quantize_q8a((block_q8a*)a.data(), x.data(), cols);
      T->quantize_q8K((block_q8_K*)k.data(), x.data(), cols);
      CHECK(a == ra);
      CHECK(k == rk);
    }
  }
}

// NaN and inf activations (hostile weights make them) and blocks so small that 1 / d overflows
// to inf: every ISA gives defined bytes (the reference's conversion saturates as cvtps + packs
// do; a plain cast is undefined behaviour, which scripts/sanitize's UBSan reports), the
// reference's bytes where max |x| is the same (not across NaN: x86 max and fmax treat it apart).
TEST(activation_quantization_of_nonfinite_and_tiny_values_is_defined) {
  const int cols = 512;
  const float inf = INFINITY;
  for (int kase = 0; kase < 4; ++kase) {
    std::vector<float> x(cols);
    for (int j = 0; j < cols; ++j) x[j] = (float)((j * 37) % 19 - 9) * 0.25f;
    if (kase == 0) x[3] = inf, x[40] = -inf, x[300] = inf;                                  // inf
    if (kase == 1) for (int j = 32; j < 64; ++j) x[j] = j % 3 ? 1e-39f * (j % 5) : -3e-40f;  // 1 / d = inf
    if (kase == 2) x[5] = 3e38f, x[6] = -3.4e38f, x[290] = 1e38f;                           // huge
    if (kase == 3) x[7] = NAN, x[33] = -NAN, x[260] = NAN;                                   // NaN
    std::vector<uint8_t> ra(q8a_row_bytes(cols)), rk(cols / QK_K * sizeof(block_q8_K));
    ref::quantize_q8a((block_q8a*)ra.data(), x.data(), cols);
    ref::quantize_q8_K((block_q8_K*)rk.data(), x.data(), cols);
    if (kase == 3) CHECK(((block_q8a*)ra.data())[0].qs[7] == -128 && ((block_q8_K*)rk.data())[1].qs[4] == -128);
    for (const KernelTable* T : kernel_tables()) {
      std::vector<uint8_t> a(ra.size()), k(rk.size());
      T->quantize_q8a((block_q8a*)a.data(), x.data(), cols);
      T->quantize_q8K((block_q8_K*)k.data(), x.data(), cols);
      if (kase == 3) continue;
      for (int b = 0; b < cols / QK; ++b)  // qs and d (s of an inf block is NaN)
        CHECK(!std::memcmp(a.data() + b * sizeof(block_q8a), ra.data() + b * sizeof(block_q8a), QK + 4));
      for (int b = 0; b < cols / QK_K; ++b)
        CHECK(!std::memcmp(k.data() + b * sizeof(block_q8_K), rk.data() + b * sizeof(block_q8_K), 4 + QK_K));
    }
  }
}
