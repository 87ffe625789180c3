"""Compiled walks and updates of a wide sum/min tree (``index/sumtree.py``'s ``SumTree`` holds the layout).

Invariant: given the tree's own ``sums``, ``mins`` and ``offsets``, ``_find`` writes ``out[i]`` for
``i < u.size`` and every leaf it returns is ``< n_leaves``; ``_update`` / ``set_leaf`` / ``refresh_parents``
write only leaves they are given and their ancestors. The entry points ``find`` and ``update`` check the
output's size and that every leaf is in ``[0, n_leaves)`` first; the other kernels are called from kernels
that checked their leaves (``_native/priorities.py``).
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native.bounds import check_array, check_indices


@numba.njit(cache=True, nogil=True)
def _find(sums, offsets, b, n_leaves, u, out):  # pragma: no cover (compiled)
    for i in range(u.size):
        out[i] = find_one(sums, offsets, b, n_leaves, u[i])


@numba.njit(cache=True, nogil=True)
def _update(sums, mins, offsets, b, leaves, values):  # pragma: no cover (compiled)
    for i in range(leaves.size):  # every leaf first, so repeated parents are recomputed from final values
        set_leaf(sums, mins, leaves[i], values[i])
    refresh_parents(sums, mins, offsets, b, leaves)


@numba.njit(cache=True, nogil=True, inline="always")
def set_leaf(sums, mins, leaf, value):  # pragma: no cover (compiled)
    sums[leaf] = value
    mins[leaf] = value if value > 0 else np.inf


@numba.njit(cache=True, nogil=True)
def refresh_parents(sums, mins, offsets, b, leaves):  # pragma: no cover (compiled)
    """Recompute every ancestor of ``leaves`` from its children (after the leaves were set)."""
    top = offsets.size - 2
    for i in range(leaves.size):
        node = leaves[i]
        for level in range(top):
            parent = node // b
            start = offsets[level] + parent * b
            s = 0.0
            m = np.inf
            for c in range(b):
                s += sums[start + c]
                if mins[start + c] < m:
                    m = mins[start + c]
            sums[offsets[level + 1] + parent] = s
            mins[offsets[level + 1] + parent] = m
            node = parent


@numba.njit(cache=True, nogil=True)
def find_one(sums, offsets, b, n_leaves, x):  # pragma: no cover (compiled)
    """The leaf whose cumulative interval contains ``x``."""
    node = 0
    for level in range(offsets.size - 3, -1, -1):
        start = offsets[level] + node * b
        j = 0
        while j < b - 1 and x >= sums[start + j]:
            x -= sums[start + j]
            j += 1
        node = node * b + j
    return min(node, n_leaves - 1)


def _check_tree(sums, mins, offsets, n_leaves) -> None:
    if offsets.size < 3 or sums.size != offsets[-1] or mins.size != sums.size or not 0 < n_leaves <= offsets[1]:
        raise ValueError(f"not a sum tree: {sums.size} sums, {mins.size} minima, level offsets "
                         f"{offsets.tolist()[:8]}, {n_leaves} leaves")


def find(sums, offsets, b, n_leaves, u, out) -> None:
    """``out[i]`` = the leaf whose cumulative interval holds ``u[i]`` (``_find``), ``out`` checked first."""
    _check_tree(sums, sums, offsets, n_leaves)
    check_array("out", out, np.int64, ndim=1, min_size=u.size)
    _find(sums, offsets, b, n_leaves, u, out)


def update(sums, mins, offsets, b, n_leaves, leaves, values) -> None:
    """Set ``leaves`` to ``values`` and refresh their ancestors (``_update``), after checking every leaf
    is in ``[0, n_leaves)`` and there is a value for each."""
    _check_tree(sums, mins, offsets, n_leaves)
    if values.size < leaves.size:
        raise ValueError(f"{values.size} values for {leaves.size} leaves")
    check_indices("leaves", leaves, 0, n_leaves)
    _update(sums, mins, offsets, b, leaves, values)
