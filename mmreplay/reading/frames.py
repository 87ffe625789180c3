"""Frame ids in, decoded pixels out: the read half of the frame ring, a router over one source per tier.

Invariant: ``gather``/``gather_stacks`` write exactly the frames the ring stores under the ids asked
for (the caller guarantees ``ring.oldest <= id < ring.head``), or raise; a failed read leaves no chunk
of that batch in the cache. Which source serves a frame is decided here, and only here
(``reading/sources/``, one module a tier):

1. the **decoded cache** (``DecodedCacheSource``), a hit costs a copy;
2. the **compressed tier** (``CompressedTierSource``), whole shard files held in RAM, decoded by compiled code
   (``reading/decoding.py``) with no Python per chunk and the GIL released, shared with the codec helpers when
   a batch has many;
3. the **writer's RAM** (``WriterRamSource``): rows of the staging and sealed shards, copied;
4. the **files** (``FileSource``): the chunks of shards the compressed tier does not hold (a store larger than its
   share of the budget: the tier then holds as many whole shards as fit), all of a batch's read together, runs of
   frames only in the bytes the batch needs, then decoded by the same compiled code.

A cache miss is filled from the writer's RAM, else the compressed tier, else the files. When the decoded cache
could hold only a small share of the frames (``ColumnReader.direct``), frames are decoded straight into the batch
instead: from the compressed tier, the files for runs it lacks, and the cache only for what the writer holds or an
index marks empty. The budget (``cache_bytes``) is split between the tiers by ``reading/planner.py``.

The reader learns of writes through ``FrameEvents`` (it is the ring's listener): shards written or
changed elsewhere, rows about to be overwritten, a ring that grew. A batch holds its column's compressed
tier still while it decodes (``ResidentShards.reading``), so the writer thread's installs and the
background pass (``reading/preload.py``) never free or move bytes under a decode; the pass installs no
shard that the writer entered, wrote or dropped after the pass listed it.
"""

from __future__ import annotations

import numpy as np

from mmreplay.index.frame_ring import FrameEvents, FrameRing
from mmreplay.reading.decoding import Decoder
from mmreplay.reading.planner import TierPlanner
from mmreplay.reading.preload import BackgroundPass
from mmreplay.reading.requests import FramePlaces, RunRequests
from mmreplay.reading.sources.compressed import CompressedTierSource
from mmreplay.reading.sources.decoded import DecodedCacheSource
from mmreplay.reading.sources.files import FileSource
from mmreplay.reading.sources.writer_ram import WriterRamSource
from mmreplay.reading.tiers import ColumnReader
from mmreplay.settings import DEFAULT_IO_DEPTH


class FrameReader(FrameEvents):
    """The read half of the frame ring for one store (see the module invariant): per observation key a
    ``ColumnReader`` (its tiers, planned from one budget by ``TierPlanner``), the sources that read them, kept
    in step with the writer through the ring's events."""

    def __init__(self, ring: FrameRing, cache_bytes: int, *, preload: bool = True, io_depth: int = DEFAULT_IO_DEPTH,
                 partial_reads: bool = True, held_elsewhere: int = 0, codec_threads: int | None = None):
        self.ring = ring
        # the session's Settings.codec_threads: the process's helper threads are made, with it, by the first
        # batch any store of the process decodes (``_native/helpers.py``)
        self.codec_threads = codec_threads
        self.planner = TierPlanner(ring, cache_bytes, held_elsewhere, partial_reads)
        self.columns: dict[str, ColumnReader] = {}
        self.planner.plan_columns(self.columns, self.planner.ring_bytes)
        decoder = Decoder(codec_threads)
        self.writer_ram = WriterRamSource(ring)
        self.compressed = CompressedTierSource(self.writer_ram, decoder, self.preloading)
        self.files = FileSource(io_depth, decoder)
        self.cached = DecodedCacheSource(ring, decoder, self._fill_slots)
        self.background = BackgroundPass(self)
        ring.listener = self
        if preload:
            self.start_preload()

    @property
    def plan(self):
        """The tier plan now (``reading/tiers.py``: ``TierPlan``)."""
        return self.planner.plan

    @property
    def cache_bytes(self) -> int:
        return self.planner.cache_bytes

    @property
    def head(self) -> int:
        return self.ring.head

    @property
    def oldest(self) -> int:
        return self.ring.oldest

    # -- events from the ring (FrameEvents) -----------------------------------------------------
    def shard_written(self, name: str, shard: int, raw: bytes) -> None:
        self.planner.note_written(self.columns, name, raw)
        self.compressed.hold_written(self.columns[name], shard, raw)

    def shards_changed(self, shards) -> None:
        shards = list(shards)
        for col in self.columns.values():
            col.forget_shards(shards, self.ring.shard_rows)

    def rows_replaced(self, lo: int, hi: int) -> None:
        for col in self.columns.values():
            col.invalidate_rows(lo, hi)

    def grown(self, rows: int) -> None:
        for col in self.columns.values():
            col.grow_address_space(rows)

    def cleared(self) -> None:
        for col in self.columns.values():
            col.clear()

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
        self.gather_sets(name, ((frame_ids, out),))

    def gather_sets(self, name: str, sets) -> None:
        """``gather`` of several ``(frame_ids, out)`` pairs of column ``name`` at once. Why: a run that holds
        frames of several outputs is then decoded once (a sequence's last steps and its next observation)."""
        if self.planner.due():
            self.planner.replan(self.columns)
        col = self.columns[name]
        sets = [(ids, out) for ids, out in sets if ids.size]
        if col.direct and col.spec.chunk_rows > 1 and all(out.flags.c_contiguous for _, out in sets):
            # runs of frames (a sequence's consecutive steps): each run decoded once, up to the last frame asked
            # for, every frame straight into its place in its output
            if sets:
                req = RunRequests.of_frame_sets(
                    [(ids, self.stack_words(out.reshape(ids.size, -1), col.row_nbytes)) for ids, out in sets],
                    col.row_nbytes, 0 if self.ring.unbounded else self.ring.rows, col.spec.chunk_rows)
                with self.compressed.holding(col):
                    self._decode_run_requests(col, req)
            return
        for frame_ids, out in sets:
            with self.compressed.holding(col):
                index = self.cached.slab_index(col, frame_ids.reshape(-1))
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
        planner = self.planner  # ``planner.due()`` inline: the sampler's hot path
        if planner.remeasured is not None or self.ring.head - self.ring.oldest > planner.planned_rows:
            planner.replan(self.columns)
        col = self.columns[name]
        ring_rows = 0 if self.ring.unbounded else self.ring.rows
        with self.compressed.holding(col):
            if not col.direct:
                self.cached.copy_stacks(col, obs_ids, next_ids, obs_words, next_words, shifted, ring_rows)
            elif col.spec.chunk_rows > 1:
                self._decode_runs_into_batch(col, obs_ids, next_ids, obs_words, next_words, shifted, ring_rows)
            elif not self.compressed.decode_stacks(col, obs_ids, next_ids, obs_words, next_words, shifted,
                                                   ring_rows):
                self._decode_frames_into_batch(col, obs_ids, next_ids, obs_words, next_words, shifted)

    def _decode_frames_into_batch(self, col: ColumnReader, obs_ids, next_ids, obs_words, next_words,
                                  shifted) -> None:
        """``gather_stacks`` of one-frame chunks some of which the compressed tier lacks: their shards loaded
        whole while it has room; the rest (rows in the writer's RAM, a tier that is full) come through the
        decoded cache, the others are decoded straight into their places. In a shifted pair of stacks, frame
        ``j > 0`` of the obs stack is frame ``j - 1`` of the next stack: decoded once, copied."""
        k = obs_ids.shape[1]
        places = FramePlaces.of_stacks(obs_ids, next_ids, obs_words, next_words, shifted, col.row_nbytes)
        rows = self.ring.row_of(places.ids)
        addr = self.compressed.locate(col, rows)
        rest = np.flatnonzero(addr <= 0)
        if rest.size:
            self.cached.copy_into_places(col, places, rest, obs_words, next_words, shifted and k > 1)
        held = addr > 0
        dst, copies = places.dst, places.copies
        if rest.size:
            addr, dst, copies, rows = addr[held], dst[held], copies[held], rows[held]
        self.compressed.decode_frames(col, rows, addr, dst, copies, (obs_words, next_words))
        col.cache.stats.misses += places.ids.size

    def _decode_runs_into_batch(self, col: ColumnReader, obs_ids, next_ids, obs_words, next_words, shifted,
                                ring_rows: int) -> None:
        """``gather_stacks`` for runs of frames (the temporal codec): every frame the batch needs decoded from its
        run straight into its place, with only the frames of the run its references lead to; a frame that
        several places need (a shifted pair of stacks, overlapping samples) is decoded once and copied. Runs
        held in the compressed tier are decoded from there while the files (``FileSource``) read the others;
        runs still in the writer's RAM (or marked empty) come through the decoded cache."""
        self._decode_run_requests(col, RunRequests.of_stacks(obs_ids, next_ids, obs_words, next_words, shifted,
                                                             col.row_nbytes, ring_rows, col.spec.chunk_rows))

    def _decode_run_requests(self, col: ColumnReader, req: RunRequests) -> None:
        """Frames ``req`` asks for, each run once: from the compressed tier, the files, or the decoded cache."""
        src, sizes, all_held = self.compressed.locate_runs(col, req.chunks)
        col.cache.stats.misses += req.ids.size
        if all_held:  # the store in RAM: every run decoded from the compressed tier, no array operation more
            self.compressed.decode_runs(col, req, src, sizes, None)
            return
        tier = np.flatnonzero(src > 0)
        through_cache = src <= 0
        from_files = np.flatnonzero(through_cache & ~self.writer_ram.holds(col, req.chunks) & (src == 0)) \
            if through_cache.any() else tier[:0]
        if from_files.size:
            self.files.read_runs_into_batch(col, req, from_files, src, sizes,
                                            lambda: self.compressed.decode_runs(col, req, src, sizes, tier))
        else:
            self.compressed.decode_runs(col, req, src, sizes, tier)
        starts, order = req.starts, req.order
        for g in np.flatnonzero(src <= 0).tolist():  # the writer's RAM, or a run the index marks empty
            lo, hi = starts[g], starts[g + 1]
            self.cached.copy_rows_to(col, req.ids[order[lo:hi]], req.dsts[lo:hi], req.into)

    def _fill_slots(self, col: ColumnReader, chunks: np.ndarray, slots: np.ndarray) -> None:
        """Chunks the decoded cache lacks, into the ``slots`` it admitted them to: from the writer's RAM, else
        decoded from the compressed tier, else read from their files."""
        from_ram = self.writer_ram.copy_into_slots(col, chunks, slots)
        chunks, slots = chunks[~from_ram], slots[~from_ram]
        if not chunks.size:
            return
        if col.resident is not None:
            absent = self.compressed.decode_into_slots(col, chunks, slots)
            if not absent.any():
                return
            chunks, slots = chunks[absent], slots[absent]
        self.files.read_into_slots(col, chunks, slots)

    @staticmethod
    def stack_words(out: np.ndarray, row_nbytes: int) -> np.ndarray:
        """A batch buffer of stacks ``(n, [k,] *frame shape)`` as (n * k, words) for ``gather_stacks``."""
        word = np.uint64 if row_nbytes % 8 == 0 else np.uint8
        return out.view(np.uint8).reshape(-1, row_nbytes).view(word)

    def close(self) -> None:
        self.stop_preload()
        self.cleared()
        self.files.close()
