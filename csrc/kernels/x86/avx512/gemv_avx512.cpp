// AVX-512 (F/BW/VL/DQ + VNNI) GEMV kernels: the traits V plus the shared x86/gemv_simd.h (every
// type, fp32 and int8 activations), and the wider kernels below that replace some of them: the
// 4-bit quads (Q4_0/Q4_1/Q5_0/Q5_1 int8) and Q4_K/Q5_K/Q6_K int8 at 512 bits.
//
// The unit of work of the 4-bit int8 kernels is a quad: 4 rows x 1 column block. With interleave g >= 4 a quad's 4 blocks
// are contiguous in the tile (72 bytes for Q4_0), so two loads and one vpermt2w put block k's
// 16 nibble bytes in 128-bit lane k and its scale in float lanes 4k..4k+3; the activation
// block is broadcast to all four lanes and one vpdpbusd per nibble half gives every row's
// partial dot product. Rows of a ragged group (or interleave 1 and 2) are gathered from 4
// pointers instead (a missing row repeats the last one; its result is dropped).
// Weight nibbles are unsigned (0..15, Q5_0 and Q5_1 0..31); the -8 offset of Q4_0 (-16 of Q5_0) enters as
// the initial value of the int32 accumulator, -8 * (lane sums of the activation), precomputed in
// q8a_sums.
#include <immintrin.h>

#include <cmath>
#include <cstdlib>
#include <new>
#include <type_traits>

#include "../../isa_kernels.h"
#include "../../tile_walk.h"
#include "cflow/planes.h"
#include "vec.h"

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

// Q4_0 / Q4_1 / Q5_0 / Q5_1 blocks: scale words at 0 (and m at 1), qh (Q5_0, Q5_1) at byte
// QHOFF (0: none), qs from byte QSOFF. ZS: the int8 path subtracts 2^ZS * (lane sums of x)
// (Q4_0: 8, Q5_0: 16; Q4_1, Q5_1: m). The fifth bits come out as two 64-bit masks in h (low,
// high nibbles; bit 16k + j: weight j resp. 16 + j of block k, matching byte 16k + j of qs).
template <int BB, int QSOFF, bool HAS_M, int ZS, int QHOFF = 0>
struct Nib {
  static constexpr int kBB = BB, kZeroShift = ZS;
  static constexpr bool kHasM = HAS_M, kHasH = QHOFF > 0;
  static constexpr int kWords = BB / 2;
  static const WordIdx& idx_qs() {
    static const WordIdx w = make_idx([](int i) { return (i / 8) * kWords + QSOFF / 2 + i % 8; });
    return w;
  }
  // words 0..15: d of block i/4; 16..31: m of block (i-16)/4, or (qh, no m: Q5_0) words 16+k,
  // 20+k: the low and high qh word of block k.
  static const WordIdx& idx_dm() {
    static const WordIdx w = make_idx([](int i) {
      if (i < 16 || !kHasH || HAS_M) return ((i % 16) / 4) * kWords + (i >= 16 ? 1 : 0);
      return i < 24 ? ((i - 16) % 4) * kWords + QHOFF / 2 + (i - 16) / 4 : 0;
    });
    return w;
  }
  // (qh and m: Q5_1) words k, 4+k: the low and high qh word of block k; the rest unused.
  static const WordIdx& idx_h() {
    static const WordIdx w = make_idx([](int i) { return i < 8 ? (i % 4) * kWords + QHOFF / 2 + i / 4 : 0; });
    return w;
  }
  // 4 contiguous blocks at p.
  static inline void load(const uint8_t* p, __m512i& qs, __m512& d, __m512& m, __m128i& hm) {
    const __m512i a = _mm512_loadu_si512(p);
    const __m512i b = _mm512_maskz_loadu_epi16((__mmask32)((1u << (2 * BB - 32)) - 1), p + 64);
    qs = _mm512_permutex2var_epi16(a, load_idx(idx_qs()), b);
    const __m512i dm = _mm512_permutex2var_epi16(a, load_idx(idx_dm()), b);
    d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    if (HAS_M) m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
    if (kHasH && HAS_M) hm = _mm512_castsi512_si128(_mm512_permutex2var_epi16(a, load_idx(idx_h()), b));
    else if (kHasH) hm = _mm512_extracti32x4_epi32(dm, 2);
  }
  // 4 blocks at 4 pointers.
  static inline void load4(const uint8_t* const* p, __m512i& qs, __m512& d, __m512& m, __m128i& hm) {
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
    if (kHasH) {
      uint64_t lo = 0, hi = 0;
      for (int k = 0; k < 4; ++k) {
        uint32_t qh;
        std::memcpy(&qh, p[k] + QHOFF, 4);
        lo |= (uint64_t)(qh & 0xFFFF) << (16 * k);
        hi |= (uint64_t)(qh >> 16) << (16 * k);
      }
      hm = _mm_set_epi64x((long long)hi, (long long)lo);
    }
  }
};

using Q4_0 = Nib<18, 2, false, 3>;
using Q4_1 = Nib<20, 4, true, 0>;
using Q5_0 = Nib<22, 6, false, 4, 2>;
using Q5_1 = Nib<24, 8, true, 0, 4>;

// One quad (4 rows) over nb column blocks of 4-bit weights. CONTIG: the quad's 4 blocks of
// column block b are contiguous at q0 + b * stride (rows of one interleave group, g >= 4);
// else row k's block b is at rows[k].base + b * rows[k].stride.
template <class T, bool CONTIG>
inline __m512 quad_nib(const uint8_t* q0, size_t stride, const TileRow* rows, const block_q8a* xa,
                       const q8a_sums* xs, int nb) {
  constexpr bool kOff = !T::kHasM;  // Q4_0: q - 8, Q5_0: q - 16; Q4_1, Q5_1: d*q + m
  const __m512i lo4 = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(16);
  __m512 acc = _mm512_setzero_ps();
  __m512 accm = _mm512_setzero_ps();
  for (int b = 0; b < nb; ++b) {
    const block_q8a& a = xa[b];
    __m512i qs;
    __m512 d, m;
    __m128i h;
    if (CONTIG) T::load(q0 + b * stride, qs, d, m, h);
    else {
      const uint8_t* p[4] = {rows[0].base + b * rows[0].stride, rows[1].base + b * rows[1].stride,
                             rows[2].base + b * rows[2].stride, rows[3].base + b * rows[3].stride};
      T::load4(p, qs, d, m, h);
    }
    const __m512i xlo = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)a.qs));
    const __m512i xhi = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(a.qs + 16)));
    __m512i s = _mm512_setzero_si512();
    if (kOff)  // -2^ZS * lane sums of x
      s = _mm512_sub_epi32(s, _mm512_slli_epi32(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)xs[b].lsum4)), T::kZeroShift));
    __m512i ulo = _mm512_and_si512(qs, lo4), uhi = _mm512_and_si512(_mm512_srli_epi16(qs, 4), lo4);
    if (T::kHasH) {  // Q5_0, Q5_1: + 16 where the fifth bit is set
      ulo = _mm512_mask_add_epi8(ulo, (__mmask64)_mm_cvtsi128_si64(h), ulo, bit4);
      uhi = _mm512_mask_add_epi8(uhi, (__mmask64)_mm_extract_epi64(h, 1), uhi, bit4);
    }
    s = _mm512_dpbusd_epi32(s, ulo, xlo);
    s = _mm512_dpbusd_epi32(s, uhi, xhi);
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
void gemv_nib_q8(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  const block_q8a* x = (const block_q8a*)xv;
  const q8a_sums* xs = q8a_sums_of(x, L.cols);
  walk_tiles_whole(y, w, L, row_begin, row_end,
                   [&](const uint8_t* tile, int r, int nr, int cb0, int nb) {
                     for_each_quad(tile, nr, nb, L.g, T::kBB,
                                   [&](int i, const uint8_t* q0, size_t stride, const TileRow* tr, int n) {
                                     if (q0) add_quad(y + r + i, quad_nib<T, true>(q0, stride, nullptr, x + cb0, xs + cb0, nb));
                                     else add_quad_n(y + r + i, quad_nib<T, false>(nullptr, 0, tr, x + cb0, xs + cb0, nb), n);
                                   });
                   });
}

// ---- the shared kernels (x86/gemv_simd.h): every other type and path ----
// Integer dot products are 256-bit VNNI (AVX512_VNNI + VL): vpdpbusd for unsigned x signed
// bytes; the K-quants' sub-block scales enter by maddubs + vpdpwssd (int16 pair sums times the
// int16 scale, accumulated in int32). Q8_0 weights are offset to unsigned (w ^ 0x80 = w + 128)
// and -128 * (lane sums of x) starts the accumulator. fp32 paths are 512-bit, masked tails.
struct V : Vec, IVec {
  static void add_n(float* y, reg a, int n) { store_n(y, add(load_n(y, n), a), n); }
  static reg cvt_e(int e, __m256i h) {  // 16 fp16 or bf16 values -> floats
    if (e == 1) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  template <int E>
  static reg load_e(const uint8_t* p) {
    if (E == 0) return _mm512_loadu_ps((const float*)p);
    return cvt_e(E, _mm256_loadu_si256((const __m256i*)p));
  }
  template <int E>
  static reg load_e_n(const uint8_t* p, int n) {
    if (E == 0) return load_n((const float*)p, n);
    return cvt_e(E, _mm256_maskz_loadu_epi16(mask(n), p));
  }
  static void fma32(__m256i q, float d0, float o0, float d1, float o1, const float* x, reg& a0, reg& a1) {
    auto w = [](__m128i b, float d, float o) {
      return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), _mm512_set1_ps(d), _mm512_set1_ps(o));
    };
    a0 = fmadd(w(_mm256_castsi256_si128(q), d0, o0), load(x), a0);
    a1 = fmadd(w(_mm256_extracti128_si256(q, 1), d1, o1), load(x + 16), a1);
  }
};

// One block of 32 activations -> o.qs; returns the scale d.
inline float quantize_block(const float* x, block_q8a& o) {
  const __m512 sign = _mm512_set1_ps(-0.f);
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float d = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1))) / 127.f;
  const __m512 vid = _mm512_set1_ps(d ? 1.f / d : 0.f);
  _mm_storeu_si128((__m128i*)o.qs, _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v0, vid))));
  _mm_storeu_si128((__m128i*)(o.qs + 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(v1, vid))));
  return d;
}

#include "../gemv_simd.h"
#include "../planes_simd.h"
#include "kplanes.h"
#include "planes_finish.h"
#include "planes_unpack.h"

// K-quants at 512 bits: 64 weights per maddubs + vpdpwssd (the shared kinds take 32).
inline __m256i fold(__m512i s) { return _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1)); }

// Q4_K and Q5_K: chunk c's 64 weights (Base::quants: low nibbles sub-block 2c, high 2c+1 = weights
// 64c .. 64c+63 in order) in one maddubs against the activations, times the two scales.
template <class Base>
struct KK4_512 : Base {
  static void dot(const uint8_t* p, const block_q8_K& a, const void*, __m256& acc, float& accs) {
    uint8_t sm[16];
    scales_k4(p + 4, sm);
    __m512i s = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      __m256i lo, hi;
      Base::quants(p, c, lo, hi);
      const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
      const __m512i sc = _mm512_inserti64x4(_mm512_set1_epi16(sm[2 * c]), _mm256_set1_epi16(sm[2 * c + 1]), 1);
      s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(u, _mm512_loadu_si512(a.qs + 64 * c)), sc);
    }
    Base::finish(p, a, sm, fold(s), acc, accs);
  }
};
using KQ4_K512 = KK4_512<BlkQ4_K>;
using KQ5_K512 = KK4_512<BlkQ5_K>;

struct KQ6_K512 : BlkQ6_K {
  // Half h: ql's 64 bytes give quarters 0|1 (low nibbles, weights 0..63 of the half) and 2|3
  // (high nibbles, 64..127); qh (32 bytes, in both 256-bit halves) is shifted by 0|2 and 4|6.
  // int16 word i of a 64-weight vector covers weights 2i, 2i+1: scale sc[8h + 4t + i/8].
  static void dot(const uint8_t* p, const block_q8_K& a, const void*, __m256& acc, float&) {
    const __m512i scw = _mm512_cvtepi8_epi16(_mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)(p + 192))));
    const __m512i m3 = _mm512_set1_epi8(3), m4 = _mm512_set1_epi8(0x0F);
    const __m512i sh01 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i sh23 = _mm512_add_epi16(sh01, _mm512_set1_epi16(4));
    alignas(64) static const uint16_t kIdx[32] = {0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                                  2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3};
    const __m512i idx = _mm512_load_si512(kIdx);
    __m512i s = _mm512_setzero_si512();
    for (int h = 0; h < 2; ++h) {
      const __m512i ql = _mm512_loadu_si512(p + 64 * h);
      const __m512i qh = _mm512_broadcast_i64x4(load32(p + 128 + 32 * h));
      auto hi2 = [&](__m512i sh) { return _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(qh, sh), m3), 4); };
      const __m512i u01 = _mm512_or_si512(_mm512_and_si512(ql, m4), hi2(sh01));
      const __m512i u23 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4), hi2(sh23));
      const __m512i sc01 = _mm512_permutexvar_epi16(_mm512_add_epi16(idx, _mm512_set1_epi16(8 * h)), scw);
      const __m512i sc23 = _mm512_permutexvar_epi16(_mm512_add_epi16(idx, _mm512_set1_epi16(8 * h + 4)), scw);
      s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(u01, _mm512_loadu_si512(a.qs + 128 * h)), sc01);
      s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(u23, _mm512_loadu_si512(a.qs + 128 * h + 64)), sc23);
    }
    finish(p, a, fold(s), acc);
  }
};

// ---- TQ2_0, int8 activations, at 512 bits ----
// A block's 64 code bytes are one zmm v: byte j (half h = j / 32, m = j % 32) holds in bit pair l
// the code of weight 128h + 32l + m; X_l, the activation bytes 32l .. 32l+31 and 128+32l ..
// 128+32l+31 of the q8_K block, meets bit pair l (formed once per column block, shared by the
// rows). Codes are unsigned (0..3), activations signed: vpdpbusd sums code x act, and minus the
// block's sum of x (from bsums) turns t into t - 1. Bit pairs 0 and 2 go in as codes (v & 3,
// (v >> 4) & 3), 1 and 3 as 4 * code (v & 12, (v >> 4) & 12): one shift per block instead of
// three. Their sum hi starts at -4 * sum(x) and is exact in int32, so hi >> 2 (exact: every
// lane is a multiple of 4) starts the sum of pairs 0 and 2. Then one cvt and one fmadd with
// the block's d * d_x into the row's 16 float lanes, summed once at the stripe's end.
// The GEMV (4 rows at a time) and the batched GEMV (4 rows, every token of a group) run the
// same tq2_acts / tq2_codes / tq2_isum / tq2_finish, so a token's result does not depend on
// its batch.
struct Tq2Acts {
  __m512i x[4];
  __m512i s4;  // -4 * bsums: the start of every row's sum of bit pairs 1 and 3
};
inline void tq2_acts(const block_q8_K& a, Tq2Acts& A) {
  for (int l = 0; l < 4; ++l)
    A.x[l] = _mm512_inserti64x4(_mm512_castsi256_si512(load32(a.qs + 32 * l)), load32(a.qs + 128 + 32 * l), 1);
  A.s4 = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_cvtepi16_epi32(load32(a.bsums)), 2));
}
inline void tq2_codes(const uint8_t* p, __m512i (&c)[4]) {
  __m512i v = _mm512_loadu_si512(p);
  __asm__("" : "+v"(v));  // one load, not one per use
  const __m512i v4 = _mm512_srli_epi16(v, 4), m3 = _mm512_set1_epi8(3), m12 = _mm512_set1_epi8(12);
  c[0] = _mm512_and_si512(v, m3);
  c[1] = _mm512_and_si512(v, m12);
  c[2] = _mm512_and_si512(v4, m3);
  c[3] = _mm512_and_si512(v4, m12);
}
inline __m512i tq2_isum(const __m512i (&c)[4], const Tq2Acts& A) {
  const __m512i hi = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(A.s4, c[1], A.x[1]), c[3], A.x[3]);
  return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_srai_epi32(hi, 2), c[0], A.x[0]), c[2], A.x[2]);
}
// sc: the block's d times the activation block's d (one float multiply), broadcast from memory
// (a load, where the compiler's register broadcasts of lanes 1..3 took two shuffles each)
inline __m512 tq2_finish(const float& sc, __m512i s, __m512 acc) {
  __m512 b;
  __asm__("vbroadcastss %1, %0" : "=v"(b) : "m"(sc));
  return _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), b, acc);
}
inline uint16_t tq2_dbits(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p + 64, 2);
  return h;
}

// Rows i .. i+3 of a tile (a missing row repeats the last one of [lo, hi); its twin is dropped).
struct Tq2Rows {
  TileRow r[4];
  int n;
  Tq2Rows(const uint8_t* tile, int nr, int nb, int g, int i, int hi)
      : r{TileRow(tile, nr, nb, g, BlkTQ2_0::kBB, i), TileRow(tile, nr, nb, g, BlkTQ2_0::kBB, std::min(i + 1, hi - 1)),
          TileRow(tile, nr, nb, g, BlkTQ2_0::kBB, std::min(i + 2, hi - 1)),
          TileRow(tile, nr, nb, g, BlkTQ2_0::kBB, std::min(i + 3, hi - 1))},
        n(std::min(4, hi - i)) {}
  const uint8_t* at(int k, int b) const { return r[k].base + b * r[k].stride; }
};

// The activation row's Tq2Acts, formed once per call (per thread), read by every row.
inline const Tq2Acts* tq2_acts_row(const block_q8_K* x, int nbr) {
  thread_local std::vector<Tq2Acts> xa;
  xa.resize((size_t)nbr);
  for (int b = 0; b < nbr; ++b) tq2_acts(x[b], xa[b]);
  return xa.data();
}

// The GEMV: payload order (stripe, tile, 4 rows), each row's 16 float lanes kept across the
// column tiles of its stripe. Software prefetch: each of the 4 row streams asks for the same
// block kTq2Ahead rows further on (with whole-row tiles the payload is linear; the shared
// kernel's kPrefetchAhead bytes from each of two adjacent rows landed in the other row and
// left every second row to the hardware), into L2 (prefetcht2: at 1 thread 52 against 39
// Gweights/s for prefetcht0; prefetchnta fell to 39 from 65), both lines a 66-byte block
// touches: one hint at the block's start left one line in 33 of each row stream to a demand
// miss from DRAM, which cost 20-25% (1 thread 67 -> 85 Gweights/s in paired runs). 4, 8 and 16
// rows ahead, and one linear stream of hints over the 4 rows' span, measured alike.
constexpr int kTq2Ahead = 8;
inline void tq2_prefetch(const uint8_t* p) {
  __builtin_prefetch(p, 0, 1);
  __builtin_prefetch(p + BlkTQ2_0::kBB - 1, 0, 1);
}
void gemv_tq2_q8(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  const block_q8_K* x = (const block_q8_K*)xv;
  const Tq2Acts* xa = tq2_acts_row(x, L.cols / QK_K);
  thread_local std::vector<__m512> acc;
  const bool pf = prefetch_on();
  for_stripes(L, w, row_begin, row_end, [&](const Stripe& S, int lo, int hi) {
    acc.assign((size_t)S.nr, _mm512_setzero_ps());
    for (int t = 0; t < S.ntiles(); ++t) {
      const uint8_t* tile = S.tile(t);
      const int nb = S.nb(t), cb0 = t * S.bpt;
      const size_t ahead = (size_t)kTq2Ahead * nb * BlkTQ2_0::kBB;
      for (int i = lo; i < hi; i += 4) {
        const Tq2Rows R(tile, S.nr, nb, S.g, i, hi);
        __m512 a0 = acc[i], a1 = acc[R.n > 1 ? i + 1 : i], a2 = acc[R.n > 2 ? i + 2 : i], a3 = acc[R.n > 3 ? i + 3 : i];
        for (int b = 0; b < nb; ++b) {
          const Tq2Acts& A = xa[cb0 + b];
          const uint8_t* const p[4] = {R.at(0, b), R.at(1, b), R.at(2, b), R.at(3, b)};
          if (pf)
            for (int k = 0; k < 4; ++k) tq2_prefetch(p[k] + ahead);
          // the 4 rows' d * d_x, as 4 lanes (each the one float multiply tq2_finish's caller owes)
          alignas(16) float sc[4];
          _mm_store_ps(sc, _mm_mul_ps(_mm_cvtph_ps(_mm_setr_epi16((short)tq2_dbits(p[0]), (short)tq2_dbits(p[1]),
                                                                    (short)tq2_dbits(p[2]), (short)tq2_dbits(p[3]), 0, 0, 0, 0)),
                                      _mm_set1_ps(x[cb0 + b].d)));
          auto row = [&](int k, __m512& a) {
            __m512i c[4];
            tq2_codes(p[k], c);
            a = tq2_finish(sc[k], tq2_isum(c, A), a);
          };
          row(0, a0);
          row(1, a1);
          row(2, a2);
          row(3, a3);
        }
        acc[i] = a0;
        if (R.n > 1) acc[i + 1] = a1;
        if (R.n > 2) acc[i + 2] = a2;
        if (R.n > 3) acc[i + 3] = a3;
      }
    }
    for (int i = lo; i < hi; ++i) y[S.row + i - row_begin] = _mm512_reduce_add_ps(acc[i]);
  });
}

// The batched form (kernels.h GemvBatchFn): groups of up to kTernGroup tokens; per column block,
// 4 rows decoded once and met by every token of the group with the GEMV's tq2_isum and
// tq2_finish, in its block order: each token's result is the GEMV's bit for bit.
void gemv_tq2_batch(float* y, int ldy, const void* xv, int m, const uint8_t* w, const TileLayout& L, int row_begin,
                    int row_end) {
  const size_t ab = act_bytes(BlockType::TQ2_0, AType::Q8, L.cols);
  thread_local std::vector<__m512> acc;
  for (int t0 = 0; t0 < m; t0 += kTernGroup) {
    const int nt = std::min(kTernGroup, m - t0);
    const block_q8_K* x[kTernGroup];
    for (int k = 0; k < nt; ++k) x[k] = (const block_q8_K*)((const uint8_t*)xv + (size_t)(t0 + k) * ab);
    for_stripes(L, w, row_begin, row_end, [&](const Stripe& S, int lo, int hi) {
      acc.assign((size_t)nt * S.nr, _mm512_setzero_ps());
      for (int t = 0; t < S.ntiles(); ++t) {
        const uint8_t* tile = S.tile(t);
        const int nb = S.nb(t), cb0 = t * S.bpt;
        for (int i = lo; i < hi; i += 4) {
          const Tq2Rows R(tile, S.nr, nb, S.g, i, hi);
          for (int b = 0; b < nb; ++b) {
            __m512i c[4][4];
            for (int r = 0; r < R.n; ++r) {
              if (prefetch_on()) tq2_prefetch(R.at(r, b) + (size_t)kTq2Ahead * nb * BlkTQ2_0::kBB);
              tq2_codes(R.at(r, b), c[r]);
            }
            for (int k = 0; k < nt; ++k) {
              Tq2Acts A;
              tq2_acts(x[k][cb0 + b], A);
              const float dx = x[k][cb0 + b].d;
              __m512* ak = acc.data() + (size_t)k * S.nr + i;
              for (int r = 0; r < R.n; ++r) {
                const float sc = h2f(R.at(r, b) + 64) * dx;
                ak[r] = tq2_finish(sc, tq2_isum(c[r], A), ak[r]);
              }
            }
          }
        }
      }
      for (int k = 0; k < nt; ++k)
        for (int i = lo; i < hi; ++i)
          y[(size_t)(t0 + k) * ldy + S.row + i - row_begin] = _mm512_reduce_add_ps(acc[(size_t)k * S.nr + i]);
    });
  }
}

// ---- planes-packed GEMVs: one token (GemvFn) or a pass of up to 8 (GemvBatchFn, without AMX) ----
// Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 with block_q8a activations (cflow/planes.h): one interleave
// group of 16 rows is one zmm of int32 lanes, lane i = row i. Per column block: the 16 scales are
// one fp16 load; each 64-byte plane holds slice k (4 quant bytes) of every row, and one vpdpbusd
// against the 4 activation bytes of slice k, broadcast, adds every row's partial dot product. No
// shuffles. The weights are unsigned (planes_unpack.h), their offsets enter the int32 accumulator
// exactly, as its start value -kZero * sum(x): Q4_0 -8 * sum(x), Q5_0 -16 * sum(x), Q8_0 (weights
// made unsigned by ^ 0x80) -128 * sum(x); Q4_1 and Q5_1 add m * d_x * sum(x) in float
// (planes_finish). A group of fewer rows is widened to 16 (planes_widen).
// Q4_K / Q5_K / Q6_K with block_q8_K activations (kplanes.h): per super-block of a 16-row group,
// M from the mins (Q4_K), then per group of 16 slices each sub-block's D_s, started at -kZero *
// (its sum of x), by one vpdpbusd per slice against the 4 activation bytes broadcast, times the
// sub-block's 16 row scales (vpmulld), into I; then kplanes_finish.
// TWO (AType::Q8x2): the second int8 level of the activation meets the same unpacked slices, so
// it costs arithmetic, not a second pass over the weights.
// A pass over a thread's rows serves up to kVnniGroup tokens: each chunk (or K-quant group) is
// unpacked once and met by every token's activations in turn, in one block order, so a token's
// result is bit for bit the same in any pass. What a pass of several saves is the weight traffic
// and the unpacking of every token after the first; the dot products stay one token's each. The
// one-token GEMV is the pass of one: its activations laid out in loop order (PassActs) made it
// 4-40% faster in L2 than a kernel that read them from the blocks (docs/KERNELS.md).
constexpr int kVnniGroup = 8;
static_assert(kVnniGroup >= kBatchGroupMin, "kernels.h promises this many tokens per pass");

// The activations of a pass's tokens: token t's level 1 (x, its sums xs) and level 2 (x2, xs2).
template <class B, int NT>
struct TokenActs {
  const B *x[NT], *x2[NT];
  const q8a_sums *xs[NT], *xs2[NT];  // block_q8a only
  TokenActs(const uint8_t* xv, size_t ab, int cols) {
    for (int t = 0; t < NT; ++t) {
      x[t] = (const B*)(xv + t * ab);
      if constexpr (std::is_same_v<B, block_q8a>) {
        x2[t] = (const B*)(xv + t * ab + q8a_row_bytes(cols));
        xs[t] = q8a_sums_of(x[t], cols), xs2[t] = q8a_sums_of(x2[t], cols);
      } else {
        x2[t] = x[t] + cols / QK_K;
      }
    }
  }
};

// The activations of a pass in the order its dot products read them (built once per call):
// per column block cb, slice j (4 bytes), token t and level l one int32 at
// q[((cb * 8 + j) * NT + t) * L + l], and per (cb, t) the scalars of the float part. One pointer
// per block then reaches every broadcast as one load at a constant offset; read through
// per-token pointers (TokenActs), the compiled loop spent about two scalar loads and address
// computations beside each vpdpbusd.
struct PassScale {
  int32_t start, start2;  // the accumulators' exact start values, -kZero * sum(x) per level
  float d, s;             // planes_finish's da and s
};

template <BlockType WT, bool TWO, int NT>
struct PassActs {
  static constexpr int L = TWO ? 2 : 1, kQ = 8 * NT * L;  // int32 slices per column block
  const int32_t* q;
  const PassScale* sc;
  static size_t bytes(int nb) { return (size_t)nb * (kQ * sizeof(int32_t) + NT * sizeof(PassScale)); }
  // buf: bytes(cols / 32), 64-byte aligned; have: buf already holds this layout (pass_scratch_for).
  PassActs(const uint8_t* xv, size_t ab, int cols, void* buf, bool have = false) {
    const int nb = cols / QK;
    int32_t* qo = (int32_t*)buf;
    PassScale* so = (PassScale*)(qo + (size_t)nb * kQ);
    q = qo, sc = so;
    if (have) return;
    const TokenActs<block_q8a, NT> x(xv, ab, cols);
    auto start = [](const q8a_sums& l) {
      return -PlanesKind<WT>::kZero * (l.lsum4[0] + l.lsum4[1] + l.lsum4[2] + l.lsum4[3]);
    };
    for (int cb = 0; cb < nb; ++cb)
      for (int t = 0; t < NT; ++t) {
        const block_q8a& a = x.x[t][cb];
        const block_q8a* a2 = x.x2[t] + cb;
        for (int j = 0; j < 8; ++j) {
          std::memcpy(qo + ((size_t)(cb * 8 + j) * NT + t) * L, a.qs + 4 * j, 4);
          if (TWO) std::memcpy(qo + ((size_t)(cb * 8 + j) * NT + t) * L + 1, a2->qs + 4 * j, 4);
        }
        const ActScalars sc = planes_act_scalars<TWO>(a, a2);
        so[cb * NT + t] = {start(x.xs[t][cb]), TWO ? start(x.xs2[t][cb]) : 0, sc.da, sc.s};
      }
  }
};

// A thread's scratch for PassActs, grown as needed, 64-byte aligned; kept: it was not grown (what
// it held is still there).
inline void* pass_scratch(size_t n, bool* kept) {
  struct Buf {
    void* p = nullptr;
    size_t n = 0;
    ~Buf() { std::free(p); }
  };
  thread_local Buf b;
  *kept = b.n >= n;
  if (b.n < n) {
    std::free(b.p);
    b.n = (n + 4095) & ~(size_t)4095;
    b.p = std::aligned_alloc(64, b.n);
    if (!b.p) throw std::bad_alloc();
  }
  return b.p;
}

// The scratch for a call's pass activations, and whether it still holds them (acts_stamp in
// kernels.h): the same nonzero stamp, activation pointer, kernel (type, levels, tokens) and
// columns as the layout this thread made last, which no call has overwritten since.
struct PassKey {
  uint64_t stamp;
  const void* x;
  int wt, two, nt, cols;
  bool operator==(const PassKey& o) const {
    return stamp == o.stamp && x == o.x && wt == o.wt && two == o.two && nt == o.nt && cols == o.cols;
  }
};
inline void* pass_scratch_for(size_t n, const PassKey& key, bool* have) {
  thread_local PassKey last{};
  bool kept;
  void* p = pass_scratch(n, &kept);
  *have = key.stamp && kept && key == last;
  last = key;
  return p;
}

// K tokens T0 .. T0+K-1 of the pass on one unpacked chunk u: their integer dot products as K
// (two: 2K) independent vpdpbusd chains, so that the chains' latencies overlap, then each token's
// planes_finish.
template <BlockType WT, bool TWO, int NT, int K>
inline void planes_dots(const uint8_t* c, const __m512i (&u)[8], const int32_t* q, const PassScale* sc, int T0,
                        __m512* acc) {
  constexpr int L = TWO ? 2 : 1;
  constexpr int C = K == 1 ? 4 : K == 2 ? 2 : 1;  // chains per token and level: 4 or more in all
  __m512i S[K][C], T[K][C];
  for (int k = 0; k < K; ++k)
    for (int i = 0; i < C; ++i) {
      S[k][i] = i ? _mm512_setzero_si512() : _mm512_set1_epi32(sc[T0 + k].start);
      T[k][i] = TWO && !i ? _mm512_set1_epi32(sc[T0 + k].start2) : _mm512_setzero_si512();
    }
  for (int j = 0; j < 8; ++j)
    for (int k = 0; k < K; ++k) {
      const int32_t* e = q + (j * NT + T0 + k) * L;
      S[k][j % C] = _mm512_dpbusd_epi32(S[k][j % C], u[j], _mm512_set1_epi32(e[0]));
      if (TWO) T[k][j % C] = _mm512_dpbusd_epi32(T[k][j % C], u[j], _mm512_set1_epi32(e[1]));
    }
  for (int k = 0; k < K; ++k) {  // integer sums: exact in any grouping
    for (int i = 1; i < C; ++i) {
      S[k][0] = _mm512_add_epi32(S[k][0], S[k][i]);
      if (TWO) T[k][0] = _mm512_add_epi32(T[k][0], T[k][i]);
    }
    const PassScale& z = sc[T0 + k];
    acc[k] = planes_finish<WT, TWO>(c, S[k][0], T[k][0], z.d, z.s, acc[k]);
  }
}

// planes_dots over tokens T0 .. NT-1, KMAX at a time.
template <BlockType WT, bool TWO, int NT, int KMAX, int T0 = 0>
inline void planes_dots_all(const uint8_t* c, const __m512i (&u)[8], const int32_t* q, const PassScale* sc,
                            __m512* acc) {
  if constexpr (T0 < NT) {
    constexpr int K = NT - T0 < KMAX ? NT - T0 : KMAX;
    planes_dots<WT, TWO, NT, K>(c, u, q, sc, T0, acc + T0);
    planes_dots_all<WT, TWO, NT, KMAX, T0 + K>(c, u, q, sc, acc);
  }
}

// One token on two groups' chunks at once (ca, cb; unpacked u, v): each activation broadcast
// feeds both groups' vpdpbusd, two chains a group and level. The broadcasts had been as many as
// the dot products: two groups a broadcast took a two-level GEMV 19-21% faster for Q4_0 and
// Q4_1, 13% for Q8_0, 4% for Q5_0 and Q5_1, whose fifth bits cost more than the broadcasts
// (docs/KERNELS.md). The tokens of a pass of several gained nothing from it (Q5_0 lost), so only
// the one-token GEMV walks in pairs.
template <BlockType WT, bool TWO>
inline void planes_dot2(const uint8_t* ca, const uint8_t* cb, const __m512i (&u)[8], const __m512i (&v)[8],
                        const int32_t* q, const PassScale& z, __m512& acca, __m512& accb) {
  constexpr int L = TWO ? 2 : 1;
  const __m512i zero = _mm512_setzero_si512();
  __m512i Sa[2] = {_mm512_set1_epi32(z.start), zero}, Sb[2] = {Sa[0], zero};
  __m512i Ta[2] = {TWO ? _mm512_set1_epi32(z.start2) : zero, zero}, Tb[2] = {Ta[0], zero};
  for (int j = 0; j < 8; ++j) {
    const __m512i x1 = _mm512_set1_epi32(q[j * L]);
    Sa[j & 1] = _mm512_dpbusd_epi32(Sa[j & 1], u[j], x1);
    Sb[j & 1] = _mm512_dpbusd_epi32(Sb[j & 1], v[j], x1);
    if (TWO) {
      const __m512i x2 = _mm512_set1_epi32(q[j * L + 1]);
      Ta[j & 1] = _mm512_dpbusd_epi32(Ta[j & 1], u[j], x2);
      Tb[j & 1] = _mm512_dpbusd_epi32(Tb[j & 1], v[j], x2);
    }
  }
  // integer sums: exact in any grouping, so a row's result is the one-group walk's
  acca = planes_finish<WT, TWO>(ca, _mm512_add_epi32(Sa[0], Sa[1]), _mm512_add_epi32(Ta[0], Ta[1]), z.d, z.s, acca);
  accb = planes_finish<WT, TWO>(cb, _mm512_add_epi32(Sb[0], Sb[1]), _mm512_add_epi32(Tb[0], Tb[1]), z.d, z.s, accb);
}

template <BlockType WT, bool TWO, int NT>
void planes_tokens(float* y, int ldy, const uint8_t* xv, size_t ab, const uint8_t* w, const TileLayout& L,
                   int row_begin, int row_end) {
  using P = PassActs<WT, TWO, NT>;
  bool have;
  void* buf = pass_scratch_for(P::bytes(L.cols / QK), {acts_stamp(), xv, (int)WT, TWO, NT, L.cols}, &have);
  const P x(xv, ab, L.cols, buf, have);
  auto group = [&](int r, int gg, int cb0, int nb, auto&& chunk) {
    __m512 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const uint8_t* c = chunk(b);
      __m512i u[8];
      planes_unpack<WT>(c, u);
      planes_dots_all<WT, TWO, NT, 4>(c, u, x.q + (size_t)(cb0 + b) * P::kQ, x.sc + (size_t)(cb0 + b) * NT, acc);
    }
    for (int t = 0; t < NT; ++t) planes_store(y + (size_t)t * ldy + r, gg, acc[t]);
  };
  if constexpr (NT == 1) {
    auto pair = [&](int r, int cb0, int nb, auto&& chunks) {
      __m512 acca = _mm512_setzero_ps(), accb = acca;
      for (int b = 0; b < nb; ++b) {
        const uint8_t *ca, *cb;
        chunks(b, ca, cb);
        __m512i u[8], v[8];
        planes_unpack<WT>(ca, u);
        planes_unpack<WT>(cb, v);
        planes_dot2<WT, TWO>(ca, cb, u, v, x.q + (size_t)(cb0 + b) * P::kQ, x.sc[cb0 + b], acca, accb);
      }
      planes_store(y + r, kPlanesMaxG, acca);
      planes_store(y + r + kPlanesMaxG, kPlanesMaxG, accb);
    };
    walk_planes_pairs<WT>(y, w, L, row_begin, row_end, pair, group);
  } else {
    walk_planes<WT>(y, w, L, row_begin, row_end, group);
  }
}

// The K-quants' activations of a pass in loop order (built once per call), as
// PassActs: per super-block cb, slice i (4 bytes, 64 of them), token t and level l one int32 at
// q[((cb * 64 + i) * NT + t) * L + l]; per (cb, sub-block s, t, l) the sub-block's start value
// -kZero * (its sum of x) at st[((cb * kNumSub + s) * NT + t) * L + l]; Q4_K and Q5_K: per
// (cb, t, l) the 4 asum pairs of kplanes_mins_pairs at ms[((cb * NT + t) * L + l) * 4].
template <BlockType WT, bool TWO, int NT>
struct KPassActs {
  using Q = KPlanesKind<WT>;
  static constexpr int L = TWO ? 2 : 1, kQ = 64 * NT * L, kS = Q::kNumSub * NT * L, kM = Q::kQ4 ? 4 * NT * L : 0;
  const int32_t *q, *st, *ms;
  static size_t bytes(int nb) { return (size_t)nb * (kQ + kS + kM) * sizeof(int32_t); }
  KPassActs(const TokenActs<block_q8_K, NT>& x, int nb, void* buf, bool have = false) {
    int32_t* qo = (int32_t*)buf;
    int32_t* so = qo + (size_t)nb * kQ;
    int32_t* mo = so + (size_t)nb * kS;
    q = qo, st = so, ms = mo;
    if (have) return;
    for (int cb = 0; cb < nb; ++cb)
      for (int t = 0; t < NT; ++t)
        for (int l = 0; l < L; ++l) {
          const block_q8_K& a = l ? x.x2[t][cb] : x.x[t][cb];
          for (int i = 0; i < 64; ++i) std::memcpy(qo + ((size_t)(cb * 64 + i) * NT + t) * L + l, a.qs + 4 * i, 4);
          for (int sb = 0; sb < Q::kNumSub; ++sb)
            so[((size_t)(cb * Q::kNumSub + sb) * NT + t) * L + l] = -Q::kZero * Q::asum(a, sb);
          if constexpr (Q::kQ4)
            for (int i = 0; i < 4; ++i) mo[(((size_t)cb * NT + t) * L + l) * 4 + i] = kplanes_asum_pair<WT>(a, i);
        }
  }
};

// K tokens T0 .. T0+K-1 of the pass on group q's unpacked slices: each sub-block's D_s times its
// row scales, summed into I (two: I2), K (two: 2K) chains side by side. sl and st: the pass's
// slices and start values of this super-block.
template <BlockType WT, bool TWO, int NT, int K>
inline void kplanes_groups(const __m512i (&u)[16], const __m512i (&scs)[KPlanesKind<WT>::kSubs], int q,
                           const int32_t* sl, const int32_t* st, int T0, __m512i* I, __m512i* I2) {
  using Q = KPlanesKind<WT>;
  constexpr int L = TWO ? 2 : 1;
  for (int r = 0; r < Q::kSubs; ++r) {
    const int s = Q::sub(q, r);
    __m512i D[K], T[K];
    for (int k = 0; k < K; ++k) {
      D[k] = _mm512_set1_epi32(st[(s * NT + T0 + k) * L]);
      T[k] = TWO ? _mm512_set1_epi32(st[(s * NT + T0 + k) * L + 1]) : D[k];
    }
    for (int j = 0; j < Q::kSlices; ++j)
      for (int k = 0; k < K; ++k) {
        const int32_t* e = sl + ((Q::kSubW / 4 * s + j) * NT + T0 + k) * L;
        D[k] = _mm512_dpbusd_epi32(D[k], u[r * Q::kSlices + j], _mm512_set1_epi32(e[0]));
        if (TWO) T[k] = _mm512_dpbusd_epi32(T[k], u[r * Q::kSlices + j], _mm512_set1_epi32(e[1]));
      }
    const __m512i sc = scs[r];
    for (int k = 0; k < K; ++k) {
      I[k] = _mm512_add_epi32(I[k], _mm512_mullo_epi32(D[k], sc));
      if (TWO) I2[k] = _mm512_add_epi32(I2[k], _mm512_mullo_epi32(T[k], sc));
    }
  }
}

template <BlockType WT, bool TWO, int NT, int KMAX, int T0 = 0>
inline void kplanes_groups_all(const __m512i (&u)[16], const __m512i (&scs)[KPlanesKind<WT>::kSubs], int q,
                               const int32_t* sl, const int32_t* st, __m512i* I, __m512i* I2) {
  if constexpr (T0 < NT) {
    constexpr int K = NT - T0 < KMAX ? NT - T0 : KMAX;
    kplanes_groups<WT, TWO, NT, K>(u, scs, q, sl, st, T0, I + T0, I2 + T0);
    kplanes_groups_all<WT, TWO, NT, KMAX, T0 + K>(u, scs, q, sl, st, I, I2);
  }
}

// Tokens whose chains run side by side on one group's slices: Q6_K's 16 sub-blocks of 16 (four
// slices each, a vpmulld per chain) keep 4 tokens' chains in flight, about 10% faster than 2 on
// a Zen 4 core (`cflow_bench_gemm --type q6_k --batched 1 --levels 2`, ten alternating runs);
// Q4_K and Q5_K (sub-blocks of 32) measured the same either way and keep 2.
template <BlockType WT>
constexpr int kGroupTokens = WT == BlockType::Q6_K ? 4 : 2;

template <BlockType WT, bool TWO, int NT>
void kplanes_tokens(float* y, int ldy, const uint8_t* xv, size_t ab, const uint8_t* w, const TileLayout& L,
                    int row_begin, int row_end) {
  using P = KPassActs<WT, TWO, NT>;
  const TokenActs<block_q8_K, NT> x(xv, ab, L.cols);
  bool have;
  void* buf = pass_scratch_for(P::bytes(L.cols / QK_K), {acts_stamp(), xv, (int)WT, TWO, NT, L.cols}, &have);
  const P pa(x, L.cols / QK_K, buf, have);
  walk_planes<WT>(y, w, L, row_begin, row_end, [&](int r, int gg, int cb0, int nb, auto&& chunk) {
    __m512 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      const uint8_t* c = chunk(b);
      const int cb = cb0 + b;
      const int32_t *sl = pa.q + (size_t)cb * P::kQ, *st = pa.st + (size_t)cb * P::kS;
      __m512i I[NT], I2[NT];
      for (int t = 0; t < NT; ++t) I[t] = I2[t] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {  // unrolled: every plane and activation offset a constant
        __m512i u[16];
        planes_prefetch_quarter(c, 16 * KPlanesKind<WT>::kBB, q);
        kplanes_unpack<WT>(c, q, u);
        __m512i scs[KPlanesKind<WT>::kSubs];  // the group's sub-block scales, formed once for every token
        for (int r = 0; r < KPlanesKind<WT>::kSubs; ++r) scs[r] = kplanes_scale<WT>(c, KPlanesKind<WT>::sub(q, r));
        kplanes_groups_all<WT, TWO, NT, kGroupTokens<WT>>(u, scs, q, sl, st, I, I2);
      }
      __m512i mp[4];
      if constexpr (KPlanesKind<WT>::kQ4) kplanes_min_pairs<WT>(c, mp);
      for (int t = 0; t < NT; ++t) {
        __m512i M = _mm512_setzero_si512(), M2 = M;
        if constexpr (KPlanesKind<WT>::kQ4) {
          const int32_t* ap = pa.ms + ((size_t)cb * NT + t) * P::L * 4;
          M = kplanes_mins_pairs(mp, ap);
          if (TWO) M2 = kplanes_mins_pairs(mp, ap + 4);
        }
        acc[t] = kplanes_finish<WT, TWO>(c, I[t], M, I2[t], M2, x.x[t][cb], x.x2[t] + cb, acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t) planes_store(y + (size_t)t * ldy + r, gg, acc[t]);
  });
}

// The one-token GEMVs of fill_planes_table (planes_simd.h): the pass of one token. TWO: x holds
// the first level's blocks (cols/32 block_q8a, or cols/256 block_q8_K), then the second's.
template <BlockType WT, bool TWO>
void gemv_planes_q8(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  planes_tokens<WT, TWO, 1>(y, 0, (const uint8_t*)xv, act_bytes(WT, TWO ? AType::Q8x2 : AType::Q8, L.cols), w, L,
                            row_begin, row_end);
}

template <BlockType WT, bool TWO>
void gemv_kplanes_q8(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  kplanes_tokens<WT, TWO, 1>(y, 0, (const uint8_t*)xv, act_bytes(WT, TWO ? AType::Q8x2 : AType::Q8, L.cols), w, L,
                             row_begin, row_end);
}

template <BlockType WT, bool TWO>
void gemv_batch_vnni(float* y, int ldy, const void* xv, int m, const uint8_t* w, const TileLayout& L, int row_begin,
                     int row_end) {
  const int n = std::min(row_end, L.rows) - row_begin;
  if (n <= 0 || m <= 0) return;
  const size_t ab = act_bytes(WT, TWO ? AType::Q8x2 : AType::Q8, L.cols);
  for (int k = 0; k < m; ++k) std::memset(y + (size_t)k * ldy, 0, sizeof(float) * n);
  for (int t0 = 0; t0 < m; t0 += kVnniGroup) {
    const uint8_t* x = (const uint8_t*)xv + t0 * ab;
    with_count<kVnniGroup>(std::min(kVnniGroup, m - t0), [&](auto NT) {
      if constexpr (kKQuant<WT>)
        kplanes_tokens<WT, TWO, NT>(y + (size_t)t0 * ldy, ldy, x, ab, w, L, row_begin, row_end);
      else
        planes_tokens<WT, TWO, NT>(y + (size_t)t0 * ldy, ldy, x, ab, w, L, row_begin, row_end);
    });
  }
}

// A row of activations -> block_q8a at 512 bits, byte for byte quantize_q8a_v: the blocks' scales
// and their reciprocals 16 blocks at a time, before any block is quantized. Block by block, each
// block's two scalar divisions (d = max / 127, then 1 / d) sat on the path from its maximum to its
// bytes; as vectors they are the same IEEE divisions (vdivps), off that path. (Level 2 keeps the
// shared quantize_q8a_level2_v: a version built the same way measured slower.)
constexpr int kScaleRun = 16;  // blocks whose scales are divided at once

inline void quantize_q8a_512(block_q8a* out, const float* x, int cols) {
  const int nb = cols / QK;
  q8a_sums* ls = q8a_sums_of(out, cols);
  const __m512 sign = _mm512_set1_ps(-0.f);
  alignas(64) float d[kScaleRun], id[kScaleRun];
  for (int b0 = 0; b0 < nb; b0 += kScaleRun) {
    const int m = std::min(kScaleRun, nb - b0);
    for (int j = 0; j < m; ++j) {
      const float* xb = x + (size_t)(b0 + j) * QK;
      d[j] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_andnot_ps(sign, _mm512_loadu_ps(xb)),
                                                _mm512_andnot_ps(sign, _mm512_loadu_ps(xb + 16))));
    }
    const __mmask16 live = (__mmask16)((1u << m) - 1);
    const __m512 vd = _mm512_div_ps(_mm512_maskz_loadu_ps(live, d), _mm512_set1_ps(127.f));
    // d ? 1 / d : 0 (NaN != 0: NaN, as the scalar test)
    const __mmask16 nz = _mm512_cmp_ps_mask(vd, _mm512_setzero_ps(), _CMP_NEQ_UQ);
    _mm512_store_ps(d, vd);
    _mm512_store_ps(id, _mm512_maskz_div_ps(nz, _mm512_set1_ps(1.f), vd));
    for (int j = 0; j < m; ++j) {
      const float* xb = x + (size_t)(b0 + j) * QK;
      block_q8a& o = out[b0 + j];
      const __m512 vid = _mm512_set1_ps(id[j]);
      const __m128i q0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb), vid)));
      const __m128i q1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16), vid)));
      const __m256i q = _mm256_inserti128_si256(_mm256_castsi128_si256(q0), q1, 1);
      _mm256_storeu_si256((__m256i*)o.qs, q);
      finish_q8a_v(o, ls[b0 + j], q, d[j]);
    }
  }
}

// The wider kernels above in place of the shared ones (after fill_table).
void fill_wide(KernelTable& t) {
  t.quantize_q8a = quantize_q8a_512;
  set_gemv_q8<gemv_nib_q8<Q4_0>>(t, BlockType::Q4_0);
  set_gemv_q8<gemv_nib_q8<Q4_1>>(t, BlockType::Q4_1);
  set_gemv_q8<gemv_nib_q8<Q5_0>>(t, BlockType::Q5_0);
  set_gemv_q8<gemv_nib_q8<Q5_1>>(t, BlockType::Q5_1);
  set_gemv_q8<gemv_q8<KQ4_K512>>(t, BlockType::Q4_K);
  set_gemv_q8<gemv_q8<KQ5_K512>>(t, BlockType::Q5_K);
  set_gemv_q8<gemv_q8<KQ6_K512>>(t, BlockType::Q6_K);
  set_gemv_q8<gemv_tq2_q8>(t, BlockType::TQ2_0);
}

}  // namespace

GemvBatchFn vnni_gemv_batch(BlockType bt, Pack pack, AType at) {
  if (bt == BlockType::TQ2_0 && pack == Pack::Blocks && at == AType::Q8) return gemv_tq2_batch;
  if (GemvBatchFn f = tern_batch_fn(bt, pack, at)) return f;
  return planes_batch_fn(bt, pack, at, [](auto wt, auto two) -> GemvBatchFn {
    return gemv_batch_vnni<decltype(wt)::value, decltype(two)::value>;
  });
}

}  // namespace avx512

const KernelTable& kernel_table_avx512() {
  static const KernelTable t =
      make_table(Isa::Avx512, {avx512::fill_table, avx512::fill_planes_table, avx512::fill_gemm, avx512::fill_wide});
  return t;
}

}  // namespace cflow
