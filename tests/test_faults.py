"""Injected faults on the read path: a clear error or true data, never silent garbage.

Each test breaks one thing (a read that fails once, a flipped byte, a deleted file, an edited record) and
then checks every row it can still read against the ground truth of ``synthetic``.
"""

import errno
import glob
import json
import os

import numpy as np
import pytest

import mmreplay
import mmreplay.storage.format.sharded as sharded
from mmreplay.reading import disk
import synthetic as syn
from mmreplay.sampling.strategy import Prioritized

N = 1500


@pytest.fixture
def filled(synthetic_store, store_path):
    synthetic_store(2000, n=N).close()
    return store_path


def all_rows_right(store) -> int:
    oldest, head = store.inspect.valid_range()
    ids = np.array([g for g in range(oldest, head) if syn.needs(g) >= oldest])
    for lo in range(0, ids.size, 256):
        assert syn.wrong_rows(store.inspect.get(ids[lo:lo + 256])) == []
    for _ in range(30):
        assert syn.wrong_rows(store.sample(64)) == []
    return ids.size


def frame_shards(path):
    """Frame shard files, shard 0 first."""
    files = glob.glob(os.path.join(path, "frames", "obs", "c", "*", "0", "0"))
    return sorted(files, key=lambda f: int(f.split(os.sep)[-3]))


class FailingPread:
    """``os.pread`` (and ``preadv``, ``.vectored``: the disk path's reading threads) that raise EIO on calls
    number ``fail_on`` (a set, counted over both), and work otherwise."""

    def __init__(self, fail_on):
        self.calls, self.fail_on, self.real, self.real_v = 0, set(fail_on), os.pread, os.preadv

    def _count(self) -> None:
        self.calls += 1
        if self.calls in self.fail_on:
            raise OSError(errno.EIO, "Input/output error (injected)")

    def __call__(self, fd, n, offset):
        self._count()
        return self.real(fd, n, offset)

    def vectored(self, fd, buffers, offset, *flags):
        self._count()
        return self.real_v(fd, buffers, offset, *flags)


@pytest.mark.parametrize("mode", ["r", "a"])
def test_a_read_that_fails_once_leaves_no_garbage_in_the_cache(filled, monkeypatch, mode):
    with mmreplay.Store.open(filled, mode=mode, cache_bytes=1 << 14) as s:  # a tiny cache: many misses
        # calls 3-5 are index-tail reads of files opened at once on the IO threads (reading/disk.py): such a
        # failure is retried by the file's own open, so the later ones are what make batches raise
        failing = FailingPread(fail_on={3, 4, 5, 40, 90, 150})
        monkeypatch.setattr(sharded.os, "pread", failing)
        monkeypatch.setattr(sharded.os, "preadv", failing.vectored)
        monkeypatch.setattr(disk, "_cached_first", False)  # every chunk read is a (failing) blocking pread
        raised = 0
        for _ in range(40):
            try:
                assert syn.wrong_rows(s.sample(64)) == []
            except OSError as exc:
                assert exc.errno == errno.EIO
                raised += 1
        assert raised >= 2 and failing.calls > 40
        monkeypatch.undo()
        assert all_rows_right(s) == N


def test_a_corrupt_chunk_raises_and_is_not_cached(filled):
    path = frame_shards(filled)[0]
    original = open(path, "rb").read()
    damaged = bytearray(original)
    damaged[10] ^= 0xFF  # inside the first chunk's compressed bytes
    with mmreplay.Store.open(filled, mode="r", cache_bytes=1 << 14) as s:
        with open(path, "wb") as f:
            f.write(damaged)
        with pytest.raises(mmreplay.CorruptDataError, match=r"frames/obs.*shard 0, chunk 0"):
            s.inspect.get(np.arange(0, 64))
        with open(path, "wb") as f:  # the file is fine again: so is every row
            f.write(original)
        assert all_rows_right(s) == N


@pytest.mark.parametrize("what", ["frames", "transitions"])
def test_a_deleted_committed_shard_is_an_error_not_zeros(filled, what):
    victim = frame_shards(filled)[0] if what == "frames" else \
        os.path.join(filled, "transitions", "action", "c", "0")
    os.unlink(victim)
    with pytest.raises(mmreplay.CorruptDataError, match="missing"):
        s = mmreplay.Store.open(filled, mode="r")
        try:
            s.inspect.get(np.arange(0, 64))
            for _ in range(20):
                s.sample(64)
        finally:
            s.close()


def test_an_edited_commit_record_is_refused(filled):
    commit = os.path.join(filled, "commit", "zarr.json")
    group = json.load(open(commit))
    group["attributes"]["mmreplay_commit"]["frame_head"] -= 5
    with open(commit, "w") as f:
        json.dump(group, f)
    with pytest.raises(mmreplay.CorruptDataError, match="checksum"):
        mmreplay.Store.open(filled, mode="r")


def test_a_record_without_checksum_still_opens(filled):
    """Stores written before the record had a checksum open as they are."""
    commit = os.path.join(filled, "commit", "zarr.json")
    group = json.load(open(commit))
    del group["attributes"]["mmreplay_commit_crc32c"]
    with open(commit, "w") as f:
        json.dump(group, f)
    with mmreplay.Store.open(filled, mode="r") as s:
        assert all_rows_right(s) == N


def test_a_refresh_that_fails_midway_is_loaded_again(filled, monkeypatch):
    reader = mmreplay.Store.open(filled, mode="r", cache_bytes=1 << 14)
    with mmreplay.Store.open(filled) as writer:
        for g in range(N, N + 700):
            writer.add(*syn.transition(g))
    failing = FailingPread(fail_on=set(range(2, 6)))
    monkeypatch.setattr(sharded.os, "pread", failing)
    with pytest.raises(OSError):
        reader.refresh()
    with pytest.raises(OSError):
        reader.sample(32)  # loads again first, and fails again: never samples the half-loaded state
    monkeypatch.undo()
    assert syn.wrong_rows(reader.sample(32)) == []
    assert reader.inspect.valid_range()[1] == N + 700
    assert all_rows_right(reader) > 0
    reader.close()


def test_priorities_that_overflow_float32_or_the_tree_are_refused_before_anything_changes(filled):
    with mmreplay.Store.open(filled) as s:
        sampler = s.sampler(32, Prioritized())
        batch = next(sampler)
        before = s.inspect.priorities().raw.copy()
        for bad in (1e39, 3.5e38, float("inf"), float("nan"), -1.0):
            with pytest.raises(ValueError):
                sampler.update_priorities(batch.indices, np.full(32, bad))
        np.testing.assert_array_equal(s.inspect.priorities().raw, before)
        with pytest.raises(ValueError, match="overflows"):
            s.inspect.priorities(alpha=1e9)  # (1 + 1e-6) ** 1e9 = e ** 1000
        sampler.update_priorities(batch.indices, np.full(32, 3e38))  # largest float32-ish: still fine at 0.6
        with pytest.raises(ValueError, match="overflows"):
            s.inspect.priorities(alpha=10.0)  # (3e38) ** 10 overflows float64
        assert s.inspect.priorities().alpha == 0.6
        assert syn.wrong_rows(next(sampler)) == []
        s.flush()  # commits still work
    with mmreplay.Store.open(filled) as again:  # and the store reopens with everything
        assert again.inspect.valid_range() == (0, N)
        assert float(again.inspect.priorities().raw.max()) == pytest.approx(3e38, rel=1e-6)
        assert syn.wrong_rows(next(again.sampler(32, Prioritized()))) == []
    with pytest.raises(ValueError, match="overflows"):
        with mmreplay.Store.open(filled) as third:
            third.sampler(32, Prioritized(alpha=1e9))


def test_small_things_that_used_to_pass_silently(filled, tmp_path):
    with mmreplay.Store.open(filled, mode="r") as s:
        with pytest.raises(TypeError, match="integer transition ids"):
            s.inspect.get([1.7])
        with pytest.raises(TypeError, match="integer transition ids"):
            s.inspect.get(np.array([True]))
        with pytest.raises(ValueError, match="larger than the store"):
            s.sample(10**6)  # checked before 10**6 rows of buffers are allocated
    closed = mmreplay.Store.open(filled, mode="r")
    closed.close()
    for use in (len, lambda x: x.inspect.valid_range(), lambda x: x.num_added, lambda x: x.inspect.cache_stats()):
        with pytest.raises(mmreplay.StoreClosedError):
            use(closed)
    os.unlink(os.path.join(filled, "transitions", "reward", "zarr.json"))
    with mmreplay.Store.open(filled, mode="r") as s:
        problems = s.verify()
    assert any("transitions/reward" in p and "missing" in p for p in problems), problems


def test_a_priority_name_that_leaves_the_store_is_refused(filled):
    from mmreplay.storage.durability.commit import CHECKSUM_KEY, COMMIT_KEY, record_checksum

    commit = os.path.join(filled, "commit", "zarr.json")
    group = json.load(open(commit))
    group["attributes"][COMMIT_KEY]["priorities"] = {"..": {"buffer": 0, "max_priority": 1.0, "head": 5}}
    group["attributes"][CHECKSUM_KEY] = record_checksum(group["attributes"][COMMIT_KEY])
    with open(commit, "w") as f:
        json.dump(group, f)
    with pytest.raises(mmreplay.FormatError, match="priorities"):
        mmreplay.Store.open(filled, mode="r")


def test_a_create_that_crashed_before_its_first_commit_is_started_again(store_path):
    import subprocess
    import sys
    import textwrap

    # Kill a child inside Store.create, after the arrays exist and before the commit record is written.
    code = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
        import mmreplay, mmreplay.storage.durability.commit as st, synthetic as syn
        def die(*a, **k):
            os.kill(os.getpid(), signal.SIGKILL)
        st.write_commit = die
        mmreplay.Store.create({store_path!r}, syn.OBS_SPACE, syn.ACTION_SPACE, capacity=300)
    """)
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    assert os.path.exists(os.path.join(store_path, "zarr.json"))
    with pytest.raises(mmreplay.NotAStoreError, match="never completely created"):
        mmreplay.Store.open(store_path)
    with mmreplay.Store.create(store_path, syn.OBS_SPACE, syn.ACTION_SPACE, capacity=300, frame_stack=3,
                               reward_values=(-1, 0, 1)) as s:
        for g in range(150):
            s.add(*syn.transition(g))
    with mmreplay.Store.open(store_path, mode="r") as s:
        assert all_rows_right(s) == 150
    with pytest.raises(FileExistsError):  # a store with a commit is never replaced
        mmreplay.Store.create(store_path, syn.OBS_SPACE, syn.ACTION_SPACE, capacity=300)
