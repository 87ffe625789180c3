"""Stable-Baselines3: the on-disk buffer as a drop-in replay_buffer_class."""

import json
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

from mmreplay.integrations.sb3 import MMReplayBuffer  # noqa: E402

DQN_KW = dict(learning_rate=2.3e-3, batch_size=64, buffer_size=100_000, learning_starts=1000, gamma=0.99,
              target_update_interval=10, train_freq=256, gradient_steps=128, exploration_fraction=0.16,
              exploration_final_eps=0.04, policy_kwargs=dict(net_arch=[256, 256]), seed=0)


def test_dqn_learns_cartpole_and_a_second_process_resumes(tmp_path):
    path = str(tmp_path / "cartpole.mmr")
    env = gym.make("CartPole-v1")
    model = DQN("MlpPolicy", env, replay_buffer_class=MMReplayBuffer, replay_buffer_kwargs=dict(path=path),
                **DQN_KW)
    model.learn(total_timesteps=30_000)
    mean, _ = evaluate_policy(model, env, n_eval_episodes=10, deterministic=True)
    assert mean >= 150, f"DQN with the on-disk buffer reached only {mean}"
    recorded = model.num_timesteps  # SB3 collects in train_freq chunks: a little past total_timesteps
    assert model.replay_buffer.size() == recorded
    first = model.replay_buffer.store.get(np.arange(0, 500))
    model.replay_buffer.close()
    np.save(tmp_path / "first_obs.npy", first.obs.numpy())

    code = textwrap.dedent(f"""
        import json, numpy as np, gymnasium as gym
        from stable_baselines3 import DQN
        from mmreplay.integrations.sb3 import MMReplayBuffer
        kw = {json.dumps({k: v for k, v in DQN_KW.items() if k != 'policy_kwargs'})}
        model = DQN("MlpPolicy", gym.make("CartPole-v1"), replay_buffer_class=MMReplayBuffer,
                    replay_buffer_kwargs=dict(path={path!r}), policy_kwargs=dict(net_arch=[256, 256]), **kw)
        before = model.replay_buffer.size()
        same = bool(np.array_equal(model.replay_buffer.store.get(np.arange(0, 500)).obs.numpy(),
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
    assert store.num_frames == 80 + store.info()["episodes_started"]  # each frame once
    batch = store.get(np.arange(80))
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
    b = buf.store.get([9])
    assert bool(b.truncated[0]) and not bool(b.terminated[0])
    assert float(buf.sample(10).dones.max()) == 0.0  # truncation never zeroes the bootstrap
    buf.close()
