"""Whole shard files read many at a time, with the GIL released for every system call.

Invariant: ``open_files`` returns, per path, an open descriptor and the file's size (or -1 for both when
the file cannot be opened or is not a regular file), and whether it was opened ``O_DIRECT`` (asked for, and allowed by the file
system); a file opened plainly the kernel has been asked to start reading (``POSIX_FADV_WILLNEED``).
``read_files`` reads each file whole from offset 0 into its destination and says how many bytes it got (-1:
not read; a count other than the size: the read failed or the file changed). It writes nothing outside
``[destination, destination + size)`` for a plain file and ``[destination, destination + size rounded up
to DIRECT_ALIGN)`` for a direct one, and drops a plain file's pages from the page cache after reading
them. Every descriptor ``open_files`` returned is closed by ``close_files``, exactly once, by the caller.

Why: the compressed tier is filled right after a restart by a background pass reading ~10,000 shard files
of ~100 KB (10M Atari transitions). Read from Python, each file costs a dozen calls that release the GIL
(open, fstat, mmap, preadv, fadvise, close), and each time the loader waits for the sampling thread to give
it back (up to the 5 ms switch interval): measured on one VM, the tier filled at ~25 MB/s while sampling,
against ~100 MB/s that one plain sequential reader got from the same files. Here a group of files costs
two compiled calls. Direct reads put the device's bytes straight into the tier's pages: no page-cache copy
to make and then drop (~15% of the pass's CPU, measured on a 1.5 GB/s disk), and nothing that counts twice
against a memory cgroup. A file system that refuses ``O_DIRECT`` at open (tmpfs) or at a read gets the
plain path for that file.

Only regular files are read: each is opened ``O_NOFOLLOW | O_NONBLOCK`` (a link is refused, and a FIFO opens at
once instead of waiting for a writer that never comes) and ``statx``'d on its descriptor; anything else is
closed and reported as not opened (-1), which sends the caller to ``storage/files.open_regular``'s error.

``read_files`` writes only inside the buffer it is given: before the kernel runs, every file it will read
is checked to fit that buffer at its offset, a direct one at an aligned address with its rounded-up size
(``bounds``). The C functions are libc's, linked by name (as ``linked.py`` links the codecs), so numba's
on-disk cache stays valid across processes. ``AVAILABLE`` is False where the platform lacks
``posix_fadvise``; the caller then reads one file at a time from Python.
"""

from __future__ import annotations

import os

import numba
import numpy as np
from numba import types

from mmreplay._native.bounds import check_array



def _libc_has(name: str) -> bool:
    try:
        import ctypes

        return hasattr(ctypes.CDLL(None), name)
    except (ImportError, OSError):
        return False


# statx (glibc >= 2.28) tells a file's type and size through one fixed, architecture-independent layout
AVAILABLE = hasattr(os, "posix_fadvise") and hasattr(os, "O_CLOEXEC") and hasattr(os, "O_NOFOLLOW") \
    and _libc_has("statx")

_i64, _int = types.int64, types.intc
# open(2) is variadic; called with its third (mode) argument given, as its variadic form receives it
_open = types.ExternalFunction("open", _int(_i64, _int, _int))
_pread = types.ExternalFunction("pread", _i64(_int, _i64, _i64, _i64))
_close = types.ExternalFunction("close", _int(_int))
_fadvise = types.ExternalFunction("posix_fadvise", _int(_int, _i64, _i64, _int))
# fcntl(2) is variadic: called with its third argument given, as for open(2)
_fcntl = types.ExternalFunction("fcntl", _int(_int, _int, _int))
_statx = types.ExternalFunction("statx", _int(_int, _i64, _int, types.uint32, _i64))

_FLAGS = (os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK) if AVAILABLE else 0
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_AT_EMPTY_PATH = 0x1000  # statx of the descriptor itself
_STATX_TYPE_SIZE = 0x1 | 0x200
_STATX_BYTES = 256  # sizeof(struct statx); stx_mode: u16 at 28, stx_size: u64 at 40
_S_IFMT, _S_IFREG = 0o170000, 0o100000
_O_DIRECT = getattr(os, "O_DIRECT", 0)
try:
    from fcntl import F_GETFL as _F_GETFL, F_SETFL as _F_SETFL
except ImportError:  # no fcntl (Windows): AVAILABLE is False there, nothing here is called
    _F_GETFL = _F_SETFL = 0
# What a direct read's address, offset and length are multiples of (the common logical block sizes divide it)
DIRECT_ALIGN = 4096
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", 3)
_DONTNEED = getattr(os, "POSIX_FADV_DONTNEED", 4)


@numba.njit(nogil=True, cache=True)
def _open_all(paths, starts, flags, direct_flag, willneed, fds, sizes, direct, statbuf, mode, size_out
              ):  # pragma: no cover - compiled
    base = paths.ctypes.data
    empty = statbuf.ctypes.data + _STATX_BYTES  # a NUL byte: statx's path for "the descriptor itself"
    for i in range(starts.size):
        fd = -1
        if direct_flag != 0:
            fd = _open(base + starts[i], flags | direct_flag, 0)
        direct[i] = fd >= 0
        if fd < 0:  # no O_DIRECT asked, or the file system refuses it (tmpfs): through the page cache
            fd = _open(base + starts[i], flags, 0)
        fds[i] = fd
        sizes[i] = -1
        if fd < 0:
            continue
        # a regular file only (mode/size_out view statbuf's bytes); then O_NONBLOCK, there for FIFOs, goes
        ok = _statx(fd, empty, _AT_EMPTY_PATH, _STATX_TYPE_SIZE, statbuf.ctypes.data) == 0 \
            and (mode[0] & _S_IFMT) == _S_IFREG
        if ok:
            fl = _fcntl(fd, _F_GETFL, 0)
            ok = fl >= 0 and _fcntl(fd, _F_SETFL, fl & ~_O_NONBLOCK) >= 0
        if not ok:
            _close(fd)
            fds[i] = -1
            continue
        size = np.int64(size_out[0])
        sizes[i] = size
        if not direct[i]:
            _fadvise(fd, 0, size, willneed)


@numba.njit(nogil=True, cache=True)
def _read_all(fds, sizes, lengths, dst, direct_flag, dontneed, got):  # pragma: no cover - compiled
    for i in range(fds.size):
        got[i] = -1
        fd, size, length = fds[i], sizes[i], lengths[i]
        if fd < 0 or dst[i] == 0:
            continue
        done = 0
        while done < size:  # a direct read asks for whole blocks: the one past the end comes back short
            n = _pread(fd, dst[i] + done, length - done, done)
            if n < 0 and length != size:
                # a file system that opened the file O_DIRECT but refuses the read (its block size, or a
                # short block mid-file): the rest through the page cache
                flags = _fcntl(fd, _F_GETFL, 0)
                if flags < 0 or _fcntl(fd, _F_SETFL, flags & ~direct_flag) < 0:
                    break
                length = size
                continue
            if n <= 0:
                break
            done += n
        got[i] = done  # more than ``size``: the file grew since it was opened (not held)
        if length == size:  # read through the page cache: its copy is redundant now
            _fadvise(fd, 0, 0, dontneed)


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


def open_files(paths: list[str], direct: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(descriptors, sizes, direct) of ``paths``, -1 where a file could not be opened. ``direct``: open with
    ``O_DIRECT`` where the file system allows it (the bytes go from the device to the caller's buffer, never
    through the page cache: nothing is copied twice, and nothing counts twice against a memory cgroup);
    the other files are opened plainly and the kernel starts reading them. The caller closes them with
    ``close_files``."""
    buf, starts = encode_paths(paths)
    fds = np.full(len(paths), -1, dtype=np.int32)
    sizes = np.full(len(paths), -1, dtype=np.int64)
    opened_direct = np.zeros(len(paths), dtype=np.bool_)
    if len(paths):
        statbuf = np.zeros(_STATX_BYTES + 8, dtype=np.uint8)  # + a NUL byte (statx's empty path), aligned views
        mode, size = statbuf[28:30].view(np.uint16), statbuf[40:48].view(np.uint64)
        _open_all(buf, starts, _FLAGS, _O_DIRECT if direct and AVAILABLE else 0, _WILLNEED, fds, sizes,
                  opened_direct, statbuf, mode, size)
    return fds, sizes, opened_direct


def read_files(fds: np.ndarray, sizes: np.ndarray, buffer: np.ndarray, offsets: np.ndarray,
               take: np.ndarray, direct: np.ndarray | None = None) -> np.ndarray:
    """Bytes read of each file ``i`` with ``take[i]`` into ``buffer[offsets[i]:offsets[i] + sizes[i]]``;
    -1 where a file was not read (or not taken). A count other than the size means the read failed or the
    file changed. ``direct[i]``: file ``i`` was opened with ``O_DIRECT`` (``open_files``); it is read in
    whole blocks of ``DIRECT_ALIGN``, so its destination must be aligned to that and hold its size rounded up
    to it. Raises ``ValueError`` before reading if a taken file would not fit ``buffer`` at its offset."""
    n = fds.size
    check_array("fds", fds, np.int32, ndim=1)
    direct = np.zeros(n, dtype=np.bool_) if direct is None else direct
    for name, arr, dtype in (("sizes", sizes, np.int64), ("offsets", offsets, np.int64), ("take", take, np.bool_),
                             ("direct", direct, np.bool_)):
        check_array(name, arr, dtype, shape=(n,))
    check_array("buffer", buffer, np.uint8, ndim=1)
    lengths = np.where(direct, -(-sizes // DIRECT_ALIGN) * DIRECT_ALIGN, sizes)
    addresses = np.where(take, buffer.ctypes.data + offsets, 0).astype(np.int64)
    if take.any():
        lo, hi = offsets[take], offsets[take] + lengths[take]
        misaligned = direct[take] & (addresses[take] % DIRECT_ALIGN != 0)
        bad = np.flatnonzero((lo < 0) | (sizes[take] < 0) | (hi > buffer.size) | misaligned)
        if bad.size:
            i = int(np.flatnonzero(take)[bad[0]])
            raise ValueError(f"file {i} ({int(sizes[i])} bytes{', read in whole blocks' if direct[i] else ''} "
                             f"at offset {int(offsets[i])}) does not fit the {buffer.size}-byte buffer it is "
                             f"read into{f' at a {DIRECT_ALIGN}-byte boundary' if direct[i] else ''}")
    got = np.full(n, -1, dtype=np.int64)
    if n:
        _read_all(fds, sizes, lengths, addresses, _O_DIRECT, _DONTNEED, got)
    return got


def close_files(fds: np.ndarray) -> None:
    if fds.size:
        _close_all(fds)
