"""TorchRL integration: MMReplayStorage under TorchRL's ReplayBuffer, with TorchRL's samplers and ours, a
collector and a DQN loss on CartPole, and dumps/loads mapped to the store's commit and reopen."""

import os

import numpy as np
import pytest
import torch

torchrl = pytest.importorskip("torchrl", reason="torchrl is not installed (pip install 'mmreplay[torchrl]')")

from gymnasium import spaces  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from torchrl.data import ReplayBuffer, TensorDictReplayBuffer  # noqa: E402
from torchrl.data.replay_buffers.samplers import RandomSampler, SliceSampler  # noqa: E402

from mmreplay.integrations.torchrl import (MMReplayPrioritizedSampler, MMReplayRandomSampler,  # noqa: E402
                                           MMReplaySliceSampler, MMReplayStorage)


def rollout(n_envs, steps, seed=0, obs_dim=3, first_traj=0):
    """Collector-shaped data of ``n_envs`` envs, env-major and flattened (what a TorchRL collector yields
    for a batched env after ``reshape(-1)``), with ``("collector", "traj_ids")``. Observation = (env, t,
    episode) so every row names itself; episodes end by termination or truncation at random."""
    rng = np.random.default_rng(seed)
    rows = []
    traj = first_traj
    for env in range(n_envs):
        t, ep_t = 0, 0
        for _ in range(steps):
            end = rng.random()
            term, trunc = end < 0.08, 0.08 <= end < 0.12
            obs = np.array([env, t, ep_t], np.float32)[:obs_dim]
            nxt = np.array([env, t + 1, ep_t + 1], np.float32)[:obs_dim]
            rows.append((obs, int(rng.integers(0, 2)), float(rng.normal()), nxt, term, trunc, traj))
            t += 1
            ep_t += 1
            if term or trunc:
                traj, ep_t, t = traj + 1, 0, t + 1000  # the next episode starts from a fresh observation
        traj += 1
    obs, act, rew, nxt, term, trunc, tid = map(np.array, zip(*rows, strict=True))
    n = len(rows)
    b = lambda x: torch.as_tensor(x).reshape(n, 1)  # noqa: E731
    return TensorDict({"observation": torch.as_tensor(obs), "action": torch.nn.functional.one_hot(
        torch.as_tensor(act), 2), "done": torch.zeros(n, 1, dtype=torch.bool),
        "collector": TensorDict({"traj_ids": torch.as_tensor(tid)}, [n]),
        "next": TensorDict({"observation": torch.as_tensor(nxt), "reward": b(rew.astype(np.float32)),
                            "terminated": b(term), "truncated": b(trunc), "done": b(term | trunc)}, [n])}, [n])


def assert_rows_equal(sample, data, positions, flags=True):
    keys = ["observation", "action", ("next", "observation"), ("next", "reward"), ("next", "terminated")]
    for key in keys + ([("next", "truncated"), ("next", "done")] if flags else []):
        torch.testing.assert_close(sample[key], data[key][positions.reshape(-1)], msg=f"{key}")


@pytest.fixture
def storage(tmp_path):
    s = MMReplayStorage(str(tmp_path / "rb.mmr"), 1000)
    yield s
    s.close()


def test_torchrl_random_and_native_samplers_return_what_was_extended(storage):
    data = rollout(1, 120)
    rb = TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=16)
    rb.extend(data)
    assert len(rb) == 120
    s = rb.sample()
    assert_rows_equal(s, data, s["index"])
    assert s["action"].shape == (16, 2) and s["next", "reward"].shape == (16, 1)
    rb2 = TensorDictReplayBuffer(storage=storage, sampler=MMReplayRandomSampler(seed=0), batch_size=16)
    s = rb2.sample()
    assert_rows_equal(s, data, s["index"])


def test_torchrl_slice_sampler_and_native_slices_follow_episodes(storage):
    """TorchRL's SliceSampler over one env (episodes contiguous); ours over four interleaved envs."""
    data = rollout(1, 150, seed=1)
    storage.store  # noqa: B018  (created lazily by the first extend)
    rb = TensorDictReplayBuffer(storage=storage, sampler=SliceSampler(num_slices=4, end_key=("next", "done"),
                                                                      strict_length=True), batch_size=24)
    rb.extend(data)
    s = rb.sample()
    # TorchRL's SliceSampler marks each slice's last step truncated (by design): compare the rest
    assert_rows_equal(s, data, s["index"], flags=False)
    stored = data["next", "truncated"][s["index"].reshape(-1)].reshape(4, 6)
    want = stored.clone()
    want[:, -1] = True
    assert torch.equal(s["next", "truncated"].reshape(4, 6), want)
    for sl in s["index"].reshape(4, 6):
        tid = data["collector", "traj_ids"][sl]
        assert (tid == tid[0]).all() and (torch.diff(sl) == 1).all()


def test_native_slices_over_interleaved_streams(tmp_path):
    """Two collector batches of 4 envs (env-major rows each): episodes that cross the batch boundary stay one
    episode in the store (one stream per live trajectory), and slices walk them."""
    full = rollout(4, 60, seed=2)
    t = torch.arange(60).repeat(4)
    order = torch.cat([torch.nonzero(t < 30).reshape(-1), torch.nonzero(t >= 30).reshape(-1)])
    data = full[order]  # rows in the order the store receives them
    storage = MMReplayStorage(str(tmp_path / "s.mmr"), None)
    try:
        rb = TensorDictReplayBuffer(storage=storage, sampler=MMReplaySliceSampler(slice_len=5, sample_from="steps",
                                                                                  seed=0), batch_size=40)
        rb.extend(data[:120])
        rb.extend(data[120:])
        prev, _, _ = storage.store.inspect.episode_links(0, 240)
        tid = data["collector", "traj_ids"].tolist()
        last = {}
        for g, traj in enumerate(tid):
            assert prev[g] == last.get(traj, -1), f"episode link of step {g} (trajectory {traj})"
            last[traj] = g
        s = rb.sample()
        assert_rows_equal(s, data, s["index"])
        for sl in s["index"].reshape(8, 5):
            tid = data["collector", "traj_ids"][sl]
            assert (tid == tid[0]).all(), "a slice mixed episodes"
            t = data["observation"][sl, 1]
            assert (torch.diff(t) == 1).all(), "a slice skipped or repeated a step"
        padded = MMReplaySliceSampler(slice_len=30, strict_length=False, seed=1)
        index, info = padded.sample(storage, 120)
        assert (~info["mask"]).any()  # some episodes are shorter than 30 steps
    finally:
        storage.close()


def test_prioritized_samplers_and_checkpoint_roundtrip(tmp_path):
    path, ckpt = str(tmp_path / "p.mmr"), str(tmp_path / "ckpt")
    data = rollout(2, 80, seed=3)
    storage = MMReplayStorage(path, 1000)
    rb = TensorDictReplayBuffer(storage=storage, sampler=MMReplayPrioritizedSampler(alpha=1.0, beta=0.5, seed=0),
                                batch_size=32)
    rb.extend(data)
    s = rb.sample()
    assert_rows_equal(s, data, s["index"])
    assert s["priority_weight"].shape == (32,)
    favoured = int(s["index"][0])
    prio = torch.zeros(len(storage))
    prio[favoured] = 5.0
    rb.update_priority(torch.arange(len(storage)), prio)
    assert set(rb.sample()["index"].tolist()) == {favoured}
    rb.dumps(ckpt)
    storage.close()

    storage2 = MMReplayStorage(path)
    rb2 = TensorDictReplayBuffer(storage=storage2, sampler=MMReplayPrioritizedSampler(alpha=1.0, beta=0.5),
                                 batch_size=32)
    rb2.loads(ckpt)
    try:
        assert len(rb2) == len(data)
        s = rb2.sample()
        assert set(s["index"].tolist()) == {favoured}  # the priorities were committed with the store
        assert_rows_equal(s, data, s["index"])
        with open(os.path.join(ckpt, "storage", "mmreplay_storage.json")) as f:
            assert '"head": 160' in f.read()
    finally:
        storage2.close()


def test_torchrl_prioritized_sampler_where_its_extension_loads(storage):
    from torchrl.data.replay_buffers.samplers import PrioritizedSampler

    try:
        sampler = PrioritizedSampler(1000, alpha=1.0, beta=0.5)
    except Exception as exc:  # its C++ sum tree did not load for this torch
        pytest.skip(f"TorchRL's PrioritizedSampler needs torchrl's C++ extension, which did not load: {exc}")
    data = rollout(1, 100, seed=4)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=16)
    rb.extend(data)
    s = rb.sample()
    assert_rows_equal(s, data, s["index"])
    rb.update_priority(torch.arange(100), torch.where(torch.arange(100) == 7, 10.0, 0.0))
    assert set(rb.sample()["index"].tolist()) == {7}


def test_plain_replay_buffer_and_bad_input(tmp_path):
    storage = MMReplayStorage(str(tmp_path / "b.mmr"), 100, observation_space=spaces.Box(-1, 1, (3,), np.float32),
                              action_space=spaces.Discrete(2), action_encoding="categorical")
    try:
        rb = ReplayBuffer(storage=storage, batch_size=8)
        rb.extend(rollout(1, 20, seed=5))
        s = rb.sample()
        assert s["action"].dtype == torch.int64 and s["action"].shape == (8,)
        with pytest.raises(KeyError, match="needs 'observation' and \\('next', 'observation'\\)"):
            rb.extend(TensorDict({"obs": torch.zeros(2, 3), "action": torch.zeros(2, dtype=torch.long)}, [2]))
        with pytest.raises(IndexError, match="index out of range"):
            storage.get(torch.tensor([25]))
    finally:
        storage.close()


def test_dqn_loss_on_a_cartpole_collector(tmp_path):
    """A TorchRL collector fills the store, a TorchRL DQN loss trains on its samples."""
    from tensordict.nn import TensorDictSequential
    from torchrl.envs import GymEnv
    from torchrl.modules import MLP, EGreedyModule, QValueActor
    from torchrl.objectives import DQNLoss, SoftUpdate
    try:
        from torchrl.collectors import SyncDataCollector as Collector  # TorchRL <= 0.13
    except ImportError:
        from torchrl.collectors import Collector

    torch.manual_seed(0)
    env = GymEnv("CartPole-v1")
    env.set_seed(0)
    actor = QValueActor(MLP(out_features=2, num_cells=[32]), in_keys=["observation"], spec=env.action_spec)
    policy = TensorDictSequential(actor, EGreedyModule(env.action_spec, eps_init=1.0, eps_end=1.0))
    storage = MMReplayStorage(str(tmp_path / "dqn.mmr"), 10_000)
    rb = TensorDictReplayBuffer(storage=storage, sampler=RandomSampler(), batch_size=32)
    loss_fn = DQNLoss(actor, action_space=env.action_spec, delay_value=True)
    loss_fn.make_value_estimator(gamma=0.99)
    updater = SoftUpdate(loss_fn, eps=0.95)
    optim = torch.optim.Adam(loss_fn.parameters(), 1e-3)
    collected = []
    try:
        for data in Collector(env, policy, frames_per_batch=64, total_frames=320):
            collected.append(data.reshape(-1).clone())
            rb.extend(data.reshape(-1))
            for _ in range(2):
                sample = rb.sample()
                loss = loss_fn(sample)["loss"]
                optim.zero_grad()
                loss.backward()
                optim.step()
                updater.step()
                assert torch.isfinite(loss)
        every = torch.cat(collected)
        assert len(storage) == every.shape[0] == 320
        assert_rows_equal(sample, every, sample["index"])
        # episodes in the store are the collector's trajectories
        prev, _, _ = storage.store.inspect.episode_links(0, 320)
        tid = every["collector", "traj_ids"]
        for g in range(1, 320):
            assert (prev[g] == g - 1) == bool(tid[g] == tid[g - 1]), g
    finally:
        storage.close()
