// Tile GEMV kernels: y = W x over the tiled payload of src/cflow/format/tiles.py.
//
// W has `rows` outputs and `cols` inputs, encoded as blocks of a WType and tiled with tile shape
// (tr, tc) and in-tile row interleave g (docs/KERNELS.md): stripes of tr rows, stripe-major,
// column tiles of tc columns, inside a tile groups of g rows stored block-column-major.
//
// Two activation types per quantized weight type:
//   AType::F32 - x is fp32 (const float*, cols values): the parity path, dequantize + FMA.
//   AType::Q8  - x is quantized once per op (quantize_act) to int8 blocks: block_q8a[cols/32]
//                for the 32-block types, block_q8_K[cols/256] for Q4_K/Q6_K; integer dot
//                products (VNNI / maddubs). The fast path. F32/F16/BF16 weights have only F32.
//   AType::Q8x2 - two int8 levels (below), planes-packed Q4_0/Q4_1/Q8_0.
//
// Every kernel has the GemvFn signature. The row range [row_begin, row_end) must start on a
// stripe (row_begin % tr == 0) and end on one or at `rows`, so threads that take whole stripes
// never share a tile or an output. y points at the output of row_begin:
//   y: (row_end - row_begin) fp32, overwritten.
// Every SIMD kernel has a scalar twin in namespace cflow::ref that stays compiled; the tests
// compare them.
#pragma once
#include <cstddef>
#include <cstdint>

#include "cflow/blocks.h"
#include "cflow/cpu.h"

namespace cflow {

// Weight block types; values are GGML type ids (as BLOCK_TYPES in format/tiles.py).
enum class WType : int {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14, BF16 = 30
};
// Q8x2: two-level int8 activations, x ~ d1 q1 + d2 q2, q2 the int8 quantization of the
// residual x - d1 q1 (act_residual): the prepared activation is the cols/32 block_q8a of the
// first level followed by those of the second. About 14 bits of activation precision for the
// integer arithmetic of one more dot per weight byte. Planes-packed Q4_0/Q4_1/Q8_0 only.
enum class AType : int { F32 = 0, Q8 = 1, Q8x2 = 2 };

// How an interleave group stores the blocks of one column block (docs/FORMAT.md, 5.1):
//   Blocks: g whole blocks, one per row (GGUF's block encoding, any type);
//   Planes: the same bytes regrouped for g <= 16 rows of Q4_0 / Q4_1 / Q8_0 (cflow/planes.h):
//           the g fp16 scales (then the g Q4_1 mins), then the quants in 4-byte slices, slice k
//           of every row together, so one 512-bit load holds slice k of 16 rows and one vpdpbusd
//           against 4 broadcast activation bytes serves all 16 rows.
enum class Pack : int { Blocks = 0, Planes = 1 };

struct TileShape {
  int tr = 128;  // rows per stripe
  int tc = 256;  // columns per tile (multiple of the block size)
  int g = 1;     // in-tile row interleave (divides tr)
  Pack pack = Pack::Blocks;
};

int block_elems(WType wt);       // weights per block (1 for F32/F16/BF16)
int block_bytes(WType wt);       // bytes per block
const char* wtype_name(WType wt);  // "q4_0", ...
bool wtype_from_name(const char* name, WType* out);
bool has_q8_path(WType wt);      // quantized types: true
size_t tiled_nbytes(WType wt, int rows, int cols);
// nullptr when (rows, cols, ts) is a valid tiling of wt, else a message naming the problem.
const char* check_tiling(WType wt, int rows, int cols, const TileShape& ts);

// Bytes of the prepared activation for (wt, at): cols*4 for F32, else the int8 blocks.
size_t act_bytes(WType wt, AType at, int cols);
// Prepare x for (wt, at): F32 copies x; Q8 quantizes (quantize_q8a or quantize_q8_K).
void prepare_act(WType wt, AType at, void* xa, const float* x, int cols);
// r = x - (the values xa holds): the part of x an int8 activation (prepare_act, Q8) misses.
void act_residual(WType wt, const void* xa, const float* x, int cols, float* r);
// x: (cols) fp32 -> xq: (cols/32) blocks; cols % 32 == 0.
void quantize_q8a(block_q8a* xq, const float* x, int cols);
// x: (cols) fp32 -> xq: (cols/256) blocks; cols % 256 == 0.
void quantize_q8_K(block_q8_K* xq, const float* x, int cols);

// y: (row_end-row_begin) fp32; x: prepared activation; w: tiled payload of (rows, cols).
using GemvFn = void (*)(float* y, const void* x, const uint8_t* w, int rows, int cols,
                        const TileShape& ts, int row_begin, int row_end);

// The kernel for (wt, at) of the best ISA at or below `isa` that has one (scalar always does);
// *used (optional) receives the ISA of the returned kernel. nullptr for an unsupported pair.
GemvFn gemv_fn(WType wt, AType at, Isa isa, Isa* used = nullptr, Pack pack = Pack::Blocks);
bool pack_from_name(const char* name, Pack* out);  // "blocks" / "planes"
const char* pack_name(Pack pack);

// Scalar references (the parity definition; also the fallback of every type).
namespace ref {
#define CFLOW_GEMV_DECL(name) \
  void name(float* y, const void* x, const uint8_t* w, int rows, int cols, const TileShape& ts, \
            int row_begin, int row_end);
CFLOW_GEMV_DECL(gemv_f32_f32)
CFLOW_GEMV_DECL(gemv_f16_f32)
CFLOW_GEMV_DECL(gemv_bf16_f32)
CFLOW_GEMV_DECL(gemv_q4_0_f32)
CFLOW_GEMV_DECL(gemv_q4_1_f32)
CFLOW_GEMV_DECL(gemv_q5_0_f32)
CFLOW_GEMV_DECL(gemv_q8_0_f32)
CFLOW_GEMV_DECL(gemv_q4_k_f32)
CFLOW_GEMV_DECL(gemv_q6_k_f32)
CFLOW_GEMV_DECL(gemv_q4_0_q8)
CFLOW_GEMV_DECL(gemv_q4_1_q8)
CFLOW_GEMV_DECL(gemv_q5_0_q8)
CFLOW_GEMV_DECL(gemv_q8_0_q8)
CFLOW_GEMV_DECL(gemv_q4_k_q8)
CFLOW_GEMV_DECL(gemv_q6_k_q8)

// Dequantize n_blocks consecutive blocks of wt into out (n_blocks * block_elems floats).
void dequantize(WType wt, const uint8_t* blocks, int n_blocks, float* out);

// Planes-packed weights (Q4_0, Q4_1, Q8_0; both activation paths): each stripe regrouped into
// whole blocks (unpack_planes), then the kernel above. The definition the SIMD kernels match.
CFLOW_GEMV_DECL(gemv_q4_0_f32_planes)
CFLOW_GEMV_DECL(gemv_q4_1_f32_planes)
CFLOW_GEMV_DECL(gemv_q8_0_f32_planes)
CFLOW_GEMV_DECL(gemv_q4_0_q8_planes)
CFLOW_GEMV_DECL(gemv_q4_1_q8_planes)
CFLOW_GEMV_DECL(gemv_q8_0_q8_planes)
CFLOW_GEMV_DECL(gemv_q4_0_q8x2_planes)
CFLOW_GEMV_DECL(gemv_q4_1_q8x2_planes)
CFLOW_GEMV_DECL(gemv_q8_0_q8x2_planes)
}  // namespace ref

// Rows [0, nr) of one stripe (nr rows, cols columns) of a planes-packed payload -> the same
// stripe with whole blocks (Pack::Blocks, same tile shape and interleave): dst, same size.
void unpack_planes(WType wt, const uint8_t* src, uint8_t* dst, int nr, int cols, const TileShape& ts);

// ---- multi-threaded drivers (split whole stripes over the pool) ----
class ThreadPool;

// y: (rows) = W x with the kernel gemv_fn(wt, at, isa); x is the prepared activation.
void gemv(WType wt, AType at, Isa isa, float* y, const void* x, const uint8_t* w, int rows,
          int cols, const TileShape& ts, ThreadPool* pool);

// Gated linear unit fused into one pass over a gate+up matrix interleaved by half-stripes
// (tiles.py fuse_rows(..., "glu")): every stripe of tr rows holds h = tr/2 gate rows followed
// by the matching h up rows (the last stripe: r gate rows then r up rows, r = ff - k*h).
// out: (ff) = act(gate x) * (up x); w: tiled (2*ff, cols).
enum class Glu : int { Silu = 0, GeluTanh = 1 };
void gemv_glu(WType wt, AType at, Isa isa, Glu act, float* out, const void* x, const uint8_t* w,
              int ff, int cols, const TileShape& ts, ThreadPool* pool);

}  // namespace cflow
