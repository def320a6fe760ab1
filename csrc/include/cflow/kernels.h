// Tile kernels over the tiled payload of src/cflow/format/tiles.py (cflow/blocktypes.h: the
// block types and TileLayout). The GEMV (y = W x, one token: decode) is declared here, the GEMM
// (n tokens: prefill) in cflow/gemm.h; the kernels of both live in one KernelTable per ISA.
//
// GEMV kernels have the GemvFn signature. The row range [row_begin, row_end) must start on a
// stripe (row_begin % tr == 0) and end on one or at L.rows, so threads that take whole stripes
// never share a tile or an output. y points at the output of row_begin:
//   y: (row_end - row_begin) fp32, overwritten.
// Activations (AType): F32 takes x as cols floats; Q8 one row of the type's int8 activation
// blocks (act_block: block_q8a[cols/32] or block_q8_K[cols/256]); Q8x2 two such rows.
// Every SIMD kernel has a scalar twin (kernel_table(Isa::Scalar)) that stays compiled; the tests
// compare them on every ISA this CPU runs.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cflow/blocks.h"
#include "cflow/blocktypes.h"
#include "cflow/cpu.h"

namespace cflow {

// ---- int8 activations ----

// Int8 activations of n tokens (cols % 32 == 0): token k's level l (l < levels) is the row of
// cols/32 block_q8a (then their q8a_sums, blocks.h) at row(k, l). One token's rows are adjacent,
// so n = 1 is the x of a Q8 (levels 1) or Q8x2 (levels 2) GEMV.
struct QActs {
  int n = 0, cols = 0, levels = 1;
  uint8_t* data = nullptr;  // bytes() bytes
  block_q8a* row(int k, int l = 0) const {
    return (block_q8a*)(data + ((size_t)k * levels + l) * q8a_row_bytes(cols));
  }
  size_t bytes() const { return (size_t)n * levels * q8a_row_bytes(cols); }
};

// Bytes of the prepared activation for (bt, at): cols*4 for F32, else the int8 rows.
size_t act_bytes(BlockType bt, AType at, int cols);
// x (cols) -> `levels` (1 or 2) rows of int8 blocks of kind ab at xa: level 1 quantizes x,
// level 2 the residual x - level 1 (the part of x level 1 misses): block_q8a rows at the scale
// d1 / 256 (ref::quantize_q8a_level2), block_q8_K rows at their own.
void quantize_act(ActBlock ab, void* xa, const float* x, int cols, int levels);
// Prepare x for (bt, at): F32 copies x; Q8 / Q8x2 quantize it (one or two levels).
void prepare_act(BlockType bt, AType at, void* xa, const float* x, int cols);
// n tokens (token k at x + k * ldx) -> out.row(k, l), l < out.levels (out.b sized by the caller).
void quantize_acts(const float* x, int ldx, int n, int cols, QActs& out);

// ---- kernel signatures and the per-ISA table ----

// y: (row_end-row_begin) fp32; x: prepared activation; w: tiled payload of L.
using GemvFn = void (*)(float* y, const void* x, const uint8_t* w, const TileLayout& L, int row_begin, int row_end);
// y[t*ldy + (r - r0)] = sum_c W[r][c] * x_t[c] for t < n, r in [r0, r1); [r0, r1) on interleave
// group boundaries (gemm.h unit_row).
using GemmF32Fn = void (*)(const TileLayout& L, const uint8_t* w, int r0, int r1, const float* x, int ldx, int n,
                           float* y, int ldy);
// The same with int8 activations of every level summed: x1 + x2 for two levels.
using GemmQ8Fn = void (*)(const TileLayout& L, const uint8_t* w, int r0, int r1, const QActs& x, float* y, int ldy);

struct KernelTable {
  Isa isa;
  GemvFn gemv[kNumBlockTypes][2][3];    // [block_index][Pack][AType]; nullptr: the ISA below
  GemmQ8Fn gemm_q8[kNumBlockTypes][2];  // [block_index][Pack]; nullptr: the ISA below
  GemmF32Fn gemm_f32;                   // every type and pack (rows dequantized once)
  void (*quantize_q8a)(block_q8a* out, const float* x, int cols);  // one row (and its sums)
  // level 2 of a two-level row from x and its level 1 (ref::quantize_q8a_level2)
  void (*quantize_q8a_level2)(block_q8a* out, block_q8a* l1, const float* x, int cols);
  void (*quantize_q8K)(block_q8_K* out, const float* x, int cols);  // one row of the K-quants' activations
};
// The table of one ISA; `isa` must be supported by this CPU (isa_supported).
const KernelTable& kernel_table(Isa isa);

// The GEMV for (bt, pack, at) of the best ISA at or below `isa` that has one (scalar always
// does); *used (optional) receives the ISA of the returned kernel. nullptr for an unsupported
// combination.
GemvFn gemv_fn(BlockType bt, Pack pack, AType at, Isa isa, Isa* used = nullptr);

// m tokens through one GEMV at once: token k's prepared activation at x + k * act_bytes(bt, at,
// cols), its outputs at y + k * ldy (rows as for GemvFn). Each token's outputs are bit-identical
// to a GemvFn call of the same (bt, pack, at, isa) on its activation alone: the kernel forms the
// exact integer dot products another way (several tokens per pass over the weights) and then
// runs the same float operations in the same order, so a token's result does not depend on the
// batch it rides in.
using GemvBatchFn = void (*)(float* y, int ldy, const void* x, int m, const uint8_t* w, const TileLayout& L,
                             int row_begin, int row_end);
// A batched kernel takes at least this many tokens per pass over its rows (16 activation rows:
// 16 tokens of one level, 8 of two).
constexpr int kBatchGroupMin = 8;
// The batched kernel matching gemv_fn(bt, pack, at, isa), or nullptr where there is none (the
// caller then runs the GEMV token by token). Today: TQ1_0/TQ2_0 whole blocks with one int8
// level (each block decoded once, met by every token), and planes-packed Q4_0/Q4_1/Q5_0/Q5_1/Q8_0/Q4_K/Q5_K/Q6_K
// with int8 activations on the AVX2 and AVX-512 paths: on AMX (amx_usable()) one tile dot product
// forms 16 (token, level) rows' integers at once; elsewhere each chunk is unpacked once per pass and
// met by every token's dot products in turn (vpdpbusd; AVX2 maddubs + madd).
GemvBatchFn gemv_batch_fn(BlockType bt, Pack pack, AType at, Isa isa);
// Whether the batched kernel is also faster than the int8 GEMM for prompt rows: at 512 bits it
// is, on AMX and on VNNI alike (docs/KERNELS.md); at 256 bits the GEMM is.
bool gemv_batch_beats_gemm(Isa isa);

// Several calls over the same prepared activations. A GEMV kernel of the planes pack first lays
// a call's activations out in the order of its dot products (for a pass of 8 two-level tokens
// over 4864 columns, some 40 KB), and a caller whose rows are handed out in runs calls it several
// times over the same activations. While the calling thread holds a nonzero stamp
// (set_acts_stamp), a kernel that laid out the same activations (pointer, token count, shape)
// under that stamp on this thread last keeps its layout. The caller takes a new stamp
// (new_acts_stamp) whenever the bytes at its activation pointer change, and sets 0 when it is
// done; with 0 (the default) every call lays its activations out anew.
uint64_t new_acts_stamp();
void set_acts_stamp(uint64_t stamp);
uint64_t acts_stamp();

// Scalar references outside the table.
namespace ref {
void quantize_q8a(block_q8a* xq, const float* x, int cols);     // a row and its sums; cols % 32 == 0
// Level 2 of a two-level row: the residual r = x - d1 q1 (one fused multiply-add) at the
// fixed scale d2 = d1 / 256 per block (|r| <= d1 / 2, so |r / d2| <= 128, clamped to 127), and
// its sums; a block of l1 whose d1 / 256 would not be a normal float (|x| < 2^-111) is zeroed in
// both. The fixed ratio lets a kernel combine the levels' exact integer dot products as
// 256 S + T before one conversion to float (x86/avx512/planes_finish.h); kernels that scale each
// level by its own d need nothing of it. The SIMD tables' version gives the same bytes.
void quantize_q8a_level2(block_q8a* out, block_q8a* l1, const float* x, int cols);
void quantize_q8_K(block_q8_K* xq, const float* x, int cols);   // cols % 256 == 0
// Dequantize n_blocks consecutive blocks of bt into out (n_blocks * block_elems floats).
void dequantize(BlockType bt, const uint8_t* blocks, int n_blocks, float* out);
}  // namespace ref

// Rows [0, nr) of one stripe of a planes-packed L -> the same stripe with whole blocks
// (Pack::Blocks, same tile shape and interleave): dst, same size.
void unpack_planes(const TileLayout& L, const uint8_t* src, uint8_t* dst, int nr);

// ---- multi-threaded drivers (split whole stripes over the pool) ----
class ThreadPool;

// Q4_0 with a fitted scale (the encoder of format/quant.py): n_blocks blocks of 32 floats at x
// -> n_blocks GGUF Q4_0 blocks (18 bytes) at out, on a pool of its own of `threads` threads (any
// caller thread may use it). Per block the candidate scales d = gguf's (extreme / -8), and for
// s = 7.0, 7.2 .. 9.0 the least-squares d of the integers that put the extreme at -s; each
// rounded to fp16 and its integers refitted to it (nearest, clipped to -8..7); the least squared
// error kept (the first of equals, so gguf's d on ties). No block is worse than gguf's rounding.
// Returns the number of blocks whose values no finite fp16 scale covers (written as zeros).
// importance (optional): one positive weight per column of a row of row_blocks blocks (x is rows
// of row_blocks * 32 floats); the squared errors and the least-squares fits are then weighted by
// it (llama.cpp's importance matrix: the mean square of the column's activations), so the
// columns that meet large activations are kept closer.
int64_t quantize_q4_0_fit(const float* x, int64_t n_blocks, uint8_t* out, int threads,
                          const float* importance = nullptr, int64_t row_blocks = 1);
// Q4_1 likewise (20-byte blocks, x ~ d q + m): gguf's (d, m) = ((max - min) / 15, min), and the
// least-squares (d, m) of the grids that spread the range over 14.0 .. 16.0 steps.
int64_t quantize_q4_1_fit(const float* x, int64_t n_blocks, uint8_t* out, int threads,
                          const float* importance = nullptr, int64_t row_blocks = 1);

// y: (L.rows) = W x with the kernel gemv_fn(L.bt(), L.packing(), at, isa); x is prepared.
void gemv(AType at, Isa isa, float* y, const void* x, const uint8_t* w, const TileLayout& L, ThreadPool* pool);

// Gated linear unit fused into one pass over a gate+up matrix interleaved by half-stripes
// (tiles.py fuse_rows(..., "glu")): every stripe of tr rows holds h = tr/2 gate rows followed
// by the matching h up rows (the last stripe: r gate rows then r up rows, r = ff - k*h).
// out: (ff) = act(gate x) * (up x); L: the tiled (2*ff, cols).
enum class Glu : int { Silu = 0, GeluTanh = 1 };
void gemv_glu(AType at, Isa isa, Glu act, float* out, const void* x, const uint8_t* w, const TileLayout& L,
              ThreadPool* pool);

}  // namespace cflow
