// AVX2 + FMA GEMV kernels, int8-activation paths for Q4_0, Q4_1, Q8_0 (without VNNI:
// maddubs + madd). One row at a time, any interleave: a row's blocks are found with TileRow.
// Nibble weights are unsigned (0..15) times signed x; Q8_0 uses |w| times sign(x, w).
#include <immintrin.h>

#include "../../isa_kernels.h"
#include "../../tile_walk.h"

namespace cflow {
namespace avx2 {
namespace {

inline float hsum(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

enum Kind { kQ4_0, kQ4_1, kQ8_0 };

// Dot of one row (nb blocks, block b at row.base + b * row.stride) with xa[0 .. nb-1].
template <Kind K>
inline float row_dot(const TileRow& row, const block_q8a* xa, int nb) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m128i lo4 = _mm_set1_epi8(0x0F);
  __m256 acc = _mm256_setzero_ps();
  float accm = 0.0f;
  for (int b = 0; b < nb; ++b) {
    const uint8_t* p = row.base + b * row.stride;
    const block_q8a& a = xa[b];
    const __m256i xv = _mm256_loadu_si256((const __m256i*)a.qs);
    __m256i s;
    fp16_t dh;
    std::memcpy(&dh, p, 2);
    if (K == kQ8_0) {
      const __m256i w = _mm256_loadu_si256((const __m256i*)(p + 2));
      s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(xv, w)), ones);
    } else {
      const __m128i q = _mm_loadu_si128((const __m128i*)(p + (K == kQ4_1 ? 4 : 2)));
      // low 128 bits: weights 0..15 (low nibbles), high: 16..31, as x's natural order
      const __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), lo4), _mm_and_si128(q, lo4));
      s = _mm256_madd_epi16(_mm256_maddubs_epi16(w, xv), ones);
      if (K == kQ4_0) s = _mm256_sub_epi32(s, _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)a.lsum8), 3));
      if (K == kQ4_1) {
        fp16_t mh;
        std::memcpy(&mh, p + 2, 2);
        accm += fp16_to_f32(mh) * a.s;
      }
    }
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(fp16_to_f32(dh) * a.d), acc);
  }
  return hsum(acc) + accm;
}

template <Kind K, int BB>
void gemv_q8(float* y, const void* xv, const uint8_t* w, int rows, int cols, const TileShape& ts,
             int row_begin, int row_end) {
  const block_q8a* x = (const block_q8a*)xv;
  walk_tiles_whole(y, w, rows, cols, ts, QK, BB, row_begin, row_end,
                   [&](const uint8_t* tile, int r, int nr, int cb0, int nb) {
                     for (int i = 0; i < nr; ++i) y[r + i] += row_dot<K>(TileRow(tile, nr, nb, ts.g, BB, i), x + cb0, nb);
                   });
}

}  // namespace
}  // namespace avx2

const GemvTable& gemv_table_avx2() {
  static GemvTable t = {};
  static const bool filled = [] {
    t[wtype_index(WType::Q4_0)][(int)AType::Q8] = avx2::gemv_q8<avx2::kQ4_0, 18>;
    t[wtype_index(WType::Q4_1)][(int)AType::Q8] = avx2::gemv_q8<avx2::kQ4_1, 20>;
    t[wtype_index(WType::Q8_0)][(int)AType::Q8] = avx2::gemv_q8<avx2::kQ8_0, 34>;
    return true;
  }();
  (void)filled;
  return t;
}

}  // namespace cflow
