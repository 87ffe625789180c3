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
- ``rollback_record`` only lowers ``head`` (one atomic record: the old state or the new one); frame ids
  are never reused (``frame_head`` stays), so no cached frame ever changes. Rows past the new head will
  be rewritten: the record's ``rollbacks`` count grows, and a reader that sees a count other than the one
  it loaded trusts nothing it read (``CommitWatcher``) and loads again (``refresh``).
- Every sampled read (any draw strategy, fixed ids included) goes through ``read``: the one place that
  reloads a broken-off refresh, drains pending adds, checks what was read and retries.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from mmreplay.columns.encode import ColumnEncoder
from mmreplay.columns.spec import Schema
from mmreplay.errors import FormatError
from mmreplay.index.ring import TransitionRing
from mmreplay.index.streams import Streams
from mmreplay._native.draw import lowest_read
from mmreplay.sampling.draw import check_batch_size
from mmreplay.sampling.priorities import Priorities
from mmreplay.sampling.registry import PrioritySets, SamplerStates
from mmreplay.sampling.strategy import DrawStrategy, DrawView, Picked
from mmreplay.settings import Settings
from mmreplay.storage.durability.commit import FORMAT_VERSION, CommitLog, CommitWatcher, read_commit
from mmreplay.reading.frames import FrameReader
from mmreplay.storage.durability import priority_files
from mmreplay.index.frame_ring import FrameRing
from mmreplay.storage.files import writer_active
from mmreplay.storage.format.layout import RingGeometry, StoreGeometry, resize_arrays
from mmreplay.storage.format.sharded import expect_identities, shard_identities
from mmreplay.storage.durability.meta import check_record


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
                                head=rec.get("frame_head", 0), oldest=rec.get("frame_oldest", 0), writable=writable,
                                encoder=settings.encoder)
        self.reader = FrameReader(self.frames, settings.cache_bytes, preload=False, io_depth=settings.io_depth,
                                  partial_reads=settings.partial_reads, held_elsewhere=self.ring.nbytes,
                                  codec_threads=settings.codec_threads)
        self.priorities = None
        self._view: DrawView | None = None  # what strategies read, made by view()
        self.watcher: CommitWatcher | None = None  # readers: made by _load
        try:
            self._load(record, writable=writable, durable=settings.durable, preload=settings.preload)
        except BaseException:  # release the files (and the encoder child) of a state that could not load
            self.close()
            raise

    def _load(self, record: dict | None, *, writable: bool, durable: bool, preload: bool = True) -> None:
        rec, path = record or {}, self.path
        self.streams = Streams(self.schema.observations)
        self._decode_reward = ColumnEncoder(self.schema.reward).decode  # n-step returns sum stored rewards
        self.app_meta: dict = dict(rec.get("app", {}))  # the application's metadata, committed with the rest
        self.rollbacks = rec.get("rollbacks", 0)  # rollbacks ever committed (see the module invariants)
        self.samplers = SamplerStates(rec.get("samplers", {}))
        self.priorities = PrioritySets(self._open_priority_files, self.ring, self.frames, self.schema.frame_stack,
                                       rec.get("priorities", {}), writable=writable)
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
        if preload:
            self.reader.start_preload()

    def _open_priority_files(self, name: str, ring: TransitionRing) -> priority_files.PriorityFiles:
        """The files of priority set ``name`` (what ``PrioritySets`` is handed: sampling/ imports no storage)."""
        geometry = RingGeometry(ring.rows, ring.shard_rows, ring.capacity is None)
        return priority_files.PriorityFiles(self.path, name, geometry)

    def _identified_arrays(self) -> list:
        return [c.array for c in self.frames.columns.values()] + list(self.ring.disk.values())

    def _shard_identities(self, record: dict) -> dict:
        """What ``record`` (about to be written) expects of the shard files (storage/format/sharded.py)."""
        geo = self.geometry()
        return {**shard_identities([c.array for c in self.frames.columns.values()], geo.frames,
                                   record["frame_oldest"], record["frame_head"]),
                **shard_identities(list(self.ring.disk.values()), geo.transitions, record["oldest"], record["head"])}

    def _expect_shards(self, record: dict) -> None:
        """Shard files are read only if they are the ones ``record`` lists (storage/format/sharded.py); a reader
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

    # -- what the store asks, at the level of intent (store.py never reaches through the state) -----
    def array_layouts(self) -> list:
        """The layouts of every zarr array a new store creates: the index ring's columns, then the frames'."""
        return self.ring.layouts() + [c.layout for c in self.frames.columns.values()]

    def num_added(self) -> int:
        """Transitions ever added (the ring's ``head``)."""
        return self.ring.head

    def num_frames(self) -> int:
        """Distinct observations ever stored (the frame ring's ``head``)."""
        return self.frames.head

    def valid_range(self) -> tuple[int, int]:
        """``(oldest, head)``: the transition ids the ring holds."""
        return self.ring.oldest, self.ring.head

    def count_valid(self) -> int:
        """Transitions a draw can return (their whole frame stack is held)."""
        return self.ring.count_valid(self.schema.frame_stack, self.frames.head)

    def check_batch_size(self, batch_size: int) -> int:
        """The number of valid transitions, if a batch of ``batch_size`` can be drawn from them (else an error
        naming both)."""
        return check_batch_size(self.ring, self.schema.frame_stack, self.frames.head, batch_size)

    def read_range(self, name: str, lo: int, hi: int, what: str) -> np.ndarray:
        """The stored codes of transition column ``name`` for ids ``[lo, hi)`` (``what`` names the caller in
        errors)."""
        return self.ring.read_range(name, lo, hi, what)

    def episode_links(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(prev, terminated, truncated)`` of transitions ``[lo, hi)`` (``TransitionRing.episode_links``)."""
        return self.ring.episode_links(lo, hi)

    def stream_tail(self, stream: int) -> tuple[int, bool] | None:
        """``(id, ended)`` of stream ``stream``'s newest transition still held, or None."""
        sid = int(stream)
        last = self.streams.last.get(sid, -1)
        return None if last < self.ring.oldest else (last, self.streams.ended.get(sid, True))

    def cache_stats(self) -> dict[str, dict]:
        """The frame reader's cache and disk statistics per observation key."""
        return self.reader.stats()

    def committed_record(self) -> dict:
        """The last commit record (writers: the newest durable one; readers: the one loaded)."""
        return self.log.record

    def committed_app_meta(self) -> dict:
        """The application's metadata of the last commit (``{}`` if none)."""
        return self.log.record.get("app", {})

    def priority_set(self, name: str, alpha: float | None = None, eps: float | None = None) -> Priorities:
        """Priority set ``name`` (``PrioritySets.get``)."""
        return self.priorities.get(name, alpha, eps)

    def saved_sampler_state(self, name: str) -> dict | None:
        """The committed RNG state of sampler ``name``, or None."""
        return self.samplers.saved_state(name)

    def register_sampler(self, sampler: Any) -> None:
        """``sampler`` is now the open sampler of its name (an error if another one is open)."""
        self.samplers.register(sampler)

    def open_sampler_names(self) -> list[str]:
        """The names of the samplers open on this state, sorted."""
        return sorted(name for name, smp in self.samplers.live.items() if not smp.closed)

    def close_samplers(self) -> None:
        """Close every open sampler; their RNG states are what the next commit records."""
        self.samplers.close_all()

    def commit_record(self, record: dict) -> None:
        """Replace the commit record with ``record``, writing no data (a new store's first record, a
        rollback's): every file it names must already be durable."""
        self.log.commit(record, [])

    # -- writers ----------------------------------------------------------------------------------
    def record(self) -> dict:
        """The commit record of the state in RAM (the log sets the sequence number)."""
        return {"format_version": FORMAT_VERSION, "sequence": 0, "head": self.ring.head,
                "oldest": self.ring.oldest, "frame_head": self.frames.head, "frame_oldest": self.frames.oldest,
                "transition_rows": self.ring.rows, "frame_rows": self.frames.rows,
                "max_prev_delta": self.ring.max_prev_delta, "streams": self.streams.to_json(),
                "samplers": self.samplers.state(), "priorities": dict(self.priorities.entries),
                **({"app": self.app_meta} if self.app_meta else {}),
                **({"rollbacks": self.rollbacks} if self.rollbacks else {})}

    def changed(self) -> bool:
        """Is there anything besides new transitions that the last commit lacks?"""
        return self.frames.dirty or bool(self.ring.dirty) or self.priorities.changed() or \
            self.samplers.changed(self.log.record.get("samplers", {})) or \
            self.app_meta != self.log.record.get("app", {})

    def commit(self) -> None:
        """Write every changed shard and priority buffer, make them durable, then replace the record."""
        self.frames.flush()
        self.ring.flush()
        self.priorities.flush()
        self.log.commit(self.record(), self._take_written())

    def _take_written(self) -> list[str]:
        """The data files written since the last commit (each to be fsynced before the next record)."""
        files = self.frames.written + self.ring.written + self.priorities.written
        for written in (self.frames.written, self.ring.written, self.priorities.written):
            written.clear()
        return files

    def _before_overwrite(self) -> None:
        self.log.give_up_below(self.ring.oldest, self.frames.oldest, self._take_written)

    def rollback_record(self, num_added: int) -> dict:
        """The commit record of this state without the transitions added after the first ``num_added``
        (a committed state: the caller flushed). Nothing is stored again: ``head`` goes back, every
        stream's episode ends (its next add starts a new one), priority sets forget what they saw past
        the new head, frames stay where they are (the dropped ones are never referenced again)."""
        record = dict(self.log.record)
        record.pop("sequence", None)
        record.update(head=num_added, streams=[], rollbacks=self.rollbacks + 1,
                      priorities=priority_files.rolled_back(self.priorities.entries, num_added))
        return record

    def check_rollback(self, num_added) -> int:
        """``num_added`` as an int if it lies in ``[oldest, head]`` (what the ring still holds), else an
        error naming it and that range."""
        if not isinstance(num_added, (int, np.integer)) or isinstance(num_added, (bool, np.bool_)):
            raise TypeError(f"rollback(num_added={num_added!r}): expected an integer count of transitions")
        ring, n = self.ring, int(num_added)
        if n > ring.head:
            raise ValueError(f"rollback(num_added={n}): the store holds only {ring.head} transitions ever added; "
                             f"a rollback can only drop transitions, to a count in [{ring.oldest}, {ring.head}]")
        if n < ring.oldest:
            raise ValueError(f"rollback(num_added={n}): transitions below {ring.oldest} were already overwritten "
                             f"(the ring holds [{ring.oldest}, {ring.head})); num_added must lie in "
                             f"[{ring.oldest}, {ring.head}]")
        return n

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
        self.rollbacks = record.get("rollbacks", 0)
        # sets and samplers made from now on start from this commit (live ones keep their own state)
        self.priorities.reload(self.ring, record.get("priorities", {}))
        self.samplers.reload(record.get("samplers", {}))
        whole = self._bound_by_newest_commit()
        self._check_frame_links(record)
        self.needs_reload = not whole
        return True

    def _bound_by_newest_commit(self) -> bool:
        """Right after loading a commit's files: a later commit may have replaced some of them meanwhile.
        Narrow the valid range to the newest record, read after loading. If the store was rolled back
        meanwhile, rows of two histories may have been read: hold nothing until the next load (False)."""
        record = self.watcher.newest()
        ring, frames = self.ring, self.frames
        if record.get("rollbacks", 0) != self.rollbacks:
            ring.oldest = ring.head
            self.needs_reload = True
            return False
        ring.oldest = min(max(ring.oldest, record["oldest"]), ring.head)
        frames.oldest = min(max(frames.oldest, record["frame_oldest"]), frames.head)
        ring.advance_past_frames(frames.oldest)
        return True

    def still_valid(self, g: np.ndarray, obs_ids: np.ndarray, next_ids: np.ndarray) -> bool:
        """Readers: were transitions ``g`` and frames ``obs_ids``/``next_ids``, just read, still the
        committed ones (see ``CommitWatcher.still_valid``)? Writers: always."""
        return self.watcher is None or self.watcher.still_valid(*lowest_read(g, obs_ids, next_ids))

    # -- reading, safe against a writer in another process ---------------------------------------
    def view(self) -> DrawView:
        """What a draw strategy reads now: made again when a reader's refresh replaced the ring."""
        view = self._view
        if view is None or view.ring is not self.ring:
            view = self._view = DrawView(self.ring, self.reader, self.schema, self.priorities, self._decode_reward)
        return view

    def read(self, draw: DrawStrategy, size: int, rng: np.random.Generator | None, drain: Callable[[], None],
             buffers: Any = None) -> Picked:
        """The one read of sampled rows: ``draw.pick`` ``size`` rows after ``drain()`` (pending adds) and,
        with ``buffers``, ``draw.assemble`` them there. A reader whose writer overwrote what it read
        refreshes and reads again (see ``_retry``); without ``buffers`` only the index in RAM is read, so
        nothing can be overwritten under it. Returns what was picked (arrays a strategy may reuse)."""
        if self.needs_reload:
            self.refresh()
        for attempt in range(MAX_READ_ATTEMPTS):
            drain()
            oldest_before = self.ring.oldest
            view = self.view()
            picked = draw.pick(view, size, rng)
            if buffers is None or self.still_valid(*draw.assemble(view, picked, buffers)):
                return picked
            self._retry(attempt, oldest_before, size, redraws=getattr(draw, "redraws", True))
        raise RuntimeError(f"store {self.path!r}: the writer kept overwriting what this reader sampled "
                           f"({MAX_READ_ATTEMPTS} tries, the last from the newest "
                           f"{self.ring.head - self.ring.oldest} transitions only)")

    def _retry(self, attempt: int, oldest_before: int, size: int, *, redraws: bool) -> None:
        """After a read the writer overtook: load its newer commit (ids read again are re-checked against
        it). A strategy that draws again also gives up a growing margin of the oldest transitions, the ones
        the writer reaches first: a reader slower than the writer (a loaded machine, a tiny cache) then
        draws from rows that outlive its read instead of failing on the same race again and again. Fixed
        ids (``Ids``) give up nothing: they are read again or found gone."""
        self.refresh()
        if redraws:
            overtaken = max(self.ring.oldest - oldest_before, self.ring.shard_rows)
            self._give_up_oldest(overtaken << attempt, size)

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

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
        self.reader.stop_preload()
        self.frames.close()
        # close, not only clear: its IO threads (32 stacks and malloc arenas) otherwise outlive the store, and a
        # process opening store after store piled them up (found by scripts/checks/fuzz_store_tree.py)
        self.reader.close()
        for disk in self.ring.disk.values():
            disk.close()
        if self.priorities is not None:
            self.priorities.close()
