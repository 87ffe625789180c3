"""StoreDataset with DataLoader defaults: whole batches through batch_size=1, single transitions batched by
the DataLoader, fork workers next to an open writer, a new random stream every epoch."""

import gymnasium as gym
import pytest
import torch

import mmreplay
from mmreplay.integrations.gymnasium import create_store_for
from mmreplay.integrations.torch_data import StoreDataset
from mmreplay.sampling.batch import Batch
from conftest import record_random_steps


@pytest.fixture
def cartpole_store(store_path):
    """A committed CartPole store, still open for writing (what a training process holds)."""
    env = gym.make("CartPole-v1")
    store = create_store_for(env, store_path, capacity=10_000, durable=False)
    record_random_steps(env, store, 1500)
    store.flush()
    yield store
    store.close()


def _same_as_store(path, indices, obs, action):
    with mmreplay.Store.open(path, mode="r") as s:
        again = s.inspect.get(indices)
        return bool((again.obs == obs).all()) and bool((again.action == action).all())


def test_default_dataloader_passes_whole_batches_through_fork_workers(cartpole_store, store_path):
    ds = StoreDataset(store_path, 32, num_batches=6, seed=3)
    loader = torch.utils.data.DataLoader(ds, num_workers=2, multiprocessing_context="fork")  # batch_size=1
    batches = list(loader)
    assert len(batches) == 6 and all(isinstance(b, Batch) for b in batches)
    assert batches[0].obs.shape == (32, 4) and batches[0].action.shape == (32,)
    assert len({tuple(b.indices.tolist()) for b in batches}) == 6  # the two workers draw different streams
    assert _same_as_store(store_path, batches[1].indices, batches[1].obs, batches[1].action)


def test_grouping_whole_batches_says_what_to_pass(cartpole_store, store_path):
    loader = torch.utils.data.DataLoader(StoreDataset(store_path, 32, num_batches=4), batch_size=4)
    with pytest.raises(TypeError, match=r"batch_size at 1 or None.*StoreDataset\(path\)"):
        next(iter(loader))


def test_single_transitions_are_batched_by_the_dataloader(cartpole_store, store_path):
    ds = StoreDataset(store_path, num_samples=64, seed=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context="fork")
    batches = list(loader)
    assert len(batches) == 4
    b = batches[0]
    assert set(b) >= {"obs", "action", "reward", "next_obs", "terminated", "truncated", "indices"}
    assert b["obs"].shape == (16, 4) and b["reward"].shape == (16,) and b["terminated"].dtype == torch.bool
    assert _same_as_store(store_path, b["indices"], b["obs"], b["action"])
    with pytest.raises(ValueError, match="num_samples"):
        StoreDataset(store_path, num_batches=3)


def _epoch(loader):
    return [tuple(b.indices.tolist()) for b in loader]


def test_a_fixed_seed_draws_new_batches_every_epoch(cartpole_store, store_path):
    ds = StoreDataset(store_path, 8, num_batches=3, seed=1)
    loader = torch.utils.data.DataLoader(ds, batch_size=None)
    first, second = _epoch(loader), _epoch(loader)
    assert first != second  # main process: the iteration count keys the stream
    ds.set_epoch(4)
    a = _epoch(loader)
    again = StoreDataset(store_path, 8, num_batches=3, seed=1)
    again.set_epoch(4)
    assert _epoch(torch.utils.data.DataLoader(again, batch_size=None)) == a  # same seed and epoch: same batches
    ds.set_epoch(5)
    assert _epoch(loader) != a

    # workers: each epoch gets new workers and a new base seed from torch's RNG
    workers = torch.utils.data.DataLoader(StoreDataset(store_path, 8, num_batches=4, seed=1), num_workers=2,
                                          multiprocessing_context="fork")
    torch.manual_seed(0)
    e1, e2 = _epoch(workers), _epoch(workers)
    torch.manual_seed(0)
    assert e1 != e2 and _epoch(workers) == e1  # seeding torch repeats the run
    persistent = torch.utils.data.DataLoader(StoreDataset(store_path, 8, num_batches=4, seed=1), num_workers=2,
                                             multiprocessing_context="fork", persistent_workers=True)
    assert _epoch(persistent) != _epoch(persistent)  # the same workers count their epochs
