"""One shard file, byte for byte as the zarr v3 ``sharding_indexed`` codec defines it.

Invariant: a shard file is the concatenation of its encoded inner chunks followed by the index — one
little-endian ``(offset, nbytes)`` uint64 pair per inner chunk in C order, ``(2**64-1, 2**64-1)`` for an
empty chunk (read as the fill value) — and the crc32c of the index as 4 little-endian bytes. Each inner
chunk is ``compressor(bytes) + crc32c`` (the codecs ``bytes``, ``blosc``/``zstd``, ``crc32c``).
zarr-python and TensorStore read these files; we read them faster by caching the index and issuing
``pread``s for just the chunks a batch needs.

Identity (mmreplay's addition, invisible to zarr): between the chunks and the index lies a *tag*
(``ShardTag``): magic ``MMRS``, the crc32c of the array's path, the shard number, when it was written, a
random nonce and the crc32c of every inner chunk. The crc32c of the whole tail (tag + index + index crc)
is the shard's *identity*; the commit record lists the identity of every sealed shard it covers, and the
write time of its partial one (``storage/format/sharded.py``). A valid
checksum only proves that bytes are intact; the identity proves that the file is the one the commit
expects (not another shard of the store, not an older copy of this one), and the tag's chunk crcs bind
every chunk to it. No index entry points into the tag, so zarr readers never see it.
"""

from __future__ import annotations

import os
import struct
import time
from dataclasses import dataclass

import google_crc32c
import numpy as np

from mmreplay.errors import CorruptDataError

EMPTY = np.uint64(2**64 - 1)
CRC_BYTES = 4


def crc32c(data) -> bytes:
    return struct.pack("<I", google_crc32c.value(data))


def encode_chunk(compressor, chunk: np.ndarray) -> bytes:
    data = compressor.encode(np.ascontiguousarray(chunk))
    return bytes(data) + crc32c(data)


def decode_chunk(compressor, raw: bytes, out: np.ndarray, where) -> None:
    """Check the chunk's crc32c, then decode it straight into ``out`` (a C-contiguous array).
    ``where()`` names the chunk in errors (built only when one happens)."""
    if len(raw) < CRC_BYTES:
        raise CorruptDataError(f"{where()}: chunk is {len(raw)} bytes, shorter than its checksum")
    body = raw[:-CRC_BYTES]
    if google_crc32c.value(body) != int.from_bytes(raw[-CRC_BYTES:], "little"):
        raise CorruptDataError(f"{where()}: checksum mismatch (stored data is corrupt)")
    try:
        compressor.decode(body, out)
    except Exception as exc:  # codec libraries raise a zoo of types, e.g. for a wrong decoded size
        raise CorruptDataError(f"{where()}: chunk does not decode to {out.nbytes} bytes ({exc})") from None


def build_shard(encoded_chunks: list[bytes | None], tag: "ShardTag | None" = None) -> bytes:
    """Concatenate encoded chunks (None = empty), the identity tag (if given) and the index and its
    checksum."""
    index = np.full((len(encoded_chunks), 2), EMPTY, dtype="<u8")
    parts, offset = [], 0
    chunk_crcs = np.zeros(len(encoded_chunks), dtype="<u4")
    for i, chunk in enumerate(encoded_chunks):
        if chunk is None:
            continue
        index[i] = (offset, len(chunk))
        chunk_crcs[i] = int.from_bytes(chunk[-CRC_BYTES:], "little")
        parts.append(chunk)
        offset += len(chunk)
    if tag is not None:
        parts.append(tag.encode(chunk_crcs))
    index_bytes = index.tobytes()
    parts.append(index_bytes)
    parts.append(crc32c(index_bytes))
    return b"".join(parts)


# -- identity ------------------------------------------------------------------------------------
TAG_MAGIC = b"MMRS"
TAG_VERSION = 1
TAG_HEAD = struct.Struct("<4sIIIQQQ")  # magic, version, array crc, n_chunks, shard, written (ns), nonce


def tag_nbytes(n_chunks: int) -> int:
    return TAG_HEAD.size + 4 * n_chunks


def array_crc(path: str) -> int:
    return google_crc32c.value(path.encode())


@dataclass(frozen=True)
class ShardTag:
    """What a shard file says it is: which array (crc32c of its path), which shard, written when (ns
    since the epoch) with which random nonce (two writes of the same rows differ), and each inner chunk's
    crc32c (0 for an empty chunk)."""

    array: int
    shard: int
    written_ns: int = 0
    nonce: int = 0
    chunk_crcs: tuple = ()

    @classmethod
    def new(cls, path: str, shard: int) -> "ShardTag":
        return cls(array_crc(path), shard, time.time_ns(), int.from_bytes(os.urandom(8), "little"))

    def encode(self, chunk_crcs: np.ndarray) -> bytes:
        head = TAG_HEAD.pack(TAG_MAGIC, TAG_VERSION, self.array, len(chunk_crcs), self.shard, self.written_ns,
                             self.nonce)
        return head + np.asarray(chunk_crcs, dtype="<u4").tobytes()

    @classmethod
    def decode(cls, raw: bytes, n_chunks: int) -> "ShardTag | None":
        """The tag at the start of ``raw`` (``tag_nbytes(n_chunks)`` bytes), or None if there is none."""
        if len(raw) != tag_nbytes(n_chunks):
            return None
        magic, version, array, n, shard, written, nonce = TAG_HEAD.unpack_from(raw)
        if magic != TAG_MAGIC or version != TAG_VERSION or n != n_chunks:
            return None
        return cls(array, shard, written, nonce, tuple(np.frombuffer(raw, dtype="<u4", offset=TAG_HEAD.size).tolist()))

    def describe(self, path: str) -> str:
        what = "this array" if self.array == array_crc(path) else "another array"
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.written_ns / 1e9))
        return f"shard {self.shard} of {what}, written {when} UTC (nonce {self.nonce:#x})"


def identity(tail: bytes) -> int:
    """A shard's identity: crc32c of its tail (tag, index, index crc), as the commit record stores it."""
    return google_crc32c.value(tail)


def tail_nbytes(n_chunks: int) -> int:
    return tag_nbytes(n_chunks) + index_nbytes(n_chunks)


def check_written_since(tail: bytes, n_chunks: int, written_ns: int, array_path: str, shard: int, file: str
                        ) -> tuple:
    """Is ``tail`` the tail of shard ``shard``'s file as the commit covers it when the shard is partial:
    tagged as this array's shard ``shard``, written at ``written_ns`` or later (a newer write holds the
    same committed rows; an older copy lacks some)? Returns the tag's chunk crcs, else
    ``CorruptDataError`` naming the file and what it holds."""
    tag = ShardTag.decode(tail[:tag_nbytes(n_chunks)], n_chunks) if len(tail) == tail_nbytes(n_chunks) else None
    if tag is not None and tag.shard == shard and tag.array == array_crc(array_path) and tag.written_ns >= written_ns:
        return tag.chunk_crcs
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(written_ns / 1e9))
    raise _not_the_expected_file(array_path, shard, file, f"this array's shard {shard}, written {when} UTC or "
                                 "later", tag)


def check_identity(tail: bytes, n_chunks: int, expected: int, array_path: str, shard: int, file: str
                   ) -> tuple | None:
    """Is ``tail`` (the last ``tail_nbytes(n_chunks)`` bytes of shard ``shard``'s file, fewer if the file is
    smaller) the tail of the file the commit expects (identity ``expected``)? Returns the tag's chunk
    crcs; raises ``CorruptDataError`` naming the file, what it holds and what was expected."""
    found = identity(tail) if len(tail) == tail_nbytes(n_chunks) else None
    if found == expected:
        tag = ShardTag.decode(tail[:tag_nbytes(n_chunks)], n_chunks)
        if tag is not None and tag.shard == shard and tag.array == array_crc(array_path):
            return tag.chunk_crcs
    tag = ShardTag.decode(tail[:tag_nbytes(n_chunks)], n_chunks) if found is not None else None
    raise _not_the_expected_file(array_path, shard, file, f"identity {expected:#010x}, found "
                                 f"{'none' if found is None else f'{found:#010x}'}", tag)


def _not_the_expected_file(array_path: str, shard: int, file: str, expected: str, tag) -> CorruptDataError:
    holds = tag.describe(array_path) if tag is not None else "no mmreplay shard tag (a file of another store, " \
        "or written before shard identities existed)"
    return CorruptDataError(
        f"array {array_path!r}, shard {shard}: {file} is not the shard file the last commit expects ({expected}); "
        f"it holds {holds}: a misplaced or stale file (a restored backup, a copy, a lost rename?); its rows are "
        "not read")


def index_nbytes(n_chunks: int) -> int:
    return n_chunks * 16 + CRC_BYTES


def parse_index(raw: bytes, n_chunks: int, where: str) -> np.ndarray:
    """The (n_chunks, 2) uint64 index from the tail bytes of a shard file; checksum verified."""
    if len(raw) != index_nbytes(n_chunks):
        raise CorruptDataError(f"{where}: shard index is {len(raw)} bytes, expected {index_nbytes(n_chunks)} "
                               "(truncated shard file?)")
    body, stored = raw[:-CRC_BYTES], raw[-CRC_BYTES:]
    if crc32c(body) != stored:
        raise CorruptDataError(f"{where}: shard index checksum mismatch")
    return np.frombuffer(body, dtype="<u8").reshape(n_chunks, 2)


def read_tail(fd: int, file_size: int, n_chunks: int) -> bytes:
    """The last ``tail_nbytes(n_chunks)`` bytes of the file (all of it if it is smaller)."""
    size = min(file_size, tail_nbytes(n_chunks))
    return os.pread(fd, size, file_size - size)


def index_from_tail(tail: bytes, file_size: int, n_chunks: int, where: str) -> np.ndarray:
    """The checked index from a file's tail (``read_tail``): checksum, and every used entry within the
    chunk data (no offset or size past it; checked without uint64 overflow)."""
    size = index_nbytes(n_chunks)
    if file_size < size or len(tail) < size:
        raise CorruptDataError(f"{where}: shard file is {file_size} bytes, smaller than its index ({size})")
    index = parse_index(tail[len(tail) - size:], n_chunks, where)
    check_bounds(index, file_size - size, where)
    return index


def check_bounds(index: np.ndarray, data_nbytes: int, where: str) -> None:
    """Every used entry (offset, nbytes) lies within ``[0, data_nbytes)``: compared one at a time against
    the limit (``offset <= limit and nbytes <= limit - offset``), never as a sum, which wraps around 2**64."""
    used = index[:, 0] != EMPTY
    offsets, sizes = index[used, 0], index[used, 1]
    limit = np.uint64(data_nbytes)
    if offsets.size and (np.any(offsets > limit) or np.any(sizes > limit - np.minimum(offsets, limit))):
        raise CorruptDataError(f"{where}: shard index points past the chunk data (truncated shard file?)")
    empty_sizes = index[~used, 1]
    if np.any(empty_sizes != EMPTY):
        raise CorruptDataError(f"{where}: shard index marks a chunk empty with a size (damaged index)")


def read_index(fd: int, file_size: int, n_chunks: int, where: str) -> np.ndarray:
    return index_from_tail(read_tail(fd, file_size, n_chunks), file_size, n_chunks, where)
