// Scalar reference GEMMs over the tiled layout, activation quantization and row dequantization.
#include <cmath>
#include <cstring>
#include <vector>

#include "cflow/cpu.h"
#include "cflow/gemm.h"
#include "cflow/kernels.h"
#include "gemm_tiles.h"
#include "isa_kernels.h"

namespace cflow {

BlockInfo block_info(int type) {
  switch (type) {
    case T_F32: return {1, 4};
    case T_F16: return {1, 2};
    case T_BF16: return {1, 2};
    case T_Q4_0: return {32, 18};
    case T_Q4_1: return {32, 20};
    case T_Q5_0: return {32, 22};
    case T_Q8_0: return {32, 34};
    case T_Q4_K: return {256, 144};  // fp32 path only (dequantize + FMA)
    case T_Q6_K: return {256, 210};
  }
  return {0, 0};
}

bool q8_supported(int type) {
  return type == T_Q4_0 || type == T_Q4_1 || type == T_Q5_0 || type == T_Q8_0;
}

bool make_layout(TileLayout& L, const char** err) {
  BlockInfo bi = block_info(L.type);
  if (!bi.elems) { *err = "unsupported block type"; return false; }
  L.qk = bi.elems;
  L.bb = bi.bytes;
  if (L.rows <= 0 || L.cols <= 0) { *err = "empty matrix"; return false; }
  if (L.cols % L.qk) { *err = "columns not a multiple of the block size"; return false; }
  if (L.tr <= 0 || L.tc <= 0 || L.tc % L.qk || L.g <= 0 || L.tr % L.g) {
    *err = "bad tile shape or interleave";
    return false;
  }
  if (L.pack != 0 && (L.pack != (int)Pack::Planes || !planes_header(static_cast<WType>(L.type)) || L.g > kPlanesMaxG)) {
    *err = "bad pack (planes: q4_0, q4_1, q8_0 with interleave <= 16)";
    return false;
  }
  return true;
}

size_t layout_nbytes(const TileLayout& L) { return (size_t)L.rows * (L.cols / L.qk) * L.bb; }

int layout_units(const TileLayout& L) {
  const int gps = L.tr / L.g, full = L.rows / L.tr, rem = L.rows % L.tr;
  return full * gps + (rem + L.g - 1) / L.g;
}

int unit_row(const TileLayout& L, int u) {
  const int gps = L.tr / L.g;
  return std::min(L.rows, (u / gps) * L.tr + (u % gps) * L.g);
}

// ---------------------------------------------------------------- block decoding
static inline uint16_t rd16(const uint8_t* p) { uint16_t v; std::memcpy(&v, p, 2); return v; }

// Block -> qk floats (the kernel library's reference decoder, shared by every path).
static inline void dequant_block(int type, const uint8_t* b, float* out) {
  ref::dequantize(static_cast<WType>(type), b, 1, out);
}

// Integer part of a block: q[0..31] as small integers, and (scale, offset) with
// value_j = scale * q_j + offset.
static void int_block(int type, const uint8_t* b, int* q, float* scale, float* offset) {
  switch (type) {
    case T_Q4_0:
      *scale = fp16_to_f32(rd16(b));
      *offset = -8 * *scale;
      for (int j = 0; j < 16; ++j) { q[j] = b[2 + j] & 15; q[j + 16] = b[2 + j] >> 4; }
      return;
    case T_Q4_1:
      *scale = fp16_to_f32(rd16(b));
      *offset = fp16_to_f32(rd16(b + 2));
      for (int j = 0; j < 16; ++j) { q[j] = b[4 + j] & 15; q[j + 16] = b[4 + j] >> 4; }
      return;
    case T_Q5_0: {
      *scale = fp16_to_f32(rd16(b));
      *offset = -16 * *scale;
      uint32_t qh;
      std::memcpy(&qh, b + 2, 4);
      for (int j = 0; j < 16; ++j) {
        q[j] = (b[6 + j] & 15) | (((qh >> j) & 1) << 4);
        q[j + 16] = (b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
      }
      return;
    }
    case T_Q8_0:
      *scale = fp16_to_f32(rd16(b));
      *offset = 0;
      for (int j = 0; j < 32; ++j) q[j] = (int8_t)b[2 + j];
      return;
  }
}

void dequant_group_row(const TileLayout& L, const Group& G, int i, float* out) {
  const int hdr = L.pack == (int)Pack::Planes ? planes_header(static_cast<WType>(L.type)) : 0;
  uint8_t blk[64];
  for (int t = 0; t < G.ntiles; ++t) {
    const uint8_t* tb = G.tile(t);
    const int nb = G.nb_of(t);
    for (int b = 0; b < nb; ++b) {
      const uint8_t* p = tb + ((size_t)b * G.g + i) * G.bb;
      if (hdr) {  // planes: gather row i's block from its chunk
        planes_get(tb + (size_t)b * G.g * G.bb, G.g, i, hdr, G.bb, blk);
        p = blk;
      }
      dequant_block(L.type, p, out + (size_t)(t * G.bpt + b) * L.qk);
    }
  }
}

void dequant_row(const TileLayout& L, const uint8_t* w, int r, float* out) {
  const int sr = r / L.tr * L.tr, gs = sr + (r - sr) / L.g * L.g;  // start of r's group
  for_groups(L, w, gs, r + 1, [&](const Group& G) { dequant_group_row(L, G, r - G.row, out); });
}

// ---------------------------------------------------------------- reference kernels
void gemm_f32_ref(const TileLayout& L, const uint8_t* w, int r0, int r1, const float* x, int ldx, int n,
                  float* y, int ldy) {
  if (gemm_on_whole_blocks(L, w, r0, r1, y, [&](const TileLayout& S, const uint8_t* ws, int a, int b, float* ys) {
        gemm_f32_ref(S, ws, a, b, x, ldx, n, ys, ldy);
      }))
    return;
  float blk[32];
  std::vector<double> acc(n);
  for_groups(L, w, r0, r1, [&](const Group& G) {
    for (int i = 0; i < G.g; ++i) {
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int t = 0; t < G.ntiles; ++t) {
        const uint8_t* tb = G.tile(t);
        const int nb = G.nb_of(t);
        for (int b = 0; b < nb; ++b) {
          dequant_block(L.type, tb + ((size_t)b * G.g + i) * G.bb, blk);
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

void gemm_q8_ref(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  if (gemm_on_whole_blocks(L, w, r0, r1, y, [&](const TileLayout& S, const uint8_t* ws, int a, int b, float* ys) {
        gemm_q8_ref(S, ws, a, b, x, ys, ldy);
      }))
    return;
  int q[32];
  const int xb = x.cols / 32;
  for_groups(L, w, r0, r1, [&](const Group& G) {
    for (int i = 0; i < G.g; ++i) {
      for (int k = 0; k < x.n; ++k) {
        float acc = 0;
        for (int t = 0; t < G.ntiles; ++t) {
          const uint8_t* tb = G.tile(t);
          const int nb = G.nb_of(t);
          for (int b = 0; b < nb; ++b) {
            float sc = 0, off = 0;
            int_block(L.type, tb + ((size_t)b * G.g + i) * G.bb, q, &sc, &off);
            const int cb = t * G.bpt + b;  // block column == activation block
            const int8_t* xq = x.q + (size_t)k * x.cols + cb * 32;
            int dot = 0;
            for (int j = 0; j < 32; ++j) dot += q[j] * xq[j];
            acc += sc * x.d[(size_t)k * xb + cb] * dot + off * x.s[(size_t)k * xb + cb];
          }
        }
        y[(size_t)k * ldy + (G.row + i - r0)] = acc;
      }
    }
  });
}

void quantize_acts_ref(const float* x, int ldx, int n, int cols, QActs& out) {
  const int nb = cols / 32;
  out.n = n;
  out.cols = cols;
  for (int k = 0; k < n; ++k) {
    for (int b = 0; b < nb; ++b) {
      const float* xb = x + (size_t)k * ldx + b * 32;
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(xb[j]));
      const float d = amax / 127.f, id = d ? 1.f / d : 0.f;
      int sum = 0;
      int8_t* q = out.q + (size_t)k * cols + b * 32;
      for (int j = 0; j < 32; ++j) {
        q[j] = (int8_t)std::nearbyint(xb[j] * id);
        sum += q[j];
      }
      out.d[(size_t)k * nb + b] = d;
      out.s[(size_t)k * nb + b] = d * sum;
    }
  }
}

// ---------------------------------------------------------------- dispatch
static bool no_q8x2(const TileLayout&, const uint8_t*, int, int, const QActs&, const QActs&, float*, int) {
  return false;
}

const GemmTable& gemm_table(Isa isa) {
  static const GemmTable ref{Isa::Scalar, gemm_f32_ref, gemm_q8_ref, no_q8x2, quantize_acts_ref};
#if defined(CFLOW_X86)
  if (isa == Isa::Avx512) return gemm_table_avx512();
  if (isa == Isa::Avx2) return gemm_table_avx2();
#endif
  return ref;
}

static const GemmTable& best() {
  static const GemmTable& t = gemm_table(best_isa());
  return t;
}

void gemm_f32(const TileLayout& L, const uint8_t* w, int r0, int r1, const float* x, int ldx, int n,
              float* y, int ldy) {
  best().f32(L, w, r0, r1, x, ldx, n, y, ldy);
}

void gemm_q8(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy) {
  best().q8(L, w, r0, r1, x, y, ldy);
}

void gemm_q8x2(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, const QActs& x2, float* y,
               int ldy) {
  if (best().q8x2(L, w, r0, r1, x, x2, y, ldy)) return;
  thread_local std::vector<float> y2;
  const int nr = r1 - r0;
  y2.resize((size_t)x.n * nr);
  gemm_q8(L, w, r0, r1, x, y, ldy);
  gemm_q8(L, w, r0, r1, x2, y2.data(), nr);
  for (int k = 0; k < x.n; ++k)
    for (int r = 0; r < nr; ++r) y[(size_t)k * ldy + r] += y2[(size_t)k * nr + r];
}

void quantize_acts(const float* x, int ldx, int n, int cols, QActs& out) { best().quantize(x, ldx, n, cols, out); }

}  // namespace cflow
