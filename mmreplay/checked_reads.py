"""``CheckedReads``: every sampled read of a ``StoreState`` (state.py composes it), safe against a writer in
another process, and a reader's following of that writer's commits.

Invariants (all under the store's lock):
- Every sampled read (any draw strategy, fixed ids included) goes through ``read``: the one place that
  reloads a broken-off refresh, drains pending adds, checks what was read and retries.
- Readers: ``refresh`` loads a newer record completely or leaves ``needs_reload`` set (nothing is
  sampled from a half-loaded state); rows read are trusted only if they lie above the ``oldest`` of
  every record seen after the read (``still_valid``): the writer commits a larger ``oldest`` before
  it replaces the files of what it gives up.
- A record whose ``rollbacks`` count differs from the one loaded may hold rows of another history: a
  reader that sees one trusts nothing it read (``CommitWatcher``) and loads again.
- Writers: nothing can be overwritten under their own reads (``still_valid`` is always true).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import numpy as np

from mmreplay._native.draw import lowest_read
from mmreplay.columns.encode import ColumnEncoder
from mmreplay.columns.spec import Schema
from mmreplay.errors import FormatError
from mmreplay.index.frame_ring import FrameRing
from mmreplay.index.ring import TransitionRing
from mmreplay.index.ring_scans import frame_span
from mmreplay.reading.frames import FrameReader
from mmreplay.sampling.registry import PrioritySets
from mmreplay.sampling.strategy import DrawStrategy, DrawView, Picked
from mmreplay.storage.durability.commit import CommitLog, CommitWatcher, read_commit
from mmreplay.storage.durability.meta import check_record

MAX_READ_ATTEMPTS = 12  # reads of one batch before a reader gives up on a writer that outruns it


class Readable(Protocol):
    """What ``CheckedReads`` reads: a ``StoreState`` (state.py, the module above this one)."""

    path: str
    meta: dict
    schema: Schema
    ring: TransitionRing
    frames: FrameRing
    reader: FrameReader
    priorities: PrioritySets
    rollbacks: int
    log: CommitLog

    def reload(self, record: dict, *, drop_cache: bool) -> None: ...


def check_frame_links(ring: TransitionRing, record: dict, path: str) -> None:
    """Every frame a valid transition of ``ring`` refers to must lie in ``record``'s frame range (what the
    record says and what the index holds must be one state). Readers check once their valid range is
    bounded by the newest commit: rows below it may already belong to the writer's next lap."""
    lo, hi = frame_span(ring, record["frame_head"])
    if lo < record["frame_oldest"] or hi >= record["frame_head"]:
        raise FormatError(f"store {path!r}: its transitions refer to frames [{lo}, {hi}] but the commit "
                          f"record keeps frames [{record['frame_oldest']}, {record['frame_head']}) (an edited "
                          "or mismatched commit record)")


class CheckedReads:
    """The race-checked reads of one ``StoreState`` and, for readers, the commits they follow (see the
    module invariants)."""

    def __init__(self, state: Readable, *, writable: bool):
        """Reads of ``state``; a reader (``writable=False``) watches the commit record from now on and
        narrows what the state holds to the newest one."""
        self._state = state
        self._view: DrawView | None = None  # what strategies read, made by view()
        self._decode_reward = ColumnEncoder(state.schema.reward).decode  # n-step returns sum stored rewards
        self.needs_reload = False  # readers: a refresh broke off; the next sample or get loads again
        self.watcher = None if writable else CommitWatcher(state.path)
        if not writable:
            self.bound_by_newest_commit()

    # -- readers: following the writer --------------------------------------------------------------
    def refresh(self) -> bool:
        """Load the writer's newest commit if it is newer than the loaded one (True) or an earlier load
        broke off. Cached frames of shards written since are dropped; the rest stay warm."""
        state = self._state
        record = read_commit(state.path)
        check_record(record, state.meta, state.path)
        reload = self.needs_reload
        if record["sequence"] == state.log.sequence and not reload:
            return False
        self.needs_reload = True  # until this load completes: a half-loaded state is never sampled
        state.reload(record, drop_cache=reload)  # an earlier load broke off somewhere: trust no cached frame
        whole = self.bound_by_newest_commit()
        check_frame_links(state.ring, record, state.path)
        self.needs_reload = not whole
        return True

    def bound_by_newest_commit(self) -> bool:
        """Right after loading a commit's files: a later commit may have replaced some of them meanwhile.
        Narrow the valid range to the newest record, read after loading. If the store was rolled back
        meanwhile, rows of two histories may have been read: hold nothing until the next load (False)."""
        record = self.watcher.newest()
        ring, frames = self._state.ring, self._state.frames
        if record.get("rollbacks", 0) != self._state.rollbacks:
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

    # -- the one read of sampled rows ---------------------------------------------------------------
    def view(self) -> DrawView:
        """What a draw strategy reads now: made again when a reader's refresh replaced the ring."""
        view, state = self._view, self._state
        if view is None or view.ring is not state.ring:
            view = self._view = DrawView(state.ring, state.reader, state.schema, state.priorities,
                                         self._decode_reward)
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
            oldest_before = self._state.ring.oldest
            view = self.view()
            picked = draw.pick(view, size, rng)
            if buffers is None or self.still_valid(*draw.assemble(view, picked, buffers)):
                return picked
            self._retry(attempt, oldest_before, size, redraws=getattr(draw, "redraws", True))
        ring = self._state.ring
        raise RuntimeError(f"store {self._state.path!r}: the writer kept overwriting what this reader sampled "
                           f"({MAX_READ_ATTEMPTS} tries, the last from the newest "
                           f"{ring.head - ring.oldest} transitions only)")

    def _retry(self, attempt: int, oldest_before: int, size: int, *, redraws: bool) -> None:
        """After a read the writer overtook: load its newer commit (ids read again are re-checked against
        it). A strategy that draws again also gives up a growing margin of the oldest transitions, the ones
        the writer reaches first: a reader slower than the writer (a loaded machine, a tiny cache) then
        draws from rows that outlive its read instead of failing on the same race again and again. Fixed
        ids (``Ids``) give up nothing: they are read again or found gone."""
        self.refresh()
        if redraws:
            ring = self._state.ring
            overtaken = max(ring.oldest - oldest_before, ring.shard_rows)
            self._give_up_oldest(overtaken << attempt, size)

    def _give_up_oldest(self, margin: int, batch_size: int) -> None:
        """Readers: leave the oldest ``margin`` transitions of this view out of the draws until the next
        refresh, as long as at least a batch of valid transitions (and a quarter of the view) remains."""
        state = self._state
        ring, k = state.ring, state.schema.frame_stack
        keep = max((ring.head - ring.oldest) // 4, 2 * batch_size)
        oldest = min(ring.oldest + margin, ring.head - keep)
        if oldest <= ring.oldest:
            return
        before = ring.oldest
        ring.oldest = oldest
        if ring.count_valid(k, state.frames.head) < batch_size:
            ring.oldest = before

    def close(self) -> None:
        """Stop watching the commit record (readers)."""
        if self.watcher is not None:
            self.watcher.close()
