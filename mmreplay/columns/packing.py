"""Bit packing of small codes into bytes.

Invariant: a packed buffer holding ``n`` codes of ``bits`` bits (1, 2 or 4) is ``ceil(n * bits / 8)``
bytes; code ``i`` lives in byte ``(i * bits) // 8`` at bit offset ``(i * bits) % 8``, least significant
bits first. Because ``bits`` divides 8, a code never straddles two bytes, so reading or writing any
set of positions is a handful of vectorised numpy operations (no per-element Python loops).
"""

from __future__ import annotations

import numpy as np

from mmreplay._native import packing as kernels

PACKABLE_BITS = (1, 2, 4)


def packed_nbytes(n: int, bits: int) -> int:
    """Bytes needed to hold ``n`` codes of ``bits`` bits."""
    _check_bits(bits)
    return (n * bits + 7) // 8


def pack(codes: np.ndarray, bits: int) -> np.ndarray:
    """Pack a 1-D array of codes (each < 2**bits) into a new uint8 buffer."""
    _check_bits(bits)
    codes = np.asarray(codes, dtype=np.uint8).ravel()
    per_byte = 8 // bits
    padded = np.zeros(packed_nbytes(codes.size, bits) * per_byte, dtype=np.uint8)
    padded[: codes.size] = codes
    lanes = padded.reshape(-1, per_byte)
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits)
    return np.bitwise_or.reduce(lanes << shifts, axis=1).astype(np.uint8)


def unpack(buf: np.ndarray, bits: int, n: int) -> np.ndarray:
    """Unpack the first ``n`` codes of a packed buffer into a uint8 array."""
    _check_bits(bits)
    per_byte = 8 // bits
    shifts = (np.arange(per_byte, dtype=np.uint8) * bits)
    mask = np.uint8((1 << bits) - 1)
    return ((buf[:, None] >> shifts) & mask).ravel()[:n]


def read_codes(buf: np.ndarray, bits: int, positions: np.ndarray) -> np.ndarray:
    """Codes at arbitrary positions (any integer array shape)."""
    bit_pos = np.asarray(positions, dtype=np.int64) * bits
    shift = (bit_pos & 7).astype(np.uint8)
    bit_pos >>= 3
    return (buf[bit_pos] >> shift) & np.uint8((1 << bits) - 1)


def decode_into(buf: np.ndarray, bits: int, positions: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    """``out[i] = table[code at positions[i]]``: read and decode in one pass (the sampler's hot path)."""
    kernels.decode_into(buf, bits, positions, table, out)  # 1-D int64 positions and out (the sampler's own arrays)


def bits_into(first: np.ndarray, second: np.ndarray, positions: np.ndarray, out_first: np.ndarray,
              out_second: np.ndarray) -> None:
    """Two 1-bit columns at the same positions as booleans, in one pass (a batch's two episode flags)."""
    kernels.bits_into(first, second, positions, out_first, out_second)


def write_codes(buf: np.ndarray, bits: int, positions: np.ndarray, codes: np.ndarray) -> None:
    """Store ``codes`` at ``positions`` in place.

    Positions may share a byte (e.g. four consecutive 2-bit actions), so the update is done per
    position class ``(position * bits) % 8`` — at most ``8 // bits`` rounds in which no two positions
    touch the same byte — to stay correct without a per-element loop.
    """
    positions = np.asarray(positions, dtype=np.int64).ravel()
    codes = np.asarray(codes, dtype=np.uint8).ravel()
    if positions.size == 1:  # the hot path of single adds
        bit_pos = int(positions[0]) * bits
        byte, shift = bit_pos >> 3, bit_pos & 7
        mask = ((1 << bits) - 1) << shift
        buf[byte] = (int(buf[byte]) & ~mask & 0xFF) | ((int(codes[0]) << shift) & mask)
        return
    bit_pos = positions * bits
    shifts = (bit_pos & 7).astype(np.uint8)
    byte_idx = bit_pos >> 3
    for shift in np.unique(shifts):
        sel = shifts == shift
        mask = np.uint8(((1 << bits) - 1) << int(shift))
        idx = byte_idx[sel]
        buf[idx] = (buf[idx] & ~mask) | ((codes[sel] << shift) & mask)


def _check_bits(bits: int) -> None:
    if bits not in PACKABLE_BITS:
        raise ValueError(f"bits must be one of {PACKABLE_BITS}, got {bits!r}")
