"""cflow: CPU-first LLM inference on a tile-native weight format, and pipeline-native transformers.

Layers of the package (each a folder or module):
  config.py      ModelConfig, the single source of truth shared by torch model, exporter,
                 file header, engine plan and bandwidth analysis.
  format/        the .cflow tile format: quantized blocks, tile packing, writer, reader.
  _core          the native C++ core (kernels, thread pool, decode engine).
  commands/      one module per CLI verb; cli.py dispatches.
  convert/, engine_ref.py, tokenizer.py, sampling.py, generate.py, llm.py, hub.py
                 running existing models (docs/MODELS.md); cflow.LLM is the Python API.
"""

__version__ = "0.1.0"

from cflow.errors import CflowError, CflowFormatError  # noqa: E402


def __getattr__(name):  # cflow.LLM without importing the generation stack on `import cflow`
    if name == "LLM":
        from cflow.llm import LLM

        return LLM
    raise AttributeError(f"module 'cflow' has no attribute {name!r}")


__all__ = ["CflowError", "CflowFormatError", "LLM", "__version__"]
