"""The compressed tier as a source of frames: whole shard files held in RAM (``reading/resident.py``), decoded by
compiled code (``reading/decoding.py``) straight into a batch or into the decoded cache's slots.

Invariant: every decode of held bytes runs while the caller holds the column's tier still (``holding``:
``ResidentShards.reading``), so no buffer is freed or moved under it, and is told the bytes are ``verified``
(every chunk the tier holds matched its crc32c when the tier installed it: ``reading/resident.py``); a chunk the
tier lacks is loaded with its whole shard only while the tier has room, the background pass is not running and
the writer is not in that shard (its rows are the writer's RAM's); what is still not held is left to the caller
(the router sends it to the decoded cache or the files), never guessed. Hits count the chunks decoded from here
(``TierStats.hits``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable

import numpy as np

from mmreplay._native import decode as native
from mmreplay._native.bounds import address_of
from mmreplay.reading.decoding import SHARED_MIN_DECODES, Decoder, raise_bad_chunk
from mmreplay.reading.resident import EMPTY_CHUNK
from mmreplay.reading.sources.writer_ram import WriterRamSource

if TYPE_CHECKING:
    from mmreplay.reading.requests import RunRequests
    from mmreplay.reading.tiers import ColumnReader


class CompressedTierSource:
    """Frames decoded from the compressed tier of each column (see the module invariant)."""

    def __init__(self, writer_ram: WriterRamSource, decoder: Decoder, preloading: Callable[[], bool]):
        self.writer_ram = writer_ram
        self.decoder = decoder
        self.preloading = preloading  # is the background pass (``reading/preload.py``) still reading shards?

    @staticmethod
    def holding(col: "ColumnReader"):
        """The compressed tier held still while a batch decodes from it (``ResidentShards.reading``): the
        writer thread's installs and the background loader wait (a batch at most), never the reverse."""
        return col.resident.reading() if col.resident is not None else contextlib.nullcontext()

    def hold_written(self, col: "ColumnReader", shard: int, raw: bytes) -> None:
        """The bytes the writer just wrote to ``shard``'s file: held in place of an older copy if they fit, else
        the older copy (the previous lap, or a partial flush) dropped: it must not stay."""
        res = col.resident
        if res is None:
            return
        held = res.buffers.get(shard)
        if res.nbytes - (0 if held is None else held.nbytes) + len(raw) <= col.tier.capacity_bytes:
            res.install(shard, raw)  # replaces the older copy
        else:
            res.drop([shard])

    def load_whole(self, col: "ColumnReader", chunks: np.ndarray) -> None:
        """The shards holding ``chunks`` (one frame row each when chunks are frames), read whole into the
        compressed tier while it has room; rows still in the writer's RAM are not read from their files."""
        if self.preloading():
            # The background pass is reading every shard in file order: loading whole shards here too, for a
            # few frames each, made the first seconds after a restart 30x slower (10M Atari: ~3 MB read per
            # batch of 32); while it runs, a miss reads only its chunks (``reading/disk.py``).
            return
        res, in_ram = col.resident, self.writer_ram.shards(col)
        for shard in np.unique(chunks // res.per_shard).tolist():
            if shard in in_ram or shard in res.buffers:
                continue  # a held shard's chunk not held failed its checksum there: the files path reports it
            if res.full(col.tier.capacity_bytes) or not res.load(shard, col.tier.capacity_bytes):
                break  # full: the rest is read from the files

    def compressed_chunks(self, col: "ColumnReader", chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The held bytes of ``chunks``, as they lie in RAM: their addresses (0: not held, ``EMPTY_CHUNK``: the
        index marks the chunk empty) and sizes (checksum included). Valid only inside ``holding(col)``."""
        res = col.resident
        if res is None:
            return np.zeros(chunks.size, dtype=np.int64), np.zeros(chunks.size, dtype=np.int64)
        return res.chunk_addr[chunks], res.chunk_size[chunks]

    # -- one-frame chunks straight into a batch -----------------------------------------------------
    def decode_stacks(self, col: "ColumnReader", obs_ids, next_ids, obs_words, next_words, shifted,
                      ring_rows: int) -> bool:
        """A batch's stacks decoded into place if every chunk is held (plan and decodes in one compiled call,
        or the plan in one and the decodes shared with the codec helpers when there are many); False, having
        written nothing, if some chunk is not held."""
        n, k = obs_ids.shape
        nbytes, res = col.row_nbytes, col.resident
        decodes = n * (k + 1 if shifted else 2 * k)
        if decodes < SHARED_MIN_DECODES or self.decoder.helpers() is None:
            status = np.empty(decodes, dtype=np.int8)
            bad, rows = native.checked_decode_stacks(obs_ids, next_ids, shifted, obs_words, next_words, nbytes,
                                                     ring_rows, res.chunk_addr, res.chunk_size, col.codec, status,
                                                     verified=True)
            if bad > 0:
                raise_bad_chunk(col, rows, status)
            done = bad == 0
        else:
            plan = native.checked_plan_stack_decodes(obs_ids, next_ids, shifted, obs_words, next_words, nbytes,
                                                     ring_rows, res.chunk_addr, res.chunk_size)
            if plan.absent == 0:
                self.decoder.decode_stack_plan(col, plan, verified=True)
            done = plan.absent == 0
        if done:
            col.tier.hits += decodes
            col.cache.stats.misses += decodes
        return done

    def locate(self, col: "ColumnReader", chunks: np.ndarray) -> np.ndarray:
        """Where ``chunks`` lie in the tier (``compressed_chunks``' addresses), their shards loaded whole
        first where they are not held and may be (``load_whole``)."""
        addr = col.resident.chunk_addr[chunks]
        if not (addr > 0).all():
            self.load_whole(col, chunks[addr == 0])
            addr = col.resident.chunk_addr[chunks]
        return addr

    def decode_frames(self, col: "ColumnReader", chunks, addr, dst, copies, into) -> None:
        """Held one-frame ``chunks`` (at ``addr``) decoded to ``dst`` (and copied to ``copies``) inside ``into``."""
        self.decoder.decode_chunks(col, chunks, addr, col.resident.chunk_size[chunks], dst, copies, col.row_nbytes,
                                   into, verified=True)
        col.tier.hits += int(addr.size)

    # -- runs of frames (the temporal codec) -----------------------------------------------------------
    def locate_runs(self, col: "ColumnReader", chunks: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """Addresses and sizes of the runs ``chunks`` in the tier (0: not held, ``EMPTY_CHUNK``: empty), their
        shards loaded whole first where they may be, and whether every run is held; counts the held ones as
        hits. One compiled pass when the tier holds them all (a batch-32's array operations were ~15% of its
        CPU besides its decodes)."""
        res = col.resident
        src, sizes, held = native.checked_locate_chunks(res.chunk_addr, res.chunk_size, chunks)
        if held < chunks.size and (src == 0).any():
            self.load_whole(col, chunks[src == 0])
            src, sizes, held = native.checked_locate_chunks(res.chunk_addr, res.chunk_size, chunks)
        col.tier.hits += held
        return src, sizes, held == chunks.size

    def decode_runs(self, col: "ColumnReader", req: "RunRequests", src, sizes, groups) -> None:
        """The frames ``req`` asks of the held runs ``groups`` (None: every run of ``req``) decoded into place."""
        if groups is None or groups.size:
            self.decoder.decode_run_groups(col, req, src, sizes, groups, verified=True)

    # -- into the decoded cache ---------------------------------------------------------------------------
    def decode_into_slots(self, col: "ColumnReader", chunks: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """``chunks`` decoded into the decoded cache's ``slots`` where the tier holds them (loading their shards
        whole where it may); chunks its index marks empty are zeros there (the writer's next lap: the overwrite
        check discards them). Returns which chunks were not held (the caller reads them from their files)."""
        res = col.resident
        addr = res.chunk_addr[chunks]
        absent = addr == 0
        if absent.any():
            self.load_whole(col, chunks[absent])
            addr = res.chunk_addr[chunks]
            absent = addr == 0
        empty = addr == EMPTY_CHUNK
        if empty.any():  # every frame read is committed: an index that lacks it is another file's, or a new lap's
            shard, inner = divmod(int(chunks[np.flatnonzero(empty)[0]]), res.per_shard)
            col.column.array.check_empty_chunk(shard, inner)
            col.cache.slab[slots[empty]] = 0  # zarr's fill value
        held = addr > 0
        n_held = int(np.count_nonzero(held))
        if n_held:
            cache = col.cache
            dst = address_of(cache.slab) + slots[held].astype(np.int64) * cache.chunk_nbytes
            self.decoder.decode_chunks(col, chunks[held], addr[held], res.chunk_size[chunks[held]], dst,
                                       np.zeros_like(dst), cache.chunk_nbytes, (cache.slab,), verified=True)
        col.tier.hits += n_held
        return absent
