"""LZ4 blocks through numcodecs' linked C library: the high-compression encoder numcodecs' own ``lz4.compress``
does not offer (it exports the symbol), and the bounded decoder.

Invariant: every call passes the C functions a source and a destination whose sizes are the numpy arrays'
own, so ``LZ4_compress_HC`` never writes past its capacity and ``LZ4_decompress_safe`` never reads past the
block nor writes past ``out`` (negative: a malformed block). The raw addresses stay in this module.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

_LIBRARY = None
_LOCK = threading.Lock()


def _library():
    global _LIBRARY
    if _LIBRARY is None:
        with _LOCK:
            if _LIBRARY is None:
                from numcodecs import lz4

                lib = ctypes.CDLL(lz4.__file__)
                lib.LZ4_compress_HC.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
                                                ctypes.c_int]
                lib.LZ4_compress_HC.restype = ctypes.c_int
                lib.LZ4_decompress_safe.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
                lib.LZ4_decompress_safe.restype = ctypes.c_int
                _LIBRARY = lib
    return _LIBRARY


def compress_hc_block(data: np.ndarray, level: int) -> bytes:
    """``data`` (1-D uint8, contiguous) as a size-prefixed LZ4 block (numcodecs' LZ4 format: a 4-byte
    little-endian size, then the block) at LZ4HC ``level``."""
    data = np.ascontiguousarray(data, dtype=np.uint8).reshape(-1)
    capacity = data.size + data.size // 255 + 16  # LZ4_compressBound
    out = np.empty(4 + capacity, dtype=np.uint8)
    n = _library().LZ4_compress_HC(data.ctypes.data, out.ctypes.data + 4, data.size, capacity, level)
    if n <= 0:
        raise RuntimeError(f"LZ4_compress_HC failed on {data.size} bytes ({n})")
    out[:4] = np.frombuffer(int(data.size).to_bytes(4, "little"), dtype=np.uint8)
    return out[:4 + n].tobytes()


def decompress_block(block, out: np.ndarray) -> int:
    """The bytes ``LZ4_decompress_safe`` wrote into ``out`` (C-contiguous) from ``block`` (negative:
    malformed); it never writes past ``out`` nor reads past ``block``."""
    if not out.flags.c_contiguous:
        raise ValueError(f"LZ4 destination must be C-contiguous, got strides {out.strides}")
    src = np.frombuffer(block, dtype=np.uint8)
    return _library().LZ4_decompress_safe(src.ctypes.data, out.ctypes.data, src.size, out.nbytes)
