"""``sb3_frames.FrameStacks`` on its own, against SB3's own ``StackedObservations`` (what ``VecFrameStack`` uses):
stacks of k frames of c channels on the first or last axis are seen as ``(k, *frame)`` and laid out again bit
for bit, and ``check`` accepts every step SB3 produces (episode ends included) and refuses the three ways a
stack can differ from what the store would rebuild."""

import numpy as np
import pytest
import torch

pytest.importorskip("stable_baselines3")
from gymnasium import spaces  # noqa: E402
from stable_baselines3.common.vec_env.stacked_observations import StackedObservations  # noqa: E402

from mmreplay.integrations.sb3_frames import FrameStacks  # noqa: E402

K, SIDE, N_ENVS = 4, 6, 2
LAYOUTS = [(1, True), (1, False), (3, True), (3, False)]  # (channels, channels first)


def frame_shape(c: int, first: bool) -> tuple[int, ...]:
    return (c, SIDE, SIDE) if first else (SIDE, SIDE, c)


def sb3_steps(c: int, first: bool, steps: int, seed: int = 0):
    """``(obs, next_obs, dones, newest frames)`` of ``N_ENVS`` envs as SB3's replay buffers get them: env ``i``
    ends an episode every ``4 + i`` steps (``next_obs`` is then the stacked terminal observation)."""
    rng = np.random.default_rng(seed)
    space = spaces.Box(0, 255, frame_shape(c, first), np.uint8)
    stacked = StackedObservations(N_ENVS, K, space, "first" if first else "last")
    frames = rng.integers(1, 256, (N_ENVS, *space.shape), dtype=np.uint8)  # never 0: padding is told apart
    obs = stacked.reset(frames)
    out = []
    for t in range(steps):
        dones = np.array([(t + 1) % (4 + i) == 0 for i in range(N_ENVS)])
        new = rng.integers(1, 256, (N_ENVS, *space.shape), dtype=np.uint8)
        infos = [{"terminal_observation": rng.integers(1, 256, space.shape, dtype=np.uint8)} if d else {}
                 for d in dones]
        nxt, infos = stacked.update(new, dones, infos)
        real_next = np.stack([infos[i]["terminal_observation"] if dones[i] else nxt[i] for i in range(N_ENVS)])
        out.append((obs.copy(), real_next, dones, frames))
        obs, frames = nxt, new
    return out


def flat(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).reshape(N_ENVS, -1)


@pytest.mark.parametrize("c, first", LAYOUTS)
def test_frames_and_the_sb3_layout_are_inverse_and_the_newest_frame_is_the_envs(c, first):
    shape = (K * c, SIDE, SIDE) if first else (SIDE, SIDE, K * c)
    stacks = FrameStacks(shape, K, c, first, 1)
    for obs, _nxt, _dones, frames in sb3_steps(c, first, 12):
        viewed = stacks.frames(obs)
        assert viewed.shape == (N_ENVS, K, *((SIDE, SIDE) if c == 1 else frame_shape(c, first)))
        np.testing.assert_array_equal(viewed[:, -1].reshape(frames.shape), frames)
        np.testing.assert_array_equal(stacks.to_sb3(torch.from_numpy(np.ascontiguousarray(viewed))).numpy(), obs)


@pytest.mark.parametrize("c, first", LAYOUTS)
def test_check_accepts_every_step_sb3_makes_and_refuses_what_the_store_could_not_rebuild(c, first):
    shape = (K * c, SIDE, SIDE) if first else (SIDE, SIDE, K * c)
    stacks = FrameStacks(shape, K, c, first, 1)
    tails: dict[int, tuple[bytes, bool]] = {}
    steps = sb3_steps(c, first, 15)
    for obs, nxt, dones, _frames in steps:  # what the buffer does at each add
        stacks.check(flat(obs), flat(nxt), tails.get)
        for i in range(N_ENVS):
            tails[i] = (flat(nxt)[i].tobytes(), bool(dones[i]))
    assert sum(d.sum() for _o, _n, d, _f in steps) >= 5  # episode ends (zero-padded new stacks) were checked

    obs, nxt, _dones, _frames = steps[2]  # mid-episode for both envs
    previous = {i: (flat(steps[1][1])[i].tobytes(), False) for i in range(N_ENVS)}
    stacks.check(flat(obs), flat(nxt), previous.get)
    older = (slice(None), slice(0, c)) if first else (slice(None), Ellipsis, slice(0, c))
    changed = obs.copy()
    changed[older] ^= 1  # the oldest frame differs, the newest is the same
    with pytest.raises(ValueError, match="sub-env 0 differs from the previous step's next observation"):
        stacks.check(flat(changed), flat(nxt), previous.get)
    with pytest.raises(ValueError, match="sub-env 0 starts an episode but its 3 older frames are not all zero"):
        stacks.check(flat(obs), flat(nxt), lambda i: None)
    bad_next = nxt.copy()
    bad_next[older] ^= 1  # the next stack's oldest frame is not the stack's second frame
    with pytest.raises(ValueError, match="sub-env 0 and its next observation are not one frame apart"):
        stacks.check(flat(obs), flat(bad_next), previous.get)
