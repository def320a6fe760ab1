"""Qwen 2 / 2.5: the llama decoder with biases on Q, K and V."""

from cflow.models.base import Architecture

ARCH = Architecture(name="qwen2", summary="Qwen 2, Qwen 2.5: QKV bias", hf_model_types=("qwen2",),
                    gguf_archs=("qwen2",), fixed=dict(qkv_bias=True))
