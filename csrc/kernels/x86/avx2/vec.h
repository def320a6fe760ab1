// The float-vector traits of AVX2 + FMA + F16C: 8 floats per register; used by the ops (x86/ops_simd.h)
// and the GEMVs (x86/gemv_simd.h), which derive their V from it. Compiled
// only with the ISA's flags (files under x86/avx2/).
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace cflow {
namespace avx2 {

struct Vec {
  using reg = __m256;
  static constexpr int W = 8;
  static reg zero() { return _mm256_setzero_ps(); }
  static reg set1(float a) { return _mm256_set1_ps(a); }
  static reg load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, reg a) { _mm256_storeu_ps(p, a); }
  static __m256i mask(int n) {  // first n lanes set
    static const int32_t m[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
    return _mm256_loadu_si256((const __m256i*)(m + 8 - n));
  }
  static reg load_n(const float* p, int n, float fill = 0.f) {
    const __m256i k = mask(n);
    return _mm256_blendv_ps(set1(fill), _mm256_maskload_ps(p, k), _mm256_castsi256_ps(k));
  }
  static void store_n(float* p, reg a, int n) { _mm256_maskstore_ps(p, mask(n), a); }
  // IEEE halves (uint16_t bits) <-> floats: widening is exact, narrowing rounds to nearest even.
  // No 16-bit masked moves in AVX2: ragged ends go through a small buffer.
  static reg load_h(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
  static reg load_h_n(const uint16_t* p, int n) {
    alignas(16) uint16_t t[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < n; ++i) t[i] = p[i];
    return _mm256_cvtph_ps(_mm_load_si128((const __m128i*)t));
  }
  static void store_h(uint16_t* p, reg a) {
    _mm_storeu_si128((__m128i*)p, _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  static void store_h_n(uint16_t* p, reg a, int n) {
    alignas(16) uint16_t t[8];
    _mm_store_si128((__m128i*)t, _mm256_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (int i = 0; i < n; ++i) p[i] = t[i];
  }
  static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  static reg fmadd(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static reg fnmadd(reg a, reg b, reg c) { return _mm256_fnmadd_ps(a, b, c); }
  static reg max(reg a, reg b) { return _mm256_max_ps(a, b); }
  static reg min(reg a, reg b) { return _mm256_min_ps(a, b); }
  static float hsum(reg a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static float hsum8(__m256 a) { return hsum(a); }
  // The sums of a, b, c, d as the 4 lanes of one __m128 (the dot products of 4 rows at once).
  static __m128 hsum4(reg a, reg b, reg c, reg d) {
    const __m256 abcd = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
  }
  static float hmax(reg a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  // Bit j set where lane j of a is >= b (clear for NaN lanes).
  static unsigned ge_mask(reg a, reg b) { return (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
  static reg round(reg a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static reg ldexp(reg y, reg n) {  // two factors 2^n1 * 2^n2 keep each exponent in range
    const __m256i ni = _mm256_cvtps_epi32(n);
    const __m256i n1 = _mm256_srai_epi32(ni, 1), n2 = _mm256_sub_epi32(ni, n1);
    const __m256i b = _mm256_set1_epi32(127);
    const reg f1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, b), 23));
    const reg f2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, b), 23));
    return mul(mul(y, f1), f2);
  }
};

// The int8 side, over 256-bit integer vectors ("lane" = 4 bytes = one int32 of the result):
//   dot(acc, u, s)          acc + lane sums of u * s (u unsigned, at most 128; s signed)
//   dot_sc(acc, u, s, sc)   acc + madd(maddubs(u, s), sc): pair sums of u * s times the int16 sc
//   dot_s8(w, s, lsum8)     lane sums of w * s, both signed (lsum8: the lane sums of s)
//   bits32(b)               byte j = 0xFF where bit j of b is set
struct IVec {
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

// An empty asm that takes v in a register and may change it: a running sum into v is then
// finished in program order, where the compiler would otherwise reassociate a chunk's many
// maddubs into a tree whose live partial results outnumber the 16 ymm registers and go to the
// stack (a quarter of the one-token GEMV's instructions were such spills, docs/KERNELS.md).
inline void keep_in_register(__m256i& v) { __asm__("" : "+x"(v)); }

}  // namespace avx2
}  // namespace cflow
