// AVX-512 (VNNI) GEMMs over the tiled layout: the shared x86/gemm_simd.h with 512-bit vectors
// and vpdpbusd, and its planes kernel (16 rows in one zmm).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "../../isa_kernels.h"
#include "../../tile_walk.h"
#include "cflow/gemm.h"
#include "vec.h"

namespace cflow {
namespace avx512 {
namespace {

struct V : Vec, IVec {
  static constexpr int kNT = 4;        // 4 rows x 4 tokens: 16 of the 32 registers accumulate
  static constexpr int kPlanesNT = 8;  // tokens per planes_tokens call: 8 zmm accumulate
};

// ---- planes GEMM at 512 bits (gemm_simd.h: planes_tokens) ----
// An interleave group of 16 rows is one zmm (lane i = row i). Per column block, the chunk's
// planes are unpacked once into 8 registers of unsigned weights, u[j] holding slice j (weights
// 4j..4j+3 of every row; for Q4 the high nibbles are slices 4..7); then each of NT tokens meets
// them with its own 8 activation slices, broadcast: 8 vpdpbusd give the 16 rows' int32 dots.
// Per (block, token): acc += d_w * (d_x * dot + off * s_x), off = -8 (Q4_0) or -128 (Q8_0, made
// unsigned by ^ 0x80), or acc += d_w * d_x * dot + m_w * s_x (Q4_1); s_x = d_x * sum(q_x).
// No shuffles, no horizontal sums.
template <BlockType TYPE, int NT, bool TWO, class Chunk>
void planes_tokens(int bpr, Chunk&& chunk, const QActs& x, int k0, float* y, int ldy, int g) {
  constexpr int kHdr = planes_header(TYPE);
  __m512 acc[NT];
  for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i lo = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
  const __m512 off = _mm512_set1_ps(TYPE == BlockType::Q4_0 ? -8.f : TYPE == BlockType::Q8_0 ? -128.f : 0.f);
  // The int32 dots of one token's activation blocks q with the 16 rows.
  auto dot = [](const __m512i* u, const int8_t* q) {
    const int32_t* xs = (const int32_t*)q;
    __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
    for (int j = 0; j < 8; j += 2) {
      s0 = _mm512_dpbusd_epi32(s0, u[j], _mm512_set1_epi32(xs[j]));
      s1 = _mm512_dpbusd_epi32(s1, u[j + 1], _mm512_set1_epi32(xs[j + 1]));
    }
    return _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1));
  };
  const block_q8a* xr[NT][2];
  token_rows<NT>(x, k0, xr);
  for (int cb = 0; cb < bpr; ++cb) {
    const uint8_t* c = chunk(cb);
    const __m512i* pl = (const __m512i*)(c + kPlanesMaxG * kHdr);
    __m512i u[8];
    if constexpr (TYPE == BlockType::Q8_0) {
      for (int j = 0; j < 8; ++j) u[j] = _mm512_xor_si512(_mm512_loadu_si512(pl + j), flip);
    } else {
      for (int j = 0; j < 4; ++j) {
        const __m512i q = _mm512_loadu_si512(pl + j);
        u[j] = _mm512_and_si512(q, lo);
        u[4 + j] = _mm512_and_si512(_mm512_srli_epi16(q, 4), lo);
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)c));
    __m512 m = _mm512_setzero_ps();
    if constexpr (TYPE == BlockType::Q4_1) m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(c + 32)));
    for (int t = 0; t < NT; ++t) {
      // f = d_x * dot + off * s_x, summed over the levels; Q4_1's m * s_x goes in separately
      float sx;
      const __m512 f = over_levels<TWO>(xr[t], cb, sx, [&](const block_q8a& a) {
        return _mm512_mul_ps(dot(u, a.qs), _mm512_set1_ps(a.d));
      });
      if constexpr (TYPE == BlockType::Q4_1) {
        acc[t] = _mm512_fmadd_ps(m, _mm512_set1_ps(sx), _mm512_fmadd_ps(d, f, acc[t]));
      } else {
        acc[t] = _mm512_fmadd_ps(d, _mm512_fmadd_ps(off, _mm512_set1_ps(sx), f), acc[t]);
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
