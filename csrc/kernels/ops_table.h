// Internal: builds an OpsTable from the functions of one namespace (ref, avx2, avx512).
#pragma once
#include "cflow/ops.h"

#define CFLOW_OPS_TABLE(ns, isa_)                                                             \
  OpsTable {                                                                                  \
    isa_, ns::rmsnorm, ns::rope, ns::softmax, ns::log_softmax, ns::silu, ns::gelu_tanh,       \
        ns::swiglu, ns::geglu, ns::topk, ns::attn_decode, ns::attn_decode_f16,                \
        ns::attn_prefill, ns::attn_prefill_f16, ns::add, ns::scale, ns::f32_to_f16,           \
        ns::f16_to_f32                                                                        \
  }
