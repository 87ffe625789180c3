"""``StoreState``: what one commit record describes, in RAM, and the protocol that keeps the two in step.

It holds the index ring, the frame ring, the episode streams, the priority sets and the sampler RNG
states of an open store, and the commit log. It composes the two sides of the commit protocol:
``Committer`` (committing.py: records, commits, rollbacks, shard identities) and ``CheckedReads``
(checked_reads.py: the one race-checked read, and a reader's following of its writer's commits).

Invariants (all under the store's lock):
- ``log.record`` is the newest commit record whose data files are durable (writers), or the record
  this reader loaded last (readers).
- ``commit`` writes every changed shard, fsyncs what it wrote, then replaces the record; before a
  shard of the previous lap is overwritten the record first gives it up (``Committer.before_overwrite``).
- Readers: ``refresh`` loads a newer record completely (``reload``) or leaves the reads refusing to
  sample until a later load completes; rows read are trusted only if they lie above the ``oldest`` of
  every record seen after the read (``CheckedReads.still_valid``).
- ``commit_rollback`` only lowers ``head`` (one atomic record: the old state or the new one); frame ids
  are never reused (``frame_head`` stays), so no cached frame ever changes. Rows past the new head will
  be rewritten: the record's ``rollbacks`` count grows, and a reader that sees a count other than the one
  it loaded trusts nothing it read (``CommitWatcher``) and loads again (``refresh``).
- Every sampled read (any draw strategy, fixed ids included) goes through ``read`` (``CheckedReads.read``).
- ``store.py`` asks the state at the level of intent (the methods below), never through its parts.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import numpy as np

from mmreplay.checked_reads import CheckedReads, check_frame_links
from mmreplay.columns.spec import Schema
from mmreplay.committing import Committer
from mmreplay.index.frame_ring import FrameRing
from mmreplay.index.ring import TransitionRing
from mmreplay.index.streams import Streams
from mmreplay.reading.frames import FrameReader
from mmreplay.sampling.draw import check_batch_size
from mmreplay.sampling.priorities import Priorities
from mmreplay.sampling.registry import PrioritySets, SamplerStates
from mmreplay.sampling.strategy import DrawStrategy, Picked
from mmreplay.settings import Settings
from mmreplay.storage.durability import priority_files
from mmreplay.storage.durability.commit import CommitLog
from mmreplay.storage.format.layout import RingGeometry, StoreGeometry, resize_arrays


def _new_ring(path: str, meta: dict, schema: Schema, record: dict) -> TransitionRing:
    """The (empty) index ring of commit ``record`` of the store at ``path``."""
    geometry = StoreGeometry.from_meta(meta, record).transitions
    return TransitionRing(path, schema.transition_columns, geometry, capacity=meta["capacity"],
                          head=record.get("head", 0), oldest=record.get("oldest", 0))


def _restore(ring: TransitionRing, frames: FrameRing, streams: Streams, record: dict) -> None:
    """Read what ``record`` covers into the rings and streams made for it."""
    ring.load(record["head"], record["frame_head"])  # with what the record does not say (longest link, ...)
    frames.load_staging()
    streams.restore(record["streams"])


def _open_priority_files(path: str, name: str, ring: TransitionRing) -> priority_files.PriorityFiles:
    """The files of priority set ``name`` (what ``PrioritySets`` is handed: sampling/ imports no storage)."""
    geometry = RingGeometry(ring.rows, ring.shard_rows, ring.capacity is None)
    return priority_files.PriorityFiles(path, name, geometry)


class StoreState:
    """The in-RAM state of one open store and its commit protocol (see the module invariants)."""

    def __init__(self, path: str, meta: dict, schema: Schema, record: dict | None, *, writable: bool,
                 settings: Settings):
        """The state of commit ``record`` (None: a new, empty store) of the store at ``path``."""
        self.path, self.meta, self.schema = path, meta, schema
        rec = record or {}
        geometry = StoreGeometry.from_meta(meta, record)
        self.ring = _new_ring(path, meta, schema, rec)
        self.frames = FrameRing(path, schema.observations, geometry.frames.rows, geometry.frames.shard_rows,
                                unbounded=geometry.frames.unbounded,
                                head=rec.get("frame_head", 0), oldest=rec.get("frame_oldest", 0), writable=writable,
                                encoder=settings.encoder)
        self.reader = FrameReader(self.frames, settings.cache_bytes, preload=False, io_depth=settings.io_depth,
                                  partial_reads=settings.partial_reads, held_elsewhere=self.ring.nbytes,
                                  codec_threads=settings.codec_threads)
        self.priorities: PrioritySets | None = None
        self.reads: CheckedReads | None = None  # made last: a reader's is bounded by the newest commit
        try:
            self.streams = Streams(schema.observations)
            self.app_meta: dict = dict(rec.get("app", {}))  # the application's metadata, committed with the rest
            self.rollbacks = rec.get("rollbacks", 0)  # rollbacks ever committed (see the module invariants)
            self.samplers = SamplerStates(rec.get("samplers", {}))
            self.priorities = PrioritySets(partial(_open_priority_files, path), self.ring, self.frames,
                                           schema.frame_stack, rec.get("priorities", {}), writable=writable)
            self.committer = Committer(self, writable=writable)
            if record is not None:
                self.committer.expect(record)
                _restore(self.ring, self.frames, self.streams, record)
            self.log = CommitLog(path, {**self.committer.record(), "sequence": rec.get("sequence", 0)},
                                 durable=settings.durable)
            self.log.identities = self.committer.identities
            self.reads = CheckedReads(self, writable=writable)
            if record is not None:
                check_frame_links(self.ring, record, path)
            self.frames.before_overwrite = self.ring.before_overwrite = self.committer.before_overwrite
            self.frames.on_invalidate = self.ring.advance_past_frames
            self.frames.on_grow = lambda rows: resize_arrays(path, [c.layout for c in self.frames.columns.values()],
                                                             rows)
            self.ring.on_grow = lambda rows: resize_arrays(path, self.ring.layouts(), rows)
            if settings.preload:
                self.reader.start_preload()
        except BaseException:  # release the files (and the encoder child) of a state that could not load
            self.close()
            raise

    def reload(self, record: dict, *, drop_cache: bool) -> None:
        """Readers: load commit ``record`` (newer than the loaded one) in place of the loaded one. Cached
        frames of shards written since are dropped, all of them with ``drop_cache`` (an earlier load broke
        off somewhere). Sets and samplers made from now on start from this commit (live ones keep their
        own state)."""
        old_frame_head = self.log.record["frame_head"]
        if drop_cache:
            self.frames.drop_cached()
            old_frame_head = record["frame_head"]
        for disk in self.ring.disk.values():
            disk.close()
        self.ring = _new_ring(self.path, self.meta, self.schema, record)
        self.committer.expect(record)
        self.frames.catch_up(old_frame_head, record["frame_head"], record["frame_oldest"], record["frame_rows"])
        self.streams = Streams(self.schema.observations)
        _restore(self.ring, self.frames, self.streams, record)
        self.log.record = record
        self.app_meta = dict(record.get("app", {}))
        self.rollbacks = record.get("rollbacks", 0)
        self.priorities.reload(self.ring, record.get("priorities", {}))
        self.samplers.reload(record.get("samplers", {}))

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
        """The last commit record (writers: the newest durable one; readers: the one loaded); its ``"app"``
        is the application's metadata of that commit."""
        return self.log.record

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

    # -- writers (committing.py) ------------------------------------------------------------------
    def changed(self) -> bool:
        """Is there anything besides new transitions that the last commit lacks?"""
        return self.committer.changed()

    def commit(self) -> None:
        """Write every changed shard and priority buffer, make them durable, then replace the record (a new
        store's first commit writes its first record)."""
        self.committer.commit()

    def commit_rollback(self, num_added: int) -> None:
        """Commit this state without the transitions added after the first ``num_added`` (checked by
        ``committing.check_rollback``; a committed state: the caller flushed). The state in RAM is then
        stale: the caller loads the record again."""
        self.committer.commit_rollback(num_added)

    # -- reading, safe against a writer in another process (checked_reads.py) ----------------------
    def refresh(self) -> bool:
        """Readers: load the writer's newest commit if it is newer than the loaded one (True)."""
        return self.reads.refresh()

    def read(self, draw: DrawStrategy, size: int, rng: np.random.Generator | None, drain: Callable[[], None],
             buffers: Any = None) -> Picked:
        """The one read of sampled rows (``CheckedReads.read``)."""
        return self.reads.read(draw, size, rng, drain, buffers)

    def close(self) -> None:
        if self.reads is not None:
            self.reads.close()
        self.reader.stop_preload()
        self.frames.close()
        # close, not only clear: its IO threads (32 stacks and malloc arenas) otherwise outlive the store, and a
        # process opening store after store piled them up (found by scripts/checks/fuzz_store_tree.py)
        self.reader.close()
        for disk in self.ring.disk.values():
            disk.close()
        if self.priorities is not None:
            self.priorities.close()
