"""A wide sum/min tree over non-negative leaf values: proportional draws in O(log_b n).

Invariants:
- Levels are stored in one flat float64 array, leaves first (level 0, padded with zeros to a multiple
  of ``branching``), the root last. Every node of level ``l + 1`` holds the exact sum of its
  ``branching`` children in level ``l``, recomputed from the children on each update (never by adding
  deltas, so no drift accumulates over millions of updates).
- ``mins`` mirrors ``sums`` with the minimum over *positive* leaves (``inf`` where a subtree has none),
  so the smallest priority among the drawable leaves is one lookup.
- ``find(u)`` for ``0 <= u < total`` returns the leaf whose cumulative interval contains ``u``; a leaf of
  value 0 is never the answer except through float rounding at an interval's end, which callers detect
  (the returned leaf's value is 0) and redraw.

Why numba: the tree is walked once per sampled transition, a few dozen scalar steps each. As numpy
calls over the batch (one gather + cumsum per level) that cost 50 us a batch-32 draw and as much an
update, several times cpprb's whole C++ sample; compiled, both take a few microseconds. Why wide: 32
children per node keep a million leaves four levels deep, and each node's children in one cache line
run.
"""

from __future__ import annotations

import numpy as np

from mmreplay._native import sumtree as kernels
from mmreplay._native.bounds import check_indices

DEFAULT_BRANCHING = 32


class SumTree:
    """Sums and positive minima over ``n_leaves`` non-negative values, ``branching`` children a node."""

    def __init__(self, n_leaves: int, branching: int = DEFAULT_BRANCHING):
        if n_leaves < 1:
            raise ValueError(f"a sum tree needs at least one leaf, got {n_leaves}")
        if branching < 2:
            raise ValueError(f"branching must be at least 2, got {branching}")
        self.n_leaves = int(n_leaves)
        self.b = int(branching)
        sizes = []
        size = self.n_leaves
        while True:
            padded = -(-size // self.b) * self.b
            sizes.append(padded)
            if padded == self.b:
                break
            size = padded // self.b
        sizes.append(1)  # the root
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # level l: [off[l], off[l+1])
        self.sums = np.zeros(int(self.offsets[-1]))
        self.mins = np.full(int(self.offsets[-1]), np.inf)

    # -- reading ----------------------------------------------------------------------------------
    @property
    def total(self) -> float:
        return float(self.sums[-1])

    @property
    def min_positive(self) -> float:
        """The smallest positive leaf value (``inf`` when every leaf is 0)."""
        return float(self.mins[-1])

    @property
    def leaves(self) -> np.ndarray:
        """The leaf values (a view: do not write to it; use ``update``)."""
        return self.sums[: self.n_leaves]

    def find(self, u: np.ndarray) -> np.ndarray:
        """Leaf indices whose cumulative intervals contain ``u`` (each in ``[0, total)``)."""
        u = np.ascontiguousarray(u, dtype=np.float64).reshape(-1)
        out = np.empty(u.size, dtype=np.int64)
        kernels.find(self.sums, self.offsets, self.b, self.n_leaves, u, out)
        return out

    # -- writing ----------------------------------------------------------------------------------
    def update(self, leaves: np.ndarray, values) -> None:
        """Set ``leaves`` to ``values`` (non-negative, finite; for repeated leaves the last one wins)."""
        leaves = np.ascontiguousarray(leaves, dtype=np.int64).reshape(-1)
        if leaves.size == 0:
            return
        values = np.ascontiguousarray(np.broadcast_to(np.asarray(values, dtype=np.float64), leaves.shape))
        if leaves.size * 4 >= self.n_leaves:  # cheaper to recompute every level once
            check_indices("leaves", leaves, 0, self.n_leaves)  # numpy would wrap a negative leaf onto the root
            self.sums[leaves] = values
            self.rebuild()
            return
        kernels.update(self.sums, self.mins, self.offsets, self.b, self.n_leaves, leaves, values)

    def set_all(self, values: np.ndarray) -> None:
        """Replace every leaf (``values`` has ``n_leaves`` entries)."""
        self.sums[: self.n_leaves] = values
        self.sums[self.n_leaves: self.offsets[1]] = 0
        self.rebuild()

    def rebuild(self) -> None:
        """Recompute every inner node from the leaves."""
        off, b = self.offsets, self.b
        leaves = self.sums[: off[1]]
        self.mins[: off[1]] = np.where(leaves > 0, leaves, np.inf)
        for level in range(1, off.size - 1):
            below = slice(off[level - 1], off[level])
            n = (off[level] - off[level - 1]) // b
            here = slice(off[level], off[level + 1])
            self.sums[here] = 0
            self.mins[here] = np.inf
            self.sums[off[level]: off[level] + n] = self.sums[below].reshape(-1, b).sum(axis=1)
            self.mins[off[level]: off[level] + n] = self.mins[below].reshape(-1, b).min(axis=1)
