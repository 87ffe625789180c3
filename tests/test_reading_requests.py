"""The compiled pieces of a batch's run requests (``reading/requests.py``, ``reading/sources/compressed.py``): the
frame requests of a pair of stacks and where the compressed tier holds a batch's runs, each against the array
operations they replace, and the fast path of a store held whole in RAM against the frames written."""

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from conftest import wait_preloaded
from mmreplay._native import decode as native
from mmreplay.reading.requests import RunRequests
from mmreplay.reading.resident import EMPTY_CHUNK


def _reference_requests(obs_ids, next_ids, shifted, obs_addr, next_addr, nbytes):
    """What ``RunRequests.of_stacks`` built with array operations before the compiled pass."""
    n, k = obs_ids.shape
    next_req = np.concatenate([obs_ids[:, 1:], next_ids[:, -1:]], axis=1) if shifted else next_ids
    ids = np.concatenate([obs_ids.reshape(-1), next_req.reshape(-1)]).astype(np.int64)
    pos = np.arange(n * k, dtype=np.int64) * nbytes
    return ids, np.concatenate([obs_addr + pos, next_addr + pos])


@pytest.mark.parametrize("shifted", [True, False])
@pytest.mark.parametrize("k", [1, 3, 4])
def test_stack_frame_requests_equal_the_array_operations(shifted, k):
    rng = np.random.default_rng(k)
    obs = rng.integers(0, 10_000, (37, k)).astype(np.int64)
    nxt = obs + 1 if shifted else rng.integers(0, 10_000, (37, k)).astype(np.int64)
    if shifted:
        nxt[:, :-1] = -7  # only the last column of the next stack is read: a wrong read shows
    got = native.checked_stack_frame_requests(obs, nxt, shifted, 1 << 20, 1 << 30, 7056)
    want = _reference_requests(obs, nxt, shifted, 1 << 20, 1 << 30, 7056)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_of_stacks_refuses_mismatched_stacks():
    obs, words = np.zeros((4, 3), np.int64), np.zeros((12, 8), np.uint64)
    with pytest.raises(ValueError, match=r"obs int64\(4, 3\) and next int64\(4, 2\)"):
        RunRequests.of_stacks(obs, np.zeros((4, 2), np.int64), words, words, True, 64, 0, 8)


def test_locate_chunks_reads_the_tier_index():
    """Held chunks give their address and size; not held 0; empty ``EMPTY_CHUNK``; outside the index 0, 0;
    ``held`` counts only the addresses."""
    addr = np.array([4096, 0, EMPTY_CHUNK, 8192], np.int64)
    size = np.array([100, 0, 0, 200], np.int64)
    src, sizes, held = native.checked_locate_chunks(addr, size, np.array([3, 0, 1, 2, 9, 3], np.int64))
    assert src.tolist() == [8192, 4096, 0, EMPTY_CHUNK, 0, 8192]
    assert sizes.tolist() == [200, 100, 0, 0, 0, 200]
    assert held == 3
    with pytest.raises(ValueError, match="the index's two of one length"):
        native.checked_locate_chunks(addr, size[:2], np.array([3], np.int64))


def test_store_in_ram_decodes_runs_straight_and_exactly(store_path):
    """A temporal store whose runs the compressed tier holds whole samples through the fast path (every run
    located at once): the stacks equal the frames written, obs and next obs, and the tier counts every run."""
    rng = np.random.default_rng(0)
    frames = np.zeros((801, 84, 84), np.uint8)  # ~5.6 MB decoded, a few hundred KB coded: the tier holds them all
    for t in range(801):
        frames[t, t % 60:t % 60 + 12, 20:32] = rng.integers(0, 256, (12, 12), dtype=np.uint8)
    box = spaces.Box(0, 255, (84, 84), np.uint8)
    with mmreplay.Store.create(store_path, box, spaces.Discrete(2), capacity=800, frame_stack=4,
                               frame_codec="delta-zstd") as s:
        for t in range(800):
            s.add(frames[t], 0, 0.0, frames[t + 1], False, t == 799)
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=1 << 20) as s:
        wait_preloaded(s)
        stats = s.inspect.cache_stats()["obs"]["compressed"]
        assert stats["direct"] and stats["bytes"] > 0, stats  # decoded straight into the batch, from the tier
        smp = s.sampler(64, seed=3, prefetch=0)
        for _ in range(5):
            b = smp.sample()
            for i, g in enumerate(b.indices.tolist()):
                lo = max(0, g - 3)
                want = np.concatenate([np.repeat(frames[lo:lo + 1], 3 - (g - lo), axis=0), frames[lo:g + 1]])
                assert np.array_equal(b.obs[i].numpy(), want), g
                assert np.array_equal(b.next_obs[i].numpy()[-1], frames[g + 1]), g
        smp.close()
        assert s.inspect.cache_stats()["obs"]["compressed"]["hits"] > 0
