// AVX2 + FMA + F16C GEMV kernels: the traits V (over vec.h's Vec) plus the shared
// x86/gemv_simd.h (every type, fp32 and int8 activations, any interleave). Without VNNI the
// int8 dot products are maddubs (unsigned x signed bytes -> int16 pair sums) + madd (-> int32);
// Q8_0 uses |w| times sign(x, w). The K-quants' sub-block scales ride the madd (int16 scales
// instead of ones).
#include <immintrin.h>

#include <cstring>

#include "../../isa_kernels.h"
#include "../../tile_walk.h"
#include "vec.h"

namespace cflow {
namespace avx2 {
namespace {

struct V : Vec {
  static float hsum8(__m256 a) { return hsum(a); }
  static void add_n(float* y, reg a, int n) { store_n(y, add(load_n(y, n), a), n); }
  static reg cvt_e(int e, __m128i h) {  // 8 fp16 or bf16 values -> floats
    if (e == 1) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  template <int E>
  static reg load_e(const uint8_t* p) {
    if (E == 0) return _mm256_loadu_ps((const float*)p);
    return cvt_e(E, _mm_loadu_si128((const __m128i*)p));
  }
  template <int E>
  static reg load_e_n(const uint8_t* p, int n) {
    if (E == 0) return load_n((const float*)p, n);
    // no 16-bit masked load in AVX2: pairs of halves as 32-bit lanes, or a copy for odd n
    if (n % 2 == 0) return cvt_e(E, _mm_maskload_epi32((const int*)p, _mm256_castsi256_si128(mask(n / 2))));
    alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::memcpy(t, p, (size_t)n * 2);
    return cvt_e(E, _mm_load_si128((const __m128i*)t));
  }
  static void fma32(__m256i q, float d0, float o0, float d1, float o1, const float* x, reg& a0, reg& a1) {
    const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
    const reg D0 = set1(d0), O0 = set1(o0), D1 = set1(d1), O1 = set1(o1);
    auto w = [](__m128i b, reg d, reg o) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d, o); };
    a0 = fmadd(w(lo, D0, O0), load(x), a0);
    a1 = fmadd(w(_mm_srli_si128(lo, 8), D0, O0), load(x + 8), a1);
    a0 = fmadd(w(hi, D1, O1), load(x + 16), a0);
    a1 = fmadd(w(_mm_srli_si128(hi, 8), D1, O1), load(x + 24), a1);
  }
  static __m256i dot(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
  }
  static __m256i dot_sc(__m256i acc, __m256i u, __m256i s, __m256i sc) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc));
  }
  static __m256i dot_s8(__m256i w, __m256i s, __m256i) {
    return dot(_mm256_setzero_si256(), _mm256_abs_epi8(w), _mm256_sign_epi8(s, w));
  }
  static __m256i bits32(uint32_t b) {  // byte j of the broadcast holds bit j's byte; test it
    const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
    const __m256i bytes = _mm256_shuffle_epi8(_mm256_set1_epi32((int)b), shuf);
    const __m256i bit = _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe);  // all bits but bit j % 8
    return _mm256_cmpeq_epi8(_mm256_or_si256(bytes, bit), _mm256_set1_epi64x(-1));
  }
};

#include "../gemv_simd.h"

}  // namespace
}  // namespace avx2

const GemvTable& gemv_table_avx2() {
  static GemvTable t = {};
  static const bool filled = [] {
    avx2::fill_table(t);
    return true;
  }();
  (void)filled;
  return t;
}

}  // namespace cflow
