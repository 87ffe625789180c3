"""Record gymnasium environments into a store, with no glue code.

``RecordToStore(env, store)`` wraps a single env; ``RecordVectorToStore(envs, store)`` wraps a vector env
(sub-env ``i`` is stream ``i`` of the store). Invariant: every real transition is recorded exactly once,
with its true next observation — including the final observation of an episode that ended, which
gymnasium's vector autoreset hides (``NEXT_STEP`` mode: the step after an episode end is a reset, not a
transition, and is skipped; ``SAME_STEP`` mode: the final observation comes from ``info["final_obs"]``).

Frame stacks: over an env whose observations are gymnasium's ``FrameStackObservation(env, k)`` stacks
(``(k, *frame)``), ``create_store_for`` makes a store of single frames with ``frame_stack=k`` and the
wrapper's padding (``"reset"``: the first frame repeated, ``"zero"``: zeros), and the recorders store the
newest frame of each stack: sampled stacks are then exactly the stacks the env returned, each frame stored
once (never stacks of stacks).
"""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.wrappers import FrameStackObservation

from mmreplay.store import Store


def create_store_for(env, path: str, **kwargs) -> Store:
    """A store whose columns come from ``env``'s spaces (the single-env spaces of a vector env). Over
    ``FrameStackObservation(env, k)`` it stores single frames with ``frame_stack=k`` and the wrapper's padding
    (``frame_stack``/``stack_padding`` may be given only as the same values; ``frame_stack=1`` stores each
    stack whole, ``k`` times the disk)."""
    obs_space = getattr(env, "single_observation_space", env.observation_space)
    act_space = getattr(env, "single_action_space", env.action_space)
    stacking = frame_stacking(env)
    if stacking is None or kwargs.get("frame_stack") == 1:
        if stacking is not None:
            warnings.warn(f"mmreplay: frame_stack=1 over FrameStackObservation(stack_size={stacking[0]}): each stack "
                          f"is stored whole, {stacking[0]}x the disk; leave frame_stack out to store each frame once",
                          RuntimeWarning, stacklevel=2)
        return Store.create(path, obs_space, act_space, **kwargs)
    k, padding = stacking
    given = {name: kwargs.pop(name) for name in ("frame_stack", "stack_padding") if name in kwargs}
    if given not in ({}, {"frame_stack": k}, {"stack_padding": padding}, {"frame_stack": k, "stack_padding": padding}):
        raise ValueError(f"create_store_for: {', '.join(f'{n}={v!r}' for n, v in given.items())} with an env whose "
                         f"observations are FrameStackObservation(stack_size={k}) stacks, padded with {padding!r}: "
                         f"pass frame_stack={k}, stack_padding={padding!r}, or leave them out (read from the env)")
    return Store.create(path, newest_frame_space(obs_space), act_space, frame_stack=k, stack_padding=padding, **kwargs)


def frame_stacking(env) -> tuple[int, str] | None:
    """``(stack_size, the store's stack_padding)`` of the ``FrameStackObservation`` whose stacks are ``env``'s
    observations (a single env's wrappers, or a vector env's sub-envs), None without one. A padding the
    store cannot rebuild (a custom observation) is refused."""
    found = _frame_stack_wrapper(env)
    if found is None:
        return None
    k, padding = found
    stores = {"reset": "first", "zero": "zeros"}
    if padding not in stores:
        raise ValueError(f"FrameStackObservation(stack_size={k}, padding_type=<a custom observation>): the store pads "
                         "an episode's first stack by repeating its first frame or with zeros only, so its stacks "
                         "would differ from the env's: use padding_type='reset' or 'zero'")
    return int(k), stores[padding]


def _frame_stack_wrapper(env) -> tuple[int, str] | None:
    """``(stack_size, padding_type)`` of the outermost ``FrameStackObservation`` whose observations are the
    env's, or None (also when a wrapper above it changes the observations: then they are not its stacks)."""
    top = getattr(env, "single_observation_space", env.observation_space)
    vector = hasattr(env, "num_envs") and hasattr(env, "single_observation_space")
    if vector:
        while isinstance(env, gym.vector.VectorWrapper):
            env = env.env
        subs = getattr(env, "envs", None)
        if subs:
            env = subs[0]
        else:  # AsyncVectorEnv: ask the sub-envs through their wrappers
            try:
                return _if_same(top, env.get_attr("stack_size")[0], env.get_attr("padding_type")[0],
                                env.get_attr("observation_space")[0])
            except Exception:  # noqa: BLE001 - no such attribute in the workers: not a stack
                return None
    while isinstance(env, gym.Wrapper):
        if isinstance(env, FrameStackObservation):
            return _if_same(top, env.stack_size, env.padding_type, env.observation_space)
        env = env.env
    return None


def _if_same(top: spaces.Space, k: int, padding, stacked: spaces.Space) -> tuple[int, str] | None:
    return (int(k), padding if isinstance(padding, str) else "_custom") if stacked == top else None


def newest_frame_space(space: spaces.Space) -> spaces.Space:
    """The space of one frame of stacks ``(k, *frame)`` (a Box; a Dict of them per key)."""
    if isinstance(space, spaces.Dict):
        return spaces.Dict({key: newest_frame_space(sub) for key, sub in space.spaces.items()})
    if not isinstance(space, spaces.Box) or len(space.shape) < 2:
        raise ValueError(f"FrameStackObservation stacks of {space}: single frames are stored for Box (or Dict of Box) "
                         "observations only; pass frame_stack=1 to store each stack whole")
    return spaces.Box(space.low[-1], space.high[-1], dtype=space.dtype)


def _newest(obs, stacked: bool, vector: bool):
    """The newest frame of each stack (``obs`` unchanged when the store holds the env's observations)."""
    if not stacked:
        return obs
    if isinstance(obs, dict):
        return {k: _newest(v, True, vector) for k, v in obs.items()}
    obs = np.asarray(obs)
    return obs[:, -1] if vector else obs[-1]


def _stores_newest(env, store: Store) -> bool:
    """Does ``store`` hold single frames of ``env``'s ``FrameStackObservation`` stacks? Refuses a store whose
    padding differs from the wrapper's (its stacks at episode starts would differ from the env's)."""
    stacking = frame_stacking(env) if store.frame_stack > 1 else None
    if stacking is None:
        return False
    k, padding = stacking
    obs_space = getattr(env, "single_observation_space", env.observation_space)
    try:
        single = newest_frame_space(obs_space) == store.observation_space
    except ValueError:
        return False
    if single and (store.frame_stack, store.schema.stack_padding) != (k, padding):
        raise ValueError(f"store {store.path!r} has frame_stack={store.frame_stack}, stack_padding="
                         f"{store.schema.stack_padding!r}; the env's FrameStackObservation stacks {k} frames padded "
                         f"with {padding!r}: make the store with create_store_for(env, path) (frame_stack={k}, "
                         f"stack_padding={padding!r})")
    return single


class RecordToStore(gym.Wrapper):
    """Wrap an env so each ``step`` adds ``(obs, action, reward, next_obs, terminated, truncated)``."""

    def __init__(self, env: gym.Env, store: Store, *, stream: int = 0):
        super().__init__(env)
        self.store = store
        self.stream = stream
        self._stacked = _stores_newest(env, store)  # FrameStackObservation: store each stack's newest frame
        self._obs = None

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self._obs = obs
        return obs, info

    def step(self, action):
        if self._obs is None:
            raise RuntimeError("RecordToStore: call reset() before step()")
        next_obs, reward, terminated, truncated, info = self.env.step(action)
        self.store.add(_newest(self._obs, self._stacked, False), action, reward,
                       _newest(next_obs, self._stacked, False), terminated, truncated, stream=self.stream)
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
        self._stacked = _stores_newest(env, store)  # FrameStackObservation: store each stack's newest frame
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
            self.store.extend(_newest(_take(self._obs, rows), self._stacked, True), np.asarray(actions)[rows],
                              np.asarray(rewards)[rows], _newest(_take(stored_next, rows), self._stacked, True),
                              np.asarray(terminated)[rows], np.asarray(truncated)[rows], streams=rows)
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
