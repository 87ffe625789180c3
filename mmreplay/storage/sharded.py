"""Whole-shard writes and chunk-granular reads of one sharded zarr array, without zarr's per-call cost.

Invariant: ``write_shard`` replaces a shard file atomically (readers see the old or the new file) and
keeps this object's cached index for that shard equal to the file's; ``read_chunk`` returns exactly
what ``zarr.open_array(...)`` returns for that chunk (the fill value 0 for a chunk the index marks empty)
or raises ``CorruptDataError`` naming the array, shard and chunk. A missing shard file is an error too
(callers only read shards a commit covers), unless the array was made with ``missing_ok`` (priority
buffers, whose never-written shards are zarr's fill value): zarr would read it as zeros, silently.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict

import numpy as np

from mmreplay.errors import CorruptDataError
from mmreplay.storage.codecs import numcodecs_compressor
from mmreplay.storage.files import atomic_write
from mmreplay.storage.layout import ArrayLayout
from mmreplay.storage.shardfile import EMPTY, build_shard, decode_chunk, encode_chunk, read_index

EMPTY_INT = int(EMPTY)


def _as_lists(index: np.ndarray) -> tuple[list, list]:
    """(offsets, sizes) as Python lists: indexing them per chunk is several times cheaper than numpy."""
    return index[:, 0].tolist(), index[:, 1].tolist()

MAX_OPEN_FILES = 128


class ShardedArray:
    def __init__(self, root: str, layout: ArrayLayout, *, missing_ok: bool = False):
        self.root = root
        self.layout = layout
        self.missing_ok = missing_ok
        self.compressor = numcodecs_compressor(layout.codec, layout.np_dtype)
        self.chunk_shape = (layout.chunk_rows, *layout.row_shape)
        self._indexes: dict[int, np.ndarray | None] = {}  # shard -> index; None = no file (all empty)
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()

    # -- writing ---------------------------------------------------------------------------------
    def encode_shard(self, data: np.ndarray, n_rows: int) -> bytes:
        """Shard bytes for ``data`` (shard_rows rows) whose first ``n_rows`` rows are meaningful."""
        c = self.layout.chunk_rows
        n_used = -(-n_rows // c)
        encoded = [encode_chunk(self.compressor, data[i * c:(i + 1) * c]) for i in range(n_used)]
        return build_shard(encoded + [None] * (self.layout.chunks_per_shard - n_used))

    def install_shard(self, shard: int, raw: bytes) -> str:
        """Write encoded shard bytes atomically; returns the file path (for a later fsync)."""
        path = self.layout.shard_file(self.root, shard)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        atomic_write(path, raw)
        n = self.layout.chunks_per_shard
        index = np.frombuffer(raw[len(raw) - n * 16 - 4: len(raw) - 4], dtype="<u8").reshape(n, 2)
        with self._lock:
            self._close_fd(shard)
            self._indexes[shard] = _as_lists(index)
        return path

    def write_shard(self, shard: int, data: np.ndarray, n_rows: int) -> str:
        return self.install_shard(shard, self.encode_shard(data, n_rows))

    def forget(self, shards=None) -> None:
        """Drop cached indexes and file handles (all, or some shards) after files changed elsewhere."""
        with self._lock:
            for shard in list(self._indexes) if shards is None else shards:
                self._indexes.pop(shard, None)
                self._close_fd(shard)

    def close(self) -> None:
        self.forget()

    # -- reading ---------------------------------------------------------------------------------
    def where(self, shard: int, inner: int) -> str:
        return f"array {self.layout.path!r}, shard {shard}, chunk {inner}"

    def read_chunk(self, chunk: int, out: np.ndarray) -> None:
        """Decode inner chunk ``chunk`` (global chunk number along axis 0) into ``out``."""
        shard, inner = divmod(int(chunk), self.layout.chunks_per_shard)
        with self._lock:  # the read happens under the lock so no other thread can close the fd meanwhile
            fd, index = self._open(shard)
            if index is None or index[0][inner] == EMPTY_INT:
                raw = None
            else:
                nbytes = index[1][inner]
                raw = os.pread(fd, nbytes, index[0][inner])
                if len(raw) != nbytes:
                    raise CorruptDataError(f"{self.where(shard, inner)}: read {len(raw)} of {nbytes} bytes "
                                           "(truncated shard file?)")
        if raw is None:
            out[...] = 0
        else:  # outside the lock: decoders release the GIL
            decode_chunk(self.compressor, raw, out, lambda: self.where(shard, inner))

    def verify_shard(self, shard: int) -> list[str]:
        """Check a shard file's index and every chunk (checksum and decoded size); the problems found."""
        self.forget([shard])
        path = self.layout.shard_file(self.root, shard)
        if not os.path.exists(path):
            return [f"array {self.layout.path!r}, shard {shard}: file {path} is missing"]
        problems = []
        out = np.empty(self.chunk_shape, dtype=self.layout.np_dtype)
        for inner in range(self.layout.chunks_per_shard):
            try:
                self.read_chunk(shard * self.layout.chunks_per_shard + inner, out)
            except CorruptDataError as exc:
                problems.append(str(exc))
                if "index" in str(exc) or "shard file" in str(exc):
                    break  # the index itself is bad: every chunk would repeat it
        self.forget([shard])
        return problems

    def read_rows(self, start: int, stop: int) -> np.ndarray:
        """Rows [start, stop) as a new array (used to load resident columns at open)."""
        c = self.layout.chunk_rows
        first, last = start // c, -(-stop // c)
        buf = np.empty(((last - first) * c, *self.layout.row_shape), dtype=self.layout.np_dtype)
        for i, chunk in enumerate(range(first, last)):
            self.read_chunk(chunk, buf[i * c:(i + 1) * c])
        return buf[start - first * c: stop - first * c]

    def _open(self, shard: int) -> tuple[int, tuple[list, list] | None]:
        """The shard's file descriptor and index as (offsets, sizes) lists (caller holds the lock);
        (-1, None) if there is no file."""
        fd = self._fds.get(shard)
        if fd is not None:
            self._fds.move_to_end(shard)
            return fd, self._indexes.get(shard)
        path = self.layout.shard_file(self.root, shard)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            if not self.missing_ok:
                raise CorruptDataError(f"array {self.layout.path!r}, shard {shard}: file {path} is missing, but the "
                                       "last commit says it holds committed data (deleted or moved?)") from None
            return -1, None  # not remembered: the file may be written later
        try:
            index = self._indexes.get(shard)
            if index is None:
                index = _as_lists(read_index(fd, os.fstat(fd).st_size, self.layout.chunks_per_shard,
                                             f"array {self.layout.path!r}, shard {shard}"))
        except BaseException:
            os.close(fd)
            raise
        self._indexes[shard] = index
        self._fds[shard] = fd
        while len(self._fds) > MAX_OPEN_FILES:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd, index

    def _close_fd(self, shard: int) -> None:
        fd = self._fds.pop(shard, None)
        if fd is not None:
            os.close(fd)
