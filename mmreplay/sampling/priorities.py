"""Priorities for proportional prioritized replay: one value per ring slot, a sum tree, crash-safe on disk.

Invariants (all under the store's lock):
- ``raw[slot]`` is the priority last given to the transition in that slot (``update``), or the running
  maximum priority at the time it was added. ``drawable[slot]`` is True iff the slot holds a valid
  transition of ``[oldest, head)`` as of the last ``sync``; its leaf in the tree is then
  ``(raw + eps) ** alpha`` (0 for a zero priority with ``eps = 0``), and 0 otherwise, so the tree only
  ever draws transitions that exist.
- ``sync`` is lazy: nothing on the add path knows about priorities. Before each draw or update the
  transitions added since the last sync enter the tree at the maximum priority and those given up
  (overwritten, or whose frame stack now reaches below ``oldest``) leave it.
- Persistence is given, not imported: a ``PriorityPersistence`` (``state.py`` hands each set its
  ``storage/durability/priority_files.py`` ``PriorityFiles``: two buffers, the commit writes the one the record does not
  name; a crash reopens the priorities of the last commit exactly). Every change to ``raw`` is marked there
  (``files.mark``, or the update kernel writing ``files.new_tick()`` into ``files.shard_tick``).
"""

from __future__ import annotations

import math
from typing import Protocol

import numpy as np

from mmreplay.errors import FormatError
from mmreplay.index.ring import TransitionRing, as_transition_ids
from mmreplay.index.sumtree import SumTree
from mmreplay.storage.public import check_leaf_range, valid_name
from mmreplay._native import priorities as kernels

INITIAL_MAX_PRIORITY = 1.0
DEFAULT_ALPHA = 0.6
DEFAULT_PRIORITY_EPS = 1e-6


class PriorityPersistence(Protocol):
    """The files of one priority set, as a set drives them (``storage/durability/priority_files.py``'s ``PriorityFiles``
    is the one the store hands in): which shards changed since each buffer was written, writing the buffer
    the record does not name, reading a committed one back, and the record entry naming the committed one."""

    buffer: int  # the committed buffer (what ``entry`` names)
    shard_tick: np.ndarray  # tick of each file shard's last change (the update kernel writes into it)

    def new_tick(self) -> int: ...
    def mark(self, slots: np.ndarray) -> None: ...
    def stale(self) -> bool: ...
    def grow(self, rows: int) -> None: ...
    def make_files(self) -> None: ...
    def flush(self, raw: np.ndarray) -> list[str]: ...
    def load(self, buffer: int, live: np.ndarray) -> np.ndarray: ...
    def entry(self, max_priority: float, head: int, alpha: float, eps: float) -> dict: ...
    def close(self) -> None: ...


def check_name(name) -> str:
    if not valid_name(name):
        raise ValueError(f"sampler name must be 1-64 letters, digits, '_' or '-' (it names a directory), "
                         f"got {name!r}")
    return name


def check_exponent(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError(f"{what} must be a finite number >= 0, got {value!r}")
    return float(value)


class Priorities:
    """One named priority set of a store (what ``store.inspect.priorities(name)`` returns): ``raw`` holds the
    priority of each ring slot, ``tree`` the sum tree of leaves ``(raw + eps) ** alpha``. Update it through
    the prioritized sampler of the same name (``sampler.update_priorities``)."""

    def __init__(self, ring: TransitionRing, frames, frame_stack: int, files: PriorityPersistence, name: str, *,
                 alpha: float, eps: float, entry: dict | None):
        """A priority set for ``ring`` (whose frame stacks of ``frame_stack`` frames point into ``frames``,
        an object with a ``head``), persisted by ``files`` (laid out for ``ring`` as it is now); ``entry`` is
        its committed record (None: new)."""
        self.ring, self.frames, self.frame_stack = ring, frames, frame_stack
        self.name = check_name(name)
        self.alpha = check_exponent(alpha, "alpha")
        self.eps = check_exponent(eps, "eps")
        check_leaf_range(INITIAL_MAX_PRIORITY, self.alpha, self.eps, f"priority set {name!r}")
        self.rows = ring.rows
        self.shard_rows = ring.shard_rows
        self.raw = np.zeros(self.rows, dtype=np.float32)
        self.drawable = np.zeros(self.rows, dtype=np.bool_)  # holds a valid transition (its leaf may be 0)
        self.tree = SumTree(self.rows)
        self.max_priority = INITIAL_MAX_PRIORITY
        self.synced_head = self.synced_oldest = ring.oldest
        self.files = files
        self._draw_buffers: dict[int, tuple] = {}
        if entry is not None:
            self._load(entry)
        self.sync()

    def rebind(self, ring: TransitionRing) -> None:
        """A reader reloaded its index (``Store.refresh``): follow the new ring; the next sync catches up."""
        self.ring = ring

    # -- keeping the tree in step with the ring ----------------------------------------------------
    def leaf_values(self, raw: np.ndarray) -> np.ndarray:
        out = np.empty(raw.shape)
        kernels.leaf_values(np.ascontiguousarray(raw, dtype=np.float32).reshape(-1), self.alpha, self.eps,
                            out.reshape(-1))
        return out

    def sync(self) -> None:
        """Bring the tree up to the ring's ``[oldest, head)``: new transitions enter at the maximum
        priority, those given up leave."""
        ring = self.ring
        if ring.rows != self.rows:
            self._regrow(ring.rows)
        head, oldest = ring.head, ring.oldest
        if head == self.synced_head and oldest == self.synced_oldest:
            return
        gone = np.arange(self.synced_oldest, min(oldest, self.synced_head), dtype=np.int64)
        if gone.size:
            self._undraw(ring.slot(gone))
        new = np.arange(max(self.synced_head, oldest), head, dtype=np.int64)
        if new.size:
            slots = ring.slot(new)
            self.raw[slots] = self.max_priority
            self.drawable[slots] = True
            self.files.mark(slots)
            self.tree.update(slots, self.leaf_values(self.raw[slots]))
        if oldest != self.synced_oldest or new.size:
            self._drop_stacks_below_oldest()
        self.synced_head, self.synced_oldest = head, oldest

    def _drop_stacks_below_oldest(self) -> None:
        """Transitions just above ``oldest`` whose frame stack reaches below it are not drawable."""
        ring, k = self.ring, self.frame_stack
        if k == 1 or ring.head == ring.oldest:
            return
        window = min(ring.head - ring.oldest, (k - 1) * max(1, ring.max_prev_delta))
        g = np.arange(ring.oldest, ring.oldest + window, dtype=np.int64)
        _, _, valid = ring.stack_frames(g, k, self.frames.head)
        if not valid.all():
            self._undraw(ring.slot(g[~valid]))

    def _undraw(self, slots: np.ndarray) -> None:
        self.drawable[slots] = False
        self.tree.update(slots, 0.0)

    def _set_leaves_from_raw(self) -> None:
        leaves = np.zeros(self.rows)
        leaves[self.drawable] = self.leaf_values(self.raw[self.drawable])
        self.tree.set_all(leaves)

    def _regrow(self, rows: int) -> None:
        """An unbounded ring doubled (slot == global id there): carry the priorities over."""
        raw = np.zeros(rows, dtype=np.float32)
        raw[: self.rows] = self.raw
        drawable = np.zeros(rows, dtype=np.bool_)
        drawable[: self.rows] = self.drawable
        self.raw, self.drawable, self.rows = raw, drawable, rows
        self.tree = SumTree(rows)
        self._set_leaves_from_raw()
        self.files.grow(rows)
        self._drop_stacks_below_oldest()

    def set_alpha(self, alpha: float, eps: float) -> None:
        """A sampler with other exponents took this set over: recompute every leaf from ``raw``."""
        if type(alpha) is float and type(eps) is float and alpha == self.alpha and eps == self.eps:
            return  # the same exponents (every draw and update of a sampler passes its own): nothing to check
        alpha, eps = check_exponent(alpha, "alpha"), check_exponent(eps, "eps")
        if (alpha, eps) == (self.alpha, self.eps):
            return
        check_leaf_range(self.max_priority, alpha, eps, f"priority set {self.name!r}")
        self.alpha, self.eps = alpha, eps
        self._set_leaves_from_raw()

    # -- drawing and updating ---------------------------------------------------------------------
    def draw(self, batch_size: int, rng: np.random.Generator, beta: float):
        """``batch_size`` valid transitions drawn with probability proportional to their leaf (stratified:
        one draw in each of ``batch_size`` equal slices of the total), their frame stacks and their
        importance-sampling weights ``(leaf / min leaf) ** -beta`` (the largest possible weight is 1)."""
        ring, tree, k = self.ring, self.tree, self.frame_stack
        self.sync()
        ring_rows = 0 if ring.capacity is None else ring.rows
        out = self._draw_buffers.get(batch_size)
        if out is None:  # reused: the caller copies them into its batch under the store's lock
            out = self._draw_buffers[batch_size] = (
                np.empty(batch_size, np.int64), np.empty(batch_size, np.int64), np.empty(batch_size),
                np.empty(batch_size), np.empty((batch_size, k), np.int64), np.empty((batch_size, k), np.int64),
                np.empty(batch_size, np.bool_))
        slots, g, leaf, weights, obs_ids, next_ids, valid = out
        arrays = ring.arrays
        for _ in range(1000):
            if tree.total <= 0:
                raise ValueError("cannot sample from an empty store (no valid transitions yet)")
            bad = kernels.draw_batch(tree.sums, tree.offsets, tree.b, tree.n_leaves, rng.random(batch_size),
                                     ring.head, ring.oldest, ring_rows, tree.min_positive, -beta, arrays["obs_frame"],
                                     arrays["next_frame"], arrays["prev_delta"], self.frames.head, k,
                                     slots, g, leaf, weights, obs_ids, next_ids, valid)
            if not bad:
                return g, obs_ids, next_ids, weights
            # Rare: a stack reaching below ``oldest`` (its transition leaves the tree for good) or a float
            # rounding miss onto an empty leaf. Draw the whole batch again so it stays stratified.
            drop = slots[~valid]
            if drop.size:
                self._undraw(drop)
        raise RuntimeError("could not draw valid transitions from the priority tree (index inconsistent?)")

    def update(self, indices, priorities) -> int:
        """Set the priorities of transitions ``indices`` (global ids, as in ``Batch.indices``). Ids the
        ring gave up since they were sampled are skipped. Returns how many were updated."""
        g = as_transition_ids(indices)
        p = _as_priorities(priorities, g.size)
        top = float(p.max(initial=0.0))
        if top == top:  # NaN is refused by kernels.apply_update, with the others that are not finite and >= 0
            check_leaf_range(top, self.alpha, self.eps, "update_priorities")
        ring = self.ring
        self.sync()
        tree, files = self.tree, self.files
        n, top = kernels.apply_update(g, p, ring.oldest, ring.head, 0 if ring.capacity is None else ring.rows,
                                      self.shard_rows, files.new_tick(), self.alpha, self.eps, self.raw,
                                      files.shard_tick, self.drawable, tree.sums, tree.mins, tree.offsets, tree.b)
        if n == -1:
            bad = g[(g < 0) | (g >= ring.head)][:8].tolist()
            raise IndexError(f"transition ids {bad} were never added (ids lie in [0, {ring.head}))")
        if n == -2:
            bad = p[~np.isfinite(p) | (p < 0)][:8].tolist()
            raise ValueError(f"priorities must be finite and >= 0, got {bad}")
        self.max_priority = max(self.max_priority, top)
        return n

    def of(self, indices) -> np.ndarray:
        """The current priorities (float32 copies) of valid transitions ``indices``."""
        g = as_transition_ids(indices)
        self.sync()
        ring = self.ring
        if g.size and (g.min() < ring.oldest or g.max() >= ring.head):
            raise IndexError(f"transition ids must lie in the valid range [{ring.oldest}, {ring.head}), got "
                             f"{g[(g < ring.oldest) | (g >= ring.head)][:8].tolist()}")
        return self.raw[ring.slot(g)].copy()

    @property
    def total(self) -> float:
        """The priority mass: the sum of every drawable leaf ``(priority + eps) ** alpha``."""
        self.sync()
        return float(self.tree.total)

    @property
    def smallest(self) -> float:
        """The smallest positive drawable leaf ``(priority + eps) ** alpha`` (what importance weights are
        relative to; ``inf`` when no leaf is drawable)."""
        self.sync()
        return float(self.tree.min_positive)

    # -- persistence (the PriorityPersistence given), driven by the commit ----------------------------
    def write(self) -> tuple[dict, list[str]]:
        """Write the shards the other buffer lacks; returns the record entry naming it and the files
        written (to fsync before the commit record names them)."""
        self.sync()
        written = self.files.flush(self.raw)
        return self.entry(), written

    def make_files(self) -> None:
        """The buffers' zarr metadata (``PriorityFiles.make_files``): a writer makes them with the set."""
        self.files.make_files()

    def changed(self, committed: dict | None) -> bool:
        """Does the committed buffer (whose record entry is ``committed``) lack anything: updates, or
        transitions the tree has not seen?"""
        return self.synced_head != self.ring.head or self.files.stale() or committed != self.entry()

    def entry(self) -> dict:
        return self.files.entry(self.max_priority, self.synced_head, self.alpha, self.eps)

    def _load(self, entry: dict) -> None:
        """Read the committed buffer; transitions the set had not seen yet enter at the max priority."""
        ring = self.ring
        self.max_priority = entry["max_priority"]
        live_hi = max(ring.oldest, min(entry["head"], ring.head))
        live = np.arange(ring.oldest, live_hi, dtype=np.int64)
        self.raw[:] = self.files.load(entry["buffer"], ring.slot(live))
        check_leaf_range(max(self.max_priority, float(self.raw.max(initial=0.0))), self.alpha, self.eps,
                         f"committed priority set {self.name!r}", FormatError)
        self.drawable[ring.slot(live)] = True
        self._set_leaves_from_raw()
        self.synced_oldest = ring.oldest
        self.synced_head = live_hi
        self._drop_stacks_below_oldest()

    def close(self) -> None:
        self.files.close()


def _as_priorities(priorities, n: int) -> np.ndarray:
    if hasattr(priorities, "detach"):
        priorities = priorities.detach().cpu().numpy()
    p = np.ascontiguousarray(priorities, dtype=np.float64).reshape(-1)
    if p.size != n:
        raise ValueError(f"got {p.size} priorities for {n} indices (expected one priority per index)")
    return p  # range checked by kernels.apply_update before anything changes

