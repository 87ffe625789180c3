"""Exports and TorchRL samplers against a writer that overwrites what they read (issue 40 item 8), TorchRL's
``storage[:]`` (issue 41 item 6), ``readable_range`` and the d3rlpy install line (issue 41 item 8).

The writer's overwrite is made to land exactly between the reader's listing/draw and its read (a hook
in the read path writes a ring's worth of transitions first), so the race happens in every run, by
construction. On 31f9547's parent: the exports raised a raw ``IndexError`` and exported nothing, the
TorchRL samplers raised ``IndexError``, ``storage[:]`` had no actions or rewards, ``readable_range`` did
not exist and ``get``'s refusal quoted the range it refused, and the documented d3rlpy line did not name
the packages ``import d3rlpy.dataset`` needs.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay.datasets import export_dataset, import_dataset
from mmreplay.store import StoreInspector
from tests.test_datasets import build_store, make_episodes, minari_root, store_episodes  # noqa: F401

h5py = pytest.importorskip("h5py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def overwrite(store, n: int, rng, stream: int = 99) -> None:
    """A writer's burst: ``n`` fresh transitions of one long episode on its own stream."""
    obs = rng.standard_normal((n + 1, 4)).astype(np.float32)
    store.extend(obs[:-1], rng.uniform(-1, 1, (n, 2)).astype(np.float32), np.zeros(n, np.float32), obs[1:],
                 np.zeros(n, bool), np.zeros(n, bool), streams=np.full(n, stream))


def is_subsequence(got, truth) -> bool:
    """Each of ``got`` equals an episode of ``truth``, in order (episodes compared bit for bit)."""
    it = iter(truth)
    for g in got:
        for t in it:
            if len(t["rewards"]) == len(g["rewards"]) and np.array_equal(t["obs"], g["obs"]) and \
                    np.array_equal(t["actions"], g["actions"]) and np.array_equal(t["rewards"], g["rewards"]) and \
                    np.array_equal(t["term"], g["term"]) and np.array_equal(t["trunc"], g["trunc"]):
                break
        else:
            return False
    return True


@pytest.mark.parametrize("fmt", ["d4rl", "d3rlpy", "minari"])
def test_an_export_racing_a_writer_exports_whole_surviving_episodes_and_says_what_it_skipped(
        tmp_path, minari_root, fmt):  # noqa: F811
    if fmt == "minari":
        pytest.importorskip("minari")
    rng = np.random.default_rng(11)
    eps = make_episodes("lowdim", rng, 14, max_len=25)
    started, store = build_store(str(tmp_path / "live.mmr"), "lowdim", eps, n_streams=2, capacity=256, rng=rng)
    out = tmp_path / ("ds" if fmt == "minari" else "ds.h5")
    bursts = []

    def writer_runs(done, total):  # after the first block is read, the writer wraps the listed steps
        if not bursts:
            bursts.append(done)
            overwrite(store, 200, rng)
    with store:
        assert store.inspect.valid_range()[0] == 0
        summary = export_dataset(store, out, fmt, block_rows=16, progress=writer_runs)
    assert bursts, "the writer ran during the export"
    lost = len(started) - summary["episodes"]
    assert lost > 0 and summary["episodes"] > 0, summary
    assert any(f"skipped {lost} of the {len(started)} listed episode(s): a writer overwrote" in n
               for n in summary["notes"]), summary["notes"]
    if fmt == "minari":
        meta = json.loads(json.load(open(out / "data" / "metadata.json"))["mmreplay"])
    else:
        with h5py.File(out, "r") as f:
            meta = json.loads(f.attrs["mmreplay"])
    assert meta["skipped_overwritten_episodes"] == lost and meta["episodes"] == summary["episodes"]
    import_dataset(out, tmp_path / "back.mmr", fmt)
    with mmreplay.Store.open(tmp_path / "back.mmr", mode="r") as back:
        got = store_episodes(back)
    assert len(got) == summary["episodes"] and sum(len(g["rewards"]) for g in got) == summary["steps"]
    assert is_subsequence(got, started), "an exported episode is not a whole recorded one"


# -- TorchRL -------------------------------------------------------------------------------------------------

torchrl = pytest.importorskip("torchrl")
import torch  # noqa: E402
from torchrl.data import TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import SliceSampler  # noqa: E402

from mmreplay.integrations.torchrl import (  # noqa: E402
    MMReplayPrioritizedSampler,
    MMReplayRandomSampler,
    MMReplaySliceSampler,
    MMReplayStorage,
)


def lowdim_storage(path, capacity=300, n=280, seed=0):
    store = mmreplay.Store.create(path, spaces.Box(-np.inf, np.inf, (4,), np.float32),
                                  spaces.Box(-1, 1, (2,), np.float32), capacity=capacity, durable=False)
    overwrite(store, n, np.random.default_rng(seed), stream=0)
    return MMReplayStorage(store)


@pytest.mark.parametrize("make_sampler, batch", [
    (lambda: MMReplayRandomSampler(seed=1), 32),
    (lambda: MMReplayPrioritizedSampler(seed=1), 32),
    (lambda: MMReplaySliceSampler(slice_len=8, seed=1), 32),
])
def test_native_samplers_draw_again_when_a_writer_overwrote_the_draw(tmp_path, monkeypatch, make_sampler, batch):
    storage = lowdim_storage(str(tmp_path / "rb.mmr"))
    rb = TensorDictReplayBuffer(storage=storage, sampler=make_sampler(), batch_size=batch)
    real_get = StoreInspector.get
    races = []

    def get_after_a_writer(self, indices, **kwargs):  # the writer commits a ring's worth first, once
        if not races:
            races.append(np.asarray(indices).copy())
            overwrite(storage.store, 300, np.random.default_rng(7), stream=0)
        return real_get(self, indices, **kwargs)
    monkeypatch.setattr(StoreInspector, "get", get_after_a_writer)
    try:
        sample = rb.sample()
        assert races and races[0].min() < storage.store.inspect.valid_range()[0], "the drawn ids were overwritten"
        monkeypatch.setattr(StoreInspector, "get", real_get)
        again = storage[sample["index"]]  # info["index"] names the rows returned, after the redraw
        for key in ("observation", "action", ("next", "observation"), ("next", "reward")):
            assert torch.equal(sample[key], again[key]), key
    finally:
        storage.close()


def test_storage_colon_returns_every_key_as_a_range_does_and_samplers_still_get_the_index_view(tmp_path):
    storage = lowdim_storage(str(tmp_path / "rb.mmr"), n=60)
    try:
        n = len(storage)
        everything, ranged = storage[:], storage[0:n]
        assert set(everything.keys(include_nested=True)) == set(ranged.keys(include_nested=True))
        for key in ranged.keys(include_nested=True, leaves_only=True):
            assert torch.equal(everything[key], ranged[key]), key
        assert "action" in everything.keys() and ("next", "reward") in everything.keys(include_nested=True)
        view = storage.index_view()  # what TorchRL's SliceSampler reads, without a frame
        assert "observation" not in view.keys() and "episode" in view.keys()
        rb = TensorDictReplayBuffer(storage=storage, sampler=SliceSampler(num_slices=2, traj_key="episode"),
                                    batch_size=8)
        assert rb.sample()["observation"].shape == (8, 4)
    finally:
        storage.close()


# -- readable_range ------------------------------------------------------------------------------------------

def interleaved_store(path, seed):
    """Three streams interleaved, frame_stack 4, a ring that cut episodes: ids near ``oldest`` whose
    stacks reach overwritten frames."""
    rng = np.random.default_rng(seed)
    s = mmreplay.Store.create(path, spaces.Box(0, 255, (4,), np.uint8), spaces.Discrete(3), capacity=120,
                              frame_stack=4, durable=False)
    last = {}
    for _ in range(500):
        st = int(rng.integers(0, 3))
        o = last.get(st)
        o = rng.integers(0, 256, (4,), dtype=np.uint8) if o is None else o
        nx = rng.integers(0, 256, (4,), dtype=np.uint8)
        t = bool(rng.random() < 0.05)
        s.add(o, 0, 0.0, nx, t, False, stream=st)
        last[st] = None if t else nx
    return s


def test_readable_range_holds_only_ids_get_accepts_and_the_refusal_says_what_else_is_needed(tmp_path):
    with interleaved_store(str(tmp_path / "s.mmr"), 0) as s:
        oldest, head = s.inspect.valid_range()
        lo, head2 = s.inspect.readable_range()
        assert head2 == head and oldest < lo < head
        s.inspect.get(np.arange(lo, head))  # every one accepted
        with pytest.raises(IndexError) as refused:
            s.inspect.get(np.arange(oldest, head))
        message = str(refused.value)
        assert "frame stack of 4 reaches frames the ring overwrote" in message
        assert "readable_range()" in message
        storage = MMReplayStorage(s)
        assert len(storage) == head - lo
        storage[torch.arange(len(storage))]  # TorchRL's RandomSampler may draw any of them


# -- d3rlpy's install line ------------------------------------------------------------------------------------

#: what ``import d3rlpy.dataset`` (d3rlpy 2.8.1) needs besides mmreplay's own dependencies, found by
#: installing it with --no-deps into an empty target and adding each missing module (2026-12-07)
D3RLPY_NEEDS = ("d3rlpy", "gym", "structlog", "dataclasses-json", "marshmallow", "typing-inspect", "mypy-extensions",
                "scikit-learn", "scipy", "joblib", "threadpoolctl", "narwhals")


def test_the_documented_d3rlpy_install_line_names_what_d3rlpy_dataset_imports():
    text = open(os.path.join(ROOT, "docs", "datasets.md")).read()
    lines = re.findall(r"pip install --no-deps ([^`\n]+)", text)
    assert lines, "docs/datasets.md gives a pip install --no-deps line for d3rlpy"
    named = set(lines[0].split())
    assert set(D3RLPY_NEEDS) <= named, f"missing from the documented line: {set(D3RLPY_NEEDS) - named}"
