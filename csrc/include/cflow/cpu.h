// CPU feature detection for run-time ISA dispatch.
#pragma once
#include <string>

namespace cflow {

enum class Isa : int { Scalar = 0, Avx2 = 1, Avx512 = 2 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512vnni = false;
};

// Features of the CPU we run on (cached after the first call).
const CpuFeatures& cpu_features();
// Best ISA this CPU supports; the CFLOW_ISA environment variable (scalar|avx2|avx512) caps it.
Isa best_isa();
const char* isa_name(Isa isa);
// True when `isa` can run on this CPU.
bool isa_supported(Isa isa);
// True when the AMX int8 tile unit can be used: the CPU has AMX-TILE and AMX-INT8, the OS
// saves tile state and granted this process the tile data (asked once, on the first call), and
// CFLOW_AMX is not 0. The batched decode kernels use it on top of the AVX-512 path.
bool amx_usable();

}  // namespace cflow
