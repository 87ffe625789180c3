"""Stable-Baselines3: the on-disk buffer as a drop-in replay_buffer_class."""

import json
import shutil
import subprocess
import sys
import textwrap

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

sb3 = pytest.importorskip("stable_baselines3")
from stable_baselines3 import DQN  # noqa: E402
from stable_baselines3.common.evaluation import evaluate_policy  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack  # noqa: E402

from mmreplay.integrations.sb3 import MMReplayBuffer, save_replay_buffer  # noqa: E402



pytestmark = pytest.mark.usefixtures("one_torch_thread")


DQN_KW = dict(learning_rate=2.3e-3, batch_size=64, buffer_size=100_000, learning_starts=1000, gamma=0.99,
              target_update_interval=10, train_freq=256, gradient_steps=128, exploration_fraction=0.16,
              exploration_final_eps=0.04, policy_kwargs=dict(net_arch=[256, 256]), seed=0)


def test_dqn_learns_cartpole_and_a_second_process_resumes(tmp_path):
    path = str(tmp_path / "cartpole.mmr")
    env = gym.make("CartPole-v1")
    model = DQN("MlpPolicy", env, replay_buffer_class=MMReplayBuffer, replay_buffer_kwargs=dict(path=path),
                **DQN_KW)
    model.learn(total_timesteps=10_000)
    mean, _ = evaluate_policy(model, env, n_eval_episodes=10, deterministic=True)
    if mean < 150:
        # DQN on CartPole dips now and then mid-training whatever its buffer (it depends on the seeded draws:
        # after 10k / 15k / 20k steps seed 0 scored 256 / 151 / 210 here, seed 1 152 / 44 / 128, seed 2
        # 102 / 103 / 150; a random policy ~22): train on before judging
        model.learn(total_timesteps=10_000, reset_num_timesteps=False)
        mean = max(mean, evaluate_policy(model, env, n_eval_episodes=10, deterministic=True)[0])
    assert mean >= 150, f"DQN with the on-disk buffer reached only {mean}"
    recorded = model.num_timesteps  # SB3 collects in train_freq chunks: a little past total_timesteps
    assert model.replay_buffer.size() == recorded
    first = model.replay_buffer.store.inspect.get(np.arange(0, 500))
    model.replay_buffer.close()
    np.save(tmp_path / "first_obs.npy", first.obs.numpy())

    code = textwrap.dedent(f"""
        import json, numpy as np, gymnasium as gym
        from stable_baselines3 import DQN
        from mmreplay.integrations.sb3 import MMReplayBuffer
        # what is checked here is the buffer going on from the first process's commit, not learning: a few
        # gradient steps per collection keep the 2,000 steps short
        kw = {json.dumps({**{k: v for k, v in DQN_KW.items() if k != 'policy_kwargs'}, 'gradient_steps': 4})}
        model = DQN("MlpPolicy", gym.make("CartPole-v1"), replay_buffer_class=MMReplayBuffer,
                    replay_buffer_kwargs=dict(path={path!r}), policy_kwargs=dict(net_arch=[256, 256]), **kw)
        before = model.replay_buffer.size()
        same = bool(np.array_equal(model.replay_buffer.store.inspect.get(np.arange(0, 500)).obs.numpy(),
                                   np.load({str(tmp_path / 'first_obs.npy')!r})))
        model.learn(total_timesteps=2_000)
        print(json.dumps(dict(before=before, after=model.replay_buffer.size(), same=same)))
        model.replay_buffer.close()
    """)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result["before"] == recorded and result["after"] >= recorded + 2_000 and result["same"]


class CounterFrames(gym.Env):
    """8x8 frames whose pixels hold the step number: stacks are easy to check."""
    observation_space = spaces.Box(0, 255, (8, 8, 1), np.uint8)
    action_space = spaces.Discrete(2)

    def __init__(self, length):
        self.length, self.t = length, 0

    def reset(self, seed=None, options=None):
        self.t = 0
        return np.full((8, 8, 1), 100, np.uint8), {}

    def step(self, action):
        self.t += 1
        obs = np.full((8, 8, 1), 100 + self.t, np.uint8)
        return obs, 1.0, self.t == self.length, False, {}


def test_vecframestack_stores_each_frame_once_and_rebuilds_stacks(tmp_path):
    venv = VecFrameStack(DummyVecEnv([lambda: CounterFrames(7), lambda: CounterFrames(11)]), n_stack=4)
    buf = MMReplayBuffer(10_000, venv.observation_space, venv.action_space, device="cpu", n_envs=2,
                         path=str(tmp_path / "stack.mmr"), frame_stack=4)
    obs = venv.reset()
    recorded = []
    for _ in range(40):
        actions = np.array([0, 1])
        next_obs, rewards, dones, infos = venv.step(actions)
        real_next = next_obs.copy()
        for i, done in enumerate(dones):  # what SB3's off-policy loop does before add()
            if done:
                real_next[i] = infos[i]["terminal_observation"]
        buf.add(obs, real_next, actions, rewards, dones, infos)
        recorded += [(obs[i].copy(), real_next[i].copy(), bool(dones[i])) for i in range(2)]
        obs = next_obs
    store = buf.store
    assert len(store) == 80
    assert store.inspect.num_frames == 80 + store.info()["episodes_started"]  # each frame once
    batch = store.inspect.get(np.arange(80))
    for g, (o, n, d) in enumerate(recorded):
        np.testing.assert_array_equal(buf._layout(batch.obs[g:g + 1])[0].numpy(), o, err_msg=f"obs {g}")
        np.testing.assert_array_equal(buf._layout(batch.next_obs[g:g + 1])[0].numpy(), n, err_msg=f"next {g}")
        assert bool(batch.terminated[g]) == d
    samples = buf.sample(16)
    assert samples.observations.shape == (16, 8, 8, 4) and samples.actions.shape == (16, 1)
    assert samples.dones.shape == (16, 1) and samples.rewards.dtype == sb3.common.buffers.th.float32
    buf.close()


def test_truncation_is_not_a_done_for_bootstrapping(tmp_path):
    space = spaces.Box(-1, 1, (2,), np.float32)
    buf = MMReplayBuffer(100, space, spaces.Discrete(2), device="cpu", path=str(tmp_path / "t.mmr"))
    o = np.zeros((1, 2), np.float32)
    for t in range(10):
        buf.add(o + t, o + t + 1, np.array([0]), np.array([1.0]), np.array([t == 9]),
                [{"TimeLimit.truncated": t == 9}])
    b = buf.store.inspect.get([9])
    assert bool(b.truncated[0]) and not bool(b.terminated[0])
    assert float(buf.sample(10).dones.max()) == 0.0  # truncation never zeroes the bootstrap
    buf.close()


# -- n-step, Dict observations, small buffers, save/resume, reset ----------------------------------------

from stable_baselines3 import SAC  # noqa: E402
from stable_baselines3.common.buffers import DictReplayBuffer, NStepReplayBuffer  # noqa: E402
from stable_baselines3.common.type_aliases import DictReplayBufferSamples  # noqa: E402


def _fill_both(mm, ref, steps=120, seed=0):
    """The same transitions into our buffer and SB3's: obs = [t, t] names the step (next_obs = [t+1, t+1]:
    a step continues its episode when its obs is the previous next_obs); episodes end by termination or
    truncation at random."""
    rng = np.random.default_rng(seed)
    t_in_ep = 0
    for t in range(steps):
        t_in_ep += 1
        end = rng.random() < 0.12
        term = end and rng.random() < 0.5
        trunc = end and not term
        args = (np.full((1, 2), t, np.float32), np.full((1, 2), t + 1, np.float32), np.array([t % 2]),
                np.array([float(rng.integers(-3, 4))]), np.array([end]), [{"TimeLimit.truncated": trunc}])
        mm.add(*args)
        ref.add(*args)


def test_nstep_samples_match_sb3_nstep_replay_buffer(tmp_path):
    space, act = spaces.Box(-1e6, 1e6, (2,), np.float32), spaces.Discrete(2)
    mm = MMReplayBuffer(1000, space, act, device="cpu", path=str(tmp_path / "n.mmr"), n_steps=3, gamma=0.9)
    ref = NStepReplayBuffer(1000, space, act, device="cpu", n_steps=3, gamma=0.9)
    _fill_both(mm, ref)
    s = mm.sample(64)
    assert s.discounts is not None and s.discounts.shape == (64, 1)
    t = s.observations[:, 0].long().numpy()
    want = ref._get_samples(t)  # n_envs=1: SB3's n-step windows for the same steps
    np.testing.assert_allclose(s.rewards.numpy(), want.rewards.numpy(), rtol=1e-6)
    np.testing.assert_allclose(s.discounts.numpy(), want.discounts.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(s.dones.numpy(), want.dones.numpy())
    np.testing.assert_array_equal(s.next_observations.numpy(), want.next_observations.numpy())
    assert len(set(s.discounts.flatten().tolist())) > 1  # windows cut short by episode ends were drawn
    mm.close()


def test_dqn_with_n_steps_3_trains_end_to_end(tmp_path):
    model = DQN("MlpPolicy", gym.make("CartPole-v1"), replay_buffer_class=MMReplayBuffer,
                replay_buffer_kwargs=dict(path=str(tmp_path / "n3.mmr"), n_steps=3, gamma=0.99),
                learning_starts=100, batch_size=32, train_freq=4, policy_kwargs=dict(net_arch=[32]), seed=0)
    model.learn(total_timesteps=400)
    assert model.replay_buffer.size() == model.num_timesteps
    assert model._n_updates > 0 and model.replay_buffer.sample(8).discounts is not None
    model.replay_buffer.close()


def test_sac_on_pendulum_trains_before_the_buffer_holds_a_batch(tmp_path):
    # SAC's defaults: batch 256, learning_starts 100 -> its first updates sample more than the buffer holds
    model = SAC("MlpPolicy", gym.make("Pendulum-v1"), replay_buffer_class=MMReplayBuffer,
                replay_buffer_kwargs=dict(path=str(tmp_path / "sac.mmr")), learning_starts=100,
                policy_kwargs=dict(net_arch=[32, 32]), seed=0)
    model.learn(total_timesteps=300)
    assert model.replay_buffer.size() == 300 and model._n_updates >= 150
    model.replay_buffer.close()


def test_batches_larger_than_the_buffer_draw_with_replacement(tmp_path):
    space = spaces.Box(-10, 10, (2,), np.float32)
    buf = MMReplayBuffer(100, space, spaces.Box(-1, 1, (1,), np.float32), device="cpu",
                         path=str(tmp_path / "few.mmr"))
    for t in range(10):
        buf.add(np.full((1, 2), t, np.float32), np.full((1, 2), t + 1, np.float32), np.array([[t / 10]]),
                np.array([float(t)]), np.array([False]), [{}])
    s = buf.sample(64)
    t = s.observations[:, 0].long().numpy()
    assert s.observations.shape == (64, 2) and set(t) == set(range(10))  # repeats, every transition reachable
    np.testing.assert_allclose(s.rewards[:, 0].numpy(), t)  # each row is one whole transition
    np.testing.assert_allclose(s.next_observations[:, 0].numpy(), t + 1)
    np.testing.assert_allclose(s.actions[:, 0].numpy(), t / 10, rtol=1e-6)
    buf.close()


class GoalEnv(gym.Env):
    """A Dict observation with a Box and a Discrete key (SB3 shapes the latter (1,))."""
    observation_space = spaces.Dict({"pos": spaces.Box(-5, 5, (2,), np.float32), "phase": spaces.Discrete(3)})
    action_space = spaces.Discrete(2)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def _obs(self):
        return {"pos": np.full(2, self.t / 10, np.float32), "phase": self.t % 3}

    def step(self, action):
        self.t += 1
        return self._obs(), float(action), self.t >= 20, False, {}


def test_dict_observations_with_multi_input_policy(tmp_path):
    model = DQN("MultiInputPolicy", GoalEnv(), replay_buffer_class=MMReplayBuffer,
                replay_buffer_kwargs=dict(path=str(tmp_path / "dict.mmr")), learning_starts=50, batch_size=16,
                train_freq=4, policy_kwargs=dict(net_arch=[16]), seed=0)
    model.learn(total_timesteps=200)
    buf = model.replay_buffer
    assert model._n_updates > 0 and buf.size() == 200
    assert sorted(c.name for c in buf.store.schema.observations) == ["phase", "pos"]  # one column per key
    ref = DictReplayBuffer(10, GoalEnv.observation_space, GoalEnv.action_space, device="cpu")
    obs = {"pos": np.zeros((1, 2), np.float32), "phase": np.array([1])}
    ref.add(obs, obs, np.array([0]), np.array([0.0]), np.array([False]), [{}])
    s, want = buf.sample(8), ref.sample(8)
    assert isinstance(s, DictReplayBufferSamples)
    for k in ("pos", "phase"):
        assert s.observations[k].shape == want.observations[k].shape
        assert s.next_observations[k].dtype == want.next_observations[k].dtype
    # the stored phase follows the stored position: pos = t/10 and phase = t % 3 for the same step t
    t = np.rint(s.observations["pos"][:, 0].numpy() * 10).astype(int)
    np.testing.assert_array_equal(s.observations["phase"][:, 0].numpy(), t % 3)
    buf.close()


SAVE_KW = dict(learning_starts=50, batch_size=16, train_freq=4, policy_kwargs=dict(net_arch=[16]), seed=0)


def test_save_and_load_replay_buffer_in_a_fresh_dqn_load(tmp_path):
    path = str(tmp_path / "run.mmr")
    env = gym.make("CartPole-v1")
    model = DQN("MlpPolicy", env, replay_buffer_class=MMReplayBuffer, replay_buffer_kwargs=dict(path=path),
                **SAVE_KW)
    model.learn(total_timesteps=300)
    model.save(tmp_path / "dqn")
    model.save_replay_buffer(tmp_path / "buffer")
    saved = (tmp_path / "buffer.pkl").read_bytes()
    assert len(saved) < 2000 and path.encode() in saved  # the store's path and settings, no transitions
    first = model.replay_buffer.store.inspect.get(np.arange(100)).obs.clone()

    again = DQN.load(tmp_path / "dqn", env=env)  # same process: adopts the open store (no writer-lock error)
    again.load_replay_buffer(tmp_path / "buffer")
    assert again.replay_buffer.store is model.replay_buffer.store
    assert again.replay_buffer.size() == 300
    again.learn(total_timesteps=100, reset_num_timesteps=False)
    assert again.replay_buffer.size() == 400
    assert bool((again.replay_buffer.store.inspect.get(np.arange(100)).obs == first).all())
    json_file = save_replay_buffer(again, tmp_path / "buffer_json")
    assert json.loads(open(json_file).read())["path"] == str(tmp_path / "run.mmr")
    model.replay_buffer.close()  # another buffer still uses the store: it stays open
    assert again.replay_buffer.size() == 400
    again.replay_buffer.close()

    # a fresh process: DQN.load + load_replay_buffer (pickle and JSON forms) continue the store; it ends
    # without close() and without knowing about commits, and a third process sees everything it added
    code = textwrap.dedent(f"""
        import json, gymnasium as gym
        from stable_baselines3 import DQN
        from mmreplay.integrations.sb3 import load_replay_buffer
        model = DQN.load({str(tmp_path / 'dqn')!r}, env=gym.make("CartPole-v1"))
        before = model.replay_buffer.size()
        model.load_replay_buffer({str(tmp_path / 'buffer')!r})
        load_replay_buffer(model, {str(tmp_path / 'buffer_json')!r})
        model.learn(total_timesteps=100, reset_num_timesteps=False)
        print(json.dumps(dict(before=before, after=model.replay_buffer.size())))
    """)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"before": 400, "after": 500}
    import mmreplay

    with mmreplay.Store.open(path, mode="r") as store:
        assert len(store) == 500
    shutil.rmtree(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        again.load_replay_buffer(tmp_path / "buffer")  # never an empty store in place of the saved one


def test_reset_empties_the_store_and_keeps_its_columns(tmp_path):
    space = spaces.Box(-1, 1, (2,), np.float32)
    path = str(tmp_path / "r.mmr")
    buf = MMReplayBuffer(100, space, spaces.Discrete(3), device="cpu", path=path, reward_values=(-1, 0, 1))
    o = np.zeros((1, 2), np.float32)
    for t in range(20):
        buf.add(o, o, np.array([1]), np.array([1.0]), np.array([False]), [{}])
    schema = buf.store.schema
    buf.reset()
    assert buf.size() == 0 and buf.store.schema == schema
    buf.add(o, o + 0.5, np.array([2]), np.array([-1.0]), np.array([True]), [{}])
    assert buf.size() == 1 and float(buf.sample(4).rewards.max()) == -1.0
    buf.close()
    import mmreplay

    with mmreplay.Store.open(path, mode="r") as store:
        assert len(store) == 1


def test_her_arguments_are_refused_with_the_reason(tmp_path):
    with pytest.raises(NotImplementedError, match="relabelling"):
        MMReplayBuffer(100, spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(2), device="cpu",
                       path=str(tmp_path / "her.mmr"), goal_selection_strategy="future")
