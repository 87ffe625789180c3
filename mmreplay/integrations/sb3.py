"""A Stable-Baselines3 replay buffer backed by an on-disk store.

    DQN("CnnPolicy", env, replay_buffer_class=MMReplayBuffer,
        replay_buffer_kwargs=dict(path="runs/pong.mmr", frame_stack=4, n_steps=3, gamma=0.99))

Invariants:
- Every ``add`` of SB3's ``n_envs`` rows becomes one ``extend`` (sub-env ``i`` = stream ``i``);
  ``terminated`` and ``truncated`` are stored separately (SB3's ``TimeLimit.truncated`` info), and
  ``sample`` returns ``dones`` = terminated (with ``handle_timeout_termination``, SB3's default) or
  terminated | truncated — of the window's last step with n-step returns, with ``discounts`` = gamma**m.
- With ``frame_stack=k`` (``VecFrameStack``) only the newest frame of each stacked observation is stored
  and stacks are rebuilt at sample time, zero-padded at episode starts as ``VecFrameStack`` does.
- One open ``Store`` per directory in this process: every buffer made for the same ``path`` (``DQN.load``,
  ``load_replay_buffer``, a copy) adopts it instead of reopening it (a second writer would hit the store's
  writer lock). The store is committed when a buffer is saved (``save_replay_buffer``, pickling), when
  another buffer adopts it, and closed (committed) when its last buffer is closed or garbage collected.
- What SB3 pickles of a buffer (``save_replay_buffer``, ``copy.deepcopy``) is a JSON document of where the
  store lives and the buffer's settings — never transitions.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import weakref
from dataclasses import fields
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples

from mmreplay.columns.spaces import space_from_json, space_to_json
from mmreplay.errors import StoreClosedError
from mmreplay.sampling.batch import Batch
from mmreplay.sampling.nstep import check_nstep
from mmreplay.store import Store

SETTINGS_FORMAT = "mmreplay.sb3-buffer"
SETTINGS_VERSION = 1
SAMPLER_NAME = "sb3"
# HerReplayBuffer's own arguments: passing them here means the user expects goal relabelling.
HER_KWARGS = ("goal_selection_strategy", "n_sampled_goal", "copy_info_dict", "env")


class _SharedStore:
    """The one open store of a directory in this process; every buffer on that path holds this handle."""

    def __init__(self, store: Store):
        self.store = store
        self.buffers: weakref.WeakSet = weakref.WeakSet()  # buffers attached and not closed
        # Commit and release the writer lock once no buffer holds the handle (or at interpreter exit).
        self._finalizer = weakref.finalize(self, _close_quietly, store)

    def replace(self, store: Store) -> None:
        self._finalizer.detach()
        self.store = store
        self._finalizer = weakref.finalize(self, _close_quietly, store)

    def close(self) -> None:
        self._finalizer()  # runs _close_quietly once; later calls do nothing


_OPEN: "weakref.WeakValueDictionary[str, _SharedStore]" = weakref.WeakValueDictionary()


def _close_quietly(store: Store) -> None:
    try:
        store.close()
    except StoreClosedError:
        pass


def _key(path: str) -> str:
    return os.path.realpath(path)


def _adopt(path: str) -> _SharedStore | None:
    """The handle this process already has open for ``path`` (committed now), or None."""
    shared = _OPEN.get(_key(path))
    if shared is None:
        return None
    try:
        shared.store.flush()  # the buffer that takes over starts from a committed state
    except StoreClosedError:  # closed behind the buffers' back (store.close()): reopen
        _OPEN.pop(_key(path), None)
        return None
    return shared


class MMReplayBuffer(ReplayBuffer):
    """SB3's ``ReplayBuffer`` API over a store at ``path`` (created from the spaces, or continued).

    ``n_steps``/``gamma``: n-step returns computed by the store at sample time (SB3 >= 2.7 passes them
    only to its own buffer class, so give them in ``replay_buffer_kwargs``). ``frame_stack``: the
    observations are ``VecFrameStack`` stacks of ``k`` frames. Other keyword arguments go to
    ``Store.create`` (``reward_values``, ``frame_codec``, ``commit_every``, ...).

    What users must know: the buffer lives on disk and survives the process (pickling the buffer, as SB3's
    ``save_replay_buffer`` does, only commits the store and records its path); ``sample`` draws uniformly
    with replacement from the valid transitions; ``reset()`` deletes the store's contents.
    """

    def __init__(self, buffer_size: int, observation_space: spaces.Space, action_space: spaces.Space,
                 device: torch.device | str = "auto", n_envs: int = 1, optimize_memory_usage: bool = False,
                 handle_timeout_termination: bool = True, *, path: str | os.PathLike, frame_stack: int = 1,
                 n_steps: int = 1, gamma: float = 0.99, reward_values=None, cache_bytes: int | None = None,
                 **store_kwargs: Any):
        her = sorted(set(store_kwargs) & set(HER_KWARGS))
        if her:
            raise NotImplementedError(
                f"MMReplayBuffer does not do HER goal relabelling (got {her}): relabelling needs a later step "
                "of the same episode for each sampled transition and the env's compute_reward over the stored "
                "infos; the store links episodes backwards only and keeps no infos. Use SB3's HerReplayBuffer.")
        # BaseBuffer, not ReplayBuffer.__init__: that one would allocate the whole buffer in RAM.
        BaseBuffer.__init__(self, buffer_size, observation_space, action_space, device, n_envs=n_envs)
        self.optimize_memory_usage = False  # frames are stored once anyway
        self.handle_timeout_termination = handle_timeout_termination
        self.path = os.fspath(path)
        self.frame_stack = int(frame_stack)
        self.n_steps, self.gamma = check_nstep(n_steps, gamma, name="n_steps")
        if self.n_steps > 1 and "discounts" not in ReplayBufferSamples._fields:
            raise RuntimeError(f"n_steps={self.n_steps} needs stable-baselines3 >= 2.7, whose algorithms read "
                               "ReplayBufferSamples.discounts; this one has no such field")
        if self.frame_stack > 1 and isinstance(observation_space, spaces.Dict):
            raise ValueError(f"frame_stack={self.frame_stack} with a Dict observation space: stacks are rebuilt "
                             "for one image observation (VecFrameStack on a Box); use frame_stack=1")
        self.stack_axis = _stack_axis(observation_space, self.frame_stack)
        self._frame_space = _frame_space(observation_space, self.frame_stack, self.stack_axis)
        self._open_kwargs = {} if cache_bytes is None else {"cache_bytes": int(cache_bytes)}
        self._create_kwargs = dict(reward_values=reward_values, **store_kwargs)
        self._shared = _adopt(self.path) or self._open_or_create()
        self._check_matches(self.store)
        self._shared.buffers.add(self)
        self._sampler = None
        self._enough_for = 0  # the largest batch size the store is known to hold (it only grows)

    @property
    def store(self) -> Store:
        return self._shared.store

    def _open_or_create(self) -> _SharedStore:
        if os.path.exists(os.path.join(self.path, "zarr.json")):
            store = Store.open(self.path, **self._open_kwargs)
        else:
            store = Store.create(self.path, self._frame_space, self.action_space, capacity=self.buffer_size,
                                 frame_stack=self.frame_stack,
                                 stack_padding="zeros" if self.frame_stack > 1 else "first",
                                 **self._open_kwargs, **self._create_kwargs)
        shared = _SharedStore(store)
        _OPEN[_key(self.path)] = shared
        return shared

    def _check_matches(self, store: Store) -> None:
        if store.observation_space != self._frame_space or store.frame_stack != self.frame_stack:
            raise ValueError(f"store {self.path!r} holds {store.observation_space} with frame_stack "
                             f"{store.frame_stack}; this buffer needs {self._frame_space} with frame_stack "
                             f"{self.frame_stack}")
        if store.action_space != self.action_space:
            raise ValueError(f"store {self.path!r} holds actions of {store.action_space}; this buffer needs "
                             f"{self.action_space}")

    # -- SB3's buffer API -----------------------------------------------------------------------------
    def add(self, obs, next_obs, action: np.ndarray, reward: np.ndarray, done: np.ndarray,
            infos: list[dict[str, Any]]) -> None:
        truncated = np.array([bool(info.get("TimeLimit.truncated", False)) for info in infos])
        done = np.asarray(done, dtype=bool).reshape(self.n_envs)
        action = np.asarray(action).reshape(self.n_envs, *self.store.schema.action.shape)
        self.store.extend(self._newest(obs), action, np.asarray(reward, dtype=np.float32).reshape(self.n_envs),
                          self._newest(next_obs), done & ~truncated, done & truncated)

    def sample(self, batch_size: int, env=None) -> ReplayBufferSamples | DictReplayBufferSamples:
        """``batch_size`` transitions drawn uniformly with replacement (like SB3), also while the buffer
        holds fewer than ``batch_size`` (SAC/TD3 start training before that)."""
        if self.n_steps > 1 and env is not None and getattr(env, "norm_reward", False):
            raise NotImplementedError("n-step returns with VecNormalize(norm_reward=True): the store sums the raw "
                                      "rewards at sample time and cannot normalise each step first; use "
                                      "norm_reward=False or n_steps=1")
        if batch_size > self._enough_for:
            held = len(self.store)
            if held == 0:
                raise ValueError("cannot sample from an empty replay buffer (no transitions added yet)")
            if held < batch_size:
                return self._samples(self._draw_from_few(batch_size, held), batch_size, env)
            self._enough_for = batch_size
        return self._samples(next(self._main_sampler(batch_size)), batch_size, env)

    def size(self) -> int:
        return len(self.store)

    def reset(self) -> None:
        """Discard every transition: the store directory is deleted and made again, empty, with the same
        columns, capacity and commit settings (every buffer of this process on ``path`` sees the new one)."""
        old = self.store
        schema = old.schema
        obs_space, act_space = schema.spaces()
        columns = {c.name: c for c in (*schema.observations, schema.action, schema.reward)}
        settings = dict(capacity=old.capacity, frame_stack=schema.frame_stack, stack_padding=schema.stack_padding,
                        extras=schema.extras, columns=columns, settings=old.settings)
        self._shared.close()
        shutil.rmtree(self.path)
        self._shared.replace(Store.create(self.path, obs_space, act_space, **settings, **self._open_kwargs))
        self._sampler = None
        self._enough_for = 0
        for buffer in list(self._shared.buffers):
            buffer._sampler, buffer._enough_for = None, 0

    def close(self) -> None:
        """Detach this buffer; the store is committed and closed once no other buffer of this process
        uses it."""
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        self._shared.buffers.discard(self)
        if len(self._shared.buffers) == 0:
            self._shared.close()
            if _OPEN.get(_key(self.path)) is self._shared:
                del _OPEN[_key(self.path)]

    # -- saving: SB3 pickles the buffer object; we hand it the JSON settings and nothing else ----------
    def settings(self) -> dict[str, Any]:
        """What reopens this buffer: the store's absolute path and the buffer's arguments (plain JSON)."""
        return {"format": SETTINGS_FORMAT, "version": SETTINGS_VERSION, "path": os.path.abspath(self.path),
                "buffer_size": int(self.buffer_size), "observation_space": space_to_json(self.observation_space),
                "action_space": space_to_json(self.action_space), "n_envs": int(self.n_envs),
                "handle_timeout_termination": bool(self.handle_timeout_termination),
                "frame_stack": self.frame_stack, "n_steps": self.n_steps, "gamma": self.gamma,
                "device": str(self.device), **self._open_kwargs}

    def __reduce__(self):
        self.store.flush()  # saving the buffer = committing the store
        return _buffer_from_json, (json.dumps(self.settings()),)

    # -- sampling -------------------------------------------------------------------------------------
    def _main_sampler(self, batch_size: int):
        smp = self._sampler
        if smp is None or smp.batch_size != batch_size or self._sampler_store is not self.store:
            for buffer in [self, *self._shared.buffers]:  # one open sampler per name and store: the newest wins
                if buffer._sampler is not None:
                    buffer._sampler.close()
                    buffer._sampler = None
            # Continue a reopened store's sequence; else seed from numpy's global RNG, which SB3's `seed=`
            # sets, so runs with the same seed sample the same batches.
            seed = None if self.store.has_sampler_state(SAMPLER_NAME) else int(np.random.randint(2**31 - 1))
            self._sampler = self.store.sampler(batch_size, prefetch=0, seed=seed, name=SAMPLER_NAME,
                                               n_step=self.n_steps, gamma=self.gamma)
            self._sampler_store = self.store
        return self._sampler

    def _draw_from_few(self, batch_size: int, held: int) -> Batch:
        """``batch_size`` > ``held`` transitions: the store draws uniformly *with* replacement but refuses
        batches larger than itself, so draw ``ceil(batch_size / held)`` batches of ``held`` (each an
        independent uniform draw) and keep the first ``batch_size`` rows."""
        seed = int(np.random.randint(2**31 - 1))
        with self.store.sampler(held, prefetch=0, seed=seed, name=f"{SAMPLER_NAME}-fill", n_step=self.n_steps,
                                gamma=self.gamma) as smp:
            parts = [_copy_batch(smp.sample()) for _ in range(math.ceil(batch_size / held))]
        return _concat_batches(parts, batch_size)

    def _samples(self, b: Batch, batch_size: int, env) -> ReplayBufferSamples | DictReplayBufferSamples:
        obs, next_obs = self._observations(b.obs, batch_size), self._observations(b.next_obs, batch_size)
        if env is not None:  # VecNormalize
            obs, next_obs = self._normalize(obs, env), self._normalize(next_obs, env)
        dones = b.terminated if self.handle_timeout_termination else (b.terminated | b.truncated)
        rewards = b.reward.reshape(-1, 1).to(torch.float32)
        if env is not None:
            rewards = torch.as_tensor(self._normalize_reward(rewards.numpy(), env))
        discounts = None if b.discount is None else b.discount.reshape(-1, 1).to(torch.float32)
        # copy=True: the sampler reuses its host buffers for the next batch.
        to_dev = lambda t: None if t is None else t.to(self.device, copy=True)  # noqa: E731
        obs_dev = {k: to_dev(v) for k, v in obs.items()} if isinstance(obs, dict) else to_dev(obs)
        next_dev = {k: to_dev(v) for k, v in next_obs.items()} if isinstance(next_obs, dict) else to_dev(next_obs)
        actions = b.action.reshape(batch_size, -1)
        cls = DictReplayBufferSamples if isinstance(obs, dict) else ReplayBufferSamples
        data = [obs_dev, to_dev(actions), next_dev, to_dev(dones.to(torch.float32).reshape(-1, 1)),
                to_dev(rewards.to(torch.float32))]
        return cls(*data) if discounts is None else cls(*data, to_dev(discounts))  # SB3 < 2.7: no discounts

    def _observations(self, x, batch_size: int):
        """SB3's layout: channel-last stacks for VecFrameStack, ``obs_shape`` per key (Discrete: ``(1,)``)."""
        if isinstance(x, dict):
            return {k: v.reshape(batch_size, *self.obs_shape[k]) for k, v in x.items()}
        return self._layout(x).reshape(batch_size, *self.obs_shape)

    def _normalize(self, obs, env):
        if isinstance(obs, dict):
            out = self._normalize_obs({k: v.numpy() for k, v in obs.items()}, env)
            return {k: torch.as_tensor(v) for k, v in out.items()}
        return torch.as_tensor(self._normalize_obs(obs.numpy(), env))

    # -- frame stacks -------------------------------------------------------------------------------
    def _newest(self, obs):
        if isinstance(obs, dict):
            return {k: np.asarray(v).reshape(self.n_envs, *self._frame_space[k].shape) for k, v in obs.items()}
        obs = np.asarray(obs)
        if self.frame_stack == 1:
            return obs.reshape(self.n_envs, *self._frame_space.shape)
        return obs[:, -1] if self.stack_axis == 0 else obs[..., -1]

    def _layout(self, stacked: torch.Tensor) -> torch.Tensor:
        if self.frame_stack == 1 or self.stack_axis == 0:
            return stacked
        return stacked.movedim(1, -1)  # (B, k, H, W) -> (B, H, W, k): VecFrameStack's channel-last order


# -- saving and loading without pickle -----------------------------------------------------------------

def _buffer_from_json(text: str) -> MMReplayBuffer:
    """Rebuild a buffer from ``MMReplayBuffer.settings()`` (what SB3's pickle of a buffer holds)."""
    s = json.loads(text)
    if not isinstance(s, dict) or s.get("format") != SETTINGS_FORMAT:
        raise ValueError(f"not an mmreplay SB3 buffer description (expected format {SETTINGS_FORMAT!r}): {text[:200]}")
    if s.get("version") != SETTINGS_VERSION:
        raise ValueError(f"mmreplay SB3 buffer description version {s.get('version')!r}; this mmreplay reads "
                         f"version {SETTINGS_VERSION}")
    if _OPEN.get(_key(s["path"])) is None and not os.path.exists(os.path.join(s["path"], "zarr.json")):
        raise FileNotFoundError(f"the saved replay buffer names the store {s['path']!r}, which does not exist "
                                "(moved or deleted?); a buffer is never recreated empty on load")
    return MMReplayBuffer(s["buffer_size"], space_from_json(s["observation_space"]),
                          space_from_json(s["action_space"]), s["device"], s["n_envs"], False,
                          s["handle_timeout_termination"], path=s["path"], frame_stack=s["frame_stack"],
                          n_steps=s["n_steps"], gamma=s["gamma"], cache_bytes=s.get("cache_bytes"))


def save_replay_buffer(model, path: str | os.PathLike) -> str:
    """Like ``model.save_replay_buffer(path)``, as a plain JSON file (``.json`` added without a suffix):
    commits the store and records where it lives. Returns the file's path."""
    buffer = model.replay_buffer
    if not isinstance(buffer, MMReplayBuffer):
        raise TypeError(f"model.replay_buffer is a {type(buffer).__name__}, not an MMReplayBuffer")
    path = os.fspath(path)
    path = path if os.path.splitext(path)[1] else path + ".json"
    buffer.store.flush()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(buffer.settings(), f, indent=1)
    return path


def load_replay_buffer(model, path: str | os.PathLike) -> MMReplayBuffer:
    """Like ``model.load_replay_buffer(path)`` for a file written by ``save_replay_buffer``: the model's
    buffer becomes the store it names (adopted if this process has it open, else opened)."""
    path = os.fspath(path)
    if not os.path.exists(path) and os.path.exists(path + ".json"):
        path += ".json"
    with open(path) as f:
        buffer = _buffer_from_json(f.read())
    buffer.device = model.device
    model.replay_buffer = buffer
    return buffer


# -- helpers ---------------------------------------------------------------------------------------------

def _copy_batch(b: Batch) -> Batch:
    def copy(x):
        if isinstance(x, dict):
            return {k: copy(v) for k, v in x.items()}
        return x.clone() if isinstance(x, torch.Tensor) else x
    return Batch(**{f.name: copy(getattr(b, f.name)) for f in fields(b)})


def _concat_batches(parts: list[Batch], n: int) -> Batch:
    def cat(xs):
        if xs[0] is None:
            return None
        if isinstance(xs[0], dict):
            return {k: cat([x[k] for x in xs]) for k in xs[0]}
        return torch.cat(xs)[:n]
    return Batch(**{f.name: cat([getattr(p, f.name) for p in parts]) for f in fields(parts[0])})


def _one_int(space: spaces.Discrete) -> spaces.Box:
    start = int(space.start)
    return spaces.Box(start, start + int(space.n) - 1, (1,), np.int64)


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
    """What the store holds per step: the newest frame of a stack; a Dict's Discrete keys as SB3 shapes
    them, ``(1,)`` integers (mmreplay's vector ``extend`` does not take scalar-shaped Dict keys)."""
    if isinstance(space, spaces.Dict):
        return spaces.Dict({key: _one_int(sub) if isinstance(sub, spaces.Discrete) else sub
                            for key, sub in space.spaces.items()})
    if k == 1:
        return space
    low = space.low[0] if axis == 0 else space.low[..., 0]
    high = space.high[0] if axis == 0 else space.high[..., 0]
    return spaces.Box(low, high, dtype=space.dtype)
