"""The acting-side stack equals the stack the store returns at sample time for the same transition."""

import gymnasium as gym
import numpy as np
import pytest
from gymnasium import spaces

from mmreplay.integrations.acting import FrameStacker, StackFrames
from mmreplay.integrations.gymnasium import RecordVectorToStore, create_store_for


class Frames(gym.Env):
    """4x4 frames holding a value unique to (sub-env, episode, step); episodes end after `length` steps,
    by termination or (every third episode) truncation."""
    observation_space = spaces.Box(0, 255, (4, 4), np.uint8)
    action_space = spaces.Discrete(2)

    def __init__(self, env_id, length):
        self.env_id, self.length, self.episode = env_id, length, -1

    def _obs(self):
        return np.full((4, 4), (37 * self.env_id + 11 * self.episode + self.t) % 251 + 1, np.uint8)

    def reset(self, seed=None, options=None):
        self.episode += 1
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        end = self.t >= self.length + self.episode % 2  # lengths vary between episodes
        trunc = end and self.episode % 3 == 2
        return self._obs(), 0.0, end and not trunc, trunc, {}


@pytest.mark.parametrize("padding", ["first", "zeros"])
@pytest.mark.parametrize("mode", [gym.vector.AutoresetMode.NEXT_STEP, gym.vector.AutoresetMode.SAME_STEP])
def test_acting_stacks_equal_the_stored_stacks(store_path, mode, padding):
    k, lengths = 4, [2, 5, 7]  # an episode shorter than the stack, and longer ones
    base = gym.vector.SyncVectorEnv([lambda i=i, n=n: Frames(i, n) for i, n in enumerate(lengths)],
                                    autoreset_mode=mode)
    store = create_store_for(base, store_path, capacity=10_000, frame_stack=k, stack_padding=padding,
                             durable=False)
    envs = StackFrames(RecordVectorToStore(base, store), store)
    assert envs.single_observation_space.shape == (k, 4, 4)
    obs, _ = envs.reset(seed=0)
    acted, after = [], []  # per recorded transition, in store order: the stack acted on, the stack after
    starting = np.zeros(len(lengths), dtype=bool)
    for _ in range(60):
        before = obs.copy()
        obs, _, term, trunc, _ = envs.step(np.zeros(len(lengths), dtype=np.int64))
        done = term | trunc
        for i in range(len(lengths)):
            if mode == gym.vector.AutoresetMode.NEXT_STEP and starting[i]:
                continue  # a reset step: not a transition
            acted.append(before[i])
            after.append(None if mode == gym.vector.AutoresetMode.SAME_STEP and done[i] else obs[i].copy())
        starting = done
    batch = store.inspect.get(np.arange(len(acted)))
    assert len(store) == len(acted)
    for g, (a, n) in enumerate(zip(acted, after)):
        np.testing.assert_array_equal(batch.obs[g].numpy(), a, err_msg=f"obs stack of transition {g}")
        if n is not None:
            np.testing.assert_array_equal(batch.next_obs[g].numpy(), n, err_msg=f"next stack of transition {g}")
    assert (batch.obs[:, 0] == 0).any() == (padding == "zeros")  # padding was exercised
    store.close()


def test_dict_observations_stack_per_key():
    st = FrameStacker(2, 3, padding="first")
    out = st.reset({"a": np.array([[1], [2]]), "b": np.array([5, 6])})
    assert out["a"].shape == (2, 3, 1) and out["b"].tolist() == [[5, 5, 5], [6, 6, 6]]
    out = st.step({"a": np.array([[3], [4]]), "b": np.array([7, 8])}, [True, False], [False, False])
    assert out["b"].tolist() == [[5, 5, 7], [6, 6, 8]]
    out = st.step({"a": np.array([[9], [9]]), "b": np.array([1, 2])}, [False, False], [False, False])
    assert out["b"].tolist() == [[1, 1, 1], [6, 8, 2]]  # NEXT_STEP: env 0 restarted from its reset obs


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="padding"):
        FrameStacker(2, 4, padding="edge")
    with pytest.raises(ValueError, match=r"\(3, \.\.\.\)"):
        FrameStacker(3, 4).reset(np.zeros((2, 4)))
    with pytest.raises(RuntimeError, match="reset"):
        FrameStacker(3, 4).step(np.zeros((3, 4)), [False] * 3, [False] * 3)
