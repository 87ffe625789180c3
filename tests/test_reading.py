"""The read path as units: the compiled decoder, the compressed tier, the budget split, and the reader's
three tiers (decoded cache, compressed shards in RAM, files) checked against ground truth."""

import errno
import glob
import mmap
import os
import struct

import google_crc32c
import numpy as np
import pytest
from numcodecs import blosc, zstd

import mmreplay
from conftest import wait_preloaded
from mmreplay._native import chunk_decode, linked
from mmreplay._native.codec_kinds import CODEC_BLOSC, CODEC_ZSTD
from mmreplay.reading.frames import FrameReader
from mmreplay.reading.preload import BackgroundPass
from mmreplay.reading.tiers import (MAX_RESIDENT_SHARE, MIN_DECODED_SHARE, PARTIAL_RESIDENT_SHARE, TierPlan,
                                    plan_tiers)
from mmreplay.reading.resident import EMPTY_CHUNK, ResidentShards
from mmreplay.storage.format.layout import ArrayLayout
from mmreplay.storage.format.shardfile import build_shard
from mmreplay.sampling.strategy import NStep

pytestmark = pytest.mark.skipif(not linked.AVAILABLE, reason="this numcodecs/google-crc32c build exports no C symbols")

FRAME = (84, 84)


def chunk_bytes(payload: bytes) -> bytes:
    return payload + struct.pack("<I", google_crc32c.value(payload))


def frames(n: int, seed: int = 0) -> np.ndarray:
    """Compressible frames with structure (runs of a few gray levels), like Atari's."""
    rng = np.random.default_rng(seed)
    levels = rng.integers(0, 4, (n, 84, 12), dtype=np.uint8) * 60
    return np.repeat(levels, 7, axis=2)


def decode(chunks: list[bytes], out: np.ndarray, codec: int) -> np.ndarray:
    """Decode ``chunks`` (held in one buffer) into the rows of ``out`` with the kernel; the status array."""
    buf = np.frombuffer(b"".join(chunks), dtype=np.uint8)
    sizes = np.array([len(c) for c in chunks], dtype=np.int64)
    src = buf.ctypes.data + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    dst = out.ctypes.data + np.arange(len(chunks), dtype=np.int64) * out[0].nbytes
    status = np.full(len(chunks), -1, dtype=np.int8)
    chunk_decode.decode_chunks(src, sizes, dst, np.zeros_like(dst), out[0].nbytes, codec, status)
    return status


@pytest.mark.parametrize("codec", ["blosc-lz4hc", "blosc-zstd", "zstd"])
def test_the_kernel_decodes_what_numcodecs_encoded(codec):
    data = frames(50)
    if codec == "zstd":
        enc, kind = (lambda a: zstd.compress(a, 3)), CODEC_ZSTD
    else:
        cname = codec.split("-")[1].encode()
        enc, kind = (lambda a: blosc.compress(a, cname, 3, blosc.NOSHUFFLE, 0)), CODEC_BLOSC
    chunks = [chunk_bytes(bytes(enc(np.ascontiguousarray(f)))) for f in data]
    out = np.zeros_like(data)
    assert (decode(chunks, out, kind) == linked.OK).all()
    np.testing.assert_array_equal(out, data)


def test_the_kernel_refuses_a_flipped_byte_a_short_chunk_and_a_wrong_size():
    data = frames(4)
    chunks = [chunk_bytes(bytes(blosc.compress(np.ascontiguousarray(f), b"lz4", 5, blosc.NOSHUFFLE, 0))) for f in data]
    flipped = bytearray(chunks[1])
    flipped[20] ^= 0x01
    chunks[1] = bytes(flipped)
    chunks[2] = chunks[2][:3]
    half = np.ascontiguousarray(data[3][:42])  # decodes to half a frame: the checksum is right, the size not
    chunks[3] = chunk_bytes(bytes(blosc.compress(half, b"lz4", 5, blosc.NOSHUFFLE, 0)))
    out = np.zeros_like(data)
    status = decode(chunks, out, CODEC_BLOSC)
    assert status.tolist() == [linked.OK, linked.BAD_CHECKSUM, linked.BAD_SIZE, linked.BAD_SIZE]
    np.testing.assert_array_equal(out[0], data[0])
    assert not out[1].any()  # nothing written for a chunk whose checksum failed


def test_a_zstd_payload_of_another_size_is_refused():
    data = frames(1)
    short = chunk_bytes(zstd.compress(np.ascontiguousarray(data[0][:10]), 1))
    out = np.zeros_like(data)
    assert decode([short], out, CODEC_ZSTD).tolist() == [linked.BAD_SIZE]


def layout(tmp_path, rows=64, shard_rows=16) -> ArrayLayout:
    return ArrayLayout("frames/obs", rows, FRAME, "uint8", 1, shard_rows, {"name": "blosc", "cname": "lz4", "clevel": 5})


def shard_of(data: np.ndarray, empty=()) -> bytes:
    return build_shard([None if i in empty else chunk_bytes(bytes(blosc.compress(np.ascontiguousarray(f), b"lz4", 5,
                                                                                 blosc.NOSHUFFLE, 0)))
                        for i, f in enumerate(data)])


def write(lay: ArrayLayout, root, shard: int, raw: bytes) -> str:
    path = lay.shard_file(str(root), shard)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(raw)
    return path


def test_resident_shards_map_every_chunk_and_mark_empty_ones(tmp_path):
    lay = layout(tmp_path)
    data = frames(16)
    write(lay, tmp_path, 1, shard_of(data, empty={5}))
    res = ResidentShards(str(tmp_path), lay, 64)
    assert res.load(1, budget=1 << 20)
    addr = res.chunk_addr[16:32]
    assert addr[5] == EMPTY_CHUNK and (np.delete(addr, 5) > 0).all()
    assert (res.chunk_addr[:16] == 0).all() and (res.chunk_addr[32:] == 0).all()
    out = np.zeros_like(data)
    held = np.flatnonzero(addr > 0)
    status = np.empty(held.size, dtype=np.int8)
    copy = np.zeros_like(data)  # a second place for each decoded frame (the kernel copies it there)
    at = held.astype(np.int64) * out[0].nbytes
    chunk_decode.decode_chunks(addr[held], res.chunk_size[16 + held], out.ctypes.data + at, copy.ctypes.data + at,
                               out[0].nbytes, CODEC_BLOSC, status)
    assert (status == 0).all()
    np.testing.assert_array_equal(out[held], data[held])
    np.testing.assert_array_equal(copy[held], data[held])
    res.drop([1])
    assert not res.chunk_addr.any() and res.nbytes == 0


def test_resident_shards_refuse_what_does_not_fit_or_is_not_a_shard(tmp_path):
    lay = layout(tmp_path)
    path = write(lay, tmp_path, 0, shard_of(frames(16)))
    res = ResidentShards(str(tmp_path), lay, 64)
    assert not res.load(0, budget=100)  # over the budget: not held
    assert not res.load(2, budget=1 << 20)  # no file
    with open(path, "r+b") as f:  # a damaged index: not held (the file path reports it)
        f.seek(-10, os.SEEK_END)
        f.write(b"\xff\xff")
    assert not res.load(0, budget=1 << 20)
    assert res.nbytes == 0 and not res.chunk_addr.any()


def rss_of_mapping_pages(buf: np.ndarray) -> int:
    """Resident pages (bytes) of the process's mapping that holds ``buf`` (/proc/self/smaps)."""
    addr = buf.ctypes.data
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and line.startswith("Rss:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the buffer")


def test_a_group_of_shards_is_read_whole_within_the_budget_each_on_its_own_pages(tmp_path):
    """``open_many``/``read_many``/``hold_many`` (the background pass's reads): what fits the budget is held, byte for
    byte as the files are, the rest refused; a missing file is skipped; a shard dropped later gives its
    pages back although the others of its group stay."""
    lay = layout(tmp_path, rows=96)
    data = {shard: frames(16, seed=shard) for shard in (0, 1, 2, 3, 5)}
    raw = {shard: shard_of(d) for shard, d in data.items()}
    for shard, b in raw.items():
        write(lay, tmp_path, shard, b)
    res = ResidentShards(str(tmp_path), lay, 96)
    budget = len(raw[0]) + len(raw[1]) + len(raw[2]) + len(raw[3]) // 2  # room for three of them
    opened = res.open_many([0, 4, 1, 2, 3, 5])  # shard 4 has no file
    assert opened.sizes[1] == -1 and opened.fds[1] == -1
    assert res.hold_many(res.read_many(opened, budget), budget, res.generations(range(6))) == 3
    assert (opened.fds == -1).all()  # every descriptor closed
    assert sorted(res.buffers) == [0, 1, 2] and res.nbytes <= budget and res.full(budget)
    for shard in (0, 1, 2):
        assert res.buffers[shard].tobytes() == raw[shard]
        assert res.buffers[shard].ctypes.data % mmap.PAGESIZE == 0  # its pages are its own
    assert not res.chunk_addr[48:].any()
    shared = res.buffers[1]
    before = rss_of_mapping_pages(shared)
    res.drop([1])
    assert rss_of_mapping_pages(shared) <= before - (len(raw[1]) // mmap.PAGESIZE) * mmap.PAGESIZE
    assert res.buffers[0].tobytes() == raw[0] and res.buffers[2].tobytes() == raw[2]


@pytest.mark.parametrize("direct", [False, True], ids=["page-cache", "O_DIRECT"])
def test_reading_files_into_a_buffer_they_do_not_fit_is_refused_before_any_read(tmp_path, direct):
    """``bulk.read_files`` writes through raw addresses: a file that would not fit is a ValueError first. A
    direct read takes whole blocks, so it needs its size rounded up, at an aligned address."""
    from mmreplay._native import bulk
    path = tmp_path / "f"
    path.write_bytes(b"x" * 100)
    fds, sizes, opened_direct = bulk.open_files([str(path)], direct=direct)
    try:
        assert opened_direct[0] == (direct and _allows_o_direct(tmp_path))
        room = bulk.DIRECT_ALIGN if opened_direct[0] else 100
        buf = np.frombuffer(mmap.mmap(-1, 2 * bulk.DIRECT_ALIGN), np.uint8)
        too_far = [2 * bulk.DIRECT_ALIGN - room + 1] + ([bulk.DIRECT_ALIGN + 8] if opened_direct[0] else [])
        for offset in too_far:  # past the end; for a direct read also off the block boundary
            with pytest.raises(ValueError, match="does not fit"):
                bulk.read_files(fds, sizes, buf, np.array([offset], np.int64), np.array([True]), opened_direct)
        assert not buf.any()
        at = bulk.DIRECT_ALIGN
        assert bulk.read_files(fds, sizes, buf, np.array([at], np.int64), np.array([True]), opened_direct)[0] == 100
        assert buf[at:at + 100].tobytes() == b"x" * 100 and not buf[:at].any() and not buf[at + 100:].any()
    finally:
        bulk.close_files(fds)


def _allows_o_direct(folder) -> bool:
    probe = os.path.join(folder, ".o_direct_probe")
    open(probe, "wb").close()
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        os.unlink(probe)


@pytest.mark.parametrize("size", [1, 4095, 4096, 4097, 100_003, 3 * 65536])
def test_direct_reads_give_the_files_bytes_where_o_direct_works_and_where_it_does_not(tmp_path, size):
    """The background pass opens its files ``O_DIRECT``: each file comes back byte for byte whatever its size
    against the block, and on a file system that refuses ``O_DIRECT`` (tmpfs) through the page cache."""
    from mmreplay._native import bulk
    folders = [tmp_path] + (["/dev/shm"] if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else [])
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    for folder in folders:
        path = os.path.join(folder, f"mmreplay-direct-{os.getpid()}-{size}")
        with open(path, "wb") as f:
            f.write(data)
        try:
            fds, sizes, opened_direct = bulk.open_files([path, path + ".missing"], direct=True)
            try:
                assert list(sizes) == [size, -1] and opened_direct[0] == _allows_o_direct(folder)
                span = -(-size // mmap.PAGESIZE) * mmap.PAGESIZE
                buf = np.frombuffer(mmap.mmap(-1, span), np.uint8)
                got = bulk.read_files(fds, sizes, buf, np.zeros(2, np.int64), np.array([True, False]), opened_direct)
                assert list(got) == [size, -1]
                assert buf[:size].tobytes() == data and not buf[size:].any()
            finally:
                bulk.close_files(fds)
        finally:
            os.unlink(path)


def test_a_group_load_that_raced_a_drop_installs_nothing_stale(tmp_path):
    """A shard the writer changed after the loader listed it (its generation moved on) is not held."""
    lay = layout(tmp_path)
    for shard in (0, 1):
        write(lay, tmp_path, shard, shard_of(frames(16, seed=shard)))
    res = ResidentShards(str(tmp_path), lay, 64)
    listed = res.generations([0, 1])
    opened = res.open_many([0, 1])
    res.drop([1])  # what the writer's replacement of the file does meanwhile
    assert res.hold_many(res.read_many(opened, 1 << 20), 1 << 20, listed) == 1
    assert sorted(res.buffers) == [0]


def test_the_background_pass_lets_go_of_the_file_indexes_of_what_it_holds(atari_like, monkeypatch):
    """A shard held whole is never read from its file again: the index the disk path cached for it (read
    while the pass was starting) is let go, as is its descriptor (~3 KB a shard: ~30 MB for 10M Atari)."""
    import threading
    path, data = atari_like
    hold, real = threading.Event(), BackgroundPass._run

    def paused(self, shards, listed):
        hold.wait(60)
        return real(self, shards, listed)

    monkeypatch.setattr(BackgroundPass, "_run", paused)
    with mmreplay.Store.open(path, mode="r") as s:
        col = s._state.reader.columns["obs"]
        array = col.column.array
        g = np.arange(*s.inspect.valid_range())
        try:
            np.testing.assert_array_equal(s.inspect.get(g).obs.numpy(), expected_obs(data, g))  # chunk reads
            assert len(array._indexes) > 1
        finally:
            hold.set()
        wait_preloaded(s)
        held = set(col.resident.buffers)
        assert len(held) > 1 and not held & set(array._indexes) and not held & set(array._fds)
        np.testing.assert_array_equal(s.inspect.get(g).obs.numpy(), expected_obs(data, g))


def test_a_writer_closed_on_its_own_preload_thread_does_not_deadlock(atari_like, monkeypatch):
    """A writable ``Store`` dropped without ``close`` is closed by ``__del__`` wherever the garbage collector
    runs, which may be one of the background pass's reader threads (seen: a numba cache load there ran the
    collector). Its close stops the pass, which waits for that very thread: it must not join it."""
    import threading
    path, data = atari_like
    real, ready, done, errors = BackgroundPass._read_group, threading.Event(), threading.Event(), []
    holder = {}

    def read_then_close(col, shards):
        read = real(col, shards)
        store = holder.pop("store", None) if ready.wait(60) else None  # the first reader thread only
        if store is not None:
            try:
                store.close()  # what Store.__del__ does when the collector runs on this thread
            except Exception as exc:  # noqa: BLE001  (reported by the assertion below)
                errors.append(exc)
            done.set()
        return read

    monkeypatch.setattr(BackgroundPass, "_read_group", staticmethod(read_then_close))
    holder["store"] = mmreplay.Store.open(path, mode="a")
    ready.set()
    assert done.wait(120), "the close on the pass's reader thread did not return (it joined its own pass)"
    assert not errors, errors
    with mmreplay.Store.open(path, mode="r") as s:  # the close committed, and every row is still true
        g = np.arange(*s.inspect.valid_range())
        np.testing.assert_array_equal(s.inspect.get(g).obs.numpy(), expected_obs(data, g))


def test_a_group_load_that_fails_leaks_no_descriptor_and_the_rows_stay_true(atari_like, monkeypatch):
    """The background pass reads the next groups of files on reader threads while it holds the first: if
    a read raises (an ``mmap`` refused for want of memory), the pass stops there, the groups read or opened
    meanwhile are closed all the same and held nowhere, and what the tier lacks is read from the files."""
    from mmreplay.reading import preload as preload_module
    path, data = atari_like
    monkeypatch.setattr(preload_module, "PRELOAD_GROUP_FILES", 1)  # one file a group: several groups
    real, calls = ResidentShards.read_many, []

    def fails_first(self, opened, *args, **kw):
        calls.append(opened.shards[0])
        if opened.shards[0] == 0:
            opened.close()
            raise OSError(errno.ENOMEM, "mmap refused")
        return real(self, opened, *args, **kw)

    monkeypatch.setattr(ResidentShards, "read_many", fails_first)
    before = set(os.listdir("/proc/self/fd"))
    with mmreplay.Store.open(path, mode="r") as s:
        s._state.reader.background.join(60)
        assert 0 in calls and len(calls) <= preload_module.PRELOAD_READS_AHEAD  # stopped at the failure
        assert not s._state.reader.columns["obs"].resident.buffers  # the groups read beside it: dropped
        g = np.arange(*s.inspect.valid_range())
        np.testing.assert_array_equal(s.inspect.get(g).obs.numpy(), expected_obs(data, g))
    leaked = [os.readlink(f"/proc/self/fd/{fd}") for fd in set(os.listdir("/proc/self/fd")) - before
              if os.path.exists(f"/proc/self/fd/{fd}")]
    assert not [p for p in leaked if p.startswith(path)], leaked


def test_a_load_that_raced_a_drop_is_not_installed(tmp_path, monkeypatch):
    """The file changed while a background load was reading it: its bytes are stale and must not be held."""
    lay = layout(tmp_path)
    write(lay, tmp_path, 0, shard_of(frames(16)))
    res = ResidentShards(str(tmp_path), lay, 64)
    real = os.preadv

    def preadv_then_drop(fd, buffers, offset):
        got = real(fd, buffers, offset)
        res.drop([0])  # what the writer's replacement of the file does meanwhile
        return got

    monkeypatch.setattr(os, "preadv", preadv_then_drop)
    assert not res.load(0, budget=1 << 20)
    assert 0 not in res.buffers
    monkeypatch.undo()
    assert res.load(0, budget=1 << 20)


def test_a_second_load_of_a_held_shard_keeps_the_copy_in_use(tmp_path):
    lay = layout(tmp_path)
    write(lay, tmp_path, 0, shard_of(frames(16)))
    res = ResidentShards(str(tmp_path), lay, 64)
    assert res.load(0, budget=1 << 20)
    before = res.chunk_addr.copy()
    assert res.load(0, budget=1 << 21)
    np.testing.assert_array_equal(res.chunk_addr, before)


def test_the_budget_holds_the_compressed_store_when_it_fits_and_decodes_into_batches_when_the_cache_is_small():
    assert plan_tiers(1000, 300, 1000) == TierPlan(300, 700, False)  # the decoded cache holds most frames
    assert plan_tiers(1000, 300, 100_000) == TierPlan(300, 0, True)  # it would hold 0.7%: decode into batches
    assert plan_tiers(1000, 300, int(700 / MIN_DECODED_SHARE)) == TierPlan(300, 700, False)


def test_a_store_too_large_for_the_budget_gets_nearly_all_of_it_as_whole_compressed_shards():
    """Issue 21: the decoded cache of a store 10x-60x larger decoded would serve almost no hits; the
    compressed tier holds whole shards in ``PARTIAL_RESIDENT_SHARE`` of the budget (all of them if they fit)."""
    over = int(MAX_RESIDENT_SHARE * 1000) + 1
    assert plan_tiers(1000, over, 10_000) == TierPlan(over, 1000 - over, True)  # fits the larger share: held whole
    assert plan_tiers(1000, 5000, 100_000) == TierPlan(int(PARTIAL_RESIDENT_SHARE * 1000),
                                                       1000 - int(PARTIAL_RESIDENT_SHARE * 1000), True)
    assert plan_tiers(1000, 5000, 5000) == TierPlan(0, 1000, False)  # compression gains nothing: decoded cache
    assert plan_tiers(1000, 700, 1200) == TierPlan(0, 1000, False)  # the decoded cache holds 65% of the frames


@pytest.fixture
def no_preload(monkeypatch):
    """Shards are loaded only when a batch needs them (so a test sees its own loads and failures)."""
    monkeypatch.setattr(FrameReader, "start_preload", lambda self: None)


@pytest.fixture
def atari_like(store_path):
    """1,500 transitions of 84x84 compressible frames, stack 4, in several frame shards."""
    from gymnasium import spaces
    data = frames(1501, seed=3)
    with mmreplay.Store.create(store_path, spaces.Box(0, 255, FRAME, np.uint8), spaces.Discrete(4), capacity=1500,
                               frame_stack=4, durable=False) as s:
        for g in range(1500):
            s.add(data[g], g % 4, 0.0, data[g + 1], g % 100 == 99, False)
    return store_path, data


def expected_obs(data: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Stack 4 of transitions ``g`` (episodes of 100, padded by repeating the first frame)."""
    start = g - g % 100
    ids = np.maximum(g[:, None] + np.arange(-3, 1)[None, :], start[:, None])
    return data[ids]


def frame_files(path):
    return sorted(glob.glob(os.path.join(path, "frames", "obs", "c", "*", "0", "0")),
                  key=lambda f: int(f.split(os.sep)[-3]))


def test_a_reopened_store_decodes_from_the_compressed_tier(atari_like, no_preload):
    path, data = atari_like
    with mmreplay.Store.open(path, mode="r", cache_bytes=64 << 20) as s:
        for _ in range(20):
            b = s.sample(32)
            np.testing.assert_array_equal(b.obs.numpy(), expected_obs(data, b.indices.numpy()))
        stats = s.inspect.cache_stats()["obs"]["compressed"]
        assert stats["compiled"] and stats["hits"] > 0 and stats["misses"] == 0
        assert 0 < stats["shard_loads"] <= len(frame_files(path))
        assert 0 < stats["bytes"] <= stats["capacity_bytes"]


def test_a_tier_too_small_for_the_store_holds_what_fits_and_reads_the_rest_from_files(atari_like):
    path, data = atari_like
    on_disk = sum(os.path.getsize(f) for f in frame_files(path))
    with mmreplay.Store.open(path, mode="r", cache_bytes=int(on_disk * 0.6)) as s:
        wait_preloaded(s)  # while the background pass runs, misses read chunks from the files (no tier hits)
        b = s.inspect.get(np.arange(0, 1500, 7))
        np.testing.assert_array_equal(b.obs.numpy(), expected_obs(data, np.arange(0, 1500, 7)))
        stats = s.inspect.cache_stats()["obs"]
        tier = stats["compressed"]
        assert 0 < tier["bytes"] <= tier["capacity_bytes"] < on_disk
        assert tier["hits"] > 0 and tier["misses"] > 0 and stats["disk"]["reads"] > 0


def test_a_corrupt_shard_loaded_whole_raises_naming_the_chunk_and_caches_nothing(atari_like, no_preload):
    path, data = atari_like
    victim = frame_files(path)[0]
    original = open(victim, "rb").read()
    damaged = bytearray(original)
    damaged[10] ^= 0xFF  # inside chunk 0's compressed bytes; the shard index is intact
    with open(victim, "wb") as f:
        f.write(damaged)
    with mmreplay.Store.open(path, mode="r", cache_bytes=64 << 20) as s:
        with pytest.raises(mmreplay.CorruptDataError, match=r"frames/obs.*shard 0, chunk 0.*checksum"):
            s.inspect.get(np.arange(0, 8))
        assert s.inspect.cache_stats()["obs"]["bytes"] == 0  # the failed batch left nothing in the decoded cache
        b = s.inspect.get(np.arange(200, 264))  # other shards are fine
        np.testing.assert_array_equal(b.obs.numpy(), expected_obs(data, np.arange(200, 264)))


def test_a_failed_whole_shard_read_falls_back_to_the_file_path_and_its_errors(atari_like, monkeypatch, no_preload):
    path, data = atari_like

    def failing_preadv(fd, buffers, offset):
        raise OSError(errno.EIO, "Input/output error (injected)")

    with mmreplay.Store.open(path, mode="r", cache_bytes=64 << 20) as s:
        monkeypatch.setattr(os, "preadv", failing_preadv)
        b = s.inspect.get(np.arange(0, 1500, 11))  # every shard load fails: chunk-by-chunk reads still give true data
        np.testing.assert_array_equal(b.obs.numpy(), expected_obs(data, np.arange(0, 1500, 11)))
        assert s.inspect.cache_stats()["obs"]["compressed"]["misses"] > 0


@pytest.mark.parametrize("budget", [64 << 20, 1 << 20], ids=["decoded-cache", "direct"])
def test_the_writer_holds_what_it_writes_and_readers_follow_overwrites(store_path, budget):
    """A ring that wraps several times while a reader samples: every row true, in both processes' views."""
    from gymnasium import spaces
    data = frames(4001, seed=5)
    with mmreplay.Store.create(store_path, spaces.Box(0, 255, FRAME, np.uint8), spaces.Discrete(4), capacity=300,
                               frame_stack=4, durable=False, cache_bytes=budget) as w:
        reader = None
        for g in range(4000):
            w.add(data[g], 0, 0.0, data[g + 1], g % 100 == 99, False)
            if g % 250 == 249:
                w.flush()
                reader = reader or mmreplay.Store.open(store_path, mode="r", cache_bytes=budget)
                reader.refresh()
                for store in (w, reader):
                    b = store.sample(64)
                    np.testing.assert_array_equal(b.obs.numpy(), expected_obs(data, b.indices.numpy()))
        assert w.inspect.cache_stats()["obs"]["compressed"]["bytes"] > 0
        # planned for the rows held, which are the ring's now
        assert w.inspect.cache_stats()["obs"]["compressed"]["direct"] == (budget == 1 << 20)
        reader.close()


def test_background_preload_and_sampling_agree(atari_like):
    path, data = atari_like
    for _ in range(3):
        with mmreplay.Store.open(path, mode="r", cache_bytes=64 << 20) as s:
            for _ in range(30):  # samples race the preloader's installs
                b = s.sample(64)
                np.testing.assert_array_equal(b.obs.numpy(), expected_obs(data, b.indices.numpy()))


def direct_budget(path) -> int:
    """A budget whose compressed share holds the store but whose decoded share holds few of its frames."""
    with mmreplay.Store.open(path, mode="r", cache_bytes=1 << 30) as s:
        need = s.inspect.cache_stats()["obs"]["compressed"]["capacity_bytes"]  # the whole ring, compressed
    return int(need / MAX_RESIDENT_SHARE) + 64


def test_frames_decoded_straight_into_batches_are_the_true_frames(atari_like):
    path, data = atari_like
    with mmreplay.Store.open(path, mode="r", cache_bytes=direct_budget(path)) as s:
        wait_preloaded(s)
        assert s.inspect.cache_stats()["obs"]["compressed"]["direct"]
        for _ in range(10):
            b = s.sample(48)
            g = b.indices.numpy()
            np.testing.assert_array_equal(b.obs.numpy(), expected_obs(data, g))
            np.testing.assert_array_equal(b.next_obs.numpy(), expected_obs(data, g + 1) * (g % 100 != 99)[:, None, None, None]
                                          + np.where((g % 100 == 99)[:, None, None, None],
                                                     np.concatenate([expected_obs(data, g)[:, 1:], data[g + 1][:, None]], 1), 0))
        ids = np.arange(0, 1500)
        # > 4 MiB: the threads split it
        np.testing.assert_array_equal(s.inspect.get(ids).obs.numpy(), expected_obs(data, ids))
        stats = s.inspect.cache_stats()["obs"]
        # only rows of the last, partly filled shard (kept in RAM) went through the decoded cache
        assert stats["compressed"]["hits"] > 10 * stats["hits"]


def test_n_step_batches_decoded_straight_into_batches_match_the_cached_path(atari_like):
    path, _ = atari_like
    got = []
    for budget in (direct_budget(path), 64 << 20):
        with mmreplay.Store.open(path, mode="r", cache_bytes=budget) as s:
            smp = s.sampler(32, NStep(3, 0.9), seed=5, name="n3")
            b = next(smp)
            got.append((b.indices.numpy().copy(), b.obs.numpy().copy(), b.next_obs.numpy().copy()))
            smp.close()
    for a, b in zip(got[0], got[1]):
        np.testing.assert_array_equal(a, b)


def test_a_new_store_plans_its_tiers_again_once_it_knows_how_its_frames_compress(store_path):
    from gymnasium import spaces
    data = np.repeat(frames(801, seed=9)[:, :2], 42, axis=1)  # compresses far better than the first guess
    with mmreplay.Store.create(store_path, spaces.Box(0, 255, FRAME, np.uint8), spaces.Discrete(4), capacity=2000,
                               frame_stack=4, durable=False, cache_bytes=3 << 20) as w:
        assert not w._state.reader.planner.measured  # planned from a guess (for the rows it holds: one shard's)
        for g in range(800):
            w.add(data[g], 0, 0.0, data[g + 1], g % 100 == 99, False)
        w.flush()
        b = w.sample(64)
        stats = w.inspect.cache_stats()["obs"]["compressed"]
        assert w._state.reader.planner.measured
        assert 0 < stats["capacity_bytes"] <= MAX_RESIDENT_SHARE * (3 << 20)  # measured: the compressed ring fits
        start = b.indices.numpy() - b.indices.numpy() % 100
        ids = np.maximum(b.indices.numpy()[:, None] + np.arange(-3, 1), start[:, None])
        np.testing.assert_array_equal(b.obs.numpy(), data[ids])


def test_the_compressed_tier_and_the_files_hand_out_the_same_compressed_bytes(atari_like):
    """What a device decode (#38) asks the sources: the compressed bytes of chunks, as held in RAM
    (``CompressedTierSource.compressed_chunks``) and as read from their files (``FileSource.compressed_chunks``):
    byte for byte the same, checksum included, and they decode to the frames the reader returns."""
    import ctypes
    path, _ = atari_like
    with mmreplay.Store.open(path, mode="r", cache_bytes=64 << 20) as s:
        wait_preloaded(s)
        reader = s._state.reader
        col = reader.columns["obs"]
        ids = np.arange(reader.oldest, reader.oldest + 40, dtype=np.int64)
        chunks = reader.ring.row_of(ids)
        with reader.compressed.holding(col):
            addr, sizes = reader.compressed.compressed_chunks(col, chunks)
            assert (addr > 0).all() and (sizes > 4).all()
            held = [ctypes.string_at(int(a), int(n)) for a, n in zip(addr.tolist(), sizes.tolist())]
        got = reader.files.compressed_chunks(col, chunks)
        try:
            assert not got.empty.any()
            read = [got.buffer[p:p + n].tobytes() for p, n in zip(got.pos.tolist(), got.sizes.tolist())]
            assert read == held
            out = np.zeros((ids.size, *FRAME), np.uint8)
            dst = out.ctypes.data + np.arange(ids.size, dtype=np.int64) * out[0].nbytes
            reader.files.decoder.decode_chunks(col, chunks, got.addresses(), got.sizes, dst, np.zeros_like(dst),
                                               out[0].nbytes, (out,))
        finally:
            got.release()
        for i, frame_id in enumerate(ids.tolist()):
            np.testing.assert_array_equal(out[i], reader.read_frame("obs", frame_id))
        assert reader.compressed.compressed_chunks(col, chunks[:0])[0].size == 0
