"""Compiled draws and updates of proportional priorities (``sampling/priorities.py`` holds the policy).

Invariant: ``draw_batch`` writes entry ``i < rand.size`` of ``slots``, ``g``, ``leaf``, ``weights``,
``valid`` and row ``i`` of ``obs_ids`` / ``next_ids``; ``apply_update`` validates every id and priority
before it writes anything, then writes ``raw``, ``shard_tick``, the tree at slots of ids in
``[oldest, head)`` only (``slot < ring_rows``, or ``< head`` when unbounded: ``Priorities`` sizes its
arrays to the ring). ``leaf_values`` writes ``out[i]`` for ``i < raw.size``.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native.ring import stack_frames_into
from mmreplay._native.sumtree import find_one, refresh_parents, set_leaf
from mmreplay._native import intrinsics, kernel_cache, ring, sumtree

kernel_cache.follow(__file__, ring, sumtree, intrinsics)  # kernels of these are inlined


# -- one pass each over the batch (see index/sumtree.py for why numba) ---------------------------------


@numba.njit(cache=True, nogil=True, inline="always")
def _leaf(raw32, alpha, eps):  # pragma: no cover (compiled)
    return (np.float64(raw32) + eps) ** alpha


@numba.njit(cache=True, nogil=True)
def leaf_values(raw, alpha, eps, out):  # pragma: no cover (compiled)
    for i in range(raw.size):
        out[i] = _leaf(raw[i], alpha, eps)


@numba.njit(cache=True, nogil=True)
def draw_batch(sums, offsets, b, n_leaves, rand, head, oldest, ring_rows, smallest, minus_beta, obs_frame,
                next_frame, prev_delta, frame_head, k, slots, g, leaf, weights, obs_ids, next_ids,
                valid):  # pragma: no cover (compiled)
    """Draw ``i`` lands in the ``i``-th of ``rand.size`` equal slices of the total mass; slot -> global id
    is the newest id in the ring living in that slot; weight = (leaf / smallest leaf) ** -beta; then the
    frame stacks (``TransitionRing.stack_frames``). Returns how many draws are unusable: an empty leaf
    (float rounding) or a stack reaching below ``oldest``."""
    n = rand.size
    width = sums[sums.size - 1] / n
    for i in range(n):
        slot = find_one(sums, offsets, b, n_leaves, (i + rand[i]) * width)
        slots[i] = slot
        leaf[i] = sums[slot]
        weights[i] = (leaf[i] / smallest) ** minus_beta
        g[i] = head - 1 - (head - 1 - slot) % ring_rows if ring_rows else slot
    stack_frames_into(g, k, obs_frame, next_frame, prev_delta, ring_rows, oldest, head, frame_head, obs_ids,
                      next_ids, valid)
    bad = 0
    for i in range(n):
        if leaf[i] <= 0 or not valid[i]:
            bad += 1
    return bad


@numba.njit(cache=True, nogil=True)
def apply_update(g, p, oldest, head, ring_rows, shard_rows, tick, alpha, eps, raw, shard_tick, drawable, sums,
                  mins, offsets, b):  # pragma: no cover (compiled)
    """Validate everything first (-1: an id never added, -2: a priority < 0 or not finite; nothing
    changed), then set each kept id's raw priority and, if drawable, its leaf. Returns (updated, max)."""
    for i in range(g.size):
        if g[i] < 0 or g[i] >= head:
            return -1, 0.0
        if not (p[i] >= 0.0 and p[i] < np.inf):
            return -2, 0.0
    slots = np.empty(g.size, dtype=np.int64)
    n = 0
    top = 0.0
    for i in range(g.size):
        if g[i] < oldest:
            continue  # given up since it was sampled
        slot = g[i] % ring_rows if ring_rows else g[i]
        raw[slot] = p[i]
        shard_tick[slot // shard_rows] = tick
        if drawable[slot]:  # stacks that reach below oldest stay out of the tree
            set_leaf(sums, mins, slot, _leaf(raw[slot], alpha, eps))
        top = max(top, np.float64(raw[slot]))
        slots[n] = slot
        n += 1
    refresh_parents(sums, mins, offsets, b, slots[:n])
    return n, top
