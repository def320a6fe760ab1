"""BitNet b1.58: the llama decoder with an RMSNorm before each of the two output projections
(attn_sub_norm on the attention output, ffn_sub_norm on act(gate) * up), trained for ternary
weights in {-1, 0, +1} times a scale (cflow convert --quant tq2_0 stores them losslessly).

Hugging Face: model_type "bitnet" (BitNetForCausalLM), the FFN's activation config.json's
hidden_act (relu2, squared ReLU, in Microsoft's checkpoints; silu in older ones). A checkpoint
whose quantization_config packs the weights (quant_method "bitnet") is refused with a clear
error: convert its unpacked (bf16) release instead.
GGUF: architecture "bitnet", as llama.cpp writes it from 1bitLLM's checkpoints: the FFN runs
SwiGLU (llama.cpp's graph), rope rotates halves (its converter does not permute Q and K), and
the output head is the embedding table. llama.cpp's optional per-tensor scales (*.scale) are
refused by the tensor check: files made by its converter carry none.
"""

from __future__ import annotations

from cflow.errors import UnsupportedError
from cflow.models.base import GGUF_NAMES, HF_NAMES, Architecture, gguf_common


class BitNet(Architecture):
    name = "bitnet"
    summary = "BitNet b1.58: ternary-trained llama with sub-norms before Wo and Wd (squared-ReLU or SwiGLU FFN)"
    hf_model_types = ("bitnet",)
    gguf_archs = ("bitnet",)
    hf_names = dict(HF_NAMES, **{
        "model.layers.{l}.self_attn.attn_sub_norm.weight": "blk.{l}.attn_sub_norm",
        "model.layers.{l}.mlp.ffn_sub_norm.weight": "blk.{l}.ffn_sub_norm",
    })
    gguf_names = dict(GGUF_NAMES, **{
        "blk.{l}.attn_sub_norm.weight": "blk.{l}.attn_sub_norm",
        "blk.{l}.ffn_sub_norm.weight": "blk.{l}.ffn_sub_norm",
    })
    fixed = dict(sub_norms=True)

    def hf_fields(self, c):
        q = c.get("quantization_config")
        if isinstance(q, dict) and q.get("quant_method") == "bitnet":
            raise UnsupportedError("this BitNet checkpoint stores packed ternary weights (quantization_config "
                                   "quant_method 'bitnet'); convert its unpacked bf16 release instead")
        return super().hf_fields(c)

    def gguf_fields(self, m):
        return dict(gguf_common(m), act="silu", tie_embeddings=True)


ARCH = BitNet()
