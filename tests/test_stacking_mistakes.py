"""The common stacking mistakes (issue 41 items 1 and 4): SB3's ``VecFrameStack`` given to ``MMReplayBuffer``
without ``frame_stack``, gymnasium's ``FrameStackObservation`` given to ``create_store_for``, and stacks passed
where single frames are expected. Each is stored as single frames whose rebuilt stacks equal, bit for bit, what
the policy saw, or refused with the arguments to pass — never silently stored whole (k times the disk).

The envs are small fake image envs (grey or RGB, channel-first or channel-last) whose every frame names its
env, episode and step in its pixels, so a rebuilt stack is checked against the exact stack the env returned.
"""

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces
from gymnasium.wrappers import FrameStackObservation, TimeLimit

import mmreplay
from mmreplay.integrations.gymnasium import RecordToStore, RecordVectorToStore, create_store_for

sb3 = pytest.importorskip("stable_baselines3")
from stable_baselines3 import DQN  # noqa: E402
from stable_baselines3.common.vec_env import DummyVecEnv, VecFrameStack, VecTransposeImage  # noqa: E402

from mmreplay.integrations.sb3 import MMReplayBuffer  # noqa: E402

SIZE = 16  # image side: larger than any channel count here, so SB3 finds the channel axis as the smallest


class IdFrames(gym.Env):
    """Frames of ``channels`` channels (1 grey, 3 RGB), first or last, whose pixels encode (env, episode,
    step); episodes of 3..9 steps, some cut by a TimeLimit of 7 (truncations)."""

    action_space = spaces.Discrete(2)

    def __init__(self, env_id: int, channels: int, channels_first: bool, squeeze: bool = False):
        self.env_id, self.c, self.first, self.squeeze = env_id, channels, channels_first, squeeze
        shape = (SIZE, SIZE) if squeeze else ((channels, SIZE, SIZE) if channels_first else (SIZE, SIZE, channels))
        self.observation_space = spaces.Box(0, 255, shape, np.uint8)
        self.episode, self.t = -1, 0

    def _obs(self):
        ch = np.arange(self.c)[:, None, None]
        y, x = np.arange(SIZE)[None, :, None], np.arange(SIZE)[None, None, :]
        f = ((self.env_id * 31 + self.episode * 7 + self.t * 13 + ch * 101 + y * 3 + x) % 251 + 1).astype(np.uint8)
        f[:, 0, :3] = [self.env_id + 1, self.episode + 1, self.t + 1]  # never zero: padding is told apart
        if self.squeeze:
            return f[0]
        return f if self.first else f.transpose(1, 2, 0).copy()

    def reset(self, seed=None, options=None):
        self.episode, self.t = self.episode + 1, 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        length = 3 + (self.env_id * 5 + self.episode * 3) % 7
        return self._obs(), float(self.t), self.t == length, False, {}


class RecordingBuffer(MMReplayBuffer):
    """``MMReplayBuffer`` that keeps a copy of every ``add`` (what SB3 handed it: what the policy saw)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen = []

    def add(self, obs, next_obs, action, reward, done, infos):
        super().add(obs, next_obs, action, reward, done, infos)
        for i in range(self.n_envs):
            self.seen.append((np.array(obs[i]), np.array(next_obs[i])))


def venv_of(channels: int, channels_first: bool, n_stack: int, transpose: bool = False):
    venv = DummyVecEnv([lambda i=i: TimeLimit(IdFrames(i, channels, channels_first), 7) for i in range(2)])
    venv = VecFrameStack(venv, n_stack=n_stack)
    return VecTransposeImage(venv) if transpose else venv


def dqn(venv, path, **buffer_kw):
    return DQN("MlpPolicy", venv, buffer_size=1000, learning_starts=10_000, policy_kwargs=dict(net_arch=[8]), seed=0,
               replay_buffer_class=RecordingBuffer, replay_buffer_kwargs=dict(path=path, **buffer_kw))


LAYOUTS = [(c, first, k, transpose) for c in (1, 3) for first in (True, False) for k in (3, 4)
           for transpose in ((False, True) if not first else (False,))]


@pytest.mark.parametrize("channels, channels_first, n_stack, transpose", LAYOUTS)
def test_sb3_vecframestack_without_frame_stack_stores_single_frames_and_rebuilds_exact_stacks(
        tmp_path, channels, channels_first, n_stack, transpose):
    venv = venv_of(channels, channels_first, n_stack, transpose)
    model = dqn(venv, str(tmp_path / "s.mmr"))  # no frame_stack: the Atari recipe as users write it
    buffer = model.replay_buffer
    # SB3 puts VecTransposeImage over channel-last images (or the user did): the buffer sees channel-first stacks
    frame = (SIZE, SIZE) if channels == 1 else (channels, SIZE, SIZE)
    assert buffer.frame_stack == n_stack and buffer.store.observation_space.shape == frame
    assert model.replay_buffer_kwargs["frame_stack"] == n_stack  # model.save records it for DQN.load
    model.learn(64)  # 32 steps of 2 envs (rollouts of train_freq=4): SB3's own collection loop calls add
    store = buffer.store
    assert store.num_added == len(buffer.seen) == 64
    # each frame stored once: one per transition, plus the first frame of each episode
    assert store.inspect.num_frames == 64 + store.info()["episodes_started"] < 2 * 64
    batch = store.inspect.get(np.arange(64))
    obs, next_obs = buffer._layout(batch.obs).numpy(), buffer._layout(batch.next_obs).numpy()
    for g, (o, n) in enumerate(buffer.seen):
        np.testing.assert_array_equal(obs[g], o, err_msg=f"obs {g}")
        np.testing.assert_array_equal(next_obs[g], n, err_msg=f"next_obs {g}")
    samples = buffer.sample(8)
    assert tuple(samples.observations.shape[1:]) == tuple(model.env.observation_space.shape)  # SB3 may transpose
    buffer.close()


def test_sb3_dqn_load_without_env_takes_the_stacking_the_model_recorded(tmp_path):
    venv = venv_of(1, False, 4)
    model = dqn(venv, str(tmp_path / "s.mmr"))
    model.learn(24)
    model.save(tmp_path / "m")
    model.replay_buffer.close()
    again = DQN.load(tmp_path / "m", custom_objects={"replay_buffer_class": MMReplayBuffer})  # no env
    assert again.replay_buffer.frame_stack == 4 and again.replay_buffer.store.num_added == 24
    again.replay_buffer.close()


@pytest.mark.parametrize("kwargs, message", [
    (dict(frame_stack=3), (r"frame_stack=3 does not match .*VecFrameStack\(n_stack=4\) stacks frames of 1 "
                           r"channel\(s\).*pass frame_stack=4, channels=1")),
    (dict(frame_stack=4, channels=3), r"channels=3 does not match .*pass frame_stack=4, channels=1"),
])
def test_sb3_arguments_that_contradict_the_env_are_refused_with_the_right_ones(tmp_path, kwargs, message):
    # grey VecFrameStack(4) told frame_stack=3 used to hear "pass frame_stack=28, channels=3"
    with pytest.raises(ValueError, match=message):
        dqn(venv_of(1, False, 4), str(tmp_path / "s.mmr"), **kwargs)


def test_sb3_explicit_frame_stack_1_over_vecframestack_warns_of_the_disk_it_takes(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"stores each stack whole, 4x the disk.*pass frame_stack=4, channels=1"):
        model = dqn(venv_of(1, False, 4), str(tmp_path / "s.mmr"), frame_stack=1)
    assert model.replay_buffer.store.observation_space.shape == (4, SIZE, SIZE)  # transposed whole stacks
    model.replay_buffer.close()


@pytest.mark.parametrize("shape, kwargs, message", [
    # the old hint here was "pass frame_stack=28, channels=3"
    ((84, 84, 4), dict(frame_stack=3), (r"frame_stack=3 does not fit observations of shape \(84, 84, 4\).*"
                                        r"VecFrameStack\(n_stack=4\) of grey frames: pass frame_stack=4, channels=1")),
    ((4, 84, 84), dict(frame_stack=3), r"pass frame_stack=4, channels=1"),
    # no env to read (a buffer made by hand) and stacks in the shape: refused, never stored whole
    ((84, 84, 4), {}, (r"looks like VecFrameStack's stacks of 4 frame\(s\) of 1 channel\(s\).*"
                       r"pass frame_stack=4, channels=1")),
    ((12, 84, 84), {}, r"stacks of 4 frame\(s\) of 3 channel\(s\).*pass frame_stack=4, channels=3"),
])
def test_sb3_shapes_alone_name_the_arguments_to_pass(tmp_path, shape, kwargs, message):
    with pytest.raises(ValueError, match=message):
        MMReplayBuffer(100, spaces.Box(0, 255, shape, np.uint8), spaces.Discrete(2), device="cpu",
                       path=str(tmp_path / "x.mmr"), **kwargs)


def test_sb3_single_frames_by_hand_still_need_no_arguments(tmp_path):
    for shape in [(84, 84, 3), (3, 84, 84), (84, 84, 1), (84, 84), (7,)]:
        b = MMReplayBuffer(100, spaces.Box(0, 255, shape, np.uint8), spaces.Discrete(2), device="cpu",
                           path=str(tmp_path / f"{shape}.mmr"))
        assert b.frame_stack == 1 and b.store.observation_space.shape == shape
        b.close()


def test_sb3_a_buffer_made_again_without_arguments_takes_the_stores_stacking(tmp_path):
    path = str(tmp_path / "s.mmr")
    space = spaces.Box(0, 255, (SIZE, SIZE, 12), np.uint8)
    MMReplayBuffer(100, space, spaces.Discrete(2), device="cpu", path=path, frame_stack=4, channels=3).close()
    again = MMReplayBuffer(100, space, spaces.Discrete(2), device="cpu", path=path)
    assert (again.frame_stack, again.channels, again.channels_first) == (4, 3, False)
    again.close()


# -- gymnasium's FrameStackObservation ---------------------------------------------------------------

def fso_env(env_id, channels, first, k, padding="reset", squeeze=False):
    return FrameStackObservation(TimeLimit(IdFrames(env_id, channels, first, squeeze), 7), k, padding_type=padding)


@pytest.mark.parametrize("channels, first, squeeze", [(1, True, True), (3, True, False), (3, False, False)])
@pytest.mark.parametrize("k, padding", [(3, "reset"), (4, "zero")])
def test_create_store_for_frame_stack_observation_stores_single_frames(tmp_path, channels, first, squeeze, k, padding):
    env = fso_env(0, channels, first, k, padding, squeeze)
    store = create_store_for(env, str(tmp_path / "g.mmr"), capacity=1000)
    frame = env.env.observation_space.shape
    assert store.frame_stack == k and store.observation_space.shape == frame
    assert store.schema.stack_padding == {"reset": "first", "zero": "zeros"}[padding]
    rec = RecordToStore(env, store)
    seen = []
    obs, _ = rec.reset(seed=0)
    for _ in range(40):
        nxt, _, term, trunc, _ = rec.step(0)
        seen.append((obs, nxt))
        obs = rec.reset()[0] if term or trunc else nxt
    batch = store.inspect.get(np.arange(40))
    assert batch.obs.shape == (40, k, *frame)  # stacks of frames, not stacks of stacks
    for g, (o, n) in enumerate(seen):
        np.testing.assert_array_equal(batch.obs[g].numpy(), o, err_msg=f"obs {g}")
        np.testing.assert_array_equal(batch.next_obs[g].numpy(), n, err_msg=f"next_obs {g}")
    assert store.inspect.num_frames < 2 * 40
    store.close()


def test_record_vector_to_store_over_frame_stack_observation(tmp_path):
    envs = gym.vector.SyncVectorEnv([lambda i=i: fso_env(i, 3, False, 4) for i in range(2)])
    store = create_store_for(envs, str(tmp_path / "v.mmr"), capacity=1000)
    assert store.frame_stack == 4 and store.observation_space.shape == (SIZE, SIZE, 3)
    rec = RecordVectorToStore(envs, store)
    obs, _ = rec.reset(seed=0)
    seen, resetting = [], np.zeros(2, bool)
    for _ in range(30):
        nxt, _, term, trunc, _ = rec.step(np.zeros(2, np.int64))
        seen += [(obs[i].copy(), nxt[i].copy()) for i in range(2) if not resetting[i]]
        resetting, obs = term | trunc, nxt
    batch = store.inspect.get(np.arange(store.num_added))
    assert store.num_added == len(seen)
    for g, (o, n) in enumerate(seen):
        np.testing.assert_array_equal(batch.obs[g].numpy(), o, err_msg=f"obs {g}")
        np.testing.assert_array_equal(batch.next_obs[g].numpy(), n, err_msg=f"next_obs {g}")
    store.close()


def test_create_store_for_refuses_a_contradicting_frame_stack_with_the_fix(tmp_path):
    env = fso_env(0, 1, True, 4, squeeze=True)
    with pytest.raises(ValueError, match=r"frame_stack=3 with an env whose observations are "
                                         r"FrameStackObservation\(stack_size=4\).*pass frame_stack=4"):
        create_store_for(env, str(tmp_path / "a.mmr"), frame_stack=3)
    with pytest.raises(ValueError, match="padding_type='reset' or 'zero'"):
        create_store_for(FrameStackObservation(IdFrames(0, 1, True, True), 4,
                                               padding_type=np.zeros((SIZE, SIZE), np.uint8) + 5),
                         str(tmp_path / "b.mmr"))
    with pytest.warns(RuntimeWarning, match="4x the disk"):
        whole = create_store_for(env, str(tmp_path / "c.mmr"), frame_stack=1)
    assert whole.observation_space.shape == (4, SIZE, SIZE)
    whole.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        create_store_for(env, str(tmp_path / "d.mmr"), frame_stack=4).close()  # the same as the env: fine


def test_a_recorder_refuses_a_store_whose_padding_differs_from_the_envs(tmp_path):
    env = fso_env(0, 1, True, 4, padding="zero", squeeze=True)
    store = mmreplay.Store.create(str(tmp_path / "p.mmr"), env.env.observation_space, env.action_space,
                                  capacity=100, frame_stack=4)  # stack_padding "first"
    with pytest.raises(ValueError, match="stack_padding='first'.*padded with 'zeros'.*create_store_for"):
        RecordToStore(env, store)
    store.close()


# -- stacks passed where single frames are expected ----------------------------------------------------

@pytest.mark.parametrize("given", [(4, SIZE, SIZE), (SIZE, SIZE, 4)])
def test_a_stack_given_to_add_is_told_to_pass_single_frames(tmp_path, given):
    store = mmreplay.Store.create(str(tmp_path / "a.mmr"), spaces.Box(0, 255, (SIZE, SIZE), np.uint8),
                                  spaces.Discrete(2), capacity=100, frame_stack=4)
    stack = np.ones(given, np.uint8)
    with pytest.raises(ValueError, match=r"obs: got shape \(1, .*\), 1 stack\(s\) of 4 frames, but this store "
                                         r"\(frame_stack=4\) expects single frames of shape \(16, 16\).*"
                                         "pass single frames"):
        store.add(stack, 0, 0.0, stack, False, False)
    with pytest.raises(ValueError, match=r"2 stack\(s\) of 4 frames.*pass single frames"):
        store.extend(np.ones((2, *given), np.uint8), [0, 0], [0.0, 0.0], np.ones((2, *given), np.uint8),
                     [False, False], [False, False])
    assert store.num_added == 0
    store.close()


def test_sb3_an_env_without_vecframestack_keeps_its_own_channels(tmp_path):
    # 4 channels of the env's own (no VecFrameStack): the env says it is one frame, nothing is refused
    venv = DummyVecEnv([lambda: IdFrames(0, 4, True)])
    model = dqn(venv, str(tmp_path / "s.mmr"))
    assert model.replay_buffer.frame_stack == 1 and model.replay_buffer.store.observation_space.shape == (4, SIZE, SIZE)
    model.replay_buffer.close()


def test_sb3_a_store_of_whole_stacks_made_before_keeps_working_and_says_so(tmp_path):
    # a run started before the buffer read VecFrameStack from the env: its store holds whole stacks
    path = str(tmp_path / "old.mmr")
    venv = venv_of(1, True, 4)
    old = MMReplayBuffer(100, venv.observation_space, venv.action_space, device="cpu", n_envs=2, path=path,
                         frame_stack=1)
    old.close()
    with pytest.warns(RuntimeWarning, match="holds whole VecFrameStack"):
        model = dqn(venv, path)  # what DQN.load of that run's model does: no frame_stack in its kwargs
    assert model.replay_buffer.frame_stack == 1
    model.replay_buffer.close()
