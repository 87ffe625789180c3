"""Storage and cache modules as units, each against its stated invariant: shard files byte for byte as
zarr defines them, chunk reads equal to zarr's, the decoded-chunk cache's slot bookkeeping and LRU order,
and the frame ring's events to its reader."""

import os

import numpy as np
import pytest
import zarr
from gymnasium import spaces

from mmreplay import Store
from mmreplay.columns.spec import ColumnSpec
from mmreplay.errors import CorruptDataError
from mmreplay.reading.cache import ChunkCache
from mmreplay.index.frame_ring import FrameEvents, FrameRing
from mmreplay.storage.format.layout import ArrayLayout
from mmreplay.storage.format.sharded import ShardedArray
from mmreplay.storage.format.shardfile import EMPTY, build_shard, index_nbytes, parse_index, read_index

CODEC = {"name": "blosc", "cname": "lz4", "clevel": 5}


def layout(rows=64, shard_rows=16, chunk_rows=4) -> ArrayLayout:
    return ArrayLayout("frames/obs", rows, (3, 5), "uint8", chunk_rows, shard_rows, CODEC)


# -- shard files ------------------------------------------------------------------------------------
def test_a_shard_is_its_chunks_then_an_index_with_a_checksum():
    raw = build_shard([b"abc", None, b"defgh"])
    n = 3
    index = parse_index(raw[-index_nbytes(n):], n, "x")
    assert index[0].tolist() == [0, 3] and index[2].tolist() == [3, 5]
    assert (index[1] == EMPTY).all()  # an empty chunk: zarr's fill value
    assert raw[:8] == b"abcdefgh"
    damaged = bytearray(raw)
    damaged[-10] ^= 1
    with pytest.raises(CorruptDataError, match="index checksum"):
        parse_index(bytes(damaged[-index_nbytes(n):]), n, "x")


def test_an_index_that_points_past_the_data_is_refused(tmp_path):
    raw = build_shard([b"abc", b"defgh"])
    path = tmp_path / "shard"
    path.write_bytes(raw[:2] + raw[8:])  # chunk bytes cut, index intact
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(CorruptDataError, match="past the chunk data"):
            read_index(fd, os.fstat(fd).st_size, 2, "x")
    finally:
        os.close(fd)


# -- chunk reads of a sharded array ------------------------------------------------------------------
def test_chunk_reads_equal_what_zarr_reads(tmp_path):
    lay = layout()
    root = zarr.open_group(str(tmp_path), mode="w")
    root.create_group("frames")
    lay.create(root)
    arr = ShardedArray(str(tmp_path), lay)
    data = np.random.default_rng(0).integers(0, 4, (64, 3, 5), dtype=np.uint8) * 60
    for shard in range(3):  # shard 3 never written
        arr.write_shard(shard, data[shard * 16:(shard + 1) * 16], 16 if shard < 2 else 6)
    z = zarr.open_array(str(tmp_path / lay.path), mode="r")
    out = np.empty((4, 3, 5), np.uint8)
    for chunk in range(10):  # shard 2 holds 6 rows: chunks 8 and 9
        arr.read_chunk(chunk, out)
        np.testing.assert_array_equal(out, z[chunk * 4:(chunk + 1) * 4])
    for chunk in (10, 11):  # zarr reads zeros; every row we read is committed, so an empty chunk is an error
        assert not z[chunk * 4:(chunk + 1) * 4].any()
        with pytest.raises(CorruptDataError, match="marks this chunk empty"):
            arr.read_chunk(chunk, out)
    with pytest.raises(CorruptDataError, match="missing"):
        arr.read_chunk(13, out)  # a committed-looking read of a shard with no file
    lenient = ShardedArray(str(tmp_path), lay, missing_ok=True)
    lenient.read_chunk(13, out)
    assert not out.any()


def test_a_truncated_shard_file_is_an_error_naming_it(tmp_path):
    lay = layout()
    arr = ShardedArray(str(tmp_path), lay)
    arr.write_shard(0, np.ones((16, 3, 5), np.uint8), 16)
    path = lay.shard_file(str(tmp_path), 0)
    raw = open(path, "rb").read()
    with open(path, "wb") as f:
        f.write(raw[: len(raw) // 2])
    fresh = ShardedArray(str(tmp_path), lay)
    with pytest.raises(CorruptDataError, match=r"frames/obs.*shard 0"):
        fresh.read_chunk(0, np.empty((4, 3, 5), np.uint8))


# -- the decoded-chunk cache -------------------------------------------------------------------------
def cache(slots=4) -> ChunkCache:
    return ChunkCache(100, (1, 2), np.uint8, budget_bytes=slots * 2, min_slots=slots)


def test_admitted_chunks_are_found_and_marked_used():
    c = cache()
    slots = c.admit(np.array([7, 9]))
    c.slab[slots] = [[[7, 7]], [[9, 9]]]
    rows, chunks, hits = c.lookup_rows(np.array([9, 7, 8]), 0, 1)
    assert hits == 2 and rows[2] == -1 and chunks.tolist() == [9, 7, 8]
    assert c.slab[rows[0], 0].tolist() == [9, 9]
    assert all(c.chunk_in[c.slot_of[ch]] == ch for ch in (7, 9))  # the invariant, both ways


def test_the_least_recently_used_chunks_go_first_never_one_of_the_current_batch():
    c = cache(slots=4)
    for chunk in range(4):  # one batch each: ticks 1..4
        c.lookup_rows(np.array([chunk]), 0, 1)
        c.admit(np.array([chunk]))
    c.lookup_rows(np.array([0, 1]), 0, 1)  # 0 and 1 used again
    c.lookup_rows(np.array([10, 11]), 0, 1)
    c.admit(np.array([10, 11]))
    held = set(c.chunk_in[c.chunk_in >= 0].tolist())
    assert {10, 11} <= held and not {2, 3} & held  # 2 and 3 were the least recently used


def test_a_batch_larger_than_the_budget_grows_the_slab_and_forget_releases():
    c = cache(slots=4)
    c.lookup_rows(np.arange(6), 0, 1)
    slots = c.admit(np.arange(6))
    assert len(set(slots.tolist())) == 6 and c.n_slots >= 6
    c.forget(np.array([1, 2]))
    assert c.slot_of[1] == -1 and c.slot_of[2] == -1 and c.stats.bytes == 4 * c.chunk_nbytes
    c.invalidate(0, 4)
    assert (c.slot_of[:4] == -1).all()


def test_the_chunk_table_is_made_at_the_first_lookup_not_by_writes_or_growth():
    """An import writes 50M frames and never samples: its cache's chunk table (an int32 a chunk, filled at
    once) would cost 24 MiB of RSS for nothing (issue #42)."""
    c = ChunkCache(1000, (1, 2), np.uint8, budget_bytes=200, min_slots=8)
    c.invalidate(0, 1000)  # the writer overwriting frames
    c.forget(np.array([3, 4]))
    c.grow_address_space(3000)  # an unbounded store grew
    assert c._slot_of is None and c.stats.bytes == 0
    rows, _, hits = c.lookup_rows(np.array([2999, 5]), 0, 1)
    assert hits == 0 and (rows == -1).all() and c.slot_of.shape == (3000,) and (c.slot_of == -1).all()
    c.admit(np.array([2999]))
    c.grow_address_space(5000)  # made now: growth keeps what is held
    assert c.slot_of.shape == (5000,) and c.chunk_in[c.slot_of[2999]] == 2999 and (c.slot_of[3000:] == -1).all()


def test_a_store_written_and_never_sampled_makes_no_chunk_table(tmp_path):
    store = Store.create(str(tmp_path / "s"), observation_space=spaces.Box(0, 255, (8, 8), np.uint8),
                         action_space=spaces.Discrete(4), capacity=4096)
    rng = np.random.default_rng(0)
    for _ in range(3):
        obs = rng.integers(0, 255, (512, 8, 8), dtype=np.uint8)
        store.extend(obs, rng.integers(0, 4, 512), np.zeros(512, np.float32), obs, np.zeros(512, bool),
                     np.zeros(512, bool))
    store.flush()
    caches = [col.cache for col in store._state.reader.columns.values()]
    assert caches and all(c._slot_of is None for c in caches)
    store.sample(16)
    assert any(c._slot_of is not None for c in caches)
    store.close()


# -- the frame ring and its listener -----------------------------------------------------------------
class Recorder(FrameEvents):
    def __init__(self):
        self.written, self.changed, self.replaced, self.grown = [], [], [], []

    def shard_written(self, name, shard, raw):
        self.written.append((name, shard, bytes(raw)))

    def shards_changed(self, shards):
        self.changed.append(list(shards))

    def rows_replaced(self, lo, hi):
        self.replaced.append((lo, hi))

    def grown(self, rows):
        self.grown.append(rows)


def test_the_frame_ring_tells_its_reader_every_write_and_overwrite(tmp_path):
    spec = ColumnSpec("obs", "frame", (84, 84), "uint8", chunk_rows=1, codec=CODEC)
    ring = FrameRing(str(tmp_path), [spec], rows=32, shard_rows=8, unbounded=False, writable=False)
    events = Recorder()
    ring.listener = events
    frames = np.arange(80, dtype=np.uint8)[:, None, None] * np.ones((1, 84, 84), np.uint8)
    for lo in range(0, 80, 4):
        ring.append({"obs": frames[lo:lo + 4]})
        if lo == 0:
            assert list(ring.ram_shards("obs")) == [0]  # the staging shard is read from RAM
    ring.flush()
    last = {shard: raw for _, shard, raw in events.written}  # what the reader was handed last per shard ...
    assert set(last) == {0, 1, 2, 3}
    for shard, raw in last.items():  # ... is what the file holds
        assert raw == open(ring.columns["obs"].layout.shard_file(str(tmp_path), shard), "rb").read()
    assert [0] in events.changed and [1] in events.changed  # the second lap gave up shards 0 and 1 first
    assert ring.oldest >= 80 - 32
    ring.close()


def test_a_cache_is_direct_mapped_while_the_chunks_fill_only_its_first_slots_then_lru():
    """A store created for 1M transitions holding 20k: its ring has far more chunks than the cache has
    slots, but the chunks held all lie below the slot count: chunk c lives in slot c (the fast contiguous
    copies) until a chunk past the slots comes; from then on an LRU cache that keeps what it held."""
    c = ChunkCache(1000, (1, 2), np.uint8, budget_bytes=200, min_slots=8)  # 100 slots for 1000 chunks
    rng = np.random.default_rng(1)
    for _ in range(10):
        missing = np.flatnonzero(c.slot_of[:100] < 0)
        chunks = np.unique(rng.choice(missing, size=min(9, missing.size), replace=False))
        assert (c.admit(chunks) == chunks).all()
    assert c.direct_mapped and c.stats.evictions == 0
    held_before = np.flatnonzero(c.slot_of >= 0)
    low = int(np.flatnonzero(c.slot_of[:100] < 0)[0])
    slots = c.admit(np.array([low, 500]))  # one chunk past the slots ends the direct mapping
    assert not c.direct_mapped
    held = np.flatnonzero(c.slot_of >= 0)
    assert set(held_before) <= set(held) and (c.slot_of[held_before] == held_before).all()  # kept in place
    assert (c.chunk_in[c.slot_of[held]] == held).all() and len(set(c.slot_of[held].tolist())) == held.size
    assert slots.size and (slots < c.n_slots).all()
    for _ in range(20):  # LRU from now on: more chunks than slots come and go, the invariant holds
        c.tick += 1  # a new batch (lookup_rows): the slots of earlier batches may be evicted
        missing = np.flatnonzero(c.slot_of < 0)
        c.admit(np.unique(rng.choice(missing, size=30, replace=False)))
        held = np.flatnonzero(c.slot_of >= 0)
        assert (c.chunk_in[c.slot_of[held]] == held).all() and held.size <= c.n_slots
    assert c.stats.evictions > 0


def test_a_cache_with_a_slot_for_every_chunk_is_direct_mapped_and_keeps_its_invariant():
    c = ChunkCache(50, (1, 2), np.uint8, budget_bytes=200, min_slots=8)  # 100 slots for 50 chunks
    assert c.direct_mapped
    rng = np.random.default_rng(0)
    for _ in range(30):
        missing = np.flatnonzero(c.slot_of < 0)
        chunks = np.unique(rng.choice(missing, size=min(7, missing.size), replace=False))
        slots = c.admit(chunks)
        assert (slots == chunks).all()  # chunk c lives in slot c: neighbours stay neighbours
        c.invalidate(int(rng.integers(0, 50)), int(rng.integers(0, 50)))  # overwritten ranges come and go
        held = np.flatnonzero(c.slot_of >= 0)
        assert (c.chunk_in[c.slot_of[held]] == held).all() and (c.slot_of[held] == held).all()
        assert c.stats.bytes == held.size * c.chunk_nbytes and c.stats.evictions == 0
    c.grow_address_space(400)  # an unbounded store: more chunks than slots now; slots handed out as they come
    assert not c.direct_mapped
    held_before = np.flatnonzero(c.slot_of >= 0)
    slots = c.admit(np.arange(200, 260))
    assert len(set(slots.tolist()) | set(c.slot_of[held_before].tolist())) == slots.size + held_before.size
    held = np.flatnonzero(c.slot_of >= 0)
    assert (c.chunk_in[c.slot_of[held]] == held).all()
