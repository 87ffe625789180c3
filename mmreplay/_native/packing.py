"""Compiled reads of bit-packed columns (``columns/packing.py`` holds the format and the checked entry points).

Invariant: ``_decode_into`` and ``_bits_into`` read byte ``(p * bits) >> 3`` of each packed buffer for every
position ``p`` and write ``out[i]`` for ``i < positions.size`` only, and only once every position has
been found below ``limit`` (else they return the first one that is not, having written nothing) and every
output found to hold ``positions.size`` entries (else ``TOO_SHORT``, nothing written); their entry points
``decode_into`` and ``bits_into`` check the types, pass the limit the buffers hold, and name a fault.
Positions and sizes are checked inside the kernel: a separate check cost a second call a column a batch.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native.bounds import check_array


TOO_SHORT = -2  # a kernel's answer when an output holds fewer entries than there are positions


@numba.njit(cache=True, nogil=True)
def _first_outside(positions, limit):  # pragma: no cover (compiled)
    for i in range(positions.size):
        if not 0 <= positions[i] < limit:
            return i
    return -1


@numba.njit(cache=True, nogil=True)
def _decode_into(buf, bits, positions, table, out, limit):  # pragma: no cover (compiled)
    if out.size < positions.size:
        return TOO_SHORT
    bad = _first_outside(positions, limit)
    if bad >= 0:
        return bad
    mask = (1 << bits) - 1
    for i in range(positions.size):
        bit_pos = positions[i] * bits
        out[i] = table[(buf[bit_pos >> 3] >> (bit_pos & 7)) & mask]
    return -1


@numba.njit(cache=True, nogil=True)
def _bits_into(first, second, positions, out_first, out_second, limit):  # pragma: no cover (compiled)
    if out_first.size < positions.size or out_second.size < positions.size:
        return TOO_SHORT
    bad = _first_outside(positions, limit)
    if bad >= 0:
        return bad
    for i in range(positions.size):
        p = positions[i]
        out_first[i] = (first[p >> 3] >> (p & 7)) & 1
        out_second[i] = (second[p >> 3] >> (p & 7)) & 1
    return -1


def _refuse(positions: np.ndarray, bad: int, limit: int) -> None:
    if bad >= 0:
        raise ValueError(f"positions holds {positions[bad].item()!r} at flat position {bad}, outside [0, {limit}); "
                         "nothing was written")


_I64 = np.dtype(np.int64)


def _plain(positions, out, out2=None) -> bool:
    """The common case in a few attribute reads (this runs for several columns a batch): 1-D int64
    C-contiguous ``positions``, 1-D numpy outputs (their sizes are tested in the kernel)."""
    return (type(positions) is type(out) is np.ndarray and positions.dtype == _I64 and positions.ndim == 1
            and out.ndim == 1 and positions.flags.c_contiguous
            and (out2 is None or (type(out2) is np.ndarray and out2.ndim == 1)))


def decode_into(buf, bits, positions, table, out) -> None:
    """``out[i] = table[code at positions[i]]`` (``_decode_into``) after checking every position lies in
    ``buf`` and ``out`` holds ``positions.size`` entries. The codes are the column's own, each below its
    table's size since it was written (a table may be shorter than ``2 ** bits``: 3 actions in 2 bits)."""
    if not (_plain(positions, out) and bits in (1, 2, 4)):
        check_array("positions", positions, np.int64, ndim=1)
        check_array("out", out, ndim=1, contiguous=False)
        if bits not in (1, 2, 4):
            raise ValueError(f"bits must be 1, 2 or 4, got {bits!r}")
    limit = buf.size * 8 // bits
    bad = _decode_into(buf, bits, positions, table, out, limit)
    if bad != -1:  # nothing was written: name the fault
        if bad == TOO_SHORT:
            check_array("out", out, ndim=1, min_size=positions.size, contiguous=False)
        _refuse(positions, bad, limit)


def bits_into(first, second, positions, out_first, out_second) -> None:
    """Two 1-bit columns at ``positions`` as booleans (``_bits_into``), after the same checks."""
    if not _plain(positions, out_first, out_second):
        check_array("positions", positions, np.int64, ndim=1)
        for name, out in (("out_first", out_first), ("out_second", out_second)):
            check_array(name, out, ndim=1, contiguous=False)
    limit = min(first.size, second.size) * 8
    bad = _bits_into(first, second, positions, out_first, out_second, limit)
    if bad != -1:  # nothing was written: name the fault
        if bad == TOO_SHORT:
            for name, out in (("out_first", out_first), ("out_second", out_second)):
                check_array(name, out, ndim=1, min_size=positions.size, contiguous=False)
        _refuse(positions, bad, limit)
