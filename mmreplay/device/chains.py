"""Rebuild: the temporal codec's delta chains, with torch ops on the device that holds the decoded residuals.

Invariant: after ``rebuild_chains(table, refs, depth)`` every row ``r`` with ``refs[r] >= 0`` holds its
residual plus row ``refs[r]``'s rebuilt bytes, modulo 256 (what the encoder subtracted: ``codecs/temporal.py``);
rows are rebuilt one chain depth at a time, so a row's reference is always complete before it is added. A
row decoded as it is (``refs[r] < 0``) is not touched. ``depth`` comes from ``staging.chain_depths``.

Cost: one ``index_select`` + add + ``index_copy_`` per depth on a device (numpy's row gathers on the CPU); a run
of 16 frames with its key in the middle has chains of at most 8, whatever the batch size.
"""

from __future__ import annotations

import numpy as np


def rebuild_chains(table, refs: np.ndarray, depth: np.ndarray) -> None:
    """Add each row's reference into it, in place (``table``: ``(rows, row_nbytes)`` uint8 on any device)."""
    import torch

    if not refs.size or int(depth.max(initial=0)) == 0:
        return
    if table.device.type == "cpu":  # numpy's row gathers are several times faster than torch's on the CPU
        rows_np = table.numpy()
        for d in range(1, int(depth.max()) + 1):
            rows = np.flatnonzero(depth == d)
            rows_np[rows] += rows_np[refs[rows]]  # uint8: modulo 256
        return
    for d in range(1, int(depth.max()) + 1):
        rows = np.flatnonzero(depth == d)
        at = torch.as_tensor(rows, device=table.device)
        ref = torch.as_tensor(refs[rows], device=table.device)
        # uint8 addition wraps modulo 256, as the encoder's subtraction did
        table.index_copy_(0, at, table.index_select(0, at) + table.index_select(0, ref))
