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

The pieces, one job a module: ``sb3_buffer`` (``MMReplayBuffer``, its pickle, its commits at model
checkpoints), ``sb3_stacking`` (how observations are stacked: from the env's ``VecFrameStack``, the store or
the arguments), ``sb3_frames`` (stacks stored one frame a step, checked at ``add``, rebuilt at ``sample``),
``sb3_shared`` (one open store per directory in this process); this module: the public names and the
JSON save/load of a model's buffer.
"""

from __future__ import annotations

import json
import os

from mmreplay.integrations.sb3_buffer import (  # noqa: F401  (the public names of the SB3 integration)
    HER_KWARGS,
    SAMPLER_NAME,
    SETTINGS_FORMAT,
    SETTINGS_VERSION,
    MMReplayBuffer,
    _buffer_from_json,  # what pickles of buffers (SB3's save_replay_buffer files) name: keep it here
    commit_on_save,
    match_checkpoint,
)
from mmreplay.storage.files import read_regular


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
