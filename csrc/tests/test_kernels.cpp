// Kernel tests without Python: every GEMV kernel and ISA path against the scalar reference on
// random shapes (ragged stripes and column tiles, several interleaves), the scalar reference
// against a plain dequantize-and-dot, fused GLU, the thread pool and the probe.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cflow/kernels.h"
#include "cflow/planes.h"
#include "cflow/threadpool.h"
#include "test_util.h"

using namespace cflow;

namespace {

// A tiling to test: tile rows and columns, interleave, pack.
struct Tiling {
  int tr = 128, tc = 256, g = 1;
  Pack pack = Pack::Blocks;
};

TileLayout layout(BlockType wt, int rows, int cols, const Tiling& ts) {
  const char* err = nullptr;
  const TileLayout L = tile_layout(wt, rows, cols, ts.tr, ts.tc, ts.g, ts.pack, &err);
  if (err) std::fprintf(stderr, "bad test layout: %s\n", err);
  return L;
}

std::mt19937_64& rng() {
  static std::mt19937_64 r(1234);
  return r;
}

// Random row-major encoded matrix (rows, cols): random bytes with sane scales (|d| ~ 1e-2).
std::vector<uint8_t> random_rows(BlockType wt, int rows, int cols) {
  const int bb = block_bytes(wt), qk = block_elems(wt);
  const size_t nblk = (size_t)rows * (cols / qk);
  std::vector<uint8_t> m(nblk * bb);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& v : m) v = (uint8_t)byte(rng());
  for (size_t i = 0; i < nblk; ++i) {
    uint8_t* p = m.data() + i * bb;
    auto put16 = [](uint8_t* q, uint16_t v) { std::memcpy(q, &v, 2); };
    switch (wt) {
      case BlockType::F32: {
        float f = u(rng());
        std::memcpy(p, &f, 4);
        break;
      }
      case BlockType::F16: put16(p, f32_to_fp16(u(rng()))); break;
      case BlockType::BF16: put16(p, f32_to_bf16(u(rng()))); break;
      case BlockType::Q4_0: case BlockType::Q5_0: case BlockType::Q8_0: put16(p, f32_to_fp16(0.01f * u(rng()))); break;
      case BlockType::Q4_1: case BlockType::Q5_1:
        put16(p, f32_to_fp16(0.01f * u(rng()))); put16(p + 2, f32_to_fp16(0.05f * u(rng()))); break;
      case BlockType::Q4_K: case BlockType::Q5_K: put16(p, f32_to_fp16(0.001f * u(rng()))); put16(p + 2, f32_to_fp16(0.001f * u(rng()))); break;
      case BlockType::Q6_K: case BlockType::TQ1_0: case BlockType::TQ2_0:  // d: the last two bytes
        put16(p + bb - 2, f32_to_fp16(0.001f * u(rng())));
        break;
    }
  }
  return m;
}

// Tiled payload of a row-major matrix (the permutation of format/tiles.py).
std::vector<uint8_t> pack(BlockType wt, const std::vector<uint8_t>& rm, int rows, int cols, const Tiling& ts) {
  const int bb = block_bytes(wt), qk = block_elems(wt), nbr = cols / qk, bpt = ts.tc / qk;
  std::vector<uint8_t> out(rm.size());
  size_t o = 0;
  for (int r0 = 0; r0 < rows; r0 += ts.tr) {
    const int nr = std::min(ts.tr, rows - r0);
    for (int b0 = 0; b0 < nbr; b0 += bpt) {
      const int nb = std::min(bpt, nbr - b0);
      for (int g0 = 0; g0 < nr; g0 += ts.g) {
        const int g = std::min(ts.g, nr - g0);
        for (int b = 0; b < nb; ++b, o += (size_t)g * bb)
          for (int i = 0; i < g; ++i) {
            const uint8_t* blk = &rm[((size_t)(r0 + g0 + i) * nbr + b0 + b) * bb];
            if (ts.pack == Pack::Planes) planes_put(&out[o], g, i, wt, blk);
            else std::memcpy(&out[o + (size_t)i * bb], blk, bb);
          }
      }
    }
  }
  return out;
}

std::vector<float> random_x(int n) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(n);
  for (auto& v : x) v = nd(rng());
  return x;
}

// Plain reference in double: y = deq(W) x, and the scale sum_j |w_ij x_j| per row.
void naive(BlockType wt, const std::vector<uint8_t>& rm, int rows, int cols, const std::vector<float>& x,
           std::vector<double>& y, std::vector<double>& scale) {
  const int nbr = cols / block_elems(wt);
  std::vector<float> wr(cols);
  y.assign(rows, 0.0);
  scale.assign(rows, 0.0);
  for (int r = 0; r < rows; ++r) {
    ref::dequantize(wt, rm.data() + (size_t)r * nbr * block_bytes(wt), nbr, wr.data());
    for (int j = 0; j < cols; ++j) {
      y[r] += (double)wr[j] * x[j];
      scale[r] += std::fabs((double)wr[j] * x[j]);
    }
  }
}

const BlockType kAll[] = {BlockType::F32, BlockType::F16, BlockType::BF16, BlockType::Q4_0, BlockType::Q4_1,
                      BlockType::Q5_0, BlockType::Q5_1, BlockType::Q8_0, BlockType::Q4_K, BlockType::Q5_K,
                      BlockType::Q6_K, BlockType::TQ1_0, BlockType::TQ2_0};

}  // namespace

TEST(scalar_reference_matches_naive_dot) {
  for (BlockType wt : kAll) {
    const int qk = block_elems(wt);
    const int rows = 131, cols = qk == 256 ? 768 : 288;  // ragged stripe and column tile
    Tiling ts{128, 256, 4};
    auto rm = random_rows(wt, rows, cols);
    auto tiled = pack(wt, rm, rows, cols, ts);
    auto x = random_x(cols);
    std::vector<double> yn, sc;
    naive(wt, rm, rows, cols, x, yn, sc);
    std::vector<float> y(rows);
    gemv_fn(wt, Pack::Blocks, AType::F32, Isa::Scalar)(y.data(), x.data(), tiled.data(), layout(wt, rows, cols, ts), 0,
                                                       rows);
    bool ok = true;
    for (int r = 0; r < rows; ++r) ok &= std::fabs(y[r] - yn[r]) <= 1e-5 * sc[r] + 1e-30;
    if (!ok) std::fprintf(stderr, "type %s\n", block_name(wt));
    CHECK(ok);
  }
}

namespace {
// Compares the kernel of `isa` for (wt, at) with the scalar kernel of the same pair:
// |y - y_ref| <= 1e-5 * sum_j |w_ij x_j| per row (the fp32 rounding scale of a dot product).
bool compare_isa(BlockType wt, AType at, Isa isa, int rows, int cols, const Tiling& ts) {
  auto rm = random_rows(wt, rows, cols);
  auto tiled = pack(wt, rm, rows, cols, ts);
  auto x = random_x(cols);
  std::vector<uint8_t> xa(act_bytes(wt, at, cols));
  prepare_act(wt, at, xa.data(), x.data(), cols);
  std::vector<double> yn, sc;
  naive(wt, rm, rows, cols, x, yn, sc);
  std::vector<float> y(rows, NAN), yr(rows, NAN);
  const TileLayout L = layout(wt, rows, cols, ts);
  gemv_fn(wt, ts.pack, at, Isa::Scalar)(yr.data(), xa.data(), tiled.data(), L, 0, rows);
  // two halves on stripe boundaries, as two threads would run them
  const int mid = ((rows / ts.tr) / 2) * ts.tr;
  Isa used = Isa::Scalar;
  GemvFn fn = gemv_fn(wt, ts.pack, at, isa, &used);
  if (used != isa) {  // every pair has its own kernel on every ISA
    std::fprintf(stderr, "%s %s: asked %s, runs %s\n", block_name(wt), at == AType::F32 ? "f32" : at == AType::Q8 ? "q8" : "q8x2",
                 isa_name(isa), isa_name(used));
    return false;
  }
  fn(y.data(), xa.data(), tiled.data(), L, 0, mid);
  fn(y.data() + mid, xa.data(), tiled.data(), L, mid, rows);
  bool ok = true;
  double worst = 0.0;
  if (ts.pack == Pack::Planes && at == AType::F32)  // the planes scalar path is the whole-block one
    for (int r = 0; r < rows; ++r) ok &= std::fabs(yr[r] - yn[r]) <= 1e-5 * sc[r] + 1e-30;
  for (int r = 0; r < rows; ++r) {
    ok &= std::fabs(y[r] - yr[r]) <= 1e-5 * sc[r] + 1e-30;
    worst = std::max(worst, std::fabs(y[r] - yr[r]) / (sc[r] + 1e-30));
  }
  if (!ok)
    std::fprintf(stderr, "worst |y - y_ref| / sum|w x| = %.3g; ", worst);
  if (!ok)
    std::fprintf(stderr, "mismatch: %s %s %s rows=%d cols=%d tile=(%d,%d,g=%d)\n", block_name(wt),
                 at == AType::F32 ? "f32" : at == AType::Q8 ? "q8" : "q8x2", isa_name(isa), rows, cols, ts.tr, ts.tc, ts.g);
  if (!ok && ts.pack == Pack::Planes) std::fprintf(stderr, "  (planes pack)\n");
  return ok;
}
}  // namespace

// Two-level int8 activations (quantize_act): level 2 at exactly d1 / 256 per block, so that the
// AVX-512 kernels may sum the levels' integers as 256 S + T; level 1 + level 2 within d1 / 512 of
// x; a block of near-zero activations (d1 / 256 not a normal float) zero in both levels; and the
// kernels of every ISA on such a row still agree with the scalar one.
TEST(two_level_activations_keep_their_scale_ratio) {
  const int cols = 256;
  auto x = random_x(cols);
  for (int j = 64; j < 96; ++j) x[j] *= 1e-36f;  // block 2: |x| < 2^-111
  std::vector<uint8_t> xa(act_bytes(BlockType::Q4_0, AType::Q8x2, cols));
  prepare_act(BlockType::Q4_0, AType::Q8x2, xa.data(), x.data(), cols);
  const block_q8a* l1 = (const block_q8a*)xa.data();
  const block_q8a* l2 = (const block_q8a*)(xa.data() + q8a_row_bytes(cols));
  bool ok = true;
  for (int b = 0; b < cols / QK; ++b) {
    ok &= l2[b].d == l1[b].d / 256.0f;
    for (int j = 0; j < QK; ++j) {
      ok &= std::abs((int)l2[b].qs[j]) <= 127;
      const float v = l1[b].d * l1[b].qs[j] + l2[b].d * l2[b].qs[j];
      ok &= std::fabs(v - x[b * QK + j]) <= l1[b].d / 512.0f * 1.0001f + (b == 2 ? 1e-33f : 0.0f);
    }
  }
  ok &= l1[2].d == 0.0f && l2[2].d == 0.0f;
  CHECK(ok);
  // every table's level 2 gives the reference's bytes (from level-1 bytes that are the same):
  // this row, and rows of 24 and 48 blocks (the AVX-512 code divides scales 16 blocks at a time)
  // with infinities, huge, tiny and near-zero blocks in them
  std::vector<std::vector<float>> rows{x};
  for (int n : {768, 1536}) {
    auto r = random_x(n);
    for (int j = 64; j < 96; ++j) r[j] *= 1e-36f;
    for (int j = 512; j < 544; ++j) r[j] = j % 3 ? 1e-39f * (j % 5) : -3e-40f;
    r[5] = INFINITY, r[700] = -3.4e38f, r[n - 1] = 3e38f;
    rows.push_back(r);
  }
  for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
    if (!isa_supported(isa)) continue;
    for (const auto& v : rows) {
      const int n = (int)v.size();
      std::vector<uint8_t> a1(q8a_row_bytes(n)), b1, a2(q8a_row_bytes(n)), b2(a2.size());
      ref::quantize_q8a((block_q8a*)a1.data(), v.data(), n);
      b1 = a1;
      ref::quantize_q8a_level2((block_q8a*)a2.data(), (block_q8a*)a1.data(), v.data(), n);
      kernel_table(isa).quantize_q8a_level2((block_q8a*)b2.data(), (block_q8a*)b1.data(), v.data(), n);
      bool same = a1 == b1;
      for (int b = 0; b < n / QK; ++b)  // qs and d (s of an infinite block is NaN in both)
        same &= !std::memcmp(a2.data() + b * sizeof(block_q8a), b2.data() + b * sizeof(block_q8a), QK + 4);
      if (!same) std::fprintf(stderr, "level 2 bytes differ: %s, %d columns\n", isa_name(isa), n);
      CHECK(same);
    }
  }
  for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
    if (!isa_supported(isa)) continue;
    for (BlockType wt : {BlockType::Q4_0, BlockType::Q4_1, BlockType::Q5_0, BlockType::Q5_1, BlockType::Q8_0})
      for (Pack pk : {Pack::Blocks, Pack::Planes}) {
        const int rows = 48;
        const Tiling ts{32, 256, 16, pk};
        auto rm = random_rows(wt, rows, cols);
        const auto tiled = pack(wt, rm, rows, cols, ts);
        const TileLayout L = layout(wt, rows, cols, ts);
        std::vector<double> yn, sc;
        naive(wt, rm, rows, cols, x, yn, sc);
        std::vector<float> y(rows), yr(rows);
        gemv_fn(wt, pk, AType::Q8x2, Isa::Scalar)(yr.data(), xa.data(), tiled.data(), L, 0, rows);
        gemv_fn(wt, pk, AType::Q8x2, isa)(y.data(), xa.data(), tiled.data(), L, 0, rows);
        bool same = true;
        for (int r = 0; r < rows; ++r) same &= std::fabs(y[r] - yr[r]) <= 1e-5 * sc[r] + 1e-30;
        if (!same) std::fprintf(stderr, "two levels, a near-zero block: %s %s %s\n", block_name(wt), pack_name(pk), isa_name(isa));
        CHECK(same);
      }
  }
}

TEST(simd_paths_match_scalar_on_ragged_shapes) {
  std::uniform_int_distribution<int> ri(1, 300);
  for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
    if (!isa_supported(isa)) continue;
    for (BlockType wt : kAll) {
      const int qk = block_elems(wt);
      for (AType at : {AType::F32, AType::Q8, AType::Q8x2}) {
        if (at != AType::F32 && !has_int8_path(wt, false)) continue;
        for (int g : {1, 2, 4, 8, 16}) {
          const int rows = ri(rng());
          const int cols = qk == 1 ? ri(rng()) + 7 : qk * (1 + ri(rng()) % (qk == 256 ? 5 : 20));
          const int tc = qk == 256 ? 256 : (g % 2 ? 256 : 128);
          CHECK(compare_isa(wt, at, isa, rows, cols, Tiling{128, tc, g}));
        }
        CHECK(compare_isa(wt, at, isa, 100, qk == 1 ? 300 : 8 * qk, Tiling{32, qk == 256 ? 512 : 64, 32}));
        CHECK(compare_isa(wt, at, isa, 259, qk == 256 ? 1024 : 640, Tiling{128, qk == 256 ? 1024 : 640, 1}));
        if (!planes_header(wt)) continue;
        for (int g : {1, 4, 12, 16}) {  // the planes pack: full and ragged groups of up to 16 rows
          const int rows = ri(rng());
          CHECK(compare_isa(wt, at, isa, rows, qk * (1 + ri(rng()) % 20), Tiling{96, 256, g, Pack::Planes}));
        }
      }
    }
  }
}

// The largest weights against the largest activations: the int16 partial sums of the int8 GEMVs
// (AVX2's maddubs runs, the K-quants' scaled pair sums) must not saturate or wrap. Every quant byte
// at its extreme (nibbles, fifth bits and scales all ones; Q8_0 -128), x all equal (every
// activation byte 127); each ISA's int8 GEMV, both packs, against the scalar one.
TEST(int8_gemv_holds_extreme_weights) {
  for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
    if (!isa_supported(isa)) continue;
    for (BlockType wt : kAll) {
      if (!has_int8_path(wt, false)) continue;
      const int qk = block_elems(wt), bb = block_bytes(wt), rows = 40, cols = 4 * std::max(qk, 64);
      // the quant bytes: all but the leading header (d, and m / dmin), or (Q6_K, the ternary
      // types) all but d at the end
      int lead = 0;
      switch (wt) {
        case BlockType::Q4_0: case BlockType::Q5_0: case BlockType::Q8_0: lead = 2; break;
        case BlockType::Q4_1: case BlockType::Q5_1: case BlockType::Q4_K: case BlockType::Q5_K: lead = 4; break;
        default: break;
      }
      const int q0 = lead, q1 = lead ? bb : bb - 2;
      auto rm = random_rows(wt, rows, cols);
      for (size_t o = 0; o < rm.size(); o += bb) std::memset(&rm[o + q0], wt == BlockType::Q8_0 ? 0x80 : 0xFF, q1 - q0);
      const std::vector<float> x(cols, 1.0f);
      std::vector<double> yn, sc;
      naive(wt, rm, rows, cols, x, yn, sc);
      for (Pack pk : {Pack::Blocks, Pack::Planes}) {
        if (pk == Pack::Planes && !planes_header(wt)) continue;
        const Tiling ts{32, 256, 16, pk};
        const auto tiled = pack(wt, rm, rows, cols, ts);
        const TileLayout L = layout(wt, rows, cols, ts);
        for (AType at2 : {AType::Q8, AType::Q8x2}) {
          std::vector<uint8_t> xa(act_bytes(wt, at2, cols));
          prepare_act(wt, at2, xa.data(), x.data(), cols);
          std::vector<float> y(rows), yr(rows);
          gemv_fn(wt, pk, at2, Isa::Scalar)(yr.data(), xa.data(), tiled.data(), L, 0, rows);
          gemv_fn(wt, pk, at2, isa)(y.data(), xa.data(), tiled.data(), L, 0, rows);
          bool ok = true;
          for (int r = 0; r < rows; ++r) ok &= std::fabs(y[r] - yr[r]) <= 1e-5 * sc[r] + 1e-30;
          if (!ok) std::fprintf(stderr, "extreme weights: %s %s %s %s\n", block_name(wt), pack_name(pk),
                                at2 == AType::Q8 ? "q8" : "q8x2", isa_name(isa));
          CHECK(ok);
        }
      }
    }
  }
}

// m tokens through `batch` and, one by one, through the GEMV of the same (wt, pack, at): the same
// floats, bit for bit (rows in two calls: the first stripe, then the rest).
static bool batch_matches(Isa isa, BlockType wt, AType at, const Tiling& ts, int m, GemvBatchFn batch, int rows,
                          int cols, const std::vector<uint8_t>& tiled) {
  GemvFn one = gemv_fn(wt, ts.pack, at, isa);
  const TileLayout L = layout(wt, rows, cols, ts);
  const size_t ab = act_bytes(wt, at, cols);
  std::vector<uint8_t> xa(m * ab);
  for (int k = 0; k < m; ++k) prepare_act(wt, at, xa.data() + k * ab, random_x(cols).data(), cols);
  const int r0 = std::min(ts.tr, rows), r1 = rows;  // from the second stripe on (rows < tr: nothing)
  const int ldy = rows + 5;
  std::vector<float> yb((size_t)m * ldy, NAN), y1((size_t)m * ldy, NAN);
  batch(yb.data(), ldy, xa.data(), m, tiled.data(), L, 0, r0);
  batch(yb.data() + r0, ldy, xa.data(), m, tiled.data(), L, r0, r1);
  for (int k = 0; k < m; ++k) {
    one(y1.data() + (size_t)k * ldy, xa.data() + k * ab, tiled.data(), L, 0, r0);
    one(y1.data() + (size_t)k * ldy + r0, xa.data() + k * ab, tiled.data(), L, r0, r1);
  }
  bool same = true;
  for (int k = 0; k < m; ++k)
    same &= std::memcmp(yb.data() + (size_t)k * ldy, y1.data() + (size_t)k * ldy, sizeof(float) * rows) == 0;
  if (!same)
    std::fprintf(stderr, "batched != alone: %s %s %s m=%d rows=%d cols=%d g=%d\n", isa_name(isa), block_name(wt),
                 at == AType::Q8 ? "q8" : "q8x2", m, rows, cols, ts.g);
  return same;
}

// The batched GEMV gives every token exactly (bitwise) what the GEMV gives it alone, for batches
// of one to more than one A tile of tokens, full and ragged groups, several column tiles, on
// every SIMD ISA the CPU has (the engine runs one, the test all); it exists for every planes type
// on AVX2 and AVX-512 (AMX where usable, else VNNI), and for the ternary types' whole blocks with
// one int8 level.
TEST(batched_gemv_is_bitwise_the_gemv_of_each_token) {
  bool any = false;
  std::uniform_int_distribution<int> ri(1, 300);
  for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
    if (!isa_supported(isa)) continue;
    for (BlockType wt : kAll)
      for (AType at : {AType::Q8, AType::Q8x2})
        for (int g : {16, 12, 4}) {
          if (!planes_header(wt)) continue;
          const Tiling ts{96, 256, g, Pack::Planes};
          GemvBatchFn batch = gemv_batch_fn(wt, ts.pack, at, isa);
          CHECK(batch);  // every planes type has one on AVX2 and AVX-512
          if (!batch) continue;
          any = true;
          const int qk = block_elems(wt), rows = 16 + ri(rng()), cols = qk * (1 + ri(rng()) % (qk == 256 ? 5 : 24));
          const auto tiled = pack(wt, random_rows(wt, rows, cols), rows, cols, ts);
          for (int m : {1, 2, 3, 8, 9, 16, 17, 33}) CHECK(batch_matches(isa, wt, at, ts, m, batch, rows, cols, tiled));
        }
    for (BlockType wt : {BlockType::TQ1_0, BlockType::TQ2_0})  // whole blocks, one level
      for (const Tiling& ts : {Tiling{96, 256, 1, Pack::Blocks}, Tiling{64, 512, 4, Pack::Blocks}}) {
        GemvBatchFn batch = gemv_batch_fn(wt, ts.pack, AType::Q8, isa);
        CHECK(batch);
        if (!batch) continue;
        any = true;
        const int rows = 16 + ri(rng()), cols = 256 * (2 + ri(rng()) % 5);
        const auto tiled = pack(wt, random_rows(wt, rows, cols), rows, cols, ts);
        for (int m : {1, 2, 7, 8, 9, 17}) CHECK(batch_matches(isa, wt, AType::Q8, ts, m, batch, rows, cols, tiled));
      }
  }
  if (!any) std::fprintf(stderr, "  (no batched GEMV on this CPU: nothing to compare)\n");
}

// Activation stamps (kernels.h): calls under one stamp over the same activations give what calls
// without one give; new bytes at the same pointer under a new stamp are laid out anew, as is
// another token count under the same stamp.
TEST(acts_stamp_keeps_a_layout_only_for_the_same_activations) {
  for (Isa isa : {Isa::Avx2, Isa::Avx512}) {
    if (!isa_supported(isa)) continue;
    for (BlockType wt : {BlockType::Q4_1, BlockType::Q5_0, BlockType::Q4_K, BlockType::Q6_K})
      for (AType at : {AType::Q8, AType::Q8x2}) {
        const Tiling ts{96, 256, 16, Pack::Planes};
        GemvBatchFn batch = gemv_batch_fn(wt, ts.pack, at, isa);
        GemvFn one = gemv_fn(wt, ts.pack, at, isa);
        CHECK(batch && one);
        if (!batch || !one) continue;
        const int rows = 200, cols = block_elems(wt) == 256 ? 1024 : 576, ldy = rows, h = 96;
        const auto tiled = pack(wt, random_rows(wt, rows, cols), rows, cols, ts);
        const TileLayout L = layout(wt, rows, cols, ts);
        const size_t ab = act_bytes(wt, at, cols);
        std::vector<uint8_t> xa(8 * ab);
        auto fill = [&] {
          for (int k = 0; k < 8; ++k) prepare_act(wt, at, xa.data() + k * ab, random_x(cols).data(), cols);
          return xa;
        };
        // rows [r0, r1) of m tokens of activations a (m == 1: the one-token GEMV), under `stamp`
        auto run = [&](const std::vector<uint8_t>& a, int m, int r0, int r1, uint64_t stamp) {
          std::vector<float> y((size_t)m * ldy);
          set_acts_stamp(stamp);
          if (m == 1) one(y.data(), a.data(), tiled.data(), L, r0, r1);
          else batch(y.data(), ldy, a.data(), m, tiled.data(), L, r0, r1);
          set_acts_stamp(0);
          return y;
        };
        auto same = [&](const std::vector<float>& a, const std::vector<float>& b) {
          return a.size() == b.size() && std::memcmp(a.data(), b.data(), sizeof(float) * a.size()) == 0;
        };
        const auto A = fill();
        const uint64_t s1 = new_acts_stamp(), s2 = new_acts_stamp();
        CHECK(s1 && s2 && s1 != s2);
        const auto a_lo = run(xa, 8, 0, h, s1), a_hi = run(xa, 8, h, rows, s1);  // the second keeps A's layout
        const auto B = fill();  // new bytes at the same pointer, under a new stamp: laid out anew
        const auto b_hi = run(xa, 8, h, rows, s2), b_lo = run(xa, 8, 0, h, s2);
        const auto b3 = run(xa, 3, h, rows, s2), b1 = run(xa, 1, h, rows, s2);  // other counts, same stamp
        CHECK(same(a_lo, run(A, 8, 0, h, 0)) && same(a_hi, run(A, 8, h, rows, 0)));
        CHECK(same(b_hi, run(B, 8, h, rows, 0)) && same(b_lo, run(B, 8, 0, h, 0)));
        CHECK(same(b3, run(B, 3, h, rows, 0)) && same(b1, run(B, 1, h, rows, 0)));
      }
  }
}

