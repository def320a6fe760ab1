#include "cflow/cpu.h"

#include <cstdlib>
#include <cstring>

namespace cflow {

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = [] {
    CpuFeatures c;
#if defined(CFLOW_X86)
    __builtin_cpu_init();
    c.avx2 = __builtin_cpu_supports("avx2");
    c.fma = __builtin_cpu_supports("fma");
    c.f16c = __builtin_cpu_supports("f16c");
    c.avx512f = __builtin_cpu_supports("avx512f");
    c.avx512bw = __builtin_cpu_supports("avx512bw");
    c.avx512vl = __builtin_cpu_supports("avx512vl");
    c.avx512dq = __builtin_cpu_supports("avx512dq");
    c.avx512vnni = __builtin_cpu_supports("avx512vnni");
#endif
    return c;
  }();
  return f;
}

bool isa_supported(Isa isa) {
  const CpuFeatures& c = cpu_features();
  switch (isa) {
    case Isa::Scalar: return true;
    case Isa::Avx2: return c.avx2 && c.fma && c.f16c;
    case Isa::Avx512:
      return isa_supported(Isa::Avx2) && c.avx512f && c.avx512bw && c.avx512vl && c.avx512dq &&
             c.avx512vnni;
  }
  return false;
}

Isa best_isa() {
  Isa best = Isa::Scalar;
  if (isa_supported(Isa::Avx512)) best = Isa::Avx512;
  else if (isa_supported(Isa::Avx2)) best = Isa::Avx2;
  if (const char* cap = std::getenv("CFLOW_ISA")) {
    Isa want = best;
    if (!std::strcmp(cap, "scalar")) want = Isa::Scalar;
    else if (!std::strcmp(cap, "avx2")) want = Isa::Avx2;
    else if (!std::strcmp(cap, "avx512")) want = Isa::Avx512;
    if (static_cast<int>(want) < static_cast<int>(best)) best = want;
  }
  return best;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::Scalar: return "scalar";
    case Isa::Avx2: return "avx2";
    case Isa::Avx512: return "avx512";
  }
  return "?";
}

}  // namespace cflow
