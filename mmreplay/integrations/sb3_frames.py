"""``VecFrameStack`` stacks as an SB3 buffer stores and returns them: one new frame a step, stacks rebuilt.

A stack in SB3's layout is viewed as ``(k, *frame)``: channels first, ``(k*c, H, W)`` is ``(k, c, H, W)`` as
it is; channels last, ``(H, W, k*c)`` is ``(H, W, k, c)`` with the ``k`` axis moved to the front.
Single-channel frames are ``(H, W)``, as the store has always held them.

Invariant: ``FrameStacks.check`` accepts an ``add`` only if the store will return its stacks bit for bit
(each stack continues the previous step's next stack, or is zero-padded at an episode start; each next
stack is its stack shifted by one frame), and raises before anything is stored otherwise; ``to_sb3`` lays
the store's ``(B, k, *frame)`` stacks out exactly as ``VecFrameStack`` does (oldest frame's channels first).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch


class FrameStacks:
    """``VecFrameStack(n_stack=k)`` observations of shape ``obs_shape``: ``k`` frames of ``c`` channels
    stacked on the first axis (``channels_first``) or the last."""

    def __init__(self, obs_shape: tuple[int, ...], k: int, c: int, channels_first: bool, itemsize: int):
        self.obs_shape, self.k, self.c, self.channels_first = tuple(obs_shape), k, c, channels_first
        self._flat = FlatStack(self.obs_shape, k, c, channels_first, itemsize)

    def frames(self, obs) -> np.ndarray:
        """Stacks ``(n, *obs_shape)`` as ``(n, k, *frame)`` views."""
        obs = np.asarray(obs).reshape(-1, *self.obs_shape)
        k, c = self.k, self.c
        if self.channels_first:
            return obs.reshape(obs.shape[0], k, *((c,) if c > 1 else ()), *obs.shape[2:])
        frames = np.moveaxis(obs.reshape(*obs.shape[:-1], k, c), -2, 1)  # (n, k, H, W, c)
        return frames if c > 1 else frames[..., 0]

    def check(self, obs: np.ndarray, next_obs: np.ndarray, tail_of: Callable[[int], tuple[bytes, bool] | None]) -> None:
        """Refuse (before anything is stored) stacks the store would not rebuild bit for bit: a stack must
        be the previous next stack when the store continues the episode (same newest frame, episode not
        ended), else zeros before its newest frame; a next stack is the stack shifted by one frame.
        ``obs``/``next_obs``: ``(n_envs, -1)`` bytes of the stacks in SB3's layout; ``tail_of(i)``: stream
        ``i``'s last next stack's bytes and whether it ended the episode, or None (a new episode)."""
        layout = self._flat
        for i in range(obs.shape[0]):
            tail = tail_of(i)
            continued = tail is not None and not tail[1]
            if not (continued and obs[i].tobytes() == tail[0]):  # (the usual step: one memcmp)
                if continued and layout.same_newest(obs[i], np.frombuffer(tail[0], np.uint8)):
                    self._refuse(i, "differs from the previous step's next observation although its newest "
                                    "frame is the same and the episode did not end")
                if not layout.padded(obs[i]):
                    self._refuse(i, f"starts an episode but its {self.k - 1} older frames are not "
                                    "all zero (VecFrameStack pads with zeros)")
            if not layout.one_frame_on(obs[i], next_obs[i]):
                self._refuse(i, "and its next observation are not one frame apart (the next stack must be the "
                                "stack without its oldest frame, then the new frame)")

    def _refuse(self, i: int, what: str) -> None:
        raise ValueError(
            f"add: the observation of sub-env {i} {what}; it is not a VecFrameStack stack of {self.k} "
            f"frames of {self.c} channel(s) stacked on the {'first' if self.channels_first else 'last'} axis "
            f"of {self.obs_shape}, so the store could not return it as the policy saw it (nothing was stored). "
            "Without VecFrameStack pass frame_stack=1; with VecFrameStack(n_stack=n) on frames of c channels "
            "pass frame_stack=n, channels=c")

    def to_sb3(self, stacked: torch.Tensor) -> torch.Tensor:
        """``(B, k, *frame)`` stacks from the store in SB3's layout: the frames' channels concatenated,
        oldest first, on the first axis ``(B, k*c, H, W)`` or the last ``(B, H, W, k*c)``."""
        b = stacked.shape[0]
        if self.channels_first:
            return stacked.reshape(b, -1, *stacked.shape[-2:])
        frames = stacked if self.c > 1 else stacked.unsqueeze(-1)  # (B, k, H, W, c)
        return frames.movedim(1, -2).reshape(b, *frames.shape[2:-1], -1)


class FlatStack:
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
