"""A Stable-Baselines3 replay buffer backed by an on-disk store.

    DQN("CnnPolicy", env, replay_buffer_class=MMReplayBuffer,
        replay_buffer_kwargs=dict(path="runs/pong.mmr", frame_stack=4))

Invariants: every ``add`` of SB3's ``n_envs`` rows becomes one ``extend`` (sub-env ``i`` = stream ``i``);
``terminated`` and ``truncated`` are stored separately (SB3's ``TimeLimit.truncated`` info), and
``sample`` returns ``dones`` = terminated (with ``handle_timeout_termination``, SB3's default) or
terminated | truncated. With ``frame_stack=k`` (``VecFrameStack``) only the newest frame of each stacked
observation is stored and stacks are rebuilt at sample time, zero-padded at episode starts as
``VecFrameStack`` does. Reopening: a buffer made with the ``path`` of an existing store continues it.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import ReplayBufferSamples

from mmreplay.store import Store


class MMReplayBuffer(ReplayBuffer):
    def __init__(self, buffer_size: int, observation_space: spaces.Space, action_space: spaces.Space,
                 device: torch.device | str = "auto", n_envs: int = 1, optimize_memory_usage: bool = False,
                 handle_timeout_termination: bool = True, *, path: str, frame_stack: int = 1,
                 reward_values=None, cache_bytes: int | None = None, **store_kwargs: Any):
        # BaseBuffer, not ReplayBuffer.__init__: that one would allocate the whole buffer in RAM.
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs=n_envs)
        self.optimize_memory_usage = False  # frames are stored once anyway
        self.handle_timeout_termination = handle_timeout_termination
        self.path = os.fspath(path)
        self.frame_stack = int(frame_stack)
        self.stack_axis = _stack_axis(observation_space, self.frame_stack)
        frame_space = _frame_space(observation_space, self.frame_stack, self.stack_axis)
        open_kwargs = {} if cache_bytes is None else {"cache_bytes": cache_bytes}
        if os.path.exists(os.path.join(self.path, "zarr.json")):
            self.store = Store.open(self.path, **open_kwargs)
            if self.store.observation_space != frame_space or self.store.frame_stack != self.frame_stack:
                raise ValueError(f"store {self.path!r} holds {self.store.observation_space} with frame_stack "
                                 f"{self.store.frame_stack}; this buffer needs {frame_space} with frame_stack "
                                 f"{self.frame_stack}")
        else:
            self.store = Store.create(self.path, frame_space, action_space, capacity=buffer_size,
                                      frame_stack=self.frame_stack, reward_values=reward_values,
                                      stack_padding="zeros" if self.frame_stack > 1 else "first",
                                      **open_kwargs, **store_kwargs)
        self._sampler = None

    # -- SB3's buffer API -----------------------------------------------------------------------------
    def add(self, obs: np.ndarray, next_obs: np.ndarray, action: np.ndarray, reward: np.ndarray, done: np.ndarray,
            infos: list[dict[str, Any]]) -> None:
        truncated = np.array([bool(info.get("TimeLimit.truncated", False)) for info in infos])
        done = np.asarray(done, dtype=bool).reshape(self.n_envs)
        action = np.asarray(action).reshape(self.n_envs, *self.store.schema.action.shape)
        self.store.extend(self._newest(obs), action, np.asarray(reward, dtype=np.float32).reshape(self.n_envs),
                          self._newest(next_obs), done & ~truncated, done & truncated)

    def sample(self, batch_size: int, env=None) -> ReplayBufferSamples:
        if self._sampler is None or self._sampler.batch_size != batch_size:
            # Continue a reopened store's sequence; else seed from numpy's global RNG, which SB3's `seed=`
            # sets, so runs with the same seed sample the same batches.
            seed = None if self.store._saved_sampler_state("sb3") else int(np.random.randint(2**31 - 1))
            self._sampler = self.store.sampler(batch_size, prefetch=0, seed=seed, name="sb3")
        b = next(self._sampler)
        obs, next_obs = self._layout(b.obs), self._layout(b.next_obs)
        if env is not None:  # VecNormalize
            obs = torch.as_tensor(self._normalize_obs(obs.numpy(), env))
            next_obs = torch.as_tensor(self._normalize_obs(next_obs.numpy(), env))
        dones = b.terminated if self.handle_timeout_termination else (b.terminated | b.truncated)
        rewards = b.reward.reshape(-1, 1)
        if env is not None:
            rewards = torch.as_tensor(self._normalize_reward(rewards.numpy(), env))
        actions = b.action.reshape(batch_size, -1)
        data = (obs, actions, next_obs, dones.to(torch.float32).reshape(-1, 1), rewards.to(torch.float32))
        return ReplayBufferSamples(*(t.to(self.device) for t in data))  # .to() copies the reused buffers

    def size(self) -> int:
        return len(self.store)

    def reset(self) -> None:
        raise NotImplementedError("MMReplayBuffer keeps its experience on disk; delete the store directory "
                                  f"{self.path!r} to start from nothing")

    # SB3's save_replay_buffer / load_replay_buffer pickle the buffer object: keep only where it lives.
    def __getstate__(self) -> dict:
        self.store.flush()
        return {"path": self.path, "args": (self.buffer_size, self.observation_space, self.action_space,
                                            str(self.device), self.n_envs, False, self.handle_timeout_termination),
                "frame_stack": self.frame_stack}

    def __setstate__(self, state: dict) -> None:
        self.__init__(*state["args"], path=state["path"], frame_stack=state["frame_stack"])

    def close(self) -> None:
        self.store.close()

    # -- frame stacks -------------------------------------------------------------------------------
    def _newest(self, obs: np.ndarray) -> np.ndarray:
        obs = np.asarray(obs)
        if self.frame_stack == 1:
            return obs.reshape(self.n_envs, *self.obs_shape)
        return obs[:, -1] if self.stack_axis == 0 else obs[..., -1]

    def _layout(self, stacked: torch.Tensor) -> torch.Tensor:
        if self.frame_stack == 1 or self.stack_axis == 0:
            return stacked
        return stacked.movedim(1, -1)  # (B, k, H, W) -> (B, H, W, k): VecFrameStack's channel-last order


def _stack_axis(space: spaces.Space, k: int) -> int:
    if k == 1:
        return 0
    if not isinstance(space, spaces.Box) or len(space.shape) != 3:
        raise ValueError(f"frame_stack={k} needs a stacked image Box observation (k, H, W) or (H, W, k), got {space}")
    if space.shape[0] == k:
        return 0
    if space.shape[-1] == k:
        return -1
    raise ValueError(f"frame_stack={k} but no axis of the observation shape {space.shape} has length {k}")


def _frame_space(space: spaces.Space, k: int, axis: int) -> spaces.Space:
    if k == 1:
        return space
    low = space.low[0] if axis == 0 else space.low[..., 0]
    high = space.high[0] if axis == 0 else space.high[..., 0]
    return spaces.Box(low, high, dtype=space.dtype)
