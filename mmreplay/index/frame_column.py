"""One observation key of the frame ring: its on-disk array and the RAM block of the shard being filled.

Invariant: ``staging`` holds ``shard_rows`` rows of the column's shape and dtype (heap memory, or a shared
segment of the encoder child: ``index/encoder_pipe.py``), and ``layout`` / ``array`` describe the files of
every other shard; the column never decides which shard is staging (``FrameRing`` does).
"""

from __future__ import annotations

import numpy as np

from mmreplay.columns.spec import ColumnSpec
from mmreplay.storage.format.layout import frame_layout
from mmreplay.storage.format.sharded import ShardedArray


class FrameColumn:
    """One observation key: its on-disk array and staging block."""

    def __init__(self, root: str, spec: ColumnSpec, rows: int, shard_rows: int):
        self.spec = spec
        self.row_nbytes = spec.row_nbytes  # a property that costs microseconds: read per batch
        self.layout = frame_layout(spec, rows, shard_rows)
        self.array = ShardedArray(root, self.layout)
        self.staging = heap_buffer(spec, shard_rows)


def heap_buffer(spec: ColumnSpec, shard_rows: int) -> np.ndarray:
    """A shard's rows of ``spec``, zeroed, in this process's heap (no encoder child to share them with)."""
    return np.zeros((shard_rows, *spec.shape), dtype=spec.np_dtype)
