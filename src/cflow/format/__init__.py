"""The .cflow tile-native weight format (docs/FORMAT.md).

CflowWriter writes one (atomically), CflowFile maps and checks one; spec holds the byte layout.
"""

from cflow.format.reader import CflowFile
from cflow.format.spec import Expert, Section, Tensor, fuse_rows, unfuse_rows
from cflow.format.writer import CflowWriter, decode_order

__all__ = ["CflowFile", "CflowWriter", "Expert", "Section", "Tensor", "decode_order", "fuse_rows", "unfuse_rows"]
