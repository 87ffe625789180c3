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

    @property
    def steps(self) -> int:
        return sum(len(e) for e in self.episodes)


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

    def __len__(self) -> int:
        return int(self.action.shape[0])


def list_episodes(store, *, include_partial: bool = False,
                  select: Sequence[int] | slice | None = None) -> EpisodeListing:
    """The store's episodes (see the module invariants). ``select`` picks among the listed episodes by
    position (a slice, or a sequence of positions)."""
    oldest, head = store.inspect.valid_range()
    n = head - oldest
    listing = EpisodeListing([])
    if n == 0:
        return _select(listing, select)
    prev, term, trunc = store.inspect.episode_links(oldest, head)
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
                progress: ProgressFn | None = None) -> Iterator[Piece]:
    """The steps of ``episodes`` in order, read ``block_rows`` transitions at a time (short episodes
    share a read, long ones are split into several pieces)."""
    if block_rows < 1:
        raise ValueError(f"block_rows must be >= 1, got {block_rows}")
    action_dtype = store.schema.action.np_dtype if store.action_space is None else \
        np.dtype(store.action_space.dtype)
    total = sum(len(e) for e in episodes)
    done_rows = 0
    queue: list[tuple[int, int, int]] = []  # (episode, lo, hi) positions inside the episode
    queued = 0

    def flush():
        ids = np.concatenate([episodes[e].ids[lo:hi] for e, lo, hi in queue])
        batch = store.inspect.get(ids, out=BatchBuffers(store.schema, ids.size, numpy=True))  # numpy: no torch
        obs, next_obs = _frames(batch.obs, store), _frames(batch.next_obs, store)
        action = batch.action.astype(action_dtype, copy=False)
        reward = batch.reward
        term, trunc = batch.terminated, batch.truncated
        at = 0
        for e, lo, hi in queue:
            part = slice(at, at + hi - lo)
            at = part.stop
            yield Piece(e, lo == 0, hi == len(episodes[e]), {k: v[part] for k, v in obs.items()},
                        {k: v[part] for k, v in next_obs.items()}, action[part], reward[part], term[part],
                        trunc[part])

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


def _frames(x, store) -> dict[str, np.ndarray]:
    """Newest frame of each stack (the stored observation), per observation key."""
    arrays = x if isinstance(x, dict) else {"obs": x}
    k = store.frame_stack
    return {name: (a[:, -1] if k > 1 else a) for name, a in arrays.items()}


def as_space_value(obs: dict[str, np.ndarray], dict_obs: bool):
    """Observation dict (per key) -> what a gymnasium space of the store holds: the array, or the dict."""
    return obs if dict_obs else obs["obs"]
