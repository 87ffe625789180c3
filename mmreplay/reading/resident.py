"""The compressed tier: whole shard files of one frame column held in RAM, and where each chunk lies.

Invariant: ``chunk_addr[c] > 0`` iff the bytes of chunk ``c`` (``chunk_size[c]`` of them, checksum
included) are at that address inside ``buffers[c // chunks_per_shard]``, a copy of that shard's file
as it was when loaded or written; ``chunk_addr[c] == EMPTY_CHUNK`` iff that resident shard's index
marks the chunk empty (zarr's fill value, zeros); 0 = not resident. A buffer is freed only by
``drop`` (called under the store's lock, as every decode is, so no decode reads a freed buffer);
loads from the background thread only add shards, and only if no ``drop`` of that shard happened
since they started reading (``_generation``), so a file replaced meanwhile is never installed stale.

Why whole shards: a cache miss that goes to a file is a small random read (a few hundred bytes of one
84x84 frame); right after a restart, with a cold page cache, thousands of them per second are what made
sampling 10-20x slower than from RAM. A 1M-transition Atari store is ~0.5 GB compressed: holding it is
cheap next to its ~6.7 GB of decoded frames, and loading it is one sequential read per shard.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Callable

import numpy as np

from mmreplay.errors import CorruptDataError
from mmreplay.storage.layout import ArrayLayout
from mmreplay.storage.shardfile import EMPTY, index_nbytes, parse_index

EMPTY_CHUNK = -1


def _allocate(size: int) -> np.ndarray:
    """A buffer of its own pages: freed to the system when dropped. (From malloc, shards loaded by
    several threads landed in per-thread arenas whose freed space the process kept: +60 MB of RSS each.)"""
    return np.frombuffer(mmap.mmap(-1, max(1, size)), dtype=np.uint8)[:size]


class ResidentShards:
    def __init__(self, root: str, layout: ArrayLayout, n_chunks: int):
        self.root = root
        self.layout = layout
        self.per_shard = layout.chunks_per_shard
        self.chunk_addr = np.zeros(n_chunks, dtype=np.int64)
        self.chunk_size = np.zeros(n_chunks, dtype=np.int64)
        self.buffers: dict[int, np.ndarray] = {}
        self.nbytes = 0
        self.loads = 0  # shards read from their files
        self._generation: dict[int, int] = {}  # shard -> drops so far
        self._epoch = 0  # drops of everything so far
        self._lock = threading.Lock()
        # ``ShardedArray.check_file``: a loaded file must be the one the commit expects (storage/sharded.py)
        self.check_file: Callable[[int, np.ndarray], None] | None = None

    def grow_address_space(self, n_chunks: int) -> None:
        if n_chunks > self.chunk_addr.size:
            with self._lock:
                for name in ("chunk_addr", "chunk_size"):
                    old = getattr(self, name)
                    grown = np.zeros(n_chunks, dtype=np.int64)
                    grown[:old.size] = old
                    setattr(self, name, grown)

    def install(self, shard: int, raw) -> bool:
        """Hold ``raw``, the bytes the writer just wrote to ``shard``'s file, in place of any older copy.
        Safe while decodes run: a shard being written is read from the writer's RAM, not from here.
        False if the bytes are not a well-formed shard (nothing is held; the file path reports it)."""
        return self._install(shard, raw, self._generation.get(shard, 0), replace=True)

    def _install(self, shard: int, raw, generation: int, *, replace: bool, epoch: int | None = None) -> bool:
        epoch = self._epoch if epoch is None else epoch
        buf = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
        try:
            index = self._parse(shard, buf)
        except CorruptDataError:
            return False
        with self._lock:
            if self._generation.get(shard, 0) != generation or self._epoch != epoch:
                return False  # dropped while it was being read: the file changed
            if shard in self.buffers and not replace:
                return True  # loaded meanwhile by another thread (same file): decodes may be using that copy
            self._release(shard)
            lo = shard * self.per_shard
            if lo + self.per_shard > self.chunk_addr.size:
                return False  # beyond the ring as this reader knows it (an unbounded store grew)
            used = index[:, 0] != EMPTY
            base = buf.ctypes.data
            addr = np.full(self.per_shard, EMPTY_CHUNK, dtype=np.int64)
            addr[used] = base + index[used, 0].astype(np.int64)
            self.chunk_size[lo:lo + self.per_shard] = np.where(used, index[:, 1], 0).astype(np.int64)
            self.chunk_addr[lo:lo + self.per_shard] = addr
            self.buffers[shard] = buf
            self.nbytes += buf.nbytes
        return True

    def _parse(self, shard: int, buf: np.ndarray) -> np.ndarray:
        where = f"array {self.layout.path!r}, shard {shard}"
        size = index_nbytes(self.per_shard)
        if buf.size < size:
            raise CorruptDataError(f"{where}: shard is {buf.size} bytes, smaller than its index")
        index = parse_index(buf[buf.size - size:].tobytes(), self.per_shard, where)
        used = index[:, 0] != EMPTY
        if used.any() and int((index[used, 0] + index[used, 1]).max()) > buf.size - size:
            raise CorruptDataError(f"{where}: shard index points past the chunk data")
        return index

    def load(self, shard: int, budget: int) -> bool:
        """Read ``shard``'s file whole and hold it if the tier stays within ``budget`` bytes; False if not,
        or if there is no file or it is malformed (the chunk-by-chunk file path then reads it and reports
        what is wrong)."""
        generation, epoch = self._generation.get(shard, 0), self._epoch
        path = self.layout.shard_file(self.root, shard)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return False
        try:
            size = os.fstat(fd).st_size
            if self.nbytes + size > budget:
                return False
            buf = _allocate(size)
            view, done = memoryview(buf), 0
            while done < size:  # readv releases the GIL: sampling goes on while a loader reads
                got = os.preadv(fd, [view[done:]], done)
                if got <= 0:
                    return False
                done += got
            if hasattr(os, "posix_fadvise"):  # we hold the bytes now: the page cache copy is redundant
                os.posix_fadvise(fd, 0, size, os.POSIX_FADV_DONTNEED)
        except OSError:
            return False
        finally:
            os.close(fd)
        self.loads += 1
        if self.check_file is not None:
            try:
                self.check_file(shard, buf)
            except CorruptDataError:
                return False  # not held: the file path reads it and reports what it is
        return self._install(shard, buf, generation, replace=False, epoch=epoch)

    def drop(self, shards=None) -> None:
        """Forget shards (all when None): their files changed, or the tier is being emptied."""
        with self._lock:
            if shards is None:
                self._epoch += 1
            for shard in list(self.buffers) if shards is None else shards:
                self._generation[shard] = self._generation.get(shard, 0) + 1
                self._release(shard)

    def _release(self, shard: int) -> None:
        buf = self.buffers.pop(shard, None)
        if buf is not None:
            lo = shard * self.per_shard
            self.chunk_addr[lo:lo + self.per_shard] = 0
            self.chunk_size[lo:lo + self.per_shard] = 0
            self.nbytes -= buf.nbytes
