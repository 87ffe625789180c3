"""The acting side of a frame-stacked store: the stacks an agent sees while a vector env runs.

A store with ``frame_stack=k`` holds single frames and rebuilds stacks at sample time; the policy acting
in the env needs the same stacks as it goes. ``FrameStacker`` keeps them for ``num_envs`` sub-envs;
``StackFrames`` wraps a vector env (usually around ``RecordVectorToStore``) so the agent receives stacks
while the store records single frames:

    store = create_store_for(envs, "runs/pong.mmr", frame_stack=4)
    envs = StackFrames(RecordVectorToStore(envs, store), store)   # observations: (num_envs, 4, H, W)

Invariant: the stack the agent acts on for a transition equals ``batch.obs`` the store returns for that
transition (the newest ``k`` frames of the episode, oldest first, padded before the episode's first frame
as the store's ``stack_padding`` says: that frame repeated, or zeros), and after a step that did not end
the episode it equals that transition's ``batch.next_obs``. Episode starts follow the env's autoreset mode:
``NEXT_STEP`` (gymnasium's default: the observation after an episode's end is the new episode's first)
and ``SAME_STEP`` (the reset observation comes in the same step as the end).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from mmreplay.store import Store


class FrameStacker:
    """Stacks of the newest ``frame_stack`` observations of each of ``num_envs`` sub-envs.

    Call ``reset(obs)`` after ``envs.reset`` and ``step(obs, terminated, truncated)`` after every
    ``envs.step``; both return the stacks, ``(num_envs, frame_stack, *frame)`` (a dict of those for Dict
    observations). The arrays returned are the stacker's own: copy them to keep one past the next call.
    """

    def __init__(self, num_envs: int, frame_stack: int, *, padding: str = "first",
                 autoreset_mode: gym.vector.AutoresetMode | str = gym.vector.AutoresetMode.NEXT_STEP):
        if isinstance(num_envs, bool) or not isinstance(num_envs, (int, np.integer)) or num_envs < 1:
            raise ValueError(f"num_envs must be a positive integer, got {num_envs!r}")
        if isinstance(frame_stack, bool) or not isinstance(frame_stack, (int, np.integer)) or frame_stack < 1:
            raise ValueError(f"frame_stack must be a positive integer, got {frame_stack!r}")
        if padding not in ("first", "zeros"):
            raise ValueError(f"padding must be 'first' (repeat the episode's first frame) or 'zeros', got {padding!r}")
        mode = gym.vector.AutoresetMode(autoreset_mode)
        if mode == gym.vector.AutoresetMode.DISABLED:
            raise ValueError("FrameStacker needs an autoresetting vector env (NEXT_STEP or SAME_STEP); with "
                             "autoreset disabled call reset(obs) yourself when episodes end")
        self.num_envs = int(num_envs)
        self.frame_stack = int(frame_stack)
        self.padding = padding
        self.mode = mode
        self._stacks: dict[str, np.ndarray] | None = None
        self._dict = False
        self._starting = np.zeros(self.num_envs, dtype=bool)  # NEXT_STEP: the next obs starts an episode

    @classmethod
    def for_store(cls, store: Store, envs: gym.vector.VectorEnv) -> "FrameStacker":
        """A stacker matching ``store``'s ``frame_stack`` and ``stack_padding`` for the vector env ``envs``."""
        return cls(envs.num_envs, store.frame_stack, padding=store.schema.stack_padding,
                   autoreset_mode=_autoreset_mode(envs))

    @property
    def stacks(self):
        if self._stacks is None:
            raise RuntimeError("FrameStacker: call reset(obs) first")
        return dict(self._stacks) if self._dict else self._stacks["obs"]

    def reset(self, obs, envs=None):
        """Start episodes from ``obs`` in every sub-env (or only in those where the bool mask ``envs`` is set)."""
        frames = self._frames(obs)
        if self._stacks is None or envs is None:
            self._stacks = {k: np.empty((self.num_envs, self.frame_stack, *f.shape[1:]), f.dtype)
                            for k, f in frames.items()}
            envs = np.ones(self.num_envs, dtype=bool)
        self._start(frames, np.asarray(envs, dtype=bool))
        self._starting[envs] = False
        return self.stacks

    def step(self, obs, terminated, truncated):
        """Push the observations ``envs.step`` returned; sub-envs whose episode starts with them get a fresh,
        padded stack."""
        if self._stacks is None:
            raise RuntimeError("FrameStacker: call reset(obs) before step()")
        frames = self._frames(obs)
        done = np.logical_or(np.asarray(terminated, dtype=bool), np.asarray(truncated, dtype=bool))
        starts = self._starting.copy() if self.mode == gym.vector.AutoresetMode.NEXT_STEP else done
        for k, stack in self._stacks.items():
            stack[:, :-1] = stack[:, 1:]
            stack[:, -1] = frames[k]
        if starts.any():
            self._start(frames, starts)
        if self.mode == gym.vector.AutoresetMode.NEXT_STEP:
            self._starting = done  # the next observation of these sub-envs is their reset observation
        return self.stacks

    def _start(self, frames: dict[str, np.ndarray], rows: np.ndarray) -> None:
        for k, stack in self._stacks.items():
            first = frames[k][rows]
            stack[rows] = 0 if self.padding == "zeros" else first[:, None]
            stack[rows, -1] = first

    def _frames(self, obs) -> dict[str, np.ndarray]:
        self._dict = isinstance(obs, dict)
        frames = {k: np.asarray(v) for k, v in obs.items()} if self._dict else {"obs": np.asarray(obs)}
        for k, f in frames.items():
            if f.ndim == 0 or f.shape[0] != self.num_envs:
                raise ValueError(f"observation {k!r} has shape {f.shape}; expected one row per sub-env "
                                 f"({self.num_envs}, ...)")
        return frames


class StackFrames(gym.vector.VectorWrapper):
    """A vector env whose observations are the stacks of a frame-stacked ``store`` (``FrameStacker``):
    wrap it around ``RecordVectorToStore`` so the store records single frames and the agent sees stacks."""

    def __init__(self, env: gym.vector.VectorEnv, store: Store):
        super().__init__(env)
        self.stacker = FrameStacker.for_store(store, env)
        self.single_observation_space = _stacked_space(env.single_observation_space, store.frame_stack,
                                                       store.schema.stack_padding)
        self.observation_space = gym.vector.utils.batch_space(self.single_observation_space, env.num_envs)

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        return self.stacker.reset(obs), info

    def step(self, actions):
        obs, rewards, terminated, truncated, info = self.env.step(actions)
        return self.stacker.step(obs, terminated, truncated), rewards, terminated, truncated, info


def _autoreset_mode(envs) -> gym.vector.AutoresetMode:
    mode = getattr(envs, "metadata", {}).get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
    return gym.vector.AutoresetMode(mode)


def _stacked_space(space: spaces.Space, k: int, padding: str) -> spaces.Space:
    if isinstance(space, spaces.Dict):
        return spaces.Dict({key: _stacked_space(sub, k, padding) for key, sub in space.spaces.items()})
    if not isinstance(space, spaces.Box):
        raise TypeError(f"StackFrames stacks Box observations (or a Dict of them), got {space}")
    low, high = np.repeat(space.low[None], k, axis=0), np.repeat(space.high[None], k, axis=0)
    if padding == "zeros":  # a padded position holds 0, which the frame's own bounds may exclude
        low, high = np.minimum(low, 0), np.maximum(high, 0)
    return spaces.Box(low, high, dtype=space.dtype)
