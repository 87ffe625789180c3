"""Assemble: batch tensors (stacks, next observations, sequences) as one gather over a decoded frame table.

Invariant: ``gather_rows(table, index)`` is ``table[index]`` shaped ``index.shape + table.shape[1:]`` on
``table``'s device: every output position is one table row, copied once. The distributed frames wire rebuilds
its learner's stacks with the same function (``distributed/learner_wire.py``: ``rebuild_torch``).

Padding is a row of the table, not a mask: ``table_index`` points every position the CPU path zeroes (a stack
position before its episode's first frame with ``stack_padding="zeros"``; a sequence step past a window's end)
at one all-zero row appended to the table, so the batch is a plain gather whatever the padding.
"""

from __future__ import annotations

import numpy as np


def gather_rows(table, index, out=None):
    """``table[index]`` (torch; ``index`` a numpy or torch integer array of any shape) on ``table``'s device;
    into ``out`` (a tensor of that shape and dtype) when given."""
    import torch

    shape = (*tuple(index.shape), *table.shape[1:])
    if table.device.type == "cpu" and isinstance(index, np.ndarray):  # numpy's take copies rows ~10x faster here
        rows = table.numpy()
        if out is None:
            return torch.from_numpy(np.take(rows, index.reshape(-1), axis=0).reshape(shape))
        np.take(rows, index.reshape(-1), axis=0, out=out.numpy().reshape(index.size, *rows.shape[1:]))
        return out
    flat = torch.as_tensor(index, device=table.device).reshape(-1).long()
    if out is None:
        return torch.index_select(table, 0, flat).reshape(shape)
    torch.index_select(table, 0, flat, out=out.view(flat.numel(), *table.shape[1:]))
    return out


def padding_positions(frame_ids: np.ndarray) -> np.ndarray:
    """Where a stack (last axis) holds padding before its episode's first frame: a frame id equal to the next
    position's (within an episode every position has its own frame; ``sampling/batch.py``'s rule)."""
    pad = np.zeros(frame_ids.shape, dtype=bool)
    pad[..., :-1] = frame_ids[..., :-1] == frame_ids[..., 1:]
    return pad


def table_index(row_of_id, frame_ids: np.ndarray, zero_row: int, zero: np.ndarray | None) -> np.ndarray:
    """Table rows of ``frame_ids`` (``row_of_id`` maps ids to rows), ``zero_row`` where ``zero`` is set."""
    rows = row_of_id(frame_ids)
    if zero is not None and zero.any():
        rows = np.where(zero, zero_row, rows)
    return rows
