"""The disk path (``reading/disk.py``, issue 21): frames that RAM does not hold, read from their files many at
once. Batches with the disk path forced on (a budget nothing fits in) equal those read from RAM, for both frame
codecs, frame stacks and n-step across episode starts and a wrapped ring, every row checked against the
reference; failed, short and misplaced reads are errors naming the file that leave nothing cached."""

import errno
import os
import threading

import google_crc32c
import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from conftest import frame_shard_file, wait_preloaded
from mmreplay.reading import disk
from mmreplay.storage.format.shardfile import CRC_BYTES, EMPTY, index_nbytes
from reference import ReferenceReplay, assert_batch_matches
from test_nstep import assert_nstep_matches

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "atari_fixture.npz")
CAPACITY = 512
TINY = 1 << 12  # no shard fits: every frame the decoded cache lacks is read from its file
LARGE = 1 << 30


@pytest.fixture(scope="module")
def atari_frames():
    with np.load(FIXTURE, allow_pickle=False) as data:
        return data["frames"]


def record(store, ref, frames, n, episode_len=7):
    """``n`` transitions of real frames in episodes of ``episode_len`` steps, ending terminated or truncated."""
    frame = 0
    for t in range(n):
        step = t % episode_len
        if step == 0:
            frame += 1
        obs, nxt = frames[frame % len(frames)], frames[(frame + 1) % len(frames)]
        frame += 1
        end = step == episode_len - 1
        row = (obs, t % 6, float(t % 3 - 1), nxt, end and t % 2 == 0, end and t % 2 == 1)
        store.add(*row)
        ref.add(0, *row)


def make_store(path, frames, codec, n=3 * CAPACITY + 37, **settings):
    """A store whose ring wrapped three times, and its reference; left open for writing."""
    ref = ReferenceReplay(4, CAPACITY)
    store = mmreplay.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6),
                                  capacity=CAPACITY, frame_stack=4, reward_values=(-1, 0, 1), frame_codec=codec,
                                  durable=False, **settings)
    record(store, ref, frames, n)
    return store, ref


def blocking_reads_only(monkeypatch) -> None:
    """Every chunk read goes to the reading threads through ``os.pread``, none is served at once from the
    page cache (whose content a test does not control: the kernel may start a read for ``RWF_NOWAIT``)."""
    monkeypatch.setattr(disk, "_cached_first", False)


def disk_stats(store) -> dict:
    return store.inspect.cache_stats()["obs"]["disk"]


@pytest.mark.parametrize("codec", ["lz4hc", "delta-zstd"])
def test_batches_equal_with_the_disk_path_forced_on_and_off(store_path, atari_frames, codec):
    store, ref = make_store(store_path, atari_frames, codec)
    store.close()
    batches = {}
    on_disk = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in
                  os.walk(os.path.join(store_path, "frames")) for f in files)
    with mmreplay.Store.open(store_path, mode="r", preload=False) as s:
        index = s._state.ring.nbytes  # a budget that binds pays for the index ring too
    partial = on_disk // 2 + index  # the compressed tier holds some whole shards, the rest is read from the files
    for budget in (TINY, partial, LARGE):
        with mmreplay.Store.open(store_path, mode="r", cache_bytes=budget) as s:
            wait_preloaded(s)  # while the background pass runs, misses read chunks from the files instead
            valid = ref.valid_ids(s.inspect.valid_range()[0])
            got = [s.inspect.get(valid[lo:lo + 100]) for lo in range(0, len(valid), 100)]
            for lo, batch in zip(range(0, len(valid), 100), got):
                assert_batch_matches(batch, ref, valid[lo:lo + 100])
            with s.sampler(32, mmreplay.NStep(3, 0.9), seed=3) as smp:
                sampled = []
                for _ in range(8):  # each batch checked and copied before the next reuses its buffers
                    batch = next(smp)
                    assert_nstep_matches(batch, ref, 3, 0.9)
                    sampled.append((batch.indices.clone(), batch.obs.clone(), batch.next_obs.clone()))
            batches[budget] = (got, sampled)
            stats = disk_stats(s)
            tier = s.inspect.cache_stats()["obs"]["compressed"]
            if budget == TINY:
                assert stats["reads"] > 0 and stats["bytes_read"] > 0 and stats["chunks_read"] >= stats["reads"]
                assert stats["hit_rates"]["file"] > 0.5 and tier["bytes"] == 0
            elif budget == partial:
                assert 0 < tier["bytes"] <= tier["capacity_bytes"] < on_disk and tier["hits"] > 0
                assert stats["reads"] > 0 and 0 < stats["hit_rates"]["compressed"] < 1
            else:
                assert stats["reads"] == 0 and stats["hit_rates"]["file"] == 0.0
    off, off_sampled = batches[LARGE]
    for budget in (TINY, partial):
        on, on_sampled = batches[budget]
        for a, b in zip(on, off):
            assert np.array_equal(a.obs.numpy(), b.obs.numpy()) and np.array_equal(a.next_obs.numpy(),
                                                                                   b.next_obs.numpy())
        for a, b in zip(on_sampled, off_sampled):
            assert all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a, b))


@pytest.mark.parametrize("codec", ["lz4hc", "delta-zstd"])
def test_a_writer_with_a_tiny_budget_reads_back_every_row(store_path, atari_frames, codec):
    """Rows of the writer's RAM (its staging shard) and of its files, mixed in one batch. ``flush`` first:
    which sealed shards the background writer has written yet is up to it (~1 run in 8 on a loaded machine
    had written none, read every row from RAM, and the decoded cache then held them all); the writer's
    sealed-but-unwritten shards are read in ``test_tier_races``."""
    store, ref = make_store(store_path, atari_frames, codec, cache_bytes=TINY)
    try:
        store.flush()
        valid = ref.valid_ids(store.inspect.valid_range()[0])
        assert_batch_matches(store.inspect.get(valid), ref, valid)
        assert disk_stats(store)["reads"] > 0
        for _ in range(5):
            batch = store.sample(64)
            assert_batch_matches(batch, ref, batch.indices.tolist())
    finally:
        store.close()


def test_reads_are_merged_and_issued_together(store_path, atari_frames, monkeypatch):
    store, ref = make_store(store_path, atari_frames, "lz4hc")
    store.close()
    blocking_reads_only(monkeypatch)
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=TINY, io_depth=8) as s:
        for _ in range(5):
            batch = s.sample(64)
            assert_batch_matches(batch, ref, batch.indices.tolist())
        stats = disk_stats(s)
        # a stack's four frames are neighbours in their file: one read carries them
        assert stats["merged_reads"] > 0 and stats["chunks_read"] > stats["reads"]
        assert stats["max_queue_depth"] == 8 and 1 <= stats["mean_queue_depth"] <= 8
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=TINY, io_depth=1) as s:
        s.sample(64)
        assert disk_stats(s)["max_queue_depth"] == 1


def shard_index(raw, per: int) -> np.ndarray:
    """The ``(per, 2)`` (offset, size) index at the tail of a shard file's bytes ``raw``."""
    return np.frombuffer(bytes(raw[len(raw) - index_nbytes(per):-CRC_BYTES]), dtype="<u8").reshape(per, 2)


def evict_chunk_bytes(store) -> None:
    """The chunks of every frame shard file out of the page cache (written back first: dirty pages stay),
    their index tails left in: the next reads of chunks wait for the device, a file's open does not."""
    per = store.geometry.frames.shard_rows
    root = os.path.join(store.path, "frames")
    for folder, _, files in os.walk(root):
        for name in files:
            path = os.path.join(folder, name)
            if name.endswith(".json"):
                continue
            with open(path, "rb") as f:
                index = shard_index(f.read(), per)
            stored = index[index[:, 0] != EMPTY]
            data_end = int((stored[:, 0] + stored[:, 1]).max()) if stored.size else 0
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, data_end & ~4095, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def threads_reading(monkeypatch) -> list[str]:
    """The names of the threads that run each blocking chunk read from now on."""
    names, real = [], disk._read_fully

    def read_fully(read):
        names.append(threading.current_thread().name)
        return real(read)

    monkeypatch.setattr(disk, "_read_fully", read_fully)
    return names


@pytest.mark.parametrize("starts_reads", [True, False], ids=["kernel-starts-reads", "older-kernel"])
def test_reads_that_wait_for_the_device_are_collected_by_the_caller_once_the_kernel_started_them(
        store_path, atari_frames, monkeypatch, starts_reads):
    """Where ``RWF_NOWAIT`` starts the device reads it cannot serve (Linux >= 5.9), the caller collects
    them itself, no thread involved; on an older kernel (simulated) the threads issue them. True rows both ways."""
    if not disk._cached_first:
        pytest.skip("this platform has no RWF_NOWAIT: every read goes to the threads")
    store, ref = make_store(store_path, atari_frames, "lz4hc")
    store.close()
    monkeypatch.setattr(disk, "_nowait_starts_reads", starts_reads)
    readers = threads_reading(monkeypatch)
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=TINY, io_depth=8) as s:
        evict_chunk_bytes(s)
        for _ in range(3):
            batch = s.sample(64)
            assert_batch_matches(batch, ref, batch.indices.tolist())
        stats = disk_stats(s)
        if stats["page_cache_reads"] == stats["reads"]:
            pytest.skip("the page cache kept the files (a file system that ignores POSIX_FADV_DONTNEED)")
        on_io_threads = [name for name in readers if name.startswith("mmreplay-io")]
        assert readers  # some reads waited for the device
        if starts_reads:  # (a cold open may still use the IO threads: only chunk reads are counted)
            assert on_io_threads == []
        else:
            assert on_io_threads and stats["max_queue_depth"] > 1


def test_a_batch_opens_its_cold_files_at_once_and_a_misplaced_one_is_still_named(store_path, atari_frames,
                                                                                 monkeypatch):
    """The files a batch needs that no descriptor is kept for are opened, and their index tails read, on the
    reading threads at once (right after a restart each waits for the device); their identities are checked
    as one at a time: a misplaced file among them is the same error, a tail read that fails is retried by
    the file's own open, and every row is true."""
    from mmreplay.storage.format.sharded import ShardedArray
    store, ref = make_store(store_path, atari_frames, "lz4hc")
    store.close()
    real, threads = ShardedArray.open_file, []

    def open_file(self, shard):
        threads.append(threading.current_thread().name)
        return None if len(threads) == 3 else real(self, shard)  # one fails: its own open reads it again

    monkeypatch.setattr(ShardedArray, "open_file", open_file)
    monkeypatch.setattr(disk, "COLD_OPEN_S", 0.0)  # every open counts as one that waited for the device
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=TINY, io_depth=8, preload=False) as s:
        valid = ref.valid_ids(s.inspect.valid_range()[0])
        assert_batch_matches(s.inspect.get(valid), ref, valid)
        files = {frame_shard_file(s, k) for k in range(s.geometry.frames.rows // s.geometry.frames.shard_rows)}
        on_threads = [name for name in threads if name.startswith("mmreplay-io-")]
        assert len(files) >= 4 and len(on_threads) >= len(files) - 2  # the first one is opened by the batch
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=TINY, io_depth=8, preload=False) as s:
        first, second = frame_shard_file(s, 0), frame_shard_file(s, 1)
        with open(first, "rb") as f:
            original = f.read()
        with open(second, "rb") as src, open(first, "wb") as dst:
            dst.write(src.read())
        try:
            with pytest.raises(mmreplay.CorruptDataError, match="not the shard file the last commit expects"):
                s.inspect.get(valid)
        finally:
            with open(first, "wb") as f:
                f.write(original)
        assert_batch_matches(s.inspect.get(valid), ref, valid)


class FailingPread:
    """``os.preadv`` (what the reading threads read chunks with) that fails (``mode``) on the chunk reads
    numbered in ``fail_on`` (reads of a shard's tail, its index, are left alone), and works otherwise."""

    def __init__(self, fail_on, mode="eio"):
        self.calls, self.fail_on, self.mode, self.real = 0, set(fail_on), mode, os.preadv

    def __call__(self, fd, buffers, offset, *flags):
        n = sum(len(b) for b in buffers)
        if offset + n != os.fstat(fd).st_size:  # not the tail
            self.calls += 1  # the reading threads count under the GIL; which read fails does not matter
            if self.calls in self.fail_on:
                if self.mode == "eio":
                    raise OSError(errno.EIO, "Input/output error (injected)")
                return 0  # end of file: the file is shorter than its index says
        return self.real(fd, buffers, offset, *flags)


@pytest.mark.parametrize("mode", ["eio", "short"])
@pytest.mark.parametrize("codec", ["lz4hc", "delta-zstd"])
def test_a_read_that_fails_once_names_the_file_and_poisons_nothing(store_path, atari_frames, monkeypatch, mode,
                                                                   codec):
    store, ref = make_store(store_path, atari_frames, codec)
    store.close()
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=TINY) as s:
        valid = ref.valid_ids(s.inspect.valid_range()[0])
        ids = valid[:64]
        blocking_reads_only(monkeypatch)
        failing = FailingPread(fail_on={1}, mode=mode)
        monkeypatch.setattr(disk.os, "preadv", failing)
        expected = OSError if mode == "eio" else mmreplay.CorruptDataError
        with pytest.raises(expected) as info:
            s.inspect.get(ids)
        assert os.path.join(store_path, "frames", "obs", "c") in str(info.value)
        if mode == "eio":
            assert info.value.errno == errno.EIO and info.value.filename.startswith(store_path)
        monkeypatch.undo()
        # the same rows again, from the cache where the failed batch left nothing
        assert_batch_matches(s.inspect.get(ids), ref, ids)
        assert_batch_matches(s.inspect.get(valid), ref, valid)


def test_a_shard_file_replaced_by_another_is_an_error(store_path, atari_frames):
    store, ref = make_store(store_path, atari_frames, "lz4hc")
    store.close()
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=TINY) as s:
        first, second = frame_shard_file(s, 0), frame_shard_file(s, 1)
        with open(first, "rb") as f:
            original = f.read()
        with open(second, "rb") as src, open(first, "wb") as dst:
            dst.write(src.read())
        valid = ref.valid_ids(s.inspect.valid_range()[0])  # frame shard 0 holds frames some of them need
        with pytest.raises(mmreplay.CorruptDataError, match="not the shard file the last commit expects"):
            s.inspect.get(valid)
        with open(first, "wb") as f:
            f.write(original)
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=TINY) as s:
        valid = ref.valid_ids(s.inspect.valid_range()[0])
        assert_batch_matches(s.inspect.get(valid), ref, valid)


def test_a_replaced_chunk_whose_own_checksum_is_right_is_an_error(store_path, atari_frames):
    """A chunk changed and its crc32c recomputed passes the decoder's check; the identity tag's crc does not."""
    store, ref = make_store(store_path, atari_frames, "lz4hc")
    store.close()
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=TINY) as s:
        path = frame_shard_file(s, 0)
        per = s.geometry.frames.shard_rows  # lz4hc: one frame a chunk
        raw = bytearray(open(path, "rb").read())
        index = shard_index(raw, per)
        inner = int(np.flatnonzero(index[:, 0] != EMPTY)[3])
        offset, size = int(index[inner, 0]), int(index[inner, 1])
        raw[offset + size - CRC_BYTES - 1] ^= 0x01
        raw[offset + size - CRC_BYTES:offset + size] = google_crc32c.value(
            bytes(raw[offset:offset + size - CRC_BYTES])).to_bytes(CRC_BYTES, "little")
        with open(path, "wb") as f:
            f.write(bytes(raw))
        valid = ref.valid_ids(s.inspect.valid_range()[0])  # frame shard 0 holds frames some of them need
        with pytest.raises(mmreplay.CorruptDataError, match=f"shard 0, chunk {inner}: chunk checksum differs"):
            s.inspect.get(valid)


@pytest.mark.parametrize("bad", [0, -1, True, 2.5, "8", 100_000])
def test_io_depth_is_validated(bad):
    with pytest.raises(ValueError, match="io_depth must be an integer from 1 to"):
        mmreplay.Settings(io_depth=bad)


def test_io_depth_is_a_session_setting(store_path, atari_frames):
    store, _ = make_store(store_path, atari_frames, "lz4hc", n=300, io_depth=3)
    assert store.settings.io_depth == 3
    store.close()


def test_a_failing_page_cache_read_falls_back_to_the_blocking_read(store_path, atari_frames, monkeypatch):
    store, ref = make_store(store_path, atari_frames, "delta-zstd")
    store.close()
    calls = []

    def failing_preadv(fd, buffers, offset, flags=0):
        calls.append(flags)
        raise OSError(errno.EIO, "Input/output error (injected)")

    with mmreplay.Store.open(store_path, mode="r", cache_bytes=TINY) as s:
        valid = ref.valid_ids(s.inspect.valid_range()[0])
        monkeypatch.setattr(disk, "_preadv", failing_preadv)
        assert_batch_matches(s.inspect.get(valid), ref, valid)
        assert calls and disk_stats(s)["page_cache_reads"] == 0


def test_a_file_system_that_refuses_page_cache_reads_leaves_other_stores_theirs(tmp_path, atari_frames,
                                                                               monkeypatch):
    """``RWF_NOWAIT`` refused (a tmpfs, say) turns the page-cache first pass off for that store's files only:
    once it turned off for the whole process, so a full-disk test's store took every later store's."""
    refusing, other = str(tmp_path / "refusing"), str(tmp_path / "other")
    stores = {p: make_store(p, atari_frames, "lz4hc") for p in (refusing, other)}
    for store, _ in stores.values():
        store.close()
    real = disk._preadv
    monkeypatch.setattr(disk, "_refused_roots", set())

    def preadv(fd, buffers, offset, flags=0):
        if flags and os.readlink(f"/proc/self/fd/{fd}").startswith(refusing):
            raise OSError(errno.EOPNOTSUPP, "Operation not supported (injected)")
        return real(fd, buffers, offset, flags)

    monkeypatch.setattr(disk, "_preadv", preadv)
    for path in (refusing, other, refusing):
        ref = stores[path][1]
        with mmreplay.Store.open(path, mode="r", cache_bytes=TINY) as s:
            valid = ref.valid_ids(s.inspect.valid_range()[0])
            assert_batch_matches(s.inspect.get(valid), ref, valid)
            stats = disk_stats(s)
            assert stats["reads"] > 0
            if path == refusing:
                assert stats["page_cache_reads"] == 0
            else:
                assert stats["page_cache_reads"] > 0  # the files were just written: the page cache holds them
    assert disk._cached_first and all(root.startswith(refusing) for root in disk._refused_roots)
    assert disk._refused_roots


# -- the default budget follows the memory limit ---------------------------------------------------------
GIB = 1 << 30


@pytest.fixture
def fake_cgroup(tmp_path, monkeypatch):
    """A fake cgroup mount, /proc/self/cgroup and /proc/meminfo: ``make(cgroup_lines, {file: text}, ram)``."""
    from mmreplay import settings

    def make(lines, files, ram=64 * GIB):
        root = tmp_path / "cgroup"
        for rel, text in files.items():
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text + "\n")
        (tmp_path / "self_cgroup").write_text("".join(line + "\n" for line in lines))
        (tmp_path / "meminfo").write_text(f"MemTotal:       {ram // 1024} kB\nMemFree:  1 kB\n")
        monkeypatch.setattr(settings, "CGROUP_ROOT", str(root))
        monkeypatch.setattr(settings, "PROC_SELF_CGROUP", str(tmp_path / "self_cgroup"))
        monkeypatch.setattr(settings, "MEMINFO", str(tmp_path / "meminfo"))
        monkeypatch.setattr(settings, "process_rss", lambda: 0)  # tests/test_budget.py covers the baseline

    return make


NO_LIMIT_V1 = "9223372036854771712"


@pytest.mark.parametrize("lines,files,ram,expected", [
    (["0::/user.slice/job"], {"user.slice/job/memory.max": str(2 * GIB), "user.slice/memory.max": "max"}, 64 * GIB,
     int(0.7 * 2 * GIB)),  # cgroup v2, the process's own cgroup
    (["0::/user.slice/job"], {"user.slice/job/memory.max": "max", "user.slice/memory.max": str(GIB)}, 64 * GIB,
     int(0.7 * GIB)),  # an ancestor's limit binds too
    (["0::/"], {"memory.max": str(4 * GIB)}, 64 * GIB, int(0.7 * 4 * GIB)),  # a container's own namespace
    (["4:memory:/process/a", "3:cpu,cpuacct:/"], {"memory/process/a/memory.limit_in_bytes": str(4 * GIB),
                                                 "memory/memory.limit_in_bytes": NO_LIMIT_V1}, 64 * GIB,
     int(0.7 * 4 * GIB)),  # cgroup v1
    (["4:memory:/process/a"], {"memory/process/a/memory.limit_in_bytes": str(4 * GIB)}, 2 * GIB,
     int(0.7 * 2 * GIB)),  # a limit above the machine's RAM: the RAM
    (["4:memory:/a"], {"memory/a/memory.limit_in_bytes": NO_LIMIT_V1}, 64 * GIB, GIB),  # no limit: 1 GiB
    (["0::/job"], {"job/memory.max": "max"}, 64 * GIB, GIB),
    (["0::/job"], {}, 64 * GIB, GIB),  # no memory controller files at all
])
def test_the_default_budget_is_70_percent_of_the_memory_limit(fake_cgroup, lines, files, ram, expected):
    fake_cgroup(lines, files, ram)
    assert mmreplay.Settings().cache_bytes == expected
    assert mmreplay.Settings(cache_bytes=12345).cache_bytes == 12345  # explicit wins


def test_a_store_opened_under_a_memory_limit_plans_for_it(fake_cgroup, store_path, atari_frames):
    store, _ = make_store(store_path, atari_frames, "lz4hc", n=300)
    store.close()
    fake_cgroup(["0::/job"], {"job/memory.max": str(GIB)})
    with mmreplay.Store.open(store_path, mode="r") as s:
        assert s.settings.cache_bytes == int(0.7 * GIB)
        assert s._state.reader.cache_bytes == int(0.7 * GIB)
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=TINY) as s:
        assert s._state.reader.cache_bytes == TINY


# -- the RAM plan follows what the store holds (issue 24, item 4) ------------------------------------------
def test_the_plan_follows_the_rows_held_and_is_made_again_as_they_double(store_path, atari_frames):
    """A store made for 20,000 transitions that holds 300 is planned as one holding ~600: its decoded cache
    holds all of it (planned for its capacity, the compressed tier would take the budget and frames would be
    decoded into every batch). As it fills, the plan is made again, and decodes into batches once the decoded
    cache could hold too few of its frames."""
    ref = ReferenceReplay(4, 20_000)
    with mmreplay.Store.create(store_path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6),
                               capacity=20_000, frame_stack=4, reward_values=(-1, 0, 1), durable=False,
                               cache_bytes=8 << 20) as s:
        record(s, ref, atari_frames, 300)
        s.flush()
        batch = s.sample(64)
        assert_batch_matches(batch, ref, batch.indices.tolist())
        small = s.inspect.cache_stats()["obs"]["compressed"]
        assert not small["direct"] and small["capacity_bytes"] < 1 << 20
        assert s.inspect.cache_stats()["obs"]["capacity_bytes"] >= 300 * 84 * 84  # every frame held fits decoded
        for _ in range(3):  # the rows held double, and double again
            record(s, ref, atari_frames, 1500)
            s.flush()
            batch = s.sample(64)
            assert_batch_matches(batch, ref, batch.indices.tolist())
        large = s.inspect.cache_stats()["obs"]["compressed"]
        assert large["direct"] and large["capacity_bytes"] > 2 * small["capacity_bytes"]


def test_while_the_background_pass_runs_a_miss_reads_its_chunks_not_whole_shards(store_path, atari_frames,
                                                                                  monkeypatch):
    """Right after a restart the background pass reads every shard in file order; a batch that loaded the
    shards of its own frames whole as well read ~100x the bytes it needed (10M Atari: 43 batch-32/s in the
    first 10 s). While the pass runs, misses are chunk reads; the pass still fills the tier."""
    from mmreplay.reading.preload import BackgroundPass

    store, ref = make_store(store_path, atari_frames, "delta-zstd")
    store.close()
    hold = threading.Event()
    real = BackgroundPass._run

    def paused(self, shards, listed):
        hold.wait(60)
        return real(self, shards, listed)
    monkeypatch.setattr(BackgroundPass, "_run", paused)
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=LARGE) as s:
        try:
            for _ in range(4):
                batch = s.sample(64)
                assert_batch_matches(batch, ref, batch.indices.numpy())
            stats = s.inspect.cache_stats()["obs"]
            assert stats["compressed"]["loading"] and stats["compressed"]["shard_loads"] == 0
            assert stats["disk"]["reads"] > 0
        finally:
            hold.set()
        wait_preloaded(s)
        assert s.inspect.cache_stats()["obs"]["compressed"]["bytes"] > 0
        reads = disk_stats(s)["reads"]
        batch = s.sample(64)
        assert_batch_matches(batch, ref, batch.indices.numpy())
        assert disk_stats(s)["reads"] == reads  # held now: no more file reads


def test_reads_land_in_buffers_of_their_own_pages_kept_for_the_next_batch():
    """Not malloc's heap (see ``ReadBuffers``): one buffer is kept, the smallest that fits is reused."""
    import mmap

    buffers = disk.ReadBuffers()
    a = buffers.take(5000)
    assert a.size >= 5000 and a.size % buffers.ROUND == 0 and a.ctypes.data % mmap.PAGESIZE == 0
    buffers.give(a)
    b = buffers.take(3000)
    assert b.ctypes.data == a.ctypes.data  # reused
    c = buffers.take(3000)  # the kept one is taken: a new one
    assert c.ctypes.data != b.ctypes.data
    buffers.give(b)
    buffers.give(c)
    assert len(buffers._free) == disk.ReadBuffers.KEEP == 1
