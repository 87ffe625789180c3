"""Stable-Baselines3 on colour frames: VecFrameStack stacks come back exactly as the policy saw them, every
combination that cannot be mapped is refused, and a saved model finds its store from any directory.

Frames carry their identity: every pixel of frame ``(env, episode, step, channel)`` is derived from it
and row 0 holds ``env, episode // 256, episode % 256, step`` in every channel, so each sampled stack is
checked, frame by frame and bit for bit, against what the env produced.
"""

import os

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.wrappers import TimeLimit

sb3 = pytest.importorskip("stable_baselines3")
from stable_baselines3 import DQN  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack, VecTransposeImage  # noqa: E402

import mmreplay  # noqa: E402
from mmreplay.integrations.sb3 import MMReplayBuffer  # noqa: E402

SIZE = 16
TIME_LIMIT = 6  # episodes longer than this are truncated by gymnasium's TimeLimit


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def episode_length(env_id: int, episode: int) -> int:
    return 1 + (env_id * 7 + episode * 5) % 9  # 1..9: shorter than a stack, and past the time limit


def frame(env_id: int, episode: int, step: int) -> np.ndarray:
    """The (3, SIZE, SIZE) channel-first frame of ``step`` of ``episode`` (never zero anywhere)."""
    ch = np.arange(3)[:, None, None]
    y, x = np.arange(SIZE)[None, :, None], np.arange(SIZE)[None, None, :]
    out = (env_id * 31 + episode * 7 + step * 13 + ch * 101 + y * 3 + x) % 251 + 1
    out[:, 0, :4] = [[env_id, episode // 256, episode % 256, step]] * 3
    out[:, 0, 4] = ch[:, 0, 0] + 1
    return out.astype(np.uint8)


def frame_id(first: np.ndarray) -> tuple[int, int, int] | None:
    """``(env, episode, step)`` of a channel-first frame, None for VecFrameStack's zero padding."""
    if not first.any():
        return None
    head = first[0, 0, :4].astype(int)
    return int(head[0]), int(head[1] * 256 + head[2]), int(head[3])


class IdFrames(gym.Env):
    """RGB frames that say which env, episode and step they are; reward = a function of the same."""

    action_space = spaces.Discrete(3)

    def __init__(self, env_id: int, channels_last: bool):
        self.env_id, self.channels_last = env_id, channels_last
        shape = (SIZE, SIZE, 3) if channels_last else (3, SIZE, SIZE)
        self.observation_space = spaces.Box(0, 255, shape, np.uint8)
        self.episode, self.t = -1, 0

    def _obs(self):
        f = frame(self.env_id, self.episode, self.t)
        return f.transpose(1, 2, 0).copy() if self.channels_last else f

    def reset(self, seed=None, options=None):
        self.episode, self.t = self.episode + 1, 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), reward_of(self.env_id, self.episode, self.t), \
            self.t == episode_length(self.env_id, self.episode), False, {}


def reward_of(env_id, episode, step):
    return float(env_id * 1000 + episode * 10 + step)


def make_venv(channels_last: bool, n_envs: int = 2, *, transpose: bool = False, channels_order=None):
    venv = DummyVecEnv([lambda i=i: TimeLimit(IdFrames(i, channels_last), TIME_LIMIT) for i in range(n_envs)])
    venv = VecFrameStack(venv, n_stack=3, channels_order=channels_order)
    return VecTransposeImage(venv) if transpose else venv


def to_frames(stack: np.ndarray, channels_first: bool) -> list[np.ndarray]:
    """A VecFrameStack stack of 3 RGB frames as its 3 channel-first frames, oldest first."""
    if not channels_first:
        stack = stack.transpose(2, 0, 1)
    return [stack[3 * j: 3 * j + 3] for j in range(3)]


def expected_stack(env_id, episode, step, channels_first: bool) -> np.ndarray:
    """What VecFrameStack(3) shows at ``step``: the episode's last 3 frames, zeros before its start."""
    frames = [frame(env_id, episode, s) if s >= 0 else np.zeros((3, SIZE, SIZE), np.uint8)
              for s in (step - 2, step - 1, step)]
    stack = np.concatenate(frames)
    return stack if channels_first else stack.transpose(1, 2, 0)


def check_stack(stack: np.ndarray, channels_first: bool, what: str) -> tuple[int, int, int]:
    """``stack`` is exactly the VecFrameStack stack of its newest frame; returns that frame's id."""
    newest = frame_id(to_frames(stack, channels_first)[-1])
    assert newest is not None, f"{what}: the newest frame is padding"
    np.testing.assert_array_equal(stack, expected_stack(*newest, channels_first), err_msg=what)
    return newest


def collect(venv, buffer, steps: int) -> dict:
    """SB3's off-policy collection (OffPolicyAlgorithm._store_transition): obs, next obs with the
    terminal observation of finished episodes, and ``add``. Returns what was added per (env, episode,
    step): the stacks, reward and flags."""
    added = {}
    obs = venv.reset()
    rng = np.random.default_rng(0)
    for _ in range(steps):
        actions = rng.integers(0, 3, venv.num_envs)
        new_obs, rewards, dones, infos = venv.step(actions)
        next_obs = new_obs.copy()
        for i, done in enumerate(dones):
            if done and infos[i].get("terminal_observation") is not None:
                next_obs[i] = infos[i]["terminal_observation"]
        buffer.add(obs, next_obs, actions, rewards, dones, infos)
        for i in range(venv.num_envs):
            key = frame_id(to_frames(obs[i], buffer.channels_first)[-1])
            truncated = bool(infos[i].get("TimeLimit.truncated", False))
            added[key] = (obs[i].copy(), next_obs[i].copy(), float(rewards[i]), bool(dones[i]) and not truncated,
                          int(actions[i]))
        obs = new_obs
    return added


def check_samples(buffer, added: dict, rows: int = 4096) -> int:
    """Every sampled row equals, bit for bit, the transition added with the same newest frame."""
    checked = 0
    while checked < rows:
        s = buffer.sample(1024)
        obs, next_obs = s.observations.numpy(), s.next_observations.numpy()
        for r in range(obs.shape[0]):
            key = frame_id(to_frames(obs[r], buffer.channels_first)[-1])
            o, n, reward, terminated, action = added[key]
            np.testing.assert_array_equal(obs[r], o, err_msg=f"obs of {key}")
            np.testing.assert_array_equal(next_obs[r], n, err_msg=f"next obs of {key}")
            assert float(s.rewards[r, 0]) == reward and bool(s.dones[r, 0]) == terminated
            assert int(s.actions[r, 0]) == action
        checked += obs.shape[0]
    return checked


LAYOUTS = {  # name: (env frames channel-last, VecTransposeImage, buffer keywords, buffer obs shape)
    "last": (True, False, dict(channels=3), (SIZE, SIZE, 9)),
    "last-inferred": (True, False, {}, (SIZE, SIZE, 9)),
    "first": (False, False, dict(channels=3), (9, SIZE, SIZE)),
    "last-transposed": (True, True, dict(channels=3), (9, SIZE, SIZE)),
    "first-order-given": (False, False, dict(channels=3, channels_order="first"), (9, SIZE, SIZE)),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_vecframestack_rgb_samples_equal_what_the_policy_saw(tmp_path, layout):
    channels_last, transpose, kwargs, shape = LAYOUTS[layout]
    venv = make_venv(channels_last, transpose=transpose)
    assert venv.observation_space.shape == shape
    buffer = MMReplayBuffer(10_000, venv.observation_space, venv.action_space, device="cpu", n_envs=2,
                            path=str(tmp_path / "rgb.mmr"), frame_stack=3, **kwargs)
    assert buffer.channels == 3 and buffer.channels_first == (shape[0] == 9)
    added = collect(venv, buffer, 300)
    store = buffer.store
    assert len(store) == 600 and store.inspect.num_frames == 600 + store.info()["episodes_started"]  # each frame once
    assert check_samples(buffer, added) >= 4096
    buffer.close()


def test_nstep_next_observations_are_the_stacks_after_the_window(tmp_path):
    venv = make_venv(True, transpose=True)
    buffer = MMReplayBuffer(10_000, venv.observation_space, venv.action_space, device="cpu", n_envs=2,
                            path=str(tmp_path / "rgb.mmr"), frame_stack=3, channels=3, n_steps=3, gamma=0.5)
    added = collect(venv, buffer, 200)
    last_step = {}  # (env, episode) -> its newest transition's step (the episode running at the end is cut)
    for env_id, ep, step in added:
        last_step[env_id, ep] = max(step, last_step.get((env_id, ep), 0))
    for _ in range(3):
        s = buffer.sample(1024)
        for r in range(1024):
            env_id, ep, step = check_stack(s.observations[r].numpy(), True, "obs")
            m = int(round(np.log(float(s.discounts[r, 0])) / np.log(0.5)))
            assert (env_id, ep, step + m) == check_stack(s.next_observations[r].numpy(), True, "next obs")
            assert m == min(3, episode_length(env_id, ep) - step, TIME_LIMIT - step, last_step[env_id, ep] - step + 1)
    buffer.close()


def test_dqn_learns_briefly_on_rgb_stacks_and_samples_exactly(tmp_path):
    """The real SB3 loop: DQN wraps the channel-last stacks in VecTransposeImage itself and trains."""
    venv = make_venv(True)
    model = DQN("MlpPolicy", venv, buffer_size=10_000, learning_starts=100, batch_size=32, train_freq=4,
                gradient_steps=1, policy_kwargs=dict(net_arch=[16]), seed=0, replay_buffer_class=MMReplayBuffer,
                replay_buffer_kwargs=dict(path=str(tmp_path / "dqn.mmr"), frame_stack=3, channels=3))
    model.learn(200)
    buffer = model.replay_buffer
    assert buffer.size() == model.num_timesteps and buffer.obs_shape == (9, SIZE, SIZE)
    s = buffer.sample(2048)
    for r in range(2048):
        env_id, ep, step = check_stack(s.observations[r].numpy(), True, "obs")
        assert (env_id, ep, step + 1) == check_stack(s.next_observations[r].numpy(), True, "next obs")
        assert float(s.rewards[r, 0]) == reward_of(env_id, ep, step + 1)
        assert bool(s.dones[r, 0]) == (step + 1 == episode_length(env_id, ep))  # truncation is no done
    buffer.close()


# -- refused at construction ------------------------------------------------------------------------

def box(shape):
    return spaces.Box(0, 255, shape, np.uint8)


@pytest.mark.parametrize("shape, kwargs, message", [
    ((SIZE, SIZE, 3), dict(frame_stack=3), "looks like one RGB frame.*frame_stack=1"),
    ((3, SIZE, SIZE), dict(frame_stack=3), "looks like one RGB frame.*frame_stack=1"),
    ((SIZE, SIZE, 9), dict(frame_stack=9), r"VecFrameStack\(n_stack=3\) of RGB frames: pass frame_stack=3, "
                                           "channels=3"),
    ((9, SIZE, SIZE), dict(frame_stack=9), "pass frame_stack=3, channels=3"),
    ((SIZE, SIZE, 6), dict(frame_stack=3), r"VecFrameStack\(n_stack=2\) of RGB frames"),
    ((SIZE, SIZE, 9), dict(frame_stack=3, channels=2), "must hold the stacked channels"),
    ((SIZE, SIZE, 9), dict(frame_stack=3, channels=3, channels_order="first"), "the first axis"),
    ((12, 12, 12), dict(frame_stack=4), "channels_order='first' or 'last'"),
    ((SIZE, SIZE, 3), dict(frame_stack=1, channels=3), "channels=3 with frame_stack=1"),
    ((SIZE, SIZE, 9), dict(frame_stack=3, channels=0), "positive integer"),
    ((SIZE, SIZE, 9), dict(frame_stack=3, channels_order="middle"), "channels_order must be"),
])
def test_unmappable_combinations_are_refused_at_construction(tmp_path, shape, kwargs, message):
    with pytest.raises(ValueError, match=message):
        MMReplayBuffer(100, box(shape), spaces.Discrete(3), device="cpu", path=str(tmp_path / "x.mmr"), **kwargs)
    assert not os.path.exists(tmp_path / "x.mmr")


def test_grey_stacks_keep_working_and_three_grey_frames_are_said_explicitly(tmp_path):
    for shape in [(84, 84, 4), (4, 84, 84)]:  # the Atari recipe: inferred, one channel per frame
        b = MMReplayBuffer(100, box(shape), spaces.Discrete(3), device="cpu", path=str(tmp_path / f"{shape[0]}.mmr"),
                           frame_stack=4)
        assert (b.channels, b.channels_first) == (1, shape[0] == 4)
        assert b.store.observation_space.shape == (84, 84)
        b.close()
    b = MMReplayBuffer(100, box((SIZE, SIZE, 3)), spaces.Discrete(3), device="cpu", path=str(tmp_path / "g.mmr"),
                       frame_stack=3, channels=1)
    assert b.store.observation_space.shape == (SIZE, SIZE)
    b.close()


def test_a_store_padded_with_first_frames_is_refused(tmp_path):
    path = str(tmp_path / "first.mmr")
    mmreplay.Store.create(path, box((3, SIZE, SIZE)), spaces.Discrete(3), capacity=100, frame_stack=3,
                          stack_padding="first").close()
    with pytest.raises(ValueError, match="pads stacks with 'first'"):
        MMReplayBuffer(100, box((9, SIZE, SIZE)), spaces.Discrete(3), device="cpu", path=path, frame_stack=3,
                       channels=3)


# -- refused at add: stacks the store would not rebuild exactly --------------------------------------

def test_a_wrong_explicit_channel_count_is_refused_at_the_first_add_and_nothing_is_stored(tmp_path):
    # VecFrameStack(3) of RGB declared as 9 grey frames: the reset stack's older "frames" are not zero
    venv = make_venv(True)
    buffer = MMReplayBuffer(1000, venv.observation_space, venv.action_space, device="cpu", n_envs=2,
                            path=str(tmp_path / "grey9.mmr"), frame_stack=9, channels=1)
    with pytest.raises(ValueError, match="older frames are not all zero.*frame_stack=n, channels=c"):
        collect(venv, buffer, 1)
    assert buffer.store.num_added == 0
    buffer.close()
    # one RGB frame (no VecFrameStack) declared as 3 grey frames
    plain = DummyVecEnv([lambda: IdFrames(0, True)])
    buffer = MMReplayBuffer(1000, plain.observation_space, plain.action_space, device="cpu",
                            path=str(tmp_path / "grey3.mmr"), frame_stack=3, channels=1)
    obs = plain.reset()
    new_obs, rewards, dones, infos = plain.step(np.array([0]))
    with pytest.raises(ValueError, match="sub-env 0 starts an episode"):
        buffer.add(obs, new_obs, np.array([0]), rewards, dones, infos)
    assert buffer.store.num_added == 0
    buffer.close()


def test_next_stacks_that_are_not_one_frame_on_are_refused(tmp_path):
    venv = make_venv(False, n_envs=1)
    buffer = MMReplayBuffer(1000, venv.observation_space, venv.action_space, device="cpu",
                            path=str(tmp_path / "skip.mmr"), frame_stack=3, channels=3)
    obs = venv.reset()
    skipped = np.concatenate([obs[:, 6:]] * 3, axis=1)  # (f0, f0, f0) after (0, 0, f0): padding lost
    with pytest.raises(ValueError, match="not one frame apart"):
        buffer.add(obs, skipped, np.array([0]), np.array([0.0]), np.array([False]), [{}])
    assert buffer.store.num_added == 0
    buffer.close()


@pytest.mark.parametrize("how", ["reopened", "adopted"])
def test_a_second_buffer_continues_an_episode_exactly_or_refuses(tmp_path, how):
    """A second buffer on the store (a new process: reopened; load_replay_buffer in this one: adopted)
    knows the episode the store will continue: the same stacks continue it; a reset stack whose frame
    happens to equal the store's last one would be rebuilt with the old episode's frames: refused."""
    path = str(tmp_path / "resume.mmr")
    venv = make_venv(False, n_envs=1)
    first = MMReplayBuffer(1000, venv.observation_space, venv.action_space, device="cpu", path=path, frame_stack=3,
                           channels=3)
    obs = venv.reset()
    for _ in range(3):  # episode 0 of env 0 lasts 1 + 0 = 1 step; episode 1 lasts 6: stop in its middle
        new_obs, rewards, dones, infos = venv.step(np.array([0]))
        next_obs = new_obs.copy()
        if dones[0]:
            next_obs[0] = infos[0]["terminal_observation"]
        first.add(obs, next_obs, np.array([0]), rewards, dones, infos)
        obs = new_obs
    assert first.store.inspect.stream_tail(0) == (2, False)
    if how == "reopened":
        first.close()

    again = MMReplayBuffer(1000, venv.observation_space, venv.action_space, device="cpu", path=path,
                           frame_stack=3, channels=3)
    coincidence = np.zeros_like(obs)
    coincidence[:, 6:] = obs[:, 6:]  # a reset stack whose newest frame is the store's last next frame
    with pytest.raises(ValueError, match="differs from the previous step's next observation"):
        again.add(coincidence, obs, np.array([0]), np.array([0.0]), np.array([False]), [{}])
    assert again.store.num_added == 3
    added = {}
    for _ in range(20):  # the same stacks go on: the episode continues across the two buffers
        new_obs, rewards, dones, infos = venv.step(np.array([1]))
        next_obs = new_obs.copy()
        if dones[0]:
            next_obs[0] = infos[0]["terminal_observation"]
        again.add(obs, next_obs, np.array([1]), rewards, dones, infos)
        added[frame_id(obs[0, 6:])] = (obs[0].copy(), next_obs[0].copy())
        obs = new_obs
    batch = again.store.inspect.get(np.arange(3, 23))
    for r in range(20):
        o = again._layout(batch.obs[r:r + 1])[0].numpy()
        want_obs, want_next = added[frame_id(o[6:])]
        np.testing.assert_array_equal(o, want_obs)
        np.testing.assert_array_equal(again._layout(batch.next_obs[r:r + 1])[0].numpy(), want_next)
    again.close()
    first.close()


# -- the store's path: absolute, from any working directory -------------------------------------------

def small_dqn(env, path, **kw):
    return DQN("MlpPolicy", env, buffer_size=1000, learning_starts=10_000, policy_kwargs=dict(net_arch=[8]), seed=0,
               replay_buffer_class=MMReplayBuffer, replay_buffer_kwargs=dict(path=path), **kw)


def test_dqn_load_from_another_directory_reopens_the_store(tmp_path, monkeypatch):
    train, elsewhere = tmp_path / "train", tmp_path / "elsewhere"
    train.mkdir(), elsewhere.mkdir()
    env = gym.make("CartPole-v1")
    monkeypatch.chdir(train)
    model = small_dqn(env, "runs/cp.mmr")
    model.learn(120)
    assert model.replay_buffer_kwargs["path"] == str(train / "runs" / "cp.mmr")  # what model.save records
    model.save(train / "dqn")
    model.replay_buffer.close()

    monkeypatch.chdir(elsewhere)
    loaded = DQN.load(train / "dqn", env=env)
    assert loaded.replay_buffer.path == str(train / "runs" / "cp.mmr")
    assert loaded.replay_buffer.size() == 120
    assert not (elsewhere / "runs").exists()  # no stray empty store
    loaded.replay_buffer.close()


def test_a_model_saved_with_a_relative_path_is_an_error_elsewhere_never_an_empty_buffer(tmp_path, monkeypatch):
    train, elsewhere = tmp_path / "train", tmp_path / "elsewhere"
    train.mkdir(), elsewhere.mkdir()
    env = gym.make("CartPole-v1")
    monkeypatch.chdir(train)
    model = small_dqn(env, "cp.mmr")
    model.learn(50)
    model.replay_buffer_kwargs = dict(path="cp.mmr")  # what an older mmreplay left in the saved model
    model.save(train / "dqn")
    model.replay_buffer.close()

    monkeypatch.chdir(elsewhere)
    with pytest.raises(FileNotFoundError, match=f"no replay store at '{elsewhere / 'cp.mmr'}' "
                                                r"\(path='cp.mmr', working directory"):
        DQN.load(train / "dqn", env=env)
    assert not (elsewhere / "cp.mmr").exists()
    real = DQN.load(train / "dqn", env=env, custom_objects={"replay_buffer_kwargs": dict(path=str(train / "cp.mmr"))})
    assert real.replay_buffer.size() == model.num_timesteps > 0
    real.replay_buffer.close()
    fresh = DQN.load(train / "dqn", env=env,
                     custom_objects={"replay_buffer_kwargs": dict(path="new.mmr", create_if_missing=True)})
    assert fresh.replay_buffer.size() == 0 and (elsewhere / "new.mmr").exists()  # asked for: an empty store
    fresh.replay_buffer.close()


def test_store_stream_tail_names_each_streams_newest_transition_and_its_end(tmp_path):
    path = str(tmp_path / "tails.mmr")
    space = spaces.Box(-10, 10, (2,), np.float32)
    with mmreplay.Store.create(path, space, spaces.Discrete(2), capacity=100) as store:
        assert store.inspect.stream_tail(0) is None
        obs = np.zeros((2, 2), np.float32)
        store.extend(obs, np.array([0, 1]), np.zeros(2), obs + 1, np.array([False, True]), np.array([False, False]))
        store.extend(obs[:1] + 1, np.array([0]), np.zeros(1), obs[:1] + 2, np.array([False]), np.array([True]),
                     streams=[0])
        assert store.inspect.stream_tail(0) == (2, True) and store.inspect.stream_tail(1) == (1, True)
        store.extend(obs[:1], np.array([0]), np.zeros(1), obs[:1] + 1, np.array([False]), np.array([False]),
                     streams=[7])
        assert store.inspect.stream_tail(7) == (3, False) and store.inspect.stream_tail(5) is None
    with mmreplay.Store.open(path, mode="r") as store:  # kept by the commit
        assert [store.inspect.stream_tail(s) for s in (0, 1, 7)] == [(2, True), (1, True), (3, False)]


def test_a_buffer_file_written_before_channels_existed_still_loads_as_grey_stacks(tmp_path):
    import json

    from mmreplay.integrations.sb3 import load_replay_buffer

    b = MMReplayBuffer(100, box((SIZE, SIZE, 3)), spaces.Discrete(3), device="cpu", path=str(tmp_path / "g.mmr"),
                       frame_stack=3, channels=1)
    old = {k: v for k, v in b.settings().items() if k not in ("channels", "channels_order")}
    b.close()
    (tmp_path / "old.json").write_text(json.dumps(old))
    model = small_dqn(gym.make("CartPole-v1"), str(tmp_path / "cp.mmr"))
    loaded = load_replay_buffer(model, tmp_path / "old.json")  # grey frames, as that mmreplay stored them
    assert (loaded.channels, loaded.frame_stack) == (1, 3) and loaded.store.observation_space.shape == (SIZE, SIZE)
    loaded.close()
    model.replay_buffer.close()
