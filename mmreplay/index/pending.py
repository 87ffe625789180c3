"""Single adds gathered into one block, so the index and frame rings work on arrays, not scalars.

Invariant: rows ``[0, n)`` hold validated transitions in the order they were added; they are appended
to the store (``Store._drain``) before anything reads the store, flushes or adds by another path, so
no reader can tell that a transition waited here. A crash loses them, like any uncommitted add.
"""

from __future__ import annotations

import numpy as np

from mmreplay.columns.spec import Schema

BLOCK_BYTES = 2 << 20


class PendingBlock:
    """Single adds gathered in RAM until a block is full or something reads the store (module invariant)."""

    def __init__(self, schema: Schema, max_rows: int):
        row_bytes = 2 * sum(max(1, c.row_nbytes) for c in schema.observations)
        self.capacity = int(min(max_rows, np.clip(BLOCK_BYTES // row_bytes, 32, 1024)))
        cap = self.capacity
        self.obs = {c.name: np.empty((cap, *c.shape), dtype=c.np_dtype) for c in schema.observations}
        self.next_obs = {c.name: np.empty((cap, *c.shape), dtype=c.np_dtype) for c in schema.observations}
        self.codes = {c.name: np.empty((cap, *c.shape), dtype=np.uint8 if c.kind == "packed" else c.np_dtype)
                      for c in schema.transition_columns}
        self.terminated = np.empty(cap, dtype=np.uint8)
        self.truncated = np.empty(cap, dtype=np.uint8)
        self.streams = np.empty(cap, dtype=np.int64)
        self.n = 0

    @property
    def full(self) -> bool:
        return self.n == self.capacity

    def put(self, streams, obs, next_obs, codes, terminated, truncated) -> None:
        """Copy ``len(streams)`` validated rows in (the caller made room)."""
        lo, hi = self.n, self.n + len(streams)
        for k, v in obs.items():
            self.obs[k][lo:hi] = v
        for k, v in next_obs.items():
            self.next_obs[k][lo:hi] = v
        for k, v in codes.items():
            self.codes[k][lo:hi] = v
        self.terminated[lo:hi] = terminated
        self.truncated[lo:hi] = truncated
        self.streams[lo:hi] = streams
        self.n = hi

    def rows(self):
        n = self.n
        return (self.streams[:n], {k: v[:n] for k, v in self.obs.items()},
                {k: v[:n] for k, v in self.next_obs.items()}, {k: v[:n] for k, v in self.codes.items()},
                self.terminated[:n], self.truncated[:n], n)
