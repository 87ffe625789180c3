"""A wide sum/min tree over non-negative leaf values: proportional draws in O(log_b n) numpy steps.

Invariants:
- ``sums[0]`` are the leaves (padded with zeros to a multiple of ``branching``); every node of level
  ``l + 1`` holds the exact float64 sum of its ``branching`` children in level ``l``, recomputed from
  the children on each update (never by adding deltas, so no drift accumulates over millions of updates).
- ``mins`` mirrors ``sums`` with the minimum over *positive* leaves (``inf`` where a subtree has none),
  so the smallest priority among the drawable leaves is one lookup.
- ``find(u)`` for ``0 <= u < total`` returns the leaf whose cumulative interval contains ``u``; a leaf of
  value 0 is never the answer except through float rounding at an interval's end, which callers detect
  (the returned leaf's value is 0) and redraw.

Why wide: a binary tree needs ~20 levels for a million leaves, each a handful of numpy calls on the
whole batch; with 32 children a level, 4 levels do, and each level is one gather of a (batch, 32)
block plus a cumulative sum, which numpy does in one pass.
"""

from __future__ import annotations

import numpy as np

DEFAULT_BRANCHING = 32


class SumTree:
    def __init__(self, n_leaves: int, branching: int = DEFAULT_BRANCHING):
        if n_leaves < 1:
            raise ValueError(f"a sum tree needs at least one leaf, got {n_leaves}")
        if branching < 2:
            raise ValueError(f"branching must be at least 2, got {branching}")
        self.n_leaves = int(n_leaves)
        self.b = int(branching)
        self.sums: list[np.ndarray] = []
        self.mins: list[np.ndarray] = []
        size = self.n_leaves
        while True:
            padded = -(-size // self.b) * self.b
            self.sums.append(np.zeros(padded))
            self.mins.append(np.full(padded, np.inf))
            if padded == self.b:
                break
            size = padded // self.b
        # the root: level len(sums) holds one node
        self.sums.append(np.zeros(1))
        self.mins.append(np.full(1, np.inf))

    # -- reading ----------------------------------------------------------------------------------
    @property
    def total(self) -> float:
        return float(self.sums[-1][0])

    @property
    def min_positive(self) -> float:
        """The smallest positive leaf value (``inf`` when every leaf is 0)."""
        return float(self.mins[-1][0])

    @property
    def leaves(self) -> np.ndarray:
        """The leaf values (a view: do not write to it; use ``update``)."""
        return self.sums[0][: self.n_leaves]

    def find(self, u: np.ndarray) -> np.ndarray:
        """Leaf indices whose cumulative intervals contain ``u`` (float64, each in ``[0, total)``)."""
        u = np.array(u, dtype=np.float64)
        node = np.zeros(u.shape, dtype=np.int64)
        b = self.b
        for level in range(len(self.sums) - 2, -1, -1):
            children = self.sums[level].reshape(-1, b)[node]  # (n, b)
            upto = np.cumsum(children, axis=1)
            j = np.minimum((upto <= u[:, None]).sum(axis=1), b - 1)
            u -= np.where(j > 0, upto[np.arange(j.size), j - 1], 0.0)
            node = node * b + j
        return np.minimum(node, self.n_leaves - 1)

    # -- writing ----------------------------------------------------------------------------------
    def update(self, leaves: np.ndarray, values: np.ndarray) -> None:
        """Set ``leaves`` to ``values`` (non-negative, finite; for repeated leaves the last one wins)."""
        leaves = np.asarray(leaves, dtype=np.int64).reshape(-1)
        if leaves.size == 0:
            return
        if leaves.size * 4 >= self.n_leaves:  # cheaper to recompute every level than to dedupe parents
            self.sums[0][leaves] = values
            self.rebuild()
            return
        self.sums[0][leaves] = values
        self.mins[0][leaves] = np.where(self.sums[0][leaves] > 0, self.sums[0][leaves], np.inf)
        nodes = leaves // self.b  # repeated parents just get the same sum written twice: cheaper than unique
        for level in range(1, len(self.sums)):
            b = self.b
            self.sums[level][nodes] = self.sums[level - 1].reshape(-1, b)[nodes].sum(axis=1)
            self.mins[level][nodes] = self.mins[level - 1].reshape(-1, b)[nodes].min(axis=1)
            nodes = nodes // b

    def set_all(self, values: np.ndarray) -> None:
        """Replace every leaf (``values`` has ``n_leaves`` entries)."""
        self.sums[0][: self.n_leaves] = values
        self.sums[0][self.n_leaves:] = 0
        self.rebuild()

    def rebuild(self) -> None:
        """Recompute every inner node from the leaves."""
        leaves = self.sums[0]
        self.mins[0][...] = np.where(leaves > 0, leaves, np.inf)
        for level in range(1, len(self.sums)):
            b = self.b
            below_sums, below_mins = self.sums[level - 1], self.mins[level - 1]
            self.sums[level][...] = 0
            self.mins[level][...] = np.inf
            n = below_sums.size // b
            self.sums[level][:n] = below_sums.reshape(-1, b).sum(axis=1)
            self.mins[level][:n] = below_mins.reshape(-1, b).min(axis=1)
