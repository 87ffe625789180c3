"""How one frame budget is split, per observation key, between compressed shards held in RAM and decoded
frames; and the column's reader state that follows from it.

Invariant: ``plan_tiers`` never plans more than ``total`` bytes; a ``ColumnReader`` holds a compressed tier
only when the compiled decoder exists for its codec (``FrameCodec.kernel_kind``), and decodes straight into
batches (``direct``) only when that tier exists and a chunk is one frame or the compiled decoder takes single
frames out of its chunks (``FrameCodec.decodes_frames_of_runs``: the temporal codec's runs). The tier holds whole
shards, all of them when they fit its share, else as many as fit (a *partial* tier): the other shards' frames
are read from their files (``reading/disk.py``). Nothing here names a codec: the column's codec
(``mmreplay/codecs/``) says what it can do.
"""

from __future__ import annotations

from dataclasses import dataclass

from mmreplay._native import decode as native
from mmreplay.reading.cache import ChunkCache
from mmreplay.reading.disk import DiskStats
from mmreplay.reading.resident import ResidentShards
from mmreplay.reading.runs import RunDirectory
from mmreplay.index.frame_column import FrameColumn
from mmreplay.index.frame_ring import FrameRing

# The compressed tier's share of the budget when it holds the whole store is at most this; the decoded
# cache keeps the rest.
MAX_RESIDENT_SHARE = 0.6
# A store too large for that: its compressed tier holds whole shards in up to this share of the budget, the
# decoded cache keeps the rest (room for one batch's chunks, which it needs whatever its budget).
PARTIAL_RESIDENT_SHARE = 0.9
# The decoded cache is used when it holds at least this share of the ring's frames. Measured on Atari
# frames (1M store, 2 cores): a frame decoded into a random slot of a large slab and copied out costs ~2.5 us
# with the LRU bookkeeping, decoded straight into the (cache-hot) batch ~1.1 us, a hit ~0.3 us: the cache
# pays off above a ~64% hit rate, which uniform sampling reaches when it holds that share of the frames.
MIN_DECODED_SHARE = 0.65
# Beside a partial tier the decoded cache is only where multi-frame chunks (runs of the temporal codec) land
# before their frames are copied out: it would hold under ~3% of the frames (10M Atari in 1.4 GB: 0.4% hits
# measured, with 268 MB), so it gets this much and the rest of the budget stays unspent (the index ring,
# the batches and the interpreter need RAM too: peak RSS was 520 MB over a 1.4 GB budget without this cap).
# 32 MiB holds one Atari batch-256's runs (<= 512 runs of 8 frames, 29 MB); a batch that needs more grows
# the slab to fit it (``ChunkCache``), as DMC's runs of 16 colour frames do at either size.
PARTIAL_DECODED_BYTES = 32 << 20


@dataclass
class TierStats:
    """The compressed tier of one column: decoded-cache misses served from it (hits) or from the file."""
    hits: int = 0  # chunks decoded from bytes held in RAM
    misses: int = 0  # chunks read from their file
    capacity_bytes: int = 0


@dataclass(frozen=True)
class TierPlan:
    """How one budget is split (``plan_tiers``): the two shares never sum to more than the budget."""
    resident_bytes: int  # compressed tier
    decoded_bytes: int  # decoded cache
    direct: bool  # decode misses straight into the batch; the decoded cache is not used


def plan_tiers(total: int, compressed_bytes: int, decoded_bytes: int) -> TierPlan:
    """How ``total`` bytes serve a ring whose frames take ``compressed_bytes`` on disk and
    ``decoded_bytes`` decoded. The compressed ring is held whole when it fits in ``MAX_RESIDENT_SHARE``
    of the budget: a miss then costs ~1 us of decoding instead of a file read. The decoded cache gets the
    rest, and is used only if it holds at least ``MIN_DECODED_SHARE`` of the frames: below that, frames
    are decoded straight into the batch.

    When the compressed ring does not fit that share, the decoded cache could hold only a sliver of the
    frames (10M Atari transitions are ~70 GB decoded, 1M DMC ones ~21 GB) and would serve almost no hits,
    while a byte of compressed tier holds as many frames as the codec's ratio (~8x-60x) and serves each in
    ~1-2 us instead of a file read (~50-250 us). So the compressed tier takes ``PARTIAL_RESIDENT_SHARE`` of
    the budget, whole shards as many as fit (all, when the store fits there), frames are decoded straight
    into batches (or, for runs of frames, through a small decoded cache: ``PARTIAL_DECODED_BYTES``), and
    the rest is read from the files. Only where compression gains nothing (frames no
    smaller compressed) or the decoded cache would still hold ``MIN_DECODED_SHARE`` of the frames does the
    decoded cache take the whole budget instead."""
    if compressed_bytes > MAX_RESIDENT_SHARE * total:
        if compressed_bytes >= decoded_bytes or MIN_DECODED_SHARE * decoded_bytes <= total:
            return TierPlan(0, total, False)
        resident = min(compressed_bytes, int(PARTIAL_RESIDENT_SHARE * total))
        return TierPlan(resident, min(total - resident, PARTIAL_DECODED_BYTES), True)
    rest = total - compressed_bytes
    if rest >= MIN_DECODED_SHARE * decoded_bytes:
        return TierPlan(compressed_bytes, rest, False)
    return TierPlan(compressed_bytes, 0, True)


def decodes_direct(decodes_frames_of_runs: bool, chunk_rows: int) -> bool:
    """Can a column's frames be decoded straight into a batch (given a compressed tier)? One-frame chunks
    can; chunks of several frames when the compiled decoder takes frames out of them (the codec says)."""
    return chunk_rows == 1 or decodes_frames_of_runs


class ColumnReader:
    """One observation key's decoded cache and compressed tier."""

    def __init__(self, column: FrameColumn, ring: FrameRing, decoded_bytes: int, resident_bytes: int,
                 direct: bool, cache: ChunkCache | None = None, partial_reads: bool = False):
        spec = column.spec
        self.column = column
        self.spec = spec
        self.row_nbytes = spec.row_nbytes
        self.cache = cache or ChunkCache(ring.rows // spec.chunk_rows, (spec.chunk_rows, *spec.shape),
                                         spec.np_dtype, decoded_bytes)
        frame_codec = column.array.compressor  # the column's codec (``mmreplay/codecs/``): what it can do
        # the compiled decoder's kind for its chunks, None when it has none (the symbols are self-tested at the
        # first decode)
        self.codec = frame_codec.kernel_kind if native.AVAILABLE else None
        self.decodes_runs = self.codec is not None and frame_codec.decodes_frames_of_runs
        self.resident = ResidentShards(ring.root, column.layout, ring.rows // spec.chunk_rows) \
            if resident_bytes > 0 and self.codec is not None else None
        self.tier = TierStats(capacity_bytes=resident_bytes if self.resident is not None else 0)
        self.disk = DiskStats()
        # frames decoded straight into batches: one-frame chunks (images), or runs of frames whose codec's compiled
        # decoder takes out only the frames a batch needs (``native.decode_frame_groups``)
        self.direct = direct and self.resident is not None and decodes_direct(self.decodes_runs, spec.chunk_rows)
        # runs of frames read from files only in part (``reading/runs.py``): its directory is paid for from the
        # compressed tier's share of the budget
        self.runs = None
        if partial_reads and self.direct and spec.chunk_rows > 1 and self.codec is not None \
                and frame_codec.decodes_partial_runs:
            self.runs = RunDirectory(ring.rows // spec.chunk_rows, spec.chunk_rows)
            self.tier.capacity_bytes = max(0, self.tier.capacity_bytes - self.runs.nbytes)

    def stats(self, loading: bool = False) -> dict:
        """``cache_stats()`` of this key: the decoded cache, and under ``"compressed"`` the tier below it
        (``loading``: the background pass that reads the shards into it is still running)."""
        res = self.resident
        return {**self.cache.stats.as_dict(),
                "compressed": {"hits": self.tier.hits, "misses": self.tier.misses,
                               "shard_loads": 0 if res is None else res.loads,
                               "bytes": 0 if res is None else res.nbytes,
                               "capacity_bytes": self.tier.capacity_bytes,
                               "compiled": self.codec is not None, "direct": self.direct, "loading": loading},
                "runs": None if self.runs is None else {"entries": self.runs.entries, "nbytes": self.runs.nbytes},
                "disk": {**self.disk.as_dict(), "hit_rates": self.hit_rates()}}

    def hit_rates(self) -> dict:
        """Where frames came from: ``decoded``, the share of frame lookups the decoded cache served; of the
        chunks it missed, the share decoded from the compressed tier (``compressed``) and read from the files
        (``file``). (Chunks copied from the writer's RAM count in neither.)"""
        looked_up = self.cache.stats.hits + self.cache.stats.misses
        decoded_misses = self.tier.hits + self.tier.misses
        return {"decoded": self.cache.stats.hits / looked_up if looked_up else 0.0,
                "compressed": self.tier.hits / decoded_misses if decoded_misses else 0.0,
                "file": self.tier.misses / decoded_misses if decoded_misses else 0.0}

    def take_over(self, old: "ColumnReader") -> None:
        """What this column's reader keeps of the one it replaces (the tiers planned again): the run directory,
        the counters, and the compressed shards held when this one has a tier too (else they are dropped)."""
        if old.runs is not None and self.runs is not None:
            self.runs = old.runs
        self.tier.hits, self.tier.misses = old.tier.hits, old.tier.misses
        self.cache.stats.hits, self.cache.stats.misses = old.cache.stats.hits, old.cache.stats.misses
        self.disk = old.disk
        if old.resident is not None and self.resident is not None:
            self.resident = old.resident
        elif old.resident is not None:
            old.resident.drop()

    def invalidate_rows(self, lo: int, hi: int) -> None:
        c = self.spec.chunk_rows
        self.cache.invalidate(lo // c, -(-hi // c))
        if self.runs is not None:
            self.runs.forget(lo // c, -(-hi // c))

    def forget_shards(self, shards: list[int], shard_rows: int) -> None:
        """Shards written or changed elsewhere: no held copy of them stays, nor any decoded frame of theirs."""
        if self.resident is not None:
            self.resident.drop(shards)
        for shard in shards:
            self.invalidate_rows(shard * shard_rows, (shard + 1) * shard_rows)

    def grow_address_space(self, rows: int) -> None:
        """The (unbounded) ring has ``rows`` rows now."""
        chunks = rows // self.spec.chunk_rows
        self.cache.grow_address_space(chunks)
        if self.runs is not None:
            self.runs.grow(chunks)
        if self.resident is not None:
            self.resident.grow_address_space(chunks)

    def clear(self) -> None:
        """Nothing held: no decoded chunk, run entry or compressed shard."""
        self.cache.clear()
        if self.runs is not None:
            self.runs.clear()
        if self.resident is not None:
            self.resident.drop()
