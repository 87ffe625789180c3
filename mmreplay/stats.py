"""What a store holds, episode by episode, for ``mmreplay info`` and ``mmreplay plot``.

Invariants:
- Read-only, built on the public ``Store`` API (``inspect.valid_range``, ``inspect.episode_links``,
  ``inspect.read_column``: the resident index, no frame decoded) plus plain zarr reads of the documented
  on-disk format (``docs/format.md``) for small columns (``ColumnReader``, what ``plot`` uses) and committed
  priorities. ``episode_stats`` imports no zarr, and ``committed_priorities`` only when the commit record
  names a priority set, so ``mmreplay info`` starts without it.
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

#: transitions read per step (a few MB of links, flags and rewards)
CHUNK = 1 << 18


# -- reading small columns with plain zarr (docs/format.md) ---------------------------------------------

class ColumnReader:
    """Values of one transition column for global ids ``[lo, hi)``, read with zarr from the store's
    directory: slots ``g % transition_rows`` (``g`` when unbounded), packed columns decoded lsb-first."""

    def __init__(self, path: str, name: str):
        import zarr

        root = zarr.open_group(str(path), mode="r")
        meta = root.attrs["mmreplay"]
        record = root["commit"].attrs["mmreplay_commit"]
        self.array = root[f"transitions/{name}"]
        self.rows = None if meta["capacity"] is None else int(record["transition_rows"])
        attrs = self.array.attrs.get("mmreplay") or {}
        self.bits = int(attrs.get("packed_bits", 0))
        self.values = np.asarray(attrs["values"]) if self.bits else None

    def read(self, lo: int, hi: int) -> np.ndarray:
        if hi <= lo:
            return self.values[:0] if self.bits else np.zeros((0, *self.array.shape[1:]), self.array.dtype)
        return np.concatenate([self._read_slots(a, b) for a, b in self._slot_ranges(lo, hi)])

    def _slot_ranges(self, lo: int, hi: int):
        """Contiguous slot ranges covering ids ``[lo, hi)`` in id order (a ring wraps at most once a lap)."""
        if self.rows is None:
            return [(lo, hi)]
        out = []
        g = lo
        while g < hi:
            a = g % self.rows
            n = min(hi - g, self.rows - a)
            out.append((a, a + n))
            g += n
        return out

    def _read_slots(self, a: int, b: int) -> np.ndarray:
        if not self.bits:
            return np.asarray(self.array[a:b])
        first, last = (a * self.bits) // 8, ((b * self.bits) + 7) // 8
        raw = np.asarray(self.array[first:last], dtype=np.uint8)
        pos = np.arange(a, b, dtype=np.int64) * self.bits
        codes = (raw[(pos // 8) - first] >> (pos % 8).astype(np.uint8)) & ((1 << self.bits) - 1)
        return self.values[codes]


def committed_priorities(path: str) -> dict[str, np.ndarray]:
    """Raw priorities of every prioritized sampler that has committed some (by sampler name), for the
    kept transitions: ``priorities/<name>/<buffer>`` rows as the commit record names them; transitions
    added after the sampler's last commit have its ``max_priority`` (what sampling gives them)."""
    from mmreplay.storage.commit import read_commit

    if not read_commit(str(path)).get("priorities"):
        return {}  # no prioritized sampler committed: nothing to open with zarr (~0.3 s of import)
    import zarr

    root = zarr.open_group(str(path), mode="r")
    meta = root.attrs["mmreplay"]
    record = root["commit"].attrs["mmreplay_commit"]
    oldest, head = int(record["oldest"]), int(record["head"])
    rows = None if meta["capacity"] is None else int(record["transition_rows"])
    out = {}
    for name, entry in record.get("priorities", {}).items():
        array = root[f"priorities/{name}/{entry['buffer']}"]
        covered = min(int(entry["head"]), head)
        parts = []
        g = oldest
        while g < covered:
            a = g if rows is None else g % rows
            n = covered - g if rows is None else min(covered - g, rows - a)
            parts.append(np.asarray(array[a:a + n], dtype=np.float32))
            g += n
        parts.append(np.full(head - max(covered, oldest), entry["max_priority"], np.float32))
        out[name] = np.concatenate(parts)
    return out


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
        reward = store.inspect.read_column("reward", lo, hi).astype(np.float64)  # resident: no file read
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
