"""Frame ids in, decoded pixels out: the read half of the frame ring.

Invariant: ``gather``/``gather_stacks`` write exactly the frames the ring stores under the ids asked
for (the caller guarantees ``ring.oldest <= id < ring.head``), or raise; a failed read leaves no chunk
of that batch in the cache. Each frame passes through at most three tiers:

1. the **decoded cache** (``reading/cache.py``), a hit costs a copy;
2. the **compressed tier** (``reading/resident.py``), whole shard files held in RAM: a miss there is
   decoded by compiled code (``_native/decode.py``) with no Python per chunk and the GIL released,
   shared with the codec helpers when a batch has many;
3. the **file** (``reading/disk.py``): the chunks of shards the compressed tier does not hold (a store larger
   than its share of the budget: the tier then holds as many whole shards as fit), all of a batch's read
   together, merged where they lie together, ``io_depth`` reads in flight, then decoded by the same compiled
   code; rows still in the writer's RAM (the staging and sealed shards) are copied from there instead.

The reader learns of writes through ``FrameEvents`` (it is the ring's listener): shards written or
changed elsewhere, rows about to be overwritten, a ring that grew. A batch holds its column's compressed
tier still while it decodes (``ResidentShards.reading``), so the writer thread's installs and the
background pass (``reading/preload.py``) never free or move bytes under a decode; the pass installs no
shard that the writer entered, wrote or dropped after the pass listed it. The budget (``cache_bytes``)
is split between the tiers by ``plan_tiers``; when the decoded cache could hold only a small share of the
frames, frames are decoded straight into the batch instead (``_decode_into_batch``), and when the compressed
frames do not fit beside a useful decoded cache, nearly all of the budget goes to the compressed tier.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from mmreplay.errors import CorruptDataError
from mmreplay._native.bounds import address_of
from mmreplay._native import decode as native
from mmreplay.reading.disk import FileReads
from mmreplay.reading.preload import BackgroundPass
from mmreplay.settings import DEFAULT_IO_DEPTH
from mmreplay._native.gather import checked_gather_cached, checked_gather_stacks, checked_index_cached
from mmreplay._native.helpers import DECODES_PER_PIECE, RUNS_PER_PIECE, STACKS_PER_PIECE, codec_helpers
from mmreplay.reading.resident import EMPTY_CHUNK
from mmreplay.reading.tiers import ColumnReader, decodes_direct, plan_tiers
from mmreplay.index.frame_ring import FrameEvents, FrameRing

# From this many stacks a batch's copy out of the decoded slab, and from this many decodes its decodes, are
# shared with the codec helpers (``_native/helpers.py``: a piece of ~10-20 us costs two atomic operations
# to hand over); below, one compiled call in the caller's thread is cheaper.
SHARED_MIN_STACKS = 2 * STACKS_PER_PIECE
# ... and the copy only from this many bytes: handing over and waiting for the helpers costs ~10 us a batch,
# the copy of a low-dim batch (32 stacks of 16-byte rows) well under 1 us (~10% of low-dim batch-32's time).
SHARED_MIN_STACK_BYTES = 256 * 1024
SHARED_MIN_DECODES = 2 * DECODES_PER_PIECE
SHARED_MIN_RUNS = 2 * RUNS_PER_PIECE
# Frames keep at least this much of a budget that the index ring takes nearly all of (one batch's frames fit
# anyway: the decoded slab grows to hold a batch, ``ChunkCache``).
MIN_FRAME_BUDGET = 4 << 20
# What a frame compresses to before any shard of it was written (Atari frames: ~13x with lz4).
ASSUMED_RATIO = 8.0


class FrameReader(FrameEvents):
    """The read half of the frame ring for one store (see the module invariant): per observation key a
    ``ColumnReader`` (decoded cache, compressed tier, disk reader) planned from one budget, kept in step
    with the writer through the ring's events."""

    def __init__(self, ring: FrameRing, cache_bytes: int, *, preload: bool = True, io_depth: int = DEFAULT_IO_DEPTH,
                 partial_reads: bool = True, held_elsewhere: int = 0, codec_threads: int | None = None):
        self.ring = ring
        # the session's Settings.codec_threads: the process's helper threads are made, with it, by the first
        # batch any store of the process decodes (``_native/helpers.py``)
        self.codec_threads = codec_threads
        self.cache_bytes = int(cache_bytes)
        self.partial_reads = partial_reads  # runs read from files only in the bytes a batch needs (reading/runs.py)
        # what the store holds in RAM besides frames (its index ring and columns): paid for from the budget
        self.held_elsewhere = int(held_elsewhere)
        self.disk = FileReads(io_depth)
        ring_bytes, measured = self._compressed_ring_bytes(ring)
        self.columns: dict[str, ColumnReader] = {}
        self._plan(ring_bytes)
        # A new store's compression is a guess until its first shard is written: then the tiers are planned
        # again from the real figure (``shard_written`` measures, the next read re-plans, under the lock).
        self._measured = measured
        self._replan_with: dict[str, int] | None = None
        self.background = BackgroundPass(self)
        self._file_reads: ThreadPoolExecutor | None = None  # see _read_runs_beside
        self._file_reads_pid = -1
        self._file_reads_lock = threading.Lock()
        ring.listener = self
        if preload:
            self.start_preload()

    def _rows_to_plan(self) -> int:
        """Frames the tiers are planned for: twice those the store holds (it may be filling), at least a
        shard, at most the ring. A store made for 1M transitions holding 20k is planned as one holding 40k:
        planned for its capacity, it would give its whole budget to a compressed tier it does not fill and
        turn off a decoded cache that holds all it has (measured: sampling ~2x slower)."""
        ring = self.ring
        held = max(0, ring.head - ring.oldest)
        return min(ring.rows, max(ring.shard_rows, 2 * held))

    def _plan(self, ring_bytes: dict[str, int]) -> None:
        """(Re)build each column's tiers for ``_rows_to_plan()`` frames of a ring whose frames would take
        ``ring_bytes`` compressed bytes per column if it were full. A column's compressed shards already held
        stay held (they are the same bytes); its decoded cache stays unless its role changed."""
        ring = self.ring
        self.ring_bytes = ring_bytes  # compressed bytes of each column's ring, as planned
        self._planned_rows = rows = self._rows_to_plan()
        ring_bytes = {name: int(b * rows / ring.rows) for name, b in ring_bytes.items()}
        decoded_ring = sum(max(1, c.spec.row_nbytes) * rows for c in ring.columns.values())
        self.plan = plan_tiers(self.frame_budget(), sum(ring_bytes.values()), decoded_ring)
        total_row_bytes = sum(max(1, c.spec.row_nbytes) for c in ring.columns.values())
        compressed = sum(ring_bytes.values())
        for name, col in ring.columns.items():
            share = max(1, col.spec.row_nbytes) / total_row_bytes
            # each column's tier: its share of the compressed frames (all of its ring when the plan holds all)
            resident = ring_bytes[name] if self.plan.resident_bytes >= compressed else \
                int(self.plan.resident_bytes * ring_bytes[name] / max(1, compressed))
            decoded = int(self.plan.decoded_bytes * share)
            old = self.columns.get(name)
            # the decoded cache stays (warm, and sized when the store opened) unless its role changed
            keep = old is not None and old.direct == (self.plan.direct and old.resident is not None
                                                      and decodes_direct(old.decodes_runs, col.spec.chunk_rows))
            # a partial tier: the runs it lacks are read from their files, only in part where they can be
            partial = self.plan.resident_bytes < compressed and self.partial_reads
            new = ColumnReader(col, ring, decoded, resident, self.plan.direct, cache=old.cache if keep else None,
                               partial_reads=partial)
            if old is not None and old.runs is not None and new.runs is not None:
                new.runs = old.runs
            if new.resident is not None:
                new.resident.check_file = col.array.check_file  # only the files the commit expects are held
                new.resident.proven_files = col.array.proven_files
                new.resident.forget_files = col.array.forget
            if old is not None:
                new.tier.hits, new.tier.misses = old.tier.hits, old.tier.misses
                new.cache.stats.hits, new.cache.stats.misses = old.cache.stats.hits, old.cache.stats.misses
                new.disk = old.disk
                if old.resident is not None and new.resident is not None:
                    new.resident = old.resident
                elif old.resident is not None:
                    old.resident.drop()
            self.columns[name] = new

    def frame_budget(self) -> int:
        """What the budget leaves for frames once the store's other RAM (its index ring) is paid for: the
        budget is everything the store holds for reading (``Settings.cache_bytes``), so that a default
        derived from a memory limit stays inside it. At least ``MIN_FRAME_BUDGET`` (half the budget, if that
        is less: an index larger than the budget still leaves the frames something to plan with)."""
        return max(min(MIN_FRAME_BUDGET, self.cache_bytes // 2), self.cache_bytes - self.held_elsewhere)

    def _replan_if_measured(self) -> None:
        ring_bytes, self._replan_with = self._replan_with, None
        self._measured = True
        if ring_bytes is not None:
            self._plan(ring_bytes)

    def _replan_if_needed(self) -> None:
        """Before a read: plan again once the first shard told how frames compress, or once the store holds
        more frames than the tiers were planned for (twice as many as when last planned)."""
        if self._replan_with is not None:
            self._replan_if_measured()
        elif self.ring.head - self.ring.oldest > self._planned_rows:
            self._plan(self.ring_bytes)

    @staticmethod
    def _compressed_ring_bytes(ring: FrameRing) -> tuple[dict[str, int], bool]:
        """Per column, what the whole ring would take compressed: from the shard files there are (their
        mean size), else ``ASSUMED_RATIO``; and whether files were there to measure."""
        n_files = ring.rows // ring.shard_rows
        out, measured = {}, True
        for name, col in ring.columns.items():
            sizes = []
            for shard in range(n_files):
                try:
                    sizes.append(os.stat(col.layout.shard_file(ring.root, shard)).st_size)
                except OSError:
                    pass
                if len(sizes) >= 32:  # a sample is enough: shards of one store are alike
                    break
            raw = ring.shard_rows * max(1, col.spec.row_nbytes)
            mean = float(np.mean(sizes)) if sizes else raw / ASSUMED_RATIO
            measured = measured and bool(sizes)
            out[name] = int(mean * n_files * 1.05)  # + 5%: later shards may compress a little worse
        return out, measured

    @property
    def head(self) -> int:
        return self.ring.head

    @property
    def oldest(self) -> int:
        return self.ring.oldest

    # -- events from the ring (FrameEvents) -----------------------------------------------------
    def shard_written(self, name: str, shard: int, raw: bytes) -> None:
        if not self._measured and self._replan_with is None and len(self.columns) == 1:
            self._measure(name, raw)
        res = self.columns[name].resident
        if res is None:
            return
        held = res.buffers.get(shard)
        if res.nbytes - (0 if held is None else held.nbytes) + len(raw) <= self.columns[name].tier.capacity_bytes:
            res.install(shard, raw)  # replaces the older copy
        else:
            res.drop([shard])  # an older copy (the previous lap, or a partial flush) must not stay

    def _measure(self, name: str, raw: bytes) -> None:
        """The compressed size of the whole ring, from the first shard written (per chunk it holds)."""
        col = self.columns[name]
        per = col.column.layout.chunks_per_shard
        index = np.frombuffer(raw[len(raw) - per * 16 - 4:len(raw) - 4], dtype="<u8").reshape(per, 2)
        used = index[:, 0] != np.uint64(2**64 - 1)
        if used.sum() >= max(1, per // 4):  # a flush of a few rows says little
            per_chunk = float(index[used, 1].astype(np.float64).mean())
            self._replan_with = {name: int(per_chunk * (self.ring.rows // col.spec.chunk_rows) * 1.05)}

    def shards_changed(self, shards) -> None:
        shards = list(shards)
        for col in self.columns.values():
            if col.resident is not None:
                col.resident.drop(shards)
            per = self.ring.shard_rows
            for shard in shards:
                col.invalidate_rows(shard * per, (shard + 1) * per)

    def rows_replaced(self, lo: int, hi: int) -> None:
        for col in self.columns.values():
            col.invalidate_rows(lo, hi)

    def grown(self, rows: int) -> None:
        for col in self.columns.values():
            col.cache.grow_address_space(rows // col.spec.chunk_rows)
            if col.runs is not None:
                col.runs.grow(rows // col.spec.chunk_rows)
            if col.resident is not None:
                col.resident.grow_address_space(rows // col.spec.chunk_rows)

    def cleared(self) -> None:
        for col in self.columns.values():
            col.cache.clear()
            if col.runs is not None:
                col.runs.clear()
            if col.resident is not None:
                col.resident.drop()

    # -- the compressed tier filled in the background (reading/preload.py) --------------------------
    def start_preload(self) -> None:
        """Start the background pass that reads the committed shards into the compressed tier. Called as the
        store's state is loaded, before anything is added (the pass lists the shards then)."""
        self.background.start()

    def preloading(self) -> bool:
        """Is the background pass that fills the compressed tier still running?"""
        return self.background.running()

    def stats(self) -> dict[str, dict]:
        """Per observation key, what ``store.inspect.cache_stats()`` returns."""
        loading = self.preloading()
        return {name: col.stats(loading) for name, col in self.columns.items()}

    def stop_preload(self) -> None:
        self.background.stop()

    # -- reading ----------------------------------------------------------------------------------
    def gather(self, name: str, frame_ids: np.ndarray, out: np.ndarray) -> None:
        """``out[...] = frame[frame_ids]`` (``out`` shaped ``frame_ids.shape + frame shape``)."""
        self._replan_if_needed()
        col = self.columns[name]
        with self._holding_tier(col):
            index = self._slab_index(col, frame_ids.reshape(-1))
        flat = col.cache.slab.reshape(col.cache.n_slots * col.spec.chunk_rows, *col.spec.shape)
        out[...] = np.take(flat, index, axis=0, mode="clip").reshape(out.shape)

    def read_frame(self, name: str, frame_id: int) -> np.ndarray:
        col = self.columns[name]
        out = np.empty((1, *col.spec.shape), dtype=col.spec.np_dtype)
        self.gather(name, np.array([frame_id], dtype=np.int64), out)
        return out[0]

    def gather_stacks(self, name: str, obs_ids: np.ndarray, next_ids: np.ndarray, obs_words: np.ndarray,
                      next_words: np.ndarray, *, shifted: bool = True) -> None:
        """Frames ``obs_ids[i, j]`` into row ``i * k + j`` of ``obs_words`` and likewise for ``next_ids``:
        the outputs are (n * k, words) views of the batch tensors in the words of ``stack_words``. With
        ``shifted`` (as a transition's two stacks are) ``next_ids[:, :-1] == obs_ids[:, 1:]`` and only the
        last column of ``next_ids`` is read; otherwise (n-step: the next stack is a later transition's)
        all of it. Each frame is looked up once, and both outputs are filled straight from the cache slab."""
        self._replan_if_needed()
        col = self.columns[name]
        with self._holding_tier(col):
            self._gather_stacks(col, obs_ids, next_ids, obs_words, next_words, shifted)

    @staticmethod
    def _holding_tier(col: ColumnReader):
        """The compressed tier held still while a batch decodes from it (``ResidentShards.reading``): the
        writer thread's installs and the background loader wait (a batch at most), never the reverse."""
        return col.resident.reading() if col.resident is not None else contextlib.nullcontext()

    def _gather_stacks(self, col: ColumnReader, obs_ids, next_ids, obs_words, next_words, shifted) -> None:
        if col.direct:
            return self._decode_into_batch(col, obs_ids, next_ids, obs_words, next_words, shifted)
        cache = col.cache
        n, k = obs_ids.shape
        ring_rows = 0 if self.ring.unbounded else self.ring.rows
        # 8-byte words when rows allow (Atari's 7,056-byte frames do): the copy loops run at memcpy speed
        slab = cache.slab_words(col.row_nbytes)
        shared = n >= SHARED_MIN_STACKS and n * (k + 1) * col.row_nbytes >= SHARED_MIN_STACK_BYTES
        helpers = codec_helpers(self.codec_threads) if shared else None
        # The common case, every frame cached: lookup and LRU marks in one compiled pass, and the copy in
        # the same call (small batches) or shared with the helpers.
        cache.tick += 1
        if helpers is None:
            hits = checked_gather_cached(cache.slot_of, cache.last_used, cache.tick, ring_rows, col.spec.chunk_rows,
                                         slab, obs_ids, next_ids, shifted, obs_words, next_words)
            if hits >= 0:
                cache.stats.hits += hits
                return
        else:
            index = np.empty((n, k + 1 if shifted else 2 * k), dtype=np.int64)
            hits = checked_index_cached(cache.slot_of, cache.last_used, cache.tick, ring_rows, col.spec.chunk_rows,
                                        obs_ids, next_ids, shifted, index)
            if hits >= 0:
                cache.stats.hits += hits
                self._copy_stacks(helpers, slab, index, k, shifted, obs_words, next_words)
                return
        union = np.concatenate([obs_ids, next_ids[:, -1:] if shifted else next_ids], axis=1)
        index = self._slab_index(col, union.reshape(-1)).reshape(n, union.shape[1])
        slab = cache.slab_words(col.row_nbytes)  # filling misses may have grown the slab
        self._copy_stacks(helpers, slab, index, k, shifted, obs_words, next_words)

    @staticmethod
    def _copy_stacks(helpers, slab, index, k, shifted, obs_words, next_words) -> None:
        """``gather_stacks``, shared with the helpers when there are (and they are free). Not
        torch.index_select: its OpenMP workers spin while idle, and measured here, whenever other threads
        or processes (env workers, a trainer) wanted the cores too, the copy became 5-15x slower."""
        if helpers is None or not helpers.gather(slab, index, k, shifted, obs_words, next_words):
            checked_gather_stacks(slab, index, k, shifted, obs_words, next_words)

    def _decode_runs_into_batch(self, col: ColumnReader, obs_ids, next_ids, obs_words, next_words, shifted) -> None:
        """``_decode_into_batch`` for runs of frames (the temporal codec): every frame the batch needs decoded
        from its run straight into its place, with only the frames of the run its references lead to
        (``native.decode_frame_groups``; layout-1 runs decode whole into a scratch buffer). A frame that
        several places need (a shifted pair of stacks, overlapping samples) is decoded once and copied. Runs
        the compressed tier lacks are loaded with their shards while it has room, else read from their files;
        runs still in the writer's RAM (or marked empty) come through the decoded cache."""
        n, k = obs_ids.shape
        nbytes, run_rows = col.row_nbytes, col.spec.chunk_rows
        res = col.resident
        next_req = np.concatenate([obs_ids[:, 1:], next_ids[:, -1:]], axis=1) if shifted else next_ids
        ids = np.concatenate([obs_ids.reshape(-1), next_req.reshape(-1)]).astype(np.int64, copy=False)
        pos = np.arange(n * k, dtype=np.int64) * nbytes
        dsts = np.concatenate([address_of(obs_words) + pos, address_of(next_words) + pos])
        ring_rows = 0 if self.ring.unbounded else self.ring.rows
        chunks, starts, js, dsts, order = native.checked_group_frame_requests(ids, dsts, ring_rows, run_rows)
        held = chunks < res.chunk_addr.size
        src = np.zeros(chunks.size, dtype=np.int64)
        src[held] = res.chunk_addr[chunks[held]]
        if not (src > 0).all():
            self._load_whole(col, chunks[src == 0])
            src[held] = res.chunk_addr[chunks[held]]
        sizes = np.zeros(chunks.size, dtype=np.int64)
        sizes[held] = res.chunk_size[chunks[held]]
        col.tier.hits += int(np.count_nonzero(src > 0))
        col.cache.stats.misses += ids.size
        keep = []  # the bytes read from the files, alive until decoded, then their buffers kept
        try:
            through_cache = src <= 0
            into = (obs_words, next_words)
            decoded = src > 0  # the tier's groups (decoded while the files are read), then partial reads
            to_record = []  # (groups, their whole chunks read): directory entries once their checksums matched

            def decode_tier():
                if tier.size:
                    self._run_frame_decodes(col, chunks, src, sizes, starts, js, dsts, tier, nbytes, run_rows, into)

            tier = np.flatnonzero(decoded)
            from_files = np.flatnonzero(through_cache & ~self._in_ram_shards(col, chunks) & (src == 0)) \
                if through_cache.any() else tier[:0]
            if not from_files.size:
                decode_tier()
            else:
                col.tier.misses += int(from_files.size)
                got, first, last = self._read_runs_beside(col, chunks, starts, js, from_files, decode_tier)
                keep.append(got)
                read = ~got.empty
                src[from_files[read]] = got.addresses()[read]
                sizes[from_files[read]] = got.sizes[read]
                whole = got.read_whole()
                if col.runs is not None:
                    to_record.append((from_files[whole], got, whole))
                part = read & ~whole
                if part.any():
                    decoded[from_files[part]] = True
                    failed = self._decode_partial(col, chunks, src, starts, js, dsts, from_files[part], first[part],
                                                  last[part], nbytes, run_rows, into)
                    if failed.size:  # stale entries or corrupt bytes: the whole runs, whose checksums decide
                        col.runs.forget_chunks(chunks[failed])
                        col.disk.partial_retries += int(failed.size)
                        again = self.disk.read(col.column.array, chunks[failed], col.disk)
                        keep.append(again)
                        decoded[failed] = False
                        src[failed] = np.where(again.empty, 0, again.addresses())
                        sizes[failed] = np.where(again.empty, 0, again.sizes)
                        to_record.append((failed[~again.empty], again, ~again.empty))
                through_cache = src <= 0
            decode = np.flatnonzero(~through_cache & ~decoded)
            if decode.size:
                self._run_frame_decodes(col, chunks, src, sizes, starts, js, dsts, decode, nbytes, run_rows, into)
            for groups, got, which in to_record:  # decoded above: each whole chunk's checksum matched
                if groups.size:
                    col.runs.record(chunks[groups], got.buffer, got.pos[which], got.sizes[which], got.offsets[which])
            for g in np.flatnonzero(through_cache).tolist():  # the writer's RAM, or a chunk the index marks empty
                lo, hi = starts[g], starts[g + 1]
                slab_rows = self._slab_index(col, ids[order[lo:hi]])
                native.checked_copy_rows_to(col.cache.slab, slab_rows.astype(np.int64), nbytes, dsts[lo:hi], into)
        finally:
            for got in keep:
                got.release()

    def _read_runs_beside(self, col: ColumnReader, chunks, starts, js, from_files, decode_tier):
        """``_read_runs`` on the file-reads thread while this thread runs ``decode_tier()``; both have ended when
        it returns (no read writes into the batch's buffers afterwards), and an error of either is raised.
        Why a thread: the read path's Python (opening files, planning partial reads, the page-cache pass,
        checking what came back) took ~2.5 of a 19.5 ms DMC batch-256 while one core sat idle; beside the
        tier's decodes it costs their thread little (they run compiled, without the GIL)."""
        try:
            pending = self._file_reads_thread().submit(self._read_runs, col, chunks, starts, js, from_files, None)
        except RuntimeError:  # the interpreter is shutting down: no new thread work, read in this thread
            return self._read_runs(col, chunks, starts, js, from_files, decode_tier)
        try:
            decode_tier()
        except BaseException:
            with contextlib.suppress(BaseException):
                pending.result()[0].release()
            raise
        return pending.result()

    def _file_reads_thread(self) -> ThreadPoolExecutor:
        """One thread for ``_read_runs_beside``, made on first use (and again in a forked child, which has none
        of its parent's threads)."""
        with self._file_reads_lock:
            if self._file_reads_pid != os.getpid():
                self._file_reads = ThreadPoolExecutor(1, thread_name_prefix="mmreplay-file-reads")
                self._file_reads_pid = os.getpid()
            return self._file_reads

    def _read_runs(self, col: ColumnReader, chunks, starts, js, from_files, while_waiting):
        """Chunks ``chunks[from_files]`` read from their files: whole, or (a column with a run directory:
        ``reading/runs.py``) only the bytes of the frames the batch needs and those their chains lead to;
        ``while_waiting()`` runs while the reads wait for the device. Returns the bytes and, per chunk read,
        the first and last frame read (-1: read whole)."""
        first = np.full(from_files.size, -1, dtype=np.int64)
        last = np.full(from_files.size, -1, dtype=np.int64)
        runs = col.runs
        if runs is None:
            return self.disk.read(col.column.array, chunks[from_files], col.disk,
                                  while_waiting=while_waiting), first, last

        def narrow(at, offsets, sizes, listed):
            groups = from_files[at]
            take, sub_starts = _regroup(starts, groups)
            plan = runs.plan(chunks[groups], sub_starts, js[take], offsets, sizes, listed)
            first[at], last[at] = plan.first, plan.last
            return plan.lo, plan.hi

        return self.disk.read(col.column.array, chunks[from_files], col.disk, narrow, while_waiting), first, last

    def _decode_partial(self, col, chunks, src, starts, js, dsts, groups, firsts, lasts, nbytes, run_rows,
                        into) -> np.ndarray:
        """Groups ``groups`` decoded from their partial reads (``RunDirectory.decode``); returns those that
        failed (nothing of theirs is returned as data: the caller reads them whole)."""
        take, sub_starts = _regroup(starts, groups)
        status = np.empty(groups.size, dtype=np.int8)
        helpers = codec_helpers(self.codec_threads) if groups.size >= SHARED_MIN_RUNS else None
        bad = col.runs.decode(src[groups], firsts, lasts, chunks[groups], sub_starts, js[take], dsts[take], nbytes,
                              run_rows, status, into, helpers)
        return groups[status != native.OK] if bad else groups[:0]

    def _in_ram_shards(self, col: ColumnReader, chunks: np.ndarray) -> np.ndarray:
        """Which of ``chunks`` lie in shards whose rows the writer holds in RAM."""
        per = col.column.layout.chunks_per_shard
        shards = list(self.ring.ram_shards(col.spec.name))
        return np.isin(chunks // per, shards) if shards else np.zeros(chunks.size, dtype=bool)

    def _run_frame_decodes(self, col, chunks, src, sizes, starts, js, dsts, groups, nbytes, run_rows, into) -> None:
        """``native.decode_frame_groups`` over ``groups`` (all of them, or those held: then the requests are
        regrouped), shared with the codec helpers when there are many; raises on the first bad run."""
        if groups.size < chunks.size:
            lo, hi = starts[groups], starts[groups + 1]
            take = np.concatenate([np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist())])
            starts = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64)
            js, dsts, chunks, src, sizes = js[take], dsts[take], chunks[groups], src[groups], sizes[groups]
        status = np.empty(src.size, dtype=np.int8)
        helpers = codec_helpers(self.codec_threads) if src.size >= SHARED_MIN_RUNS else None
        bad = None if helpers is None else helpers.decode_frames(src, sizes, starts, js, dsts, nbytes, run_rows,
                                                                 status, into)
        if bad is None:
            bad = native.checked_decode_frame_groups(src, sizes, starts, js, dsts, nbytes, run_rows, status, into)
        if bad:
            self._raise_bad_chunk(col, chunks, status)

    def _decode_into_batch(self, col: ColumnReader, obs_ids, next_ids, obs_words, next_words, shifted) -> None:
        """``gather_stacks`` without the decoded cache: every frame decoded from the compressed tier straight
        into its place in the batch (frames not held there go through the cache). In a shifted pair of
        stacks, frame ``j > 0`` of the obs stack is frame ``j - 1`` of the next stack: decoded once, copied."""
        if col.spec.chunk_rows > 1:
            return self._decode_runs_into_batch(col, obs_ids, next_ids, obs_words, next_words, shifted)
        n, k = obs_ids.shape
        nbytes = col.row_nbytes
        res = col.resident
        ring_rows = 0 if self.ring.unbounded else self.ring.rows
        decodes = n * (k + 1 if shifted else 2 * k)
        # The common case, every chunk held: plan and decodes in one compiled call, or the plan in one and
        # the decodes shared with the codec helpers when there are many.
        if decodes < SHARED_MIN_DECODES or codec_helpers(self.codec_threads) is None:
            status = np.empty(decodes, dtype=np.int8)
            bad, rows = native.checked_decode_stacks(obs_ids, next_ids, shifted, obs_words, next_words, nbytes,
                                                     ring_rows, res.chunk_addr, res.chunk_size, col.codec, status)
            if bad > 0:
                self._raise_bad_chunk(col, rows, status)
            done = bad == 0
        else:
            plan = native.checked_plan_stack_decodes(obs_ids, next_ids, shifted, obs_words, next_words, nbytes,
                                                     ring_rows, res.chunk_addr, res.chunk_size)
            if plan.absent == 0:
                self._run_plan(col, plan)
            done = plan.absent == 0
        if done:
            col.tier.hits += decodes
            col.cache.stats.misses += decodes
            return
        obs_pos = np.arange(n * k, dtype=np.int64)
        obs_dst = address_of(obs_words) + obs_pos * nbytes
        if shifted:
            ids = np.concatenate([obs_ids.reshape(-1), next_ids[:, -1]])
            next_pos = obs_pos[k - 1::k]
            also = np.where(obs_pos % k > 0, address_of(next_words) + (obs_pos - 1) * nbytes, 0)
            copies = np.concatenate([also, np.zeros(n, dtype=np.int64)])
        else:
            ids = np.concatenate([obs_ids.reshape(-1), next_ids.reshape(-1)])
            next_pos = obs_pos
            copies = np.zeros(ids.size, dtype=np.int64)
        dst = np.concatenate([obs_dst, address_of(next_words) + next_pos * nbytes])
        rows = self.ring.row_of(ids)
        addr = res.chunk_addr[rows]
        if not (addr > 0).all():
            addr = self._resolve_absent(col, ids, rows, addr, n * k, obs_words, next_words, next_pos,
                                        shifted and k > 1)
        held = addr > 0
        n_held = int(np.count_nonzero(held))
        if n_held < addr.size:
            addr, dst, copies, rows = addr[held], dst[held], copies[held], rows[held]
        self._run_decodes(col, rows, addr, res.chunk_size[rows], dst, copies, nbytes, (obs_words, next_words))
        col.tier.hits += n_held
        col.cache.stats.misses += ids.size

    def _resolve_absent(self, col, ids, rows, addr, n_obs, obs_words, next_words, next_pos, shifted) -> np.ndarray:
        """Frames whose chunk the compressed tier does not hold: load their shards whole while it has room;
        the rest (rows in the writer's RAM, a tier that is full) come through the decoded cache. Returns
        ``addr`` with those frames marked done (0)."""
        res = col.resident
        self._load_whole(col, rows[addr == 0])
        addr = res.chunk_addr[rows]
        rest = np.flatnonzero(addr <= 0)
        if rest.size:
            slab_rows = self._slab_index(col, ids[rest])
            slab = col.cache.slab_words(col.row_nbytes)
            in_obs = rest < n_obs
            obs_rows = rest[in_obs]
            obs_words[obs_rows] = slab[slab_rows[in_obs]]
            next_words[next_pos[rest[~in_obs] - n_obs]] = slab[slab_rows[~in_obs]]
            if shifted:  # their second place: the next stack, one frame earlier
                k = n_obs // next_pos.size
                second = obs_rows[obs_rows % k > 0]
                next_words[second - 1] = obs_words[second]
            addr = addr.copy()
            addr[rest] = 0
        return addr

    def _load_whole(self, col: ColumnReader, chunks: np.ndarray) -> None:
        """The shards holding ``chunks`` (one frame row each when chunks are frames), read whole into the
        compressed tier while it has room; rows still in the writer's RAM are not read from their files."""
        if self.preloading():
            # The background pass is reading every shard in file order: loading whole shards here too, for a
            # few frames each, made the first seconds after a restart 30x slower (10M Atari: ~3 MB read per
            # batch of 32); while it runs, a miss reads only its chunks (``reading/disk.py``).
            return
        res, in_ram = col.resident, self.ring.ram_shards(col.spec.name)
        for shard in np.unique(chunks // res.per_shard).tolist():
            if shard in in_ram:
                continue
            if res.full(col.tier.capacity_bytes) or not res.load(shard, col.tier.capacity_bytes):
                break  # full: the rest is read from the files

    def _run_decodes(self, col: ColumnReader, chunks, src, sizes, dst, copies, nbytes, into) -> None:
        """Compiled decodes to addresses ``dst`` / ``copies`` inside the arrays ``into`` (checked before any is
        written), shared with the codec helpers when there are many; raises on the first bad one."""
        status = np.empty(src.size, dtype=np.int8)
        helpers = codec_helpers(self.codec_threads) if src.size >= SHARED_MIN_DECODES else None
        bad = None if helpers is None else helpers.decode(src, sizes, dst, copies, nbytes, col.codec, status, into)
        if bad is None:
            bad = native.checked_decode_chunks(src, sizes, dst, copies, nbytes, col.codec, status, into)
        if bad:
            self._raise_bad_chunk(col, chunks, status)

    def _run_plan(self, col: ColumnReader, plan) -> None:
        """``_run_decodes`` of a batch's checked ``native.StackPlan`` (every chunk held)."""
        status = np.empty(plan.src.size, dtype=np.int8)
        helpers = codec_helpers(self.codec_threads)
        bad = None if helpers is None else helpers.decode_plan(plan, col.codec, status)
        if bad is None:
            bad = native.checked_decode_plan(plan, col.codec, status)
        if bad:
            self._raise_bad_chunk(col, plan.rows, status)

    @staticmethod
    def _raise_bad_chunk(col: ColumnReader, chunks: np.ndarray, status: np.ndarray) -> None:
        """The first failed decode (``status`` by decode, ``chunks`` its chunk) as an error naming the chunk."""
        i = int(np.flatnonzero(status[:chunks.size] != native.OK)[0])
        shard, inner = divmod(int(chunks[i]), col.column.layout.chunks_per_shard)
        raise CorruptDataError(f"{col.column.array.where(shard, inner)}: "
                               f"{native.STATUS_TEXT.get(int(status[i]), 'unreadable')}")

    @staticmethod
    def stack_words(out: np.ndarray, row_nbytes: int) -> np.ndarray:
        """A batch buffer of stacks ``(n, [k,] *frame shape)`` as (n * k, words) for ``gather_stacks``."""
        word = np.uint64 if row_nbytes % 8 == 0 else np.uint8
        return out.view(np.uint8).reshape(-1, row_nbytes).view(word)

    def _slab_index(self, col: ColumnReader, ids: np.ndarray) -> np.ndarray:
        """Rows of the cache's flat slab holding frames ``ids`` (decoding the missing chunks first)."""
        c = col.spec.chunk_rows
        slab_rows, chunks, n_hit = col.cache.lookup_rows(ids, 0 if self.ring.unbounded else self.ring.rows, c)
        if n_hit < ids.size:
            rows = self.ring.row_of(ids)
            slots = self._fill_missing(col, chunks, slab_rows < 0).astype(np.int64)
            slab_rows = slots if c == 1 else slots * c + rows % c
        return slab_rows

    def _fill_missing(self, col: ColumnReader, chunks: np.ndarray, missed: np.ndarray) -> np.ndarray:
        """Bring the chunks the cache lacks into it; returns the slots of all ``chunks``. If any read
        fails (I/O error, corrupt chunk), none of the chunks admitted here stays cached: their slots
        would hold whatever was there before, and later hits would return it as data."""
        missing = np.unique(chunks[missed])
        slots = col.cache.admit(missing)
        try:
            from_ram = self._copy_from_ram(col, missing, slots)
            self._decode(col, missing[~from_ram], slots[~from_ram])
        except BaseException:
            col.cache.forget(missing)
            raise
        return col.cache.slot_of[chunks]

    def _copy_from_ram(self, col: ColumnReader, chunks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Chunks of the staging or sealed shard copied from the writer's RAM; returns which were."""
        ram = self.ring.ram_shards(col.spec.name)  # {file shard: rows of the shard in RAM}, one or two
        c, per = col.spec.chunk_rows, self.ring.shard_rows
        shard_of = chunks * c // per
        in_ram = np.zeros(chunks.size, dtype=bool)
        for shard in ram:
            in_ram |= shard_of == shard
        if not in_ram.any():
            return in_ram
        slab = col.cache.slab
        for chunk, slot, shard in zip(chunks[in_ram].tolist(), slots[in_ram].tolist(), shard_of[in_ram].tolist()):
            offset = chunk * c - shard * per
            slab[slot] = ram[shard][offset:offset + c]
        return in_ram

    def _decode(self, col: ColumnReader, chunks: np.ndarray, slots: np.ndarray) -> None:
        if not chunks.size:
            return
        res = col.resident
        if res is None:
            return self._read_files(col, chunks, slots)
        addr = res.chunk_addr[chunks]
        absent = addr == 0
        if absent.any():
            self._load_whole(col, chunks[absent])
            addr = res.chunk_addr[chunks]
            absent = addr == 0
        empty = addr == EMPTY_CHUNK
        if empty.any():  # every frame read is committed: an index that lacks it is another file's, or a new lap's
            shard, inner = divmod(int(chunks[np.flatnonzero(empty)[0]]), res.per_shard)
            col.column.array.check_empty_chunk(shard, inner)
            col.cache.slab[slots[empty]] = 0  # the writer's next lap (zarr's fill value): the overwrite check discards it
        held = addr > 0
        n_held = int(np.count_nonzero(held))
        if n_held:
            self._decode_native(col, chunks[held], addr[held], res.chunk_size[chunks[held]], slots[held])
        col.tier.hits += n_held
        if absent.any():
            self._read_files(col, chunks[absent], slots[absent])

    def _decode_native(self, col: ColumnReader, chunks, src, sizes, slots) -> None:
        cache = col.cache
        dst = address_of(cache.slab) + slots.astype(np.int64) * cache.chunk_nbytes
        self._run_decodes(col, chunks, src, sizes, dst, np.zeros_like(dst), cache.chunk_nbytes, (cache.slab,))

    def _read_files(self, col: ColumnReader, chunks: np.ndarray, slots: np.ndarray) -> None:
        """Chunks from their files into cache slots: read together (``reading/disk.py``), then checked and
        decoded by the compiled decoders; without them, one chunk at a time through numcodecs."""
        col.tier.misses += int(chunks.size)
        cache = col.cache
        if col.codec is None:
            slab, read = cache.slab, col.column.array.read_chunk
            for chunk, slot in zip(chunks.tolist(), slots.tolist()):
                read(chunk, slab[slot])
            return
        got = self.disk.read(col.column.array, chunks, col.disk)
        if got.empty.any():  # allowed by check_empty_chunk: the writer's next lap (zarr's fill value)
            cache.slab[slots[got.empty]] = 0
        held = ~got.empty
        if held.any():
            dst = address_of(cache.slab) + slots[held].astype(np.int64) * cache.chunk_nbytes
            self._run_decodes(col, chunks[held], got.addresses()[held], got.sizes[held], dst, np.zeros_like(dst),
                              cache.chunk_nbytes, (cache.slab,))

    def close(self) -> None:
        self.stop_preload()
        self.cleared()
        with self._file_reads_lock:
            if self._file_reads is not None and self._file_reads_pid == os.getpid():
                self._file_reads.shutdown(wait=True)
            self._file_reads, self._file_reads_pid = None, -1
        self.disk.close()


def _regroup(starts: np.ndarray, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The requests of ``groups`` (positions ``take`` in the request arrays) and their group starts, for
    request arrays grouped by ``starts``."""
    lo, hi = starts[groups], starts[groups + 1]
    sub_starts = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64)
    take = np.repeat(lo - sub_starts[:-1], hi - lo) + np.arange(int(sub_starts[-1]), dtype=np.int64)
    return take, sub_starts
