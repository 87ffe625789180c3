"""The compressed tier: whole shard files of one frame column held in RAM, and where each chunk lies.

Invariant: ``chunk_addr[c] > 0`` iff the bytes of chunk ``c`` (``chunk_size[c]`` of them, checksum included) are
at that address inside ``buffers[c // chunks_per_shard]``, a copy of that shard's file as it was when loaded or
written, and they matched their crc32c when the shard was installed; ``chunk_addr[c] == EMPTY_CHUNK`` iff that
resident shard's index marks the chunk empty (zarr's fill value, zeros); 0 = not resident, which a held shard's
chunk whose checksum failed is too (the files path reads it again and raises ``CorruptDataError`` naming it: a
damaged chunk is an error, never frames). Every index entry held points inside its buffer (checked without
overflow when the shard is installed). A ``load`` never takes the tier past the budget it is given (checked
again under the lock as it installs: the background loader and a batch may load at once, and a partial tier is
full well before the store is held).

Who may change what, and why no decode ever reads a freed or half-installed buffer:
- ``chunk_addr``, ``chunk_size`` and ``buffers`` change only under ``_lock`` (installs, drops, growth),
  from whichever thread: the store's, the writer thread's (``install``), the background loader's.
- Every decode of held bytes runs inside ``reading()``, which holds the same lock from before it reads
  an address until its last byte is decoded (codec helpers included: their part of a call ends before the
  call returns). So a buffer is replaced or freed only when no decode is between reading its address and
  finishing with it, and a decode never sees a shard's addresses and sizes half updated.
- A load (``load``) never installs bytes older than a change the writer made: every writer-side change
  of a shard (``drop``: its file changed or the writer entered it again; ``install``: new bytes) bumps
  that shard's generation, ``drop()`` of everything bumps the epoch, and a load installs only if both
  still equal what the caller saw when it decided to read the file (``generations``, taken by the
  background loader when it lists the shards, before the writer can enter any of them).

Why each chunk's checksum once, at install (``decode.checked_verify_chunks``: one compiled pass a shard), and
decodes of held bytes then told so (``verified``): the integrity boundary is where bytes come into this
process, from a file or another process. Held here, they are trusted as the decoded cache's frames are, never
re-checked; a decode that needs 6 frames of a 16-frame DMC run (~70 KB) no longer computes the crc of the
whole run (12-14% of a DMC batch's CPU). Reads from files, whole or partial, and shared memory check on
every decode.

Why whole shards: a cache miss that goes to a file is a small random read (a few hundred bytes of one
84x84 frame); right after a restart, with a cold page cache, thousands of them per second are what made
sampling 10-20x slower than from RAM. A 1M-transition Atari store is ~0.5 GB compressed: holding it is
cheap next to its ~6.7 GB of decoded frames, and loading it is one sequential read per shard.
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import Callable, NamedTuple

import numpy as np

from mmreplay.errors import CorruptDataError, UnsafeEntryError
from mmreplay._native import bulk
from mmreplay._native import decode as native
from mmreplay.reading.sparse import grown_sparse, sparse_zeros
from mmreplay.storage.files import open_regular
from mmreplay.storage.format.layout import ArrayLayout
from mmreplay.storage.format.shardfile import EMPTY, index_nbytes, parse_index

EMPTY_CHUNK = -1


def _allocate(size: int) -> np.ndarray:
    """A buffer of its own pages: freed to the system when dropped. (From malloc, shards loaded by
    several threads landed in per-thread arenas whose freed space the process kept: +60 MB of RSS each.)"""
    return np.frombuffer(mmap.mmap(-1, max(1, size)), dtype=np.uint8)[:size]


def _page_round(n: int) -> int:
    return -(-n // mmap.PAGESIZE) * mmap.PAGESIZE


class OpenedShards:
    """Shard files of one column opened together (``ResidentShards.open_many``), the kernel already
    reading those not opened ``O_DIRECT`` (``bulk.open_files``); ``read_many`` reads and closes them."""

    def __init__(self, shards: list[int], fds: np.ndarray, sizes: np.ndarray, direct: np.ndarray):
        self.shards, self.fds, self.sizes, self.direct = shards, fds, sizes, direct

    def close(self) -> None:
        bulk.close_files(self.fds)


class ReadShards(NamedTuple):
    """A group of shard files read whole (``ResidentShards.read_many``), not yet checked or held: file ``i``
    with ``take[i]`` is ``base[offsets[i]:offsets[i] + sizes[i]]`` if ``got[i] == sizes[i]``."""
    shards: list
    sizes: np.ndarray
    offsets: np.ndarray
    take: np.ndarray
    got: np.ndarray
    mapping: mmap.mmap
    base: np.ndarray


class ResidentShards:
    """One column's compressed tier: whole shard files in RAM and, per chunk, its address and size there
    (see the module invariant: addresses change only under the lock that every decode holds)."""

    def __init__(self, root: str, layout: ArrayLayout, n_chunks: int):
        self.root = root
        self.layout = layout
        self.per_shard = layout.chunks_per_shard
        # one entry a chunk of the ring, written only for the shards held (``sparse``: RAM for those alone)
        self.chunk_addr = sparse_zeros(n_chunks, np.int64)
        self.chunk_size = sparse_zeros(n_chunks, np.int64)
        self.buffers: dict[int, np.ndarray] = {}
        self.nbytes = 0
        self.loads = 0  # shards read from their files
        self.refused = 0  # size of the last file refused for want of room (a partial tier is full)
        self.bad_chunks = 0  # chunks of installed shards not held: their checksum failed (the files path reports them)
        # shard -> (mapping, offset, bytes) of a shard read by ``read_many`` into a mapping it shares with
        # others of its group: released, its own pages are given back at once (``_release``)
        self._spans: dict[int, tuple[mmap.mmap, int, int]] = {}
        self._generation: dict[int, int] = {}  # shard -> writer-side changes so far (drops and installs)
        self._epoch = 0  # drops of everything so far
        # Reentrant: a decode holding it (``reading``) may load a missing shard whole (``load``).
        self._lock = threading.RLock()
        # ``ShardedArray.check_file``: a loaded file must be the one the commit expects (storage/format/sharded.py)
        self.check_file: Callable[[int, np.ndarray], None] | None = None
        # ``ShardedArray.proven_files``: which of a group read whole are proven the expected files in one
        # compiled call (the others go through ``check_file``)
        self.proven_files: Callable[[list, np.ndarray, np.ndarray, np.ndarray], np.ndarray] | None = None
        # ``ShardedArray.forget``: a shard held here is not read from its file, so the file's cached index
        # (~3 KB a shard, ~30 MB for the 10,000 shards of 10M Atari transitions) is let go once it is held
        self.forget_files: Callable[[list[int]], None] | None = None

    def full(self, budget: int) -> bool:
        """No room for another shard within ``budget`` (judged by the last file refused: shards of one store
        are alike), so a batch does not open a file to learn it again."""
        return self.nbytes >= budget or self.nbytes + self.refused > budget

    def reading(self) -> threading.RLock:
        """Hold while decoding from held bytes (``with res.reading(): ...``): no buffer is replaced or freed
        and no address changes until the block ends."""
        return self._lock

    def generations(self, shards) -> tuple[dict[int, int], int]:
        """What ``load`` must still find to install these shards: their generations and the epoch now."""
        with self._lock:
            return {shard: self._generation.get(shard, 0) for shard in shards}, self._epoch

    def grow_address_space(self, n_chunks: int) -> None:
        if n_chunks > self.chunk_addr.size:
            with self._lock:
                for name in ("chunk_addr", "chunk_size"):
                    setattr(self, name, grown_sparse(getattr(self, name), n_chunks))

    def install(self, shard: int, raw) -> bool:
        """Hold ``raw``, the bytes the writer just wrote to ``shard``'s file, in place of any older copy
        (waiting for decodes that read the older copy to end). A load of the older file still in flight
        will not be installed. False if the bytes are not a well-formed shard (nothing is held then, the
        older copy is dropped; the file path reports what is wrong)."""
        with self._lock:
            generation, epoch = self._generation.get(shard, 0), self._epoch
        if self._install(shard, raw, generation, epoch, replace=True):
            return True
        self.drop([shard])
        return False

    def _install(self, shard: int, raw, generation: int, epoch: int, *, replace: bool,
                 budget: int | None = None, span: tuple[mmap.mmap, int, int] | None = None,
                 index: np.ndarray | None = None) -> bool:
        """``index``: the shard's index, already checked as ``_parse`` would (``proven_files``)."""
        buf = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
        if index is None:
            try:
                index = self._parse(shard, buf)
            except CorruptDataError:
                return False
        used = index[:, 0] != EMPTY
        offsets, sizes = index[used, 0].astype(np.int64), index[used, 1].astype(np.int64)
        sound = native.checked_verify_chunks(buf, offsets, sizes)  # the one check of these bytes (module doc)
        with self._lock:
            if self._generation.get(shard, 0) != generation or self._epoch != epoch:
                return False  # the writer changed the shard since the caller looked: these bytes may be stale
            if shard in self.buffers and not replace:
                return True  # loaded meanwhile by another thread (same file)
            if budget is not None and self.nbytes + buf.nbytes > budget:
                self.refused = buf.nbytes
                return False  # another thread's load took the room meanwhile (a partial tier is full)
            lo = shard * self.per_shard
            if lo + self.per_shard > self.chunk_addr.size:
                return False  # beyond the ring as this reader knows it (an unbounded store grew)
            if replace:  # a load of the older file that is still in flight must not follow these bytes
                self._generation[shard] = generation + 1
            self._release(shard)
            addr = np.full(self.per_shard, EMPTY_CHUNK, dtype=np.int64)
            addr[used] = np.where(sound, buf.ctypes.data + offsets, 0)  # 0: checksum failed, not resident
            self.chunk_size[lo:lo + self.per_shard] = 0
            self.chunk_size[lo:lo + self.per_shard][used] = np.where(sound, sizes, 0)
            self.chunk_addr[lo:lo + self.per_shard] = addr
            self.bad_chunks += int(sound.size - np.count_nonzero(sound))
            self.buffers[shard] = buf
            self.nbytes += buf.nbytes
            if span is not None:
                self._spans[shard] = span
        return True

    def _index_in_place(self, buf: np.ndarray) -> np.ndarray:
        """The (chunks, 2) uint64 index at the end of a shard's bytes, as a view (checked by the caller)."""
        size = index_nbytes(self.per_shard)
        return np.frombuffer(buf, dtype="<u8", count=2 * self.per_shard,
                             offset=buf.size - size).reshape(self.per_shard, 2)

    def _parse(self, shard: int, buf: np.ndarray) -> np.ndarray:
        """The shard's index, every used entry checked to lie inside the chunk data. The check is done so
        that it cannot overflow: ``offset + nbytes`` in uint64 wraps around for a hostile index (offset
        2**64-16, nbytes 32 sums to 16), and the compiled decoder would then read outside the buffer."""
        where = f"array {self.layout.path!r}, shard {shard}"
        size = index_nbytes(self.per_shard)
        if buf.size < size:
            raise CorruptDataError(f"{where}: shard is {buf.size} bytes, smaller than its index")
        index = parse_index(buf[buf.size - size:].tobytes(), self.per_shard, where)
        used = index[:, 0] != EMPTY
        offsets, sizes = index[used, 0], index[used, 1]
        limit = np.uint64(buf.size - size)  # bytes of chunk data
        outside = (offsets > limit) | (sizes > limit - np.minimum(offsets, limit))
        if outside.any():
            inner = int(np.flatnonzero(used)[np.argmax(outside)])
            raise CorruptDataError(f"{where}: index entry of chunk {inner} (offset {int(index[inner, 0])}, "
                                   f"{int(index[inner, 1])} bytes) points past the {int(limit)} bytes of chunk data")
        return index

    def load(self, shard: int, budget: int, expected: tuple[int, int] | None = None) -> bool:
        """Read ``shard``'s file whole and hold it if the tier stays within ``budget`` bytes; False if not,
        or if there is no file or it is malformed (the chunk-by-chunk file path then reads it and reports
        what is wrong). ``expected`` (generation, epoch): what the caller saw when it chose to read the
        file (default: now); if the writer changed the shard since, nothing is installed."""
        generation, epoch = expected if expected is not None else (self._generation.get(shard, 0), self._epoch)
        path = self.layout.shard_file(self.root, shard)
        try:
            fd = open_regular(path)  # never a FIFO (it would hang the loader) or a link out of the store
        except (OSError, UnsafeEntryError):
            return False
        try:
            size = os.fstat(fd).st_size
            if self.nbytes + size > budget:
                self.refused = size
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
        if not self._install(shard, buf, generation, epoch, replace=False, budget=budget):
            return False
        if self.forget_files is not None:
            self.forget_files([shard])
        return True

    def open_many(self, shards: list[int], direct: bool = False) -> OpenedShards:
        """Open the files of ``shards`` (to be read by ``read_many``). ``direct``: with ``O_DIRECT`` where the
        file system allows it (``bulk.open_files``); the others the kernel starts reading now. No Python runs
        per file."""
        fds, sizes, opened_direct = bulk.open_files([self.layout.shard_file(self.root, s) for s in shards], direct)
        return OpenedShards(list(shards), fds, sizes, opened_direct)

    def read_many(self, opened: OpenedShards, budget: int) -> "ReadShards | None":
        """The files of ``opened`` (then closed) that fit ``budget`` as the tier stands, read whole into one
        mapping (each at a page boundary, its pages its own) by one compiled call with the GIL released;
        None if none fits. Touches nothing of the tier: reads of several groups may run at once, on any
        threads, and ``hold_many`` decides what is held."""
        try:
            sizes = opened.sizes
            room = budget - self.nbytes
            offsets = np.zeros(sizes.size, dtype=np.int64)
            take = np.zeros(sizes.size, dtype=bool)
            end = 0
            for i, size in enumerate(sizes.tolist()):
                if size < 0:
                    continue  # no file: the chunk-by-chunk path reads (and reports) it
                if size > room:
                    self.refused = size
                    break  # full: the rest is read from the files
                take[i], offsets[i] = True, end
                room -= size
                end += _page_round(max(1, size))
            if not take.any():
                return None
            mapping = mmap.mmap(-1, end, flags=mmap.MAP_PRIVATE)
            base = np.frombuffer(mapping, dtype=np.uint8)
            got = bulk.read_files(opened.fds, sizes, base, offsets, take, opened.direct)
        finally:
            opened.close()
        return ReadShards(opened.shards, sizes, offsets, take, got, mapping, base)

    def hold_many(self, read: "ReadShards | None", budget: int, expected: tuple[dict[int, int], int]) -> int:
        """Check and hold, like ``load``'s, the shards ``read_many`` read whole, within ``budget``; the pages
        of those not held are given back. ``expected``: (generations, epoch) as ``generations`` gave them
        when the caller listed the shards; a shard changed since is not held. Returns how many were held."""
        if read is None:
            return 0
        generations, epoch = expected
        held: list[int] = []
        whole = read.take & (read.got == read.sizes)
        proven = np.zeros(whole.size, dtype=bool)
        if self.check_file is not None and self.proven_files is not None and whole.any():
            proven[whole] = self.proven_files([read.shards[i] for i in np.flatnonzero(whole).tolist()], read.base,
                                              read.offsets[whole], read.sizes[whole])
        for i in np.flatnonzero(read.take).tolist():
            shard, size, offset = read.shards[i], int(read.sizes[i]), int(read.offsets[i])
            span = (read.mapping, offset, _page_round(max(1, size)))
            buf = read.base[offset:offset + size]
            ok, index = bool(whole[i]), None
            if ok:
                self.loads += 1
                if proven[i]:  # its index checked already: read in place
                    index = self._index_in_place(buf)
                elif self.check_file is not None:
                    try:
                        self.check_file(shard, buf)
                    except CorruptDataError:
                        ok = False  # not held: the file path reads it and reports what it is
            if ok and self._install(shard, buf, generations.get(shard, 0), epoch, replace=False, budget=budget,
                                    span=span, index=index) and self.buffers.get(shard) is buf:
                held.append(shard)
            else:  # not held (refused, or another thread's copy is): its pages are given back
                read.mapping.madvise(mmap.MADV_DONTNEED, span[1], span[2])
        if held and self.forget_files is not None:
            self.forget_files(held)
        return len(held)

    def drop(self, shards=None) -> None:
        """Forget shards (all when None): their files changed, the writer entered them again, or the tier
        is being emptied. Waits for decodes reading them to end."""
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
        span = self._spans.pop(shard, None)
        if span is not None:  # its mapping lives on while other shards of its group are held: free its pages
            span[0].madvise(mmap.MADV_DONTNEED, span[1], span[2])
