// AVX-512 (F/BW/VL/DQ + VNNI) GEMV kernels, int8-activation paths.
//
// The unit of work is a quad: 4 rows x 1 column block. With interleave g >= 4 a quad's 4 blocks
// are contiguous in the tile (72 bytes for Q4_0), so two loads and one vpermt2w put block k's
// 16 nibble bytes in 128-bit lane k and its scale in float lanes 4k..4k+3; the activation
// block is broadcast to all four lanes and one vpdpbusd per nibble half gives every row's
// partial dot product. Rows of a ragged group (or interleave 1 and 2) are gathered from 4
// pointers instead (a missing row repeats the last one; its result is dropped).
// Weight nibbles are unsigned (0..15); the -8 offset of Q4_0 enters as the initial value of
// the int32 accumulator, -8 * (lane sums of the activation), precomputed in block_q8a.
#include <immintrin.h>

#include <type_traits>

#include "../../isa_kernels.h"
#include "../../tile_walk.h"

namespace cflow {
namespace avx512 {
namespace {

// vpermt2w index: word k*per + j picks word src(k, j) of the 128-byte pair (a, b).
struct WordIdx {
  alignas(64) uint16_t v[32];
};

template <class F>
WordIdx make_idx(F f) {
  WordIdx w;
  for (int i = 0; i < 32; ++i) w.v[i] = (uint16_t)f(i);
  return w;
}

inline __m512i load_idx(const WordIdx& w) { return _mm512_load_si512(w.v); }

// Sum the 4 float lanes of each 128-bit lane of acc, add them to y[0..3].
inline void add_quad(float* y, __m512 acc) {
  __m512 t = _mm512_add_ps(acc, _mm512_permute_ps(acc, 0x4E));
  t = _mm512_add_ps(t, _mm512_permute_ps(t, 0xB1));
  const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m128 s = _mm512_castps512_ps128(_mm512_permutexvar_ps(pick, t));
  _mm_storeu_ps(y, _mm_add_ps(_mm_loadu_ps(y), s));
}

// Add the 4 row sums of acc to y[0 .. n-1] (n < 4: ragged quad).
inline void add_quad_n(float* y, __m512 acc, int n) {
  if (n == 4) return add_quad(y, acc);
  float t[4] = {0, 0, 0, 0};
  add_quad(t, acc);
  for (int i = 0; i < n; ++i) y[i] += t[i];
}

// ---- quad loaders of the 4-bit types: qs (block k's 16 bytes in lane k), d (and m) ----

// Q4_0 / Q4_1 blocks: scale words at 0 (and 1), qs from byte QSOFF.
template <int BB, int QSOFF, bool HAS_M>
struct Nib {
  static constexpr int kBB = BB;
  static constexpr int kWords = BB / 2;
  static const WordIdx& idx_qs() {
    static const WordIdx w = make_idx([](int i) { return (i / 8) * kWords + QSOFF / 2 + i % 8; });
    return w;
  }
  static const WordIdx& idx_dm() {  // words 0..15: d of block i/4; 16..31: m of block (i-16)/4
    static const WordIdx w = make_idx([](int i) { return ((i % 16) / 4) * kWords + (i >= 16 ? 1 : 0); });
    return w;
  }
  // 4 contiguous blocks at p.
  static inline void load(const uint8_t* p, __m512i& qs, __m512& d, __m512& m) {
    const __m512i a = _mm512_loadu_si512(p);
    const __m512i b = _mm512_maskz_loadu_epi16((__mmask32)((1u << (2 * BB - 32)) - 1), p + 64);
    qs = _mm512_permutex2var_epi16(a, load_idx(idx_qs()), b);
    const __m512i dm = _mm512_permutex2var_epi16(a, load_idx(idx_dm()), b);
    d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    if (HAS_M) m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
  }
  // 4 blocks at 4 pointers.
  static inline void load4(const uint8_t* const* p, __m512i& qs, __m512& d, __m512& m) {
    __m512i q = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)(p[0] + QSOFF)));
    q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i*)(p[1] + QSOFF)), 1);
    q = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i*)(p[2] + QSOFF)), 2);
    qs = _mm512_inserti32x4(q, _mm_loadu_si128((const __m128i*)(p[3] + QSOFF)), 3);
    const uint16_t* h[4] = {(const uint16_t*)p[0], (const uint16_t*)p[1], (const uint16_t*)p[2], (const uint16_t*)p[3]};
    const __m128i dv = _mm_setr_epi16(h[0][0], h[1][0], h[2][0], h[3][0], h[0][1], h[1][1], h[2][1], h[3][1]);
    const __m512 dm = _mm512_castps256_ps512(_mm256_cvtph_ps(dv));  // d0..d3 m0..m3
    const __m512i sel_d = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    d = _mm512_permutexvar_ps(sel_d, dm);
    if (HAS_M) m = _mm512_permutexvar_ps(_mm512_add_epi32(sel_d, _mm512_set1_epi32(4)), dm);
  }
};

using Q4_0 = Nib<18, 2, false>;
using Q4_1 = Nib<20, 4, true>;

// One quad (4 rows) over nb column blocks of 4-bit weights. CONTIG: the quad's 4 blocks of
// column block b are contiguous at q0 + b * stride (rows of one interleave group, g >= 4);
// else row k's block b is at rows[k].base + b * rows[k].stride.
template <class T, bool CONTIG>
inline __m512 quad_nib(const uint8_t* q0, size_t stride, const TileRow* rows, const block_q8a* xa, int nb) {
  constexpr bool kOff = !std::is_same<T, Q4_1>::value;  // Q4_0: q - 8; Q4_1: d*q + m
  const __m512i lo4 = _mm512_set1_epi8(0x0F);
  __m512 acc = _mm512_setzero_ps();
  __m512 accm = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const block_q8a& a = xa[b];
    __m512i qs;
    __m512 d, m;
    if (CONTIG) T::load(q0 + b * stride, qs, d, m);
    else {
      const uint8_t* p[4] = {rows[0].base + b * rows[0].stride, rows[1].base + b * rows[1].stride,
                             rows[2].base + b * rows[2].stride, rows[3].base + b * rows[3].stride};
      T::load4(p, qs, d, m);
    }
    const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)a.qs));
    const __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(a.qs + 16)));
    __m512i s = _mm512_setzero_si512();
    if (kOff)  // -8 * lane sums of x
      s = _mm512_sub_epi32(s, _mm512_slli_epi32(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)a.lsum4)), 3));
    s = _mm512_dpbusd_epi32(s, _mm512_and_si512(qs, lo4), xlo);
    s = _mm512_dpbusd_epi32(s, _mm512_and_si512(_mm512_srli_epi16(qs, 4), lo4), xhi);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(d, _mm512_set1_ps(a.d)), acc);
    if (!kOff) accm = _mm512_fmadd_ps(m, _mm512_set1_ps(a.s * 0.25f), accm);  // 4 lanes per row
  }
  return kOff ? acc : _mm512_add_ps(acc, accm);
}

// Runs quad(q0, stride, rows, n) over every 4 rows of a tile: contiguous quads inside full
// groups when g % 4 == 0, gathered quads for the rest (a ragged last group, or g < 4).
template <class Quad>
inline void for_each_quad(const uint8_t* tile, int nr, int nb, int g, int bb, Quad&& quad) {
  int i = 0;
  if (g % 4 == 0)
    for (; i + g <= nr; i += g)
      for (int k = 0; k < g; k += 4) quad(i + k, tile + ((size_t)i * nb + k) * bb, (size_t)g * bb, nullptr, 4);
  for (; i < nr; i += 4) {
    const int n = nr - i < 4 ? nr - i : 4;
    const TileRow rows[4] = {TileRow(tile, nr, nb, g, bb, i), TileRow(tile, nr, nb, g, bb, i + (n > 1 ? 1 : 0)),
                             TileRow(tile, nr, nb, g, bb, i + (n > 2 ? 2 : n - 1)),
                             TileRow(tile, nr, nb, g, bb, i + (n > 3 ? 3 : n - 1))};
    quad(i, nullptr, 0, rows, n);
  }
}

template <class T>
void gemv_nib_q8(float* y, const void* xv, const uint8_t* w, int rows, int cols, const TileShape& ts,
                 int row_begin, int row_end) {
  const block_q8a* x = (const block_q8a*)xv;
  walk_tiles_whole(y, w, rows, cols, ts, QK, T::kBB, row_begin, row_end,
                   [&](const uint8_t* tile, int r, int nr, int cb0, int nb) {
                     for_each_quad(tile, nr, nb, ts.g, T::kBB,
                                   [&](int i, const uint8_t* q0, size_t stride, const TileRow* tr, int n) {
                                     if (q0) add_quad(y + r + i, quad_nib<T, true>(q0, stride, nullptr, x + cb0, nb));
                                     else add_quad_n(y + r + i, quad_nib<T, false>(nullptr, 0, tr, x + cb0, nb), n);
                                   });
                   });
}

// Q8_0 x int8: signed x signed, so the weights are offset to unsigned (w ^ 0x80 = w + 128) and
// -128 * (lane sums of x) starts the accumulator. Four rows at a time (independent chains),
// one 256-bit vpdpbusd per block and row; rows found with TileRow, so any interleave works.
inline void rows_q8_0(float* y, const TileRow* rows, int n, const block_q8a* xa, int nb) {
  const __m256i bias = _mm256_set1_epi8((char)0x80);
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
  for (int b = 0; b < nb; ++b) {
    const block_q8a& a = xa[b];
    const __m256i xv = _mm256_loadu_si256((const __m256i*)a.qs);
    const __m256i c = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(_mm256_loadu_si256((const __m256i*)a.lsum8), 7));
    const __m256 dx = _mm256_set1_ps(a.d);
    for (int k = 0; k < 4; ++k) {
      if (k >= n) break;
      const uint8_t* p = rows[k].base + b * rows[k].stride;
      const __m256i w = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(p + 2)), bias);
      const __m256i s = _mm256_dpbusd_epi32(c, w, xv);
      const __m256 d = _mm256_mul_ps(_mm256_cvtph_ps(_mm_set1_epi16((short)*(const uint16_t*)p)), dx);
      acc[k] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), d, acc[k]);
    }
  }
  for (int k = 0; k < n; ++k) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[k]), _mm256_extractf128_ps(acc[k], 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    h = _mm_add_ss(h, _mm_movehdup_ps(h));
    y[k] += _mm_cvtss_f32(h);
  }
}

void gemv_q8_0_q8(float* y, const void* xv, const uint8_t* w, int rows, int cols, const TileShape& ts,
                  int row_begin, int row_end) {
  const block_q8a* x = (const block_q8a*)xv;
  walk_tiles_whole(y, w, rows, cols, ts, QK, 34, row_begin, row_end,
                   [&](const uint8_t* tile, int r, int nr, int cb0, int nb) {
                     for (int i = 0; i < nr; i += 4) {
                       const int n = nr - i < 4 ? nr - i : 4;
                       TileRow tr[4] = {TileRow(tile, nr, nb, ts.g, 34, i), TileRow(tile, nr, nb, ts.g, 34, i),
                                        TileRow(tile, nr, nb, ts.g, 34, i), TileRow(tile, nr, nb, ts.g, 34, i)};
                       for (int k = 1; k < n; ++k) tr[k] = TileRow(tile, nr, nb, ts.g, 34, i + k);
                       rows_q8_0(y + r + i, tr, n, x + cb0, nb);
                     }
                   });
}

// ---- fp32-activation paths (parity): dequantize 32 weights into two zmm, FMA with x ----
// The weights are formed exactly as the scalar reference forms them (d * (q - 8) is one
// rounding of the exact product either way), so only the summation order differs.

// Q4_0 (w = d*q - 8d) and Q4_1 (w = d*q + m): one fma per 16 weights.
template <int BB, bool HAS_M>
struct DeqNib {
  static constexpr int kBB = BB;
  static inline void deq(const uint8_t* p, __m512& w0, __m512& w1) {
    const __m128i q = _mm_loadu_si128((const __m128i*)(p + (HAS_M ? 4 : 2)));
    const __m128i lo4 = _mm_set1_epi8(0x0F);
    const __m512 d = _mm512_set1_ps(fp16_to_f32(*(const uint16_t*)p));
    const __m512 off = HAS_M ? _mm512_set1_ps(fp16_to_f32(*(const uint16_t*)(p + 2))) : _mm512_mul_ps(d, _mm512_set1_ps(-8.0f));
    w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(q, lo4))), d, off);
    w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(q, 4), lo4))), d, off);
  }
};
using DeqQ4_0 = DeqNib<18, false>;
using DeqQ4_1 = DeqNib<20, true>;

struct DeqQ8_0 {
  static constexpr int kBB = 34;
  static inline void deq(const uint8_t* p, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(fp16_to_f32(*(const uint16_t*)p));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 2)))), d);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(p + 18)))), d);
  }
};

template <class D>
void gemv_deq_f32(float* y, const void* xv, const uint8_t* w, int rows, int cols, const TileShape& ts,
                  int row_begin, int row_end) {
  const float* x = (const float*)xv;
  walk_tiles_whole(y, w, rows, cols, ts, QK, D::kBB, row_begin, row_end,
                   [&](const uint8_t* tile, int r, int nr, int cb0, int nb) {
                     const float* xt = x + (size_t)cb0 * QK;
                     for (int i = 0; i < nr; i += 2) {  // two rows at a time: independent chains
                       const int n = nr - i < 2 ? nr - i : 2;
                       const TileRow r0(tile, nr, nb, ts.g, D::kBB, i), r1(tile, nr, nb, ts.g, D::kBB, i + n - 1);
                       __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
                       for (int b = 0; b < nb; ++b) {
                         const __m512 x0 = _mm512_loadu_ps(xt + b * QK), x1 = _mm512_loadu_ps(xt + b * QK + 16);
                         __m512 w0, w1;
                         D::deq(r0.base + b * r0.stride, w0, w1);
                         a0 = _mm512_fmadd_ps(w1, x1, _mm512_fmadd_ps(w0, x0, a0));
                         D::deq(r1.base + b * r1.stride, w0, w1);
                         a1 = _mm512_fmadd_ps(w1, x1, _mm512_fmadd_ps(w0, x0, a1));
                       }
                       y[r + i] += _mm512_reduce_add_ps(a0);
                       if (n == 2) y[r + i + 1] += _mm512_reduce_add_ps(a1);
                     }
                   });
}

// F32 / F16 / BF16 rows: contiguous inside a tile only with interleave 1; other interleaves
// (elements of g rows interleaved one by one) run the scalar kernel.
template <int BB>
inline __m512 load16(const uint8_t* p) {
  if (BB == 4) return _mm512_loadu_ps((const float*)p);
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
}
inline __m512 load16_bf16(const uint8_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

template <int BB, bool BF, GemvFn REF>
void gemv_elem_f32(float* y, const void* xv, const uint8_t* w, int rows, int cols, const TileShape& ts,
                   int row_begin, int row_end) {
  if (ts.g != 1) return REF(y, xv, w, rows, cols, ts, row_begin, row_end);
  const float* x = (const float*)xv;
  walk_tiles_whole(y, w, rows, cols, ts, 1, BB, row_begin, row_end,
                   [&](const uint8_t* tile, int r, int nr, int cb0, int nb) {
                     const float* xt = x + cb0;
                     const int n16 = nb / 16 * 16;
                     for (int i = 0; i < nr; ++i) {
                       const uint8_t* row = tile + (size_t)i * nb * BB;
                       __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
                       int j = 0;
                       for (; j + 32 <= n16; j += 32) {
                         a0 = _mm512_fmadd_ps(BF ? load16_bf16(row + j * BB) : load16<BB>(row + j * BB), _mm512_loadu_ps(xt + j), a0);
                         a1 = _mm512_fmadd_ps(BF ? load16_bf16(row + (j + 16) * BB) : load16<BB>(row + (j + 16) * BB), _mm512_loadu_ps(xt + j + 16), a1);
                       }
                       for (; j < n16; j += 16)
                         a0 = _mm512_fmadd_ps(BF ? load16_bf16(row + j * BB) : load16<BB>(row + j * BB), _mm512_loadu_ps(xt + j), a0);
                       float s = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
                       for (; j < nb; ++j) {
                         float v;
                         if (BB == 4) std::memcpy(&v, row + j * 4, 4);
                         else if (BF) v = bf16_to_f32(*(const uint16_t*)(row + j * 2));
                         else v = fp16_to_f32(*(const uint16_t*)(row + j * 2));
                         s += v * xt[j];
                       }
                       y[r + i] += s;
                     }
                   });
}

}  // namespace
}  // namespace avx512

const GemvTable& gemv_table_avx512() {
  static GemvTable t = {};
  static const bool filled = [] {
    t[wtype_index(WType::Q4_0)][(int)AType::Q8] = avx512::gemv_nib_q8<avx512::Q4_0>;
    t[wtype_index(WType::Q4_1)][(int)AType::Q8] = avx512::gemv_nib_q8<avx512::Q4_1>;
    t[wtype_index(WType::Q8_0)][(int)AType::Q8] = avx512::gemv_q8_0_q8;
    t[wtype_index(WType::Q4_0)][(int)AType::F32] = avx512::gemv_deq_f32<avx512::DeqQ4_0>;
    t[wtype_index(WType::Q4_1)][(int)AType::F32] = avx512::gemv_deq_f32<avx512::DeqQ4_1>;
    t[wtype_index(WType::Q8_0)][(int)AType::F32] = avx512::gemv_deq_f32<avx512::DeqQ8_0>;
    t[wtype_index(WType::F32)][(int)AType::F32] = avx512::gemv_elem_f32<4, false, ref::gemv_f32_f32>;
    t[wtype_index(WType::F16)][(int)AType::F32] = avx512::gemv_elem_f32<2, false, ref::gemv_f16_f32>;
    t[wtype_index(WType::BF16)][(int)AType::F32] = avx512::gemv_elem_f32<2, true, ref::gemv_bf16_f32>;
    return true;
  }();
  (void)filled;
  return t;
}

}  // namespace cflow
