"""Reading a store as episodes: the one read path every exporter uses.

Invariants:
- An episode is the chain of transitions linked by the index ring's episode links (``prev_delta``), so
  episodes interleaved across vector-env streams come out whole and in step order, never in row order.
  Episodes are listed in the order of their first kept transition.
- An episode's observations are single frames (the store's ``observation_space``), never stacks:
  observation ``t + 1`` of an episode is, bit for bit, the next observation of step ``t`` (that is how the
  store links steps), so ``N`` steps give ``N + 1`` observations, the last being the final observation.
- ``complete`` episodes start at a kept episode start and end with terminated or truncated. A *cut*
  episode (its start was overwritten by the ring) and an *unfinished* one (no end flag yet: still running
  at the head, or abandoned) are skipped unless asked for; a cut episode then starts at its first
  transition whose frame stack is still kept (the first ``frame_stack - 1`` kept steps are not readable).
- Frames are read in blocks of at most ``block_rows`` transitions: memory is bounded by the block, not
  by the store. They are read into numpy buffers: exporting never imports torch.
- A live writer never makes an export fail: the listing is read at one commit; an episode whose steps
  the writer overwrites before they are read is *lost*: ``iter_pieces`` yields nothing more of it (one
  ``Piece`` with ``lost=True`` if some of it was already yielded, so the exporter drops what it wrote of
  it), records it in ``listing.lost``, and the listing's ``notes`` say how many were lost. Every piece
  yielded is true data (the store re-reads rows that a writer replaced, or refuses them).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from mmreplay.sampling.batch import BatchBuffers

ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class EpisodeSpan:
    """The global transition ids of one episode, in step order."""

    ids: np.ndarray
    cut: bool  # the episode's first steps were overwritten: ``ids`` starts mid-episode
    ended: bool  # the last step is terminated or truncated

    def __len__(self) -> int:
        return int(self.ids.size)


@dataclass
class EpisodeListing:
    episodes: list[EpisodeSpan]
    skipped_cut: int = 0  # episodes whose start the ring overwrote
    skipped_unfinished: int = 0  # episodes without an end flag (running at the head, or abandoned)
    notes: list[str] = field(default_factory=list)
    lost: set[int] = field(default_factory=set)  # positions of episodes a writer overwrote during the export

    @property
    def steps(self) -> int:
        return sum(len(e) for e in self.episodes)

    @property
    def exported(self) -> list[EpisodeSpan]:
        """The listed episodes that were not lost to a writer during the export."""
        return [e for i, e in enumerate(self.episodes) if i not in self.lost]

    @property
    def exported_steps(self) -> int:
        return sum(len(e) for e in self.exported)

    def note_lost(self) -> None:
        """Add the note on episodes lost to a writer (once the export is done)."""
        if self.lost:
            self.notes.append(f"skipped {len(self.lost)} of the {len(self.episodes)} listed episode(s): a writer "
                              "overwrote their steps while the export read them (the episodes exported are "
                              "whole; stop the writer, or export a copy, to export every listed episode)")


@dataclass
class Piece:
    """Consecutive steps of one episode (``start``: holds its first exported step; ``end``: its last).
    Observation dicts map each observation key ("obs" for a plain Box) to an array of ``n`` rows."""

    episode: int
    start: bool
    end: bool
    obs: dict[str, np.ndarray]
    next_obs: dict[str, np.ndarray]
    action: np.ndarray
    reward: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    lost: bool = False  # the episode was overwritten part way: drop what was written of it (no rows here)

    def __len__(self) -> int:
        return int(self.action.shape[0])

    @classmethod
    def lost_marker(cls, episode: int) -> "Piece":
        """The piece that says: episode ``episode`` was overwritten after some of it was yielded."""
        empty = np.zeros(0)
        return cls(episode, False, False, {}, {}, empty, empty, empty.astype(bool), empty.astype(bool), lost=True)


def list_episodes(store, *, include_partial: bool = False,
                  select: Sequence[int] | slice | None = None) -> EpisodeListing:
    """The store's episodes (see the module invariants). ``select`` picks among the listed episodes by
    position (a slice, or a sequence of positions)."""
    oldest, head, (prev, term, trunc) = _links_at_one_commit(store)
    n = head - oldest
    listing = EpisodeListing([])
    if n == 0:
        return _select(listing, select)
    rel_prev = prev - oldest
    cut_root = (prev >= 0) & (rel_prev < 0)  # the predecessor was overwritten
    parent = np.where(rel_prev >= 0, rel_prev, np.arange(n))
    # Pointer jumping: every step learns its episode's first kept step in O(n log L).
    while True:
        grand = parent[parent]
        if np.array_equal(grand, parent):
            break
        parent = grand
    order = np.lexsort((np.arange(n), parent))  # by episode (first kept step), then by step
    roots = parent[order]
    bounds = np.flatnonzero(np.diff(roots)) + 1
    done = term | trunc
    k = store.frame_stack
    for chunk in np.split(order, bounds):
        root = int(chunk[0])
        cut = bool(cut_root[root])
        ended = bool(done[chunk[-1]])
        if cut and not include_partial:
            listing.skipped_cut += 1
            continue
        if not ended and not include_partial:
            listing.skipped_unfinished += 1
            continue
        if cut and k > 1:
            chunk = chunk[k - 1:]  # their frame stacks reach into overwritten steps
            if chunk.size == 0:
                continue
        listing.episodes.append(EpisodeSpan(chunk.astype(np.int64) + oldest, cut, ended))
    if listing.skipped_cut:
        listing.notes.append(f"skipped {listing.skipped_cut} episode(s) whose first steps the ring overwrote "
                             "(include_partial=True exports them from their first readable step)")
    if listing.skipped_unfinished:
        listing.notes.append(f"skipped {listing.skipped_unfinished} unfinished episode(s) (no terminated/"
                             "truncated step yet; include_partial=True exports them)")
    return _select(listing, select)


def _links_at_one_commit(store, tries: int = 20):
    """``(oldest, head, episode_links(oldest, head))``, read again when a writer moved the valid range
    between the two reads (the links of a range that is no longer valid are refused)."""
    for attempt in range(tries):
        oldest, head = store.inspect.valid_range()
        try:
            return oldest, head, store.inspect.episode_links(oldest, head)
        except IndexError:
            if attempt == tries - 1:
                raise RuntimeError(f"could not list the episodes of {store.path!r}: a writer moved its valid "
                                   f"range {tries} times in a row while it was read") from None
    raise AssertionError("unreachable")


def _select(listing: EpisodeListing, select) -> EpisodeListing:
    if select is None:
        return listing
    eps = listing.episodes
    if isinstance(select, slice):
        listing.episodes = eps[_checked_slice(select, len(eps))]
        return listing
    picked = []
    for i in select:
        if not -len(eps) <= int(i) < len(eps):
            raise IndexError(f"episode {i} does not exist: the store has {len(eps)} exportable episode(s)")
        picked.append(eps[int(i)])
    listing.episodes = picked
    return listing


def _checked_slice(select: slice, n: int) -> slice:
    """``select`` over ``n`` episodes, refused when it would be clipped (a bound past the last episode) or
    select nothing: an export must never be silently shorter than asked for."""
    if select.step is not None and select.step <= 0:
        raise ValueError(f"episodes={select}: expected a step > 0")
    bounds = {"start": select.start, "stop": select.stop}
    for name, value in bounds.items():
        if value is not None and not -n <= value <= n:
            raise IndexError(f"episodes={select}: {name} {value} is past the store's {n} exportable episode(s) "
                             f"(positions 0 to {n - 1})" if n else
                             f"episodes={select}: the store has no exportable episode")
    if not range(n)[select]:
        raise ValueError(f"episodes={select} selects no episode of the store's {n} exportable episode(s)")
    return select


def iter_pieces(store, episodes: Sequence[EpisodeSpan], block_rows: int = 4096,
                progress: ProgressFn | None = None, lost: set[int] | None = None) -> Iterator[Piece]:
    """The steps of ``episodes`` in order, read ``block_rows`` transitions at a time (short episodes
    share a read, long ones are split into several pieces). Episodes a writer overwrites before they are
    read are skipped and added to ``lost`` (see the module invariants)."""
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    lost = set() if lost is None else lost
    reader = _BlockReader(store)
    total = sum(len(e) for e in episodes)
    done_rows = 0
    started: set[int] = set()  # episodes some of which was yielded
    queue: list[tuple[int, int, int]] = []  # (episode, lo, hi) positions inside the episode
    queued = 0

    def flush():
        for (e, lo, hi), part in reader.read(episodes, queue):
            if e in lost:
                continue
            if part is None:  # overwritten before it was read: the whole episode goes
                lost.add(e)
                if e in started:
                    yield Piece.lost_marker(e)
                continue
            started.add(e)
            yield Piece(e, lo == 0, hi == len(episodes[e]), *part)

    for e, span in enumerate(episodes):
        lo = 0
        while lo < len(span):
            hi = min(len(span), lo + block_rows - queued)
            queue.append((e, lo, hi))
            queued += hi - lo
            lo = hi
            if queued >= block_rows:
                yield from flush()
                done_rows += queued
                if progress:
                    progress(done_rows, total)
                queue, queued = [], 0
    if queue:
        yield from flush()
        done_rows += queued
    if progress:
        progress(done_rows, total)


class _BlockReader:
    """Reads the steps of queued episode segments in one ``inspect.get``; when a writer overwrote some of
    them meanwhile (``IndexError``), reads each segment alone and reports the ones that are gone."""

    def __init__(self, store):
        self.store = store
        self.action_dtype = store.schema.action.np_dtype if store.action_space is None else \
            np.dtype(store.action_space.dtype)

    def read(self, episodes, queue):
        """``((episode, lo, hi), fields or None)`` per queued segment; fields: the ``Piece`` arrays."""
        ids = np.concatenate([episodes[e].ids[lo:hi] for e, lo, hi in queue])
        try:
            parts = self._fields(ids, [hi - lo for _, lo, hi in queue])
        except IndexError:  # a writer overwrote some of them since the listing
            parts = [self._segment_or_none(episodes[e].ids[lo:hi]) for e, lo, hi in queue]
        return zip(queue, parts)

    def _segment_or_none(self, ids):
        try:
            return self._fields(ids, [ids.size])[0]
        except IndexError:
            return None

    def _fields(self, ids, sizes):
        store = self.store
        batch = store.inspect.get(ids, out=BatchBuffers(store.schema, ids.size, numpy=True))  # numpy: no torch
        obs, next_obs = _frames(batch.obs, store), _frames(batch.next_obs, store)
        action = batch.action.astype(self.action_dtype, copy=False)
        parts, at = [], 0
        for size in sizes:
            part = slice(at, at + size)
            at = part.stop
            parts.append(({k: v[part] for k, v in obs.items()}, {k: v[part] for k, v in next_obs.items()},
                          action[part], batch.reward[part], batch.terminated[part], batch.truncated[part]))
        return parts


def _frames(x, store) -> dict[str, np.ndarray]:
    """Newest frame of each stack (the stored observation), per observation key."""
    arrays = x if isinstance(x, dict) else {"obs": x}
    k = store.frame_stack
    return {name: (a[:, -1] if k > 1 else a) for name, a in arrays.items()}


def as_space_value(obs: dict[str, np.ndarray], dict_obs: bool):
    """Observation dict (per key) -> what a gymnasium space of the store holds: the array, or the dict."""
    return obs if dict_obs else obs["obs"]
