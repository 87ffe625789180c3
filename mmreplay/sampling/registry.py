"""What a store keeps per sampler name: its priority set and its committed RNG state.

Invariants (all under the store's lock):
- ``PrioritySets``: at most one loaded ``Priorities`` per name; a set not loaded yet is created from its
  committed record entry on first use, so an untouched set costs nothing; a writer's set has its files'
  zarr metadata from then on (the commit at interpreter exit cannot run zarr). ``entries`` is what the
  next commit record names (the committed entry of every set, updated by ``flush``, which the commit drives
  like the rings' ``flush``).
- ``SamplerStates``: at most one open sampler per name (its RNG state is what gets committed); a second
  one while the first is open is an error naming both. ``state()`` is the committed states of samplers
  not open now, overlaid with the live state of every open one.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

from mmreplay.index.ring import TransitionRing
from mmreplay.sampling.priorities import (DEFAULT_ALPHA, DEFAULT_PRIORITY_EPS, Priorities, PriorityPersistence,
                                          check_name)

# Makes the files of set ``name`` laid out for ``ring`` as it is now (state.py hands in storage's PriorityFiles)
OpenPriorityFiles = Callable[[str, TransitionRing], PriorityPersistence]


class PrioritySets:
    """The priority sets of one store, by name (see the module invariant)."""

    def __init__(self, open_files: OpenPriorityFiles, ring: TransitionRing, frames, frame_stack: int,
                 committed: dict[str, dict], *, writable: bool = False):
        """Sets over ``ring``'s transitions whose stacks of ``frame_stack`` frames point into ``frames``,
        each persisted by ``open_files(name, ring)``; ``committed`` is the record's entry of every set."""
        self.open_files, self.ring, self.frames, self.frame_stack = open_files, ring, frames, frame_stack
        self.writable = writable  # a writer's sets make their files when made (see PriorityFiles.make_files)
        self.entries: dict[str, dict] = dict(committed)  # committed, maybe not loaded
        self.loaded: dict[str, Priorities] = {}
        self.written: list[str] = []  # files written by ``flush`` since the last commit took them

    def get(self, name: str, alpha: float | None = None, eps: float | None = None) -> Priorities:
        """Set ``name`` (loaded, or made from its committed entry, or new); ``alpha``/``eps`` given change its
        exponents, left out a committed set keeps its own and a new one gets the defaults."""
        # a loaded set's name was checked when it was made (a draw and an update ask for it every batch)
        prio = self.loaded.get(name) if type(name) is str else None
        if prio is None:
            check_name(name)
            entry = self.entries.get(name)
            saved = entry or {}
            alpha = saved.get("alpha", DEFAULT_ALPHA) if alpha is None else alpha
            eps = saved.get("eps", DEFAULT_PRIORITY_EPS) if eps is None else eps
            prio = Priorities(self.ring, self.frames, self.frame_stack, self.open_files(name, self.ring), name,
                              alpha=alpha, eps=eps, entry=entry)
            if self.writable:
                prio.make_files()
            self.loaded[name] = prio
        elif alpha is not None or eps is not None:
            prio.set_alpha(prio.alpha if alpha is None else alpha, prio.eps if eps is None else eps)
        return prio

    def changed(self) -> bool:
        return any(p.changed(self.entries.get(n)) for n, p in self.loaded.items())

    def flush(self) -> None:
        """Each loaded set writes its other buffer (the files go to ``written``, as the rings' do, to be made
        durable before the record); ``entries`` then names it."""
        for name, prio in self.loaded.items():
            entry, files = prio.write()
            self.entries[name] = entry
            self.written.extend(files)

    def reload(self, ring: TransitionRing, committed: dict[str, dict]) -> None:
        """A reader loaded a newer commit: loaded sets follow the new ring (their values stay in RAM), sets
        made from now on start from the new commit."""
        self.ring = ring
        self.entries = dict(committed)
        for prio in self.loaded.values():
            prio.rebind(ring)

    def close(self) -> None:
        for prio in self.loaded.values():
            prio.close()


class SamplerStates:
    """The RNG states of one store's samplers, by name: committed ones and those of open samplers."""

    def __init__(self, committed: dict[str, dict]):
        self.saved: dict[str, dict] = dict(committed)
        self.live: weakref.WeakValueDictionary = weakref.WeakValueDictionary()

    def register(self, sampler: Any) -> None:
        """``sampler`` (with ``name``, ``state``, ``closed``) is now the open sampler of its name."""
        old = self.live.get(sampler.name)
        if old is not None and old is not sampler:
            if not old.closed:
                raise ValueError(f"a sampler named {sampler.name!r} is already open on this store (its RNG state "
                                 "and priorities are committed under that name); close it first, or give this "
                                 "one another name=")
            self.saved[old.name] = old.state
        self.live[sampler.name] = sampler

    def has(self, name: str) -> bool:
        return name in self.saved or name in self.live

    def saved_state(self, name: str) -> dict | None:
        return self.saved.get(name)

    def state(self) -> dict[str, dict]:
        return {**self.saved, **{n: smp.state for n, smp in list(self.live.items())}}

    def changed(self, committed: dict[str, dict]) -> bool:
        return any(committed.get(n) != smp.state for n, smp in list(self.live.items()))

    def close_all(self) -> None:
        for sampler in list(self.live.values()):
            self.saved[sampler.name] = sampler.state
            sampler.close()

    def reload(self, committed: dict[str, dict]) -> None:
        """Samplers made from now on start from this commit (open ones keep their own state)."""
        self.saved = dict(committed)
