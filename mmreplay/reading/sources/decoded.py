"""The decoded cache as a source of frames: chunks decoded once into the cache slab (``reading/cache.py``), copied
out by compiled code; a batch's misses are filled first, from the sources below it (the router's ``fill``).

Invariant: a frame is copied out of the slab only from a slot that holds its chunk as stored now (the writer's
overwrites invalidate slots first: ``ColumnReader.invalidate_rows``); a fill that fails (I/O error, corrupt chunk)
leaves none of the chunks it admitted cached, so later hits never return a slot's old bytes as data. Hits and misses
count frame lookups (``CacheStats``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from mmreplay._native import decode as native
from mmreplay._native.gather import checked_gather_cached, checked_gather_stacks, checked_index_cached
from mmreplay._native.helpers import STACKS_PER_PIECE
from mmreplay.index.frame_ring import FrameRing
from mmreplay.reading.decoding import Decoder

if TYPE_CHECKING:
    from mmreplay.reading.requests import FramePlaces
    from mmreplay.reading.tiers import ColumnReader

# From this many stacks a batch's copy out of the decoded slab is shared with the codec helpers
# (``_native/helpers.py``); below, one compiled call in the caller's thread is cheaper ...
SHARED_MIN_STACKS = 2 * STACKS_PER_PIECE
# ... and only from this many bytes: handing over and waiting for the helpers costs ~10 us a batch, the copy of
# a low-dim batch (32 stacks of 16-byte rows) well under 1 us (~10% of low-dim batch-32's time).
SHARED_MIN_STACK_BYTES = 256 * 1024


class DecodedCacheSource:
    """Frames copied out of each column's decoded cache (see the module invariant). ``fill(col, chunks, slots)``
    brings chunks the cache lacks into the slots it admitted them to (the router: writer's RAM, compressed tier,
    files)."""

    def __init__(self, ring: FrameRing, decoder: Decoder, fill: Callable[["ColumnReader", np.ndarray, np.ndarray],
                                                                         None]):
        self.ring = ring
        self.decoder = decoder
        self.fill = fill

    def copy_stacks(self, col: "ColumnReader", obs_ids, next_ids, obs_words, next_words, shifted: bool,
                    ring_rows: int) -> None:
        """``FrameReader.gather_stacks`` through the cache: the common case, every frame cached, is lookup and
        LRU marks in one compiled pass, and the copy in the same call (small batches) or shared with the helpers;
        otherwise the misses are filled first."""
        cache = col.cache
        n, k = obs_ids.shape
        # 8-byte words when rows allow (Atari's 7,056-byte frames do): the copy loops run at memcpy speed
        slab = cache.slab_words(col.row_nbytes)
        shared = n >= SHARED_MIN_STACKS and n * (k + 1) * col.row_nbytes >= SHARED_MIN_STACK_BYTES
        helpers = self.decoder.helpers() if shared else None
        cache.tick += 1
        if helpers is None:
            hits = checked_gather_cached(cache.slot_of, cache.last_used, cache.tick, ring_rows, col.spec.chunk_rows,
                                         slab, obs_ids, next_ids, shifted, obs_words, next_words)
            if hits >= 0:
                cache.stats.hits += hits
                return
        else:
            index = np.empty((n, k + 1 if shifted else 2 * k), dtype=np.int64)
            hits = checked_index_cached(cache.slot_of, cache.last_used, cache.tick, ring_rows, col.spec.chunk_rows,
                                        obs_ids, next_ids, shifted, index)
            if hits >= 0:
                cache.stats.hits += hits
                self._copy_out(helpers, slab, index, k, shifted, obs_words, next_words)
                return
        union = np.concatenate([obs_ids, next_ids[:, -1:] if shifted else next_ids], axis=1)
        index = self.slab_index(col, union.reshape(-1)).reshape(n, union.shape[1])
        slab = cache.slab_words(col.row_nbytes)  # filling misses may have grown the slab
        self._copy_out(helpers, slab, index, k, shifted, obs_words, next_words)

    @staticmethod
    def _copy_out(helpers, slab, index, k, shifted, obs_words, next_words) -> None:
        """Stacks copied out of the slab rows ``index``, shared with the helpers when there are (and they are
        free). Not torch.index_select: its OpenMP workers spin while idle, and measured here, whenever other
        threads or processes (env workers, a trainer) wanted the cores too, the copy became 5-15x slower."""
        if helpers is None or not helpers.gather(slab, index, k, shifted, obs_words, next_words):
            checked_gather_stacks(slab, index, k, shifted, obs_words, next_words)

    def slab_index(self, col: "ColumnReader", ids: np.ndarray) -> np.ndarray:
        """Rows of the cache's flat slab holding frames ``ids`` (filling the missing chunks first)."""
        c = col.spec.chunk_rows
        slab_rows, chunks, n_hit = col.cache.lookup_rows(ids, 0 if self.ring.unbounded else self.ring.rows, c)
        if n_hit < ids.size:
            rows = self.ring.row_of(ids)
            slots = self._fill_missing(col, chunks, slab_rows < 0).astype(np.int64)
            slab_rows = slots if c == 1 else slots * c + rows % c
        return slab_rows

    def _fill_missing(self, col: "ColumnReader", chunks: np.ndarray, missed: np.ndarray) -> np.ndarray:
        """Bring the chunks the cache lacks into it; returns the slots of all ``chunks``. If any read fails,
        none of the chunks admitted here stays cached (see the module invariant)."""
        missing = np.unique(chunks[missed])
        slots = col.cache.admit(missing)
        try:
            self.fill(col, missing, slots)
        except BaseException:
            col.cache.forget(missing)
            raise
        return col.cache.slot_of[chunks]

    def copy_rows_to(self, col: "ColumnReader", ids: np.ndarray, dsts: np.ndarray, into: tuple) -> None:
        """Frames ``ids`` copied to addresses ``dsts`` inside the arrays ``into``."""
        slab_rows = self.slab_index(col, ids)
        native.checked_copy_rows_to(col.cache.slab, slab_rows.astype(np.int64), col.row_nbytes, dsts, into)

    def copy_into_places(self, col: "ColumnReader", places: "FramePlaces", rest: np.ndarray, obs_words,
                         next_words, shifted: bool) -> None:
        """The frames ``places.ids[rest]`` copied to their places in a pair of stacks (and, ``shifted``, their
        second place: the next stack, one frame earlier)."""
        slab_rows = self.slab_index(col, places.ids[rest])
        slab = col.cache.slab_words(col.row_nbytes)
        n_obs, next_pos = places.n_obs, places.next_pos
        in_obs = rest < n_obs
        obs_rows = rest[in_obs]
        obs_words[obs_rows] = slab[slab_rows[in_obs]]
        next_words[next_pos[rest[~in_obs] - n_obs]] = slab[slab_rows[~in_obs]]
        if shifted:
            k = n_obs // next_pos.size
            second = obs_rows[obs_rows % k > 0]
            next_words[second - 1] = obs_words[second]
