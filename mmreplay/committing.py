"""``Committer``: the writer's side of the commit protocol of a ``StoreState`` (state.py composes it).

Invariants (all under the store's lock):
- ``record()`` is the commit record of the state in RAM; ``commit`` writes every changed shard and
  priority buffer, fsyncs what it wrote, then replaces the record (``CommitLog.commit``): a crash leaves the
  old record or the new one, each naming only durable files.
- Before a shard of the previous lap is overwritten the durable record first gives it up
  (``before_overwrite``), so no record ever points at data of the next lap.
- Every record written names the files it covers by their identities (``identities``); a record loaded
  tells each shard array which files to trust (``expect``).
- A rollback only lowers ``head`` in one record written over durable files (``commit_rollback``): frame
  ids are never reused, the record's ``rollbacks`` count grows (see ``state.py``).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from mmreplay.index.frame_ring import FrameRing
from mmreplay.index.ring import TransitionRing
from mmreplay.index.streams import Streams
from mmreplay.sampling.registry import PrioritySets, SamplerStates
from mmreplay.storage.durability import priority_files
from mmreplay.storage.durability.commit import FORMAT_VERSION, CommitLog
from mmreplay.storage.files import writer_active
from mmreplay.storage.format.layout import StoreGeometry
from mmreplay.storage.format.sharded import expect_identities, shard_identities


class Committed(Protocol):
    """What a ``Committer`` commits: a ``StoreState`` (state.py, the module above this one)."""

    path: str
    ring: TransitionRing
    frames: FrameRing
    streams: Streams
    samplers: SamplerStates
    priorities: PrioritySets
    app_meta: dict
    rollbacks: int
    log: CommitLog

    def geometry(self) -> StoreGeometry: ...


def check_rollback(num_added, oldest: int, head: int) -> int:
    """``num_added`` as an int if it lies in ``[oldest, head]`` (what the ring still holds), else an error
    naming it and that range."""
    if not isinstance(num_added, (int, np.integer)) or isinstance(num_added, (bool, np.bool_)):
        raise TypeError(f"rollback(num_added={num_added!r}): expected an integer count of transitions")
    n = int(num_added)
    if n > head:
        raise ValueError(f"rollback(num_added={n}): the store holds only {head} transitions ever added; "
                         f"a rollback can only drop transitions, to a count in [{oldest}, {head}]")
    if n < oldest:
        raise ValueError(f"rollback(num_added={n}): transitions below {oldest} were already overwritten "
                         f"(the ring holds [{oldest}, {head})); num_added must lie in [{oldest}, {head}]")
    return n


class Committer:
    """Writes the commit records of one ``StoreState`` (see the module invariants)."""

    def __init__(self, state: Committed, *, writable: bool):
        """Commits ``state``; ``writable=False`` (a reader): only ``expect`` and ``record`` are used."""
        self._state, self._writable = state, writable

    def record(self) -> dict:
        """The commit record of the state in RAM (the log sets the sequence number)."""
        st = self._state
        ring, frames = st.ring, st.frames
        return {"format_version": FORMAT_VERSION, "sequence": 0, "head": ring.head,
                "oldest": ring.oldest, "frame_head": frames.head, "frame_oldest": frames.oldest,
                "transition_rows": ring.rows, "frame_rows": frames.rows,
                "max_prev_delta": ring.max_prev_delta, "streams": st.streams.to_json(),
                "samplers": st.samplers.state(), "priorities": dict(st.priorities.entries),
                **({"app": st.app_meta} if st.app_meta else {}),
                **({"rollbacks": st.rollbacks} if st.rollbacks else {})}

    def changed(self) -> bool:
        """Is there anything besides new transitions that the last commit lacks?"""
        st = self._state
        committed = st.log.record
        return st.frames.dirty or bool(st.ring.dirty) or st.priorities.changed() or \
            st.samplers.changed(committed.get("samplers", {})) or st.app_meta != committed.get("app", {})

    def commit(self) -> None:
        """Write every changed shard and priority buffer, make them durable, then replace the record."""
        st = self._state
        st.frames.flush()
        st.ring.flush()
        st.priorities.flush()
        st.log.commit(self.record(), self._take_written())

    def _take_written(self) -> list[str]:
        """The data files written since the last commit (each to be fsynced before the next record)."""
        st = self._state
        files = st.frames.written + st.ring.written + st.priorities.written
        for written in (st.frames.written, st.ring.written, st.priorities.written):
            written.clear()
        return files

    def before_overwrite(self) -> None:
        """A shard of the previous lap is about to be replaced: the durable record gives it up first."""
        st = self._state
        st.log.give_up_below(st.ring.oldest, st.frames.oldest, self._take_written)

    def commit_rollback(self, num_added: int) -> None:
        """Replace the record with the one of this state without the transitions added after the first
        ``num_added`` (a committed state: the caller flushed), writing no data. Nothing is stored again:
        ``head`` goes back, every stream's episode ends (its next add starts a new one), priority sets forget
        what they saw past the new head, frames stay where they are (the dropped ones are never referenced
        again)."""
        st = self._state
        record = dict(st.log.record)
        record.pop("sequence", None)
        record.update(head=num_added, streams=[], rollbacks=st.rollbacks + 1,
                      priorities=priority_files.rolled_back(st.priorities.entries, num_added))
        st.log.commit(record, [])

    # -- shard identities (storage/format/sharded.py) ----------------------------------------------
    def _arrays(self) -> tuple[list, list]:
        """The shard arrays of the frame ring's columns and of the index ring's."""
        st = self._state
        return [c.array for c in st.frames.columns.values()], list(st.ring.disk.values())

    def identities(self, record: dict) -> dict:
        """What ``record`` (about to be written) expects of the shard files (the log's ``identities``)."""
        geo = self._state.geometry()
        frame_arrays, ring_arrays = self._arrays()
        return {**shard_identities(frame_arrays, geo.frames, record["frame_oldest"], record["frame_head"]),
                **shard_identities(ring_arrays, geo.transitions, record["oldest"], record["head"])}

    def expect(self, record: dict) -> None:
        """Shard files are read only if they are the ones ``record`` lists; a reader whose writer is active
        takes a newer file as the writer's, which its commit checks bound."""
        path = self._state.path
        tolerate = None if self._writable else (lambda: writer_active(path))
        frame_arrays, ring_arrays = self._arrays()
        expect_identities(frame_arrays + ring_arrays, record, tolerate)
