"""gymnasium recorders (single and vector envs, both autoreset modes) and the torch Dataset."""

import gymnasium as gym
import numpy as np
import pytest
import torch

import mmreplay
from mmreplay.integrations.gymnasium import RecordToStore, RecordVectorToStore, create_store_for
from mmreplay.integrations.torch_data import StoreDataset
from conftest import record_random_steps
from reference import ReferenceReplay, assert_batch_matches


def test_record_single_env(store_path):
    env = gym.make("CartPole-v1")
    store = create_store_for(env, store_path, capacity=10_000, frame_stack=2)
    rec = RecordToStore(env, store)
    ref = ReferenceReplay(2, 10_000)
    obs, _ = rec.reset(seed=0)
    rng = np.random.default_rng(0)
    for _ in range(400):
        action = int(rng.integers(2))
        nxt, r, term, trunc, _ = rec.step(action)
        ref.add(0, obs, action, r, nxt, term, trunc)
        obs = nxt
        if term or trunc:
            obs, _ = rec.reset()
    ids = ref.valid_ids()
    assert len(store) == len(ids) == 400
    assert_batch_matches(store.inspect.get(ids), ref, ids)
    store.close()


@pytest.mark.parametrize("mode", [gym.vector.AutoresetMode.NEXT_STEP, gym.vector.AutoresetMode.SAME_STEP])
def test_record_vector_env_keeps_final_observations(store_path, mode):
    n = 3
    envs = gym.make_vec("CartPole-v1", num_envs=n, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": mode})
    store = create_store_for(envs, store_path, capacity=10_000)
    rec = RecordVectorToStore(envs, store)
    # the reference sees what really happened in each sub-env, taken from single envs stepped in lockstep
    singles = [gym.make("CartPole-v1") for _ in range(n)]
    ref = ReferenceReplay(1, 10_000)
    obs, _ = rec.reset(seed=[10, 11, 12])
    single_obs = [e.reset(seed=s)[0] for e, s in zip(singles, [10, 11, 12])]
    np.testing.assert_array_equal(np.stack(single_obs), obs)
    rng = np.random.default_rng(1)
    resetting = np.zeros(n, dtype=bool)
    order = []  # store ids are assigned in call order: (stream) per recorded row
    for _ in range(300):
        actions = rng.integers(0, 2, n)
        obs, _, term, trunc, _ = rec.step(actions)
        for i in range(n):
            if mode == gym.vector.AutoresetMode.NEXT_STEP and resetting[i]:
                single_obs[i] = singles[i].reset()[0]
                continue
            nxt, r, te, tr, _ = singles[i].step(int(actions[i]))
            ref.add(i, single_obs[i], int(actions[i]), r, nxt, te, tr)
            order.append(i)
            single_obs[i] = nxt
            if mode == gym.vector.AutoresetMode.SAME_STEP and (te or tr):
                single_obs[i] = singles[i].reset()[0]
        resetting = np.logical_or(term, trunc)
        for i in range(n):  # the vector env's observations are what the single envs show
            np.testing.assert_allclose(obs[i], single_obs[i])
    ids = ref.valid_ids()
    assert len(store) == len(ids)
    assert ref.transitions[-1]  # sanity
    assert_batch_matches(store.inspect.get(ids), ref, ids)
    assert any(t["terminated"] for t in ref.transitions)
    store.close()


def test_dataloader_workers_do_not_duplicate_batches(store_path):
    env = gym.make("CartPole-v1")
    with create_store_for(env, store_path, capacity=10_000) as store:
        record_random_steps(env, store, 2000)
    ds = StoreDataset(store_path, 32, num_batches=8, seed=5)
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2, multiprocessing_context="spawn")
    batches = list(loader)
    assert len(batches) == 8
    keys = {tuple(b.indices.tolist()) for b in batches}
    assert len(keys) == 8  # no two workers produced the same batch
    with mmreplay.Store.open(store_path, mode="r") as s:
        for b in batches[:2]:
            again = s.inspect.get(b.indices)
            assert bool((again.obs == b.obs).all()) and bool((again.action == b.action).all())
