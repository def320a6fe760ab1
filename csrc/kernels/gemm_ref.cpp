// Scalar reference GEMMs over the tiled layout, row dequantization and the GEMM dispatch.
#include <cmath>
#include <cstring>
#include <vector>

#include "cflow/cpu.h"
#include "cflow/gemm.h"
#include "isa_kernels.h"
#include "tile_walk.h"

namespace cflow {

int layout_units(const TileLayout& L) {
  const int gps = L.tr / L.g, full = L.rows / L.tr, rem = L.rows % L.tr;
  return full * gps + (rem + L.g - 1) / L.g;
}

int unit_row(const TileLayout& L, int u) {
  const int gps = L.tr / L.g;
  return std::min(L.rows, (u / gps) * L.tr + (u % gps) * L.g);
}

void dequant_group_row(const TileLayout& L, const Group& G, int i, float* out) {
  const BlockTraits& T = *block_traits(L.bt());
  uint8_t blk[256];  // one whole block (the largest, Q6_K, is 210 bytes)
  for (int t = 0; t < G.ntiles; ++t) {
    const uint8_t* tb = G.tile(t);
    const int nb = G.nb_of(t);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* p = tb + ((size_t)b * G.g + i) * G.bb;
      if (L.planes()) {  // planes: gather row i's block from its chunk
        planes_get(tb + (size_t)b * G.g * G.bb, G.g, i, L.bt(), blk);
        p = blk;
      }
      T.dequantize(p, out + (size_t)(t * G.bpt + b) * L.qk);
    }
  }
}

void dequant_row(const TileLayout& L, const uint8_t* w, int r, float* out) {
  const int sr = r / L.tr * L.tr, gs = sr + (r - sr) / L.g * L.g;  // start of r's group
  for_groups(L, w, gs, r + 1, [&](const Group& G) { dequant_group_row(L, G, r - G.row, out); });
}

// ---------------------------------------------------------------- reference kernels
namespace ref {

void gemm_f32(const TileLayout& L, const uint8_t* w, int r0, int r1, const float* x, int ldx, int n, float* y,
              int ldy) {
  if (L.planes())  // each stripe unpacked to whole blocks (planes.h)
    return for_unpacked_stripes(L, w, r0, r1, y, [&](const TileLayout& S, const uint8_t* ws, int a, int b, float* ys) {
      ref::gemm_f32(S, ws, a, b, x, ldx, n, ys, ldy);
    });
  const BlockTraits& T = *block_traits(L.bt());
  float blk[QK_K];
  std::vector<double> acc(n);
  for_groups(L, w, r0, r1, [&](const Group& G) {
    for (int i = 0; i < G.g; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int t = 0; t < G.ntiles; ++t) {
        const uint8_t* tb = G.tile(t);
        const int nb = G.nb_of(t);
        for (int b = 0; b < nb; ++b) {
          T.dequantize(tb + ((size_t)b * G.g + i) * G.bb, blk);
          const int c0 = (t * G.bpt + b) * L.qk;
          for (int k = 0; k < n; ++k) {
            const float* xk = x + (size_t)k * ldx + c0;
            float s = 0;
            for (int j = 0; j < L.qk; ++j) s += blk[j] * xk[j];
            acc[k] += s;
          }
        }
      }
      for (int k = 0; k < n; ++k) y[(size_t)k * ldy + (G.row + i - r0)] = (float)acc[k];
    }
  });
}

// Every level's int8 dot (the table's codec) per block, summed.
void gemm_q8(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  if (L.planes())
    return for_unpacked_stripes(L, w, r0, r1, y, [&](const TileLayout& S, const uint8_t* ws, int a, int b, float* ys) {
      ref::gemm_q8(S, ws, a, b, x, ys, ldy);
    });
  const BlockTraits& T = *block_traits(L.bt());
  for_groups(L, w, r0, r1, [&](const Group& G) {
    for (int i = 0; i < G.g; ++i) {
      for (int k = 0; k < x.n; ++k) {
        float acc = 0;
        for (int t = 0; t < G.ntiles; ++t) {
          const uint8_t* tb = G.tile(t);
          const int nb = G.nb_of(t);
          for (int b = 0; b < nb; ++b)
            for (int l = 0; l < x.levels; ++l)
              acc += T.dot(tb + ((size_t)b * G.g + i) * G.bb, x.row(k, l) + t * G.bpt + b);
        }
        y[(size_t)k * ldy + (G.row + i - r0)] = acc;
      }
    }
  });
}

}  // namespace ref

// ---------------------------------------------------------------- dispatch
GemmQ8Fn gemm_q8_fn(const TileLayout& L, Isa isa) {
  const int i = block_index(L.bt());
  if (i < 0) return nullptr;
  return lookup(isa, nullptr, [&](const KernelTable& t) { return t.gemm_q8[i][L.pack]; });
}

void gemm_f32(const TileLayout& L, const uint8_t* w, int r0, int r1, const float* x, int ldx, int n, float* y,
              int ldy) {
  static const GemmF32Fn f = kernel_table(best_isa()).gemm_f32;
  f(L, w, r0, r1, x, ldx, n, y, ldy);
}

void gemm_q8(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  if (GemmQ8Fn f = gemm_q8_fn(L, best_isa())) f(L, w, r0, r1, x, y, ldy);
}

}  // namespace cflow
