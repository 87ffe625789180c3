"""Compiled draws and updates of proportional priorities (``sampling/priorities.py`` holds the policy).

Invariant: ``_draw_batch`` writes entry ``i < rand.size`` of ``slots``, ``g``, ``leaf``, ``weights``,
``valid`` and row ``i`` of ``obs_ids`` / ``next_ids``; ``_apply_update`` validates every id and priority
before it writes anything, then writes ``raw``, ``shard_tick``, the tree at slots of ids in
``[oldest, head)`` only (``slot < ring_rows``, or ``< head`` when unbounded). ``_leaf_values`` writes
``out[i]`` for ``i < raw.size``. Their entry points (the same names without the underscore) check that
every array they write holds those entries before the call.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native.bounds import check_array
from mmreplay._native.ring import stack_frames_into
from mmreplay._native.sumtree import find_one, refresh_parents, set_leaf
from mmreplay._native import intrinsics, kernel_cache, ring, sumtree

kernel_cache.follow(__file__, ring, sumtree, intrinsics)  # kernels of these are inlined


# -- one pass each over the batch (see index/sumtree.py for why numba) ---------------------------------


@numba.njit(cache=True, nogil=True, inline="always")
def _leaf(raw32, alpha, eps):  # pragma: no cover (compiled)
    return (np.float64(raw32) + eps) ** alpha


@numba.njit(cache=True, nogil=True)
def _leaf_values(raw, alpha, eps, out):  # pragma: no cover (compiled)
    for i in range(raw.size):
        out[i] = _leaf(raw[i], alpha, eps)


@numba.njit(cache=True, nogil=True)
def _draw_batch(sums, offsets, b, n_leaves, rand, head, oldest, ring_rows, smallest, minus_beta, obs_frame,
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
def _apply_update(g, p, oldest, head, ring_rows, shard_rows, tick, alpha, eps, raw, shard_tick, drawable, sums,
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


def leaf_values(raw, alpha, eps, out) -> None:
    """``out[i] = (raw[i] + eps) ** alpha`` (``_leaf_values``), ``out`` checked first."""
    check_array("out", out, np.float64, ndim=1, min_size=raw.size)
    _leaf_values(raw, alpha, eps, out)


NOT_CHECKED = -2  # ``_draw_batch_checked``'s answer when an output is too small: nothing was drawn
_I64, _F64 = np.dtype(np.int64), np.dtype(np.float64)


@numba.njit(cache=True, nogil=True)
def _draw_batch_checked(sums, offsets, b, n_leaves, rand, head, oldest, ring_rows, smallest, minus_beta, obs_frame,
                        next_frame, prev_delta, frame_head, k, slots, g, leaf, weights, obs_ids, next_ids,
                        valid):  # pragma: no cover (compiled)
    """``_draw_batch`` if the outputs are C-contiguous and hold ``rand.size`` draws of ``k``-frame stacks and
    the ring columns are as long as each other (``draw_batch``'s checks), else ``NOT_CHECKED``."""
    n = rand.size
    if not (slots.flags.c_contiguous and slots.size >= n and g.flags.c_contiguous and g.size >= n
            and leaf.flags.c_contiguous and leaf.size >= n and weights.flags.c_contiguous and weights.size >= n
            and valid.flags.c_contiguous and valid.size >= n and obs_ids.flags.c_contiguous
            and next_ids.flags.c_contiguous and obs_ids.shape[0] >= n and next_ids.shape[0] >= n
            and obs_ids.shape[1] == k and next_ids.shape[1] == k and next_frame.size >= obs_frame.size
            and prev_delta.size >= obs_frame.size):
        return NOT_CHECKED
    return _draw_batch(sums, offsets, b, n_leaves, rand, head, oldest, ring_rows, smallest, minus_beta, obs_frame,
                       next_frame, prev_delta, frame_head, k, slots, g, leaf, weights, obs_ids, next_ids, valid)


def draw_batch(sums, offsets, b, n_leaves, rand, head, oldest, ring_rows, smallest, minus_beta, obs_frame,
               next_frame, prev_delta, frame_head, k, slots, g, leaf, weights, obs_ids, next_ids, valid) -> int:
    """``_draw_batch`` after checking its outputs hold ``rand.size`` draws of ``k``-frame stacks and the
    ring columns are as long as each other; returns the number of unusable draws. The types are tested
    here in one expression, the sizes inside the compiled call (this runs every batch); a fault is named
    by the checks below."""
    if (type(slots) is type(g) is type(leaf) is type(weights) is type(valid) is type(obs_ids) is type(next_ids)
            is np.ndarray and slots.dtype == _I64 and g.dtype == _I64 and leaf.dtype == _F64 and weights.dtype == _F64
            and valid.dtype == np.bool_ and obs_ids.dtype == _I64 and next_ids.dtype == _I64
            and slots.ndim == g.ndim == leaf.ndim == weights.ndim == valid.ndim == 1
            and obs_ids.ndim == next_ids.ndim == 2):
        bad = _draw_batch_checked(sums, offsets, b, n_leaves, rand, head, oldest, ring_rows, smallest, minus_beta,
                                  obs_frame, next_frame, prev_delta, frame_head, k, slots, g, leaf, weights, obs_ids,
                                  next_ids, valid)
        if bad != NOT_CHECKED:
            return bad
    n = rand.size
    for name, out, dtype in (("slots", slots, np.int64), ("g", g, np.int64), ("leaf", leaf, np.float64),
                             ("weights", weights, np.float64), ("valid", valid, np.bool_)):
        check_array(name, out, dtype, ndim=1, min_size=n)
    for name, out in (("obs_ids", obs_ids), ("next_ids", next_ids)):
        check_array(name, out, np.int64, shape=(None, k))
        if out.shape[0] < n:
            raise ValueError(f"{name} has {out.shape[0]} rows for {n} draws")
    if next_frame.size < obs_frame.size or prev_delta.size < obs_frame.size:
        raise ValueError(f"ring columns of {obs_frame.size}, {next_frame.size} and {prev_delta.size} rows "
                         "(obs_frame, next_frame, prev_delta must be as long)")
    return _draw_batch(sums, offsets, b, n_leaves, rand, head, oldest, ring_rows, smallest, minus_beta, obs_frame,
                       next_frame, prev_delta, frame_head, k, slots, g, leaf, weights, obs_ids, next_ids, valid)


def apply_update(g, p, oldest, head, ring_rows, shard_rows, tick, alpha, eps, raw, shard_tick, drawable, sums,
                 mins, offsets, b) -> tuple[int, float]:
    """``_apply_update`` after checking that every slot an id in ``[oldest, head)`` maps to has an entry
    in ``raw``, ``drawable``, ``shard_tick`` and the tree's leaves; returns ``(updated, max)`` (negative
    ``updated``: see ``_apply_update``)."""
    if p.size < g.size:
        raise ValueError(f"{p.size} priorities for {g.size} ids")
    slots = ring_rows if ring_rows else head  # the slots ids below head map to
    shards = -(-slots // shard_rows) if shard_rows > 0 else -1
    if shards < 0 or raw.size < slots or drawable.size < slots or shard_tick.size < shards or \
            offsets.size < 2 or offsets[1] < slots or sums.size != mins.size:
        raise ValueError(f"priority arrays too small for {slots} slots: raw {raw.size}, drawable {drawable.size}, "
                         f"shard ticks {shard_tick.size} (shards of {shard_rows}), tree leaves "
                         f"{int(offsets[1]) if offsets.size > 1 else 0}")
    return _apply_update(g, p, oldest, head, ring_rows, shard_rows, tick, alpha, eps, raw, shard_tick, drawable,
                         sums, mins, offsets, b)
