"""Record gymnasium environments into a store, with no glue code.

``RecordToStore(env, store)`` wraps a single env; ``RecordVectorToStore(envs, store)`` wraps a vector env
(sub-env ``i`` is stream ``i`` of the store). Invariant: every real transition is recorded exactly once,
with its true next observation — including the final observation of an episode that ended, which
gymnasium's vector autoreset hides (``NEXT_STEP`` mode: the step after an episode end is a reset, not a
transition, and is skipped; ``SAME_STEP`` mode: the final observation comes from ``info["final_obs"]``).
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np

from mmreplay.store import Store


def create_store_for(env, path: str, **kwargs) -> Store:
    """A store whose columns come from ``env``'s spaces (the single-env spaces of a vector env)."""
    obs_space = getattr(env, "single_observation_space", env.observation_space)
    act_space = getattr(env, "single_action_space", env.action_space)
    return Store.create(path, obs_space, act_space, **kwargs)


class RecordToStore(gym.Wrapper):
    """Wrap an env so each ``step`` adds ``(obs, action, reward, next_obs, terminated, truncated)``."""

    def __init__(self, env: gym.Env, store: Store, *, stream: int = 0):
        super().__init__(env)
        self.store = store
        self.stream = stream
        self._obs = None

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        return obs, info

    def step(self, action):
        if self._obs is None:
            raise RuntimeError("RecordToStore: call reset() before step()")
        next_obs, reward, terminated, truncated, info = self.env.step(action)
        self.store.add(self._obs, action, reward, next_obs, terminated, truncated, stream=self.stream)
        self._obs = next_obs
        return next_obs, reward, terminated, truncated, info


class RecordVectorToStore(gym.vector.VectorWrapper):
    """Wrap a vector env; sub-env ``i`` is stream ``i``. Works with ``NEXT_STEP`` (gymnasium's default)
    and ``SAME_STEP`` autoreset."""

    def __init__(self, env: gym.vector.VectorEnv, store: Store):
        super().__init__(env)
        mode = env.metadata.get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
        mode = gym.vector.AutoresetMode(mode) if not isinstance(mode, gym.vector.AutoresetMode) else mode
        if mode == gym.vector.AutoresetMode.DISABLED:
            raise ValueError("RecordVectorToStore needs autoreset (NEXT_STEP or SAME_STEP); the env has it disabled")
        self.mode = mode
        self.store = store
        self._obs = None
        self._resetting = np.zeros(env.num_envs, dtype=bool)  # NEXT_STEP: this step is a reset

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        self._resetting[:] = False
        return obs, info

    def step(self, actions):
        if self._obs is None:
            raise RuntimeError("RecordVectorToStore: call reset() before step()")
        next_obs, rewards, terminated, truncated, info = self.env.step(actions)
        done = np.logical_or(terminated, truncated)
        real = ~self._resetting
        stored_next = next_obs
        if self.mode == gym.vector.AutoresetMode.SAME_STEP and done.any():
            stored_next = _replace_final(next_obs, info, done)
        rows = np.flatnonzero(real)
        if rows.size:
            self.store.extend(_take(self._obs, rows), np.asarray(actions)[rows], np.asarray(rewards)[rows],
                              _take(stored_next, rows), np.asarray(terminated)[rows], np.asarray(truncated)[rows],
                              streams=rows)
        if self.mode == gym.vector.AutoresetMode.NEXT_STEP:
            self._resetting = done  # the next step of these sub-envs returns their reset observation
        self._obs = next_obs
        return next_obs, rewards, terminated, truncated, info


def _take(obs, rows):
    if isinstance(obs, dict):
        return {k: np.asarray(v)[rows] for k, v in obs.items()}
    return np.asarray(obs)[rows]


def _replace_final(next_obs, info, done):
    """SAME_STEP autoreset: ``next_obs`` holds reset observations where ``done``; the final ones are in info."""
    final = info.get("final_obs")
    if final is None:
        raise KeyError("SAME_STEP autoreset without info['final_obs']: cannot record the final observation")
    if isinstance(next_obs, dict):
        out = {k: np.array(v, copy=True) for k, v in next_obs.items()}
        for i in np.flatnonzero(done):
            for k in out:
                out[k][i] = final[i][k]
        return out
    out = np.array(next_obs, copy=True)
    for i in np.flatnonzero(done):
        out[i] = final[i]
    return out
