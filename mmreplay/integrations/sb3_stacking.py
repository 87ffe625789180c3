"""How the observations an SB3 buffer is given are stacked, and what the store holds per step.

Where ``(frame_stack, channels, channels_order)`` come from, in order: the store already at the path when
``frame_stack`` is left out (a buffer made again for it), the ``VecFrameStack`` in the wrappers of the env of
the model being set up (seen through a ``VecTransposeImage``), the arguments, else ``frame_stack=1``.

Invariants:
- A stacking is accepted only when it maps the observations exactly: the env's ``VecFrameStack`` and the
  arguments must agree (``frame_stack=1`` against it warns: stacks stored whole), a space whose stacked axis
  is ambiguous (``(84, 84, 3)``: one RGB frame or three grey ones?) is refused with the arguments to pass,
  and observations that look like stacks with no env and no store to tell are refused, never stored whole
  without a word.
- ``store_frame_space`` is one frame of a stack, the bounds ``VecFrameStack`` repeated ``k`` times taken once:
  ``(H, W)`` for one channel, else ``(c, H, W)`` or ``(H, W, c)``; a Dict's Discrete keys as SB3 shapes them.
"""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
from gymnasium import spaces
from stable_baselines3.common.buffers import ReplayBuffer
from stable_baselines3.common.off_policy_algorithm import OffPolicyAlgorithm
from stable_baselines3.common.vec_env import VecFrameStack, VecTransposeImage

from mmreplay.columns.spec import Schema
from mmreplay.errors import MMReplayError
from mmreplay.integrations.sb3_shared import OPEN, store_key
from mmreplay.storage.durability.meta import read_meta


def model_being_set_up(buffer: ReplayBuffer) -> OffPolicyAlgorithm | None:
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


def resolve_stacking(space: spaces.Space, frame_stack: int | None, channels: int | None,
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
    shared = OPEN.get(store_key(path))
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
            first, c = stack_layout(space, k, None, order)
        except ValueError:
            continue
        if isinstance(space, spaces.Box) and store_frame_space(space, k, first, c).shape == frame_shape:
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


def stack_layout(space: spaces.Space, k: int, channels: int | None,
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



def store_frame_space(space: spaces.Space, k: int, channels_first: bool, channels: int) -> spaces.Space:
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


def _one_int(space: spaces.Discrete) -> spaces.Box:
    start = int(space.start)
    return spaces.Box(start, start + int(space.n) - 1, (1,), np.int64)
