#include "cflow/cpu.h"
#include "cflow/planes.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

#if defined(CFLOW_X86) && defined(__linux__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

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

bool amx_usable() {
  static const bool ok = [] {
    if (const char* v = std::getenv("CFLOW_AMX"))
      if (!std::strcmp(v, "0")) return false;
#if defined(CFLOW_X86) && defined(__linux__)
    if (!isa_supported(Isa::Avx512)) return false;
    unsigned a, b, c, d;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 25))) return false;  // AMX-TILE, AMX-INT8
    // Linux enables tile data per process on request (ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#else
    return false;
#endif
  }();
  return ok;
}

}  // namespace cflow

namespace cflow {

// The kernels' software prefetch switch (cflow/planes.h): on unless CFLOW_PREFETCH=0.
static bool prefetch_default() {
  const char* v = std::getenv("CFLOW_PREFETCH");
  return !(v && v[0] == '0' && !v[1]);
}
std::atomic<bool> g_prefetch{prefetch_default()};

}  // namespace cflow
