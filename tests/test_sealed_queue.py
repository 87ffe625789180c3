"""Full frame shards queue for the encoder child instead of each add waiting for the previous shard's
encoding (issue 24, item 7: TorchRL ``extend`` near ``LazyMemmapStorage``): adds go on while the child
has not answered, queued shards read back from RAM, and a commit still covers only shards on disk."""

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay.storage.format import encoder as encoder_module
from mmreplay.index import encoder_pipe

SHAPE = (32, 32)  # 1 KiB rows: image-sized, so the encoder child encodes them


def frame(i: int) -> np.ndarray:
    rng = np.random.default_rng(i)
    return (rng.integers(0, 4, SHAPE) + i % 200).astype(np.uint8)


def add_steps(store, lo: int, hi: int) -> None:
    """Steps ``lo..hi-1`` of one long episode: step ``t`` goes from frame ``t`` to frame ``t + 1``."""
    for t in range(lo, hi):
        store.add(frame(t), t % 4, float(t % 3 - 1), frame(t + 1), False, False)


def check_rows(store, n: int) -> None:
    ids = np.arange(*store.inspect.valid_range())
    assert ids.size == n
    batch = store.inspect.get(ids)
    for i, t in enumerate(ids.tolist()):
        np.testing.assert_array_equal(batch.obs[i].numpy(), frame(t), err_msg=f"obs of step {t}")
        np.testing.assert_array_equal(batch.next_obs[i].numpy(), frame(t + 1), err_msg=f"next_obs of step {t}")
    np.testing.assert_array_equal(batch.action.numpy(), ids % 4)
    np.testing.assert_array_equal(batch.reward.numpy(), ids % 3 - 1)


class HeldEncoder:
    """Wraps ``ShardEncoder.submit``: the child's answers are withheld (``ready()`` is False) until
    ``release()``; a wait on one (``result()``) before then is recorded, then let through."""

    def __init__(self, monkeypatch):
        self.released = False
        self.early_waits = 0
        self.jobs = 0
        real_submit = encoder_module.ShardEncoder.submit
        held = self

        class Held:
            def __init__(self, pending):
                self.pending = pending

            def ready(self):
                return held.released and self.pending.ready()

            def result(self):
                if not held.released:
                    held.early_waits += 1
                return self.pending.result()

        def submit(encoder, jobs, arrays, outputs=None):
            held.jobs += 1
            return Held(real_submit(encoder, jobs, arrays, outputs))

        monkeypatch.setattr(encoder_module.ShardEncoder, "submit", submit)

    def release(self):
        self.released = True


@pytest.fixture
def with_encoder(monkeypatch):
    monkeypatch.delenv("MMREPLAY_ENCODER", raising=False)


def test_adds_do_not_wait_for_the_encoder_and_queued_shards_read_back(store_path, with_encoder, monkeypatch):
    held = HeldEncoder(monkeypatch)
    n = 2300  # four and a half 512-frame shards
    with mmreplay.Store.create(store_path, spaces.Box(0, 255, SHAPE, np.uint8), spaces.Discrete(4), capacity=5000,
                               reward_values=(-1, 0, 1)) as s:
        frames = s._state.frames
        assert frames.sealed.pipe is not None and frames.shard_rows == 512
        add_steps(s, 0, n)
        # four full shards sealed, none waited for: the child holds the oldest, the rest are queued
        assert held.early_waits == 0
        assert len(frames.sealed.entries) == 4 and held.jobs == encoder_pipe.CHILD_JOBS
        check_rows(s, n)  # every queued shard (and the staging one) reads back from RAM
        held.release()
        s.flush()  # the commit waits for every sealed shard
        assert not frames.sealed.entries
    with mmreplay.Store.open(store_path, mode="r") as s:
        check_rows(s, n)
        assert s.verify() == []


def test_a_commit_while_shards_are_queued_covers_them_on_disk(store_path, with_encoder, monkeypatch):
    """The commit retires the queue (this process encodes what the child did not take): the committed
    store, opened by a reader before the writer closes, has every row."""
    held = HeldEncoder(monkeypatch)
    n = 1600
    s = mmreplay.Store.create(store_path, spaces.Box(0, 255, SHAPE, np.uint8), spaces.Discrete(4), capacity=5000,
                              reward_values=(-1, 0, 1))
    try:
        add_steps(s, 0, n)
        assert len(s._state.frames.sealed.entries) == 3
        held.release()
        s.flush()
        with mmreplay.Store.open(store_path, mode="r") as r:
            check_rows(r, n)
            assert r.verify() == []
        add_steps(s, n, n + 700)  # and the writer goes on past the commit
    finally:
        s.close()
    with mmreplay.Store.open(store_path, mode="r") as r:
        check_rows(r, n + 700)


def test_short_shared_memory_keeps_one_shard_sealed(store_path, with_encoder, monkeypatch):
    """Shared memory that would fall under half free: no more staging buffers, adds wait as before."""
    monkeypatch.setattr(encoder_pipe, "_shared_memory_to_spare", lambda nbytes, path="/dev/shm": False)
    n = 2300
    with mmreplay.Store.create(store_path, spaces.Box(0, 255, SHAPE, np.uint8), spaces.Discrete(4), capacity=5000,
                               reward_values=(-1, 0, 1)) as s:
        add_steps(s, 0, n)
        assert s._state.frames.sealed.max_sealed == 1 and len(s._state.frames.sealed.entries) <= 1
        check_rows(s, n)
    with mmreplay.Store.open(store_path, mode="r") as s:
        check_rows(s, n)


@pytest.mark.parametrize("held", [True, False])
def test_laps_of_the_ring_with_shards_queued(store_path, with_encoder, monkeypatch, held):
    """Two and a half laps of the frame ring while shards queue (the child's answers withheld, or not):
    the writer never enters a file whose previous lap is still queued, so every valid row reads back true,
    in the writer and after reopening."""
    encoder = HeldEncoder(monkeypatch)
    if not held:
        encoder.release()
    with mmreplay.Store.create(store_path, spaces.Box(0, 255, SHAPE, np.uint8), spaces.Discrete(4), capacity=1000,
                               reward_values=(-1, 0, 1)) as s:
        frames = s._state.frames
        n = int(frames.rows * 2.5)
        add_steps(s, 0, n // 2)
        if held:  # released answers may all be in by now: how many are queued then depends on timing
            assert len(frames.sealed.entries) > 1  # shards did queue
        add_steps(s, n // 2, n)
        oldest, head = s.inspect.valid_range()
        check_rows(s, head - oldest)
        encoder.release()
    with mmreplay.Store.open(store_path, mode="r") as s:
        oldest, head = s.inspect.valid_range()
        assert head == n
        check_rows(s, head - oldest)
        assert s.verify() == []
