"""Whole-shard writes and chunk-granular reads of one sharded zarr array, without zarr's per-call cost.

Invariant: ``write_shard`` replaces a shard file atomically (readers see the old or the new file) and
keeps this object's cached index for that shard equal to the file's; ``read_chunk`` returns exactly
what ``zarr.open_array(...)`` returns for that chunk or raises ``CorruptDataError`` naming the array,
shard and chunk. Callers only read rows a commit covers, so a missing shard file and a chunk the index
marks empty are errors too (zarr would read zeros, silently), unless the array was made with
``missing_ok`` (priority buffers, whose never-written shards are zarr's fill value).

Identity: the commit record says which file each shard it covers must be (``expect``): a *sealed* shard
(every row written, not written again this lap) by its identity (``shardfile.identity``: tag and index, so
the tag's chunk crcs bind every chunk); the *partial* shard (the one holding the head, rewritten at every
commit) by its tag's write time, which a file written since (by a commit that crashed before its record,
holding the same committed rows) may exceed but an older copy cannot. Anything else is
``CorruptDataError`` naming the file and what it holds. Shards the record says nothing about (stores
written before identities) are read as before. A reader whose writer is active (``tolerate_mismatch()``)
takes a mismatch as the writer's newer file, which the commit protocol (``CommitWatcher``) already bounds.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Callable

import numpy as np

from mmreplay._native import shardcheck
from mmreplay.errors import CorruptDataError, UnsafeEntryError
from mmreplay.storage.format.codecs import numcodecs_compressor
from mmreplay.storage.files import atomic_write, open_regular
from mmreplay.storage.format.layout import ArrayLayout
from mmreplay.storage.format.shardfile import (CRC_BYTES, EMPTY, TAG_MAGIC, TAG_VERSION, ShardTag, array_crc, build_shard,
                                       check_identity, check_written_since, decode_chunk, encode_chunk, identity,
                                       index_from_tail, read_tail, tag_nbytes, tail_nbytes)

EMPTY_INT = int(EMPTY)


def _as_columns(index: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(offsets, sizes) as two uint64 arrays: 16 bytes a chunk. (Python lists cost ~80 bytes a chunk, ~0.8 GB
    for the indexes of a 10M-frame store, which a reader keeps for every shard it has read from.)"""
    return np.ascontiguousarray(index[:, 0]), np.ascontiguousarray(index[:, 1])


def _index_of(raw: bytes, n: int) -> np.ndarray:
    """The (offset, nbytes) index of ``n`` chunks at the end of shard bytes built here (tagged or not)."""
    return np.frombuffer(raw[len(raw) - n * 16 - CRC_BYTES: len(raw) - CRC_BYTES], dtype="<u8").reshape(n, 2)


def _chunk_end_crcs(buf: np.ndarray, index: np.ndarray) -> np.ndarray:
    """Per chunk of ``index`` (offsets and sizes in ``buf``, a whole shard file's bytes), the little-endian
    crc32c that ends the chunk, as uint32 (0 for an empty chunk)."""
    used = np.flatnonzero(index[:, 0] != EMPTY)
    ends = (index[used, 0] + index[used, 1]).astype(np.int64)
    crcs = np.zeros(len(index), dtype=np.uint32)
    for k in range(CRC_BYTES):
        crcs[used] |= buf[ends - CRC_BYTES + k].astype(np.uint32) << np.uint32(8 * k)
    return crcs


def _max_open_files() -> int:
    """Descriptors one array keeps open: a random batch touches hundreds of shards, and reopening one costs
    ~15 us warm, a device read of its index tail cold; bounded by an eighth of the process's limit (a store
    has several arrays, a process several stores), at most 4096. A cap of 512 thrashed on 1M DMC frames in a
    4 GB cgroup (~1,500 shards outside the RAM tier): 0.81x -> 0.86x of the DrQ-v2 loader with 4096 (the soft
    limit here is 20,000; under the common 1,024 it is 128: raise ``ulimit -n`` for stores larger than RAM)."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):
        return 128
    return 4096 if soft == resource.RLIM_INFINITY else max(16, min(4096, soft // 8))


MAX_OPEN_FILES = _max_open_files()


class ShardedArray:
    """One sharded zarr array on disk, written a whole shard at a time and read a chunk at a time.

    Invariant: each shard's cached index (and chunk crcs) equals the one in that shard's file as last
    written here or checked against the commit record's expectation (``expect``); a shard whose expected
    file changed is read again from disk. Open file descriptors stay at most ``MAX_OPEN_FILES`` (LRU), and
    every method may be called from several threads (one lock guards indexes and descriptors).
    """

    def __init__(self, root: str, layout: ArrayLayout, *, missing_ok: bool = False):
        self.root = root
        self.layout = layout
        self.missing_ok = missing_ok
        self.compressor = numcodecs_compressor(layout.codec, layout.np_dtype)
        self.chunk_shape = (layout.chunk_rows, *layout.row_shape)
        self._indexes: dict[int, np.ndarray | None] = {}  # shard -> index; None = no file (all empty)
        self._chunk_crcs: dict[int, np.ndarray | None] = {}  # shard -> crc32c of each chunk, from its checked tag
        self._fds: OrderedDict[int, int] = OrderedDict()
        self._lock = threading.Lock()
        self.identities: dict[int, int] = {}  # file shard -> identity of its file (expected, or written here)
        self.written_ns: dict[int, int] = {}  # file shard -> write time in the tag of the file written here
        self.partial: tuple[int, int] | None = None  # (file shard, written at or after) of the partial shard
        self.tolerate_mismatch: Callable[[], bool] | None = None

    # -- identity --------------------------------------------------------------------------------
    def expect(self, identities: dict[int, int], partial: tuple[int, int] | None = None) -> None:
        """What a (newly loaded) commit record expects of this array's files: the identities of its sealed
        shards, and (file shard, earliest write time) of its partial one."""
        with self._lock:
            changed = {s for s in set(self.identities) | set(identities)
                       if self.identities.get(s) != identities.get(s)}
            changed |= {p[0] for p in (self.partial, partial) if p is not None and self.partial != partial}
            self.identities, self.partial = dict(identities), partial
            self.written_ns = {} if partial is None else {partial[0]: partial[1]}  # kept by a commit not writing it
            for shard in changed:  # checked against another commit's expectations: check again
                self._indexes.pop(shard, None)
                self._close_fd(shard)

    def _check_tail(self, shard: int, tail: bytes) -> tuple | None:
        """The chunk crcs of the file whose tail this is, if it is the file the commit expects (None: the
        commit expects nothing of it, or a reader's writer is active); else ``CorruptDataError``."""
        n, path = self.layout.chunks_per_shard, self.layout.shard_file(self.root, shard)
        expected, partial = self.identities.get(shard), self.partial
        try:
            if expected is not None:
                return check_identity(tail, n, expected, self.layout.path, shard, path)
            if partial is not None and partial[0] == shard:
                return check_written_since(tail, n, partial[1], self.layout.path, shard, path)
        except CorruptDataError:
            if self.tolerate_mismatch is None or not self.tolerate_mismatch():
                raise
        return None

    def check_empty_chunk(self, shard: int, inner: int) -> None:
        """A row that a commit covers was asked for, and the shard's index marks its chunk empty: another
        file's index, so ``CorruptDataError``; except for priority buffers (``missing_ok``: never-written
        chunks are zarr's fill value) and for a reader whose writer is active (``tolerate_mismatch``): the
        writer may have started the shard's next lap since the reader's commit, and the reader's overwrite
        check discards what it read from it (zarr's fill value, zeros)."""
        if self.missing_ok or (self.tolerate_mismatch is not None and self.tolerate_mismatch()):
            return
        raise CorruptDataError(f"{self.where(shard, inner)}: the shard index marks this chunk empty, but the last "
                               "commit says it holds committed rows (an older or misplaced shard file?)")

    def proven_files(self, shards: list[int], buffer: np.ndarray, offsets: np.ndarray, sizes: np.ndarray
                     ) -> np.ndarray:
        """Per whole shard file read into ``buffer`` (file ``i``: ``sizes[i]`` bytes at ``offsets[i]``), True if
        one compiled check proves it the file the commit expects, each chunk included (``_native/shardcheck``);
        False: not proven, and ``check_file`` decides (the partial shard, a file the commit lists no identity
        for, anything wrong)."""
        partial = self.partial[0] if self.partial is not None else None
        identities = np.array([-1 if s == partial else self.identities.get(s, -1) for s in shards], dtype=np.int64)
        return shardcheck.expected_files(buffer, offsets, sizes, identities, np.asarray(shards, dtype=np.int64),
                                         self.layout.chunks_per_shard, array_crc(self.layout.path), TAG_MAGIC,
                                         TAG_VERSION)

    def check_file(self, shard: int, raw) -> None:
        """``raw`` (a whole shard file read elsewhere, e.g. into the compressed tier) must be a well-formed
        shard (index checksum, every entry within the data: checked without overflow) and, when the commit
        lists an identity for it, the file the commit expects, each chunk included; ``CorruptDataError`` if
        not."""
        buf = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
        n = self.layout.chunks_per_shard
        tail = buf[max(0, buf.size - tail_nbytes(n)):].tobytes()
        index = index_from_tail(tail, buf.size, n, f"array {self.layout.path!r}, shard {shard}")
        crcs = self._check_tail(shard, tail)
        if crcs is None:
            return
        used = np.flatnonzero(index[:, 0] != EMPTY)
        bad = used[_chunk_end_crcs(buf, index)[used] != np.asarray(crcs, dtype=np.uint32)[used]]
        if bad.size:
            raise CorruptDataError(f"{self.where(shard, int(bad[0]))}: chunk checksum differs from the one the "
                                   "shard's identity tag lists (the chunk was replaced)")

    # -- writing ---------------------------------------------------------------------------------
    def encode_shard(self, data: np.ndarray, n_rows: int) -> bytes:
        """Shard bytes for ``data`` (shard_rows rows) whose first ``n_rows`` rows are meaningful."""
        c = self.layout.chunk_rows
        n_used = -(-n_rows // c)
        encoded = [encode_chunk(self.compressor, data[i * c:(i + 1) * c]) for i in range(n_used)]
        return build_shard(encoded + [None] * (self.layout.chunks_per_shard - n_used))  # tagged by install_shard

    def install_shard(self, shard: int, raw: bytes, *, tagged: bool = False) -> str:
        """Write encoded shard bytes atomically: ``build_shard`` output, given this array's identity tag here
        (or already ``tagged``); returns the file path (for a later fsync). The shard's identity becomes
        the new file's."""
        n = self.layout.chunks_per_shard
        if not tagged:
            raw = self.tagged(shard, raw)
        tail = raw[len(raw) - tail_nbytes(n):]
        path = self.layout.shard_file(self.root, shard)
        atomic_write(path, raw, root=self.root)  # its directories made inside the store, never through a link
        with self._lock:
            self._close_fd(shard)
            # Not cached: the first read of the shard (``_adopt``) reads its index from the file (one tail read,
            # checked against the identity set here). A writer that kept every index it wrote held ~2 B a
            # frame forever, allocated on the thread that installs shards between that thread's transient
            # encoding buffers: those small live blocks pinned ~13 B a frame of freed heap that malloc_trim
            # cannot return (the dqn-replay import's RSS grew ~25 instead of ~12 B a transition; 50M: +0.6 GB).
            self._indexes.pop(shard, None)
            self.identities[shard] = identity(bytes(tail))
            self.written_ns[shard] = ShardTag.decode(bytes(tail[:tag_nbytes(n)]), n).written_ns
            self._chunk_crcs.pop(shard, None)  # read from the tag at the next open
        return path

    def tagged(self, shard: int, raw: bytes) -> bytes:
        """Untagged shard bytes (chunks, index, crc) with this array's tag inserted before the index (the
        chunk offsets do not change): the bytes ``install_shard`` writes."""
        n = self.layout.chunks_per_shard
        data_end = len(raw) - n * 16 - CRC_BYTES
        crcs = _chunk_end_crcs(np.frombuffer(raw, dtype=np.uint8), _index_of(raw, n)).astype("<u4")
        tag = ShardTag.new(self.layout.path, shard).encode(crcs)
        return b"".join((raw[:data_end], tag, raw[data_end:]))

    def write_shard(self, shard: int, data: np.ndarray, n_rows: int) -> str:
        return self.install_shard(shard, self.encode_shard(data, n_rows))

    def forget(self, shards=None) -> None:
        """Drop cached indexes and file handles (all, or some shards) after files changed elsewhere."""
        with self._lock:
            for shard in list(self._indexes) if shards is None else shards:
                self._indexes.pop(shard, None)
                self._chunk_crcs.pop(shard, None)
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
            offset = EMPTY_INT if index is None else int(index[0][inner])
            if offset == EMPTY_INT:
                raw = None
            else:
                nbytes = int(index[1][inner])
                raw = os.pread(fd, nbytes, offset)
                if len(raw) != nbytes:
                    raise CorruptDataError(f"{self.where(shard, inner)}: read {len(raw)} of {nbytes} bytes "
                                           "(truncated shard file?)")
                crcs = self._chunk_crcs.get(shard)
                if crcs is not None and raw[-CRC_BYTES:] != int(crcs[inner]).to_bytes(CRC_BYTES, "little"):
                    raise CorruptDataError(f"{self.where(shard, inner)}: chunk checksum differs from the one the "
                                           "shard's identity tag lists (the chunk was replaced)")
        if raw is None:
            self.check_empty_chunk(shard, inner)
            out[...] = 0
        else:  # outside the lock: decoders release the GIL
            decode_chunk(self.compressor, raw, out, lambda: self.where(shard, inner))

    def files_held(self) -> threading.Lock:
        """Hold while reading through descriptors from ``open_shard`` (``with array.files_held(): ...``): none
        of them is closed until the block ends (``reading/disk.py`` reads many chunks at once this way)."""
        return self._lock

    def open_shard(self, shard: int) -> tuple[int, tuple[np.ndarray, np.ndarray] | None, tuple | None]:
        """(descriptor, index as (offsets, sizes) lists, chunk crcs its identity tag lists or None) of shard
        ``shard``'s file, its identity checked as for ``read_chunk``; the caller holds ``files_held()``. The
        descriptor is -1 and the index None when there is no file and the array is ``missing_ok``."""
        fd, index = self._open(shard)
        return fd, index, self._chunk_crcs.get(shard)

    def read_rows(self, start: int, stop: int, damaged: list | None = None) -> np.ndarray:
        """Rows [start, stop) as a new array (used to load resident columns at open). With a ``damaged``
        list, a chunk that cannot be read is zeros and ``(chunk, CorruptDataError)`` is appended to it
        instead of raising: damage stays local to its chunk (``FrameRing.load_staging``)."""
        c = self.layout.chunk_rows
        first, last = start // c, -(-stop // c)
        buf = np.empty(((last - first) * c, *self.layout.row_shape), dtype=self.layout.np_dtype)
        for i, chunk in enumerate(range(first, last)):
            try:
                self.read_chunk(chunk, buf[i * c:(i + 1) * c])
            except CorruptDataError as exc:
                if damaged is None:
                    raise
                buf[i * c:(i + 1) * c] = 0
                damaged.append((chunk, exc))
        return buf[start - first * c: stop - first * c]

    def _open(self, shard: int) -> tuple[int, tuple[np.ndarray, np.ndarray] | None]:
        """The shard's file descriptor and index as (offsets, sizes) lists (caller holds the lock);
        (-1, None) if there is no file."""
        fd = self._fds.get(shard)
        if fd is not None:
            self._fds.move_to_end(shard)
            return fd, self._indexes.get(shard)
        path = self.layout.shard_file(self.root, shard)
        try:
            fd = open_regular(path)  # a FIFO would hang every reader, a link lead out of the store
        except UnsafeEntryError as exc:
            raise CorruptDataError(f"array {self.layout.path!r}, shard {shard}: {exc}") from None
        except FileNotFoundError:
            if not self.missing_ok:
                raise CorruptDataError(f"array {self.layout.path!r}, shard {shard}: file {path} is missing, but the "
                                       "last commit says it holds committed data (deleted or moved?)") from None
            return -1, None  # not remembered: the file may be written later
        return self._adopt(shard, fd, path)

    def unopened(self, shards) -> list[int]:
        """Those of ``shards`` whose file this array holds no descriptor for (caller holds ``files_held()``)."""
        return [s for s in shards if s not in self._fds]

    def open_file(self, shard: int) -> tuple[int, int, bytes] | None:
        """(descriptor, size, index tail) of shard ``shard``'s file, read without touching this array's state,
        so that many files can be opened at once on other threads (each open and tail read of a cold file
        waits for the device); ``adopt_file`` then checks and keeps it. None for any failure: ``open_shard``
        then opens the file itself and reports what is wrong."""
        try:
            fd = open_regular(self.layout.shard_file(self.root, shard))
        except (OSError, UnsafeEntryError):
            return None
        try:
            size = os.fstat(fd).st_size
            return fd, size, read_tail(fd, size, self.layout.chunks_per_shard)
        except OSError:
            os.close(fd)
            return None

    def adopt_file(self, shard: int, fd: int, size: int, tail: bytes) -> None:
        """Keep a file ``open_file`` opened, as ``open_shard`` would have (its identity and index checked,
        errors raised the same way); the caller holds ``files_held()``. A shard opened meanwhile keeps its
        descriptor and this one is closed."""
        if shard in self._fds:
            os.close(fd)
            return
        self._adopt(shard, fd, self.layout.shard_file(self.root, shard), (size, tail))

    def _adopt(self, shard: int, fd: int, path: str, read: tuple[int, bytes] | None = None
               ) -> tuple[int, tuple[np.ndarray, np.ndarray] | None]:
        if hasattr(os, "posix_fadvise"):  # chunk reads are small and random: no readahead (a cgroup pays for it)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        try:
            index = self._indexes.get(shard)
            if index is None:
                index = self._read_checked_index(fd, shard, path, read)
        except OSError as exc:
            os.close(fd)
            raise OSError(exc.errno, f"{exc.strerror} (reading the index of array {self.layout.path!r}, shard "
                          f"{shard})", path) from None
        except BaseException:
            os.close(fd)
            raise
        self._indexes[shard] = index
        self._fds[shard] = fd
        while len(self._fds) > MAX_OPEN_FILES:
            _, old = self._fds.popitem(last=False)
            os.close(old)
        return fd, index

    def _read_checked_index(self, fd: int, shard: int, path: str, read: tuple[int, bytes] | None = None
                            ) -> tuple[np.ndarray, np.ndarray]:
        """The shard's index from its file (``read``: its (size, tail), read already), after checking the
        file's identity (when the commit lists one; the tag's chunk crcs are kept for ``read_chunk``)."""
        n = self.layout.chunks_per_shard
        if read is None:
            size = os.fstat(fd).st_size
            tail = read_tail(fd, size, n)
        else:
            size, tail = read
        crcs = self._check_tail(shard, tail)
        index = _as_columns(index_from_tail(tail, size, n, f"array {self.layout.path!r}, shard {shard}"))
        # 4 bytes a chunk (a tuple of ints costs ~36): a reader keeps these for every shard it read from
        self._chunk_crcs[shard] = None if crcs is None else np.asarray(crcs, dtype=np.uint32)
        return index

    def _close_fd(self, shard: int) -> None:
        fd = self._fds.pop(shard, None)
        if fd is not None:
            os.close(fd)


def verify_shard(array: ShardedArray, shard: int, committed_chunks: int | None = None) -> list[str]:
    """Check shard ``shard``'s file of ``array``: its identity and index, and every chunk decoded (checksum,
    format, decoded size): the problems found. The first ``committed_chunks`` chunks (all if None) hold
    committed rows and must be there; later ones may be empty."""
    layout = array.layout
    array.forget([shard])
    path = layout.shard_file(array.root, shard)
    if not os.path.exists(path):
        return [f"array {layout.path!r}, shard {shard}: file {path} is missing"]
    try:
        with array.files_held():
            _, index, _ = array.open_shard(shard)
    except CorruptDataError as exc:  # the index or identity is bad: every chunk would repeat it
        array.forget([shard])
        return [str(exc)]
    committed = layout.chunks_per_shard if committed_chunks is None else committed_chunks
    problems = []
    out = np.empty(array.chunk_shape, dtype=layout.np_dtype)
    for inner in range(layout.chunks_per_shard):
        if inner >= committed and (index is None or int(index[0][inner]) == EMPTY_INT):
            continue  # beyond the committed rows: empty is right
        try:
            array.read_chunk(shard * layout.chunks_per_shard + inner, out)
        except CorruptDataError as exc:
            problems.append(str(exc))
    array.forget([shard])
    return problems


def shard_identities(arrays, ring, oldest: int, head: int) -> dict[str, dict]:
    """What a commit record of rows ``[oldest, head)`` of ``ring`` (a ``RingGeometry``) expects of the files
    of ``arrays``, per array path: ``{"sealed": [identity or None per file shard], "partial": [file shard,
    written at or after] or None}``. Sealed: the shards from ``oldest``'s to the one before ``head``'s
    (the writer does not write them again this lap); partial: ``head``'s, if it holds committed rows."""
    if head <= oldest:
        return {}
    sealed = {int(ring.file_shard(g)) for g in range(oldest // ring.shard_rows, head // ring.shard_rows)}
    partial = int(ring.file_shard(head // ring.shard_rows)) if head % ring.shard_rows else None
    out = {}
    for array in arrays:
        with array._lock:
            ids, written = dict(array.identities), dict(array.written_ns)
        listed = {s: ids[s] for s in sealed if s in ids}
        entry = {"sealed": [listed.get(s) for s in range(max(listed) + 1)] if listed else [],
                 "partial": [partial, written[partial]] if partial in written else None}
        if listed or entry["partial"]:
            out[array.layout.path] = entry
    return out


def expect_identities(arrays, record: dict | None, tolerate_mismatch: Callable[[], bool] | None = None) -> None:
    """Give each array what ``record`` expects of its files (nothing for records without identities);
    readers pass ``tolerate_mismatch`` (see the module docstring)."""
    listed = (record or {}).get("shard_ids", {})
    for array in arrays:
        entry = listed.get(array.layout.path, {})
        ids = entry.get("sealed", [])
        partial = entry.get("partial")
        array.expect({s: v for s, v in enumerate(ids) if v is not None}, None if partial is None else tuple(partial))
        array.tolerate_mismatch = tolerate_mismatch
