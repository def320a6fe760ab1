// Internal: builds an OpsTable from the functions of one namespace (ref, avx2, avx512).
#pragma once
#include "cflow/ops.h"

#define CFLOW_OPS_TABLE(ns, isa_) \
  OpsTable { isa_, ns::rmsnorm, ns::softmax, ns::swiglu, ns::geglu, ns::dot_rows, ns::mix_rows, ns::dot_rows_n, ns::mix_rows_n, \
        ns::dot_rows_n_h, ns::mix_rows_n_h, ns::to_half, ns::from_q8, ns::exp_max, \
        ns::block_maxima, ns::at_least }
