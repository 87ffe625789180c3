"""The disk path: the chunks a batch misses in RAM, read from their shard files many at once.

Invariant: ``FileReads.read`` returns, for each chunk asked for, either its bytes exactly as the shard file
the commit expects holds them (the file's identity checked when its index was read, the chunk's checksum
matching the one its identity tag lists), or "empty" where the index marks the chunk empty and
``ShardedArray.check_empty_chunk`` allows it; otherwise it raises (``OSError`` naming the file for a failed
read, ``CorruptDataError`` for a short read, a missing or misplaced file, a replaced chunk). Nothing is
decoded here: the caller checks and decodes the bytes with the compiled decoders (``_native/decode.py``).

How: each shard's index is parsed once and kept (``ShardedArray``); chunks of one file lying within
``MERGE_GAP`` bytes of each other (a sample's stack spans consecutive chunks) are one read; the reads are
all put to the kernel at once. First pass, by the caller: each read asks for what the page cache holds,
without waiting (``RWF_NOWAIT``). That pass also starts the device reads of the rest: the kernel begins
reading a missing page before it answers ``EAGAIN`` (since Linux 5.9; seen here on 6.18), so once it ends
every read of the batch is in flight at the device, and the caller collects them one after the other
(each waits only for its own, already issued, request). Reads the pass could not start (a kernel before
5.9, a file system that refuses the flag) are issued by ``io_depth`` threads at once (``os.preadv``
releases the GIL), so the device sees up to ``io_depth`` requests in flight instead of one. Why not the
threads for all: they only waited for reads the kernel had started, and handing each to a thread cost
CPU; collected by the caller, 10M Atari forced to disk sampled 17% more b256/s at 15% less CPU a batch
(docs/performance.md). Measured on one VM's disk: ~3,900 random 4 KiB reads/s from one thread, ~22,000/s
with 32 in flight (another's: ~26,000 and ~40,000). Files read this way are opened with
``POSIX_FADV_RANDOM`` (``storage/format/sharded.py``): no readahead, which a memory cgroup would be charged for.
The descriptors stay open while the reads run: they are issued with the array's file lock held
(``ShardedArray.files_held``), in rounds of at most ``SHARDS_PER_ROUND`` files so that none of them is
closed by the array's bound on open files.
"""

from __future__ import annotations

import errno
import functools
import mmap
import os
import queue
import threading
import time
from dataclasses import dataclass

import numpy as np

from mmreplay.errors import CorruptDataError
from mmreplay.storage.format.shardfile import CRC_BYTES, EMPTY
from mmreplay.storage.format.sharded import MAX_OPEN_FILES, ShardedArray

# Chunks of one file this close are read together: a 4 KiB page is read whole anyway, and one request
# costs far more than a few KiB of transfer.
MERGE_GAP = 4096
MAX_MERGED_READ = 1 << 20
SHARDS_PER_ROUND = MAX_OPEN_FILES // 2
# An open and index-tail read that took longer than this waited for the device (a few microseconds from the
# kernel's caches; ~0.1-3 ms cold): the batch's other unopened files are opened at once on the IO threads.
COLD_OPEN_S = 200e-6
EMPTY_INT = int(EMPTY)


@dataclass
class DiskStats:
    """What one column's disk path did. Queue depth: how many reads that had to wait for the device were in
    flight together (of one round: those the page-cache pass started, plus at most ``io_depth`` on the
    threads), averaged over those reads."""
    reads: int = 0  # read requests issued
    bytes: int = 0  # bytes they read
    chunks: int = 0  # chunks they carried
    merged_reads: int = 0  # requests that carried more than one chunk
    page_cache_reads: int = 0  # requests the page cache served at once (no wait for the device)
    rounds: int = 0
    partial_chunks: int = 0  # chunks of which only the bytes a batch needs were read (``reading/runs.py``)
    bytes_skipped: int = 0  # bytes of those chunks not read
    partial_retries: int = 0  # partial reads whose frame checksums failed, read again whole
    max_depth: int = 0
    _depth_sum: int = 0  # sum over reads that waited of the depth they were issued at
    _waited: int = 0

    def count_round(self, sizes: list[int], chunks: int, merged: int, waited: int, depth: int, partial: int = 0,
                    skipped: int = 0) -> None:
        self.partial_chunks += partial
        self.bytes_skipped += skipped
        self.reads += len(sizes)
        self.bytes += sum(sizes)
        self.chunks += chunks
        self.merged_reads += merged
        self.page_cache_reads += len(sizes) - waited
        self.rounds += 1
        self.max_depth = max(self.max_depth, depth)
        self._depth_sum += depth * waited
        self._waited += waited

    def as_dict(self) -> dict:
        return {"reads": self.reads, "bytes_read": self.bytes, "chunks_read": self.chunks,
                "merged_reads": self.merged_reads, "page_cache_reads": self.page_cache_reads,
                "partial_chunks": self.partial_chunks, "bytes_skipped": self.bytes_skipped,
                "partial_retries": self.partial_retries,
                "max_queue_depth": self.max_depth,
                "mean_queue_depth": self._depth_sum / self._waited if self._waited else 0.0}


class ReadBuffers:
    """Buffers the reads land in: pages of their own (``mmap``), not malloc's, kept for the next batch once
    given back (at most ``KEEP``, the largest).

    Why: a batch's reads take ~5-20 MB. From malloc, the first such buffer freed raises glibc's mmap threshold
    to its size, and every later one came from the heap, whose freed space the process kept. Measured on the
    1M DMC store (b256, n-step 3, 64 MB budget, 45 batches): peak RSS 606 MB from malloc, 525 MB with a fixed
    threshold (``MALLOC_MMAP_THRESHOLD_``), 551 MB with these buffers. A kept buffer also spares each batch the
    page faults of fresh pages."""

    KEEP = 1  # a batch reads into one (a second only to read failed partial runs again whole)
    ROUND = 1 << 20  # sizes rounded up to this, so that a batch a little larger than the last reuses a buffer

    def __init__(self):
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        """A buffer of at least ``nbytes`` (uint8; its first ``nbytes`` are the ones to use)."""
        if nbytes <= 0:
            return np.empty(0, dtype=np.uint8)
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.size >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].size))
        size = max(1, -(-nbytes // self.ROUND) * self.ROUND)
        return np.frombuffer(mmap.mmap(-1, size), dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        """``buf`` (from ``take``) is no longer read by anyone."""
        with self._lock:
            self._free.append(buf)
            self._free.sort(key=lambda b: b.size, reverse=True)
            del self._free[self.KEEP:]

    def clear(self) -> None:
        with self._lock:
            self._free.clear()


@dataclass
class ChunkBytes:
    """Chunks read from files: chunk ``i`` is ``sizes[i]`` bytes at ``buffer[pos[i]:]``, unless ``empty[i]``
    (the index marks it empty: zarr's fill value, zeros). Those bytes start at byte ``lo[i]`` of the chunk,
    ``whole[i]`` bytes long, at offset ``offsets[i]`` of its file; a chunk read whole has ``sizes == whole``."""
    buffer: np.ndarray
    pos: np.ndarray
    sizes: np.ndarray
    empty: np.ndarray
    lo: np.ndarray | None = None
    whole: np.ndarray | None = None
    offsets: np.ndarray | None = None
    owner: ReadBuffers | None = None  # where ``buffer``'s memory goes back to (``release``)
    _memory: np.ndarray | None = None

    def release(self) -> None:
        """The bytes are no longer needed (no decode reads them any more): their buffer is kept for another
        batch. Optional: an unreleased buffer is freed with the last reference to it."""
        if self.owner is not None and self._memory is not None:
            memory, self._memory, self.buffer = self._memory, None, np.empty(0, dtype=np.uint8)
            self.owner.give(memory)

    def read_whole(self) -> np.ndarray:
        """Which chunks were read whole (their checksums checked by the decode)."""
        return ~self.empty if self.whole is None else ~self.empty & (self.sizes == self.whole)

    def addresses(self) -> np.ndarray:
        return self.buffer.ctypes.data + self.pos


class _Read:
    """One request: ``nbytes`` at ``offset`` of a shard file into ``view``; ``done`` bytes of it so far;
    ``started``: the kernel already reads the rest (the page-cache pass started it)."""
    __slots__ = ("fd", "offset", "nbytes", "view", "done", "started", "array", "shard", "inner")

    def __init__(self, fd, offset, nbytes, array, shard, inner):
        self.fd, self.offset, self.nbytes, self.array, self.shard, self.inner = fd, offset, nbytes, array, shard, inner
        self.view, self.done, self.started = None, 0, False

    def names(self) -> tuple[str, str]:
        """(the file, the first chunk read) for errors."""
        return self.array.layout.shard_file(self.array.root, self.shard), self.array.where(self.shard, self.inner)


# ``RWF_NOWAIT``: a read the page cache can serve is done at once by the caller (~1-2 us), without handing it
# to a thread (tens of us, more on a busy machine); only the rest waits for the device. Off where the kernel
# lacks the flag, and for the arrays whose file system refuses it (``_refused_roots``: one store on a tmpfs
# that refuses it leaves the other stores of the process their page-cache reads).
_cached_first = hasattr(os, "RWF_NOWAIT")
_refused_roots: set[str] = set()
_preadv = os.preadv  # bound at import: tests that fake ``os.preadv`` aim at the compressed tier's whole-file loads


def _kernel_release() -> tuple[int, int]:
    """(major, minor) of the running kernel, (0, 0) where it cannot be read."""
    try:
        major, minor = os.uname().release.split(".")[:2]
        return int(major), int("".join(c for c in minor if c.isdigit()) or 0)
    except (ValueError, AttributeError):
        return 0, 0


# An ``RWF_NOWAIT`` read that answers ``EAGAIN`` (or stops short) has started the device read of what it
# lacks since Linux 5.9 (read-ahead allowed under ``IOCB_NOWAIT``, which came with io_uring's async buffered
# reads); before, it only refused. Where it starts them, the caller waits for each in turn.
_nowait_starts_reads = _kernel_release() >= (5, 9)


def _read_cached(read: _Read) -> None:
    """As much of ``read`` as the page cache holds now, without waiting for the device; the rest started at
    the device where the kernel does that (``read.started``)."""
    try:
        got = _preadv(read.fd, [read.view[read.done:]], read.offset + read.done, os.RWF_NOWAIT)
    except BlockingIOError:
        read.started = _nowait_starts_reads
        return
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            _refused_roots.add(read.array.root)
        return  # the blocking read tries again, and reports what is wrong
    read.done += max(0, got)
    read.started = _nowait_starts_reads and got > 0  # short of the end: stopped at a page it started to read


def _read_fully(read: _Read) -> None:
    """The rest of ``read`` (from ``read.done``) into ``read.view``, or an error naming the file."""
    while read.done < read.nbytes:
        done = read.done
        try:
            # straight into the batch's buffer: a bytes object per read, made by 32 threads, left freed
            # space in per-thread malloc arenas that the process kept (RSS over the budget)
            got = os.preadv(read.fd, [read.view[done:read.nbytes]], read.offset + done)
        except OSError as exc:
            path, where = read.names()
            raise OSError(exc.errno, f"{exc.strerror} (reading {read.nbytes} bytes at offset {read.offset} of "
                          f"{where})", path) from None
        if got <= 0:
            path, where = read.names()
            raise CorruptDataError(f"{where}: read {done} of {read.nbytes} bytes at offset {read.offset} of "
                                   f"{path} (truncated shard file?)")
        read.done += got


@dataclass
class _Call:
    """A function run on an IO thread (``IoThreads.call``), its result put at ``results[at]``."""
    fn: object
    results: list
    at: int

    def run(self) -> None:
        self.results[self.at] = self.fn()


class IoThreads:
    """``depth`` threads that run reads handed to them; made on first use, and again in a forked child."""

    def __init__(self, depth: int):
        self.depth = depth
        self._queue: queue.SimpleQueue | None = None
        self._threads: list[threading.Thread] = []
        self._pid = -1
        self._lock = threading.Lock()

    def run(self, reads: list[_Read], while_waiting=None) -> tuple[int, int]:
        """Every read done, or the first error raised once all have ended (no thread still writes into
        the caller's buffer after this returns). ``while_waiting()``, when given, is called once every read
        that waits for the device is under way (started by the page-cache pass, or handed to the threads):
        the caller's other work overlaps them; an error it raises is raised once every read ended. Then the
        caller collects the started ones. Returns how many had to wait for the device, and how many of them
        were in flight together at most."""
        if _cached_first:
            for read in reads:
                if read.array.root not in _refused_roots:
                    _read_cached(read)
            reads = [read for read in reads if read.done < read.nbytes]
        started = [read for read in reads if read.started]
        issue = [read for read in reads if not read.started]
        if len(issue) < 2 or self.depth == 1:
            if while_waiting is not None:
                while_waiting()
            for read in started + issue:
                _read_fully(read)
            return len(reads), max(len(started), min(1, len(issue)))
        jobs = self._started()
        done: queue.SimpleQueue = queue.SimpleQueue()
        for read in issue:
            jobs.put((read, done))
        try:
            if while_waiting is not None:
                while_waiting()
            for read in started:
                _read_fully(read)
        finally:  # even when it raised: no read may still be writing into the caller's buffer
            errors = [err for err in (done.get() for _ in issue) if err is not None]
        if errors:
            raise errors[0]
        return len(reads), len(started) + min(self.depth, len(issue))

    def _started(self) -> queue.SimpleQueue:
        with self._lock:
            if self._pid != os.getpid():  # first use, or a forked child: the parent's threads are not here
                self._queue, self._pid = queue.SimpleQueue(), os.getpid()
                self._threads = [threading.Thread(target=self._serve, args=(self._queue,), daemon=True,
                                                  name=f"mmreplay-io-{i}") for i in range(self.depth)]
                for thread in self._threads:
                    thread.start()
            return self._queue

    def call(self, fns: list) -> list:
        """``fn()`` of each of ``fns`` on the threads, all at once; their results, in order, once all have
        ended (the first error raised then)."""
        if len(fns) < 2 or self.depth == 1:
            return [fn() for fn in fns]
        jobs = self._started()
        done: queue.SimpleQueue = queue.SimpleQueue()
        results: list = [None] * len(fns)
        for i, fn in enumerate(fns):
            jobs.put((_Call(fn, results, i), done))
        errors = [err for err in (done.get() for _ in fns) if err is not None]
        if errors:
            raise errors[0]
        return results

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            work, done = job
            try:
                work.run() if isinstance(work, _Call) else _read_fully(work)
            except BaseException as exc:  # handed to the caller, which raises it
                done.put(exc)
            else:
                done.put(None)

    def close(self) -> None:
        """The threads told to end, and waited for (briefly: an idle thread ends at once): each holds a stack
        and, once it allocated, a malloc arena of address space, which a process that opens store after store
        under an address-space limit would otherwise pile up."""
        with self._lock:
            threads = self._threads if self._pid == os.getpid() else []
            for _ in threads:
                self._queue.put(None)
            self._threads, self._queue, self._pid = [], None, -1
        deadline = time.monotonic() + 1.0
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join(max(0.0, deadline - time.monotonic()))


class FileReads:
    """Batched chunk reads of the arrays of one reader, with at most ``io_depth`` in flight."""

    def __init__(self, io_depth: int):
        self.io_depth = int(io_depth)
        self.threads = IoThreads(self.io_depth)
        self.buffers = ReadBuffers()

    def read(self, array: ShardedArray, chunks: np.ndarray, stats: DiskStats, narrow=None,
             while_waiting=None) -> ChunkBytes:
        """The stored bytes of ``chunks`` (global chunk numbers, unique) of ``array`` (see the invariant).
        ``narrow(which, offsets, sizes, listed)``, when given, says which bytes ``[lo, hi)`` of chunks
        ``chunks[which]`` (at file ``offsets``, ``sizes`` bytes, their tag listing checksum ``listed``, -1 for
        none) to read; a chunk not read whole is not checked here (``reading/runs.py`` checks its frames).
        ``while_waiting()``: the caller's work to do while the first round's reads wait for the device
        (``IoThreads.run``); called once (also when nothing is read), unless opening a file fails first."""
        chunks = np.asarray(chunks, dtype=np.int64)
        per = array.layout.chunks_per_shard
        pos = np.zeros(chunks.size, dtype=np.int64)
        sizes = np.zeros(chunks.size, dtype=np.int64)
        empty = np.zeros(chunks.size, dtype=bool)
        lo = np.zeros(chunks.size, dtype=np.int64)
        whole = np.zeros(chunks.size, dtype=np.int64)
        offsets = np.zeros(chunks.size, dtype=np.int64)
        order = np.argsort(chunks, kind="stable")
        shard_of = chunks[order] // per
        bounds = np.flatnonzero(np.diff(shard_of)) + 1
        groups = np.split(order, bounds)  # positions in ``chunks`` per shard, in chunk order
        parts, total, crc_checks = [], 0, []
        for first in range(0, len(groups), SHARDS_PER_ROUND):
            round_groups = groups[first:first + SHARDS_PER_ROUND]
            (memory, buf), got = self._read_round(array, chunks, round_groups, per,
                                                  (pos, sizes, empty, lo, whole, offsets), stats, crc_checks, narrow,
                                                  while_waiting)
            while_waiting = None
            pos[got] += total  # positions in the one buffer all rounds are copied into
            parts.append((memory, buf))
            total += buf.size
        if len(parts) == 1:
            memory, buffer = parts[0]
        else:  # more files than a round holds: one buffer for all (rare: a batch touches few hundred files)
            memory = self.buffers.take(total)
            buffer = memory[:total]
            at = 0
            for part_memory, part in parts:
                buffer[at:at + part.size] = part
                at += part.size
                self.buffers.give(part_memory)
        if while_waiting is not None:  # no chunk to read at all
            while_waiting()
        for i in np.flatnonzero(empty).tolist():  # outside the file lock: it may probe the writer's lock
            array.check_empty_chunk(*divmod(int(chunks[i]), per))
        self._check_tag_crcs(array, chunks, buffer, pos, sizes, crc_checks)
        return ChunkBytes(buffer, pos, sizes, empty, lo, whole, offsets, self.buffers, memory)

    def _read_round(self, array, chunks, groups, per, out, stats, crc_checks, narrow, while_waiting=None):
        """Reads of up to ``SHARDS_PER_ROUND`` files, issued together while their descriptors are held open.
        Fills ``out`` (``pos`` in this round's buffer, bytes read, empty, first byte read, whole size, file
        offset: per chunk); returns the buffer and which chunks got bytes."""
        pos, sizes, empty, lo_of, whole_of, offset_of = out
        reads: list[_Read] = []
        carried: list[int] = []  # chunks per read
        read_of: list[int] = []  # per chunk read: its read, and its place in it
        within: list[int] = []
        which, fds, shards, inners_at, offs, szs, listed = [], [], [], [], [], [], []
        with array.files_held():
            self._open_at_once(array, [int(chunks[group[0]]) // per for group in groups])
            for group in groups:
                shard = int(chunks[group[0]]) // per
                fd, index, crcs = array.open_shard(shard)
                inners = chunks[group] - shard * per
                offsets = [EMPTY_INT] * inners.size if index is None else index[0][inners].tolist()
                nbytes = [0] * inners.size if index is None else index[1][inners].tolist()
                tagged = [-1] * inners.size if crcs is None else crcs[inners].tolist()
                for i, inner, offset, size, crc in zip(group.tolist(), inners.tolist(), offsets, nbytes, tagged):
                    if offset == EMPTY_INT:
                        empty[i] = True
                        continue
                    which.append(i), fds.append(fd), shards.append(shard), inners_at.append(inner)
                    offs.append(offset), szs.append(size), listed.append(int(crc))
            at = np.asarray(which, dtype=np.int64)
            whole = np.asarray(szs, dtype=np.int64)
            if narrow is not None and at.size:
                first, last = narrow(at, np.asarray(offs, dtype=np.int64), whole, np.asarray(listed, dtype=np.int64))
                first, last = first.tolist(), last.tolist()
            else:
                first, last = [0] * at.size, szs
            current, current_shard = None, -1
            for k, i in enumerate(which):
                offset, size = offs[k] + first[k], last[k] - first[k]
                if listed[k] >= 0 and first[k] == 0 and last[k] == szs[k]:
                    crc_checks.append((i, listed[k]))
                if current is not None and current_shard == shards[k] and \
                        current.offset <= offset <= current.offset + current.nbytes + MERGE_GAP \
                        and offset + size - current.offset <= MAX_MERGED_READ:
                    current.nbytes = max(current.nbytes, offset + size - current.offset)
                    carried[-1] += 1
                else:
                    current, current_shard = _Read(fds[k], offset, size, array, shards[k], inners_at[k]), shards[k]
                    reads.append(current)
                    carried.append(1)
                read_of.append(len(reads) - 1)
                within.append(offset - current.offset)
                sizes[i] = size
            lengths = np.array([r.nbytes for r in reads], dtype=np.int64)
            starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
            memory = self.buffers.take(int(starts[-1]))
            buf = memory[:int(starts[-1])]
            view = memoryview(buf)
            for read, start in zip(reads, starts.tolist()):
                read.view = view[start:start + read.nbytes]
            waited, depth = self.threads.run(reads, while_waiting)
        if at.size:
            pos[at] = starts[np.asarray(read_of, dtype=np.int64)] + np.asarray(within, dtype=np.int64)
            lo_of[at] = np.asarray(first, dtype=np.int64)
            whole_of[at] = whole
            offset_of[at] = np.asarray(offs, dtype=np.int64)
        partial = int(np.count_nonzero(sizes[at] < whole)) if at.size else 0
        stats.count_round(lengths.tolist(), len(which), sum(1 for c in carried if c > 1), waited,
                          depth, partial, int((whole - sizes[at]).sum()) if at.size else 0)
        return (memory, buf), at

    def _open_at_once(self, array: ShardedArray, shards: list[int]) -> None:
        """Open the files of ``shards`` not open yet, and read their index tails, on the IO threads at once
        once they turn out cold: right after a restart each open and tail read waits for the device (the
        inode, then the tail), and one after the other they bounded a batch to a few hundred files a second.
        They are opened here one at a time while that takes under ``COLD_OPEN_S`` each (files in the kernel's
        caches: no thread is worth starting); from the first that waited for the device, the rest go to the
        threads. The caller holds the files; what fails here is left to ``open_shard``, which reports it."""
        todo = array.unopened(shards)
        if len(todo) < 2 or self.io_depth == 1:
            return
        for k, shard in enumerate(todo):
            start = time.perf_counter()
            got = array.open_file(shard)
            if got is not None:
                array.adopt_file(shard, *got)
            if time.perf_counter() - start >= COLD_OPEN_S and len(todo) - k > 2:
                rest = todo[k + 1:]
                break
        else:
            return
        opened = self.threads.call([functools.partial(array.open_file, shard) for shard in rest])
        for k, (shard, got) in enumerate(zip(rest, opened)):
            if got is None:
                continue
            try:
                array.adopt_file(shard, *got)
            except BaseException:  # closed by adopt_file; the rest are closed before the error goes on
                for later in opened[k + 1:]:
                    if later is not None:
                        os.close(later[0])
                raise

    @staticmethod
    def _check_tag_crcs(array, chunks, buffer, pos, sizes, crc_checks) -> None:
        """Each chunk's stored checksum (its last 4 bytes) must be the one its file's identity tag lists:
        else the chunk was replaced (the decode's own checksum check would pass on a self-consistent chunk)."""
        if not crc_checks:
            return
        which = np.array([i for i, _ in crc_checks], dtype=np.int64)
        listed = np.array([c for _, c in crc_checks], dtype=np.uint32)
        ends = pos[which] + sizes[which]
        ok = sizes[which] >= CRC_BYTES
        stored = np.zeros(which.size, dtype=np.uint32)
        for k in range(CRC_BYTES):  # little-endian
            stored |= buffer[np.where(ok, ends - CRC_BYTES + k, 0)].astype(np.uint32) << np.uint32(8 * k)
        bad = np.flatnonzero(~ok | (stored != listed))
        if bad.size:
            shard, inner = divmod(int(chunks[which[bad[0]]]), array.layout.chunks_per_shard)
            raise CorruptDataError(f"{array.where(shard, inner)}: chunk checksum differs from the one the shard's "
                                   "identity tag lists (the chunk was replaced)")

    def close(self) -> None:
        self.threads.close()
        self.buffers.clear()
