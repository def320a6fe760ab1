// Tile GEMM over the tiled weight layout (src/cflow/format/tiles.py): y (n, R) = x (n, C) @ W^T.
// n = 1 is the decode GEMV; n > 1 is prefill, where each weight block is read once and applied
// to every token. Two activation paths:
//   f32: exact dequantize-and-FMA (parity path);
//   q8 : activations quantized once per op into int8 blocks of 32 (scale d, d * sum(q)),
//        integer dot products (AVX-512 VNNI), the fast path.
// Every kernel has a scalar reference (*_ref) that stays compiled and is what tests compare to.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cflow/blocks.h"  // fp16_to_f32, bf16_to_f32
#include "cflow/cpu.h"     // Isa

namespace cflow {

// GGML block type codes (tiles.py BLOCK_TYPES).
enum BlockCode : int { T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q8_0 = 8, T_Q4_K = 12, T_Q6_K = 14, T_BF16 = 30 };

struct BlockInfo {
  int elems;  // QK: weights per block
  int bytes;  // bytes per block
};
// Block geometry of a type code; {0, 0} when the engine does not support it.
BlockInfo block_info(int type);
// True when the q8 (int8 activation) path has a kernel for this weight type.
bool q8_supported(int type);

// One tiled matrix: R rows (outputs) x C columns (inputs), tiles (tr, tc), g rows interleaved.
// pack: 0 whole blocks, 1 planes (kernels.h Pack); a planes-packed matrix is regrouped into
// whole blocks stripe by stripe (per-thread buffer) before the GEMM kernels run on it.
struct TileLayout {
  int type = 0, rows = 0, cols = 0, tr = 128, tc = 256, g = 1;
  int qk = 1, bb = 4;  // block elems / bytes (filled by make_layout)
  int pack = 0;
};
// Fills qk/bb and checks the shape; returns false (with `err` set) when it is inconsistent.
bool make_layout(TileLayout& L, const char** err);
size_t layout_nbytes(const TileLayout& L);

// Activations of n tokens quantized to int8 blocks of 32 columns (C % 32 == 0).
struct QActs {
  int n = 0, cols = 0;
  float* d = nullptr;   // (n, C/32) block scales
  float* s = nullptr;   // (n, C/32) d * sum(q): folds the offset of Q4_0/Q4_1/Q5_0 weights
  int8_t* q = nullptr;  // (n, C)
};
void quantize_acts_ref(const float* x, int ldx, int n, int cols, QActs& out);
void quantize_acts(const float* x, int ldx, int n, int cols, QActs& out);

// Row ranges given to the kernels start and end on interleave-group boundaries:
// row r0 of stripe s satisfies (r0 - s*tr) % g == 0, and r1 is such a row or R.
// unit_row(L, u): first row of interleave group u (groups counted across stripes).
int layout_units(const TileLayout& L);
int unit_row(const TileLayout& L, int u);

// y[t*ldy + (r - r0)] = sum_c W[r][c] * x[t*ldx + c] for t < n, r in [r0, r1).
void gemm_f32_ref(const TileLayout& L, const uint8_t* w, int r0, int r1, const float* x, int ldx, int n,
                  float* y, int ldy);
void gemm_q8_ref(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy);
// Dispatched versions (best ISA; CFLOW_ISA caps it; gemm_table below).
void gemm_f32(const TileLayout& L, const uint8_t* w, int r0, int r1, const float* x, int ldx, int n,
              float* y, int ldy);
void gemm_q8(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy);
// Two activation levels (x ~ x1 + x2, kernels.h AType::Q8x2): y = W x1 + W x2. Planes-packed
// weights take both in one pass (AVX-512); others, two gemm_q8 passes summed.
void gemm_q8x2(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x1, const QActs& x2, float* y,
               int ldy);

// Row r of W dequantized to fp32: out (C,).
void dequant_row(const TileLayout& L, const uint8_t* w, int r, float* out);


// The GEMM kernels of one ISA. The dispatched functions above use gemm_table(best_isa()).
struct GemmTable {
  Isa isa;
  void (*f32)(const TileLayout& L, const uint8_t* w, int r0, int r1, const float* x, int ldx, int n, float* y,
              int ldy);
  void (*q8)(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy);
  // Both levels in one pass; false (nothing done) where the ISA has no such kernel for L's
  // layout, and gemm_q8x2 then sums two q8 passes.
  bool (*q8x2)(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x1, const QActs& x2, float* y,
               int ldy);
  void (*quantize)(const float* x, int ldx, int n, int cols, QActs& out);
};
// The table of one ISA; `isa` must be supported by this CPU (isa_supported).
const GemmTable& gemm_table(Isa isa);

}  // namespace cflow
