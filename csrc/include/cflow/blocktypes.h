// The block types of the tiled weight format and the layout of one tiled matrix: one table for
// the GEMV (decode) and the GEMM (prefill) kernels alike.
//
//   BlockType    the one enum of block encodings; values are GGML type ids (tiles.py BLOCK_TYPES).
//   BlockTraits  per type, one row of kBlockTypes: name, weights and bytes per block, the scalar
//                block codec (dequantize; the int8 dot with one activation block), the int8
//                activation block its kernels take (ActBlock: block_q8a for the 32-blocks,
//                block_q8_K for the K-quants and the ternary types, none for float types),
//                whether the prefill GEMM has int8 kernels for it (the K-quants' and the ternary
//                types' GEMM is fp32 only; their prompt rows take the batched GEMV: data here,
//                read by the one predicate has_int8_path), the header bytes of its planes pack (0: no pack)
//                and where those header words sit in a whole block (Q6_K: at its end).
//   TileLayout   one tiled matrix: type, shape, tile (tr, tc), interleave g and pack. Every GEMV
//                and GEMM kernel takes it.
//   KernelTable  (kernels.h) per ISA, indexed by block_index: the GEMV of each (pack, activation)
//                and the int8 GEMM of each pack; a missing entry falls to the ISA below.
// The int8 activations are rows of activation blocks, one row per level (QActs, kernels.h):
// level 2, where used, quantizes the residual x - level 1 (quantize_act, written once).
#pragma once
#include <cstddef>
#include <cstdint>

#include "cflow/blocks.h"

namespace cflow {

enum class BlockType : int {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14,
  BF16 = 30, TQ1_0 = 34, TQ2_0 = 35
};

// The int8 activation block of a type's int8 path.
enum class ActBlock : int { None = 0, Q8a = 1, Q8K = 2 };

// Activation types of a kernel:
//   F32  - x is fp32 (cols values): the parity path, dequantize + FMA;
//   Q8   - x quantized once per op to one row of the type's activation blocks: the fast path;
//   Q8x2 - two int8 levels, x ~ d1 q1 + d2 q2 (two rows): about 14 bits of activation precision
//          for the integer arithmetic of one more dot per weight byte.
enum class AType : int { F32 = 0, Q8 = 1, Q8x2 = 2 };

// How an interleave group stores the blocks of one column block (docs/FORMAT.md, 5.1):
//   Blocks: g whole blocks, one per row (GGUF's block encoding, any type);
//   Planes: the same bytes regrouped for g <= 16 rows of Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 / Q4_K /
//           Q5_K / Q6_K (cflow/planes.h).
enum class Pack : int { Blocks = 0, Planes = 1 };

// The scalar block codecs the table points at (kernels/gemv_ref.cpp): one block -> its
// `elems` floats; the int8 dot of one block with one activation block (block_q8a or
// block_q8_K), as float.
namespace ref {
void deq_f32(const uint8_t* b, float* out);
void deq_f16(const uint8_t* b, float* out);
void deq_bf16(const uint8_t* b, float* out);
void deq_q4_0(const uint8_t* b, float* out);
void deq_q4_1(const uint8_t* b, float* out);
void deq_q5_0(const uint8_t* b, float* out);
void deq_q5_1(const uint8_t* b, float* out);
void deq_q8_0(const uint8_t* b, float* out);
void deq_q4_k(const uint8_t* b, float* out);
void deq_q5_k(const uint8_t* b, float* out);
void deq_q6_k(const uint8_t* b, float* out);
void deq_tq1_0(const uint8_t* b, float* out);
void deq_tq2_0(const uint8_t* b, float* out);
float dot_q4_0(const uint8_t* b, const void* a);
float dot_q4_1(const uint8_t* b, const void* a);
float dot_q5_0(const uint8_t* b, const void* a);
float dot_q5_1(const uint8_t* b, const void* a);
float dot_q8_0(const uint8_t* b, const void* a);
float dot_q4_k(const uint8_t* b, const void* a);
float dot_q5_k(const uint8_t* b, const void* a);
float dot_q6_k(const uint8_t* b, const void* a);
float dot_tq1_0(const uint8_t* b, const void* a);
float dot_tq2_0(const uint8_t* b, const void* a);
}  // namespace ref

struct BlockTraits {
  BlockType type;
  const char* name;
  int elems, bytes;         // weights and bytes per block
  ActBlock act;             // the int8 activation block (None: fp32 activations only)
  bool gemm_int8;           // the prefill GEMM has int8 kernels for this type
  int planes_header;        // header bytes (fp16 d, and m / dmin) of the planes pack; 0: no planes pack
  int planes_header_at;     // the header's byte offset in a whole block (0, Q6_K 208)
  void (*dequantize)(const uint8_t* block, float* out);
  float (*dot)(const uint8_t* block, const void* act);  // nullptr where act is None
};

constexpr int kNumBlockTypes = 13;
inline constexpr BlockTraits kBlockTypes[kNumBlockTypes] = {
    {BlockType::F32, "f32", 1, 4, ActBlock::None, false, 0, 0, ref::deq_f32, nullptr},
    {BlockType::F16, "f16", 1, 2, ActBlock::None, false, 0, 0, ref::deq_f16, nullptr},
    {BlockType::Q4_0, "q4_0", 32, 18, ActBlock::Q8a, true, 2, 0, ref::deq_q4_0, ref::dot_q4_0},
    {BlockType::Q4_1, "q4_1", 32, 20, ActBlock::Q8a, true, 4, 0, ref::deq_q4_1, ref::dot_q4_1},
    {BlockType::Q5_0, "q5_0", 32, 22, ActBlock::Q8a, true, 2, 0, ref::deq_q5_0, ref::dot_q5_0},
    {BlockType::Q5_1, "q5_1", 32, 24, ActBlock::Q8a, true, 4, 0, ref::deq_q5_1, ref::dot_q5_1},
    {BlockType::Q8_0, "q8_0", 32, 34, ActBlock::Q8a, true, 2, 0, ref::deq_q8_0, ref::dot_q8_0},
    {BlockType::Q4_K, "q4_k", 256, 144, ActBlock::Q8K, false, 4, 0, ref::deq_q4_k, ref::dot_q4_k},
    {BlockType::Q5_K, "q5_k", 256, 176, ActBlock::Q8K, false, 4, 0, ref::deq_q5_k, ref::dot_q5_k},
    {BlockType::Q6_K, "q6_k", 256, 210, ActBlock::Q8K, false, 2, 208, ref::deq_q6_k, ref::dot_q6_k},
    {BlockType::BF16, "bf16", 1, 2, ActBlock::None, false, 0, 0, ref::deq_bf16, nullptr},
    {BlockType::TQ1_0, "tq1_0", 256, 54, ActBlock::Q8K, false, 0, 0, ref::deq_tq1_0, ref::dot_tq1_0},
    {BlockType::TQ2_0, "tq2_0", 256, 66, ActBlock::Q8K, false, 0, 0, ref::deq_tq2_0, ref::dot_tq2_0},
};

// Row of bt in kBlockTypes (the index of every kernel table); -1 for an unknown code.
constexpr int block_index(BlockType bt) {
  for (int i = 0; i < kNumBlockTypes; ++i)
    if (kBlockTypes[i].type == bt) return i;
  return -1;
}
// bt's row; nullptr for an unknown code.
constexpr const BlockTraits* block_traits(BlockType bt) {
  const int i = block_index(bt);
  return i < 0 ? nullptr : &kBlockTypes[i];
}
// One field of a block type's row, or `none` for an unknown code. It indexes the table rather
// than testing block_traits() against nullptr: GCC 12 does not fold that test in a constant
// expression under -fsanitize=null (the CFLOW_SANITIZE build).
template <typename T>
constexpr T block_field(BlockType bt, T BlockTraits::*field, T none) {
  const int i = block_index(bt);
  return i < 0 ? none : kBlockTypes[i].*field;
}
constexpr int block_elems(BlockType bt) { return block_field(bt, &BlockTraits::elems, 0); }
constexpr int block_bytes(BlockType bt) { return block_field(bt, &BlockTraits::bytes, 0); }
constexpr int planes_header(BlockType bt) { return block_field(bt, &BlockTraits::planes_header, 0); }
constexpr int planes_header_at(BlockType bt) { return block_field(bt, &BlockTraits::planes_header_at, 0); }
constexpr ActBlock act_block(BlockType bt) { return block_field(bt, &BlockTraits::act, ActBlock::None); }
const char* block_name(BlockType bt);  // "q4_0", ...; "?" for an unknown code
bool block_from_name(const char* name, BlockType* out);
const char* pack_name(Pack pack);  // "blocks" / "planes"
bool pack_from_name(const char* name, Pack* out);

// Whether bt's int8 activation path exists: for the GEMV (one token: every quantized type), or
// for the GEMM (several tokens: where the table's gemm_int8 says so).
bool has_int8_path(BlockType bt, bool gemm);

constexpr int kPlanesMaxG = 16;  // the planes pack is defined for interleave groups of <= 16 rows

// One tiled matrix: rows (outputs) x cols (inputs) encoded as blocks of `type`, in stripes of tr
// rows (stripe-major), column tiles of tc columns, inside a tile groups of g rows stored
// block-column-major, each group's column block packed as `pack`. type and pack hold the codes
// (as the plan's tensor table carries them); bt() and packing() read them typed.
struct TileLayout {
  int type = 0;             // BlockType code
  int rows = 0, cols = 0;
  int tr = 128, tc = 256;   // rows per stripe, columns per tile (a multiple of the block size)
  int g = 1;                // in-tile row interleave (divides tr)
  int pack = 0;             // Pack code
  int qk = 1, bb = 4;       // weights / bytes per block (filled by make_layout)
  BlockType bt() const { return static_cast<BlockType>(type); }
  Pack packing() const { return static_cast<Pack>(pack); }
  bool planes() const { return pack == (int)Pack::Planes; }
};

// Fills qk/bb and checks the layout; false (with *err naming the problem) when it is not one.
bool make_layout(TileLayout& L, const char** err);
// A checked layout of (bt, rows, cols, tile, interleave, pack); *err set (and ok false) if not.
TileLayout tile_layout(BlockType bt, int rows, int cols, int tr, int tc, int g, Pack pack, const char** err);
size_t layout_nbytes(const TileLayout& L);

}  // namespace cflow
