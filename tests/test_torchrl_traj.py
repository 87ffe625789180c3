"""TorchRL over MMReplayStorage (issue 24, item 7): ``("collector", "traj_ids")`` stored and read back as the
collector gave them, so TorchRL's own ``SliceSampler`` (traj_key, end_key, auto-detected) works unchanged;
spaces inferred from the first TensorDict (continuous actions, pixels) with errors that say what to give."""

import numpy as np
import pytest
import torch

pytest.importorskip("torchrl", reason="torchrl is not installed (pip install 'mmreplay[torchrl]')")

from gymnasium import spaces  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import SliceSampler  # noqa: E402

from mmreplay import Store  # noqa: E402
from mmreplay.integrations.torchrl import MMReplayStorage  # noqa: E402

TRAJ = ("collector", "traj_ids")


def collector_batches(n_envs, steps, batches, seed=0, continuous=False, obs_key="observation", first_traj=0):
    """What a TorchRL collector over ``n_envs`` envs yields, ``batches`` times ``steps`` steps, each batch
    flattened env-major (``data.reshape(-1)``). Trajectory ids are global, new at each reset; episodes end
    by termination or truncation. Observation = (env, global step, trajectory id): each row names itself."""
    rng = np.random.default_rng(seed)
    total = steps * batches
    traj = np.empty((n_envs, total), np.int64)
    term, trunc = np.zeros((n_envs, total), bool), np.zeros((n_envs, total), bool)
    next_id = first_traj
    current = list(range(next_id, next_id + n_envs))
    next_id += n_envs
    for t in range(total):
        for e in range(n_envs):
            traj[e, t] = current[e]
            end = rng.random()
            term[e, t], trunc[e, t] = end < 0.05, 0.05 <= end < 0.09
            if term[e, t] or trunc[e, t]:
                current[e], next_id = next_id, next_id + 1
    env = np.broadcast_to(np.arange(n_envs)[:, None], (n_envs, total))
    step = np.broadcast_to(np.arange(total)[None], (n_envs, total))
    obs = np.stack([env, step, traj], -1).astype(np.float32)
    nxt = np.stack([env, step + 1, traj], -1).astype(np.float32)
    if continuous:
        action = torch.as_tensor(rng.uniform(-1, 1, (n_envs, total, 2)).astype(np.float32))
    else:
        action = torch.nn.functional.one_hot(torch.as_tensor(rng.integers(0, 3, (n_envs, total))), 3)
    b = lambda x: torch.as_tensor(x).unsqueeze(-1)  # noqa: E731
    full = TensorDict({obs_key: torch.as_tensor(obs), "action": action,
                       "done": torch.zeros(n_envs, total, 1, dtype=torch.bool),
                       "collector": TensorDict({"traj_ids": torch.as_tensor(traj)}, [n_envs, total]),
                       "next": TensorDict({obs_key: torch.as_tensor(nxt),
                                           "reward": torch.as_tensor(rng.normal(size=(n_envs, total, 1)),
                                                                     dtype=torch.float32),
                                           "terminated": b(term), "truncated": b(trunc), "done": b(term | trunc)},
                                          [n_envs, total])}, [n_envs, total])
    return [full[:, i * steps:(i + 1) * steps].reshape(-1) for i in range(batches)]


def check_slices(sample, data, num_slices, obs_key="observation"):
    """Every slice: the collector's rows at the sampled indices (flags but TorchRL's own last-step truncation),
    one trajectory, consecutive steps of one env, and the trajectory ids the collector gave."""
    index = sample["index"].reshape(-1)
    for key in [obs_key, "action", ("next", obs_key), ("next", "reward"), ("next", "terminated"), TRAJ]:
        torch.testing.assert_close(sample[key], data[key][index], msg=str(key))
    for sl in sample["index"].reshape(num_slices, -1):
        rows = data[sl]
        assert (rows[TRAJ] == rows[TRAJ][0]).all(), f"slice {sl.tolist()} mixes trajectories"
        assert (rows[obs_key][:, 2] == rows[TRAJ]).all()
        assert (rows[obs_key][:, 0] == rows[obs_key][0, 0]).all(), "a slice mixes envs"
        assert (torch.diff(rows[obs_key][:, 1]) == 1).all(), "a slice skips or repeats a step"
        assert not rows["next", "done"][:-1].any(), "a slice runs past its episode's end"


@pytest.mark.parametrize("sampler_kw", [dict(traj_key=TRAJ), dict(), dict(end_key=("next", "done"))],
                         ids=["traj_key", "auto", "end_key"])
def test_torchrl_slice_sampler_unchanged_on_collector_batches(tmp_path, sampler_kw):
    """Four envs, three collector batches: trajectories continue across batches and end terminated or
    truncated. With traj_key (given or auto-detected) TorchRL slices within runs of one id; with end_key
    one env (TorchRL's contract: a trajectory's steps are contiguous)."""
    n_envs = 1 if "end_key" in sampler_kw else 4
    batches = collector_batches(n_envs, 60, 3, seed=len(sampler_kw))
    data = torch.cat(batches)
    storage = MMReplayStorage(str(tmp_path / "rb.mmr"), 10_000)
    try:
        rb = TensorDictReplayBuffer(storage=storage, sampler=SliceSampler(num_slices=8, **sampler_kw), batch_size=48)
        for b in batches:
            rb.extend(b)
        assert torch.equal(storage[:][TRAJ], data[TRAJ])  # what SliceSampler reads: the collector's ids
        for _ in range(20):
            check_slices(rb.sample(), data, 8)
    finally:
        storage.close()


def test_trajectory_ids_survive_reopen_and_rows_without_ids_get_fresh_ones(tmp_path):
    """Ids read back after reopening; rows written without ids (one stream) get one new id per episode,
    counted on from the largest id held, so TorchRL's SliceSampler still finds every episode."""
    path = str(tmp_path / "rb.mmr")
    first = collector_batches(2, 50, 1, seed=3)[0]
    storage = MMReplayStorage(path, 10_000)
    storage.set(0, first)
    storage.close()
    storage = MMReplayStorage(path)
    try:
        assert torch.equal(storage[:][TRAJ], first[TRAJ])
        assert torch.equal(storage.get(torch.arange(100))[TRAJ], first[TRAJ])
        more = collector_batches(1, 80, 1, seed=4)[0]
        del more["collector"]
        storage.set(0, more)
        ids = storage[:][TRAJ][100:]
        ended = more["next", "done"].reshape(-1)
        episode = torch.cumsum(ended.long(), 0) - ended.long()  # episode number of each row
        assert torch.equal(ids, int(first[TRAJ].max()) + 1 + episode)
        rb = TensorDictReplayBuffer(storage=storage, sampler=SliceSampler(num_slices=4, traj_key=TRAJ),
                                    batch_size=16)
        for _ in range(10):
            s = rb.sample()
            for sl in s["index"].reshape(4, -1):
                assert (storage[:][TRAJ][sl] == storage[:][TRAJ][sl[0]]).all()
                assert (storage.index_view()["episode"][sl] == storage.index_view()["episode"][sl[0]]).all()
    finally:
        storage.close()


def test_a_store_without_the_column_reads_its_episode_numbers_as_trajectory_ids(tmp_path):
    """A store made by Store.create (or before this column existed): episode numbers, a bijection."""
    store = Store.create(str(tmp_path / "old.mmr"), spaces.Box(-np.inf, np.inf, (3,), np.float32),
                         spaces.Discrete(3), 1000)
    data = collector_batches(1, 120, 1, seed=5)[0]
    storage = MMReplayStorage(store)
    try:
        storage.set(0, data)
        view = storage.index_view()
        assert torch.equal(view[TRAJ], view["episode"])
        _, first = np.unique(data[TRAJ].numpy(), return_index=True)
        assert len(np.unique(view[TRAJ].numpy())) == len(first)
        assert torch.equal(view[TRAJ][torch.as_tensor(first)], torch.arange(len(first)))  # one id per trajectory
        rb = TensorDictReplayBuffer(storage=storage, sampler=SliceSampler(num_slices=4, traj_key=TRAJ),
                                    batch_size=20)
        for _ in range(10):
            for sl in rb.sample()["index"].reshape(4, -1):
                assert (data[TRAJ][sl] == data[TRAJ][sl[0]]).all()
    finally:
        storage.close()


def test_spaces_inferred_from_continuous_actions_and_pixels(tmp_path):
    """Continuous actions need no action_space (LazyTensorStorage needs nothing either); a "pixels"
    observation is found without observation_key."""
    batches = collector_batches(2, 40, 2, seed=6, continuous=True, obs_key="pixels")
    data = torch.cat(batches)
    storage = MMReplayStorage(str(tmp_path / "c.mmr"), 1000)
    try:
        rb = TensorDictReplayBuffer(storage=storage, sampler=SliceSampler(num_slices=4, traj_key=TRAJ),
                                    batch_size=16)
        for b in batches:
            rb.extend(b)
        assert storage.store.action_space == spaces.Box(-np.inf, np.inf, (2,), np.float32)
        assert storage.store.observation_space.shape == (3,)
        for _ in range(10):
            check_slices(rb.sample(), data, 4, obs_key="pixels")
    finally:
        storage.close()


def test_ambiguous_inference_says_what_to_give(tmp_path):
    data = collector_batches(1, 20, 1, seed=7)[0]
    both = data.clone()
    both["pixels"] = both["observation"]
    both["next", "pixels"] = both["next", "observation"]
    with pytest.raises(ValueError, match=r"both of \('observation', 'pixels'\).*give observation_key="):
        MMReplayStorage(str(tmp_path / "a.mmr"), 100).set(0, both)
    categorical = data.clone()
    categorical["action"] = data["action"].argmax(-1)
    with pytest.raises(ValueError, match="cannot infer the action space from int64 actions.*give action_space="):
        MMReplayStorage(str(tmp_path / "b.mmr"), 100).set(0, categorical)
    storage = MMReplayStorage(str(tmp_path / "c.mmr"), 100, observation_key="pixels")
    both["action"] = both["action"].float()
    storage.set(0, both)  # the key given settles it
    assert storage.store.observation_space.shape == (3,)
    storage.close()


def test_extra_columns_are_written_from_and_read_back_under_their_key(tmp_path):
    """Extras given to Store.create come from the TensorDict key of the same name, next to the trajectory ids."""
    from mmreplay import ColumnSpec

    data = collector_batches(2, 30, 1, seed=8)[0]
    data["cost"] = torch.arange(60, dtype=torch.float32)
    storage = MMReplayStorage(str(tmp_path / "e.mmr"), 100, extras=[ColumnSpec.numeric("cost", (), "float32")])
    try:
        storage.set(0, data)
        back = storage.get(torch.arange(60))
        assert torch.equal(back["cost"], data["cost"]) and torch.equal(back[TRAJ], data[TRAJ])
    finally:
        storage.close()
