"""``StoreState``: what one commit record describes, in RAM, and the protocol that keeps the two in step.

It holds the index ring, the frame ring, the episode streams, the priority sets and the sampler RNG
states of an open store, and the commit log (writers) or commit watcher (readers).

Invariants (all under the store's lock):
- ``log.record`` is the newest commit record whose data files are durable (writers), or the record
  this reader loaded last (readers).
- ``commit`` writes every changed shard, fsyncs what it wrote, then replaces the record; before a
  shard of the previous lap is overwritten the record first gives it up (``_before_overwrite``).
- Readers: ``refresh`` loads a newer record completely or leaves ``needs_reload`` set (nothing is
  sampled from a half-loaded state); rows read are trusted only if they lie above the ``oldest`` of
  every record seen after the read (``still_valid``): the writer commits a larger ``oldest`` before
  it replaces the files of what it gives up.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from mmreplay.columns.encode import ColumnEncoder
from mmreplay.columns.spec import Schema
from mmreplay.errors import FormatError
from mmreplay.index.ring import TransitionRing
from mmreplay.index.streams import Streams
from mmreplay.sampling.batch import BatchBuffers, assemble
from mmreplay.sampling.draw import check_batch_size, draw_into, draw_uniform, lowest_read
from mmreplay.sampling.priorities import Priorities
from mmreplay.sampling.registry import PrioritySets, SamplerStates
from mmreplay.sampling.sequences import SequenceBuffers, StartDrawer, assemble_sequences
from mmreplay.settings import Settings
from mmreplay.storage.commit import FORMAT_VERSION, CommitLog, CommitWatcher, read_commit
from mmreplay.reading.frames import FrameReader
from mmreplay.storage.frame_ring import FrameRing
from mmreplay.storage.files import writer_active
from mmreplay.storage.layout import RingGeometry, StoreGeometry, resize_arrays
from mmreplay.storage.sharded import expect_identities, shard_identities
from mmreplay.storage.meta import check_record


MAX_READ_ATTEMPTS = 12  # reads of one batch before a reader gives up on a writer that outruns it


class StoreState:
    """The in-RAM state of one open store and its commit protocol (see the module invariants)."""

    def __init__(self, path: str, meta: dict, schema: Schema, record: dict | None, *, writable: bool,
                 settings: Settings):
        """The state of commit ``record`` (None: a new, empty store) of the store at ``path``."""
        self.path, self.meta, self.schema = path, meta, schema
        rec = record or {}
        geometry = StoreGeometry.from_meta(meta, record)
        self.ring = self._new_ring(rec)
        self.frames = FrameRing(path, schema.observations, geometry.frames.rows, geometry.frames.shard_rows,
                                unbounded=geometry.frames.unbounded,
                                head=rec.get("frame_head", 0), oldest=rec.get("frame_oldest", 0), writable=writable)
        self.reader = FrameReader(self.frames, settings.cache_bytes, preload=False,
                                  io_depth=settings.io_depth)  # frames are read here
        self.priorities = None
        self.watcher: CommitWatcher | None = None  # readers: made by _load
        try:
            self._load(record, writable=writable, durable=settings.durable)
        except BaseException:  # release the files (and the encoder child) of a state that could not load
            self.close()
            raise

    def _load(self, record: dict | None, *, writable: bool, durable: bool) -> None:
        rec, path = record or {}, self.path
        self.streams = Streams(self.schema.observations)
        self._decode_reward = ColumnEncoder(self.schema.reward).decode  # n-step returns sum stored rewards
        self.app_meta: dict = dict(rec.get("app", {}))  # the application's metadata, committed with the rest
        self.samplers = SamplerStates(rec.get("samplers", {}))
        self.priorities = PrioritySets(path, self.ring, self.frames, self.schema.frame_stack, rec.get("priorities", {}),
                                       writable=writable)
        self._priority_written: list[str] = []
        self._writable = writable
        if record is not None:
            self._expect_shards(record)
            self._restore(record)
        self.log = CommitLog(path, {**self.record(), "sequence": rec.get("sequence", 0)}, durable=durable)
        self.log.identities = self._shard_identities
        self.watcher = None if writable else CommitWatcher(path)
        self.needs_reload = False  # readers: a refresh broke off; the next sample or get loads again
        if not writable:
            self._bound_by_newest_commit()
        if record is not None:
            self._check_frame_links(record)
        self.frames.before_overwrite = self.ring.before_overwrite = self._before_overwrite
        self.frames.on_invalidate = self.ring.advance_past_frames
        self.frames.on_grow = lambda rows: resize_arrays(path, [c.layout for c in self.frames.columns.values()], rows)
        self.ring.on_grow = lambda rows: resize_arrays(path, self.ring.layouts(), rows)
        self.reader.start_preload()

    def _identified_arrays(self) -> list:
        return [c.array for c in self.frames.columns.values()] + list(self.ring.disk.values())

    def _shard_identities(self, record: dict) -> dict:
        """What ``record`` (about to be written) expects of the shard files (storage/sharded.py)."""
        geo = self.geometry()
        return {**shard_identities([c.array for c in self.frames.columns.values()], geo.frames,
                                   record["frame_oldest"], record["frame_head"]),
                **shard_identities(list(self.ring.disk.values()), geo.transitions, record["oldest"], record["head"])}

    def _expect_shards(self, record: dict) -> None:
        """Shard files are read only if they are the ones ``record`` lists (storage/sharded.py); a reader
        whose writer is active takes a newer file as the writer's, which its commit checks bound."""
        tolerate = None if self._writable else (lambda: writer_active(self.path))
        expect_identities(self._identified_arrays(), record, tolerate)

    def _new_ring(self, record: dict) -> TransitionRing:
        geometry = StoreGeometry.from_meta(self.meta, record).transitions
        return TransitionRing(self.path, self.schema.transition_columns, geometry, capacity=self.meta["capacity"],
                              head=record.get("head", 0), oldest=record.get("oldest", 0))

    def _restore(self, record: dict) -> None:
        self.ring.load(record["head"])
        # The episode links in RAM, not the record, say how far back a link reaches (what n-step and
        # stack-validity scans need): exact, and immune to an edited record.
        self.ring.max_prev_delta = self.ring.live_max_prev_delta()
        self.ring.rebuild_shard_min_frame(record["frame_head"])
        self.frames.load_staging()
        self.streams.restore(record["streams"])

    def _check_frame_links(self, record: dict) -> None:
        """Every frame a valid transition refers to must lie in the record's frame range (what the record
        says and what the index holds must be one state). Readers call it once their valid range is
        bounded by the newest commit: rows below it may already belong to the writer's next lap."""
        lo, hi = self.ring.frame_span(record["frame_head"])
        if lo < record["frame_oldest"] or hi >= record["frame_head"]:
            raise FormatError(f"store {self.path!r}: its transitions refer to frames [{lo}, {hi}] but the commit "
                              f"record keeps frames [{record['frame_oldest']}, {record['frame_head']}) (an edited "
                              "or mismatched commit record)")

    def geometry(self) -> StoreGeometry:
        """The store's geometry now (an unbounded store's rings grow)."""
        unbounded = self.meta["capacity"] is None
        return StoreGeometry(self.meta["capacity"], RingGeometry(self.ring.rows, self.ring.shard_rows, unbounded),
                             RingGeometry(self.frames.rows, self.frames.shard_rows, unbounded))

    # -- writers ----------------------------------------------------------------------------------
    def record(self) -> dict:
        """The commit record of the state in RAM (the log sets the sequence number)."""
        return {"format_version": FORMAT_VERSION, "sequence": 0, "head": self.ring.head,
                "oldest": self.ring.oldest, "frame_head": self.frames.head, "frame_oldest": self.frames.oldest,
                "transition_rows": self.ring.rows, "frame_rows": self.frames.rows,
                "max_prev_delta": self.ring.max_prev_delta, "streams": self.streams.to_json(),
                "samplers": self.samplers.state(), "priorities": dict(self.priorities.entries),
                **({"app": self.app_meta} if self.app_meta else {})}

    def changed(self) -> bool:
        """Is there anything besides new transitions that the last commit lacks?"""
        return self.frames.dirty or bool(self.ring.dirty) or self.priorities.changed() or \
            self.samplers.changed(self.log.record.get("samplers", {})) or \
            self.app_meta != self.log.record.get("app", {})

    def commit(self) -> None:
        """Write every changed shard and priority buffer, make them durable, then replace the record."""
        self.frames.flush()
        self.ring.flush()
        self.priorities.write(self._priority_written)
        self.log.commit(self.record(), self._take_written())

    def _take_written(self) -> list[str]:
        """The data files written since the last commit (each to be fsynced before the next record)."""
        files = self.frames.written + self.ring.written + self._priority_written
        for written in (self.frames.written, self.ring.written, self._priority_written):
            written.clear()
        return files

    def _before_overwrite(self) -> None:
        self.log.give_up_below(self.ring.oldest, self.frames.oldest, self._take_written)

    # -- readers ----------------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Load the writer's newest commit if it is newer than the loaded one (True) or an earlier load
        broke off. Cached frames of shards written since are dropped; the rest stay warm."""
        record = read_commit(self.path)
        check_record(record, self.meta, self.path)
        reload = self.needs_reload
        if record["sequence"] == self.log.sequence and not reload:
            return False
        self.needs_reload = True  # until this load completes: a half-loaded state is never sampled
        old_frame_head = self.log.record["frame_head"]
        if reload:  # an earlier load broke off somewhere: trust no cached frame
            self.frames.drop_cached()
            old_frame_head = record["frame_head"]
        for disk in self.ring.disk.values():
            disk.close()
        self.ring = self._new_ring(record)
        self._expect_shards(record)
        self.frames.catch_up(old_frame_head, record["frame_head"], record["frame_oldest"], record["frame_rows"])
        self.streams = Streams(self.schema.observations)
        self._restore(record)
        self.log.record = record
        self.app_meta = dict(record.get("app", {}))
        # sets and samplers made from now on start from this commit (live ones keep their own state)
        self.priorities.reload(self.ring, record.get("priorities", {}))
        self.samplers.reload(record.get("samplers", {}))
        self._bound_by_newest_commit()
        self._check_frame_links(record)
        self.needs_reload = False
        return True

    def _bound_by_newest_commit(self) -> None:
        """Right after loading a commit's files: a later commit may have replaced some of them meanwhile.
        Narrow the valid range to the newest record, read after loading."""
        record = self.watcher.newest()
        ring, frames = self.ring, self.frames
        ring.oldest = min(max(ring.oldest, record["oldest"]), ring.head)
        frames.oldest = min(max(frames.oldest, record["frame_oldest"]), frames.head)
        ring.advance_past_frames(frames.oldest)

    def still_valid(self, g: np.ndarray, obs_ids: np.ndarray, next_ids: np.ndarray) -> bool:
        """Readers: were transitions ``g`` and frames ``obs_ids``/``next_ids``, just read, still the
        committed ones (see ``CommitWatcher.still_valid``)? Writers: always."""
        return self.watcher is None or self.watcher.still_valid(*lowest_read(g, obs_ids, next_ids))

    # -- reading, safe against a writer in another process ---------------------------------------
    def draw(self, buf: BatchBuffers, rng: np.random.Generator, drain: Callable[[], None], **draw: Any) -> None:
        """Draw a batch into ``buf`` (``sampling.draw.draw_into`` with ``draw``'s options), after ``drain()``
        (pending adds); a reader draws again if the writer overwrote what it read."""
        self._read_checked(drain, lambda: draw_into(self.ring, self.reader, self.schema.frame_stack, buf, rng,
                                                    decode_reward=self._decode_reward, **draw), buf.batch_size)

    def draw_sequences(self, buf: SequenceBuffers, drawer: StartDrawer, rng: np.random.Generator,
                       drain: Callable[[], None], *, priorities: Priorities | None = None, beta: float = 0.0) -> None:
        """Draw windows with ``drawer`` into ``buf`` (``sampling.sequences.assemble_sequences``), after
        ``drain()``; a reader draws again if the writer overwrote what it read."""
        def read():
            ids, weights = drawer.draw(self.ring, self.reader.head, buf.batch_size, rng, priorities, beta)
            return assemble_sequences(self.ring, self.reader, self.schema, ids, buf, weights)
        self._read_checked(drain, read, buf.batch_size)

    def _read_checked(self, drain: Callable[[], None], read: Callable[[], tuple], batch_size: int) -> None:
        """``read()`` (returning the transition ids, obs and next-obs frame ids it read) after ``drain()``,
        again after a refresh while a reader finds that the writer overwrote what it read.

        Each retry also gives up a growing margin of the oldest transitions, the ones the writer reaches
        first: a reader slower than the writer (a loaded machine, a tiny cache) then draws from rows that
        outlive its read instead of failing on the same race again and again."""
        if self.needs_reload:
            self.refresh()
        for attempt in range(MAX_READ_ATTEMPTS):
            drain()
            oldest_before = self.ring.oldest
            if self.still_valid(*read()):
                return
            self.refresh()
            overtaken = max(self.ring.oldest - oldest_before, self.ring.shard_rows)
            self._give_up_oldest(overtaken << attempt, batch_size)
        raise RuntimeError(f"store {self.path!r}: the writer kept overwriting what this reader sampled "
                           f"({MAX_READ_ATTEMPTS} tries, the last from the newest "
                           f"{self.ring.head - self.ring.oldest} transitions only)")

    def _give_up_oldest(self, margin: int, batch_size: int) -> None:
        """Readers: leave the oldest ``margin`` transitions of this view out of the draws until the next
        refresh, as long as at least a batch of valid transitions (and a quarter of the view) remains."""
        ring, k = self.ring, self.schema.frame_stack
        keep = max((ring.head - ring.oldest) // 4, 2 * batch_size)
        oldest = min(ring.oldest + margin, ring.head - keep)
        if oldest <= ring.oldest:
            return
        before = ring.oldest
        ring.oldest = oldest
        if ring.count_valid(k, self.frames.head) < batch_size:
            ring.oldest = before

    def draw_indices(self, size: int, rng: np.random.Generator, *, priorities: Priorities | None = None,
                     beta: float = 0.0) -> tuple[np.ndarray, np.ndarray | None]:
        """``size`` valid transition ids (uniform, or by ``priorities`` with importance weights for ``beta``),
        no frame read; fresh arrays ``(ids, weights or None)``. The caller drained pending adds."""
        if self.needs_reload:
            self.refresh()
        check_batch_size(self.ring, self.schema.frame_stack, self.reader.head, size)
        if priorities is None:
            return draw_uniform(self.ring, self.schema.frame_stack, self.reader.head, size, rng)[0], None
        g, _, _, weights = priorities.draw(size, rng, beta)  # the set's buffers are reused: copy
        return g.copy(), weights.astype(np.float32)

    def draw_windows(self, drawer: StartDrawer, size: int, rng: np.random.Generator) -> np.ndarray:
        """``size`` windows drawn by ``drawer`` (``(size, burn_in + seq_len)`` ids, ``-1`` padding), no
        frame read. The caller drained pending adds."""
        if self.needs_reload:
            self.refresh()
        return drawer.draw(self.ring, self.reader.head, size, rng)[0]

    def gather(self, g: np.ndarray, buf: BatchBuffers) -> None:
        """Transitions ``g`` (which must be valid) into ``buf``; a reader re-checks them against a newer commit
        if the writer overwrote what it read."""
        if self.needs_reload:
            self.refresh()
        for _ in range(2):
            obs_ids, next_ids, valid = self.ring.stack_frames(g, self.schema.frame_stack, self.frames.head)
            if not valid.all():
                raise IndexError(f"transition ids {g[~valid][:8].tolist()} are not valid (valid ids lie in "
                                 f"[{self.ring.oldest}, {self.ring.head}) and need their frame stack)")
            assemble(self.ring, self.reader, g, obs_ids, next_ids, buf)
            if self.still_valid(g, obs_ids, next_ids):
                return
            self.refresh()  # then re-check validity against the newer commit

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.reader.stop_preload()
        self.frames.close()
        self.reader.cleared()
        for disk in self.ring.disk.values():
            disk.close()
        if self.priorities is not None:
            self.priorities.close()
