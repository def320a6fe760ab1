// Internal: the per-ISA kernel tables (defined in x86/avx2 and x86/avx512, compiled with their
// ISA flags, called only after cpu.h says the ISA is there).
#pragma once
#include "cflow/gemm.h"
#include "cflow/kernels.h"

namespace cflow {

// Index of a weight type in the kernel tables (0 .. kNumWTypes-1).
constexpr int kNumWTypes = 9;
int wtype_index(WType wt);

// table[wtype_index][(int)AType]; nullptr where the ISA has no kernel (scalar is used).
using GemvTable = GemvFn[kNumWTypes][3];  // [type][AType]
const GemvTable& gemv_table_avx2();
const GemvTable& gemv_table_avx512();
// The same for planes-packed weights (entries only for the types that have the pack).
const GemvTable& gemv_planes_avx2();
const GemvTable& gemv_planes_avx512();

// The GEMM tables (cflow/gemm.h).
const GemmTable& gemm_table_avx2();
const GemmTable& gemm_table_avx512();

}  // namespace cflow
