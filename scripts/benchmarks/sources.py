"""Inputs of the benchmarks, prepared outside the timed regions: the real Atari frame pool
(``scripts/atari_frames.py``) as single frames or FrameStack stacks, CartPole low-dim transitions, and
synthetic episodic streams.

Invariant: every system of one run gets the same transitions: dataset transition ``i`` is pool transition
``i % pool_size``, stream ``k`` of ``n_envs`` holds the ``k``-th contiguous slice (its episodes continue),
and a stack never reaches before its episode's first frame (padded with it, as FrameStackObservation does).
"""
from __future__ import annotations

import os
import time

import numpy as np

from .measure import log

FRAME_BYTES = 84 * 84
ATARI_ACTIONS = 18  # the pool mixes Pong (6), Breakout (4) and Seaquest (18)


class AtariSource:
    """The real-frame pool, read WITHOUT mmap (pread into small anonymous buffers), so that feeding a
    system does not add the pool's file pages to its RSS.  Dataset transition ``i`` is pool transition
    ``i % pool_size`` (the pool's episodes tiled, as ``atari_frames`` does for n > pool_size)."""

    def __init__(self):
        import atari_frames
        pool = atari_frames.load_atari_pool(verbose=True)
        self.P = len(pool["action"])
        self.oi = np.array(pool["obs_index"], np.int64)
        self.ni = np.array(pool["next_obs_index"], np.int64)
        self.action = np.array(pool["action"], np.int64)
        self.reward = np.sign(np.array(pool["reward"], np.float32)).astype(np.float32)
        self.term = np.array(pool["terminated"], bool)
        self.trunc = np.array(pool["truncated"], bool)
        starts = np.array(pool["episode_start"], np.int64)
        self.ep_start = starts[np.searchsorted(starts, np.arange(self.P), side="right") - 1]
        del pool
        path = os.path.join(atari_frames.DEFAULT_CACHE_DIR, "frames.npy")
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                np.lib.format.read_array_header_1_0(f)
            else:
                np.lib.format.read_array_header_2_0(f)
            self.offset = f.tell()
        self.fd = os.open(path, os.O_RDONLY)

    def read_frames(self, lo: int, hi: int) -> np.ndarray:
        out = np.empty((hi - lo, 84, 84), np.uint8)
        mv = memoryview(out).cast("B")
        pos, off = 0, self.offset + lo * FRAME_BYTES
        while pos < len(mv):
            k = os.preadv(self.fd, [mv[pos:]], off + pos)
            if k <= 0:
                raise OSError("short read from the Atari pool")
            pos += k
        return out

    def get(self, a: int, b: int, stacks: bool) -> dict:
        """Dataset transitions [a, b): single frames (``stacks=False``: obs/next_obs (n,84,84)) or
        FrameStack stacks (n,4,84,84), oldest first, episode starts padded with the first frame."""
        parts = []
        while a < b:
            p0 = a % self.P
            take = min(b - a, self.P - p0)
            parts.append(self._piece(p0, p0 + take, stacks))
            a += take
        return {k: np.concatenate([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in parts[0]}

    def _piece(self, p0, p1, stacks):
        ids = np.arange(p0, p1)
        ni = self.ni[ids]
        if stacks:
            tt = np.maximum(self.ep_start[ids][:, None], ids[:, None] + np.arange(-3, 1))
            so = self.oi[tt]
            sn = np.concatenate([so[:, 1:], ni[:, None]], axis=1)
        else:
            so, sn = self.oi[ids], ni
        lo, hi = int(min(so.min(), sn.min())), int(max(so.max(), sn.max())) + 1
        buf = self.read_frames(lo, hi)
        return {"obs": buf[so - lo], "next_obs": buf[sn - lo], "action": self.action[ids],
                "reward": self.reward[ids], "terminated": self.term[ids], "truncated": self.trunc[ids]}


def atari_chunks(src: AtariSource, n: int, n_envs: int, stacks: bool, chunk_transitions: int = 512):
    """Yield (steps, dict of arrays shaped (steps, n_envs, ...)); stream k holds dataset transitions
    [k*S, (k+1)*S) with S = n // n_envs, so each stream's episodes continue."""
    S = n // n_envs
    cs = max(1, chunk_transitions // n_envs)
    for u in range(0, S, cs):
        v = min(S, u + cs)
        parts = [src.get(k * S + u, k * S + v, stacks) for k in range(n_envs)]
        yield v - u, {key: np.stack([p[key] for p in parts], axis=1) for key in parts[0]}


def add_atari_transitions(store, n: int) -> None:
    """The first ``n`` transitions of the Atari dataset, one ``store.add`` each (one env), as a user's loop adds
    them; only the public ``add`` is used, so any revision's ``Store`` takes them (``bench_ab`` builds old ones)."""
    for steps, d in atari_chunks(AtariSource(), n, 1, stacks=False):
        o, no = d["obs"][:, 0], d["next_obs"][:, 0]
        a, r = d["action"][:, 0].tolist(), d["reward"][:, 0].tolist()
        te, tr = d["terminated"][:, 0].tolist(), d["truncated"][:, 0].tolist()
        for t in range(steps):
            store.add(o[t], a[t], r[t], no[t], te[t], tr[t])


def lowdim_path(workdir: str, n: int, n_envs: int) -> str:
    return os.path.join(workdir, f"cartpole_{n}_{n_envs}.npz")


def make_lowdim_data(workdir: str, n: int, n_envs: int, seed: int = 0) -> str:
    """CartPole-v1 transitions from uniform-random play, ``n_envs`` independent envs stepped in
    lockstep (cached).  Arrays shaped (steps, n_envs, ...); next_obs is the real final obs at episode
    ends (the next step starts from the reset obs)."""
    path = lowdim_path(workdir, n, n_envs)
    if os.path.exists(path):
        return path
    import gymnasium as gym
    steps = n // n_envs
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    act = rng.integers(0, 2, (steps, n_envs)).astype(np.int64)
    obs = np.empty((steps, n_envs, 4), np.float32)
    nxt = np.empty_like(obs)
    rew = np.empty((steps, n_envs), np.float32)
    term = np.zeros((steps, n_envs), bool)
    trunc = np.zeros((steps, n_envs), bool)
    for e in range(n_envs):
        env = gym.make("CartPole-v1")
        o, _ = env.reset(seed=seed + e)
        for t in range(steps):
            o2, r, te, tr, _ = env.step(int(act[t, e]))
            obs[t, e], nxt[t, e], rew[t, e], term[t, e], trunc[t, e] = o, o2, r, te, tr and not te
            o = env.reset()[0] if (te or tr) else o2
        env.close()
    os.makedirs(workdir, exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(tmp, obs=obs, next_obs=nxt, action=act, reward=rew, terminated=term, truncated=trunc)
    os.replace(tmp, path)
    log(f"[bench] generated {steps * n_envs} CartPole transitions in {time.perf_counter() - t0:.1f}s -> {path}")
    return path


def synthetic_stream(n_steps, n_envs=1, obs_shape=(84, 84), obs_dtype=np.uint8,
                     frame_stack=4, ep_len=(50, 400), trunc_prob=0.25,
                     n_actions=6, seed=0, frame_source=None):
    """Precompute ``n_steps`` batches of ``n_envs`` transitions with
    FrameStack-consistent stacks (reset padding repeats the first frame) and
    random episode lengths; about ``trunc_prob`` of episodes end truncated.

    Returns a dict of arrays with a leading (n_steps, n_envs) shape; obs /
    next_obs are (n_steps, n_envs, S, *obs_shape) (no S axis if S == 1).
    ``frame_source(rng, k)`` may supply k frames (default: random noise)."""
    rng = np.random.default_rng(seed)
    S = frame_stack
    E = n_envs

    def frames(k):
        if frame_source is not None:
            return frame_source(rng, k)
        if np.dtype(obs_dtype) == np.uint8:
            return rng.integers(0, 256, (k, *obs_shape), np.uint8)
        return rng.standard_normal((k, *obs_shape)).astype(obs_dtype)

    obs = np.empty((n_steps, E, S, *obs_shape), obs_dtype)
    nxt = np.empty_like(obs)
    term = np.zeros((n_steps, E), bool)
    trunc = np.zeros((n_steps, E), bool)
    for e in range(E):
        t = 0
        while t < n_steps:
            L = int(rng.integers(ep_len[0], ep_len[1] + 1))
            L = min(L, n_steps - t)
            f = frames(L + 1)
            stream = np.concatenate([np.repeat(f[:1], S - 1, 0), f])  # padded
            win = np.lib.stride_tricks.sliding_window_view(stream, S, axis=0)
            win = np.moveaxis(win, -1, 1)                 # (L+1, S, *shape)
            obs[t:t + L, e] = win[:L]
            nxt[t:t + L, e] = win[1:L + 1]
            if rng.random() < trunc_prob:
                trunc[t + L - 1, e] = True
            else:
                term[t + L - 1, e] = True
            t += L
    out = {"obs": obs, "next_obs": nxt,
           "action": rng.integers(0, n_actions, (n_steps, E)).astype(np.int64),
           "reward": rng.choice(np.array([-1, 0, 0, 0, 1], np.float32), (n_steps, E)),
           "terminated": term, "truncated": trunc}
    if S == 1:
        out["obs"] = obs[:, :, 0]
        out["next_obs"] = nxt[:, :, 0]
    return out
