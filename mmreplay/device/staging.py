"""Gather: a batch's compressed frame bytes, from wherever they lie, checked and cut, in one staging buffer.

Invariant: every byte put in the staging buffer for a stored chunk passed the chunk's crc32c (and, for a shard
file, the crc its identity tag lists) here on the CPU, and its headers passed the codec's checks
(``FrameCodec.device_pieces``) before anything is decoded; a chunk that fails either is a ``CorruptDataError``
naming it, and nothing of that batch is staged. Bytes are taken from, in this order:

- the writer's RAM (the staging and sealed shards, ``FrameRing.ram_shards``): rows stored as they are (pieces
  to copy);
- the compressed tier (``ResidentShards``), read under its ``reading()`` lock so that no buffer moves;
- the shard file (``ShardedArray.open_shard`` + ``pread``);

a chunk the index marks empty is zeros where ``ShardedArray.check_empty_chunk`` allows it. The reader's state is
only read here (its tiers are the reader's business); this runs under the store's lock, like the CPU path's
gather, so that the reader's overwrite check covers what was staged.

Every key of the batch shares the one buffer: a copy to the device is one transfer (``Staged.to_device``).
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field

import google_crc32c
import numpy as np

from mmreplay.codecs.base import PIECE_COPY
from mmreplay.errors import CorruptDataError
from mmreplay.reading.resident import EMPTY_CHUNK

CRC_BYTES = 4
EMPTY_OFFSET = 2**64 - 1
ROW_ZERO = np.zeros(1, dtype=np.int64)  # the row a one-frame chunk is asked for


@dataclass
class KeyPlan:
    """One observation key of a staged batch: its decoded frames form a table of ``n_rows`` rows of
    ``row_nbytes`` bytes at byte ``table_at`` of the batch's decode buffer, then one row of zeros (row
    ``n_rows``: what padding positions gather, ``device/assemble.py``); ``row_of`` maps each frame id
    asked for (``ids``, sorted) to its table row; ``refs`` / ``depth`` say, per table row, the row its bytes
    are a residual from (-1: none) and how many references lead to a row decoded as it is."""
    name: str
    shape: tuple
    dtype: np.dtype
    row_nbytes: int
    ids: np.ndarray
    row_of: np.ndarray
    n_rows: int
    table_at: int
    refs: np.ndarray
    depth: np.ndarray


@dataclass
class Staged:
    """A batch's compressed bytes in one buffer (``host``: numpy, pinned when asked) and what to do with them:
    piece ``i`` of kind ``kinds[i]`` is ``host[src[i, 0]:src[i, 1]]`` and decodes into bytes ``dst[i]`` of the
    decode buffer (``decoded_nbytes`` bytes: every key's table and zero row, one after the other)."""
    host: np.ndarray
    pinned: object  # the torch tensor ``host`` views when pinned (kept alive with it), or None
    kinds: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    decoded_nbytes: int
    keys: dict = field(default_factory=dict)
    chunks: int = 0  # chunks staged (for statistics)

    @property
    def nbytes(self) -> int:
        return int(self.host.size)


def chunk_body(col, chunk: int):
    """The stored bytes of ``col``'s chunk ``chunk`` with its checksum checked and removed, or None when the
    shard's index marks it empty and that is allowed (zeros). ``col`` is a ``ColumnReader``."""
    array = col.column.array
    shard, inner = divmod(int(chunk), col.column.layout.chunks_per_shard)
    raw = None
    res = col.resident
    if res is not None:
        with res.reading():  # no buffer of the tier is freed or moved while its bytes are copied out
            addr = int(res.chunk_addr[chunk]) if chunk < res.chunk_addr.size else 0
            if addr > 0:
                raw = ctypes.string_at(addr, int(res.chunk_size[chunk]))
            elif addr == EMPTY_CHUNK:
                array.check_empty_chunk(shard, inner)
                return None
    if raw is None:
        with array.files_held():
            fd, index, crcs = array.open_shard(shard)
            offset = EMPTY_OFFSET if index is None else int(index[0][inner])
            if offset == EMPTY_OFFSET:
                fd = -1
            else:
                nbytes = int(index[1][inner])
                raw = os.pread(fd, nbytes, offset)
                if len(raw) != nbytes:
                    raise CorruptDataError(f"{array.where(shard, inner)}: read {len(raw)} of {nbytes} bytes "
                                           "(truncated shard file?)")
                if crcs is not None and raw[-CRC_BYTES:] != int(crcs[inner]).to_bytes(CRC_BYTES, "little"):
                    raise CorruptDataError(f"{array.where(shard, inner)}: chunk checksum differs from the one the "
                                           "shard's identity tag lists (the chunk was replaced)")
        if fd == -1:
            array.check_empty_chunk(shard, inner)
            return None
    if len(raw) < CRC_BYTES:
        raise CorruptDataError(f"{array.where(shard, inner)}: chunk is {len(raw)} bytes, shorter than its checksum")
    body = raw[:-CRC_BYTES]
    if google_crc32c.value(body) != int.from_bytes(raw[-CRC_BYTES:], "little"):
        raise CorruptDataError(f"{array.where(shard, inner)}: checksum mismatch (stored data is corrupt)")
    return body


def stage(reader, wanted: dict[str, np.ndarray], *, pin: bool = False) -> Staged:
    """Gather the compressed bytes of the frames ``wanted`` (observation key -> frame ids, any shape, each
    ``reader.ring.oldest <= id < head``) of ``reader`` (a ``FrameReader``) into one staging buffer, with the
    pieces each decodes to (module docstring). ``pin``: the buffer is pinned host memory (a CUDA copy)."""
    parts: list = []  # bytes objects / arrays, concatenated at the end
    kinds, srcs, dsts = [], [], []
    at = 0  # bytes staged so far
    table_at = 0
    keys = {}
    n_chunks = 0
    for name, ids in wanted.items():
        col = reader.columns[name]
        spec = col.spec
        c, row_nbytes = int(spec.chunk_rows), int(spec.row_nbytes)
        codec = col.column.array.compressor
        ids = np.unique(np.asarray(ids, dtype=np.int64).reshape(-1))
        rows = reader.ring.row_of(ids)
        chunks, inner = np.divmod(rows, c)
        # ids are sorted, but a ring's rows wrap: group by chunk wherever its ids lie
        order = np.argsort(chunks, kind="stable")
        chunks_sorted, inner_sorted = chunks[order], inner[order]
        starts = np.flatnonzero(np.r_[True, chunks_sorted[1:] != chunks_sorted[:-1]]) if ids.size else \
            np.zeros(0, dtype=np.int64)
        bounds = np.r_[starts, ids.size]
        ram = reader.ring.ram_shards(name)
        per = reader.ring.shard_rows
        row_of = np.empty(ids.size, dtype=np.int64)
        refs_parts, n_rows = [], 0
        for g in range(starts.size):
            chunk = int(chunks_sorted[bounds[g]])
            want = ROW_ZERO if c == 1 else np.unique(inner_sorted[bounds[g]:bounds[g + 1]])
            shard = chunk * c // per
            body = None
            if shard in ram:
                offset = chunk * c - shard * per
                held = np.ascontiguousarray(ram[shard][offset:offset + c]).reshape(-1).view(np.uint8)
                pieces = _copy_all(c, row_nbytes)
                parts.append(held)
                body_nbytes = held.size
            else:
                body = chunk_body(col, chunk)
                if body is None:  # empty (allowed): zeros, as the CPU path reads it
                    parts.append(np.zeros(c * row_nbytes, dtype=np.uint8))
                    pieces, body_nbytes = _copy_all(c, row_nbytes), c * row_nbytes
                else:
                    try:
                        pieces = codec.device_pieces(body, c, row_nbytes, want)
                    except ValueError as exc:
                        shard_no, inner_no = divmod(chunk, col.column.layout.chunks_per_shard)
                        raise CorruptDataError(f"{col.column.array.where(shard_no, inner_no)}: {exc}") from None
                    parts.append(body)
                    body_nbytes = len(body)
            n_chunks += 1
            kinds.append(pieces.kinds)
            srcs.append(pieces.src + at)
            if c == 1:  # one frame a chunk: table row n_rows, decoded as it is
                dsts.append(pieces.dst + (table_at + n_rows * row_nbytes))
                refs_parts.append(pieces.refs)
                row_of[order[bounds[g]:bounds[g + 1]]] = n_rows
            else:  # table rows of this chunk: its produced rows, in order
                local = np.full(c, -1, dtype=np.int64)
                local[pieces.rows] = n_rows + np.arange(pieces.rows.size)
                piece_rows = pieces.dst[:, 0] // row_nbytes
                dst = (local[piece_rows] * row_nbytes + pieces.dst[:, 0] - piece_rows * row_nbytes)[:, None] + \
                    (pieces.dst - pieces.dst[:, :1])
                dsts.append(dst + table_at)
                refs_parts.append(np.where(pieces.refs >= 0, local[np.maximum(pieces.refs, 0)], -1))
                row_of[order[bounds[g]:bounds[g + 1]]] = local[inner_sorted[bounds[g]:bounds[g + 1]]]
            n_rows += pieces.rows.size
            at += body_nbytes
        refs = np.concatenate(refs_parts) if refs_parts else np.zeros(0, dtype=np.int64)
        keys[name] = KeyPlan(name, tuple(spec.shape), np.dtype(spec.np_dtype), row_nbytes, ids, row_of, n_rows,
                             table_at, refs, chain_depths(refs))
        table_at += (n_rows + 1) * row_nbytes  # the table, then its zero row
    host, pinned = _buffer(at, pin)
    pos = 0
    for part in parts:
        n = len(part)
        host[pos:pos + n] = np.frombuffer(part, dtype=np.uint8) if not isinstance(part, np.ndarray) else part
        pos += n
    cat = (lambda xs, shape: np.concatenate(xs) if xs else np.zeros(shape, dtype=np.int64))
    return Staged(host, pinned, cat(kinds, (0,)).astype(np.int8), cat(srcs, (0, 2)), cat(dsts, (0, 2)), table_at,
                  keys, n_chunks)


def _copy_all(c: int, row_nbytes: int):
    """Pieces for a chunk held as it is: one copy, every row."""
    from mmreplay.codecs.base import whole_chunk_pieces

    return whole_chunk_pieces(PIECE_COPY, c * row_nbytes, c * row_nbytes, c)


def _buffer(nbytes: int, pin: bool):
    if not pin:
        return np.empty(nbytes, dtype=np.uint8), None
    import torch

    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    return pinned.numpy(), pinned


def chain_depths(refs: np.ndarray) -> np.ndarray:
    """Per table row, the references from it to a row decoded as it is (``refs``: each row's reference row or -1;
    the codecs' header checks guarantee the references end). Vectorised: one pass per chain step."""
    depth = np.where(refs < 0, 0, -1).astype(np.int64)
    for _ in range(refs.size):
        todo = np.flatnonzero(depth < 0)
        if not todo.size:
            return depth
        ready = todo[depth[refs[todo]] >= 0]
        if not ready.size:
            break
        depth[ready] = depth[refs[ready]] + 1
    if (depth < 0).any():
        raise CorruptDataError(f"frame references form a cycle (table rows {np.flatnonzero(depth < 0)[:8].tolist()})")
    return depth
