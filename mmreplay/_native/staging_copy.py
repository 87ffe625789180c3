"""The device path's staging kernel (``mmreplay/device/staging.py``): stored chunks copied into the staging
buffer with their crc32c checked, in one compiled call.

Invariant: ``checked_copy(addrs, sizes, out, at)`` reads exactly ``sizes[i]`` bytes at ``addrs[i]`` (a chunk with
its 4-byte crc32c; the caller holds whatever keeps those bytes in place: the compressed tier's ``holding``, a file
read's buffer) and writes exactly the ``sizes[i] - 4`` bytes of its body at ``out[at[i]:]``, every one of them
inside ``out`` (checked before the call); it returns per chunk ``OK`` when the body's crc32c equals the stored one,
else ``BAD_CHECKSUM`` (or ``BAD_SIZE`` for a chunk shorter than its checksum: nothing copied).

Why compiled: a Python copy and ``google_crc32c.value`` per chunk cost ~5-10 us each, and a batch-256 of
one-frame chunks stages ~1,000 of them.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native.linked import (
    AVAILABLE,
    BAD_CHECKSUM,
    BAD_SIZE,
    OK,
    crc32c,
    memcpy,
)

CRC = 4


@numba.njit(cache=True, nogil=True)
def _copy_checked(addrs, sizes, base, at, status, scratch):  # pragma: no cover (compiled)
    for i in range(addrs.size):
        n = sizes[i]
        if n < CRC:
            status[i] = BAD_SIZE
            continue
        body = n - CRC
        memcpy(base + at[i], addrs[i], body)
        memcpy(scratch.ctypes.data, addrs[i] + body, 4)
        status[i] = OK if crc32c(base + at[i], body) == (scratch[0] & np.uint64(0xFFFFFFFF)) else BAD_CHECKSUM


def checked_copy(addrs: np.ndarray, sizes: np.ndarray, out: np.ndarray, at: np.ndarray) -> np.ndarray:
    """The kernel above, its writes checked to land inside ``out`` first; the statuses. Without the linked C
    functions (``AVAILABLE`` False) the same in Python."""
    addrs = np.ascontiguousarray(addrs, dtype=np.int64)
    sizes = np.ascontiguousarray(sizes, dtype=np.int64)
    at = np.ascontiguousarray(at, dtype=np.int64)
    if addrs.shape != sizes.shape or at.shape != sizes.shape or out.dtype != np.uint8 or out.ndim != 1 or \
            not out.flags.c_contiguous:
        raise ValueError(f"checked_copy: {addrs.size} addresses, {sizes.size} sizes, {at.size} offsets into a "
                         f"{out.dtype} {out.shape} buffer; expected equal counts into a contiguous 1-D uint8 buffer")
    if sizes.size and (at.min() < 0 or (at + np.maximum(sizes - CRC, 0)).max() > out.size):
        raise ValueError(f"checked_copy: bodies at {at.min()}..{(at + sizes).max()} do not fit a buffer of {out.size}")
    status = np.empty(sizes.size, dtype=np.int8)
    if not AVAILABLE:
        import ctypes

        import google_crc32c

        for i, (a, n) in enumerate(zip(addrs.tolist(), sizes.tolist())):
            if n < CRC:
                status[i] = BAD_SIZE
                continue
            raw = ctypes.string_at(a, n)
            out[at[i]:at[i] + n - CRC] = np.frombuffer(raw, dtype=np.uint8, count=n - CRC)
            ok = google_crc32c.value(raw[:-CRC]) == int.from_bytes(raw[-CRC:], "little")
            status[i] = OK if ok else BAD_CHECKSUM
        return status
    _copy_checked(addrs, sizes, out.ctypes.data, at, status, np.zeros(1, dtype=np.uint64))
    return status
