"""What a store holds, episode by episode, for ``mmreplay info`` and ``mmreplay plot``.

Invariants:
- Read-only, built on the public ``Store`` API (``inspect.valid_range``, ``inspect.episode_links``,
  ``inspect.read_column``: the resident index, never a frame; ``inspect.get`` would decode every frame
  stack just to read a reward) and, for committed priorities, on the storage layer's reader of the
  priority files (``storage/priority_files.read_committed``); nothing here parses the on-disk format.
- Memory is bounded by the chunk (``CHUNK`` transitions) plus a few numbers per episode, never by the
  store: episodes are followed across chunks by carrying the open ones (at most one per stream).
- An episode counts as *complete* when its first step is still kept and it has ended (terminated or
  truncated); returns and lengths are over complete episodes, in the order they ended. Episodes whose
  start the ring overwrote (*cut*) and episodes still running are counted, not measured.
- A writer committing while this reads may change the oldest rows under it: the figures describe the
  store at about the moment they were read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from mmreplay.storage.durability import priority_files
from mmreplay.storage.durability.commit import read_commit

#: transitions read per step (a few MB of links, flags and rewards)
CHUNK = 1 << 18


# -- committed priorities --------------------------------------------------------------------------------

def committed_priorities(store) -> dict[str, np.ndarray]:
    """Raw priorities of every prioritized sampler that has committed some (by sampler name), for the
    transitions ``[oldest, head)`` of the store's last commit, in id order: what the commit's buffers hold,
    and the sampler's ``max_priority`` for transitions added after its last commit (what sampling gives
    them). Read from the files (``storage/durability/priority_files.py``): no priority set is loaded into the store."""
    return priority_files.read_committed(store.path, read_commit(store.path), store.geometry.transitions)


# -- episodes --------------------------------------------------------------------------------------------

@dataclass
class EpisodeStats:
    """Complete episodes in the order they ended, and counts of the others."""

    returns: np.ndarray = field(default_factory=lambda: np.zeros(0))
    lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    end_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # global id of the last step
    cut: int = 0  # ended, but the ring overwrote their first steps
    running: int = 0  # kept start (or cut), no end flag yet

    @property
    def complete(self) -> int:
        return int(self.returns.size)

    def summary(self, last: int = 100) -> dict:
        """Counts and return / length statistics (JSON-ready; None where there is no complete episode)."""
        out = {"complete": self.complete, "cut": self.cut, "running": self.running}
        if not self.complete:
            return {**out, "return": None, "length": None}
        r, n = self.returns, self.lengths
        return {**out, "return": {"mean": float(r.mean()), "min": float(r.min()), "max": float(r.max()),
                                  f"last_{last}_mean": float(r[-last:].mean()), "last": min(last, r.size)},
                "length": {"mean": float(n.mean()), "min": int(n.min()), "max": int(n.max())}}


def episode_stats(store, chunk: int = CHUNK) -> EpisodeStats:
    """Returns and lengths of the store's episodes (see the module invariants)."""
    oldest, head = store.inspect.valid_range()
    # open episodes, keyed by the global id of their latest step: [return, length, cut]
    open_eps: dict[int, list] = {}
    returns, lengths, ends = [], [], []
    cut_ended = 0
    for lo in range(oldest, head, chunk):
        hi = min(head, lo + chunk)
        prev, term, trunc = store.inspect.episode_links(lo, hi)
        reward = store.inspect.read_column("reward", lo, hi).astype(np.float64)
        n = hi - lo
        local = prev - lo
        inside = (prev >= lo)
        parent = np.where(inside, local, np.arange(n))
        while True:  # pointer jumping: every step learns its episode's first step in this chunk
            grand = parent[parent]
            if np.array_equal(grand, parent):
                break
            parent = grand
        roots, inverse = np.unique(parent, return_inverse=True)
        sums = np.bincount(inverse, weights=reward, minlength=roots.size)
        counts = np.bincount(inverse, minlength=roots.size)
        last = np.zeros(roots.size, np.int64)
        np.maximum.at(last, inverse, np.arange(n))
        done = term[last] | trunc[last]
        for j, r in enumerate(roots.tolist()):
            p = int(prev[r])
            if p < 0:
                ep = [0.0, 0, False]
            else:  # continues an episode of an earlier chunk, or one whose start was overwritten
                ep = open_eps.pop(p, None) or [0.0, 0, True]
            ep[0] += float(sums[j])
            ep[1] += int(counts[j])
            if done[j]:
                if ep[2]:
                    cut_ended += 1
                else:
                    returns.append(ep[0])
                    lengths.append(ep[1])
                    ends.append(lo + int(last[j]))
            else:
                open_eps[lo + int(last[j])] = ep
    order = np.argsort(np.asarray(ends, np.int64), kind="stable")
    return EpisodeStats(np.asarray(returns, np.float64)[order], np.asarray(lengths, np.int64)[order],
                        np.asarray(ends, np.int64)[order], cut=cut_ended, running=len(open_eps))
