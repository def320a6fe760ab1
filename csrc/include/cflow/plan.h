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
// Threads meet only at Barrier ops, which the builder places where data dependence needs them
// (the sequential schedule); the pipeline schedule derives the dependencies from the ops' buffers
// instead and ignores them (docs/ENGINE.md, "Schedules").
//
// Every op but Barrier names the weight stream it belongs to (`stream`, Stream below): the byte
// counters add its weight bytes there, and the pipeline schedule runs each stream's ops on its
// own threads.
//
// Mixture-of-experts layers: a Router op picks each row's top_k experts and their gates; an
// Experts op looks its layer's experts up in the plan's expert table (ExpertRef: one contiguous
// byte range of the file per (layer, expert), as the file's expert offset table gives it) and
// multiplies only the chosen experts' weights.
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

// One entry of the expert table: where (layer, expert)'s weights lie in the mapped file.
#define CFLOW_EXPERT_FIELDS(X)                                                                   \
  X(int32_t, layer, 0, "the Experts op's `layer`")                                               \
  X(int32_t, expert, 0, "expert id, 0 .. n_expert - 1")                                          \
  X(int64_t, offset, 0, "byte offset of the expert's range in the mapped file (4096-aligned)")   \
  X(int64_t, length, 0, "bytes of the range; both tensors lie inside it")                        \
  X(int32_t, gate_up, -1, "tensor (2 F, C): gate and up rows in `chunk`-row pieces")              \
  X(int32_t, down, -1, "tensor (C, F)")                                                          \
  X(int32_t, chunk, 0, "gate_up's rows per piece (as GateUp's chunk)")                          \
  X(int64_t, crc32c, -1, "CRC-32C of the range's `length` bytes, or -1 when the file has none")

#define CFLOW_BUFFER_FIELDS(X)                                                                   \
  X(std::string, name, "", "what the buffer holds (x, qkv, logits, ...)")                        \
  X(int32_t, width, 0, "floats per token")

// The weight streams (an op's `stream`): what the byte counters count, and the lanes of the
// pipeline schedule (router with the experts; embed and head on every thread).
enum Stream : int32_t { kEmbed = 0, kAttention = 1, kDense = 2, kRouter = 3, kExperts = 4, kHead = 5, kNumStreams = 6 };
#define CFLOW_STREAM_FIELD(X) X(int32_t, stream, 1, "weight stream (Stream): 0 embed, 1 attention, 2 dense, 3 router, 4 experts, 5 head")

// Op kinds. Each: X(type, name, default, doc) for its fields.
#define CFLOW_OP_BARRIER(X)
#define CFLOW_OP_EMBED(X)                                                                        \
  X(int32_t, table, -1, "embedding tensor (vocab, width of dst)")                                \
  X(int32_t, dst, -1, "buffer: the rows of the step's tokens")                                   \
  X(float, scale, 1.f, "multiplies every row (gemma: sqrt(d_model))") \
  CFLOW_STREAM_FIELD(X)
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
  X(bool, last_token, false, "only the last token of each sequence (the logits head)") \
  CFLOW_STREAM_FIELD(X)
#define CFLOW_OP_GATE_UP(X)                                                                      \
  CFLOW_PRODUCT_FIELDS(X)                                                                        \
  X(int32_t, dst, -1, "buffer of width F = R / 2: act(gate x) * (up x)")                         \
  X(int32_t, chunk, 0, "W's rows come in pieces: `chunk` gate rows, then the same up rows")     \
  X(int32_t, act, 0, "0: silu (SwiGLU), 1: tanh-GELU (GeGLU), 2: squared ReLU") \
  CFLOW_STREAM_FIELD(X)
#define CFLOW_OP_ACT_MUL(X)                                                                      \
  X(int32_t, src, -1, "buffer of width 2F: (gate | up)")                                         \
  X(int32_t, dst, -1, "buffer of width F: act(gate) * up")                                       \
  X(int32_t, act, 0, "0: silu, 1: tanh-GELU, 2: squared ReLU") \
  CFLOW_STREAM_FIELD(X)
#define CFLOW_OP_ATTENTION(X)                                                                    \
  X(int32_t, kv, -1, "KV cache slot of the sequence state (one per attention layer)")            \
  X(int32_t, src, -1, "buffer (q | k | v) of width (n_head + 2 n_kv_head) head_dim")             \
  X(int32_t, dst, -1, "buffer of width n_head head_dim")                                          \
  X(int32_t, n_head, 0, "query heads")                                                           \
  X(int32_t, n_kv_head, 0, "key/value heads (divides n_head)")                                   \
  X(int32_t, head_dim, 0, "even, at most 1024")                                                  \
  X(int32_t, q_norm, -1, "RMSNorm (head_dim,) of each query head, or (n_head head_dim,) of all q (OLMoE), or -1") \
  X(int32_t, k_norm, -1, "RMSNorm (head_dim,) of each key head, or (n_kv_head head_dim,) of all k, or -1") \
  X(int32_t, window, 0, "> 0: attend to the last `window` positions only")                       \
  X(float, rope_theta, 10000.f, "RoPE base (neox: rotate halves)")                               \
  X(float, scale, 0.f, "score scale; 0: 1/sqrt(head_dim)") \
  CFLOW_STREAM_FIELD(X)
#define CFLOW_OP_ADD(X)                                                                          \
  X(int32_t, src, -1, "buffer")                                                                  \
  X(int32_t, dst, -1, "buffer of the same width: dst (+)= sigmoid(gate)? * scale * gain * rmsnorm?(src)") \
  X(int32_t, norm, -1, "RMSNorm weight (width,) applied to src first, or -1")                    \
  X(int32_t, gain, -1, "per-channel gain (width,), or -1")                                       \
  X(float, scale, 1.f, "multiplies the (normalised) src")                                        \
  X(int32_t, gate, -1, "buffer of width 1: y *= sigmoid(its row), or -1 (Qwen2-MoE's shared expert)") \
  X(bool, accumulate, true, "dst += y; false: dst = y (a copy)") \
  CFLOW_STREAM_FIELD(X)
// Router: p = softmax(R rmsnorm?(x)) over the n_expert rows of R; the top_k largest (ties: the
// lower id), their gates p_i (renorm: p_i / sum of the top_k's p). dst row: top_k expert ids as
// floats (exact below 2^24), then their top_k gates, in falling order of p.
#define CFLOW_OP_ROUTER(X)                                                                       \
  X(int32_t, weight, -1, "router matrix R (n_expert, C), any type (dequantized once)")           \
  X(int32_t, src, -1, "buffer of width C")                                                       \
  X(int32_t, norm, -1, "RMSNorm weight (C,) applied to src first, or -1")                        \
  X(int32_t, dst, -1, "buffer of width 2 top_k: ids, then gates")                                \
  X(int32_t, top_k, 0, "experts per row, 1 .. n_expert")                                         \
  X(bool, renorm, true, "gates renormalised over the top_k (Mixtral, Qwen3-MoE norm_topk_prob, pnt)") \
  CFLOW_STREAM_FIELD(X)
// Experts: dst (+)= scale * sum over the row's top_k of gate_i * down_i(act(gate_i x) * up_i x),
// x = rmsnorm?(src), the experts (Plan.experts entries of `layer`) in ascending id. Only the
// chosen experts' bytes are read: each expert once per step for all the rows that chose it.
#define CFLOW_OP_EXPERTS(X)                                                                      \
  X(int32_t, layer, -1, "the expert table's layer")                                              \
  X(int32_t, n_expert, 0, "experts of the layer: entries 0 .. n_expert - 1")                     \
  X(int32_t, src, -1, "buffer of width C")                                                       \
  X(int32_t, norm, -1, "RMSNorm weight (C,) applied to src first, or -1")                        \
  X(int32_t, route, -1, "the Router's dst (width 2 top_k)")                                      \
  X(int32_t, dst, -1, "buffer of width C")                                                       \
  X(int32_t, act, 0, "0: silu (SwiGLU), 1: tanh-GELU (GeGLU), 2: squared ReLU")                                   \
  X(float, scale, 1.f, "multiplies the sum")                                                     \
  X(bool, accumulate, false, "dst += y instead of dst = y")                                      \
  X(bool, two_level, false, "int8 path: two-level activations") \
  CFLOW_STREAM_FIELD(X)

// (Kind, TABLE): the op kinds in the order of their index in Op.
#define CFLOW_OPS(K)                 \
  K(Barrier, CFLOW_OP_BARRIER)       \
  K(Embed, CFLOW_OP_EMBED)           \
  K(Matmul, CFLOW_OP_MATMUL)         \
  K(GateUp, CFLOW_OP_GATE_UP)               \
  K(ActMul, CFLOW_OP_ACT_MUL)        \
  K(Attention, CFLOW_OP_ATTENTION)   \
  K(Add, CFLOW_OP_ADD)               \
  K(Router, CFLOW_OP_ROUTER)         \
  K(Experts, CFLOW_OP_EXPERTS)

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
struct ExpertRef {
  CFLOW_EXPERT_FIELDS(CFLOW_DECLARE_FIELD)
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
  std::vector<ExpertRef> experts;  // the expert table (empty for dense models)
  int32_t logits = -1;        // buffer holding the logits (width: the vocabulary) after the last op
  float norm_eps = 1e-5f;     // every RMSNorm: x / sqrt(mean(x^2) + eps) * (norm_offset + w)
  float norm_offset = 0.f;
};

}  // namespace cflow
