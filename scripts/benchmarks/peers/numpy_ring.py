"""The "numpy" peer: a plain numpy ring in RAM that stores every frame once and rebuilds stacks by fancy
indexing, the "memcpy limit" a frame-deduplicating store can hope for.

Invariant: a sampled transition's frames are all still in the frame ring (transitions whose oldest frame
was lapped drop out of the valid window; stale frames are never sampled).
"""
from __future__ import annotations

import numpy as np
import torch


class NumpyFrameRing:
    """Per env: a ring of frames (``n_frames`` slots) written in episode order
    (a new episode writes its whole first stack, then one frame per step) and a
    ring of ``C = capacity // n_envs`` transitions storing the monotonic frame
    counter of their next_obs' newest frame; obs stack = frames
    ``[nf-S, nf)``, next_obs stack = ``(nf-S, nf]``.  Because episode starts
    cost S frames, the frame ring has ``extra_frames`` spare slots; if it still
    laps the oldest transitions (very short episodes), those drop out of
    sampling (the valid window is tracked, never sampled stale)."""

    name = "numpy"

    def __init__(self, capacity, obs_shape, obs_dtype, n_envs=1, frame_stack=1,
                 extra_frames=None, seed=0):
        self.E, self.S = int(n_envs), int(frame_stack)
        self.C = max(int(capacity) // self.E, 1)
        self.obs_shape = tuple(obs_shape)
        extra = extra_frames if extra_frames is not None else self.C // 8 + 4 * self.S
        self.F = self.C + self.S + int(extra)
        self.frames = np.empty((self.E, self.F, *self.obs_shape), obs_dtype)
        self._flat = self.frames.reshape(self.E * self.F, *self.obs_shape)
        self.next_fc = np.zeros((self.E, self.C), np.int64)
        self.action = np.zeros((self.E, self.C), np.int64)
        self.reward = np.zeros((self.E, self.C), np.float32)
        self.term = np.zeros((self.E, self.C), np.float32)
        self.fc = np.zeros(self.E, np.int64)      # frames written per env
        self.tc = 0                               # transitions added per env
        self.valid_from = np.zeros(self.E, np.int64)  # oldest valid transition
        self.new_ep = np.ones(self.E, bool)
        self._ar = np.arange(self.E)
        self._sr = np.arange(self.S)
        self.rng = np.random.default_rng(seed)

    def add_batch(self, obs, action, reward, next_obs, terminated, truncated):
        S, F = self.S, self.F
        if S == 1:
            obs = obs[:, None]
            next_obs = next_obs[:, None]
        for e in np.flatnonzero(self.new_ep):     # episode start: whole stack
            idx = (self.fc[e] + self._sr) % F
            self.frames[e, idx] = obs[e]
            self.fc[e] += S
        self.frames[self._ar, self.fc % F] = next_obs[:, -1]
        self.fc += 1
        slot = self.tc % self.C
        self.next_fc[:, slot] = self.fc - 1
        self.action[:, slot] = action
        self.reward[:, slot] = reward
        self.term[:, slot] = terminated
        self.tc += 1
        self.new_ep = np.asarray(terminated, bool) | np.asarray(truncated, bool)
        # keep only transitions whose oldest frame is still in the frame ring
        lo = max(self.tc - self.C, 0)
        vf = np.maximum(self.valid_from, lo)
        stale = self.next_fc[self._ar, vf % self.C] - S < self.fc - F
        for e in np.flatnonzero(stale):           # rare: frame ring lapped
            while vf[e] < self.tc and self.next_fc[e, vf[e] % self.C] - S < self.fc[e] - F:
                vf[e] += 1
        self.valid_from = vf

    def __len__(self):
        return int((self.tc - self.valid_from).sum())

    def sample(self, batch_size):
        counts = self.tc - self.valid_from
        if self.E == 1:
            e = np.zeros(batch_size, np.int64)
            t = self.valid_from[0] + self.rng.integers(0, counts[0], batch_size)
        else:
            cum = np.cumsum(counts)
            r = self.rng.integers(0, cum[-1], batch_size)
            e = np.searchsorted(cum, r, side="right")
            t = self.valid_from[e] + r - (cum[e] - counts[e])
        slot = t % self.C
        nf = self.next_fc[e, slot]
        off = e * self.F
        if self.S == 1:
            o = self._flat[off + (nf - 1) % self.F]
            n = self._flat[off + nf % self.F]
        else:
            base = nf[:, None] - self.S + self._sr          # (B, S)
            o = self._flat[off[:, None] + base % self.F]
            n = self._flat[off[:, None] + (base + 1) % self.F]
        return {"obs": torch.from_numpy(o), "next_obs": torch.from_numpy(n),
                "action": torch.from_numpy(self.action[e, slot]),
                "reward": torch.from_numpy(self.reward[e, slot]),
                "done": torch.from_numpy(self.term[e, slot])}

    def nbytes(self):
        return sum(a.nbytes for a in (self.frames, self.next_fc, self.action,
                                      self.reward, self.term))

    def close(self):
        self.frames = self._flat = None
