// The batched GEMV (kernels.h GemvBatchFn) of the planes pack on AMX: several tokens' int8 dot
// products per pass over the weights, each token's result bit-identical to the AVX-512 GEMV's.
//
// Why it matches: the one-token kernel (gemv_avx512.cpp) forms, per 16-row chunk of a column
// block, every row's exact integer dot product with the token's activation block, then runs
// planes_finish (float). Integer sums do not depend on their order, so here one AMX dot product
// forms them for up to 16 (token, level) activation rows at once, and planes_finish then runs per
// token exactly as the one-token kernel runs it, over the same walk (walk_planes) and into y in
// the same order.
//
// Tiles, per column block b of a 16-row group (chunk c), on two alternating tile sets:
//   A: 16 rows x 32 bytes, one row per (token, level) of up to 16 / levels tokens: the
//       activation bytes of block b, copied once per call into a padded buffer (missing rows 0);
//   B: 8 rows x 64 bytes, row k = slice k of the 16 weight rows (4 weights each), as signed
//       bytes. Q8_0 planes are that already; Q4_0/Q4_1/Q5_0/Q5_1 unpack plane k's low nibbles
//       into slice k and its high nibbles into slice 4 + k (planes_unpack.h; Q5_0/Q5_1 with their fifth
//       bits), minus their zero point (Q4_0 8, Q5_0 16: the offset inside);
//   C = A . B (tdpbssd): C[(t, l)][i] = row i's dot product with token t's level l.
//
// The K-quants (Q4_K, Q5_K, Q6_K; kplanes.h) take one dot product per sub-block s of a super-block
// (chunk c): A is 16 (token, level) rows of the block_q8_K bytes of s (32, Q6_K 16), B the kSlices
// slices of s (kplanes_unpack, minus kZero: Q6_K 32), so C[(t, l)] is the GEMV's D_s; per token
// I = sum_s sc_s * D_s and M (kplanes_mins_pairs) are the GEMV's exact integers and kplanes_finish
// its float part.
#include <immintrin.h>

#include <cstring>
#include <type_traits>
#include <vector>

#include "../../isa_kernels.h"
#include "../../tile_walk.h"
#include "cflow/planes.h"

namespace cflow {
namespace avx512 {
namespace {

#include "../planes_simd.h"
#include "kplanes.h"
#include "planes_finish.h"
#include "planes_unpack.h"

// The tile configuration (palette 1): rows and bytes per row of tiles 0..7.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

constexpr int kSlices = 8;  // 4-byte slices of a 32-weight block: B's rows
constexpr int kARows = 16;  // (token, level) rows of an A tile

// Two sets of tiles, so that two dot products are in flight: set s is A = tile 3s, B = 3s + 1,
// C = 3s + 2. A dot product spans 4 * slices weights (the 32-blocks: 8 slices).
inline void configure(int slices = kSlices) {
  TileConfig t;
  for (int s = 0; s < 2; ++s) {
    t.rows[3 * s] = kARows, t.colsb[3 * s] = 4 * slices;  // A: (token, level) x 4 * slices activation bytes
    t.rows[3 * s + 1] = slices, t.colsb[3 * s + 1] = 64;  // B: slices x 16 rows x 4 bytes
    t.rows[3 * s + 2] = kARows, t.colsb[3 * s + 2] = 64;  // C: (token, level) x 16 int32
  }
  // GCC does not see ldtilecfg read t (an out-of-line copy loaded a zeroed config: SIGILL at
  // the first tile load): the empty asm makes the stores above happen first.
  asm volatile("" : : "r"(&t) : "memory");
  _tile_loadconfig(&t);
}

// Chunk c's 16 x 32 weights as B (signed bytes, slice-major): the Q8_0 planes themselves, or the
// 4-bit planes unpacked (planes_unpack.h) into buf, minus their zero point.
template <BlockType WT>
inline const int8_t* weights_b(const uint8_t* c, int8_t* buf) {
  using K = PlanesKind<WT>;
  if (!K::kNib) return (const int8_t*)(c + K::kQs);
  __m512i u[8];
  planes_unpack<WT>(c, u);
  for (int j = 0; j < kSlices; ++j) _mm512_store_si512(buf + 64 * j, _mm512_sub_epi8(u[j], _mm512_set1_epi8(K::kZero)));
  return buf;
}

// C = A . B on tile set S: A at a (kARows rows, lda bytes apart), B at b; C stored to c. (The
// tile intrinsics take literal tile numbers.)
template <int S>
inline void dot_tiles(const int8_t* a, const int8_t* b, int32_t* c, int lda = QK) {
  if constexpr (S == 0) {
    _tile_loadd(0, a, lda);
    _tile_loadd(1, b, 64);
    _tile_zero(2);
    _tile_dpbssd(2, 0, 1);
    _tile_stored(2, c, 64);
  } else {
    _tile_loadd(3, a, lda);
    _tile_loadd(4, b, 64);
    _tile_zero(5);
    _tile_dpbssd(5, 3, 4);
    _tile_stored(5, c, 64);
  }
}

// The A rows of every activation block b (block_q8a or block_q8_K: its qs bytes) of n rows x:
// apad + b * kARows * sizeof qs holds x[0][b].qs, ..., x[n-1][b].qs, then zero rows to kARows.
template <class B>
inline void fill_a(int8_t* apad, const B* const* x, int n, int nbr) {
  constexpr size_t kq = sizeof(x[0]->qs);
  for (int b = 0; b < nbr; ++b)
    for (int i = 0; i < kARows; ++i) {
      int8_t* row = apad + ((size_t)b * kARows + i) * kq;
      if (i < n) std::memcpy(row, x[i][b].qs, kq);
      else std::memset(row, 0, kq);
    }
}

// Column blocks per stage (see token_group): 4 where B is unpacked into the stage buffers, 8
// where the tile loads B from the weights themselves (Q8_0). Weights streamed from memory, 1 thread,
// 8 two-level tokens, ns per (token, 16 x 32 block), 4 / 8 blocks a stage: Q5_0 151936 x 896
// 5.37-5.40 / 6.09-6.23, Q4_1 49152 x 576 3.80-4.09 / 4.68-4.98, Q8_0 151936 x 896 7.84-7.86 /
// 6.44-6.86; in L2 the same within 2% (Q4_1 1536 x 576 3.65-3.71 / 3.68-3.77). Steps of 8
// sequences alone, the builds alternated: Qwen2.5-0.5B (Q5_0 and Q8_0 from memory) 33.5 -> 31.8
// ms, SmolLM2 10.0 -> 9.6. From memory the kernel overlaps its loads with its arithmetic poorly
// (docs/KERNELS.md); a shorter stage waits less on each stage's weights.
template <BlockType WT>
constexpr int kBatch = PlanesKind<WT>::kNib ? 4 : 8;

// A call's scratch: per block of a batch, its B, its C and (widened groups) its chunk.
template <BlockType WT>
struct Scratch {
  alignas(64) int8_t b[kBatch<WT>][kSlices * 64];
  alignas(64) int32_t c[kBatch<WT>][kARows * 16];
  alignas(64) uint8_t chunk[kBatch<WT>][kPlanesMaxG * PlanesKind<WT>::kBB];
};

// NT tokens (one A tile) over rows [row_begin, row_end): token t's scalars of column block cb at
// xs[cb * NT + t] (formed once per call, broadcast straight from memory), its outputs
// y + t * ldy; apad holds the A tile of every column block. The float part forms a chunk's
// header floats once for all its tokens (planes_header_ps): per token, as planes_finish(c, ...)
// would, they cost two conversions from memory, which the stores to the stage buffers kept the
// compiler from hoisting, and the float part of a batched step was then a third slower
// (docs/KERNELS.md).
template <BlockType WT, bool TWO, int NT>
void token_group(float* y, int ldy, const ActScalars* xs, const int8_t* apad, const uint8_t* w,
                 const TileLayout& L, int row_begin, int row_end, Scratch<WT>& sc) {
  constexpr int LV = TWO ? 2 : 1;
  walk_planes<WT>(y, w, L, row_begin, row_end, [&](int r, int gg, int cb0, int nb, auto&& chunk) {
    __m512 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
    const int8_t* ab = apad + (size_t)cb0 * kARows * QK;
    // kBatch blocks at a time, each stage over all of them before the next, so that no load
    // waits on a store just issued (a tile load cannot take data from pending vector stores, nor
    // a vector load from a pending tile store): B for every block, then every dot product (the
    // two tile sets alternating), then every block's float part.
    constexpr int KB = kBatch<WT>;
    for (int b0 = 0; b0 < nb; b0 += KB) {
      const int nk = std::min(KB, nb - b0);
      const uint8_t* c[KB];
      const int8_t* bw[KB];
      for (int j = 0; j < nk; ++j) {
        c[j] = chunk(b0 + j);
        if (gg < kPlanesMaxG) c[j] = (const uint8_t*)std::memcpy(sc.chunk[j], c[j], sizeof sc.chunk[j]);  // chunk() reuses its buffer
        bw[j] = weights_b<WT>(c[j], sc.b[j]);
      }
      for (int j = 0; j < nk; ++j) {
        const int8_t* a = ab + (size_t)(b0 + j) * kARows * QK;
        if (j % 2) dot_tiles<1>(a, bw[j], sc.c[j]);
        else dot_tiles<0>(a, bw[j], sc.c[j]);
      }
      for (int j = 0; j < nk; ++j) {
        const ActScalars* xc = xs + (size_t)(cb0 + b0 + j) * NT;
        __m512 d, mw;
        planes_header_ps<WT>(c[j], d, mw);
        for (int t = 0; t < NT; ++t) {
          const __m512i S = _mm512_load_si512(sc.c[j] + 16 * (t * LV));
          const __m512i T = TWO ? _mm512_load_si512(sc.c[j] + 16 * (t * LV + 1)) : S;
          acc[t] = planes_finish<WT, TWO>(d, mw, S, T, xc[t].da, xc[t].s, acc[t]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) planes_store(y + (size_t)t * ldy + r, gg, acc[t]);
  });
}

template <BlockType WT, bool TWO>
void gemv_batch_planes(float* y, int ldy, const void* xv, int m, const uint8_t* w, const TileLayout& L,
                       int row_begin, int row_end) {
  constexpr int LV = TWO ? 2 : 1, kGroup = kARows / LV;  // tokens per A tile
  static_assert(kGroup >= kBatchGroupMin, "kernels.h promises this many tokens per pass");
  const size_t lrow = q8a_row_bytes(L.cols);  // one level's row; a token's LV rows are adjacent
  const int n = std::min(row_end, L.rows) - row_begin, nbr = L.cols / QK;
  if (n <= 0 || m <= 0) return;
  for (int k = 0; k < m; ++k) std::memset(y + (size_t)k * ldy, 0, sizeof(float) * n);
  thread_local std::vector<int8_t> apad;  // per column block: the A tile, missing rows zero
  thread_local std::vector<ActScalars> xs;  // per column block and token: its scalars (planes_act_scalars)
  apad.resize((size_t)nbr * kARows * QK);
  Scratch<WT> sc;
  configure();
  for (int t0 = 0; t0 < m; t0 += kGroup) {
    const int nt = std::min(kGroup, m - t0);
    const block_q8a* x[kARows];
    for (int i = 0; i < nt * LV; ++i) x[i] = (const block_q8a*)((const uint8_t*)xv + (size_t)(t0 * LV + i) * lrow);
    fill_a(apad.data(), x, nt * LV, nbr);
    xs.resize((size_t)nbr * nt);
    for (int cb = 0; cb < nbr; ++cb)
      for (int t = 0; t < nt; ++t)
        xs[(size_t)cb * nt + t] = planes_act_scalars<TWO>(x[t * LV][cb], TWO ? x[t * LV + 1] + cb : nullptr);
    with_count<kGroup>(nt, [&](auto NT) {
      token_group<WT, TWO, NT>(y + (size_t)t0 * ldy, ldy, xs.data(), apad.data(), w, L, row_begin, row_end, sc);
    });
  }
  _tile_release();
}

// ---- the K-quants: one dot product per sub-block ----

template <BlockType WT>
struct KScratch {
  using K = KPlanesKind<WT>;
  alignas(64) int8_t b[K::kNumSub][K::kSlices * 64];
  alignas(64) int32_t c[K::kNumSub][kARows * 16];
  alignas(64) uint8_t chunk[kPlanesMaxG * K::kBB];
};

// A token's scalars of a super-block for the float part: its levels' d, and (Q4_K, Q5_K) their
// asum pairs for kplanes_mins_pairs.
struct KAScale {
  float d, d2 = 0.f;
  int32_t ap[4], ap2[4];
};

// NT tokens over rows [row_begin, row_end): token t's scalars of super-block cb at xs[cb * NT + t],
// its outputs y + t * ldy; apad holds per super-block the A rows (kARows x 256 bytes).
template <BlockType WT, bool TWO, int NT>
void ktoken_group(float* y, int ldy, const KAScale* xs, const int8_t* apad, const uint8_t* w,
                  const TileLayout& L, int row_begin, int row_end, KScratch<WT>& sc) {
  using K = KPlanesKind<WT>;
  constexpr int LV = TWO ? 2 : 1;
  walk_planes<WT>(y, w, L, row_begin, row_end, [&](int r, int gg, int cb0, int nb, auto&& chunk) {
    __m512 acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps();
    for (int b = 0; b < nb; ++b) {
      // B of every sub-block, then every dot product (the two tile sets alternating), then per
      // token the integers and the float part: no tile load waits on a store just issued.
      const uint8_t* c = chunk(b);
      if (gg < kPlanesMaxG) c = (const uint8_t*)std::memcpy(sc.chunk, c, sizeof sc.chunk);
      for (int q = 0; q < 4; ++q) {
        __m512i u[16];
        kplanes_unpack<WT>(c, q, u);
        for (int k = 0; k < 16; ++k)
          _mm512_store_si512(sc.b[K::sub(q, k / K::kSlices)] + 64 * (k % K::kSlices),
                             _mm512_sub_epi8(u[k], _mm512_set1_epi8(K::kZero)));
      }
      const int8_t* a = apad + (size_t)(cb0 + b) * kARows * QK_K;
      for (int s = 0; s < K::kNumSub; ++s) {
        if (s % 2) dot_tiles<1>(a + K::kSubW * s, sc.b[s], sc.c[s], QK_K);
        else dot_tiles<0>(a + K::kSubW * s, sc.b[s], sc.c[s], QK_K);
      }
      // per chunk, once for every token: the sub-block scales, the mins as int16 pairs, the header
      __m512i scl[K::kNumSub], mp[4];
      for (int s = 0; s < K::kNumSub; ++s) scl[s] = kplanes_scale<WT>(c, s);
      if constexpr (K::kQ4) kplanes_min_pairs<WT>(c, mp);
      __m512 d, dmin;
      kplanes_header_ps<WT>(c, d, dmin);
      const KAScale* xc = xs + (size_t)(cb0 + b) * NT;
      for (int t = 0; t < NT; ++t) {
        __m512i I = _mm512_setzero_si512(), I2 = I, M = I, M2 = I;
        for (int s = 0; s < K::kNumSub; ++s) {
          I = _mm512_add_epi32(I, _mm512_mullo_epi32(_mm512_load_si512(sc.c[s] + 16 * (t * LV)), scl[s]));
          if (TWO) I2 = _mm512_add_epi32(I2, _mm512_mullo_epi32(_mm512_load_si512(sc.c[s] + 16 * (t * LV + 1)), scl[s]));
        }
        if constexpr (K::kQ4) {
          M = kplanes_mins_pairs(mp, xc[t].ap);
          if (TWO) M2 = kplanes_mins_pairs(mp, xc[t].ap2);
        }
        acc[t] = kplanes_finish<WT, TWO>(d, dmin, I, M, I2, M2, xc[t].d, xc[t].d2, acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t) planes_store(y + (size_t)t * ldy + r, gg, acc[t]);
  });
}

template <BlockType WT, bool TWO>
void gemv_batch_kplanes(float* y, int ldy, const void* xv, int m, const uint8_t* w, const TileLayout& L,
                        int row_begin, int row_end) {
  constexpr int LV = TWO ? 2 : 1, kGroup = kARows / LV;
  const int n = std::min(row_end, L.rows) - row_begin, nbr = L.cols / QK_K;
  if (n <= 0 || m <= 0) return;
  for (int k = 0; k < m; ++k) std::memset(y + (size_t)k * ldy, 0, sizeof(float) * n);
  thread_local std::vector<int8_t> apad;  // per super-block: kARows rows of 256 bytes, missing rows zero
  thread_local std::vector<KAScale> xs;   // per super-block and token: its scalars
  apad.resize((size_t)nbr * kARows * QK_K);
  KScratch<WT> sc;
  configure(KPlanesKind<WT>::kSlices);
  for (int t0 = 0; t0 < m; t0 += kGroup) {
    const int nt = std::min(kGroup, m - t0);
    const block_q8_K* x[kARows];
    for (int i = 0; i < nt * LV; ++i) x[i] = (const block_q8_K*)xv + (size_t)(t0 * LV + i) * nbr;
    fill_a(apad.data(), x, nt * LV, nbr);
    xs.resize((size_t)nbr * nt);
    for (int cb = 0; cb < nbr; ++cb)
      for (int t = 0; t < nt; ++t) {
        KAScale& e = xs[(size_t)cb * nt + t];  // (what the float part reads: the second level's with TWO,
        const block_q8_K& a = x[t * LV][cb];    // the asum pairs where the type has mins)
        e.d = a.d;
        if constexpr (KPlanesKind<WT>::kQ4)
          for (int i = 0; i < 4; ++i) e.ap[i] = kplanes_asum_pair<WT>(a, i);
        if constexpr (TWO) {
          const block_q8_K& a2 = x[t * LV + 1][cb];
          e.d2 = a2.d;
          if constexpr (KPlanesKind<WT>::kQ4)
            for (int i = 0; i < 4; ++i) e.ap2[i] = kplanes_asum_pair<WT>(a2, i);
        }
      }
    with_count<kGroup>(nt, [&](auto NT) {
      ktoken_group<WT, TWO, NT>(y + (size_t)t0 * ldy, ldy, xs.data(), apad.data(), w, L, row_begin, row_end, sc);
    });
  }
  _tile_release();
}

}  // namespace

GemvBatchFn amx_gemv_batch(BlockType bt, Pack pack, AType at) {
  return planes_batch_fn(bt, pack, at, [](auto wt, auto two) -> GemvBatchFn {
    constexpr BlockType WT = decltype(wt)::value;
    if constexpr (kKQuant<WT>) return gemv_batch_kplanes<WT, decltype(two)::value>;
    else return gemv_batch_planes<WT, decltype(two)::value>;
  });
}

}  // namespace avx512
}  // namespace cflow
