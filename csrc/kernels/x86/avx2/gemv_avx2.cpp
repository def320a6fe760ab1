// AVX2 + FMA GEMV kernels.
#include <immintrin.h>

#include "../../isa_kernels.h"
#include "../../tile_walk.h"

namespace cflow {

const GemvTable& gemv_table_avx2() {
  static const GemvTable t = {};
  return t;
}

}  // namespace cflow
