"""``MMReplayBuffer``: SB3's ``ReplayBuffer`` API over an on-disk store, and its commits at model checkpoints.

Invariants:
- Every ``add`` of SB3's ``n_envs`` rows becomes one ``extend`` (sub-env ``i`` = stream ``i``);
  ``terminated`` and ``truncated`` are stored separately (SB3's ``TimeLimit.truncated`` info), and
  ``sample`` returns ``dones`` = terminated (with ``handle_timeout_termination``, SB3's default) or
  terminated | truncated — of the window's last step with n-step returns, with ``discounts`` = gamma**m.
- With ``frame_stack=k`` only the newest frame of each stacked observation is stored, every ``add`` is
  checked first (``sb3_frames.FrameStacks``), and sampled stacks are rebuilt in ``VecFrameStack``'s layout.
- The store's path is absolute from construction; a buffer made by an SB3 algorithm writes it (and the
  stacking found) back into the model's ``replay_buffer_kwargs``, so ``model.save`` records it. A model that
  has trained (``num_timesteps > 0``) whose store is missing is an error naming the path, never a new empty
  buffer (unless ``create_if_missing=True``); a store ahead of the model's ``num_timesteps`` is rolled back
  to it with ``rollback_to_checkpoint=True``, else a warning says by how much.
- Every ``model.save`` of the model the buffer was made for commits the store, and the next ``add`` commits
  again (SB3 saves checkpoints from its callbacks before it adds that step's transitions), so the newest
  checkpoint of ``num_timesteps`` steps has that many committed transitions.
- What SB3 pickles of a buffer (``save_replay_buffer``, ``copy.deepcopy``) is a JSON document of where the
  store lives and the buffer's settings, never transitions; pickles name ``mmreplay.integrations.sb3``.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings
import weakref
from dataclasses import fields
from typing import Any

import numpy as np
import torch
from gymnasium import spaces
from stable_baselines3.common.buffers import BaseBuffer, ReplayBuffer
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.type_aliases import (
    DictReplayBufferSamples,
    ReplayBufferSamples,
)

from mmreplay.columns.encode import cast_exact
from mmreplay.columns.spaces import space_from_json, space_to_json
from mmreplay.integrations.sb3_frames import FrameStacks
from mmreplay.integrations.sb3_shared import OPEN, SharedStore, adopt, store_key
from mmreplay.integrations.sb3_stacking import (
    model_being_set_up,
    resolve_stacking,
    stack_layout,
    store_frame_space,
)
from mmreplay.sampling.batch import Batch
from mmreplay.sampling.nstep import check_nstep
from mmreplay.sampling.strategy import NStep, Uniform
from mmreplay.store import Store

SETTINGS_FORMAT = "mmreplay.sb3-buffer"
SETTINGS_VERSION = 1
SAMPLER_NAME = "sb3"
# HerReplayBuffer's own arguments: passing them here means the user expects goal relabelling.
HER_KWARGS = ("goal_selection_strategy", "n_sampled_goal", "copy_info_dict", "env")
# Pickles name a function or class by its module: SB3's save_replay_buffer files (a buffer pickles to
# _buffer_from_json) and model.save's replay_buffer_class name the public module, as before the split.
PUBLIC_MODULE = "mmreplay.integrations.sb3"


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
        model = model_being_set_up(self)
        frame_stack, channels, channels_order = resolve_stacking(
            observation_space, frame_stack, channels, channels_order, None if model is None else model.env, self.path)
        self.frame_stack = int(frame_stack)
        self.n_steps, self.gamma = check_nstep(n_steps, gamma, name="n_steps")
        if self.n_steps > 1 and "discounts" not in ReplayBufferSamples._fields:
            raise RuntimeError(f"n_steps={self.n_steps} needs stable-baselines3 >= 2.7, whose algorithms read "
                               "ReplayBufferSamples.discounts; this one has no such field")
        if self.frame_stack > 1 and isinstance(observation_space, spaces.Dict):
            raise ValueError(f"frame_stack={self.frame_stack} with a Dict observation space: stacks are rebuilt "
                             "for one image observation (VecFrameStack on a Box); use frame_stack=1")
        self.channels_first, self.channels = stack_layout(observation_space, self.frame_stack, channels,
                                                          channels_order)
        self._frame_stacks = FrameStacks(self.obs_shape, self.frame_stack, self.channels, self.channels_first,
                                         np.dtype(observation_space.dtype).itemsize) if self.frame_stack > 1 else None
        self._frame_space = store_frame_space(observation_space, self.frame_stack, self.channels_first, self.channels)
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
        self._shared = adopt(self.path) or self._open_or_create(os.fspath(path), bool(create_if_missing))
        self._check_matches(self.store)
        self._shared.buffers.add(self)
        self._sampler = None
        self._enough_for = 0  # the largest batch size the store is known to hold (it only grows)
        if model is not None and model.num_timesteps > 0:  # DQN.load: the store may be ahead of the checkpoint
            match_checkpoint(self, model.num_timesteps, bool(rollback_to_checkpoint))

    @property
    def store(self) -> Store:
        return self._shared.store

    def _open_or_create(self, given: str, create: bool) -> SharedStore:
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
        shared = SharedStore(store)
        OPEN[store_key(self.path)] = shared
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
            self._frame_stacks.check(obs, next_obs, lambda i: self._shared.tails.get(i) or self._store_tail(i))
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
        settings = {"capacity": old.capacity, "frame_stack": schema.frame_stack, "stack_padding": schema.stack_padding,
                    "extras": schema.extras, "columns": columns, "settings": old.settings}
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
            if OPEN.get(store_key(self.path)) is self._shared:
                del OPEN[store_key(self.path)]

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

    def _newest(self, obs):
        if isinstance(obs, dict):
            return {k: np.asarray(v).reshape(self.n_envs, *self._frame_space[k].shape) for k, v in obs.items()}
        if self.frame_stack == 1:
            return np.asarray(obs).reshape(self.n_envs, *self._frame_space.shape)
        return self._frame_stacks.frames(obs)[:, -1]

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

    def _layout(self, stacked: torch.Tensor) -> torch.Tensor:
        """``(B, k, *frame)`` stacks from the store in SB3's layout (``FrameStacks.to_sb3``)."""
        return stacked if self.frame_stack == 1 else self._frame_stacks.to_sb3(stacked)


# -- the buffer's pickle: a JSON document of where the store lives ---------------------------------------

def _buffer_from_json(text: str) -> MMReplayBuffer:
    """Rebuild a buffer from ``MMReplayBuffer.settings()`` (what SB3's pickle of a buffer holds)."""
    s = json.loads(text)
    if not isinstance(s, dict) or s.get("format") != SETTINGS_FORMAT:
        raise ValueError(f"not an mmreplay SB3 buffer description (expected format {SETTINGS_FORMAT!r}): {text[:200]}")
    if s.get("version") != SETTINGS_VERSION:
        raise ValueError(f"mmreplay SB3 buffer description version {s.get('version')!r}; this mmreplay reads "
                         f"version {SETTINGS_VERSION}")
    if OPEN.get(store_key(s["path"])) is None and not os.path.exists(os.path.join(s["path"], "zarr.json")):
        raise FileNotFoundError(f"the saved replay buffer names the store {s['path']!r}, which does not exist "
                                "(moved or deleted?); a buffer is never recreated empty on load")
    return MMReplayBuffer(s["buffer_size"], space_from_json(s["observation_space"]),
                          space_from_json(s["action_space"]), s["device"], s["n_envs"], False,
                          s["handle_timeout_termination"], path=s["path"], frame_stack=s["frame_stack"],
                          # files written before `channels` existed: single-channel frames, as then
                          channels=s.get("channels", 1) if s["frame_stack"] > 1 else None,
                          channels_order=s.get("channels_order"), n_steps=s["n_steps"], gamma=s["gamma"],
                          cache_bytes=s.get("cache_bytes"))


MMReplayBuffer.__module__ = _buffer_from_json.__module__ = PUBLIC_MODULE


# -- model checkpoints ---------------------------------------------------------------------------------

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
