// Internal: the one walk over a tiled payload (format/tiles.py layout), for the GEMV and the GEMM
// kernels. A Stripe knows where every tile, interleave group and block of its rows lies;
// for_stripes visits the stripes met by a row range. On it:
//   walk_tiles_whole / walk_tiles  payload order (stripe, column tile, group): the GEMV, which
//                                  streams the weights once;
//   for_groups                     group by group, all column tiles of a group before the next:
//                                  the GEMM, which finishes a row group's outputs at once.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cflow/blocktypes.h"

namespace cflow {

// Rows [row, row + nr) of L: column tile t holds column blocks t*bpt .. t*bpt + nb(t) - 1, and
// inside it the group of rows g0 .. g0+gg-1 stores block (row g0+i, column block b) at
// group(t, g0) + (b * gg + i) * bb.
struct Stripe {
  const uint8_t* base;  // the stripe's first byte
  int row, nr;          // first row, rows
  int bpr, bpt, bb, g;  // blocks per row, per full tile; bytes per block; interleave
  int ntiles() const { return (bpr + bpt - 1) / bpt; }
  int nb(int t) const { return std::min(bpt, bpr - t * bpt); }
  const uint8_t* tile(int t) const { return base + (size_t)nr * t * bpt * bb; }
  const uint8_t* group(int t, int g0) const { return tile(t) + (size_t)g0 * nb(t) * bb; }
  int group_rows(int g0) const { return std::min(g, nr - g0); }
};

// Calls f(S, lo, hi) for each stripe S met by rows [r0, r1): rows [lo, hi) of S (relative to
// S.row) lie in the range.
template <class F>
inline void for_stripes(const TileLayout& L, const uint8_t* w, int r0, int r1, F&& f) {
  const int bpr = L.cols / L.qk, bpt = L.tc / L.qk;
  const size_t row_bytes = (size_t)bpr * L.bb;
  r1 = std::min(r1, L.rows);
  for (int r = r0; r < r1;) {
    const int sr = r / L.tr * L.tr, nr = std::min(L.tr, L.rows - sr);
    const Stripe S{w + (size_t)sr * row_bytes, sr, nr, bpr, bpt, L.bb, L.g};
    const int end = std::min(r1, sr + nr);
    f(S, r - sr, end - sr);
    r = end;
  }
}

// GEMV walk over the tiles of the stripes in [row_begin, row_end): f(tile, r, nr, cb0, nb), the
// tile holding rows r .. r+nr-1 (relative to row_begin) over column blocks cb0 .. cb0+nb-1;
// TileRow finds a row's blocks in it. y is zeroed first, so f adds its partial dot products into
// y[r + i]. row_begin and row_end lie on interleave-group boundaries (or row_end at L.rows):
// where they cut a stripe, f gets the stripe's rows in range as a tile of their own (a tile's
// groups are contiguous, group g0 at tile + g0 * nb * bb, so rows [lo, hi) of a tile laid out
// from its row lo are a tile of hi - lo rows with the same groups). Threads can then share a
// matrix of few stripes evenly (896 rows: 7 stripes of 128, but 56 groups of 16).
template <class F>
inline void walk_tiles_whole(float* y, const uint8_t* w, const TileLayout& L, int row_begin, int row_end, F&& f) {
  row_end = std::min(row_end, L.rows);
  if (row_end > row_begin) std::memset(y, 0, sizeof(float) * (size_t)(row_end - row_begin));
  for_stripes(L, w, row_begin, row_end, [&](const Stripe& S, int lo, int hi) {
    for (int t = 0; t < S.ntiles(); ++t)
      f(S.tile(t) + (size_t)lo * S.nb(t) * S.bb, S.row + lo - row_begin, hi - lo, t * S.bpt, S.nb(t));
  });
}

// The same by interleave group: f(grp, r, gg, cb0, nb), the group holding rows r .. r+gg-1
// (relative to row_begin), block (row r+i, column block cb0+b) at grp + (b*gg + i) * bb.
template <class F>
inline void walk_tiles(float* y, const uint8_t* w, const TileLayout& L, int row_begin, int row_end, F&& f) {
  walk_tiles_whole(y, w, L, row_begin, row_end, [&](const uint8_t* tile, int r, int nr, int cb0, int nb) {
    for (int g0 = 0; g0 < nr; g0 += L.g)
      f(tile + (size_t)g0 * nb * L.bb, r + g0, std::min(L.g, nr - g0), cb0, nb);
  });
}

// Row i of a tile (nr rows, nb blocks, interleave g): block b is at base + b * stride.
struct TileRow {
  const uint8_t* base;
  size_t stride;
  TileRow(const uint8_t* tile, int nr, int nb, int g, int bb, int i) {
    if (g == 1) {  // whole rows: no divisions (a kernel builds one per row and tile)
      base = tile + (size_t)i * nb * bb;
      stride = (size_t)bb;
      return;
    }
    const int g0 = i - i % g, gg = nr - g0 < g ? nr - g0 : g;
    base = tile + ((size_t)g0 * nb + (i - g0)) * bb;
    stride = (size_t)gg * bb;
  }
};

// One interleave group across all column tiles (GEMM): rows [row, row + g). Block b of tile t
// for row i of the group is at tile(t) + (b * g + i) * bb.
struct Group {
  const Stripe* S;
  int ro;                 // first row, relative to the stripe
  int row, g;             // first row, rows in the group
  int ntiles, bpt, bpr, bb;
  const uint8_t* tile(int t) const { return S->group(t, ro); }
  int nb_of(int t) const { return S->nb(t); }
};

// Calls f(Group) for every group with rows in [r0, r1) (r0 on a group boundary).
template <class F>
inline void for_groups(const TileLayout& L, const uint8_t* w, int r0, int r1, F&& f) {
  for_stripes(L, w, r0, r1, [&](const Stripe& S, int lo, int hi) {
    for (int ro = lo; ro < hi; ro += L.g) f(Group{&S, ro, S.row + ro, S.group_rows(ro), S.ntiles(), S.bpt, S.bpr, S.bb});
  });
}

// Row i of group G dequantized: out (C,) (either pack).
void dequant_group_row(const TileLayout& L, const Group& G, int i, float* out);

}  // namespace cflow
