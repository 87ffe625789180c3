"""Processes around a store: fork (DataLoader and env workers), a crashed writer with live children, and
a small /dev/shm. A clear error or a working store; never a hang, a crash, or a store left locked."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from gymnasium import spaces

import mmreplay
import synthetic as syn
from conftest import encoder_children
from mmreplay.storage.format import encoder as encoder_module
from mmreplay._native import helpers

HERE = os.path.dirname(os.path.abspath(__file__))
ATARI = spaces.Box(0, 255, (84, 84), np.uint8)


def atari_store(path, n=600, **kw):
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (n + 1, 84, 84), dtype=np.uint8)
    s = mmreplay.Store.create(path, ATARI, spaces.Discrete(4), capacity=10_000, frame_stack=4,
                              reward_values=(-1, 0, 1), durable=False, **kw)
    for t in range(n):
        s.add(frames[t], t % 4, 0.0, frames[t + 1], False, False)
    return s, frames


def run_in_fork(fn, timeout=60.0) -> int:
    """``fn()`` in a forked child; its exit code (0: fn returned), or -1 if it hung past ``timeout``."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        except BaseException as exc:  # reported through the exit code; print for the test log
            print("child failed:", repr(exc), flush=True)
        os._exit(code)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return -1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # Python 3.12+ warns about fork with threads
def test_fork_after_decode_threads_ran(store_path):
    s, frames = atari_store(store_path)
    s.flush()
    big = s.inspect.get(np.arange(10, 300))  # stacks gathered with the codec helpers' threads
    assert torch.equal(big.next_obs[:, -1], torch.from_numpy(frames[11:301]))
    parent_helpers = helpers.codec_helpers()
    assert parent_helpers is not None and all(t.is_alive() for t in parent_helpers._threads)

    def child():
        with pytest.raises(mmreplay.StoreClosedError, match="forked"):
            s.sample(8)  # the parent's store: a clear error
        with mmreplay.Store.open(store_path, mode="r") as mine:  # a store opened here works, helpers and all
            batch = mine.inspect.get(np.arange(10, 300))
            # numpy, not torch, in the child: torch's own OpenMP threads are not fork-safe (its business)
            assert np.array_equal(batch.next_obs[:, -1].numpy(), frames[11:301])
            mine_helpers = helpers.codec_helpers()  # the child's own, running
            assert mine_helpers is not parent_helpers and all(t.is_alive() for t in mine_helpers._threads)

    assert run_in_fork(child) == 0
    s.add(frames[0], 0, 0.0, frames[1], False, False)  # the parent's store is untouched by the child
    s.close()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_dataloader_fork_workers_after_parent_sampled(store_path):
    from mmreplay.integrations.torch_data import StoreDataset

    s, frames = atari_store(store_path)
    s.close()
    with mmreplay.Store.open(store_path, mode="r") as parent:
        parent.inspect.get(np.arange(10, 300))  # the parent's decode threads run before the workers fork
        loader = torch.utils.data.DataLoader(StoreDataset(store_path, 256, num_batches=4, seed=0), batch_size=None,
                                             num_workers=2, multiprocessing_context="fork", timeout=60)
        batches = list(loader)
    assert len(batches) == 4
    for b in batches:
        want = torch.from_numpy(frames[b.indices.numpy() + 1])
        assert torch.equal(b.next_obs[:, -1], want)


WRITER_WITH_CHILD = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {here!r})
    import mmreplay, synthetic as syn
    s = mmreplay.Store.create({path!r}, syn.OBS_SPACE, syn.ACTION_SPACE, capacity=300, frame_stack=3,
                              reward_values=(-1, 0, 1))
    for g in range(50):
        s.add(*syn.transition(g))
    s.flush()
    child = os.fork()  # an env worker, say, that outlives its parent for a while
    if child == 0:
        # printed by the child: os.fork has returned here, so the fork hooks that drop the inherited lock
        # descriptor have run (printed by the parent, the SIGKILL could come before the child ran them)
        print(os.getpid(), flush=True)
        time.sleep(60)
        os._exit(0)
    time.sleep(60)
""")


def test_a_crashed_writer_with_live_children_leaves_no_lock(store_path):
    proc = subprocess.Popen([sys.executable, "-c", WRITER_WITH_CHILD.format(here=HERE, path=store_path)],
                            stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    try:
        with pytest.raises(RuntimeError, match="already open for writing"):
            mmreplay.Store.open(store_path)  # the writer lives: locked
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with mmreplay.Store.open(store_path) as s:  # the writer died; its child lives on: not locked
            assert s.inspect.valid_range() == (0, 50)
            s.add(*syn.transition(50))
    finally:
        os.kill(child, signal.SIGKILL)


def test_no_room_in_shared_memory_falls_back_to_a_thread(store_path, monkeypatch):
    def no_room(fd, offset, length):
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(encoder_module.os, "posix_fallocate", no_room)
    before = set(encoder_children())
    with pytest.warns(RuntimeWarning, match="shared memory"):
        s, frames = atari_store(store_path, n=1200)
    assert not set(encoder_children()) - before  # shards were encoded by a thread
    s.close()
    with mmreplay.Store.open(store_path, mode="r") as again:
        b = again.inspect.get(np.arange(3, 1200))
        assert torch.equal(b.next_obs[:, -1], torch.from_numpy(frames[4:1201]))


SMALL_SHM = textwrap.dedent("""
    import sys, warnings
    import numpy as np
    sys.path.insert(0, {here!r})
    from test_process_safety import atari_store
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s, frames = atari_store({path!r}, n=1200)
    s.close()
    import mmreplay
    with mmreplay.Store.open({path!r}, mode="r") as again:
        b = again.inspect.get(np.arange(3, 1200))
        assert (b.next_obs[:, -1].numpy() == frames[4:1201]).all()
    print("ok", any("shared memory" in str(w.message) for w in caught))
""")


def test_a_real_small_dev_shm(store_path):
    """A 2 MiB /dev/shm in a private mount namespace (root only; skipped elsewhere)."""
    script = SMALL_SHM.format(here=HERE, path=store_path)
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("cannot make a mount namespace here (not root?): the injected test covers the fallback")
    cmd = f"mount -t tmpfs -o size=2m tmpfs /dev/shm && exec {sys.executable} -c \"$0\""
    out = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd, script],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["ok", "True"]
