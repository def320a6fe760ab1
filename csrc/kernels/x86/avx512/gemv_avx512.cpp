// AVX-512 (F/BW/VL/DQ + VNNI) GEMV kernels.
#include <immintrin.h>

#include "../../isa_kernels.h"
#include "../../tile_walk.h"

namespace cflow {

const GemvTable& gemv_table_avx512() {
  static const GemvTable t = {};
  return t;
}

}  // namespace cflow
