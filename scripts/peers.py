"""Peer replay buffers behind one interface, for mmreplay benchmarks.

    rb = make(kind, capacity, obs_shape, obs_dtype, n_envs, frame_stack)
    rb.add_batch(obs, action, reward, next_obs, terminated, truncated)
    out = rb.sample(batch_size)   # dict of CPU torch tensors

``kind`` is one of ``KINDS``:

``"numpy"``   plain numpy ring in RAM that stores every frame once and rebuilds
              stacks by fancy indexing: the "memcpy limit" a frame-deduplicating
              store can hope for.
``"sb3"``     ``stable_baselines3.common.buffers.ReplayBuffer(
              optimize_memory_usage=True, handle_timeout_termination=False)``
              (stores one full stack per transition; next_obs is the next slot).
``"cpprb"``   ``cpprb.ReplayBuffer(next_of=("obs",), stack_compress="obs")``,
              one buffer per env (its compression assumes consecutive adds come
              from one stream), ``on_episode_end()`` called at episode ends.
``"torchrl"`` ``torchrl.data.TensorDictReplayBuffer(LazyMemmapStorage(scratch
              dir under /tmp), sampler=RandomSampler())``, the usual TorchRL
              layout (obs and ("next","obs") full stacks, no deduplication).

Shapes.  ``obs_shape`` is the shape of ONE frame/observation (``(84, 84)`` for
Atari, ``(4,)`` for CartPole-like low-dim).  With ``frame_stack = S > 1`` the
``obs``/``next_obs`` passed to ``add_batch`` are stacks ``(n_envs, S,
*obs_shape)``, oldest frame first, as ``gymnasium.wrappers.FrameStackObservation``
gives (``next_obs[:, :-1] == obs[:, 1:]``); with ``S == 1`` they are ``(n_envs,
*obs_shape)``.  ``action`` (n_envs,) int64, ``reward`` (n_envs,) float32,
``terminated``/``truncated`` (n_envs,) bool.  On a truncation or termination
``next_obs`` is the real final observation (not the reset one), and the next
``add_batch`` for that env starts a new episode.

``sample(B)`` returns ``{"obs", "next_obs"}`` (B, S, *obs_shape) (or (B,
*obs_shape) when S == 1) contiguous tensors of ``obs_dtype``, ``"action"`` (B,)
int64, ``"reward"`` (B,) float32 and ``"done"`` (B,) float32.  ``done`` is
``terminated`` for every peer except SB3: SB3's memory-optimised buffer cannot
keep a truncated episode's final observation (the next slot is overwritten by
the next episode's first obs), so, as SB3's own algorithms do with
``handle_timeout_termination=False``, it is given ``done = terminated |
truncated`` and returns that.

``capacity`` counts transitions over all envs (each env gets ``capacity //
n_envs``).  ``rb.close()`` frees memory / scratch files.

``make_lowdim(kind, capacity, n_envs)`` is the low-dim variant (obs (4,)
float32, 2 actions, no stacking).

Prioritized (PER, proportional) peers, ``kind`` in ``PER_KINDS``, add the same
way and also have::

    out = rb.sample(batch_size, beta=0.4)  # + "weights" (B,) float32, "indices" (B,) int64
    rb.update_priorities(out["indices"], priorities)  # raw |TD|-like values

``"cpprb_per"``   ``cpprb.PrioritizedReplayBuffer(alpha=0.6)`` (see
                  ``CpprbPERPeer`` for the multi-env Atari case).
``"torchrl_per"`` ``TensorDictReplayBuffer(LazyMemmapStorage, PrioritizedSampler(
                  capacity, alpha=0.6, beta=0.4))``; needs a loadable
                  ``torchrl._torchrl`` (see ``TorchRLPERPeer``).

Both store ``(p + eps) ** alpha`` in sum/min segment trees, give new items the
largest priority seen so far, and return IS weights ``(p_i / p_min) ** -beta``
with ``p_min`` the minimum over the WHOLE stored buffer (so weights are in
(0, 1], 1 only for the globally least likely item, not batch-max normalised).
cpprb samples stratified (B equal slices of the priority mass, one draw each);
TorchRL draws B i.i.d. masses.  ``check_per_peer(rb)`` is a sanity check.

Run ``python scripts/peers.py`` for a self-test/benchmark table (see
``--help``).
"""
from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import time

import numpy as np
import torch

KINDS = ("numpy", "sb3", "cpprb", "torchrl")
PER_KINDS = ("cpprb_per", "torchrl_per")


def tune_malloc(threshold=1 << 30):
    """glibc only: raise M_MMAP_THRESHOLD and M_TRIM_THRESHOLD so that large,
    short-lived sample batches (a 256 x 4x84x84 uint8 batch is 7 MB) are reused
    from the heap instead of being mmap'ed/trimmed and page-faulted afresh on
    every call.  Out of the box, glibc's dynamic threshold handles ONE such
    array per call but not two (obs + next_obs), which halves batch-256 Atari
    sampling rates for every peer.  Same effect as the environment variables
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_.  Returns True on success."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold))) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


def _tt(x):
    """numpy -> contiguous CPU torch tensor (zero-copy when possible)."""
    return torch.from_numpy(np.ascontiguousarray(x))


# --------------------------------------------------------------------------
# numpy ring: every frame stored once ("memcpy limit")
# --------------------------------------------------------------------------
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


# --------------------------------------------------------------------------
# Stable-Baselines3
# --------------------------------------------------------------------------
class SB3Peer:
    name = "sb3"

    def __init__(self, capacity, obs_shape, obs_dtype, n_envs=1, frame_stack=1,
                 n_actions=6, seed=0):
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer
        self.E, self.S = int(n_envs), int(frame_stack)
        shape = (self.S, *obs_shape) if self.S > 1 else tuple(obs_shape)
        dt = np.dtype(obs_dtype)
        if dt == np.uint8:
            space = spaces.Box(0, 255, shape, np.uint8)
        else:
            space = spaces.Box(-np.inf, np.inf, shape, dt)
        np.random.seed(seed)  # SB3 samples with the global numpy RNG
        # SB3 divides buffer_size by n_envs itself
        self.rb = ReplayBuffer(int(capacity), space, spaces.Discrete(n_actions),
                               device="cpu", n_envs=self.E,
                               optimize_memory_usage=True,
                               handle_timeout_termination=False)
        self._infos = [{} for _ in range(self.E)]

    def add_batch(self, obs, action, reward, next_obs, terminated, truncated):
        done = np.asarray(terminated, bool) | np.asarray(truncated, bool)
        self.rb.add(obs, next_obs, np.asarray(action), np.asarray(reward, np.float32),
                    done.astype(np.float32), self._infos)

    def __len__(self):
        return self.rb.size() * self.E

    def sample(self, batch_size):
        s = self.rb.sample(batch_size)
        return {"obs": s.observations, "next_obs": s.next_observations,
                "action": s.actions.reshape(-1), "reward": s.rewards.reshape(-1),
                "done": s.dones.reshape(-1)}

    def nbytes(self):
        rb = self.rb
        return sum(a.nbytes for a in (rb.observations, rb.actions, rb.rewards,
                                      rb.dones, rb.timeouts))

    def close(self):
        self.rb = None


# --------------------------------------------------------------------------
# cpprb
# --------------------------------------------------------------------------
class CpprbPeer:
    """One cpprb buffer per env: ``next_of`` and ``stack_compress`` rely on
    consecutive ``add`` calls being consecutive steps of ONE episode stream, so
    interleaving envs in a single buffer would corrupt stacks.  cpprb wants the
    stack axis LAST, so stacks are moved (S,84,84) -> (84,84,S) on add and back
    on sample (copies included in the timings)."""

    name = "cpprb"

    def __init__(self, capacity, obs_shape, obs_dtype, n_envs=1, frame_stack=1,
                 seed=0):
        from cpprb import ReplayBuffer
        self.E, self.S = int(n_envs), int(frame_stack)
        self.C = max(int(capacity) // self.E, 1)
        kw = {}
        if self.S > 1:
            shape = (*obs_shape, self.S)
            kw["stack_compress"] = "obs"
        else:
            shape = tuple(obs_shape)
        env_dict = {"obs": {"shape": shape, "dtype": np.dtype(obs_dtype)},
                    "act": {"dtype": np.int64},
                    "rew": {"dtype": np.float32},
                    "done": {"dtype": np.float32}}
        self.rbs = [ReplayBuffer(self.C, env_dict, next_of=("obs",), **kw)
                    for _ in range(self.E)]
        self.rng = np.random.default_rng(seed)
        np.random.seed(seed)  # cpprb samples with the global numpy RNG

    def add_batch(self, obs, action, reward, next_obs, terminated, truncated):
        if self.S > 1:
            obs = np.moveaxis(obs, 1, -1)
            next_obs = np.moveaxis(next_obs, 1, -1)
        ends = np.asarray(terminated, bool) | np.asarray(truncated, bool)
        for e, rb in enumerate(self.rbs):
            rb.add(obs=obs[e], act=action[e], rew=reward[e], next_obs=next_obs[e],
                   done=float(terminated[e]))
            if ends[e]:
                rb.on_episode_end()

    def __len__(self):
        return sum(rb.get_stored_size() for rb in self.rbs)

    def sample(self, batch_size):
        if self.E == 1:
            s = self.rbs[0].sample(batch_size)
        else:
            sizes = np.array([rb.get_stored_size() for rb in self.rbs], float)
            per = self.rng.multinomial(batch_size, sizes / sizes.sum())
            parts = [rb.sample(int(k)) for rb, k in zip(self.rbs, per) if k > 0]
            s = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
        o, n = s["obs"], s["next_obs"]
        if self.S > 1:
            o, n = np.moveaxis(o, -1, 1), np.moveaxis(n, -1, 1)
        return {"obs": _tt(o), "next_obs": _tt(n),
                "action": _tt(s["act"].reshape(-1)),
                "reward": _tt(s["rew"].reshape(-1)),
                "done": _tt(s["done"].reshape(-1))}

    def close(self):
        self.rbs = None


# --------------------------------------------------------------------------
# TorchRL
# --------------------------------------------------------------------------
class TorchRLPeer:
    name = "torchrl"

    def __init__(self, capacity, obs_shape, obs_dtype, n_envs=1, frame_stack=1,
                 scratch_dir=None, seed=0):
        from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
        from torchrl.data.replay_buffers.samplers import RandomSampler
        self.E, self.S = int(n_envs), int(frame_stack)
        self._own_dir = scratch_dir is None
        self.dir = scratch_dir or tempfile.mkdtemp(prefix="mmreplay_torchrl_",
                                                    dir="/tmp")
        torch.manual_seed(seed)  # RandomSampler uses torch's global RNG
        self.rb = TensorDictReplayBuffer(
            storage=LazyMemmapStorage(int(capacity), scratch_dir=self.dir),
            sampler=RandomSampler())

    def add_batch(self, obs, action, reward, next_obs, terminated, truncated):
        from tensordict import TensorDict
        E = self.E
        term = torch.from_numpy(np.asarray(terminated, bool)).reshape(E, 1)
        trunc = torch.from_numpy(np.asarray(truncated, bool)).reshape(E, 1)
        td = TensorDict({
            "obs": torch.from_numpy(np.ascontiguousarray(obs)),
            "action": torch.from_numpy(np.asarray(action, np.int64)),
            "next": TensorDict({
                "obs": torch.from_numpy(np.ascontiguousarray(next_obs)),
                "reward": torch.from_numpy(np.asarray(reward, np.float32)).reshape(E, 1),
                "terminated": term, "truncated": trunc, "done": term | trunc,
            }, batch_size=[E]),
        }, batch_size=[E])
        self.rb.extend(td)

    def __len__(self):
        return len(self.rb)

    def sample(self, batch_size):
        s = self.rb.sample(batch_size)
        return {"obs": s["obs"], "next_obs": s["next", "obs"],
                "action": s["action"],
                "reward": s["next", "reward"].reshape(-1),
                "done": s["next", "terminated"].reshape(-1).float()}

    def disk_bytes(self):
        tot = 0
        for root, _, files in os.walk(self.dir):
            for f in files:
                try:
                    tot += os.stat(os.path.join(root, f)).st_blocks * 512
                except OSError:
                    pass
        return tot

    def close(self):
        self.rb = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)


# --------------------------------------------------------------------------
# prioritized (PER) peers
# --------------------------------------------------------------------------
def _np(x, dtype):
    """torch tensor / array-like -> 1-D numpy array of ``dtype``."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype).reshape(-1)


class CpprbPERPeer:
    """cpprb ``PrioritizedReplayBuffer(alpha=0.6, eps=1e-4)`` (proportional).

    Layout, chosen so that cpprb's own PER stays exact where it can:

    * low-dim (``frame_stack == 1``): ONE buffer for all envs, obs and next_obs
      stored explicitly (16 bytes each), the ``n_envs`` transitions of a step
      added in one ``add`` call.  Sampling, IS weights: cpprb's, unchanged.
    * Atari (``frame_stack > 1``): frames as in ``CpprbPeer`` (``next_of`` +
      ``stack_compress``, stack axis last), which needs one buffer per env.
      With ``n_envs == 1`` that is one buffer and cpprb's PER, unchanged.
      With ``n_envs > 1`` (one buffer per env), the per-env batch sizes are
      drawn ``multinomial(B, per-env priority sums)`` from a float64 mirror of
      the stored ``(p + eps) ** alpha`` values, each env's part is sampled by
      cpprb (stratified within the env), and the IS weights are recomputed
      globally, ``(p_i / p_min_all_envs) ** -beta`` (cpprb's formula over the
      union; cpprb's per-env weights would use per-env minima).  New items get
      the global max priority (passed explicitly to ``add``).

    ``indices`` are global slots: ``env * (capacity // n_envs) + local``
    (``n_slots`` bounds them).  cpprb draws from its own ``std::mt19937``
    seeded by ``std::random_device``: its sampling is not reproducible.
    """

    name = "cpprb_per"

    def __init__(self, capacity, obs_shape, obs_dtype, n_envs=1, frame_stack=1,
                 alpha=0.6, eps=1e-4, seed=0):
        from cpprb import PrioritizedReplayBuffer
        self.E, self.S = int(n_envs), int(frame_stack)
        self.alpha, self.eps = float(alpha), float(eps)
        dt = np.dtype(obs_dtype)
        base = {"act": {"dtype": np.int64}, "rew": {"dtype": np.float32},
                "done": {"dtype": np.float32}}
        if self.S == 1:
            shape = tuple(obs_shape)
            env_dict = {"obs": {"shape": shape, "dtype": dt},
                        "next_obs": {"shape": shape, "dtype": dt}, **base}
            self.C = max(int(capacity), 1)
            self.rbs = [PrioritizedReplayBuffer(self.C, env_dict, alpha=self.alpha,
                                                eps=self.eps)]
        else:
            env_dict = {"obs": {"shape": (*obs_shape, self.S), "dtype": dt}, **base}
            self.C = max(int(capacity) // self.E, 1)
            self.rbs = [PrioritizedReplayBuffer(self.C, env_dict, alpha=self.alpha,
                                                eps=self.eps, next_of=("obs",),
                                                stack_compress="obs")
                        for _ in range(self.E)]
        self.split = len(self.rbs) > 1
        self.n_slots = len(self.rbs) * self.C
        if self.split:
            nr = len(self.rbs)
            self._v = np.zeros((nr, self.C))          # mirror of (p + eps) ** alpha
            self._vflat = self._v.reshape(-1)
            self._sum = np.zeros(nr)                  # per-env sums of _v
            self._min = np.full(nr, np.inf)           # per-env minima (lazy)
            self._min_dirty = np.zeros(nr, bool)
            self._maxp = 1.0                          # raw max priority (cpprb's init)
            self._n_upd = 0
        self.rng = np.random.default_rng(seed)
        np.random.seed(seed)

    # -- mirror bookkeeping (split layout only) --
    def _mirror_set(self, flat_idx, raw_p):
        """Unique ``flat_idx`` get raw priorities ``raw_p``."""
        v = (raw_p + self.eps) ** self.alpha
        old = self._vflat[flat_idx]
        self._vflat[flat_idx] = v
        e = flat_idx // self.C
        np.add.at(self._sum, e, v - old)
        self._min_dirty[e[old <= self._min[e]]] = True   # a minimum was replaced
        np.minimum.at(self._min, e, v)
        self._n_upd += len(flat_idx)
        if self._n_upd > 64 * self.C:                     # re-sum: no float drift
            self._sum = self._v.sum(1)
            self._n_upd = 0

    def add_batch(self, obs, action, reward, next_obs, terminated, truncated):
        term = np.asarray(terminated, np.float32)
        if self.S == 1:
            self.rbs[0].add(obs=obs, act=action, rew=reward, next_obs=next_obs,
                            done=term)
            return
        obs = np.moveaxis(obs, 1, -1)
        next_obs = np.moveaxis(next_obs, 1, -1)
        ends = np.asarray(terminated, bool) | np.asarray(truncated, bool)
        if not self.split:
            rb = self.rbs[0]
            rb.add(obs=obs[0], act=action[0], rew=reward[0], next_obs=next_obs[0],
                   done=term[0])
            if ends[0]:
                rb.on_episode_end()
            return
        p = self._maxp
        slots = np.empty(self.E, np.int64)
        for e, rb in enumerate(self.rbs):
            slots[e] = e * self.C + rb.get_next_index()
            rb.add(obs=obs[e], act=action[e], rew=reward[e], next_obs=next_obs[e],
                   done=term[e], priorities=p)
            if ends[e]:
                rb.on_episode_end()
        self._mirror_set(slots, np.full(self.E, p))

    def __len__(self):
        return sum(rb.get_stored_size() for rb in self.rbs)

    def sample(self, batch_size, beta=0.4):
        if not self.split:
            s = self.rbs[0].sample(batch_size, beta)
            # cpprb's "weights"/"indexes" are views of internal vectors that the
            # NEXT sample() overwrites (or frees, when B changes): copy them
            idx, w = s["indexes"].astype(np.int64), s["weights"].copy()
        else:
            for e in np.flatnonzero(self._min_dirty):
                n = self.rbs[e].get_stored_size()
                self._min[e] = self._v[e, :n].min() if n else np.inf
            self._min_dirty[:] = False
            per = self.rng.multinomial(batch_size, self._sum / self._sum.sum())
            parts, idxs = [], []
            for e in np.flatnonzero(per):
                parts.append(self.rbs[e].sample(int(per[e]), beta))
                idxs.append(parts[-1]["indexes"].astype(np.int64) + e * self.C)  # copies
            s = {k: np.concatenate([q[k] for q in parts]) for k in ("obs", "next_obs",
                                                                    "act", "rew", "done")}
            idx = np.concatenate(idxs)
            w = ((self._vflat[idx] / self._min.min()) ** -beta).astype(np.float32)
        o, n = s["obs"], s["next_obs"]
        if self.S > 1:
            o, n = np.moveaxis(o, -1, 1), np.moveaxis(n, -1, 1)
        return {"obs": _tt(o), "next_obs": _tt(n),
                "action": _tt(s["act"].reshape(-1)),
                "reward": _tt(s["rew"].reshape(-1)),
                "done": _tt(s["done"].reshape(-1)),
                "weights": _tt(w.reshape(-1)), "indices": _tt(idx)}

    def update_priorities(self, indices, priorities):
        idx = _np(indices, np.int64)
        p = _np(priorities, np.float64)
        if p.size == 1 and idx.size > 1:
            p = np.full(idx.size, p[0])
        if not self.split:
            self.rbs[0].update_priorities(idx, p)
            return
        # duplicates: the last value wins (as in cpprb's sequential update)
        u, first_rev = np.unique(idx[::-1], return_index=True)
        p = p[idx.size - 1 - first_rev]
        e, local = u // self.C, u % self.C
        for k in np.unique(e):
            m = e == k
            self.rbs[k].update_priorities(local[m], p[m])
        self._maxp = max(self._maxp, float(p.max()))
        self._mirror_set(u, p)

    def close(self):
        self.rbs = None


class TorchRLPERPeer(TorchRLPeer):
    """``TensorDictReplayBuffer(storage=LazyMemmapStorage(capacity),
    sampler=PrioritizedSampler(capacity, alpha=0.6, beta=0.4))``, same layout
    and ``add_batch`` as ``TorchRLPeer`` (one storage for all envs: global PER).
    ``sample(B, beta)`` sets the sampler's ``beta`` when it changes.  The
    sampler draws its masses with numpy's GLOBAL RNG (seeded here).

    Needs the ``torchrl._torchrl`` C++ extension (the segment trees); the
    torchrl 0.8-0.14 wheels on PyPI do not load against torch 2.13.0+cpu
    (undefined symbols), see ``scripts/per_peers_probe.py --rebuild-torchrl-ext``.
    """

    name = "torchrl_per"

    def __init__(self, capacity, obs_shape, obs_dtype, n_envs=1, frame_stack=1,
                 scratch_dir=None, alpha=0.6, beta=0.4, seed=0):
        from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
        from torchrl.data.replay_buffers.samplers import PrioritizedSampler
        self.E, self.S = int(n_envs), int(frame_stack)
        self.n_slots = int(capacity)
        sampler = PrioritizedSampler(int(capacity), alpha=alpha, beta=beta)
        self._own_dir = scratch_dir is None
        self.dir = scratch_dir or tempfile.mkdtemp(prefix="mmreplay_torchrl_per_",
                                                    dir="/tmp")
        torch.manual_seed(seed)
        np.random.seed(seed)  # PrioritizedSampler draws with np.random.uniform
        self.sampler = sampler
        self.rb = TensorDictReplayBuffer(
            storage=LazyMemmapStorage(int(capacity), scratch_dir=self.dir),
            sampler=sampler)

    def sample(self, batch_size, beta=0.4):
        if beta != self.sampler.beta:
            self.sampler.beta = beta
        s = self.rb.sample(batch_size)
        return {"obs": s["obs"], "next_obs": s["next", "obs"],
                "action": s["action"],
                "reward": s["next", "reward"].reshape(-1),
                "done": s["next", "terminated"].reshape(-1).float(),
                "weights": s["priority_weight"].reshape(-1).float(),
                "indices": s["index"].reshape(-1)}

    def update_priorities(self, indices, priorities):
        idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(
            np.asarray(indices, np.int64))
        p = priorities if isinstance(priorities, torch.Tensor) else torch.as_tensor(
            np.asarray(priorities, np.float32))
        self.rb.update_priority(idx, p)


# --------------------------------------------------------------------------
def make(kind, capacity, obs_shape=(84, 84), obs_dtype=np.uint8, n_envs=1,
         frame_stack=4, *, n_actions=6, seed=0, scratch_dir=None):
    """Build a peer replay buffer with the uniform interface (see module doc)."""
    if kind == "numpy":
        return NumpyFrameRing(capacity, obs_shape, obs_dtype, n_envs, frame_stack,
                              seed=seed)
    if kind == "sb3":
        return SB3Peer(capacity, obs_shape, obs_dtype, n_envs, frame_stack,
                       n_actions=n_actions, seed=seed)
    if kind == "cpprb":
        return CpprbPeer(capacity, obs_shape, obs_dtype, n_envs, frame_stack,
                         seed=seed)
    if kind == "torchrl":
        return TorchRLPeer(capacity, obs_shape, obs_dtype, n_envs, frame_stack,
                           scratch_dir=scratch_dir, seed=seed)
    if kind == "cpprb_per":
        return CpprbPERPeer(capacity, obs_shape, obs_dtype, n_envs, frame_stack,
                            seed=seed)
    if kind == "torchrl_per":
        return TorchRLPERPeer(capacity, obs_shape, obs_dtype, n_envs, frame_stack,
                              scratch_dir=scratch_dir, seed=seed)
    raise ValueError(f"unknown peer kind {kind!r}; expected one of "
                     f"{KINDS + PER_KINDS}")


def make_lowdim(kind, capacity, n_envs=1, *, seed=0, scratch_dir=None):
    """Low-dim variant: obs (4,) float32, 2 discrete actions, no stacking."""
    return make(kind, capacity, (4,), np.float32, n_envs, 1, n_actions=2,
                seed=seed, scratch_dir=scratch_dir)


# --------------------------------------------------------------------------
# synthetic episodic streams with consistent stacks (for tests / benchmarks)
# --------------------------------------------------------------------------
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


def check_peer(rb, frame_stack, batch_size=256):
    """Sampled stacks must overlap: next_obs[:, :-1] == obs[:, 1:].  Returns
    the fraction of sampled transitions where that fails (SB3 is expected to
    fail at episode ends: its next obs slot is overwritten by the reset)."""
    if frame_stack < 2:
        return 0.0
    s = rb.sample(batch_size)
    ok = (s["next_obs"][:, :-1] == s["obs"][:, 1:]).flatten(1).all(1)
    return 1.0 - ok.float().mean().item()



def check_per_peer(rb, batch_size=256, beta=0.4, n_draws=4):
    """Sanity check of a PER peer (``kind`` in ``PER_KINDS``).  Returns a dict
    of checks (``"ok"`` = all passed):

    ``weights_ok``  sampled IS weights finite and in (0, 1];
    ``indices_ok``  indices int64 in [0, rb.n_slots), one per sampled row;
    ``update_ok``   after raising ONE sampled index's priority so that its
                    ``p ** alpha`` is ~3x the rest of the buffer's mass, it makes
                    up > 50% of the next samples and has the smallest weight.

    Destructive: leaves that large priority (and the libraries' running max
    priority, given to new items) behind, so call it last."""
    s = rb.sample(batch_size, beta)
    w, idx = s["weights"], s["indices"]
    res = {"weights_ok": bool(torch.isfinite(w).all() and (w > 0).all()
                              and (w <= 1 + 1e-6).all()),
           "indices_ok": bool(idx.dtype == torch.int64 and idx.numel() == batch_size
                              and (idx >= 0).all() and (idx < rb.n_slots).all()
                              and w.numel() == batch_size)}
    target = int(idx[0])
    alpha = getattr(rb, "alpha", 0.6)
    big = (3.0 * max(len(rb), 1)) ** (1.0 / alpha) * float(w.min()) ** (-1.0 / beta)
    rb.update_priorities(torch.tensor([target]), torch.tensor([big]))
    hits, lowest = 0, True
    for _ in range(n_draws):
        t = rb.sample(batch_size, beta)
        m = t["indices"] == target
        hits += int(m.sum())
        if m.any() and (~m).any():
            lowest &= bool(t["weights"][m].max() <= t["weights"][~m].min())
    res["hit_frac"] = hits / (n_draws * batch_size)
    res["update_ok"] = res["hit_frac"] > 0.5 and lowest
    res["ok"] = res["weights_ok"] and res["indices_ok"] and res["update_ok"]
    return res

# --------------------------------------------------------------------------
def _add_range(rb, data, a, b):
    for i in range(a, b):
        rb.add_batch(data["obs"][i], data["action"][i], data["reward"][i],
                     data["next_obs"][i], data["terminated"][i],
                     data["truncated"][i])


def _bench_one(kind, n, n_envs, atari, malloc_tune=True, threads=1, chunks=5,
               sample_repeats=7, sample_seconds=0.25):
    """One peer, one config; meant to run in a fresh process (allocator and
    RSS baselines are then not polluted by earlier peers)."""
    import logging

    import psutil
    if malloc_tune:
        tune_malloc()
    torch.set_num_threads(threads)
    import torchrl  # noqa: F401  (its import sets its own log level)
    logging.getLogger("torchrl").setLevel(logging.WARNING)
    if atari:
        shape, dtype, S, nA = (84, 84), np.uint8, 4, 6
    else:
        shape, dtype, S, nA = (4,), np.float32, 1, 2
    steps = n // n_envs
    data = synthetic_stream(steps, n_envs, shape, dtype, S, n_actions=nA)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    rb = make(kind, steps * n_envs, shape, dtype, n_envs, S, n_actions=nA)
    t0 = time.perf_counter()
    _add_range(rb, data, 0, steps)              # lap 1: first fill
    fill = steps * n_envs / (time.perf_counter() - t0)
    rss1 = proc.memory_info().rss
    add_rates = []                              # lap 2: overwrite, steady state
    bounds = np.linspace(0, steps, chunks + 1).astype(int)
    for a, b in itertools.pairwise(bounds):
        t0 = time.perf_counter()
        _add_range(rb, data, a, b)
        add_rates.append((b - a) * n_envs / (time.perf_counter() - t0))
    res = {"peer": kind, "stored": len(rb), "fill/s": fill,
           "add/s": float(np.median(add_rates)), "rss_MB": (rss1 - rss0) / 2 ** 20}
    if kind == "torchrl":
        res["disk_MB"] = rb.disk_bytes() / 2 ** 20
    for B in (32, 256):
        rb.sample(B)  # warm-up
        rates = []
        for _ in range(sample_repeats):
            k, t0 = 0, time.perf_counter()
            while True:
                rb.sample(B)
                k += 1
                dt = time.perf_counter() - t0
                if dt >= sample_seconds:
                    break
            rates.append(k / dt)
        res[f"b{B}/s"] = float(np.median(rates))
    res["stack_err"] = check_peer(rb, S)
    rb.close()
    return res


def _print_table(rows, title):
    cols = ["peer", "stored", "fill/s", "add/s", "b32/s", "b256/s", "rss_MB",
            "disk_MB", "stack_err"]
    print(f"\n{title}")
    print(" ".join(f"{c:>10s}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            if isinstance(v, float):
                v = f"{v:.3f}" if c == "stack_err" else f"{v:,.0f}"
            cells.append(f"{v!s:>10s}")
        print(" ".join(cells), flush=True)


def main(argv=None):
    import argparse
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    p = argparse.ArgumentParser(description="Self-test / quick benchmark of the peers.")
    p.add_argument("--n", type=int, default=20_000, help="transitions (= capacity)")
    p.add_argument("--n-envs", type=int, nargs="+", default=[1, 8])
    p.add_argument("--peers", nargs="+", default=list(KINDS))
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads in each run (default 1)")
    p.add_argument("--no-malloc-tune", action="store_true",
                   help="skip tune_malloc() (glibc defaults; see its docstring)")
    p.add_argument("--no-lowdim", action="store_true")
    a = p.parse_args(argv)
    print(f"torch {torch.__version__}, threads={a.threads}, malloc_tune="
          f"{not a.no_malloc_tune}, n={a.n} transitions = capacity; "
          f"one fresh process per peer and config")
    ctx = mp.get_context("spawn")
    for E in a.n_envs:
        for atari in ((True,) if a.no_lowdim else (True, False)):
            rows = []
            for k in a.peers:
                with ProcessPoolExecutor(1, mp_context=ctx) as ex:
                    rows.append(ex.submit(_bench_one, k, a.n, E, atari,
                                          not a.no_malloc_tune, a.threads).result())
            _print_table(rows, ("Atari-shaped: 4x84x84 uint8 stacks" if atari
                                else "Low-dim: obs (4,) float32") + f", n_envs={E}")
    print("\nfill/s = transitions/s while first filling the empty buffer; add/s = "
          "transitions/s overwriting a full one (median of 5 chunks); b32/s, b256/s "
          "= sampled batches/s (median of 7 x 0.25 s); rss_MB = RSS growth while "
          "filling (torchrl: its memmap pages); disk_MB = torchrl scratch files; "
          "stack_err = fraction of a 256-sample where next_obs[:, :-1] != obs[:, 1:] "
          "(SB3 > 0 is expected: episode ends)")


if __name__ == "__main__":
    main()
