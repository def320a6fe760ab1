#include <immintrin.h>

#include "cflow/probe.h"

namespace cflow {
namespace avx512 {

// 4 cache lines per iteration into 4 independent accumulators (the adds are never the limit).
float read_sum(const float* p, size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  alignas(64) float t[16];
  _mm512_store_ps(t, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  float s = 0.0f;
  for (float v : t) s += v;
  return s;
}

}  // namespace avx512
}  // namespace cflow
