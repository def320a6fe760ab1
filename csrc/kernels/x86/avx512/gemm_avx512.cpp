// AVX-512 (VNNI) GEMMs over the tiled layout: the shared x86/gemm_simd.h with 512-bit vectors
// and vpdpbusd, and its planes kernel (16 rows in one zmm).
#include <immintrin.h>

#include <type_traits>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "../../isa_kernels.h"
#include "../../tile_walk.h"
#include "cflow/gemm.h"
#include "cflow/planes.h"
#include "vec.h"

namespace cflow {
namespace avx512 {
namespace {

struct V : Vec, IVec {
  static constexpr int kNT = 4;        // 4 rows x 4 tokens: 16 of the 32 registers accumulate
  static constexpr int kPlanesNT = 8;  // tokens per planes_tokens call: 8 zmm accumulate
};

#include "../planes_simd.h"
#include "planes_unpack.h"

// ---- planes GEMM at 512 bits (gemm_simd.h: planes_tokens) ----
// An interleave group of 16 rows is one zmm (lane i = row i). Per column block, the chunk's
// planes are unpacked once into 8 registers of unsigned weights (planes_unpack.h), u[j] holding
// slice j (weights 4j..4j+3 of every row; for Q4 the high nibbles are slices 4..7); then each of
// NT tokens meets them with its own 8 activation slices, broadcast: 8 vpdpbusd give the 16 rows'
// int32 dots. Per (block, token), f = d_x * dot summed over the levels (level 2 by one fma),
// s_x = d_x * sum(q_x) of each level: acc += d_w * (f + off * s_x), off = -kZero (Q4_0 -8,
// Q5_0 -16, Q8_0 -128), or acc += d_w * f + m_w * s_x (Q4_1, Q5_1). No shuffles, no horizontal sums.
// Port 0 is the limit: it alone runs the 512-bit vpdpbusd, so nothing else that only it runs
// (vcvtdq2ps) is in the token loop: a dot starts from the bits of 1.5 * 2^23, and as a float the
// sum is 1.5 * 2^23 + dot exactly (|dot| <= 32 * 255 * 127 < 2^22), one subtraction away. The
// s_x terms take their broadcasts from memory, folded into the fmas. Every token is unrolled,
// so acc[] and the token pointers stay in registers.
template <BlockType TYPE, int NT, bool TWO, class Chunk>
void planes_tokens(int bpr, Chunk&& chunk, const QActs& x, int k0, float* y, int ldy, int g) {
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i magic = _mm512_set1_epi32(0x4B400000);  // the bits of 1.5 * 2^23
  const __m512 magic_f = _mm512_set1_ps(12582912.f);
  const __m512 off = _mm512_set1_ps(-(float)PlanesKind<TYPE>::kZero);
  // The int32 dots of one token's activation block with the 16 rows, as floats; two chains.
  auto dot = [&](const __m512i* u, const block_q8a* a) {
    const int32_t* xs = (const int32_t*)a->qs;
    __m512i s0 = magic, s1 = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
      s0 = _mm512_dpbusd_epi32(s0, u[j], _mm512_set1_epi32(xs[j]));
      s1 = _mm512_dpbusd_epi32(s1, u[j + 1], _mm512_set1_epi32(xs[j + 1]));
    }
    return _mm512_sub_ps(_mm512_castsi512_ps(_mm512_add_epi32(s0, s1)), magic_f);
  };
  const block_q8a* xr[NT];
  token_rows<NT>(x, k0, xr);
  const size_t l2 = level_bytes(x);
  for (int cb = 0; cb < bpr; ++cb) {
    const uint8_t* c = chunk(cb);
    __m512i u[8];
    planes_unpack<TYPE>(c, u);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)c));
    __m512 m = _mm512_setzero_ps();
    if constexpr (PlanesKind<TYPE>::kHasM) m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(c + 32)));
#pragma GCC unroll 16
    for (int t = 0; t < NT; ++t) {
      const block_q8a* a = xr[t] + cb;
      const block_q8a* a2 = level2(a, l2);
      __m512 f = _mm512_mul_ps(dot(u, a), _mm512_set1_ps(a->d));
      if constexpr (TWO) f = _mm512_fmadd_ps(dot(u, a2), _mm512_set1_ps(a2->d), f);
      if constexpr (PlanesKind<TYPE>::kHasM) {
        acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a->s), _mm512_fmadd_ps(d, f, acc[t]));
        if constexpr (TWO) acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(a2->s), acc[t]);
      } else {
        f = _mm512_fmadd_ps(off, _mm512_set1_ps(a->s), f);
        if constexpr (TWO) f = _mm512_fmadd_ps(off, _mm512_set1_ps(a2->s), f);
        acc[t] = _mm512_fmadd_ps(d, f, acc[t]);
      }
    }
  }
  for (int t = 0; t < NT; ++t) _mm512_mask_storeu_ps(y + (size_t)(k0 + t) * ldy, (__mmask16)((1u << g) - 1), acc[t]);
}

#include "../gemm_simd.h"

}  // namespace

void fill_gemm(KernelTable& t) { fill_gemm_table(t); }

}  // namespace avx512

}  // namespace cflow
