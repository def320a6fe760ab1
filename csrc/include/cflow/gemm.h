// Tile GEMM over the tiled weight layout (src/cflow/format/tiles.py): y (n, R) = x (n, C) @ W^T.
// n > 1 is prefill, where each weight block is read once and applied to every token. Two
// activation paths:
//   f32: exact dequantize-and-FMA (parity path), every type;
//   q8 : activations quantized once per op (QActs, kernels.h: one or two levels of block_q8a),
//        integer dot products, where has_int8_path(type, true): the fast path.
// The kernels are the gemm_f32 / gemm_q8 entries of each ISA's KernelTable (kernels.h); the
// scalar entries (ref::gemm_f32, ref::gemm_q8) are the definition the tests compare to.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cflow/kernels.h"

namespace cflow {

// Row ranges given to the kernels start and end on interleave-group boundaries:
// row r0 of stripe s satisfies (r0 - s*tr) % g == 0, and r1 is such a row or R.
// unit_row(L, u): first row of interleave group u (groups counted across stripes).
int layout_units(const TileLayout& L);
int unit_row(const TileLayout& L, int u);

namespace ref {
void gemm_f32(const TileLayout& L, const uint8_t* w, int r0, int r1, const float* x, int ldx, int n, float* y,
              int ldy);
void gemm_q8(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy);
}  // namespace ref

// Dispatched versions: the entry of the best ISA that has one (CFLOW_ISA caps it).
void gemm_f32(const TileLayout& L, const uint8_t* w, int r0, int r1, const float* x, int ldx, int n, float* y,
              int ldy);
void gemm_q8(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy);
// The int8 GEMM entry of `isa` (or the ISA below it that has one) for L's type and pack.
GemmQ8Fn gemm_q8_fn(const TileLayout& L, Isa isa);

// Row r of W dequantized to fp32: out (C,).
void dequant_row(const TileLayout& L, const uint8_t* w, int r, float* out);

}  // namespace cflow
