"""One shard file, byte for byte as the zarr v3 ``sharding_indexed`` codec defines it.

Invariant: a shard file is the concatenation of its encoded inner chunks followed by the index — one
little-endian ``(offset, nbytes)`` uint64 pair per inner chunk in C order, ``(2**64-1, 2**64-1)`` for an
empty chunk (read as the fill value) — and the crc32c of the index as 4 little-endian bytes. Each inner
chunk is ``compressor(bytes) + crc32c`` (the codecs ``bytes``, ``blosc``/``zstd``, ``crc32c``).
zarr-python and TensorStore read these files; we read them faster by caching the index and issuing
``pread``s for just the chunks a batch needs.
"""

from __future__ import annotations

import os
import struct

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


def build_shard(encoded_chunks: list[bytes | None]) -> bytes:
    """Concatenate encoded chunks (None = empty) and append the index and its checksum."""
    index = np.full((len(encoded_chunks), 2), EMPTY, dtype="<u8")
    parts, offset = [], 0
    for i, chunk in enumerate(encoded_chunks):
        if chunk is None:
            continue
        index[i] = (offset, len(chunk))
        parts.append(chunk)
        offset += len(chunk)
    index_bytes = index.tobytes()
    parts.append(index_bytes)
    parts.append(crc32c(index_bytes))
    return b"".join(parts)


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


def read_index(fd: int, file_size: int, n_chunks: int, where: str) -> np.ndarray:
    size = index_nbytes(n_chunks)
    if file_size < size:
        raise CorruptDataError(f"{where}: shard file is {file_size} bytes, smaller than its index ({size})")
    index = parse_index(os.pread(fd, size, file_size - size), n_chunks, where)
    used = index[:, 0] != EMPTY
    ends = index[used, 0] + index[used, 1]
    if ends.size and int(ends.max()) > file_size - size:
        raise CorruptDataError(f"{where}: shard index points past the chunk data (truncated shard file?)")
    return index
