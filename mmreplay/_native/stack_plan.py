"""Compiled planning of a batch's frame stacks: which held chunk decodes to which row of the batch's outputs.

Invariant: ``plan_stack_decodes`` computes every destination and copy address from the bases of the two
outputs it is given, frame ``p`` of the ``n * k`` flat stacks to row ``p`` (so they lie inside outputs of
``n * k`` frames: the entry points, ``decode.checked_plan_stack_decodes`` and ``decode.checked_decode_stacks``,
check that before they call it), and reports as ``absent`` every frame whose chunk the table does not hold,
in which case ``decode_stacks`` decodes nothing. The plan only reads the chunk tables; ``decode_stacks``
writes through ``chunk_decode.decode_chunks``.

Why: a frame stack's frames are neighbours in the batch's output, so with ``shifted`` (next stacks one frame
on from obs stacks) a next stack's first ``k - 1`` frames are copies of decoded obs frames, made while the
bytes are in the core's cache, and only its last frame is decoded on its own.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native import chunk_decode, codec_kinds, intrinsics, kernel_cache, linked, run_decode
from mmreplay._native import temporal_header as temporal
from mmreplay._native.chunk_decode import decode_chunks
from mmreplay._native.intrinsics import prefetch

# the kernels inline these, and what they inline (see kernel_cache)
kernel_cache.follow(__file__, intrinsics, temporal, codec_kinds, linked, run_decode, chunk_decode)


@numba.njit(cache=True, nogil=True)
def _prefetch_chunk_rows(obs_ids, next_ids, ring_rows, chunk_addr, chunk_size):  # pragma: no cover (compiled)
    """Ask for the chunk addresses and sizes of a batch's frames before the plan reads them: random rows of
    two 1M-entry tables are cache misses that overlap when asked for at once (a stack's frames are
    neighbours: its first and last frame cover its rows)."""
    addr_at, size_at = chunk_addr.ctypes.data, chunk_size.ctypes.data
    for ids in (obs_ids, next_ids):
        for i in range(ids.shape[0]):
            for j in (0, ids.shape[1] - 1):
                row = ids[i, j] % ring_rows if ring_rows else ids[i, j]
                if 0 <= row < chunk_addr.size:
                    prefetch(addr_at + row * 8)
                    prefetch(size_at + row * 8)


@numba.njit(cache=True, nogil=True)
def plan_stack_decodes(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                       chunk_size):  # pragma: no cover (compiled)
    """The ``decode_chunks`` arguments that fill a batch's obs and next-obs stacks (``(n, k)`` frame ids,
    one frame a chunk) from held chunks into the contiguous outputs ``obs_out`` / ``next_out`` (``n * k``
    frames of ``nbytes`` each): frame ``p`` of the flat obs stacks goes to row ``p`` of ``obs_out``, and
    with ``shifted`` on to row ``p - 1`` of ``next_out``, so that only each next stack's last frame is
    decoded on its own. Returns ``(rows, src, sizes, dst, copies, absent)``: ``absent`` counts frames
    whose chunk address is not held (0); the caller then takes the general path."""
    n, k = obs_ids.shape
    obs_base, next_base = obs_out.ctypes.data, next_out.ctypes.data
    total = n * k + (n if shifted else n * k)
    rows = np.empty(total, dtype=np.int64)
    src = np.empty(total, dtype=np.int64)
    sizes = np.empty(total, dtype=np.int64)
    dst = np.empty(total, dtype=np.int64)
    copies = np.zeros(total, dtype=np.int64)
    absent = 0
    _prefetch_chunk_rows(obs_ids, next_ids, ring_rows, chunk_addr, chunk_size)
    for t in range(total):
        if t < n * k:
            fid = obs_ids[t // k, t % k]
            dst[t] = obs_base + t * nbytes
            if shifted and t % k > 0:
                copies[t] = next_base + (t - 1) * nbytes
        elif shifted:
            i = t - n * k
            fid = next_ids[i, k - 1]
            dst[t] = next_base + (i * k + k - 1) * nbytes
        else:
            p = t - n * k
            fid = next_ids[p // k, p % k]
            dst[t] = next_base + p * nbytes
        row = fid % ring_rows if ring_rows else fid
        rows[t] = row
        if 0 <= row < chunk_addr.size:
            src[t] = chunk_addr[row]
            sizes[t] = chunk_size[row]
        else:  # beyond what the tier has room for yet: the general path deals with it
            src[t] = sizes[t] = 0
        if src[t] <= 0:
            absent += 1
    return rows, src, sizes, dst, copies, absent


@numba.njit(cache=True, nogil=True)
def decode_stacks(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr, chunk_size, codec,
                  status, verified=False):  # pragma: no cover (compiled)
    """``plan_stack_decodes`` and ``decode_chunks`` in one call (a batch too small to split over threads).
    Returns ``(failures, rows)``, with ``failures == -1`` and nothing written when a chunk is not held;
    ``status`` (at least one entry per decode) and ``rows`` say which chunk failed. ``verified``: as
    ``decode_chunks``' (the held chunks' checksums matched when the tier installed them)."""
    rows, src, sizes, dst, copies, absent = plan_stack_decodes(obs_ids, next_ids, shifted, obs_out, next_out,
                                                               nbytes, ring_rows, chunk_addr, chunk_size)
    if absent:
        return -1, rows
    return decode_chunks(src, sizes, dst, copies, nbytes, codec, status[:src.size], verified), rows

