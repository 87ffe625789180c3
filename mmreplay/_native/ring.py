"""Compiled frame-stack walk of the index ring (``index/ring.py``).

Invariant: ``stack_frames_into`` reads ring rows only at slots ``< obs_frame.size`` (an id outside the
ring is reported invalid) and writes ``obs_ids[i, :k]``, ``next_ids[i, :k]`` and ``valid[i]`` for
``i < g.size``; its entry point ``stack_frames`` checks that
they have ``g.size`` rows of ``k``, that ``k >= 1`` and that the ring's columns cover ``ring_rows``.
``_prefetch_rows`` only asks for cache lines of rows inside the ring: it writes nothing.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native.bounds import check_array
from mmreplay._native.intrinsics import prefetch
from mmreplay._native import intrinsics, kernel_cache

kernel_cache.follow(__file__, intrinsics)  # the kernels inline it (see kernel_cache)


@numba.njit(cache=True, nogil=True)
def _prefetch_rows(g, ring_rows, obs_frame, next_frame, prev_delta):  # pragma: no cover (compiled)
    """Ask for the index rows of transitions ``g`` (and the line before, where a stack walks back) before
    they are read: random rows of a 1M ring are cache misses, and asked for all at once they overlap
    instead of being waited for one after the other (Atari batch-256: stack walk 55-73 -> 13-16 us)."""
    obs_at, next_at, prev_at = obs_frame.ctypes.data, next_frame.ctypes.data, prev_delta.ctypes.data
    for i in range(g.size):
        slot = g[i] % ring_rows if ring_rows else g[i]
        if 0 <= slot < obs_frame.size:
            prefetch(obs_at + slot * obs_frame.itemsize)
            prefetch(next_at + slot * next_frame.itemsize)
            prefetch(prev_at + slot * prev_delta.itemsize)
            back = max(slot - 8, 0)  # a stack of 4 reads up to 3 rows back: maybe the previous line
            prefetch(obs_at + back * obs_frame.itemsize)
            prefetch(prev_at + back * prev_delta.itemsize)


@numba.njit(cache=True, nogil=True)
def stack_frames_into(g, k, obs_frame, next_frame, prev_delta, ring_rows, oldest, head, frame_head,
                  obs_ids, next_ids, valid):  # pragma: no cover (compiled)
    """``stack_frames`` per transition: walk ``prev_delta`` back ``k - 1`` steps (staying put at an
    episode start), turning each 32-bit frame id into its global id (within 2**32 of ``frame_head``)."""
    _prefetch_rows(g, ring_rows, obs_frame, next_frame, prev_delta)
    head32 = np.uint32(frame_head & 0xFFFFFFFF)
    for i in range(g.size):
        cur = g[i]
        ok = oldest <= cur < head
        slot = cur % ring_rows if ring_rows else cur
        if not 0 <= slot < obs_frame.size:
            slot = 0  # an id outside the ring: reported invalid, any frame will do
            ok = False
        obs_ids[i, k - 1] = frame_head - np.int64(np.uint32(head32 - obs_frame[slot]))
        next_ids[i, k - 1] = frame_head - np.int64(np.uint32(head32 - next_frame[slot]))
        for j in range(1, k):
            delta = np.int64(prev_delta[slot])
            if delta > 0:
                prev = cur - delta
                if prev >= oldest:
                    cur = prev
                    slot = cur % ring_rows if ring_rows else cur
                else:
                    ok = False  # the stack needs a transition the ring gave up
            obs_ids[i, k - 1 - j] = frame_head - np.int64(np.uint32(head32 - obs_frame[slot]))
        for j in range(k - 1):
            next_ids[i, j] = obs_ids[i, j + 1]
        valid[i] = ok


@numba.njit(cache=True, nogil=True)
def _stack_frames_checked(g, k, obs_frame, next_frame, prev_delta, ring_rows, oldest, head, frame_head, obs_ids,
                          next_ids, valid):  # pragma: no cover (compiled)
    """``stack_frames_into`` if the outputs hold ``g.size`` stacks of ``k`` and the columns cover the ring
    (True), else nothing written (False): the shape tests inside the one compiled call a draw makes."""
    if not (k >= 1 and obs_ids.shape[0] >= g.size and obs_ids.shape[1] == k and next_ids.shape[0] >= g.size
            and next_ids.shape[1] == k and valid.size >= g.size and next_frame.size >= obs_frame.size
            and prev_delta.size >= obs_frame.size and ring_rows <= obs_frame.size):
        return False
    stack_frames_into(g, k, obs_frame, next_frame, prev_delta, ring_rows, oldest, head, frame_head, obs_ids,
                      next_ids, valid)
    return True


def stack_frames(g, k, obs_frame, next_frame, prev_delta, ring_rows, oldest, head, frame_head, obs_ids, next_ids,
                 valid) -> None:
    """``stack_frames_into`` after checking the outputs hold ``g.size`` stacks of ``k`` and the ring's
    columns are as long as each other and cover ``ring_rows``. Dtypes and dimensions are tested here, the
    sizes inside the compiled call (this runs several times a batch); a fault is then named by
    ``_check_stack_arrays``."""
    if (type(g) is type(obs_ids) is type(next_ids) is type(valid) is np.ndarray and g.dtype == I64
            and obs_ids.dtype == I64 and next_ids.dtype == I64 and valid.dtype == np.bool_ and g.ndim == 1
            and obs_ids.ndim == 2 and next_ids.ndim == 2 and valid.ndim == 1 and g.flags.c_contiguous
            and obs_ids.flags.c_contiguous and next_ids.flags.c_contiguous and valid.flags.c_contiguous
            and _stack_frames_checked(g, k, obs_frame, next_frame, prev_delta, ring_rows, oldest, head, frame_head,
                                      obs_ids, next_ids, valid)):
        return
    _check_stack_arrays(g, k, obs_frame, next_frame, prev_delta, ring_rows, obs_ids, next_ids, valid)
    stack_frames_into(g, k, obs_frame, next_frame, prev_delta, ring_rows, oldest, head, frame_head, obs_ids,
                      next_ids, valid)


I64 = np.dtype(np.int64)


def _check_stack_arrays(g, k, obs_frame, next_frame, prev_delta, ring_rows, obs_ids, next_ids, valid) -> None:
    """Raise ``ValueError`` naming what ``stack_frames`` cannot write into."""
    if k < 1:
        raise ValueError(f"a frame stack of {k} frames (expected >= 1)")
    check_array("g", g, np.int64, ndim=1)
    for name, out in (("obs_ids", obs_ids), ("next_ids", next_ids)):
        check_array(name, out, np.int64, shape=(None, k))
        if out.shape[0] < g.size:
            raise ValueError(f"{name} has {out.shape[0]} rows for {g.size} transitions")
    check_array("valid", valid, np.bool_, ndim=1, min_size=g.size)
    if next_frame.size < obs_frame.size or prev_delta.size < obs_frame.size or ring_rows > obs_frame.size:
        raise ValueError(f"ring columns of {obs_frame.size}, {next_frame.size} and {prev_delta.size} rows for a "
                         f"ring of {ring_rows} rows (obs_frame, next_frame, prev_delta must cover it)")
