"""A Stable-Baselines3 replay buffer backed by an on-disk store.

    env = VecFrameStack(make_atari_env("PongNoFrameskip-v4", n_envs=4), n_stack=4)
    DQN("CnnPolicy", env, replay_buffer_class=MMReplayBuffer,
        replay_buffer_kwargs=dict(path="runs/pong.mmr", n_steps=3, gamma=0.99))

Invariants:
- Every ``add`` of SB3's ``n_envs`` rows becomes one ``extend`` (sub-env ``i`` = stream ``i``);
  ``terminated`` and ``truncated`` are stored separately (SB3's ``TimeLimit.truncated`` info), and
  ``sample`` returns ``dones`` = terminated (with ``handle_timeout_termination``, SB3's default) or
  terminated | truncated — of the window's last step with n-step returns, with ``discounts`` = gamma**m.
- Stacks are never stored whole without a word: ``frame_stack`` left out is read from the model's env
  (its ``VecFrameStack``'s ``n_stack`` and frames, through a ``VecTransposeImage``), else from the store
  already at ``path``; observations that look like stacks with neither are refused with the arguments to
  pass; an explicit ``frame_stack`` that contradicts the env is refused, ``frame_stack=1`` warns.
- With ``frame_stack=k`` (``VecFrameStack``) only the newest frame of each stacked observation is stored
  — ``channels`` channels of the stacked axis, the first (``(k*c, H, W)``) or the last (``(H, W, k*c)``)
  — and stacks are rebuilt at sample time, zero-padded at episode starts, and laid out as
  ``VecFrameStack`` lays them out (oldest frame's channels first). A space whose stacking is ambiguous
  (``(84, 84, 3)``: one RGB frame or three grey ones?) is refused at construction; every ``add`` is
  checked to be exactly what the store will rebuild (the stack continues the previous step's next
  stack, or is zero-padded at an episode start; next stacks shift by one frame) before anything is
  stored. So a sampled observation is, bit for bit, the one the policy saw, or ``add`` raised.
- The store's path is absolute from construction; a buffer made by an SB3 algorithm writes it back into
  the model's ``replay_buffer_kwargs``, so ``model.save`` records it and ``DQN.load`` from any directory
  reopens the same store. A model that has trained (``num_timesteps > 0``) whose store is missing is an
  error naming the path, never a new empty buffer (unless ``create_if_missing=True``).
- A model's ``num_timesteps`` counts the transitions its buffer was given (every row of every ``add``). A
  checkpoint's model loaded onto a store that is ahead of it (the run went on, or crashed, after the
  checkpoint) rolls the store back to ``num_timesteps`` with ``rollback_to_checkpoint=True``; by default
  it only warns (loading an older checkpoint, say to evaluate it, must not delete what the store holds).
- One open ``Store`` per directory in this process: every buffer made for the same ``path`` (``DQN.load``,
  ``load_replay_buffer``, a copy) adopts it instead of reopening it (a second writer would hit the store's
  writer lock). The store is committed when a buffer is saved (``save_replay_buffer``, pickling), when
  another buffer adopts it, and closed (committed) when its last buffer is closed or garbage collected.
- Every ``model.save`` of the model the buffer was made for (``CheckpointCallback``'s too) commits the store,
  and the next ``add`` commits again: SB3 saves a checkpoint from its callbacks before it adds that step's
  transitions, so the newest checkpoint of ``num_timesteps`` steps has that many committed transitions.
- What SB3 pickles of a buffer (``save_replay_buffer``, ``copy.deepcopy``) is a JSON document of where the
  store lives and the buffer's settings — never transitions.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import warnings
import weakref
from dataclasses import fields
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.type_aliases import DictReplayBufferSamples, ReplayBufferSamples
from stable_baselines3.common.vec_env import VecFrameStack, VecTransposeImage

from mmreplay.columns.encode import cast_exact
from mmreplay.columns.spaces import space_from_json, space_to_json
from mmreplay.columns.spec import Schema
from mmreplay.errors import MMReplayError, StoreClosedError
from mmreplay.sampling.batch import Batch
from mmreplay.sampling.nstep import check_nstep
from mmreplay.sampling.strategy import NStep, Uniform
from mmreplay.storage.files import read_regular
from mmreplay.storage.durability.meta import read_meta
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
        # Frame stacks: stream -> (its last next stack's bytes in SB3's layout, whether that step ended the
        # episode), as this process's buffers added them; a stream not here is asked of the store.
        self.tails: dict[int, tuple[bytes, bool]] = {}
        # A model checkpoint was saved before the transitions of its own step were added (SB3 runs callbacks,
        # CheckpointCallback's model.save among them, before it stores that step): commit again after them.
        self.commit_after_add = False
        # Commit and release the writer lock once no buffer holds the handle (or at interpreter exit).
        self._finalizer = weakref.finalize(self, _close_quietly, store)

    def replace(self, store: Store) -> None:
        self._finalizer.detach()
        self.store = store
        self.tails.clear()
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
    only to its own buffer class, so give them in ``replay_buffer_kwargs``). ``frame_stack`` (read from the
    model's ``VecFrameStack`` when left out): the observations are ``VecFrameStack`` stacks of ``k``
    frames of ``channels`` channels each (inferred as the stacked axis's length / ``k`` unless ambiguous;
    3 for RGB), stacked on the first or last axis (``channels_order``, inferred unless both fit).
    ``create_if_missing``: None creates a missing store unless the buffer is made for a model that has
    already trained (``DQN.load``: the store must exist);
    True always creates, False never. ``rollback_to_checkpoint``: when ``DQN.load`` makes this buffer for
    a model of ``num_timesteps`` steps and the store holds more transitions (added after that checkpoint),
    drop them (``Store.rollback``) so that the resumed run's store matches the checkpoint exactly; False
    (the default) warns instead and keeps them. Other keyword arguments go to ``Store.create``
    (``reward_values``, ``frame_codec``, ``commit_every``, ...).

    What users must know: the buffer lives on disk and survives the process (pickling the buffer, as SB3's
    ``save_replay_buffer`` does, only commits the store and records its path); ``sample`` draws uniformly
    with replacement from the valid transitions; ``reset()`` deletes the store's contents.
    """

    def __init__(self, buffer_size: int, observation_space: spaces.Space, action_space: spaces.Space,
                 device: torch.device | str = "auto", n_envs: int = 1, optimize_memory_usage: bool = False,
                 handle_timeout_termination: bool = True, *, path: str | os.PathLike, frame_stack: int | None = None,
                 channels: int | None = None, channels_order: str | None = None, n_steps: int = 1,
                 gamma: float = 0.99, reward_values=None, cache_bytes: int | None = None,
                 create_if_missing: bool | None = None, rollback_to_checkpoint: bool = False, **store_kwargs: Any):
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
        self.path = os.path.abspath(os.fspath(path))  # DQN.load may run from another directory
        model = _model_being_set_up(self)
        frame_stack, channels, channels_order = _resolve_stacking(
            observation_space, frame_stack, channels, channels_order, None if model is None else model.env, self.path)
        self.frame_stack = int(frame_stack)
        self.n_steps, self.gamma = check_nstep(n_steps, gamma, name="n_steps")
        if self.n_steps > 1 and "discounts" not in ReplayBufferSamples._fields:
            raise RuntimeError(f"n_steps={self.n_steps} needs stable-baselines3 >= 2.7, whose algorithms read "
                               "ReplayBufferSamples.discounts; this one has no such field")
        if self.frame_stack > 1 and isinstance(observation_space, spaces.Dict):
            raise ValueError(f"frame_stack={self.frame_stack} with a Dict observation space: stacks are rebuilt "
                             "for one image observation (VecFrameStack on a Box); use frame_stack=1")
        self.channels_first, self.channels = _stack_layout(observation_space, self.frame_stack, channels,
                                                           channels_order)
        if self.frame_stack > 1:
            self._flat_layout = _FlatStack(self.obs_shape, self.frame_stack, self.channels, self.channels_first,
                                           np.dtype(observation_space.dtype).itemsize)
        self._frame_space = _frame_space(observation_space, self.frame_stack, self.channels_first, self.channels)
        self._open_kwargs = {} if cache_bytes is None else {"cache_bytes": int(cache_bytes)}
        self._create_kwargs = dict(reward_values=reward_values, **store_kwargs)
        if model is not None:  # what model.save records: the store's absolute path (not the caller's cwd) and
            # the stacking found from the env (DQN.load may have no env to find it in)
            stacking = {"frame_stack": self.frame_stack}
            if self.frame_stack > 1:
                stacking.update(channels=self.channels, channels_order="first" if self.channels_first else "last")
            model.replay_buffer_kwargs = {**model.replay_buffer_kwargs, "path": self.path, **stacking}
            commit_on_save(model)
        if create_if_missing is None:
            create_if_missing = model is None or model.num_timesteps == 0
        self._shared = _adopt(self.path) or self._open_or_create(os.fspath(path), bool(create_if_missing))
        self._check_matches(self.store)
        self._shared.buffers.add(self)
        self._sampler = None
        self._enough_for = 0  # the largest batch size the store is known to hold (it only grows)
        if model is not None and model.num_timesteps > 0:  # DQN.load: the store may be ahead of the checkpoint
            match_checkpoint(self, model.num_timesteps, bool(rollback_to_checkpoint))

    @property
    def store(self) -> Store:
        return self._shared.store

    def _open_or_create(self, given: str, create: bool) -> _SharedStore:
        if os.path.exists(os.path.join(self.path, "zarr.json")):
            store = Store.open(self.path, **self._open_kwargs)
        elif not create:
            raise FileNotFoundError(
                f"no replay store at {self.path!r} (path={given!r}, working directory {os.getcwd()!r}): the model "
                "has trained with a store that is not there (moved or deleted, or a relative path saved by an "
                "older mmreplay and loaded from another directory). A trained model never gets a new empty "
                "buffer in its place: load it from the training directory, or pass the store's absolute path "
                "with custom_objects={'replay_buffer_kwargs': {..., 'path': ...}}; to start an empty store on "
                "purpose add 'create_if_missing': True")
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
                             f"{self.frame_stack}: pass the frame_stack (and channels) the store was made with, "
                             "or leave them out to take the store's, or give a new path")
        if self.frame_stack > 1 and store.schema.stack_padding != "zeros":
            raise ValueError(f"store {self.path!r} pads stacks with {store.schema.stack_padding!r}; VecFrameStack "
                             "pads with zeros, so its stacks would differ from what the policy saw at episode "
                             "starts: use a store made with stack_padding='zeros'")
        if store.action_space != self.action_space:
            raise ValueError(f"store {self.path!r} holds actions of {store.action_space}; this buffer needs "
                             f"{self.action_space}")

    # -- SB3's buffer API -----------------------------------------------------------------------------
    def add(self, obs, next_obs, action: np.ndarray, reward: np.ndarray, done: np.ndarray,
            infos: list[dict[str, Any]]) -> None:
        truncated = np.array([bool(info.get("TimeLimit.truncated", False)) for info in infos])
        done = np.asarray(done, dtype=bool).reshape(self.n_envs)
        action = np.asarray(action).reshape(self.n_envs, *self.store.schema.action.shape)
        if self.frame_stack > 1:
            dtype = np.dtype(self.observation_space.dtype)  # the checks compare bytes: the stored dtype's
            obs, next_obs = (np.ascontiguousarray(cast_exact(np.asarray(x), dtype, what)).reshape(self.n_envs, -1)
                             for x, what in ((obs, "obs"), (next_obs, "next_obs")))
            self._check_stacks(obs, next_obs)
        self.store.extend(self._newest(obs), action, np.asarray(reward, dtype=np.float32).reshape(self.n_envs),
                          self._newest(next_obs), done & ~truncated, done & truncated)
        if self.frame_stack > 1:
            for i in range(self.n_envs):
                self._shared.tails[i] = (next_obs[i].tobytes(), bool(done[i]))
        if self._shared.commit_after_add:  # the checkpoint's step is complete: its store holds num_timesteps
            self._shared.commit_after_add = False
            self.store.flush()

    def checkpoint(self) -> None:
        """A model checkpoint is being saved: commit the store now, and again after the next ``add`` (the
        transitions of the checkpoint's own step, which SB3 adds after running the callbacks), so that the
        newest checkpoint never has fewer committed transitions behind it than its ``num_timesteps``."""
        self.store.flush()
        self._shared.commit_after_add = True

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
                "frame_stack": self.frame_stack, "channels": self.channels,
                "channels_order": "first" if self.channels_first else "last", "n_steps": self.n_steps,
                "gamma": self.gamma, "device": str(self.device), **self._open_kwargs}

    def __reduce__(self):
        self.checkpoint()  # saving the buffer = committing the store (again after this step's add)
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
            seed = None if self.store.inspect.has_sampler_state(SAMPLER_NAME) else int(np.random.randint(2**31 - 1))
            self._sampler = self.store.sampler(batch_size, self._draw(), prefetch=0, seed=seed, name=SAMPLER_NAME)
            self._sampler_store = self.store
        return self._sampler

    def _draw(self) -> Uniform | NStep:
        """The draw strategy of this buffer's batches: uniform transitions, with n-step returns for ``n_steps``."""
        return NStep(self.n_steps, self.gamma) if self.n_steps > 1 else Uniform()

    def _draw_from_few(self, batch_size: int, held: int) -> Batch:
        """``batch_size`` > ``held`` transitions: the store draws uniformly *with* replacement but refuses
        batches larger than itself, so draw ``ceil(batch_size / held)`` batches of ``held`` (each an
        independent uniform draw) and keep the first ``batch_size`` rows."""
        seed = int(np.random.randint(2**31 - 1))
        with self.store.sampler(held, self._draw(), prefetch=0, seed=seed, name=f"{SAMPLER_NAME}-fill") as smp:
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
    # A stack in SB3's layout is viewed as (k, *frame): channels first, (k*c, H, W) is (k, c, H, W) as it
    # is; channels last, (H, W, k*c) is (H, W, k, c) with the k axis moved to the front. Single-channel
    # frames are (H, W), as the store has always held them.
    def _stacks(self, obs) -> np.ndarray:
        """Stacks ``(n, *obs_shape)`` as ``(n, k, *frame)`` views."""
        obs = np.asarray(obs).reshape(-1, *self.obs_shape)
        k, c = self.frame_stack, self.channels
        if self.channels_first:
            return obs.reshape(obs.shape[0], k, *((c,) if c > 1 else ()), *obs.shape[2:])
        frames = np.moveaxis(obs.reshape(*obs.shape[:-1], k, c), -2, 1)  # (n, k, H, W, c)
        return frames if c > 1 else frames[..., 0]

    def _newest(self, obs):
        if isinstance(obs, dict):
            return {k: np.asarray(v).reshape(self.n_envs, *self._frame_space[k].shape) for k, v in obs.items()}
        if self.frame_stack == 1:
            return np.asarray(obs).reshape(self.n_envs, *self._frame_space.shape)
        return self._stacks(obs)[:, -1]

    def _check_stacks(self, obs: np.ndarray, next_obs: np.ndarray) -> None:
        """Refuse (before anything is stored) stacks the store would not rebuild bit for bit: a stack must
        be the previous next stack when the store continues the episode (same newest frame, episode not
        ended), else zeros before its newest frame; a next stack is the stack shifted by one frame.
        ``obs``/``next_obs``: ``(n_envs, -1)`` bytes of the stacks in SB3's layout."""
        layout = self._flat_layout
        for i in range(self.n_envs):
            tail = self._shared.tails.get(i) or self._store_tail(i)
            continued = tail is not None and not tail[1]
            if not (continued and obs[i].tobytes() == tail[0]):  # (the usual step: one memcmp)
                if continued and layout.same_newest(obs[i], np.frombuffer(tail[0], np.uint8)):
                    self._refuse(i, "differs from the previous step's next observation although its newest "
                                    "frame is the same and the episode did not end")
                if not layout.padded(obs[i]):
                    self._refuse(i, f"starts an episode but its {self.frame_stack - 1} older frames are not "
                                    "all zero (VecFrameStack pads with zeros)")
            if not layout.one_frame_on(obs[i], next_obs[i]):
                self._refuse(i, "and its next observation are not one frame apart (the next stack must be the "
                                "stack without its oldest frame, then the new frame)")

    def _store_tail(self, i: int) -> tuple[bytes, bool] | None:
        """Stream ``i``'s last next stack and end flag as the store holds them (a reopened store), or None
        when the store would start a new episode whatever comes."""
        tail = self.store.inspect.stream_tail(i)
        if tail is None or tail[1]:
            return None
        try:
            stack = self.store.inspect.get([tail[0]]).next_obs  # zero-padded as sampled
        except IndexError:  # its frames were overwritten since: the store starts a new episode
            return None
        self._shared.tails[i] = (self._layout(stack).numpy().tobytes(), False)
        return self._shared.tails[i]

    def _refuse(self, i: int, what: str) -> None:
        raise ValueError(
            f"add: the observation of sub-env {i} {what}; it is not a VecFrameStack stack of {self.frame_stack} "
            f"frames of {self.channels} channel(s) stacked on the {'first' if self.channels_first else 'last'} axis "
            f"of {self.obs_shape}, so the store could not return it as the policy saw it (nothing was stored). "
            "Without VecFrameStack pass frame_stack=1; with VecFrameStack(n_stack=n) on frames of c channels "
            "pass frame_stack=n, channels=c")

    def _layout(self, stacked: torch.Tensor) -> torch.Tensor:
        """``(B, k, *frame)`` stacks from the store in SB3's layout: the frames' channels concatenated,
        oldest first, on the first axis ``(B, k*c, H, W)`` or the last ``(B, H, W, k*c)``."""
        if self.frame_stack == 1:
            return stacked
        b = stacked.shape[0]
        if self.channels_first:
            return stacked.reshape(b, -1, *stacked.shape[-2:])
        frames = stacked if self.channels > 1 else stacked.unsqueeze(-1)  # (B, k, H, W, c)
        return frames.movedim(1, -2).reshape(b, *frames.shape[2:-1], -1)


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
                          # files written before `channels` existed: single-channel frames, as then
                          channels=s.get("channels", 1) if s["frame_stack"] > 1 else None,
                          channels_order=s.get("channels_order"), n_steps=s["n_steps"], gamma=s["gamma"],
                          cache_bytes=s.get("cache_bytes"))


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


def load_replay_buffer(model, path: str | os.PathLike, *, rollback_to_checkpoint: bool = False) -> MMReplayBuffer:
    """Like ``model.load_replay_buffer(path)`` for a file written by ``save_replay_buffer``: the model's
    buffer becomes the store it names (adopted if this process has it open, else opened). A store ahead
    of the model's ``num_timesteps`` is rolled back to it with ``rollback_to_checkpoint=True``, else a
    warning says by how much."""
    path = os.fspath(path)
    if not os.path.exists(path) and os.path.exists(path + ".json"):
        path += ".json"
    buffer = _buffer_from_json(read_regular(path, 1 << 24).decode())  # never a FIFO or /dev/zero: bounded
    buffer.device = model.device
    model.replay_buffer = buffer
    commit_on_save(model)
    if model.num_timesteps > 0:
        match_checkpoint(buffer, model.num_timesteps, rollback_to_checkpoint)
    return buffer


def rollback_to_checkpoint(model) -> int:
    """Roll the store of ``model.replay_buffer`` back to ``model.num_timesteps`` transitions (after
    ``DQN.load`` of a checkpoint older than the store); returns how many were dropped."""
    buffer = model.replay_buffer
    if not isinstance(buffer, MMReplayBuffer):
        raise TypeError(f"model.replay_buffer is a {type(buffer).__name__}, not an MMReplayBuffer")
    return match_checkpoint(buffer, model.num_timesteps, True)


def match_checkpoint(buffer: MMReplayBuffer, num_timesteps: int, roll_back: bool) -> int:
    """Compare the store with a model of ``num_timesteps`` steps (each step added one transition per
    sub-env): roll a store that is ahead back to it (``roll_back``) or warn; warn when it is behind (the
    steps after its last commit were lost). Returns the transitions dropped."""
    store, steps = buffer.store, int(num_timesteps)
    held = store.num_added
    if held > steps and roll_back:
        for other in [buffer, *buffer._shared.buffers]:  # their samplers hold positions being dropped
            if other._sampler is not None:
                other._sampler.close()
                other._sampler = None
            other._enough_for = 0
        try:
            dropped = store.rollback(steps)
        except ValueError as exc:
            raise ValueError(f"store {buffer.path!r} cannot go back to the checkpoint's num_timesteps={steps}: "
                             f"{exc}") from None
        buffer._shared.tails.clear()  # every stream starts a new episode (Store.rollback)
        return dropped
    if held > steps:
        warnings.warn(f"mmreplay: store {buffer.path!r} holds {held} transitions ever added, {held - steps} more "
                      f"than the model's num_timesteps={steps} (added after this checkpoint); training on "
                      "collects those steps again. To resume exactly from the checkpoint pass "
                      "rollback_to_checkpoint=True in replay_buffer_kwargs (or to load_replay_buffer), or call "
                      "mmreplay.integrations.sb3.rollback_to_checkpoint(model)", RuntimeWarning, stacklevel=3)
    elif held < steps:
        warnings.warn(f"mmreplay: store {buffer.path!r} holds {held} transitions ever added, {steps - held} fewer "
                      f"than the model's num_timesteps={steps}: the steps after its last commit were lost "
                      "(killed between the checkpoint's save and its own step's add, or a model saved without "
                      "this buffer?); training continues without them",
                      RuntimeWarning, stacklevel=3)
    return 0


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


def _resolve_stacking(space: spaces.Space, frame_stack: int | None, channels: int | None,
                      channels_order: str | None, env, path: str) -> tuple[int, int | None, str | None]:
    """``(frame_stack, channels, channels_order)`` for observations ``space``: from the env's
    ``VecFrameStack`` when there is one (an explicit ``frame_stack`` must agree with it), else from the
    store already at ``path``, else ``frame_stack=1`` — unless there is no env to tell and the space looks
    like stacks (then refused: storing them whole would take ``k`` times the disk without a word)."""
    if frame_stack is not None and (isinstance(frame_stack, bool) or int(frame_stack) != frame_stack
                                    or frame_stack < 1):
        raise ValueError(f"frame_stack must be a positive integer (VecFrameStack's n_stack), got {frame_stack!r}")
    found = _env_frame_stack(env)
    stored = _stored_stacking(space, path) if frame_stack is None else None
    if stored is not None:  # a store made before (by an older mmreplay, maybe): its layout, as it was made
        if found is not None and stored[0] == 1 and found[0] > 1:
            warnings.warn(f"mmreplay: store {path!r} holds whole VecFrameStack(n_stack={found[0]}) stacks ({found[0]}x "
                          "the disk of single frames, as made before mmreplay read frame_stack from the env); a new "
                          "store (another path) stores each frame once", RuntimeWarning, stacklevel=4)
        return stored
    if found is not None:
        return _from_env_stacking(space, frame_stack, channels, channels_order, *found)
    if frame_stack is not None:
        return frame_stack, channels, channels_order
    guess = _stack_guess(space) if env is None else None  # an env without VecFrameStack: its own channels
    if guess is not None:
        raise ValueError(
            f"the observation space {space.shape} looks like VecFrameStack's stacks of {guess[0]} frame(s) of "
            f"{guess[1]} channel(s) (it has {guess[0] * guess[1]} on its channel axis), which the buffer would store "
            f"whole ({guess[0]}x the disk): pass frame_stack={guess[0]}, channels={guess[1]} to store single frames "
            "(or frame_stack=1 if each observation really is one frame)")
    return 1, channels, channels_order


def _env_frame_stack(env) -> tuple[int, spaces.Space, int | None, bool] | None:
    """``(n_stack, the frames' space, channels per frame, stacked on the first axis as the buffer sees it)``
    of the ``VecFrameStack`` in ``env``'s wrappers, None without one. A ``VecTransposeImage`` above it (SB3 adds
    one for channel-last images) moves the stacked channels to the first axis."""
    transposed = False
    for _ in range(64):  # a chain of VecEnvWrappers (VecNormalize, VecMonitor, ...) over the VecEnv
        if env is None:
            return None
        if isinstance(env, VecFrameStack):
            stacked, frame_space = env.stacked_obs, env.venv.observation_space
            if not hasattr(stacked, "repeat_axis"):  # a Dict space: stacked per key
                return int(stacked.n_stack), frame_space, None, False
            first = bool(stacked.channels_first) or transposed
            return int(stacked.n_stack), frame_space, int(frame_space.shape[stacked.repeat_axis]), first
        transposed = transposed or isinstance(env, VecTransposeImage)
        env = getattr(env, "venv", None)
    return None


def _from_env_stacking(space, frame_stack, channels, channels_order, n_stack, frame_space, c,
                       first) -> tuple[int, int | None, str | None]:
    """The stacking of the env's ``VecFrameStack(n_stack)`` over frames ``frame_space``; the user's
    arguments must say the same (or be left out)."""
    if not (isinstance(frame_space, spaces.Box) and len(frame_space.shape) == 3):
        if frame_stack is None or frame_stack == 1:
            warnings.warn(f"mmreplay: VecFrameStack(n_stack={n_stack}) over {frame_space} (not an image with a "
                          f"channel axis): the buffer stores each stack whole, {n_stack}x the disk of single frames; "
                          "give the frames a channel axis ((H, W, 1)) to store each frame once", RuntimeWarning,
                          stacklevel=4)
            return 1, channels, channels_order
        raise ValueError(f"frame_stack={frame_stack} with VecFrameStack(n_stack={n_stack}) over {frame_space}: "
                         "single frames are stored for stacks of images (H, W, c) or (c, H, W) only; pass "
                         "frame_stack=1 (each stack stored whole)")
    order = "first" if first else "last"
    fix = f"pass frame_stack={n_stack}, channels={c} (or leave both out: they are read from the env)"
    what = f"the env's VecFrameStack(n_stack={n_stack}) stacks frames of {c} channel(s) into {space.shape}"
    if frame_stack == 1:
        warnings.warn(f"mmreplay: frame_stack=1 while {what}: the buffer stores each stack whole, {n_stack}x the "
                      f"disk; to store each frame once {fix}", RuntimeWarning, stacklevel=4)
        return 1, channels, channels_order
    if frame_stack not in (None, n_stack) or channels not in (None, c) or channels_order not in (None, order):
        given = ", ".join(f"{k}={v!r}" for k, v in (("frame_stack", frame_stack), ("channels", channels),
                                                   ("channels_order", channels_order)) if v is not None)
        raise ValueError(f"{given} does not match what the buffer is given: {what}; {fix}")
    return n_stack, c, order


def _stored_stacking(space: spaces.Space, path: str) -> tuple[int, int | None, str | None] | None:
    """The stacking of the store already at ``path`` (a buffer made again for it without arguments), or
    None: none there, or it does not hold frames of ``space``."""
    shared = _OPEN.get(_key(path))
    if shared is not None:
        schema = shared.store.schema
    elif os.path.exists(os.path.join(path, "zarr.json")):
        try:
            schema = Schema.from_json(read_meta(path)["schema"])
        except (OSError, ValueError, MMReplayError):  # unreadable: opening it for writing says why
            return None
    else:
        return None
    k = schema.frame_stack
    frame_shape = schema.spaces()[0].shape if schema.observation_space else None
    if k == 1:
        return (1, None, None) if frame_shape == space.shape else None
    for order in ("first", "last"):
        try:
            first, c = _stack_layout(space, k, None, order)
        except ValueError:
            continue
        if isinstance(space, spaces.Box) and _frame_space(space, k, first, c).shape == frame_shape:
            return k, c, order
    return None


def _stacking_fix(space: spaces.Space) -> str:
    """What to pass for observations ``space``, from its shape alone."""
    guess = _stack_guess(space)
    if guess is not None:
        return (f"it looks like VecFrameStack(n_stack={guess[0]}) of {'RGB' if guess[1] == 3 else 'grey'} frames: "
                f"pass frame_stack={guess[0]}, channels={guess[1]}")
    return ("pass frame_stack=n_stack and channels=c (3 for RGB) of the VecFrameStack that made these observations, "
            "or frame_stack=1 without one")


def _stack_guess(space: spaces.Space) -> tuple[int, int] | None:
    """``(k, c)`` when ``space`` looks like ``VecFrameStack(k)`` stacks of ``c``-channel image frames: a
    uint8 image whose channel axis (the smaller of the first and last, smaller than the image's sides)
    holds neither 1 (grey) nor 3 (RGB) channels; None otherwise."""
    if not (isinstance(space, spaces.Box) and np.dtype(space.dtype) == np.uint8 and len(space.shape) == 3):
        return None
    shape = space.shape
    axis = 0 if shape[0] < shape[-1] else 2
    length = shape[axis]
    if length in (1, 3) or length >= min(d for i, d in enumerate(shape) if i != axis):
        return None
    return (length // 3, 3) if length % 3 == 0 else (length, 1)


def _stack_layout(space: spaces.Space, k: int, channels: int | None,
                  channels_order: str | None) -> tuple[bool, int]:
    """``(channels_first, channels)`` of ``VecFrameStack(n_stack=k)`` observations ``space``: which axis
    holds the ``k * channels`` stacked channels. Refuses what cannot be mapped exactly, or only by a guess."""
    if channels_order not in (None, "first", "last"):
        raise ValueError(f"channels_order must be 'first', 'last' or None (inferred), got {channels_order!r}")
    if k == 1:
        if channels is not None:
            raise ValueError(f"channels={channels} with frame_stack=1: channels describe the frames of a "
                             "VecFrameStack stack, and with frame_stack=1 each observation is stored whole; pass "
                             "frame_stack=n_stack with it, or leave channels out")
        return True, 1
    if not isinstance(space, spaces.Box) or len(space.shape) != 3:
        raise ValueError(f"frame_stack={k} with observations {space}: single frames are stored for stacked image "
                         "Box observations (k*c, H, W) or (H, W, k*c) only; pass frame_stack=1 (each observation "
                         "stored whole)")
    if channels is not None and (isinstance(channels, bool) or int(channels) != channels or channels < 1):
        raise ValueError(f"channels must be a positive integer (channels per frame: 1 grey, 3 RGB), got {channels!r}")
    fits = [axis for axis in (0, 2) if channels_order in (None, ("first", None, "last")[axis])
            and space.shape[axis] % k == 0 and (channels is None or space.shape[axis] == k * channels)]
    what = f"frame_stack={k}" + ("" if channels is None else f", channels={channels}")
    if channels is None:  # only the axis VecFrameStack stacks on: (84, 84, 4) is never 3 frames of (28, 84, 4)
        fits = [axis for axis in fits if _frame_channel_axis(space.shape, k, axis) == axis]
    if not fits:
        where = {None: "the first or the last axis", "first": "the first axis", "last": "the last axis"}[channels_order]
        raise ValueError(f"{what} does not fit observations of shape {space.shape}: {where} must hold the stacked "
                         f"channels, k*c of them (VecFrameStack(n_stack=k) of c-channel frames); "
                         f"{_stacking_fix(space)}")
    if len(fits) == 2:
        # Keep the axes VecFrameStack itself would have stacked on (its image test: the frame's smallest axis
        # holds the channels), then those that make grey or RGB frames: (84, 84, 4) is 4 grey frames, not
        # frames of (21, 84, 4).
        fits = [axis for axis in fits if _frame_channel_axis(space.shape, k, axis) == axis] or fits
        if len(fits) == 2:
            fits = [axis for axis in fits if space.shape[axis] // k in (1, 3)] or fits
        if len(fits) != 1:
            raise ValueError(f"{what}: both the first and the last axis of {space.shape} could hold the stacked "
                             "channels; pass channels=c (3 for RGB) and channels_order='first' or 'last' "
                             "(VecFrameStack's channels_order)")
    axis = fits[0]
    length = space.shape[axis]
    if channels is None and length % 3 == 0 and (length // k) % 3 != 0:
        # a colour frame's 3 channels would be split across frames: grey stacks and RGB look alike
        hint = ("one RGB frame (no VecFrameStack): pass frame_stack=1" if length == 3 else
                f"VecFrameStack(n_stack={length // 3}) of RGB frames: pass frame_stack={length // 3}, channels=3")
        raise ValueError(f"frame_stack={k}: the observation shape {space.shape} looks like {hint}; if it really "
                         f"is VecFrameStack(n_stack={k}) of frames of {length // k} channel(s), pass "
                         f"channels={length // k}")
    return axis == 0, length // k


def _frame_channel_axis(shape: tuple[int, ...], k: int, axis: int) -> int:
    """The channel axis VecFrameStack finds in the frame that ``shape`` implies (its ``axis`` divided by
    ``k``): its test for images, the smallest axis (0 if first, else 2, the last)."""
    frame = list(shape)
    frame[axis] //= k
    return 0 if int(np.argmin(frame)) == 0 else 2


class _FlatStack:
    """Where the frames of a stack in SB3's layout lie in its flat bytes: channels first, frame ``j`` is
    bytes ``[j*f, (j+1)*f)``; channels last, pixel ``p``'s ``k*c`` values are consecutive and frame ``j``
    holds ``[p*K + j*c, p*K + (j+1)*c)``. Either way the next stack is the stack ``s`` bytes on (one frame,
    or one frame's channels), which makes the checks contiguous compares."""

    def __init__(self, shape: tuple[int, ...], k: int, c: int, channels_first: bool, itemsize: int):
        n = int(np.prod(shape)) * itemsize
        row = n if channels_first else shape[-1] * itemsize  # bytes holding all k frames' channels
        self.shift = row // k  # bytes from one frame's value to the next frame's
        older = np.arange(n) % row < row - self.shift  # bytes of the k-1 older frames
        self.all_older = bool(channels_first)
        self.older = older.view(np.uint8) * np.uint8(255)  # a byte mask
        self.newest = ~older
        self.ignored = ~older[: n - self.shift]  # next-stack bytes of the new frame: nothing to compare

    def padded(self, x: np.ndarray) -> bool:
        """Are the older frames all zero (VecFrameStack's padding at an episode start)?"""
        x = x.view(np.uint8)
        return not (x[: x.size - self.shift].any() if self.all_older else (x & self.older).any())

    def one_frame_on(self, x: np.ndarray, nxt: np.ndarray) -> bool:
        """Is ``nxt``'s every older frame ``x``'s next frame?"""
        x, nxt, s = x.view(np.uint8), nxt.view(np.uint8), self.shift
        if self.all_older:
            return nxt[: nxt.size - s].tobytes() == x[s:].tobytes()
        return bool(((nxt[: nxt.size - s] == x[s:]) | self.ignored).all())

    def same_newest(self, x: np.ndarray, y: np.ndarray) -> bool:
        x, y = x.view(np.uint8), y.view(np.uint8)
        return bool(np.array_equal(x[self.newest], y[self.newest]))


def commit_on_save(model: OffPolicyAlgorithm) -> None:
    """Make every ``model.save`` (``CheckpointCallback``'s, ``EvalCallback``'s best model, the user's) commit
    the store of ``model.replay_buffer`` (``MMReplayBuffer.checkpoint``): a checkpoint then never points
    past what survives a crash. SB3's ``save`` asks ``_excluded_save_params()`` first, and nothing else does:
    this model's own version of it commits, then names itself so that ``save`` does not store it."""
    if getattr(model.__dict__.get("_excluded_save_params"), "mmreplay_commits", False):
        return
    excluded = type(model)._excluded_save_params
    model_ref = weakref.ref(model)  # the model holds this function: no cycle through it

    def excluded_save_params() -> list[str]:
        saved = model_ref()
        buffer = getattr(saved, "replay_buffer", None)
        if isinstance(buffer, MMReplayBuffer):
            buffer.checkpoint()
        return [*excluded(saved), "_excluded_save_params"]

    excluded_save_params.mmreplay_commits = True
    model._excluded_save_params = excluded_save_params


def _model_being_set_up(buffer: MMReplayBuffer) -> OffPolicyAlgorithm | None:
    """The SB3 algorithm whose ``_setup_model`` is making ``buffer``, if any. SB3 hands a buffer no
    reference to its model, and the model's ``replay_buffer_kwargs`` are what ``model.save`` records and
    ``DQN.load`` builds the buffer from again: the caller's frame is the one place to find it."""
    frame = sys._getframe(1)
    for _ in range(8):  # __init__ of subclasses of MMReplayBuffer in between
        frame = frame.f_back
        if frame is None:
            return None
        model = frame.f_locals.get("self")
        if (isinstance(model, OffPolicyAlgorithm) and frame.f_code.co_name == "_setup_model"
                and model.replay_buffer is None and isinstance(model.replay_buffer_kwargs, dict)):
            return model
    return None


def _frame_space(space: spaces.Space, k: int, channels_first: bool, channels: int) -> spaces.Space:
    """What the store holds per step: one frame of a stack (``(H, W)`` for one channel, else ``(c, H, W)``
    or ``(H, W, c)``); a Dict's Discrete keys as SB3 shapes them, ``(1,)`` integers (mmreplay's vector
    ``extend`` does not take scalar-shaped Dict keys)."""
    if isinstance(space, spaces.Dict):
        return spaces.Dict({key: _one_int(sub) if isinstance(sub, spaces.Discrete) else sub
                            for key, sub in space.spaces.items()})
    if k == 1:
        return space
    # VecFrameStack's bounds are np.repeat(frame_bounds, k, axis): each channel's bound k times in a row.
    axis = 0 if channels_first else -1
    every_kth = np.arange(0, k * channels, k)
    low, high = (np.take(b, every_kth, axis=axis) for b in (space.low, space.high))
    if channels == 1:
        low, high = (np.take(b, 0, axis=axis) for b in (low, high))
    return spaces.Box(low, high, dtype=space.dtype)
