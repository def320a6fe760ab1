// Internal: the walk over a tiled payload shared by every GEMV kernel (format/tiles.py layout).
#pragma once
#include <cstdint>
#include <cstring>

#include "cflow/kernels.h"

namespace cflow {

// Calls f(grp, r, gg, cb0, nb) for every row group of every tile of the stripes in
// [row_begin, row_end), in payload order: grp points at the group's first block, the group
// holds rows r .. r+gg-1 (relative to row_begin) over column blocks cb0 .. cb0+nb-1, and
// block (row r+i, column block cb0+b) is at grp + (b*gg + i) * bb. y is zeroed first, so f
// adds its partial dot products into y[r + i].
template <class F>
inline void walk_tiles(float* y, const uint8_t* w, int rows, int cols, const TileShape& ts, int qk,
                       int bb, int row_begin, int row_end, F&& f) {
  const int nbr = cols / qk;      // blocks per row
  const int bpt = ts.tc / qk;     // blocks per full column tile
  const size_t row_bytes = (size_t)nbr * bb;
  if (row_end > rows) row_end = rows;
  if (row_end > row_begin) std::memset(y, 0, sizeof(float) * (size_t)(row_end - row_begin));
  for (int r0 = row_begin; r0 < row_end; r0 += ts.tr) {
    const int nr = rows - r0 < ts.tr ? rows - r0 : ts.tr;
    const uint8_t* stripe = w + (size_t)r0 * row_bytes;
    for (int cb0 = 0; cb0 < nbr; cb0 += bpt) {
      const int nb = nbr - cb0 < bpt ? nbr - cb0 : bpt;
      const uint8_t* tile = stripe + (size_t)nr * cb0 * bb;
      for (int g0 = 0; g0 < nr; g0 += ts.g) {
        const int gg = nr - g0 < ts.g ? nr - g0 : ts.g;
        f(tile + (size_t)g0 * nb * bb, r0 - row_begin + g0, gg, cb0, nb);
      }
    }
  }
}

// Calls f(tile, r, nr, cb0, nb) for every tile of the stripes in [row_begin, row_end): the tile
// holds rows r .. r+nr-1 (relative to row_begin) over column blocks cb0 .. cb0+nb-1. y is
// zeroed first. Use TileRow to find a row's blocks inside the tile.
template <class F>
inline void walk_tiles_whole(float* y, const uint8_t* w, int rows, int cols, const TileShape& ts,
                             int qk, int bb, int row_begin, int row_end, F&& f) {
  const int nbr = cols / qk, bpt = ts.tc / qk;
  const size_t row_bytes = (size_t)nbr * bb;
  if (row_end > rows) row_end = rows;
  if (row_end > row_begin) std::memset(y, 0, sizeof(float) * (size_t)(row_end - row_begin));
  for (int r0 = row_begin; r0 < row_end; r0 += ts.tr) {
    const int nr = rows - r0 < ts.tr ? rows - r0 : ts.tr;
    const uint8_t* stripe = w + (size_t)r0 * row_bytes;
    for (int cb0 = 0; cb0 < nbr; cb0 += bpt) {
      const int nb = nbr - cb0 < bpt ? nbr - cb0 : bpt;
      f(stripe + (size_t)nr * cb0 * bb, r0 - row_begin, nr, cb0, nb);
    }
  }
}

// Row i of a tile (nr rows, nb blocks, interleave g): block b is at base + b * stride.
struct TileRow {
  const uint8_t* base;
  size_t stride;
  TileRow(const uint8_t* tile, int nr, int nb, int g, int bb, int i) {
    const int g0 = i - i % g, gg = nr - g0 < g ? nr - g0 : g;
    base = tile + ((size_t)g0 * nb + (i - g0)) * bb;
    stride = (size_t)gg * bb;
  }
};

}  // namespace cflow
