"""The compiled decode of a ``delta-lz4`` run (``codecs/delta_lz4.py``): one LZ4 block of residuals, then each
frame rebuilt from the frame it references, for whole runs or their first ``m`` frames (a sequence that ends
inside a run needs no more: LZ4 decodes a block front to back, so it stops there).

Invariant: ``decode_delta_lz4_run`` writes only ``dst[0 : m * frame_nbytes]`` (``m`` = ``upto`` frames, all
of them when ``upto`` is 0 or the run's length), after checking the run's header against ``dst_nbytes``
(magic, ``1 <= n <= MAX_RUN``, ``n * frame_nbytes == dst_nbytes``) and every reference (``refs[i] <= i``);
LZ4 (``LZ4_decompress_safe_partial``) never reads past ``src + body`` nor writes past ``dst + m * frame_nbytes``,
and a block that does not yield exactly those bytes is refused. Its result is a status of ``linked.py``
(``OK``, ``BAD_SIZE``, ``BAD_CODEC``). The run's checksum is the caller's (``chunk_decode._decode_one``,
``run_decode._decode_run_frames`` check it first). Decoded up to frame ``m``, the block is checked that far
only (LZ4 decodes front to back): a block whose bytes after that point are damaged yields the frames a
checksum-valid run holds up to ``m``, and is refused where the whole run is decoded.
"""

from __future__ import annotations

import importlib

import llvmlite.binding as llvm
import numba
import numpy as np
from numba import types

from mmreplay._native import delta_lz4_header as header
from mmreplay._native import intrinsics, kernel_cache, linked
from mmreplay._native.intrinsics import address
from mmreplay._native.linked import BAD_CODEC, BAD_SIZE, OK

kernel_cache.follow(__file__, header, intrinsics, linked)

MAGIC = int.from_bytes(header.MAGIC, "little")
HEADER_BYTES = header.HEADER.size
MAX_RUN = header.MAX_RUN
LZ4_MAX_BYTES = header.LZ4_MAX_BYTES


def _load() -> bool:
    """``LZ4_decompress_safe_partial`` linkable by name (numcodecs' LZ4 module exports it)."""
    try:
        llvm.load_library_permanently(importlib.import_module("numcodecs.lz4").__file__)
        return bool(llvm.address_of_symbol("LZ4_decompress_safe_partial"))
    except (ImportError, RuntimeError, AttributeError, TypeError):
        return False


AVAILABLE = _load()
_vp, _int = types.voidptr, types.intc
# (src, dst, srcSize, targetOutputSize, dstCapacity): decodes until targetOutputSize bytes are out (or the block
# ends), never reading past srcSize nor writing past dstCapacity; negative if malformed
lz4_decompress_safe_partial = types.ExternalFunction("LZ4_decompress_safe_partial", _int(_vp, _vp, _int, _int, _int))


@numba.njit(cache=True, nogil=True)
def _word(src, at):  # pragma: no cover (compiled)
    b = numba.carray(address(src + at), (4,), np.uint8)
    return np.int64(b[0]) | np.int64(b[1]) << 8 | np.int64(b[2]) << 16 | np.int64(b[3]) << 24


@numba.njit(cache=True, nogil=True)
def decode_delta_lz4_run(src, body, dst, dst_nbytes, upto):  # pragma: no cover (compiled)
    """The run of ``body`` bytes at ``src`` into ``dst`` (room for ``dst_nbytes``, the whole run): its first
    ``upto`` frames (``upto`` 0: all). A status (see the module docstring)."""
    if body < HEADER_BYTES:
        return BAD_SIZE
    magic, n, fb = _word(src, 0), _word(src, 4), _word(src, 8)
    if magic != MAGIC or n < 1 or n > MAX_RUN or fb < 1 or n * fb != dst_nbytes or dst_nbytes > LZ4_MAX_BYTES:
        return BAD_SIZE
    if body < HEADER_BYTES + n or body - HEADER_BYTES - n > LZ4_MAX_BYTES:
        return BAD_SIZE
    refs = numba.carray(address(src + HEADER_BYTES), (n,), np.uint8)
    for i in range(n):
        if np.int64(refs[i]) > i:
            return BAD_CODEC
    m = n if upto <= 0 or upto > n else upto
    want = m * fb
    got = lz4_decompress_safe_partial(src + HEADER_BYTES + n, dst, np.int32(body - HEADER_BYTES - n),
                                      np.int32(want), np.int32(want))
    if got < 0:
        return BAD_CODEC
    if got != want:
        return BAD_SIZE
    for i in range(1, m):
        d = np.int64(refs[i])
        if d:  # 1-D views: the residual plus its reference, modulo 256
            frame = numba.carray(address(dst + i * fb), (fb,), np.uint8)
            frame += numba.carray(address(dst + (i - d) * fb), (fb,), np.uint8)
    return OK


def checked_decode_run(data: np.ndarray, out: np.ndarray, upto: int = 0) -> int:
    """``decode_delta_lz4_run`` of ``data`` (1-D uint8, C-contiguous) into ``out`` (C-contiguous, the run's
    bytes), after checking both are what the kernel assumes; a status."""
    if data.dtype != np.uint8 or data.ndim != 1 or not data.flags.c_contiguous:
        raise ValueError(f"delta-lz4 run bytes must be a C-contiguous uint8 vector, got {data.dtype}{data.shape}")
    if not out.flags.c_contiguous:
        raise ValueError(f"delta-lz4 destination must be C-contiguous, got strides {out.strides}")
    if not AVAILABLE:
        raise RuntimeError("numcodecs' LZ4 library does not export LZ4_decompress_safe_partial")
    return decode_delta_lz4_run(data.ctypes.data, data.size, out.ctypes.data, out.nbytes, int(upto))
