// AVX2 + FMA + F16C GEMV kernels: the traits V (over vec.h's Vec) plus the shared
// x86/gemv_simd.h (every type, fp32 and int8 activations, any interleave). Without VNNI the
// int8 dot products are maddubs (unsigned x signed bytes -> int16 pair sums) + madd (-> int32);
// Q8_0 uses |w| times sign(x, w). The K-quants' sub-block scales ride the madd (int16 scales
// instead of ones).
#include <immintrin.h>

#include <type_traits>

#include <cmath>
#include <cstring>
#include <vector>

#include "../../isa_kernels.h"
#include "../../tile_walk.h"
#include "cflow/planes.h"
#include "vec.h"

namespace cflow {
namespace avx2 {
namespace {

struct V : Vec, IVec {
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
};

// One block of 32 activations -> o.qs; returns the scale d.
inline float quantize_block(const float* x, block_q8a& o) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undo the lane-wise packs
  __m256 v[4], m = _mm256_setzero_ps();
  for (int j = 0; j < 4; ++j) {
    v[j] = _mm256_loadu_ps(x + 8 * j);
    m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
  }
  const float d = Vec::hmax(m) / 127.f, id = d ? 1.f / d : 0.f;
  const __m256 vid = _mm256_set1_ps(id);
  __m256i q[4];
  for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], vid));
  const __m256i w01 = _mm256_packs_epi32(q[0], q[1]), w23 = _mm256_packs_epi32(q[2], q[3]);
  _mm256_storeu_si256((__m256i*)o.qs, _mm256_permutevar8x32_epi32(_mm256_packs_epi16(w01, w23), order));
  return d;
}

#include "../gemv_simd.h"
#include "../planes_simd.h"
#include "kplanes.h"
#include "planes_unpack.h"
#include "planes_x16.h"

// ---- planes-packed Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0, int8 activations (cflow/planes.h) ----
// A group of 16 rows is two ymm of int32 lanes (rows 0..7, 8..15): each 64-byte plane is two
// 32-byte halves (planes_unpack.h), and slice j of the activation is broadcast to every lane.
// Nibbles: maddubs of the slices, their int16 sums added while they cannot saturate (8 slices
// of 4-bit weights: at most 8 * 2 * 15 * 127 = 30480; 4 of Q5_0's or Q5_1's: 31496), one madd to int32 per
// run; the start value -kZero * sum(x) as the AVX-512 kernel. Q8_0: |w| times sign(x, w).
// y[0 .. gg) += a group's outputs: rows 0..7 in a0, 8..15 in a1 (rows past gg dropped). A full
// group adds as two vectors: a K-quant tile is one block wide, so the GEMVs add a group for each
// chunk of 16 x 256 weights, 16 times a chunk in a batched pass of 16 tokens.
inline void add_group(float* y, int gg, __m256 a0, __m256 a1) {
  if (gg == kPlanesMaxG) {
    _mm256_storeu_ps(y, _mm256_add_ps(_mm256_loadu_ps(y), a0));
    _mm256_storeu_ps(y + 8, _mm256_add_ps(_mm256_loadu_ps(y + 8), a1));
    return;
  }
  alignas(32) float t[16];
  _mm256_store_ps(t, a0);
  _mm256_store_ps(t + 8, a1);
  for (int i = 0; i < gg; ++i) y[i] += t[i];
}

// The exact integers I = 256 s + s2 (TWO) or s of NH halves of a chunk (S[i]: half h0 + i) against
// one activation block and its second level, plane by plane: slice(h, k, ul, uh) gives plane k's
// two unsigned slices k and 4 + k of half h (Q8_0: slice k's signed weights in ul), which meet
// every level's broadcast activation slices before the next plane is touched. Each level's
// maddubs add up in int16 over kRun planes (2 slices a plane: 8 slices of 4-bit weights, 4 of
// 5-bit ones), kept in one register each (keep_in_register); Q8_0 takes |w| times sign(x, w) and a
// madd per slice. s starts at z, the block's -kZero * sum(a) (BlockStart).
// Unpacking a half's 8 slices into registers first and broadcasting the 8 activation slices
// once (as before 2026-12-03) keeps 16 vectors live, all of AVX2's registers: the spills made
// the one-token GEMV 1.5-2x slower (docs/KERNELS.md).
template <BlockType WT, bool TWO, int NH, class SliceF>
inline void planes_dot(SliceF&& slice, int h0, const block_q8a& a, const block_q8a* a2, int32_t z, __m256i (&S)[NH]) {
  using K = PlanesKind<WT>;
  const __m256i ones = _mm256_set1_epi16(1);
  // The activation bytes through pointers the compiler cannot see through: where a caller
  // meets the same blocks again (the two halves, the tokens of a pass), it would otherwise keep
  // every broadcast of the first call for the next, in registers it does not have (stack spills).
  const int8_t* q1 = a.qs;
  const int8_t* q2 = TWO ? a2->qs : a.qs;
  __asm__("" : "+r"(q1), "+r"(q2));
  auto bcast = [&](int level, int j) {  // activation slice j (bytes 4j .. 4j+3) to every lane
    int32_t v;
    std::memcpy(&v, (level == 1 ? q1 : q2) + 4 * j, 4);
    return _mm256_set1_epi32(v);
  };
  for (int i = 0; i < NH; ++i) S[i] = _mm256_set1_epi32(K::kNib && K::kZero ? z : 0);
  auto merge = [&](__m256i& Si, __m256i p1, __m256i p2) {  // one run's int32 sums into S
    Si = _mm256_add_epi32(Si, TWO ? _mm256_add_epi32(_mm256_slli_epi32(p1, 8), p2) : p1);
  };
  if constexpr (K::kNib) {
    constexpr int kRun = 32767 / (2 * K::kMaxU * 127) >= 8 ? 4 : 2;  // planes per int16 run
    for (int k0 = 0; k0 < 4; k0 += kRun) {
      __m256i P1[NH], P2[NH];
      for (int i = 0; i < NH; ++i) P1[i] = P2[i] = _mm256_setzero_si256();
      for (int k = k0; k < k0 + kRun; ++k) {
        const __m256i xl = bcast(1, k), xh = bcast(1, 4 + k);
        const __m256i xl2 = TWO ? bcast(2, k) : xl, xh2 = TWO ? bcast(2, 4 + k) : xh;
        for (int i = 0; i < NH; ++i) {
          __m256i ul, uh;
          slice(h0 + i, k, ul, uh);
          auto dot = [&](__m256i xlo, __m256i xhi) {  // plane k's two slices against one level
            return _mm256_add_epi16(_mm256_maddubs_epi16(ul, xlo), _mm256_maddubs_epi16(uh, xhi));
          };
          P1[i] = _mm256_add_epi16(P1[i], dot(xl, xh));
          keep_in_register(P1[i]);
          if (TWO) {
            P2[i] = _mm256_add_epi16(P2[i], dot(xl2, xh2));
            keep_in_register(P2[i]);
          }
        }
      }
      for (int i = 0; i < NH; ++i)
        merge(S[i], _mm256_madd_epi16(P1[i], ones), TWO ? _mm256_madd_epi16(P2[i], ones) : P1[i]);
    }
  } else {
    for (int k = 0; k < 8; ++k) {
      const __m256i x1 = bcast(1, k), x2 = TWO ? bcast(2, k) : x1;
      for (int i = 0; i < NH; ++i) {
        __m256i wq, unused;
        slice(h0 + i, k, wq, unused);
        const __m256i aw = _mm256_abs_epi8(wq);
        const __m256i p1 = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x1, wq)), ones);
        merge(S[i], p1, TWO ? _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(x2, wq)), ones) : p1);
      }
    }
  }
}

// Plane k's slices of half h straight from chunk c (the one-token GEMV: no slice array at all;
// Q5_0 and Q5_1 read the half's qh plane again for each plane, from L1).
template <BlockType WT>
inline void planes_chunk_slice(const uint8_t* c, int h, int k, __m256i& ul, __m256i& uh) {
  using K = PlanesKind<WT>;
  const __m256i q = _mm256_loadu_si256((const __m256i*)(c + K::kQs + 64 * k + 32 * h));
  if constexpr (!K::kNib) {
    ul = q;
  } else {
    const __m256i lo = _mm256_set1_epi8(0x0F);
    ul = _mm256_and_si256(q, lo), uh = _mm256_and_si256(_mm256_srli_epi16(q, 4), lo);
    if constexpr (K::kFifth) {
      const __m256i qh = _mm256_loadu_si256((const __m256i*)(c + K::kQh + 32 * h));
      const __m256i qh4 = _mm256_slli_epi16(qh, 4);
      ul = _mm256_or_si256(ul, planes_fifth(qh, qh4, k));
      uh = _mm256_or_si256(uh, planes_fifth(qh, qh4, 4 + k));
    }
  }
}

// planes_dot's slices from a half unpacked by planes_unpack: plane k's slices k and 4 + k (nibble
// types, k < 4), or slice k itself (Q8_0, k < 8).
template <BlockType WT>
inline auto unpacked_slices(const __m256i (&u)[8]) {
  return [&u](int, int k, __m256i& ul, __m256i& uh) {
    ul = u[k];
    if constexpr (PlanesKind<WT>::kNib) uh = u[4 + k];
  };
}

// One chunk of 16 rows, both halves, against one or two activation levels (the one-token GEMV).
// Each plane's slices are unpacked where they meet the activations. With one level both halves
// share the broadcasts (NH 2); Q5_0 and Q5_1 with two levels take one half at a time, since their
// fifth bits make the two halves' slices too many live registers (2026-12-03, ns per (token, 16 x
// 32) in L2: Q5_0 23.0 -> 21.4 against unpacking each half's 8 slices first, one level 18.6 ->
// 17.7; NH 2 with two levels: 27.2).
template <BlockType WT, bool TWO>
inline void planes_block(const uint8_t* c, const block_q8a& a, const block_q8a* a2, const BlockStart* st,
                         __m256& acc0, __m256& acc1) {
  if constexpr (WT == BlockType::Q8_0 && TWO) {
    alignas(32) int16_t x16[32];  // Q8_0's widening costs less than its int8 path even for one token
    x16_of(a, *a2, x16);
    __m256i S[2];
    dot16<2, true>([&](int h, int j, __m256i& wl, __m256i& wh) { q8_widen(c, h, j, wl, wh); }, 0, x16, S);
    acc0 = planes_finish<WT, TWO>(c, 0, S[0], a, a2, acc0);
    acc1 = planes_finish<WT, TWO>(c, 1, S[1], a, a2, acc1);
  } else if constexpr (PlanesKind<WT>::kFifth && TWO) {
    auto slice = [&](int h, int k, __m256i& ul, __m256i& uh) { planes_chunk_slice<WT>(c, h, k, ul, uh); };
    __m256i S[1];
    planes_dot<WT, TWO, 1>(slice, 0, a, a2, start_z<WT>(st), S);
    acc0 = planes_finish<WT, TWO>(c, 0, S[0], a, a2, st, acc0);
    planes_dot<WT, TWO, 1>(slice, 1, a, a2, start_z<WT>(st), S);
    acc1 = planes_finish<WT, TWO>(c, 1, S[0], a, a2, st, acc1);
  } else {
    __m256i S[2];
    planes_dot<WT, TWO, 2>([&](int h, int k, __m256i& ul, __m256i& uh) { planes_chunk_slice<WT>(c, h, k, ul, uh); },
                           0, a, a2, start_z<WT>(st), S);
    acc0 = planes_finish<WT, TWO>(c, 0, S[0], a, a2, st, acc0);
    acc1 = planes_finish<WT, TWO>(c, 1, S[1], a, a2, st, acc1);
  }
}

// TWO (AType::Q8x2): x holds the first level's cols/32 blocks, then the second's; both are
// dotted with each chunk while it is in registers.
template <BlockType WT, bool TWO>
void gemv_planes_q8(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  const block_q8a* x = (const block_q8a*)xv;
  const block_q8a* x2 = (const block_q8a*)((const uint8_t*)xv + q8a_row_bytes(L.cols));
  constexpr bool kStarts = kBlockStarts<WT>;
  const BlockStart* st = kStarts ? block_starts<WT, TWO>((const uint8_t*)xv, 0, 1, L.cols) : nullptr;
  walk_planes<WT>(y, w, L, row_begin, row_end, [&](int r, int gg, int cb0, int nb, auto&& chunk) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b)
      planes_block<WT, TWO>(chunk(b), x[cb0 + b], x2 + cb0 + b, kStarts ? st + cb0 + b : nullptr, acc0, acc1);
    add_group(y + r, gg, acc0, acc1);
  });
}

// ---- planes-packed Q4_K / Q5_K / Q6_K, q8_K activations (kplanes.h) ----
// As the AVX-512 kernel, per half of the group (8 rows, one ymm): each sub-block's D_s from
// maddubs of its slices against the broadcast activation bytes, int16 sums of up to 32004
// (Q4_K: 8 slices of at most 2 * 15 * 127; Q5_K: 4 of 2 * 31 * 127; Q6_K: 2 of 2 * 63 * 127: no
// saturation), one madd to int32 per run. Q4_K and Q5_K (no offset) take their row scales in
// that madd, as int16 pairs (the same integers: sc * (pair + pair)); Q6_K's runs are summed
// from -kZero * (the sub-block's sum of x) and the sum times its row scales (vpmulld): its
// offset would need a madd of its own.
// Rows 8h .. 8h+7 of the NH halves h = h0 .. h0+NH-1: group q's share of I[h - h0] (and I2, the
// second level's) for one token, added in: slice(h, k) gives half h's slice k of the group
// unsigned (kplanes_unpack's u[k]), met by both levels' broadcast activation bytes (one broadcast
// for the NH halves) before the next, each int16 run kept in one register
// (keep_in_register), the loops unrolled so that with q a constant every plane index is one.
// q1 and q2: the token's levels' bytes, as the caller lets the compiler see them; z (Q6_K): its
// sub-blocks' start values for this super-block (kplanes_starts), unused by Q4_K and Q5_K.
// PIN: I and I2 held in registers at the end of each sub-block, so that the compiler does not
// interleave the sub-blocks of a fully unrolled group. In the one-token GEMV, which unpacks as it
// goes, the interleaving spilled int32 sums to the stack; pinned, Q6_K's GEMV runs 6.5% fewer
// instructions (its 37 vector stores per half chunk gone) and about 6% faster, Q5_K's 5% fewer
// and Q4_K's 1% (docs/KERNELS.md). The batched pass, whose slices come from L1, ran 3-5% more
// instructions pinned for Q5_K and Q6_K, and is left as the compiler schedules it.
template <BlockType WT, bool TWO, bool PIN = false, int NH = 1, class SliceF>
inline void kplanes_group_dot(SliceF&& slice, const uint8_t* c, int h0, int q, __m256i* I, __m256i* I2,
                              const int8_t* q1, const int8_t* q2, const __m256i* z) {
  using K = KPlanesKind<WT>;
  constexpr int kPer16 = K::kMaxU == 15 ? 8 : K::kMaxU == 31 ? 4 : 2;  // slices per int16 run
  static_assert(kPer16 * 2 * K::kMaxU * 127 <= 32767, "the int16 sums must not saturate");
  // Q4_K, Q5_K (no offset): the row scales (0..63) ride the madds as int16 pairs, the runs go
  // straight into I; Q6_K: the runs' sums start at -kZero * (the sub-block's sum of x) and are
  // multiplied by the scales after (one half at a time: kBothHalves).
  constexpr bool kScaleInMadd = K::kZero == 0;
  static_assert(NH == 1 || kScaleInMadd, "two halves at once hold only their sums");
  const __m256i ones = _mm256_set1_epi16(1);
  auto bcast = [](const int8_t* x, int s, int j) {
    int32_t v;
    std::memcpy(&v, x + K::kSubW * s + 4 * j, 4);
    return _mm256_set1_epi32(v);
  };
#pragma GCC unroll 4
  for (int r = 0; r < K::kSubs; ++r) {
    const int s = K::sub(q, r);
    __m256i m16[NH], D[NH], D2[NH];
    for (int i = 0; i < NH; ++i) {
      m16[i] = ones, D[i] = I[i], D2[i] = I2[i];
      if constexpr (kScaleInMadd) {
        const __m256i sc = kplanes_scale<WT>(c, h0 + i, s);
        m16[i] = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
      } else {
        D[i] = _mm256_load_si256(z + s);
        D2[i] = TWO ? _mm256_load_si256(z + K::kNumSub + s) : D[i];
      }
    }
#pragma GCC unroll 8
    for (int j0 = 0; j0 < K::kSlices; j0 += kPer16) {
      __m256i p[NH], p2[NH];
      for (int i = 0; i < NH; ++i) p[i] = p2[i] = _mm256_setzero_si256();
#pragma GCC unroll 8
      for (int j = j0; j < j0 + kPer16; ++j) {
        // each broadcast once for the NH halves, made where the first half meets it
        const __m256i u0 = slice(h0, r * K::kSlices + j), x1 = bcast(q1, s, j);
        p[0] = _mm256_add_epi16(p[0], _mm256_maddubs_epi16(u0, x1));
        keep_in_register(p[0]);
        const __m256i x2 = TWO ? bcast(q2, s, j) : x1;
        if (TWO) {
          p2[0] = _mm256_add_epi16(p2[0], _mm256_maddubs_epi16(u0, x2));
          keep_in_register(p2[0]);
        }
        for (int i = 1; i < NH; ++i) {
          const __m256i u = slice(h0 + i, r * K::kSlices + j);
          p[i] = _mm256_add_epi16(p[i], _mm256_maddubs_epi16(u, x1));
          keep_in_register(p[i]);
          if (TWO) {
            p2[i] = _mm256_add_epi16(p2[i], _mm256_maddubs_epi16(u, x2));
            keep_in_register(p2[i]);
          }
        }
      }
      for (int i = 0; i < NH; ++i) {
        D[i] = _mm256_add_epi32(D[i], _mm256_madd_epi16(p[i], m16[i]));
        if (TWO) D2[i] = _mm256_add_epi32(D2[i], _mm256_madd_epi16(p2[i], m16[i]));
      }
    }
    for (int i = 0; i < NH; ++i) {
      if constexpr (kScaleInMadd) {
        I[i] = D[i];
        if (TWO) I2[i] = D2[i];
      } else {
        const __m256i sc = kplanes_scale<WT>(c, h0 + i, s);
        I[i] = _mm256_add_epi32(I[i], _mm256_mullo_epi32(D[i], sc));
        if (TWO) I2[i] = _mm256_add_epi32(I2[i], _mm256_mullo_epi32(D2[i], sc));
      }
      if constexpr (PIN) {
        keep_in_register(I[i]);
        if (TWO) keep_in_register(I2[i]);
      }
    }
  }
}

// The types whose one-token GEMV takes both halves of a chunk per activation broadcast
// (kplanes_group_dot with NH 2): Q4_K and Q5_K, whose scales ride the madds. Broadcasting each
// slice once per half instead cost them a sixth of their instructions (2026-12-04, callgrind:
// Q4_K 220 -> 180, Q5_K 288 -> 265 per (token, 16 x 32); docs/KERNELS.md). Q6_K's runs start from
// its offsets and are multiplied by the scales after, twice the sums: both halves at once would
// not fit AVX2's registers.
template <BlockType WT>
constexpr bool kBothHalves = KPlanesKind<WT>::kZero == 0;

// The one-token GEMV's I and I2 of NH halves from h0 (rows 8h .. 8h+7 of half h): every group
// with each slice unpacked where it is used (kplanes_slice), no slice array. Unpacking a group's
// 16 slices into an array first, once per level (as before 2026-12-03), ran 1.5-2x slower on
// AVX2 (docs/KERNELS.md). The chunk
// is prefetched a quarter per group (planes_prefetch_quarter) on the first half's pass.
template <BlockType WT, bool TWO, int NH = 1>
inline void kplanes_isum(const uint8_t* c, int h0, const block_q8_K& a, const block_q8_K* a2, __m256i* I, __m256i* I2,
                         const __m256i* z) {
  for (int i = 0; i < NH; ++i) I[i] = I2[i] = _mm256_setzero_si256();
  // The activation bytes through pointers the compiler cannot see through (as planes_dot):
  // otherwise it loads each 4-byte slice of both levels once for both halves and parks them all
  // on the stack, a scalar load and store each: the load/store unit then bound the loop, 14-19%
  // slower (docs/KERNELS.md).
  const int8_t* q1 = a.qs;
  const int8_t* q2 = TWO ? a2->qs : a.qs;
  __asm__("" : "+r"(q1), "+r"(q2));
#pragma GCC unroll 4
  for (int q = 0; q < 4; ++q) {
    if (h0 == 0) planes_prefetch_quarter(c, 16 * KPlanesKind<WT>::kBB, q);
    kplanes_group_dot<WT, TWO, true, NH>([&](int h, int k) { return kplanes_slice<WT>(c, h, q, k); }, c, h0, q, I, I2,
                                         q1, q2, z);
  }
}

// Q6_K's start values, -kZero * (a sub-block's sum of x), as vectors: for each super-block of a
// token, its kNumSub sub-blocks' for level 1, then level 2's (zero with one level), at out.
// Made once a call and loaded by every chunk of the column; made where used they took a scalar
// multiply, a move to a vector register and a broadcast per sub-block, level and chunk (7% of
// the GEMV's vector operations). Every Q6_K caller passes them: with both forms in the unrolled
// loop behind a run-time test, it spilled (31 ns per (token, 16 x 32) against 24).
struct alignas(32) Lanes { int32_t v[8]; };
template <BlockType WT, bool TWO>
inline void kplanes_starts(const block_q8_K* x, const block_q8_K* x2, int nsb, __m256i* out) {
  using K = KPlanesKind<WT>;
  for (int b = 0; b < nsb; ++b, out += 2 * K::kNumSub)
    for (int s = 0; s < K::kNumSub; ++s) {
      out[s] = _mm256_set1_epi32(-K::kZero * K::asum(x[b], s));
      out[K::kNumSub + s] = _mm256_set1_epi32(TWO ? -K::kZero * K::asum(x2[b], s) : 0);
    }
}

// TWO: x holds the cols/256 block_q8_K of the first level, then those of the second.
template <BlockType WT, bool TWO>
void gemv_kplanes_q8(float* y, const void* xv, const uint8_t* w, const TileLayout& L, int row_begin, int row_end) {
  using K = KPlanesKind<WT>;
  const block_q8_K* x = (const block_q8_K*)xv;
  const block_q8_K* x2 = x + L.cols / QK_K;
  thread_local std::vector<Lanes> zs;
  const int per = 2 * K::kNumSub;
  if constexpr (K::kZero != 0) {
    zs.resize((size_t)(L.cols / QK_K) * per);
    kplanes_starts<WT, TWO>(x, x2, L.cols / QK_K, (__m256i*)zs.data());
  }
  const __m256i* z0 = (const __m256i*)zs.data();
  walk_planes<WT>(y, w, L, row_begin, row_end, [&](int r, int gg, int cb0, int nb, auto&& chunk) {
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < nb; ++b) {
      const uint8_t* c = chunk(b);
      const block_q8_K& a = x[cb0 + b];
      const block_q8_K* a2 = x2 + cb0 + b;
      const __m256i* z = K::kZero != 0 ? z0 + (size_t)(cb0 + b) * per : nullptr;
      __m256i Ib[2], I2b[2];  // both halves' sums (kBothHalves)
      if constexpr (kBothHalves<WT>) kplanes_isum<WT, TWO, 2>(c, 0, a, a2, Ib, I2b, z);
      for (int h = 0; h < 2; ++h) {
        __m256i I, I2;
        if constexpr (kBothHalves<WT>) I = Ib[h], I2 = I2b[h];
        else kplanes_isum<WT, TWO>(c, h, a, a2, &I, &I2, z);  // a half at a time
        __m256i mp[4];
        kplanes_min_pairs<WT>(c, h, mp);
        const __m256i M = kplanes_mins<WT>(mp, a), M2 = TWO ? kplanes_mins<WT>(mp, *a2) : M;
        acc[h] = kplanes_finish<WT, TWO>(c, h, I, M, TWO ? I2 : I, M2, a, a2, acc[h]);
      }
    }
    add_group(y + r, gg, acc[0], acc[1]);
  });
}

// ---- the batched GEMV (kernels.h GemvBatchFn) at 256 bits ----
// As the AVX-512 one (gemv_avx512.cpp): up to 16 tokens per pass over the rows (8 measured 3-8%
// slower per token on prompt rows; docs/KERNELS.md), each chunk half
// unpacked once (the K-quants: each group of 16 slices, kept in L1 for the tokens in turn) and
// met by every token's levels through the GEMV's own integer and float code, each half's float
// operations in the GEMV's order (level 1, then level 2, block by block): bit for bit the GEMV.
constexpr int kAvx2Group = 16;

// The walk of nt tokens over rows [row_begin, row_end): block(c, cb, acc) adds chunk c (column
// block cb) into acc[t][h], token t's rows 8h .. 8h+7 of the group; then each token's outputs.
template <BlockType WT, class Block>
void walk_tokens(float* y, int ldy, int nt, const uint8_t* w, const TileLayout& L, int row_begin, int row_end,
                 Block&& block) {
  walk_planes<WT>(y, w, L, row_begin, row_end, [&](int r, int gg, int cb0, int nb, auto&& chunk) {
    __m256 acc[kAvx2Group][2];
    for (int t = 0; t < nt; ++t) acc[t][0] = acc[t][1] = _mm256_setzero_ps();
    for (int b = 0; b < nb; ++b) block(chunk(b), cb0 + b, acc);
    for (int t = 0; t < nt; ++t) add_group(y + (size_t)t * ldy + r, gg, acc[t][0], acc[t][1]);
  });
}

// NT: the tokens of every pass a constant, or 0 (nt_ of them).
template <BlockType WT, bool TWO, int NT>
void planes_tokens(float* y, int ldy, const uint8_t* xv, size_t ab, int nt_, const uint8_t* w, const TileLayout& L,
                   int row_begin, int row_end) {
  const int nt = NT ? NT : nt_;
  // Token t's first-level block cb lies at xv + t * ab + cb * sizeof(block_q8a), its second level
  // R bytes on (level2): one stride per token, so that the token loop steps a pointer instead of
  // looking up per-token pointers; the blocks' start records (BlockStart) in the tokens' order.
  const size_t R = TWO ? q8a_row_bytes(L.cols) : 0;
  constexpr bool kX16 = WT == BlockType::Q8_0 && TWO;  // both levels in 16 bits (planes_x16.h)
  const BlockStart* st = kBlockStarts<WT> ? block_starts<WT, TWO>(xv, ab, nt, L.cols) : nullptr;
  walk_tokens<WT>(y, ldy, nt, w, L, row_begin, row_end, [&](const uint8_t* c, int cb, __m256 (*acc)[2]) {
    const uint8_t* x0 = (const uint8_t*)((const block_q8a*)xv + cb);  // token 0's block cb
    auto first = [&](int t) -> const block_q8a& { return *(const block_q8a*)(x0 + (size_t)t * ab); };
    if constexpr (kX16) {
      static_assert(kAvx2Group <= 16);
      q8_chunk_two_levels(c, nt, first, [&](int t) { return level2(&first(t), R); }, acc);
    } else {
      const BlockStart* st0 = kBlockStarts<WT> ? st + (size_t)cb * nt : nullptr;  // block cb's, token by token
      for (int h = 0; h < 2; ++h) {
        __m256i u[8];  // the half's slices, unpacked once for every token
        planes_unpack<WT>(c, h, u);
        const auto slice = unpacked_slices<WT>(u);
        const uint8_t* xt = x0;
        for (int t = 0; t < nt; ++t, xt += ab) {
          const block_q8a& a = *(const block_q8a*)xt;
          const block_q8a* a2 = level2(&a, R);
          const BlockStart* s = kBlockStarts<WT> ? st0 + t : nullptr;
          __m256i Sm[1];
          planes_dot<WT, TWO, 1>(slice, h, a, a2, start_z<WT>(s), Sm);
          acc[t][h] = planes_finish<WT, TWO>(c, h, Sm[0], a, a2, s, acc[t][h]);
        }
      }
    }
  });
}

template <BlockType WT, bool TWO, int NT>
void kplanes_tokens(float* y, int ldy, const uint8_t* xv, size_t ab, int nt_, const uint8_t* w, const TileLayout& L,
                    int row_begin, int row_end) {
  using K = KPlanesKind<WT>;
  const int nt = NT ? NT : nt_, nsb = L.cols / QK_K, per = 2 * K::kNumSub;
  const block_q8_K *x[kAvx2Group], *x2[kAvx2Group];
  for (int t = 0; t < nt; ++t) x[t] = (const block_q8_K*)(xv + t * ab), x2[t] = x[t] + nsb;
  thread_local std::vector<Lanes> zs;  // token t's start values at t * nsb * per (kplanes_starts)
  if constexpr (K::kZero != 0) {
    zs.resize((size_t)nt * nsb * per);
    for (int t = 0; t < nt; ++t) kplanes_starts<WT, TWO>(x[t], x2[t], nsb, (__m256i*)zs.data() + (size_t)t * nsb * per);
  }
  const __m256i* z0 = (const __m256i*)zs.data();
  walk_tokens<WT>(y, ldy, nt, w, L, row_begin, row_end, [&](const uint8_t* c, int cb, __m256 (*acc)[2]) {
    for (int h = 0; h < 2; ++h) {
      __m256i I[kAvx2Group], I2[kAvx2Group];
      for (int t = 0; t < nt; ++t) I[t] = I2[t] = _mm256_setzero_si256();
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {  // unrolled: every plane offset a constant
        __m256i u[16];
        kplanes_unpack<WT>(c, h, q, u);
        for (int t = 0; t < nt; ++t)
          kplanes_group_dot<WT, TWO>([&](int, int k) { return _mm256_load_si256(u + k); }, c, h, q, I + t, I2 + t,
                                     x[t][cb].qs, TWO ? x2[t][cb].qs : x[t][cb].qs,
                                     K::kZero != 0 ? z0 + ((size_t)t * nsb + cb) * per : nullptr);
      }
      __m256i mp[4];
      kplanes_min_pairs<WT>(c, h, mp);
      for (int t = 0; t < nt; ++t) {
        const __m256i M = kplanes_mins<WT>(mp, x[t][cb]), M2 = TWO ? kplanes_mins<WT>(mp, x2[t][cb]) : M;
        acc[t][h] = kplanes_finish<WT, TWO>(c, h, I[t], M, TWO ? I2[t] : I[t], M2, x[t][cb], x2[t] + cb, acc[t][h]);
      }
    }
  });
}

template <BlockType WT, bool TWO>
void gemv_batch_avx2(float* y, int ldy, const void* xv, int m, const uint8_t* w, const TileLayout& L, int row_begin,
                     int row_end) {
  const int n = std::min(row_end, L.rows) - row_begin;
  if (n <= 0 || m <= 0) return;
  const size_t ab = act_bytes(WT, TWO ? AType::Q8x2 : AType::Q8, L.cols);
  for (int k = 0; k < m; ++k) std::memset(y + (size_t)k * ldy, 0, sizeof(float) * n);
  for (int t0 = 0; t0 < m; t0 += kAvx2Group) {
    const uint8_t* x = (const uint8_t*)xv + t0 * ab;
    const int nt = std::min(kAvx2Group, m - t0);
    // a full group's token count, or a decode step's 8, is a constant (NT): its token loops unrolled
    auto pass = [&](auto count) {
      constexpr int NT = decltype(count)::value;
      if constexpr (kKQuant<WT>) kplanes_tokens<WT, TWO, NT>(y + (size_t)t0 * ldy, ldy, x, ab, nt, w, L, row_begin, row_end);
      else planes_tokens<WT, TWO, NT>(y + (size_t)t0 * ldy, ldy, x, ab, nt, w, L, row_begin, row_end);
    };
    if (nt == kAvx2Group) pass(std::integral_constant<int, kAvx2Group>{});
    else if (nt == 8) pass(std::integral_constant<int, 8>{});
    else pass(std::integral_constant<int, 0>{});
  }
}

}  // namespace

GemvBatchFn gemv_batch(BlockType bt, Pack pack, AType at) {
  if (GemvBatchFn f = tern_batch_fn(bt, pack, at)) return f;
  return planes_batch_fn(bt, pack, at, [](auto wt, auto two) -> GemvBatchFn {
    return gemv_batch_avx2<decltype(wt)::value, decltype(two)::value>;
  });
}

}  // namespace avx2

const KernelTable& kernel_table_avx2() {
  static const KernelTable t = make_table(Isa::Avx2, {avx2::fill_table, avx2::fill_planes_table, avx2::fill_gemm});
  return t;
}

}  // namespace cflow
