"""Compiled lookups in a decoded-chunk cache (``reading/cache.py``'s ``ChunkCache``).

Invariant: ``slab_row`` only reads ``slot_of`` (at ``row // chunk_rows``, where ``row`` is the frame's
array row) and returns a row of the flat slab or -1; ``lookup_rows`` writes ``slab_rows[i]``, ``chunks[i]``
for ``i < ids.size`` and ``last_used`` at the slots it found. ``lookup_rows`` checks that ``slot_of``
covers every row an id can fall in and that the outputs hold ``ids.size`` entries; the slots in ``slot_of``
are the cache's own (``ChunkCache``'s invariant: each is a slot of ``last_used``).
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native.bounds import check_array, check_indices


@numba.njit(cache=True, nogil=True, inline="always")
def slab_row(slot_of, ring_rows, chunk_rows, frame_id):  # pragma: no cover (compiled)
    """Row of the flat slab holding frame ``frame_id`` (array row ``id % ring_rows``, or ``id`` when
    ``ring_rows`` is 0), or -1 if its chunk is not cached."""
    row = frame_id % ring_rows if ring_rows else frame_id
    slot = slot_of[row // chunk_rows]
    return np.int64(slot) * chunk_rows + row % chunk_rows if slot >= 0 else np.int64(-1)


@numba.njit(cache=True, nogil=True)
def _lookup_rows(slot_of, last_used, tick, ids, ring_rows, chunk_rows, slab_rows, chunks):  # pragma: no cover
    n_hit = 0
    for i in range(ids.size):
        row = ids[i] % ring_rows if ring_rows else ids[i]
        chunks[i] = row // chunk_rows
        slab_rows[i] = slab_row(slot_of, ring_rows, chunk_rows, ids[i])
        if slab_rows[i] >= 0:
            last_used[slab_rows[i] // chunk_rows] = tick
            n_hit += 1
    return n_hit


_I64 = np.dtype(np.int64)


@numba.njit(cache=True, nogil=True)
def _lookup_rows_checked(slot_of, last_used, tick, ids, ring_rows, chunk_rows, slab_rows,
                         chunks):  # pragma: no cover (compiled)
    """``_lookup_rows`` if ``lookup_rows``'s checks pass, else -1 with nothing written."""
    covered = slot_of.size * chunk_rows
    if not (chunk_rows >= 1 and slab_rows.flags.c_contiguous and chunks.flags.c_contiguous
            and last_used.flags.c_contiguous and slab_rows.size >= ids.size and chunks.size >= ids.size):
        return -1
    if ring_rows:
        if not 0 < ring_rows <= covered:
            return -1
    else:
        for i in range(ids.size):
            if not 0 <= ids[i] < covered:
                return -1
    return _lookup_rows(slot_of, last_used, tick, ids, ring_rows, chunk_rows, slab_rows, chunks)


def lookup_rows(slot_of, last_used, tick, ids, ring_rows, chunk_rows, slab_rows, chunks) -> int:
    """``_lookup_rows`` after checking that it reads ``slot_of`` and writes the outputs in bounds; returns
    the number of hits. The types are tested here, the sizes and ids inside the compiled call (this runs
    every batch); a fault is named by the checks below."""
    if (type(slab_rows) is type(chunks) is type(last_used) is type(ids) is np.ndarray and slab_rows.dtype == _I64
            and chunks.dtype == _I64 and last_used.dtype == _I64 and slab_rows.ndim == chunks.ndim == last_used.ndim
            == ids.ndim == 1):
        hits = _lookup_rows_checked(slot_of, last_used, tick, ids, ring_rows, chunk_rows, slab_rows, chunks)
        if hits >= 0:
            return hits
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be >= 1, got {chunk_rows}")
    for name, out in (("slab_rows", slab_rows), ("chunks", chunks)):
        check_array(name, out, np.int64, ndim=1, min_size=ids.size)
    check_array("last_used", last_used, np.int64, ndim=1)
    covered = slot_of.size * chunk_rows
    if ring_rows:
        if not 0 < ring_rows <= covered:
            raise ValueError(f"a ring of {ring_rows} rows, but the cache's chunk table covers {covered} rows")
    else:
        check_indices("ids", ids, 0, covered)
    return _lookup_rows(slot_of, last_used, tick, ids, ring_rows, chunk_rows, slab_rows, chunks)
