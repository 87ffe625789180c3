"""The scans of a loaded index ring (``TransitionRing``): what its resident columns say about transitions
``[oldest, head)`` that a commit record does not (or must not be trusted to) say.

Invariant: every scan reads the ring's columns through views of at most ``SCAN_BLOCK`` consecutive slots
(``slot_runs``), never through an index array over the whole ring: gathering the live transitions that way
took four int64 copies of the ring (~320 MB for 10M transitions) on top of the ring itself, at the process's
peak before any frame was read. The scans only read the ring.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

NO_FRAME = np.iinfo(np.int64).max  # a shard's minimum frame when it holds no transition
SCAN_BLOCK = 1 << 20  # transitions a scan reads at a time


def slot_runs(ring, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
    """Transitions ``[lo, hi)`` of ``ring`` as runs ``(g, slot, n)``: transitions ``g .. g + n`` lie in slots
    ``slot .. slot + n``, at most ``SCAN_BLOCK`` of them."""
    g = lo
    while g < hi:
        slot = int(ring.slot(g))
        n = min(hi - g, SCAN_BLOCK, ring.rows - slot)
        yield g, slot, n
        g += n


def shard_min_frames(ring, frame_head: int) -> np.ndarray:
    """Per file shard of ``ring``, the smallest global obs frame of its transitions in ``[oldest, head)``
    (``NO_FRAME`` for a shard that holds none)."""
    mins = np.full(ring.rows // ring.shard_rows, NO_FRAME, dtype=np.int64)
    for g, slot, n in slot_runs(ring, ring.oldest, ring.head):
        frames = ring.frame_globals(ring.arrays["obs_frame"][slot:slot + n], frame_head)
        first = g // ring.shard_rows
        bounds = np.arange(first, (g + n - 1) // ring.shard_rows + 1, dtype=np.int64) * ring.shard_rows
        bounds[0] = g
        run_mins = np.minimum.reduceat(frames, bounds - g)
        shards = ring.file_shard_array(np.arange(first, first + bounds.size, dtype=np.int64))
        np.minimum.at(mins, shards, run_mins)
    return mins


def live_max_prev_delta(ring) -> int:
    """The longest episode link among transitions ``[oldest, head)`` of ``ring``."""
    delta = ring.arrays["prev_delta"]
    return max((int(delta[slot:slot + n].max()) for _, slot, n in slot_runs(ring, ring.oldest, ring.head)),
               default=0)


def frame_span(ring, frame_head: int) -> tuple[int, int]:
    """Smallest and largest global frame id that transitions ``[oldest, head)`` of ``ring`` refer to (their own
    observation and next observation); ``(frame_head, -1)`` when there are none."""
    lo, hi = frame_head, -1
    for _, slot, n in slot_runs(ring, ring.oldest, ring.head):
        for name in ("obs_frame", "next_frame"):
            frames = ring.frame_globals(ring.arrays[name][slot:slot + n], frame_head)
            lo, hi = min(lo, int(frames.min())), max(hi, int(frames.max()))
    return lo, hi
