"""Whole shard files read many at a time, with the GIL released for every system call.

Invariant: ``open_files`` returns, per path, an open descriptor and the file's size (or -1 for both when
the file cannot be opened), having asked the kernel to start reading the file (``POSIX_FADV_WILLNEED``);
``read_files`` reads each file whole from offset 0 into its destination (never more than its size) and
says how many bytes it got (-1: not read), then drops the file's pages from the page cache; every
descriptor ``open_files`` returned is closed by ``close_files``, exactly once, by the caller.

Why: the compressed tier is filled right after a restart by one background thread reading ~10,000 shard
files of ~100 KB (10M Atari transitions). Read from Python, each file costs a dozen calls that release the
GIL (open, fstat, mmap, preadv, fadvise, close), and each time the loader waits for the sampling thread to
give it back (up to the 5 ms switch interval): measured here, the tier filled at ~25 MB/s while sampling,
against ~100 MB/s that one plain sequential reader gets from the same files. Here a group of files costs
two compiled calls; the kernel reads the next group (``WILLNEED``) while this one is copied, so the device
keeps a queue of requests.

``read_files`` writes only inside the buffer it is given: before the kernel runs, every file it will read
is checked to fit that buffer at its offset (``bounds``). The C functions are libc's, linked by name (as
``decode.py`` links the codecs), so numba's on-disk cache stays valid across processes. ``AVAILABLE`` is False where the platform lacks ``posix_fadvise``; the
caller then reads one file at a time from Python.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from numba import types

from mmreplay._native.bounds import check_array

AVAILABLE = hasattr(os, "posix_fadvise") and hasattr(os, "O_CLOEXEC")

_i64, _int = types.int64, types.intc
# open(2) is variadic; called with its third (mode) argument given, as its variadic form receives it
_open = types.ExternalFunction("open", _int(_i64, _int, _int))
_pread = types.ExternalFunction("pread", _i64(_int, _i64, _i64, _i64))
_close = types.ExternalFunction("close", _int(_int))
_lseek = types.ExternalFunction("lseek", _i64(_int, _i64, _int))
_fadvise = types.ExternalFunction("posix_fadvise", _int(_int, _i64, _i64, _int))

_FLAGS = (os.O_RDONLY | os.O_CLOEXEC) if AVAILABLE else 0
_SEEK_END = os.SEEK_END
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", 3)
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", 4)


@numba.njit(nogil=True, cache=True)
def _open_all(paths, starts, flags, seek_end, willneed, fds, sizes):  # pragma: no cover - compiled
    base = paths.ctypes.data
    for i in range(starts.size):
        fd = _open(base + starts[i], flags, 0)
        fds[i] = fd
        sizes[i] = -1
        if fd < 0:
            continue
        size = _lseek(fd, 0, seek_end)
        if size < 0:
            _close(fd)
            fds[i] = -1
            continue
        sizes[i] = size
        _fadvise(fd, 0, size, willneed)


@numba.njit(nogil=True, cache=True)
def _read_all(fds, sizes, dst, dontneed, got):  # pragma: no cover - compiled
    for i in range(fds.size):
        got[i] = -1
        fd, size = fds[i], sizes[i]
        if fd < 0 or dst[i] == 0:
            continue
        done = 0
        while done < size:
            n = _pread(fd, dst[i] + done, size - done, done)
            if n <= 0:
                break
            done += n
        got[i] = done
        _fadvise(fd, 0, 0, dontneed)  # the bytes are held now: the page cache copy is redundant


@numba.njit(nogil=True, cache=True)
def _close_all(fds):  # pragma: no cover - compiled
    for i in range(fds.size):
        if fds[i] >= 0:
            _close(fds[i])
            fds[i] = -1


def encode_paths(paths: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """The paths as one buffer of NUL-terminated names, and where each starts."""
    names = [os.fsencode(p) + b"\0" for p in paths]
    starts = np.zeros(len(names), dtype=np.int64)
    if names:
        starts[1:] = np.cumsum([len(n) for n in names[:-1]])
    return np.frombuffer(b"".join(names), dtype=np.uint8), starts


def open_files(paths: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(descriptors, sizes) of ``paths``, -1 where a file could not be opened; the kernel starts reading
    each file. The caller closes them with ``close_files``."""
    buf, starts = encode_paths(paths)
    fds = np.full(len(paths), -1, dtype=np.int32)
    sizes = np.full(len(paths), -1, dtype=np.int64)
    if len(paths):
        _open_all(buf, starts, _FLAGS, _SEEK_END, _WILLNEED, fds, sizes)
    return fds, sizes


def read_files(fds: np.ndarray, sizes: np.ndarray, buffer: np.ndarray, offsets: np.ndarray,
               take: np.ndarray) -> np.ndarray:
    """Bytes read of each file ``i`` with ``take[i]`` into ``buffer[offsets[i]:offsets[i] + sizes[i]]``;
    -1 where a file was not read (or not taken). A short count means the read failed or the file shrank.
    Raises ``ValueError`` before reading if a taken file would not fit ``buffer`` at its offset."""
    n = fds.size
    check_array("fds", fds, np.int32, ndim=1)
    for name, arr, dtype in (("sizes", sizes, np.int64), ("offsets", offsets, np.int64), ("take", take, np.bool_)):
        check_array(name, arr, dtype, shape=(n,))
    check_array("buffer", buffer, np.uint8, ndim=1)
    if take.any():
        lo, hi = offsets[take], offsets[take] + sizes[take]
        bad = np.flatnonzero((lo < 0) | (sizes[take] < 0) | (hi > buffer.size))
        if bad.size:
            i = int(np.flatnonzero(take)[bad[0]])
            raise ValueError(f"file {i} ({int(sizes[i])} bytes at offset {int(offsets[i])}) does not fit the "
                             f"{buffer.size}-byte buffer it is read into")
    addresses = np.where(take, buffer.ctypes.data + offsets, 0).astype(np.int64)
    got = np.full(n, -1, dtype=np.int64)
    if n:
        _read_all(fds, sizes, addresses, _DONTNEED, got)
    return got


def close_files(fds: np.ndarray) -> None:
    if fds.size:
        _close_all(fds)
