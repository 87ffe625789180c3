"""numpy <-> torch conversions shared by the peer adapters.

Invariant: ``to_tensor`` never copies an array that is already contiguous (the copy would be timed as the
peer's cost); ``to_numpy`` always returns a 1-D array of the asked dtype.
"""
from __future__ import annotations

import numpy as np
import torch


def to_tensor(x):
    """numpy -> contiguous CPU torch tensor (zero-copy when possible)."""
    return torch.from_numpy(np.ascontiguousarray(x))


def to_numpy(x, dtype):
    """torch tensor / array-like -> 1-D numpy array of ``dtype``."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype).reshape(-1)


def from_cpprb(s: dict, frame_stack: int) -> dict:
    """A cpprb sample (stack axis last) as the peers' batch: obs/next_obs (B, S, ...) and 1-D action,
    reward, done tensors."""
    o, n = s["obs"], s["next_obs"]
    if frame_stack > 1:
        o, n = np.moveaxis(o, -1, 1), np.moveaxis(n, -1, 1)
    return {"obs": to_tensor(o), "next_obs": to_tensor(n),
            "action": to_tensor(s["act"].reshape(-1)),
            "reward": to_tensor(s["rew"].reshape(-1)),
            "done": to_tensor(s["done"].reshape(-1))}
