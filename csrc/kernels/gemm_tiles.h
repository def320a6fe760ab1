// Walking the tiled layout by interleave groups (shared by the reference and SIMD GEMMs).
#pragma once
#include <algorithm>
#include <cstdint>

#include "cflow/gemm.h"
#include "cflow/kernels.h"
#include "cflow/planes.h"

namespace cflow {

// One interleave group: rows [row, row + g) of stripe s, across all column tiles. Block b of
// tile t for row i of the group is at tile(t) + (b * g + i) * bb.
struct Group {
  int row, g;           // first row, rows in the group
  int ntiles, bpt;      // column tiles, blocks per full tile
  int bpr;              // blocks per row
  const uint8_t* base;  // tile 0 of this group
  size_t tile_stride;   // bytes between tile t and t+1 of the same group (nr * bpt * bb)
  int bb, nr, ro;
  const uint8_t* tile(int t) const {
    // Every tile before t is full width; inside tile t the group starts after ro rows of nb blocks.
    int nb = nb_of(t);
    return base + tile_stride * t + (size_t)ro * nb * bb;
  }
  int nb_of(int t) const { return std::min(bpt, bpr - t * bpt); }
};

// Row i of group G dequantized: out (C,).
void dequant_group_row(const TileLayout& L, const struct Group& G, int i, float* out);

// Calls f(Group) for every group with rows in [r0, r1).
template <class F>
inline void for_groups(const TileLayout& L, const uint8_t* w, int r0, int r1, F&& f) {
  const int bpr = L.cols / L.qk, bpt = L.tc / L.qk;
  const int ntiles = (bpr + bpt - 1) / bpt;
  int r = r0;
  while (r < r1) {
    const int s = r / L.tr, sr = s * L.tr;
    const int nr = std::min(L.tr, L.rows - sr);
    const uint8_t* stripe = w + (size_t)sr * bpr * L.bb;
    const int end = std::min(r1, sr + nr);
    for (; r < end;) {
      Group G;
      G.ro = r - sr;
      G.row = r;
      G.g = std::min(L.g, nr - G.ro);
      G.ntiles = ntiles;
      G.bpt = bpt;
      G.bpr = bpr;
      G.bb = L.bb;
      G.nr = nr;
      G.tile_stride = (size_t)nr * bpt * L.bb;
      G.base = stripe;
      f(G);
      r += G.g;
    }
  }
}

// Planes-packed L: calls f(S, ws, a, b, ys) for each stripe met by rows [r0, r1), with S the
// stripe as a whole-block matrix of its own (ws, a per-thread buffer), rows [a, b) of it, and ys
// the output of its first row (y[t * ldy + (r - r0)] keeps its meaning). Returns false, doing
// nothing, for whole-block layouts.
template <class F>
inline bool gemm_on_whole_blocks(const TileLayout& L, const uint8_t* w, int r0, int r1, float* y, F&& f) {
  if (L.pack != (int)Pack::Planes) return false;
  thread_local std::vector<uint8_t> buf;
  const size_t row_bytes = (size_t)(L.cols / L.qk) * L.bb;
  const TileShape ts{L.tr, L.tc, L.g, Pack::Planes};
  TileLayout S = L;
  S.pack = 0;
  for (int r = r0; r < r1;) {
    const int sr = r / L.tr * L.tr, nr = std::min(L.tr, L.rows - sr), end = std::min(r1, sr + nr);
    buf.resize((size_t)nr * row_bytes);
    unpack_planes(static_cast<WType>(L.type), w + (size_t)sr * row_bytes, buf.data(), nr, L.cols, ts);
    S.rows = nr;
    f(S, buf.data(), r - sr, end - sr, y + (r - r0));
    r = end;
  }
  return true;
}

}  // namespace cflow
