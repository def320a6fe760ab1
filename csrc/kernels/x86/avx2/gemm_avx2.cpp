// AVX2 + FMA + F16C GEMMs over the tiled layout: the shared x86/gemm_simd.h with 256-bit
// vectors and, without VNNI, maddubs + madd for the int8 dots (IVec), its planes kernel (16 rows
// as two halves of 8).
#include <immintrin.h>

#include <type_traits>

#include <cmath>
#include <cstring>
#include <vector>

#include "../../isa_kernels.h"
#include "../../tile_walk.h"
#include "cflow/gemm.h"
#include "cflow/planes.h"
#include "vec.h"

namespace cflow {
namespace avx2 {
namespace {

struct V : Vec, IVec {
  static constexpr int kNT = 4;         // 4 rows x 4 tokens: 16 accumulators, a few kept in L1
  static constexpr int kPlanesNT = 16;  // tokens per planes chunk visit (32 accumulators, most in L1;
                                        // each chunk unpacked once for 16 tokens: docs/KERNELS.md)
};

#include "../planes_simd.h"
#include "planes_unpack.h"
#include "planes_x16.h"

// ---- planes GEMM at 256 bits (gemm_simd.h: planes_tokens) ----
// A chunk of 16 rows is two halves of 8 (int32 lane i = row 8h + i; half h is bytes 32h..32h+31
// of every 64-byte plane). Per half the 8 slices are unpacked once into u[0..8) (planes_unpack.h;
// slice j: weights 4j..4j+3 of each row), then each token meets them with its 8 activation
// slices broadcast. Q4: 8 maddubs whose pair sums (at most 2 * 15 * 127) add up in int16 to at
// most 30480, no saturation, then one madd to int32; Q5_0 and Q5_1 (pair sums up to 2 * 31 *
// 127): two runs of 4 (31496), two madds (kRun). Q8_0: |w| times sign(x, w) per slice (pair sums
// up to 32512), each widened by madd; with two levels the half is widened to int16 instead and
// meets x16 = 256 q1 + q2 through the GEMV's integers and finish (planes_x16.h). Per (block,
// token): f = d_x * dot (- kZero * s_x: Q4_0 -8 s_x, Q5_0 -16 s_x), summed over the levels;
// acc += d_w * f (+ m_w * s_x for Q4_1, Q5_1); s_x = d_x * sum(q_x).
template <BlockType TYPE, int NT, bool TWO, class Chunk>
void planes_tokens(int bpr, Chunk&& chunk, const QActs& x, int k0, float* y, int ldy, int g) {
  __m256 acc[NT][2];
  for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
  const __m256i ones = _mm256_set1_epi16(1);
  // Slices whose maddubs (pair sums up to 2 * kMaxU * 127) add up in int16 without saturating.
  constexpr int kRun = 8 * 2 * PlanesKind<TYPE>::kMaxU * 127 <= 32767 ? 8 : 4;
  static_assert(!PlanesKind<TYPE>::kNib || kRun * 2 * PlanesKind<TYPE>::kMaxU * 127 <= 32767);
  // The int32 dots of one token's activation block q with the 8 rows of a half, as floats.
  // Each 4-byte slice is broadcast straight from the activation block (no copy through the stack).
  auto dot = [&](const __m256i* u, const int8_t* q) {
    auto xs = [q](int j) {
      int32_t v;
      std::memcpy(&v, q + 4 * j, 4);
      return v;
    };
    __m256i s = _mm256_setzero_si256();
    if constexpr (TYPE == BlockType::Q8_0) {
      for (int j = 0; j < 8; ++j) {
        const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(u[j]), _mm256_sign_epi8(_mm256_set1_epi32(xs(j)), u[j]));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, ones));
      }
    } else {  // kRun slices summed in int16, then one madd
      for (int j0 = 0; j0 < 8; j0 += kRun) {
        __m256i p = _mm256_maddubs_epi16(u[j0], _mm256_set1_epi32(xs(j0)));
        for (int j = j0 + 1; j < j0 + kRun; ++j) {
          p = _mm256_add_epi16(p, _mm256_maddubs_epi16(u[j], _mm256_set1_epi32(xs(j))));
          keep_in_register(p);
        }
        s = j0 ? _mm256_add_epi32(s, _mm256_madd_epi16(p, ones)) : _mm256_madd_epi16(p, ones);
      }
    }
    return _mm256_cvtepi32_ps(s);
  };
  const block_q8a* xr[NT];
  token_rows<NT>(x, k0, xr);
  const size_t l2 = level_bytes(x);
  for (int cb = 0; cb < bpr; ++cb) {
    const uint8_t* c = chunk(cb);
    if constexpr (TYPE == BlockType::Q8_0 && TWO) {  // both levels in 16 bits, the GEMV's integers
      static_assert(NT <= 16);
      q8_chunk_two_levels(c, NT, [&](int t) -> const block_q8a& { return xr[t][cb]; },
                          [&](int t) { return level2(xr[t] + cb, l2); }, acc);
      continue;
    }
    for (int h = 0; h < 2; ++h) {
      __m256i u[8];
      planes_unpack<TYPE>(c, h, u);
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + 16 * h)));
      __m256 m = _mm256_setzero_ps();
      if constexpr (PlanesKind<TYPE>::kHasM) m = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(c + 32 + 16 * h)));
      for (int t = 0; t < NT; ++t) {
        const block_q8a* a = xr[t] + cb;
        const block_q8a* a2 = level2(a, l2);
        __m256 f = _mm256_mul_ps(dot(u, a->qs), _mm256_set1_ps(a->d));
        if constexpr (TWO) f = _mm256_fmadd_ps(dot(u, a2->qs), _mm256_set1_ps(a2->d), f);
        if constexpr (PlanesKind<TYPE>::kNib && PlanesKind<TYPE>::kZero)
          f = _mm256_add_ps(f, _mm256_set1_ps(-(float)PlanesKind<TYPE>::kZero * (TWO ? a->s + a2->s : a->s)));
        acc[t][h] = _mm256_fmadd_ps(d, f, acc[t][h]);
        if constexpr (PlanesKind<TYPE>::kHasM) {
          acc[t][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a->s), acc[t][h]);
          if constexpr (TWO) acc[t][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(a2->s), acc[t][h]);
        }
      }
    }
  }
  for (int t = 0; t < NT; ++t) {
    float* yt = y + (size_t)(k0 + t) * ldy;
    if (g >= 8) Vec::store(yt, acc[t][0]);
    else Vec::store_n(yt, acc[t][0], g);
    if (g > 8) Vec::store_n(yt + 8, acc[t][1], g - 8);
  }
}

#include "../gemm_simd.h"

}  // namespace

void fill_gemm(KernelTable& t) { fill_gemm_table(t); }

}  // namespace avx2

}  // namespace cflow
