"""Compiled reduction over a drawn batch.

Invariant: ``_lowest_read`` reads its three arrays and writes nothing; it reads their first entries
unchecked, so its entry point ``lowest_read`` refuses empty ones.
"""

from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True)
def _lowest_read(g, obs_ids, next_ids):  # pragma: no cover (compiled)
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


def lowest_read(g, obs_ids, next_ids) -> tuple[int, int]:
    """``(g.min(), min(obs_ids.min(), next_ids.min()))`` in one pass (``_lowest_read``), for non-empty
    arrays."""
    if g.size == 0 or obs_ids.size == 0 or next_ids.size == 0:
        raise ValueError(f"lowest_read of an empty batch: {g.size} ids, stacks of shapes {obs_ids.shape} "
                         f"and {next_ids.shape}")
    return _lowest_read(g, obs_ids, next_ids)
