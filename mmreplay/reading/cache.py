"""LRU cache of decoded chunks of one column, in one preallocated slab.

Invariant: ``slot_of[chunk] == s >= 0`` iff ``slab[s]`` holds the decoded chunk ``chunk`` and
``chunk_in[s] == chunk`` (until the first lookup makes it, the table is all -1 and held nowhere); the slab never
grows past its slot count except to fit a single batch. A cache
is direct-mapped while every chunk it admitted lies below its slot count: chunk ``c`` only ever lives in
slot ``c``, so neighbouring frames are neighbours in the slab (a frame stack is one contiguous copy, measured
1.3-1.7x faster than the same stack scattered) and nothing is ever evicted. That holds for good when it has a
slot for every chunk of a fixed address space, and while a ring's frames fill only its first slots (a store
created for 1M transitions holding 20k: measured 1.4-1.8x faster sampling than the LRU over the same
frames); the first chunk admitted past the slots turns it into an LRU cache, keeping what it holds.
Lookups and LRU bookkeeping are vectorised (a chunk -> slot table and a last-used tick per slot),
so a batch of hits costs a few numpy calls. Eviction is exact LRU at batch granularity: the slots
with the oldest tick go first, and never a slot the current batch uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mmreplay._native import cache as kernels


@dataclass
class CacheStats:
    """Counters of one decoded cache, as ``cache_stats()`` reports them: they only grow (a re-plan of the
    tiers carries them over to the new cache)."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes: int = 0  # decoded bytes currently held
    capacity_bytes: int = 0

    def as_dict(self) -> dict:
        return dict(hits=self.hits, misses=self.misses, evictions=self.evictions, bytes=self.bytes,
                    capacity_bytes=self.capacity_bytes)


class ChunkCache:
    """The decoded chunks of one column in one slab, LRU or direct-mapped (see the module invariant:
    ``slot_of`` and ``chunk_in`` always agree, and a slot the current batch uses is never evicted)."""

    def __init__(self, n_chunks: int, chunk_shape: tuple[int, ...], dtype, budget_bytes: int, min_slots: int = 64):
        self.chunk_shape = tuple(chunk_shape)
        self.dtype = np.dtype(dtype)
        self.chunk_nbytes = int(np.prod(chunk_shape, dtype=np.int64)) * self.dtype.itemsize
        n_slots = self.slots_for(n_chunks, self.chunk_nbytes, budget_bytes, min_slots)
        self.slab = np.empty((n_slots, *chunk_shape), dtype=self.dtype)
        self._n_chunks = int(n_chunks)
        self._slot_of: np.ndarray | None = None  # made at the first lookup (``slot_of``)
        self.chunk_in = np.full(n_slots, -1, dtype=np.int64)
        self.last_used = np.zeros(n_slots, dtype=np.int64)
        self._words: np.ndarray | None = None
        self.n_used = 0  # slots [0, n_used) have been handed out at least once
        self._free = np.empty(0, dtype=np.int64)  # slots released since (eviction, invalidation)
        self.tick = 0
        self.stats = CacheStats(capacity_bytes=n_slots * self.chunk_nbytes)
        self.direct_mapped = True  # until a chunk past the slots is admitted (see the module invariant)

    @staticmethod
    def slots_for(n_chunks: int, chunk_nbytes: int, budget_bytes: int, min_slots: int = 64) -> int:
        """The slot count a cache of ``budget_bytes`` gets: no more than the chunks that exist."""
        n_slots = max(min_slots, int(budget_bytes) // max(1, chunk_nbytes))
        return min(n_slots, max(min_slots, n_chunks))

    @property
    def n_slots(self) -> int:
        return self.slab.shape[0]

    @property
    def slot_of(self) -> np.ndarray:
        """The chunk -> slot table (-1: not held), made at its first use: a store written and never sampled (an
        import) does not pay for it, an int32 a chunk filled at once (24 MiB for 50M Atari frames in chunks of 8).
        Callers hold the reader's lock, as for every other change here."""
        if self._slot_of is None:
            self._slot_of = np.full(self._n_chunks, -1, dtype=np.int32)
        return self._slot_of

    def grow_address_space(self, n_chunks: int) -> None:
        """Unbounded stores: more chunks exist now."""
        if n_chunks > self._n_chunks:
            if self._slot_of is not None:
                grown = np.full(n_chunks, -1, dtype=np.int32)
                grown[: self._n_chunks] = self._slot_of
                self._slot_of = grown
            self._n_chunks = int(n_chunks)
            if self.direct_mapped:  # chunk numbers may now pass the slot count: hand out slots as they come
                self._end_direct_mapping()

    def _end_direct_mapping(self) -> None:
        """From now on an LRU cache: the chunks held keep their slots; the empty slots are the free list."""
        self.direct_mapped = False
        self.n_used = self.n_slots
        self._free = np.flatnonzero(self.chunk_in < 0)

    def lookup_rows(self, ids: np.ndarray, ring_rows: int, chunk_rows: int) -> tuple[np.ndarray, np.ndarray, int]:
        """For frames ``ids`` (row ``id % ring_rows`` of the array; ``ring_rows`` 0: row ``id``): their rows
        in the flat slab (``slot * chunk_rows + row % chunk_rows``, -1 where the chunk is missing), their
        chunk numbers, and the hit count; hits are marked used. One compiled pass: the sampler's hot path."""
        self.tick += 1
        slab_rows = np.empty(ids.size, dtype=np.int64)
        chunks = np.empty(ids.size, dtype=np.int64)
        n_hit = kernels.lookup_rows(self.slot_of, self.last_used, self.tick, ids, ring_rows, chunk_rows, slab_rows,
                                    chunks)
        self.stats.hits += n_hit
        self.stats.misses += ids.size - n_hit
        return slab_rows, chunks, n_hit

    def admit(self, chunks: np.ndarray) -> np.ndarray:
        """Slots for ``chunks`` (unique, all missing), evicting the least recently used others."""
        need = int(chunks.size)
        if self.direct_mapped:
            if not need or int(chunks.max()) < self.n_slots:
                return self._place(chunks, chunks.astype(np.int64))
            self._end_direct_mapping()
        fresh = min(need, self.n_slots - self.n_used)  # never-used slots first
        slots = [np.arange(self.n_used, self.n_used + fresh)]
        self.n_used += fresh
        short = need - fresh
        if short > self._free.size:
            self._evict(short - self._free.size)
        reuse = min(short, self._free.size)
        slots.append(self._free[:reuse])
        self._free = self._free[reuse:]
        if short > reuse:  # one batch needs more chunks than the budget holds: grow just enough
            slots.append(self._grow(short - reuse))
        return self._place(chunks, np.concatenate(slots))

    def _place(self, chunks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        self.slot_of[chunks] = slots
        self.chunk_in[slots] = chunks
        self.last_used[slots] = self.tick
        self.stats.bytes += int(chunks.size) * self.chunk_nbytes
        return slots.astype(np.int32)

    def forget(self, chunks: np.ndarray) -> None:
        """Drop ``chunks`` (those held): a batch that failed while filling them leaves no trace."""
        if self._slot_of is None:
            return  # nothing was ever held
        slots = self._slot_of[chunks]
        held = slots[slots >= 0].astype(np.int64)
        if held.size:
            self._release(held)

    def invalidate(self, chunk_lo: int, chunk_hi: int) -> None:
        """Forget chunks in [chunk_lo, chunk_hi) (their data is being overwritten)."""
        if self._slot_of is None:
            return  # nothing was ever held: the writer's overwrites do not make the table
        chunk_hi = min(chunk_hi, self._n_chunks)
        slots = self._slot_of[chunk_lo:chunk_hi]
        held = slots[slots >= 0].astype(np.int64)
        if held.size:
            self._release(held)

    def clear(self) -> None:
        if self._slot_of is None:
            return  # nothing was ever held (closing a writer that never sampled does not make the table)
        self._release(np.flatnonzero(self.chunk_in >= 0))

    def _release(self, slots: np.ndarray) -> None:
        self.slot_of[self.chunk_in[slots]] = -1
        self.chunk_in[slots] = -1
        self.last_used[slots] = -1
        if not self.direct_mapped:  # direct-mapped slots belong to their chunk: no free list
            self._free = np.concatenate([self._free, slots])
        self.stats.bytes -= int(slots.size) * self.chunk_nbytes

    def _evict(self, count: int) -> None:
        # Evict a few more than needed so the O(slots) partition runs once per many misses.
        never = np.iinfo(np.int64).max
        ticks = np.where(self.chunk_in >= 0, self.last_used, never)
        ticks[self.last_used == self.tick] = never  # in use by the current batch
        count = min(int(np.count_nonzero(ticks < never)), max(count, self.n_slots // 64))
        if count <= 0:
            return
        victims = np.argpartition(ticks, count - 1)[:count]
        self._release(victims)
        self.stats.evictions += int(victims.size)

    def slab_words(self, row_nbytes: int) -> np.ndarray:
        """The slab as (rows, words) of 8-byte words (1-byte when rows are not a multiple of 8), for
        compiled copies; cached until the slab grows."""
        if self._words is None:
            word = np.uint64 if row_nbytes % 8 == 0 else np.uint8
            self._words = self.slab.view(np.uint8).reshape(-1, row_nbytes).view(word)
        return self._words

    def _grow(self, extra: int) -> np.ndarray:
        old = self.n_slots
        self._words = None
        self.slab = np.concatenate([self.slab, np.empty((extra, *self.chunk_shape), self.dtype)])
        self.chunk_in = np.concatenate([self.chunk_in, np.full(extra, -1, np.int64)])
        self.last_used = np.concatenate([self.last_used, np.full(extra, -1, np.int64)])
        self.stats.capacity_bytes = self.n_slots * self.chunk_nbytes
        self.n_used = self.n_slots
        return np.arange(old, old + extra)
