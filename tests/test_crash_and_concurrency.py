"""Crash safety: SIGKILL at random instants loses nothing committed; concurrent readers never see a torn
transition; a write that meets a full disk fails clearly and the store reopens at its last commit."""

import errno

import numpy as np
import pytest

import mmreplay
import synthetic as syn
from torture import check_store, concurrent_readers, kill_trials


def test_sigkill_at_random_instants(store_path):
    results = kill_trials(store_path, trials=8, capacity=300, seed=1, log=lambda *a: None)
    for round_ in range(2, 12):  # on a loaded machine the writer gets less done before each kill
        if results[-1][0] > 300:
            break
        results = kill_trials(store_path, trials=4, capacity=300, seed=round_, log=lambda *a: None)
    assert results[-1][0] > 300  # the ring wrapped: overwrite commits were exercised too


def test_concurrent_readers_see_only_whole_committed_transitions(store_path):
    outputs = concurrent_readers(store_path, readers=2, seconds=4.0, capacity=200, min_batches=10)
    for out in outputs:
        status, batches, heads = out.split()
        assert status == "ok" and int(batches) > 10 and int(heads) > 1  # they saw the writer progress


def test_disk_full_fails_clearly_and_store_reopens_at_last_commit(synthetic_store, store_path, monkeypatch):
    s = synthetic_store(300, n=200, durable=True)
    s.flush()
    import mmreplay.storage.files as files

    real_write = files.os.write

    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files.os, "write", full_disk)
    with pytest.raises(mmreplay.StorageError, match="No space left on device"):
        for g in range(200, 260):  # a full shard is written during adds, the rest at flush
            s.add(*syn.transition(g))
        s.flush()
    with pytest.raises(mmreplay.StorageError, match="reopen"):
        s.add(*syn.transition(260))  # a failed store refuses further writes
    monkeypatch.setattr(files.os, "write", real_write)
    s.close()  # releases the lock without writing
    head, checked = check_store(store_path, 300)
    assert head == 200 and checked == 200
    with mmreplay.Store.open(store_path) as again:  # and the writer can go on from the last commit
        for g in range(200, 400):
            again.add(*syn.transition(g))
    assert check_store(store_path, 300)[0] == 400


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 2 MiB filesystem to fill up (needs root; skipped where mounting is not allowed)."""
    import subprocess

    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root?): the injected-ENOSPC test covers this path")
    yield str(mount)
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_real_full_disk(tiny_tmpfs):
    from gymnasium import spaces

    path = f"{tiny_tmpfs}/store"
    rng = np.random.default_rng(0)
    space = spaces.Box(0, 255, (84, 84), np.uint8)
    s = mmreplay.Store.create(path, space, spaces.Discrete(4), capacity=300, frame_stack=2, durable=True)
    frames = rng.integers(0, 256, (400, 84, 84), dtype=np.uint8)  # incompressible: ~7 KB a frame
    committed = 0
    with pytest.raises(mmreplay.StorageError, match="No space left on device"):
        for t in range(399):
            s.add(frames[t], t % 4, 0.0, frames[t + 1], False, False)
            if t % 20 == 19:
                s.flush()
                committed = t + 1
    s.close()
    assert committed > 0
    with mmreplay.Store.open(path, mode="r") as again:
        assert again.inspect.valid_range() == (0, committed)
        b = again.inspect.get(np.arange(committed))
        np.testing.assert_array_equal(b.next_obs[:, -1].numpy(), frames[1:committed + 1])
        assert again.verify() == []
