"""The "cpprb_per" peer: ``cpprb.PrioritizedReplayBuffer(alpha=0.6, eps=1e-4)``, proportional.

Invariant: IS weights are ``(p_i / p_min) ** -beta`` with ``p_min`` over every stored item of every env
(recomputed globally when there is one buffer per env), new items get the largest priority seen so far.
"""
from __future__ import annotations

import numpy as np

from .convert import from_cpprb, to_numpy, to_tensor


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
        return {**from_cpprb(s, self.S), "weights": to_tensor(w.reshape(-1)), "indices": to_tensor(idx)}

    def update_priorities(self, indices, priorities):
        idx = to_numpy(indices, np.int64)
        p = to_numpy(priorities, np.float64)
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
