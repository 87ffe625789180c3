"""Compiled reads of bit-packed columns (``columns/packing.py`` holds the format and the checked entry points).

Invariant: ``decode_into`` and ``bits_into`` read byte ``(p * bits) >> 3`` of each packed buffer for every
position ``p`` and write ``out[i]`` for ``i < positions.size`` only; the entry points in
``columns/packing.py`` check that the buffers hold those bytes and the outputs those entries first.
"""

from __future__ import annotations

import numba


@numba.njit(cache=True, nogil=True)
def decode_into(buf, bits, positions, table, out):  # pragma: no cover (compiled)
    mask = (1 << bits) - 1
    for i in range(positions.size):
        bit_pos = positions[i] * bits
        out[i] = table[(buf[bit_pos >> 3] >> (bit_pos & 7)) & mask]


@numba.njit(cache=True, nogil=True)
def bits_into(first, second, positions, out_first, out_second):  # pragma: no cover (compiled)
    for i in range(positions.size):
        p = positions[i]
        out_first[i] = (first[p >> 3] >> (p & 7)) & 1
        out_second[i] = (second[p >> 3] >> (p & 7)) & 1
