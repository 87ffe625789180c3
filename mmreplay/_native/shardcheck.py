"""Whole shard files checked in one compiled call: is each, beyond doubt, the file the commit expects?

Invariant: ``expected_files`` says True for file ``i`` only if all of these hold, read from the bytes
``buffer[offsets[i]:offsets[i] + sizes[i]]`` (which it checks lie inside ``buffer``): the file holds at least
its tail (identity tag, index, index crc32c); the crc32c of that tail equals ``identities[i]`` (the identity
the commit lists, >= 0); the tag names this array (``array_crc``), ``n_chunks`` chunks and shard
``shards[i]``, with the tag magic and version given; the index's crc32c matches; every used index entry lies
inside the bytes before the index (compared without overflow) and holds at least its own checksum; every
empty entry has an empty size; and every used chunk ends with the crc32c its tag lists. False says nothing
but "not proven here": the caller then checks that file the long way (``ShardedArray.check_file``), which
names what is wrong, or tolerates it where the store says so.

Why: the background pass that fills the compressed tier after a restart checked ~10,000 files of a 10M
Atari store in Python, ~55 us each (index parse, bounds, tag, chunk checksums), holding the GIL a second
per GB while the sampling thread waited for it. Here a group of files is one call with the GIL released.
Reads only inside ``buffer``; writes only ``ok``.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native import linked
from mmreplay._native.bounds import check_array

AVAILABLE = linked.AVAILABLE
EMPTY = np.uint64(2**64 - 1)
CRC_BYTES = 4
INDEX_ENTRY_BYTES = 16
# The tag's head (storage/format/shardfile.py's TAG_HEAD, "<4sIIIQQQ"): magic, version, array crc, chunks, shard
TAG_HEAD_NBYTES = 40


@numba.njit(cache=True, nogil=True)
def _u32(buf, at):  # pragma: no cover (compiled)
    return (np.uint32(buf[at]) | np.uint32(buf[at + 1]) << np.uint32(8) | np.uint32(buf[at + 2]) << np.uint32(16)
            | np.uint32(buf[at + 3]) << np.uint32(24))


@numba.njit(cache=True, nogil=True)
def _u64(buf, at):  # pragma: no cover (compiled)
    lo = np.uint64(_u32(buf, at))
    hi = np.uint64(_u32(buf, at + 4))
    return lo | (hi << np.uint64(32))


@numba.njit(cache=True, nogil=True)
def _is_expected(buf, start, size, n_chunks, identity, shard, array_crc, magic, version):  # pragma: no cover
    tag_nbytes = TAG_HEAD_NBYTES + CRC_BYTES * n_chunks
    index_nbytes = INDEX_ENTRY_BYTES * n_chunks + CRC_BYTES
    tail_nbytes = tag_nbytes + index_nbytes
    if identity < 0 or size < tail_nbytes:
        return False
    tail = start + size - tail_nbytes
    if np.int64(linked.crc32c(buf.ctypes.data + tail, tail_nbytes)) != identity:
        return False
    if (_u32(buf, tail) != magic or _u32(buf, tail + 4) != version or _u32(buf, tail + 8) != array_crc
            or _u32(buf, tail + 12) != n_chunks or _u64(buf, tail + 16) != np.uint64(shard)):
        return False
    index = tail + tag_nbytes
    body = index_nbytes - CRC_BYTES
    if linked.crc32c(buf.ctypes.data + index, body) != _u32(buf, index + body):
        return False
    limit = np.uint64(size - index_nbytes)  # chunk bytes lie before the index (the tag included, as zarr's)
    for c in range(n_chunks):
        offset = _u64(buf, index + INDEX_ENTRY_BYTES * c)
        nbytes = _u64(buf, index + INDEX_ENTRY_BYTES * c + 8)
        if offset == EMPTY:
            if nbytes != EMPTY:
                return False
            continue
        if offset > limit or nbytes > limit - offset or nbytes < np.uint64(CRC_BYTES):
            return False
        end = start + np.int64(offset + nbytes)
        if _u32(buf, end - CRC_BYTES) != _u32(buf, tail + TAG_HEAD_NBYTES + CRC_BYTES * c):
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _expected_files(buf, offsets, sizes, identities, shards, n_chunks, array_crc, magic, version, ok
                    ):  # pragma: no cover (compiled)
    for i in range(offsets.size):
        start, size = offsets[i], sizes[i]
        ok[i] = (start >= 0 and size >= 0 and start + size <= buf.size
                 and _is_expected(buf, start, size, n_chunks, identities[i], shards[i], array_crc, magic, version))


def expected_files(buffer: np.ndarray, offsets: np.ndarray, sizes: np.ndarray, identities: np.ndarray,
                   shards: np.ndarray, n_chunks: int, array_crc: int, magic: bytes, version: int) -> np.ndarray:
    """Per file, True if it is proven the expected file (see the module invariant); all False where the
    linked crc32c is not available."""
    n = offsets.size
    ok = np.zeros(n, dtype=np.bool_)
    if not AVAILABLE or n == 0:
        return ok
    check_array("buffer", buffer, np.uint8, ndim=1)
    for name, arr in (("offsets", offsets), ("sizes", sizes), ("identities", identities), ("shards", shards)):
        check_array(name, arr, np.int64, shape=(n,))
    _expected_files(buffer, offsets, sizes, identities, shards, np.int64(n_chunks), np.uint32(array_crc),
                    np.uint32(int.from_bytes(magic, "little")), np.uint32(version), ok)
    return ok
