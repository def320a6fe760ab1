// The step plan: the one description of a model's forward pass that every engine runs.
//
// A model's module (src/cflow/models/) builds the plan once per model from its arguments and
// the tensors of the mapped file; the native executor (csrc/engine) runs it, the numpy
// reference engine (src/cflow/engine_ref.py) interprets it, the bandwidth analysis walks it.
//
// Every op kind and its named fields are defined once, by the tables below (X-macros): they
// generate the C++ structs here and their Python classes in csrc/bindings/plan.cpp
// (cflow._core.Matmul, ...). A field means one thing whatever the model. Ids index the plan's
// tensors (-1: none) and buffers. A buffer holds one row of `width` floats per token of the
// step; every op works on all the rows of the step (several sequences may share a step).
// Threads meet only at Barrier ops, which the builder places where data dependence needs them.
#pragma once
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace cflow {

// X(type, name, default, doc)
#define CFLOW_TENSOR_FIELDS(X)                                                                   \
  X(std::string, name, "", "tensor name in the file (blk.0.attn_qkv, ...)")                      \
  X(int64_t, offset, 0, "byte offset of the tiled payload in the mapped file")                   \
  X(int64_t, nbytes, 0, "payload bytes")                                                          \
  X(int32_t, type, 0, "block type code (GGML type id)")                                          \
  X(int32_t, rows, 0, "rows (outputs); 1 for a vector")                                          \
  X(int32_t, cols, 0, "columns (inputs)")                                                        \
  X(int32_t, tile_rows, 128, "rows per stripe")                                                  \
  X(int32_t, tile_cols, 256, "columns per tile")                                                 \
  X(int32_t, interleave, 1, "rows interleaved in a tile")                                        \
  X(int32_t, pack, 0, "0: whole blocks, 1: planes")

#define CFLOW_BUFFER_FIELDS(X)                                                                   \
  X(std::string, name, "", "what the buffer holds (x, qkv, logits, ...)")                        \
  X(int32_t, width, 0, "floats per token")

// Op kinds. Each: X(type, name, default, doc) for its fields.
#define CFLOW_OP_BARRIER(X)
#define CFLOW_OP_EMBED(X)                                                                        \
  X(int32_t, table, -1, "embedding tensor (vocab, width of dst)")                                \
  X(int32_t, dst, -1, "buffer: the rows of the step's tokens")                                   \
  X(float, scale, 1.f, "multiplies every row (gemma: sqrt(d_model))")
// The fields of both ops that multiply a weight by their (normalised) input rows.
#define CFLOW_PRODUCT_FIELDS(X)                                                                  \
  X(int32_t, weight, -1, "tensor W (R, C)")                                                      \
  X(int32_t, src, -1, "buffer of width C")                                                       \
  X(int32_t, norm, -1, "RMSNorm weight (C,) applied to src first, or -1")                        \
  X(bool, two_level, false, "int8 path: two-level activations (about 14 bits)")
#define CFLOW_OP_MATMUL(X)                                                                       \
  CFLOW_PRODUCT_FIELDS(X)                                                                        \
  X(int32_t, dst, -1, "buffer; this op writes its columns [dst_col, dst_col + R)")               \
  X(int32_t, dst_col, 0, "first output column in dst")                                           \
  X(int32_t, bias, -1, "bias (R,) added, or -1")                                                 \
  X(float, scale, 1.f, "multiplies the product (after the bias)")                                \
  X(float, softcap, 0.f, "> 0: y = softcap * tanh(y / softcap)")                                 \
  X(bool, accumulate, false, "dst += y instead of dst = y")                                      \
  X(bool, last_token, false, "only the last token of each sequence (the logits head)")
#define CFLOW_OP_GATE_UP(X)                                                                      \
  CFLOW_PRODUCT_FIELDS(X)                                                                        \
  X(int32_t, dst, -1, "buffer of width F = R / 2: act(gate x) * (up x)")                         \
  X(int32_t, chunk, 0, "W's rows come in pieces: `chunk` gate rows, then the same up rows")     \
  X(int32_t, act, 0, "0: silu (SwiGLU), 1: tanh-GELU (GeGLU)")
#define CFLOW_OP_ACT_MUL(X)                                                                      \
  X(int32_t, src, -1, "buffer of width 2F: (gate | up)")                                         \
  X(int32_t, dst, -1, "buffer of width F: act(gate) * up")                                       \
  X(int32_t, act, 0, "0: silu, 1: tanh-GELU")
#define CFLOW_OP_ATTENTION(X)                                                                    \
  X(int32_t, kv, -1, "KV cache slot of the sequence state (one per attention layer)")            \
  X(int32_t, src, -1, "buffer (q | k | v) of width (n_head + 2 n_kv_head) head_dim")             \
  X(int32_t, dst, -1, "buffer of width n_head head_dim")                                          \
  X(int32_t, n_head, 0, "query heads")                                                           \
  X(int32_t, n_kv_head, 0, "key/value heads (divides n_head)")                                   \
  X(int32_t, head_dim, 0, "even, at most 1024")                                                  \
  X(int32_t, q_norm, -1, "RMSNorm weight (head_dim,) of each query head, or -1")                 \
  X(int32_t, k_norm, -1, "RMSNorm weight (head_dim,) of each key head, or -1")                   \
  X(int32_t, window, 0, "> 0: attend to the last `window` positions only")                       \
  X(float, rope_theta, 10000.f, "RoPE base (neox: rotate halves)")                               \
  X(float, scale, 0.f, "score scale; 0: 1/sqrt(head_dim)")
#define CFLOW_OP_NORM_ADD(X)                                                                     \
  X(int32_t, norm, -1, "RMSNorm weight (width,)")                                                \
  X(int32_t, src, -1, "buffer")                                                                  \
  X(int32_t, dst, -1, "buffer of the same width: dst += rmsnorm(src)")

// (Kind, TABLE): the op kinds in the order of their index in Op.
#define CFLOW_OPS(K)                 \
  K(Barrier, CFLOW_OP_BARRIER)       \
  K(Embed, CFLOW_OP_EMBED)           \
  K(Matmul, CFLOW_OP_MATMUL)         \
  K(GateUp, CFLOW_OP_GATE_UP)               \
  K(ActMul, CFLOW_OP_ACT_MUL)        \
  K(Attention, CFLOW_OP_ATTENTION)   \
  K(NormAdd, CFLOW_OP_NORM_ADD)

#define CFLOW_DECLARE_FIELD(type, name, def, doc) type name = def;
#define CFLOW_DECLARE_STRUCT(Kind, TABLE) \
  struct Kind {                           \
    TABLE(CFLOW_DECLARE_FIELD)            \
  };
struct TensorRef {
  CFLOW_TENSOR_FIELDS(CFLOW_DECLARE_FIELD)
};
struct BufferSpec {
  CFLOW_BUFFER_FIELDS(CFLOW_DECLARE_FIELD)
};
CFLOW_OPS(CFLOW_DECLARE_STRUCT)
#undef CFLOW_DECLARE_STRUCT

// std::monostate closes the list the macro writes (Kind, Kind, ...,); an op holding it is rejected
// by the executor's validation, and the bindings never make one.
#define CFLOW_OP_TYPE(Kind, TABLE) Kind,
using Op = std::variant<CFLOW_OPS(CFLOW_OP_TYPE) std::monostate>;
#undef CFLOW_OP_TYPE

struct Plan {
  std::vector<TensorRef> tensors;
  std::vector<BufferSpec> buffers;
  std::vector<Op> ops;
  int32_t logits = -1;        // buffer holding the logits (width: the vocabulary) after the last op
  float norm_eps = 1e-5f;     // every RMSNorm: x / sqrt(mean(x^2) + eps) * (norm_offset + w)
  float norm_offset = 0.f;
};

}  // namespace cflow
