"""Compiled reduction over a drawn batch.

Invariant: ``lowest_read`` reads its three arrays and writes nothing.
"""

from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True)
def lowest_read(g, obs_ids, next_ids):  # pragma: no cover (compiled)
    """``(g.min(), min(obs_ids.min(), next_ids.min()))``: the oldest transition and frame a batch read
    (what a reader checks against the newest commit), in one pass instead of three reductions."""
    low_g = g[0]
    for i in range(1, g.size):
        low_g = min(low_g, g[i])
    low_f = obs_ids[0, 0]
    for i in range(obs_ids.shape[0]):
        for j in range(obs_ids.shape[1]):
            low_f = min(low_f, obs_ids[i, j])
    for i in range(next_ids.shape[0]):
        for j in range(next_ids.shape[1]):
            low_f = min(low_f, next_ids[i, j])
    return low_g, low_f
