"""The writer's RAM as a source of frames: rows of the staging shard (being filled) and of the sealed shard (being
written to its file), which a reader copies from there rather than reading a file that is not written yet.

Invariant: a chunk is copied from the writer's RAM only if its shard is one of ``FrameRing.ram_shards`` as the
reader asks (under the store's lock, so the rows cannot move meanwhile), and then it is copied whole, as decoded
rows: the writer's RAM holds no compressed bytes (a device decode, #38, reads these rows as they are).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mmreplay.index.frame_ring import FrameRing

if TYPE_CHECKING:
    from mmreplay.reading.tiers import ColumnReader


class WriterRamSource:
    """Rows still in the writer's RAM, per column (see the module invariant)."""

    def __init__(self, ring: FrameRing):
        self.ring = ring

    def shards(self, col: "ColumnReader") -> dict:
        """{file shard: its rows in RAM}, one or two: the files of these shards are not read."""
        return self.ring.ram_shards(col.spec.name)

    def holds(self, col: "ColumnReader", chunks: np.ndarray) -> np.ndarray:
        """Which of ``chunks`` lie in shards whose rows the writer holds in RAM."""
        per = col.column.layout.chunks_per_shard
        shards = list(self.ring.ram_shards(col.spec.name))
        return np.isin(chunks // per, shards) if shards else np.zeros(chunks.size, dtype=bool)

    def copy_into_slots(self, col: "ColumnReader", chunks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Chunks of the staging or sealed shard copied into the decoded cache's ``slots``; returns which were."""
        ram = self.ring.ram_shards(col.spec.name)  # {file shard: rows of the shard in RAM}, one or two
        c, per = col.spec.chunk_rows, self.ring.shard_rows
        shard_of = chunks * c // per
        in_ram = np.zeros(chunks.size, dtype=bool)
        for shard in ram:
            in_ram |= shard_of == shard
        if not in_ram.any():
            return in_ram
        slab = col.cache.slab
        for chunk, slot, shard in zip(chunks[in_ram].tolist(), slots[in_ram].tolist(), shard_of[in_ram].tolist()):
            offset = chunk * c - shard * per
            slab[slot] = ram[shard][offset:offset + c]
        return in_ram
