"""cflow: CPU-first LLM inference on a tile-native weight format, and pipeline-native transformers.

Layers of the package (each a folder or module):
  config.py      ModelConfig, the single source of truth shared by torch model, exporter,
                 file header, engine plan and bandwidth analysis.
  format/        the .cflow tile format: quantized blocks, tile packing, writer, reader.
  _core          the native C++ core (kernels, thread pool, decode engine).
  commands/      one module per CLI verb; cli.py dispatches.
"""

__version__ = "0.1.0"

from cflow.errors import CflowError, CflowFormatError  # noqa: E402

__all__ = ["CflowError", "CflowFormatError", "__version__"]
