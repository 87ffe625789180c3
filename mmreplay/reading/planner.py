"""The plan of a reader's tiers: how its frame budget is split, per observation key, between the compressed tier and
the decoded cache (``plan_tiers``), for how many frames, and from what compression figure; planned again once the
first shard written measures the compression, or once the store holds more frames than it was planned for.

Invariant: the tiers planned never take more than ``frame_budget()`` (``plan_tiers``' bound, a run directory paid
from the compressed tier's share); planning again keeps what is already held and still fits its role: a column's
compressed shards stay (the same bytes), its decoded cache stays unless its role changed (decoded straight into
batches or not), its run directory, statistics and disk counters carry over. The columns dict is updated in place
(the background pass and the router hold it).
"""

from __future__ import annotations

import os

import numpy as np

from mmreplay.index.frame_ring import FrameRing
from mmreplay.reading.tiers import ColumnReader, decodes_direct, plan_tiers

# Frames keep at least this much of a budget that the index ring takes nearly all of (one batch's frames fit
# anyway: the decoded slab grows to hold a batch, ``ChunkCache``).
MIN_FRAME_BUDGET = 4 << 20
# What a frame compresses to before any shard of it was written (Atari frames: ~13x with lz4).
ASSUMED_RATIO = 8.0


class TierPlanner:
    """The tier plan of one reader (see the module invariant). ``partial_reads``: runs read from files only in
    the bytes a batch needs (``reading/runs.py``); ``held_elsewhere``: what the store holds in RAM besides
    frames (its index ring and columns), paid for from the budget."""

    def __init__(self, ring: FrameRing, cache_bytes: int, held_elsewhere: int = 0, partial_reads: bool = True):
        self.ring = ring
        self.cache_bytes = int(cache_bytes)
        self.held_elsewhere = int(held_elsewhere)
        self.partial_reads = partial_reads
        # A new store's compression is a guess until its first shard is written: then the tiers are planned
        # again from the real figure (``note_written`` measures, the next read re-plans, under the lock).
        self.ring_bytes, self.measured = compressed_ring_bytes(ring)  # compressed bytes of each column's ring
        self.remeasured: dict[str, int] | None = None
        self.plan = None
        self.planned_rows = 0

    def frame_budget(self) -> int:
        """What the budget leaves for frames once the store's other RAM (its index ring) is paid for: the
        budget is everything the store holds for reading (``Settings.cache_bytes``), so that a default
        derived from a memory limit stays inside it. At least ``MIN_FRAME_BUDGET`` (half the budget, if that
        is less: an index larger than the budget still leaves the frames something to plan with)."""
        return max(min(MIN_FRAME_BUDGET, self.cache_bytes // 2), self.cache_bytes - self.held_elsewhere)

    def rows_to_plan(self) -> int:
        """Frames the tiers are planned for: twice those the store holds (it may be filling), at least a
        shard, at most the ring. A store made for 1M transitions holding 20k is planned as one holding 40k:
        planned for its capacity, it would give its whole budget to a compressed tier it does not fill and
        turn off a decoded cache that holds all it has (measured: sampling ~2x slower)."""
        ring = self.ring
        held = max(0, ring.head - ring.oldest)
        return min(ring.rows, max(ring.shard_rows, 2 * held))

    def due(self) -> bool:
        """Plan again before this read? Once the first shard told how frames compress, or once the store holds
        more frames than the tiers were planned for (twice as many as when last planned)."""
        return self.remeasured is not None or self.ring.head - self.ring.oldest > self.planned_rows

    def replan(self, columns: dict[str, ColumnReader]) -> None:
        """Plan ``columns`` again (``due()``): from the measured compression once there is one, else for more rows."""
        if self.remeasured is not None:
            ring_bytes, self.remeasured = self.remeasured, None
            self.measured = True
            self.plan_columns(columns, ring_bytes)
        else:
            self.plan_columns(columns, self.ring_bytes)

    def plan_columns(self, columns: dict[str, ColumnReader], ring_bytes: dict[str, int]) -> None:
        """(Re)build each column's tiers in ``columns`` for ``rows_to_plan()`` frames of a ring whose frames would
        take ``ring_bytes`` compressed bytes per column if it were full (see the module invariant)."""
        ring = self.ring
        self.ring_bytes = ring_bytes
        self.planned_rows = rows = self.rows_to_plan()
        ring_bytes = {name: int(b * rows / ring.rows) for name, b in ring_bytes.items()}
        decoded_ring = sum(max(1, c.spec.row_nbytes) * rows for c in ring.columns.values())
        self.plan = plan = plan_tiers(self.frame_budget(), sum(ring_bytes.values()), decoded_ring)
        total_row_bytes = sum(max(1, c.spec.row_nbytes) for c in ring.columns.values())
        compressed = sum(ring_bytes.values())
        for name, col in ring.columns.items():
            share = max(1, col.spec.row_nbytes) / total_row_bytes
            # each column's tier: its share of the compressed frames (all of its ring when the plan holds all)
            resident = ring_bytes[name] if plan.resident_bytes >= compressed else \
                int(plan.resident_bytes * ring_bytes[name] / max(1, compressed))
            old = columns.get(name)
            # the decoded cache stays (warm, and sized when the store opened) unless its role changed
            keep = old is not None and old.direct == (plan.direct and old.resident is not None
                                                      and decodes_direct(old.decodes_runs, col.spec.chunk_rows))
            # a partial tier: the runs it lacks are read from their files, only in part where they can be
            partial = plan.resident_bytes < compressed and self.partial_reads
            new = ColumnReader(col, ring, int(plan.decoded_bytes * share), resident, plan.direct,
                               cache=old.cache if keep else None, partial_reads=partial)
            if new.resident is not None:
                new.resident.check_file = col.array.check_file  # only the files the commit expects are held
                new.resident.proven_files = col.array.proven_files
                new.resident.forget_files = col.array.forget
            if old is not None:
                new.take_over(old)
            columns[name] = new

    def note_written(self, columns: dict[str, ColumnReader], name: str, raw: bytes) -> None:
        """A shard was written: the first one of a store planned from a guess measures the compression of the
        whole ring (per chunk it holds; a flush of a few rows says little). The next read plans again."""
        if self.measured or self.remeasured is not None or len(columns) != 1:
            return
        col = columns[name]
        per = col.column.layout.chunks_per_shard
        index = np.frombuffer(raw[len(raw) - per * 16 - 4:len(raw) - 4], dtype="<u8").reshape(per, 2)
        used = index[:, 0] != np.uint64(2**64 - 1)
        if used.sum() >= max(1, per // 4):
            per_chunk = float(index[used, 1].astype(np.float64).mean())
            self.remeasured = {name: int(per_chunk * (self.ring.rows // col.spec.chunk_rows) * 1.05)}


def compressed_ring_bytes(ring: FrameRing) -> tuple[dict[str, int], bool]:
    """Per column, what the whole ring would take compressed: from the shard files there are (their mean size),
    else ``ASSUMED_RATIO``; and whether files were there to measure."""
    n_files = ring.rows // ring.shard_rows
    out, measured = {}, True
    for name, col in ring.columns.items():
        sizes = []
        for shard in range(n_files):
            try:
                sizes.append(os.stat(col.layout.shard_file(ring.root, shard)).st_size)
            except OSError:
                pass
            if len(sizes) >= 32:  # a sample is enough: shards of one store are alike
                break
        raw = ring.shard_rows * max(1, col.spec.row_nbytes)
        mean = float(np.mean(sizes)) if sizes else raw / ASSUMED_RATIO
        measured = measured and bool(sizes)
        out[name] = int(mean * n_files * 1.05)  # + 5%: later shards may compress a little worse
    return out, measured
