"""Qwen 3 (dense): the llama decoder with an RMSNorm over each head of q and k."""

from cflow.models.base import Architecture

ARCH = Architecture(name="qwen3", summary="Qwen 3 (dense): QK-norm", hf_model_types=("qwen3",),
                    gguf_archs=("qwen3",), fixed=dict(qk_norm=True))
