"""Prioritized replay: draw frequencies, importance weights, the ring's churn, persistence and crashes."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from gymnasium import spaces

import mmreplay
from mmreplay.storage.durability.commit import record_checksum
from mmreplay.index.sumtree import SumTree
from mmreplay.sampling.strategy import Prioritized
from reference import assert_batch_matches
from test_store_semantics import drive

LOWDIM = spaces.Box(-1, 1, (3,), np.float32)


def lowdim_store(path, n, capacity=None, **kw):
    """``n`` transitions of one stream in episodes of 10 steps; transition g's obs holds g."""
    store = mmreplay.Store.create(path, LOWDIM, spaces.Discrete(2), capacity=capacity, durable=False, **kw)
    g = np.arange(n)
    obs = np.repeat(g[:, None], 3, axis=1).astype(np.float32) / 1e6
    store.extend(obs, g % 2, g.astype(np.float32), obs + 5e-7, g % 10 == 9, np.zeros(n, bool),
                 streams=np.zeros(n, int))
    return store


def leaf(p, alpha, eps=1e-6):
    return (np.asarray(p, np.float64) + eps) ** alpha


def chi_square(counts, expected):
    return float(((counts - expected) ** 2 / expected).sum())


# -- the sum tree on its own -------------------------------------------------------------------------
@pytest.mark.parametrize("n,branching", [(1, 32), (31, 4), (1000, 32), (5000, 16)])
def test_sum_tree_finds_the_leaf_of_each_prefix_sum(n, branching):
    rng = np.random.default_rng(n)
    values = rng.random(n) * (rng.random(n) > 0.3)
    tree = SumTree(n, branching)
    tree.set_all(values)
    for _ in range(3):
        idx = rng.integers(0, n, 20)
        new = rng.random(20) * (rng.random(20) > 0.2)
        tree.update(idx, new)
        values[idx] = new  # numpy's fancy assignment also keeps the last of repeated indices
        assert tree.total == pytest.approx(values.sum(), rel=1e-12)
        positive = values[values > 0]
        assert tree.min_positive == (positive.min() if positive.size else np.inf)
        if tree.total > 0:
            u = rng.random(2000) * tree.total
            np.testing.assert_array_equal(tree.find(u), np.searchsorted(np.cumsum(values), u, side="right"))


# -- drawing -----------------------------------------------------------------------------------------
def test_draw_frequencies_match_priorities(store_path):
    """Chi-square over 60 transitions with a fixed seed; zero-priority transitions are never drawn."""
    store = lowdim_store(store_path, 60)
    alpha = 0.7
    smp = store.sampler(64, Prioritized(alpha=alpha, eps=0.0), seed=1)
    p = np.random.default_rng(0).uniform(0.1, 5.0, 60)
    p[[3, 17]] = 0.0
    assert smp.update_priorities(np.arange(60), p) == 60
    counts = np.zeros(60)
    for _ in range(600):
        np.add.at(counts, next(smp).indices.numpy(), 1)
    assert counts[[3, 17]].sum() == 0
    live = p > 0
    expected = leaf(p[live], alpha, 0) / leaf(p[live], alpha, 0).sum() * counts.sum()
    # df = 57: the 1e-6 upper quantile of chi2(57) is about 117
    assert chi_square(counts[live], expected) < 117
    uniform = np.full(live.sum(), counts.sum() / live.sum())
    assert chi_square(counts[live], uniform) > 1000  # the test can tell priorities from uniform
    store.close()


def test_weights_follow_the_formula(store_path):
    store = lowdim_store(store_path, 200, capacity=256)
    alpha, beta, eps = 0.6, 0.4, 1e-3
    smp = store.sampler(256, Prioritized(alpha=alpha, beta=beta, eps=eps), seed=2)
    p = np.random.default_rng(1).uniform(0.0, 3.0, 200)
    smp.update_priorities(np.arange(200), p)
    batch = next(smp)
    g = batch.indices.numpy()
    expected = (leaf(p[g], alpha, eps) / leaf(p, alpha, eps).min()) ** -beta
    np.testing.assert_allclose(batch.weights.numpy(), expected, rtol=1e-5)
    assert batch.weights.dtype == torch.float32 and float(batch.weights.max()) <= 1.0
    smp.beta = 1.0  # annealed
    batch = next(smp)
    g = batch.indices.numpy()
    np.testing.assert_allclose(batch.weights.numpy(), leaf(p, alpha, eps).min() / leaf(p[g], alpha, eps),
                               rtol=1e-5)
    store.close()


def test_stratified_draws_cover_equal_slices_of_the_mass(store_path):
    """With equal priorities, a batch as large as the store takes one draw from each slice: every id."""
    store = lowdim_store(store_path, 128)
    batch = store.sampler(128, Prioritized(), seed=3).sample()
    assert sorted(batch.indices.tolist()) == list(range(128))
    store.close()


def test_new_transitions_enter_at_the_max_priority_and_overwritten_ones_leave(store_path):
    store = lowdim_store(store_path, 100, capacity=128)
    smp = store.sampler(32, Prioritized(alpha=1.0, eps=0.0), seed=4)
    smp.update_priorities(np.arange(100), np.full(100, 0.5))
    smp.update_priorities([7], [9.0])
    obs = np.zeros((80, 3), np.float32)
    store.extend(obs, np.zeros(80, int), np.zeros(80, np.float32), obs, np.zeros(80, bool), np.zeros(80, bool),
                 streams=np.arange(80) + 1)
    prio = store.inspect.priorities()
    oldest, head = store.inspect.valid_range()
    assert (oldest, head) == (52, 180)
    batch = next(smp)
    assert int(batch.indices.min()) >= oldest
    slots = store.geometry.transitions.slot(np.arange(oldest, head))
    np.testing.assert_array_equal(prio.raw[slots[100 - oldest:]], 9.0)  # new ones: the max so far
    np.testing.assert_array_equal(prio.tree.leaves[slots[: 100 - oldest]], 0.5)
    assert prio.tree.total == pytest.approx(48 * 0.5 + 80 * 9.0)
    assert prio.total == pytest.approx(48 * 0.5 + 80 * 9.0) and prio.smallest == pytest.approx(0.5)
    # an id the ring gave up is skipped, one never added is an error
    assert smp.update_priorities([10, 60], [1.0, 1.0]) == 1
    with pytest.raises(IndexError, match=r"\[180\] were never added"):
        smp.update_priorities([180], [1.0])
    store.close()


def test_frame_stacks_and_ring_wrap_with_priorities(store_path):
    """Image stacks over interleaved streams with a wrapped ring: every batch is valid and exact."""
    rng = np.random.default_rng(8)
    store, ref = drive(store_path, rng, capacity=150, frame_stack=4, steps=240)
    valid = set(ref.valid_ids(store.inspect.valid_range()[0]))
    with store.sampler(64, Prioritized(), seed=5) as smp:
        for step in range(8):
            batch = next(smp)
            assert set(batch.indices.tolist()) <= valid
            assert_batch_matches(batch, ref, batch.indices.tolist())
            smp.update_priorities(batch.indices, torch.rand(64) * step)
    store.close()


def test_unbounded_store_grows_under_the_tree(store_path):
    store = lowdim_store(store_path, 50)
    smp = store.sampler(16, Prioritized(alpha=1.0, eps=0.0), seed=6)
    smp.update_priorities(np.arange(50), np.arange(50) + 1.0)
    rows = store.geometry.transitions.rows
    more = rows + 100
    obs = np.zeros((more, 3), np.float32)
    store.extend(obs, np.zeros(more, int), np.zeros(more, np.float32), obs, np.zeros(more, bool),
                 np.zeros(more, bool), streams=np.zeros(more, int))
    batch = next(smp)
    assert store.geometry.transitions.rows > rows
    prio = store.inspect.priorities()
    np.testing.assert_array_equal(prio.raw[:50], np.arange(50) + 1.0)
    assert prio.tree.total == pytest.approx(np.arange(1, 51).sum() + more * 50.0)
    assert int(batch.indices.max()) < 50 + more
    store.close()


# -- persistence -------------------------------------------------------------------------------------
def test_priorities_and_sequence_identical_after_reopen(store_path):
    rng = np.random.default_rng(9)
    store, _ = drive(store_path, rng, capacity=120, frame_stack=2, steps=150)
    smp = store.sampler(16, Prioritized(alpha=0.5), seed=7)
    for _ in range(5):
        batch = next(smp)
        smp.update_priorities(batch.indices, torch.rand(16) * 4)
    store.flush()
    expected = next(smp).indices.tolist()  # drawn after the commit
    prio = store.inspect.priorities()
    raw, leaves, max_p = prio.raw.copy(), prio.tree.leaves.copy(), prio.max_priority

    # a reader sees the committed priorities and RNG state: it draws the same next batch
    reader = mmreplay.Store.open(store_path, mode="r")
    rs = reader.sampler(16, Prioritized(alpha=0.5))
    assert next(rs).indices.tolist() == expected
    np.testing.assert_array_equal(reader.inspect.priorities().tree.leaves, leaves)
    oldest, head = reader.inspect.valid_range()
    rs.update_priorities(np.arange(oldest, head), np.ones(head - oldest))  # in the reader's RAM only
    reader.close()
    store.close()

    store = mmreplay.Store.open(store_path, durable=False)
    smp = store.sampler(16, Prioritized(alpha=0.5))
    prio = store.inspect.priorities()
    slots = store.geometry.transitions.slot(np.arange(oldest, head))
    np.testing.assert_array_equal(prio.raw[slots], raw[slots])
    np.testing.assert_array_equal(prio.tree.leaves, leaves)
    assert prio.max_priority == max_p
    store.close()


def test_zarr_reads_the_committed_priorities(store_path):
    import zarr

    store = lowdim_store(store_path, 40, capacity=64)
    smp = store.sampler(8, Prioritized(), seed=0)
    smp.update_priorities(np.arange(40), np.arange(40) / 10)
    store.flush()
    smp.update_priorities([0], [7.0])
    store.close()
    with open(os.path.join(store_path, "commit", "zarr.json")) as f:
        entry = json.load(f)["attributes"]["mmreplay_commit"]["priorities"]["default"]
    assert entry["head"] == 40 and entry["max_priority"] == pytest.approx(7.0)
    arr = zarr.open_group(store_path, mode="r")[f"priorities/default/{entry['buffer']}"]
    expected = (np.arange(40) / 10).astype(np.float32)
    expected[0] = 7.0
    np.testing.assert_array_equal(arr[:40], expected)


CRASH_CHILD = textwrap.dedent("""
    import os, signal, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    import mmreplay, mmreplay.storage.durability.commit
    from test_per import lowdim_store
    store = lowdim_store({path!r}, 300, capacity=256)
    smp = store.sampler(32, mmreplay.Prioritized(), seed=0)
    for step in range(3):  # three commits: both buffers have been written
        smp.update_priorities(np.arange(44, 300), np.random.default_rng(step).random(256) + step)
        store.flush()
    np.save({saved!r}, store.inspect.priorities().raw)
    smp.update_priorities(np.arange(44, 300), np.full(256, 99.0))
    obs = np.zeros((5, 3), np.float32)
    store.extend(obs, [0] * 5, [0.0] * 5, obs, [False] * 5, [False] * 5, streams=[1] * 5)
    def die(*a, **k):  # the new buffer is on disk, the commit record never gets written
        os.kill(os.getpid(), signal.SIGKILL)
    mmreplay.storage.durability.commit.write_commit = die
    store.flush()
""")


def test_a_crash_between_buffer_and_commit_reopens_the_last_commit(store_path, tmp_path):
    saved = str(tmp_path / "raw.npy")
    code = CRASH_CHILD.format(tests=os.path.dirname(__file__), path=store_path, saved=saved)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    store = mmreplay.Store.open(store_path, durable=False)
    assert store.inspect.valid_range() == (44, 300)
    raw = np.load(saved)
    prio = store.inspect.priorities()
    slots = store.geometry.transitions.slot(np.arange(44, 300))
    np.testing.assert_array_equal(prio.raw[slots], raw[slots])
    assert prio.max_priority == pytest.approx(float(raw.max()))
    store.close()


# -- bad input ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("indices,priorities,err,match", [
    ([1, 2], [1.0], ValueError, r"got 1 priorities for 2 indices"),
    ([1], [-1.0], ValueError, r"finite and >= 0, got \[-1.0\]"),
    ([1], [float("nan")], ValueError, r"finite and >= 0, got \[nan\]"),
    ([1.5], [1.0], TypeError, r"integer transition ids .* got dtype float64"),
    ([-1], [1.0], IndexError, r"\[-1\] were never added"),
])
def test_bad_priority_updates_change_nothing(store_path, indices, priorities, err, match):
    store = lowdim_store(store_path, 20)
    smp = store.sampler(4, Prioritized(), seed=0)
    before = store.inspect.priorities().raw.copy()
    with pytest.raises(err, match=match):
        smp.update_priorities(indices, priorities)
    np.testing.assert_array_equal(store.inspect.priorities().raw, before)
    store.close()


def test_bad_prioritized_sampler_arguments(store_path):
    store = lowdim_store(store_path, 20)
    with pytest.raises(ValueError, match=r"alpha must be a finite number >= 0, got -1"):
        store.sampler(4, Prioritized(alpha=-1))
    with pytest.raises(ValueError, match=r"beta must be a finite number >= 0, got nan"):
        store.sampler(4, Prioritized(beta=float("nan")))
    with pytest.raises(ValueError, match=r"sampler name .* got '../x'"):
        store.sampler(4, Prioritized(), name="../x")
    with pytest.raises(RuntimeError, match=r"this sampler draws Uniform\(\), not by priority"):
        store.sampler(4).update_priorities([0], [1.0])
    store.close()


def test_corrupt_priority_record_is_refused(store_path):
    store = lowdim_store(store_path, 20)
    store.sampler(4, Prioritized(), seed=0)
    store.close()
    path = os.path.join(store_path, "commit", "zarr.json")
    with open(path) as f:
        group = json.load(f)
    group["attributes"]["mmreplay_commit"]["priorities"]["default"]["buffer"] = 5
    with open(path, "w") as f:
        json.dump(group, f)
    with pytest.raises(mmreplay.CorruptDataError, match="checksum"):  # an edit without the checksum
        mmreplay.Store.open(store_path)
    group["attributes"]["mmreplay_commit_crc32c"] = record_checksum(group["attributes"]["mmreplay_commit"])
    with open(path, "w") as f:
        json.dump(group, f)
    with pytest.raises(mmreplay.FormatError, match="'priorities' must map names"):
        mmreplay.Store.open(store_path)


def test_verify_checks_the_committed_priorities(store_path):
    store = lowdim_store(store_path, 40, capacity=64)
    smp = store.sampler(8, Prioritized(), seed=0)
    smp.update_priorities(np.arange(40), np.arange(40) / 10)
    store.close()
    store = mmreplay.Store.open(store_path, mode="r")
    assert store.verify() == []
    with open(os.path.join(store_path, "commit", "zarr.json")) as f:
        buffer = json.load(f)["attributes"]["mmreplay_commit"]["priorities"]["default"]["buffer"]
    shard = os.path.join(store_path, "priorities", "default", str(buffer), "c", "0")
    with open(shard, "r+b") as f:
        f.seek(3)
        byte = f.read(1)
        f.seek(3)
        f.write(bytes([byte[0] ^ 0xFF]))
    problems = store.verify()
    assert problems and all("priorities/default" in p for p in problems)
    store.close()


def test_prefetching_prioritized_sampler_with_updates(store_path):
    store = lowdim_store(store_path, 300, capacity=256)
    oldest, head = store.inspect.valid_range()
    with store.sampler(16, Prioritized(), seed=1, prefetch=2) as smp:
        for _ in range(30):
            batch = next(smp)
            g = batch.indices.numpy()
            assert ((g >= oldest) & (g < head)).all() and batch.weights.max() <= 1.0
            smp.update_priorities(batch.indices, np.ones(16) * 3.0)
    assert store.inspect.priorities().max_priority == 3.0
    store.close()


def test_a_zero_priority_is_never_drawn_until_it_is_raised(store_path):
    store = lowdim_store(store_path, 16)
    smp = store.sampler(64, Prioritized(alpha=1.0, eps=0.0), seed=2)
    smp.update_priorities(np.arange(16), np.r_[np.zeros(8), np.ones(8)])
    assert next(smp).indices.min() >= 8
    smp.update_priorities([0], [100.0])  # back in the tree: it now holds most of the mass
    drawn = next(smp).indices.numpy()
    assert (drawn == 0).sum() > 32
    store.close()


def test_reader_loads_the_priorities_of_the_commit_it_refreshed_to(store_path):
    """(A review finding.) ``refresh`` must also move the committed priority entries forward: a sampler made
    after it loads the newer commit's priorities, not the ones the reader opened with."""
    writer = lowdim_store(store_path, 100, capacity=256)
    ws = writer.sampler(8, Prioritized(alpha=1.0, eps=0.0), seed=1)
    ws.update_priorities(np.arange(100), np.full(100, 0.5))
    writer.flush()
    reader = mmreplay.Store.open(store_path, mode="r")
    try:
        obs = np.ones((50, 3), np.float32) * 0.5
        writer.extend(obs, np.zeros(50, int), np.ones(50, np.float32), obs, np.zeros(50, bool),
                      np.zeros(50, bool), streams=np.ones(50, int))
        ws.update_priorities(np.arange(100, 150), np.full(50, 0.25))
        writer.flush()
        assert reader.refresh()
        reader.sampler(8, Prioritized(alpha=1.0, eps=0.0))
        oldest, head = reader.inspect.valid_range()
        assert (oldest, head) == (0, 150)
        slots = reader.geometry.transitions.slot(np.arange(oldest, head))
        np.testing.assert_array_equal(reader.inspect.priorities().raw[slots], writer.inspect.priorities().raw[slots])
    finally:
        reader.close()
        writer.close()


def test_exponents_are_committed_and_kept_on_reopen(store_path):
    store = lowdim_store(store_path, 30)
    store.sampler(4, Prioritized(alpha=0.3, eps=0.01), seed=0)
    store.close()
    store = mmreplay.Store.open(store_path)
    smp = store.sampler(4, Prioritized(), seed=0)  # no exponents given: the committed ones
    assert (smp.priorities.alpha, smp.priorities.eps) == (0.3, 0.01)
    store.inspect.priorities(alpha=0.5)  # given: changed
    assert store.inspect.priorities().alpha == 0.5
    store.close()
