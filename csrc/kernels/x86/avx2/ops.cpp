// AVX2 + FMA + F16C versions of the small ops: the traits of vec.h plus the shared x86/ops_simd.h.
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "../../ops_table.h"
#include "vec.h"

namespace cflow {
namespace avx2 {

struct V : Vec {};

#include "../ops_simd.h"

}  // namespace avx2

const OpsTable& ops_table_avx2() {
  static const OpsTable t = CFLOW_OPS_TABLE(avx2, Isa::Avx2);
  return t;
}

}  // namespace cflow
