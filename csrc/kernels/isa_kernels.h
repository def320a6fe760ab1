// Internal: the per-ISA kernel tables (kernels.h KernelTable) and the helpers that fill and
// read them. The x86/avx2 and x86/avx512 tables are compiled with their ISA flags and called
// only after cpu.h says the ISA is there.
#pragma once
#include <initializer_list>

#include "cflow/gemm.h"
#include "cflow/kernels.h"
#include "cflow/planes.h"

namespace cflow {

const KernelTable& kernel_table_scalar();  // gemv_ref.cpp
const KernelTable& kernel_table_avx2();    // x86/avx2/gemv_avx2.cpp
const KernelTable& kernel_table_avx512();  // x86/avx512/gemv_avx512.cpp
// The GEMM entries of an ISA's table (x86/<isa>/gemm_<isa>.cpp, from x86/gemm_simd.h).
namespace avx2 { void fill_gemm(KernelTable& t); }
namespace avx512 { void fill_gemm(KernelTable& t); }
// The AMX batched GEMV of (bt, pack, at) matching the AVX-512 GEMV (x86/avx512/gemv_amx.cpp),
// nullptr for other types; call only when amx_usable().
namespace avx512 { GemvBatchFn amx_gemv_batch(BlockType bt, Pack pack, AType at); }
// The same without AMX, on AVX-512 VNNI (x86/avx512/gemv_avx512.cpp): several tokens per pass,
// each chunk unpacked once, every token's dot products by vpdpbusd.
namespace avx512 { GemvBatchFn vnni_gemv_batch(BlockType bt, Pack pack, AType at); }
// The same at 256 bits (x86/avx2/gemv_avx2.cpp), matching the AVX2 GEMV.
namespace avx2 { GemvBatchFn gemv_batch(BlockType bt, Pack pack, AType at); }

// get(table) of the best ISA at or below `isa` that this CPU runs and whose entry is set;
// *used (optional) receives that ISA. nullptr when none has one.
template <class Get>
auto lookup(Isa isa, Isa* used, Get&& get) -> decltype(get(kernel_table_scalar())) {
  for (int k = (int)isa; k >= 0; --k) {
    const Isa i = static_cast<Isa>(k);
    if (!isa_supported(i)) continue;
    if (auto f = get(kernel_table(i))) {
      if (used) *used = i;
      return f;
    }
  }
  return nullptr;
}

// A table of `isa` made by the fill functions, in order (later ones may replace entries).
inline KernelTable make_table(Isa isa, std::initializer_list<void (*)(KernelTable&)> fills) {
  KernelTable t{};
  t.isa = isa;
  for (auto fill : fills) fill(t);
  return t;
}

// The level-1 activation rows of tokens k0 .. k0+NT-1 of x: rows[t] = x.row(k0 + t). A token's
// level 2 follows its level 1 by level_bytes(x) (QActs), the same offset for every token, so a
// kernel holds one pointer per token and reaches level 2 through level2(a, l2).
template <int NT>
inline void token_rows(const QActs& x, int k0, const block_q8a* (&rows)[NT]) {
  for (int t = 0; t < NT; ++t) rows[t] = x.row(k0 + t);
}
inline size_t level_bytes(const QActs& x) { return q8a_row_bytes(x.cols); }
inline const block_q8a* level2(const block_q8a* a, size_t l2) { return (const block_q8a*)((const uint8_t*)a + l2); }

// Table entries of block type bt: the fp32 GEMV F of whole blocks (and, for a type with a planes
// pack, F after unpacking); the int8 GEMV Q of `pack` with its two-level form (two passes).
template <GemvFn F>
void set_gemv_f32(KernelTable& t, BlockType bt) {
  t.gemv[block_index(bt)][(int)Pack::Blocks][(int)AType::F32] = F;
  if (planes_header(bt)) t.gemv[block_index(bt)][(int)Pack::Planes][(int)AType::F32] = gemv_unpacked<F>;
}
template <GemvFn Q>
void set_gemv_q8(KernelTable& t, BlockType bt, Pack pack = Pack::Blocks) {
  t.gemv[block_index(bt)][(int)pack][(int)AType::Q8] = Q;
  t.gemv[block_index(bt)][(int)pack][(int)AType::Q8x2] = gemv_two_levels<Q>;
}

}  // namespace cflow
