// The float-vector traits of AVX-512: 16 floats per register; used by the ops (x86/ops_simd.h)
// and the GEMVs (x86/gemv_simd.h), which derive their V from it. Compiled
// only with the ISA's flags (files under x86/avx512/).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace cflow {
namespace avx512 {

struct Vec {
  using reg = __m512;
  static constexpr int W = 16;
  static reg zero() { return _mm512_setzero_ps(); }
  static reg set1(float a) { return _mm512_set1_ps(a); }
  static reg load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, reg a) { _mm512_storeu_ps(p, a); }
  static __mmask16 mask(int n) { return (__mmask16)((1u << n) - 1); }
  static reg load_n(const float* p, int n, float fill = 0.f) {
    return _mm512_mask_loadu_ps(set1(fill), mask(n), p);
  }
  static void store_n(float* p, reg a, int n) { _mm512_mask_storeu_ps(p, mask(n), a); }
  // IEEE halves (uint16_t bits) <-> floats: widening is exact, narrowing rounds to nearest even
  static reg load_h(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
  static reg load_h_n(const uint16_t* p, int n) { return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask(n), p)); }
  static void store_h(uint16_t* p, reg a) {
    _mm256_storeu_si256((__m256i*)p, _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void store_h_n(uint16_t* p, reg a, int n) {
    _mm256_mask_storeu_epi16(p, mask(n), _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static reg fnmadd(reg a, reg b, reg c) { return _mm512_fnmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm512_max_ps(a, b); }
  static reg min(reg a, reg b) { return _mm512_min_ps(a, b); }
  static float hsum(reg a) { return _mm512_reduce_add_ps(a); }
  static float hsum8(__m256 a) { return _mm512_reduce_add_ps(_mm512_zextps256_ps512(a)); }
  // The sums of a, b, c, d as the 4 lanes of one __m128 (the dot products of 4 rows at once).
  static __m128 hsum4(reg a, reg b, reg c, reg d) {
    auto half = [](reg v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); };
    const __m256 ab = _mm256_hadd_ps(half(a), half(b)), cd = _mm256_hadd_ps(half(c), half(d));
    const __m256 abcd = _mm256_hadd_ps(ab, cd);  // lane j (and 4 + j): halves of the sum of row j
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  }
  static float hmax(reg a) { return _mm512_reduce_max_ps(a); }
  // Bit j set where lane j of a is >= b (clear for NaN lanes).
  static unsigned ge_mask(reg a, reg b) { return _mm512_cmp_ps_mask(a, b, _CMP_GE_OQ); }
  static reg round(reg a) {
    return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  }
  static reg ldexp(reg y, reg n) {  // two factors 2^n1 * 2^n2 keep each exponent in range
    const __m512i ni = _mm512_cvtps_epi32(n);
    const __m512i n1 = _mm512_srai_epi32(ni, 1), n2 = _mm512_sub_epi32(ni, n1);
    const __m512i b = _mm512_set1_epi32(127);
    const reg f1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, b), 23));
    const reg f2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, b), 23));
    return mul(mul(y, f1), f2);
  }
};

// The int8 side, over 256-bit integer vectors ("lane" = 4 bytes = one int32 of the result):
//   dot(acc, u, s)          acc + lane sums of u * s (u unsigned, at most 128; s signed)
//   dot_sc(acc, u, s, sc)   acc + madd(maddubs(u, s), sc): pair sums of u * s times the int16 sc
//   dot_s8(w, s, lsum8)     lane sums of w * s, both signed (lsum8: the lane sums of s)
//   bits32(b)               byte j = 0xFF where bit j of b is set
struct IVec {
  static __m256i dot(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
  static __m256i dot_sc(__m256i acc, __m256i u, __m256i s, __m256i sc) {
    return _mm256_dpwssd_epi32(acc, _mm256_maddubs_epi16(u, s), sc);
  }
  static __m256i dot_s8(__m256i w, __m256i s, __m256i lsum8) {
    const __m256i c = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(lsum8, 7));
    return _mm256_dpbusd_epi32(c, _mm256_xor_si256(w, _mm256_set1_epi8((char)0x80)), s);
  }
  static __m256i bits32(uint32_t b) { return _mm256_movm_epi8(b); }
};

}  // namespace avx512
}  // namespace cflow
