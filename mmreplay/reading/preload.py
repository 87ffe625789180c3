"""The background pass: right after a store opens, its committed shard files read whole into the compressed
tier, so that one sequential pass replaces hundreds of thousands of small random reads.

Invariant: the pass installs a shard only if the writer has not entered, written or dropped it since the pass
listed it, and only into the tier it listed it for (a tier planned again is left alone): the shards are
listed, with their generations and the tier's epoch, before the writer can enter any of them, and
``ResidentShards.hold_many``/``load`` compare those under the tier's lock as they install. It never takes a
tier past its capacity. It ends when every listed shard is held or refused, at ``stop()`` (joined), at the
interpreter's shutdown, or at an ``OSError`` of a reader (no memory for a group's mapping): what it did not
hold is read from the files. Reader threads' bytes not held are given back; their descriptors are closed.

How: shards in file order, ``group_size`` files at a time (``_native/bulk.py``: no Python per file, the GIL
released for every system call), up to ``PRELOAD_READS_AHEAD`` groups at once on reader threads (a cold
restart waits on the device for each file's inode and data: one reader at a time left a fast disk idle),
``O_DIRECT`` where the file system allows it; the pass's own thread proves and holds the groups in order.
One file at a time from Python where ``bulk`` is not available.
"""

from __future__ import annotations

import collections
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

from mmreplay._native import bulk

if TYPE_CHECKING:
    from mmreplay.reading.tiers import ColumnReader

# The pass reads this many bytes of shard files at once (at most this many files), up to PRELOAD_READS_AHEAD
# groups at a time. Small, because a batch's chunk reads wait behind what is queued: on a VM whose disk
# streamed ~100 MB/s from one reader of ~100 KB files, 4 MB groups made batches slower while the tier filled.
PRELOAD_GROUP_BYTES = 1 << 20
PRELOAD_GROUP_FILES = 64
# Groups read at once by the pass's reader threads (each opens its files, then reads them whole).
PRELOAD_READS_AHEAD = 4


class BackgroundPass:
    """The pass of one ``FrameReader`` (see the module invariant): started once, stopped and joined at close.
    It reads the reader's ``columns``, ``ring`` and its planner's ``ring_bytes`` (not imported here: the reader
    owns it)."""

    def __init__(self, reader):
        self.reader = reader
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._reader_threads: set[int] = set()  # idents of the pool threads that have read a group

    def start(self) -> None:
        """List the committed shards and their generations now (the store's state is loading: nothing has
        been added yet), then read them on a daemon thread. Once; a reader without a compressed tier has none."""
        columns = self.reader.columns
        if not any(c.resident is not None for c in columns.values()) or self.thread is not None:
            return
        shards = self._committed_file_shards()
        listed = {name: (col.resident, col.resident.generations(shards))
                  for name, col in columns.items() if col.resident is not None}
        self.thread = threading.Thread(target=self._run, args=(shards, listed), name="mmreplay-preload",
                                       daemon=True)
        self.thread.start()

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the pass to end; called from one of the pass's own threads (a ``Store`` garbage collected
        while that thread ran, whose ``__del__`` closes it), it only returns: that thread cannot wait for the
        pass, which waits for it (the pass ends on its own once stopped)."""
        if self.thread is not None and not self._on_own_thread():
            self.thread.join(timeout)

    def _on_own_thread(self) -> bool:
        me = threading.get_ident()
        return me == self.thread.ident or me in self._reader_threads

    def stop(self) -> None:
        self._stop.set()
        self.join()

    def _committed_file_shards(self) -> list[int]:
        ring = self.reader.ring
        first, last = ring.oldest // ring.shard_rows, ring.staging_shard
        return sorted({ring.file_shard(s) for s in range(first, last)})

    def _run(self, shards: list[int], listed: dict) -> None:
        """``listed``: per column, the tier and the generations (and epoch) its shards had when listed."""
        if not bulk.AVAILABLE:
            self._one_by_one_all(shards, listed)
            return
        step = self.group_size()  # once: a group size that changed mid-pass would skip or repeat shards
        in_flight: collections.deque = collections.deque()
        pool = ThreadPoolExecutor(PRELOAD_READS_AHEAD, thread_name_prefix="mmreplay-preload-read")
        try:
            for lo in range(0, len(shards), step):
                group = shards[lo:lo + step]
                for name, col in list(self.reader.columns.items()):
                    if self._stop.is_set():
                        return
                    if name not in listed or col.resident is not listed[name][0]:
                        continue  # the tiers were planned again: this pass's generations say nothing about them
                    wanted = self._to_load(name, col, group)
                    if wanted:
                        try:
                            in_flight.append((name, col, pool.submit(self._read_group_here, col, wanted)))
                        except RuntimeError:  # the interpreter is shutting down: no new reader may start
                            return
                    while len(in_flight) >= PRELOAD_READS_AHEAD:
                        self._hold_group(in_flight.popleft(), listed)
            while in_flight and not self._stop.is_set():
                self._hold_group(in_flight.popleft(), listed)
        except OSError:
            return  # e.g. no memory for a group's mapping: the tier stays partial, the rest is read from files
        finally:
            for _, _, future in in_flight:
                future.cancel()
            pool.shutdown(wait=True)  # reads in flight end (their descriptors closed); their bytes are dropped

    def _read_group_here(self, col: "ColumnReader", shards: list[int]):
        """``_read_group`` on a pool thread, which is first named as one of the pass's own (see ``join``)."""
        self._reader_threads.add(threading.get_ident())
        return self._read_group(col, shards)

    @staticmethod
    def _read_group(col: "ColumnReader", shards: list[int]):
        """A reader thread's part: the group's files opened (``O_DIRECT`` where allowed: the bytes go from the
        device into the tier's pages, never through the page cache, so they count once against a memory
        cgroup) and read whole."""
        res = col.resident
        return res.read_many(res.open_many(shards, direct=True), col.tier.capacity_bytes)

    def _hold_group(self, entry, listed: dict) -> None:
        name, col, future = entry
        read = future.result()  # an OSError of the reader ends the pass (see ``_run``)
        if col.resident is listed[name][0] and not self._stop.is_set():
            col.resident.hold_many(read, col.tier.capacity_bytes, listed[name][1])

    def _one_by_one_all(self, shards: list[int], listed: dict) -> None:
        for name, col in list(self.reader.columns.items()):
            if name in listed and col.resident is listed[name][0]:
                self._one_by_one(col, shards, listed[name][1])

    def group_size(self) -> int:
        """Shard files a background read takes at once: ~``PRELOAD_GROUP_BYTES`` of them (they are alike)."""
        ring = self.reader.ring
        per_file = sum(self.reader.planner.ring_bytes.values()) / max(1, ring.rows // ring.shard_rows)
        return int(max(1, min(PRELOAD_GROUP_FILES, PRELOAD_GROUP_BYTES // max(1.0, per_file))))

    def _to_load(self, name: str, col: "ColumnReader", group: list[int]) -> list[int]:
        """The shards of ``group`` the tier still lacks and may hold (none once it is full)."""
        res = col.resident
        if res.full(col.tier.capacity_bytes):
            return []
        in_ram = self.reader.ring.ram_shards(name)  # the writer is in them (their rows come from RAM)
        return [s for s in group if s not in res.buffers and s not in in_ram]

    def _one_by_one(self, col: "ColumnReader", group: list[int], expected) -> None:
        generations, epoch = expected
        for shard in self._to_load(col.spec.name, col, group):
            if self._stop.is_set() or col.resident.full(col.tier.capacity_bytes):
                return
            col.resident.load(shard, col.tier.capacity_bytes, (generations[shard], epoch))
