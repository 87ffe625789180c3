"""The uniform draw of transitions from the index ring, and what a reader checks after a batch.

Invariants:
- ``draw_uniform`` returns only valid transitions (in ``[oldest, head)`` with their whole frame stack),
  each drawn uniformly over the valid ones: invalid draws are redrawn (rejection), never shifted.
- ``lowest_read`` is the oldest transition and frame a batch read (checked against the newest commit).
"""

from __future__ import annotations

import numpy as np

from mmreplay.index.ring import TransitionRing

MAX_REDRAWS = 1000


def check_batch_size(ring: TransitionRing, frame_stack: int, frame_head: int, batch_size: int) -> int:
    """The number of valid transitions, if a batch of ``batch_size`` can be drawn from them."""
    n_valid = ring.count_valid(frame_stack, frame_head)
    if n_valid == 0:
        raise ValueError("cannot sample from an empty store (no valid transitions yet)")
    if batch_size > n_valid:
        raise ValueError(f"batch_size {batch_size} is larger than the store ({n_valid} valid transitions); "
                         "wait until it holds at least one batch")
    return n_valid


def draw_uniform(ring: TransitionRing, frame_stack: int, frame_head: int, batch_size: int,
                 rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``batch_size`` valid transition ids drawn uniformly, with their obs / next-obs frame stacks."""
    check_batch_size(ring, frame_stack, frame_head, batch_size)
    lo, hi = ring.oldest, ring.head
    g = rng.integers(lo, hi, size=batch_size)  # the same draws as lo + integers(0, hi - lo), a call cheaper
    obs_ids, next_ids, valid = ring.stack_frames(g, frame_stack, frame_head)
    for _ in range(MAX_REDRAWS):  # rejection keeps the draw uniform over valid transitions
        if valid.all():
            return g, obs_ids, next_ids
        bad = np.flatnonzero(~valid)
        g[bad] = rng.integers(lo, hi, size=bad.size)
        o, nx, v = ring.stack_frames(g[bad], frame_stack, frame_head)
        obs_ids[bad], next_ids[bad], valid[bad] = o, nx, v
    raise RuntimeError("could not draw valid transitions (index inconsistent?)")
